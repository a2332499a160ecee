//! Taking a snapshot: walk the live table, aggregate per stack and per
//! thread, read the counters, and symbolize the stacks.
//!
//! The walk goes first and the stack catalog second, so every stack key a
//! live record names was already published when the catalog is read.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant, SystemTime};

use heapdump_table::{AllocationsReader, DroppedReason, ResourceKey, ResourcesReader, TableError};
use indicatif::{ProgressBar, ProgressStyle};

use crate::process::age::{AgeFilter, Clock};
use crate::process::discovery::Target;
use crate::symbolization::maps::Mapping;
use crate::symbolization::plumbing;
use crate::symbolization::symbolizer::{self, Frame, Symbolizer};

/// Process-wide totals.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Totals {
    /// Bytes in live blocks (sum over the walk).
    pub live_bytes: u64,
    /// Live blocks (count from the walk).
    pub live_blocks: u64,
    /// Bytes ever allocated (header counter).
    pub alloc_bytes: u64,
    /// Blocks ever allocated (header counter).
    pub alloc_blocks: u64,
    /// Highest live bytes seen (header counter).
    pub peak_bytes: u64,
    /// How far the true high-water mark may lie above `peak_bytes`: 1/64
    /// of it (a smaller rise does not move the recorded peak) plus the
    /// writers' running-total lag (64 KiB per thread recording at
    /// the same time).
    pub peak_tolerance: u64,
}

/// Live use of one thread (the thread that allocated each live block).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ThreadStat {
    /// Kernel thread id (0 when the record is unreadable).
    pub tid: u64,
    /// Thread name.
    pub name: String,
    /// Bytes in live blocks allocated by this thread.
    pub live_bytes: u64,
    /// Live blocks allocated by this thread.
    pub live_blocks: u64,
}

/// One allocation site: a distinct stack trace.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Site {
    /// Return addresses, leaf (caller of malloc) first.
    pub addresses: Vec<u64>,
    /// Symbolized frames, leaf first, inlined frames expanded.
    pub frames: Vec<Frame>,
    /// Bytes in live blocks.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Bytes ever allocated from this stack.
    pub alloc_bytes: u64,
    /// Blocks ever allocated from this stack.
    pub alloc_blocks: u64,
    /// Live use per thread: (index into `Snapshot::threads`, bytes, blocks).
    pub by_thread: Vec<(usize, u64, u64)>,
    /// When the oldest live block of this site was allocated.
    pub oldest: Option<SystemTime>,
    /// When the newest live block of this site was allocated.
    pub newest: Option<SystemTime>,
}

impl Site {
    /// How long before `at` (the snapshot's time) the site's oldest live
    /// block was allocated, if both are known.
    pub fn oldest_age(&self, at: Option<SystemTime>) -> Option<Duration> {
        Some(at?.duration_since(self.oldest?).unwrap_or_default())
    }

    /// Takes in the allocation times of another site's live blocks.
    fn merge_times(&mut self, oldest: Option<SystemTime>, newest: Option<SystemTime>) {
        self.oldest = match (self.oldest, oldest) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        self.newest = match (self.newest, newest) {
            (Some(a), Some(b)) => Some(a.max(b)),
            (a, b) => a.or(b),
        };
    }
}

/// The blocks a snapshot was restricted to by allocation time
/// (`--older-than`, `--newer-than`): sites and threads count only these;
/// totals stay those of the whole heap.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Selection {
    /// Blocks allocated before this time.
    pub older_than: Option<SystemTime>,
    /// Blocks allocated at or after this time.
    pub newer_than: Option<SystemTime>,
    /// Bytes in the selected live blocks.
    pub live_bytes: u64,
    /// Selected live blocks.
    pub live_blocks: u64,
}

/// The snapshot request this snapshot answers.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Request {
    /// The request counter value answered.
    pub count: u64,
    /// Its name (empty for a signal).
    pub name: String,
    /// When it was made (wall clock), if known.
    pub time: Option<SystemTime>,
}

/// Timing of one snapshot.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timing {
    /// Time spent walking the live table.
    pub walk: Duration,
    /// Time spent symbolizing.
    pub symbolize: Duration,
    /// Nodes examined by the walk.
    pub nodes: u64,
}

/// A heap snapshot of one process.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub process: String,
    /// Command line.
    pub cmdline: Vec<String>,
    /// When the walk started.
    pub taken_at: Option<SystemTime>,
    /// Totals.
    pub totals: Totals,
    /// Dropped events by reason name (only non-zero reasons).
    pub dropped: BTreeMap<String, u64>,
    /// Threads, registration order.
    pub threads: Vec<ThreadStat>,
    /// Sites, by live bytes then allocated bytes, descending.
    pub sites: Vec<Site>,
    /// Executable mappings with build IDs.
    pub mappings: Vec<Mapping>,
    /// Why the snapshot is incomplete, if it is.
    pub partial: Option<String>,
    /// The request answered, if any.
    pub request: Option<Request>,
    /// Whether frames carry symbols.
    pub symbolized: bool,
    /// The blocks selected by allocation time, if the snapshot was
    /// restricted to some.
    pub selection: Option<Selection>,
    /// What the snapshot cannot show, in words (see
    /// [`crate::process::visibility`]); empty when nothing is known.
    pub notes: Vec<String>,
    /// How the agent walked the stacks (`fp`, `cfi+fp`, `cfi`, or
    /// `unknown` for agents that did not record it).
    pub unwinder: String,
    /// Sampled mode: the mean bytes between sampled allocations; every
    /// count and byte figure is then an unbiased estimate. `None`: every
    /// allocation was recorded.
    pub sampling: Option<u64>,
    /// For a process `heapdump attach` attached to: since when it is
    /// recorded, and what its allocator says of the whole heap. `None`
    /// for a process recorded since it started.
    pub recording: Option<Recording>,
    /// The memory curve from the start of recording to the snapshot (its
    /// last point is the snapshot's own totals); `None` for agents older
    /// than format 1.4.
    pub timeline: Option<Timeline>,
    /// Set when the snapshot is the heap at its peak (`snapshot --peak`):
    /// sites, threads and totals are then the heap's then.
    pub peak: Option<PeakInfo>,
    /// Timing.
    pub timing: Timing,
}

/// The moment a `--peak` snapshot shows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PeakInfo {
    /// When the heap was at its peak.
    pub time: SystemTime,
    /// Live bytes then, as rebuilt (the sites' sum).
    pub live_bytes: u64,
    /// How far below the true high-water mark this may be, bytes: 1/64 of
    /// it (a smaller rise does not move the recorded peak) plus the
    /// writers' running-total lag (64 KiB per thread recording at
    /// the same time).
    pub tolerance: u64,
    /// Whether what is shown is the heap at its peak (else the heap now:
    /// the curve stood higher before, and no composition was kept then).
    pub at_peak: bool,
}

/// One point of the memory curve.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TimelinePoint {
    /// When (wall clock).
    pub time: SystemTime,
    /// Live bytes then.
    pub live_bytes: u64,
    /// Live blocks then.
    pub live_blocks: u64,
    /// Bytes allocated since recording started, then.
    pub alloc_bytes: u64,
}

