//! `heapdump report`: one self-contained HTML page (no network needed to
//! open it, nothing fetched from elsewhere): the process's facts, memory
//! over time (the curve; with a series of snapshots, the top sites stacked
//! over time), the top sites now and at the peak with their stacks, an
//! interactive flamegraph of live bytes (inferno's SVG, in an iframe of its
//! own so its script sees only its document), and leak suspects.
//!
//! Charts are plain SVG drawn here: a few polylines and polygons need no
//! charting library, and the page stays one file.
//!
//! Invariants: every text from a snapshot (function names, file paths,
//! process names) is HTML-escaped; the page has no `src`/`href` to
//! anything but itself and `data:` URLs.

use crate::formats::site_names::Wrappers;
use std::fmt::Write;
use std::time::{Duration, SystemTime};

use base64::Engine;

use crate::formats::json::rfc3339;
use crate::formats::text::human_bytes;
use crate::process::snapshot::{Site, Snapshot, TimelinePoint};

/// What a report shows.
#[derive(Debug)]
pub struct Report<'a> {
    /// The latest snapshot.
    pub now: &'a Snapshot,
    /// The heap at its peak, if recorded.
    pub peak: Option<&'a Snapshot>,
    /// Earlier snapshots of the same process, oldest first (a series a
    /// `watch --interval` wrote); empty for one snapshot.
    pub series: &'a [Snapshot],
}

/// A site that looks like a leak, and why.
#[derive(Clone, Debug, PartialEq)]
pub struct Suspect {
    /// The site's display name (its first frame).
    pub name: String,
    /// Its frames, leaf first.
    pub frames: Vec<String>,
    /// Live bytes now.
    pub live_bytes: u64,
    /// Why it is suspected.
    pub why: String,
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
        .replace('\'', "&#39;")
}

/// A site's key across snapshots: its frames' names.
fn site_key(s: &Site) -> String {
    s.frames
        .iter()
        .map(|f| f.display_name())
        .collect::<Vec<_>>()
        .join(" < ")
}

/// A site's name in words: the frames past its allocation wrappers (see
/// [`crate::formats::site_names`]).
fn site_name(s: &Site, w: &Wrappers) -> String {
    w.name(s).to_string()
}

/// Leak suspects. With a series: sites whose live bytes never fell from
/// one snapshot to the next and grew overall (ranked by growth). From one
/// snapshot: sites whose live blocks were allocated steadily over the
/// recording and never freed: at least 8 live blocks, allocated over at
/// least a third of the recording (newest minus oldest), and nearly as
/// many live blocks as ever allocated (9 in 10).
pub fn leak_suspects(now: &Snapshot, series: &[Snapshot]) -> Vec<Suspect> {
    let mut out = Vec::new();
    let wrappers = Wrappers::of(now);
    if series.len() >= 2 {
        let mut all: Vec<&Snapshot> = series.iter().collect();
        all.push(now);
        for site in now.sites.iter().filter(|s| s.live_bytes > 0) {
            let key = site_key(site);
            let values: Vec<u64> = all
                .iter()
                .map(|s| {
                    s.sites
                        .iter()
                        .filter(|x| site_key(x) == key)
                        .map(|x| x.live_bytes)
                        .sum()
                })
                .collect();
            let never_fell = values.windows(2).all(|w| w[1] >= w[0]);
            let grew = values.last() > values.first();
            let rises = values.windows(2).filter(|w| w[1] > w[0]).count();
            if never_fell && grew && rises * 2 >= values.len() - 1 {
                out.push(Suspect {
                    name: site_name(site, &wrappers),
                    frames: site.frames.iter().map(|f| f.display_name()).collect(),
                    live_bytes: site.live_bytes,
                    why: format!(
                        "grew in {rises} of {} intervals and never fell: {} to {}",
                        values.len() - 1,
                        human_bytes(values[0]),
                        human_bytes(*values.last().unwrap_or(&0))
                    ),
                });
            }
        }
        out.sort_by_key(|s| std::cmp::Reverse(s.live_bytes));
        return out;
    }
    let (Some(at), Some(start)) = (
        now.taken_at,
        now.timeline
            .as_ref()
            .and_then(|t| t.points.first())
            .map(|p| p.time),
    ) else {
        return out;
    };
    let span = at.duration_since(start).unwrap_or_default();
    if span < Duration::from_millis(100) {
        return out;
    }
    for site in &now.sites {
        let (Some(old), Some(new)) = (site.oldest, site.newest) else {
            continue;
        };
        let since = |t: SystemTime| t.duration_since(start).unwrap_or_default();
        if site.live_blocks >= 8
            && since(new).saturating_sub(since(old)) >= span / 3
            && site.live_blocks * 10 >= site.alloc_blocks * 9
        {
            out.push(Suspect {
                name: site_name(site, &wrappers),
                frames: site.frames.iter().map(|f| f.display_name()).collect(),
                live_bytes: site.live_bytes,
                why: format!(
                    "{} live blocks allocated from {} to {} after recording began and never \
                     freed ({} of {} ever allocated still live)",
                    site.live_blocks,
                    secs(since(old)),
                    secs(since(new)),
                    site.live_blocks,
                    site.alloc_blocks
                ),
            });
        }
    }
    out.sort_by_key(|s| std::cmp::Reverse(s.live_bytes));
    out
}

