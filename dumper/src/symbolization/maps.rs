//! The executable mappings of a process (`/proc/PID/maps`) with the build
//! ID of each mapped file, recorded in every snapshot so that it can also
//! be symbolized later, elsewhere.

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use object::Object;
use serde::{Deserialize, Serialize};

use crate::process::target_files::{self, BoundedFile, TargetRoot};
use crate::process::user_space_mounts;

/// One executable, file-backed mapping.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mapping {
    /// First address of the mapping.
    pub start: u64,
    /// One past the last address.
    pub end: u64,
    /// File offset mapped at `start`.
    pub offset: u64,
    /// Path of the mapped file, as the target sees it (shared by the
    /// mappings of one file: a target can map one file under a 4 KiB path
    /// tens of thousands of times).
    pub path: Arc<str>,
    /// GNU build ID of the file (lower-case hex), when it has one.
    pub build_id: Option<String>,
    /// How heapdump opens the file (see [`LocalFile`]). Not serialized.
    #[serde(skip)]
    pub local: Option<LocalFile>,
    /// The mapped file's device and inode as the maps named them, when
    /// read from a live process: the mappings of one file are checked and
    /// read for their build ID once ([`read_maps`]). Not serialized.
    #[serde(skip)]
    pub file: Option<FileId>,
}

/// A file as the maps name it: its device (major, minor) and inode.
pub type FileId = ((u32, u32), u64);

/// How heapdump reaches the file behind a mapping, under the rules of
/// [`target_files`]: the mapped inode itself through
/// `/proc/PID/map_files/START-END` where heapdump may open it (root), else
/// the mapping's path resolved inside the target's root. The root is held
/// open, so the file stays reachable after the target exited.
#[derive(Clone, Debug)]
pub struct LocalFile {
    /// `/proc/PID/map_files/START-END`, when it could be opened.
    pub map_file: Option<PathBuf>,
    /// The root the path resolves in (the target's; heapdump's own for a
    /// file the user named).
    pub root: Arc<TargetRoot>,
    /// The file's path inside `root` (`None` for a deleted file: its name
    /// now names something else, or nothing).
    pub path: Option<Arc<Path>>,
    /// The real user id of the process that maps it, whose share of the
    /// total read budget its reading is charged to (`None`: heapdump's
    /// own file, charged to the total only).
    pub owner: Option<u32>,
}

impl PartialEq for LocalFile {
    fn eq(&self, other: &Self) -> bool {
        self.key() == other.key()
    }
}

impl Eq for LocalFile {}

impl LocalFile {
    /// A file of heapdump's own, named by the user (`--binaries`).
    pub fn own(path: PathBuf, root: Arc<TargetRoot>) -> LocalFile {
        LocalFile {
            map_file: None,
            root,
            path: Some(path.into()),
            owner: None,
        }
    }

    /// Opens the file for reading (a regular file only).
    pub fn open(&self) -> io::Result<File> {
        if let Some(m) = &self.map_file {
            match target_files::open_regular(m, self.root.mounts()) {
                Ok(f) => return Ok(f),
                // Its name leads to the same file system.
                Err(e) if user_space_mounts::is_refusal(&e) => {
                    return Err(match &self.path {
                        Some(p) => user_space_mounts::naming(e, p),
                        None => e,
                    })
                }
                Err(_) => {}
            }
        }
        match &self.path {
            Some(p) => self.root.open(p),
            None => Err(io::Error::new(
                io::ErrorKind::NotFound,
                "the mapped file was deleted and cannot be opened through map_files",
            )),
        }
    }

    /// A name for caches and messages.
    pub fn key(&self) -> String {
        match (&self.map_file, &self.path) {
            (Some(m), _) => m.display().to_string(),
            (None, Some(p)) => format!("{:p}:{}", Arc::as_ptr(&self.root), p.display()),
            (None, None) => String::new(),
        }
    }
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

/// The cache keys ([`LocalFile::key`]) of the files behind `maps`: what
/// a long-running dumper's caches keep when it forgets the rest.
pub fn mapped_keys<'a>(maps: impl IntoIterator<Item = &'a Mapping>) -> HashSet<String> {
    maps.into_iter()
        .filter_map(|m| m.local.as_ref().map(LocalFile::key))
        .collect()
}

