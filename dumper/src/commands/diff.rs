//! `heapdump diff A B`: growth per stack between two JSON snapshots.
//!
//! Sites are matched by their frames: the function name where symbolized,
//! else the module and the address's offset in the module's file, so two
//! runs of one binary with different load addresses (ASLR) still match.
//! The pprof output holds B − A in each of the four sample types (negative
//! where the heap shrank), so `go tool pprof -top diff.pb.gz` shows the
//! growth directly.

use std::collections::HashMap;
use std::fmt::Write;

use crate::formats::pprof::{self, InputSample};
use crate::formats::text::{human_bytes, human_delta};
use crate::process::snapshot::Snapshot;
use crate::symbolization::maps::{self, Mapping};
use crate::symbolization::symbolizer::Frame;

use crate::commands::args::ReportArgs;
use crate::formats::Format;
use anyhow::bail;
use anyhow::Context as _;
use clap::Args;
use std::io::Write as _;

/// The change of one site.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SiteDelta {
    /// Frames (from B when the site is in B).
    pub frames: Vec<Frame>,
    /// Live bytes in A.
    pub a_live_bytes: u64,
    /// Live bytes in B.
    pub b_live_bytes: u64,
    /// B − A live bytes.
    pub live_bytes: i64,
    /// B − A live blocks.
    pub live_blocks: i64,
    /// B − A allocated bytes.
    pub alloc_bytes: i64,
    /// B − A allocated blocks.
    pub alloc_blocks: i64,
}

/// A whole diff.
#[derive(Clone, Debug)]
pub struct Diff {
    /// Snapshot A.
    pub a: Snapshot,
    /// Snapshot B.
    pub b: Snapshot,
    /// Changed sites, largest live growth first.
    pub sites: Vec<SiteDelta>,
}

fn frame_key(f: &Frame, maps: &[Mapping]) -> String {
    if let Some(func) = &f.function {
        return func.clone();
    }
    match maps::find(maps, f.address.wrapping_sub(1)) {
        Some(m) => format!("{}+{:#x}", m.basename(), f.address - m.start + m.offset),
        None => format!("{:#x}", f.address),
    }
}

/// The key that matches a site across snapshots: its frames by function
/// name, else by module and offset (see the module doc).
pub fn site_key(frames: &[Frame], maps: &[Mapping]) -> String {
    frames
        .iter()
        .map(|f| frame_key(f, maps))
        .collect::<Vec<_>>()
        .join(";")
}

/// `b - a` as a signed count, saturating at the ends of `i64`.
pub fn delta(b: u64, a: u64) -> i64 {
    (i128::from(b) - i128::from(a)).clamp(i128::from(i64::MIN), i128::from(i64::MAX)) as i64
}

/// Computes B − A per site.
pub fn diff(a: Snapshot, b: Snapshot) -> Diff {
    let mut by_key: HashMap<String, SiteDelta> = HashMap::new();
    for s in &a.sites {
        let e = by_key
            .entry(site_key(&s.frames, &a.mappings))
            .or_insert_with(|| SiteDelta {
                frames: s.frames.clone(),
                ..SiteDelta::default()
            });
        e.a_live_bytes += s.live_bytes;
        e.live_bytes -= delta(s.live_bytes, 0);
        e.live_blocks -= delta(s.live_blocks, 0);
        e.alloc_bytes -= delta(s.alloc_bytes, 0);
        e.alloc_blocks -= delta(s.alloc_blocks, 0);
    }
    for s in &b.sites {
        let e = by_key
            .entry(site_key(&s.frames, &b.mappings))
            .or_insert_with(|| SiteDelta {
                frames: s.frames.clone(),
                ..SiteDelta::default()
            });
        e.frames = s.frames.clone();
        e.b_live_bytes += s.live_bytes;
        e.live_bytes += delta(s.live_bytes, 0);
        e.live_blocks += delta(s.live_blocks, 0);
        e.alloc_bytes += delta(s.alloc_bytes, 0);
        e.alloc_blocks += delta(s.alloc_blocks, 0);
    }
    let mut sites: Vec<SiteDelta> = by_key
        .into_values()
        .filter(|d| {
            d.live_bytes != 0 || d.live_blocks != 0 || d.alloc_bytes != 0 || d.alloc_blocks != 0
        })
        .collect();
    sites.sort_by(|x, y| {
        y.live_bytes
            .cmp(&x.live_bytes)
            .then(y.alloc_bytes.cmp(&x.alloc_bytes))
            .then_with(|| site_key(&x.frames, &[]).cmp(&site_key(&y.frames, &[])))
    });
    Diff { a, b, sites }
}

