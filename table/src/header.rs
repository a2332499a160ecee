//! The region header: identity (magic, version, kind, size, writer pid,
//! clock base), layout parameters, and the process-wide counters.
//!
//! Invariants:
//! - The *static* part ([`StaticHeader`], bytes `0..STATIC_HEADER_LEN`) is
//!   written once by the creator before the memfd is sealed and before any
//!   other process can see it. A reader copies it once and validates it;
//!   later changes by a hostile writer are never trusted.
//! - The *dynamic* part (counters, request slot, kind-specific words) is a
//!   set of 8-byte atomics at fixed offsets, read with relaxed loads; every
//!   value read there is range-checked by the code that uses it.
//! - The header occupies `HEADER_SIZE` bytes (one page); data follows.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::TableError;
use crate::shared_view::SharedView;

/// The eight bytes every region starts with.
pub const MAGIC: [u8; 8] = *b"HEAPDUMP";
/// Format major version: a reader refuses any other.
pub const FORMAT_MAJOR: u16 = 1;
/// Format minor version: additions that older readers may ignore.
/// 1.1 added the resources region's per-thread counter blocks; 1.2 the
/// unwinder and sample-rate words (`offsets::UNWINDER`,
/// `offsets::SAMPLE_RATE`); 1.3 the attach words (`offsets::ATTACHED_AT`,
/// `offsets::DETACHED_AT`, `offsets::ALLOCATOR_HEAP`,
/// `offsets::ALLOCATOR_HEAP_SOURCE`); 1.4 the memory curve in the
/// allocations region's header page (`crate::timeline`), the peak words
/// (`crate::peak`) and the resources region's peak blocks; 1.5 the
/// allocations region's writer lines (layout words 6 and 7: young blocks'
/// counts, which a 1.4 reader leaves out of live blocks and totals; its
/// snapshots are unaffected); 1.6 the resources region's stack caches in
/// place of its counter blocks (a 1.5 reader marks their sums partial and
/// leaves them out of the cumulative counts), and later the
/// `offsets::BATCHING_THREADS` word (0 from an older agent: readers then
/// count every thread), the `offsets::AGENT_KIND` word (0 from an
/// older agent: readers then tell by the process's mappings), the
/// `offsets::FORKED_FROM` word (0 from an older agent: a fork child is
/// not told apart) and the `offsets::INHERITED` word (0 from an older
/// agent: nothing was copied at the fork).
pub const FORMAT_MINOR: u16 = 6;
/// Bytes reserved for the header at the start of every region.
pub const HEADER_SIZE: u64 = 4096;

/// Which table a region holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum RegionKind {
    /// Append-only stack traces and thread records.
    Resources = 1,
    /// The live-allocations table.
    Allocations = 2,
}

impl RegionKind {
    /// The memfd name, as shown in `/proc/PID/fd` (`/memfd:NAME (deleted)`).
    pub fn memfd_name(self) -> &'static str {
        match self {
            RegionKind::Resources => "heapdump.resources",
            RegionKind::Allocations => "heapdump.allocations",
        }
    }

    /// Finds the kind whose memfd this `readlink` target belongs to.
    pub fn from_link_target(target: &str) -> Option<Self> {
        let name = target.strip_prefix("/memfd:")?;
        let name = name.strip_suffix(" (deleted)").unwrap_or(name);
        [RegionKind::Resources, RegionKind::Allocations]
            .into_iter()
            .find(|k| k.memfd_name() == name)
    }
}

/// The part of the header written once at creation.
#[derive(Clone, Copy, Debug, FromBytes, IntoBytes, KnownLayout, Immutable)]
#[repr(C)]
pub struct StaticHeader {
    /// [`MAGIC`].
    pub magic: [u8; 8],
    /// [`FORMAT_MAJOR`] of the writer.
    pub version_major: u16,
    /// [`FORMAT_MINOR`] of the writer.
    pub version_minor: u16,
    /// [`RegionKind`] as a number.
    pub kind: u32,
    /// Total size of the region in bytes (the sealed memfd size).
    pub region_size: u64,
    /// Size of the header ([`HEADER_SIZE`]).
    pub header_size: u64,
    /// Pid of the process that created the region.
    pub writer_pid: u32,
    /// Reserved, zero.
    pub reserved: u32,
    /// `CLOCK_REALTIME_COARSE` at creation, nanoseconds since the Unix
    /// epoch (`CLOCK_REALTIME` in regions of agents before 2026-11-29).
    pub clock_realtime_ns: u64,
    /// `CLOCK_MONOTONIC_COARSE` at the same instant, nanoseconds: the base
    /// of record times, which are read from that clock, so no record time
    /// lies before it (`CLOCK_MONOTONIC` in older regions, which a coarse
    /// reading could lag). Timestamps in the tables are monotonic; wall
    /// time = realtime + (t - monotonic).
    pub clock_monotonic_ns: u64,
    /// Kind-specific layout parameters (see each table's module).
    pub layout: [u64; 8],
}