/// Whether two readings of a process's mappings name the same files at
/// the same places.
pub fn same_files(a: &[Mapping], b: &[Mapping]) -> bool {
    a.len() == b.len()
        && a.iter()
            .zip(b)
            .all(|(a, b)| (a.start, a.end, &a.path) == (b.start, b.end, &b.path))
}

/// Caches build IDs by file, so a long-running dumper reads each file's
/// notes once.
#[derive(Debug, Default)]
pub struct BuildIds {
    cache: HashMap<String, Option<String>>,
}

impl BuildIds {
    /// Forgets every file not behind one of `maps` (a collector's
    /// watched processes): the cache then holds what live targets map,
    /// not every file of every process seen since it started, and a
    /// process id used again never meets the build ID of the file its
    /// previous owner mapped at the same place.
    pub fn retain_mapped<'a>(&mut self, maps: impl IntoIterator<Item = &'a Mapping>) {
        let keys = mapped_keys(maps);
        self.cache.retain(|k, _| keys.contains(k));
    }

    /// How many files the cache holds.
    pub fn len(&self) -> usize {
        self.cache.len()
    }

    /// Whether the cache holds no file.
    pub fn is_empty(&self) -> bool {
        self.cache.is_empty()
    }

    /// The build ID of the ELF file `file` (hex), if any.
    pub fn get(&mut self, file: &LocalFile) -> Option<String> {
        self.cache
            .entry(file.key())
            .or_insert_with(|| read_build_id(file.open().ok()?))
            .clone()
    }
}

/// Most bytes read from a file while looking for its build ID: the ELF
/// header, program and section headers, section names and the notes,
/// each note at most [`target_files::MAX_NOTE_BYTES`].
const BUILD_ID_READ_BUDGET: u64 = 8 << 20;

/// Reads the GNU build ID note of an open ELF file, reading only the parts
/// needed, within a small budget (a target's file with a 4 GiB note
/// section costs the refusal, not 4 GiB).
pub fn read_build_id(file: File) -> Option<String> {
    let bounded = BoundedFile::new(file, BUILD_ID_READ_BUDGET).ok()?;
    let obj = object::File::parse(&bounded).ok()?;
    build_id_of(&obj)
}

