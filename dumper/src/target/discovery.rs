//! Finding instrumented processes and opening their regions.
//!
//! An instrumented process has two memfds whose `/proc/PID/fd` links read
//! `/memfd:heapdump.resources (deleted)` and
//! `/memfd:heapdump.allocations (deleted)`. Opening `/proc/PID/fd/N` needs
//! the same permission as reading the process's memory (ptrace access mode
//! "read"), so the regions are exactly as private as the process.
//!
//! After `fork`, a child briefly holds its parent's regions: only regions
//! whose header names the inspected pid as writer are trusted.

use std::collections::HashMap;
use std::fs;
use std::io;
use std::path::PathBuf;

use heapdump_table::{AllocationsReader, Counters, RegionKind, RegionReader, TableError};

/// An instrumented process with both regions mapped read-only.
///
/// The mappings stay valid after the process exits (even by SIGKILL), so a
/// `Target` can still be snapshotted then: the live set at death.
#[derive(Debug)]
pub struct Target {
    /// Process id.
    pub pid: u32,
    /// Process name (`/proc/PID/comm`) when opened.
    pub name: String,
    /// Command line when opened (may be empty).
    pub cmdline: Vec<String>,
    /// Start time of the process (`/proc/PID/stat`, clock ticks after
    /// boot) when opened: tells the same process from a later one that
    /// reused its pid.
    pub start_time: Option<u64>,
    /// The resources region (stacks, threads).
    pub resources: RegionReader,
    /// The allocations region (live blocks, counters, requests).
    pub allocations: RegionReader,
    /// What the agent cannot see in this program, read from its files
    /// once (see [`Target::blind_spots`]).
    blind_spots: std::sync::OnceLock<Vec<String>>,
}

impl Target {
    /// What the agent cannot see in this program, in words
    /// ([`crate::target::visibility`]): read from its files at the first
    /// call (while it runs) and kept, so that repeated snapshots (watch,
    /// top, serve) do not read them again, and a final snapshot after it
    /// exited still says it.
    pub fn blind_spots(&self) -> &[String] {
        self.blind_spots
            .get_or_init(|| crate::target::visibility::inspect_process(self.pid).described())
    }

    /// The process-wide counters in the allocations header.
    pub fn counters(&self) -> Result<Counters, TableError> {
        Ok(AllocationsReader::new(&self.allocations)?.counters())
    }

    /// The current names of the target's live threads (`/proc/PID/task/TID/comm`)
    /// by tid, or `None` when the process is gone (or its pid now belongs
    /// to another process) or cannot be read. A thread renamed after it
    /// last allocated shows under its current name this way.
    pub fn live_thread_names(&self) -> Option<HashMap<u64, String>> {
        let started = self.start_time?;
        if start_time(self.pid) != Some(started) {
            return None;
        }
        let mut names = HashMap::new();
        for e in fs::read_dir(format!("/proc/{}/task", self.pid))
            .ok()?
            .flatten()
        {
            let Some(tid) = e.file_name().to_str().and_then(|t| t.parse::<u64>().ok()) else {
                continue;
            };
            if let Ok(n) = fs::read_to_string(e.path().join("comm")) {
                names.insert(tid, n.trim_end_matches('\n').to_string());
            }
        }
        // Still the same process after reading: the names are its own.
        (start_time(self.pid) == Some(started)).then_some(names)
    }
}

/// Start time of `pid` (field 22 of `/proc/PID/stat`), if it runs.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_start_time(&fs::read_to_string(format!("/proc/{pid}/stat")).ok()?)
}

/// Field 22 (start time) of a `/proc/PID/stat` line.
fn stat_start_time(stat: &str) -> Option<u64> {
    // The name (field 2) may hold spaces and parentheses: count fields
    // after its closing parenthesis, the last one in the line.
    let rest = &stat[stat.rfind(')')? + 1..];
    rest.split_ascii_whitespace().nth(19)?.parse().ok()
}

