//! `heapdump snapshot`, `list` and `diff` against the fake target, whose
//! live set is known exactly (heapdump::testing::fake_target::PLAN).

mod common;

use std::collections::HashMap;
use std::os::unix::fs::PermissionsExt;

use common::*;
use heapdump::testing::fake_target::{CHURN_SIZES, PLAN};
use serde_json::Value;

fn expected_totals() -> (u64, u64, u64, u64) {
    let live_bytes = PLAN.iter().map(|p| p.live * p.size).sum();
    let live_blocks = PLAN.iter().map(|p| p.live).sum();
    let alloc_bytes = PLAN.iter().map(|p| (p.live + p.freed) * p.size).sum();
    let alloc_blocks = PLAN.iter().map(|p| p.live + p.freed).sum();
    (live_bytes, live_blocks, alloc_bytes, alloc_blocks)
}

fn leaf_name(site: &Value) -> String {
    site["frames"][0]["function"]
        .as_str()
        .unwrap_or("")
        .rsplit("::")
        .next()
        .unwrap()
        .to_string()
}

fn snapshot_json(pid: u32, dir: &TempDir, name: &str, extra: &[&str]) -> Value {
    let path = dir.str(name);
    let pid = pid.to_string();
    let mut args = vec!["snapshot", &pid, "-o", &path];
    args.extend_from_slice(extra);
    let out = heapdump(&args);
    assert!(out.status.success(), "snapshot failed: {}", stderr(&out));
    read_json(&dir.path(name))
}

#[test]
fn json_matches_ground_truth_exactly() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("truth");
    let j = snapshot_json(target.pid(), &dir, "snap.json", &[]);

    let mode = std::fs::metadata(dir.path("snap.json"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "snapshot files are private");

    assert_eq!(j["pid"], target.pid());
    // The fake target names its main thread, hence the process.
    assert_eq!(j["process"], "fake-main");
    assert!(j["taken_at"].as_str().unwrap().ends_with('Z'));
    assert!(j["partial"].is_null(), "clean snapshot: {}", j["partial"]);
    assert_eq!(j["dropped"]["total"], 0);

    let (lb, lk, ab, ak) = expected_totals();
    let t = &j["totals"];
    assert_eq!(t["live_bytes"], lb);
    assert_eq!(t["live_blocks"], lk);
    assert_eq!(t["alloc_bytes"], ab);
    assert_eq!(t["alloc_blocks"], ak);
    assert!(t["peak_bytes"].as_u64().unwrap() >= lb);

    // Per site: exactly the planned sites, with symbolized frames.
    let sites = j["sites"].as_array().unwrap();
    assert_eq!(sites.len(), PLAN.len());
    for p in PLAN {
        let s = sites
            .iter()
            .find(|s| leaf_name(s) == p.function)
            .unwrap_or_else(|| panic!("site {} missing", p.function));
        assert_eq!(s["live_bytes"], p.live * p.size, "{}", p.function);
        assert_eq!(s["live_blocks"], p.live, "{}", p.function);
        assert_eq!(
            s["alloc_bytes"],
            (p.live + p.freed) * p.size,
            "{}",
            p.function
        );
        assert_eq!(s["alloc_blocks"], p.live + p.freed, "{}", p.function);
        let frames = s["frames"].as_array().unwrap();
        assert_eq!(frames.len(), 3);
        let f0 = &frames[0];
        assert_eq!(
            f0["function"],
            format!("heapdump::testing::fake_target::{}", p.function)
        );
        assert!(f0["address"].as_str().unwrap().starts_with("0x"));
        assert!(f0["file"].as_str().unwrap().ends_with("fake_target.rs"));
        assert!(f0["line"].as_u64().unwrap() > 0);
        assert!(f0["module"].as_str().unwrap().ends_with("heapdump"));
        assert_eq!(
            frames[1]["function"],
            format!("heapdump::testing::fake_target::{}", p.caller)
        );
        assert_eq!(
            frames[2]["function"],
            "heapdump::testing::fake_target::fake_root"
        );
        // Per-thread breakdown of the site.
        let st = s["threads"].as_array().unwrap();
        assert_eq!(st.len(), 1);
        assert_eq!(st[0]["live_bytes"], p.live * p.size);
    }

    // Per thread.
    let threads = j["threads"].as_array().unwrap();
    let mut want: HashMap<&str, (u64, u64)> = HashMap::new();
    for p in PLAN {
        let e = want.entry(p.thread).or_default();
        e.0 += p.live * p.size;
        e.1 += p.live;
    }
    assert_eq!(threads.len(), want.len());
    for t in threads {
        let name = t["name"].as_str().unwrap();
        let (b, k) = want[name];
        assert_eq!(t["live_bytes"], b, "{name}");
        assert_eq!(t["live_blocks"], k, "{name}");
        assert!(t["tid"].as_u64().unwrap() > 0);
    }
    let main = threads.iter().find(|t| t["name"] == "fake-main").unwrap();
    assert_eq!(main["tid"], target.pid());

    // Mappings with build IDs.
    let maps = j["mappings"].as_array().unwrap();
    let own = maps
        .iter()
        .find(|m| m["path"].as_str().unwrap().ends_with("/heapdump"))
        .expect("the target's executable mapping");
    assert!(own["build_id"].as_str().is_some_and(|b| b.len() >= 16));
}

