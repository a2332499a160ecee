//! What the preload agent can see in a program, told from its ELF files
//! before it starts (`heapdump run`) or while it runs (`list`, snapshots).
//!
//! The agent sees an allocation only when it goes through the `malloc`
//! family or C++ `new`/`delete` as the dynamic linker resolves them. It sees
//! nothing, or only a part, when:
//! - the executable is static (no `PT_INTERP`): `LD_PRELOAD` is ignored;
//! - the executable exports its own `malloc`: it comes before any preload
//!   in the lookup order, so the program's calls never reach the agent;
//! - an allocator is linked statically under its own names (a Rust
//!   program with `tikv-jemallocator` or `mimalloc`, a C program calling
//!   `je_malloc`, `mi_malloc`, `tc_malloc`): those calls bypass `malloc`;
//! - a library preloaded before the agent defines `malloc` (the agent says
//!   so itself on stderr; here it is read from `/proc/PID/environ`).
//!
//! Invariant: every check reads files only (bounded by what `object`
//! parses and a fixed depth of `DT_NEEDED` resolution); nothing is
//! executed, and an unreadable file yields no finding rather than an error.

use std::collections::HashSet;
use std::path::{Path, PathBuf};

use object::read::elf::{Dyn, ElfFile64, FileHeader, ProgramHeader};

use super::target_files::{self, BoundedFile};
use super::user_space_mounts::UserSpaceMounts;
use object::{Object, ObjectSymbol};

/// One reason the agent may miss a program's allocations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum BlindSpot {
    /// The executable is statically linked: `LD_PRELOAD` is ignored.
    StaticExecutable,
    /// The executable exports its own `malloc`.
    ExecutableDefinesMalloc,
    /// An allocator linked into the executable under its own names.
    StaticAllocator(&'static str),
    /// A library before the agent in `LD_PRELOAD` (running process).
    PreloadedBefore(String),
}

impl std::fmt::Display for BlindSpot {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            BlindSpot::StaticExecutable => write!(
                f,
                "the program is statically linked, so LD_PRELOAD is ignored and the agent is \
                 never loaded"
            ),
            BlindSpot::ExecutableDefinesMalloc => write!(
                f,
                "the program defines malloc itself (a statically linked allocator), which comes \
                 before the agent: its allocations are not seen"
            ),
            BlindSpot::StaticAllocator(name) => write!(
                f,
                "the program has {name} linked in statically under its own names: allocations \
                 made through it are not seen, only those through malloc"
            ),
            BlindSpot::PreloadedBefore(lib) => write!(
                f,
                "{lib} comes before libheapdump_preload.so in LD_PRELOAD: put the agent first"
            ),
        }
    }
}

/// What was found about an executable.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ProgramInfo {
    /// Reasons allocations may be missed.
    pub blind_spots: Vec<BlindSpot>,
    /// The program or one of its libraries links `libjemalloc`.
    pub links_jemalloc: bool,
}

impl ProgramInfo {
    /// The blind spots in words, one each.
    pub fn described(&self) -> Vec<String> {
        self.blind_spots.iter().map(ToString::to_string).collect()
    }
}

/// Symbols by which a statically linked allocator is recognised, and its
/// name.
const ALLOCATOR_SYMBOLS: &[(&str, &str)] = &[
    ("_rjem_malloc", "jemalloc (tikv-jemallocator)"),
    ("_rjem_mallocx", "jemalloc (tikv-jemallocator)"),
    ("je_malloc", "jemalloc"),
    ("mi_malloc", "mimalloc"),
    ("tc_malloc", "tcmalloc"),
    ("snmalloc_malloc", "snmalloc"),
];

/// Inspects the executable at `path` (and, for jemalloc, the libraries it
/// needs, found as the dynamic linker would in the usual places).
pub fn inspect_program(path: &Path) -> ProgramInfo {
    inspect_elf(path, true, &UserSpaceMounts::none())
}

