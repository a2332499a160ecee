//! `heapdump attach` / `detach` on processes started without the agent
//! (`tests/c/attach_target.c`: four threads in malloc/free loops, one in
//! nanosleep, one in read, the main thread in epoll_wait, 1000 blocks
//! from before the attach): what follows the attach is recorded exactly,
//! what came before never is, detach stops it, no thread sees an EINTR,
//! and every refusal leaves the process as it was.

mod common;

use std::process::Command;

use common::*;
use heapdump_tests::{compile_c, compile_c_variant, preload_lib, real_dependency, Target};
use serde_json::Value;

fn start() -> Target {
    let mut cmd = Command::new(compile_c("attach_target"));
    cmd.env_remove("LD_PRELOAD");
    Target::spawn(cmd)
}

fn attach(pid: u32, extra: &[&str]) -> std::process::Output {
    let lib = preload_lib();
    let pid = pid.to_string();
    let mut args = vec!["attach", pid.as_str(), "--library", lib.to_str().unwrap()];
    args.extend_from_slice(extra);
    heapdump(&args)
}

fn attach_ok(pid: u32, extra: &[&str]) {
    let out = attach(pid, extra);
    assert!(out.status.success(), "attach failed: {}", stderr(&out));
    assert!(stdout(&out).contains("attached to"), "{}", stdout(&out));
}

fn detach_ok(pid: u32) {
    let out = heapdump(&["detach", &pid.to_string()]);
    assert!(out.status.success(), "detach failed: {}", stderr(&out));
}

fn snapshot_json(pid: u32, dir: &TempDir, name: &str) -> Value {
    let file = dir.str(&format!("{name}.json"));
    let out = heapdump(&["snapshot", &pid.to_string(), "-o", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(&dir.path(&format!("{name}.json")));
    assert!(j["partial"].is_null(), "{}", j["partial"]);
    j
}

/// The allocator's own figure, once the housekeeping thread stored it
/// (within a second of the attach): a bounded loop of snapshots, where no
/// sleep decides the outcome (the loop only ends sooner).
fn allocator_heap(pid: u32, dir: &TempDir) -> serde_json::Map<String, Value> {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    loop {
        let j = snapshot_json(pid, dir, "heap");
        if let Some(h) = j["recording"]["allocator_heap"].as_object() {
            return h.clone();
        }
        assert!(std::time::Instant::now() < deadline, "no allocator figure");
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
}

/// Ends the target and checks that no thread saw an EINTR.
fn quit_without_eintr(mut t: Target) {
    t.send("quit");
    let line = t.wait_line("eintr ");
    assert_eq!(line, "eintr 0", "a thread saw EINTR across attach/detach");
    assert!(t.finish().success());
}

#[test]
fn an_attached_process_records_its_later_sites_exactly_and_never_its_earlier_blocks() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-exact");
    let j = snapshot_json(pid, &dir, "s");
    let sites = live_by_leaf(&j);
    assert_eq!(
        sites.get("site_after_malloc"),
        Some(&(50, 50_000)),
        "{sites:#?}"
    );
    // The realloc of a block from before the attach records the new block
    // at the realloc's stack.
    assert_eq!(
        sites.get("site_realloc_pre"),
        Some(&(1, 5000)),
        "{sites:#?}"
    );
    // The 1000 blocks from before (999 of them freed since, unseen) are
    // never counted.
    assert_eq!(sites.get("pre_attach"), None, "{sites:#?}");
    assert!(j["totals"]["live_blocks"].as_u64().unwrap() < 1000);
    let rec = &j["recording"];
    assert!(rec["attached_at"].is_string(), "{rec}");
    assert!(rec["detached_at"].is_null(), "{rec}");
    // `list` marks it as attached.
    let list = stdout(&heapdump(&["list"]));
    let row = list
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("{pid} not listed: {list}"));
    assert!(row.contains("exact+"), "{row}");
    // The text report says since when.
    let text = stdout(&heapdump(&["snapshot", &pid.to_string()]));
    assert!(
        text.contains("recording since heapdump attach at"),
        "{text}"
    );
    quit_without_eintr(t);
}

#[test]
fn the_allocators_own_figure_for_the_whole_heap_is_shown_beside_the_recorded_part() {
    let t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    let dir = TempDir::new("attach-heap");
    let heap = allocator_heap(pid, &dir);
    assert_eq!(heap["source"], "glibc's mallinfo2");
    // The whole heap: the 1000 blocks from before the attach (599 500
    // bytes, never recorded; "alloc" would free them) are in it; and when
    // it was read is said.
    assert!(heap["bytes"].as_u64().unwrap() >= 599_500, "{heap:?}");
    assert!(heap["read_at"].is_string(), "{heap:?}");
    quit_without_eintr(t);
}

#[test]
fn tcmallocs_own_figure_for_the_whole_heap_is_shown() {
    if !real_dependency(
        "tcmalloc (libgoogle-perftools-dev)",
        heapdump_tests::has_header("/usr/include/gperftools/malloc_extension_c.h"),
    ) {
        return;
    }
    let mut cmd = Command::new(compile_c_variant(
        "attach_target",
        "tcmalloc",
        &["-ltcmalloc"],
    ));
    cmd.env_remove("LD_PRELOAD");
    let t = Target::spawn(cmd);
    let pid = t.pid();
    attach_ok(pid, &[]);
    let dir = TempDir::new("attach-heap-tc");
    let heap = allocator_heap(pid, &dir);
    assert_eq!(heap["source"], "tcmalloc's current_allocated_bytes");
    assert!(heap["bytes"].as_u64().unwrap() >= 599_500, "{heap:?}");
    detach_ok(pid);
    quit_without_eintr(t);
}

#[test]
fn detach_stops_recording_and_a_later_attach_records_again() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    detach_ok(pid);
    t.send("more");
    t.wait_line("more done");
    let dir = TempDir::new("attach-detach");
    let j = snapshot_json(pid, &dir, "detached");
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("site_more"), None, "recorded while detached");
    assert_eq!(sites.get("site_after_malloc"), Some(&(50, 50_000)));
    assert!(
        j["recording"]["detached_at"].is_string(),
        "{}",
        j["recording"]
    );
    let list = stdout(&heapdump(&["list"]));
    assert!(list.contains("exact-"), "{list}");
    // Detaching twice says so.
    let again = heapdump(&["detach", &pid.to_string()]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("detached already"),
        "{}",
        stderr(&again)
    );
    // Attaching again with other settings is refused: the mode is fixed.
    let other = attach(pid, &["--sample-rate", "64KiB"]);
    assert!(!other.status.success());
    assert!(
        stderr(&other).contains("other settings"),
        "{}",
        stderr(&other)
    );
    // With the same settings it records again, from a clean table, made
    // clean by the agent's own thread (not the thread the injector held),
    // and `attach` returns once it is.
    let out = attach(pid, &[]);
    assert!(out.status.success(), "re-attach failed: {}", stderr(&out));
    assert!(
        stdout(&out).contains("the agent's own thread forgot the previous attach's records"),
        "{}",
        stdout(&out)
    );
    let list = stdout(&heapdump(&["list"]));
    assert!(list.contains("exact+"), "{list}");
    t.send("more");
    t.wait_line("more done");
    let j = snapshot_json(pid, &dir, "again");
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("site_more"), Some(&(40, 80_000)), "{sites:#?}");
    // The records of the first attach are forgotten (their frees while
    // detached were not seen); the site stays with its cumulative counts.
    assert_eq!(
        sites.get("site_after_malloc").map_or(0, |c| c.0),
        0,
        "stale records kept"
    );
    quit_without_eintr(t);
}