/// Length of [`StaticHeader`] in bytes.
pub const STATIC_HEADER_LEN: usize = core::mem::size_of::<StaticHeader>();

/// Offsets of the dynamic header words.
pub mod offsets {
    /// Live bytes (allocations region).
    pub const LIVE_BYTES: u64 = 256;
    /// Live blocks (in an allocations region, added to the per-shard
    /// counts; see [`super::read_counters`]).
    pub const LIVE_BLOCKS: u64 = 264;
    /// Allocations ever recorded (plus the per-shard counts).
    pub const TOTAL_ALLOCS: u64 = 272;
    /// Bytes ever allocated (plus the per-shard counts).
    pub const TOTAL_BYTES: u64 = 280;
    /// Highest live-bytes value seen.
    pub const PEAK_LIVE_BYTES: u64 = 288;
    /// `DROPPED_REASONS` counters, 8 bytes each.
    pub const DROPPED: u64 = 296;
    /// Snapshot requests made so far.
    pub const REQUEST_COUNT: u64 = 424;
    /// Monotonic ns of the last request.
    pub const REQUEST_TIME: u64 = 432;
    /// Seqlock word guarding the request name.
    pub const REQUEST_NAME_SEQ: u64 = 440;
    /// Length of the last request's name.
    pub const REQUEST_NAME_LEN: u64 = 448;
    /// Name bytes (`REQUEST_NAME_MAX`).
    pub const REQUEST_NAME: u64 = 456;
    /// The request count the stored name belongs to (a signal request has
    /// no name, so the name shows only when this equals the count).
    pub const REQUEST_NAME_FOR: u64 = 520;
    /// How the agent walks stacks ([`super::Unwinder`] as a number; 0 in
    /// regions of agents older than format 1.2). Written once at start.
    pub const UNWINDER: u64 = 528;
    /// Sampling: the mean bytes between sampled allocations (0: every
    /// allocation is recorded). Written once at start.
    pub const SAMPLE_RATE: u64 = 536;
    /// `heapdump attach`: monotonic ns at which recording started in a
    /// process that was already running (0: recording since the process
    /// started). Format 1.3.
    pub const ATTACHED_AT: u64 = 544;
    /// `heapdump detach`: monotonic ns of the last detach (0: recording).
    /// Format 1.3.
    pub const DETACHED_AT: u64 = 552;
    /// An attached agent's reading of the allocator's own whole-heap
    /// figure, bytes (see [`super::AttachWords`]). Format 1.3.
    pub const ALLOCATOR_HEAP: u64 = 560;
    /// Where [`ALLOCATOR_HEAP`] comes from ([`super::HeapSource`] as a
    /// number; 0: none). Format 1.3.
    pub const ALLOCATOR_HEAP_SOURCE: u64 = 568;
    /// When [`ALLOCATOR_HEAP`] was read, monotonic ns (0: not recorded,
    /// an agent before this word). Format 1.3, added later.
    pub const ALLOCATOR_HEAP_AT: u64 = 576;
    /// The most threads that could hold live bytes not yet added to the
    /// running live total at once (the agent's per-thread tables it has
    /// mapped: a thread takes them at its first event and gives them back,
    /// its batch settled, at exit). The running total, and so the peak,
    /// lags the truth by at most
    /// [`LIVE_BATCH`](crate::allocations_table::LIVE_BATCH) bytes per such
    /// thread (see [`read_batching_threads`]). 0: not recorded (an agent
    /// before this word). Format 1.6, added later.
    pub const BATCHING_THREADS: u64 = 584;
    /// Which agent writes the regions ([`super::AgentKind`] as a number;
    /// 0: not recorded, an agent before this word). Written once at start.
    /// Format 1.6, added later.
    pub const AGENT_KIND: u64 = 592;
    /// The pid of the process whose fork made this one, when the agent
    /// made these regions in a fork child (0: not a fork child, or an
    /// agent before this word). The child's table starts empty at the
    /// fork, unless the agent copied the parent's records into it
    /// ([`INHERITED`]): otherwise the blocks it inherited are recorded in
    /// that process's table.
    /// Written once at start. Format 1.6, added later.
    pub const FORKED_FROM: u64 = 600;
    /// In a fork child (see [`FORKED_FROM`]), the blocks it held at the
    /// fork that the agent copied from its parent's table into its own,
    /// plus one (0: none copied, the child's table starting empty at the
    /// fork; or an agent before this word). Written once at start.
    /// Format 1.6, added later.
    pub const INHERITED: u64 = 608;
    /// First kind-specific dynamic word.
    pub const KIND_WORDS: u64 = 1024;
}

