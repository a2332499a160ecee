//! Output files and directories written so that another user can neither
//! read them nor steer where root's bytes land.
//!
//! heapdump often runs as root and writes where a user asked (`-o`,
//! `watch -d`), sometimes into directories other users can write. Rules:
//!
//! - A file is written under a fresh temporary name in its directory,
//!   created `O_CREAT|O_EXCL|O_NOFOLLOW` with mode 0600 (so no planted file
//!   or link is ever opened), and renamed over the final name only when
//!   complete: a reader never sees half a snapshot.
//! - An existing final name is replaced only when it is a regular file
//!   owned by heapdump's user: a planted symbolic link or another user's
//!   file is refused and left alone.
//! - The directory must be owned by root or heapdump's user, and not
//!   writable by group or others unless it is sticky (as `/tmp` is: there
//!   nobody else can rename or remove what heapdump made).
//! - A snapshot directory (`watch -d`) is heapdump's own: made with mode
//!   0700, or, if it exists, refused unless a real directory owned by
//!   heapdump's user and writable by no one else.

use std::fs::{self, File, OpenOptions};
use std::io;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

fn euid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

fn refused(msg: String) -> io::Error {
    io::Error::new(io::ErrorKind::PermissionDenied, msg)
}

/// Checks that `dir` may receive heapdump's files (see the module's rules).
pub fn check_directory(dir: &Path) -> io::Result<()> {
    let shown = if dir.as_os_str().is_empty() {
        Path::new(".")
    } else {
        dir
    };
    let m = fs::metadata(shown)?;
    if !m.is_dir() {
        return Err(refused(format!("{} is not a directory", shown.display())));
    }
    let owner_ok = m.uid() == 0 || m.uid() == euid();
    let sticky = m.mode() & libc::S_ISVTX != 0;
    if !owner_ok {
        return Err(refused(format!(
            "{} belongs to another user (uid {}): heapdump does not write into it, since its \
             owner could replace what is written; choose a directory of your own",
            shown.display(),
            m.uid()
        )));
    }
    if m.mode() & 0o022 != 0 && !sticky {
        return Err(refused(format!(
            "{} is writable by other users (mode {:o}) and not sticky: they could replace \
             what heapdump writes; choose another directory or `chmod go-w` it",
            shown.display(),
            m.mode() & 0o7777
        )));
    }
    Ok(())
}

/// A file being written privately; [`PrivateFile::commit`] puts it in
/// place, dropping it uncommitted removes it.
#[derive(Debug)]
pub struct PrivateFile {
    file: Option<File>,
    temp: PathBuf,
    path: PathBuf,
}

impl PrivateFile {
    /// Starts writing `path` (see the module's rules).
    pub fn create(path: &Path) -> io::Result<PrivateFile> {
        let dir = path.parent().unwrap_or(Path::new(""));
        check_directory(dir)?;
        if let Ok(m) = fs::symlink_metadata(path) {
            if m.file_type().is_symlink() {
                return Err(refused(format!(
                    "{} is a symbolic link: not written through, not replaced",
                    path.display()
                )));
            }
            if !m.is_file() || m.uid() != euid() {
                return Err(refused(format!(
                    "{} exists and is not a regular file of yours (owner uid {}): not replaced",
                    path.display(),
                    m.uid()
                )));
            }
        }
        let name = path
            .file_name()
            .ok_or_else(|| refused(format!("{} names no file", path.display())))?;
        for attempt in 0..16u32 {
            let mut tmp_name = std::ffi::OsString::from(".");
            tmp_name.push(name);
            tmp_name.push(format!(".{}.{attempt}.tmp", std::process::id()));
            let temp = dir.join(tmp_name);
            match OpenOptions::new()
                .write(true)
                .create_new(true)
                .mode(0o600)
                .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
                .open(&temp)
            {
                Ok(file) => {
                    file.set_permissions(fs::Permissions::from_mode(0o600))?;
                    return Ok(PrivateFile {
                        file: Some(file),
                        temp,
                        path: path.to_path_buf(),
                    });
                }
                // Taken (by a planted file, or an earlier run): another.
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists => continue,
                Err(e) => return Err(e),
            }
        }
        Err(refused(format!(
            "could not create a temporary file beside {}",
            path.display()
        )))
    }

