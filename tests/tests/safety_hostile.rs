//! Hostile targets (DESIGN.md §3 point 4, issue 5): processes that hold
//! heapdump regions made with the table's writers and then damage them
//! while being dumped, leave them unsealed, or claim another format
//! version. The dumper must answer each with a clean snapshot, a snapshot
//! marked partial (exit 2), or an error naming the problem (exit 1): never
//! a crash, a signal or a hang.

mod safety_common;

use std::process::Command;

use heapdump_tests::Target;
use safety_common::{built_bin, check_outcome, heapdump, run_guarded, scratch, snapshot_json};

fn hostile(args: &[&str]) -> Target {
    let mut cmd = Command::new(built_bin("hostile"));
    cmd.args(args);
    Target::spawn(cmd)
}

#[test]
fn scribbling_target_never_crashes_the_dumper() {
    let dir = scratch("hostile-scribble");
    let mut outcomes = [0u32; 3];
    // Two seeds, ten snapshots each, while the target keeps scribbling.
    for seed in ["7", "1234567"] {
        let t = hostile(&["scribble", seed]);
        for i in 0..10 {
            let out = dir.join(format!("s{seed}-{i}.json"));
            // Half the runs skip symbolization: that path ends sooner and
            // so reaches the tables while other damage is in place.
            let extra: &[&str] = if i % 2 == 0 { &[] } else { &["--no-symbolize"] };
            let run = snapshot_json(t.pid(), &out, extra);
            outcomes[check_outcome(&run, &out) as usize] += 1;
        }
        // `list` reads every instrumented process's header: it must cope.
        let list = run_guarded({
            let mut c = Command::new(heapdump());
            c.arg("list");
            c
        });
        assert_eq!(list.code(), 0, "{list:?}");
        // The target was never disturbed by being read.
        let mut t = t;
        assert!(t.child.try_wait().unwrap().is_none(), "target died");
        t.send("stop");
        assert!(t.finish().success());
    }
    eprintln!(
        "outcomes: ok {} / error {} / partial {}",
        outcomes[0], outcomes[1], outcomes[2]
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unsealed_region_is_refused_by_name() {
    let dir = scratch("hostile-unsealed");
    let t = hostile(&["unsealed"]);
    let out = dir.join("u.json");
    let run = snapshot_json(t.pid(), &out, &[]);
    assert_eq!(check_outcome(&run, &out), 1);
    assert!(run.stderr.contains("not sealed"), "{}", run.stderr);
    assert!(!out.exists());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn foreign_version_is_refused_naming_both_versions() {
    let dir = scratch("hostile-version");
    let t = hostile(&["version"]);
    let out = dir.join("v.json");
    let run = snapshot_json(t.pid(), &out, &[]);
    assert_eq!(check_outcome(&run, &out), 1);
    let major = heapdump_table::FORMAT_MAJOR;
    assert!(
        run.stderr.contains("version 7.") && run.stderr.contains(&format!("{major}.x")),
        "{}",
        run.stderr
    );
    let _ = std::fs::remove_dir_all(&dir);
}
