//! The agent libraries carried inside the `heapdump` executable, so that
//! one file is all a host needs (`scp heapdump host: && ssh host sudo
//! ./heapdump attach PID`).
//!
//! A release binary (`scripts/release`, through the hidden `heapdump
//! __bundle` command) is the ELF executable with the libraries appended
//! after it; the kernel and the dynamic loader read only what the program
//! headers name, so the appended bytes are never mapped. Layout:
//!
//! ```text
//! [ELF executable][libheapdump_preload.so][libheapdump_jemalloc.so][footer]
//! footer, 64 bytes, little-endian u64 words:
//!   magic "HDAGENT1", preload offset, preload length,
//!   jemalloc offset, jemalloc length (0: none), FNV-1a 64 of both
//!   libraries' bytes, executable length, reserved 0
//! ```
//!
//! Invariants:
//! - The executable is our own (`/proc/self/exe`), not a target's; still,
//!   every offset and length in the footer is checked against the file's
//!   size and [`MAX_LIBRARY`], and the checksum against the bytes read, so
//!   a damaged download gives a clear error, never a library that is half
//!   another file.
//! - The libraries are used only when nothing wins over them: an explicit
//!   `--library`, `HEAPDUMP_PRELOAD`, or a `libheapdump_preload.so` next to
//!   the executable (see `commands::run::find_preload`).
//! - They are written out once per content, by
//!   [`library_placement::place_files`](crate::attach::library_placement::place_files):
//!   a directory of heapdump's user under `/tmp`, named for the content,
//!   created without following links and trusted only when nobody else
//!   can write it; each file is read back and compared before use.

use std::fs::File;
use std::io::{Read, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};

use crate::attach::library_placement;
use crate::commands::run::{JEMALLOC_COMPANION_NAME, PRELOAD_NAME};
use crate::process::target_files::TargetRoot;

/// The footer's first word.
const MAGIC: &[u8; 8] = b"HDAGENT1";
/// The footer's size.
const FOOTER: u64 = 64;
/// Largest library accepted (the agent is a few MiB).
const MAX_LIBRARY: u64 = 256 << 20;

/// The libraries a bundle carries.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AgentLibraries {
    /// `libheapdump_preload.so`.
    pub preload: Vec<u8>,
    /// `libheapdump_jemalloc.so`, if bundled.
    pub jemalloc: Option<Vec<u8>>,
}

