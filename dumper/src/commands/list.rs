//! `heapdump list`: the instrumented processes of the host, with what a
//! snapshot of each could not show.

use std::io::Write;

use anyhow::Result;

use crate::formats::text::human_bytes;
use crate::target::{discovery, snapshot, visibility};

/// Prints the table of instrumented processes; returns the exit status.
pub fn command() -> Result<i32> {
    let (entries, denied) = discovery::scan();
    let mut out = std::io::stdout().lock();
    if entries.is_empty() {
        writeln!(out, "no instrumented processes found")?;
    } else {
        writeln!(
            out,
            "{:>8}  {:<16} {:>12} {:>10} {:>8} {:>8}",
            "PID", "NAME", "LIVE", "BLOCKS", "THREADS", "DROPPED"
        )?;
        for e in &entries {
            match &e.state {
                Ok((c, threads)) => writeln!(
                    out,
                    "{:>8}  {:<16} {:>12} {:>10} {:>8} {:>8}",
                    e.pid,
                    e.name,
                    human_bytes(c.live_bytes),
                    c.live_blocks,
                    threads.map_or("?".to_string(), |t| t.to_string()),
                    c.dropped_total()
                )?,
                Err(err) => writeln!(out, "{:>8}  {:<16} ({err})", e.pid, e.name)?,
            }
        }
        for e in &entries {
            if let Ok((c, _)) = &e.state {
                let blind = visibility::inspect_process(e.pid).described();
                for note in snapshot::notes(&blind, c.total_allocs) {
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
