//! The dumper against the real agent: C programs under the preload library
//! and Rust programs with the `Agent` global allocator (from the
//! `heapdump-tests` crate), checked against ground truth read
//! independently with `heapdump-table`'s readers (`heapdump_tests::dump`).
//!
//! Needs the whole workspace built first (`cargo build --workspace`: the
//! preload library and the test programs sit next to `heapdump`).
//! Synchronisation is by printed lines only; timeouts are hang guards.

mod common;

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};

use common::*;
use heapdump_tests::{compile_c, dump, preload_lib, profile_dir, Dump, Target};
use serde_json::Value;

/// A binary of the workspace (built by `cargo build --workspace`).
fn workspace_bin(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test`",
        p.display()
    );
    p
}

/// The C pattern's live sites (tests/c/pattern.c): leaf function ->
/// (blocks, bytes).
fn c_pattern_sites() -> BTreeMap<String, (u64, u64)> {
    [
        ("site_malloc", 100, 100 * 1000),
        ("site_calloc", 50, 50 * 24),
        ("site_realloc", 10, 10 * 4096),
        ("site_free_half", 100, 100 * 32),
        ("site_aligned", 20, 5 * (200 + 256 + 300 + 100)),
        ("site_reallocarray", 7, 7 * 120),
        ("site_thread1", 30, 30 * 512),
        ("site_thread2", 20, 20 * 2048),
    ]
    .into_iter()
    .map(|(n, b, s)| (n.to_string(), (b, s)))
    .collect()
}

fn u(v: &Value) -> u64 {
    v.as_u64().unwrap_or_else(|| panic!("not a u64: {v}"))
}

fn function(frame: &Value) -> &str {
    frame["function"].as_str().unwrap_or("")
}

/// Live (blocks, bytes) per leaf-most frame function, over all sites.
fn by_leaf(j: &Value) -> BTreeMap<String, (u64, u64)> {
    let mut t: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in j["sites"].as_array().expect("sites") {
        let Some(leaf) = s["frames"].as_array().and_then(|f| f.first()) else {
            continue;
        };
        let e = t.entry(function(leaf).to_string()).or_default();
        e.0 += u(&s["live_blocks"]);
        e.1 += u(&s["live_bytes"]);
    }
    t
}

/// Live (blocks, bytes) per thread name from the independent reader.
fn truth_threads(d: &Dump) -> BTreeMap<String, (u64, u64)> {
    let mut t: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for b in &d.blocks {
        let e = t.entry(b.thread.name.clone()).or_default();
        e.0 += 1;
        e.1 += b.size;
    }
    t
}

fn json_threads(j: &Value) -> BTreeMap<String, (u64, u64)> {
    let mut t: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for th in j["threads"].as_array().expect("threads") {
        let (blocks, bytes) = (u(&th["live_blocks"]), u(&th["live_bytes"]));
        if blocks == 0 {
            continue;
        }
        let e = t
            .entry(th["name"].as_str().unwrap_or("").to_string())
            .or_default();
        e.0 += blocks;
        e.1 += bytes;
    }
    t
}

/// Checks a JSON snapshot of the C pattern against the expected sites and
/// the ground truth `d` read while the target was quiescent.
fn check_c_pattern_json(j: &Value, d: &Dump) {
    assert!(j["partial"].is_null(), "partial: {}", j["partial"]);
    let live_bytes: u64 = d.blocks.iter().map(|b| b.size).sum();
    assert_eq!(u(&j["totals"]["live_blocks"]), d.blocks.len() as u64);
    assert_eq!(u(&j["totals"]["live_bytes"]), live_bytes);
    let leaves = by_leaf(j);
    for (site, want) in c_pattern_sites() {
        assert_eq!(leaves.get(&site), Some(&want), "{site}: {leaves:#?}");
    }
    // Freed blocks are not reported (the site stays, with its cumulative
    // counts, and no live blocks).
    assert_eq!(
        leaves.get("site_freed_all").map_or(0, |v| v.0),
        0,
        "{leaves:#?}"
    );
    // Per thread: exactly the ground truth, and the workers hold exactly
    // their sites' blocks.
    let threads = json_threads(j);
    assert_eq!(threads, truth_threads(d));
    assert_eq!(threads["worker-1"], (30, 30 * 512));
    assert_eq!(threads["worker-2"], (20, 20 * 2048));
    let sum: u64 = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| u(&s["live_bytes"]))
        .sum();
    assert_eq!(sum, live_bytes);
}

/// `heapdump snapshot PID --format json -o PATH`, which must succeed; the
/// document.
fn snapshot_json(pid: u32, path: &str) -> Value {
    let out = heapdump(&["snapshot", &pid.to_string(), "--format", "json", "-o", path]);
    assert!(out.status.success(), "{}", stderr(&out));
    read_json(Path::new(path))
}

fn c_pattern(hold: bool) -> Target {
    let mut cmd = Command::new(compile_c("pattern"));
    cmd.env("LD_PRELOAD", preload_lib());
    if hold {
        cmd.arg("hold");
    }
    Target::spawn(cmd)
}

#[test]
fn snapshot_json_of_c_program_under_preload_is_exact() {
    let target = c_pattern(true);
    let pid = target.pid();
    let truth = dump(pid);
    assert_eq!(truth.partial, None);
    let dir = TempDir::new("real-c-json");
    let j = snapshot_json(pid, &dir.str("c.json"));
    assert_eq!(u(&j["pid"]), u64::from(pid));
    check_c_pattern_json(&j, &truth);

    // pprof of the same quiescent process: go tool pprof reads the totals
    // and the site names back.
    let pb = dir.str("c.pb.gz");
    let out = heapdump(&["snapshot", &pid.to_string(), "-o", &pb]);
    assert!(out.status.success(), "{}", stderr(&out));
    if go_available() {
        let live: u64 = truth.blocks.iter().map(|b| b.size).sum();
        let top = go_pprof(&["-top", "-unit=B", "-sample_index=inuse_space", &pb]);
        assert!(top.contains(&format!("{live}B total")), "{top}");
        assert!(top.contains("site_malloc"), "{top}");
    }
    assert!(target.finish().success());
}

#[test]
fn a_live_thread_shows_under_its_current_name() {
    let mut cmd = Command::new(compile_c("rename"));
    cmd.env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn(cmd);
    let pid = target.pid();
    let dir = TempDir::new("rename");
    let snapshot = |file: &str| snapshot_json(pid, &dir.str(file));
    assert_eq!(
        json_threads(&snapshot("before.json")).get("before-name"),
        Some(&(20, 20 * 300))
    );
    target.send("rename");
    target.wait_line("renamed");
    // The agent's record still has the name the thread allocated under
    // (it did not allocate since); the dumper shows the current one.
    let truth = dump(pid);
    assert_eq!(
        truth_threads(&truth).get("before-name"),
        Some(&(20, 20 * 300))
    );
    let threads = json_threads(&snapshot("after.json"));
    assert_eq!(
        threads.get("after-name"),
        Some(&(20, 20 * 300)),
        "{threads:?}"
    );
    assert_eq!(threads.get("before-name"), None, "{threads:?}");
    assert!(target.finish().success());
}

#[test]
fn a_thread_renamed_while_it_allocates_shows_once_under_its_last_name() {
    // The agent writes a record for each name a thread allocates under
    // (the JVM renames its threads after they start: each showed twice,
    // as "java" and as "G1 Main Marker"). The records of one thread are
    // one thread: its blocks together, under the name it had last.
    let mut cmd = Command::new(compile_c("renamed_while_allocating"));
    cmd.env("LD_PRELOAD", preload_lib());
    let target = Target::spawn(cmd);
    let pid = target.pid();
    let dir = TempDir::new("renamed-while-allocating");
    let j = snapshot_json(pid, &dir.str("s.json"));
    let threads = j["threads"].as_array().expect("threads");
    let worker: Vec<&Value> = threads
        .iter()
        .filter(|t| u(&t["tid"]) != u64::from(pid))
        .collect();
    assert_eq!(worker.len(), 1, "{threads:#?}");
    assert_eq!(worker[0]["name"], "third-name", "{threads:#?}");
    assert_eq!(
        (u(&worker[0]["live_blocks"]), u(&worker[0]["live_bytes"])),
        (35, 10 * 1000 + 20 * 2000 + 5 * 3000),
        "{threads:#?}"
    );
    // The agent did write a record per name (what the dumper joined).
    let truth = dump(pid);
    let names = truth_threads(&truth);
    for (name, blocks, bytes) in [
        ("first-name", 10, 10 * 1000),
        ("second-name", 20, 20 * 2000),
        ("third-name", 5, 5 * 3000),
    ] {
        assert_eq!(names.get(name), Some(&(blocks, bytes)), "{names:?}");
    }
    let text = stdout(&heapdump(&["snapshot", &pid.to_string()]));
    assert_eq!(text.matches("third-name").count(), 1, "{text}");
    assert!(
        !text.contains("first-name") && !text.contains("second-name"),
        "{text}"
    );
    assert!(target.finish().success());
}

/// `heapdump snapshot PID --format json -o PATH ARGS...` (must succeed).
fn snapshot_json_with(pid: u32, path: &str, args: &[&str]) -> Value {
    let pid = pid.to_string();
    let mut all = vec!["snapshot", &pid, "--format", "json", "-o", path];
    all.extend_from_slice(args);
    let out = heapdump(&all);
    assert!(out.status.success(), "{}", stderr(&out));
    read_json(Path::new(path))
}

/// [`by_leaf`] without the sites that have no live blocks (sites keep
/// their cumulative counts when none of their blocks is selected).
fn live_leaves(j: &Value) -> Vec<(String, (u64, u64))> {
    by_leaf(j)
        .into_iter()
        .filter(|(_, (n, _))| *n > 0)
        .collect()
}

fn time_of(v: &Value) -> std::time::SystemTime {
    humantime::parse_rfc3339(v.as_str().unwrap_or_else(|| panic!("not a time: {v}")))
        .unwrap_or_else(|e| panic!("{v}: {e}"))
}

/// The site whose leaf frame is `leaf`.
fn site_of<'a>(j: &'a Value, leaf: &str) -> &'a Value {
    j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["frames"][0]["function"] == leaf)
        .unwrap_or_else(|| panic!("no site {leaf}"))
}

#[test]
fn blocks_are_selected_by_when_they_were_allocated() {
    // tests/c/aged.c: 40 x 700 B at site_early, the moment "mid", 25 x
    // 1500 B at site_late; later, 9 x 333 B at site_later.
    let exe = compile_c("aged");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn_until(cmd, "mid ");
    let mid_ns: u64 = target.last_line()["mid ".len()..].parse().unwrap();
    let mid = std::time::UNIX_EPOCH + std::time::Duration::from_nanos(mid_ns);
    let mid_arg = humantime::format_rfc3339_nanos(mid).to_string();
    target.wait_line("late");
    let pid = target.pid();
    let dir = TempDir::new("aged");

    // Unselected: every site, and each site's oldest and newest block
    // on the right side of "mid".
    let all = snapshot_json(pid, &dir.str("all.json"));
    assert_eq!(all["selection"], Value::Null);
    let leaves = by_leaf(&all);
    assert_eq!(leaves.get("site_early"), Some(&(40, 40 * 700)));
    assert_eq!(leaves.get("site_late"), Some(&(25, 25 * 1500)));
    let (early, late) = (site_of(&all, "site_early"), site_of(&all, "site_late"));
    assert!(time_of(&early["oldest_alloc_time"]) <= time_of(&early["newest_alloc_time"]));
    assert!(time_of(&early["newest_alloc_time"]) < mid, "{early}");
    assert!(
        time_of(&late["oldest_alloc_time"]) >= mid,
        "{late} vs {mid_arg}"
    );
    assert!(time_of(&late["newest_alloc_time"]) <= time_of(&all["taken_at"]));

    // Newer than "mid": exactly the late blocks.
    let newer = snapshot_json_with(pid, &dir.str("newer.json"), &["--newer-than", &mid_arg]);
    assert_eq!(
        live_leaves(&newer),
        [("site_late".to_string(), (25, 25 * 1500))]
    );
    assert_eq!(newer["selection"]["live_blocks"], 25);
    assert_eq!(newer["selection"]["live_bytes"], 25 * 1500);
    // (JSON times are in microseconds.)
    let said = time_of(&newer["selection"]["newer_than"]);
    assert!(said <= mid && mid.duration_since(said).unwrap().as_nanos() < 1000);
    assert_eq!(newer["selection"]["older_than"], Value::Null);
    // Totals stay the whole heap's (the program is idle between snapshots).
    assert_eq!(newer["totals"], all["totals"]);
    let threads: u64 = newer["threads"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| u(&t["live_blocks"]))
        .sum();
    assert_eq!(threads, 25);

    // Older than "mid": everything before it, none of the late blocks.
    let older = snapshot_json_with(pid, &dir.str("older.json"), &["--older-than", &mid_arg]);
    let leaves = by_leaf(&older);
    assert_eq!(leaves.get("site_early"), Some(&(40, 40 * 700)));
    assert_eq!(leaves.get("site_late"), Some(&(0, 0)));
    assert_eq!(
        u(&older["selection"]["live_blocks"]) + 25,
        u(&all["totals"]["live_blocks"])
    );

    // Durations count back from the snapshot: nothing is 1000 days old,
    // everything is newer than that.
    let none = snapshot_json_with(pid, &dir.str("none.json"), &["--older-than", "1000d"]);
    assert_eq!(none["selection"]["live_blocks"], 0);
    assert_eq!(live_leaves(&none), []);
    let every = snapshot_json_with(pid, &dir.str("every.json"), &["--newer-than", "1000d"]);
    assert_eq!(by_leaf(&every), by_leaf(&all));
    assert_eq!(
        every["selection"]["live_blocks"],
        all["totals"]["live_blocks"]
    );

    // The text report says what it selected and shows each site's oldest
    // block's age.
    let out = heapdump(&["snapshot", &pid.to_string(), "--newer-than", &mid_arg]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    assert!(
        text.contains("selected: blocks allocated at or after")
            && text.contains("36.6 KiB in 25 blocks"),
        "{text}"
    );
    assert!(
        text.contains("site_late") && !text.contains("site_early"),
        "{text}"
    );
    assert!(text.contains(" ago)"), "{text}");

    // Since a saved snapshot: the blocks allocated after it, still live.
    target.send("more");
    target.wait_line("later");
    let since = snapshot_json_with(
        pid,
        &dir.str("since.json"),
        &["--newer-than", &dir.str("all.json")],
    );
    assert_eq!(
        live_leaves(&since),
        [("site_later".to_string(), (9, 9 * 333))]
    );
    assert_eq!(since["selection"]["newer_than"], all["taken_at"]);

    // The process can be named instead of numbered (it is the only one
    // with its name); a name no instrumented process has is refused.
    let name = exe.file_name().unwrap().to_str().unwrap();
    let out = heapdump(&["snapshot", name, "-n", "1"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).starts_with(&format!("heapdump snapshot of pid {pid} (")));
    let out = heapdump(&["snapshot", "no-such-program-here"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("no instrumented process is named"),
        "{}",
        stderr(&out)
    );

    // Bad values are refused with what is accepted.
    let out = heapdump(&["snapshot", &pid.to_string(), "--older-than", "last tuesday"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(
        stderr(&out).contains("neither a duration"),
        "{}",
        stderr(&out)
    );
    assert!(target.finish().success());
}

#[test]
fn top_shows_live_sites_with_growth_and_a_last_report_at_exit() {
    let target = c_pattern(true);
    let pid = target.pid().to_string();
    let out = heapdump(&[
        "top",
        &pid,
        "--iterations",
        "2",
        "--interval",
        "10ms",
        "-n",
        "40",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = stdout(&out);
    let reports: Vec<&str> = text.split("heapdump top: ").skip(1).collect();
    assert_eq!(reports.len(), 2, "{text}");
    for r in &reports {
        // site_malloc: 100 blocks of 1000 bytes, unchanged (the pattern
        // is idle while it holds them).
        let line = r
            .lines()
            .find(|l| l.contains(" site_malloc ("))
            .unwrap_or_else(|| panic!("no site_malloc line: {r}"));
        let cols: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(cols[..5], ["97.7", "KiB", "+0", "B", "100"], "{line}");
        assert!(line.contains("pattern.c:"), "{line}");
    }
    assert!(reports[1].contains("report 2") && reports[1].contains("allocating "));

    // Without --iterations it runs until the target exits, then shows the
    // heap at exit.
    let mut child = Command::new(bin())
        .args(["top", &pid, "--interval", "20ms"])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Lines::new(child.stdout.take().unwrap());
    while !lines.next().starts_with("heapdump top: ") {}
    assert!(target.finish().success());
    let want = format!("pid {pid} exited: this is its heap at exit");
    while lines
        .next_or_eof()
        .expect("top ended without its exit line")
        != want
    {}
    assert!(child.wait().unwrap().success());
}

#[test]
fn an_unsymbolized_snapshot_is_symbolized_later_by_build_id() {
    let target = c_pattern(true);
    let pid = target.pid();
    let dir = TempDir::new("symbolize-later");
    let raw = dir.str("raw.json");
    let out = heapdump(&["snapshot", &pid.to_string(), "--no-symbolize", "-o", &raw]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(target.finish().success());
    // "Elsewhere": the program is no longer at the path it ran from, but a
    // copy sits under another name in a directory of binaries, next to a
    // decoy that has the program's name and another build ID.
    let exe = compile_c("pattern");
    let mut j = read_json(Path::new(&raw));
    assert_eq!(j["symbolized"], false);
    assert!(!by_leaf(&j).contains_key("site_malloc"));
    let moved = "/nonexistent/heapdump-test/pattern";
    let mut found = 0;
    for m in j["mappings"].as_array_mut().unwrap() {
        if m["path"] == exe.to_str().unwrap() {
            assert!(m["build_id"].is_string(), "{m}");
            m["path"] = moved.into();
            found += 1;
        }
    }
    assert!(found > 0, "the program's mapping is recorded");
    let elsewhere = dir.str("elsewhere.json");
    std::fs::write(&elsewhere, serde_json::to_vec(&j).unwrap()).unwrap();
    let bins = dir.path("bins");
    std::fs::create_dir(&bins).unwrap();
    std::fs::copy(&exe, bins.join("renamed-program")).unwrap();
    std::fs::copy(compile_c("threads"), bins.join("pattern")).unwrap();

    // Without the directory: the program's frames stay unsymbolized, and
    // it says which file it could not find.
    let plain = dir.str("plain.json");
    let out = heapdump(&["symbolize", &elsewhere, "-o", &plain]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("no file with build ID") && stderr(&out).contains(moved),
        "{}",
        stderr(&out)
    );
    assert!(!by_leaf(&read_json(Path::new(&plain))).contains_key("site_malloc"));

    // With it: the sites of the live pattern, exactly.
    let symbolize_to = |path: &str| {
        let bins = bins.to_str().unwrap();
        let out = heapdump(&["symbolize", &elsewhere, "--binaries", bins, "-o", path]);
        assert!(out.status.success(), "{}", stderr(&out));
    };
    let sym = dir.str("sym.json");
    symbolize_to(&sym);
    let j = read_json(Path::new(&sym));
    assert_eq!(j["symbolized"], true);
    let leaves = by_leaf(&j);
    for (site, want) in c_pattern_sites() {
        assert_eq!(leaves.get(&site), Some(&want), "{site}: {leaves:#?}");
    }
    let pb = dir.str("sym.pb.gz");
    symbolize_to(&pb);
    if go_available() {
        let top = go_pprof(&["-top", "-sample_index=inuse_space", &pb]);
        assert!(top.contains("site_malloc"), "{top}");
    }
}

#[test]
fn a_stripped_program_is_symbolized_from_its_separate_debug_file() {
    // The C pattern split the way distributions ship programs: a binary
    // without DWARF, and its DWARF in ROOT/.build-id/ab/cdef....debug.
    let exe = compile_c("pattern");
    let dir = TempDir::new("debug-file");
    let stripped = dir.path("pattern-stripped");
    let objcopy = |args: &[&std::ffi::OsStr]| {
        let st = Command::new("objcopy")
            .args(args)
            .status()
            .expect("objcopy");
        assert!(st.success());
    };
    let debug = dir.path("pattern.debug");
    objcopy(&[
        "--only-keep-debug".as_ref(),
        exe.as_os_str(),
        debug.as_os_str(),
    ]);
    objcopy(&[
        "--strip-debug".as_ref(),
        exe.as_os_str(),
        stripped.as_os_str(),
    ]);
    let id = heapdump::symbolization::maps::read_build_id(std::fs::File::open(&stripped).unwrap())
        .expect("build ID");
    let root = dir.path("debug-root");
    let place = root.join(".build-id").join(&id[..2]);
    std::fs::create_dir_all(&place).unwrap();
    std::fs::rename(&debug, place.join(format!("{}.debug", &id[2..]))).unwrap();

    // And split the way many builds ship: the binary names its debug file
    // in a `.gnu_debuglink` (file name and CRC), kept in `.debug/` next to
    // it.
    let linked_dir = dir.path("linked");
    std::fs::create_dir_all(linked_dir.join(".debug")).unwrap();
    let linked_debug = linked_dir.join(".debug").join("pattern-linked.debug");
    objcopy(&[
        "--only-keep-debug".as_ref(),
        exe.as_os_str(),
        linked_debug.as_os_str(),
    ]);
    let linked = linked_dir.join("pattern-linked");
    let link_arg = format!("--add-gnu-debuglink={}", linked_debug.display());
    objcopy(&[
        "--strip-debug".as_ref(),
        link_arg.as_ref(),
        exe.as_os_str(),
        linked.as_os_str(),
    ]);

    let spawn = |exe: &Path| {
        let mut cmd = Command::new(exe);
        cmd.env("LD_PRELOAD", preload_lib()).arg("hold");
        Target::spawn(cmd)
    };
    let target = spawn(&stripped);
    let linked_target = spawn(&linked);
    // The leaf frame of the `site_malloc` site of `target`, from a snapshot
    // taken with HEAPDUMP_DEBUG_DIRS set to `debug_dirs`.
    let leaf_of = |target: &Target, name: &str, debug_dirs: &Path| -> Value {
        let pid = target.pid().to_string();
        let path = dir.str(name);
        let out = Command::new(bin())
            .env("HEAPDUMP_DEBUG_DIRS", debug_dirs)
            .args(["snapshot", &pid, "--format", "json", "-o", &path])
            .output()
            .unwrap();
        assert!(out.status.success(), "{}", stderr(&out));
        let j = read_json(Path::new(&path));
        let site = j["sites"]
            .as_array()
            .unwrap()
            .iter()
            .find(|s| function(&s["frames"][0]) == "site_malloc")
            .cloned()
            .unwrap_or_else(|| panic!("no site_malloc site: {j}"));
        site["frames"][0].clone()
    };
    let leaf = |name: &str, debug_dirs: &Path| leaf_of(&target, name, debug_dirs);
    // Without the debug file: the symbol table names the function, but
    // there is no source line.
    let f = leaf("plain.json", &dir.path("nothing-here"));
    assert!(f["file"].is_null() && f["line"].is_null(), "{f}");
    // With it: file and line from its DWARF.
    let f = leaf("debug.json", &root);
    assert!(
        f["file"].as_str().is_some_and(|p| p.ends_with("pattern.c")),
        "{f}"
    );
    assert!(f["line"].as_u64().is_some_and(|l| l > 0), "{f}");
    assert!(target.finish().success());

    // Through the debuglink (no debug directory has it by build ID).
    let nothing = dir.path("nothing-here");
    let f = leaf_of(&linked_target, "linked.json", &nothing);
    assert!(
        f["file"].as_str().is_some_and(|p| p.ends_with("pattern.c")),
        "{f}"
    );
    // A debug file that is not the one linked (another CRC) is not used.
    let mut bytes = std::fs::read(&linked_debug).unwrap();
    bytes.extend_from_slice(b"rebuilt");
    std::fs::write(&linked_debug, bytes).unwrap();
    let f = leaf_of(&linked_target, "mismatch.json", &nothing);
    assert!(f["file"].is_null() && f["line"].is_null(), "{f}");
    assert!(linked_target.finish().success());
}

/// Frames of a JSON site up to (not including) the first in `crate_prefix`,
/// and that frame's function.
fn split_at_crate<'a>(site: &'a Value, crate_prefix: &str) -> Option<(Vec<&'a str>, &'a str)> {
    let frames = site["frames"].as_array()?;
    let i = frames
        .iter()
        .position(|f| function(f).starts_with(crate_prefix))?;
    Some((
        frames[..i].iter().map(function).collect(),
        function(&frames[i]),
    ))
}

#[test]
fn snapshot_json_of_rust_program_with_agent_starts_at_the_site() {
    let exe = workspace_bin("rust_pattern");
    let mut target = Target::spawn(Command::new(&exe));
    let pid = target.pid().to_string();
    let dir = TempDir::new("real-rust-json");
    let json = dir.str("r.json");
    let out = heapdump(&["snapshot", &pid, "--format", "json", "-o", &json]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(Path::new(&json));
    assert!(j["partial"].is_null(), "{}", j["partial"]);

    // Group by the first frame of the program itself; before it there may
    // only be Vec's own (non-plumbing) frames, never allocator plumbing.
    let mut sites: BTreeMap<String, (u64, u64)> = BTreeMap::new();
    for s in j["sites"].as_array().unwrap() {
        let Some((before, site)) = split_at_crate(s, "rust_pattern::site_") else {
            continue;
        };
        for f in &before {
            assert!(
                !heapdump::symbolization::plumbing::is_allocator_function(f),
                "{f}"
            );
            if u(&s["live_blocks"]) > 0 {
                assert!(f.contains("alloc::vec::"), "unexpected leading frame {f}");
            }
        }
        let site = site.trim_start_matches("rust_pattern::");
        let site = site.trim_end_matches("::{{closure}}").to_string();
        let e = sites.entry(site).or_default();
        e.0 += u(&s["live_blocks"]);
        e.1 += u(&s["live_bytes"]);
    }
    let want: BTreeMap<String, (u64, u64)> = [
        ("site_vec", 100, 100 * 1000),
        ("site_zeroed", 50, 50 * 24),
        ("site_realloc", 10, 10 * 4096),
        ("site_free_half", 100, 100 * 32),
        ("site_thread1", 30, 30 * 512),
        ("site_thread2", 20, 20 * 2048),
        ("site_freed_all", 0, 0),
    ]
    .into_iter()
    .map(|(n, b, s)| (n.to_string(), (b, s)))
    .collect();
    assert_eq!(sites, want);
    let sites_stripped = j["sites"].as_array().unwrap().len();

    // --keep-allocator-frames keeps the plumbing: same totals, more sites
    // (the realloc and alloc paths differ), leaf frames in the allocator.
    let json2 = dir.str("r-keep.json");
    let out = heapdump(&[
        "snapshot",
        &pid,
        "--format",
        "json",
        "--keep-allocator-frames",
        "-o",
        &json2,
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let k = read_json(Path::new(&json2));
    assert_eq!(k["totals"]["live_bytes"], j["totals"]["live_bytes"]);
    assert!(k["sites"].as_array().unwrap().len() >= sites_stripped);
    let vec_site = k["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| split_at_crate(s, "rust_pattern::site_vec").is_some())
        .expect("site_vec");
    assert!(
        heapdump::symbolization::plumbing::is_allocator_function(function(&vec_site["frames"][0])),
        "{}",
        vec_site["frames"][0]
    );

    target.send("go");
    target.wait_line("stats");
    assert!(target.finish().success());
}

#[test]
fn run_passes_the_exit_status_and_instruments_the_program() {
    let out = heapdump(&["run", "--", "sh", "-c", "ls -l /proc/$$/fd; exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    assert!(
        stdout(&out).contains("memfd:heapdump.allocations"),
        "{}",
        stdout(&out)
    );
    let out = heapdump(&["run", "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(128 + 9), "{}", stderr(&out));
    let out = heapdump(&["run", "--", "/nonexistent/program"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("/nonexistent/program"),
        "{}",
        stderr(&out)
    );
}

/// A `heapdump` child with stdin and stdout piped.
struct Dumper {
    child: Child,
    stdin: Option<ChildStdin>,
    lines: Lines,
}

impl Dumper {
    fn start(args: &[&str]) -> Dumper {
        let mut child = Command::new(bin())
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start heapdump");
        let stdin = child.stdin.take();
        let lines = Lines::new(child.stdout.take().unwrap());
        Dumper {
            child,
            stdin,
            lines,
        }
    }

    /// The next line starting with `prefix` (others are skipped).
    fn line(&self, prefix: &str) -> String {
        loop {
            let l = self.lines.next();
            if l.starts_with(prefix) {
                return l;
            }
        }
    }

    /// The path of the next `wrote PATH` line.
    fn wrote(&self) -> PathBuf {
        PathBuf::from(self.line("wrote ").strip_prefix("wrote ").unwrap())
    }
}

impl Drop for Dumper {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn signal(pid: u32, sig: libc::c_int) {
    // SAFETY: kill(2) with a pid and a signal number; no memory involved.
    assert_eq!(unsafe { libc::kill(pid as libc::pid_t, sig) }, 0);
}

fn file_name(p: &Path) -> String {
    p.file_name().unwrap().to_string_lossy().into_owned()
}

#[test]
fn run_watch_answers_an_api_request_made_before_attaching() {
    // `rust_pattern request` asks for a snapshot named `from-api` first
    // thing: `run --watch` answers it even if it attached later.
    let dir = TempDir::new("run-watch");
    let snaps = dir.str("snaps");
    let exe = workspace_bin("rust_pattern");
    let mut d = Dumper::start(&[
        "run",
        "--watch",
        &snaps,
        "-f",
        "json",
        "--",
        exe.to_str().unwrap(),
        "request",
    ]);
    let pid: u32 = d.line("ready ")["ready ".len()..].trim().parse().unwrap();
    let api = d.wrote();
    assert!(
        file_name(&api).starts_with(&format!("heapdump-{pid}-0001-req-from-api-")),
        "{api:?}"
    );
    let j = read_json(&api);
    assert_eq!(j["request"]["name"], "from-api");
    assert_eq!(j["request"]["count"], 1);
    assert!(j["partial"].is_null());

    // Closing stdin ends the program: final snapshot, exit status 0.
    drop(d.stdin.take());
    let exit = d.wrote();
    assert!(
        file_name(&exit).starts_with(&format!("heapdump-{pid}-0002-exit-")),
        "{exit:?}"
    );
    assert!(d.child.wait().unwrap().success());
}

#[test]
fn run_watch_answers_a_signal_of_a_c_program() {
    let dir = TempDir::new("run-watch-c");
    let snaps = dir.str("snaps");
    let exe = compile_c("pattern");
    let mut d = Dumper::start(&[
        "run",
        "--watch",
        &snaps,
        "-f",
        "json",
        "--",
        exe.to_str().unwrap(),
    ]);
    let pid: u32 = d.line("ready ")["ready ".len()..].trim().parse().unwrap();
    // Answered whether the watch attached before or after the signal.
    signal(pid, libc::SIGUSR2);
    let p = d.wrote();
    assert!(
        file_name(&p).starts_with(&format!("heapdump-{pid}-0001-signal-")),
        "{p:?}"
    );
    let j = read_json(&p);
    let leaves = by_leaf(&j);
    assert_eq!(leaves["site_malloc"], (100, 100_000), "{leaves:#?}");
    d.stdin.as_mut().unwrap().write_all(b"go\n").unwrap();
    let exit = d.wrote();
    assert!(file_name(&exit).contains("-0002-exit-"), "{exit:?}");
    assert!(d.child.wait().unwrap().success());
}

#[test]
fn watch_answers_api_requests_per_attach_policy_and_signals() {
    let exe = workspace_bin("rust_pattern");
    let target = Target::spawn({
        let mut c = Command::new(&exe);
        c.arg("request");
        c
    });
    let pid = target.pid();
    let dir = TempDir::new("watch-api");
    let (plain_dir, pending_dir) = (dir.str("plain"), dir.str("pending"));
    let pid_s = pid.to_string();
    // Default: the request made before attaching is not answered.
    let plain = Dumper::start(&["watch", &pid_s, "--dir", &plain_dir, "-f", "json"]);
    plain.line("watching ");
    // --answer-pending: it is, at once.
    let pending = Dumper::start(&[
        "watch",
        &pid_s,
        "--dir",
        &pending_dir,
        "-f",
        "json",
        "--answer-pending",
    ]);
    pending.line("watching ");
    let p = pending.wrote();
    assert!(
        file_name(&p).starts_with(&format!("heapdump-{pid}-0001-req-from-api-")),
        "{p:?}"
    );
    assert_eq!(read_json(&p)["request"]["name"], "from-api");

    // A real signal request: both answer it; for the plain watcher it is
    // the first snapshot.
    signal(pid, libc::SIGUSR2);
    let a = plain.wrote();
    assert!(
        file_name(&a).starts_with(&format!("heapdump-{pid}-0001-signal-")),
        "{a:?}"
    );
    let ja = read_json(&a);
    assert_eq!(ja["request"]["count"], 2);
    assert_eq!(ja["request"]["name"], "");
    let b = pending.wrote();
    assert!(file_name(&b).contains("-0002-signal-"), "{b:?}");

    // SIGKILL: both write the final snapshot.
    let mut target = target;
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let e = plain.wrote();
    assert!(file_name(&e).contains("-0002-exit-"), "{e:?}");
    let je = read_json(&e);
    assert!(je["partial"].is_null());
    assert_eq!(je["totals"]["live_bytes"], ja["totals"]["live_bytes"]);
    assert!(pending.wrote().to_string_lossy().contains("-0003-exit-"));
}

#[test]
fn watch_final_snapshot_after_sigkill_is_the_complete_live_set() {
    let mut target = c_pattern(true);
    let pid = target.pid();
    let truth = dump(pid);
    let dir = TempDir::new("watch-kill");
    let snaps = dir.str("snaps");
    let mut w = Dumper::start(&[
        "watch",
        &pid.to_string(),
        "--dir",
        &snaps,
        "-f",
        "json",
        "-f",
        "pprof",
    ]);
    w.line("watching ");
    target.child.kill().unwrap();
    target.child.wait().unwrap();
    let json = w.wrote();
    let pb = w.wrote();
    assert!(
        file_name(&json).starts_with(&format!("heapdump-{pid}-0001-exit-")),
        "{json:?}"
    );
    assert!(file_name(&pb).ends_with(".pb.gz"), "{pb:?}");
    check_c_pattern_json(&read_json(&json), &truth);
    // Every target gone: watch ends by itself.
    assert!(w.child.wait().unwrap().success());
    drop(target);
}

#[test]
fn demo_writes_its_files() {
    let dir = TempDir::new("demo");
    let out = Command::new(bin())
        .args(["demo", "--dir", "out"])
        .current_dir(&dir.0)
        .stdin(Stdio::null())
        .output()
        .expect("run demo");
    let text = stdout(&out);
    assert!(out.status.success(), "{}{}", text, stderr(&out));
    assert!(text.contains("demo_cache_blobs"), "{text}");
    assert!(!text.contains("alloc::alloc::alloc"), "{text}");
    for ext in ["pb.gz", "json", "svg", "dhat.json", "txt"] {
        let p = dir.path("out").join(format!("heapdump-demo.{ext}"));
        let meta = std::fs::metadata(&p).unwrap_or_else(|e| panic!("{}: {e}", p.display()));
        assert!(meta.len() > 0, "{} is empty", p.display());
        use std::os::unix::fs::PermissionsExt;
        assert_eq!(meta.permissions().mode() & 0o777, 0o600, "{}", p.display());
        assert!(text.contains(&format!("out/heapdump-demo.{ext}")), "{text}");
    }
    let j = read_json(&dir.path("out").join("heapdump-demo.json"));
    assert!(j["partial"].is_null());
    assert!(u(&j["totals"]["live_blocks"]) >= 50_000);
}
