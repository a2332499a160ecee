//! `heapdump snapshot --format dhat` of a real instrumented process loads in
//! valgrind's DHAT viewer: the viewer's own `buildTree()` (dh_view.js, run
//! by node with a minimal DOM stub in tests/js/dh_view_check.js) accepts the
//! file and its root totals equal the snapshot's cumulative totals.
//!
//! Needs `node` and valgrind's dh_view.js; with HEAPDUMP_REQUIRE_DHVIEW=1
//! (set by CI) their absence is a failure, otherwise the test says why it
//! did not run.

use std::path::{Path, PathBuf};
use std::process::Command;

use heapdump_tests::*;

fn dh_view_js() -> Option<PathBuf> {
    [
        "/usr/libexec/valgrind/dh_view.js",
        "/usr/lib/x86_64-linux-gnu/valgrind/dh_view.js",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
}

#[test]
fn dhat_output_is_accepted_by_dh_view() {
    let required = std::env::var("HEAPDUMP_REQUIRE_DHVIEW").is_ok_and(|v| v == "1");
    let node_ok = Command::new("node").arg("--version").output().is_ok();
    let Some(js) = dh_view_js().filter(|_| node_ok) else {
        assert!(!required, "node or valgrind's dh_view.js missing");
        eprintln!("skipped: node or valgrind's dh_view.js not installed");
        return;
    };
    let exe = compile_c("pattern");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let target = Target::spawn(cmd);
    let dir = std::env::temp_dir().join(format!("heapdump-dhat-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let dhat = dir.join("snap.dhat.json");
    let json = dir.join("snap.json");
    let heapdump = profile_dir().join("heapdump");
    for (out, fmt) in [(&dhat, "dhat"), (&json, "json")] {
        let st = Command::new(&heapdump)
            .args(["snapshot", &target.pid().to_string(), "--format", fmt, "-o"])
            .arg(out)
            .status()
            .unwrap();
        assert!(st.success(), "heapdump snapshot --format {fmt} failed");
    }
    assert!(target.finish().success());
    let check = Path::new(env!("CARGO_MANIFEST_DIR")).join("js/dh_view_check.js");
    let out = Command::new("node")
        .arg(check)
        .arg(&js)
        .arg(&dhat)
        .output()
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "dh_view rejected the file: {text}");
    let snap: serde_json::Value = serde_json::from_slice(&std::fs::read(&json).unwrap()).unwrap();
    // DHAT's "total" is what was allocated over the run: heapdump's
    // cumulative alloc_* counters.
    let alloc_bytes = snap["totals"]["alloc_bytes"].as_u64().unwrap();
    let alloc_blocks = snap["totals"]["alloc_blocks"].as_u64().unwrap();
    let root: serde_json::Value =
        serde_json::from_str(text.trim().strip_prefix("OK ").unwrap()).unwrap();
    // The quiescent target's two snapshots agree; dh_view sees the same heap.
    assert_eq!(root["tb"].as_u64(), Some(alloc_bytes), "{text}");
    assert_eq!(root["tbk"].as_u64(), Some(alloc_blocks), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}