/// The memory curve (see `heapdump_table::timeline`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Timeline {
    /// Points, oldest first; older ones thinned (coarser the older).
    pub points: Vec<TimelinePoint>,
    /// Points thinned away so far.
    pub thinned: u64,
}

impl Timeline {
    /// The highest point (the earliest of equals).
    pub fn peak(&self) -> Option<&TimelinePoint> {
        self.points.iter().rev().max_by_key(|p| p.live_bytes)
    }

    /// One line for reports: start, peak and when, now.
    pub fn describe(&self, now: Option<SystemTime>) -> Option<String> {
        use crate::formats::text::human_bytes;
        let first = self.points.first()?;
        let last = self.points.last()?;
        let peak = self.peak()?;
        let ago = |t: SystemTime| {
            now.and_then(|n| n.duration_since(t).ok())
                .map(|d| {
                    format!(
                        " ({} ago)",
                        humantime::format_duration(Duration::from_secs(d.as_secs()))
                    )
                })
                .unwrap_or_default()
        };
        Some(format!(
            "memory over time: {} at {}{}, peak {} at {}{}, now {} ({} points{})",
            human_bytes(first.live_bytes),
            crate::formats::json::rfc3339(first.time),
            ago(first.time),
            human_bytes(peak.live_bytes),
            crate::formats::json::rfc3339(peak.time),
            ago(peak.time),
            human_bytes(last.live_bytes),
            self.points.len(),
            if self.thinned > 0 {
                format!(", older ones thinned: {} dropped", self.thinned)
            } else {
                String::new()
            }
        ))
    }
}

/// Whether the target's agent records the heap's peak (`snapshot --peak`
/// needs one of format 1.4 or later): an error in words when not. A
/// process whose heap never rose enough to move the peak has its peak now.
pub fn peak_recorded(target: &Target) -> Result<(), String> {
    if heapdump_table::timeline::kept_by(target.allocations.header().version_minor) {
        return Ok(());
    }
    Err(format!(
        "pid {}'s agent (format 1.{}) does not record the heap's peak: it needs an agent of \
         format 1.4 or later",
        target.pid,
        target.allocations.header().version_minor
    ))
}

/// The memory curve of a target's regions as it stands now; `None` when
/// the writer keeps none. Read when the snapshot's time is taken: the
/// writers go on thinning the curve's older half while a snapshot walks
/// and symbolizes (a second or more), and only points up to the snapshot's
/// time are shown, so a curve read at the end of a busy process's
/// snapshot held few of them.
fn read_curve(target: &Target) -> Option<heapdump_table::timeline::Curve> {
    if !heapdump_table::timeline::kept_by(target.allocations.header().version_minor) {
        return None;
    }
    Some(heapdump_table::timeline::read(&target.allocations.view()).unwrap_or_default())
}

/// The memory curve `curve` ([`read_curve`]) of a target's regions,
/// ending with `last` (the snapshot's own totals at its time).
fn timeline(
    target: &Target,
    curve: Option<heapdump_table::timeline::Curve>,
    last: Option<TimelinePoint>,
) -> Option<Timeline> {
    let curve = curve?;
    // One clock pairing for every point: each pairing of the wall and
    // monotonic clocks differs from the next by a microsecond or so, and
    // points read within one coarse tick must not come out of order.
    let clock = Clock::now(target.allocations.header().clock_monotonic_ns);
    let mut points: Vec<TimelinePoint> = curve
        .points
        .iter()
        .filter_map(|p| {
            Some(TimelinePoint {
                time: (p.time_ns != 0)
                    .then(|| clock.wall_of_monotonic(p.time_ns))
                    .flatten()?,
                live_bytes: p.live_bytes,
                live_blocks: p.live_blocks,
                alloc_bytes: p.alloc_bytes,
            })
        })
        .collect();
    if let Some(l) = last {
        // Keep the order: the snapshot's own point comes last.
        points.retain(|p| p.time <= l.time);
        points.push(l);
    }
    Some(Timeline {
        points,
        thinned: curve.thinned,
    })
}

/// What a snapshot of an attached process says of its recording (or of a
/// process recorded since it started whose recording stopped).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Recording {
    /// When `heapdump attach` started recording (the last attach); `None`
    /// for a process recorded since it started.
    pub attached_at: Option<SystemTime>,
    /// When `heapdump detach` stopped it, if it is stopped (in a process
    /// recorded since it started: when the program sandboxed itself, see
    /// the agent's `recorder::sandboxed`).
    pub detached_at: Option<SystemTime>,
    /// The allocator's own figure for the bytes the whole heap holds,
    /// blocks from before the attach included: (where it was read, bytes).
    pub allocator_heap: Option<(String, u64)>,
    /// When the agent read the allocator's figure (it does so about once
    /// a second while recording, never after a detach).
    pub allocator_heap_at: Option<SystemTime>,
}

impl Recording {
    /// One line for reports: "recording since heapdump attach at T: N
    /// recorded since the attach, of M in use according to glibc's
    /// mallinfo2". `recorded_live_bytes`: the recorded live bytes now
    /// ([`Snapshot::recorded_live_now`]; `None`: not known, for the heap
    /// at its peak without a curve, and the line says only what the
    /// allocator holds).
    pub fn describe(
        &self,
        recorded_live_bytes: Option<u64>,
        taken_at: Option<SystemTime>,
    ) -> String {
        use crate::formats::text::human_bytes;
        if self.attached_at.is_none() {
            if let Some(d) = self.detached_at {
                // Recorded since start, stopped by the agent itself.
                return format!(
                    "recording stopped at {} (the program installed a seccomp filter, which \
                     could forbid the agent's system calls; nothing recorded since): {} live \
                     recorded before",
                    crate::formats::json::rfc3339(d),
                    recorded_live_bytes.map_or("?".into(), human_bytes)
                );
            }
        }
        let at = self
            .attached_at
            .map(crate::formats::json::rfc3339)
            .unwrap_or_else(|| "an unknown time".into());
        let mut line = format!("recording since heapdump attach at {at}");
        if let Some(d) = self.detached_at {
            line += &format!(
                ", detached at {} (nothing recorded since)",
                crate::formats::json::rfc3339(d)
            );
        }
        if let Some(b) = recorded_live_bytes {
            line += &format!(": {} live recorded since the attach", human_bytes(b));
        }
        match &self.allocator_heap {
            Some((source, bytes)) => {
                line += &format!(
                    "{} {} in use according to {source}",
                    if recorded_live_bytes.is_some() {
                        ", of"
                    } else {
                        ": now"
                    },
                    human_bytes(*bytes)
                );
                // A figure read a while ago (after a detach, or under a
                // stalled housekeeping thread) says so.
                let age = self
                    .allocator_heap_at
                    .zip(taken_at)
                    .and_then(|(read, now)| now.duration_since(read).ok());
                // The agent reads it about once a second: a heap that
                // moves faster than that may not be in it yet.
                match age {
                    Some(d) if d >= Duration::from_secs(2) => {
                        line += &format!(
                            " (read {} before this snapshot)",
                            humantime::format_duration(Duration::from_secs(d.as_secs()))
                        )
                    }
                    Some(d) => {
                        line += &format!(" (read {} ms before this snapshot)", d.as_millis())
                    }
                    None if self.allocator_heap_at.is_none() => {
                        line += " (read at an unknown time)"
                    }
                    None => {}
                }
            }
            None => line += "; blocks allocated before the attach are not shown",
        }
        line
    }
}

