//! Out-of-process symbolization of return addresses.
//!
//! Uses gimli-rs's `addr2line` (with `object` underneath): it is the DWARF
//! reader behind Rust's own backtraces, well kept, pure Rust, and gives
//! file, line and inlined frames from DWARF plus symbol-table fallback and
//! demangling of Rust and C++ names. We pick it over a whole-process
//! symbolizer because the dumper must symbolize from a list of mappings
//! it recorded earlier: the target may have exited (watch's final
//! snapshot), so `/proc/PID` may no longer exist.
//!
//! A runtime address is mapped to the file through the mapping that holds
//! it (file offset), then to the ELF's virtual address through the PT_LOAD
//! segment that holds that file offset. Stack frames are return addresses,
//! so `address - 1` is looked up (the call instruction).
//!
//! A file without DWARF (a stripped binary or library) is symbolized from
//! its separate debug file when one is installed where distributions put
//! them, found by build ID: `DIR/.build-id/ab/cdef....debug` for each DIR
//! of `HEAPDUMP_DEBUG_DIRS` (colon-separated; default `/usr/lib/debug`);
//! else through its `.gnu_debuglink` (a file name and a CRC-32), looked for
//! where GDB looks: next to the file, in `.debug/` next to it, and under
//! each DIR followed by the file's directory; only a file with the recorded
//! CRC is taken. Its segments still come from the mapped file.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};

use addr2line::Loader;
use object::{Object, ObjectSegment, ObjectSymbol, ReadCache};

use crate::symbolization::maps::{self, Mapping};

/// One symbolized frame. Inlined functions give several frames for one
/// address, innermost first; all but the last of them have `inlined` set.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Default)]
pub struct Frame {
    /// The return address as captured in the target.
    pub address: u64,
    /// Demangled function name, if known.
    pub function: Option<String>,
    /// Source file, if known.
    pub file: Option<String>,
    /// Source line, if known.
    pub line: Option<u32>,
    /// Path of the mapped file that holds the address.
    pub module: Option<String>,
    /// Offset of the address in that file (`module+0x...`, as perf and
    /// pprof name a frame no symbol covers).
    pub module_offset: Option<u64>,
    /// This frame was inlined into the next one (same address).
    pub inlined: bool,
}

impl Frame {
    /// A short human name: the function, or `module+0xoffset` (the
    /// return address's offset in the module's file), or the address.
    pub fn display_name(&self) -> String {
        match (&self.function, &self.module, self.module_offset) {
            (Some(f), _, _) => f.clone(),
            (None, Some(m), Some(off)) => {
                format!("{}+{off:#x}", m.rsplit('/').next().unwrap_or(m))
            }
            (None, Some(m), None) => {
                format!("{}@{:#x}", m.rsplit('/').next().unwrap_or(m), self.address)
            }
            (None, None, _) => format!("{:#x}", self.address),
        }
    }

    /// `file:line` if known.
    pub fn location(&self) -> Option<String> {
        let file = self.file.as_ref()?;
        Some(match self.line {
            Some(l) => format!("{file}:{l}"),
            None => file.clone(),
        })
    }
}

struct Module {
    /// PT_LOAD segments: (file offset, file size, virtual address).
    segments: Vec<(u64, u64, u64)>,
    loader: Option<Loader>,
    /// Function symbols with their extents, for addresses DWARF does not
    /// name (see [`SymbolExtents`]).
    symbols: SymbolExtents,
}

/// A module's function symbols as (address, size, name), sorted by
/// address: from the full symbol table (of the separate debug file where
/// there is one), else the dynamic one.
///
/// Invariant: a name is given only to an address inside its symbol's
/// extent (`address <= a < address + size`). A stripped binary's static
/// function lies past the end of the exported symbol before it; naming it
/// after that symbol (as `object`'s nearest-symbol map does) would be a
/// silent guess, so such an address stays `module+0xoffset`, as perf and
/// pprof show it. Symbols of size 0 cover nothing.
#[derive(Default)]
struct SymbolExtents(Vec<(u64, u64, String)>);

impl SymbolExtents {
    /// The function symbols of a parsed file: its full symbol table, else
    /// its dynamic one.
    fn of<'d, R: object::ReadRef<'d>>(obj: &object::File<'d, R>) -> SymbolExtents {
        let full: Vec<_> = obj.symbols().collect();
        let syms = if full.is_empty() {
            obj.dynamic_symbols().collect()
        } else {
            full
        };
        let mut out: Vec<(u64, u64, String)> = syms
            .into_iter()
            .filter(|s| s.kind() == object::SymbolKind::Text && s.size() != 0 && s.is_definition())
            .filter_map(|s| Some((s.address(), s.size(), s.name().ok()?.to_string())))
            .collect();
        out.sort_by_key(|s| (s.0, std::cmp::Reverse(s.1)));
        SymbolExtents(out)
    }