fn secs(d: Duration) -> String {
    format!("{:.1} s", d.as_secs_f64())
}

const W: f64 = 900.0;
const H: f64 = 260.0;
const PAD: f64 = 70.0;

/// The memory curve as an SVG chart (live bytes against time), the peak
/// marked.
fn curve_svg(points: &[TimelinePoint]) -> String {
    let (Some(first), Some(last)) = (points.first(), points.last()) else {
        return "<p>No memory curve (an agent older than format 1.4).</p>".into();
    };
    let span = last
        .time
        .duration_since(first.time)
        .unwrap_or_default()
        .as_secs_f64()
        .max(1e-3);
    let max = points
        .iter()
        .map(|p| p.live_bytes)
        .max()
        .unwrap_or(0)
        .max(1) as f64;
    let x = |t: SystemTime| {
        PAD + (t
            .duration_since(first.time)
            .unwrap_or_default()
            .as_secs_f64()
            / span)
            * (W - 2.0 * PAD)
    };
    let y = |v: u64| H - PAD + -(v as f64 / max) * (H - 2.0 * PAD);
    // Steps: the heap stays at a point's value until the next point.
    let mut line = String::new();
    let mut prev: Option<u64> = None;
    for p in points {
        if let Some(v) = prev {
            let _ = write!(line, "{:.1},{:.1} ", x(p.time), y(v));
        }
        let _ = write!(line, "{:.1},{:.1} ", x(p.time), y(p.live_bytes));
        prev = Some(p.live_bytes);
    }
    let peak = points
        .iter()
        .rev()
        .max_by_key(|p| p.live_bytes)
        .expect("not empty");
    let mut o = String::new();
    let _ = write!(
        o,
        "<svg id=\"memory-chart\" class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" \
         viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"live bytes over time\">\
         <line x1=\"{PAD}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" class=\"axis\"/>\
         <line x1=\"{PAD}\" y1=\"{PAD}\" x2=\"{PAD}\" y2=\"{b}\" class=\"axis\"/>\
         <text x=\"{PAD}\" y=\"{ty}\" class=\"label\">{start}</text>\
         <text x=\"{r}\" y=\"{ty}\" class=\"label\" text-anchor=\"end\">{end}</text>\
         <text x=\"{lx}\" y=\"{PAD}\" class=\"label\" text-anchor=\"end\">{maxl}</text>\
         <text x=\"{lx}\" y=\"{b}\" class=\"label\" text-anchor=\"end\">0</text>\
         <polyline class=\"curve\" points=\"{line}\"/>\
         <circle class=\"peak\" cx=\"{px:.1}\" cy=\"{py:.1}\" r=\"4\"><title>peak {pl} at {pt}</title></circle>\
         <text x=\"{px:.1}\" y=\"{pty:.1}\" class=\"label\" text-anchor=\"middle\">peak {pl}</text>\
         </svg>",
        b = H - PAD,
        r = W - PAD,
        ty = H - PAD + 18.0,
        lx = PAD - 4.0,
        start = esc(&rfc3339(first.time)),
        end = esc(&format!("+{}", secs(Duration::from_secs_f64(span)))),
        maxl = esc(&human_bytes(max as u64)),
        px = x(peak.time),
        py = y(peak.live_bytes),
        pty = (y(peak.live_bytes) - 8.0).max(12.0),
        pl = esc(&human_bytes(peak.live_bytes)),
        pt = esc(&rfc3339(peak.time)),
    );
    o
}