/// How the agent that wrote a region walks stacks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Unwinder {
    /// Not recorded (an agent older than format 1.2), or a value this
    /// reader does not know.
    Unknown,
    /// Frame pointers only (`HEAPDUMP_UNWIND=fp`, or CFI not available).
    FramePointer,
    /// CFI from `.eh_frame`, frame pointers where a counter has none
    /// (`HEAPDUMP_UNWIND=auto`, the default).
    CfiWithFramePointerFallback,
    /// CFI only (`HEAPDUMP_UNWIND=cfi`).
    Cfi,
    /// Frame pointers only, though CFI was asked for: it is not available
    /// where the agent runs (no loaded module could be found: glibc before
    /// 2.35 has no `_dl_find_object`, and the agent's own module table
    /// came out empty).
    FramePointerNoCfi,
}

impl Unwinder {
    /// The number stored in the header for this unwinder (0: unknown).
    pub fn code(self) -> u64 {
        match self {
            Unwinder::Unknown => 0,
            Unwinder::FramePointer => 1,
            Unwinder::CfiWithFramePointerFallback => 2,
            Unwinder::Cfi => 3,
            Unwinder::FramePointerNoCfi => 4,
        }
    }

    /// The unwinder a header number stands for (the inverse of
    /// [`Self::code`]; `Unknown` for any other number).
    pub fn from_code(code: u64) -> Unwinder {
        match code {
            1 => Unwinder::FramePointer,
            2 => Unwinder::CfiWithFramePointerFallback,
            3 => Unwinder::Cfi,
            4 => Unwinder::FramePointerNoCfi,
            _ => Unwinder::Unknown,
        }
    }

    /// A short name for reports (`fp`, `cfi+fp`, `cfi`, `fp-no-cfi`,
    /// `unknown`).
    pub fn name(self) -> &'static str {
        match self {
            Unwinder::Unknown => "unknown",
            Unwinder::FramePointer => "fp",
            Unwinder::CfiWithFramePointerFallback => "cfi+fp",
            Unwinder::Cfi => "cfi",
            Unwinder::FramePointerNoCfi => "fp-no-cfi",
        }
    }
}

/// The unwinder word of a region's header (any value is safe to read).
pub fn read_unwinder(view: &SharedView) -> Unwinder {
    Unwinder::from_code(view.load_u64(offsets::UNWINDER).unwrap_or(0))
}

/// The sample rate of a region's agent: mean bytes between sampled
/// allocations, 0 when every allocation is recorded (any value is safe to
/// read; an absurd one is the dumper's to refuse).
pub fn read_sample_rate(view: &SharedView) -> u64 {
    view.load_u64(offsets::SAMPLE_RATE).unwrap_or(0)
}

/// Where an attached agent read the allocator's whole-heap figure.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeapSource {
    /// glibc's `mallinfo2()`: `uordblks + hblkhd` (bytes in use, arenas
    /// and mmapped chunks).
    GlibcMallinfo2,
    /// jemalloc's `stats.allocated` (through `mallctl`).
    JemallocStatsAllocated,
    /// tcmalloc's `generic.current_allocated_bytes`.
    TcmallocCurrentAllocated,
    /// glibc's `mallinfo()` (before 2.33, which has no `mallinfo2`):
    /// `uordblks + hblkhd` in 32-bit counters that wrap past 4 GiB.
    GlibcMallinfo,
}

