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
//!   lookup) is checked before anything else by its device and the mount
//!   it was reached through, from `statx(AT_STATX_DONT_SYNC)`, which FUSE
//!   answers from the kernel's cache without a request: a mount in the
//!   target's or heapdump's mountinfo is judged by its type.
//! - A file on a file system mounted nowhere the target or heapdump can
//!   see (lazily unmounted: `fusermount -uz` takes a user's FUSE mount out
//!   of every mount table while the files mapped from it stay served; or
//!   a kernel before 5.8, whose `statx` gives no mount id, and a device no
//!   mountinfo names) is refused too when its device is an anonymous one (major 0, as every
//!   FUSE mount a user can make) unless the kernel's FUSE control file
//!   system (`/sys/fs/fuse/connections`, one directory per live
//!   connection, named by its device) is mounted and lists no connection
//!   of that device; the kernel's own hidden mount of shared memory
//!   (memfd, SysV segments) is known by a memfd of heapdump's own. The
//!   check runs on the descriptor of a file that exists, so its
//!   connection, if it has one, is listed by then: no race.
//! - A target's mount table is read a page at a time, at most
//!   [`MAX_MOUNTS`] lines and for at most [`MOUNTINFO_DEADLINE`]: the
//!   target decides how long it is (a user's own mount namespace holds up
//!   to `fs.mount-max`, 100 000) and what each line costs the kernel to
//!   write (mounts stacked on one point: the whole stack walked for each
//!   line, 9.5 s of kernel time for 23 000 of them). A table not read
//!   whole may hide a user-space mount anywhere: then no name is resolved
//!   in the target's root at all ([`UserSpaceMounts::check_path`] refuses
//!   every path), and files reached through magic links are judged by
//!   their devices as for detached mounts.
//! - Opening a target's regions reads no mount table
//!   ([`UserSpaceMounts::for_shared_memory`]): they are memfds, on the
//!   kernel's shared-memory mount, and any other file is judged as on a
//!   detached mount. `list`, every scan of `watch --all` and every request
//!   of `serve` open every instrumented process's regions.
//! - `HEAPDUMP_READ_FUSE=1` turns all of this off (for file systems whose
//!   servers the user trusts, on hosts where no other user may mount).

use std::io;
use std::os::fd::AsRawFd;
use std::path::{Component, Path, PathBuf};
use std::time::{Duration, Instant};

/// Most lines of a mount table read (see the module doc): a host's own
/// table, containers' mounts included, holds a few thousand.
pub const MAX_MOUNTS: usize = 16384;
/// Longest a mount table is read for (see the module doc).
pub const MOUNTINFO_DEADLINE: Duration = Duration::from_secs(1);

/// One mount of a user-space file system.
#[derive(Clone, Debug, PartialEq, Eq)]
struct Mount {
    /// The kernel's id of the mount (unique on the host).
    id: u64,
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
    /// Every mount the target and heapdump see, of any type: a file of a
    /// mount among them is judged by its type; one on an anonymous device
    /// none of them (nor the kernel's shared-memory mount) has is on a
    /// detached mount. `None`: such files are not checked
    /// ([`UserSpaceMounts::none`]).
    known: Option<Known>,
    /// The target's mount table was not read whole: no name is resolved
    /// in its root (see the module doc).
    incomplete: bool,
}

/// Every mount a target and heapdump see.
#[derive(Clone, Debug, Default)]
struct Known {
    /// Mount ids, each with its file system's type.
    ids: Vec<(u64, String)>,
    /// Devices, and the kernel's shared-memory mount's.
    devs: Vec<(u32, u32)>,
}

impl Known {
    fn of(mounts: &[Mount]) -> Known {
        Known {
            ids: mounts.iter().map(|m| (m.id, m.fstype.clone())).collect(),
            devs: mounts.iter().map(|m| m.dev).collect(),
        }
    }
}

/// The `fstype` of a refusal for a file on a detached mount that may be
/// a user-space file system's.
const DETACHED: &str = "detached";
/// The `fstype` of a refusal for a name in the root of a process whose
/// mount table was not read whole.
const UNREAD: &str = "unread";

/// Why a file was not opened: it lies on a user-space file system, or on
/// a detached one that may be.
#[derive(Debug, thiserror::Error)]
#[error("{path} is on {}, and could stall heapdump for ever: not read (HEAPDUMP_READ_FUSE=1 \
         reads such files)", describe(.fstype))]
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

