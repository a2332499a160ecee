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
//! CRC is taken. Its segments still come from the mapped file. Split DWARF
//! is read from a `.dwp` package beside the file, looked for only when the
//! file's units ask for it; separate `.dwo` files (named by absolute paths
//! of the build machine) are not opened.
//!
//! Every file is a target's, opened and read under the rules of
//! [`crate::process::target_files`]: regular files only, resolved inside
//! the target's root, read into private memory within a budget (no shared
//! mapping a target could truncate under us), and the whole of one
//! symbolization within a deadline, past which the remaining frames are
//! addresses and the snapshot says why.

use std::borrow::Cow;
use std::collections::HashMap;
use std::fs::File;
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use addr2line::{Context, LookupContinuation, LookupResult};
use gimli::read::EndianArcSlice;
use gimli::RunTimeEndian;
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol};

use crate::process::target_files::{self, BoundedFile, TargetRoot, TotalBudget};
use crate::process::user_space_mounts;
use crate::symbolization::dwarf_limits::{self, Refusal};
use crate::symbolization::maps::{self, LocalFile, Mapping};
use crate::symbolization::perf_map::{PerfMap, MAX_PERF_MAP};

/// The reader symbolization uses: sections copied out of the file.
type Reader = EndianArcSlice<RunTimeEndian>;

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
    /// Offset of the return address in its function, for a frame named
    /// from a symbol table with no line (`deflateInit2_+0x7c`), so that
    /// two call sites in one function never print alike.
    pub function_offset: Option<u64>,
    /// This frame was inlined into the next one (same address).
    pub inlined: bool,
}

impl Frame {
    /// A short human name: the function, or `module+0xoffset` (the
    /// return address's offset in the module's file), or the address.
    pub fn display_name(&self) -> String {
        match (&self.function, &self.module, self.module_offset) {
            (Some(f), _, _) => match (self.line, self.function_offset) {
                (None, Some(off)) => format!("{f}+{off:#x}"),
                _ => f.clone(),
            },
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

/// A `.dwp` package, its sections copied out, and the file they came
/// from (its read budget).
type DwpPackage = (gimli::DwarfPackage<Reader>, BoundedFile);

struct Module {
    /// PT_LOAD segments: (file offset, file size, virtual address).
    segments: Vec<(u64, u64, u64)>,
    /// The DWARF of the file (or of its separate debug file).
    dwarf: Option<Context<Reader>>,
    /// Where a `.dwp` package would be, and the package once looked for
    /// (with its file, whose budget its units' tables are charged to).
    dwp: Option<(LocalFile, OnceLock<Option<DwpPackage>>)>,
    /// Function symbols with their extents, for addresses DWARF does not
    /// name (see [`SymbolExtents`]).
    symbols: SymbolExtents,
    /// Why DWARF (the file's, or a unit of its `.dwp`) was not used, for
    /// the snapshot's notes.
    refused_dwarf: OnceLock<String>,
    /// The symbolizer's total budget, which a `.dwp` read later is
    /// charged to.
    total: TotalBudget,
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

    /// The start and name of the symbol whose extent holds `svma`, if one
    /// does.
    fn covering(&self, svma: u64) -> Option<(u64, &str)> {
        let i = self.0.partition_point(|s| s.0 <= svma);
        // Nested or overlapping symbols (aliases of one function share an
        // address): look back a few entries for one that covers.
        self.0[..i]
            .iter()
            .rev()
            .take(8)
            .find(|(a, size, _)| svma < a.saturating_add(*size))
            .map(|(a, _, n)| (*a, n.as_str()))
    }
}

/// A section's bytes, decompressed, copied into private memory; empty
/// when missing, unreadable, or over what is left of the file's budget.
fn section_bytes<'d>(
    obj: &object::File<'d, &'d BoundedFile>,
    file: &'d BoundedFile,
    name: &str,
) -> Arc<[u8]> {
    let Some(section) = obj.section_by_name(name) else {
        return Arc::from(&[][..]);
    };
    let Ok(compressed) = section.compressed_data() else {
        return Arc::from(&[][..]);
    };
    // The uncompressed size is the file's word: charge it before
    // `object` sets memory aside for it.
    if compressed.format != object::CompressionFormat::None
        && !file.charge_extra(compressed.uncompressed_size)
    {
        return Arc::from(&[][..]);
    }
    match compressed.decompress() {
        Ok(Cow::Borrowed(b)) => Arc::from(b),
        Ok(Cow::Owned(v)) => Arc::from(v),
        Err(_) => Arc::from(&[][..]),
    }
}

fn endian_of<'d>(obj: &object::File<'d, &'d BoundedFile>) -> RunTimeEndian {
    if obj.is_little_endian() {
        RunTimeEndian::Little
    } else {
        RunTimeEndian::Big
    }
}

/// The DWARF context of a parsed file, its sections copied out (the file
/// may then be closed, truncated or gone); `Err` when addr2line cannot be
/// trusted with it (see [`dwarf_limits`]: its tables are charged to the
/// file's budget).
fn dwarf_context<'d>(
    obj: &object::File<'d, &'d BoundedFile>,
    file: &'d BoundedFile,
) -> Result<Option<Context<Reader>>, Refusal> {
    let endian = endian_of(obj);
    let Ok(dwarf) = gimli::Dwarf::load(|id| {
        Ok::<_, gimli::Error>(Reader::new(section_bytes(obj, file, id.name()), endian))
    }) else {
        return Ok(None);
    };
    admit(&dwarf, file)?;
    Ok(Context::from_dwarf(dwarf).ok())
}

