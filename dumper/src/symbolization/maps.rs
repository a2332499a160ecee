//! The executable mappings of a process (`/proc/PID/maps`) with the build
//! ID of each mapped file, recorded in every snapshot so that it can also
//! be symbolized later, elsewhere.

use std::collections::HashMap;
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};

use object::{Object, ReadCache};
use serde::{Deserialize, Serialize};

/// One executable, file-backed mapping.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// File offset mapped at `start`.
    pub offset: u64,
    /// Path of the mapped file, as the target sees it.
    pub path: String,
    /// GNU build ID of the file (lower-case hex), when it has one.
    pub build_id: Option<String>,
    /// Where this process can read the file (through `/proc/PID/root` for
    /// a target in another mount namespace). Not serialized.
    #[serde(skip)]
    pub local_path: Option<PathBuf>,
}

impl Mapping {
    /// Whether `addr` lies inside the mapping.
    pub fn contains(&self, addr: u64) -> bool {
        (self.start..self.end).contains(&addr)
    }

    /// The file name without directories.
    pub fn basename(&self) -> &str {
        self.path.rsplit('/').next().unwrap_or(&self.path)
    }
}

/// Finds the mapping containing `addr`.
pub fn find(maps: &[Mapping], addr: u64) -> Option<&Mapping> {
    // Few mappings (tens to hundreds): a linear scan is fine and needs no
    // sorting invariant from the caller.
    maps.iter().find(|m| m.contains(addr))
}

/// Caches build IDs by file path, so a long-running dumper reads each
/// file's notes once.
#[derive(Debug, Default)]
pub struct BuildIds {
    cache: HashMap<PathBuf, Option<String>>,
}

impl BuildIds {
    /// The build ID of the ELF file at `path` (hex), if any.
    pub fn get(&mut self, path: &Path) -> Option<String> {
        self.cache
            .entry(path.to_path_buf())
            .or_insert_with(|| read_build_id(path))
            .clone()
    }
}

/// Reads the GNU build ID note of an ELF file, reading only the parts
/// needed (`object::ReadCache`, no mapping of the whole file).
pub fn read_build_id(path: &Path) -> Option<String> {
    let file = File::open(path).ok()?;
    let cache = ReadCache::new(file);
    let obj = object::File::parse(&cache).ok()?;
    build_id_of(&obj)
}

/// The GNU build ID of a parsed ELF file (hex), if it has one.
pub fn build_id_of<'d, R: object::ReadRef<'d>>(obj: &object::File<'d, R>) -> Option<String> {
    let id = obj.build_id().ok()??;
    Some(id.iter().map(|b| format!("{b:02x}")).collect())
}

/// Most files [`locate_by_build_id`] reads while indexing directories (a
/// guard against pointing it at `/`).
pub const MAX_INDEXED_FILES: usize = 200_000;

/// For a snapshot symbolized later, elsewhere: points each mapping's
/// `local_path` at a file with the mapping's build ID, looked up in `dirs`
/// (searched recursively, symbolic links to directories not followed),
/// else at
/// the mapping's own path if that file exists here with the same build ID
/// (or the mapping recorded none). Returns one line per mapping left
/// without a file, saying why; its frames stay unsymbolized.
pub fn locate_by_build_id(maps: &mut [Mapping], dirs: &[PathBuf]) -> Vec<String> {
    let mut by_id: HashMap<String, PathBuf> = HashMap::new();
    let mut budget = MAX_INDEXED_FILES;
    let mut warnings = Vec::new();
    for d in dirs {
        let mut stack = vec![d.clone()];
        while let Some(dir) = stack.pop() {
            let Ok(entries) = std::fs::read_dir(&dir) else {
                warnings.push(format!("cannot read directory {}", dir.display()));
                continue;
            };
            for e in entries.flatten() {
                let Ok(t) = e.file_type() else { continue };
                let path = e.path();
                if t.is_dir() {
                    stack.push(path);
                } else if budget > 0 && (t.is_file() || t.is_symlink()) {
                    budget -= 1;
                    if let Some(id) = read_build_id(&path) {
                        by_id.entry(id).or_insert(path);
                    }
                }
            }
        }
    }
    if budget == 0 {
        warnings.push(format!(
            "stopped indexing after {MAX_INDEXED_FILES} files: name narrower directories"
        ));
    }
    for m in maps.iter_mut() {
        m.local_path = None;
        let own = PathBuf::from(&m.path);
        match &m.build_id {
            Some(id) => {
                if let Some(p) = by_id.get(id) {
                    m.local_path = Some(p.clone());
                } else if read_build_id(&own).as_ref() == Some(id) {
                    m.local_path = Some(own);
                } else {
                    warnings.push(format!(
                        "no file with build ID {id} for {} (pass its directory with --binaries)",
                        m.path
                    ));
                }
            }
            None if own.is_file() => m.local_path = Some(own),
            None => warnings.push(format!(
                "{} is not here and recorded no build ID to find it by",
                m.path
            )),
        }
    }
    // A file mapped in several executable pieces is reported once.
    warnings.sort();
    warnings.dedup();
    warnings
}