#[test]
fn twenty_attach_and_detach_cycles_leave_the_busy_process_unharmed() {
    let mut t = start();
    let pid = t.pid();
    for _ in 0..20 {
        // The agent's own SIGUSR2 handler, left from the first attach, is
        // never taken for the program's.
        let out = attach(pid, &[]);
        assert!(out.status.success(), "{}", stderr(&out));
        assert!(
            !stderr(&out).contains("handles SIGUSR2"),
            "{}",
            stderr(&out)
        );
        detach_ok(pid);
    }
    t.send("alloc");
    t.wait_line("allocated");
    quit_without_eintr(t);
}

#[test]
fn attach_for_a_while_detaches_by_itself() {
    let t = start();
    let pid = t.pid();
    let out = attach(pid, &["--for", "1s"]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(stdout(&out).contains("detached from"), "{}", stdout(&out));
    let dir = TempDir::new("attach-for");
    let j = snapshot_json(pid, &dir, "s");
    assert!(j["recording"]["detached_at"].is_string());
    quit_without_eintr(t);
}

#[test]
fn sampled_attach_records_with_its_rate() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &["--sample-rate", "64KiB"]);
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-sampled");
    let j = snapshot_json(pid, &dir, "s");
    assert_eq!(j["sampling"]["rate_bytes"], 65536, "{}", j["sampling"]);
    let list = stdout(&heapdump(&["list"]));
    assert!(list.contains("~1/64.0KiB+"), "{list}");
    quit_without_eintr(t);
}

#[test]
fn attaching_twice_is_refused_and_changes_nothing() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    let again = attach(pid, &[]);
    assert!(!again.status.success());
    assert!(
        stderr(&again).contains("attached to process"),
        "{}",
        stderr(&again)
    );
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-twice");
    let sites = live_by_leaf(&snapshot_json(pid, &dir, "s"));
    assert_eq!(sites.get("site_after_malloc"), Some(&(50, 50_000)));
    quit_without_eintr(t);
}

