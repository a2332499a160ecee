//! Text files of `/proc` read whole, whatever bytes they hold.
//!
//! Much of what `/proc/PID/` shows is the target's to write: its name
//! (`comm`, in `stat` and `status` too), its files' and mount points'
//! names (`maps`, `mountinfo`). A name is any bytes but `/` and NUL, so
//! none of these is UTF-8 for sure. `read_to_string` refused the whole
//! file for one such byte, and each caller then read "gone", "no mounts"
//! or "not instrumented": a target that named itself `\xff` looked dead
//! to `watch`, one that mapped a file so named was hidden from `list`,
//! and a FUSE mount under such a name was not known as one. Here a byte
//! that is not UTF-8 becomes U+FFFD and the rest of the text is read as
//! written.

use std::io;
use std::path::Path;

/// The file at `path`, as text (bytes that are not UTF-8 replaced).
pub fn read(path: impl AsRef<Path>) -> io::Result<String> {
    let bytes = std::fs::read(path)?;
    Ok(match String::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_that_is_not_utf8_is_read_with_its_other_bytes_kept() {
        let p = std::env::temp_dir().join(format!("heapdump-proc-text-{}", std::process::id()));
        std::fs::write(&p, b"Name:\tx\xffy\nUid:\t0\n").unwrap();
        assert_eq!(read(&p).unwrap(), "Name:\tx\u{fffd}y\nUid:\t0\n");
        std::fs::remove_file(&p).unwrap();
        assert_eq!(read(&p).unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
