//! pprof output in Go's heap-profile layout, gzipped.
//!
//! Sample types, in Go's order: `alloc_objects/count`, `alloc_space/bytes`
//! (cumulative since start), `inuse_objects/count`, `inuse_space/bytes`
//! (live now); `period_type` is `space/bytes`, period 1 when every block
//! is counted, or the sample rate in sampled mode, where the values are
//! already the scaled estimates (as Go writes them);
//! `default_sample_type` is `inuse_space`.
//!
//! Each distinct return address is one `Location`, whose `address` is the
//! return address minus one (inside the call instruction, so any tool can
//! symbolize it again), tied to its `Mapping` (with the build ID), and
//! whose `Line`s list inlined functions innermost first, as pprof wants.
//! The string table starts with `""`, and every string is stored once.
//!
//! With `per_thread`, live values are split per allocating thread, with a
//! `thread` label (`name [tid]`) and a numeric `tid` label; the cumulative
//! `alloc_*` values are only kept per stack, so they go in one extra
//! sample per stack without a thread label. Sums stay exact either way.
//!
//! The protobuf messages are written out here with `prost` derives (from
//! pprof's `profile.proto`), so no `protoc` is needed to build.

use std::collections::HashMap;
use std::io::Write;

use flate2::write::GzEncoder;
use flate2::Compression;
use prost::Message;

use crate::process::snapshot::Snapshot;
use crate::symbolization::maps::Mapping;
use crate::symbolization::symbolizer::Frame;

/// `perftools.profiles.Profile`.
#[derive(Clone, PartialEq, Message)]
pub struct Profile {
    /// Sample value types.
    #[prost(message, repeated, tag = "1")]
    pub sample_type: Vec<ValueType>,
    /// Samples.
    #[prost(message, repeated, tag = "2")]
    pub sample: Vec<Sample>,
    /// Mappings.
    #[prost(message, repeated, tag = "3")]
    pub mapping: Vec<PbMapping>,
    /// Locations.
    #[prost(message, repeated, tag = "4")]
    pub location: Vec<Location>,
    /// Functions.
    #[prost(message, repeated, tag = "5")]
    pub function: Vec<Function>,
    /// String table; entry 0 is `""`.
    #[prost(string, repeated, tag = "6")]
    pub string_table: Vec<String>,
    /// Regexp (string index) of frames to drop.
    #[prost(int64, tag = "7")]
    pub drop_frames: i64,
    /// Regexp (string index) of frames to keep.
    #[prost(int64, tag = "8")]
    pub keep_frames: i64,
    /// Time of collection, ns since the epoch.
    #[prost(int64, tag = "9")]
    pub time_nanos: i64,
    /// Duration, ns.
    #[prost(int64, tag = "10")]
    pub duration_nanos: i64,
    /// Kind of events between samples.
    #[prost(message, optional, tag = "11")]
    pub period_type: Option<ValueType>,
    /// Events between samples.
    #[prost(int64, tag = "12")]
    pub period: i64,
    /// Free-form comments (string indices).
    #[prost(int64, repeated, tag = "13")]
    pub comment: Vec<i64>,
    /// Preferred sample type (string index).
    #[prost(int64, tag = "14")]
    pub default_sample_type: i64,
}

/// `ValueType`.
#[derive(Clone, PartialEq, Message)]
pub struct ValueType {
    /// Type (string index).
    #[prost(int64, tag = "1")]
    pub r#type: i64,
    /// Unit (string index).
    #[prost(int64, tag = "2")]
    pub unit: i64,
}

/// `Sample`.
#[derive(Clone, PartialEq, Message)]
pub struct Sample {
    /// Location ids, leaf first.
    #[prost(uint64, repeated, tag = "1")]
    pub location_id: Vec<u64>,
    /// One value per sample type.
    #[prost(int64, repeated, tag = "2")]
    pub value: Vec<i64>,
    /// Labels.
    #[prost(message, repeated, tag = "3")]
    pub label: Vec<Label>,
}

/// `Label`.
#[derive(Clone, PartialEq, Message)]
pub struct Label {
    /// Key (string index).
    #[prost(int64, tag = "1")]
    pub key: i64,
    /// String value (string index).
    #[prost(int64, tag = "2")]
    pub str: i64,
    /// Numeric value.
    #[prost(int64, tag = "3")]
    pub num: i64,
    /// Unit of `num` (string index).
    #[prost(int64, tag = "4")]
    pub num_unit: i64,
}