#[test]
fn a_process_started_under_the_agent_is_not_attached_again() {
    // Under the library's usual name, and under another (a distribution's
    // package): the agent says which it is, so the second is not taken
    // for the Rust agent.
    let dir = TempDir::new("attach-renamed");
    let renamed = dir.path("agent-renamed.so");
    std::fs::copy(preload_lib(), &renamed).unwrap();
    for lib in [preload_lib(), renamed] {
        let mut cmd = Command::new(compile_c("attach_target"));
        cmd.env("LD_PRELOAD", &lib);
        let t = Target::spawn(cmd);
        let out = attach(t.pid(), &[]);
        assert!(!out.status.success());
        assert!(
            stderr(&out).contains("started under the agent"),
            "{}: {}",
            lib.display(),
            stderr(&out)
        );
        quit_without_eintr(t);
    }
}

#[test]
fn a_static_program_is_refused_before_anything_is_injected() {
    let exe = compile_c_variant("attach_target", "static", &["-static"]);
    let t = Target::spawn(Command::new(exe));
    let out = attach(t.pid(), &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("statically linked"),
        "{}",
        stderr(&out)
    );
    quit_without_eintr(t);
}

#[test]
fn a_program_without_dlopen_is_refused_before_anything_is_injected() {
    // Dynamically linked (an interpreter), but no library at all.
    let exe = compile_c_variant(
        "nolibc",
        "nolibc",
        &[
            "-nostdlib",
            "-fno-stack-protector",
            "-fPIE",
            "-pie",
            "-Wl,--as-needed",
            "-Wl,-I/lib64/ld-linux-x86-64.so.2",
        ],
    );
    let mut t = Target::spawn(Command::new(exe));
    let pid = t.last_line()["ready ".len()..].trim().to_string();
    let out = heapdump(&["attach", &pid]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("maps no dlopen"), "{}", stderr(&out));
    // Untouched: it was never stopped, and answers.
    t.send("");
    t.wait_line("bye");
    assert!(t.finish().success());
}

#[test]
fn a_user_who_may_not_debug_the_process_is_told_why_and_nothing_changes() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !real_dependency(
        "root and setpriv (another user's heapdump)",
        root && std::path::Path::new("/usr/bin/setpriv").exists(),
    ) {
        return;
    }
    let t = start();
    let out = Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin())
        .args(["attach", &t.pid().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("may not look into process") && e.contains("belongs to uid 0"),
        "{e}"
    );
    let maps = std::fs::read_to_string(format!("/proc/{}/maps", t.pid())).unwrap();
    assert!(!maps.contains("libheapdump_preload"), "{maps}");
    // Attached by root, a detach by that user is refused for the same
    // reason (not "not attached").
    attach_ok(t.pid(), &[]);
    let out = Command::new("/usr/bin/setpriv")
        .args(["--reuid=65534", "--regid=65534", "--clear-groups", "--"])
        .arg(bin())
        .args(["detach", &t.pid().to_string()])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("may not look into process"),
        "{}",
        stderr(&out)
    );
    detach_ok(t.pid());
    quit_without_eintr(t);
}

#[test]
fn heapdump_does_not_attach_to_itself() {
    // `exec` keeps the shell's pid: heapdump is asked to attach to itself.
    let out = Command::new("sh")
        .arg("-c")
        .arg(format!("exec {} attach $$", bin()))
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("is heapdump itself"),
        "{}",
        stderr(&out)
    );
}

#[test]
fn a_thread_on_a_tiny_stack_is_never_used_and_the_attach_gives_up_changing_nothing() {
    // The only thread lives on a 16 KiB alternate signal stack: every
    // round refuses it, and after its 40 rounds attach gives up.
    let mut t = Target::spawn(Command::new(compile_c("altstack")));
    let pid = t.pid();
    let out = attach(pid, &[]);
    assert!(!out.status.success());
    let e = stderr(&out);
    assert!(
        e.contains("tried 40 times") && e.contains("of stack left below its stack pointer"),
        "{e}"
    );
    assert!(e.contains("nothing was changed"), "{e}");
    // Nothing was loaded, and the thread goes on.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(!maps.contains("libheapdump_preload"), "{maps}");
    t.send("ping");
    t.wait_line("pong");
    t.send("quit");
    assert!(t.finish().success());
}

#[test]
fn a_traced_process_is_refused_with_its_tracer_named() {
    let t = start();
    let pid = nix::unistd::Pid::from_raw(t.pid() as i32);
    // This test thread becomes the main thread's tracer (seize: the
    // process is not stopped).
    nix::sys::ptrace::seize(pid, nix::sys::ptrace::Options::empty()).expect("seize");
    let out = attach(t.pid(), &[]);
    let _ = nix::sys::ptrace::detach(pid, None);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("being traced by pid"),
        "{}",
        stderr(&out)
    );
    quit_without_eintr(t);
}