/// Whether addr2line may read `dwarf`, from `file` ([`dwarf_limits`]):
/// the tables it would build are charged to the file's budget.
fn admit(dwarf: &gimli::Dwarf<Reader>, file: &BoundedFile) -> Result<(), Refusal> {
    let tables = dwarf_limits::admit(dwarf, file.budget_left())?;
    if file.charge_extra(tables) {
        Ok(())
    } else {
        Err(Refusal::TooBig { bytes: tables })
    }
}

/// Opens a file of a target within the read budget, every read also
/// charged to `total`, or `None`.
fn bounded(file: File, total: &TotalBudget) -> Option<BoundedFile> {
    BoundedFile::within(file, target_files::max_file_read(), total).ok()
}

impl Module {
    fn open(
        opened: File,
        local: &LocalFile,
        debug_dirs: &[PathBuf],
        deadline: Option<Instant>,
        total: &TotalBudget,
    ) -> Option<Module> {
        let file = bounded(opened, total)?;
        let obj = object::File::parse(&file).ok()?;
        let segments = obj
            .segments()
            .map(|s| {
                let (off, size) = s.file_range();
                (off, size, s.address())
            })
            .collect();
        let own_root = TargetRoot::own().ok();
        // No DWARF here: a separate debug file, if installed, has it (and
        // the full symbol table).
        let separate: Option<BoundedFile> = if obj.section_by_name(".debug_info").is_none() {
            maps::build_id_of(&obj)
                .and_then(|id| {
                    let root = own_root.as_ref()?;
                    let p = find_debug_file(&id, debug_dirs, root)?;
                    bounded(root.open(&p).ok()?, total)
                })
                .or_else(|| {
                    let (name, crc) = obj.gnu_debuglink().ok()??;
                    let root = own_root.as_ref()?;
                    find_debuglink(local, name, crc, debug_dirs, root, deadline, total)
                        .map(|(_, f)| f)
                })
        } else {
            None
        };
        let separate_obj = separate.as_ref().and_then(|f| object::File::parse(f).ok());
        // The separate debug file's full symbol table where it has one,
        // else this file's (parsed above).
        let symbols = separate_obj
            .as_ref()
            .map(SymbolExtents::of)
            .filter(|s| !s.0.is_empty())
            .unwrap_or_else(|| SymbolExtents::of(&obj));
        let refused_dwarf = OnceLock::new();
        let mut refuse = |e: Refusal| {
            let _ = refused_dwarf.set(e.to_string());
            None
        };
        let dwarf = match (&separate_obj, &separate) {
            (Some(o), Some(f)) => dwarf_context(o, f).unwrap_or_else(&mut refuse),
            _ => None,
        }
        .or_else(|| dwarf_context(&obj, &file).unwrap_or_else(&mut refuse));
        // A `.dwp` package sits beside the file, by the file's own name.
        let dwp = local.path.as_ref().map(|p| {
            let mut name = p.as_os_str().to_os_string();
            name.push(".dwp");
            (
                LocalFile {
                    map_file: None,
                    root: local.root.clone(),
                    path: Some(PathBuf::from(name).into()),
                    owner: local.owner,
                },
                OnceLock::new(),
            )
        });
        Some(Module {
            segments,
            dwarf,
            dwp,
            symbols,
            refused_dwarf,
            total: total.clone(),
        })
    }

