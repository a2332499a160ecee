//! Finding instrumented processes and opening their regions.
//!
//! An instrumented process is one that maps a heapdump region *writable
//! and shared*: `/proc/PID/maps` shows `rw-s ... /memfd:heapdump.allocations
//! (deleted)` (and `heapdump.resources`). A dumper maps regions read-only
//! (`r--s`), so a running `heapdump watch` or `serve`, which keeps other
//! processes' regions open, is never taken for an instrumented process.
//!
//! Each region is opened through its mapping, `/proc/PID/map_files/START-END`,
//! where the kernel allows it: with `CAP_CHECKPOINT_RESTORE` (or
//! `CAP_SYS_ADMIN`: root, or a collector given that capability) and the
//! right to read the process's memory (ptrace access mode "read"). Else
//! through the descriptor that still names it (`/proc/PID/fd/N`, matched
//! to the mapping by inode): that needs the right to read the process's
//! memory too, so either way the regions are exactly as private as the
//! process. Root never reads the descriptors: a target holding half a
//! million would make every scan read half a million links. A daemon may
//! have closed every descriptor (`close_range`, daemonizing): without the
//! capability, such a process is still listed, and the error says what is
//! needed.
//!
//! After `fork`, a child briefly maps its parent's regions: only regions
//! whose header names the inspected pid as writer are trusted. The agent
//! writes the pid its process has in its own pid namespace (`getpid`): a
//! process in a container is `N` on the host and, say, `1` inside, so the
//! writer may be either (`NSpid` of `/proc/PID/status`, which the kernel
//! writes). Where both an inherited pair and the process's own match (an
//! inner pid equal to a parent's outer one), the later-made region wins.

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
    /// ([`crate::process::visibility`]): read from its files at the first
    /// call (while it runs) and kept, so that repeated snapshots (watch,
    /// top, serve) do not read them again, and a final snapshot after it
    /// exited still says it.
    pub fn blind_spots(&self) -> &[String] {
        self.blind_spots
            .get_or_init(|| crate::process::visibility::inspect_process(self.pid).described())
    }

    /// Whether process `pid`, the same process (its start time unchanged),
    /// no longer maps the allocations region it was opened with: it
    /// executed another program (`exec`), whose regions, if the agent is
    /// loaded there too, are new ones; what was opened is the program it
    /// ran before. False while it still maps it, and when that cannot be
    /// told (the process exited or is exiting, or its pid is another's
    /// now: see [`crate::commands::watch::ExitWatch`] and `start_time`).
    ///
    /// One walk of its shared writable file mappings (the kernel filters
    /// them where it can, see [`super::mappings`]): cheap enough for a
    /// watch to ask once per scan.
    pub fn replaced(&self) -> bool {
        let Some(inode) = fstat_inode(self.allocations.raw_fd()) else {
            return false;
        };
        let wanted = super::mappings::Wanted {
            file_backed: true,
            writable: true,
            shared: true,
            ..Default::default()
        };
        let mut mapped = false;
        let walked = super::mappings::for_each(self.pid, wanted, |l| {
            mapped = l.inode == inode
                && region_mapping(l).is_some_and(|m| m.kind == RegionKind::Allocations);
            if mapped {
                std::ops::ControlFlow::Break(())
            } else {
                std::ops::ControlFlow::Continue(())
            }
        });
        if walked.is_err() || mapped {
            return false;
        }
        // A process being killed releases its memory before it becomes a
        // zombie: in between its maps read empty, which is not an exec (a
        // new program maps its executable before it runs a line).
        let program = super::mappings::Wanted {
            executable: true,
            ..Default::default()
        };
        let mut runs_a_program = false;
        let walked = super::mappings::for_each(self.pid, program, |_| {
            runs_a_program = true;
            std::ops::ControlFlow::Break(())
        });
        walked.is_ok() && runs_a_program && start_time(self.pid) == self.start_time
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
            if let Ok(n) = crate::process::proc_text::read(e.path().join("comm")) {
                names.insert(tid, n.trim_end_matches('\n').to_string());
            }
        }
        // Still the same process after reading: the names are its own.
        (start_time(self.pid) == Some(started)).then_some(names)
    }
}

/// The pid process `pid` has in its own pid namespace, the last of the
/// `NSpid` line of `/proc/PID/status` (written by the kernel; a name with
/// a newline is escaped there); `None` where the line is missing (before
/// Linux 4.1) or unreadable.
pub fn namespace_pid(pid: u32) -> Option<u32> {
    let status = crate::process::proc_text::read(format!("/proc/{pid}/status")).ok()?;
    parse_namespace_pid(&status)
}

