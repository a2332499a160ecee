//! `--format json`: the stable, machine-readable snapshot schema.
//!
//! Schema (version 1; fields are only ever added, never renamed):
//!
//! ```text
//! {
//!   "format": "heapdump-snapshot", "schema_version": 1,
//!   "pid": 1234, "process": "name", "cmdline": ["prog", "arg"],
//!   "taken_at": "2024-01-01T12:00:00.123456Z",        // RFC 3339, UTC
//!   "totals": {"live_bytes", "live_blocks", "alloc_bytes", "alloc_blocks", "peak_bytes",
//!              "peak_tolerance"},
//!   "dropped": {"total": 0, "<reason>": n, ...},       // reasons with n > 0
//!   "threads": [{"tid", "name", "live_bytes", "live_blocks"}],
//!   "sites": [{"live_bytes", "live_blocks", "alloc_bytes", "alloc_blocks",
//!              "frames": [{"address": "0x55...", "function", "file", "line",
//!                          "module", "inlined"}],       // leaf first
//!              "threads": [{"tid", "live_bytes", "live_blocks"}],
//!              "oldest_alloc_time": null | "RFC 3339",  // of its live blocks
//!              "newest_alloc_time": null | "RFC 3339"}],
//!   "mappings": [{"start": "0x..", "end": "0x..", "offset": "0x..", "path", "build_id"}],
//!   "request": null | {"count", "name", "time"},
//!   "symbolized": true,
//!   "partial": null | "reason the walk was not clean",
//!   "selection": null | {"older_than": null | "RFC 3339", "newer_than": null | "RFC 3339",
//!                        "live_bytes", "live_blocks"},
//!   "notes": ["what the snapshot cannot show, e.g. no allocation recorded and why"],
//!   "unwinder": "cfi+fp" | "cfi" | "fp" | "fp-no-cfi" | "unknown",
//!   "sampling": null | {"rate_bytes": 524288, "estimated": true},
//!   "recording": null | {"attached_at": null | "RFC 3339", "detached_at": null | "RFC 3339",
//!                        "allocator_heap": null | {"source", "bytes", "read_at"}},
//!   "timeline": null | [{"time": "RFC 3339", "live_bytes", "live_blocks", "alloc_bytes"}],
//!   "timeline_thinned": 0,
//!   "peak": null | {"time": "RFC 3339", "live_bytes", "tolerance"}  // snapshot --peak
//! }
//! ```
//!
//! `alloc_*` are cumulative since the process started; `live_*` are the
//! blocks live at the snapshot. With a `selection` (`--older-than`,
//! `--newer-than`), sites and threads count only the live blocks allocated
//! in that range (`selection.live_*` sums them), while `totals` stay the
//! whole heap's. Allocation times are read from a coarse clock: up to one
//! kernel tick early. Unknown `function`/`file`/`line`/`module`
//! are `null`. `frames` are leaf first (the caller of malloc first); the
//! frames of one address that were inlined have the same `address` and
//! `inlined: true` on all but the outermost.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::process::snapshot::{Request, Selection, Site, Snapshot, ThreadStat, Totals};
use crate::symbolization::maps::Mapping;
use crate::symbolization::symbolizer::Frame;

/// Top-level JSON document.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct JsonSnapshot {
    /// Always `heapdump-snapshot`.
    pub format: String,
    /// Schema version (1).
    pub schema_version: u32,
    /// Process id.
    pub pid: u32,
    /// Process name.
    pub process: String,
    /// Command line.
    #[serde(default)]
    pub cmdline: Vec<String>,
    /// RFC 3339 UTC time of the walk.
    pub taken_at: String,
    /// Totals.
    pub totals: JsonTotals,
    /// Dropped events: `total` and each non-zero reason.
    pub dropped: BTreeMap<String, u64>,
    /// Threads.
    pub threads: Vec<JsonThread>,
    /// Allocation sites.
    pub sites: Vec<JsonSite>,
    /// Executable mappings with build IDs.
    #[serde(default)]
    pub mappings: Vec<JsonMapping>,
    /// The request answered, if any.
    #[serde(default)]
    pub request: Option<JsonRequest>,
    /// Whether frames were symbolized.
    #[serde(default)]
    pub symbolized: bool,
    /// Why the snapshot is not clean, or null.
    pub partial: Option<String>,
    /// The blocks selected by allocation time, or null (every live block).
    #[serde(default)]
    pub selection: Option<JsonSelection>,
    /// What the snapshot cannot show, in words ("no allocation recorded",
    /// a statically linked allocator...); empty when nothing is known.
    #[serde(default)]
    pub notes: Vec<String>,
    /// How the agent walked the stacks: `fp`, `cfi+fp`, `cfi`, or
    /// `unknown`.
    #[serde(default = "unknown_unwinder")]
    pub unwinder: String,
    /// Sampled mode, or null when every allocation was recorded.
    #[serde(default)]
    pub sampling: Option<JsonSampling>,
    /// For a process `heapdump attach` attached to: since when it is
    /// recorded; null for a process recorded since it started.
    #[serde(default)]
    pub recording: Option<JsonRecording>,
    /// The memory curve, oldest first, its last point the snapshot's
    /// totals; null for agents older than format 1.4.
    #[serde(default)]
    pub timeline: Option<Vec<JsonPoint>>,
    /// Points of the curve thinned away (older ones, coarser the older).
    #[serde(default)]
    pub timeline_thinned: u64,
    /// Set when the document is the heap at its peak (`snapshot --peak`).
    #[serde(default)]
    pub peak: Option<JsonPeak>,
}