/// Inspects the executable at `path`; follows its `DT_NEEDED` libraries
/// (in heapdump's own root) only when `follow_needed` (a program about to
/// be started, not a running target, whose mapped libraries say more and
/// whose search paths are its own to choose).
fn inspect_elf(path: &Path, follow_needed: bool, mounts: &UserSpaceMounts) -> ProgramInfo {
    let mut info = ProgramInfo::default();
    let Some(data) = map_file(path, mounts) else {
        return info;
    };
    let Ok(elf) = ElfFile64::<object::Endianness, _>::parse(&data) else {
        return info;
    };
    let endian = elf.endian();
    let has_interp = elf
        .elf_program_headers()
        .iter()
        .any(|ph| ph.p_type(endian) == object::elf::PT_INTERP);
    if !has_interp && elf.elf_header().e_type(endian) == object::elf::ET_EXEC {
        info.blind_spots.push(BlindSpot::StaticExecutable);
        return info;
    }
    if !has_interp && elf.dynamic_symbols().next().is_none() {
        // A static-pie executable: no interpreter, no dynamic symbols.
        info.blind_spots.push(BlindSpot::StaticExecutable);
        return info;
    }
    if elf
        .dynamic_symbols()
        .any(|s| s.is_definition() && s.name() == Ok("malloc"))
    {
        info.blind_spots.push(BlindSpot::ExecutableDefinesMalloc);
    }
    let mut seen = HashSet::new();
    for s in elf.symbols().chain(elf.dynamic_symbols()) {
        if !s.is_definition() {
            continue;
        }
        let Ok(name) = s.name() else { continue };
        if let Some((_, alloc)) = ALLOCATOR_SYMBOLS.iter().find(|(n, _)| *n == name) {
            if seen.insert(*alloc) {
                info.blind_spots.push(BlindSpot::StaticAllocator(alloc));
            }
        }
    }
    if follow_needed {
        info.links_jemalloc = needs_library(path, &data, "libjemalloc.so");
    }
    info
}

/// Inspects a running process: its executable, the libraries it has
/// mapped, and its `LD_PRELOAD`.
pub fn inspect_process(pid: u32) -> ProgramInfo {
    let exe = PathBuf::from(format!("/proc/{pid}/exe"));
    let mut info = inspect_elf(&exe, false, &UserSpaceMounts::of_process(pid));
    // The library's code mapping; the walk stops at it.
    let code = super::mappings::Wanted {
        file_backed: true,
        executable: true,
        ..Default::default()
    };
    let _ = super::mappings::for_each(pid, code, |l| {
        if l.path.contains("/libjemalloc.so") {
            info.links_jemalloc = true;
            std::ops::ControlFlow::Break(())
        } else {
            std::ops::ControlFlow::Continue(())
        }
    });
    if let Ok(env) = std::fs::read(format!("/proc/{pid}/environ")) {
        if let Some(first) = preloaded_before_agent(&env) {
            info.blind_spots.push(BlindSpot::PreloadedBefore(first));
        }
    }
    info
}

/// The first `LD_PRELOAD` entry of an environment block (NUL-separated
/// `NAME=value` pairs) when it comes before `libheapdump_preload.so`.
fn preloaded_before_agent(environ: &[u8]) -> Option<String> {
    let value = environ
        .split(|b| *b == 0)
        .find_map(|kv| kv.strip_prefix(b"LD_PRELOAD="))?;
    let value = String::from_utf8_lossy(value);
    let entries: Vec<&str> = value.split([':', ' ']).filter(|e| !e.is_empty()).collect();
    let ours = entries
        .iter()
        .position(|e| e.ends_with(crate::commands::run::PRELOAD_NAME))?;
    (ours > 0).then(|| entries[0].to_string())
}

/// Library directories searched after `DT_RUNPATH` / `DT_RPATH` and
/// `LD_LIBRARY_PATH` (Debian's multiarch layout first).
const SYSTEM_DIRS: &[&str] = &[
    "/lib/x86_64-linux-gnu",
    "/usr/lib/x86_64-linux-gnu",
    "/lib/aarch64-linux-gnu",
    "/usr/lib/aarch64-linux-gnu",
    "/lib64",
    "/usr/lib64",
    "/lib",
    "/usr/lib",
    "/usr/local/lib",
];

/// How many levels of `DT_NEEDED` are followed, and how many files read.
const MAX_DEPTH: usize = 4;
const MAX_FILES: usize = 200;

/// True when the object in `data` (at `path`) or a library it needs,
/// transitively, has a `DT_NEEDED` entry starting with `prefix`.
fn needs_library(path: &Path, data: &BoundedFile, prefix: &str) -> bool {
    let mut queue: Vec<(PathBuf, Option<BoundedFile>, usize)> = vec![(path.to_path_buf(), None, 0)];
    let mut visited = HashSet::new();
    while let Some((path, mapped, depth)) = queue.pop() {
        let data: &BoundedFile = match &mapped {
            None => data,
            Some(m) => m,
        };
        let Some((needed, search)) = dynamic_entries(&path, data) else {
            continue;
        };
        if needed.iter().any(|n| n.starts_with(prefix)) {
            return true;
        }
        if depth >= MAX_DEPTH {
            continue;
        }
        for name in needed {
            if !visited.insert(name.clone()) || visited.len() > MAX_FILES {
                continue;
            }
            if let Some(found) = find_library(&name, &search) {
                if let Some(m) = map_file(&found, &UserSpaceMounts::none()) {
                    queue.push((found, Some(m), depth + 1));
                }
            }
        }
    }
    false
}