/// The recording facts of a target's regions (`None`: recorded since it
/// started).
pub fn recording(target: &Target) -> Option<Recording> {
    let w = heapdump_table::header::read_attach(&target.allocations.view());
    if w.attached_at == 0 && w.detached_at == 0 {
        return None;
    }
    Some(Recording {
        attached_at: (w.attached_at != 0)
            .then(|| wall_time(target, w.attached_at))
            .flatten(),
        detached_at: (w.detached_at != 0)
            .then(|| wall_time(target, w.detached_at))
            .flatten(),
        allocator_heap: w
            .allocator_heap
            .map(|(src, bytes)| (src.describe().to_string(), bytes)),
        allocator_heap_at: (w.allocator_heap_at != 0)
            .then(|| wall_time(target, w.allocator_heap_at))
            .flatten(),
    })
}

impl Snapshot {
    /// Total dropped events.
    pub fn dropped_total(&self) -> u64 {
        // Saturating: the counters come from the target and may be hostile.
        self.dropped
            .values()
            .fold(0u64, |a, b| a.saturating_add(*b))
    }

    /// Live bytes that sites and threads count: the selection's when there
    /// is one, else the whole heap's.
    pub fn shown_live_bytes(&self) -> u64 {
        self.selection
            .as_ref()
            .map_or(self.totals.live_bytes, |s| s.live_bytes)
    }

    /// The recorded live bytes now, as the allocator's own figure of the
    /// whole heap (read about now) is to be compared with: the totals',
    /// except in a snapshot of the heap at its peak, whose totals are the
    /// peak's; there the curve's last point (the snapshot's own moment).
    /// `None` for such a snapshot without a curve.
    pub fn recorded_live_now(&self) -> Option<u64> {
        match &self.peak {
            Some(p) if p.at_peak => self
                .timeline
                .as_ref()
                .and_then(|t| t.points.last())
                .map(|l| l.live_bytes),
            _ => Some(self.totals.live_bytes),
        }
    }
}

/// How to take a snapshot.
#[derive(Debug, Default)]
pub struct Options<'a> {
    /// Symbolize with this symbolizer (`None`: addresses and modules only).
    pub symbolizer: Option<&'a mut Symbolizer>,
    /// Show a progress bar on stderr (only drawn when stderr is a terminal).
    pub progress: bool,
    /// The request being answered.
    pub request: Option<Request>,
    /// Keep allocator plumbing frames (`alloc::raw_vec::...`,
    /// `__rust_alloc`, `std::allocator<T>::allocate`, ...) at the leaf end
    /// of each stack instead of dropping them (see [`crate::symbolization::plumbing`]).
    pub keep_allocator_frames: bool,
    /// Keep only blocks allocated in this time range (see [`crate::process::age`]).
    pub ages: AgeFilter,
    /// The heap at its peak instead of now (see `heapdump_table::peak`).
    pub peak: bool,
    /// Leave every site's `frames` empty (its `addresses` are kept), for a
    /// caller that symbolizes only a few sites itself with
    /// [`symbolize_sites`] (`serve`'s `/metrics`: its top sites). Ignored
    /// when a symbolizer is given.
    pub addresses_only: bool,
}

/// Drops the leading allocator plumbing frames of every site and merges
/// the sites that become identical, summing their counts; then expands
/// each site's addresses into frames from `table` (the symbolized frames
/// of each address). Works on addresses first, so that stripped frames are
/// never copied: a site is cut after its leading addresses whose frames
/// are all plumbing, plus the leading plumbing (inlined) frames of the
/// next address. `addresses` keep the return addresses of the frames that
/// remain. The order (live bytes, then allocated bytes, descending) is
/// restored.
fn strip_plumbing(sites: Vec<Site>, table: &HashMap<u64, Vec<Frame>>) -> Vec<Site> {
    // Per address: how many of its frames lead with plumbing.
    let plumbing_of = |a: &u64| -> (usize, usize) {
        let frames = table.get(a).map_or(&[][..], Vec::as_slice);
        let n = frames
            .iter()
            .take_while(|f| plumbing::is_allocator_frame(f))
            .count();
        (n, frames.len())
    };
    let mut out: Vec<(Site, usize)> = Vec::with_capacity(sites.len());
    let mut index: HashMap<(Vec<u64>, usize), usize> = HashMap::with_capacity(sites.len());
    let mut merged = false;
    for mut s in sites {
        let mut skip = (0, 0);
        for (i, a) in s.addresses.iter().enumerate() {
            let (n, len) = plumbing_of(a);
            if n < len || len == 0 {
                skip = (i, n);
                break;
            }
            // No break: every frame is plumbing and the stack stays whole.
        }
        s.addresses.drain(..skip.0);
        let key = (s.addresses.clone(), skip.1);
        match index.get(&key) {
            Some(&i) => {
                merged = true;
                let t = &mut out[i].0;
                t.live_bytes = t.live_bytes.saturating_add(s.live_bytes);
                t.live_blocks = t.live_blocks.saturating_add(s.live_blocks);
                t.alloc_bytes = t.alloc_bytes.saturating_add(s.alloc_bytes);
                t.alloc_blocks = t.alloc_blocks.saturating_add(s.alloc_blocks);
                t.by_thread.extend(s.by_thread);
                t.merge_times(s.oldest, s.newest);
            }
            None => {
                index.insert(key, out.len());
                out.push((s, skip.1));
            }
        }
    }
    let mut out: Vec<Site> = out
        .into_iter()
        .map(|(mut s, skip)| {
            s.frames = expand(&s.addresses, table);
            s.frames.drain(..skip.min(s.frames.len()));
            s
        })
        .collect();
    if merged {
        for s in &mut out {
            let mut per: BTreeMap<usize, (u64, u64)> = BTreeMap::new();
            for &(ti, b, n) in &s.by_thread {
                let e = per.entry(ti).or_default();
                e.0 = e.0.saturating_add(b);
                e.1 = e.1.saturating_add(n);
            }
            s.by_thread = per.into_iter().map(|(ti, (b, n))| (ti, b, n)).collect();
        }
        out.sort_by(|a, b| {
            (b.live_bytes, b.alloc_bytes, &a.addresses).cmp(&(
                a.live_bytes,
                a.alloc_bytes,
                &b.addresses,
            ))
        });
    }
    out
}

/// The frames of a stack: each address's symbolized frames, leaf first.
fn expand(addresses: &[u64], table: &HashMap<u64, Vec<Frame>>) -> Vec<Frame> {
    addresses
        .iter()
        .flat_map(|a| table.get(a).cloned().unwrap_or_default())
        .collect()
}