/// The moment a `--peak` snapshot shows.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonPeak {
    /// RFC 3339: when live bytes were highest.
    pub time: String,
    /// Live bytes then (the sites' sum).
    pub live_bytes: u64,
    /// Bytes the true high-water mark may exceed `live_bytes` by.
    pub tolerance: u64,
    /// Whether the document shows the heap at its peak; false: the heap
    /// at `time` (the snapshot's), the composition at the peak, higher,
    /// not having been recorded. Absent (true) in older documents.
    #[serde(default = "yes")]
    pub at_peak: bool,
}

fn yes() -> bool {
    true
}

impl From<&crate::process::snapshot::PeakInfo> for JsonPeak {
    fn from(p: &crate::process::snapshot::PeakInfo) -> Self {
        JsonPeak {
            time: rfc3339(p.time),
            live_bytes: p.live_bytes,
            tolerance: p.tolerance,
            at_peak: p.at_peak,
        }
    }
}

/// One point of the memory curve.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonPoint {
    /// RFC 3339.
    pub time: String,
    /// Live bytes then.
    pub live_bytes: u64,
    /// Live blocks then.
    pub live_blocks: u64,
    /// Bytes allocated since recording started, then.
    pub alloc_bytes: u64,
}

impl From<&crate::process::snapshot::TimelinePoint> for JsonPoint {
    fn from(p: &crate::process::snapshot::TimelinePoint) -> Self {
        JsonPoint {
            time: rfc3339(p.time),
            live_bytes: p.live_bytes,
            live_blocks: p.live_blocks,
            alloc_bytes: p.alloc_bytes,
        }
    }
}

fn timeline_from_json(j: &JsonSnapshot) -> Option<crate::process::snapshot::Timeline> {
    let points = j.timeline.as_ref()?;
    Some(crate::process::snapshot::Timeline {
        points: points
            .iter()
            .filter_map(|p| {
                Some(crate::process::snapshot::TimelinePoint {
                    time: humantime::parse_rfc3339(&p.time).ok()?,
                    live_bytes: p.live_bytes,
                    live_blocks: p.live_blocks,
                    alloc_bytes: p.alloc_bytes,
                })
            })
            .collect(),
        thinned: j.timeline_thinned,
    })
}

/// `recording`: an attached process's recording.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonRecording {
    /// RFC 3339: when `heapdump attach` started recording.
    pub attached_at: Option<String>,
    /// RFC 3339: when `heapdump detach` stopped it, or null.
    pub detached_at: Option<String>,
    /// The allocator's own whole-heap figure, or null.
    pub allocator_heap: Option<JsonAllocatorHeap>,
}

/// The allocator's own figure for the whole heap.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonAllocatorHeap {
    /// Where it was read (`glibc's mallinfo2`, `jemalloc's stats.allocated`).
    pub source: String,
    /// Bytes in use, blocks from before the attach included.
    pub bytes: u64,
    /// RFC 3339: when the agent read it (null: unknown).
    #[serde(default)]
    pub read_at: Option<String>,
}

impl From<&crate::process::snapshot::Recording> for JsonRecording {
    fn from(r: &crate::process::snapshot::Recording) -> Self {
        JsonRecording {
            attached_at: r.attached_at.map(rfc3339),
            detached_at: r.detached_at.map(rfc3339),
            allocator_heap: r
                .allocator_heap
                .as_ref()
                .map(|(source, bytes)| JsonAllocatorHeap {
                    source: source.clone(),
                    bytes: *bytes,
                    read_at: r.allocator_heap_at.map(rfc3339),
                }),
        }
    }
}

