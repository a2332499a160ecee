//! Faults (issue 5): the target killed in the middle of snapshots, the
//! dumper killed in the middle of one, fork storms and fork+exec under the
//! preload library while threads allocate, and signals whose handlers
//! allocate arriving while the agent is inside the allocator. (A full
//! table and thread-exit storms are covered by agent_lifecycle.rs.)
//!
//! No sleeps as synchronisation: outcomes are checked whatever the timing,
//! and every wait has a hang guard.

mod safety_common;

use std::process::{Command, Stdio};
use std::sync::mpsc;

use heapdump_tests::*;
use safety_common::{built_bin, check_outcome, heapdump, scratch, snapshot_json};

fn churn_target() -> Target {
    let mut cmd = Command::new(built_bin("rust_pattern"));
    cmd.arg("churn");
    Target::spawn(cmd)
}

fn sigkill(pid: u32) {
    // SAFETY: kill(2) on our own, not yet reaped, child.
    unsafe { libc::kill(pid as i32, libc::SIGKILL) };
}

#[test]
fn target_killed_while_snapshots_run() {
    let dir = scratch("fault-target-killed");
    let mut outcomes = [0u32; 3];
    for round in 0..6u32 {
        let mut target = churn_target();
        let pid = target.pid();
        // A thread takes snapshots back to back and reports each one.
        let (tx, rx) = mpsc::channel();
        let d = dir.clone();
        let snapper = std::thread::spawn(move || {
            for i in 0..4 {
                let out = d.join(format!("r{round}-{i}.json"));
                // Alternate symbolized (longer: the kill may land while
                // symbolizing) and not.
                let extra: &[&str] = if i % 2 == 0 { &[] } else { &["--no-symbolize"] };
                let run = snapshot_json(pid, &out, extra);
                let code = check_outcome(&run, &out);
                if tx.send(code).is_err() {
                    break;
                }
            }
        });
        // Kill after 0, 1 or 2 finished snapshots: the next one is then
        // anywhere between start and finish.
        let mut codes = Vec::new();
        for _ in 0..round % 3 {
            codes.push(rx.recv_timeout(HANG_GUARD).expect("snapshot finished"));
        }
        sigkill(pid);
        let _ = target.child.wait();
        while let Ok(c) = rx.recv_timeout(HANG_GUARD) {
            codes.push(c);
        }
        snapper.join().expect("snapshot thread");
        assert_eq!(codes.len(), 4, "every snapshot ended: {codes:?}");
        for c in codes {
            outcomes[c as usize] += 1;
        }
    }
    eprintln!(
        "outcomes: ok {} / error {} / partial {}",
        outcomes[0], outcomes[1], outcomes[2]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn dumper_killed_mid_snapshot_leaves_target_unaffected() {
    let dir = scratch("fault-dumper-killed");
    let mut target = churn_target();
    let pid = target.pid();
    for i in 0..8 {
        let out = dir.join(format!("k{i}.json"));
        let mut dumper = Command::new(heapdump())
            .args(["snapshot", &pid.to_string(), "--format", "json", "-o"])
            .arg(&out)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn heapdump");
        // Killed at whatever point it has reached (often mid-walk or
        // mid-symbolization on a loaded machine).
        let _ = dumper.kill();
        let _ = dumper.wait();
    }
    assert!(target.child.try_wait().unwrap().is_none(), "target died");
    // It can be snapshotted again, cleanly or partial, never an error.
    let out = dir.join("after.json");
    let run = snapshot_json(pid, &out, &[]);
    let code = check_outcome(&run, &out);
    assert!(code == 0 || code == 2, "{run:?}");
    target.send("stop");
    assert!(target.finish().success(), "target did not stop cleanly");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn fork_storm_and_exec_while_threads_allocate() {
    let exe = compile_c("safety_forkstorm");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let target = Target::spawn(cmd);
    let line = target.last_line().to_string();
    assert!(line.ends_with("failed=0"), "children failed: {line}");
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.writer_pid, pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(&exe, pid);
    let t = by_site(&d, &syms, "site_");
    assert_eq!(
        t.get("site_keep").map(|e| (e.0, e.1)),
        Some((100, 100 * 333)),
        "{t:#?}"
    );
    assert!(target.finish().success());
}

#[test]
fn signal_handlers_that_allocate_inside_the_agent() {
    let exe = built_bin("safety_sigalloc");
    let target = Target::spawn(Command::new(&exe));
    let line = target.last_line().to_string();
    let hits: u64 = line
        .split_whitespace()
        .find_map(|w| w.strip_prefix("hits="))
        .and_then(|h| h.parse().ok())
        .expect("hits");
    assert!(hits > 0, "no signal was handled: {line}");
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(&exe, pid);
    let t = by_site(&d, &syms, "site_");
    // Exactly the kept blocks: every 100th of 200 000, sizes 100..150.
    let expect_bytes: u64 = (0..2000u64).map(|j| 100 + j % 50).sum();
    assert_eq!(
        t.get("site_kept").map(|e| (e.0, e.1)),
        Some((2000, expect_bytes)),
        "{t:#?}"
    );
    assert!(
        !t.contains_key("site_temp"),
        "freed blocks reported: {t:#?}"
    );
    eprintln!("signals handled {hits}; dropped {:?}", d.counters.dropped);
    assert!(target.finish().success());
}
