//! `heapdump top PID`: a live view of a process's heap, refreshed in the
//! terminal like `top`: the sites holding most memory now, how much each
//! grew since the view started, how old its oldest block is, and the
//! process's allocation rate.
//!
//! Invariants:
//! - Each report is one ordinary snapshot ([`crate::process::snapshot::take`]); the
//!   symbolizer's cache is kept across reports, so only new addresses cost
//!   symbolization after the first.
//! - Sites are matched across reports the way `diff` matches them (by
//!   function names, else module offsets), against the first report.
//! - The regions stay open for the whole view, so when the target exits the
//!   last report still shows its heap at exit.

use crate::formats::escape_controls;
use crate::formats::site_names::Wrappers;
use std::collections::HashMap;
use std::fmt::Write;
use std::time::{Duration, SystemTime};

use crate::commands::diff::{delta, site_key};
use crate::formats::text::{human_bytes, human_delta, is_library_frame};
use crate::process::age::human_age;
use crate::process::snapshot::{Site, Snapshot};

use crate::process::age::AgeFilter;
use crate::symbolization::maps::{read_maps, BuildIds};
use crate::symbolization::symbolizer::Symbolizer;
use anyhow::Context as _;
use clap::Args;
use std::io::{IsTerminal as _, Write as _};

/// How sites are ordered.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum SortBy {
    /// Live bytes now, largest first.
    #[default]
    Live,
    /// Growth of live bytes since the view started, largest first.
    Growth,
}

/// What a report shows.
#[derive(Clone, Copy, Debug)]
pub struct TopOptions {
    /// Sites shown.
    pub top: usize,
    /// Frames shown per site (on one line, innermost first).
    pub depth: usize,
    /// Order.
    pub sort: SortBy,
}

/// Live bytes per site of the first report, to measure growth against.
#[derive(Debug)]
pub struct Baseline {
    live: HashMap<String, u64>,
    live_bytes: u64,
    live_blocks: u64,
}

impl Baseline {
    /// The baseline of snapshot `s`.
    pub fn of(s: &Snapshot) -> Baseline {
        let mut live: HashMap<String, u64> = HashMap::new();
        for site in &s.sites {
            let e = live.entry(site_key(&site.frames, &s.mappings)).or_default();
            *e = e.saturating_add(site.live_bytes);
        }
        Baseline {
            live,
            live_bytes: s.totals.live_bytes,
            live_blocks: s.totals.live_blocks,
        }
    }
}

/// One line's worth of frames: the first `depth` frames of the program's
/// own code, leaving out those of the standard library and dependencies
/// (iterator adapters, closures' plumbing; all frames if there are no
/// others), joined with ` < ` (callee < caller).
fn frames_line(site: &Site, depth: usize, wrappers: &Wrappers) -> String {
    if site.frames.is_empty() {
        return "<no stack>".to_string();
    }
    // The program's own allocation wrappers (zmalloc, g_malloc) tell no
    // site apart: the line starts past them.
    let past_wrappers = &site.frames[wrappers.name(site).wrapper_frames..];
    let own: Vec<&crate::symbolization::symbolizer::Frame> = past_wrappers
        .iter()
        .filter(|f| !is_library_frame(f))
        .collect();
    let frames = if own.is_empty() {
        past_wrappers.iter().collect()
    } else {
        own
    };
    let mut parts: Vec<String> = frames
        .iter()
        .take(depth.max(1))
        .map(|f| match (f.file.as_deref(), f.line) {
            (Some(file), Some(line)) => {
                let base = file.rsplit('/').next().unwrap_or(file);
                format!(
                    "{} ({}:{line})",
                    escape_controls(&f.display_name()),
                    escape_controls(base)
                )
            }
            _ => escape_controls(&f.display_name()).into_owned(),
        })
        .collect();
    if parts.len() < frames.len() {
        parts.push("...".to_string());
    }
    parts.join(" < ")
}

