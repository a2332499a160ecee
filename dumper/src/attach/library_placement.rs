//! Where the agent library is put so that a target can load it, without
//! another user choosing what gets loaded.
//!
//! `heapdump attach` makes the target `dlopen` a path. Whatever file that
//! path names when the target opens it runs as the target's user, so the
//! path must name heapdump's own bytes, and nobody but root (or heapdump's
//! user) may be able to change that between the placing and the loading.
//!
//! Invariants:
//! - The library's own path is used as is only when, resolved inside the
//!   target's root *without following any symbolic link*, it is the very
//!   file heapdump would load, and every directory on the way is owned by
//!   root or heapdump's user and writable by no one else (a sticky
//!   directory, such as `/tmp`, counts as safe: nobody else can rename
//!   what root put there).
//! - Otherwise the bytes are copied to `/tmp/heapdump-agent-HASH/` inside
//!   the target's root (HASH names the content; `/var/tmp` or `/dev/shm`
//!   when `/tmp` is mounted `noexec`, where no library can be mapped
//!   executable). The parent is resolved without symbolic links; the directory is made with `mkdirat` (never
//!   following a link) or, if it exists, used only when it is a real
//!   directory owned by heapdump's user and writable by no one else; else a
//!   fresh directory with a random suffix is made. The file is written
//!   under a temporary name with `O_CREAT|O_EXCL|O_NOFOLLOW` and renamed
//!   into place, and a file found there is used only when owned by
//!   heapdump's user, writable by no one else, and byte for byte the
//!   library. The placed file is read back and compared before the path is
//!   handed to the target.

use std::ffi::CString;
use std::fs::File;
use std::io::Write;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Component, Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::process::target_files::{self, TargetRoot};

/// The library's file name inside a placement directory.
const FILE_NAME: &str = "libheapdump_preload.so";

/// Largest library read (the agent is a few MiB).
const MAX_LIBRARY: u64 = 256 << 20;

/// Where a target loads the library from.
#[derive(Debug, PartialEq, Eq)]
pub struct Placement {
    /// The path the target is to `dlopen`, as it sees it.
    pub path: String,
    /// The directory the library was copied to inside the target's root,
    /// when it was.
    pub copied_to: Option<String>,
}

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// Whether a file or directory with this `stat` can be changed only by
/// root or heapdump's user.
pub fn trusted(st: &libc::stat) -> bool {
    let owner_ok = st.st_uid == 0 || st.st_uid == euid();
    let is_dir = st.st_mode & libc::S_IFMT == libc::S_IFDIR;
    let sticky = is_dir && st.st_mode & libc::S_ISVTX != 0;
    owner_ok && (st.st_mode & 0o022 == 0 || sticky)
}

/// Whether `lib`, as the target resolves it, is this very file and can be
/// changed by nobody but root or heapdump's user.
fn usable_in_place(root: &TargetRoot, lib: &Path, ours: &libc::stat) -> bool {
    let Ok(fd) = root.resolve(lib, true) else {
        return false;
    };
    let Ok(st) = target_files::fstat(&fd) else {
        return false;
    };
    if st.st_dev != ours.st_dev || st.st_ino != ours.st_ino || !trusted(&st) {
        return false;
    }
    let mut dir = PathBuf::from("/");
    for c in lib.parent().into_iter().flat_map(Path::components) {
        match c {
            Component::RootDir => {}
            Component::Normal(n) => dir.push(n),
            _ => return false,
        }
        let ok = root
            .resolve(&dir, true)
            .and_then(|fd| target_files::fstat(&fd))
            .is_ok_and(|st| trusted(&st));
        if !ok {
            return false;
        }
    }
    true
}

/// A name for the content (FNV-1a, 64 bits): not a security check (the
/// bytes are compared in full), only so that one library version shares
/// one directory.
pub fn content_name(bytes: &[u8]) -> String {
    format!("{:016x}", fnv1a(&[bytes]))
}

/// FNV-1a, 64 bits, over `parts` in order: a name for content, or a check
/// against damage (not against an adversary).
pub fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in parts.iter().flat_map(|p| p.iter()) {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

fn cstr(s: &str) -> Result<CString> {
    CString::new(s).context("a name with a NUL byte")
}

fn openat(dir: &impl AsRawFd, name: &str, flags: i32, mode: u32) -> std::io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| std::io::ErrorKind::InvalidInput)?;
    // SAFETY: `dir` is an open directory, `c` a valid string.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC, mode) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// The directory `name` in `tmp`: made now (mode 0755, ours), or found