fn word(footer: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(footer[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// The footer of `file` (of `len` bytes), if it has one: (preload offset,
/// length, jemalloc offset, length, checksum, executable length).
fn footer(file: &mut File, len: u64) -> Result<Option<[u64; 6]>> {
    if len < FOOTER {
        return Ok(None);
    }
    let mut f = [0u8; FOOTER as usize];
    file.seek(SeekFrom::Start(len - FOOTER))?;
    file.read_exact(&mut f)?;
    if &f[..8] != MAGIC {
        return Ok(None);
    }
    let w = [
        word(&f, 1),
        word(&f, 2),
        word(&f, 3),
        word(&f, 4),
        word(&f, 5),
        word(&f, 6),
    ];
    let body = len - FOOTER;
    let in_file = |off: u64, n: u64| off.checked_add(n).is_some_and(|end| end <= body);
    if !in_file(w[0], w[1])
        || !in_file(w[2], w[3])
        || w[1] == 0
        || w[1] > MAX_LIBRARY
        || w[3] > MAX_LIBRARY
        || w[5] > w[0]
    {
        bail!("the agent libraries appended to this executable are damaged (bad footer)");
    }
    Ok(Some(w))
}

fn read_at(file: &mut File, off: u64, n: u64) -> Result<Vec<u8>> {
    let mut v = vec![0u8; n as usize];
    file.seek(SeekFrom::Start(off))?;
    file.read_exact(&mut v)?;
    Ok(v)
}

/// The libraries appended to the executable at `exe`, or `None` when it
/// carries none (a `cargo build`).
pub fn read_from(exe: &Path) -> Result<Option<AgentLibraries>> {
    let mut file = File::open(exe).with_context(|| format!("opening {}", exe.display()))?;
    let len = file.metadata()?.len();
    let Some(w) = footer(&mut file, len)? else {
        return Ok(None);
    };
    let preload = read_at(&mut file, w[0], w[1])?;
    let jemalloc = (w[3] != 0)
        .then(|| read_at(&mut file, w[2], w[3]))
        .transpose()?;
    let sum = library_placement::fnv1a(&[&preload, jemalloc.as_deref().unwrap_or(&[])]);
    if sum != w[4] {
        bail!(
            "the agent libraries appended to {} are damaged (checksum mismatch): download the \
             release again",
            exe.display()
        );
    }
    Ok(Some(AgentLibraries { preload, jemalloc }))
}

/// The libraries this very executable carries.
pub fn own() -> Result<Option<AgentLibraries>> {
    read_from(Path::new("/proc/self/exe"))
}

/// Writes `out`: the executable `exe` (without any libraries it already
/// carries) followed by `libs` and the footer, mode 0755.
pub fn write_bundle(exe: &Path, libs: &AgentLibraries, out: &Path) -> Result<()> {
    let mut file = File::open(exe).with_context(|| format!("opening {}", exe.display()))?;
    let len = file.metadata()?.len();
    let elf_len = match footer(&mut file, len)? {
        Some(w) => w[5],
        None => len,
    };
    let elf = read_at(&mut file, 0, elf_len)?;
    if !elf.starts_with(b"\x7fELF") {
        bail!("{} is not an ELF executable", exe.display());
    }
    let jemalloc = libs.jemalloc.as_deref().unwrap_or(&[]);
    for (what, lib) in [("preload", &libs.preload[..]), ("jemalloc", jemalloc)] {
        if lib.len() as u64 > MAX_LIBRARY || (!lib.is_empty() && !lib.starts_with(b"\x7fELF")) {
            bail!("the {what} library is not a shared object of at most 256 MiB");
        }
    }
    let pre_off = elf_len;
    let jem_off = pre_off + libs.preload.len() as u64;
    let words = [
        pre_off,
        libs.preload.len() as u64,
        jem_off,
        jemalloc.len() as u64,
        library_placement::fnv1a(&[&libs.preload, jemalloc]),
        elf_len,
        0,
    ];
    let mut f = Vec::with_capacity(FOOTER as usize);
    f.extend_from_slice(MAGIC);
    for w in words {
        f.extend_from_slice(&w.to_le_bytes());
    }
    let tmp = out.with_extension("partial");
    let mut o = File::create(&tmp).with_context(|| format!("creating {}", tmp.display()))?;
    o.write_all(&elf)?;
    o.write_all(&libs.preload)?;
    o.write_all(jemalloc)?;
    o.write_all(&f)?;
    o.sync_all()?;
    drop(o);
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o755))?;
    std::fs::rename(&tmp, out).with_context(|| format!("writing {}", out.display()))?;
    Ok(())
}

/// Writes the libraries this executable carries where programs on this
/// host can load them (see the module doc), and returns the path of
/// `libheapdump_preload.so` there (`libheapdump_jemalloc.so` beside it
/// when bundled); `None` when the executable carries none.
pub fn extract_own() -> Result<Option<PathBuf>> {
    let Some(libs) = own()? else {
        return Ok(None);
    };
    let root = TargetRoot::own().context("opening our own root")?;
    let mut files: Vec<(&str, &[u8])> = vec![(PRELOAD_NAME, &libs.preload)];
    if let Some(j) = &libs.jemalloc {
        files.push((JEMALLOC_COMPANION_NAME, j));
    }
    let dir = library_placement::place_files(&root, &files)
        .context("writing out the agent libraries this executable carries")?;
    Ok(Some(Path::new(&dir).join(PRELOAD_NAME)))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fake_elf(n: usize) -> Vec<u8> {
        let mut v = b"\x7fELF".to_vec();
        v.resize(n, 7);
        v
    }

    #[test]
    fn a_bundle_reads_back_the_libraries_it_was_given_and_rebundles_cleanly() {
        let dir = tempfile_dir();
        let exe = dir.join("exe");
        std::fs::write(&exe, fake_elf(1000)).unwrap();
        let libs = AgentLibraries {
            preload: fake_elf(300),
            jemalloc: Some(fake_elf(200)),
        };
        let out = dir.join("bundle");
        write_bundle(&exe, &libs, &out).unwrap();
        assert_eq!(read_from(&out).unwrap(), Some(libs.clone()));
        assert_eq!(read_from(&exe).unwrap(), None);
        // Bundling a bundle replaces what it carried.
        let other = AgentLibraries {
            preload: fake_elf(50),
            jemalloc: None,
        };
        let again = dir.join("again");
        write_bundle(&out, &other, &again).unwrap();
        assert_eq!(read_from(&again).unwrap(), Some(other));
        assert_eq!(std::fs::metadata(&again).unwrap().len(), 1000 + 50 + FOOTER);
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_damaged_bundle_is_an_error_not_a_library() {
        let dir = tempfile_dir();
        let exe = dir.join("exe");
        std::fs::write(&exe, fake_elf(1000)).unwrap();
        let libs = AgentLibraries {
            preload: fake_elf(300),
            jemalloc: None,
        };
        let out = dir.join("bundle");
        write_bundle(&exe, &libs, &out).unwrap();
        let mut bytes = std::fs::read(&out).unwrap();
        bytes[1100] ^= 1;
        std::fs::write(&out, &bytes).unwrap();
        let e = read_from(&out).unwrap_err().to_string();
        assert!(e.contains("checksum"), "{e}");
        // A footer whose offsets point past the file.
        let n = bytes.len();
        bytes[n - FOOTER as usize + 8..n - FOOTER as usize + 16]
            .copy_from_slice(&u64::MAX.to_le_bytes());
        std::fs::write(&out, &bytes).unwrap();
        let e = read_from(&out).unwrap_err().to_string();
        assert!(e.contains("bad footer"), "{e}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "heapdump-bundle-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
