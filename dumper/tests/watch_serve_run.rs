//! `heapdump watch`, `serve` and `run` with real processes.

mod common;

use std::process::{Command, Stdio};

use common::*;
use heapdump::commands::serve::MAX_PENDING_DELTAS as MAX_PENDING;
use heapdump::testing::fake_target::PLAN;

struct Running {
    child: std::process::Child,
    lines: Lines,
}

impl Running {
    fn start(args: &[&str]) -> Running {
        let mut child = Command::new(bin())
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start heapdump");
        let lines = Lines::new(child.stdout.take().unwrap());
        Running { child, lines }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn watch_answers_requests_and_dumps_at_sigkill() {
    let mut target = FakeTarget::start(&[]);
    let dir = TempDir::new("watch");
    let pid = target.pid().to_string();
    let out_dir = dir.str("snaps");
    let mut w = Running::start(&[
        "watch", &pid, "--dir", &out_dir, "-f", "json", "-f", "pprof", "--poll", "5ms",
    ]);
    assert!(w.lines.next().starts_with("watching "));

    // An API-style request with a name: one snapshot, in two formats.
    target.cmd("request before-load");
    let a = w.lines.next();
    let b = w.lines.next();
    assert!(
        a.contains(&format!("heapdump-{pid}-0001-req-before-load-")),
        "{a}"
    );
    assert!(a.ends_with(".json"), "{a}");
    assert!(b.ends_with(".pb.gz"), "{b}");
    let j = read_json(std::path::Path::new(a.strip_prefix("wrote ").unwrap()));
    assert_eq!(j["request"]["name"], "before-load");
    assert_eq!(j["request"]["count"], 1);

    // A signal-style request (no name).
    target.cmd("signal");
    let a = w.lines.next();
    w.lines.next();
    assert!(a.contains(&format!("heapdump-{pid}-0002-signal-")), "{a}");

    // More heap, then SIGKILL: the final snapshot has the live set at death.
    target.cmd("alloc");
    target.cmd("alloc");
    target.kill9();
    let a = w.lines.next();
    w.lines.next();
    assert!(a.contains(&format!("heapdump-{pid}-0003-exit-")), "{a}");
    let j = read_json(std::path::Path::new(a.strip_prefix("wrote ").unwrap()));
    let live_blocks: u64 = PLAN.iter().map(|p| p.live).sum::<u64>() + 2;
    assert_eq!(j["totals"]["live_blocks"], live_blocks);
    assert!(j["partial"].is_null());
    let alpha = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["frames"][0]["function"] == "heapdump::testing::fake_target::site_alpha")
        .expect("symbolized after death from the recorded mappings");
    assert_eq!(alpha["live_blocks"], PLAN[0].live + 2);

    // Watch ends by itself once its only target is gone.
    assert_eq!(w.lines.next_or_eof(), None);
    let status = w.child.wait().unwrap();
    assert!(status.success());
}

#[test]
fn watch_selects_blocks_by_age_in_every_snapshot() {
    let mut target = FakeTarget::start(&[]);
    let dir = TempDir::new("watch-ages");
    let pid = target.pid().to_string();
    let out_dir = dir.str("snaps");
    // Blocks allocated in the last thousand days: all of them, counted
    // from each snapshot.
    let w = Running::start(&[
        "watch",
        &pid,
        "--dir",
        &out_dir,
        "-f",
        "json",
        "--poll",
        "5ms",
        "--newer-than",
        "1000d",
    ]);
    assert!(w.lines.next().starts_with("watching "));
    target.cmd("request aged");
    let a = w.lines.next();
    let j = read_json(std::path::Path::new(a.strip_prefix("wrote ").unwrap()));
    let live: u64 = PLAN.iter().map(|p| p.live).sum();
    assert_eq!(j["selection"]["live_blocks"], live);
    assert_eq!(j["totals"]["live_blocks"], live);
    let since = humantime::parse_rfc3339(j["selection"]["newer_than"].as_str().unwrap()).unwrap();
    let taken = humantime::parse_rfc3339(j["taken_at"].as_str().unwrap()).unwrap();
    let back = taken.duration_since(since).unwrap().as_secs();
    assert!(
        (1000 * 86_400 - 1..=1000 * 86_400 + 1).contains(&back),
        "{back}"
    );
    assert_eq!(j["selection"]["older_than"], serde_json::Value::Null);
}

fn http_get(addr: &str, path: &str) -> (String, Vec<u8>) {
    http_get_with(addr, path, "")
}

#[test]
fn serve_gives_go_compatible_heap_profiles() {
    let target = FakeTarget::start(&[]);
    let other = FakeTarget::start(&[]);
    let (p1, p2) = (target.pid().to_string(), other.pid().to_string());
    let srv = Running::start(&["serve", "--listen", "127.0.0.1:0", &p1, &p2]);
    let line = srv.lines.next();
    let url = line.strip_prefix("listening on ").expect("listening line");
    let addr = url
        .strip_prefix("http://")
        .unwrap()
        .split('/')
        .next()
        .unwrap()
        .to_string();

    // Two targets: pid is required.
    let (head, body) = http_get(&addr, "/debug/pprof/heap");
    assert!(
        head.starts_with("HTTP/1.1 400") || head.starts_with("HTTP/1.0 400"),
        "{head}"
    );
    assert!(String::from_utf8_lossy(&body).contains("?pid="));

    let (head, body) = http_get(&addr, &format!("/debug/pprof/heap?pid={p1}"));
    assert!(head.contains(" 200 "), "{head}");
    assert!(
        head.to_ascii_lowercase()
            .contains("content-type: application/octet-stream"),
        "{head}"
    );
    let p = heapdump::formats::pprof::decode(&body).expect("pprof body");
    let inuse: i64 = p.sample.iter().map(|s| s.value[3]).sum();
    let want: u64 = PLAN.iter().map(|p| p.live * p.size).sum();
    assert_eq!(inuse, want as i64);

    // Blocks by age: none is a thousand hours old (`+` is a space in a
    // query), all are newer than a thousand days; a bad value is refused.
    let inuse_of = |query: &str| {
        let (head, body) = http_get(&addr, &format!("/debug/pprof/heap?pid={p1}&{query}"));
        assert!(head.contains(" 200 "), "{query}: {head}");
        let p = heapdump::formats::pprof::decode(&body).expect("pprof body");
        p.sample.iter().map(|s| s.value[3]).sum::<i64>()
    };
    assert_eq!(inuse_of("older_than=1000h+30m"), 0);
    assert_eq!(inuse_of("newer_than=1000d"), want as i64);
    let (head, body) = http_get(
        &addr,
        &format!("/debug/pprof/heap?pid={p1}&older_than=soon"),
    );
    assert!(head.contains(" 400 "), "{head}");
    let body = String::from_utf8_lossy(&body);
    assert!(
        body.contains("bad older_than") && !body.contains("snapshot file"),
        "{body}"
    );

    if go_available() {
        let top = go_pprof(&[
            "-top",
            "-unit=B",
            &format!("http://{addr}/debug/pprof/heap?pid={p2}"),
        ]);
        assert!(top.contains(&format!("{want}B total")), "{top}");
        assert!(top.contains("site_delta"), "{top}");
    }
}

#[test]
fn run_passes_exit_status_through() {
    // Any existing file works as a stand-in preload library here: the
    // dynamic loader warns about a non-ELF preload and runs the program.
    let dir = TempDir::new("run");
    let fake_lib = dir.path("libheapdump_preload.so");
    std::fs::write(&fake_lib, b"not a library").unwrap();
    let lib = fake_lib.display().to_string();
    let out = heapdump(&["run", "--preload", &lib, "--", "sh", "-c", "exit 7"]);
    assert_eq!(out.status.code(), Some(7), "{}", stderr(&out));
    let out = heapdump(&["run", "--preload", &lib, "--", "sh", "-c", "kill -9 $$"]);
    assert_eq!(out.status.code(), Some(128 + 9));
    let out = heapdump(&[
        "run",
        "--preload",
        &lib,
        "--",
        "sh",
        "-c",
        "echo $LD_PRELOAD",
    ]);
    assert!(stdout(&out).contains(&lib));

    let out = heapdump(&["run", "--preload", "/nonexistent/lib.so", "--", "true"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("does not exist"));
}

#[test]
fn watch_keep_deletes_all_but_the_newest_periodic_snapshots() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("keep");
    let pid = target.pid().to_string();
    let out_dir = dir.str("snaps");
    let mut w = Running::start(&[
        "watch",
        &pid,
        "--dir",
        &out_dir,
        "-f",
        "json",
        "-f",
        "text",
        "--interval",
        "10ms",
        "--poll",
        "5ms",
        "--keep",
        "2",
    ]);
    assert!(w.lines.next().starts_with("watching "));
    // Six periodic snapshots (two files each), read as they are announced.
    let mut written: Vec<String> = Vec::new();
    let mut removed: Vec<String> = Vec::new();
    while written.len() < 12 {
        let l = w.lines.next();
        if let Some(p) = l.strip_prefix("wrote ") {
            assert!(p.contains("-interval-"), "{l}");
            written.push(p.to_string());
        } else if let Some(p) = l.strip_prefix("removed ") {
            removed.push(p.to_string());
        } else {
            panic!("unexpected line {l}");
        }
    }
    let status = Command::new("kill")
        .args(["-TERM", &w.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    let mut last = Vec::new();
    while let Some(l) = w.lines.next_or_eof() {
        if let Some(p) = l.strip_prefix("wrote ") {
            if p.contains("-stop-") {
                last.push(p.to_string());
            } else {
                written.push(p.to_string());
            }
        } else if let Some(p) = l.strip_prefix("removed ") {
            removed.push(p.to_string());
        }
    }
    assert!(w.child.wait().unwrap().success());
    assert_eq!(last.len(), 2, "the final snapshot, in both formats");
    // Every periodic file but the newest two snapshots' was removed, each
    // once, oldest first; what is left on disk is exactly those and the
    // final snapshot.
    let n = written.len();
    assert_eq!(removed, written[..n - 4], "removed: {removed:#?}");
    let mut on_disk: Vec<String> = std::fs::read_dir(&out_dir)
        .unwrap()
        .map(|e| e.unwrap().path().display().to_string())
        .collect();
    on_disk.sort();
    let mut want: Vec<String> = written[n - 4..].iter().chain(&last).cloned().collect();
    want.sort();
    assert_eq!(on_disk, want);
    // --keep needs --interval.
    let out = heapdump(&["watch", &pid, "--keep", "2"]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("--interval"), "{}", stderr(&out));
}

#[test]
fn watch_interval_and_stop_by_sigterm() {
    let target = FakeTarget::start(&[]);
    let dir = TempDir::new("interval");
    let pid = target.pid().to_string();
    let out_dir = dir.str("snaps");
    let mut w = Running::start(&[
        "watch",
        &pid,
        "--dir",
        &out_dir,
        "-f",
        "json",
        "--interval",
        "20ms",
        "--poll",
        "5ms",
    ]);
    assert!(w.lines.next().starts_with("watching "));
    let a = w.lines.next();
    let b = w.lines.next();
    assert!(a.contains(&format!("heapdump-{pid}-0001-interval-")), "{a}");
    assert!(b.contains(&format!("heapdump-{pid}-0002-interval-")), "{b}");
    let status = Command::new("kill")
        .args(["-TERM", &w.child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Interval snapshots may still land before the stop is seen.
    let last = loop {
        match w.lines.next_or_eof() {
            Some(l) if l.contains("-stop-") => break l,
            Some(l) => assert!(l.contains("-interval-"), "{l}"),
            None => panic!("watch ended without a stop snapshot"),
        }
    };
    let j = read_json(std::path::Path::new(last.strip_prefix("wrote ").unwrap()));
    assert_eq!(j["pid"], target.pid());
    assert!(w.child.wait().unwrap().success());
    let mode = std::fs::metadata(&out_dir).unwrap();
    use std::os::unix::fs::PermissionsExt;
    assert_eq!(mode.permissions().mode() & 0o777, 0o700);
}

#[test]
fn serve_answers_allocs_delta_profiles_and_targets_by_name_as_go_does() {
    // A program name of its own: other tests of this file run the pattern
    // program at the same time, and a name shared by two targets is
    // (rightly) refused.
    let exe = heapdump_tests::compile_c_variant("pattern", "by-name", &[]);
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", heapdump_tests::preload_lib())
        .arg("hold");
    let mut target = heapdump_tests::Target::spawn(cmd);
    let name = exe.file_name().unwrap().to_str().unwrap().to_string();
    let pid = target.pid().to_string();
    let srv = Running::start(&["serve", "--listen", "127.0.0.1:0", &pid]);
    let line = srv.lines.next();
    let addr = line
        .strip_prefix("listening on http://")
        .expect("listening line")
        .split('/')
        .next()
        .unwrap()
        .to_string();

    // By name (the program's file name), with Go's gc=1 accepted.
    let (head, body) = http_get(&addr, &format!("/debug/pprof/allocs?name={name}&gc=1"));
    assert!(head.contains(" 200 "), "{head}");
    let p = heapdump::formats::pprof::decode(&body).expect("pprof body");
    let default = &p.string_table[p.default_sample_type as usize];
    assert_eq!(default, "alloc_space");
    let inuse: i64 = p.sample.iter().map(|s| s.value[3]).sum();
    assert!(inuse > 0);
    let (head, _) = http_get(&addr, "/debug/pprof/heap?name=no-such-program");
    assert!(head.contains(" 404 "), "{head}");

    // A delta over one second of a process that does not allocate: nothing
    // changed.
    let (head, body) = http_get(&addr, &format!("/debug/pprof/heap?pid={pid}&seconds=1"));
    assert!(head.contains(" 200 "), "{head}");
    let p = heapdump::formats::pprof::decode(&body).expect("pprof body");
    let changed: i64 = p.sample.iter().map(|s| s.value[3].abs()).sum();
    assert_eq!(changed, 0);
    let (head, _) = http_get(
        &addr,
        &format!("/debug/pprof/heap?pid={pid}&seconds=100000"),
    );
    assert!(head.contains(" 400 "), "{head}");
    // A delta over five minutes waits beside the other requests, not in
    // front of them (it held the server for its whole time: every scrape
    // of the host timed out, for any user who asked for one). Longer than
    // the hang guard of the requests below.
    let long = format!("/debug/pprof/heap?pid={pid}&seconds=300");
    assert!(std::time::Duration::from_secs(300) > HANG_GUARD);
    let waiting: Vec<_> = (0..MAX_PENDING)
        .map(|_| {
            let (addr, long) = (addr.clone(), long.clone());
            let (tx, rx) = std::sync::mpsc::channel();
            std::thread::spawn(move || {
                let mut s = std::net::TcpStream::connect(&addr).unwrap();
                use std::io::Write;
                write!(s, "GET {long} HTTP/1.0\r\nHost: {addr}\r\n\r\n").unwrap();
                let _ = tx.send(());
                // Held open until the server goes.
                let _ = std::io::Read::read_to_end(&mut s, &mut Vec::new());
            });
            rx
        })
        .collect();
    for sent in &waiting {
        sent.recv().unwrap();
    }
    // Answered while they wait (the index says how many do).
    let full = format!("delta profiles waiting: {MAX_PENDING} ");
    loop {
        let (head, body) = http_get(&addr, "/");
        assert!(head.contains(" 200 "), "{head}");
        if String::from_utf8_lossy(&body).contains(&full) {
            break;
        }
    }
    let (head, body) = http_get(&addr, &format!("/debug/pprof/heap?pid={pid}"));
    assert!(head.contains(" 200 "), "{head}");
    assert!(heapdump::formats::pprof::decode(&body).is_ok());
    // One more than the server keeps waiting: refused at once.
    let (head, _) = http_get(&addr, &long);
    assert!(head.contains(" 503 "), "{head}");

    if go_available() {
        let top = go_pprof(&[
            "-top",
            &format!("http://{addr}/debug/pprof/allocs?pid={pid}"),
        ]);
        assert!(top.contains("Type: alloc_space"), "{top}");
    }
    target.send("done");
    assert!(target.finish().success());
}

/// Waits for a `wrote PATH` line of the collector naming `pid`'s snapshot
/// with `reason` in its file name (other tests' processes may be
/// collected too: their lines are skipped).
fn wait_wrote(lines: &Lines, pid: &str, reason: &str) -> std::path::PathBuf {
    loop {
        let l = lines.next();
        if let Some(p) = l.strip_prefix("wrote ") {
            let name = std::path::Path::new(p)
                .file_name()
                .unwrap()
                .to_string_lossy()
                .into_owned();
            if name.starts_with(&format!("heapdump-{pid}-")) && name.contains(reason) {
                return p.into();
            }
        }
    }
}

/// Live blocks of the C pattern's `site_malloc` in a JSON snapshot.
fn site_malloc_blocks(path: &std::path::Path) -> u64 {
    let j = read_json(path);
    j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .any(|f| f["function"] == "site_malloc")
        })
        .map(|s| s["live_blocks"].as_u64().unwrap())
        .sum()
}

#[test]
fn watch_all_collects_processes_started_later_their_requests_and_deaths() {
    let dir = TempDir::new("collector");
    let out_dir = dir.str("snaps");
    let collector = Running::start(&[
        "watch", "--all", "--dir", &out_dir, "-f", "json", "--scan", "20ms", "--poll", "5ms",
    ]);
    assert!(collector.lines.next().starts_with("watching"));

    // Two instrumented processes started after the collector.
    let exe = heapdump_tests::compile_c("pattern");
    let start = || {
        let mut cmd = Command::new(&exe);
        cmd.env("LD_PRELOAD", heapdump_tests::preload_lib())
            .arg("hold");
        heapdump_tests::Target::spawn(cmd)
    };
    let mut asking = start();
    let mut killed = start();
    let (a, k) = (asking.pid().to_string(), killed.pid().to_string());
    let mut seen = (false, false);
    while seen != (true, true) {
        let l = collector.lines.next();
        seen.0 |= l.starts_with(&format!("watching {a} "));
        seen.1 |= l.starts_with(&format!("watching {k} "));
    }

    // One asks for a snapshot (the agent's signal), one is SIGKILLed.
    // SAFETY: signals to the children this test started.
    unsafe { libc::kill(asking.pid() as i32, libc::SIGUSR2) };
    let requested = wait_wrote(&collector.lines, &a, "signal");
    killed.child.kill().unwrap();
    let _ = killed.child.wait();
    let died = wait_wrote(&collector.lines, &k, "exit");
    asking.send("done");
    assert!(asking.finish().success());
    let exited = wait_wrote(&collector.lines, &a, "exit");

    // Each is the exact live set of the pattern's site_malloc.
    for f in [&requested, &died, &exited] {
        assert_eq!(site_malloc_blocks(f), 100, "{}", f.display());
    }
    // The collector outlived them and stops cleanly.
    let mut collector = collector;
    // SAFETY: SIGTERM to the collector this test started.
    unsafe { libc::kill(collector.child.id() as i32, libc::SIGTERM) };
    assert!(collector.child.wait().unwrap().success());
}

/// Byte-count flags take the agent's spellings (one parser for both), hand
/// the agent the parsed number, and refuse a bad one with a clear error
/// before anything runs.
#[test]
fn size_flags_are_parsed_before_the_program_starts() {
    let out = heapdump(&[
        "run",
        "--sample-rate",
        "2MiB",
        "--",
        "sh",
        "-c",
        "echo rate=$HEAPDUMP_SAMPLE_RATE",
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("rate=2097152"),
        "{}",
        String::from_utf8_lossy(&out.stdout)
    );
    for args in [
        &["run", "--sample-rate", "12parsecs", "--", "true"][..],
        &["watch", "--all", "--max-total", "5XB"][..],
    ] {
        let out = heapdump(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert!(stderr(&out).contains("unknown unit"), "{}", stderr(&out));
    }
}

#[test]
fn metrics_give_each_processs_heap_behind_a_token_and_end_with_the_process() {
    let dir = TempDir::new("metrics");
    let exe = heapdump_tests::compile_c("hostile");
    let start = || {
        let mut cmd = Command::new(&exe);
        cmd.env("LD_PRELOAD", heapdump_tests::preload_lib());
        let mut t = heapdump_tests::Target::spawn(cmd);
        t.send("alloc");
        t.wait_line("allocated");
        t.send("wrapped");
        t.wait_line("wrapped");
        t
    };
    let a = start();
    let mut b = start();
    let (pa, pb) = (a.pid().to_string(), b.pid().to_string());
    let token = dir.path("token");
    std::fs::write(&token, "s3cret-token\n").unwrap();
    let srv = Running::start(&[
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--token-file",
        token.to_str().unwrap(),
        &pa,
        &pb,
    ]);
    let addr = listening_addr(&srv.lines.next());
    // No token, or a wrong one: refused, for every endpoint.
    for h in ["", "Authorization: Bearer wrong\r\n"] {
        for path in ["/metrics", "/debug/pprof/heap"] {
            let (head, _) = http_get_with(&addr, path, h);
            assert!(
                head.starts_with("HTTP/1.0 401") || head.starts_with("HTTP/1.1 401"),
                "{head}"
            );
        }
    }
    let auth = "Authorization: Bearer s3cret-token\r\n";
    // OpenMetrics when asked for, as Prometheus asks (the classic text
    // otherwise: dumper/tests/prometheus.rs).
    let om = "Authorization: Bearer s3cret-token\r\n\
              Accept: application/openmetrics-text;version=1.0.0,text/plain;q=0.5\r\n";
    let (head, body) = http_get_with(&addr, "/metrics", om);
    assert!(head.contains("openmetrics-text"), "{head}");
    let text = String::from_utf8(body).unwrap();
    // Exact mode, quiescent programs: each one's figures are its
    // snapshot's.
    for pid in [&pa, &pb] {
        let out = dir.str(&format!("{pid}.json"));
        assert!(heapdump(&["snapshot", pid, "-o", &out]).status.success());
        let j = read_json(std::path::Path::new(&out));
        let l = format!("pid=\"{pid}\"");
        assert_eq!(
            sample(&text, "heapdump_live_bytes", &[&l, "mode=\"exact\""]),
            Some(j["totals"]["live_bytes"].as_u64().unwrap() as f64),
            "{text}"
        );
        assert_eq!(
            sample(&text, "heapdump_live_blocks", &[&l]),
            Some(j["totals"]["live_blocks"].as_u64().unwrap() as f64)
        );
        assert_eq!(
            sample(&text, "heapdump_peak_bytes", &[&l]),
            Some(j["totals"]["peak_bytes"].as_u64().unwrap() as f64)
        );
        // The top sites, named by the program's own functions (past its
        // allocation wrapper).
        assert_eq!(
            sample(
                &text,
                "heapdump_site_live_bytes",
                &[&l, "site=\"site_hostile ← main\""]
            ),
            Some(30_000.0),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                "heapdump_site_live_bytes",
                &[&l, "site=\"site_wrapped_a ← main\""]
            ),
            Some(4_900.0),
            "{text}"
        );
        assert!(sample(&text, "heapdump_scrape_duration_seconds", &[&l]).is_some());
    }
    // A process that exits: its series end, and the collector says why.
    b.send("quit");
    let _ = b.child.wait();
    let (_, body) = http_get_with(&addr, "/metrics", auth);
    let text = String::from_utf8(body).unwrap();
    assert!(!text.contains(&format!("pid=\"{pb}\"")), "{text}");
    assert_eq!(
        sample(&text, "heapdump_scrape_errors", &["reason=\"exited\""]),
        Some(1.0),
        "{text}"
    );
    assert!(sample(&text, "heapdump_live_bytes", &[&format!("pid=\"{pa}\"")]).is_some());
    drop(a);
}

#[test]
fn serve_refuses_an_address_off_loopback_without_a_token() {
    let out = heapdump(&["serve", "--listen", "0.0.0.0:0"]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("--token-file") && stderr(&out).contains("--insecure-listen"),
        "{}",
        stderr(&out)
    );
    let srv = Running::start(&["serve", "--listen", "0.0.0.0:0", "--insecure-listen"]);
    assert!(srv.lines.next().starts_with("listening on http://"));
}