/// and trusted; `None` when it exists but is not to be trusted.
fn our_directory(tmp: &OwnedFd, name: &str) -> Result<Option<OwnedFd>> {
    let c = cstr(name)?;
    // SAFETY: `tmp` is an open directory, `c` a valid string.
    let made = unsafe { libc::mkdirat(tmp.as_raw_fd(), c.as_ptr(), 0o755) };
    if made != 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() != Some(libc::EEXIST) {
            return Err(e).context(format!("creating {name}"));
        }
    }
    // O_NOFOLLOW: a symbolic link planted under this name is refused.
    let dir = match openat(
        tmp,
        name,
        libc::O_RDONLY | libc::O_DIRECTORY | libc::O_NOFOLLOW,
        0,
    ) {
        Ok(d) => d,
        Err(_) if made != 0 => return Ok(None),
        Err(e) => return Err(e).context(format!("opening {name}")),
    };
    let st = target_files::fstat(&dir)?;
    if st.st_uid != euid() || st.st_mode & 0o022 != 0 {
        return Ok(None);
    }
    if made == 0 {
        // The umask may have taken bits the target needs to enter it.
        // SAFETY: `dir` is an open descriptor.
        unsafe { libc::fchmod(dir.as_raw_fd(), 0o755) };
    }
    Ok(Some(dir))
}

/// Whether `dir/name` is ours and holds exactly `bytes`.
fn holds_file(dir: &OwnedFd, name: &str, bytes: &[u8]) -> bool {
    let Ok(fd) = openat(
        dir,
        name,
        libc::O_RDONLY | libc::O_NOFOLLOW | libc::O_NONBLOCK | libc::O_NOCTTY,
        0,
    ) else {
        return false;
    };
    let file = File::from(fd);
    let Ok(st) = target_files::fstat(&file) else {
        return false;
    };
    if st.st_mode & libc::S_IFMT != libc::S_IFREG || st.st_uid != euid() || st.st_mode & 0o022 != 0
    {
        return false;
    }
    target_files::read_capped(&file, MAX_LIBRARY, Path::new(name)).is_ok_and(|got| got == bytes)
}

/// Writes `bytes` as `dir/name` (a new file under a temporary name,
/// renamed into place).
fn write_file(dir: &OwnedFd, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = format!(".{name}.{}", std::process::id());
    let c_tmp = cstr(&tmp)?;
    // A leftover of an earlier attempt of ours; the directory is ours.
    // SAFETY: valid descriptor and string.
    unsafe { libc::unlinkat(dir.as_raw_fd(), c_tmp.as_ptr(), 0) };
    let fd = openat(
        dir,
        &tmp,
        libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW,
        0o644,
    )
    .with_context(|| format!("creating {name}"))?;
    let mut f = File::from(fd);
    f.write_all(bytes)?;
    // SAFETY: `f` is an open descriptor.
    unsafe { libc::fchmod(f.as_raw_fd(), 0o644) };
    f.sync_all()?;
    let c_final = cstr(name)?;
    // SAFETY: valid descriptors and strings.
    if unsafe {
        libc::renameat(
            dir.as_raw_fd(),
            c_tmp.as_ptr(),
            dir.as_raw_fd(),
            c_final.as_ptr(),
        )
    } != 0
    {
        return Err(std::io::Error::last_os_error())
            .with_context(|| format!("renaming {name} into place"));
    }
    Ok(())
}

/// Decides where the target `pid` loads the library `lib` from, copying it
/// into the target's root when its own path cannot be trusted there (see
/// the module's rules).
pub fn place(pid: u32, lib: &Path) -> Result<Placement> {
    let lib = lib.canonicalize().unwrap_or_else(|_| lib.to_path_buf());
    let own = target_files::open_regular(
        &lib,
        &crate::process::user_space_mounts::UserSpaceMounts::none(),
    )
    .with_context(|| format!("{}", lib.display()))?;
    let ours = target_files::fstat(&own)?;
    let root = match TargetRoot::of_process(pid) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            bail!("process {pid} exited")
        }
        Err(e) => return Err(e).context(format!("opening /proc/{pid}/root")),
    };
    if usable_in_place(&root, &lib, &ours) {
        return Ok(Placement {
            path: lib.display().to_string(),
            copied_to: None,
        });
    }
    let bytes = target_files::read_capped(&own, MAX_LIBRARY, &lib)?;
    let dir = place_files(&root, &[(FILE_NAME, &bytes)])
        .with_context(|| format!("placing the agent library inside process {pid}'s root"))?;
    Ok(Placement {
        path: format!("{dir}/{FILE_NAME}"),
        copied_to: Some(dir),
    })
}

/// Where placement directories may go, in order: a directory owned by
/// root (or heapdump's user), on a file system mounted without `noexec`
/// (a library there could not be mapped executable: hardened hosts mount
/// `/tmp` so).
const PARENTS: [&str; 3] = ["/tmp", "/var/tmp", "/dev/shm"];