impl From<&JsonRecording> for crate::process::snapshot::Recording {
    fn from(j: &JsonRecording) -> Self {
        crate::process::snapshot::Recording {
            attached_at: parse_time(j.attached_at.as_deref()),
            detached_at: parse_time(j.detached_at.as_deref()),
            allocator_heap: j
                .allocator_heap
                .as_ref()
                .map(|h| (h.source.clone(), h.bytes)),
            allocator_heap_at: j
                .allocator_heap
                .as_ref()
                .and_then(|h| parse_time(h.read_at.as_deref())),
        }
    }
}

/// How a sampled snapshot was recorded.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonSampling {
    /// Mean bytes allocated between two sampled allocations.
    pub rate_bytes: u64,
    /// Always true: counts and bytes (live and cumulative, per site,
    /// thread and in total) are unbiased estimates, each sampled block
    /// weighted by 1 / (1 - exp(-size / rate_bytes)).
    pub estimated: bool,
}

fn unknown_unwinder() -> String {
    "unknown".into()
}

/// The blocks a snapshot was restricted to by allocation time.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonSelection {
    /// RFC 3339: blocks allocated before this time.
    pub older_than: Option<String>,
    /// RFC 3339: blocks allocated at or after this time.
    pub newer_than: Option<String>,
    /// Bytes in the selected live blocks.
    pub live_bytes: u64,
    /// Selected live blocks.
    pub live_blocks: u64,
}

/// Totals.
#[derive(Clone, Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonTotals {
    /// Bytes in live blocks.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Bytes ever allocated.
    pub alloc_bytes: u64,
    /// Blocks ever allocated.
    pub alloc_blocks: u64,
    /// Peak live bytes: the one figure every output gives (the highest of
    /// the heap now, the heap rebuilt at the recorded peak, and the
    /// curve's highest point).
    pub peak_bytes: u64,
    /// How far the true high-water mark may lie above `peak_bytes`.
    #[serde(default)]
    pub peak_tolerance: u64,
}

/// One thread.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonThread {
    /// Kernel thread id.
    pub tid: u64,
    /// Name.
    pub name: String,
    /// Live bytes allocated by this thread.
    pub live_bytes: u64,
    /// Live blocks allocated by this thread.
    pub live_blocks: u64,
}

/// Live use of a site by one thread.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonSiteThread {
    /// Kernel thread id.
    pub tid: u64,
    /// Live bytes.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
}

/// One allocation site.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonSite {
    /// Live bytes.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Bytes ever allocated.
    pub alloc_bytes: u64,
    /// Blocks ever allocated.
    pub alloc_blocks: u64,
    /// Frames, leaf first.
    pub frames: Vec<JsonFrame>,
    /// Live use per thread.
    #[serde(default)]
    pub threads: Vec<JsonSiteThread>,
    /// RFC 3339: when the site's oldest live block was allocated.
    #[serde(default)]
    pub oldest_alloc_time: Option<String>,
    /// RFC 3339: when the site's newest live block was allocated.
    #[serde(default)]
    pub newest_alloc_time: Option<String>,
}

/// One frame.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonFrame {
    /// Return address, hex string (`0x...`).
    pub address: String,
    /// Demangled function name.
    pub function: Option<String>,
    /// Source file.
    pub file: Option<String>,
    /// Source line.
    pub line: Option<u32>,
    /// Mapped file holding the address.
    pub module: Option<String>,
    /// Offset of the address in `module`'s file, hex (`module+0x...` is
    /// how a frame without a covering symbol is named).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub module_offset: Option<String>,
    /// Offset of the return address in `function`, hex, for a frame named
    /// from a symbol table without a line (`function+0x...` in text).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub function_offset: Option<String>,
    /// Inlined into the next frame.
    #[serde(default)]
    pub inlined: bool,
}

/// One mapping.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonMapping {
    /// Start address, hex.
    pub start: String,
    /// End address, hex.
    pub end: String,
    /// File offset, hex.
    pub offset: String,
    /// File path (shared with the snapshot's mapping).
    pub path: std::sync::Arc<str>,
    /// GNU build ID, hex.
    pub build_id: Option<String>,
}

/// The request answered.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct JsonRequest {
    /// Request counter value.
    pub count: u64,
    /// Name (empty for a signal).
    pub name: String,
    /// RFC 3339 time of the request.
    pub time: Option<String>,
}