impl HeapSource {
    /// The number stored in the header (`offsets::ALLOCATOR_HEAP_SOURCE`).
    pub fn code(self) -> u64 {
        match self {
            HeapSource::GlibcMallinfo2 => 1,
            HeapSource::JemallocStatsAllocated => 2,
            HeapSource::TcmallocCurrentAllocated => 3,
            HeapSource::GlibcMallinfo => 4,
        }
    }

    /// The source a header number stands for (`None` for 0 or unknown).
    pub fn from_code(code: u64) -> Option<HeapSource> {
        match code {
            1 => Some(HeapSource::GlibcMallinfo2),
            2 => Some(HeapSource::JemallocStatsAllocated),
            3 => Some(HeapSource::TcmallocCurrentAllocated),
            4 => Some(HeapSource::GlibcMallinfo),
            _ => None,
        }
    }

    /// How reports name it ("glibc's mallinfo2").
    pub fn describe(self) -> &'static str {
        match self {
            HeapSource::GlibcMallinfo2 => "glibc's mallinfo2",
            HeapSource::JemallocStatsAllocated => "jemalloc's stats.allocated",
            HeapSource::TcmallocCurrentAllocated => "tcmalloc's current_allocated_bytes",
            HeapSource::GlibcMallinfo => "glibc's mallinfo (32-bit: wraps past 4 GiB)",
        }
    }
}

/// What a region says of `heapdump attach` (all zero / `None` for a
/// process started under the agent, and in regions older than 1.3).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AttachWords {
    /// Monotonic ns recording started at (0: at process start).
    pub attached_at: u64,
    /// Monotonic ns of the last detach (0: recording now).
    pub detached_at: u64,
    /// The allocator's whole-heap figure, bytes, and its source.
    pub allocator_heap: Option<(HeapSource, u64)>,
    /// When it was read, monotonic ns (0: unknown).
    pub allocator_heap_at: u64,
}

/// The attach words of a region's header (any values are safe to read;
/// the dumper converts times through the header's clock base).
pub fn read_attach(view: &SharedView) -> AttachWords {
    let w = |o| view.load_u64(o).unwrap_or(0);
    let detached_at = w(offsets::DETACHED_AT);
    let attached_at = w(offsets::ATTACHED_AT);
    AttachWords {
        attached_at,
        // A detach older than the (re-)attach is over.
        detached_at: if detached_at > attached_at {
            detached_at
        } else {
            0
        },
        allocator_heap: HeapSource::from_code(w(offsets::ALLOCATOR_HEAP_SOURCE))
            .map(|s| (s, w(offsets::ALLOCATOR_HEAP))),
        allocator_heap_at: w(offsets::ALLOCATOR_HEAP_AT),
    }
}

/// Which agent writes a process's regions (`offsets::AGENT_KIND`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AgentKind {
    /// The preload library (`LD_PRELOAD` under any name, an
    /// `/etc/ld.so.preload` entry, or loaded by `heapdump attach`).
    Preload = 1,
    /// The Rust `heapdump_agent::Agent` global allocator.
    RustAgent = 2,
}

impl AgentKind {
    /// The word's value.
    pub fn code(self) -> u64 {
        self as u64
    }
}

/// [`offsets::AGENT_KIND`]: the agent that said which it is (`None`: an
/// agent before the word, or a value this reader does not know; any value
/// is safe to read).
pub fn read_agent_kind(view: &SharedView) -> Option<AgentKind> {
    match view.load_u64(offsets::AGENT_KIND)? {
        1 => Some(AgentKind::Preload),
        2 => Some(AgentKind::RustAgent),
        _ => None,
    }
}

/// [`offsets::FORKED_FROM`]: the pid whose fork made the writer, when the
/// agent said so (`None`: not a fork child, or an agent before the word;
/// any value is safe to read, one past a pid's range reads as `None`).
pub fn read_forked_from(view: &SharedView) -> Option<u32> {
    view.load_u64(offsets::FORKED_FROM)
        .filter(|p| *p != 0)
        .and_then(|p| u32::try_from(p).ok())
}