/// The text report: totals and the top `top` growing sites.
pub fn render_text(d: &Diff, top: usize, depth: usize) -> String {
    let mut o = String::new();
    let (ta, tb) = (&d.a.totals, &d.b.totals);
    let _ = writeln!(
        o,
        "heapdump diff: A = pid {} ({}), B = pid {} ({})",
        d.a.pid, d.a.process, d.b.pid, d.b.process
    );
    let _ = writeln!(
        o,
        "live: {} -> {} ({}), blocks {} -> {} ({:+})",
        human_bytes(ta.live_bytes),
        human_bytes(tb.live_bytes),
        human_delta(delta(tb.live_bytes, ta.live_bytes)),
        ta.live_blocks,
        tb.live_blocks,
        delta(tb.live_blocks, ta.live_blocks)
    );
    let _ = writeln!(
        o,
        "allocated in between: {} in {} blocks",
        human_delta(delta(tb.alloc_bytes, ta.alloc_bytes)),
        delta(tb.alloc_blocks, ta.alloc_blocks)
    );
    let growing: Vec<_> = d
        .sites
        .iter()
        .filter(|s| s.live_bytes != 0)
        .take(top)
        .collect();
    let _ = writeln!(o, "top {} sites by live growth:", growing.len());
    for (i, s) in growing.iter().enumerate() {
        let _ = writeln!(
            o,
            "#{:<3} {:>12}  {:+} blocks  ({} -> {})",
            i + 1,
            human_delta(s.live_bytes),
            s.live_blocks,
            human_bytes(s.a_live_bytes),
            human_bytes(s.b_live_bytes)
        );
        for f in s.frames.iter().take(depth) {
            match f.location() {
                Some(loc) => {
                    let _ = writeln!(
                        o,
                        "       {}\n           at {}",
                        crate::formats::escape_controls(&f.display_name()),
                        crate::formats::escape_controls(&loc)
                    );
                }
                None => {
                    let _ = writeln!(
                        o,
                        "       {}",
                        crate::formats::escape_controls(&f.display_name())
                    );
                }
            }
        }
    }
    o
}

/// The diff as gzipped pprof (values B − A).
pub fn render_pprof(d: &Diff) -> Vec<u8> {
    let samples: Vec<InputSample<'_>> = d
        .sites
        .iter()
        .map(|s| InputSample {
            frames: &s.frames,
            values: [s.alloc_blocks, s.alloc_bytes, s.live_blocks, s.live_bytes],
            thread: None,
        })
        .collect();
    let comments = vec![format!(
        "heapdump diff: B (pid {}) minus A (pid {})",
        d.b.pid, d.a.pid
    )];
    let time =
        d.b.taken_at
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map_or(0, |t| t.as_nanos() as i64);
    pprof::encode_gzip(&pprof::build(
        &samples,
        &d.b.mappings,
        time,
        &comments,
        d.b.symbolized,
        d.b.sampling.map_or(1, |r| r as i64),
    ))
}

/// Options of `heapdump diff`.
#[derive(Args, Debug)]
pub struct DiffArgs {
    /// The earlier JSON snapshot.
    pub(crate) a: String,
    /// The later JSON snapshot.
    pub(crate) b: String,
    #[command(flatten)]
    pub(crate) report: ReportArgs,
}

/// `heapdump diff`: returns the exit status.
pub fn command(a: DiffArgs) -> anyhow::Result<i32> {
    let format = match (a.report.format, &a.report.output) {
        (Some(f), _) => f,
        (None, Some(p)) => match Format::from_path(p) {
            Some(Format::Pprof) => Format::Pprof,
            _ => Format::Text,
        },
        (None, None) => Format::Text,
    };
    if !matches!(format, Format::Text | Format::Pprof) {
        bail!("diff writes text or pprof, not {format:?}");
    }
    let d = crate::commands::diff::diff(
        crate::formats::json::read_snapshot(&a.a)?,
        crate::formats::json::read_snapshot(&a.b)?,
    );
    let bytes = match format {
        Format::Pprof => crate::commands::diff::render_pprof(&d),
        _ => crate::commands::diff::render_text(&d, a.report.top, a.report.depth).into_bytes(),
    };
    match &a.report.output {
        Some(p) => crate::formats::write_private(p, &bytes)
            .with_context(|| format!("writing {}", p.display()))?,
        None => std::io::stdout().lock().write_all(&bytes)?,
    }
    Ok(0)
}