    /// The function symbols of the file at `path` (empty if unreadable).
    fn read(path: &Path) -> SymbolExtents {
        let Ok(file) = File::open(path) else {
            return SymbolExtents::default();
        };
        let cache = ReadCache::new(file);
        match object::File::parse(&cache) {
            Ok(obj) => SymbolExtents::of(&obj),
            Err(_) => SymbolExtents::default(),
        }
    }

    /// The name of the symbol whose extent holds `svma`, if one does.
    fn covering(&self, svma: u64) -> Option<&str> {
        let i = self.0.partition_point(|s| s.0 <= svma);
        // Nested or overlapping symbols (aliases of one function share an
        // address): look back a few entries for one that covers.
        self.0[..i]
            .iter()
            .rev()
            .take(8)
            .find(|(a, size, _)| svma < a.saturating_add(*size))
            .map(|(_, _, n)| n.as_str())
    }
}

impl Module {
    fn open(path: &Path, debug_dirs: &[PathBuf]) -> Option<Module> {
        let file = File::open(path).ok()?;
        let cache = ReadCache::new(file);
        let obj = object::File::parse(&cache).ok()?;
        let segments = obj
            .segments()
            .map(|s| {
                let (off, size) = s.file_range();
                (off, size, s.address())
            })
            .collect();
        // No DWARF here: a separate debug file, if installed, has it (and
        // the full symbol table).
        let separate = if obj.section_by_name(".debug_info").is_none() {
            maps::build_id_of(&obj)
                .and_then(|id| find_debug_file(&id, debug_dirs))
                .or_else(|| {
                    let (name, crc) = obj.gnu_debuglink().ok()??;
                    find_debuglink(path, name, crc, debug_dirs)
                })
        } else {
            None
        };
        // The separate debug file's full symbol table where it has one,
        // else this file's (parsed above).
        let symbols = separate
            .as_deref()
            .map(SymbolExtents::read)
            .filter(|s| !s.0.is_empty())
            .unwrap_or_else(|| SymbolExtents::of(&obj));
        let loader = separate
            .and_then(|p| Loader::new(&p).ok())
            .or_else(|| Loader::new(path).ok());
        Some(Module {
            segments,
            loader,
            symbols,
        })
    }

    fn svma(&self, file_offset: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|(off, size, _)| (*off..off.saturating_add(*size)).contains(&file_offset))
            .map(|(off, _, vaddr)| file_offset - off + vaddr)
    }
}

/// Symbolizes addresses against recorded mappings, caching each file's
/// debug information across calls (and across snapshots).
#[derive(Default)]
pub struct Symbolizer {
    modules: HashMap<PathBuf, Option<Module>>,
    /// Roots of separate debug files (`.build-id/` trees).
    debug_dirs: Vec<PathBuf>,
}

/// Where separate debug files are looked for unless `HEAPDUMP_DEBUG_DIRS`
/// says otherwise.
pub const DEFAULT_DEBUG_DIR: &str = "/usr/lib/debug";

/// The separate debug file of a file with build ID `id` under one of
/// `dirs`: `DIR/.build-id/ab/cdef....debug`.
pub fn find_debug_file(id: &str, dirs: &[PathBuf]) -> Option<PathBuf> {
    if id.len() < 3 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    dirs.iter()
        .map(|d| {
            d.join(".build-id")
                .join(&id[..2])
                .join(format!("{}.debug", &id[2..]))
        })
        .find(|p| p.is_file())
}

/// The debug file a `.gnu_debuglink` of the file at `path` names: `name`
/// (a bare file name) next to it, in `.debug/` next to it, or under each of
/// `dirs` followed by the file's directory (without a `/proc/PID/root`
/// prefix), whichever comes first with CRC-32 `crc`.
pub fn find_debuglink(path: &Path, name: &[u8], crc: u32, dirs: &[PathBuf]) -> Option<PathBuf> {
    let name = std::str::from_utf8(name).ok()?;
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return None;
    }
    let dir = path.parent()?;
    // Inside a container's root, the debug directories' layout follows the
    // file's own path there.
    let own_dir = strip_proc_root(dir);
    let mut candidates = vec![dir.join(name), dir.join(".debug").join(name)];
    for d in dirs {
        candidates.push(
            d.join(own_dir.strip_prefix("/").unwrap_or(own_dir))
                .join(name),
        );
    }
    candidates
        .into_iter()
        .find(|c| c != path && c.is_file() && crc32_of(c) == Some(crc))
}