/// [`offsets::INHERITED`]: how many blocks a fork child's agent copied
/// from its parent's table at the fork (`None`: none were; any value is
/// safe to read).
pub fn read_inherited(view: &SharedView) -> Option<u64> {
    view.load_u64(offsets::INHERITED)
        .filter(|n| *n != 0)
        .map(|n| n - 1)
}

/// [`offsets::BATCHING_THREADS`]: how many threads' unsettled live
/// bytes the peak may miss, at most, when the agent said (`None`: an agent
/// before the word; any value is safe to read).
pub fn read_batching_threads(view: &SharedView) -> Option<u64> {
    view.load_u64(offsets::BATCHING_THREADS).filter(|n| *n != 0)
}

/// Longest snapshot-request name kept in the header.
pub const REQUEST_NAME_MAX: usize = 64;

/// Why an event could not be recorded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum DroppedReason {
    /// The allocations table had no free record or index slot.
    AllocationsFull = 0,
    /// The resources table had no room for a new stack or thread record.
    ResourcesFull = 1,
    /// The event happened while the agent was already busy on this thread
    /// (re-entrancy, signal handler) and was passed through unrecorded.
    Reentrant = 2,
    /// A free or realloc named an address the table did not hold.
    UnknownAddress = 3,
    /// The event happened before the agent could set up its regions.
    NotReady = 4,
    /// A free of a block from before the heap's peak could not be counted
    /// for the heap at the peak (its thread's peak blocks had no room for
    /// its stack): `--peak` then shows less than the heap held.
    PeakUncounted = 5,
}

/// Number of dropped-event counters in the header (room for growth).
pub const DROPPED_SLOTS: usize = 16;

impl DroppedReason {
    /// Every reason, in counter order.
    pub const ALL: [DroppedReason; 6] = [
        DroppedReason::AllocationsFull,
        DroppedReason::ResourcesFull,
        DroppedReason::Reentrant,
        DroppedReason::UnknownAddress,
        DroppedReason::NotReady,
        DroppedReason::PeakUncounted,
    ];

    /// Short stable name (used in JSON output).
    pub fn name(self) -> &'static str {
        match self {
            DroppedReason::AllocationsFull => "allocations_full",
            DroppedReason::ResourcesFull => "resources_full",
            DroppedReason::Reentrant => "reentrant",
            DroppedReason::UnknownAddress => "unknown_address",
            DroppedReason::NotReady => "not_ready",
            DroppedReason::PeakUncounted => "peak_uncounted",
        }
    }
}

/// Validates the static header found in `view` and returns a copy of it.
pub fn parse_header(view: &SharedView, expected: RegionKind) -> Result<StaticHeader, TableError> {
    if (view.len() as u64) < HEADER_SIZE {
        return Err(TableError::Truncated {
            what: format!(
                "{} bytes, smaller than the {HEADER_SIZE}-byte header",
                view.len()
            ),
        });
    }
    // On the stack: the agent parses its own header from inside `malloc`
    // (`stats()`), where allocating would count itself.
    let mut bytes = [0u8; STATIC_HEADER_LEN];
    view.copy_into(0, &mut bytes)
        .ok_or_else(|| TableError::Truncated {
            what: "header".into(),
        })?;
    let header = StaticHeader::read_from_bytes(&bytes)
        .map_err(|_| TableError::CorruptHeader("header does not parse".into()))?;
    if header.magic != MAGIC {
        return Err(TableError::BadMagic);
    }
    if header.version_major != FORMAT_MAJOR {
        return Err(TableError::VersionMismatch {
            found_major: header.version_major,
            found_minor: header.version_minor,
            supported_major: FORMAT_MAJOR,
        });
    }
    if header.kind != expected as u32 {
        return Err(TableError::WrongKind {
            found: header.kind,
            expected: expected as u32,
        });
    }
    if header.header_size != HEADER_SIZE {
        return Err(TableError::CorruptHeader(format!(
            "header size {} (expected {HEADER_SIZE})",
            header.header_size
        )));
    }
    if header.region_size != view.len() as u64 {
        return Err(TableError::Truncated {
            what: format!(
                "header says {} bytes, mapping has {}",
                header.region_size,
                view.len()
            ),
        });
    }
    Ok(header)
}