/// The first of [`PARENTS`] inside `root` that can hold the library, and
/// its open descriptor; an error saying why each was passed over.
fn placement_parent(root: &TargetRoot) -> Result<(&'static str, OwnedFd)> {
    let mut why = Vec::new();
    for parent in PARENTS {
        let dir = match root.resolve(Path::new(parent), true) {
            Ok(d) => d,
            Err(e) => {
                why.push(format!("{parent}: {e}"));
                continue;
            }
        };
        let st = target_files::fstat(&dir)?;
        if st.st_mode & libc::S_IFMT != libc::S_IFDIR || !(st.st_uid == 0 || st.st_uid == euid()) {
            why.push(format!("{parent}: not a directory owned by root"));
            continue;
        }
        // SAFETY: an all-zero statvfs is a valid value to be filled in.
        let mut vfs: libc::statvfs = unsafe { std::mem::zeroed() };
        // SAFETY: `dir` is an open descriptor, `vfs` a valid out pointer.
        if unsafe { libc::fstatvfs(dir.as_raw_fd(), &mut vfs) } != 0 {
            why.push(format!("{parent}: {}", std::io::Error::last_os_error()));
            continue;
        }
        if vfs.f_flag & libc::ST_NOEXEC != 0 {
            why.push(format!("{parent}: mounted noexec"));
            continue;
        }
        return Ok((parent, dir));
    }
    bail!(
        "no directory to place the agent library in ({}): pass --library (or set \
         HEAPDUMP_PRELOAD) with a path the process sees, in a directory only root can write, on \
         a file system mounted without noexec",
        why.join("; ")
    )
}

/// Puts `files` (name, bytes) into one directory of heapdump's own under
/// `/tmp` inside `root`, named for their content, following the module's
/// rules (made with `mkdirat`, trusted only when ours and writable by no
/// one else, files written under a temporary name and renamed, each read
/// back and compared), under the first usable of [`PARENTS`]. Returns
/// the directory as seen inside `root` (`/tmp/heapdump-agent-HASH`).
pub fn place_files(root: &TargetRoot, files: &[(&str, &[u8])]) -> Result<String> {
    let (parent, tmp) = placement_parent(root)?;
    // One library: named for its bytes; several: for their names and bytes.
    let hash = match files {
        [(_, bytes)] => content_name(bytes),
        _ => {
            let mut all = Vec::new();
            for (name, bytes) in files {
                all.extend_from_slice(name.as_bytes());
                all.push(0);
                all.extend_from_slice(bytes);
            }
            content_name(&all)
        }
    };
    let base = format!("heapdump-agent-{hash}");
    let mut name = base.clone();
    let mut dir = our_directory(&tmp, &name)?;
    let mut tries = 0;
    while dir.is_none() {
        // Someone else holds the name: a fresh one of ours.
        tries += 1;
        if tries > 8 {
            bail!("could not make a directory of heapdump's own under {parent}");
        }
        let mut r = [0u8; 8];
        // SAFETY: `r` is a valid 8-byte buffer (the system call: glibc's
        // wrapper is from 2.25, heapdump runs on 2.17).
        if unsafe { libc::syscall(libc::SYS_getrandom, r.as_mut_ptr(), r.len(), 0) }
            != r.len() as libc::c_long
        {
            bail!("getrandom failed");
        }
        name = format!("{base}-{:016x}", u64::from_ne_bytes(r));
        // A fresh name must be made now, not found.
        let c = cstr(&name)?;
        // SAFETY: valid descriptor and string.
        if unsafe { libc::mkdirat(tmp.as_raw_fd(), c.as_ptr(), 0o755) } == 0 {
            dir = our_directory(&tmp, &name)?;
        }
    }
    let dir = dir.expect("set above");
    for (file, bytes) in files {
        if !holds_file(&dir, file, bytes) {
            write_file(&dir, file, bytes)?;
            if !holds_file(&dir, file, bytes) {
                bail!("the copy of {file} in {parent}/{name} does not read back intact");
            }
        }
    }
    let path = format!("{parent}/{name}");
    // The dlopen path must not contain what a C string cannot.
    if path.as_bytes().contains(&0) {
        bail!("bad placement path");
    }
    Ok(path)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn content_names_differ_with_content() {
        assert_ne!(content_name(b"a"), content_name(b"b"));
        assert_eq!(content_name(b"abc").len(), 16);
    }

    #[test]
    fn group_or_other_writable_is_not_trusted_unless_sticky() {
        // SAFETY: an all-zero stat is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        st.st_uid = euid();
        st.st_mode = libc::S_IFDIR | 0o755;
        assert!(trusted(&st));
        st.st_mode = libc::S_IFDIR | 0o777;
        assert!(!trusted(&st));
        st.st_mode = libc::S_IFDIR | 0o1777;
        assert!(trusted(&st));
        st.st_mode = libc::S_IFREG | 0o666;
        assert!(!trusted(&st));
        st.st_mode = libc::S_IFREG | 0o644;
        st.st_uid = euid().wrapping_add(1).max(1);
        assert!(!trusted(&st));
    }
}
