//! Folded stacks (`root;caller;leaf value` lines, Brendan Gregg's format)
//! and SVG flamegraphs rendered from them with the `inferno` crate (the
//! maintained Rust port of flamegraph.pl). Values are live bytes.

use crate::process::snapshot::Snapshot;
use crate::symbolization::symbolizer::Frame;

fn name(f: &Frame) -> String {
    // ';' separates frames and a trailing number is the value: keep both
    // out of names.
    crate::formats::escape_controls(&f.display_name()).replace(';', ":")
}

/// Folded stacks of live bytes, one line per site with live blocks,
/// root first.
pub fn folded(s: &Snapshot) -> String {
    let mut out = String::new();
    for site in s.sites.iter().filter(|x| x.live_bytes > 0) {
        let mut names: Vec<String> = site.frames.iter().rev().map(name).collect();
        if names.is_empty() {
            names.push("[no stack]".to_string());
        }
        out.push_str(&names.join(";"));
        out.push(' ');
        out.push_str(&site.live_bytes.to_string());
        out.push('\n');
    }
    out
}

/// An SVG flamegraph of live bytes.
pub fn svg(s: &Snapshot) -> Vec<u8> {
    let folded = folded(s);
    let mut opts = inferno::flamegraph::Options::default();
    opts.title = format!(
        "heapdump: live heap of pid {} ({})",
        s.pid,
        crate::formats::escape_controls(&s.process)
    );
    opts.subtitle = Some(format!(
        "{} live bytes in {} blocks",
        s.totals.live_bytes, s.totals.live_blocks
    ));
    opts.count_name = "bytes".to_string();
    let mut out = Vec::new();
    if folded.is_empty()
        || inferno::flamegraph::from_lines(&mut opts, folded.lines(), &mut out).is_err()
    {
        out = format!(
            "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"600\" height=\"60\">\
             <text x=\"10\" y=\"30\">heapdump: no live allocations in pid {}</text></svg>\n",
            s.pid
        )
        .into_bytes();
    }
    out
}