#[test]
fn a_process_that_is_gone_is_refused() {
    let mut child = Command::new("true").spawn().unwrap();
    let pid = child.id();
    child.wait().unwrap();
    let out = attach(pid, &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains(&pid.to_string()), "{}", stderr(&out));
}

#[test]
fn a_library_the_loader_refuses_is_reported_and_the_process_runs_on() {
    let t = start();
    let dir = TempDir::new("attach-badlib");
    let bad = dir.path("libheapdump_preload.so");
    std::fs::write(&bad, vec![b'x'; 8192]).unwrap();
    let out = heapdump(&[
        "attach",
        &t.pid().to_string(),
        "--library",
        bad.to_str().unwrap(),
    ]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("could not load the agent library"), "{err}");
    // dlerror's own words.
    assert!(err.contains("ELF"), "{err}");
    assert!(err.contains("left as it was"), "{err}");
    quit_without_eintr(t);
}

#[test]
fn a_child_forked_by_an_attached_process_is_recorded_from_its_birth() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("fork");
    let line = t.wait_line("child ");
    let child: u32 = line["child ".len()..].parse().unwrap();
    let dir = TempDir::new("attach-fork");
    let j = snapshot_json(child, &dir, "child");
    assert!(j["recording"]["attached_at"].is_string());
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("site_more"), Some(&(40, 80_000)), "{sites:#?}");
    // The parent's records are not the child's.
    let parent = live_by_leaf(&snapshot_json(pid, &dir, "parent"));
    assert_eq!(parent.get("site_more"), None, "{parent:#?}");
    quit_without_eintr(t);
}

#[test]
fn a_snapshot_request_of_an_attached_process_is_answered_by_watch() {
    let mut t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-watch");
    let mut watch = Command::new(bin())
        .args([
            "watch",
            &pid.to_string(),
            "-d",
            &dir.str("out"),
            "--format",
            "json",
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Lines::new(watch.stdout.take().unwrap());
    // watch says when it watches; then the signal asks for a snapshot.
    let first = lines.next();
    assert!(first.contains("watching"), "{first}");
    // SAFETY: kill(2) on the target this test started.
    unsafe { libc::kill(pid as i32, libc::SIGUSR2) };
    let wrote = lines.next();
    assert!(wrote.contains("wrote"), "{wrote}");
    let path = wrote
        .split_whitespace()
        .find(|w| w.ends_with(".json"))
        .unwrap_or_else(|| panic!("{wrote}"));
    let j = read_json(std::path::Path::new(path));
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("site_after_malloc"), Some(&(50, 50_000)));
    let _ = watch.kill();
    let _ = watch.wait();
    // The snapshot signal itself interrupts epoll_wait (as it would under
    // LD_PRELOAD), so EINTR is not checked here.
    t.send("quit");
    t.wait_line("eintr ");
    assert!(t.finish().success());
}

#[test]
fn debian_python3_attached_while_running_records_what_it_allocates_next() {
    if !real_dependency("python3", std::path::Path::new("/usr/bin/python3").exists()) {
        return;
    }
    let script = "import sys, threading\n\
         def spin():\n\
         \x20   while True:\n\
         \x20       x = [bytearray(100) for _ in range(100)]\n\
         threading.Thread(target=spin, daemon=True).start()\n\
         print('ready', flush=True)\n\
         for line in sys.stdin:\n\
         \x20   if line.strip() == 'alloc':\n\
         \x20       keep = [bytearray(100000) for _ in range(200)]\n\
         \x20       print('allocated', flush=True)\n\
         \x20   if line.strip() == 'quit':\n\
         \x20       break\n";
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.args(["-c", script]).env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-python3");
    let j = snapshot_json(pid, &dir, "s");
    let arrays: u64 = live_blocks_through(&j, "PyByteArray_Resize");
    assert!(
        arrays >= 200,
        "the 200 bytearrays made after the attach: {arrays}"
    );
    detach_ok(pid);
    t.send("quit");
    assert!(t.finish().success(), "python3 did not exit cleanly");
}

#[test]
fn jemallocs_own_calls_are_recorded_under_the_agents_names_when_attached() {
    if !real_dependency(
        "libjemalloc-dev",
        heapdump_tests::has_header("jemalloc/jemalloc.h"),
    ) {
        return;
    }
    let exe = compile_c_variant(
        "attach_target",
        "jemalloc",
        &["-DWITH_JEMALLOC", "-ljemalloc"],
    );
    let mut t = Target::spawn(Command::new(exe));
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    // mallocx'd blocks recorded; malloc'd blocks freed by sdallocx gone.
    t.send("jx");
    t.wait_line("jx done");
    let dir = TempDir::new("attach-jemalloc");
    let j = snapshot_json(pid, &dir, "s");
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("site_mallocx"), Some(&(10, 30_000)), "{sites:#?}");
    assert_eq!(
        sites.get("site_after_malloc").map_or(0, |c| c.0),
        0,
        "{sites:#?}"
    );
    let heap = allocator_heap(pid, &dir);
    assert_eq!(heap["source"], "jemalloc's stats.allocated");
    quit_without_eintr(t);
}

