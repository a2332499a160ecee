//! The agent under the lifecycle events a long-running service goes
//! through: thread exit storms with allocating TLS destructors, allocation
//! before main and after it returns, fork and fork+exec, snapshot requests
//! by signal and API (and a program that handles the signal itself), a full
//! table, C++ new/delete, HEAPDUMP_DISABLE, and frees whose release to
//! glibc is held back.

use std::os::unix::process::CommandExt;
use std::process::Command;

use heapdump_tests::*;

fn preloaded(exe: &std::path::Path) -> Command {
    let mut c = Command::new(exe);
    c.env("LD_PRELOAD", preload_lib());
    c
}

#[test]
fn thread_exit_storm_keeps_exact_accounting() {
    let exe = compile_c("threads");
    let target = Target::spawn(preloaded(&exe));
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(&exe, pid);
    let t = by_site(&d, &syms, "site_");
    let get = |s: &str| t.get(s).map(|e| (e.0, e.1)).unwrap_or_default();
    assert_eq!(get("site_ctor"), (1, 4321), "allocation before main");
    assert_eq!(get("site_worker"), (200, 200 * 640), "{t:#?}");
    // Every TLS block (99 bytes) was freed by its destructor, which kept a
    // 48-byte block allocated during thread exit.
    assert_eq!(get("site_tls_dtor"), (200, 200 * 48), "{t:#?}");
    assert!(
        !t.values().any(|e| e.2.contains(&99)),
        "TLS blocks leaked: {t:#?}"
    );
    assert_eq!(d.counters.dropped_total(), 0, "{:?}", d.counters.dropped);
    let status = target.finish();
    assert!(status.success(), "atexit allocation crashed it: {status:?}");
}