/// The file system of a refusal, in words.
fn describe(fstype: &str) -> String {
    if fstype == UNREAD {
        format!(
            "a file system heapdump cannot tell: the process's mount table was not read whole \
             (more than {MAX_MOUNTS} mounts, or over {} s to read), and any of its mounts may \
             be a user-space one (FUSE, served by a process that answers every access to it)",
            MOUNTINFO_DEADLINE.as_secs()
        )
    } else if fstype == DETACHED {
        "a file system mounted nowhere the process or heapdump can see (lazily unmounted), \
         which may be a user-space one (FUSE, served by a process that answers every access to \
         it; /sys/fs/fuse/connections, where mounted, tells)"
            .to_string()
    } else {
        format!("a {fstype} file system, whose user-space server answers every access to it")
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
#[cfg(test)]
fn parse(text: &str) -> Vec<Mount> {
    parse_all(text)
        .into_iter()
        .filter(|m| user_space(&m.fstype))
        .collect()
}

/// Every mount of a mountinfo text.
#[cfg(test)]
fn parse_all(text: &str) -> Vec<Mount> {
    text.lines().filter_map(parse_line).collect()
}

/// The mount of one mountinfo line.
fn parse_line(line: &str) -> Option<Mount> {
    let (left, right) = line.split_once(" - ")?;
    let fstype = right.split(' ').next()?;
    let mut f = left.split(' ');
    let (id, _parent, dev, _root, point) = (f.next()?, f.next()?, f.next()?, f.next()?, f.next()?);
    let (major, minor) = dev.split_once(':')?;
    Some(Mount {
        id: id.parse().ok()?,
        dev: (major.parse().ok()?, minor.parse().ok()?),
        point: Some(PathBuf::from(unescape(point))),
        fstype: fstype.to_string(),
    })
}

/// The mounts of `/proc/{of}/mountinfo`, and whether it was read whole
/// (a table that cannot be read at all reads as empty and whole, as
/// before: the process is gone). At most [`MAX_MOUNTS`] lines, read a
/// page at a time (the kernel writes a page's worth of lines per read)
/// until [`MOUNTINFO_DEADLINE`] has passed.
fn read_mountinfo(of: &str) -> (Vec<Mount>, bool) {
    read_mount_lines(
        format!("/proc/{of}/mountinfo"),
        MAX_MOUNTS,
        Instant::now() + MOUNTINFO_DEADLINE,
    )
}

fn read_mount_lines(path: String, max: usize, deadline: Instant) -> (Vec<Mount>, bool) {
    use std::io::Read;
    let Ok(mut f) = std::fs::File::open(path) else {
        return (Vec::new(), true);
    };
    let (mut mounts, mut lines) = (Vec::new(), 0usize);
    let mut pending: Vec<u8> = Vec::new();
    let mut page = [0u8; 4096];
    loop {
        let n = match f.read(&mut page) {
            Ok(0) => return (mounts, pending.is_empty()),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(_) => return (mounts, false),
        };
        pending.extend_from_slice(&page[..n]);
        let mut start = 0;
        while let Some(len) = pending[start..].iter().position(|&b| b == b'\n') {
            lines += 1;
            if lines > max {
                return (mounts, false);
            }
            let line = &pending[start..start + len];
            mounts.extend(parse_line(&String::from_utf8_lossy(line)));
            start += len + 1;
        }
        pending.drain(..start);
        // A line longer than any the kernel writes (a mount point is at
        // most a page of text, escaped: four times that) is not waited for.
        if pending.len() > 64 << 10 || Instant::now() >= deadline {
            return (mounts, false);
        }
    }
}

/// The device of the kernel's hidden shared-memory mount (memfd, SysV
/// segments), from a memfd of our own; `None` if none can be made.
fn shared_memory_device() -> Option<(u32, u32)> {
    static DEV: std::sync::OnceLock<Option<(u32, u32)>> = std::sync::OnceLock::new();
    *DEV.get_or_init(|| {
        // SAFETY: a valid NUL-terminated name and flags; through `syscall`
        // because glibc's wrapper is newer than the 2.17 the binary may
        // import.
        let fd = unsafe {
            libc::syscall(
                libc::SYS_memfd_create,
                c"heapdump-probe".as_ptr(),
                libc::MFD_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: a descriptor the kernel just gave us, owned here alone.
        let fd =
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        let st = super::target_files::fstat(&fd).ok()?;
        Some((libc::major(st.st_dev), libc::minor(st.st_dev)))
    })
}

/// Whether a file on device `dev` lies on a mount none of `known` names,
/// on an anonymous device (as every FUSE mount a user can make), that
/// `connection` (the FUSE control file system's answer) does not rule out.
fn detached_and_maybe_user_space(
    dev: (u32, u32),
    known: &[(u32, u32)],
    connection: impl FnOnce((u32, u32)) -> Option<bool>,
) -> bool {
    dev.0 == 0 && !known.contains(&dev) && connection(dev) != Some(false)
}

/// Whether device `dev` is a live FUSE connection's, as the kernel's
/// control file system lists them; `None` where it is not mounted.
fn fuse_connection(dev: (u32, u32)) -> Option<bool> {
    const FUSE_CTL_SUPER_MAGIC: i64 = 0x6573_5543;
    let dir = c"/sys/fs/fuse/connections";
    // SAFETY: an all-zero `statfs` is a valid value of the plain C struct.
    let mut sfs: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: `dir` is a valid string and `sfs` a valid place to write.
    if unsafe { libc::statfs(dir.as_ptr(), &mut sfs) } != 0
        || sfs.f_type as i64 != FUSE_CTL_SUPER_MAGIC
    {
        return None;
    }
    // The kernel's own encoding of a device number names the directory.
    let name = (u64::from(dev.0) << 20) | u64::from(dev.1);
    Some(Path::new(&format!("/sys/fs/fuse/connections/{name}")).exists())
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

    /// For a target's regions (its memfds): no mount table read (see the
    /// module doc); a file on the kernel's shared-memory mount passes, any
    /// other is judged as on a detached mount.
    pub fn for_shared_memory() -> Self {
        if disabled() {
            return Self::none();
        }
        UserSpaceMounts {
            mounts: Vec::new(),
            known: Some(Known {
                ids: Vec::new(),
                devs: shared_memory_device().into_iter().collect(),
            }),
            incomplete: false,
        }
    }

    /// The user-space mounts where process `pid`'s names resolve, and the
    /// devices of heapdump's own (a file the target maps may lie on a
    /// mount of ours).
    pub fn of_process(pid: u32) -> Self {
        if disabled() {
            return Self::none();
        }
        let (theirs, whole) = read_mountinfo(&pid.to_string());
        let (ours, _) = read_mountinfo("self");
        let mut known = Known::of(&[theirs.as_slice(), ours.as_slice()].concat());
        known.devs.extend(shared_memory_device());
        let mut mounts: Vec<Mount> = theirs
            .into_iter()
            .filter(|m| user_space(&m.fstype))
            .collect();
        for mut m in ours.into_iter().filter(|m| user_space(&m.fstype)) {
            if !mounts.iter().any(|t| t.dev == m.dev) {
                m.point = None;
                mounts.push(m);
            }
        }
        UserSpaceMounts {
            mounts,
            known: Some(known),
            incomplete: !whole,
        }
    }

    /// The user-space mounts of a mountinfo text (tests).
    #[cfg(test)]
    pub fn from_mountinfo(text: &str) -> Self {
        UserSpaceMounts {
            mounts: parse(text),
            known: Some(Known::of(&parse_all(text))),
            incomplete: false,
        }
    }

    /// Whether nothing is refused: no user-space file system is known and
    /// files on detached mounts are not checked.
    pub fn is_empty(&self) -> bool {
        self.mounts.is_empty() && self.known.is_none() && !self.incomplete
    }

    /// Whether the target's mount table was not read whole, so that no
    /// name is resolved in its root (see the module doc).
    pub fn incomplete(&self) -> bool {
        self.incomplete
    }

    /// Whether device (major, minor) is, or may be, a user-space file
    /// system's.
    pub fn has_device(&self, dev: (u32, u32)) -> bool {
        self.served(dev).is_some()
    }

    /// The type of the user-space file system of device `dev`, or
    /// [`DETACHED`] for an anonymous device mounted nowhere we see that
    /// may be one (see the module doc).
    fn served(&self, dev: (u32, u32)) -> Option<&str> {
        if let Some(m) = self.mounts.iter().find(|m| m.dev == dev) {
            return Some(&m.fstype);
        }
        let known = self.known.as_ref()?;
        detached_and_maybe_user_space(dev, &known.devs, fuse_connection).then_some(DETACHED)
    }

    /// Whether names must be resolved without symbolic links and `..`
    /// (some user-space mount exists where they resolve).
    pub fn strict(&self) -> bool {
        self.incomplete || self.mounts.iter().any(|m| m.point.is_some())
    }

    /// Refuses `path` (absolute, inside the root) if a user-space mount
    /// point is a prefix of it, or, in [`strict`](Self::strict) mode, if
    /// it has a `..`.
    pub fn check_path(&self, path: &Path) -> io::Result<()> {
        if self.incomplete {
            return Err(refusal(path, UNREAD));
        }
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
        if self.is_empty() {
            return Ok(());
        }
        let id = identity_without_request(fd)?;
        if let Some(m) = self.mounts.iter().find(|m| m.dev == id.dev) {
            return Err(refusal(shown, &m.fstype));
        }
        // A file of a mount we see is judged by the mount's type: its
        // device may be none in the tables (a btrfs subvolume's own).
        let mount = self
            .known
            .as_ref()
            .zip(id.mount)
            .and_then(|(known, mount)| known.ids.iter().find(|(m, _)| *m == mount).map(|(_, t)| t));
        match (mount, self.served(id.dev)) {
            (Some(fstype), _) if user_space(fstype) => Err(refusal(shown, fstype)),
            (Some(_), _) | (None, None) => Ok(()),
            (None, Some(fstype)) => Err(refusal(shown, fstype)),
        }
    }
}

/// What identifies a file, as the kernel has it cached.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Identity {
    /// Its device (major, minor), as `stat` gives it.
    pub dev: (u32, u32),
    /// Its inode number.
    pub ino: u64,
    /// The id of the mount it was reached through (kernels 5.8 and later).
    pub mount: Option<u64>,
}

/// The device and inode number of the file behind `fd` (an `O_PATH`
/// descriptor will do), as the kernel has them cached, without a request
/// to a user-space file system's server: `statx(AT_STATX_DONT_SYNC)`. On
/// a kernel without `statx` (before 4.11) the ordinary `fstat`.
pub fn identity_without_request(fd: &impl AsRawFd) -> io::Result<Identity> {
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
            libc::STATX_INO | libc::STATX_MNT_ID,
            &mut stx as *mut libc::statx,
        )
    };
    if ret == 0 {
        return Ok(Identity {
            dev: (stx.stx_dev_major, stx.stx_dev_minor),
            ino: stx.stx_ino,
            mount: (stx.stx_mask & libc::STATX_MNT_ID != 0).then_some(stx.stx_mnt_id),
        });
    }
    let err = io::Error::last_os_error();
    if err.raw_os_error() != Some(libc::ENOSYS) {
        return Err(err);
    }
    let st = super::target_files::fstat(fd)?;
    Ok(Identity {
        dev: (libc::major(st.st_dev), libc::minor(st.st_dev)),
        ino: st.st_ino,
        mount: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_mount_table_past_its_cap_or_deadline_is_read_in_part_and_refuses_every_name() {
        let p = std::env::temp_dir().join(format!("heapdump-mountinfo-{}", std::process::id()));
        let line = |id: u32| format!("{id} 1 0:{id} / /m{id} rw - tmpfs x rw\n");
        std::fs::write(&p, (1..=3).map(line).collect::<String>()).unwrap();
        let read = |max, deadline| read_mount_lines(p.display().to_string(), max, deadline);
        let later = Instant::now() + Duration::from_secs(3600);
        let (mounts, whole) = read(3, later);
        assert_eq!((mounts.len(), whole), (3, true));
        let (mounts, whole) = read(2, later);
        assert_eq!((mounts.len(), whole), (2, false));
        // Lines across the pages read: each whole, once.
        std::fs::write(&p, (1..=500).map(line).collect::<String>()).unwrap();
        let (mounts, whole) = read(1000, later);
        assert!(whole);
        assert_eq!(
            mounts.iter().map(|m| m.id).collect::<Vec<_>>(),
            (1..=500).collect::<Vec<u64>>()
        );
        std::fs::write(&p, (1..=3).map(line).collect::<String>()).unwrap();
        // Past the deadline: what the first page held, and no more pages.
        let (_, whole) = read(3, Instant::now());
        assert!(!whole);
        // A line that never ends is not waited for.
        std::fs::write(&p, vec![b'x'; 100 << 10]).unwrap();
        assert_eq!(read(3, later), (Vec::new(), false));
        std::fs::remove_file(&p).unwrap();
        // A table that cannot be read: a process that is gone.
        assert_eq!(read(3, later), (Vec::new(), true));
        // Not read whole: every name refused, strict, not empty.
        let m = UserSpaceMounts {
            incomplete: true,
            ..UserSpaceMounts::from_mountinfo(&line(1))
        };
        assert!(m.strict() && !m.is_empty() && m.incomplete());
        let e = m
            .check_path(Path::new("/usr/lib/debug/x.debug"))
            .unwrap_err();
        assert!(is_refusal(&e), "{e}");
        assert!(e.to_string().contains("not read whole"), "{e}");
        assert!(UserSpaceMounts::from_mountinfo(&line(1))
            .check_path(Path::new("/usr/lib/x"))
            .is_ok());
    }

    #[test]
    fn a_file_on_the_kernels_shared_memory_passes_the_regions_check_without_a_mount_table() {
        // SAFETY: a valid name and flags (see `shared_memory_device`).
        let fd = unsafe { libc::syscall(libc::SYS_memfd_create, c"t".as_ptr(), libc::MFD_CLOEXEC) };
        assert!(fd >= 0);
        // SAFETY: a descriptor the kernel just gave us, owned here alone.
        let fd =
            unsafe { <std::os::fd::OwnedFd as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        let m = UserSpaceMounts::for_shared_memory();
        assert!(m.check_fd(&fd, Path::new("memfd")).is_ok());
        assert!(!m.strict() && !m.incomplete());
    }

    const MOUNTINFO: &str = "\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
40 22 0:45 / /home/eve/mnt rw,nosuid,nodev shared:30 - fuse.sshfs eve@host: rw,user_id=1000,group_id=1000,allow_other
41 22 0:46 / /media/with\\040space rw - fuseblk /dev/sdb1 rw,allow_other
42 22 0:47 / /run/lxcfs rw - fuse lxcfs rw,allow_other
43 22 0:48 / /tmp rw - tmpfs tmpfs rw
";

    #[test]
    fn a_file_on_an_anonymous_device_no_mount_names_is_refused_unless_fusectl_says_no() {
        let known = [(8, 1), (0, 48)];
        let asked = |answer: Option<bool>| move |_| answer;
        // Mounted where we see it, or a block device: never refused here.
        assert!(!detached_and_maybe_user_space((0, 48), &known, asked(None)));
        assert!(!detached_and_maybe_user_space((8, 2), &known, asked(None)));
        // Detached: refused, unless the control file system lists no
        // FUSE connection of that device.
        assert!(detached_and_maybe_user_space((0, 99), &known, asked(None)));
        assert!(detached_and_maybe_user_space(
            (0, 99),
            &known,
            asked(Some(true))
        ));
        assert!(!detached_and_maybe_user_space(
            (0, 99),
            &known,
            asked(Some(false))
        ));
        let m = UserSpaceMounts::from_mountinfo(MOUNTINFO);
        assert!(m.has_device((0, 45)) && !m.has_device((0, 48)) && !m.has_device((8, 1)));
        assert!(!UserSpaceMounts::none().has_device((0, 99)));
        assert_eq!(
            refusal(Path::new("/x.so"), DETACHED).to_string().split(',').next(),
            Some("/x.so is on a file system mounted nowhere the process or heapdump can see (lazily unmounted)")
        );
    }

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
        let dev = identity_without_request(&f).unwrap().dev;
        let st = super::super::target_files::fstat(&f).unwrap();
        assert_eq!(dev, (libc::major(st.st_dev), libc::minor(st.st_dev)));
        let m = UserSpaceMounts {
            mounts: vec![Mount {
                dev,
                point: None,
                fstype: "fuse.test".into(),
                id: 0,
            }],
            known: None,
            incomplete: false,
        };
        let e = m.check_fd(&f, Path::new("/x")).unwrap_err();
        assert!(is_refusal(&e), "{e}");
        assert!(!m.strict());
        assert!(UserSpaceMounts::none()
            .check_fd(&f, Path::new("/x"))
            .is_ok());
    }

    #[test]
    fn our_own_files_and_memfds_are_on_known_mounts() {
        let ours = UserSpaceMounts::of_process(std::process::id());
        let exe = std::fs::File::open("/proc/self/exe").unwrap();
        ours.check_fd(&exe, Path::new("/exe")).unwrap();
        // SAFETY: a valid name and flags.
        let fd = unsafe { libc::syscall(libc::SYS_memfd_create, c"t".as_ptr(), 0) };
        assert!(fd >= 0);
        // SAFETY: a descriptor the kernel just gave us.
        let memfd = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd as i32) };
        ours.check_fd(&memfd, Path::new("/memfd:t")).unwrap();
    }
}
