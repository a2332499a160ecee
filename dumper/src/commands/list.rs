//! `heapdump list`: the instrumented processes of the host, with what a
//! snapshot of each could not show.
//!
//! In sampled mode every figure is an estimate, computed exactly as a
//! snapshot computes it (each sampled block weighted), and marked `~`;
//! the MODE column says which mode each process records in.

use std::io::Write;

use anyhow::Result;

use crate::formats::text::human_bytes;
use crate::target::{discovery, snapshot, visibility};

/// One printable row: the figures as shown.
struct Row {
    mode: String,
    live: String,
    blocks: String,
    threads: String,
    dropped: u64,
    total_allocs: u64,
    rate: Option<u64>,
}

fn row(pid: u32) -> Result<Row, discovery::DiscoveryError> {
    let t = discovery::open_target(pid)?;
    let region_error = |e| discovery::DiscoveryError::Region {
        pid,
        name: t.name.clone(),
        kind: "allocations",
        source: e,
        hint: "",
    };
    let c = t.counters().map_err(region_error)?;
    let estimate = snapshot::estimated_live(&t).map_err(region_error)?;
    let (_, rate) = snapshot::sample_rate(&t);
    let threads = discovery::live_threads(pid).map_or("?".to_string(), |t| t.to_string());
    Ok(match estimate {
        None => Row {
            mode: "exact".to_string(),
            live: human_bytes(c.live_bytes),
            blocks: c.live_blocks.to_string(),
            threads,
            dropped: c.dropped_total(),
            total_allocs: c.total_allocs,
            rate: None,
        },
        Some((bytes, blocks)) => Row {
            mode: format!("~1/{}", human_bytes(rate).replace(' ', "")),
            live: format!("~{}", human_bytes(bytes)),
            blocks: format!("~{blocks}"),
            threads,
            dropped: c.dropped_total(),
            total_allocs: c.total_allocs,
            rate: Some(rate),
        },
    })
}

/// Prints the table of instrumented processes; returns the exit status.
pub fn command() -> Result<i32> {
    let (entries, denied) = discovery::scan();
    let mut out = std::io::stdout().lock();
    if entries.is_empty() {
        writeln!(out, "no instrumented processes found")?;
    } else {
        writeln!(
            out,
            "{:>8}  {:<16} {:>10} {:>12} {:>10} {:>8} {:>8}",
            "PID", "NAME", "MODE", "LIVE", "BLOCKS", "THREADS", "DROPPED"
        )?;
        let rows: Vec<_> = entries.iter().map(|e| (e, row(e.pid))).collect();
        let mut sampled = false;
        for (e, r) in &rows {
            match r {
                Ok(r) => {
                    sampled |= r.rate.is_some();
                    writeln!(
                        out,
                        "{:>8}  {:<16} {:>10} {:>12} {:>10} {:>8} {:>8}",
                        e.pid, e.name, r.mode, r.live, r.blocks, r.threads, r.dropped
                    )?
                }
                Err(err) => writeln!(out, "{:>8}  {:<16} ({err})", e.pid, e.name)?,
            }
        }
        if sampled {
            writeln!(
                out,
                "~: sampled mode (MODE ~1/RATE: about one allocation recorded per RATE \
                 allocated): live bytes and blocks are unbiased estimates, as in a snapshot"
            )?;
        }
        for (e, r) in &rows {
            if let Ok(r) = r {
                let blind = visibility::inspect_process(e.pid).described();
                for note in snapshot::notes(&blind, r.total_allocs, r.rate) {
                    writeln!(out, "{:>8}: {note}", e.pid)?;
                }
            }
        }
    }
    if denied > 0 {
        writeln!(
            out,
            "({denied} processes of other users could not be inspected; run as root to see them)"
        )?;
    }
    Ok(0)
}