/// `Mapping`.
#[derive(Clone, PartialEq, Message)]
pub struct PbMapping {
    /// Id (1-based).
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Start address.
    #[prost(uint64, tag = "2")]
    pub memory_start: u64,
    /// End address.
    #[prost(uint64, tag = "3")]
    pub memory_limit: u64,
    /// File offset.
    #[prost(uint64, tag = "4")]
    pub file_offset: u64,
    /// File name (string index).
    #[prost(int64, tag = "5")]
    pub filename: i64,
    /// Build ID (string index).
    #[prost(int64, tag = "6")]
    pub build_id: i64,
    /// Functions were resolved.
    #[prost(bool, tag = "7")]
    pub has_functions: bool,
    /// File names were resolved.
    #[prost(bool, tag = "8")]
    pub has_filenames: bool,
    /// Line numbers were resolved.
    #[prost(bool, tag = "9")]
    pub has_line_numbers: bool,
    /// Inlined frames were resolved.
    #[prost(bool, tag = "10")]
    pub has_inline_frames: bool,
}

/// `Location`.
#[derive(Clone, PartialEq, Message)]
pub struct Location {
    /// Id (1-based).
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Mapping id (0 = none).
    #[prost(uint64, tag = "2")]
    pub mapping_id: u64,
    /// Instruction address.
    #[prost(uint64, tag = "3")]
    pub address: u64,
    /// Lines, innermost inlined first.
    #[prost(message, repeated, tag = "4")]
    pub line: Vec<Line>,
    /// Folded.
    #[prost(bool, tag = "5")]
    pub is_folded: bool,
}

/// `Line`.
#[derive(Clone, PartialEq, Message)]
pub struct Line {
    /// Function id.
    #[prost(uint64, tag = "1")]
    pub function_id: u64,
    /// Line number.
    #[prost(int64, tag = "2")]
    pub line: i64,
    /// Column.
    #[prost(int64, tag = "3")]
    pub column: i64,
}

/// `Function`.
#[derive(Clone, PartialEq, Message)]
pub struct Function {
    /// Id (1-based).
    #[prost(uint64, tag = "1")]
    pub id: u64,
    /// Name (string index).
    #[prost(int64, tag = "2")]
    pub name: i64,
    /// System (mangled) name (string index).
    #[prost(int64, tag = "3")]
    pub system_name: i64,
    /// Source file (string index).
    #[prost(int64, tag = "4")]
    pub filename: i64,
    /// Start line.
    #[prost(int64, tag = "5")]
    pub start_line: i64,
}

/// One sample to encode: frames leaf first and the four values
/// (alloc_objects, alloc_space, inuse_objects, inuse_space).
#[derive(Clone, Debug)]
pub struct InputSample<'a> {
    /// Frames, leaf first, inlined expanded.
    pub frames: &'a [Frame],
    /// Values in sample-type order.
    pub values: [i64; 4],
    /// Optional thread label: (name, tid).
    pub thread: Option<(String, u64)>,
}

#[derive(Default)]
struct Builder {
    strings: Vec<String>,
    string_ids: HashMap<String, i64>,
    functions: Vec<Function>,
    function_ids: HashMap<(i64, i64), u64>,
    locations: Vec<Location>,
    /// Keyed by address and number of lines: a stack whose leading
    /// allocator frames were dropped may keep only the outer inlined
    /// frames of an address.
    location_ids: HashMap<(u64, usize), u64>,
    mappings: Vec<PbMapping>,
}

impl Builder {
    fn s(&mut self, v: &str) -> i64 {
        if let Some(&i) = self.string_ids.get(v) {
            return i;
        }
        let i = self.strings.len() as i64;
        self.strings.push(v.to_string());
        self.string_ids.insert(v.to_string(), i);
        i
    }

    fn function(&mut self, name: &str, file: &str) -> u64 {
        let key = (self.s(name), self.s(file));
        if let Some(&id) = self.function_ids.get(&key) {
            return id;
        }
        let id = self.functions.len() as u64 + 1;
        self.functions.push(Function {
            id,
            name: key.0,
            system_name: key.0,
            filename: key.1,
            start_line: 0,
        });
        self.function_ids.insert(key, id);
        id
    }