#[test]
fn a_peak_snapshot_never_claims_less_than_the_curve_shows() {
    // The fake target's heap rose above what it holds now (it allocated
    // and freed blocks). Whatever `--peak` can rebuild, the heap it shows
    // plus its tolerance reaches the peak the totals and the curve name,
    // and a heap now shown for a peak that was higher says so: `--peak`
    // once showed the heap now, 14 KiB, "at most 2.3 KiB below the true
    // high-water mark", beside a curve whose peak was 18 KiB.
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("peak-claim");
    let j = snapshot_json(target.pid(), &dir, "peak.json", &["--peak"]);
    let (lb, ..) = expected_totals();
    let peak_bytes = j["totals"]["peak_bytes"].as_u64().unwrap();
    assert!(
        peak_bytes > lb,
        "the fake's heap was higher before: {}",
        j["totals"]
    );
    assert_eq!(curve_max(&j), peak_bytes, "{}", j["timeline"]);
    let shown = j["peak"]["live_bytes"].as_u64().unwrap();
    let tolerance = j["peak"]["tolerance"].as_u64().unwrap();
    assert!(
        shown + tolerance >= peak_bytes,
        "shown {shown} + tolerance {tolerance} < peak {peak_bytes}"
    );
    // Shown for the peak or not, it says which.
    let at_peak = j["peak"]["at_peak"].as_bool().unwrap();
    let noted = j["notes"]
        .to_string()
        .contains("was not recorded: this is the heap now");
    assert_eq!(noted, !at_peak, "{}", j["notes"]);
    if !at_peak {
        assert_eq!(shown, lb);
        assert_eq!(j["peak"]["time"], j["taken_at"]);
    }
    let text = stdout(&heapdump(&[
        "snapshot",
        &target.pid().to_string(),
        "--peak",
    ]));
    let header = text
        .lines()
        .find(|l| l.starts_with("THE HEAP"))
        .unwrap_or_else(|| panic!("{text}"));
    assert_eq!(
        header.starts_with("THE HEAP NOW"),
        !at_peak,
        "{header} (JSON at_peak {at_peak})"
    );
}

#[test]
fn no_symbolize_keeps_addresses_and_modules() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("nosym");
    let j = snapshot_json(target.pid(), &dir, "s.json", &["--no-symbolize"]);
    assert_eq!(j["symbolized"], false);
    for s in j["sites"].as_array().unwrap() {
        for f in s["frames"].as_array().unwrap() {
            assert!(f["function"].is_null());
            assert!(f["module"].as_str().unwrap().ends_with("heapdump"));
        }
    }
}