/// RFC 3339 UTC with microseconds.
pub fn rfc3339(t: SystemTime) -> String {
    humantime::format_rfc3339_micros(t).to_string()
}

fn hex(v: u64) -> String {
    format!("{v:#x}")
}

fn parse_hex(s: &str) -> u64 {
    u64::from_str_radix(s.trim_start_matches("0x"), 16).unwrap_or(0)
}

impl From<&Frame> for JsonFrame {
    fn from(f: &Frame) -> Self {
        JsonFrame {
            address: hex(f.address),
            function: f.function.clone(),
            file: f.file.clone(),
            line: f.line,
            module: f.module.clone(),
            module_offset: f.module_offset.map(hex),
            function_offset: f.function_offset.map(hex),
            inlined: f.inlined,
        }
    }
}

impl From<&JsonFrame> for Frame {
    fn from(f: &JsonFrame) -> Self {
        Frame {
            address: parse_hex(&f.address),
            function: f.function.clone(),
            file: f.file.clone(),
            line: f.line,
            module: f.module.clone(),
            module_offset: f.module_offset.as_deref().map(parse_hex),
            function_offset: f.function_offset.as_deref().map(parse_hex),
            inlined: f.inlined,
        }
    }
}

impl From<&Totals> for JsonTotals {
    fn from(t: &Totals) -> Self {
        JsonTotals {
            live_bytes: t.live_bytes,
            live_blocks: t.live_blocks,
            alloc_bytes: t.alloc_bytes,
            alloc_blocks: t.alloc_blocks,
            peak_bytes: t.peak_bytes,
            peak_tolerance: t.peak_tolerance,
        }
    }
}

/// Converts a snapshot to the JSON document.
pub fn to_json(s: &Snapshot) -> JsonSnapshot {
    let mut dropped = BTreeMap::new();
    dropped.insert("total".to_string(), s.dropped_total());
    dropped.extend(s.dropped.iter().map(|(k, v)| (k.clone(), *v)));
    JsonSnapshot {
        format: "heapdump-snapshot".into(),
        schema_version: 1,
        pid: s.pid,
        process: s.process.clone(),
        cmdline: s.cmdline.clone(),
        taken_at: s.taken_at.map(rfc3339).unwrap_or_default(),
        totals: JsonTotals::from(&s.totals),
        dropped,
        threads: s
            .threads
            .iter()
            .map(|t| JsonThread {
                tid: t.tid,
                name: t.name.clone(),
                live_bytes: t.live_bytes,
                live_blocks: t.live_blocks,
            })
            .collect(),
        sites: s
            .sites
            .iter()
            .map(|site| JsonSite {
                live_bytes: site.live_bytes,
                live_blocks: site.live_blocks,
                alloc_bytes: site.alloc_bytes,
                alloc_blocks: site.alloc_blocks,
                frames: site.frames.iter().map(JsonFrame::from).collect(),
                threads: site
                    .by_thread
                    .iter()
                    .map(|(ti, b, n)| JsonSiteThread {
                        tid: s.threads.get(*ti).map_or(0, |t| t.tid),
                        live_bytes: *b,
                        live_blocks: *n,
                    })
                    .collect(),
                oldest_alloc_time: site.oldest.map(rfc3339),
                newest_alloc_time: site.newest.map(rfc3339),
            })
            .collect(),
        mappings: s
            .mappings
            .iter()
            .map(|m| JsonMapping {
                start: hex(m.start),
                end: hex(m.end),
                offset: hex(m.offset),
                path: m.path.clone(),
                build_id: m.build_id.clone(),
            })
            .collect(),
        request: s.request.as_ref().map(|r| JsonRequest {
            count: r.count,
            name: r.name.clone(),
            time: r.time.map(rfc3339),
        }),
        symbolized: s.symbolized,
        partial: s.partial.clone(),
        selection: s.selection.as_ref().map(JsonSelection::from),
        notes: s.notes.clone(),
        unwinder: s.unwinder.clone(),
        sampling: s.sampling.map(|rate_bytes| JsonSampling {
            rate_bytes,
            estimated: true,
        }),
        recording: s.recording.as_ref().map(JsonRecording::from),
        timeline: s
            .timeline
            .as_ref()
            .map(|t| t.points.iter().map(JsonPoint::from).collect()),
        timeline_thinned: s.timeline.as_ref().map_or(0, |t| t.thinned),
        peak: s.peak.as_ref().map(JsonPeak::from),
    }
}

