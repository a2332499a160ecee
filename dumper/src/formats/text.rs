//! The default human-readable output: totals, threads and the top-N
//! allocation sites by live bytes.

use std::fmt::Write;
use std::time::SystemTime;

use crate::process::age::human_age;

use crate::formats::escape_controls as esc;
use crate::process::snapshot::Snapshot;

/// Formats a byte count with a binary unit (`1.5 MiB`).
pub fn human_bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = n as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{n} B")
    } else {
        format!("{v:.1} {}", UNITS[u])
    }
}

/// Formats a signed byte count (`+1.5 MiB`, `-12 B`).
pub fn human_delta(n: i64) -> String {
    let sign = if n < 0 { "-" } else { "+" };
    format!("{sign}{}", human_bytes(n.unsigned_abs()))
}

/// The clause that bounds the true high-water mark above a peak shown
/// (`" (the true high-water mark may be up to 64.0 KiB higher)"`), empty
/// when the peak shown is exact.
pub fn higher_by(tolerance: u64) -> String {
    if tolerance == 0 {
        String::new()
    } else {
        format!(
            " (the true high-water mark may be up to {} higher)",
            human_bytes(tolerance)
        )
    }
}

/// How much to show.
#[derive(Clone, Copy, Debug)]
pub struct TextOptions {
    /// Number of sites.
    pub top: usize,
    /// Frames shown per site.
    pub depth: usize,
}

impl Default for TextOptions {
    fn default() -> Self {
        TextOptions { top: 10, depth: 6 }
    }
}