/// The last pid of the `NSpid:` line of a `/proc/PID/status` text.
fn parse_namespace_pid(status: &str) -> Option<u32> {
    status
        .lines()
        .find_map(|l| l.strip_prefix("NSpid:"))?
        .split_whitespace()
        .last()?
        .parse()
        .ok()
}

/// The user ids of `pid` (real, effective, saved and file-system: the
/// `Uid:` line of `/proc/PID/status`), the owners a file the process
/// wrote can have; `None` where unreadable.
pub fn process_uids(pid: u32) -> Option<[u32; 4]> {
    let status = crate::process::proc_text::read(format!("/proc/{pid}/status")).ok()?;
    parse_uids(&status)
}

/// The four ids of the `Uid:` line of a `/proc/PID/status` text.
fn parse_uids(status: &str) -> Option<[u32; 4]> {
    let mut ids = status
        .lines()
        .find_map(|l| l.strip_prefix("Uid:"))?
        .split_whitespace()
        .map(|v| v.parse::<u32>().ok());
    let mut out = [0u32; 4];
    for slot in &mut out {
        *slot = ids.next()??;
    }
    Some(out)
}

/// Start time of `pid` (field 22 of `/proc/PID/stat`), if it runs.
pub fn start_time(pid: u32) -> Option<u64> {
    stat_start_time(&crate::process::proc_text::read(format!("/proc/{pid}/stat")).ok()?)
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
    /// The regions are mapped, but no descriptor names them any more and
    /// `/proc/PID/map_files` may not be opened without a capability.
    #[error(
        "process {pid} ({name}) is instrumented, but it closed the descriptors of its heapdump \
         regions (daemons close every inherited fd); the regions are still mapped, and opening \
         them through /proc/{pid}/map_files needs CAP_CHECKPOINT_RESTORE or CAP_SYS_ADMIN: run \
         heapdump as root, or give it the capability (setcap cap_checkpoint_restore+ep \
         \"$(command -v heapdump)\"). A `heapdump watch` started before the descriptors were \
         closed keeps its own handle"
    )]
    DescriptorsClosed {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
    },
    /// More files named as heapdump regions are mapped than any agent
    /// makes.
    #[error(
        "process {pid} ({name}) maps {count} files named as heapdump regions, more than a heapdump \
         agent makes ({MAX_REGION_SOURCES} at most: its two, and for a moment after fork its \
         parent's): not opened, none of them (is it running a modified or foreign agent?)"
    )]
    TooManyRegions {
        /// The pid asked for.
        pid: u32,
        /// Its name.
        name: String,
        /// How many it maps.
        count: usize,
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

/// The process name from `/proc/PID/comm` (the target's to choose: its
/// control characters escaped as `\xNN`, so no message can carry them to a
/// terminal), or `?`.
pub fn process_name(pid: u32) -> String {
    fs::read(format!("/proc/{pid}/comm"))
        .map(|b| {
            let s = String::from_utf8_lossy(&b);
            let s = s.strip_suffix('\n').unwrap_or(&s);
            crate::formats::escape_controls(s).into_owned()
        })
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

/// How a region of a process is reached.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RegionSource {
    /// Which region.
    pub kind: RegionKind,
    /// What to open: `/proc/PID/map_files/S-E` where this dumper may, else
    /// `/proc/PID/fd/N`, or the former when no descriptor names the region
    /// any more.
    pub path: PathBuf,
    /// True when `path` is under `map_files` (needs a capability).
    pub through_mapping: bool,
}

/// One heapdump region mapping of a `/proc/PID/maps` line: kind, range,
/// writable, inode.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct RegionMapping {
    kind: RegionKind,
    start: u64,
    end: u64,
    writable: bool,
    inode: u64,
}

/// The heapdump region a `/proc/PID/maps` line maps shared, if any.
fn region_mapping(l: &super::maps_lines::MapsLine<'_>) -> Option<RegionMapping> {
    let kind = RegionKind::from_link_target(l.path)?;
    let perms = l.perms.as_bytes();
    if perms.len() != 4 || perms[3] != b's' {
        return None;
    }
    Some(RegionMapping {
        kind,
        start: l.start,
        end: l.end,
        writable: perms[1] == b'w',
        inode: l.inode,
    })
}