/// Process-wide counters, as read from a header at one moment.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Counters {
    /// Bytes in live blocks.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Allocations ever recorded.
    pub total_allocs: u64,
    /// Bytes ever allocated.
    pub total_bytes: u64,
    /// Highest `live_bytes` seen.
    pub peak_live_bytes: u64,
    /// Dropped events, indexed by [`DroppedReason`].
    pub dropped: [u64; DROPPED_SLOTS],
    /// Snapshot requests made so far.
    pub request_count: u64,
}

impl Counters {
    /// Sum of all dropped counters.
    pub fn dropped_total(&self) -> u64 {
        self.dropped.iter().fold(0u64, |a, b| a.saturating_add(*b))
    }
}

/// Reads the counters (relaxed; each word is individually consistent).
///
/// In an allocations region, live blocks and the cumulative totals are kept
/// per shard (so the allocation path touches no shared counter for them);
/// this sums them with the header words, so the result is the same
/// whichever way a region is read.
pub fn read_counters(view: &SharedView) -> Counters {
    let mut c = read_header_words(view);
    crate::allocations_table::add_shard_counters(view, &mut c);
    c
}

fn read_header_words(view: &SharedView) -> Counters {
    let ld = |off| view.load_u64(off).unwrap_or(0);
    let mut dropped = [0u64; DROPPED_SLOTS];
    for (i, d) in dropped.iter_mut().enumerate() {
        *d = ld(offsets::DROPPED + 8 * i as u64);
    }
    Counters {
        live_bytes: ld(offsets::LIVE_BYTES),
        live_blocks: ld(offsets::LIVE_BLOCKS),
        total_allocs: ld(offsets::TOTAL_ALLOCS),
        total_bytes: ld(offsets::TOTAL_BYTES),
        peak_live_bytes: ld(offsets::PEAK_LIVE_BYTES),
        dropped,
        request_count: ld(offsets::REQUEST_COUNT),
    }
}

/// The last snapshot request, as read from a header.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SnapshotRequest {
    /// How many requests have been made (this one included).
    pub count: u64,
    /// Monotonic nanoseconds when it was made (0 if never).
    pub time_monotonic_ns: u64,
    /// Its name (empty for signal requests); `None` if it could not be read
    /// consistently (a writer kept changing it).
    pub name: Option<String>,
}

/// Writer-side access to the counter words of a header.
#[derive(Clone, Copy, Debug)]
pub struct HeaderCounters {
    view: SharedView,
}

impl HeaderCounters {
    pub(crate) fn new(view: SharedView) -> Self {
        HeaderCounters { view }
    }

    fn word(&self, off: u64) -> &AtomicU64 {
        // Offsets are constants inside the header page, which every region
        // has (the creator checked its size), so this cannot fail.
        self.view.atomic_u64(off).expect("header word in range")
    }

    /// Adds `add` to and subtracts `sub` from the live bytes (one atomic
    /// add), raising the peak if needed. The allocations table keeps live
    /// blocks and totals per shard (see [`read_counters`]).
    /// Returns the new running total.
    #[inline]
    pub(crate) fn live_bytes_changed(&self, add: u64, sub: u64) -> u64 {
        let delta = add.wrapping_sub(sub);
        let live = self
            .word(offsets::LIVE_BYTES)
            .fetch_add(delta, Ordering::Relaxed)
            .wrapping_add(delta);
        // Only a rise can set a new peak; a wrapped (negative) value is a
        // transient of racing threads and must not become the peak.
        if add > sub && live <= i64::MAX as u64 {
            let peak = self.word(offsets::PEAK_LIVE_BYTES);
            if live > peak.load(Ordering::Relaxed) {
                peak.fetch_max(live, Ordering::Relaxed);
            }
        }
        live
    }

    /// Counts one dropped event. Async-signal-safe (one atomic add).
    #[inline]
    pub fn on_dropped(&self, reason: DroppedReason) {
        self.on_dropped_n(reason, 1);
    }

    /// Counts `n` dropped events at once (one atomic add).
    #[inline]
    pub fn on_dropped_n(&self, reason: DroppedReason, n: u64) {
        self.word(offsets::DROPPED + 8 * reason as u64)
            .fetch_add(n, Ordering::Relaxed);
    }