/// The top sites of a series stacked over time (one band per site, the
/// rest as "other").
fn stacked_svg(all: &[&Snapshot], top: usize) -> String {
    let times: Vec<SystemTime> = all.iter().filter_map(|s| s.taken_at).collect();
    if times.len() != all.len() || all.len() < 2 {
        return String::new();
    }
    let last = all[all.len() - 1];
    let wrappers = Wrappers::of(last);
    let mut keys: Vec<(String, String, u64)> = Vec::new();
    for s in &last.sites {
        if s.live_bytes > 0 {
            keys.push((site_key(s), site_name(s, &wrappers), s.live_bytes));
        }
    }
    keys.sort_by_key(|k| std::cmp::Reverse(k.2));
    keys.truncate(top);
    // values[k][i]: site k's live bytes in snapshot i; the last band is
    // everything else.
    let mut values = vec![vec![0u64; all.len()]; keys.len() + 1];
    for (i, s) in all.iter().enumerate() {
        let mut other = s.totals.live_bytes;
        for (k, key) in keys.iter().enumerate() {
            let v: u64 = s
                .sites
                .iter()
                .filter(|x| site_key(x) == key.0)
                .map(|x| x.live_bytes)
                .sum();
            values[k][i] = v;
            other = other.saturating_sub(v);
        }
        values[keys.len()][i] = other;
    }
    let totals: Vec<u64> = (0..all.len())
        .map(|i| values.iter().map(|v| v[i]).sum())
        .collect();
    let max = totals.iter().copied().max().unwrap_or(0).max(1) as f64;
    let span = times[times.len() - 1]
        .duration_since(times[0])
        .unwrap_or_default()
        .as_secs_f64()
        .max(1e-3);
    let x = |i: usize| {
        PAD + (times[i]
            .duration_since(times[0])
            .unwrap_or_default()
            .as_secs_f64()
            / span)
            * (W - 2.0 * PAD)
    };
    let y = |v: f64| H - PAD - (v / max) * (H - 2.0 * PAD);
    const COLORS: [&str; 9] = [
        "#4e79a7", "#f28e2b", "#e15759", "#76b7b2", "#59a14f", "#edc948", "#b07aa1", "#ff9da7",
        "#9c755f",
    ];
    let mut o = format!(
        "<svg id=\"series-chart\" class=\"chart\" xmlns=\"http://www.w3.org/2000/svg\" \
         viewBox=\"0 0 {W} {H}\" role=\"img\" aria-label=\"top sites over time\">\
         <line x1=\"{PAD}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" class=\"axis\"/>\
         <text x=\"{lx}\" y=\"{PAD}\" class=\"label\" text-anchor=\"end\">{maxl}</text>",
        b = H - PAD,
        r = W - PAD,
        lx = PAD - 4.0,
        maxl = esc(&human_bytes(max as u64)),
    );
    let mut below = vec![0f64; all.len()];
    let mut legend = String::new();
    for (k, band) in values.iter().enumerate() {
        let name = keys.get(k).map_or("other".to_string(), |k| k.1.clone());
        let color = if k < keys.len() {
            COLORS[k % COLORS.len()]
        } else {
            "#bab0ac"
        };
        let mut pts = String::new();
        for i in 0..all.len() {
            let _ = write!(pts, "{:.1},{:.1} ", x(i), y(below[i] + band[i] as f64));
        }
        for i in (0..all.len()).rev() {
            let _ = write!(pts, "{:.1},{:.1} ", x(i), y(below[i]));
        }
        for i in 0..all.len() {
            below[i] += band[i] as f64;
        }
        let _ = write!(
            o,
            "<polygon class=\"band\" fill=\"{color}\" points=\"{pts}\"><title>{}</title></polygon>",
            esc(&name)
        );
        let _ = write!(
            legend,
            "<li><span class=\"swatch\" style=\"background:{color}\"></span>{}</li>",
            esc(&name)
        );
    }
    o.push_str("</svg>");
    let _ = write!(o, "<ul class=\"legend\">{legend}</ul>");
    o
}