/// The inode of an open file (a region's memfd).
fn fstat_inode(fd: std::os::fd::RawFd) -> Option<u64> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
    // SAFETY: fstat writes a `struct stat` into `st` (valid for writes of
    // its size) and reads nothing else; `fd` is a descriptor the caller's
    // reader holds open for the call.
    let r = unsafe { libc::fstat(fd, st.as_mut_ptr()) };
    // SAFETY: fstat succeeded, so it filled `st`.
    (r == 0).then(|| unsafe { st.assume_init() }.st_ino)
}

fn proc_error(pid: u32, e: io::Error) -> DiscoveryError {
    match e.kind() {
        io::ErrorKind::NotFound => DiscoveryError::NoSuchProcess { pid },
        io::ErrorKind::PermissionDenied => DiscoveryError::PermissionDenied { pid },
        _ => DiscoveryError::Io { pid, source: e },
    }
}

/// The heapdump regions `pid` maps writable (its own, or a fork child's
/// inherited ones until it unmaps them), each with the way to open it.
/// Empty when `pid` is not instrumented (a dumper's read-only mappings do
/// not count).
pub fn region_sources(pid: u32) -> Result<Vec<RegionSource>, DiscoveryError> {
    // Only shared writable file mappings are asked for (the kernel skips
    // the others itself where it can): a target's 60 000 other mappings
    // cost this scan, which `watch --all` makes of every process, nothing.
    let wanted = super::mappings::Wanted {
        file_backed: true,
        writable: true,
        shared: true,
        ..Default::default()
    };
    let mut mappings: Vec<RegionMapping> = Vec::new();
    super::mappings::for_each(pid, wanted, |l| {
        mappings.extend(region_mapping(l).filter(|m| m.writable));
        std::ops::ControlFlow::Continue(())
    })
    .map_err(|e| proc_error(pid, e))?;
    mappings.sort_by_key(|m| m.inode);
    mappings.dedup_by_key(|m| m.inode);
    if mappings.is_empty() {
        return Ok(Vec::new());
    }
    let through_mapping = |m: &RegionMapping| RegionSource {
        kind: m.kind,
        path: PathBuf::from(format!("/proc/{pid}/map_files/{:x}-{:x}", m.start, m.end)),
        through_mapping: true,
    };
    // Root (CAP_SYS_ADMIN or CAP_CHECKPOINT_RESTORE, and the right to read
    // the process's memory) opens a mapped file through its mapping, and
    // so reads no descriptor: the target decides how many it holds (half a
    // million under systemd's limit, each link read at 4.5 us: seconds at
    // every `list`, scan of `watch --all` and request of `serve`). Opening
    // one mapping's entry as a path tells whether this dumper may (no file
    // system is asked: the kernel hands over the file it holds; reading
    // the entry's link is allowed without the capability, and tells
    // nothing).
    use std::os::unix::fs::OpenOptionsExt;
    let may_open_mappings = fs::File::options()
        .read(true)
        .custom_flags(libc::O_PATH)
        .open(through_mapping(&mappings[0]).path)
        .is_ok();
    if may_open_mappings {
        return Ok(mappings.iter().map(through_mapping).collect());
    }
    // Descriptors that still name a region, by inode; no more are read
    // once every region has one.
    let mut by_inode: HashMap<u64, PathBuf> = HashMap::new();
    let entries = fs::read_dir(format!("/proc/{pid}/fd")).map_err(|e| proc_error(pid, e))?;
    for entry in entries.flatten() {
        if by_inode.len() == mappings.len() {
            break;
        }
        // A descriptor may close between readdir and readlink: skip it.
        let Ok(target) = fs::read_link(entry.path()) else {
            continue;
        };
        if target
            .to_str()
            .and_then(RegionKind::from_link_target)
            .is_none()
        {
            continue;
        }
        // Its inode as the kernel has it cached: a `stat` of a file a
        // target names `/memfd:heapdump.allocations (deleted)` at the root
        // of its detached FUSE mount would be a request its server may
        // never answer (the open below refuses such a file).
        let ino = fs::File::options()
            .read(true)
            .custom_flags(libc::O_PATH)
            .open(entry.path())
            .and_then(|f| super::user_space_mounts::identity_without_request(&f));
        if let Ok(id) = ino {
            if mappings.binary_search_by_key(&id.ino, |m| m.inode).is_ok() {
                by_inode.entry(id.ino).or_insert(entry.path());
            }
        }
    }
    Ok(mappings
        .into_iter()
        .map(|m| match by_inode.remove(&m.inode) {
            Some(path) => RegionSource {
                kind: m.kind,
                path,
                through_mapping: false,
            },
            None => through_mapping(&m),
        })
        .collect())
}