/// Why a process could not be opened.
#[derive(Debug, thiserror::Error)]
pub enum DiscoveryError {
    /// No process with this pid.
    #[error(
        "no such process: {pid} (it is not running; `heapdump list` shows instrumented processes)"
    )]
    NoSuchProcess {
        /// The pid asked for.
        pid: u32,
    },
    /// `/proc/PID/fd` or a region could not be opened.
    #[error(
        "permission denied inspecting process {pid}: reading its heap regions needs the same \
         access as a debugger (ptrace). Run heapdump as the same user as the target (with \
         /proc/sys/kernel/yama/ptrace_scope at 0 or 1), or as root / with CAP_SYS_PTRACE"
    )]
    PermissionDenied {
        /// The pid asked for.
        pid: u32,
    },
    /// The process has no heapdump regions.
    #[error(
        "process {pid} ({name}) is not instrumented by heapdump: it has no heapdump.allocations \
         memfd. Start it with `heapdump run -- CMD`, with LD_PRELOAD=libheapdump_preload.so, or \
         build it with the heapdump_agent::Agent global allocator (the agent creates its regions \
         on the first allocation)"
    )]
    NotInstrumented {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
    },
    /// Only regions inherited over `fork` from another process are present.
    #[error(
        "process {pid} ({name}) holds heapdump regions inherited from parent pid {parent}, and \
         has no own regions yet (it has not allocated since fork); try again in a moment, or \
         snapshot pid {parent}"
    )]
    InheritedOnly {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
        /// Writer pid found in the inherited regions.
        parent: u32,
    },
    /// Only one of the two regions exists.
    #[error(
        "process {pid} ({name}) has a heapdump {have} region but no {missing} region; the agent \
         may still be starting up, try again in a moment"
    )]
    Incomplete {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
        /// The region found.
        have: &'static str,
        /// The region missing.
        missing: &'static str,
    },
    /// A region was found but cannot be used.
    #[error("process {pid} ({name}): cannot use its {kind} region: {source}{hint}")]
    Region {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
        /// `resources` or `allocations`.
        kind: &'static str,
        /// The table crate's diagnosis.
        #[source]
        source: TableError,
        /// What to do about it.
        hint: &'static str,
    },
    /// Another I/O error reading `/proc`.
    #[error("reading /proc/{pid}/fd: {source}")]
    Io {
        /// The pid asked for.
        pid: u32,
        /// The error.
        #[source]
        source: io::Error,
    },
}

fn kind_name(kind: RegionKind) -> &'static str {
    match kind {
        RegionKind::Resources => "resources",
        RegionKind::Allocations => "allocations",
    }
}

/// The process name from `/proc/PID/comm`, or `?`.
pub fn process_name(pid: u32) -> String {
    fs::read_to_string(format!("/proc/{pid}/comm"))
        .map(|s| s.trim_end().to_string())
        .unwrap_or_else(|_| "?".to_string())
}

/// The command line from `/proc/PID/cmdline` (empty if unreadable).
pub fn cmdline(pid: u32) -> Vec<String> {
    fs::read(format!("/proc/{pid}/cmdline"))
        .map(|b| {
            b.split(|c| *c == 0)
                .filter(|s| !s.is_empty())
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
        .unwrap_or_default()
}

/// Number of live threads (`/proc/PID/task` entries), if readable.
pub fn live_threads(pid: u32) -> Option<usize> {
    fs::read_dir(format!("/proc/{pid}/task"))
        .ok()
        .map(|d| d.count())
}

/// The heapdump memfd links of `pid`: `(path under /proc/PID/fd, kind)`.
pub fn region_links(pid: u32) -> Result<Vec<(PathBuf, RegionKind)>, DiscoveryError> {
    let dir = PathBuf::from(format!("/proc/{pid}/fd"));
    let entries = match fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) => {
            return Err(match e.kind() {
                io::ErrorKind::NotFound => DiscoveryError::NoSuchProcess { pid },
                io::ErrorKind::PermissionDenied => DiscoveryError::PermissionDenied { pid },
                _ => DiscoveryError::Io { pid, source: e },
            })
        }
    };
    let mut out = Vec::new();
    for entry in entries.flatten() {
        // A descriptor may close between readdir and readlink: skip it.
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        if let Some(kind) = target.to_str().and_then(RegionKind::from_link_target) {
            out.push((entry.path(), kind));
        }
    }
    Ok(out)
}