/// Renders the text report.
pub fn render(s: &Snapshot, opts: TextOptions) -> String {
    let mut o = String::new();
    let when = s
        .taken_at
        .map(crate::formats::json::rfc3339)
        .unwrap_or_default();
    let _ = writeln!(
        o,
        "heapdump snapshot of pid {} ({}) at {when}, stacks by {}",
        s.pid,
        esc(&s.process),
        match s.unwinder.as_str() {
            "fp" => "frame pointers",
            "cfi" => "CFI",
            "cfi+fp" => "CFI and frame pointers",
            "fp-no-cfi" =>
                "frame pointers only (the agent found no loaded module to read CFI from: \
                 stacks stop at code built without frame pointers)",
            _ => "an unrecorded unwinder",
        }
    );
    let t = &s.totals;
    if let Some(r) = &s.recording {
        let _ = writeln!(o, "{}", r.describe(s.recorded_live_now(), s.taken_at));
    }
    if let Some(line) = s.timeline.as_ref().and_then(|tl| tl.describe(s.taken_at)) {
        let _ = writeln!(o, "{line}");
    }
    if let Some(p) = &s.peak {
        if p.at_peak {
            let _ = writeln!(
                o,
                "THE HEAP AT ITS PEAK, {}: {} live{}; sites and threads below are the heap then",
                crate::formats::json::rfc3339(p.time),
                human_bytes(p.live_bytes),
                higher_by(p.tolerance)
            );
        } else {
            let _ = writeln!(
                o,
                "THE HEAP NOW, {}: {} live; its composition at the peak ({}) was not recorded, \
                 so sites and threads below are the heap now",
                crate::formats::json::rfc3339(p.time),
                human_bytes(p.live_bytes),
                human_bytes(t.peak_bytes)
            );
        }
    }
    let _ = writeln!(
        o,
        "live: {} in {} blocks | allocated since {}: {} in {} blocks | peak live: {}{}",
        human_bytes(t.live_bytes),
        t.live_blocks,
        if s.recording
            .as_ref()
            .is_some_and(|r| r.attached_at.is_some())
        {
            "the first attach"
        } else {
            "start"
        },
        human_bytes(t.alloc_bytes),
        t.alloc_blocks,
        human_bytes(t.peak_bytes),
        if s.peak.is_none() {
            higher_by(t.peak_tolerance)
        } else {
            String::new()
        }
    );
    if s.dropped_total() > 0 {
        let detail: Vec<String> = s.dropped.iter().map(|(k, v)| format!("{k} {v}")).collect();
        let _ = writeln!(
            o,
            "dropped events: {} ({}): the snapshot misses these",
            s.dropped_total(),
            detail.join(", ")
        );
    }
    if let Some(p) = &s.partial {
        let _ = writeln!(o, "PARTIAL snapshot: {}", esc(p));
    }
    if let Some(rate) = s.sampling {
        let _ = writeln!(
            o,
            "sampled: one allocation per {} on average; every figure is an estimate",
            human_bytes(rate)
        );
    }
    for n in &s.notes {
        let _ = writeln!(o, "note: {}", esc(n));
    }
    if let Some(sel) = &s.selection {
        let mut range = Vec::new();
        if let Some(t) = sel.newer_than {
            range.push(format!("at or after {}", moment(t, s.taken_at)));
        }
        if let Some(t) = sel.older_than {
            range.push(format!("before {}", moment(t, s.taken_at)));
        }
        let _ = writeln!(
            o,
            "selected: blocks allocated {}: {} in {} blocks (sites and threads below count only these)",
            range.join(" and "),
            human_bytes(sel.live_bytes),
            sel.live_blocks
        );
    }
    let live_threads: Vec<_> = s.threads.iter().filter(|t| t.live_blocks > 0).collect();
    if !live_threads.is_empty() {
        let _ = writeln!(o, "threads with live blocks:");
        for th in live_threads {
            let _ = writeln!(
                o,
                "  {:>10}  {:>7} blocks  {} [{}]",
                human_bytes(th.live_bytes),
                th.live_blocks,
                esc(&th.name),
                th.tid
            );
        }
    }
    let shown: Vec<_> = s
        .sites
        .iter()
        .filter(|x| x.live_blocks > 0)
        .take(opts.top)
        .collect();
    let total_sites = s.sites.iter().filter(|x| x.live_blocks > 0).count();
    let _ = writeln!(
        o,
        "top {} of {} allocation sites by live bytes:",
        shown.len(),
        total_sites
    );
    let shown_bytes = s.shown_live_bytes();
    let wrappers = crate::formats::site_names::Wrappers::of(s);
    for (i, site) in shown.iter().enumerate() {
        let pct = if shown_bytes > 0 {
            site.live_bytes as f64 * 100.0 / shown_bytes as f64
        } else {
            0.0
        };
        let oldest = site
            .oldest_age(s.taken_at)
            .map_or(String::new(), |d| format!(", oldest {} ago", human_age(d)));
        let _ = writeln!(
            o,
            "#{:<3} {:>10} {:>5.1}%  {:>7} blocks  (allocated {} in {} blocks{oldest})",
            i + 1,
            human_bytes(site.live_bytes),
            pct,
            site.live_blocks,
            human_bytes(site.alloc_bytes),
            site.alloc_blocks
        );
        // Through the program's own allocation wrappers: named by the
        // frames past them.
        let name = wrappers.name(site);
        if name.via.is_some() {
            let _ = writeln!(o, "     site: {}", esc(&name.to_string()));
        }
        // Leading frames inside Rust's standard library or a dependency
        // (inlined `Vec::with_capacity`, hash map growth...) are folded into
        // one line, so the frames shown start at the program's own code.
        let lib = site
            .frames
            .iter()
            .take_while(|f| is_library_frame(f))
            .count();
        let lib = if lib == site.frames.len() { 0 } else { lib };
        if lib > 0 {
            let _ = writeln!(
                o,
                "       ({lib} frame{} in the standard library or dependencies, from {})",
                if lib == 1 { "" } else { "s" },
                esc(&site.frames[0].display_name())
            );
        }
        for f in site.frames.iter().skip(lib).take(opts.depth) {
            let inl = if f.inlined { " (inlined)" } else { "" };
            match f.location() {
                Some(loc) => {
                    let _ = writeln!(
                        o,
                        "       {}{inl}\n           at {}",
                        esc(&f.display_name()),
                        esc(&loc)
                    );
                }
                None => {
                    let _ = writeln!(o, "       {}{inl}", esc(&f.display_name()));
                }
            }
        }
        let shown = lib + opts.depth.min(site.frames.len() - lib);
        if site.frames.len() > shown {
            let _ = writeln!(o, "       ... {} more frames", site.frames.len() - shown);
        }
        if site.frames.is_empty() {
            let _ = writeln!(o, "       <no stack>");
        }
    }
    o
}