impl From<&Selection> for JsonSelection {
    fn from(s: &Selection) -> Self {
        JsonSelection {
            older_than: s.older_than.map(rfc3339),
            newer_than: s.newer_than.map(rfc3339),
            live_bytes: s.live_bytes,
            live_blocks: s.live_blocks,
        }
    }
}

fn parse_time(t: Option<&str>) -> Option<SystemTime> {
    t.and_then(|t| humantime::parse_rfc3339(t).ok())
}

/// Rebuilds a snapshot from its JSON form (for `diff` and re-rendering a
/// saved snapshot in another format).
pub fn from_json(j: &JsonSnapshot) -> Snapshot {
    let threads: Vec<ThreadStat> = j
        .threads
        .iter()
        .map(|t| ThreadStat {
            tid: t.tid,
            name: t.name.clone(),
            live_bytes: t.live_bytes,
            live_blocks: t.live_blocks,
        })
        .collect();
    let mut dropped = j.dropped.clone();
    dropped.remove("total");
    Snapshot {
        pid: j.pid,
        process: j.process.clone(),
        cmdline: j.cmdline.clone(),
        taken_at: humantime::parse_rfc3339(&j.taken_at).ok(),
        totals: Totals {
            live_bytes: j.totals.live_bytes,
            live_blocks: j.totals.live_blocks,
            alloc_bytes: j.totals.alloc_bytes,
            alloc_blocks: j.totals.alloc_blocks,
            peak_bytes: j.totals.peak_bytes,
            peak_tolerance: j.totals.peak_tolerance,
        },
        dropped,
        sites: j
            .sites
            .iter()
            .map(|s| {
                let frames: Vec<Frame> = s.frames.iter().map(Frame::from).collect();
                // One address per group of frames inlined at it: the group
                // ends with its outermost frame (`inlined: false`). Not a
                // dedup of equal neighbours: recursion repeats addresses.
                let addresses: Vec<u64> = frames
                    .iter()
                    .filter(|f| !f.inlined)
                    .map(|f| f.address)
                    .collect();
                Site {
                    addresses,
                    frames,
                    live_bytes: s.live_bytes,
                    live_blocks: s.live_blocks,
                    alloc_bytes: s.alloc_bytes,
                    alloc_blocks: s.alloc_blocks,
                    by_thread: s
                        .threads
                        .iter()
                        .filter_map(|st| {
                            let i = threads.iter().position(|t| t.tid == st.tid)?;
                            Some((i, st.live_bytes, st.live_blocks))
                        })
                        .collect(),
                    oldest: parse_time(s.oldest_alloc_time.as_deref()),
                    newest: parse_time(s.newest_alloc_time.as_deref()),
                }
            })
            .collect(),
        threads,
        mappings: j
            .mappings
            .iter()
            .map(|m| Mapping {
                start: parse_hex(&m.start),
                end: parse_hex(&m.end),
                offset: parse_hex(&m.offset),
                path: m.path.clone(),
                build_id: m.build_id.clone(),
                local: None,
                file: None,
            })
            .collect(),
        partial: j.partial.clone(),
        request: j.request.as_ref().map(|r| Request {
            count: r.count,
            name: r.name.clone(),
            time: parse_time(r.time.as_deref()),
        }),
        symbolized: j.symbolized,
        selection: j.selection.as_ref().map(|s| Selection {
            older_than: parse_time(s.older_than.as_deref()),
            newer_than: parse_time(s.newer_than.as_deref()),
            live_bytes: s.live_bytes,
            live_blocks: s.live_blocks,
        }),
        notes: j.notes.clone(),
        unwinder: j.unwinder.clone(),
        sampling: j.sampling.as_ref().map(|s| s.rate_bytes),
        recording: j.recording.as_ref().map(Into::into),
        timeline: timeline_from_json(j),
        peak: j.peak.as_ref().and_then(|p| {
            Some(crate::process::snapshot::PeakInfo {
                time: humantime::parse_rfc3339(&p.time).ok()?,
                live_bytes: p.live_bytes,
                tolerance: p.tolerance,
                at_peak: p.at_peak,
            })
        }),
        timing: Default::default(),
    }
}

/// Why a JSON snapshot file could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    /// Not readable.
    #[error("reading {path}: {source}")]
    Read {
        /// File.
        path: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
    /// Not heapdump JSON.
    #[error(
        "{path} is not a heapdump JSON snapshot ({source}); write one with \
         `heapdump snapshot PID -o FILE.json`"
    )]
    Parse {
        /// File.
        path: String,
        /// Cause.
        #[source]
        source: serde_json::Error,
    },
}

