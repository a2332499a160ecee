//! `heapdump snapshot PID`: one snapshot, as a text report or a file.

use std::io::IsTerminal;

use anyhow::{Context, Result};
use clap::Args;

use crate::commands::args::{AgeArgs, ReportArgs, SymArgs, EXIT_PARTIAL};
use crate::formats::text::human_bytes;
use crate::process::{discovery, snapshot};
use crate::symbolization::maps::{read_maps, BuildIds};
use crate::symbolization::symbolizer::Symbolizer;

/// Options of `heapdump snapshot`.
#[derive(Args, Debug)]
pub struct SnapshotArgs {
    /// The instrumented process: its pid, or its name if only one
    /// instrumented process has it.
    #[arg(value_name = "PID|NAME", value_parser = discovery::resolve_target)]
    pub(crate) pid: u32,
    #[command(flatten)]
    pub(crate) report: ReportArgs,
    /// Print timings on stderr: table walk, symbolization, total, and the
    /// dumper's peak memory.
    #[arg(long)]
    pub(crate) timings: bool,
    #[command(flatten)]
    pub(crate) sym: SymArgs,
    #[command(flatten)]
    pub(crate) ages: AgeArgs,
    /// The heap at its peak instead of now: per site and thread, the live
    /// bytes and blocks when live bytes were highest (within the tolerance
    /// the output states), with that moment. Blocks freed since the peak
    /// count under their stacks, their thread shown as "<freed since the
    /// peak>".
    #[arg(long)]
    pub(crate) peak: bool,
}

/// `heapdump snapshot`: returns the exit status (0, or [`EXIT_PARTIAL`]).
pub fn command(a: SnapshotArgs) -> Result<i32> {
    let format = a.report.format()?;
    let start = std::time::Instant::now();
    let target = discovery::open_target(a.pid)?;
    if a.peak {
        snapshot::peak_recorded(&target).map_err(anyhow::Error::msg)?;
    }
    let maps = read_maps(a.pid, &mut BuildIds::default())
        .with_context(|| format!("reading /proc/{}/maps", a.pid))?;
    let mut sym = Symbolizer::new();
    let snap = snapshot::take(
        &target,
        &maps,
        snapshot::Options {
            symbolizer: (!a.sym.no_symbolize).then_some(&mut sym),
            progress: std::io::stderr().is_terminal(),
            request: None,
            keep_allocator_frames: a.sym.keep_allocator_frames,
            ages: a.ages.filter(),
            peak: a.peak,
            addresses_only: false,
        },
    )
    .with_context(|| format!("taking a snapshot of pid {}", a.pid))?;
    a.report.write(&snap, format, a.sym.per_thread)?;
    if a.timings {
        let t = &snap.timing;
        let walk = t.walk.as_secs_f64();
        eprintln!(
            "timings: walk {:.1} ms ({} live blocks, {:.1} M blocks/s over {} nodes), \
             symbolize {:.1} ms ({} sites), total {:.1} ms, dumper peak RSS {}",
            walk * 1e3,
            snap.totals.live_blocks,
            if walk > 0.0 {
                snap.totals.live_blocks as f64 / walk / 1e6
            } else {
                0.0
            },
            t.nodes,
            t.symbolize.as_secs_f64() * 1e3,
            snap.sites.len(),
            start.elapsed().as_secs_f64() * 1e3,
            peak_rss().map_or("?".to_string(), human_bytes),
        );
    }
    if let Some(reason) = &snap.partial {
        eprintln!("heapdump: the snapshot is PARTIAL: {reason}");
        return Ok(EXIT_PARTIAL);
    }
    Ok(0)
}

/// The dumper's peak resident memory (`VmHWM`), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}