    /// The split-DWARF unit `load` asks for, from the `.dwp` package
    /// beside the file (read once, the first time a unit asks).
    fn split_unit(
        &self,
        load: &addr2line::SplitDwarfLoad<Reader>,
    ) -> Option<Arc<gimli::Dwarf<Reader>>> {
        let (file, package) = self.dwp.as_ref()?;
        let (package, f) = package
            .get_or_init(|| {
                let f = bounded(file.open().ok()?, &self.total)?;
                let package = {
                    let obj = object::File::parse(&f).ok()?;
                    let endian = endian_of(&obj);
                    gimli::DwarfPackage::load(
                        |id| {
                            Ok::<_, gimli::Error>(Reader::new(
                                id.dwo_name()
                                    .map(|n| section_bytes(&obj, &f, n))
                                    .unwrap_or_else(|| Arc::from(&[][..])),
                                endian,
                            ))
                        },
                        Reader::new(Arc::from(&[][..]), endian),
                    )
                    .ok()?
                };
                Some((package, f))
            })
            .as_ref()?;
        let unit = package.find_cu(load.dwo_id, &load.parent).ok()??;
        if let Err(e) = admit(&unit, f) {
            let _ = self
                .refused_dwarf
                .set(format!("a unit of its .dwp package: {e}"));
            return None;
        }
        Some(Arc::new(unit))
    }

    /// The frames DWARF gives for `probe` (innermost first, each a copy
    /// of `base` with what DWARF says), none without DWARF.
    fn dwarf_frames(&self, probe: u64, base: &Frame) -> Vec<Frame> {
        let mut out = Vec::new();
        let found = self.dwarf.as_ref().map(|ctx| {
            let mut lookup = ctx.find_frames(probe);
            // Split DWARF: each unit asked for comes from the `.dwp`.
            loop {
                match lookup {
                    LookupResult::Output(r) => break r,
                    LookupResult::Load { load, continuation } => {
                        lookup = continuation.resume(self.split_unit(&load));
                    }
                }
            }
        });
        if let Some(Ok(mut frames)) = found {
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
        out
    }

    fn svma(&self, file_offset: u64) -> Option<u64> {
        self.segments
            .iter()
            .find(|(off, size, _)| (*off..off.saturating_add(*size)).contains(&file_offset))
            .map(|(off, _, vaddr)| (file_offset - off).wrapping_add(*vaddr))
    }
}

/// Symbolizes addresses against recorded mappings, caching each file's
/// debug information across calls (and across snapshots).
#[derive(Default)]
pub struct Symbolizer {
    /// Modules by the file's identity (device, inode, size, change time),
    /// so one library is parsed once for every process that maps it.
    modules: HashMap<FileIdentity, Option<Module>>,
    /// Each mapping's file (by [`LocalFile::key`]) to its identity, or
    /// `None` when it could not be opened.
    opened: HashMap<String, Option<FileIdentity>>,
    /// Roots of separate debug files (`.build-id/` trees).
    debug_dirs: Vec<PathBuf>,
    /// How long one symbolization may take ([`Symbolizer::begin`]).
    time_limit: Duration,
    /// When the current symbolization must end.
    deadline: Option<Instant>,
    /// What was given up, for the snapshot's notes.
    notes: Vec<String>,
    /// Code a runtime compiled (JIT), named by its perf map.
    jit: PerfMap,
    /// Files not read for their file system (by [`LocalFile::key`]), with
    /// the note that says so in each symbolization that needs them.
    refused: HashMap<String, String>,
    /// What all the files it reads may take together
    /// (`HEAPDUMP_MAX_TOTAL_READ`): its cache keeps what it read.
    total: TotalBudget,
    /// Each user's share of `total` (by the real user id of the process a
    /// file was first read for), so that one user's processes cannot take
    /// all of a collector's total from the others'.
    shares: HashMap<u32, TotalBudget>,
    /// The bytes of `total` (`None`: no limit, and no shares); each
    /// user's share is half of them.
    total_bytes: Option<u64>,
    /// Modules that did not fit whole (read again for another user's
    /// process, or once their user's share has more room).
    short: HashMap<FileIdentity, CutShort>,
}

/// A module that did not fit whole in the share it was read in.
#[derive(Clone, Copy, Debug)]
struct CutShort {
    /// The user whose share it was read in (`None`: the total's).
    owner: Option<u32>,
    /// What that share had left just after (see
    /// [`Symbolizer::worth_reading_again`]).
    left_after: u64,
}

/// A file's identity: device, inode, size and change time.
type FileIdentity = (u64, u64, i64, i64);

/// How long one symbolization may take unless `HEAPDUMP_SYMBOLIZE_TIMEOUT`
/// (seconds) says otherwise; the frames left are shown as addresses.
pub const DEFAULT_SYMBOLIZE_TIMEOUT: Duration = Duration::from_secs(60);

/// Where separate debug files are looked for unless `HEAPDUMP_DEBUG_DIRS`
/// says otherwise.
pub const DEFAULT_DEBUG_DIR: &str = "/usr/lib/debug";

/// The separate debug file of a file with build ID `id` under one of
/// `dirs`: `DIR/.build-id/ab/cdef....debug` (a regular file in `root`,
/// heapdump's own).
pub fn find_debug_file(id: &str, dirs: &[PathBuf], root: &TargetRoot) -> Option<PathBuf> {
    if id.len() < 3 || !id.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    dirs.iter()
        .map(|d| {
            d.join(".build-id")
                .join(&id[..2])
                .join(format!("{}.debug", &id[2..]))
        })
        .find(|p| root.is_file(p))
}

/// The debug file a `.gnu_debuglink` of `file` names: `name` (a bare file
/// name) next to it, in `.debug/` next to it (both inside the target's
/// root), or under each of `dirs` (heapdump's own) followed by the file's
/// directory, whichever comes first with CRC-32 `crc`. A candidate larger
/// than the read budget is not read.
pub fn find_debuglink(
    file: &LocalFile,
    name: &[u8],
    crc: u32,
    dirs: &[PathBuf],
    own_root: &TargetRoot,
    deadline: Option<Instant>,
    total: &TotalBudget,
) -> Option<(PathBuf, BoundedFile)> {
    let name = std::str::from_utf8(name).ok()?;
    if name.is_empty() || name.contains('/') || name == "." || name == ".." {
        return None;
    }
    let path = file.path.as_ref()?;
    let dir = path.parent()?;
    let mut candidates: Vec<(&TargetRoot, PathBuf)> = vec![
        (&file.root, dir.join(name)),
        (&file.root, dir.join(".debug").join(name)),
    ];
    for d in dirs {
        candidates.push((
            own_root,
            d.join(dir.strip_prefix("/").unwrap_or(dir)).join(name),
        ));
    }
    candidates.into_iter().find_map(|(root, c)| {
        if *c == **path {
            return None;
        }
        let f = root.open(&c).ok()?;
        (crc32_of(&f, deadline)? == crc).then_some(())?;
        Some((c, bounded(f, total)?))
    })
}

/// CRC-32 (the zlib polynomial, as `.gnu_debuglink` records it) of an
/// open file, if it is within the read budget and read before `deadline`.
fn crc32_of(f: &File, deadline: Option<Instant>) -> Option<u32> {
    use std::os::unix::fs::FileExt;
    let len = target_files::fstat(f).ok()?.st_size.max(0) as u64;
    if len > target_files::max_file_read() {
        return None;
    }
    let mut crc = flate2::Crc::new();
    let mut buf = vec![0u8; 1 << 16];
    let mut at = 0u64;
    while at < len {
        if deadline.is_some_and(|d| Instant::now() > d) {
            return None;
        }
        match f.read_at(&mut buf, at) {
            Ok(0) => break,
            Ok(n) => {
                crc.update(&buf[..n]);
                at += n as u64;
            }
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return None,
        }
    }
    Some(crc.sum())
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
        module: m.map(|m| m.path.to_string()),
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
        let time_limit = std::env::var("HEAPDUMP_SYMBOLIZE_TIMEOUT")
            .ok()
            .and_then(|v| v.trim().parse().ok())
            .map(Duration::from_secs)
            .unwrap_or(DEFAULT_SYMBOLIZE_TIMEOUT);
        let total = target_files::max_total_read();
        Symbolizer {
            debug_dirs: dirs,
            time_limit,
            total: TotalBudget::new(total),
            total_bytes: Some(total),
            ..Symbolizer::default()
        }
    }