    /// Bumps the snapshot-request counter without a name.
    /// Async-signal-safe: a clock read and atomic stores only.
    pub fn request_snapshot_signal_safe(&self, now_monotonic_ns: u64) {
        self.word(offsets::REQUEST_TIME)
            .store(now_monotonic_ns, Ordering::Relaxed);
        // Release: a reader that sees the new count also sees the time.
        self.word(offsets::REQUEST_COUNT)
            .fetch_add(1, Ordering::Release);
    }

    /// Records a named snapshot request: writes the name under the name's
    /// seqlock, then bumps the counter. Concurrent callers serialise on the
    /// seqlock (a CAS from even to odd); readers never block it.
    pub fn request_snapshot(&self, name: &str, now_monotonic_ns: u64) {
        let seq = self.word(offsets::REQUEST_NAME_SEQ);
        let mut spins = 0u32;
        let start = loop {
            let s = seq.load(Ordering::Relaxed);
            if s.is_multiple_of(2)
                && seq
                    .compare_exchange_weak(s, s + 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                break s;
            }
            spins += 1;
            if spins > 1000 {
                // Another thread holds the name slot for very long (or died
                // holding it): record the request without a name.
                self.request_snapshot_signal_safe(now_monotonic_ns);
                return;
            }
            std::hint::spin_loop();
        };
        // Release fence: the odd sequence is visible before the name bytes
        // change, so a reader that copies torn bytes sees a changed seq.
        fence(Ordering::Release);
        let bytes = name.as_bytes();
        let n = bytes.len().min(REQUEST_NAME_MAX);
        let mut chunk = [0u8; REQUEST_NAME_MAX];
        chunk[..n].copy_from_slice(&bytes[..n]);
        for i in 0..REQUEST_NAME_MAX / 8 {
            let w = u64::from_le_bytes(chunk[i * 8..i * 8 + 8].try_into().unwrap());
            self.word(offsets::REQUEST_NAME + 8 * i as u64)
                .store(w, Ordering::Relaxed);
        }
        self.word(offsets::REQUEST_NAME_LEN)
            .store(n as u64, Ordering::Relaxed);
        self.word(offsets::REQUEST_TIME)
            .store(now_monotonic_ns, Ordering::Relaxed);
        let count = self.word(offsets::REQUEST_COUNT).load(Ordering::Relaxed);
        self.word(offsets::REQUEST_NAME_FOR)
            .store(count + 1, Ordering::Relaxed);
        seq.store(start + 2, Ordering::Release);
        self.word(offsets::REQUEST_COUNT)
            .fetch_add(1, Ordering::Release);
    }
}

/// Reads the last snapshot request (bounded retries on the name seqlock).
pub fn read_request(view: &SharedView) -> SnapshotRequest {
    let count = view.load_u64(offsets::REQUEST_COUNT).unwrap_or(0);
    fence(Ordering::Acquire);
    let time = view.load_u64(offsets::REQUEST_TIME).unwrap_or(0);
    let mut name = None;
    for _ in 0..64 {
        let s1 = view.load_u64(offsets::REQUEST_NAME_SEQ).unwrap_or(1);
        fence(Ordering::Acquire);
        if s1 % 2 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let len = view.load_u64(offsets::REQUEST_NAME_LEN).unwrap_or(0) as usize;
        let mut bytes = Vec::new();
        if view
            .copy_bytes(offsets::REQUEST_NAME, len.min(REQUEST_NAME_MAX), &mut bytes)
            .is_none()
        {
            break;
        }
        fence(Ordering::Acquire);
        let name_for = view.load_u64(offsets::REQUEST_NAME_FOR).unwrap_or(0);
        fence(Ordering::Acquire);
        let s2 = view.load_u64(offsets::REQUEST_NAME_SEQ).unwrap_or(0);
        if s1 == s2 {
            name = Some(if name_for == count {
                String::from_utf8_lossy(&bytes).into_owned()
            } else {
                String::new()
            });
            break;
        }
    }
    SnapshotRequest {
        count,
        time_monotonic_ns: time,
        name,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unwinder_codes_round_trip() {
        for u in [
            Unwinder::Unknown,
            Unwinder::FramePointer,
            Unwinder::CfiWithFramePointerFallback,
            Unwinder::Cfi,
        ] {
            assert_eq!(Unwinder::from_code(u.code()), u);
        }
        assert_eq!(Unwinder::from_code(99), Unwinder::Unknown);
    }
}