/// Whether `pid` sees the same root directory as this process (no
/// container, no chroot).
fn same_root(pid: u32) -> bool {
    use std::os::unix::fs::MetadataExt;
    match (
        std::fs::metadata(format!("/proc/{pid}/root/")),
        std::fs::metadata("/"),
    ) {
        (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
        _ => false,
    }
}

/// Where to read a file the target maps: the path itself when the target
/// shares our root (so it still works after the target exited: `watch`'s
/// final snapshot), else through `/proc/PID/root` (containers), else the
/// path itself if it exists.
///
/// A file deleted (or replaced, as a rebuild does) since it was mapped is
/// read through `/proc/PID/map_files/START-END`, which still names the
/// mapped file; when that cannot be opened, it is left unsymbolized rather
/// than symbolized against whatever now has its name.
fn local_path(pid: u32, m: &Mapping, same_root: bool) -> Option<PathBuf> {
    if m.path.ends_with(" (deleted)") {
        let mapped = PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end));
        return File::open(&mapped).is_ok().then_some(mapped);
    }
    let path = m.path.as_str();
    let plain = PathBuf::from(path);
    if same_root && plain.exists() {
        return Some(plain);
    }
    let via_root = PathBuf::from(format!("/proc/{pid}/root{path}"));
    if via_root.exists() {
        return Some(via_root);
    }
    plain.exists().then_some(plain)
}

/// Parses the text of a `/proc/PID/maps` file, keeping executable,
/// file-backed mappings.
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    let mut out = Vec::new();
    for line in text.lines() {
        let mut fields = line.splitn(6, ' ');
        let (Some(range), Some(perms), Some(offset), Some(_dev), Some(_inode)) = (
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
            fields.next(),
        ) else {
            continue;
        };
        let path = fields.next().unwrap_or("").trim_start();
        if !perms.contains('x') || !path.starts_with('/') {
            continue;
        }
        let Some((s, e)) = range.split_once('-') else {
            continue;
        };
        let (Ok(start), Ok(end), Ok(offset)) = (
            u64::from_str_radix(s, 16),
            u64::from_str_radix(e, 16),
            u64::from_str_radix(offset, 16),
        ) else {
            continue;
        };
        out.push(Mapping {
            start,
            end,
            offset,
            path: path.to_string(),
            build_id: None,
            local_path: None,
        });
    }
    out
}

/// Reads the executable mappings of `pid`, with build IDs.
pub fn read_maps(pid: u32, build_ids: &mut BuildIds) -> io::Result<Vec<Mapping>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/maps"))?;
    let mut maps = parse_maps(&text);
    let same_root = same_root(pid);
    for m in &mut maps {
        m.local_path = local_path(pid, m, same_root);
        m.build_id = m.local_path.as_deref().and_then(|p| build_ids.get(p));
    }
    Ok(maps)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_executable_file_mappings_only() {
        let text = "\
55d0c0a00000-55d0c0a20000 r--p 00000000 08:01 123 /usr/bin/prog
55d0c0a20000-55d0c0a80000 r-xp 00020000 08:01 123 /usr/bin/prog
7f0000000000-7f0000001000 r-xp 00000000 00:00 0 [vdso]
7f0000002000-7f0000003000 r-xp 00001000 08:01 9 /lib/with space.so (deleted)
";
        let m = parse_maps(text);
        assert_eq!(m.len(), 2);
        assert_eq!(m[0].start, 0x55d0c0a20000);
        assert_eq!(m[0].offset, 0x20000);
        assert_eq!(m[0].path, "/usr/bin/prog");
        assert_eq!(m[1].path, "/lib/with space.so (deleted)");
        assert!(find(&m, 0x55d0c0a20010).is_some());
        assert!(find(&m, 0x55d0c0a00010).is_none());
    }
}