#[test]
fn a_single_threaded_daemon_asleep_in_poll_is_attached_and_its_poll_goes_on() {
    // Its one thread's poll resumes through the restart block: the
    // injector takes it when no other thread comes, and makes the poll
    // again from the start; the program never sees EINTR.
    let mut t = Target::spawn(Command::new(compile_c("poll_single")));
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    let dir = TempDir::new("attach-poll");
    let sites = live_by_leaf(&snapshot_json(pid, &dir, "s"));
    assert_eq!(sites.get("site_poll"), Some(&(10, 7770)), "{sites:#?}");
    detach_ok(pid);
    t.send("quit");
    assert_eq!(t.wait_line("eintr "), "eintr 0");
    assert!(t.finish().success());
}

#[test]
fn the_agent_says_nothing_in_the_attached_process_output() {
    // A process that handles SIGUSR2 itself (as postgres does): under
    // LD_PRELOAD the agent says on stderr that it leaves the signal alone;
    // attached, the process's stderr is its log, so the dumper says it.
    let mut cmd = Command::new(compile_c("poll_single"));
    cmd.arg("usr2").stderr(std::process::Stdio::piped());
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    let out = attach(pid, &[]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("handles SIGUSR2 itself"),
        "{}",
        stderr(&out)
    );
    t.send("quit");
    t.wait_line("eintr ");
    let mut err = String::new();
    use std::io::Read;
    t.child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(t.finish().success());
    assert!(
        !err.contains("heapdump"),
        "the agent wrote into the process's stderr: {err}"
    );
}

#[test]
fn a_process_in_another_mount_namespace_gets_a_copy_of_the_library_inside_it() {
    // The library's directory is hidden inside the target's mount
    // namespace by a tmpfs: attach must place a copy where the target can
    // open it, and say where.
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !real_dependency(
        "unshare (util-linux), root",
        root && std::path::Path::new("/usr/bin/unshare").exists(),
    ) {
        return;
    }
    let dir = TempDir::new("attach-mntns");
    let hidden = dir.path("lib");
    std::fs::create_dir_all(&hidden).unwrap();
    let lib = hidden.join("libheapdump_preload.so");
    std::fs::copy(preload_lib(), &lib).unwrap();
    let exe = compile_c("poll_single");
    let mut cmd = Command::new("/usr/bin/unshare");
    cmd.args(["-m", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs none {} && exec {}",
            hidden.display(),
            exe.display()
        ));
    let mut t = Target::spawn(cmd);
    // The pid the target printed (sh exec'd it: the same process).
    let pid: u32 = t.last_line()["ready ".len()..].parse().unwrap();
    assert!(
        !std::path::Path::new(&format!("/proc/{pid}/root{}", lib.display())).exists(),
        "the tmpfs does not hide the library"
    );
    let out = heapdump(&[
        "attach",
        &pid.to_string(),
        "--library",
        lib.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(
        stderr(&out).contains("copied to /tmp/heapdump-agent-"),
        "{}",
        stderr(&out)
    );
    t.send("alloc");
    t.wait_line("allocated");
    let sites = live_by_leaf(&snapshot_json(pid, &dir, "s"));
    assert_eq!(sites.get("site_poll"), Some(&(10, 7770)), "{sites:#?}");
    detach_ok(pid);
    t.send("quit");
    assert_eq!(t.wait_line("eintr "), "eintr 0");
}

#[test]
fn a_library_dlopened_after_the_attach_is_recorded_once_the_agent_has_seen_it() {
    // The attached agent redirects the slots of libraries loaded later from
    // its housekeeping thread, about once a second: the plugin's blocks are
    // recorded from then on. A bounded loop of (allocate, snapshot) waits
    // for it; no sleep decides the outcome.
    let dir = TempDir::new("attach-plugin");
    let plugin = dir.path("libattach_plugin.so");
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/attach_plugin.c");
    let status = Command::new("cc")
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-shared",
            "-fPIC",
            "-o",
        ])
        .arg(&plugin)
        .arg(&src)
        .status()
        .unwrap();
    assert!(status.success());
    let mut cmd = Command::new(compile_c("attach_target"));
    cmd.env("ATTACH_PLUGIN", &plugin);
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    attach_ok(pid, &[]);
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let mut rounds = 0u64;
    let seen = loop {
        t.send("plugin");
        assert_eq!(t.wait_line("plugin "), "plugin done");
        rounds += 1;
        let sites = live_by_leaf(&snapshot_json(pid, &dir, "s"));
        if let Some(&(blocks, bytes)) = sites.get("site_plugin") {
            break (blocks, bytes);
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the plugin's blocks were never recorded ({rounds} rounds)"
        );
        std::thread::sleep(std::time::Duration::from_millis(200));
    };
    // Whole rounds of 20 blocks of 1234 bytes, recorded from the round the
    // slots were redirected on.
    assert!(
        seen.0 > 0 && seen.0 % 20 == 0 && seen.0 <= 20 * rounds,
        "{seen:?}"
    );
    assert_eq!(seen.1, seen.0 * 1234);
    quit_without_eintr(t);
}