/// Gives each site its frames: symbolizes every distinct address once
/// against `mappings` with `symbolizer` (showing progress on a terminal
/// when asked and there is much to do), or without one records addresses
/// and modules only; then, when symbolized and not told to keep them,
/// drops the leading allocator plumbing frames and merges the sites that
/// become identical (see `strip_plumbing`). Used by [`take`] and to
/// symbolize a saved snapshot later (`heapdump symbolize`).
pub fn symbolize_sites(
    mut sites: Vec<Site>,
    mappings: &[Mapping],
    symbolizer: Option<&mut Symbolizer>,
    keep_allocator_frames: bool,
    progress: bool,
) -> Vec<Site> {
    let symbolized = symbolizer.is_some();
    let mut unique: Vec<u64> = sites
        .iter()
        .flat_map(|s| s.addresses.iter().copied())
        .collect();
    unique.sort_unstable();
    unique.dedup();
    let mut table: HashMap<u64, Vec<Frame>> = HashMap::with_capacity(unique.len());
    match symbolizer {
        Some(sym) => {
            sym.begin();
            let bar = if progress && unique.len() > 200 {
                let b = ProgressBar::new(unique.len() as u64);
                b.set_style(
                    ProgressStyle::with_template("symbolizing {bar:30} {pos}/{len} frames")
                        .unwrap_or_else(|_| ProgressStyle::default_bar()),
                );
                b
            } else {
                ProgressBar::hidden()
            };
            for (i, a) in unique.iter().enumerate() {
                table.insert(*a, sym.symbolize(*a, mappings));
                if i % 64 == 0 {
                    bar.set_position(i as u64);
                }
            }
            bar.finish_and_clear();
        }
        None => {
            for a in &unique {
                table.insert(*a, vec![symbolizer::unsymbolized(*a, mappings)]);
            }
        }
    }
    if symbolized && !keep_allocator_frames {
        sites = strip_plumbing(sites, &table);
    } else {
        for s in &mut sites {
            s.frames = expand(&s.addresses, &table);
        }
    }
    sites
}

/// Live blocks of one (stack, thread) pair found by the walk.
#[derive(Clone, Copy, Debug)]
struct KeyStats {
    /// Bytes (in sampled mode, the estimate: each block weighted).
    bytes: f64,
    /// Blocks (in sampled mode, the estimate).
    blocks: f64,
    /// Record time of the oldest block.
    oldest_us: u64,
    /// Record time of the newest block.
    newest_us: u64,
}

impl KeyStats {
    const EMPTY: KeyStats = KeyStats {
        bytes: 0.0,
        blocks: 0.0,
        oldest_us: u64::MAX,
        newest_us: 0,
    };

    #[inline]
    fn add(&mut self, bytes: f64, blocks: f64, t_us: u64) {
        self.bytes += bytes;
        self.blocks += blocks;
        self.oldest_us = self.oldest_us.min(t_us);
        self.newest_us = self.newest_us.max(t_us);
    }

    #[inline]
    fn merge(&mut self, o: &KeyStats) {
        self.bytes += o.bytes;
        self.blocks += o.blocks;
        self.oldest_us = self.oldest_us.min(o.oldest_us);
        self.newest_us = self.newest_us.max(o.newest_us);
    }
}

/// Walks made before a snapshot with records that never read consistently
/// is reported partial.
pub const WALK_ATTEMPTS: u32 = 3;

/// Converts a monotonic timestamp of the target (0: none) into wall time,
/// the way block times are converted (see [`crate::process::age`]).
pub fn wall_time(target: &Target, monotonic_ns: u64) -> Option<SystemTime> {
    if monotonic_ns == 0 {
        return None;
    }
    Clock::now(target.allocations.header().clock_monotonic_ns).wall_of_monotonic(monotonic_ns)
}

/// The header's sample rate as written, and as used: 0 (exact mode)
/// instead of a rate beyond any sane setting, which is a damaged header.
pub fn sample_rate(target: &Target) -> (u64, u64) {
    let raw = heapdump_table::header::read_sample_rate(&target.allocations.view());
    let used = if raw > heapdump_table::sampling::MAX_RATE {
        0
    } else {
        raw
    };
    (raw, used)
}

/// What one live block of `size` bytes stands for, as (bytes, blocks): in
/// sampled mode (`rate` > 0) each sampled block is weighted so that sums
/// are unbiased estimates; in exact mode it is itself.
fn weigh(size: u64, rate: u64) -> (f64, f64) {
    if rate == 0 {
        (size as f64, 1.0)
    } else {
        let w = heapdump_table::sampling::weight(size, rate);
        (size as f64 * w, w)
    }
}

/// The live heap of a sampled process as a snapshot totals it: the
/// estimated (bytes, blocks), summed and rounded exactly as [`take`] does,
/// so `heapdump list` and a snapshot of a quiet process agree. `None` in
/// exact mode (the header's counters are exact there).
pub fn estimated_live(target: &Target) -> Result<Option<(u64, u64)>, TableError> {
    let (_, rate) = sample_rate(target);
    if rate == 0 {
        return Ok(None);
    }
    let allocs = AllocationsReader::new(&target.allocations)?;
    let mut attempt = 0;
    loop {
        let (mut bytes, mut blocks) = (0f64, 0f64);
        let stats = allocs.walk(|r| {
            let (b, n) = weigh(r.size, rate);
            bytes += b;
            blocks += n;
        });
        attempt += 1;
        if stats.unstable == 0 || attempt >= WALK_ATTEMPTS {
            return Ok(Some((bytes.round() as u64, blocks.round() as u64)));
        }
    }
}

