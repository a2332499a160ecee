//! `heapdump watch`: a snapshot for every request a target makes (signal
//! or API), optionally one every interval, and a final one when the target
//! exits.
//!
//! The regions stay mapped by the dumper, so when the target dies (even by
//! SIGKILL or the OOM killer) the final snapshot is the live set at death.
//! Exit is detected with a pidfd (immune to pid reuse), falling back to
//! `kill(pid, 0)` and `/proc/PID/stat` where pidfds are not available. The
//! last mappings read while the target was alive are used to symbolize the
//! final snapshot.
//!
//! Requests made before the dumper attached: `watch` records the target's
//! request counter when it opens it and answers only the requests made
//! after that, because the heap at an earlier request is gone and a
//! snapshot named after it would be misleading (another watcher may also
//! have answered it already). With `answer_pending` (`watch
//! --answer-pending`, and always for `run --watch`, which starts the
//! program itself) a request made before attaching is answered at once by
//! one snapshot, named after the latest such request. Several requests
//! made between two polls are likewise answered by one snapshot (named
//! after the latest; its `request.count` says how many were made).

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use heapdump_table::header::read_request;

use crate::commands::descriptor_limit;
use crate::commands::process_shares::{Full, Shares};
use crate::formats::{self, Format, RenderOptions};
use crate::process::age::AgeFilter;
use crate::process::discovery::{open_target, DiscoveryError, Target};
use crate::process::snapshot::{self, Request, Snapshot};
use crate::symbolization::maps::{self, read_maps, BuildIds, Mapping};
use crate::symbolization::symbolizer::Symbolizer;

use crate::commands::args::{AgeArgs, SymArgs};
use crate::commands::cost_pacing::{cost_allows, UserPace, COST_PACE};
use crate::formats::text::TextOptions;
use clap::Args;
use std::io::Write as _;

/// What `watch` does.
#[derive(Clone, Debug)]
pub struct WatchOptions {
    /// Directory for the snapshot files.
    pub dir: PathBuf,
    /// Formats written for each snapshot.
    pub formats: Vec<Format>,
    /// Also snapshot every this long.
    pub interval: Option<Duration>,
    /// Symbolize frames.
    pub symbolize: bool,
    /// Rendering options.
    pub render: RenderOptions,
    /// How often requests and exit are polled.
    pub poll: Duration,
    /// Keep allocator plumbing frames at the leaf end of stacks.
    pub keep_allocator_frames: bool,
    /// Answer, with one snapshot, requests made before the watch began.
    pub answer_pending: bool,
    /// Keep only the newest this many periodic (`interval`) snapshots of
    /// each target, deleting older ones' files; snapshots answering a
    /// request and final ones are always kept.
    pub keep: Option<usize>,
    /// Keep only blocks allocated in this time range; a duration is
    /// counted back from each snapshot.
    pub ages: AgeFilter,
    /// Host-wide collector: also watch every instrumented process found
    /// later (scanned every `scan`), run until stopped.
    pub all: bool,
    /// With the final snapshot (exit or stop), also write the heap at its
    /// peak (`-peak` before the extension).
    pub peak: bool,
    /// How often `all` looks for new instrumented processes, and each
    /// target is asked whether it executed another program.
    pub scan: Duration,
    /// Keep the snapshot files in the directory under this many bytes in
    /// all, deleting the oldest of the target that holds the most first.
    pub max_total: Option<u64>,
    /// Answer a target's requests at most once per this long; requests
    /// made faster are answered together, by one snapshot, when it has
    /// passed.
    pub min_request_interval: Duration,
    /// Keep only the newest this many snapshots answering requests of each
    /// target, with those of the programs it ran before an `exec`
    /// ([`Reason::Exec`]), deleting older ones' files.
    pub keep_requests: Option<usize>,
}

/// Why a snapshot was taken.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reason {
    /// A snapshot request (signal or API) with this name (empty: signal).
    Request(String),
    /// The interval elapsed.
    Interval,
    /// The target exited.
    Exit,
    /// The target executed another program (`exec`): the last snapshot
    /// of the program it ran before.
    Exec,
    /// The dumper was asked to stop (SIGINT/SIGTERM).
    Stop,
}

impl Reason {
    fn label(&self) -> String {
        match self {
            Reason::Request(n) if n.is_empty() => "signal".to_string(),
            Reason::Request(n) => {
                let s: String = n
                    .chars()
                    .map(|c| {
                        if c.is_ascii_alphanumeric() || c == '-' || c == '_' {
                            c
                        } else {
                            '_'
                        }
                    })
                    .take(40)
                    .collect();
                format!("req-{s}")
            }
            Reason::Interval => "interval".to_string(),
            Reason::Exit => "exit".to_string(),
            Reason::Exec => "exec".to_string(),
            Reason::Stop => "stop".to_string(),
        }
    }
}

/// A snapshot written by `watch`.
#[derive(Clone, Debug)]
pub struct Written {
    /// Target pid.
    pub pid: u32,
    /// Sequence number (per target, from 1).
    pub seq: u64,
    /// Why it was taken.
    pub reason: Reason,
    /// Files written (one per format).
    pub paths: Vec<PathBuf>,
    /// Live bytes in the snapshot.
    pub live_bytes: u64,
    /// Whether it was partial.
    pub partial: bool,
    /// Files of older periodic snapshots deleted to keep `keep` of them.
    pub removed: Vec<PathBuf>,
    /// Files that should have been deleted but could not be, and why.
    pub not_removed: Vec<(PathBuf, String)>,
}