/// Whether process `pid` blocks signal `sig` (`SigBlk` of its status).
fn blocks(pid: u32, sig: i32) -> bool {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("SigBlk:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|m| m & (1u64 << (sig - 1)) != 0)
}

/// The signals a thread of `pid` named `name` blocks (`SigBlk` of its
/// status), if there is one.
fn thread_blocked_signals(pid: u32, name: &str) -> Option<u64> {
    let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).ok()?;
    tasks.flatten().find_map(|task| {
        let comm = std::fs::read_to_string(task.path().join("comm")).ok()?;
        if comm.trim_end() != name {
            return None;
        }
        let status = std::fs::read_to_string(task.path().join("status")).ok()?;
        status
            .lines()
            .find_map(|l| l.strip_prefix("SigBlk:"))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
    })
}

#[test]
fn the_agents_thread_in_an_attached_process_blocks_every_signal() {
    // A signal sent to the process that its own threads block must wait
    // for them: were the agent's thread to take it, the program's handler
    // would run on it, beside the program (postgres's postmaster then
    // forked a backend while its SIGCHLD handler held the locale lock on
    // our thread: the backend hung in setlocale).
    let t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    let mask = thread_blocked_signals(pid, "heapdump-attach")
        .expect("the attached agent's thread, named heapdump-attach");
    // Every signal but SIGKILL and SIGSTOP (which cannot be blocked) and
    // glibc's two internal ones (32, 33: pthread_sigmask leaves them).
    for sig in 1..=64 {
        if [libc::SIGKILL, libc::SIGSTOP, 32, 33].contains(&sig) {
            continue;
        }
        assert!(
            mask & (1u64 << (sig - 1)) != 0,
            "signal {sig} is not blocked in the agent's thread (SigBlk {mask:016x})"
        );
    }
    // The program's own threads keep their masks (the borrowed thread got
    // its own back): attach_target blocks nothing.
    assert!(!blocks(pid, libc::SIGUSR1) && !blocks(pid, libc::SIGCHLD));
    quit_without_eintr(t);
}

/// `tests/c/seccomp_target.c` under a filter that meets memfd_create
/// with `mode` ("kill" or "eperm").
fn start_seccomp(mode: &str) -> Target {
    let mut cmd = Command::new(compile_c("seccomp_target"));
    cmd.arg(mode).env_remove("LD_PRELOAD");
    Target::spawn(cmd)
}

#[test]
fn a_process_under_a_seccomp_filter_is_refused_before_anything_is_injected() {
    // A filter that kills on memfd_create (the agent's first call for its
    // regions): injecting would end the service.
    let mut t = start_seccomp("kill");
    let pid = t.pid();
    let out = attach(pid, &[]);
    assert!(!out.status.success());
    let err = stderr(&out);
    assert!(err.contains("seccomp filter"), "{err}");
    assert!(err.contains("--despite-seccomp"), "{err}");
    // Nothing was loaded and the process runs on.
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        !maps.contains("libheapdump_preload"),
        "the library was loaded"
    );
    t.send("alive");
    t.wait_line("alive");
    t.send("quit");
    assert!(t.finish().success());
}

#[test]
fn despite_seccomp_a_filter_that_denies_the_agents_calls_fails_the_attach_and_the_process_runs_on()
{
    let mut t = start_seccomp("eperm");
    let pid = t.pid();
    let out = attach(pid, &["--despite-seccomp"]);
    assert!(!out.status.success(), "{}", stdout(&out));
    assert!(stderr(&out).contains("could not start"), "{}", stderr(&out));
    t.send("alive");
    t.wait_line("alive");
    t.send("quit");
    assert!(t.finish().success());
}