/// Reads a JSON snapshot file (for `diff`, `symbolize`).
pub fn read_snapshot(path: &str) -> Result<Snapshot, ReadError> {
    let bytes = std::fs::read(path).map_err(|source| ReadError::Read {
        path: path.to_string(),
        source,
    })?;
    let j: JsonSnapshot = serde_json::from_slice(&bytes).map_err(|source| ReadError::Parse {
        path: path.to_string(),
        source,
    })?;
    Ok(from_json(&j))
}

/// Renders the JSON document, pretty-printed.
pub fn render(s: &Snapshot) -> Vec<u8> {
    let mut out = Vec::new();
    write(s, &mut out).expect("writing to a Vec cannot fail");
    out
}

/// Writes the JSON document, pretty-printed, to `w` as it is serialized:
/// the same bytes as serializing [`to_json`], without copying every string
/// of the snapshot into an owned document first, and without holding the
/// whole text in memory (a symbolized snapshot of 10 000 deep sites is
/// ~130 MB of JSON).
pub fn write(s: &Snapshot, w: &mut impl std::io::Write) -> std::io::Result<()> {
    serde_json::to_writer_pretty(&mut *w, &view::SnapshotView(s))?;
    w.write_all(b"\n")
}

/// Serialize-only views of a [`Snapshot`] in the schema's shape: borrowed
/// strings, addresses formatted while written, sequences produced lazily.
/// Field order and names are those of the owned types above (a test
/// checks that both serialize to the same bytes).
mod view {
    use serde::ser::{SerializeMap, SerializeStruct};
    use serde::{Serialize, Serializer};

    use super::{rfc3339, JsonTotals};
    use crate::process::snapshot::{Site, Snapshot};
    use crate::symbolization::symbolizer::Frame;

    /// `0x...` without an intermediate `String`.
    struct Hex(u64);