    /// The file being written.
    pub fn file(&mut self) -> &mut File {
        self.file.as_mut().expect("present until committed")
    }

    /// Flushes the file to disk and renames it into place.
    pub fn commit(mut self) -> io::Result<()> {
        let file = self.file.take().expect("present until committed");
        file.sync_all()?;
        drop(file);
        fs::rename(&self.temp, &self.path)
    }
}

impl Drop for PrivateFile {
    fn drop(&mut self) {
        if self.file.is_some() {
            let _ = fs::remove_file(&self.temp);
        }
    }
}

/// Makes (or checks) a directory for snapshots (see the module's rules).
pub fn create_private_dir(dir: &Path) -> io::Result<()> {
    match fs::symlink_metadata(dir) {
        Ok(m) => {
            if !m.is_dir() {
                return Err(refused(format!(
                    "{} exists and is not a directory (a symbolic link is not followed)",
                    dir.display()
                )));
            }
            if m.uid() != euid() || m.mode() & 0o022 != 0 {
                return Err(refused(format!(
                    "{} belongs to uid {} or is writable by others (mode {:o}): snapshots go \
                     into a directory only you can write; choose another with -d",
                    dir.display(),
                    m.uid(),
                    m.mode() & 0o7777
                )));
            }
            Ok(())
        }
        Err(e) if e.kind() == io::ErrorKind::NotFound => {
            if let Some(parent) = dir.parent().filter(|p| !p.as_os_str().is_empty()) {
                fs::DirBuilder::new()
                    .recursive(true)
                    .mode(0o755)
                    .create(parent)?;
                check_directory(parent)?;
            }
            fs::DirBuilder::new().mode(0o700).create(dir)
        }
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn scratch(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("heapdump-po-{name}-{}", std::process::id()));
        let _ = fs::remove_dir_all(&d);
        fs::create_dir_all(&d).unwrap();
        fs::set_permissions(&d, fs::Permissions::from_mode(0o755)).unwrap();
        d
    }

    #[test]
    fn a_file_appears_whole_with_mode_0600_and_links_are_refused() {
        let d = scratch("file");
        let p = d.join("heap.json");
        let mut f = PrivateFile::create(&p).unwrap();
        f.file().write_all(b"{}").unwrap();
        assert!(!p.exists(), "visible before commit");
        f.commit().unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"{}");
        assert_eq!(fs::metadata(&p).unwrap().mode() & 0o777, 0o600);
        // Replacing our own file works.
        let f = PrivateFile::create(&p).unwrap();
        f.commit().unwrap();
        assert_eq!(fs::read(&p).unwrap(), b"");
        // A link is never written through.
        let target = d.join("victim");
        fs::write(&target, b"keep").unwrap();
        let link = d.join("link.json");
        std::os::unix::fs::symlink(&target, &link).unwrap();
        assert!(PrivateFile::create(&link).is_err());
        assert_eq!(fs::read(&target).unwrap(), b"keep");
        // An uncommitted file leaves nothing behind.
        drop(PrivateFile::create(&d.join("gone.json")).unwrap());
        assert_eq!(fs::read_dir(&d).unwrap().count(), 3);
        fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn open_directories_are_refused_unless_sticky() {
        let d = scratch("dirs");
        let open = d.join("open");
        fs::create_dir(&open).unwrap();
        fs::set_permissions(&open, fs::Permissions::from_mode(0o777)).unwrap();
        assert!(check_directory(&open).is_err());
        assert!(PrivateFile::create(&open.join("x.json")).is_err());
        fs::set_permissions(&open, fs::Permissions::from_mode(0o1777)).unwrap();
        assert!(check_directory(&open).is_ok());
        assert!(create_private_dir(&open).is_err(), "-d must be ours alone");
        let fresh = d.join("a/b/snaps");
        create_private_dir(&fresh).unwrap();
        assert_eq!(fs::metadata(&fresh).unwrap().mode() & 0o777, 0o700);
        create_private_dir(&fresh).unwrap();
        let link = d.join("snaplink");
        std::os::unix::fs::symlink(&fresh, &link).unwrap();
        assert!(create_private_dir(&link).is_err());
        fs::remove_dir_all(&d).unwrap();
    }
}