/// `DT_NEEDED` names and the directories to search for them
/// (`DT_RUNPATH` or `DT_RPATH` with `$ORIGIN` expanded, then
/// `LD_LIBRARY_PATH`).
fn dynamic_entries(path: &Path, data: &BoundedFile) -> Option<(Vec<String>, Vec<PathBuf>)> {
    let elf = ElfFile64::<object::Endianness, _>::parse(data).ok()?;
    let endian = elf.endian();
    let header = elf.elf_header();
    let sections = header.sections(endian, data).ok()?;
    let (dynamic, link) = sections.dynamic(endian, data).ok()??;
    let strings = sections.strings(endian, data, link).ok()?;
    let origin = path
        .canonicalize()
        .ok()
        .and_then(|p| p.parent().map(Path::to_path_buf))
        .unwrap_or_default();
    let mut needed = Vec::new();
    let mut search = Vec::new();
    for d in dynamic {
        let Some(tag) = d.tag32(endian) else { continue };
        if !matches!(
            tag,
            object::elf::DT_NEEDED | object::elf::DT_RUNPATH | object::elf::DT_RPATH
        ) {
            continue;
        }
        let offset: u64 = d.d_val(endian);
        let Some(value) = u32::try_from(offset).ok().and_then(|o| strings.get(o).ok()) else {
            continue;
        };
        let value = String::from_utf8_lossy(value).into_owned();
        if tag == object::elf::DT_NEEDED {
            needed.push(value);
        } else {
            for dir in value.split(':') {
                let dir = dir.replace("$ORIGIN", &origin.to_string_lossy());
                search.push(PathBuf::from(dir));
            }
        }
    }
    if let Some(lp) = std::env::var_os("LD_LIBRARY_PATH") {
        search.extend(std::env::split_paths(&lp));
    }
    Some((needed, search))
}

fn find_library(name: &str, search: &[PathBuf]) -> Option<PathBuf> {
    if name.contains('/') {
        let p = PathBuf::from(name);
        return p.is_file().then_some(p);
    }
    search
        .iter()
        .cloned()
        .chain(SYSTEM_DIRS.iter().map(PathBuf::from))
        .map(|d| d.join(name))
        .find(|p| p.is_file())
}

/// The file at `path` (a regular file only, never waited on), read on
/// demand into private memory within the read budget of a target's file:
/// a target may truncate its executable while it is read, which a mapping
/// would turn into SIGBUS.
fn map_file(path: &Path, mounts: &UserSpaceMounts) -> Option<BoundedFile> {
    let f = target_files::open_regular(path, mounts).ok()?;
    BoundedFile::new(f, target_files::max_file_read()).ok()
}

/// Finds `prog` as `execvp` would: a path with a slash as is, else the
/// first executable file of that name in `PATH`.
pub fn resolve_program(prog: &str) -> Option<PathBuf> {
    if prog.contains('/') {
        return Some(PathBuf::from(prog));
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|d| d.join(prog))
        .find(|p| p.is_file())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_ld_preload_entry_before_the_agent_is_named() {
        let env = b"A=1\0LD_PRELOAD=/x/libmimalloc.so:/t/libheapdump_preload.so\0B=2\0";
        assert_eq!(
            preloaded_before_agent(env),
            Some("/x/libmimalloc.so".to_string())
        );
        let env = b"LD_PRELOAD=/t/libheapdump_preload.so /x/libmimalloc.so\0";
        assert_eq!(preloaded_before_agent(env), None);
        assert_eq!(preloaded_before_agent(b"PATH=/bin\0"), None);
    }

    #[test]
    fn this_test_binary_is_dynamic_and_links_no_jemalloc() {
        let me = std::env::current_exe().unwrap();
        let info = inspect_program(&me);
        assert!(!info.links_jemalloc);
        assert!(
            !info.blind_spots.contains(&BlindSpot::StaticExecutable),
            "{info:?}"
        );
    }
}