    /// Starts one symbolization: from now, it has the time limit
    /// (`HEAPDUMP_SYMBOLIZE_TIMEOUT`, default 60 s) to open files; past
    /// it, the frames left are addresses and [`take_notes`](Self::take_notes)
    /// says so.
    pub fn begin(&mut self) {
        self.deadline = Some(Instant::now() + self.time_limit);
    }

    /// Reads the perf map of process `pid` (`/tmp/perf-PID.map` inside its
    /// root, PID as the process sees itself), naming the code its runtime
    /// compiled; forgets any earlier one. A missing map names nothing.
    ///
    /// `/tmp` is everyone's: the map is read only when no symbolic link
    /// leads to it and it belongs to one of the process's own user ids
    /// (as perf takes only its user's maps), so neither the target (a link
    /// to a file of root's) nor another user (a file of theirs put there
    /// first) decides what root reads.
    ///
    /// `root`: the process's root as its mappings were read with (its
    /// mount table read once for both: see `user_space_mounts`), else
    /// taken here.
    pub fn use_perf_map(&mut self, pid: u32, root: Option<std::sync::Arc<TargetRoot>>) {
        self.jit = PerfMap::default();
        let own_pid = crate::process::discovery::namespace_pid(pid).unwrap_or(pid);
        let Some(owners) = crate::process::discovery::process_uids(pid) else {
            return;
        };
        let Some(root) = root.or_else(|| TargetRoot::of_process(pid).ok().map(Into::into)) else {
            return;
        };
        let path = PathBuf::from(format!("/tmp/perf-{own_pid}.map"));
        let opened = root.open_owned(&path, &owners);
        if let Err(e) = &opened {
            // Refused for where it lies (not merely missing): said.
            if user_space_mounts::is_refusal(e) {
                self.notes
                    .push(format!("{e}: the code its runtime compiled is not named"));
            }
        }
        let Some(bytes) = opened
            .ok()
            .and_then(|f| target_files::read_capped(&f, MAX_PERF_MAP, &path).ok())
        else {
            return;
        };
        self.jit = PerfMap::parse(bytes);
        if self.jit.dropped() > 0 {
            self.notes.push(format!(
                "{}: its first {} lines were not kept (only its last {} are)",
                path.display(),
                self.jit.dropped(),
                crate::symbolization::perf_map::MAX_ENTRIES
            ));
        }
    }