/// Errors of `watch`.
#[derive(Debug, thiserror::Error)]
pub enum WatchError {
    /// A target could not be opened.
    #[error(transparent)]
    Discovery(#[from] DiscoveryError),
    /// A snapshot could not be taken.
    #[error("snapshot of pid {pid} failed: {source}")]
    Snapshot {
        /// Target.
        pid: u32,
        /// Cause.
        #[source]
        source: heapdump_table::TableError,
    },
    /// A file could not be written.
    #[error("writing {path}: {source}")]
    Write {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Watches for the exit of a process.
#[derive(Debug)]
pub struct ExitWatch {
    pid: u32,
    pidfd: Option<OwnedFd>,
}

impl ExitWatch {
    /// Starts watching `pid` (opens a pidfd when the kernel has them).
    pub fn new(pid: u32) -> Self {
        // SAFETY: pidfd_open takes a pid and flags and returns a new fd or
        // -1; no memory is passed.
        let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid as libc::pid_t, 0) };
        let pidfd = (fd >= 0).then(|| {
            // SAFETY: `fd` is a fresh descriptor we own exclusively.
            unsafe { OwnedFd::from_raw_fd(fd as i32) }
        });
        ExitWatch { pid, pidfd }
    }

    /// Whether the process has exited (a zombie counts as exited).
    pub fn exited(&self) -> bool {
        if let Some(fd) = &self.pidfd {
            let mut p = libc::pollfd {
                fd: fd.as_raw_fd(),
                events: libc::POLLIN,
                revents: 0,
            };
            // SAFETY: one valid pollfd, zero timeout.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            return n > 0 && p.revents & (libc::POLLIN | libc::POLLHUP) != 0;
        }
        // SAFETY: signal 0 only checks for existence and permission.
        let alive = unsafe { libc::kill(self.pid as libc::pid_t, 0) } == 0
            || std::io::Error::last_os_error().raw_os_error() == Some(libc::EPERM);
        if !alive {
            return true;
        }
        match crate::process::proc_text::read(format!("/proc/{}/stat", self.pid)) {
            Ok(stat) => stat
                .rsplit_once(") ")
                .is_some_and(|(_, rest)| rest.starts_with('Z') || rest.starts_with('X')),
            Err(_) => true,
        }
    }
}

/// One watched process.
struct Watched {
    target: Target,
    exit: ExitWatch,
    maps: Vec<Mapping>,
    last_request: u64,
    seq: u64,
    last_snapshot: Instant,
    done: bool,
    /// Files of the periodic snapshots kept, oldest first.
    periodic: std::collections::VecDeque<Vec<PathBuf>>,
    /// Files of the snapshots answering requests, oldest first.
    answered: std::collections::VecDeque<Vec<PathBuf>>,
    /// When the last request was answered.
    last_answer: Option<Instant>,
    /// Whether the log said this target asks too often.
    told_rate: bool,
    /// When its last snapshot started and how long it took (taking,
    /// symbolizing, writing): see [`cost_allows`].
    last_started: Instant,
    last_cost: Duration,
    /// Whether the log said its snapshots are paced by their cost.
    told_cost: bool,
    /// Its real user id as of its last snapshot (when opened, before
    /// one; `None`: unreadable), whose processes' snapshots are paced
    /// together ([`UserPace`]).
    uid: Option<u32>,
    /// Whether its mappings changed since the collector last forgot the
    /// files nobody maps.
    maps_changed: bool,
    /// When it was last asked whether it executed another program.
    image_checked: Instant,
    /// Whether it executed another program whose regions are not open
    /// (yet): what is open is the program it ran before, already
    /// snapshotted.
    replaced: bool,
}

impl Watched {
    /// Whether its last snapshot's cost, and its user's last one's, let it
    /// have another now.
    fn cost_allows(&self, users: &UserPace) -> bool {
        cost_allows(self.last_started.elapsed(), self.last_cost)
            && users.holding(self.uid).is_none()
    }

    /// Records a periodic snapshot's files and deletes the oldest ones
    /// beyond `keep` (a file already gone counts as deleted).
    fn rotate(&mut self, written: &mut Written, keep: Option<usize>) {
        let Some(keep) = keep else { return };
        self.periodic.push_back(written.paths.clone());
        rotate_queue(&mut self.periodic, written, keep);
    }

