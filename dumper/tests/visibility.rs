//! What the agent cannot see is said, not shown as an empty heap: a
//! statically linked program started by `heapdump run` is warned about
//! before it starts; with an allocator preloaded before the agent, the
//! agent says so on stderr, and `heapdump list` and a snapshot say "no
//! allocation recorded" and why.

mod common;

use std::process::{Command, Stdio};

use heapdump_tests::{compile_c_variant, preload_lib, real_dependency, system_lib, Target};

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