/// The GNU build ID of a parsed ELF file (hex), if it has one.
pub fn build_id_of<'d, R: object::ReadRef<'d>>(obj: &object::File<'d, R>) -> Option<String> {
    use object::ObjectSection;
    // Notes are read whole: skip any note section larger than a build ID
    // note could be before `object` reads it.
    if obj
        .sections()
        .any(|s| s.kind() == object::SectionKind::Note && s.size() > target_files::MAX_NOTE_BYTES)
    {
        return None;
    }
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
    let root = match TargetRoot::own() {
        Ok(r) => Arc::new(r),
        Err(e) => return vec![format!("cannot open the root directory: {e}")],
    };
    let id_of = |path: &Path| {
        let path = std::path::absolute(path).ok()?;
        read_build_id(root.open(&path).ok()?)
    };
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
                    if let Some(id) = id_of(&path) {
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
        m.local = None;
        let own = PathBuf::from(&*m.path);
        // Resolved from our root: a relative --binaries directory is made
        // absolute against the working directory first.
        let file = |p: PathBuf| {
            let p = std::path::absolute(&p).unwrap_or(p);
            Some(LocalFile::own(p, root.clone()))
        };
        match &m.build_id {
            Some(id) => {
                if let Some(p) = by_id.get(id) {
                    m.local = file(p.clone());
                } else if id_of(&own).as_ref() == Some(id) {
                    m.local = file(own);
                } else {
                    warnings.push(format!(
                        "no file with build ID {id} for {} (pass its directory with --binaries)",
                        m.path
                    ));
                }
            }
            None if root.is_file(&own) => m.local = file(own),
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

/// How to reach the file of mapping `m` of `pid` (see [`LocalFile`]): a
/// deleted (or replaced, as a rebuild does) file only through
/// `/proc/PID/map_files`, which still names the mapped inode; when that
/// cannot be opened, it is left unsymbolized rather than symbolized
/// against whatever now has its name.
/// `in_root` is the mapping's path inside the target's root (see
/// [`path_in_root`]), shared by the mappings of one file. `opens` is
/// whether the `map_files` entry opens (or is refused for its file
/// system), when another mapping of the same file found it out; `None`
/// opens this mapping's entry to find out.
fn local_file(
    pid: u32,
    m: &Mapping,
    root: Option<&Arc<TargetRoot>>,
    in_root: impl FnOnce() -> Arc<Path>,
    owner: Option<u32>,
    opens: Option<bool>,
) -> Option<LocalFile> {
    let root = root?;
    let map_file = PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end));
    // Kept when refused for its file system: opening it again says why.
    let opens =
        opens.unwrap_or_else(
            || match target_files::open_regular(&map_file, root.mounts()) {
                Ok(_) => true,
                Err(e) => user_space_mounts::is_refusal(&e),
            },
        );
    let map_file = opens.then_some(map_file);
    let deleted = m.path.ends_with(" (deleted)");
    if deleted && map_file.is_none() {
        return None;
    }
    Some(LocalFile {
        map_file,
        root: root.clone(),
        path: (!deleted).then(in_root),
        owner,
    })
}

/// A path as `/proc/PID/maps` shows it, made relative to the target's
/// root: the kernel writes paths as the *reader* sees them, so a chrooted
/// target's `/app/prog` reads `/srv/jail/app/prog` when its root
/// (`/proc/PID/root`, seen from here at `root_seen_at`) is reachable from
/// ours; a file outside its root stays as shown.
fn path_in_root(shown: &str, root_seen_at: Option<&Path>) -> PathBuf {
    let path = Path::new(shown);
    match root_seen_at {
        Some(r) if r != Path::new("/") => match path.strip_prefix(r) {
            Ok(rest) => Path::new("/").join(rest),
            Err(_) => path.to_path_buf(),
        },
        _ => path.to_path_buf(),
    }
}

/// A path as `/proc/PID/maps` shows it, unescaped: the kernel writes a
/// newline in a file name as `\012` (and escapes nothing else).
pub fn unescape_path(shown: &str) -> String {
    shown.replace("\\012", "\n")
}

/// Most mappings kept of one process: its executable file mappings
/// first, then the readable ones (see [`parse_maps`]). A program maps a
/// few hundred files; a target can map one file tens of thousands of times
/// under a path of 4 KB, which each kept mapping holds (60 000 made root's
/// snapshot take 1.2 GB and 10 s).
pub const MAX_MAPPINGS: usize = 16 << 10;

/// Parses the text of a `/proc/PID/maps` file, keeping executable,
/// file-backed mappings (at most [`MAX_MAPPINGS`] in all).
pub fn parse_maps(text: &str) -> Vec<Mapping> {
    let mut kept = CodeMappings::default();
    for line in crate::process::maps_lines::maps_lines(text) {
        kept.offer(&line);
    }
    kept.into_mappings()
}

/// The mappings symbolization keeps, as they are offered in address
/// order: executable ones, and the readable private mappings of files
/// with no executable mapping at all (what qemu-user shows for an
/// emulated program's code: it maps the guest's files `r--p` and runs its
/// own translation, and the agent inside records the guest's return
/// addresses); at most [`MAX_MAPPINGS`] of each until the end.
#[derive(Default)]
struct CodeMappings {
    executable: Vec<Mapping>,
    executable_paths: HashSet<Arc<str>>,
    readable_only: Vec<Mapping>,
    /// Each path once, shared by its mappings.
    paths: HashSet<Arc<str>>,
}

impl CodeMappings {
    /// Takes `line` if symbolization keeps it.
    fn offer(&mut self, line: &crate::process::maps_lines::MapsLine<'_>) {
        let (start, end, offset, path) = (line.start, line.end, line.offset, line.path);
        if !path.starts_with('/') {
            return;
        }
        let executable = line.perms.contains('x');
        if !executable && line.perms != "r--p" {
            return;
        }
        if start >= end {
            return;
        }
        let full = if executable {
            self.executable.len() == MAX_MAPPINGS
        } else {
            self.readable_only.len() == MAX_MAPPINGS
        };
        if full {
            return;
        }
        let m = Mapping {
            start,
            end,
            offset,
            path: self.interned(unescape_path(path)),
            build_id: None,
            local: None,
            file: Some((line.dev, line.inode)),
        };
        if executable {
            self.executable_paths.insert(m.path.clone());
            self.executable.push(m);
        } else {
            self.readable_only.push(m);
        }
    }

    /// `path`, shared with the mappings kept before of the same file.
    fn interned(&mut self, path: String) -> Arc<str> {
        if let Some(p) = self.paths.get(path.as_str()) {
            return p.clone();
        }
        let p: Arc<str> = path.into();
        self.paths.insert(p.clone());
        p
    }

    /// What is kept, executable mappings first, at most [`MAX_MAPPINGS`],
    /// sorted by address.
    fn into_mappings(self) -> Vec<Mapping> {
        let CodeMappings {
            executable: mut out,
            executable_paths,
            readable_only,
            ..
        } = self;
        // A data file a native program maps (a locale archive, a font) has no
        // executable mapping either and is kept too: harmless, since frames
        // are matched by address and no return address lands in data (its
        // build ID read, if ever, is bounded like every read of a target's
        // file).
        let room = MAX_MAPPINGS - out.len();
        out.extend(
            readable_only
                .into_iter()
                .filter(|m| !executable_paths.contains(&*m.path))
                .take(room),
        );
        out.sort_by_key(|m| m.start);
        out
    }
}

/// Reads the executable mappings of `pid`, with build IDs.
pub fn read_maps(pid: u32, build_ids: &mut BuildIds) -> io::Result<Vec<Mapping>> {
    // File mappings only, one at a time (`process::mappings`): never the
    // whole maps text, which the target may grow to 250 MB.
    let files = crate::process::mappings::Wanted {
        file_backed: true,
        ..Default::default()
    };
    let mut kept = CodeMappings::default();
    crate::process::mappings::for_each(pid, files, |l| {
        kept.offer(l);
        std::ops::ControlFlow::Continue(())
    })?;
    let mut maps = kept.into_mappings();
    let root = TargetRoot::of_process(pid).ok().map(Arc::new);
    let root_seen_at = std::fs::read_link(format!("/proc/{pid}/root")).ok();
    let owner = crate::process::discovery::process_uids(pid).map(|ids| ids[0]);
    let mut in_root: HashMap<Arc<str>, Arc<Path>> = HashMap::new();
    // Each file's first mapping, checked and read for its build ID: the
    // others of that file (a target may map one file tens of thousands of
    // times) share its verdict and ID, each with its own `map_files`
    // entry, instead of an open and an ELF parse each.
    let mut files: HashMap<FileId, (bool, Option<String>)> = HashMap::new();
    for m in &mut maps {
        let path = m.path.clone();
        let shared = || {
            in_root
                .entry(path.clone())
                .or_insert_with(|| path_in_root(&path, root_seen_at.as_deref()).into())
                .clone()
        };
        let known = m.file.and_then(|f| files.get(&f)).cloned();
        match known {
            Some((opens, build_id)) => {
                m.local = local_file(pid, m, root.as_ref(), shared, owner, Some(opens));
                m.build_id = build_id;
            }
            None => {
                m.local = local_file(pid, m, root.as_ref(), shared, owner, None);
                m.build_id = m.local.as_ref().and_then(|f| build_ids.get(f));
                if let Some(f) = m.file {
                    let opens = m.local.as_ref().is_some_and(|l| l.map_file.is_some());
                    files.insert(f, (opens, m.build_id.clone()));
                }
            }
        }
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
        assert_eq!(&*m[0].path, "/usr/bin/prog");
        assert_eq!(&*m[1].path, "/lib/with space.so (deleted)");
        assert!(find(&m, 0x55d0c0a20010).is_some());
        assert!(find(&m, 0x55d0c0a00010).is_none());
    }

    #[test]
    fn an_emulated_programs_read_only_code_mappings_are_kept() {
        // qemu-user: the guest's files are mapped without `x`.
        let text = "\
5500000000-5500001000 r--p 00000000 fe:00 7 /tmp/a64/prog
5500020000-5500021000 rw-p 00010000 fe:00 7 /tmp/a64/prog
55029a0000-5502b27000 r--p 00000000 fe:00 8 /usr/aarch64-linux-gnu/lib/libc.so.6
5502b27000-5502b3c000 ---p 00187000 fe:00 8 /usr/aarch64-linux-gnu/lib/libc.so.6
7ff5e1044000-7ff5e119a000 r-xp 00026000 fe:00 9 /usr/lib/x86_64-linux-gnu/libc.so.6
7ff5e119a000-7ff5e11ed000 r--p 0017c000 fe:00 9 /usr/lib/x86_64-linux-gnu/libc.so.6
";
        let m = parse_maps(text);
        let paths: Vec<_> = m.iter().map(|m| (m.start, &*m.path)).collect();
        assert_eq!(
            paths,
            [
                (0x5500000000, "/tmp/a64/prog"),
                (0x55029a0000, "/usr/aarch64-linux-gnu/lib/libc.so.6"),
                (0x7ff5e1044000, "/usr/lib/x86_64-linux-gnu/libc.so.6"),
            ]
        );
        assert!(find(&m, 0x550000093c).is_some());
        // The native library's data mapping stays out.
        assert!(find(&m, 0x7ff5e119a010).is_none());
    }

    #[test]
    fn paths_are_made_relative_to_a_chrooted_targets_root() {
        let jail = Path::new("/srv/jail");
        assert_eq!(
            path_in_root("/srv/jail/app/prog", Some(jail)),
            Path::new("/app/prog")
        );
        assert_eq!(
            path_in_root("/srv/jailbreak/x", Some(jail)),
            Path::new("/srv/jailbreak/x")
        );
        assert_eq!(
            path_in_root("/usr/lib/x.so", Some(Path::new("/"))),
            Path::new("/usr/lib/x.so")
        );
        assert_eq!(path_in_root("/app/prog", None), Path::new("/app/prog"));
    }

    #[test]
    fn at_most_max_mappings_are_kept_executable_ones_first() {
        let mut text = String::new();
        for i in 0..MAX_MAPPINGS as u64 + 10 {
            let at = 0x10000 + i * 0x2000;
            text.push_str(&format!(
                "{at:x}-{:x} r--p 00000000 08:01 5 /data/f\n",
                at + 0x1000
            ));
        }
        for i in 0..3u64 {
            let at = 0x7f0000000000 + i * 0x2000;
            text.push_str(&format!(
                "{at:x}-{:x} r-xp 00000000 08:01 6 /lib/x.so\n",
                at + 0x1000
            ));
        }
        let m = parse_maps(&text);
        assert_eq!(m.len(), MAX_MAPPINGS);
        assert_eq!(m.iter().filter(|m| &*m.path == "/lib/x.so").count(), 3);
        assert!(find(&m, 0x7f0000000010).is_some());
    }

    #[test]
    fn newlines_in_names_are_unescaped_as_the_kernel_escapes_them() {
        let text = "7f0000002000-7f0000003000 r-xp 00001000 08:01 9 /tmp/lib\\012x.so\n";
        let m = parse_maps(text);
        assert_eq!(&*m[0].path, "/tmp/lib\nx.so");
        // Garbage lines and empty ranges are skipped, never a panic.
        assert!(parse_maps("x-y r-xp 0 0 0 /a\n5-5 r-xp 0 0 0 /b\n -\n\n").is_empty());
    }
}