    /// The perf map's name for `address`, if its code is there.
    fn jit_name(&self, address: u64) -> Option<&str> {
        self.jit.name(address)
    }

    /// What this symbolization gave up, in words (once each), emptied.
    pub fn take_notes(&mut self) -> Vec<String> {
        std::mem::take(&mut self.notes)
    }

    fn past_deadline(&mut self) -> bool {
        let late = self.deadline.is_some_and(|d| Instant::now() > d);
        if late {
            let note = format!(
                "symbolization stopped after {} s (HEAPDUMP_SYMBOLIZE_TIMEOUT): the frames left \
                 are addresses",
                self.time_limit.as_secs()
            );
            if !self.notes.contains(&note) {
                self.notes.push(note);
            }
        }
        late
    }

    /// The module of a mapping's file, opened and parsed on first use.
    fn module(&mut self, local: &LocalFile) -> Option<&Module> {
        let key = local.key();
        let identity = self.identity(local, &key);
        let open = identity.is_some_and(|id| self.modules.get(&id).is_some_and(Option::is_some));
        if !open {
            if let Some(note) = self.refused.get(&key) {
                if !self.notes.contains(note) {
                    self.notes.push(note.clone());
                }
            }
            return None;
        }
        self.modules.get(&identity?)?.as_ref()
    }

    /// The identity of a mapping's file, opening and parsing it on first
    /// use (and again when it was cut short and may fit now, see
    /// [`Self::worth_reading_again`]).
    fn identity(&mut self, local: &LocalFile, key: &str) -> Option<FileIdentity> {
        if let Some(id) = self.opened.get(key) {
            let id = (*id)?;
            if !self.short.is_empty() && self.worth_reading_again(id, local, false) {
                // The same file as before (its identity checked), or left.
                let opened = local.open().ok().filter(|f| {
                    target_files::fstat(f)
                        .is_ok_and(|st| (st.st_dev, st.st_ino, st.st_size, st.st_ctime) == id)
                });
                if opened.is_some() && !self.past_deadline() {
                    self.read_again(opened, id, local, key);
                }
            }
            return Some(id);
        }
        if self.past_deadline() {
            return None;
        }
        let opened = match local.open() {
            Ok(f) => Some(f),
            Err(e) => {
                if user_space_mounts::is_refusal(&e) {
                    self.refused
                        .insert(key.to_string(), format!("{e}: its frames are addresses"));
                }
                None
            }
        };
        let id = opened.as_ref().and_then(|f| {
            let st = target_files::fstat(f).ok()?;
            Some((st.st_dev, st.st_ino, st.st_size, st.st_ctime))
        });
        self.opened.insert(key.to_string(), id);
        let id = id?;
        if !self.modules.contains_key(&id) {
            let (module, short) = self.load_module(opened, local, key);
            self.modules.insert(id, module);
            if short {
                let left_after = self.room_of(local.owner);
                self.short.insert(
                    id,
                    CutShort {
                        owner: local.owner,
                        left_after,
                    },
                );
            }
        } else if self.worth_reading_again(id, local, true) {
            self.read_again(opened, id, local, key);
        }
        Some(id)
    }

