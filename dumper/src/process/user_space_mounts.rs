//! File systems a user-space process serves (FUSE), which heapdump does
//! not read on a target's behalf.
//!
//! Every request a process makes of a FUSE file system (a lookup, a
//! `stat`, an `open`, a read of a page not cached) waits for the server's
//! answer, and once the server has taken the request not even `SIGKILL`
//! ends the wait: a server that never answers leaves the caller in
//! uninterruptible sleep until the server dies. Root's requests reach a
//! user's server only where it was mounted `allow_other` (permitted by
//! `user_allow_other` in `/etc/fuse.conf`); there a hostile user maps a
//! library from their own mount, answers their own process and stalls
//! root: `heapdump snapshot` would hang unkillable, and a collector with
//! it. So a target's file on such a mount is never opened (its frames stay
//! addresses, and the snapshot says why), whoever serves it.
//!
//! Invariants:
//! - The mounts are read from `/proc/PID/mountinfo` (the kernel's, which
//!   no server answers) of the target and of heapdump itself: mount
//!   points as the target sees them (inside its root), devices of both.
//! - A path is refused before anything of it is looked up when a mount
//!   point of such a file system is a prefix of it (component-wise): a
//!   lookup inside the mount would be a request. While the target's
//!   namespace has any such mount, names are resolved without following
//!   symbolic links and without `..` ([`UserSpaceMounts::strict`]), so the
//!   textual check sees every directory the walk enters.
//! - Only a target's files are checked: heapdump's own root (its debug
//!   directories, files the user named with `--binaries`) holds what root
//!   chose, on whatever file system root chose
//!   ([`UserSpaceMounts::none`]).
//! - An opened `O_PATH` descriptor (which costs no request: magic links of
//!   `/proc/PID/map_files` and `/proc/PID/fd` jump to the file without a
//!   lookup) is checked by its device before anything else, through
//!   `statx(AT_STATX_DONT_SYNC)` with an empty mask, which FUSE answers
//!   from the kernel's cache without a request.
//! - `HEAPDUMP_READ_FUSE=1` turns all of this off (for file systems whose
//!   servers the user trusts, on hosts where no other user may mount).

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};

/// One mount of a user-space file system.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mount {
    /// Device number (major, minor) of its superblock.
    dev: (u32, u32),
    /// Where it is mounted, as the process whose mountinfo named it sees
    /// it (`None` for mounts learned from heapdump's own namespace only).
    point: Option<PathBuf>,
    /// Its file-system type (`fuse.sshfs`, `fuseblk`, ...).
    fstype: String,
}

/// The user-space file systems mounted where a target's names resolve
/// (see the module doc).
#[derive(Clone, Debug, Default)]
pub struct UserSpaceMounts {
    mounts: Vec<Mount>,
}

/// Why a file was not opened: it lies on a user-space file system.
#[derive(Debug, thiserror::Error)]
#[error(
    "{path} is on a {fstype} file system, whose user-space server answers every access to it \
     and could stall heapdump for ever: not read (HEAPDUMP_READ_FUSE=1 reads such files)"
)]
pub struct OnUserSpaceFs {
    /// The file (or the path asked for).
    pub path: String,
    /// The file system's type.
    pub fstype: String,
}

/// Whether `e` is a refusal of [`UserSpaceMounts`].
pub fn is_refusal(e: &io::Error) -> bool {
    e.get_ref().is_some_and(|r| r.is::<OnUserSpaceFs>())
}

/// A refusal `e` naming `path` instead (a file reached through a magic
/// link is better shown by its own name); any other error unchanged.
pub fn naming(e: io::Error, path: &Path) -> io::Error {
    match e.get_ref().and_then(|r| r.downcast_ref::<OnUserSpaceFs>()) {
        Some(r) => refusal(path, &r.fstype),
        None => e,
    }
}

fn refusal(path: &Path, fstype: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::PermissionDenied,
        OnUserSpaceFs {
            path: path.display().to_string(),
            fstype: fstype.to_string(),
        },
    )
}

/// Whether a file-system type is served by a user-space process.
fn user_space(fstype: &str) -> bool {
    fstype == "fuse" || fstype == "fuseblk" || fstype.starts_with("fuse.")
}