/// `/proc/PID/root/usr/bin` -> `/usr/bin`; other paths unchanged.
fn strip_proc_root(dir: &Path) -> &Path {
    let Some(rest) = dir.to_str().and_then(|s| s.strip_prefix("/proc/")) else {
        return dir;
    };
    let Some((pid, tail)) = rest.split_once('/') else {
        return dir;
    };
    if pid.is_empty() || !pid.bytes().all(|b| b.is_ascii_digit()) {
        return dir;
    }
    match tail.strip_prefix("root") {
        Some("") => Path::new("/"),
        Some(t) if t.starts_with('/') => Path::new(t),
        _ => dir,
    }
}

/// CRC-32 (the zlib polynomial, as `.gnu_debuglink` records it) of a file.
fn crc32_of(path: &Path) -> Option<u32> {
    use std::io::Read;
    let mut f = File::open(path).ok()?;
    let mut crc = flate2::Crc::new();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match f.read(&mut buf) {
            Ok(0) => return Some(crc.sum()),
            Ok(n) => crc.update(&buf[..n]),
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
}

impl std::fmt::Debug for Symbolizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Symbolizer")
            .field("modules", &self.modules.len())
            .finish()
    }
}

/// The frame for an address without symbol information (module only).
pub fn unsymbolized(address: u64, maps: &[Mapping]) -> Frame {
    let m = maps::find(maps, address.wrapping_sub(1));
    Frame {
        address,
        module: m.map(|m| m.path.clone()),
        module_offset: m.map(|m| address - m.start + m.offset),
        ..Frame::default()
    }
}

impl Symbolizer {
    /// A symbolizer with an empty cache, looking for separate debug files
    /// under `HEAPDUMP_DEBUG_DIRS` (colon-separated), else
    /// [`DEFAULT_DEBUG_DIR`].
    pub fn new() -> Self {
        let dirs = std::env::var_os("HEAPDUMP_DEBUG_DIRS")
            .map(|v| {
                std::env::split_paths(&v)
                    .filter(|p| !p.as_os_str().is_empty())
                    .collect()
            })
            .unwrap_or_else(|| vec![PathBuf::from(DEFAULT_DEBUG_DIR)]);
        Self::with_debug_dirs(dirs)
    }

    /// A symbolizer with an empty cache, looking for separate debug files
    /// under `dirs`.
    pub fn with_debug_dirs(dirs: Vec<PathBuf>) -> Self {
        Symbolizer {
            modules: HashMap::new(),
            debug_dirs: dirs,
        }
    }

    /// Opens (and caches) the file of every mapping now, so that addresses
    /// can still be symbolized after the target exited even where its
    /// files were only reachable through `/proc/PID/root` (a container).
    pub fn open_modules(&mut self, maps: &[Mapping]) {
        for m in maps {
            if let Some(path) = &m.local_path {
                let dirs = &self.debug_dirs;
                self.modules
                    .entry(path.clone())
                    .or_insert_with(|| Module::open(path, dirs));
            }
        }
    }

