//! `--format json`: the stable, machine-readable snapshot schema.
//!
//! Schema (version 1; fields are only ever added, never renamed):
//!
//! ```text
//! {
//!   "format": "heapdump-snapshot", "schema_version": 1,
//!   "pid": 1234, "process": "name", "cmdline": ["prog", "arg"],
//!   "taken_at": "2024-01-01T12:00:00.123456Z",        // RFC 3339, UTC
//!   "totals": {"live_bytes", "live_blocks", "alloc_bytes", "alloc_blocks", "peak_bytes"},
//!   "dropped": {"total": 0, "<reason>": n, ...},       // reasons with n > 0
//!   "threads": [{"tid", "name", "live_bytes", "live_blocks"}],
//!   "sites": [{"live_bytes", "live_blocks", "alloc_bytes", "alloc_blocks",
//!              "frames": [{"address": "0x55...", "function", "file", "line",
//!                          "module", "inlined"}],       // leaf first
//!              "threads": [{"tid", "live_bytes", "live_blocks"}]}],
//!   "mappings": [{"start": "0x..", "end": "0x..", "offset": "0x..", "path", "build_id"}],
//!   "request": null | {"count", "name", "time"},
//!   "symbolized": true,
//!   "partial": null | "reason the walk was not clean"
//! }
//! ```
//!
//! `alloc_*` are cumulative since the process started; `live_*` are the
//! blocks live at the snapshot. Unknown `function`/`file`/`line`/`module`
//! are `null`. `frames` are leaf first (the caller of malloc first); the
//! frames of one address that were inlined have the same `address` and
//! `inlined: true` on all but the outermost.

use std::collections::BTreeMap;
use std::time::SystemTime;

use serde::{Deserialize, Serialize};

use crate::maps::Mapping;
use crate::snapshot::{Request, Site, Snapshot, ThreadStat, Totals};
use crate::symbolize::Frame;

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
    /// Peak live bytes.
    pub peak_bytes: u64,
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
    /// File path.
    pub path: String,
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
            inlined: f.inlined,
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
        totals: JsonTotals {
            live_bytes: s.totals.live_bytes,
            live_blocks: s.totals.live_blocks,
            alloc_bytes: s.totals.alloc_bytes,
            alloc_blocks: s.totals.alloc_blocks,
            peak_bytes: s.totals.peak_bytes,
        },
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
    }
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
        },
        dropped,
        sites: j
            .sites
            .iter()
            .map(|s| {
                let frames: Vec<Frame> = s.frames.iter().map(Frame::from).collect();
                let mut addresses: Vec<u64> = frames.iter().map(|f| f.address).collect();
                addresses.dedup();
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
                local_path: None,
            })
            .collect(),
        partial: j.partial.clone(),
        request: j.request.as_ref().map(|r| Request {
            count: r.count,
            name: r.name.clone(),
            time: r
                .time
                .as_deref()
                .and_then(|t| humantime::parse_rfc3339(t).ok()),
        }),
        symbolized: j.symbolized,
        timing: Default::default(),
    }
}

/// Renders the JSON document, pretty-printed.
pub fn render(s: &Snapshot) -> Vec<u8> {
    let mut out = serde_json::to_vec_pretty(&to_json(s)).expect("snapshot serializes");
    out.push(b'\n');
    out
}
