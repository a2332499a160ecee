//! `heapdump report`: one self-contained HTML page (see
//! [`crate::formats::html`]) from a live process, a JSON snapshot, or a
//! directory of JSON snapshots (a series `watch --interval` wrote).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::formats::html::{self, Report};
use crate::process::discovery;
use crate::process::snapshot::{self, Snapshot};
use crate::symbolization::maps::{read_maps, BuildIds};
use crate::symbolization::symbolizer::Symbolizer;

/// Options of `heapdump report`.
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// What to report on: a running instrumented process (its pid), a JSON
    /// snapshot file, or a directory of JSON snapshots of one process (a
    /// `watch --interval --format json` series; a `-peak.json` file in it
    /// is used as the heap at the peak).
    #[arg(value_name = "PID|FILE|DIR")]
    pub source: String,
    /// The HTML file to write.
    #[arg(short, long, value_name = "FILE.html")]
    pub output: PathBuf,
}

fn live(pid: u32) -> Result<(Snapshot, Option<Snapshot>)> {
    let target = discovery::open_target(pid)?;
    let maps = read_maps(pid, &mut BuildIds::default())
        .with_context(|| format!("reading /proc/{pid}/maps"))?;
    let mut sym = Symbolizer::new();
    let mut take = |peak: bool| {
        snapshot::take(
            &target,
            &maps,
            snapshot::Options {
                symbolizer: Some(&mut sym),
                progress: false,
                request: None,
                keep_allocator_frames: false,
                ages: Default::default(),
                peak,
                addresses_only: false,
            },
        )
        .with_context(|| format!("taking a snapshot of pid {pid}"))
    };
    let now = take(false)?;
    let peak = if snapshot::peak_recorded(&target).is_ok() {
        Some(take(true)?)
    } else {
        None
    };
    Ok((now, peak))
}

fn read(path: &Path) -> Result<Snapshot> {
    crate::formats::json::read_snapshot(&path.display().to_string())
        .with_context(|| format!("reading {}", path.display()))
}

/// The snapshots of a directory: the series (oldest first, by time) and the
/// peak, if one is there.
fn series(dir: &Path) -> Result<(Vec<Snapshot>, Option<Snapshot>)> {
    let mut snaps = Vec::new();
    let mut peak = None;
    let mut names: Vec<PathBuf> = std::fs::read_dir(dir)
        .with_context(|| format!("reading {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.extension().is_some_and(|e| e == "json")
                && !p.to_string_lossy().ends_with(".dhat.json")
        })
        .collect();
    names.sort();
    for p in names {
        let s = read(&p)?;
        if s.peak.is_some() {
            peak = Some(s);
        } else {
            snaps.push(s);
        }
    }
    if snaps.is_empty() {
        bail!(
            "{} holds no JSON snapshot (watch --format json writes them)",
            dir.display()
        );
    }
    let pid = snaps[0].pid;
    if snaps.iter().any(|s| s.pid != pid) {
        bail!(
            "{} holds snapshots of several processes; a report is of one (watch -d DIR per process)",
            dir.display()
        );
    }
    snaps.sort_by_key(|s| s.taken_at);
    Ok((snaps, peak))
}

/// `heapdump report`.
pub fn command(a: ReportArgs) -> Result<i32> {
    let path = Path::new(&a.source);
    let (mut all, peak) = if path.is_dir() {
        series(path)?
    } else if path.is_file() {
        (vec![read(path)?], None)
    } else if let Ok(pid) = discovery::resolve_target(&a.source) {
        let (now, peak) = live(pid)?;
        (vec![now], peak)
    } else {
        bail!(
            "{}: neither a running instrumented process, nor a snapshot file, nor a directory",
            a.source
        );
    };
    let now = all.pop().expect("at least one snapshot");
    let page = html::render(&Report {
        now: &now,
        peak: peak.as_ref(),
        series: &all,
    });
    crate::formats::write_private(&a.output, page.as_bytes())
        .with_context(|| format!("writing {}", a.output.display()))?;
    println!(
        "wrote {} ({} snapshot{}{})",
        a.output.display(),
        all.len() + 1,
        if all.is_empty() { "" } else { "s" },
        if peak.is_some() {
            ", and the heap at its peak"
        } else {
            ""
        }
    );
    Ok(0)
}