fn sites_table(s: &Snapshot, id: &str, top: usize) -> String {
    let shown = s.shown_live_bytes().max(1);
    let wrappers = Wrappers::of(s);
    let mut o = format!(
        "<table id=\"{id}\" class=\"sites\"><thead><tr><th>#</th><th>live</th><th>%</th>\
         <th>blocks</th><th>allocated</th><th>site (stack, innermost first)</th></tr></thead><tbody>"
    );
    for (i, site) in s
        .sites
        .iter()
        .filter(|x| x.live_bytes > 0)
        .take(top)
        .enumerate()
    {
        let name = wrappers.name(site);
        let frames: String = site
            .frames
            .iter()
            .map(|f| {
                let at = match (&f.file, f.line) {
                    (Some(file), Some(line)) => {
                        format!(" <span class=\"at\">{}:{line}</span>", esc(file))
                    }
                    _ => String::new(),
                };
                format!("<li>{}{at}</li>", esc(&f.display_name()))
            })
            .collect();
        let _ = write!(
            o,
            "<tr><td>{}</td><td>{}</td><td>{:.1}</td><td>{}</td><td>{}</td>\
             <td><details><summary class=\"site\">{}{}</summary><ol class=\"stack\">{frames}</ol>\
             </details></td></tr>",
            i + 1,
            esc(&human_bytes(site.live_bytes)),
            site.live_bytes as f64 * 100.0 / shown as f64,
            site.live_blocks,
            esc(&human_bytes(site.alloc_bytes)),
            esc(&name.title),
            name.via
                .as_ref()
                .map(|v| format!(" <small>via {}</small>", esc(v)))
                .unwrap_or_default(),
        );
    }
    o.push_str("</tbody></table>");
    o
}

fn facts(s: &Snapshot) -> String {
    let mut rows: Vec<(String, String)> = vec![
        ("process".into(), format!("{} (pid {})", s.process, s.pid)),
        ("command".into(), s.cmdline.join(" ")),
        (
            "taken at".into(),
            s.taken_at.map(rfc3339).unwrap_or_default(),
        ),
        (
            "mode".into(),
            match s.sampling {
                Some(r) => format!(
                    "sampled, one allocation per {} on average (every figure an estimate)",
                    human_bytes(r)
                ),
                None => "exact (every allocation)".into(),
            },
        ),
        ("stacks".into(), s.unwinder.clone()),
        (
            "live now".into(),
            format!(
                "{} in {} blocks",
                human_bytes(s.totals.live_bytes),
                s.totals.live_blocks
            ),
        ),
        (
            "allocated".into(),
            format!(
                "{} in {} blocks",
                human_bytes(s.totals.alloc_bytes),
                s.totals.alloc_blocks
            ),
        ),
        ("dropped events".into(), s.dropped_total().to_string()),
    ];
    if let Some(r) = &s.recording {
        rows.push((
            "recording".into(),
            r.describe(s.recorded_live_now(), s.taken_at),
        ));
    }
    if let Some(p) = &s.partial {
        rows.push(("PARTIAL".into(), p.clone()));
    }
    for n in &s.notes {
        rows.push(("note".into(), n.clone()));
    }
    let mut o = String::from("<table id=\"facts\" class=\"facts\">");
    for (k, v) in rows {
        let _ = write!(o, "<tr><th>{}</th><td>{}</td></tr>", esc(&k), esc(&v));
    }
    o.push_str("</table>");
    o
}

const STYLE: &str = "body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222;max-width:1100px}\
h1{font-size:1.5em}h2{font-size:1.2em;margin-top:2em;border-bottom:1px solid #ddd}\
table{border-collapse:collapse}td,th{padding:2px 8px;text-align:left;vertical-align:top}\
table.sites td:nth-child(-n+5){text-align:right;white-space:nowrap}\
.facts th{color:#555;font-weight:normal}.chart{width:100%;height:auto;border:1px solid #eee}\
.axis{stroke:#999}.label{font-size:11px;fill:#555}.curve{fill:none;stroke:#d62728;stroke-width:2}\
.peak{fill:#d62728}.band{stroke:#fff;stroke-width:.5}.legend{list-style:none;padding:0}\
.legend li{display:inline-block;margin-right:1em}.swatch{display:inline-block;width:.9em;height:.9em;margin-right:.3em}\
.stack{margin:.2em 0;font-family:monospace;font-size:12px}.at{color:#777}\
iframe{width:100%;height:560px;border:1px solid #eee}.suspect{margin-bottom:1em}";