    /// The same for snapshots answering requests, beyond `keep`.
    fn rotate_answered(&mut self, written: &mut Written, keep: Option<usize>) {
        let Some(keep) = keep else { return };
        self.answered.push_back(written.paths.clone());
        rotate_queue(&mut self.answered, written, keep);
    }
}

/// Deletes the files of the oldest entries of `queue` beyond `keep`.
fn rotate_queue(
    queue: &mut std::collections::VecDeque<Vec<PathBuf>>,
    written: &mut Written,
    keep: usize,
) {
    while queue.len() > keep {
        for p in queue.pop_front().unwrap_or_default() {
            match std::fs::remove_file(&p) {
                Ok(()) => written.removed.push(p),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => written.removed.push(p),
                Err(e) => written.not_removed.push((p, e.to_string())),
            }
        }
    }
}

/// Set by SIGINT/SIGTERM while watching.
static STOP: AtomicBool = AtomicBool::new(false);

extern "C" fn on_stop_signal(sig: libc::c_int) {
    if STOP.swap(true, Ordering::Relaxed) {
        // A second signal: the clean stop is taking too long (or is stuck
        // on a target); end now.
        // SAFETY: _exit is async-signal-safe.
        unsafe { libc::_exit(128 + sig) };
    }
}

/// Makes SIGINT and SIGTERM end `watch` cleanly (with a final snapshot of
/// each target) instead of killing the dumper; a second one ends it at
/// once. Without `SA_RESTART`, so a system call waiting when the signal
/// comes returns instead of waiting on.
pub fn install_stop_handlers() {
    use nix::sys::signal::{sigaction, SaFlags, SigAction, SigHandler, SigSet, Signal};
    let act = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::empty(),
        SigSet::empty(),
    );
    for sig in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only stores to an atomic (async-signal-safe).
        let _ = unsafe { sigaction(sig, &act) };
    }
}

/// Whether a stop was requested by signal.
pub fn stop_requested() -> bool {
    STOP.load(Ordering::Relaxed)
}

fn file_name(pid: u32, seq: u64, reason: &Reason, snap: &Snapshot, format: Format) -> String {
    let time: String = snap
        .taken_at
        .map(crate::formats::json::rfc3339)
        .unwrap_or_default()
        .chars()
        .filter(|c| *c != '-' && *c != ':')
        .collect();
    format!(
        "heapdump-{pid}-{seq:04}-{}-{time}.{}",
        reason.label(),
        format.extension()
    )
}

/// Takes one snapshot of `w` and writes it in every format.
fn shoot(
    w: &mut Watched,
    reason: Reason,
    opts: &WatchOptions,
    symbolizer: &mut Symbolizer,
    build_ids: &mut BuildIds,
) -> Result<Written, WatchError> {
    let pid = w.target.pid;
    if !w.done {
        if let Ok(m) = read_maps(pid, build_ids) {
            if !m.is_empty() {
                w.maps_changed |= !maps::same_files(&m, &w.maps);
                w.maps = m;
                if opts.symbolize {
                    symbolizer.open_modules(&w.maps);
                }
            }
        }
    }
    let request = match &reason {
        Reason::Request(name) => {
            let r = read_request(&w.target.allocations.view());
            Some(Request {
                count: w.last_request,
                name: name.clone(),
                time: snapshot::wall_time(&w.target, r.time_monotonic_ns),
            })
        }
        _ => None,
    };
    let snap = snapshot::take(
        &w.target,
        &w.maps,
        snapshot::Options {
            peak: false,
            symbolizer: opts.symbolize.then_some(symbolizer),
            progress: false,
            request,
            keep_allocator_frames: opts.keep_allocator_frames,
            ages: opts.ages,
            addresses_only: false,
        },
    )
    .map_err(|source| WatchError::Snapshot { pid, source })?;
    w.seq += 1;
    w.last_snapshot = Instant::now();
    let mut paths = Vec::new();
    for f in &opts.formats {
        let path = opts.dir.join(file_name(pid, w.seq, &reason, &snap, *f));
        formats::write_snapshot(&path, &snap, *f, opts.render).map_err(|source| {
            WatchError::Write {
                path: path.clone(),
                source,
            }
        })?;
        paths.push(path);
    }
    let last = matches!(reason, Reason::Exit | Reason::Stop | Reason::Exec);
    if last && opts.peak && snapshot::peak_recorded(&w.target).is_ok() {
        let peak = snapshot::take(
            &w.target,
            &w.maps,
            snapshot::Options {
                peak: true,
                symbolizer: opts.symbolize.then_some(&mut *symbolizer),
                progress: false,
                request: None,
                keep_allocator_frames: opts.keep_allocator_frames,
                ages: opts.ages,
                addresses_only: false,
            },
        )
        .map_err(|source| WatchError::Snapshot { pid, source })?;
        for f in &opts.formats {
            let name = file_name(pid, w.seq, &reason, &snap, *f);
            let ext = format!(".{}", f.extension());
            let stem = name.strip_suffix(&ext).unwrap_or(&name);
            let path = opts.dir.join(format!("{stem}-peak{ext}"));
            formats::write_snapshot(&path, &peak, *f, opts.render).map_err(|source| {
                WatchError::Write {
                    path: path.clone(),
                    source,
                }
            })?;
            paths.push(path);
        }
    }
    Ok(Written {
        pid,
        seq: w.seq,
        reason,
        paths,
        live_bytes: snap.totals.live_bytes,
        partial: snap.partial.is_some(),
        removed: Vec::new(),
        not_removed: Vec::new(),
    })
}