fn region_error(pid: u32, name: &str, kind: RegionKind, e: TableError) -> DiscoveryError {
    if let TableError::Io { source, .. } = &e {
        if source.kind() == io::ErrorKind::PermissionDenied {
            return DiscoveryError::PermissionDenied { pid };
        }
        if source.kind() == io::ErrorKind::NotFound {
            return DiscoveryError::NoSuchProcess { pid };
        }
    }
    let hint = match &e {
        TableError::Unsealed { .. } => {
            " (a heapdump agent always seals its regions against shrinking; an unsealed one \
             could make the dumper crash, so it is refused: is the target running a modified \
             or foreign agent?)"
        }
        TableError::VersionMismatch { .. } => "",
        TableError::BadMagic
        | TableError::CorruptHeader(_)
        | TableError::Truncated { .. }
        | TableError::WrongKind { .. } => {
            " (the region is corrupted: the target may have overwritten it; restart the target \
             to get a fresh one)"
        }
        _ => "",
    };
    DiscoveryError::Region {
        pid,
        name: name.to_string(),
        kind: kind_name(kind),
        source: e,
        hint,
    }
}

/// Opens both regions of `pid`, validated, read-only.
pub fn open_target(pid: u32) -> Result<Target, DiscoveryError> {
    let links = region_links(pid)?;
    let name = process_name(pid);
    if links.is_empty() {
        return Err(DiscoveryError::NotInstrumented { pid, name });
    }
    let mut resources = None;
    let mut allocations = None;
    let mut first_err = None;
    let mut inherited = None;
    for (path, kind) in links {
        match RegionReader::open(&path, kind) {
            Ok(r) if r.header().writer_pid == pid => match kind {
                RegionKind::Resources => resources = Some(r),
                RegionKind::Allocations => allocations = Some(r),
            },
            Ok(r) => inherited = Some(r.header().writer_pid),
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(region_error(pid, &name, kind, e));
                }
            }
        }
    }
    match (resources, allocations) {
        (Some(resources), Some(allocations)) => Ok(Target {
            pid,
            cmdline: cmdline(pid),
            start_time: start_time(pid),
            name,
            resources,
            allocations,
            blind_spots: std::sync::OnceLock::new(),
        }),
        _ if first_err.is_some() => Err(first_err.expect("checked")),
        (None, None) => match inherited {
            Some(parent) => Err(DiscoveryError::InheritedOnly { pid, name, parent }),
            None => Err(DiscoveryError::NotInstrumented { pid, name }),
        },
        (Some(_), None) => Err(DiscoveryError::Incomplete {
            pid,
            name,
            have: "resources",
            missing: "allocations",
        }),
        (None, Some(_)) => Err(DiscoveryError::Incomplete {
            pid,
            name,
            have: "allocations",
            missing: "resources",
        }),
    }
}

/// One row of `heapdump list`.
#[derive(Debug)]
pub struct ListEntry {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub name: String,
    /// Counters and live thread count, or why the process cannot be read.
    pub state: Result<(Counters, Option<usize>), DiscoveryError>,
}

