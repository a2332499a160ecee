//! The agent's half of `heapdump attach` (issue 23), without the injector:
//! a program started without the agent `dlopen`s libheapdump_preload.so
//! and calls `heapdump_attach()`, as the injected call will. Its later
//! allocations are recorded exactly, per site and thread; blocks from
//! before the attach are never counted, and their frees and a realloc of
//! one work as without the agent, on glibc and on jemalloc.

mod common;

use std::collections::BTreeMap;
use std::process::Command;

use common::*;
use heapdump_tests::{compile_c, compile_c_variant, preload_lib, real_dependency, Target};
use serde_json::Value;

/// Live (blocks, bytes) by name.
type Counts = BTreeMap<String, (u64, u64)>;

/// Live (blocks, bytes) by leaf function, and by thread name.
fn tables(j: &Value) -> (Counts, Counts) {
    let mut sites: Counts = BTreeMap::new();
    for s in j["sites"].as_array().expect("sites") {
        let leaf = s["frames"][0]["function"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let e = sites.entry(leaf).or_default();
        e.0 += s["live_blocks"].as_u64().unwrap();
        e.1 += s["live_bytes"].as_u64().unwrap();
    }
    let mut threads: Counts = BTreeMap::new();
    for t in j["threads"].as_array().expect("threads") {
        let e = threads
            .entry(t["name"].as_str().unwrap_or("").to_string())
            .or_default();
        e.0 += t["live_blocks"].as_u64().unwrap();
        e.1 += t["live_bytes"].as_u64().unwrap();
    }
    (sites, threads)
}

fn attach_in_process(exe: &std::path::Path) {
    let mut cmd = Command::new(exe);
    cmd.arg(preload_lib()).env_remove("LD_PRELOAD");
    let t = Target::spawn_until(cmd, "attached");
    let slots: i64 = t.last_line()["attached ".len()..].parse().unwrap();
    assert!(
        slots > 0,
        "no relocation slot redirected: {}",
        t.last_line()
    );
    let mut t = t;
    t.wait_line("ready");
    let dir = TempDir::new("attach-inproc");
    let out = heapdump(&["snapshot", &t.pid().to_string(), "-o", &dir.str("s.json")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(&dir.path("s.json"));
    assert!(j["partial"].is_null(), "{}", j["partial"]);
    let (sites, threads) = tables(&j);
    let want = [
        ("site_after_malloc", (50, 50 * 1000)),
        ("site_after_calloc", (20, 20 * 24)),
        ("site_after_aligned", (10, 10 * 256)),
        ("site_realloc_pre", (1, 5000)),
        ("site_thread", (30, 30 * 512)),
    ];
    for (site, counts) in want {
        assert_eq!(sites.get(site), Some(&counts), "{site}: {sites:#?}");
    }
    // Never seen: the 1000 blocks from before the attach.
    assert_eq!(sites.get("pre_attach"), None, "{sites:#?}");
    assert!(
        j["totals"]["live_blocks"].as_u64().unwrap() < 1000,
        "{}",
        j["totals"]
    );
    assert_eq!(
        threads.get("attach-worker"),
        Some(&(30, 30 * 512)),
        "{threads:#?}"
    );
    assert!(t.finish().success());
}

#[test]
fn an_agent_loaded_late_records_what_follows_on_glibc() {
    attach_in_process(&compile_c("attach_inproc"));
}

#[test]
fn an_agent_loaded_late_forwards_to_jemalloc_and_its_older_blocks_stay_its_own() {
    if !real_dependency(
        "libjemalloc-dev",
        heapdump_tests::has_header("jemalloc/jemalloc.h"),
    ) {
        return;
    }
    attach_in_process(&compile_c_variant(
        "attach_inproc",
        "jemalloc",
        &["-ljemalloc"],
    ));
}

#[test]
fn debian_python3_attached_late_records_its_objects_with_whole_stacks() {
    // Debian's python3 is a non-PIE executable that takes malloc's address:
    // dlsym(RTLD_DEFAULT, "malloc") answers with its PLT stub, which leads
    // back through a redirected slot; forwarding there recursed until the
    // stack overflowed.
    if !real_dependency("python3", std::path::Path::new("/usr/bin/python3").exists()) {
        return;
    }
    let script = format!(
        "import ctypes, sys\n\
         lib = ctypes.CDLL({:?})\n\
         print('attached', lib.heapdump_attach(None), flush=True)\n\
         keep = [bytearray(100000) for _ in range(200)]\n\
         d = {{i: str(i) * 5 for i in range(20000)}}\n\
         print('ready', flush=True)\n\
         sys.stdin.readline()\n",
        preload_lib().display().to_string()
    );
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", &script]).env_remove("LD_PRELOAD");
    let mut t = Target::spawn_until(cmd, "attached");
    let slots: i64 = t.last_line()["attached ".len()..].parse().unwrap();
    assert!(slots > 0, "{}", t.last_line());
    t.wait_line("ready");
    let dir = TempDir::new("attach-python3");
    let out = heapdump(&["snapshot", &t.pid().to_string(), "-o", &dir.str("s.json")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(&dir.path("s.json"));
    let arrays = live_blocks_through(&j, "PyByteArray_Resize");
    assert!(
        arrays >= 200,
        "the 200 bytearrays, allocated after the attach, through PyByteArray_Resize: {arrays}"
    );
    assert!(t.finish().success(), "python3 did not exit cleanly");
}