/// [`shoot`], then the directory kept within `--max-total`; with `--all`,
/// a failed snapshot ends that target's watch (`None`), not the
/// collector's, which outlives any one target.
fn shoot_or_drop(
    w: &mut Watched,
    reason: Reason,
    opts: &WatchOptions,
    symbolizer: &mut Symbolizer,
    build_ids: &mut BuildIds,
    users: &mut UserPace,
) -> Result<Option<Written>, WatchError> {
    let started = Instant::now();
    let shot = shoot(w, reason, opts, symbolizer, build_ids);
    w.last_started = started;
    w.last_cost = started.elapsed();
    // Its user now (a daemon adopted as root may have dropped to its
    // own user since): the one whose processes its cost holds back. Read
    // before asking whether it exited: an exited process's pid may be
    // another's by then.
    let now = crate::process::discovery::process_uids(w.target.pid).map(|ids| ids[0]);
    if now.is_some() && !w.exit.exited() {
        w.uid = now;
    }
    users.took(w.uid, started, w.last_cost);
    match shot {
        Ok(mut written) => {
            if let Some(max) = opts.max_total {
                enforce_total_fairly(&opts.dir, max, &mut written);
            }
            Ok(Some(written))
        }
        Err(e) if opts.all => {
            eprintln!("heapdump: {e}");
            w.done = true;
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

/// Watched targets, opened and ready to answer requests.
pub struct Watcher {
    opts: WatchOptions,
    watched: Vec<Watched>,
    symbolizer: Symbolizer,
    build_ids: BuildIds,
    users: UserPace,
    /// How many processes `all` adopts, per user.
    shares: Shares,
}

impl std::fmt::Debug for Watcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Watcher")
            .field("pids", &self.pids())
            .finish()
    }
}

impl Watcher {
    /// Opens every target and records its current request count: requests
    /// made from now on are answered (and, with `answer_pending`, the
    /// latest one made before, at the first poll).
    pub fn open(pids: &[u32], opts: WatchOptions) -> Result<Self, WatchError> {
        formats::create_private_dir(&opts.dir).map_err(|source| WatchError::Write {
            path: opts.dir.clone(),
            source,
        })?;
        let mut build_ids = BuildIds::default();
        let mut watched = Vec::new();
        for &pid in pids {
            watched.push(open_one(pid, opts.answer_pending, &mut build_ids)?);
        }
        // Open the target's files while it is alive: its final snapshot
        // is symbolized after it exited.
        let mut symbolizer = Symbolizer::new();
        if opts.symbolize {
            for w in &watched {
                symbolizer.open_modules(&w.maps);
            }
        }
        Ok(Watcher {
            opts,
            watched,
            symbolizer,
            build_ids,
            users: UserPace::default(),
            shares: Shares::new(descriptor_limit::current()),
        })
    }

    /// Starts watching `pid`, found after the watch began (`all`): every
    /// request it made is answered, since it started after the collector.
    /// Prints `watching PID (NAME)`.
    fn adopt(&mut self, pid: u32) -> Result<(), WatchError> {
        let uid = crate::process::discovery::process_uids(pid).map(|ids| ids[0]);
        if let Err(full) = self.shares.admits(uid, self.watched.iter().map(|w| w.uid)) {
            // Looked at again at the next scan.
            if self.shares.tell(uid) {
                self.tell_full(pid, uid, full);
            }
            return Ok(());
        }
        let w = open_one(pid, true, &mut self.build_ids)?;
        self.shares.adopted(uid);
        if self.opts.symbolize {
            self.symbolizer.open_modules(&w.maps);
        }
        println!("watching {pid} ({})", w.target.name);
        let _ = std::io::stdout().flush();
        self.watched.push(w);
        Ok(())
    }

    /// Says in the log that `pid`, of user `uid`, is not watched for now.
    fn tell_full(&self, pid: u32, uid: Option<u32>, full: Full) {
        let user = uid.map_or_else(|| "unknown".to_string(), |u| u.to_string());
        let budget = self.shares.budget();
        match full {
            Full::User => eprintln!(
                "heapdump: pid {pid} is not watched: its user ({user}) has {} processes watched, \
                 its share of the {budget} this collector can hold open; its other processes are \
                 not watched either until some of them exit",
                self.shares.per_user()
            ),
            Full::Others => eprintln!(
                "heapdump: pid {pid} (user {user}) is not watched: users other than root have \
                 {} processes watched, their share of the {budget} this collector can hold open, \
                 until some of them exit",
                budget / 4 * 3
            ),
            Full::Collector => eprintln!(
                "heapdump: pid {pid} (user {user}) is not watched: this collector watches \
                 {budget} processes, all that its limit of open files holds (raise it: \
                 LimitNOFILE= in its unit), until some of them exit"
            ),
        }
    }

    /// Follows the targets that executed another program (asked once per
    /// scan interval each, [`Target::replaced`]): the regions open are the
    /// program's before, whose requests and final snapshot are over, and
    /// the new program's (if the agent is loaded there too) are new ones,
    /// which nothing would ever answer (a wrapper that `exec`s the service,
    /// adopted in the moment before, hid the service from the collector
    /// for its whole life). The program before gets its last snapshot
    /// (`exec`), with the mappings it had; the new one is opened as a
    /// target found anew (`watching PID (NAME)`), at once or at a later
    /// scan.
    fn follow_execs(&mut self, on_written: &mut impl FnMut(&Written)) -> Result<(), WatchError> {
        let opts = self.opts.clone();
        for w in self.watched.iter_mut().filter(|w| !w.done) {
            if w.image_checked.elapsed() < opts.scan || !w.cost_allows(&self.users) {
                continue;
            }
            w.image_checked = Instant::now();
            if !w.replaced {
                if w.exit.exited() || !w.target.replaced() {
                    continue;
                }
                // Done while it is taken: its mappings now are the new
                // program's, not read for this one.
                w.done = true;
                let written = shoot_or_drop(
                    w,
                    Reason::Exec,
                    &opts,
                    &mut self.symbolizer,
                    &mut self.build_ids,
                    &mut self.users,
                )?;
                if let Some(mut written) = written {
                    // Kept with the answers to its requests: a process
                    // that executes itself again and again (or fakes it,
                    // unmapping its regions and making new ones) gets at
                    // most `--keep-requests` of them, not one per scan
                    // for as long as it runs.
                    w.rotate_answered(&mut written, opts.keep_requests);
                    on_written(&written);
                }
                // A request of the new program made at once is answered
                // no sooner than one made before the exec would have been.
                w.last_answer = Some(Instant::now());
                w.done = false;
                w.replaced = true;
            }
            // Until its new program is instrumented, asked again at each
            // scan (the collector's scan skips a pid it watches, so the
            // history below is never lost to an adoption anew).
            if let Ok(mut fresh) = open_one(w.target.pid, true, &mut self.build_ids) {
                if opts.symbolize {
                    self.symbolizer.open_modules(&fresh.maps);
                }
                println!("watching {} ({})", fresh.target.pid, fresh.target.name);
                let _ = std::io::stdout().flush();
                // One process, one history: its sequence, the files
                // kept of it and the pace of its answers go on from
                // the program before.
                fresh.seq = w.seq;
                fresh.periodic = std::mem::take(&mut w.periodic);
                fresh.answered = std::mem::take(&mut w.answered);
                fresh.last_answer = w.last_answer;
                fresh.told_rate = w.told_rate;
                fresh.last_started = w.last_started;
                fresh.last_cost = w.last_cost;
                fresh.told_cost = w.told_cost;
                fresh.uid = w.uid;
                fresh.maps_changed = true;
                *w = fresh;
            }
        }
        Ok(())
    }

    /// Forgets the files (parsed symbols, build IDs) that no watched
    /// process maps any more: a collector's caches hold what its live
    /// targets map, not what every process it saw in weeks mapped, and
    /// what they read goes back to `HEAPDUMP_MAX_TOTAL_READ`.
    fn forget_unwatched_files(&mut self) {
        let maps = || {
            self.watched
                .iter()
                .filter(|w| !w.done)
                .flat_map(|w| w.maps.iter())
        };
        self.symbolizer.retain_mapped(maps());
        self.build_ids.retain_mapped(maps());
        for w in &mut self.watched {
            w.maps_changed = false;
        }
    }

    /// The pids watched.
    pub fn pids(&self) -> Vec<u32> {
        self.watched.iter().map(|w| w.target.pid).collect()
    }

    /// Watches until every target has exited or a stop was requested
    /// (SIGINT/SIGTERM with [`install_stop_handlers`], or `stop` set), then
    /// returns. Calls `on_written` for each snapshot written.
    pub fn run(
        mut self,
        stop: &AtomicBool,
        mut on_written: impl FnMut(&Written),
    ) -> Result<(), WatchError> {
        let opts = self.opts.clone();
        let mut last_scan: Option<Instant> = None;
        let mut done_before = 0;
        loop {
            let stopping = stop.load(Ordering::Relaxed) || stop_requested();
            if opts.all && !stopping && last_scan.is_none_or(|t| t.elapsed() >= opts.scan) {
                last_scan = Some(Instant::now());
                let known: std::collections::HashSet<u32> =
                    self.watched.iter().map(|w| w.target.pid).collect();
                // The processes watched are not opened again, nor is one
                // past its user's share (`adopt` asks first).
                for pid in crate::process::discovery::pids_with_regions(|p| known.contains(&p)) {
                    // A process being set up, gone, not ours to read, or a
                    // fork child still holding only its parent's regions:
                    // looked at again at the next scan.
                    let _ = self.adopt(pid);
                }
            }
            self.follow_execs(&mut on_written)?;
            let (symbolizer, build_ids, users) =
                (&mut self.symbolizer, &mut self.build_ids, &mut self.users);
            let mut take = |w: &mut Watched, reason: Reason, users: &mut UserPace| {
                shoot_or_drop(w, reason, &opts, symbolizer, build_ids, users)
            };
            for w in self.watched.iter_mut().filter(|w| !w.done) {
                let exited = w.exit.exited();
                if w.replaced {
                    // Its program before the exec is snapshotted, its new
                    // one not instrumented (yet): nothing to answer.
                    w.done = exited || stopping;
                    continue;
                }
                let req = read_request(&w.target.allocations.view());
                let due = w
                    .last_answer
                    .is_none_or(|t| t.elapsed() >= opts.min_request_interval);
                if req.count > w.last_request && due && !w.cost_allows(users) {
                    // Answered once its last snapshot's cost, and its
                    // user's last one's, allow, with every request made
                    // meanwhile.
                    if !w.told_cost {
                        w.told_cost = true;
                        let ms = |d: Duration| {
                            humantime::format_duration(Duration::from_millis(d.as_millis() as u64))
                        };
                        match users.holding(w.uid) {
                            Some(cost) if cost != w.last_cost => eprintln!(
                                "heapdump: a snapshot of another process of the user of pid {} \
                                 ({}) took {}: snapshots of that user's processes are taken at \
                                 most once per {COST_PACE} times that, so that they cannot keep \
                                 the others waiting",
                                w.target.pid,
                                w.target.name,
                                ms(cost),
                            ),
                            _ => eprintln!(
                                "heapdump: a snapshot of pid {} ({}) took {}: its snapshots are \
                                 taken at most once per {COST_PACE} times that, so that it \
                                 cannot keep the others waiting",
                                w.target.pid,
                                w.target.name,
                                ms(w.last_cost),
                            ),
                        }
                    }
                } else if req.count > w.last_request && !due {
                    // Answered when the interval has passed, with every
                    // request made meanwhile (its request.count says how
                    // many).
                    if !w.told_rate {
                        w.told_rate = true;
                        eprintln!(
                            "heapdump: pid {} ({}) asks for snapshots more often than once per \
                             {}: its requests are answered at most that often, several by one \
                             snapshot",
                            w.target.pid,
                            w.target.name,
                            humantime::format_duration(opts.min_request_interval)
                        );
                    }
                } else if req.count > w.last_request {
                    w.last_request = req.count;
                    w.last_answer = Some(Instant::now());
                    let name = req.name.unwrap_or_default();
                    if let Some(mut written) = take(w, Reason::Request(name), users)? {
                        w.rotate_answered(&mut written, opts.keep_requests);
                        on_written(&written);
                    }
                } else if let Some(iv) = opts.interval {
                    if w.last_snapshot.elapsed() >= iv && w.cost_allows(users) && !exited {
                        if let Some(mut written) = take(w, Reason::Interval, users)? {
                            w.rotate(&mut written, opts.keep);
                            on_written(&written);
                        }
                    }
                }
                if (exited || stopping) && !w.done {
                    let reason = if exited { Reason::Exit } else { Reason::Stop };
                    // After exit, /proc/PID/maps is gone: keep the last maps.
                    w.done = exited;
                    let written = take(w, reason, users)?;
                    w.done = true;
                    if let Some(written) = written {
                        on_written(&written);
                    }
                }
            }
            if opts.all {
                // Forget the targets that are done (memory stays bounded
                // over days of processes coming and going), and the files
                // only they mapped.
                let before = self.watched.len();
                self.watched.retain(|w| !w.done);
                let changed = self.watched.iter().any(|w| w.maps_changed);
                if self.watched.len() != before || changed {
                    self.forget_unwatched_files();
                }
                if stopping {
                    return Ok(());
                }
            } else {
                // The same for `watch PID...`, whose targets that are done
                // stay listed: what only they mapped goes back to the
                // total for the others (their final snapshots are taken).
                let done = self.watched.iter().filter(|w| w.done).count();
                let changed = self.watched.iter().any(|w| w.maps_changed && !w.done);
                if done == self.watched.len() {
                    return Ok(());
                }
                if done != done_before || changed {
                    done_before = done;
                    self.forget_unwatched_files();
                }
            }
            std::thread::sleep(opts.poll);
        }
    }
}

/// Opens one target; with `answer_pending`, its earlier requests count as
/// unanswered.
fn open_one(
    pid: u32,
    answer_pending: bool,
    build_ids: &mut BuildIds,
) -> Result<Watched, WatchError> {
    let target = open_target(pid)?;
    let exit = ExitWatch::new(pid);
    let maps = read_maps(pid, build_ids).unwrap_or_default();
    let last_request = if answer_pending {
        0
    } else {
        read_request(&target.allocations.view()).count
    };
    Ok(Watched {
        target,
        exit,
        maps,
        last_request,
        seq: 0,
        last_snapshot: Instant::now(),
        done: false,
        periodic: Default::default(),
        answered: Default::default(),
        last_answer: None,
        told_rate: false,
        last_started: Instant::now(),
        last_cost: Duration::ZERO,
        told_cost: false,
        uid: crate::process::discovery::process_uids(pid).map(|ids| ids[0]),
        maps_changed: false,
        image_checked: Instant::now(),
        replaced: false,
    })
}

/// The pid a snapshot file of `watch` belongs to
/// (`heapdump-PID-SEQ-...`).
fn pid_of_file(name: &str) -> Option<u32> {
    name.strip_prefix("heapdump-")?
        .split('-')
        .next()?
        .parse()
        .ok()
}

/// Deletes snapshot files (`heapdump-*`) in `dir` until their total size
/// is at most `max` bytes, never the files just written nor any process's
/// newest snapshot, fairly: each time the oldest file of the target whose
/// files take the most room, so one process that floods the directory
/// deletes its own snapshots, never another's last one, and another's
/// older ones only while that one holds more. Deletions go into `written`
/// for the caller to report.
fn enforce_total_fairly(dir: &std::path::Path, max: u64, written: &mut Written) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    // Per pid (0: files of no pid), oldest first.
    let mut by_pid: std::collections::BTreeMap<u32, Vec<(std::time::SystemTime, u64, PathBuf)>> =
        Default::default();
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        if !name.starts_with("heapdump-") {
            continue;
        }
        let Ok(m) = e.metadata() else { continue };
        if !m.is_file() {
            continue;
        }
        by_pid
            .entry(pid_of_file(&name).unwrap_or(0))
            .or_default()
            .push((
                m.modified().unwrap_or(std::time::UNIX_EPOCH),
                m.len(),
                e.path(),
            ));
    }
    // What each process holds, every file counted.
    let mut totals: std::collections::BTreeMap<u32, u64> = by_pid
        .iter()
        .map(|(p, f)| (*p, f.iter().map(|x| x.1).sum()))
        .collect();
    for (pid, files) in by_pid.iter_mut() {
        files.sort();
        let before = files.len();
        files.retain(|f| !written.paths.contains(&f.2));
        // Each process's newest snapshot is its evidence: never deleted
        // for another's sake (the files just written are the writer's).
        if *pid != written.pid || files.len() == before {
            files.pop();
        }
        files.reverse(); // Oldest last, to pop.
    }
    let mut total: u64 = totals.values().sum();
    while total > max {
        // The target holding the most that still has a file to delete.
        let Some((&pid, _)) = totals
            .iter()
            .filter(|(p, _)| by_pid.get(p).is_some_and(|f| !f.is_empty()))
            .max_by_key(|(_, t)| **t)
        else {
            break;
        };
        let Some((_, len, path)) = by_pid.get_mut(&pid).and_then(Vec::pop) else {
            break;
        };
        match std::fs::remove_file(&path) {
            Ok(()) => written.removed.push(path),
            Err(e) => written.not_removed.push((path, e.to_string())),
        }
        total = total.saturating_sub(len);
        if let Some(t) = totals.get_mut(&pid) {
            *t = t.saturating_sub(len);
        }
    }
}