/// Renders one report of `now` against `base`; `previous` (the report
/// before, and when it was taken) gives the allocation rate.
pub fn render(
    now: &Snapshot,
    base: &Baseline,
    previous: Option<(&Snapshot, Duration)>,
    seq: u64,
    opts: TopOptions,
) -> String {
    let mut o = String::new();
    let when = now
        .taken_at
        .map(crate::formats::json::rfc3339)
        .unwrap_or_default();
    let _ = writeln!(
        o,
        "heapdump top: pid {} ({}) at {when}, report {seq}",
        now.pid,
        escape_controls(&now.process)
    );
    let t = &now.totals;
    let rate = match previous {
        Some((p, dt)) if dt > Duration::ZERO => {
            let bytes = t.alloc_bytes.saturating_sub(p.totals.alloc_bytes);
            let blocks = t.alloc_blocks.saturating_sub(p.totals.alloc_blocks);
            let secs = dt.as_secs_f64();
            format!(
                " | allocating {}/s in {:.0} blocks/s",
                human_bytes((bytes as f64 / secs) as u64),
                blocks as f64 / secs
            )
        }
        _ => String::new(),
    };
    let _ = writeln!(
        o,
        "live: {} in {} blocks ({}, {:+} blocks since report 1) | peak {}{rate}",
        human_bytes(t.live_bytes),
        t.live_blocks,
        human_delta(delta(t.live_bytes, base.live_bytes)),
        delta(t.live_blocks, base.live_blocks),
        human_bytes(t.peak_bytes),
    );
    if let Some(tl) = &now.timeline {
        if let Some(peak) = tl.peak() {
            let _ = writeln!(
                o,
                "memory {} peak {} at {}",
                crate::formats::text::sparkline(&tl.points, 48),
                human_bytes(peak.live_bytes),
                crate::formats::json::rfc3339(peak.time)
            );
        }
    }
    if let Some(p) = &now.partial {
        let _ = writeln!(o, "PARTIAL: {p}");
    }
    if now.dropped_total() > 0 {
        let _ = writeln!(
            o,
            "dropped events: {} (the view misses these)",
            now.dropped_total()
        );
    }
    let mut rows: Vec<(&Site, i64)> = now
        .sites
        .iter()
        .filter(|s| s.live_blocks > 0)
        .map(|s| {
            let before = base
                .live
                .get(&site_key(&s.frames, &now.mappings))
                .copied()
                .unwrap_or(0);
            (s, delta(s.live_bytes, before))
        })
        .collect();
    // Stable sorts: ties keep the snapshot's order.
    match opts.sort {
        SortBy::Live => rows.sort_by_key(|r| std::cmp::Reverse(r.0.live_bytes)),
        SortBy::Growth => rows.sort_by_key(|r| std::cmp::Reverse(r.1)),
    }
    let _ = writeln!(
        o,
        "{:>10} {:>11} {:>8} {:>8}  SITE (callee < caller)",
        "LIVE", "GROWTH", "BLOCKS", "OLDEST"
    );
    let wrappers = Wrappers::of(now);
    for (site, growth) in rows.iter().take(opts.top) {
        let oldest = site
            .oldest_age(now.taken_at)
            .map_or("-".to_string(), human_age);
        let _ = writeln!(
            o,
            "{:>10} {:>11} {:>8} {:>8}  {}",
            human_bytes(site.live_bytes),
            human_delta(*growth),
            site.live_blocks,
            oldest,
            frames_line(site, opts.depth, &wrappers)
        );
    }
    if rows.len() > opts.top {
        let _ = writeln!(o, "({} more sites)", rows.len() - opts.top);
    }
    o
}

/// The width of the terminal on standard output, if it is one.
pub fn terminal_width() -> Option<usize> {
    // SAFETY: TIOCGWINSZ writes one `winsize` into a valid out-pointer; on
    // a descriptor that is not a terminal it fails and writes nothing.
    let mut ws: libc::winsize = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let r = unsafe { libc::ioctl(libc::STDOUT_FILENO, libc::TIOCGWINSZ, &mut ws) };
    (r == 0 && ws.ws_col > 0).then_some(usize::from(ws.ws_col))
}

