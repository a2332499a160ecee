//! `heapdump list`: the instrumented processes of the host, with what a
//! snapshot of each could not show.
//!
//! In sampled mode every figure is an estimate, computed exactly as a
//! snapshot computes it (each sampled block weighted), and marked `~`;
//! the MODE column says which mode each process records in.

use crate::formats::escape_controls;
use std::io::Write;

use anyhow::Result;

use crate::formats::text::human_bytes;
use crate::process::{discovery, snapshot, visibility};

/// One printable row: the figures as shown.
struct Row {
    mode: String,
    live: String,
    blocks: String,
    threads: String,
    dropped: u64,
    total_allocs: u64,
    rate: Option<u64>,
    /// The process whose fork made it, when its agent said so.
    forked_from: Option<snapshot::ForkParent>,
    /// `+` attached and recording, `-` detached (or stopped when the
    /// program sandboxed itself), empty: since start.
    attached: &'static str,
}

fn row(t: &discovery::Target) -> Result<Row, discovery::DiscoveryError> {
    let pid = t.pid;
    let region_error = |e| discovery::DiscoveryError::Region {
        pid,
        name: t.name.clone(),
        kind: "allocations",
        source: e,
        hint: "",
    };
    let c = t.counters().map_err(region_error)?;
    let estimate = snapshot::estimated_live(t).map_err(region_error)?;
    let (_, rate) = snapshot::sample_rate(t);
    let threads = discovery::live_threads(pid).map_or("?".to_string(), |t| t.to_string());
    let words = heapdump_table::header::read_attach(&t.allocations.view());
    let attached = match (words.attached_at != 0, words.detached_at != 0) {
        (false, false) => "",
        (true, false) => "+",
        // Detached, or (recorded since start) stopped when the program
        // sandboxed itself.
        (_, true) => "-",
    };
    let (mode, live, blocks, rate) = match estimate {
        None => (
            "exact".to_string(),
            human_bytes(c.live_bytes),
            c.live_blocks.to_string(),
            None,
        ),
        Some((bytes, blocks)) => (
            format!("~1/{}", human_bytes(rate).replace(' ', "")),
            format!("~{}", human_bytes(bytes)),
            format!("~{blocks}"),
            Some(rate),
        ),
    };
    Ok(Row {
        mode: format!("{mode}{attached}"),
        attached,
        live,
        blocks,
        threads,
        dropped: c.dropped_total(),
        total_allocs: c.total_allocs,
        rate,
        forked_from: snapshot::fork_parent(t),
    })
}

/// Prints the table of instrumented processes; returns the exit status.
pub fn command() -> Result<i32> {
    // Each process's row is read while its regions are open, one process
    // at a time.
    let (rows, denied) = discovery::scan_with(|pid, name, state| {
        let r = match state {
            Ok(t) => row(&t).map_err(|err| err.to_string()),
            Err(err) => Err(err.to_string()),
        };
        (pid, name, r)
    });
    let mut out = std::io::stdout().lock();
    if rows.is_empty() {
        writeln!(out, "no instrumented processes found")?;
    } else {
        writeln!(
            out,
            "{:>8}  {:<16} {:>10} {:>12} {:>10} {:>8} {:>8}",
            "PID", "NAME", "MODE", "LIVE", "BLOCKS", "THREADS", "DROPPED"
        )?;
        let mut sampled = false;
        let mut attached = false;
        for (pid, name, r) in &rows {
            match r {
                Ok(r) => {
                    sampled |= r.rate.is_some();
                    attached |= !r.attached.is_empty();
                    writeln!(
                        out,
                        "{:>8}  {:<16} {:>10} {:>12} {:>10} {:>8} {:>8}",
                        pid,
                        escape_controls(name),
                        r.mode,
                        r.live,
                        r.blocks,
                        r.threads,
                        r.dropped
                    )?
                }
                Err(err) => writeln!(
                    out,
                    "{:>8}  {:<16} ({})",
                    pid,
                    escape_controls(name),
                    escape_controls(&err.to_string())
                )?,
            }
        }
        if sampled {
            writeln!(
                out,
                "~: sampled mode (MODE ~1/RATE: about one allocation recorded per RATE \
                 allocated): live bytes and blocks are unbiased estimates, as in a snapshot"
            )?;
        }
        if attached {
            writeln!(
                out,
                "+: recording since heapdump attach; -: detached, or stopped when the \
                 program installed a seccomp filter (what was recorded stays readable); \
                 figures count only what was allocated since the attach, if attached"
            )?;
        }
        for (pid, _, r) in &rows {
            if let Ok(r) = r {
                let blind = visibility::inspect_process(*pid).described();
                // Notes say what a row may miss: a fork child whose
                // inherited blocks were copied misses nothing (its
                // snapshots still say where they came from), and a
                // prefork server's hundred workers would each get a line.
                let forked = r.forked_from.filter(|f| f.inherited.is_none());
                for note in snapshot::notes(&blind, r.total_allocs, r.rate, forked) {
                    writeln!(out, "{:>8}: {}", pid, escape_controls(&note))?;
                }
            }
        }
    }
    if denied > 0 {
        // SAFETY: geteuid has no preconditions and cannot fail.
        if unsafe { libc::geteuid() } == 0 {
            writeln!(
                out,
                "({denied} processes refused even root the reading of their memory maps \
                 (kernel threads, or a security module's rule); they are not listed)"
            )?;
        } else {
            writeln!(
                out,
                "({denied} processes of other users could not be inspected; run as root to see \
                 them)"
            )?;
        }
    }
    Ok(0)
}
