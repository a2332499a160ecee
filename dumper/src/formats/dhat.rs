//! DHAT JSON (`dhatFileVersion` 2), loadable by valgrind's `dh_view.html`.
//!
//! Mapping of heapdump's data onto DHAT's fields, per program point (site):
//! `tb`/`tbk` = bytes/blocks allocated since start; `eb`/`ebk` (at the end,
//! i.e. at the snapshot) = live bytes/blocks; heapdump does not track each
//! site's maximum or its value at the global peak, so `mb`/`mbk` and
//! `gb`/`gbk` also carry the live values; block lifetimes are not tracked,
//! so `tl` is 0.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::process::snapshot::Snapshot;
use crate::symbolization::symbolizer::Frame;

fn frame_text(f: &Frame) -> String {
    let name = f.function.clone().unwrap_or_else(|| "???".to_string());
    match (f.location(), &f.module) {
        (Some(loc), _) => format!("{:#x}: {name} ({loc})", f.address),
        (None, Some(m)) => format!("{:#x}: {name} (in {m})", f.address),
        (None, None) => format!("{:#x}: {name}", f.address),
    }
}

/// Renders a snapshot as DHAT JSON.
pub fn render(s: &Snapshot) -> Vec<u8> {
    let mut ftbl: Vec<String> = vec!["[root]".to_string()];
    let mut fidx: HashMap<String, usize> = HashMap::new();
    let mut pps = Vec::new();
    for site in &s.sites {
        let fs: Vec<usize> = site
            .frames
            .iter()
            .map(|f| {
                let t = frame_text(f);
                *fidx.entry(t.clone()).or_insert_with(|| {
                    ftbl.push(t);
                    ftbl.len() - 1
                })
            })
            .collect();
        pps.push(json!({
            "tb": site.alloc_bytes,
            "tbk": site.alloc_blocks,
            "tl": 0,
            "mb": site.live_bytes,
            "mbk": site.live_blocks,
            "gb": site.live_bytes,
            "gbk": site.live_blocks,
            "eb": site.live_bytes,
            "ebk": site.live_blocks,
            "fs": fs,
        }));
    }
    let cmd = if s.cmdline.is_empty() {
        s.process.clone()
    } else {
        s.cmdline.join(" ")
    };
    let doc: Value = json!({
        "dhatFileVersion": 2,
        "mode": "heap",
        "verb": "Allocated",
        "bklt": true,
        "bkacc": false,
        "tu": "µs",
        "Mtu": "s",
        "tuth": 10,
        "cmd": cmd,
        "pid": s.pid,
        "tg": 0,
        "te": 0,
        "pps": pps,
        "ftbl": ftbl,
    });
    let mut out = serde_json::to_vec(&doc).expect("serializes");
    out.push(b'\n');
    out
}