    /// Whether the module of file `id`, which did not fit whole, is to be
    /// read again for the process whose mapping is `local`: for another
    /// user's process seen for the first time (`new_key`: one user that
    /// used up its share must not leave the files every process maps, the
    /// dynamic loader and libc, unread for all the others), or once the
    /// share it was read in has more room than it had just after (what
    /// crowded it out was given back: a collector's target whose file was
    /// cut short while another process of its user held the share gets it
    /// whole once that process exited). Never twice for the same room, nor
    /// for users taking turns with processes seen before.
    fn worth_reading_again(&self, id: FileIdentity, local: &LocalFile, new_key: bool) -> bool {
        self.short.get(&id).is_some_and(|s| {
            if s.owner == local.owner {
                self.room_of(s.owner) > s.left_after
            } else {
                new_key
            }
        })
    }

    /// Reads file `id` again (see [`Self::worth_reading_again`]), charged
    /// to the share of `local`'s user. In the share it was read in, whose
    /// room grew, the module read before is let go first (what it read is
    /// given back, so the new reading has all the room there is) and the
    /// new one kept, whole or not; for another user's process, the new one
    /// is kept only if it is whole (that share may have less room).
    fn read_again(&mut self, opened: Option<File>, id: FileIdentity, local: &LocalFile, key: &str) {
        let same_share = self.short.get(&id).is_some_and(|s| s.owner == local.owner);
        if same_share {
            drop(self.modules.remove(&id));
        }
        let (module, short) = self.load_module(opened, local, key);
        if !short {
            self.modules.insert(id, module);
            self.short.remove(&id);
        } else if same_share {
            self.modules.insert(id, module);
            let left_after = self.room_of(local.owner);
            if let Some(s) = self.short.get_mut(&id) {
                s.left_after = left_after;
            }
        }
    }

    /// Bytes a file read for a process of user `owner` may take now: what
    /// is left of that user's share (a share not made yet: half the
    /// total), within what is left of the total.
    fn room_of(&self, owner: Option<u32>) -> u64 {
        let total = self.total.left();
        match (owner, self.total_bytes) {
            (Some(uid), Some(bytes)) => self
                .shares
                .get(&uid)
                .map_or(total.min(bytes / 2), TotalBudget::left),
            _ => total,
        }
    }

    /// Reads a file's module, charged to an account of its own in the
    /// share of the user whose process maps it (given back to the total
    /// when the module is forgotten, `retain_mapped`), and whether some of
    /// it did not fit (what did not fit is said wherever it is used).
    fn load_module(
        &mut self,
        opened: Option<File>,
        local: &LocalFile,
        key: &str,
    ) -> (Option<Module>, bool) {
        let refusals_before = self.total.refusals();
        let budget = match (local.owner, self.total_bytes) {
            (Some(uid), Some(bytes)) => self
                .shares
                .entry(uid)
                .or_insert_with(|| self.total.share(bytes / 2)),
            _ => &self.total,
        };
        let account = budget.account();
        let module =
            opened.and_then(|f| Module::open(f, local, &self.debug_dirs, self.deadline, &account));
        let short = self.total.refusals() != refusals_before;
        if short {
            let note = format!(
                "not read whole: the files heapdump read reached \
                 HEAPDUMP_MAX_TOTAL_READ ({} bytes), or the half of it that \
                 one user's processes may take; `snapshot --no-symbolize`, \
                 then `heapdump symbolize`, names its frames later",
                self.total_bytes.unwrap_or(u64::MAX)
            );
            match &module {
                Some(m) => {
                    let _ = m.refused_dwarf.set(note);
                }
                None => {
                    let shown = local
                        .path
                        .as_ref()
                        .map_or(key.to_string(), |p| p.display().to_string());
                    self.refused
                        .insert(key.to_string(), format!("{shown}: {note}"));
                }
            }
        }
        (module, short)
    }

    /// Opens (and caches) the file of every mapping now, so that addresses
    /// can still be symbolized after the target exited, whatever became of
    /// its files.
    pub fn open_modules(&mut self, maps: &[Mapping]) {
        self.begin();
        // What opening says belongs to no snapshot yet: a file's refusal is
        // said again by the snapshot whose frames need it (before, it was
        // left for the next snapshot taken, whichever process that was).
        let notes = self.notes.len();
        for m in maps {
            if let Some(local) = &m.local {
                self.module(local);
            }
        }
        self.notes.truncate(notes);
    }