/// Takes a snapshot of `target`, symbolizing against `mappings` (read from
/// `/proc/PID/maps` now, or recorded earlier if the target has exited).
pub fn take(
    target: &Target,
    mappings: &[Mapping],
    opts: Options<'_>,
) -> Result<Snapshot, TableError> {
    let allocs = AllocationsReader::new(&target.allocations)?;
    let resources = ResourcesReader::new(&target.resources)?;
    let clock = Clock::now(target.allocations.header().clock_monotonic_ns);
    let taken_at = clock.now_wall().unwrap_or_else(SystemTime::now);
    let curve = read_curve(target);
    let bounds = clock.bounds(&opts.ages);
    let t0 = Instant::now();
    // Sampled mode: each live block stands for `weight(size)` blocks. A
    // rate beyond any sane setting is a damaged header: refused.
    let (raw_rate, rate) = sample_rate(target);
    let weigh = |size: u64| weigh(size, rate);
    // The recorded peak: its moment, and (rebuilt below, in every
    // snapshot) the heap then. `--peak` rebuilds the heap at it.
    let recorded = heapdump_table::peak::read(&target.allocations.view());
    let peak = if opts.peak { recorded } else { None };
    let before_peak = |t_us: u64| peak.is_none_or(|p| t_us <= p.time_us);
    let before_recorded = |t_us: u64| recorded.is_some_and(|p| t_us <= p.time_us);

    // Aggregate during the walk: per (stack key, thread key). A walk that
    // met records being modified throughout (a writer preempted mid-update
    // on a loaded machine) is retried a few times before it is reported
    // partial; a target killed mid-update stays partial. Blocks outside the
    // age bounds count in the totals only.
    let mut attempt = 0;
    let (per_key, live_bytes, live_blocks, selected, stats, now_live, mut at_recorded) = loop {
        // ahash: a keyed hash (the keys are the target's words) much
        // cheaper than SipHash, which was a fifth of a scrape's time at a
        // million blocks.
        let mut per_key: HashMap<(ResourceKey, ResourceKey), KeyStats, ahash::RandomState> =
            HashMap::default();
        let mut run: Option<((ResourceKey, ResourceKey), KeyStats)> = None;
        let (mut live_bytes, mut live_blocks) = (0f64, 0f64);
        let mut selected = (0f64, 0f64);
        // The heap now (differs from the totals in a `--peak` snapshot).
        let mut now_live = (0f64, 0f64);
        // The blocks still live that were allocated by the recorded peak.
        let mut at_recorded = (0f64, 0f64);
        let stats = allocs.walk(|r| {
            let (bytes, blocks) = weigh(r.size);
            now_live.0 += bytes;
            now_live.1 += blocks;
            if before_recorded(r.timestamp_us) {
                at_recorded.0 += bytes;
                at_recorded.1 += blocks;
            }
            if !before_peak(r.timestamp_us) {
                // Allocated after the peak: not part of the heap then.
                return;
            }
            live_bytes += bytes;
            live_blocks += blocks;
            if !bounds.admits(r.timestamp_us) {
                return;
            }
            selected.0 += bytes;
            selected.1 += blocks;
            // Neighbouring records often share a key (a site allocating in
            // a loop takes consecutive nodes): a run is summed here and
            // folded into the map once.
            let key = (r.stack, r.thread);
            match &mut run {
                Some((k, st)) if *k == key => st.add(bytes, blocks, r.timestamp_us),
                _ => {
                    if let Some((k, st)) = run.take() {
                        per_key.entry(k).or_insert(KeyStats::EMPTY).merge(&st);
                    }
                    let mut st = KeyStats::EMPTY;
                    st.add(bytes, blocks, r.timestamp_us);
                    run = Some((key, st));
                }
            }
        });
        if let Some((k, st)) = run.take() {
            per_key.entry(k).or_insert(KeyStats::EMPTY).merge(&st);
        }
        attempt += 1;
        if stats.unstable == 0 || attempt >= WALK_ATTEMPTS {
            break (
                per_key,
                live_bytes,
                live_blocks,
                selected,
                stats,
                now_live,
                at_recorded,
            );
        }
    };
    let walk_time = t0.elapsed();
    let (mut per_key, mut live_bytes, mut live_blocks) = (per_key, live_bytes, live_blocks);
    let mut peak_partial = None;
    if let Some(p) = &recorded {
        // The blocks freed since the peak that were allocated before it,
        // per stack (their threads are not recorded).
        let (freed, why) = resources.peak_freed(p.generation);
        peak_partial = why;
        for (stack, (count, bytes)) in freed {
            // Sampled mode counts each freed block as the (x1024) number
            // it stood for, and its bytes as the estimate.
            let blocks = if rate == 0 {
                count as f64
            } else {
                count as f64 / 1024.0
            };
            let bytes = bytes as f64;
            at_recorded.0 += bytes;
            at_recorded.1 += blocks;
            if peak.is_none() {
                continue;
            }
            live_bytes += bytes;
            live_blocks += blocks;
            let e = per_key
                .entry((stack, ResourceKey(0)))
                .or_insert(KeyStats::EMPTY);
            e.bytes += bytes;
            e.blocks += blocks;
        }
    }
    if opts.peak && peak.is_none_or(|_| now_live.0 > live_bytes) {
        // No rise was ever recorded (a server whose requests allocate and
        // free: the live heap never moved a writer's batch), or the heap
        // is higher now than at the recorded peak: the heap at its peak
        // is the heap now.
        let mut snap = take(
            target,
            mappings,
            Options {
                peak: false,
                ..opts
            },
        )?;
        let now = snap.taken_at.unwrap_or(taken_at);
        let live = snap.totals.live_bytes;
        let curve_peak = snap.timeline.as_ref().and_then(Timeline::peak).copied();
        let (time, at_peak) = match curve_peak {
            // The curve stood higher before and no composition was kept
            // then (no rise was recorded): the heap now is what can be
            // shown, and it says so; the high-water mark is at least the
            // curve's, so the tolerance is measured from the heap shown.
            Some(pt) if pt.live_bytes > live => {
                snap.notes.push(format!(
                    "the heap's composition at its peak ({}, {}) was not recorded: this is the \
                     heap now",
                    crate::formats::text::human_bytes(pt.live_bytes),
                    humantime::format_rfc3339_micros(pt.time)
                ));
                (now, false)
            }
            // When the heap first stood this high, as the curve's peak
            // names it (a heap flat at its peak reached it before now):
            // one moment for the peak in the header and the curve.
            Some(pt) if pt.live_bytes == live && pt.time <= now => (pt.time, true),
            _ => (now, true),
        };
        snap.peak = Some(PeakInfo {
            time,
            live_bytes: live,
            tolerance: (snap.totals.peak_bytes + snap.totals.peak_tolerance).saturating_sub(live),
            at_peak,
        });
        return Ok(snap);
    }
    // Estimates are summed exactly (f64) and rounded once, per key and in
    // total; in exact mode every sum is an integer below 2^53, so exact.
    let (live_bytes, live_blocks) = (live_bytes.round() as u64, live_blocks.round() as u64);
    let selected = (selected.0.round() as u64, selected.1.round() as u64);
    let counters = allocs.counters();
    let catalog = resources.stacks();
    let (thread_records, threads_partial) = resources.threads();

    let mut partial: Vec<String> = Vec::new();
    if raw_rate != rate {
        partial.push(format!(
            "the header's sample rate ({raw_rate} bytes) is not plausible: blocks are counted unweighted"
        ));
    }
    if let Some(p) = stats.partial_reason() {
        partial.push(p);
    }
    if let Some(p) = &catalog.partial {
        partial.push(format!("stack catalog: {p}"));
    }
    if let Some(p) = threads_partial {
        partial.push(format!("thread list: {p}"));
    }
    if let Some(p) = peak_partial.filter(|_| peak.is_some()) {
        partial.push(format!("peak blocks: {p}"));
    }
    let uncounted = counters.dropped[DroppedReason::PeakUncounted as usize];
    if uncounted > 0 && peak.is_some() {
        partial.push(format!(
            "{uncounted} free(s) of blocks from before the peak could not be counted (their \
             threads' peak blocks had no room for so many stacks): the heap at the peak held \
             more than shown"
        ));
    }

    // Threads: registration order. The records of one thread renamed
    // share its tid and serial: one thread, under its latest name (the
    // record written last, at the highest offset). A tid alone would also
    // join a later thread given the same tid.
    let mut threads: Vec<ThreadStat> = Vec::new();
    let mut thread_index: HashMap<ResourceKey, usize> = HashMap::new();
    let mut recs = thread_records;
    recs.sort_by_key(|(key, t)| (t.serial, key.0));
    let mut one_thread: HashMap<(u64, u64), usize> = HashMap::new();
    // The latest thread of each tid (a tid can be reused by a later thread).
    let mut latest: HashMap<u64, usize> = HashMap::new();
    for (key, t) in recs {
        let i = *one_thread.entry((t.tid, t.serial)).or_insert_with(|| {
            threads.push(ThreadStat {
                tid: t.tid,
                ..Default::default()
            });
            threads.len() - 1
        });
        thread_index.insert(key, i);
        latest.insert(t.tid, i);
        threads[i].name = t.name;
    }
    // Threads still running show under their current names (the agent
    // records a name when the thread starts allocating and re-reads it
    // only now and then).
    if let Some(live) = target.live_thread_names() {
        for (tid, i) in latest {
            if let Some(name) = live.get(&tid) {
                threads[i].name.clone_from(name);
            }
        }
    }

    // Sites: every catalog stack, plus any live key missing from it.
    let mut sites: Vec<Site> = catalog
        .stacks
        .iter()
        .map(|s| Site {
            addresses: s.frames.clone(),
            alloc_bytes: s.alloc_bytes,
            alloc_blocks: s.alloc_count,
            ..Default::default()
        })
        .collect();
    let mut extra_sites: HashMap<ResourceKey, usize> = HashMap::new();
    let mut unknown_stacks = 0u64;
    let mut per_site_thread: HashMap<(usize, usize), (u64, u64)> = HashMap::new();
    for ((stack, thread), k) in per_key {
        let (bytes, blocks) = (k.bytes.round() as u64, k.blocks.round() as u64);
        let site = match catalog.by_key.get(&stack) {
            Some(&i) => i,
            None => *extra_sites.entry(stack).or_insert_with(|| {
                let addresses = match resources.stack(stack) {
                    Ok(s) => s.frames,
                    Err(_) => {
                        unknown_stacks += 1;
                        Vec::new()
                    }
                };
                sites.push(Site {
                    addresses,
                    ..Default::default()
                });
                sites.len() - 1
            }),
        };
        sites[site].live_bytes = sites[site].live_bytes.saturating_add(bytes);
        sites[site].live_blocks += blocks;
        if k.oldest_us != u64::MAX {
            sites[site].merge_times(clock.wall_of(k.oldest_us), clock.wall_of(k.newest_us));
        }
        let ti = match thread_index.get(&thread) {
            Some(&i) => i,
            None => {
                let t = resources.thread(thread).ok();
                let unknown = if thread.0 == 0 && peak.is_some() {
                    "<freed since the peak>"
                } else {
                    "<unknown thread>"
                };
                threads.push(ThreadStat {
                    tid: t.as_ref().map_or(0, |t| t.tid),
                    name: t.map_or_else(|| unknown.to_string(), |t| t.name),
                    ..Default::default()
                });
                thread_index.insert(thread, threads.len() - 1);
                threads.len() - 1
            }
        };
        threads[ti].live_bytes = threads[ti].live_bytes.saturating_add(bytes);
        threads[ti].live_blocks += blocks;
        let e = per_site_thread.entry((site, ti)).or_default();
        e.0 = e.0.saturating_add(bytes);
        e.1 += blocks;
    }
    if unknown_stacks > 0 {
        partial.push(format!(
            "{unknown_stacks} stack key(s) named by live blocks could not be read"
        ));
    }
    for ((site, ti), (bytes, blocks)) in per_site_thread {
        sites[site].by_thread.push((ti, bytes, blocks));
    }
    for s in &mut sites {
        s.by_thread.sort_unstable();
    }
    // Blocks live now were allocated, so a cumulative counter below the live
    // count only means the counters raced the walk: keep alloc >= live.
    for s in &mut sites {
        s.alloc_blocks = s.alloc_blocks.max(s.live_blocks);
        s.alloc_bytes = s.alloc_bytes.max(s.live_bytes);
    }
    sites.sort_by(|a, b| {
        (b.live_bytes, b.alloc_bytes, &a.addresses).cmp(&(
            a.live_bytes,
            a.alloc_bytes,
            &b.addresses,
        ))
    });

    let t1 = Instant::now();
    let symbolized = opts.symbolizer.is_some();
    let mut symbolizer = opts.symbolizer;
    if let Some(sym) = symbolizer.as_deref_mut() {
        let root = mappings
            .iter()
            .find_map(|m| m.local.as_ref())
            .map(|l| l.root.clone());
        sym.use_perf_map(target.pid, root);
    }
    let sites = if opts.addresses_only && symbolizer.is_none() {
        sites
    } else {
        symbolize_sites(
            sites,
            mappings,
            symbolizer.as_deref_mut(),
            opts.keep_allocator_frames,
            opts.progress,
        )
    };
    let symbolizer_notes = symbolizer.map(|s| s.take_notes()).unwrap_or_default();

    let mut dropped = BTreeMap::new();
    for r in DroppedReason::ALL {
        let n = counters.dropped[r as usize];
        if n > 0 {
            dropped.insert(r.name().to_string(), n);
        }
    }
    for (i, n) in counters.dropped.iter().enumerate() {
        if i >= DroppedReason::ALL.len() && *n > 0 {
            dropped.insert(format!("reason_{i}"), *n);
        }
    }

    let mut snap = Snapshot {
        pid: target.pid,
        process: target.name.clone(),
        cmdline: target.cmdline.clone(),
        taken_at: Some(taken_at),
        totals: if rate == 0 {
            Totals {
                live_bytes,
                live_blocks,
                alloc_bytes: counters.total_bytes.max(live_bytes),
                alloc_blocks: counters.total_allocs.max(live_blocks),
                // Set below, with the curve: one figure everywhere.
                peak_bytes: live_bytes,
                peak_tolerance: 0,
            }
        } else {
            // The header counts the sampled blocks themselves; the
            // per-stack counters count each sampled allocation as the
            // (randomly rounded) number it stands for.
            let alloc_bytes = sites.iter().map(|s| s.alloc_bytes).sum::<u64>();
            let alloc_blocks = sites.iter().map(|s| s.alloc_blocks).sum::<u64>();
            Totals {
                live_bytes,
                live_blocks,
                alloc_bytes: alloc_bytes.max(live_bytes),
                alloc_blocks: alloc_blocks.max(live_blocks),
                peak_bytes: live_bytes,
                peak_tolerance: 0,
            }
        },
        sampling: (rate != 0).then_some(rate),
        recording: recording(target),
        timeline: None,
        peak: None,
        dropped,
        threads,
        sites,
        mappings: mappings.to_vec(),
        partial: (!partial.is_empty()).then(|| partial.join("; ")),
        request: opts.request,
        symbolized,
        selection: opts.ages.is_set().then(|| Selection {
            older_than: opts.ages.older_than.and_then(|w| clock.wall_of_when(w)),
            newer_than: opts.ages.newer_than.and_then(|w| clock.wall_of_when(w)),
            live_bytes: selected.0,
            live_blocks: selected.1,
        }),
        notes: {
            let mut n = notes(
                target.blind_spots(),
                counters.total_allocs,
                (rate != 0).then_some(rate),
                fork_parent(target),
            );
            n.extend(symbolizer_notes);
            if mappings.len() >= crate::symbolization::maps::MAX_MAPPINGS {
                n.push(format!(
                    "the process has {} file mappings or more: only as many are kept, its \
                     executable ones first; frames in the others are bare addresses",
                    crate::symbolization::maps::MAX_MAPPINGS
                ));
            }
            n
        },
        unwinder: heapdump_table::header::read_unwinder(&target.allocations.view())
            .name()
            .to_string(),
        timing: Timing {
            walk: walk_time,
            symbolize: t1.elapsed(),
            nodes: stats.nodes,
        },
    };
    // Threads whose unsettled live bytes the running total (so the peak)
    // may miss at once: every thread seen, or fewer where the agent says
    // how many recorded at the same time at most (threads that come and
    // go, one after another, do not add up).
    let threads_seen = snap.threads.len().max(1) as u64;
    let batching = heapdump_table::header::read_batching_threads(&target.allocations.view())
        .map_or(threads_seen, |n| n.min(threads_seen));
    let tolerance_of = |bytes: u64| {
        bytes / heapdump_table::peak::TOLERANCE_DIV
            + batching * heapdump_table::allocations_table::LIVE_BATCH as u64
    };
    // The curve ends at the heap now (a `--peak` snapshot's totals are the
    // heap at the peak; the exact counters give now).
    let last = if peak.is_some() {
        TimelinePoint {
            time: taken_at,
            live_bytes: now_live.0.round() as u64,
            live_blocks: now_live.1.round() as u64,
            alloc_bytes: snap.totals.alloc_bytes,
        }
    } else {
        let t = &snap.totals;
        TimelinePoint {
            time: taken_at,
            live_bytes: t.live_bytes,
            live_blocks: t.live_blocks,
            alloc_bytes: t.alloc_bytes,
        }
    };
    snap.timeline = timeline(target, curve, Some(last));
    // Nothing was recorded before the curve's first point (where recording
    // began): a moment of the coarse clock that converts to just before it
    // is that point's (so the peak is never drawn before the curve starts).
    let curve_start = snap
        .timeline
        .as_ref()
        .and_then(|tl| tl.points.first())
        .map(|p| p.time);
    let recorded_time = |p: &heapdump_table::peak::Peak| {
        // The agent truncates the coarse clock's reading to microseconds
        // for the peak and keeps it whole for the curve: the end of the
        // microsecond orders the peak after the curve's points of the same
        // reading (else the rebuilt point lands before lower points of
        // its own moment, a spike in a heap that never shrank).
        let t = clock
            .wall_of(p.time_us)
            .map_or(taken_at, |t| t + Duration::from_nanos(999));
        curve_start.map_or(t, |start| t.max(start))
    };
    if let Some(p) = &peak {
        snap.peak = Some(PeakInfo {
            time: recorded_time(p),
            live_bytes: snap.totals.live_bytes,
            tolerance: 0,
            at_peak: true,
        });
    }
    // One peak, shown alike in the totals, the curve, JSON, pprof and the
    // report: the highest of the heap now, the heap rebuilt at the
    // recorded peak, and the curve's highest point (a running total, up
    // to the writers' batches off).
    let mut candidates = vec![(last.live_bytes, last.live_blocks, taken_at)];
    if let Some(p) = &recorded {
        candidates.push((
            at_recorded.0.round() as u64,
            at_recorded.1.round() as u64,
            recorded_time(p),
        ));
    }
    if let Some(tl) = &snap.timeline {
        if let Some(pt) = tl.peak() {
            candidates.push((pt.live_bytes, pt.live_blocks, pt.time));
        }
    }
    // Of equal heaps the earliest: the high-water mark is when the heap
    // reached it (the curve may have its first point at that level only
    // later, or only now: the running total lags by the writers' batches).
    let (peak_bytes, peak_blocks, peak_time) = candidates
        .into_iter()
        .max_by_key(|c| (c.0, std::cmp::Reverse(c.2)))
        .expect("the heap now is a candidate");
    snap.totals.peak_bytes = peak_bytes;
    // In exact mode the heap never held more than was allocated since
    // recording began (every allocation is counted), so the true
    // high-water mark is also at most that: a heap that never shrank has
    // its peak exactly, whatever the batches.
    let ceiling = |shown: u64| match rate {
        0 => snap.totals.alloc_bytes.saturating_sub(shown),
        _ => u64::MAX,
    };
    // A `--peak` snapshot shows the heap rebuilt at the peak (at most the
    // peak figure): one tolerance above both.
    let shown = snap.peak.as_ref().map_or(peak_bytes, |p| p.live_bytes);
    snap.totals.peak_tolerance = tolerance_of(peak_bytes).min(ceiling(shown));
    if let Some(p) = &mut snap.peak {
        // The heap rebuilt may lie below the peak figure (the curve's
        // running total stood higher): the true high-water mark is then
        // that much further above the heap shown.
        p.tolerance = (peak_bytes.saturating_sub(p.live_bytes) + snap.totals.peak_tolerance)
            .min(ceiling(p.live_bytes));
    }
    if let Some(tl) = &mut snap.timeline {
        if tl.peak().is_none_or(|pt| {
            pt.live_bytes < peak_bytes || (pt.live_bytes == peak_bytes && pt.time > peak_time)
        }) {
            // The rebuilt peak lies between two points of the curve (or
            // the curve reached it only later): put it there, so the
            // curve's highest point is the peak, at the same moment.
            let at = tl.points.partition_point(|p| p.time <= peak_time);
            let alloc_bytes = at
                .checked_sub(1)
                .map(|i| tl.points[i].alloc_bytes)
                .unwrap_or(0)
                .max(peak_bytes);
            tl.points.insert(
                at,
                TimelinePoint {
                    time: peak_time,
                    live_bytes: peak_bytes,
                    live_blocks: peak_blocks,
                    alloc_bytes,
                },
            );
        }
    }
    Ok(snap)
}