/// Renders the report page.
pub fn render(r: &Report<'_>) -> String {
    let s = r.now;
    let mut o = String::new();
    let _ = write!(
        o,
        "<!DOCTYPE html><html lang=\"en\"><head><meta charset=\"utf-8\">\
         <title>heapdump report: {} (pid {})</title><style>{STYLE}</style></head><body>\
         <h1>heapdump report: {} (pid {})</h1>",
        esc(&s.process),
        s.pid,
        esc(&s.process),
        s.pid
    );
    o.push_str("<h2 id=\"facts-title\">The process</h2>");
    o.push_str(&facts(s));
    o.push_str("<h2 id=\"memory-title\">Memory over time</h2>");
    match &s.timeline {
        Some(t) => {
            if let Some(line) = t.describe(s.taken_at) {
                let _ = write!(o, "<p>{}</p>", esc(&line));
            }
            o.push_str(&curve_svg(&t.points));
        }
        None => o.push_str("<p>No memory curve (an agent older than format 1.4).</p>"),
    }
    if !r.series.is_empty() {
        let mut all: Vec<&Snapshot> = r.series.iter().collect();
        all.push(s);
        let _ = write!(
            o,
            "<h2 id=\"series-title\">Top sites over {} snapshots</h2>",
            all.len()
        );
        o.push_str(&stacked_svg(&all, 8));
    }
    o.push_str("<h2 id=\"suspects-title\">Leak suspects</h2>");
    let suspects = leak_suspects(s, r.series);
    if suspects.is_empty() {
        o.push_str(
            "<p id=\"suspects\">None found: no site kept growing over the series, or \
             allocated steadily and never freed.</p>",
        );
    } else {
        o.push_str("<div id=\"suspects\">");
        for sp in &suspects {
            let frames: String = sp
                .frames
                .iter()
                .map(|f| format!("<li>{}</li>", esc(f)))
                .collect();
            let _ = write!(
                o,
                "<div class=\"suspect\"><b class=\"suspect-name\">{}</b>: {} live; {}\
                 <details><summary>stack</summary><ol class=\"stack\">{frames}</ol></details></div>",
                esc(&sp.name),
                esc(&human_bytes(sp.live_bytes)),
                esc(&sp.why)
            );
        }
        o.push_str("</div>");
    }
    o.push_str("<h2 id=\"now-title\">Top sites now</h2>");
    o.push_str(&sites_table(s, "sites-now", 20));
    if let Some(p) = r.peak {
        let when = p.peak.map(|x| {
            if x.at_peak {
                format!(
                    "{}: {} live{}",
                    rfc3339(x.time),
                    human_bytes(x.live_bytes),
                    crate::formats::text::higher_by(x.tolerance)
                )
            } else {
                format!(
                    "not recorded (the peak was {}); the heap now, {}: {} live",
                    human_bytes(p.totals.peak_bytes),
                    rfc3339(x.time),
                    human_bytes(x.live_bytes)
                )
            }
        });
        let _ = write!(
            o,
            "<h2 id=\"peak-title\">Top sites at the peak</h2><p>{}</p>",
            esc(&when.unwrap_or_default())
        );
        o.push_str(&sites_table(p, "sites-peak", 20));
    }
    o.push_str("<h2 id=\"flamegraph-title\">Flamegraph of live bytes</h2>");
    let svg = crate::formats::flamegraph::svg(s);
    let _ = write!(
        o,
        "<p>Click a frame to zoom in; Ctrl-F searches.</p>\
         <iframe id=\"flamegraph\" title=\"flamegraph\" src=\"data:image/svg+xml;base64,{}\"></iframe>",
        base64::engine::general_purpose::STANDARD.encode(&svg)
    );
    o.push_str("</body></html>\n");
    o
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_from_snapshots_is_escaped() {
        assert_eq!(
            esc("<script>alert('x')</script>&"),
            "&lt;script&gt;alert(&#39;x&#39;)&lt;/script&gt;&amp;"
        );
    }
}