fn sums(p: &heapdump::formats::pprof::Profile) -> [i64; 4] {
    let mut s = [0i64; 4];
    for sample in &p.sample {
        for (i, v) in sample.value.iter().enumerate() {
            s[i] += v;
        }
    }
    s
}

#[test]
fn pprof_reads_back_with_go_heap_layout() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("pprof");
    let pid = target.pid().to_string();
    let path = dir.str("heap.pb.gz");
    let out = heapdump(&["snapshot", &pid, "-o", &path]);
    assert!(out.status.success(), "{}", stderr(&out));
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[..2], &[0x1f, 0x8b], "gzipped");
    let p = heapdump::formats::pprof::decode(&bytes).unwrap();

    let st = &p.string_table;
    assert_eq!(st[0], "");
    let mut uniq = st.clone();
    uniq.sort();
    uniq.dedup();
    assert_eq!(uniq.len(), st.len(), "strings stored once");
    let types: Vec<(String, String)> = p
        .sample_type
        .iter()
        .map(|t| (st[t.r#type as usize].clone(), st[t.unit as usize].clone()))
        .collect();
    assert_eq!(
        types,
        [
            ("alloc_objects", "count"),
            ("alloc_space", "bytes"),
            ("inuse_objects", "count"),
            ("inuse_space", "bytes")
        ]
        .map(|(a, b)| (a.to_string(), b.to_string()))
    );
    let (lb, lk, ab, ak) = expected_totals();
    assert_eq!(sums(&p), [ak as i64, ab as i64, lk as i64, lb as i64]);

    // Locations resolve to our functions, inside a mapping with a build ID.
    let names: Vec<&str> = p
        .function
        .iter()
        .map(|f| st[f.name as usize].as_str())
        .collect();
    for s in PLAN {
        assert!(names.iter().any(|n| n.ends_with(s.function)), "{names:?}");
    }
    for loc in &p.location {
        assert!(loc.mapping_id >= 1);
        let m = &p.mapping[loc.mapping_id as usize - 1];
        assert!(m.memory_start <= loc.address && loc.address < m.memory_limit);
        assert!(!st[m.build_id as usize].is_empty());
    }

    // Per-thread split keeps the sums and labels each live sample.
    let path2 = dir.str("threads.pb.gz");
    let out = heapdump(&["snapshot", &pid, "-o", &path2, "--per-thread"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p2 = heapdump::formats::pprof::decode(&std::fs::read(&path2).unwrap()).unwrap();
    assert_eq!(sums(&p2), sums(&p));
    let st2 = &p2.string_table;
    for s in &p2.sample {
        if s.value[3] > 0 {
            let l = s
                .label
                .iter()
                .find(|l| st2[l.key as usize] == "thread")
                .expect("thread label");
            assert!(st2[l.str as usize].starts_with("fake-"));
        }
    }

    if go_available() {
        let top = go_pprof(&["-top", "-unit=B", "-sample_index=inuse_space", &path]);
        assert!(
            top.contains(&format!("{lb}B total")),
            "go tool pprof total: {top}"
        );
        assert!(top.contains("site_delta"), "{top}");
        let raw = go_pprof(&["-raw", &path]);
        assert!(
            raw.contains(
                "alloc_objects/count alloc_space/bytes inuse_objects/count inuse_space/bytes"
            ),
            "{raw}"
        );
        let alloc = go_pprof(&["-top", "-unit=B", "-sample_index=alloc_space", &path]);
        assert!(alloc.contains(&format!("{ab}B total")), "{alloc}");
    }
}

#[test]
fn other_formats_render() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("formats");
    let pid = target.pid().to_string();

    let text = heapdump(&["snapshot", &pid]);
    assert!(text.status.success());
    let t = stdout(&text);
    assert!(t.contains("top 4 of 4 allocation sites"), "{t}");
    let first_site = t.find("site_delta").unwrap();
    assert!(
        first_site < t.find("site_beta").unwrap(),
        "sorted by live bytes"
    );

    let d = dir.str("heap.dhat.json");
    assert!(heapdump(&["snapshot", &pid, "-o", &d]).status.success());
    let dh = read_json(&dir.path("heap.dhat.json"));
    assert_eq!(dh["dhatFileVersion"], 2);
    assert_eq!(dh["ftbl"][0], "[root]");
    let pps = dh["pps"].as_array().unwrap();
    assert_eq!(pps.len(), PLAN.len());
    let (lb, _, ab, _) = expected_totals();
    assert_eq!(
        pps.iter().map(|p| p["eb"].as_u64().unwrap()).sum::<u64>(),
        lb
    );
    assert_eq!(
        pps.iter().map(|p| p["tb"].as_u64().unwrap()).sum::<u64>(),
        ab
    );
    let ftbl = dh["ftbl"].as_array().unwrap();
    for p in pps {
        for f in p["fs"].as_array().unwrap() {
            assert!((f.as_u64().unwrap() as usize) < ftbl.len());
        }
    }

    let folded = heapdump(&["snapshot", &pid, "--format", "folded"]);
    let f = stdout(&folded);
    assert_eq!(f.lines().count(), PLAN.len());
    let total: u64 = f
        .lines()
        .map(|l| l.rsplit_once(' ').unwrap().1.parse::<u64>().unwrap())
        .sum();
    assert_eq!(total, lb);
    assert!(f
        .lines()
        .all(|l| l.starts_with("heapdump::testing::fake_target::fake_root;")));

    let svg = dir.str("flame.svg");
    assert!(heapdump(&["snapshot", &pid, "-o", &svg]).status.success());
    let s = std::fs::read_to_string(&svg).unwrap();
    assert!(s.contains("<svg") && s.contains("site_beta"));

    let bad = heapdump(&["snapshot", &pid, "-o", &dir.str("x.unknown")]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("--format"), "{}", stderr(&bad));
}

#[test]
fn twenty_snapshots_of_a_churning_target_are_clean() {
    let target = FakeTarget::start(&["--churn"]);
    let dir = TempDir::new("churn");
    for i in 0..20 {
        let j = snapshot_json(
            target.pid(),
            &dir,
            &format!("s{i}.json"),
            &["--no-symbolize"],
        );
        assert!(j["partial"].is_null(), "snapshot {i}: {}", j["partial"]);
        let sites = j["sites"].as_array().unwrap();
        let mut live = 0;
        for s in sites {
            let (b, k) = (
                s["live_bytes"].as_u64().unwrap(),
                s["live_blocks"].as_u64().unwrap(),
            );
            live += b;
            if k == 0 {
                continue;
            }
            // Every site allocates one fixed size: a torn record would break it.
            assert_eq!(b % k, 0, "snapshot {i}: torn record? {s}");
            let size = b / k;
            assert!(
                CHURN_SIZES.contains(&size) || PLAN.iter().any(|p| p.size == size),
                "snapshot {i}: unexpected size {size}"
            );
        }
        assert_eq!(j["totals"]["live_bytes"].as_u64().unwrap(), live);
    }
}

#[test]
fn list_shows_the_target() {
    let target = FakeTarget::start(&[]);
    let out = heapdump(&["list"]);
    assert!(out.status.success());
    let s = stdout(&out);
    let line = s
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&target.pid().to_string()))
        .unwrap_or_else(|| panic!("pid missing from list: {s}"));
    let (_, lk, _, _) = expected_totals();
    assert!(line.contains(&format!(" {lk} ")), "{line}");
}

#[test]
fn diff_shows_growth_per_stack() {
    let mut target = FakeTarget::start(&[]);
    let dir = TempDir::new("diff");
    snapshot_json(target.pid(), &dir, "a.json", &[]);
    for _ in 0..3 {
        target.cmd("alloc");
    }
    snapshot_json(target.pid(), &dir, "b.json", &[]);
    let out = heapdump(&["diff", &dir.str("a.json"), &dir.str("b.json")]);
    assert!(out.status.success(), "{}", stderr(&out));
    let t = stdout(&out);
    assert!(t.contains("top 1 sites by live growth"), "{t}");
    assert!(t.contains("+300 B"), "{t}");
    assert!(t.contains("site_alpha"), "{t}");

    let pb = dir.str("diff.pb.gz");
    let out = heapdump(&["diff", &dir.str("a.json"), &dir.str("b.json"), "-o", &pb]);
    assert!(out.status.success(), "{}", stderr(&out));
    let p = heapdump::formats::pprof::decode(&std::fs::read(&pb).unwrap()).unwrap();
    assert_eq!(sums(&p), [3, 300, 3, 300]);
    if go_available() {
        let top = go_pprof(&["-top", "-unit=B", "-sample_index=inuse_space", &pb]);
        assert!(top.contains("300B total"), "{top}");
    }

    let bad = heapdump(&["diff", &dir.str("a.json"), &dir.str("missing.json")]);
    assert!(!bad.status.success());
    assert!(stderr(&bad).contains("missing.json"));
}

// ---- bad input ----

fn fails_with(args: &[&str], needle: &str) {
    let out = heapdump(args);
    assert!(!out.status.success(), "{args:?} should fail");
    let e = stderr(&out);
    assert!(e.contains(needle), "{args:?}: expected {needle:?} in: {e}");
}

#[test]
fn no_such_process() {
    let mut c = std::process::Command::new("true").spawn().unwrap();
    let pid = c.id();
    c.wait().unwrap();
    fails_with(&["snapshot", &pid.to_string()], "no such process");
}

#[test]
fn not_instrumented() {
    let mut c = std::process::Command::new("sleep")
        .arg("600")
        .spawn()
        .unwrap();
    let pid = c.id().to_string();
    fails_with(&["snapshot", &pid], "is not instrumented");
    let _ = c.kill();
    let _ = c.wait();
}

#[test]
fn corrupted_magic() {
    let t = FakeTarget::start(&["--corrupt", "magic"]);
    fails_with(&["snapshot", &t.pid().to_string()], "bad magic");
}

#[test]
fn version_mismatch() {
    let t = FakeTarget::start(&["--corrupt", "version"]);
    fails_with(
        &["snapshot", &t.pid().to_string()],
        "unsupported heapdump format version 99.",
    );
}

#[test]
fn unsealed_region() {
    let t = FakeTarget::start(&["--unsealed"]);
    fails_with(&["snapshot", &t.pid().to_string()], "not sealed");
}

#[test]
fn corrupted_nodes_give_a_partial_snapshot() {
    let t = FakeTarget::start(&["--corrupt", "nodes"]);
    let dir = TempDir::new("nodes");
    let path = dir.str("s.json");
    let out = heapdump(&["snapshot", &t.pid().to_string(), "-o", &path]);
    assert_eq!(
        out.status.code(),
        Some(2),
        "partial exit status: {}",
        stderr(&out)
    );
    assert!(stderr(&out).contains("PARTIAL"), "{}", stderr(&out));
    let j = read_json(&dir.path("s.json"));
    let reason = j["partial"].as_str().expect("partial reason");
    assert!(reason.contains("being modified"), "{reason}");
    assert!(reason.contains("stack key"), "{reason}");
}

#[test]
fn forked_child_with_inherited_regions_only() {
    let target = FakeTarget::start(&[]);
    let mut t = target;
    {
        let stdin = t.stdin.as_mut().unwrap();
        use std::io::Write;
        writeln!(stdin, "fork").unwrap();
        stdin.flush().unwrap();
    }
    let line = t.lines.next();
    let child: u32 = line
        .strip_prefix("forked ")
        .expect("forked line")
        .parse()
        .unwrap();
    fails_with(
        &["snapshot", &child.to_string()],
        &format!("inherited from parent pid {}", t.pid()),
    );
    let _ = std::process::Command::new("kill")
        .args(["-9", &child.to_string()])
        .status();
}