/// The process whose fork made a target ([`fork_parent`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForkParent {
    /// Its pid.
    pub pid: u32,
    /// Whether a process of that pid runs now, not a zombie (as far as
    /// `/proc` says: the pid may have been reused).
    pub running: bool,
    /// How many blocks the agent copied from that process's table at the
    /// fork (`None`: none were; the table starts empty at the fork).
    pub inherited: Option<u64>,
}

/// The process whose fork made `target`, when its agent said so.
pub fn fork_parent(target: &Target) -> Option<ForkParent> {
    let view = target.allocations.view();
    let pid = heapdump_table::header::read_forked_from(&view)?;
    Some(ForkParent {
        pid,
        inherited: heapdump_table::header::read_inherited(&view),
        // Not a zombie (a daemon's parent that its own parent has not
        // reaped yet).
        running: crate::process::proc_text::read(format!("/proc/{pid}/stat"))
            .ok()
            .and_then(|stat| Some(stat.rsplit_once(')')?.1.trim_start().starts_with('Z')))
            == Some(false),
    })
}

/// What a snapshot cannot show: "no allocation recorded" when the agent
/// saw none, that a fork child's table starts at its fork
/// (`forked_from`), and `blind_spots`, what the program's files say the agent
/// cannot see ([`crate::process::visibility`]).
pub fn notes(
    blind_spots: &[String],
    total_allocs: u64,
    sample_rate: Option<u64>,
    forked_from: Option<ForkParent>,
) -> Vec<String> {
    let mut notes = blind_spots.to_vec();
    // Why a fork child's table may start empty (`fork_inheritance` in
    // the agent).
    const NOT_COPIED: &str = "(the agent copies them only from a parent running one thread \
                              whose table never held more than about a million blocks)";
    match forked_from {
        Some(ForkParent {
            pid,
            inherited: Some(n),
            ..
        }) => notes.push(format!(
            "forked from pid {pid}: the {n} block{} it held at the fork {} copied from that \
             process's table and {} shown here (one older than the fork is dated at the fork)",
            if n == 1 { "" } else { "s" },
            if n == 1 { "was" } else { "were" },
            if n == 1 { "is" } else { "are" },
        )),
        Some(ForkParent {
            pid, running: true, ..
        }) => notes.push(format!(
            "forked from pid {pid}: what it inherited at the fork (blocks allocated before it) \
             is recorded in pid {pid}'s table, not shown here {NOT_COPIED}; this table starts at \
             the fork"
        )),
        Some(ForkParent {
            pid,
            running: false,
            ..
        }) => notes.push(format!(
            "forked from pid {pid}, which has exited (a daemon's start): what it inherited at \
             the fork (blocks allocated before it) is not shown {NOT_COPIED}; this table starts \
             at the fork"
        )),
        None => {}
    }
    if total_allocs == 0 {
        let note = match sample_rate {
            // In sampled mode the agent counts only what it sampled: no
            // sample yet says nothing about whether malloc is seen.
            Some(rate) => format!(
                "no allocation sampled yet (sampled mode records about one allocation per {} \
                 allocated): every figure is 0 until the first sample",
                crate::formats::text::human_bytes(rate)
            ),
            None if forked_from.is_some() => "no allocation recorded since the fork".to_string(),
            None if notes.is_empty() => "no allocation recorded: the program has not allocated \
                 through malloc or C++ new since the agent started; if it should have, it may \
                 use an allocator linked in statically, or one preloaded before the agent"
                .to_string(),
            None => "no allocation recorded: see below".to_string(),
        };
        notes.insert(0, note);
    }
    notes
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;

    fn site(frames: &[(u64, &str)], live: u64, by_thread: Vec<(usize, u64, u64)>) -> Site {
        let frames: Vec<Frame> = frames
            .iter()
            .map(|(a, f)| Frame {
                address: *a,
                function: Some(f.to_string()),
                ..Frame::default()
            })
            .collect();
        let mut addresses: Vec<u64> = frames.iter().map(|f| f.address).collect();
        addresses.dedup();
        Site {
            addresses,
            frames,
            live_bytes: live,
            live_blocks: 1,
            alloc_bytes: live,
            alloc_blocks: 1,
            by_thread,
            // Times that tell sites apart: the oldest block is `live`
            // seconds old, the newest `live / 10`.
            oldest: Some(UNIX_EPOCH + Duration::from_secs(1000 - live)),
            newest: Some(UNIX_EPOCH + Duration::from_secs(1000 - live / 10)),
        }
    }

    #[test]
    fn plumbing_is_stripped_and_identical_sites_merge() {
        // Two stacks that differ only in the allocator path (alloc vs
        // realloc) become one site; a third stays apart.
        let a = site(
            &[
                (1, "__rust_alloc"),
                (2, "alloc::alloc::alloc"),
                (10, "app::f"),
                (20, "main"),
            ],
            100,
            vec![(0, 100, 1)],
        );
        let b = site(
            &[(3, "__rust_realloc"), (10, "app::f"), (20, "main")],
            50,
            vec![(0, 30, 1), (1, 20, 1)],
        );
        let c = site(
            &[(4, "__rust_alloc"), (11, "app::g"), (20, "main")],
            120,
            vec![(1, 120, 1)],
        );
        // An address whose inlined frames start with plumbing keeps the
        // rest; a stack of plumbing only stays whole.
        let d = site(
            &[(5, "alloc::alloc::alloc"), (5, "app::h"), (21, "main")],
            10,
            vec![(0, 10, 1)],
        );
        let e = site(
            &[(6, "__rust_alloc"), (7, "alloc::alloc::alloc")],
            5,
            vec![],
        );
        let mut table: HashMap<u64, Vec<Frame>> = HashMap::new();
        for s in [&a, &b, &c, &d, &e] {
            for f in &s.frames {
                table.entry(f.address).or_default().push(f.clone());
            }
        }
        for v in table.values_mut() {
            v.dedup();
        }
        let out = strip_plumbing(vec![a, b, c, d, e], &table);
        assert_eq!(out.len(), 4);
        assert_eq!(out[2].addresses, vec![5, 21]);
        let names: Vec<_> = out[2]
            .frames
            .iter()
            .map(|f| f.function.as_deref())
            .collect();
        assert_eq!(names, [Some("app::h"), Some("main")]);
        assert_eq!(out[3].addresses, vec![6, 7]);
        assert_eq!(out[3].frames.len(), 2);
        assert_eq!(out[0].live_bytes, 150);
        assert_eq!(out[0].live_blocks, 2);
        assert_eq!(out[0].alloc_bytes, 150);
        assert_eq!(out[0].addresses, vec![10, 20]);
        assert_eq!(out[0].frames[0].function.as_deref(), Some("app::f"));
        assert_eq!(out[0].by_thread, vec![(0, 130, 2), (1, 20, 1)]);
        // The merged site spans both sites' allocation times.
        let at = |s| Some(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!((out[0].oldest, out[0].newest), (at(900), at(995)));
        assert_eq!(out[1].live_bytes, 120);
        assert_eq!(out[1].addresses, vec![11, 20]);
    }

    #[test]
    fn a_fork_childs_note_says_whether_what_it_inherited_is_shown() {
        let note = |running, inherited, allocs| {
            notes(
                &[],
                allocs,
                None,
                Some(ForkParent {
                    pid: 7,
                    running,
                    inherited,
                }),
            )
            .join(" | ")
        };
        assert_eq!(
            note(false, Some(1), 1),
            "forked from pid 7: the 1 block it held at the fork was copied from that \
             process's table and is shown here (one older than the fork is dated at the fork)"
        );
        assert!(note(true, Some(3), 3).contains("the 3 blocks it held at the fork were copied"));
        let running = note(true, None, 0);
        assert!(running.starts_with("no allocation recorded since the fork | "));
        assert!(running.contains("is recorded in pid 7's table, not shown here (the agent"));
        let exited = note(false, None, 5);
        assert!(exited.starts_with("forked from pid 7, which has exited (a daemon's start)"));
        assert!(exited.contains("only from a parent running one thread"));
        assert!(!exited.contains("no allocation"));
    }
}