    /// Location for the frames of one return address (innermost first).
    fn location(&mut self, frames: &[Frame], maps: &[Mapping]) -> u64 {
        let addr = frames[0].address;
        if let Some(&id) = self.location_ids.get(&(addr, frames.len())) {
            return id;
        }
        let pc = addr.wrapping_sub(1);
        let mapping_id = maps
            .iter()
            .position(|m| m.contains(pc))
            .map_or(0, |i| i as u64 + 1);
        let mut lines = Vec::new();
        for f in frames {
            if let Some(name) = &f.function {
                let fid = self.function(name, f.file.as_deref().unwrap_or(""));
                lines.push(Line {
                    function_id: fid,
                    line: i64::from(f.line.unwrap_or(0)),
                    column: 0,
                });
            }
        }
        let id = self.locations.len() as u64 + 1;
        self.locations.push(Location {
            id,
            mapping_id,
            address: pc,
            line: lines,
            is_folded: false,
        });
        self.location_ids.insert((addr, frames.len()), id);
        id
    }
}

/// Splits frames into runs of one address each (inlined frames together).
fn per_address(frames: &[Frame]) -> impl Iterator<Item = &[Frame]> {
    let mut rest = frames;
    std::iter::from_fn(move || {
        let first = rest.first()?;
        let n = rest
            .iter()
            .take_while(|f| f.address == first.address)
            .count();
        let (run, tail) = rest.split_at(n);
        rest = tail;
        Some(run)
    })
}