/// A mount point as mountinfo shows it, unescaped (`\040` is a space,
/// `\011` a tab, `\012` a newline, `\134` a backslash).
fn unescape(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        let octal = |d: &u8| (b'0'..=b'7').contains(d);
        if b[i] == b'\\' && i + 4 <= b.len() && b[i + 1..i + 4].iter().all(octal) {
            let v = b[i + 1..i + 4]
                .iter()
                .fold(0u32, |v, d| v * 8 + u32::from(d - b'0'));
            if let Ok(v) = u8::try_from(v) {
                out.push(v);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

/// The user-space mounts of a mountinfo text.
fn parse(text: &str) -> Vec<Mount> {
    text.lines()
        .filter_map(|line| {
            let (left, right) = line.split_once(" - ")?;
            let fstype = right.split(' ').next()?;
            if !user_space(fstype) {
                return None;
            }
            let mut f = left.split(' ');
            let (_id, _parent, dev, _root, point) =
                (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
            let (major, minor) = dev.split_once(':')?;
            Some(Mount {
                dev: (major.parse().ok()?, minor.parse().ok()?),
                point: Some(PathBuf::from(unescape(point))),
                fstype: fstype.to_string(),
            })
        })
        .collect()
}

fn read_mountinfo(of: &str) -> Vec<Mount> {
    std::fs::read_to_string(format!("/proc/{of}/mountinfo"))
        .map(|t| parse(&t))
        .unwrap_or_default()
}

fn disabled() -> bool {
    std::env::var("HEAPDUMP_READ_FUSE").is_ok_and(|v| v.trim() == "1")
}

impl UserSpaceMounts {
    /// Nothing refused: heapdump's own root (its debug directories, files
    /// the user named), or `HEAPDUMP_READ_FUSE=1`.
    pub fn none() -> Self {
        Self::default()
    }

    /// The user-space mounts where process `pid`'s names resolve, and the
    /// devices of heapdump's own (a file the target maps may lie on a
    /// mount of ours).
    pub fn of_process(pid: u32) -> Self {
        if disabled() {
            return Self::none();
        }
        let mut mounts = read_mountinfo(&pid.to_string());
        for mut m in read_mountinfo("self") {
            if !mounts.iter().any(|t| t.dev == m.dev) {
                m.point = None;
                mounts.push(m);
            }
        }
        UserSpaceMounts { mounts }
    }

    /// The user-space mounts of a mountinfo text (tests).
    #[cfg(test)]
    pub fn from_mountinfo(text: &str) -> Self {
        UserSpaceMounts {
            mounts: parse(text),
        }
    }

    /// Whether no user-space file system is known.
    pub fn is_empty(&self) -> bool {
        self.mounts.is_empty()
    }

    /// Whether device (major, minor) is a user-space file system's.
    pub fn has_device(&self, dev: (u32, u32)) -> bool {
        self.mounts.iter().any(|m| m.dev == dev)
    }

    /// Whether names must be resolved without symbolic links and `..`
    /// (some user-space mount exists where they resolve).
    pub fn strict(&self) -> bool {
        self.mounts.iter().any(|m| m.point.is_some())
    }

    /// Refuses `path` (absolute, inside the root) if a user-space mount
    /// point is a prefix of it, or, in [`strict`](Self::strict) mode, if
    /// it has a `..`.
    pub fn check_path(&self, path: &Path) -> io::Result<()> {
        if self.strict() && path.components().any(|c| c == Component::ParentDir) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{} has a `..`, and user-space file systems are mounted where it resolves: \
                     not resolved",
                    path.display()
                ),
            ));
        }
        let rooted = Path::new("/").join(path);
        for m in &self.mounts {
            if let Some(p) = &m.point {
                if rooted.starts_with(p) {
                    return Err(refusal(path, &m.fstype));
                }
            }
        }
        Ok(())
    }

    /// Refuses the file behind `fd` (an `O_PATH` descriptor) if it lies on
    /// a user-space mount, asking the kernel for its device only
    /// (`statx(AT_STATX_DONT_SYNC)`, answered without the server).
    pub fn check_fd(&self, fd: &impl AsRawFd, shown: &Path) -> io::Result<()> {
        if self.mounts.is_empty() {
            return Ok(());
        }
        let dev = device_without_request(fd)?;
        match self.mounts.iter().find(|m| m.dev == dev) {
            Some(m) => Err(refusal(shown, &m.fstype)),
            None => Ok(()),
        }
    }
}