/// A moment relative to the snapshot: `2026-... (1h 2m before)`.
fn moment(t: SystemTime, now: Option<SystemTime>) -> String {
    let at = crate::formats::json::rfc3339(t);
    match now.and_then(|n| n.duration_since(t).ok()) {
        Some(d) => format!("{at} ({} before the snapshot)", human_age(d)),
        None => at,
    }
}

/// A frame whose source is Rust's standard library (`/rustc/HASH/library`)
/// or a crate from a registry (cargo's `registry/src`, or rustc's vendored
/// `/rust/deps`).
pub fn is_library_frame(f: &crate::symbolization::symbolizer::Frame) -> bool {
    f.file.as_deref().is_some_and(|file| {
        file.starts_with("/rustc/")
            || file.starts_with("/rust/deps/")
            || file.contains("/.cargo/registry/src/")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_are_human() {
        assert_eq!(human_bytes(0), "0 B");
        assert_eq!(human_bytes(1023), "1023 B");
        assert_eq!(human_bytes(1536), "1.5 KiB");
        assert_eq!(human_delta(-2048), "-2.0 KiB");
    }

    #[test]
    fn library_frames_are_std_and_registry_sources_only() {
        let f = |file: &str| crate::symbolization::symbolizer::Frame {
            file: Some(file.to_string()),
            ..Default::default()
        };
        assert!(super::is_library_frame(&f(
            "/rustc/abc/library/alloc/src/vec/mod.rs"
        )));
        assert!(super::is_library_frame(&f(
            "/root/.cargo/registry/src/x/hashbrown/src/raw.rs"
        )));
        assert!(super::is_library_frame(&f(
            "/rust/deps/hashbrown-0.16.1/src/raw/mod.rs"
        )));
        assert!(!super::is_library_frame(&f("/work/app/src/main.rs")));
        assert!(!super::is_library_frame(
            &crate::symbolization::symbolizer::Frame::default()
        ));
    }
}

/// The memory curve in `width` characters (`▁` to `█`, each the highest
/// live bytes in its slice of time; a slice without a point repeats the
/// one before): for `heapdump top`'s header.
pub fn sparkline(points: &[crate::process::snapshot::TimelinePoint], width: usize) -> String {
    const BARS: [char; 8] = ['▁', '▂', '▃', '▄', '▅', '▆', '▇', '█'];
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return String::new();
    };
    let width = width.max(1);
    let span = last
        .time
        .duration_since(first.time)
        .unwrap_or_default()
        .as_secs_f64();
    let mut slots: Vec<Option<u64>> = vec![None; width];
    for p in points {
        let at = p
            .time
            .duration_since(first.time)
            .unwrap_or_default()
            .as_secs_f64();
        let i = if span > 0.0 {
            ((at / span) * (width - 1) as f64).round() as usize
        } else {
            width - 1
        };
        let slot = &mut slots[i.min(width - 1)];
        *slot = Some(slot.map_or(p.live_bytes, |v| v.max(p.live_bytes)));
    }
    let max = points
        .iter()
        .map(|p| p.live_bytes)
        .max()
        .unwrap_or(0)
        .max(1);
    let mut prev = first.live_bytes;
    slots
        .into_iter()
        .map(|v| {
            let v = v.unwrap_or(prev);
            prev = v;
            BARS[((v as u128 * 7 + max as u128 / 2) / max as u128).min(7) as usize]
        })
        .collect()
}

#[cfg(test)]
mod sparkline_tests {
    use super::sparkline;
    use crate::process::snapshot::TimelinePoint;
    use std::time::{Duration, UNIX_EPOCH};

    fn p(s: u64, live: u64) -> TimelinePoint {
        TimelinePoint {
            time: UNIX_EPOCH + Duration::from_secs(s),
            live_bytes: live,
            live_blocks: 0,
            alloc_bytes: 0,
        }
    }

    #[test]
    fn a_rise_a_spike_and_a_fall_draw_as_they_happened() {
        let pts = [p(0, 0), p(4, 40), p(5, 100), p(6, 40), p(9, 40)];
        assert_eq!(sparkline(&pts, 10), "▁▁▁▁▄█▄▄▄▄");
        assert_eq!(sparkline(&pts[..1], 3), "▁▁▁");
        assert_eq!(sparkline(&[], 3), "");
    }
}