/// Builds a profile from samples.
pub fn build(
    samples: &[InputSample<'_>],
    mappings: &[Mapping],
    time_nanos: i64,
    comments: &[String],
    symbolized: bool,
    period: i64,
) -> Profile {
    let mut b = Builder::default();
    b.s("");
    let vt = |b: &mut Builder, t: &str, u: &str| ValueType {
        r#type: b.s(t),
        unit: b.s(u),
    };
    let sample_type = vec![
        vt(&mut b, "alloc_objects", "count"),
        vt(&mut b, "alloc_space", "bytes"),
        vt(&mut b, "inuse_objects", "count"),
        vt(&mut b, "inuse_space", "bytes"),
    ];
    let period_type = Some(vt(&mut b, "space", "bytes"));
    let default_sample_type = b.s("inuse_space");
    for m in mappings {
        let id = b.mappings.len() as u64 + 1;
        let filename = b.s(&m.path);
        let build_id = b.s(m.build_id.as_deref().unwrap_or(""));
        b.mappings.push(PbMapping {
            id,
            memory_start: m.start,
            memory_limit: m.end,
            file_offset: m.offset,
            filename,
            build_id,
            has_functions: symbolized,
            has_filenames: symbolized,
            has_line_numbers: symbolized,
            has_inline_frames: symbolized,
        });
    }
    let thread_key = b.s("thread");
    let tid_key = b.s("tid");
    let mut out = Vec::with_capacity(samples.len());
    for s in samples {
        let location_id = per_address(s.frames)
            .map(|run| b.location(run, mappings))
            .collect();
        let label = match &s.thread {
            Some((name, tid)) => vec![
                Label {
                    key: thread_key,
                    str: b.s(&format!("{name} [{tid}]")),
                    num: 0,
                    num_unit: 0,
                },
                Label {
                    key: tid_key,
                    str: 0,
                    num: *tid as i64,
                    num_unit: 0,
                },
            ],
            None => Vec::new(),
        };
        out.push(Sample {
            location_id,
            value: s.values.to_vec(),
            label,
        });
    }
    let comment = comments.iter().map(|c| b.s(c)).collect();
    Profile {
        sample_type,
        sample: out,
        mapping: b.mappings,
        location: b.locations,
        function: b.functions,
        string_table: b.strings,
        drop_frames: 0,
        keep_frames: 0,
        time_nanos,
        duration_nanos: 0,
        period_type,
        period: period.max(1),
        comment,
        default_sample_type,
    }
}

fn sat(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

/// The pprof profile of a snapshot.
pub fn from_snapshot(s: &Snapshot, per_thread: bool) -> Profile {
    let mut samples = Vec::new();
    for site in &s.sites {
        if per_thread && !site.by_thread.is_empty() {
            samples.push(InputSample {
                frames: &site.frames,
                values: [sat(site.alloc_blocks), sat(site.alloc_bytes), 0, 0],
                thread: None,
            });
            for (ti, bytes, blocks) in &site.by_thread {
                let t = &s.threads[*ti];
                samples.push(InputSample {
                    frames: &site.frames,
                    values: [0, 0, sat(*blocks), sat(*bytes)],
                    thread: Some((t.name.clone(), t.tid)),
                });
            }
        } else {
            samples.push(InputSample {
                frames: &site.frames,
                values: [
                    sat(site.alloc_blocks),
                    sat(site.alloc_bytes),
                    sat(site.live_blocks),
                    sat(site.live_bytes),
                ],
                thread: None,
            });
        }
    }
    let mut comments = vec![format!(
        "heapdump snapshot of pid {} ({}): {} live bytes in {} blocks",
        s.pid, s.process, s.totals.live_bytes, s.totals.live_blocks
    )];
    if s.dropped_total() > 0 {
        comments.push(format!("dropped events: {}", s.dropped_total()));
    }
    if let Some(p) = &s.partial {
        comments.push(format!("partial: {p}"));
    }
    comments.extend(s.notes.iter().map(|n| format!("note: {n}")));
    comments.push(format!("unwinder: {}", s.unwinder));
    if let Some(r) = &s.recording {
        comments.push(r.describe(s.recorded_live_now(), s.taken_at));
    }
    if let Some(p) = &s.peak {
        comments.push(if p.at_peak {
            format!(
                "the heap at its peak, {}: {} live bytes (tolerance {} bytes); inuse values are \
                 the heap then",
                crate::formats::json::rfc3339(p.time),
                p.live_bytes,
                p.tolerance
            )
        } else {
            format!(
                "the heap now, {}: {} live bytes; its composition at the peak ({} bytes) was not \
                 recorded; inuse values are the heap now",
                crate::formats::json::rfc3339(p.time),
                p.live_bytes,
                s.totals.peak_bytes
            )
        });
    }
    if let Some(tl) = &s.timeline {
        if let Some(line) = tl.describe(s.taken_at) {
            comments.push(line);
        }
        // The curve itself, compactly: seconds since its first point and
        // live bytes, for tools that read comments.
        if let Some(first) = tl.points.first() {
            let pts: Vec<String> = tl
                .points
                .iter()
                .map(|p| {
                    let dt = p.time.duration_since(first.time).unwrap_or_default();
                    format!("{:.3}:{}", dt.as_secs_f64(), p.live_bytes)
                })
                .collect();
            comments.push(format!("timeline (s:live_bytes): {}", pts.join(" ")));
        }
    }
    let time_nanos = s
        .taken_at
        .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
        .map_or(0, |d| d.as_nanos() as i64);
    if let Some(rate) = s.sampling {
        comments.push(format!(
            "sampled: one allocation per {rate} bytes on average; values are estimates"
        ));
    }
    build(
        &samples,
        &s.mappings,
        time_nanos,
        &comments,
        s.symbolized,
        s.sampling.map_or(1, |r| r as i64),
    )
}

/// Gzips an encoded profile.
pub fn encode_gzip(p: &Profile) -> Vec<u8> {
    let mut enc = GzEncoder::new(Vec::new(), Compression::default());
    enc.write_all(&p.encode_to_vec())
        .expect("writing to a Vec cannot fail");
    enc.finish().expect("writing to a Vec cannot fail")
}

/// Renders a snapshot as gzipped pprof.
pub fn render(s: &Snapshot, per_thread: bool) -> Vec<u8> {
    encode_gzip(&from_snapshot(s, per_thread))
}

/// Makes `name` (one of the profile's sample types, e.g. `alloc_space`)
/// the type a viewer shows first; unchanged if the profile has no such
/// type.
pub fn set_default_sample_type(p: &mut Profile, name: &str) {
    if let Some(i) = p.string_table.iter().position(|s| s == name) {
        if p.sample_type.iter().any(|t| t.r#type == i as i64) {
            p.default_sample_type = i as i64;
        }
    }
}

/// Decodes a (possibly gzipped) pprof file.
pub fn decode(bytes: &[u8]) -> Result<Profile, prost::DecodeError> {
    use std::io::Read;
    if bytes.starts_with(&[0x1f, 0x8b]) {
        let mut raw = Vec::new();
        if flate2::read::GzDecoder::new(bytes)
            .read_to_end(&mut raw)
            .is_ok()
        {
            return Profile::decode(raw.as_slice());
        }
    }
    Profile::decode(bytes)
}