    /// Forgets every file not behind one of `maps` (the mappings of the
    /// processes a long-running collector still watches): which file a
    /// mapping is, the file's parsed symbols and DWARF (what was read of
    /// it goes back to `HEAPDUMP_MAX_TOTAL_READ`'s total), its refusal
    /// note. Without it a collector's memory grows with every file of
    /// every process it ever saw, a target that used up the total keeps
    /// it after it exited, and a process id used again meets the file its
    /// previous owner mapped at the same place.
    pub fn retain_mapped<'a>(&mut self, maps: impl IntoIterator<Item = &'a Mapping>) {
        let keys = maps::mapped_keys(maps);
        self.opened.retain(|k, _| keys.contains(k));
        self.refused.retain(|k, _| keys.contains(k));
        let kept: std::collections::HashSet<FileIdentity> =
            self.opened.values().flatten().copied().collect();
        self.modules.retain(|id, _| kept.contains(id));
        self.short.retain(|id, _| kept.contains(id));
        if let Some(bytes) = self.total_bytes {
            self.shares
                .retain(|_, share| !share.is_untouched(bytes / 2));
        }
    }

    /// How many distinct files (modules) the cache holds, parsed or not.
    pub fn files_kept(&self) -> usize {
        self.modules.len()
    }

    /// Bytes left of the total read budget (`HEAPDUMP_MAX_TOTAL_READ`).
    pub fn total_left(&self) -> u64 {
        self.total.left()
    }

    /// Frames for the return address `address` (innermost inlined first).
    /// Always returns at least one frame.
    pub fn symbolize(&mut self, address: u64, maps: &[Mapping]) -> Vec<Frame> {
        let base = unsymbolized(address, maps);
        let lookup = address.wrapping_sub(1);
        let Some(m) = maps::find(maps, lookup) else {
            // Not in a mapped file: code a runtime compiled, if its perf
            // map names it.
            let function = self.jit_name(lookup).map(str::to_string);
            return vec![Frame {
                module: function.as_ref().map(|_| "[jit]".to_string()),
                function,
                ..base
            }];
        };
        let Some(local) = m.local.clone() else {
            return vec![base];
        };
        // The deadline covers the lookups too, not only the files opened:
        // a target decides how many distinct addresses its stacks hold.
        if self.past_deadline() {
            return vec![base];
        }
        let Some(module) = self.module(&local) else {
            return vec![base];
        };
        let file_offset = lookup - m.start + m.offset;
        let Some(probe) = module.svma(file_offset) else {
            return vec![base];
        };
        let mut out = module.dwarf_frames(probe, &base);
        if out.iter().all(|f| f.function.is_none()) {
            // No DWARF function: fall back to the symbol table, keeping a
            // line if DWARF had one.
            let (file, line) = out
                .first()
                .map(|f| (f.file.clone(), f.line))
                .unwrap_or((None, None));
            if let Some((start, sym)) = module.symbols.covering(probe) {
                out = vec![Frame {
                    function: Some(addr2line::demangle_auto(sym.into(), None).into_owned()),
                    // The return address's offset (the probe is one less).
                    function_offset: line.is_none().then_some(probe + 1 - start),
                    file,
                    line,
                    ..base.clone()
                }];
            }
        }
        let refused = module.refused_dwarf.get().cloned();
        if let Some(last) = out.last_mut() {
            last.inlined = false;
        } else {
            out.push(base);
        }
        if let Some(why) = refused {
            let note = format!("{}: {why}", m.path);
            if !self.notes.contains(&note) {
                self.notes.push(note);
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn perf_maps_name_jit_code_by_its_extent() {
        let map = "7f00aa001000 40 LazyCompile:*alloc app.js:3\n\
                   7f00aa000000 100 Builtin:Foo\nnot a line\n7f00aa002000 0 empty\n";
        let mut sym = Symbolizer {
            jit: PerfMap::parse(map.as_bytes().to_vec()),
            ..Symbolizer::default()
        };
        assert_eq!(sym.jit.len(), 2);
        assert_eq!(
            sym.jit_name(0x7f00aa001010),
            Some("LazyCompile:*alloc app.js:3")
        );
        assert_eq!(sym.jit_name(0x7f00aa0000ff), Some("Builtin:Foo"));
        assert_eq!(sym.jit_name(0x7f00aa001040), None);
        assert_eq!(sym.jit_name(0x7f00a9ffffff), None);
        let f = sym.symbolize(0x7f00aa001011, &[]);
        assert_eq!(
            f[0].function.as_deref(),
            Some("LazyCompile:*alloc app.js:3")
        );
        assert_eq!(f[0].module.as_deref(), Some("[jit]"));
    }

    #[inline(never)]
    fn named_here() -> u64 {
        std::hint::black_box(named_here as *const () as u64)
    }

    #[test]
    fn past_the_deadline_addresses_in_files_already_open_are_left_unnamed() {
        let maps = crate::symbolization::maps::read_maps(
            std::process::id(),
            &mut crate::symbolization::maps::BuildIds::default(),
        )
        .unwrap();
        let here = named_here() + 1; // a return address inside it
        let mut sym = Symbolizer::new();
        sym.begin();
        let f = sym.symbolize(here, &maps);
        assert!(
            f.iter().any(|f| f
                .function
                .as_deref()
                .is_some_and(|n| n.contains("named_here"))),
            "{f:?}"
        );
        assert!(sym.take_notes().is_empty());
        // The file is open and cached now; the deadline passes.
        sym.deadline = Some(Instant::now() - Duration::from_secs(1));
        let f = sym.symbolize(here, &maps);
        assert_eq!((f.len(), f[0].function.as_deref()), (1, None), "{f:?}");
        assert!(f[0].module.is_some());
        let notes = sym.take_notes();
        assert!(notes[0].contains("HEAPDUMP_SYMBOLIZE_TIMEOUT"), "{notes:?}");
    }

    #[test]
    fn files_no_longer_mapped_are_forgotten_and_their_reads_given_back() {
        let maps = crate::symbolization::maps::read_maps(
            std::process::id(),
            &mut crate::symbolization::maps::BuildIds::default(),
        )
        .unwrap();
        let here = named_here() + 1;
        let mut sym = Symbolizer::new();
        let start = sym.total_left();
        sym.begin();
        let named = |f: &[Frame]| {
            f.iter().any(|f| {
                f.function
                    .as_deref()
                    .is_some_and(|n| n.contains("named_here"))
            })
        };
        assert!(named(&sym.symbolize(here, &maps)));
        let read = start - sym.total_left();
        assert!(read > 0 && sym.files_kept() > 0);
        // Still mapped: kept, nothing given back.
        sym.retain_mapped(&maps);
        assert_eq!(
            (start - sym.total_left(), sym.files_kept() > 0),
            (read, true)
        );
        // Only the other files mapped: the test binary's module goes, and
        // what was read of it comes back.
        let own = maps::find(&maps, here - 1).unwrap().path.clone();
        let others: Vec<&Mapping> = maps.iter().filter(|m| m.path != own).collect();
        sym.retain_mapped(others);
        assert!(start - sym.total_left() < read);
        // Nothing mapped: everything forgotten, the whole total back.
        sym.retain_mapped(&[]);
        assert_eq!((sym.total_left(), sym.files_kept()), (start, 0));
        assert!(sym.opened.is_empty());
        // And read again when asked again.
        assert!(named(&sym.symbolize(here, &maps)));
        assert_eq!(start - sym.total_left(), read);
    }

    #[test]
    fn debug_files_are_looked_up_by_build_id_only_for_plausible_ids() {
        let dir = std::env::temp_dir().join(format!("heapdump-debugdir-{}", std::process::id()));
        let place = dir.join(".build-id").join("ab");
        std::fs::create_dir_all(&place).unwrap();
        std::fs::write(place.join("cdef01.debug"), b"x").unwrap();
        let dirs = [PathBuf::from("/nonexistent"), dir.clone()];
        let root = TargetRoot::own().unwrap();
        assert_eq!(
            find_debug_file("abcdef01", &dirs, &root),
            Some(place.join("cdef01.debug"))
        );
        assert_eq!(find_debug_file("abcdef02", &dirs, &root), None);
        // Not a build ID: never turned into a path.
        assert_eq!(find_debug_file("ab", &dirs, &root), None);
        assert_eq!(find_debug_file("../../etc", &dirs, &root), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn debuglinks_are_found_where_gdb_looks_and_only_with_their_crc() {
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
        let own = Arc::new(TargetRoot::own().unwrap());
        let file = LocalFile::own(exe.clone(), own.clone());
        let find = |name: &[u8], crc| {
            find_debuglink(&file, name, crc, &dirs, &own, None, &TotalBudget::default())
                .map(|(p, _)| p)
        };
        // Under a debug root, following the file's own directory.
        std::fs::write(under_root.join("app.debug"), content).unwrap();
        assert_eq!(find(b"app.debug", crc), Some(under_root.join("app.debug")));
        // `.debug/` next to the file comes before it, the file's own
        // directory first of all; a FIFO there is passed over, not
        // waited on.
        let fifo = std::ffi::CString::new(bin_dir.join("app.debug").to_str().unwrap()).unwrap();
        // SAFETY: a valid path string.
        assert_eq!(unsafe { libc::mkfifo(fifo.as_ptr(), 0o600) }, 0);
        std::fs::write(bin_dir.join(".debug/app.debug"), content).unwrap();
        assert_eq!(
            find(b"app.debug", crc),
            Some(bin_dir.join(".debug/app.debug"))
        );
        std::fs::remove_file(bin_dir.join("app.debug")).unwrap();
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
        let crc_of_exe = crc32_of(&File::open(&exe).unwrap(), None).unwrap();
        assert_eq!(find(b"app", crc_of_exe), None);
        std::fs::remove_dir_all(&base).unwrap();
    }
}