/// `report` with every line cut to `width` characters (a refreshing
/// screen must not wrap).
pub fn fit(report: &str, width: usize) -> String {
    let mut out = String::with_capacity(report.len());
    for line in report.lines() {
        match line.char_indices().nth(width) {
            Some((i, _)) => out.push_str(&line[..i]),
            None => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The time between two snapshots' walks, if both are known.
pub fn between(earlier: &Snapshot, later: &Snapshot) -> Option<Duration> {
    let (a, b): (SystemTime, SystemTime) = (earlier.taken_at?, later.taken_at?);
    b.duration_since(a).ok()
}

/// Options of `heapdump top`.
#[derive(Args, Debug)]
pub struct TopArgs {
    /// The instrumented process: its pid, or its name if only one
    /// instrumented process has it.
    #[arg(value_name = "PID|NAME", value_parser = crate::process::discovery::resolve_target)]
    pub(crate) pid: u32,
    /// Time between reports (e.g. 2s, 500ms).
    #[arg(short, long, default_value = "2s", value_parser = humantime::parse_duration)]
    pub(crate) interval: Duration,
    /// Sites shown.
    #[arg(short = 'n', long, default_value_t = 15)]
    pub(crate) top: usize,
    /// Frames shown per site, on one line (callee < caller).
    #[arg(long, default_value_t = 3)]
    pub(crate) depth: usize,
    /// Order of the sites.
    #[arg(long, value_enum, default_value_t = SortBy::Live)]
    pub(crate) sort: SortBy,
    /// Stop after N reports (default: when the target exits, after a last
    /// report of its heap at exit, or on Ctrl-C).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    pub(crate) iterations: Option<u64>,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    pub(crate) keep_allocator_frames: bool,
}

/// `heapdump top`: returns the exit status.
pub fn command(a: TopArgs) -> anyhow::Result<i32> {
    crate::commands::watch::install_stop_handlers();
    let mut target = crate::process::discovery::open_target(a.pid)?;
    let exit = crate::commands::watch::ExitWatch::new(a.pid);
    let mut build_ids = BuildIds::default();
    let mut maps = read_maps(a.pid, &mut build_ids)
        .with_context(|| format!("reading /proc/{}/maps", a.pid))?;
    let mut sym = Symbolizer::new();
    let tty = std::io::stdout().is_terminal();
    let opts = TopOptions {
        top: a.top,
        depth: a.depth,
        sort: a.sort,
    };
    let mut baseline = None;
    let mut previous: Option<crate::process::snapshot::Snapshot> = None;
    let mut seq = 0u64;
    loop {
        let exited = exit.exited();
        // It executed another program: what is open is the program before,
        // shown once more with the mappings it had (see `watch`).
        let replaced = !exited && target.replaced();
        if !exited && !replaced {
            // New libraries may have been loaded; a dead target keeps the
            // last mappings read (its files stay open in the symbolizer).
            if let Ok(m) = read_maps(a.pid, &mut build_ids) {
                maps = m;
            }
            sym.open_modules(&maps);
        }
        let snap = crate::process::snapshot::take(
            &target,
            &maps,
            crate::process::snapshot::Options {
                peak: false,
                symbolizer: Some(&mut sym),
                progress: tty && seq == 0,
                request: None,
                keep_allocator_frames: a.keep_allocator_frames,
                ages: AgeFilter::default(),
                addresses_only: false,
            },
        )
        .with_context(|| format!("taking a snapshot of pid {}", a.pid))?;
        seq += 1;
        let base = baseline.get_or_insert_with(|| Baseline::of(&snap));
        let before = previous
            .as_ref()
            .and_then(|p| between(p, &snap).map(|d| (p, d)));
        let report = render(&snap, base, before, seq, opts);
        let mut out = std::io::stdout().lock();
        if tty {
            // Home and clear, then the report: a screen that refreshes.
            let report = match terminal_width() {
                Some(w) => fit(&report, w),
                None => report,
            };
            write!(out, "\x1b[H\x1b[2J{report}")?;
        } else {
            writeln!(out, "{report}")?;
        }
        if exited {
            writeln!(out, "pid {} exited: this is its heap at exit", a.pid)?;
        }
        if replaced {
            writeln!(
                out,
                "pid {} executed another program: this is the heap of the program before",
                a.pid
            )?;
        }
        out.flush()?;
        drop(out);
        if replaced {
            // The new program, from its first report, if the agent is
            // loaded there too (it makes its regions as the program starts).
            let opened = crate::commands::watch::wait_instrumented(a.pid, Duration::from_secs(5))
                .and_then(|()| crate::process::discovery::open_target(a.pid));
            match opened {
                Ok(t) => {
                    target = t;
                    (baseline, previous) = (None, None);
                    continue;
                }
                Err(e) => {
                    eprintln!("heapdump: {e}");
                    return Ok(0);
                }
            }
        }
        if exited
            || a.iterations.is_some_and(|n| seq >= n)
            || crate::commands::watch::stop_requested()
        {
            return Ok(0);
        }
        previous = Some(snap);
        // Wait for the next report, waking early for an exit or Ctrl-C.
        let until = std::time::Instant::now() + a.interval;
        while std::time::Instant::now() < until {
            if crate::commands::watch::stop_requested() {
                return Ok(0);
            }
            if exit.exited() {
                break;
            }
            std::thread::sleep(
                until
                    .saturating_duration_since(std::time::Instant::now())
                    .min(Duration::from_millis(20)),
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::time::UNIX_EPOCH;

    use super::*;
    use crate::process::snapshot::Totals;
    use crate::symbolization::symbolizer::Frame;

    fn site(name: &str, live: u64, blocks: u64, age_s: u64) -> Site {
        Site {
            addresses: vec![0x1000],
            frames: vec![
                Frame {
                    function: Some(name.to_string()),
                    file: Some("/src/app/main.rs".to_string()),
                    line: Some(7),
                    ..Frame::default()
                },
                Frame {
                    function: Some("main".to_string()),
                    ..Frame::default()
                },
            ],
            live_bytes: live,
            live_blocks: blocks,
            oldest: Some(UNIX_EPOCH + Duration::from_secs(1000 - age_s)),
            ..Site::default()
        }
    }

    fn snap(sites: Vec<Site>, alloc_bytes: u64, at_s: u64) -> Snapshot {
        let live_bytes = sites.iter().map(|s| s.live_bytes).sum();
        let live_blocks = sites.iter().map(|s| s.live_blocks).sum();
        Snapshot {
            pid: 7,
            process: "app".into(),
            taken_at: Some(UNIX_EPOCH + Duration::from_secs(at_s)),
            totals: Totals {
                live_bytes,
                live_blocks,
                alloc_bytes,
                alloc_blocks: alloc_bytes / 100,
                peak_bytes: live_bytes,
                peak_tolerance: 0,
            },
            sites,
            ..Snapshot::default()
        }
    }

    #[test]
    fn reports_show_growth_since_the_first_and_the_allocation_rate() {
        let first = snap(
            vec![site("cache", 1000, 10, 0), site("buf", 500, 5, 0)],
            10_000,
            990,
        );
        let base = Baseline::of(&first);
        let now = snap(
            vec![
                site("cache", 1200, 12, 10),
                site("buf", 100, 1, 10),
                site("fresh", 300, 3, 2),
            ],
            30_000,
            1000,
        );
        let opts = TopOptions {
            top: 10,
            depth: 2,
            sort: SortBy::Live,
        };
        let text = render(
            &now,
            &base,
            Some((&first, Duration::from_secs(10))),
            2,
            opts,
        );
        let lines: Vec<&str> = text.lines().collect();
        assert!(
            lines[0].contains("pid 7 (app)") && lines[0].ends_with("report 2"),
            "{text}"
        );
        // 1600 live now against 1500: +100 B; 20 000 bytes in 10 s.
        assert!(
            lines[1].contains("(+100 B, +1 blocks since report 1)"),
            "{text}"
        );
        assert!(
            lines[1].contains("allocating 2.0 KiB/s in 20 blocks/s"),
            "{text}"
        );
        let rows: Vec<Vec<&str>> = lines[3..]
            .iter()
            .map(|l| l.split_whitespace().collect())
            .collect();
        assert_eq!(rows[0][..6], ["1.2", "KiB", "+200", "B", "12", "10s"]);
        assert_eq!(rows[0][6..], ["cache", "(main.rs:7)", "<", "main"]);
        assert_eq!(
            rows[1][..7],
            ["300", "B", "+300", "B", "3", "2.0s", "fresh"]
        );
        assert_eq!(rows[2][..6], ["100", "B", "-400", "B", "1", "10s"]);
        // By growth, and only the top one with the rest counted.
        let opts = TopOptions {
            top: 1,
            sort: SortBy::Growth,
            ..opts
        };
        let text = render(&now, &base, None, 2, opts);
        assert!(text.lines().nth(3).unwrap().contains("fresh"), "{text}");
        assert!(text.ends_with("(2 more sites)\n"), "{text}");
        assert!(!text.contains("allocating"), "{text}");
    }

    #[test]
    fn lines_are_cut_to_the_screen() {
        assert_eq!(
            fit("abcdef\nab\n\u{e9}\u{e9}\u{e9}\n", 2),
            "ab\nab\n\u{e9}\u{e9}\n"
        );
    }

    #[test]
    fn library_frames_are_skipped_on_the_line() {
        let mut s = site("app::f", 1, 1, 0);
        s.frames.insert(
            0,
            Frame {
                function: Some("alloc::vec::Vec<T>::push".to_string()),
                file: Some("/rustc/abc/library/alloc/src/vec/mod.rs".to_string()),
                line: Some(1),
                ..Frame::default()
            },
        );
        s.frames.insert(
            2,
            Frame {
                function: Some("core::iter::Iterator::fold".to_string()),
                file: Some("/rustc/abc/library/core/src/iter/mod.rs".to_string()),
                ..Frame::default()
            },
        );
        let w = Wrappers::default();
        assert_eq!(frames_line(&s, 1, &w), "app::f (main.rs:7) < ...");
        assert_eq!(frames_line(&s, 3, &w), "app::f (main.rs:7) < main");
        assert_eq!(frames_line(&Site::default(), 3, &w), "<no stack>");
    }
}