#[test]
fn a_thread_with_a_small_stack_starts_and_is_recorded() {
    // The agent's thread-local storage comes out of every thread's stack;
    // when it was 31 KiB, node's 32 KiB thread failed with EINVAL.
    let exe = compile_c("small_stack");
    let mut cmd = preloaded(&exe);
    cmd.stdin(std::process::Stdio::null());
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        stdout.starts_with("ready"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let target = Target::spawn(preloaded(&exe));
    let pid = target.pid();
    let d = dump(pid);
    let syms = Symbols::of_process(&exe, pid);
    let t = by_site(&d, &syms, "site_");
    let got = t.get("site_small_stack").map(|e| (e.0, e.1));
    assert_eq!(got, Some((25, 25 * 200)), "{t:#?}");
    assert!(target.finish().success());
}

/// Runs a self-checking held-back-frees program (`tests/c/deferred.c`
/// or its Rust twin): it exits 0 and prints "all held" when every check
/// against glibc's accounting holds.
fn assert_all_held(mut cmd: Command) {
    let out = cmd.output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("all held"),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The preload library under another name (a distribution's package, a
/// host-wide `/etc/ld.so.preload` entry), beside the tests' programs.
fn renamed_preload_lib() -> std::path::PathBuf {
    let p = profile_dir().join("heapdump-agent-renamed.so");
    static COPIED: std::sync::Once = std::sync::Once::new();
    COPIED.call_once(|| {
        let tmp = p.with_extension(format!("{}.tmp", std::process::id()));
        std::fs::copy(preload_lib(), &tmp).unwrap();
        std::fs::rename(&tmp, &p).unwrap();
    });
    p
}

#[test]
fn a_preload_under_another_name_starts_at_load_and_holds_frees_back() {
    // Started at load: listed before its first allocation.
    let exe = compile_c("quiet_start");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", renamed_preload_lib());
    let target = Target::spawn(cmd);
    let d = dump(target.pid());
    assert_eq!(d.writer_pid, target.pid());
    assert!(target.finish().success());
    // Held-back frees are chosen at load, for glibc, as under the usual name.
    let mut cmd = Command::new(compile_c("deferred"));
    cmd.env("LD_PRELOAD", renamed_preload_lib());
    assert_all_held(cmd);
}

#[test]
fn a_library_listed_in_etc_ld_so_preload_starts_at_load() {
    // A host-wide install, tried in a mount namespace of the program's own
    // (an overlay over /etc holding an ld.so.preload that names the
    // renamed library), so nothing else on the machine sees it; no
    // LD_PRELOAD at all.
    let dir = std::env::temp_dir().join(format!("heapdump-ldsopreload-{}", std::process::id()));
    let (upper, work) = (dir.join("upper"), dir.join("work"));
    std::fs::create_dir_all(&upper).unwrap();
    std::fs::create_dir_all(&work).unwrap();
    let lib = renamed_preload_lib();
    std::fs::write(upper.join("ld.so.preload"), format!("{}\n", lib.display())).unwrap();
    let mount = format!(
        "mount -t overlay overlay -o lowerdir=/etc,upperdir={},workdir={} /etc",
        upper.display(),
        work.display()
    );
    let allowed = Command::new("unshare")
        .args([
            "-m",
            "sh",
            "-c",
            &format!("{mount} && grep -q heapdump /etc/ld.so.preload"),
        ])
        .env_remove("LD_PRELOAD")
        .status()
        .is_ok_and(|s| s.success());
    if !real_dependency(
        "an overlay over /etc in a mount namespace (unshare -m, as root)",
        allowed,
    ) {
        return;
    }
    let mut cmd = Command::new("unshare");
    cmd.args(["-m", "sh", "-c", &format!("{mount} && exec \"$0\"")])
        .arg(compile_c("quiet_start"))
        .env_remove("LD_PRELOAD");
    let target = Target::spawn(cmd);
    // Listed before its first allocation: the agent started at load.
    let d = dump(target.pid());
    assert_eq!(d.writer_pid, target.pid());
    assert!(target.finish().success());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn held_back_frees_reach_glibc_at_thread_exit_and_in_a_forked_child() {
    assert_all_held(preloaded(&compile_c("deferred")));
}

#[test]
fn rust_agent_held_back_deallocs_reach_glibc_at_thread_exit_and_in_a_forked_child() {
    assert_all_held(Command::new(env!("CARGO_BIN_EXE_rust_deferred")));
}

#[test]
fn fork_child_gets_own_regions_and_exec_inherits_none() {
    let exe = compile_c("forkexec");
    let mut target = Target::spawn_until(preloaded(&exe), "child-fds");
    let fds = target.last_line().to_string();
    assert!(
        !fds.contains("heapdump"),
        "exec'd image sees regions: {fds}"
    );
    let ready = target.wait_line("ready");
    let mut it = ready.split_whitespace().skip(1);
    let parent: u32 = it.next().unwrap().parse().unwrap();
    let child: u32 = it.next().unwrap().parse().unwrap();
    assert_eq!(parent, target.pid());

    let syms_p = Symbols::of_process(&exe, parent);
    let dp = dump(parent);
    assert_eq!(dp.writer_pid, parent);
    let tp = by_site(&dp, &syms_p, "site_");
    assert_eq!(tp.get("site_parent").map(|e| e.0), Some(40));
    assert_eq!(tp.get("site_parent_after").map(|e| e.0), Some(10));
    assert!(
        !tp.contains_key("site_child"),
        "child wrote into the parent's table"
    );

    let dc = dump(child);
    assert_eq!(dc.writer_pid, child, "child reads its parent's regions");
    let tc = by_site(&dc, &syms_p, "site_");
    assert_eq!(
        tc.get("site_child").map(|e| (e.0, e.1)),
        Some((25, 25 * 222))
    );
    assert!(!tc.contains_key("site_parent_after"));
    // Only one pair of regions is open in the child.
    let memfds = std::fs::read_dir(format!("/proc/{child}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains("heapdump"))
        .count();
    assert_eq!(memfds, 2);
    assert!(target.finish().success());
}

#[test]
fn rust_fork_while_threads_allocate() {
    let exe = env!("CARGO_BIN_EXE_rust_fork");
    let target = Target::spawn(Command::new(exe));
    let ready = target.last_line().to_string();
    let child: u32 = ready.split_whitespace().nth(2).unwrap().parse().unwrap();
    let syms = Symbols::of_process(exe.as_ref(), target.pid());
    let dp = dump(target.pid());
    let dc = dump(child);
    assert_eq!(dc.writer_pid, child);
    let tp = by_site(&dp, &syms, "rust_fork::");
    let tc = by_site(&dc, &syms, "rust_fork::");
    // 40 blocks of 111 bytes and the 40-element outer Vec (24-byte items).
    assert_eq!(
        tp.get("parent_site").map(|e| (e.0, e.1)),
        Some((41, 40 * 111 + 40 * 24))
    );
    assert!(!tp.contains_key("child_site"));
    assert_eq!(
        tc.get("child_site").map(|e| (e.0, e.1)),
        Some((26, 25 * 222 + 25 * 24))
    );
    assert!(
        !tc.contains_key("parent_site"),
        "inherited blocks reported in child"
    );
    assert!(target.finish().success());
}

#[test]
fn signal_and_api_requests_are_counted() {
    let exe = compile_c("signals");
    let mut target = Target::spawn(preloaded(&exe));
    let pid = target.pid();
    assert_eq!(dump(pid).request.count, 0);
    target.send("raise");
    target.wait_line("raised");
    let d = dump(pid);
    assert_eq!(d.request.count, 1);
    assert_eq!(d.request.name.as_deref(), Some(""));
    target.send("api nightly-check");
    target.wait_line("requested");
    let d = dump(pid);
    assert_eq!(d.request.count, 2);
    assert_eq!(d.request.name.as_deref(), Some("nightly-check"));
    // A signal from outside, as a user would send it.
    // SAFETY: sending a signal to our own child.
    assert_eq!(unsafe { libc::kill(pid as i32, libc::SIGUSR2) }, 0);
    target.send("api second");
    target.wait_line("requested");
    assert_eq!(dump(pid).request.count, 4);
    assert!(target.finish().success());
}

#[test]
fn program_handler_for_the_signal_is_left_alone() {
    let exe = compile_c("signals");
    let mut cmd = preloaded(&exe);
    cmd.arg("own").env("HEAPDUMP_SIGNAL", "SIGUSR1");
    let mut target = Target::spawn(cmd);
    target.send("raise");
    let line = target.wait_line("raised");
    assert_eq!(line, "raised 1", "the program's own handler must run");
    assert!(target.finish().success());
}

#[test]
fn inherited_ignore_disposition_is_not_replaced() {
    let exe = compile_c("signals");
    let mut cmd = preloaded(&exe);
    cmd.stderr(std::process::Stdio::piped());
    // SAFETY: only async-signal-safe calls between fork and exec.
    unsafe {
        cmd.pre_exec(|| {
            libc::signal(libc::SIGUSR2, libc::SIG_IGN);
            Ok(())
        });
    }
    let mut target = Target::spawn(cmd);
    let pid = target.pid();
    target.send("raise");
    target.wait_line("raised");
    assert_eq!(dump(pid).request.count, 0, "agent replaced SIG_IGN");
    let mut stderr = target.child.stderr.take().unwrap();
    assert!(target.finish().success(), "SIGUSR2 killed the program");
    let mut msg = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut msg).unwrap();
    assert_eq!(
        msg.matches("handles the snapshot signal itself").count(),
        1,
        "stderr: {msg}"
    );
}

#[test]
fn rust_api_request_has_its_name() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rust_pattern"));
    cmd.arg("request");
    let target = Target::spawn(cmd);
    let d = dump(target.pid());
    assert_eq!(d.request.count, 1);
    assert_eq!(d.request.name.as_deref(), Some("from-api"));
    assert!(target.finish().success());
}

#[test]
fn full_table_counts_dropped_and_program_runs_on() {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rust_pattern"));
    cmd.arg("full").env("HEAPDUMP_CAPACITY", "1000");
    let mut target = Target::spawn_until(cmd, "stats");
    let stats = target.last_line().to_string();
    target.wait_line("ready");
    let d = dump(target.pid());
    assert!(d.blocks.len() <= 1000);
    assert!(d.blocks.len() >= 900, "{} blocks", d.blocks.len());
    let full = d.counters.dropped[heapdump_table::DroppedReason::AllocationsFull as usize];
    assert!(full >= 4000, "dropped {:?}", d.counters.dropped);
    // The program printed its own view (heapdump_agent::stats) earlier;
    // printing allocates, so the header may have moved on since.
    let said: u64 = stats.rsplit("dropped=").next().unwrap().parse().unwrap();
    assert!(
        said >= 4000 && d.counters.dropped_total() >= said,
        "{stats}"
    );
    let live: u64 = d.blocks.iter().map(|b| b.size).sum();
    assert_eq!(d.counters.live_bytes, live);
    assert!(target.finish().success());
}

#[test]
fn cxx_new_traces_start_at_the_caller_of_new() {
    let exe = compile_c("cxx_pattern");
    let target = Target::spawn(preloaded(&exe));
    let pid = target.pid();
    // libstdc++'s new-handler ran once and std::bad_alloc reached the
    // program, through the agent's `operator new`.
    assert!(
        target.last_line().ends_with("handler=1 caught=1"),
        "{}",
        target.last_line()
    );
    let d = dump(pid);
    let syms = Symbols::of_process(&exe, pid);
    // The leaf frame itself must be the site (not libstdc++ or its caller).
    let mut leaf: std::collections::HashMap<String, (u64, u64)> = Default::default();
    for b in &d.blocks {
        if let Some(f) = b.frames.first().and_then(|f| syms.function_of(*f)) {
            if f.starts_with("site_") {
                let e = leaf
                    .entry(f.trim_end_matches("()").to_string())
                    .or_default();
                e.0 += 1;
                e.1 += b.size;
            }
        }
    }
    assert_eq!(leaf.get("site_new"), Some(&(40, 40 * 300)), "{leaf:?}");
    assert_eq!(leaf.get("site_new_object"), Some(&(30, 30 * 8)));
    assert_eq!(leaf.get("site_new_aligned"), Some(&(12, 12 * 128)));
    assert_eq!(leaf.get("site_nothrow"), Some(&(5, 5 * 70)));
    assert!(!leaf.contains_key("site_deleted"), "{leaf:?}");
    assert!(target.finish().success());
}

#[test]
fn a_normal_start_prints_nothing_and_finds_frame_pointers() {
    // The workspace builds the agent with frame pointers: no warning (the
    // agent says so on stderr when they are missing), and nothing else
    // either, from the preload library or the Rust Agent.
    for mut cmd in [
        preloaded(&compile_c("pattern")),
        Command::new(env!("CARGO_BIN_EXE_rust_pattern")),
    ] {
        let out = cmd.stdin(std::process::Stdio::null()).output().unwrap();
        assert!(out.status.success());
        assert_eq!(String::from_utf8_lossy(&out.stderr), "", "{cmd:?}");
    }
}

#[test]
fn disabled_agent_creates_no_regions() {
    let exe = compile_c("pattern");
    let mut cmd = preloaded(&exe);
    cmd.env("HEAPDUMP_DISABLE", "1");
    let target = Target::spawn(cmd);
    assert!(find_regions(target.pid()).is_none());
    assert!(target.finish().success());
}

#[test]
fn agent_allocator_steps_aside_under_the_preload_library() {
    let exe = env!("CARGO_BIN_EXE_rust_pattern");
    let mut cmd = Command::new(exe);
    cmd.arg("request")
        .env("LD_PRELOAD", preload_lib())
        .stderr(std::process::Stdio::piped());
    let mut target = Target::spawn(cmd);
    let pid = target.pid();
    let memfds = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .filter_map(|e| std::fs::read_link(e.ok()?.path()).ok())
        .filter(|l| l.to_string_lossy().contains("heapdump"))
        .count();
    assert_eq!(memfds, 2, "one pair of regions, not two");
    let d = dump(pid);
    // The API call of the (stepped-aside) Agent reached the preload agent.
    assert_eq!(d.request.count, 1);
    assert_eq!(d.request.name.as_deref(), Some("from-api"));
    assert!(d.counters.live_blocks > 0);
    let mut stderr = target.child.stderr.take().unwrap();
    assert!(target.finish().success());
    let mut msg = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut msg).unwrap();
    assert!(msg.contains("steps aside"), "stderr: {msg}");
}

#[test]
fn max_frames_limits_stacks_and_bad_settings_are_reported() {
    let exe = env!("CARGO_BIN_EXE_rust_pattern");
    let mut cmd = Command::new(exe);
    cmd.env("HEAPDUMP_MAX_FRAMES", "3");
    let target = Target::spawn(cmd);
    let d = dump(target.pid());
    assert!(!d.blocks.is_empty());
    assert!(d.blocks.iter().all(|b| b.frames.len() <= 3));
    assert!(d.blocks.iter().any(|b| b.frames.len() == 3));
    assert!(target.finish().success());

    let mut cmd = Command::new(exe);
    cmd.env("HEAPDUMP_MAX_FRAMES", "lots")
        .env("HEAPDUMP_SIGNAL", "SIGNOPE")
        .stderr(std::process::Stdio::piped());
    let mut target = Target::spawn(cmd);
    let d = dump(target.pid());
    // The default (64) applies: the pattern's stacks are deeper than 3.
    assert!(d.blocks.iter().any(|b| b.frames.len() > 3));
    let mut stderr = target.child.stderr.take().unwrap();
    assert!(target.finish().success());
    let mut msg = String::new();
    std::io::Read::read_to_string(&mut stderr, &mut msg).unwrap();
    assert!(msg.contains("HEAPDUMP_MAX_FRAMES"), "{msg}");
    assert!(msg.contains("HEAPDUMP_SIGNAL"), "{msg}");
}