    impl Serialize for Hex {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_str(&format_args!("{:#x}", self.0))
        }
    }

    /// A sequence serialized from an iterator made on demand.
    struct Seq<F>(F);

    impl<F, I> Serialize for Seq<F>
    where
        F: Fn() -> I,
        I: IntoIterator,
        I::Item: Serialize,
    {
        fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
            s.collect_seq((self.0)())
        }
    }

    pub(super) struct SnapshotView<'a>(pub &'a Snapshot);

    impl Serialize for SnapshotView<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            let s = self.0;
            let mut m = ser.serialize_struct("JsonSnapshot", 22)?;
            m.serialize_field("format", "heapdump-snapshot")?;
            m.serialize_field("schema_version", &1u32)?;
            m.serialize_field("pid", &s.pid)?;
            m.serialize_field("process", &s.process)?;
            m.serialize_field("cmdline", &s.cmdline)?;
            m.serialize_field("taken_at", &s.taken_at.map(rfc3339).unwrap_or_default())?;
            m.serialize_field("totals", &JsonTotals::from(&s.totals))?;
            m.serialize_field("dropped", &Dropped(s))?;
            m.serialize_field(
                "threads",
                &Seq(|| {
                    s.threads.iter().map(|t| Thread {
                        tid: t.tid,
                        name: &t.name,
                        live_bytes: t.live_bytes,
                        live_blocks: t.live_blocks,
                    })
                }),
            )?;
            m.serialize_field(
                "sites",
                &Seq(|| s.sites.iter().map(|site| SiteView(s, site))),
            )?;
            m.serialize_field(
                "mappings",
                &Seq(|| {
                    s.mappings.iter().map(|m| Mapping {
                        start: Hex(m.start),
                        end: Hex(m.end),
                        offset: Hex(m.offset),
                        path: &m.path,
                        build_id: m.build_id.as_deref(),
                    })
                }),
            )?;
            m.serialize_field(
                "request",
                &s.request.as_ref().map(|r| Request {
                    count: r.count,
                    name: &r.name,
                    time: r.time.map(rfc3339),
                }),
            )?;
            m.serialize_field("symbolized", &s.symbolized)?;
            m.serialize_field("partial", &s.partial)?;
            m.serialize_field(
                "selection",
                &s.selection.as_ref().map(super::JsonSelection::from),
            )?;
            m.serialize_field("notes", &s.notes)?;
            m.serialize_field("unwinder", &s.unwinder)?;
            m.serialize_field(
                "sampling",
                &s.sampling.map(|rate_bytes| super::JsonSampling {
                    rate_bytes,
                    estimated: true,
                }),
            )?;
            m.serialize_field(
                "recording",
                &s.recording.as_ref().map(super::JsonRecording::from),
            )?;
            m.serialize_field(
                "timeline",
                &s.timeline.as_ref().map(|t| {
                    t.points
                        .iter()
                        .map(super::JsonPoint::from)
                        .collect::<Vec<_>>()
                }),
            )?;
            m.serialize_field(
                "timeline_thinned",
                &s.timeline.as_ref().map_or(0, |t| t.thinned),
            )?;
            m.serialize_field("peak", &s.peak.as_ref().map(super::JsonPeak::from))?;
            m.end()
        }
    }

    /// `total` and each reason, in key order (as in the owned map).
    struct Dropped<'a>(&'a Snapshot);

    impl Serialize for Dropped<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            let s = self.0;
            let mut all: std::collections::BTreeMap<&str, u64> =
                s.dropped.iter().map(|(k, v)| (k.as_str(), *v)).collect();
            all.insert("total", s.dropped_total());
            let mut m = ser.serialize_map(Some(all.len()))?;
            for (k, v) in all {
                m.serialize_entry(k, &v)?;
            }
            m.end()
        }
    }

    #[derive(Serialize)]
    struct Thread<'a> {
        tid: u64,
        name: &'a str,
        live_bytes: u64,
        live_blocks: u64,
    }

    struct SiteView<'a>(&'a Snapshot, &'a Site);

    impl Serialize for SiteView<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            let (snap, site) = (self.0, self.1);
            let mut m = ser.serialize_struct("JsonSite", 8)?;
            m.serialize_field("live_bytes", &site.live_bytes)?;
            m.serialize_field("live_blocks", &site.live_blocks)?;
            m.serialize_field("alloc_bytes", &site.alloc_bytes)?;
            m.serialize_field("alloc_blocks", &site.alloc_blocks)?;
            m.serialize_field("frames", &Seq(|| site.frames.iter().map(FrameView)))?;
            m.serialize_field(
                "threads",
                &Seq(|| {
                    site.by_thread.iter().map(|(ti, b, n)| SiteThread {
                        tid: snap.threads.get(*ti).map_or(0, |t| t.tid),
                        live_bytes: *b,
                        live_blocks: *n,
                    })
                }),
            )?;
            m.serialize_field("oldest_alloc_time", &site.oldest.map(rfc3339))?;
            m.serialize_field("newest_alloc_time", &site.newest.map(rfc3339))?;
            m.end()
        }
    }

    #[derive(Serialize)]
    struct SiteThread {
        tid: u64,
        live_bytes: u64,
        live_blocks: u64,
    }

    struct FrameView<'a>(&'a Frame);

    impl Serialize for FrameView<'_> {
        fn serialize<S: Serializer>(&self, ser: S) -> Result<S::Ok, S::Error> {
            let f = self.0;
            let mut m = ser.serialize_struct("JsonFrame", 8)?;
            m.serialize_field("address", &Hex(f.address))?;
            m.serialize_field("function", &f.function)?;
            m.serialize_field("file", &f.file)?;
            m.serialize_field("line", &f.line)?;
            m.serialize_field("module", &f.module)?;
            if let Some(off) = f.module_offset {
                m.serialize_field("module_offset", &Hex(off))?;
            } else {
                m.skip_field("module_offset")?;
            }
            if let Some(off) = f.function_offset {
                m.serialize_field("function_offset", &Hex(off))?;
            } else {
                m.skip_field("function_offset")?;
            }
            m.serialize_field("inlined", &f.inlined)?;
            m.end()
        }
    }

    #[derive(Serialize)]
    struct Mapping<'a> {
        start: Hex,
        end: Hex,
        offset: Hex,
        path: &'a str,
        build_id: Option<&'a str>,
    }

    #[derive(Serialize)]
    struct Request<'a> {
        count: u64,
        name: &'a str,
        time: Option<String>,
    }
}

#[cfg(test)]
mod tests {
    use std::time::{Duration, UNIX_EPOCH};

    use super::*;

    fn frame(address: u64, function: Option<&str>, inlined: bool) -> Frame {
        Frame {
            address,
            function: function.map(str::to_string),
            file: function.map(|_| "/src/a \"quoted\".rs".to_string()),
            line: function.map(|_| 42),
            module: Some("/bin/prog".to_string()),
            module_offset: function.is_none().then_some(address % 0x1000),
            function_offset: None,
            inlined,
        }
    }

