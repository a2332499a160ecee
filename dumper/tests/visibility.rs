//! What the agent cannot see is said, not shown as an empty heap: a
//! statically linked program started by `heapdump run` is warned about
//! before it starts; with an allocator preloaded before the agent, the
//! agent says so on stderr, and `heapdump list` and a snapshot say "no
//! allocation recorded" and why. A process in a pid namespace (a
//! container) is listed and dumped by its host pid.

mod common;

use std::process::{Command, Stdio};

use heapdump_tests::{
    compile_c, compile_c_variant, preload_lib, real_dependency, system_lib, Target,
};

#[test]
fn heapdump_run_warns_before_starting_a_static_program() {
    let exe = compile_c_variant("idle", "static", &["-static"]);
    let mut child = Command::new(common::bin())
        .arg("run")
        .arg("--")
        .arg(&exe)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The program waits for a line: end its stdin so it exits.
    drop(child.stdin.take());
    let out = child.wait_with_output().unwrap();
    assert!(out.status.success(), "{out:?}");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("heapdump: warning: the program is statically linked"),
        "{err}"
    );
    assert!(String::from_utf8_lossy(&out.stdout).starts_with("ready"));
}

#[test]
fn an_allocator_preloaded_before_the_agent_is_named_by_the_agent_list_and_snapshot() {
    let Some(mimalloc) = system_lib("libmimalloc.so.2").or_else(|| system_lib("libmimalloc.so"))
    else {
        real_dependency("mimalloc (libmimalloc-dev)", false);
        return;
    };
    let exe = compile_c_variant("idle", "dynamic", &[]);
    let mut cmd = Command::new(&exe);
    cmd.env(
        "LD_PRELOAD",
        format!("{}:{}", mimalloc.display(), preload_lib().display()),
    )
    .stderr(Stdio::piped());
    let mut target = Target::spawn(cmd);
    let pid = target.pid().to_string();

    let list = common::heapdump(&["list"]);
    let list = common::stdout(&list);
    let ours: Vec<&str> = list
        .lines()
        .filter(|l| l.trim_start().starts_with(&format!("{pid}:")))
        .collect();
    assert!(
        ours.iter().any(|l| l.contains("no allocation recorded")),
        "{list}"
    );
    assert!(
        ours.iter()
            .any(|l| l.contains("libmimalloc") && l.contains("comes before libheapdump_preload.so")),
        "{list}"
    );

    let snap = common::heapdump(&["snapshot", &pid]);
    assert!(snap.status.success(), "{snap:?}");
    let text = common::stdout(&snap);
    assert!(text.contains("note: no allocation recorded"), "{text}");
    assert!(
        text.contains("comes before libheapdump_preload.so"),
        "{text}"
    );

    let mut agent_stderr = target.child.stderr.take().unwrap();
    target.send("done");
    assert!(target.finish().success());
    let mut err = String::new();
    std::io::Read::read_to_string(&mut agent_stderr, &mut err).unwrap();
    assert!(
        err.contains("this process's malloc comes from") && err.contains("libmimalloc"),
        "agent's stderr: {err}"
    );
}

#[test]
fn processes_in_a_pid_namespace_are_listed_and_dumped_by_their_host_pid() {
    // The agent writes the pid its process has in its own pid namespace (a
    // container's 1, 2, ...); on the host the process has another. Before,
    // `list` and `snapshot` took such regions for inherited ones and
    // refused the process. tests/c/raw_fork.c under `unshare --pid --fork`:
    // its raw-forked child (which also makes its own regions, see
    // agent/src/fork_guard.rs), then the program, each by its host pid.
    let exe = compile_c("raw_fork");
    let unshare = std::path::Path::new("/usr/bin/unshare");
    if !real_dependency("unshare (util-linux)", unshare.exists()) {
        return;
    }
    // A pid namespace needs root here (CI runs as root).
    let allowed = Command::new(unshare)
        .args(["--pid", "--fork", "--kill-child", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !real_dependency("a pid namespace (unshare --pid, as root)", allowed) {
        return;
    }
    let mut cmd = Command::new(unshare);
    cmd.args(["--pid", "--fork", "--kill-child"])
        .arg(&exe)
        .env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn_until(cmd, "child");
    let inner = target.line_pid().expect("child pid");
    let program = child_of(target.pid()).expect("the program under unshare");
    let child = child_of(program).expect("the program's raw-forked child");
    assert_ne!(child, inner, "not in a pid namespace");

    let list = common::heapdump(&["list"]);
    let list = common::stdout(&list);
    for pid in [program, child] {
        let row = list
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
            .unwrap_or_else(|| panic!("{pid} not listed:\n{list}"));
        assert!(row.contains("exact"), "{row}");
    }

    let dir = common::TempDir::new("pidns");
    let site = |pid: u32, name: &str| {
        let out = dir.path(name);
        let o = common::heapdump(&[
            "snapshot",
            &pid.to_string(),
            "--format",
            "json",
            "-o",
            out.to_str().unwrap(),
        ]);
        assert!(o.status.success(), "{}", common::stderr(&o));
        common::live_by_leaf(&common::read_json(&out))
    };
    let t = site(child, "child.json");
    assert_eq!(t.get("site_child"), Some(&(5_000, 5_000 * 24)), "{t:?}");
    assert!(!t.contains_key("site_parent"), "{t:?}");
    target.send("go");
    target.wait_line("ready");
    let t = site(program, "program.json");
    assert_eq!(t.get("site_parent"), Some(&(3_000, 3_000 * 40)), "{t:?}");
    assert!(!t.contains_key("site_child"), "{t:?}");
    target.send("go");
    target.wait_line("done");
    assert!(target.finish().success());
}

/// The child of process `pid` (by the parent field of each
/// `/proc/N/stat`).
fn child_of(pid: u32) -> Option<u32> {
    std::fs::read_dir("/proc")
        .ok()?
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .find(|n| {
            std::fs::read_to_string(format!("/proc/{n}/stat"))
                .ok()
                .and_then(|s| {
                    s[s.rfind(')')? + 1..]
                        .split_whitespace()
                        .nth(1)?
                        .parse()
                        .ok()
                })
                == Some(pid)
        })
}