fn region_error(pid: u32, name: &str, source: &RegionSource, e: TableError) -> DiscoveryError {
    let kind = source.kind;
    if let TableError::Io { source: io, .. } = &e {
        if source.through_mapping && io.kind() == io::ErrorKind::PermissionDenied {
            return DiscoveryError::DescriptorsClosed {
                pid,
                name: name.to_string(),
            };
        }
        if io.kind() == io::ErrorKind::PermissionDenied {
            return DiscoveryError::PermissionDenied { pid };
        }
        if io.kind() == io::ErrorKind::NotFound {
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

/// Most files named as heapdump regions a process may map to be opened:
/// an agent makes two, and a fork child holds its parent's two until its
/// atfork handler unmaps them (a child's child, forked before that, two
/// more). Each is opened, sealed-checked and mapped at every opening (every
/// `list`, scan of `watch --all`, request of `serve`): a process mapping
/// ten thousand such files would cost that much each time.
pub const MAX_REGION_SOURCES: usize = 16;

/// Opens both regions of `pid`, validated, read-only.
pub fn open_target(pid: u32) -> Result<Target, DiscoveryError> {
    let sources = region_sources(pid)?;
    let name = process_name(pid);
    if sources.is_empty() {
        return Err(DiscoveryError::NotInstrumented { pid, name });
    }
    if sources.len() > MAX_REGION_SOURCES {
        return Err(DiscoveryError::TooManyRegions {
            pid,
            name,
            count: sources.len(),
        });
    }
    let mut resources: Option<RegionReader> = None;
    let mut allocations: Option<RegionReader> = None;
    let mut first_err = None;
    let mut inherited = None;
    // The pid the agent wrote: the host's, or the container's (see the
    // module doc).
    let inner = namespace_pid(pid).unwrap_or(pid);
    let mounts = super::user_space_mounts::UserSpaceMounts::for_shared_memory();
    let own = |r: &RegionReader| r.header().writer_pid == pid || r.header().writer_pid == inner;
    // Of two own candidates, the one made later (the other was inherited).
    let later = |slot: &mut Option<RegionReader>, r: RegionReader| {
        if slot
            .as_ref()
            .is_none_or(|old| old.header().clock_monotonic_ns <= r.header().clock_monotonic_ns)
        {
            *slot = Some(r);
        }
    };
    for source in &sources {
        // The target can swap another file (a FIFO, a device) onto the
        // descriptor number between readlink and open: only a regular file
        // is opened, and never waited on.
        let opened = super::target_files::open_regular(&source.path, &mounts)
            .map_err(|source| TableError::Io {
                what: "open region",
                source,
            })
            .and_then(|f| RegionReader::from_file(f, source.kind));
        match opened {
            Ok(r) if own(&r) => match source.kind {
                RegionKind::Resources => later(&mut resources, r),
                RegionKind::Allocations => later(&mut allocations, r),
            },
            Ok(r) => inherited = Some(r.header().writer_pid),
            Err(e) => {
                if first_err.is_none() {
                    first_err = Some(region_error(pid, &name, source, e));
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

/// Scans `/proc` for instrumented processes (those mapping a heapdump
/// region writable), in pid order: `f` gets each one's pid, name and
/// regions opened (or why they cannot be), and what it returns is kept.
/// Returns those and how many processes could not be inspected for lack of
/// permission.
///
/// Each process's regions are closed before the next one's are opened
/// (when `f` returns): any user can run hundreds of instrumented
/// processes, and a scan that held them all open at once ran out of
/// descriptors, so the processes after them (root's) went unseen.
pub fn scan_with<T>(
    mut f: impl FnMut(u32, String, Result<Target, DiscoveryError>) -> T,
) -> (Vec<T>, usize) {
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
        match region_sources(pid) {
            Err(DiscoveryError::PermissionDenied { .. }) => denied += 1,
            Err(_) => {}
            Ok(sources) if sources.is_empty() => {}
            Ok(_) => out.push(f(pid, process_name(pid), open_target(pid))),
        }
    }
    (out, denied)
}

/// Pids of the processes that map heapdump regions writable (their own,
/// or a fork child's inherited ones until it lets go of them), but for
/// those `skip` names: read from each one's maps, no region opened (the
/// collector's scan, which would otherwise open every process it already
/// watches, and every one past its user's share, once a second).
pub fn pids_with_regions(skip: impl Fn(u32) -> bool) -> Vec<u32> {
    let me = std::process::id();
    let Ok(dir) = fs::read_dir("/proc") else {
        return Vec::new();
    };
    let mut pids: Vec<u32> = dir
        .flatten()
        .filter_map(|e| e.file_name().to_str()?.parse().ok())
        .filter(|&p| p != me && !skip(p))
        .collect();
    pids.sort_unstable();
    pids.retain(|&p| region_sources(p).is_ok_and(|s| !s.is_empty()));
    pids
}

/// Pids of every process whose own regions can be opened.
pub fn instrumented_pids() -> Vec<u32> {
    scan_with(|pid, _, state| state.is_ok().then_some(pid))
        .0
        .into_iter()
        .flatten()
        .collect()
}

/// The pid `spec` names: a number, or the name of exactly one instrumented
/// process (its name, or its executable's file name from the command line;
/// names are cut to 15 bytes by the kernel, so both are tried).
pub fn resolve_target(spec: &str) -> Result<u32, String> {
    if let Ok(pid) = spec.parse::<u32>() {
        return Ok(pid);
    }
    let candidates: Vec<(u32, Vec<String>)> = scan_with(|pid, name, state| {
        state.ok()?;
        let mut names = vec![name];
        if let Some(arg0) = cmdline(pid).into_iter().next() {
            names.push(arg0.rsplit('/').next().unwrap_or(&arg0).to_string());
        }
        Some((pid, names))
    })
    .0
    .into_iter()
    .flatten()
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
    #[test]
    fn the_namespace_pid_is_the_last_of_the_nspid_line() {
        let status = "Name:\tpython3\nPid:\t2894\nNSpid:\t2894\t3\nNSpgid:\t2890\n";
        assert_eq!(parse_namespace_pid(status), Some(3));
        assert_eq!(parse_namespace_pid("Name:\tx\nNSpid:\t77\n"), Some(77));
        assert_eq!(parse_namespace_pid("Name:\tx\nPid:\t77\n"), None);
        assert_eq!(parse_namespace_pid("NSpid:\t\n"), None);
    }

    #[test]
    fn the_uids_are_the_four_of_the_uid_line() {
        let status = "Name:\tjava\nUmask:\t0022\nUid:\t1000\t1001\t1002\t1003\nGid:\t5\t5\t5\t5\n";
        assert_eq!(parse_uids(status), Some([1000, 1001, 1002, 1003]));
        assert_eq!(parse_uids("Uid:\t0\t0\t0\n"), None);
        assert_eq!(parse_uids("Uid:\t0\tx\t0\t0\n"), None);
        assert_eq!(parse_uids("Name:\tx\n"), None);
    }

    use super::*;

    fn parse_region_mapping(line: &str) -> Option<RegionMapping> {
        region_mapping(&crate::process::maps_lines::MapsLine::parse(line)?)
    }

    #[test]
    fn only_shared_region_mappings_are_read_and_writability_is_kept() {
        let w = parse_region_mapping(
            "7f0000000000-7f0010000000 rw-s 00000000 00:01 4242                       \
             /memfd:heapdump.allocations (deleted)",
        )
        .expect("writer mapping");
        assert_eq!(
            w,
            RegionMapping {
                kind: RegionKind::Allocations,
                start: 0x7f00_0000_0000,
                end: 0x7f00_1000_0000,
                writable: true,
                inode: 4242,
            }
        );
        let r = parse_region_mapping(
            "7f0000000000-7f0000001000 r--s 00000000 00:01 77 /memfd:heapdump.resources (deleted)",
        )
        .expect("reader mapping");
        assert!(!r.writable);
        assert_eq!(r.kind, RegionKind::Resources);
        assert_eq!(
            parse_region_mapping("7f0000000000-7f0000001000 rw-p 00000000 00:01 77 /memfd:heapdump.resources (deleted)"),
            None
        );
        assert_eq!(
            parse_region_mapping(
                "7f0000000000-7f0000001000 rw-s 00000000 00:01 77 /memfd:other (deleted)"
            ),
            None
        );
        assert_eq!(parse_region_mapping("garbage"), None);
    }

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