/// Scans `/proc` for processes holding heapdump regions. Returns the
/// entries (sorted by pid) and how many processes could not be inspected
/// for lack of permission.
pub fn scan() -> (Vec<ListEntry>, usize) {
    let me = std::process::id();
    let mut out = Vec::new();
    let mut denied = 0;
    let Ok(dir) = fs::read_dir("/proc") else {
        return (out, 0);
    };
    let mut pids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .collect();
    pids.sort_unstable();
    for pid in pids {
        if pid == me {
            continue;
        }
        match region_links(pid) {
            Err(DiscoveryError::PermissionDenied { .. }) => denied += 1,
            Err(_) => {}
            Ok(links) if links.is_empty() => {}
            Ok(_) => {
                let name = process_name(pid);
                let state = open_target(pid).and_then(|t| {
                    let c = t.counters().map_err(|e| DiscoveryError::Region {
                        pid,
                        name: name.clone(),
                        kind: "allocations",
                        source: e,
                        hint: "",
                    })?;
                    Ok((c, live_threads(pid)))
                });
                out.push(ListEntry { pid, name, state });
            }
        }
    }
    (out, denied)
}

/// Pids of every process whose own regions can be opened.
pub fn instrumented_pids() -> Vec<u32> {
    scan()
        .0
        .into_iter()
        .filter(|e| e.state.is_ok())
        .map(|e| e.pid)
        .collect()
}

/// The pid `spec` names: a number, or the name of exactly one instrumented
/// process (its name, or its executable's file name from the command line;
/// names are cut to 15 bytes by the kernel, so both are tried).
pub fn resolve_target(spec: &str) -> Result<u32, String> {
    if let Ok(pid) = spec.parse::<u32>() {
        return Ok(pid);
    }
    let candidates: Vec<(u32, Vec<String>)> = scan()
        .0
        .into_iter()
        .filter(|e| e.state.is_ok())
        .map(|e| {
            let mut names = vec![e.name];
            if let Some(arg0) = cmdline(e.pid).into_iter().next() {
                names.push(arg0.rsplit('/').next().unwrap_or(&arg0).to_string());
            }
            (e.pid, names)
        })
        .collect();
    pick_by_name(spec, &candidates)
}

/// The one pid among `candidates` (pid, names) that has the name `spec`.
fn pick_by_name(spec: &str, candidates: &[(u32, Vec<String>)]) -> Result<u32, String> {
    let found: Vec<u32> = candidates
        .iter()
        .filter(|(_, names)| names.iter().any(|n| n == spec))
        .map(|(pid, _)| *pid)
        .collect();
    match found.as_slice() {
        [one] => Ok(*one),
        [] => Err(format!(
            "no instrumented process is named {spec:?} (`heapdump list` shows them; \
             a pid works too)"
        )),
        many => Err(format!(
            "{} instrumented processes are named {spec:?} (pids {}): give one pid",
            many.len(),
            many.iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_target_is_picked_by_its_name_or_its_program_only_when_unique() {
        let c = |pid, names: &[&str]| (pid, names.iter().map(|n| n.to_string()).collect());
        let all = vec![
            c(10, &["api-server", "api-server"]),
            c(11, &["worker", "python3"]),
            c(12, &["worker", "python3"]),
            c(13, &["very-long-name-", "very-long-name-of-a-daemon"]),
        ];
        assert_eq!(pick_by_name("api-server", &all), Ok(10));
        assert_eq!(pick_by_name("very-long-name-of-a-daemon", &all), Ok(13));
        let e = pick_by_name("worker", &all).unwrap_err();
        assert!(
            e.contains("2 instrumented processes") && e.contains("11, 12"),
            "{e}"
        );
        let e = pick_by_name("nginx", &all).unwrap_err();
        assert!(e.contains("no instrumented process is named"), "{e}");
        assert_eq!(resolve_target("4242"), Ok(4242));
    }

    #[test]
    fn start_time_is_field_22_even_when_the_name_has_spaces_and_parentheses() {
        let stat =
            "4242 (a (b) c) S 1 4242 4242 0 -1 4194560 100 0 0 0 1 2 0 0 20 0 1 0 987654 1234 56";
        assert_eq!(stat_start_time(stat), Some(987_654));
        assert_eq!(stat_start_time("4242 (x"), None);
        assert_eq!(stat_start_time("4242 (x) S 1"), None);
        // This process: readable and stable.
        let me = std::process::id();
        assert!(start_time(me).is_some());
        assert_eq!(start_time(me), start_time(me));
    }
}