/// Opens the targets and watches them (see [`Watcher`]).
pub fn watch(
    pids: &[u32],
    opts: &WatchOptions,
    stop: &AtomicBool,
    on_written: impl FnMut(&Written),
) -> Result<(), WatchError> {
    Watcher::open(pids, opts.clone())?.run(stop, on_written)
}

/// Waits (bounded) until `pid` has its own heapdump regions: used right
/// after starting a program, whose agent creates them on first allocation.
/// Returns the last discovery error on timeout or exit.
pub fn wait_instrumented(pid: u32, timeout: Duration) -> Result<(), DiscoveryError> {
    let start = Instant::now();
    let exit = ExitWatch::new(pid);
    loop {
        match open_target(pid) {
            Ok(_) => return Ok(()),
            Err(e) => {
                if start.elapsed() >= timeout || exit.exited() {
                    return Err(e);
                }
            }
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Options of `heapdump watch`.
#[derive(Args, Debug)]
pub struct WatchArgs {
    /// Processes to watch: pids, or names each of only one instrumented
    /// process.
    #[arg(required_unless_present = "all", value_name = "PID|NAME", value_parser = crate::process::discovery::resolve_target)]
    pub(crate) pids: Vec<u32>,
    /// Host-wide collector: watch every instrumented process of the host,
    /// those running now and those started later (every request they make
    /// is answered, and a final snapshot written when they exit), until
    /// stopped (SIGINT/SIGTERM). See dist/heapdump-collector.service.
    #[arg(long)]
    pub(crate) all: bool,
    /// How often to look for new instrumented processes (with --all), and
    /// how often each target is asked whether it executed another program
    /// (then its program before gets a last snapshot, `exec`, and the new
    /// one is watched).
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub(crate) scan: Duration,
    /// Keep the snapshot files in the directory under SIZE bytes in all
    /// (e.g. 2GiB, 500MiB), deleting the oldest file of the process whose
    /// files take the most room first (one process flooding requests
    /// deletes its own snapshots, not another's).
    #[arg(long, value_name = "SIZE", value_parser = heapdump_table::byte_size::parse_byte_size)]
    pub(crate) max_total: Option<u64>,
    /// Answer each process's snapshot requests at most once per DURATION;
    /// requests made faster are answered together by one snapshot (its
    /// request count says how many), and the log says so once.
    #[arg(long, default_value = "1s", value_parser = humantime::parse_duration)]
    pub(crate) min_request_interval: Duration,
    /// Keep only the newest N snapshots answering each process's requests
    /// (and of the programs it ran before an exec), deleting older ones'
    /// files (default with --all: 100; otherwise all are kept).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) keep_requests: Option<u64>,
    /// Directory for the snapshot files (created with mode 0700). Files are
    /// named heapdump-PID-SEQ-REASON-TIME.EXT.
    #[arg(short, long, default_value = ".")]
    pub(crate) dir: PathBuf,
    /// Formats written for each snapshot (repeatable).
    #[arg(short, long, value_enum, default_values_t = [Format::Pprof])]
    pub(crate) format: Vec<Format>,
    /// Also take a snapshot every DURATION (e.g. 30s, 5m).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub(crate) interval: Option<Duration>,
    /// With --interval: keep only the newest N periodic snapshots of each
    /// target, deleting the files of older ones (snapshots answering a
    /// request, and the final one, are always kept).
    #[arg(long, value_name = "N", requires = "interval", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) keep: Option<u64>,
    /// How often requests and exits are checked.
    #[arg(long, default_value = "15ms", value_parser = humantime::parse_duration)]
    pub(crate) poll: Duration,
    /// Also answer a request the target made before the watch began (one
    /// snapshot, named after the latest such request, taken now). By
    /// default only requests made after `watching ...` is printed are
    /// answered, since the heap at an earlier request is gone.
    #[arg(long)]
    pub(crate) answer_pending: bool,
    /// With the final snapshot (when a target exits, or the watch stops),
    /// also write the heap at its peak, in every format, its file names
    /// ending in `-peak` (see `snapshot --peak`).
    #[arg(long)]
    pub(crate) peak: bool,
    #[command(flatten)]
    pub(crate) sym: SymArgs,
    #[command(flatten)]
    pub(crate) ages: AgeArgs,
}

/// How many snapshots answering requests `watch --all` keeps per process
/// unless `--keep-requests` says otherwise.
pub const DEFAULT_KEEP_REQUESTS_ALL: usize = 100;

/// Prints what a watch wrote or removed (the lines scripts and tests read).
pub fn print_written(w: &Written) {
    for p in &w.paths {
        println!("wrote {}", p.display());
    }
    for p in &w.removed {
        println!("removed {}", p.display());
    }
    for (p, e) in &w.not_removed {
        eprintln!("heapdump: cannot remove {} (--keep): {e}", p.display());
    }
    if w.partial {
        eprintln!("heapdump: snapshot {} of pid {} is partial", w.seq, w.pid);
    }
    let _ = std::io::stdout().flush();
}

/// `heapdump watch`: returns the exit status.
pub fn command(a: WatchArgs) -> anyhow::Result<i32> {
    install_stop_handlers();
    // `watch` starts no program, so nothing inherits the raised limit.
    descriptor_limit::raise();
    let opts = WatchOptions {
        dir: a.dir,
        formats: a.format,
        interval: a.interval,
        symbolize: !a.sym.no_symbolize,
        render: RenderOptions {
            text: TextOptions::default(),
            per_thread: a.sym.per_thread,
        },
        poll: a.poll,
        keep_allocator_frames: a.sym.keep_allocator_frames,
        answer_pending: a.answer_pending,
        keep: a.keep.map(|n| n as usize),
        ages: a.ages.filter(),
        all: a.all,
        peak: a.peak,
        scan: a.scan,
        max_total: a.max_total,
        min_request_interval: a.min_request_interval,
        keep_requests: a
            .keep_requests
            .map(|n| n as usize)
            .or(a.all.then_some(DEFAULT_KEEP_REQUESTS_ALL)),
    };
    let dir = opts.dir.clone();
    let watcher = Watcher::open(&a.pids, opts)?;
    // This line tells scripts (and the tests) that requests from now on
    // are answered.
    println!(
        "watching {} (snapshots into {})",
        a.pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" "),
        dir.display()
    );
    std::io::stdout().flush()?;
    watcher.run(&AtomicBool::new(false), print_written)?;
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flooding_process_deletes_its_own_snapshots_not_anothers() {
        let dir = std::env::temp_dir().join(format!("heapdump-fair-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let file = |pid: u32, seq: u32| dir.join(format!("heapdump-{pid}-{seq:04}-signal-x.json"));
        // The evidence of pid 7: three snapshots, written first (oldest),
        // and of pid 8: one, larger than any of the flooder's.
        for seq in 1..=3 {
            std::fs::write(file(7, seq), [0u8; 100]).unwrap();
        }
        std::fs::write(file(8, 1), [0u8; 600]).unwrap();
        // pid 9 floods: forty snapshots.
        for seq in 1..=40 {
            std::fs::write(file(9, seq), [0u8; 100]).unwrap();
        }
        let mut written = Written {
            pid: 9,
            seq: 40,
            reason: Reason::Request(String::new()),
            paths: vec![file(9, 40)],
            live_bytes: 0,
            partial: false,
            removed: Vec::new(),
            not_removed: Vec::new(),
        };
        enforce_total_fairly(&dir, 1000, &mut written);
        assert!(file(7, 3).exists(), "pid 7's newest snapshot was deleted");
        assert!(file(8, 1).exists(), "pid 8's only snapshot was deleted");
        assert!(file(9, 40).exists(), "the file just written was deleted");
        let left: u64 = std::fs::read_dir(&dir)
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .sum();
        assert!(left <= 1000, "{left} bytes left");
        let flooder_removed = written
            .removed
            .iter()
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_string_lossy()
                    .starts_with("heapdump-9-")
            })
            .count();
        // The flooder lost files while it held the most (down to 200
        // bytes), then pid 7 its oldest, holding 300.
        assert_eq!(flooder_removed, 38);
        assert_eq!(written.removed.len(), 39);
        assert!(!file(7, 1).exists());
        assert_eq!(pid_of_file("heapdump-123-0001-exit-x.pb.gz"), Some(123));
        assert_eq!(pid_of_file("notes.txt"), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