#[test]
fn attach_for_detaches_after_its_output_closed_and_on_sigterm_or_sighup() {
    // `heapdump attach PID --for 1h | head -1`: the reader goes away, and
    // the user (or a service manager) ends heapdump with SIGTERM or
    // SIGHUP. Whatever it was printing, it must detach: the target ends
    // bare, not recording.
    for sig in [libc::SIGTERM, libc::SIGHUP] {
        let mut t = start();
        let pid = t.pid();
        let lib = preload_lib();
        let mut h = Command::new(bin())
            .args(["attach", &pid.to_string(), "--for", "1h", "--library"])
            .arg(&lib)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        // Nobody reads its output: every line it prints hits a closed pipe.
        drop(h.stdout.take());
        // Once it holds the ending signals (it does so first of all), the
        // signal waits until the attach is done and then ends the wait.
        let guard = std::time::Instant::now();
        while !blocks(h.id(), sig) {
            assert!(guard.elapsed() < HANG_GUARD, "heapdump never blocked {sig}");
            std::thread::yield_now();
        }
        // SAFETY: kill takes a pid and a signal.
        unsafe { libc::kill(h.id() as i32, sig) };
        let out = h.wait_with_output().unwrap();
        assert!(out.status.success(), "signal {sig}: {}", stderr(&out));
        assert!(!stderr(&out).contains("panicked"), "{}", stderr(&out));
        let again = heapdump(&["detach", &pid.to_string()]);
        assert!(
            stderr(&again).contains("detached already"),
            "signal {sig}: the target was left recording: {}",
            stderr(&again)
        );
        t.send("quit");
    }
}

#[test]
fn commands_that_print_end_quietly_when_their_reader_goes_away() {
    let mut t = start();
    attach_ok(t.pid(), &[]);
    let pid = t.pid().to_string();
    for args in [vec!["list"], vec!["snapshot", pid.as_str()]] {
        let mut h = Command::new(bin())
            .args(&args)
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        drop(h.stdout.take());
        let out = h.wait_with_output().unwrap();
        assert!(
            !stderr(&out).contains("panicked") && !stderr(&out).contains("Broken pipe"),
            "{args:?}: {}",
            stderr(&out)
        );
    }
    detach_ok(t.pid());
    t.send("quit");
}

/// The peak figures one JSON document gives: (totals.peak_bytes, the
/// curve's highest point, peak.live_bytes, tolerance).
fn peaks_of(j: &Value) -> (u64, u64, Option<u64>, u64) {
    (
        j["totals"]["peak_bytes"].as_u64().unwrap(),
        curve_max(j),
        j["peak"]["live_bytes"].as_u64(),
        j["totals"]["peak_tolerance"].as_u64().unwrap(),
    )
}

#[test]
fn the_peak_of_a_process_that_only_churns_since_the_attach_is_one_value_everywhere() {
    // attach_target's threads make only short-lived blocks: the heap
    // recorded since the attach stays near zero and the agent never moves
    // its peak (a curve of two points). `--peak` answers anyway, and the
    // curve line, the totals line, JSON and `--peak` give one peak.
    let dir = TempDir::new("attach-churn-peak");
    let t = start();
    let pid = t.pid();
    attach_ok(pid, &[]);
    for phase in ["attached", "detached"] {
        let file = dir.str(&format!("peak-{phase}.json"));
        let out = heapdump(&["snapshot", &pid.to_string(), "--peak", "-o", &file]);
        assert!(out.status.success(), "{phase}: --peak: {}", stderr(&out));
        let j = read_json(std::path::Path::new(&file));
        let (peak, curve_max, at_peak, tolerance) = peaks_of(&j);
        assert_eq!(
            peak, curve_max,
            "{phase}: the curve's highest point is the peak"
        );
        let at_peak = at_peak.expect("a --peak document says when");
        assert!(
            at_peak <= peak && peak - at_peak <= tolerance,
            "{phase}: --peak shows {at_peak}, the peak is {peak} (tolerance {tolerance})"
        );
        let j = snapshot_json(pid, &dir, phase);
        let (peak, curve_max, _, _) = peaks_of(&j);
        assert_eq!(peak, curve_max, "{phase}");
        assert!(peak >= j["totals"]["live_bytes"].as_u64().unwrap());
        let text = stdout(&heapdump(&["snapshot", &pid.to_string()]));
        let curve_peak = text
            .split(", peak ")
            .nth(1)
            .and_then(|r| r.split(" at ").next())
            .unwrap_or_else(|| panic!("{text}"));
        let totals_peak = text
            .split("peak live: ")
            .nth(1)
            .and_then(|r| {
                r.split([' ', '\n'])
                    .take(2)
                    .collect::<Vec<_>>()
                    .join(" ")
                    .into()
            })
            .unwrap_or_else(|| panic!("{text}"));
        assert_eq!(curve_peak, totals_peak, "{phase}: {text}");
        if phase == "attached" {
            detach_ok(pid);
        }
    }
}