/// The device of the file behind `fd`, without asking its file system's
/// server (see the module doc). On a kernel without `statx` (before 4.11)
/// the ordinary `fstat`.
fn device_without_request(fd: &impl AsRawFd) -> io::Result<(u32, u32)> {
    // SAFETY: an all-zero `statx` is a valid value of the plain C struct.
    let mut stx: libc::statx = unsafe { std::mem::zeroed() };
    // SAFETY: an empty, NUL-terminated path with AT_EMPTY_PATH names `fd`
    // itself; `stx` is a valid place for the kernel to write. Called
    // through `syscall`: glibc's wrapper is newer than the 2.17 the
    // binary may import.
    let ret = unsafe {
        libc::syscall(
            libc::SYS_statx,
            fd.as_raw_fd(),
            c"".as_ptr(),
            libc::AT_EMPTY_PATH | libc::AT_STATX_DONT_SYNC,
            0u32,
            &mut stx as *mut libc::statx,
        )
    };
    if ret == 0 {
        return Ok((stx.stx_dev_major, stx.stx_dev_minor));
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    let st = super::target_files::fstat(fd)?;
    Ok((libc::major(st.st_dev), libc::minor(st.st_dev)))
}

#[cfg(test)]
mod tests {
    use super::*;

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/mnt rw,nosuid,nodev shared:30 - fuse.sshfs eve@host: rw,user_id=1000,group_id=1000,allow_other
41 22 0:46 / /media/with\\040space rw - fuseblk /dev/sdb1 rw,allow_other
42 22 0:47 / /run/lxcfs rw - fuse lxcfs rw,allow_other
43 22 0:48 / /tmp rw - tmpfs tmpfs rw
";

    #[test]
    fn only_user_space_mounts_are_kept_with_their_devices_and_points() {
        let m = parse(MOUNTINFO);
        assert_eq!(
            m.iter()
                .map(|m| (m.dev, m.point.clone().unwrap(), m.fstype.as_str()))
                .collect::<Vec<_>>(),
            [
                ((0, 45), PathBuf::from("/home/eve/mnt"), "fuse.sshfs"),
                ((0, 46), PathBuf::from("/media/with space"), "fuseblk"),
                ((0, 47), PathBuf::from("/run/lxcfs"), "fuse"),
            ]
        );
        // Garbage is skipped, never a panic.
        assert!(parse("x - fuse\n - \n1 2 3 - fuse.x\n1 2 a:b / /m - fuse.x s o\n").is_empty());
        assert_eq!(unescape("\\134x\\0"), "\\x\\0");
    }

    #[test]
    fn paths_under_a_user_space_mount_point_are_refused_before_any_lookup() {
        let m = UserSpaceMounts::from_mountinfo(MOUNTINFO);
        assert!(m.strict());
        let e = m
            .check_path(Path::new("/home/eve/mnt/lib/libx.so"))
            .unwrap_err();
        assert!(is_refusal(&e), "{e}");
        assert!(e.to_string().contains("fuse.sshfs"), "{e}");
        assert!(m.check_path(Path::new("/home/eve/mnt")).is_err());
        assert!(m.check_path(Path::new("/media/with space/x")).is_err());
        // A sibling whose name merely starts alike is not under it.
        assert!(m.check_path(Path::new("/home/eve/mnt2/x")).is_ok());
        assert!(m.check_path(Path::new("/usr/lib/libc.so.6")).is_ok());
        // `..` could climb into a mount the text does not show.
        let e = m.check_path(Path::new("/home/eve/x/../mnt/y")).unwrap_err();
        assert!(!is_refusal(&e));
        assert!(UserSpaceMounts::none()
            .check_path(Path::new("/a/../b"))
            .is_ok());
    }

    #[test]
    fn a_descriptor_is_checked_by_its_device() {
        let f = std::fs::File::open("/proc/self/exe").unwrap();
        let dev = device_without_request(&f).unwrap();
        let st = super::super::target_files::fstat(&f).unwrap();
        assert_eq!(dev, (libc::major(st.st_dev), libc::minor(st.st_dev)));
        let m = UserSpaceMounts {
            mounts: vec![Mount {
                dev,
                point: None,
                fstype: "fuse.test".into(),
            }],
        };
        let e = m.check_fd(&f, Path::new("/x")).unwrap_err();
        assert!(is_refusal(&e), "{e}");
        assert!(!m.strict());
        assert!(UserSpaceMounts::none()
            .check_fd(&f, Path::new("/x"))
            .is_ok());
    }
}