    fn sample() -> Snapshot {
        let t = UNIX_EPOCH + Duration::from_micros(1_700_000_000_123_456);
        Snapshot {
            pid: 4242,
            process: "prog".into(),
            cmdline: vec!["prog".into(), "--flag=\u{e9}".into()],
            taken_at: Some(t),
            totals: Totals {
                live_bytes: 10,
                live_blocks: 2,
                alloc_bytes: 30,
                alloc_blocks: 5,
                peak_bytes: 20,
                peak_tolerance: 0,
            },
            dropped: [
                ("reentrant".to_string(), 3),
                ("allocations_full".to_string(), 1),
            ]
            .into_iter()
            .collect(),
            threads: vec![
                ThreadStat {
                    tid: 4242,
                    name: "main".into(),
                    live_bytes: 6,
                    live_blocks: 1,
                },
                ThreadStat {
                    tid: 4243,
                    name: "worker\t1".into(),
                    live_bytes: 4,
                    live_blocks: 1,
                },
            ],
            sites: vec![
                Site {
                    addresses: vec![0x1000, 0x2000],
                    frames: vec![
                        frame(0x1000, Some("inner"), true),
                        frame(0x1000, Some("outer<T>::f"), false),
                        frame(0x2000, None, false),
                    ],
                    live_bytes: 6,
                    live_blocks: 1,
                    alloc_bytes: 20,
                    alloc_blocks: 3,
                    by_thread: vec![(0, 6, 1), (7, 0, 0)],
                    oldest: Some(t - Duration::from_secs(3600)),
                    newest: Some(t - Duration::from_micros(5)),
                },
                Site::default(),
            ],
            mappings: vec![Mapping {
                start: 0x1000,
                end: 0x3000,
                offset: 0,
                path: "/bin/prog".into(),
                build_id: Some("abcd".into()),
                local: None,
                file: None,
            }],
            partial: Some("1 record never read consistently".into()),
            request: Some(Request {
                count: 2,
                name: "after-warmup".into(),
                time: Some(t),
            }),
            symbolized: true,
            selection: Some(Selection {
                older_than: Some(t - Duration::from_secs(60)),
                newer_than: None,
                live_bytes: 6,
                live_blocks: 1,
            }),
            notes: vec!["the program has mimalloc linked in statically".into()],
            unwinder: "cfi+fp".into(),
            sampling: Some(512 << 10),
            recording: None,
            timeline: None,
            peak: None,
            timing: Default::default(),
        }
    }

    #[test]
    fn the_streamed_document_is_byte_for_byte_the_owned_one() {
        let mut s = sample();
        let mut owned = serde_json::to_vec_pretty(&to_json(&s)).unwrap();
        owned.push(b'\n');
        assert_eq!(
            String::from_utf8(render(&s)).unwrap(),
            String::from_utf8(owned).unwrap()
        );
        // Selection and allocation times read back as they were.
        let back = from_json(&serde_json::from_slice(&render(&s)).unwrap());
        assert_eq!(back.selection, s.selection);
        assert_eq!(back.notes, s.notes);
        assert_eq!(
            (back.sites[0].oldest, back.sites[0].newest),
            (s.sites[0].oldest, s.sites[0].newest)
        );
        // And with every optional part empty.
        s.request = None;
        s.partial = None;
        s.taken_at = None;
        s.dropped.clear();
        s.mappings[0].build_id = None;
        s.selection = None;
        s.notes.clear();
        s.sampling = None;
        s.sites[0].oldest = None;
        s.sites[0].newest = None;
        let mut owned = serde_json::to_vec_pretty(&to_json(&s)).unwrap();
        owned.push(b'\n');
        assert_eq!(render(&s), owned);
        // It reads back as the owned document.
        let back: JsonSnapshot = serde_json::from_slice(&render(&s)).unwrap();
        assert_eq!(
            back.sites[0].frames[1].function.as_deref(),
            Some("outer<T>::f")
        );
    }

    #[test]
    fn addresses_read_back_one_per_inlined_group_and_keep_recursion() {
        let mut s = sample();
        s.sites[0].frames = vec![
            frame(0x1000, Some("inlined_into_f"), true),
            frame(0x1000, Some("f"), false),
            frame(0x2000, Some("recurse"), false),
            frame(0x2000, Some("recurse"), false),
            frame(0x3000, None, false),
        ];
        let j: JsonSnapshot = serde_json::from_slice(&render(&s)).unwrap();
        let back = from_json(&j);
        assert_eq!(back.sites[0].addresses, [0x1000, 0x2000, 0x2000, 0x3000]);
        assert_eq!(back.sites[0].frames, s.sites[0].frames);
    }
}