#[test]
fn the_agents_own_allocations_are_not_in_an_attached_processs_heap() {
    // A single-threaded daemon that allocates nothing until asked: after
    // the attach (which starts the agent's housekeeping thread from the
    // borrowed thread) the recorded heap is empty, then exactly the
    // program's 10 blocks.
    let dir = TempDir::new("attach-own");
    let mut cmd = Command::new(compile_c("poll_single"));
    cmd.env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    attach_ok(pid, &[]);
    let j = snapshot_json(pid, &dir, "idle");
    assert_eq!(j["totals"]["live_blocks"], 0, "{}", j["sites"]);
    t.send("alloc");
    t.wait_line("allocated");
    let j = snapshot_json(pid, &dir, "alloc");
    assert_eq!(j["totals"]["live_blocks"], 10, "{}", j["sites"]);
    assert_eq!(j["totals"]["live_bytes"], 7770);
    detach_ok(pid);
    t.send("quit");
    assert_eq!(t.wait_line("eintr "), "eintr 0");
}

#[test]
fn the_heap_at_its_peak_of_an_attached_process_is_not_compared_with_the_allocators_heap_now() {
    // Ten blocks kept (7 770 B), then a spike of 1 MiB allocated and freed
    // again: `--peak` shows the spike, while the allocator's figure in
    // the recording's line is read about now. That line compared it with
    // the peak's heap ("1.0 MiB live recorded since the attach, of 130 KiB
    // in use according to glibc"): it gives the heap recorded now.
    let dir = TempDir::new("attach-peak-recording");
    let mut cmd = Command::new(compile_c("poll_single"));
    cmd.env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    attach_ok(pid, &[]);
    t.send("alloc");
    t.wait_line("allocated");
    t.send("spike");
    t.wait_line("spiked");
    let recorded = |text: &str| {
        text.lines()
            .find(|l| l.starts_with("recording since heapdump attach"))
            .and_then(|l| l.split(": ").nth(1))
            .and_then(|r| r.split(" live recorded since the attach").next())
            .map(str::to_string)
            .unwrap_or_else(|| panic!("no recording line: {text}"))
    };
    let now = stdout(&heapdump(&["snapshot", &pid.to_string()]));
    assert_eq!(recorded(&now), "7.6 KiB", "{now}");
    let peak = stdout(&heapdump(&["snapshot", &pid.to_string(), "--peak"]));
    assert!(peak.contains("THE HEAP AT ITS PEAK"), "{peak}");
    let file = dir.str("peak.json");
    let out = heapdump(&["snapshot", &pid.to_string(), "--peak", "-o", &file]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(std::path::Path::new(&file));
    assert!(
        j["peak"]["live_bytes"].as_u64().unwrap() >= 7770 + 64 * 16384,
        "{}",
        j["peak"]
    );
    assert_eq!(recorded(&peak), "7.6 KiB", "{peak}");
    // The same line in the HTML report made from that document.
    let html = dir.str("peak.html");
    let out = heapdump(&["report", &file, "-o", &html]);
    assert!(out.status.success(), "{}", stderr(&out));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("7.6 KiB live recorded since the attach"),
        "{}",
        page.lines()
            .filter(|l| l.contains("recorded since"))
            .collect::<Vec<_>>()
            .join("\n")
    );
    detach_ok(pid);
    t.send("quit");
}

#[test]
fn a_stopped_process_is_refused_and_runs_on_once_continued() {
    let t = start();
    let pid = t.pid();
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(pid as i32, libc::SIGSTOP) };
    // Stopped once /proc says so (a bounded poll of a state).
    let guard = std::time::Instant::now();
    while !std::fs::read_to_string(format!("/proc/{pid}/stat"))
        .unwrap()
        .rsplit_once(") ")
        .is_some_and(|(_, r)| r.starts_with('T'))
    {
        assert!(guard.elapsed() < HANG_GUARD);
        std::thread::yield_now();
    }
    let out = attach(pid, &[]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("is stopped"), "{}", stderr(&out));
    assert!(stderr(&out).contains("kill -CONT"), "{}", stderr(&out));
    // SAFETY: as above.
    unsafe { libc::kill(pid as i32, libc::SIGCONT) };
    // It runs on (a stop and continue may itself interrupt a wait with
    // EINTR, which is not heapdump's doing: not counted here).
    let mut t = t;
    t.send("quit");
    t.wait_line("eintr ");
}

#[test]
fn a_process_instrumented_by_the_rust_agent_is_not_attached() {
    // heapdump's own fake target records through heapdump_agent::Agent,
    // its global allocator.
    let t = FakeTarget::start(&[]);
    let out = attach(t.pid(), &[]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("instrumented by heapdump_agent::Agent"),
        "{}",
        stderr(&out)
    );
}