    /// Frames for the return address `address` (innermost inlined first).
    /// Always returns at least one frame.
    pub fn symbolize(&mut self, address: u64, maps: &[Mapping]) -> Vec<Frame> {
        let base = unsymbolized(address, maps);
        let lookup = address.wrapping_sub(1);
        let Some(m) = maps::find(maps, lookup) else {
            return vec![base];
        };
        let Some(path) = m.local_path.clone() else {
            return vec![base];
        };
        let dirs = &self.debug_dirs;
        let module = self
            .modules
            .entry(path.clone())
            .or_insert_with(|| Module::open(&path, dirs));
        let Some(module) = module.as_ref() else {
            return vec![base];
        };
        let file_offset = lookup - m.start + m.offset;
        let Some(probe) = module.svma(file_offset) else {
            return vec![base];
        };
        let Some(loader) = module.loader.as_ref() else {
            return vec![base];
        };
        let mut out = Vec::new();
        if let Ok(mut frames) = loader.find_frames(probe) {
            while let Ok(Some(f)) = frames.next() {
                let function = f
                    .function
                    .as_ref()
                    .and_then(|n| n.demangle().ok().map(|s| s.into_owned()));
                let (file, line) = match &f.location {
                    Some(l) => (l.file.map(str::to_string), l.line),
                    None => (None, None),
                };
                out.push(Frame {
                    function,
                    file,
                    line,
                    inlined: true,
                    ..base.clone()
                });
            }
        }
        if out.iter().all(|f| f.function.is_none()) {
            // No DWARF function: fall back to the symbol table, keeping a
            // line if DWARF had one.
            let (file, line) = out
                .first()
                .map(|f| (f.file.clone(), f.line))
                .unwrap_or((None, None));
            if let Some(sym) = module.symbols.covering(probe) {
                out = vec![Frame {
                    function: Some(addr2line::demangle_auto(sym.into(), None).into_owned()),
                    file,
                    line,
                    ..base.clone()
                }];
            }
        }
        if let Some(last) = out.last_mut() {
            last.inlined = false;
        } else {
            out.push(base);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_files_are_looked_up_by_build_id_only_for_plausible_ids() {
        let dir = std::env::temp_dir().join(format!("heapdump-debugdir-{}", std::process::id()));
        let place = dir.join(".build-id").join("ab");
        std::fs::create_dir_all(&place).unwrap();
        std::fs::write(place.join("cdef01.debug"), b"x").unwrap();
        let dirs = [PathBuf::from("/nonexistent"), dir.clone()];
        assert_eq!(
            find_debug_file("abcdef01", &dirs),
            Some(place.join("cdef01.debug"))
        );
        assert_eq!(find_debug_file("abcdef02", &dirs), None);
        // Not a build ID: never turned into a path.
        assert_eq!(find_debug_file("ab", &dirs), None);
        assert_eq!(find_debug_file("../../etc", &dirs), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debuglinks_are_found_where_gdb_looks_and_only_with_their_crc() {
        assert_eq!(
            strip_proc_root(Path::new("/proc/42/root/usr/bin")),
            Path::new("/usr/bin")
        );
        assert_eq!(strip_proc_root(Path::new("/proc/42/root")), Path::new("/"));
        assert_eq!(
            strip_proc_root(Path::new("/proc/self/root/x")),
            Path::new("/proc/self/root/x")
        );
        assert_eq!(
            strip_proc_root(Path::new("/usr/bin")),
            Path::new("/usr/bin")
        );
        let base = std::env::temp_dir().join(format!("heapdump-debuglink-{}", std::process::id()));
        let bin_dir = base.join("opt/app");
        std::fs::create_dir_all(bin_dir.join(".debug")).unwrap();
        let exe = bin_dir.join("app");
        std::fs::write(&exe, b"binary").unwrap();
        let content = b"debug info";
        let crc = {
            let mut c = flate2::Crc::new();
            c.update(content);
            c.sum()
        };
        let root = base.join("debug-root");
        let under_root = root.join(bin_dir.strip_prefix("/").unwrap());
        std::fs::create_dir_all(&under_root).unwrap();
        let dirs = vec![root.clone()];
        let find = |name: &[u8], crc| find_debuglink(&exe, name, crc, &dirs);
        // Under a debug root, following the file's own directory.
        std::fs::write(under_root.join("app.debug"), content).unwrap();
        assert_eq!(find(b"app.debug", crc), Some(under_root.join("app.debug")));
        // `.debug/` next to the file comes before it, the file's own
        // directory first of all.
        std::fs::write(bin_dir.join(".debug/app.debug"), content).unwrap();
        assert_eq!(
            find(b"app.debug", crc),
            Some(bin_dir.join(".debug/app.debug"))
        );
        std::fs::write(bin_dir.join("app.debug"), content).unwrap();
        assert_eq!(find(b"app.debug", crc), Some(bin_dir.join("app.debug")));
        // Another CRC: none of them is the file the link names; a damaged
        // one is skipped for an intact one further on.
        assert_eq!(find(b"app.debug", crc ^ 1), None);
        std::fs::write(bin_dir.join("app.debug"), b"debug info, rebuilt").unwrap();
        assert_eq!(
            find(b"app.debug", crc),
            Some(bin_dir.join(".debug/app.debug"))
        );
        // Names that are paths, or the file itself, are never taken.
        for name in [&b"../app/app.debug"[..], b"", b".", b"..", b"/etc/passwd"] {
            assert_eq!(find(name, crc), None, "{name:?}");
        }
        let crc_of_exe = crc32_of(&exe).unwrap();
        assert_eq!(find(b"app", crc_of_exe), None);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
