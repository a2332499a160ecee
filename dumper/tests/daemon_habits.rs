//! Daemons' habits under the agent (issue 24): closing every inherited
//! descriptor, forking, running other programs, sampled children that have
//! not sampled yet; and a dumper that holds other processes' regions.
//!
//! Synchronisation is by printed lines only; timeouts are hang guards.

mod common;

use std::process::{Command, Stdio};

use common::*;
use heapdump_tests::{compile_c, preload_lib, real_dependency, Target};
use serde_json::Value;

/// True when this process may open `/proc/PID/map_files` of another
/// process (root, or CAP_CHECKPOINT_RESTORE / CAP_SYS_ADMIN).
fn can_open_map_files() -> bool {
    // CapEff bits: CAP_SYS_ADMIN = 21, CAP_CHECKPOINT_RESTORE = 40.
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status
        .lines()
        .find_map(|l| l.strip_prefix("CapEff:"))
        .map(|v| u64::from_str_radix(v.trim(), 16).unwrap())
        .unwrap_or(0);
    eff & (1 << 21 | 1 << 40) != 0
}

fn snapshot_json(pid: u32, dir: &TempDir, name: &str) -> Value {
    let path = dir.str(name);
    let out = heapdump(&["snapshot", &pid.to_string(), "-o", &path]);
    assert!(out.status.success(), "snapshot failed: {}", stderr(&out));
    read_json(&dir.path(name))
}

#[test]
fn a_fork_after_close_range_leaves_the_programs_socket_alone() {
    // varnishd's manager: close_range(3, ~0), socket() takes fd 3 (the
    // agent's old memfd number), fork; the child uses the socket. The
    // agent's fork handling once closed fd 3 in the child.
    let exe = compile_c("closefds_fork");
    for preload in [None, Some(preload_lib())] {
        let mut cmd = Command::new(&exe);
        if let Some(p) = &preload {
            cmd.env("LD_PRELOAD", p);
        }
        let t = Target::spawn_until(cmd, "child socket");
        assert_eq!(
            t.last_line(),
            "child socket ok",
            "preload {preload:?}: the child's socket was closed or replaced"
        );
        let status = t.finish();
        assert!(status.success(), "preload {preload:?}: {status:?}");
    }
}

#[test]
fn a_child_forked_after_the_program_sandboxed_itself_runs_unrecorded_not_killed() {
    // The program installs a seccomp filter that kills on memfd_create
    // after the agent started, then forks: the child's regions would need
    // that call, and the child was killed by SIGSYS in the agent's fork
    // handler. Now it runs (unrecorded); the parent stays recorded.
    let exe = compile_c("seccomp_fork");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let mut t = Target::spawn_until(cmd, "child ");
    assert_eq!(t.last_line(), "child exited 0");
    let line = t.wait_line("ready ");
    let pid: u32 = line["ready ".len()..].parse().unwrap();
    let dir = TempDir::new("seccomp-fork");
    let j = snapshot_json(pid, &dir, "parent.json");
    // The parent's one block from before the filter (1000 bytes at main).
    let sites = live_by_leaf(&j);
    assert_eq!(sites.get("main"), Some(&(1, 1000)), "{sites:#?}");
    assert!(t.finish().success());
}

#[test]
fn a_program_that_sandboxes_itself_is_not_killed_by_the_agents_calls_and_keeps_what_was_recorded() {
    // Its filter kills on prctl, which the agent calls now and then to
    // see a thread's name: the agent stops recording when the filter is
    // installed (prctl(PR_SET_SECCOMP), or syscall(SYS_seccomp) as
    // libseccomp calls it, pass through its hooks) and the program runs
    // to its end.
    let exe = compile_c("seccomp_late");
    for how in ["prctl", "syscall"] {
        let mut cmd = Command::new(&exe);
        cmd.arg(how).env("LD_PRELOAD", preload_lib());
        let mut t = Target::spawn_until(cmd, "done");
        let line = t.wait_line("ready ");
        let pid: u32 = line["ready ".len()..].parse().unwrap();
        let dir = TempDir::new("seccomp-late");
        let j = snapshot_json(pid, &dir, "s.json");
        // What was recorded before stays; recording stopped when it
        // sandboxed itself (said as a detach).
        let sites = live_by_leaf(&j);
        let rec = &j["recording"];
        assert_eq!(
            sites.get("before_sandbox"),
            Some(&(1, 1000)),
            "{how}: {sites:#?}"
        );
        assert!(rec["detached_at"].is_string(), "{how}: {rec}");
        assert!(rec["attached_at"].is_null(), "{how}: {rec}");
        // `list` marks it as stopped.
        let list = stdout(&heapdump(&["list"]));
        let row = list
            .lines()
            .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
            .unwrap_or_else(|| panic!("{pid} not listed: {list}"));
        assert!(row.contains("exact-"), "{how}: {row}");
        assert!(t.finish().success());
    }
}

#[test]
fn a_process_that_closed_its_descriptors_stays_listed_and_dumpable() {
    let exe = compile_c("closefds_fork");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let pid = t.pid();
    // Its descriptors are gone: nothing under /proc/PID/fd names a region.
    let fds: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .flatten()
        .filter_map(|e| std::fs::read_link(e.path()).ok())
        .map(|p| p.display().to_string())
        .collect();
    assert!(
        fds.iter().all(|l| !l.contains("heapdump.")),
        "the test program should have closed the agent's descriptors: {fds:?}"
    );
    let list = heapdump(&["list"]);
    let listed = stdout(&list);
    let row = listed
        .lines()
        .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("pid {pid} not listed:\n{listed}"));
    let dir = TempDir::new("closed-fds");
    if can_open_map_files() {
        assert!(row.contains("exact"), "{row}");
        let j = snapshot_json(pid, &dir, "s.json");
        let leaves = live_by_leaf(&j);
        assert_eq!(
            leaves.get("keep_blocks"),
            Some(&(100, 100 * 10_000)),
            "{leaves:#?}"
        );
        assert_eq!(leaves.get("after_close"), Some(&(1, 777)), "{leaves:#?}");
    } else {
        let out = heapdump(&["snapshot", &pid.to_string()]);
        assert!(!out.status.success());
        let err = stderr(&out);
        assert!(err.contains("closed the descriptors"), "{err}");
        assert!(err.contains("CAP_CHECKPOINT_RESTORE"), "{err}");
    }
    assert!(t.finish().success());
}

#[test]
fn python_that_closes_every_descriptor_stays_dumpable() {
    if !real_dependency("python3", std::path::Path::new("/usr/bin/python3").exists()) {
        return;
    }
    if !can_open_map_files() {
        eprintln!("skipping: opening map_files needs CAP_CHECKPOINT_RESTORE (run as root)");
        return;
    }
    let mut cmd = Command::new("/usr/bin/python3");
    cmd.env("LD_PRELOAD", preload_lib()).args([
        "-c",
        "import os,sys\n\
         x=[bytearray(100000) for _ in range(100)]\n\
         os.closerange(3,65536)\n\
         print('ready', flush=True)\n\
         sys.stdin.readline()\n",
    ]);
    let t = Target::spawn(cmd);
    let dir = TempDir::new("py-closed");
    let j = snapshot_json(t.pid(), &dir, "s.json");
    // The 100 bytearrays (100 000 bytes each) are live; the interpreter's
    // own heap comes on top.
    let held: u64 = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["live_bytes"].as_u64().unwrap() >= 100 * 100_000)
        .map(|s| s["live_blocks"].as_u64().unwrap())
        .sum();
    assert!(
        held >= 100,
        "the 100 bytearrays should be one site of >= 100 blocks: {}",
        j["totals"]
    );
    assert!(t.finish().success());
}

#[test]
fn a_running_watch_is_never_listed_as_instrumented() {
    let target = FakeTarget::start(&[]);
    let pid = target.pid();
    let dir = TempDir::new("watch-not-listed");
    let mut w = Command::new(bin())
        .args(["watch", &pid.to_string(), "--dir", &dir.str("snaps")])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Lines::new(w.stdout.take().unwrap());
    assert!(lines.next().starts_with("watching "));
    // The watch now holds the target's regions open (read-only).
    let list = stdout(&heapdump(&["list"]));
    let pids: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(pids.contains(&pid.to_string().as_str()), "{list}");
    assert!(
        !pids.contains(&w.id().to_string().as_str()),
        "the watch (pid {}) is listed:\n{list}",
        w.id()
    );
    let out = heapdump(&["snapshot", &w.id().to_string()]);
    assert!(
        stderr(&out).contains("is not instrumented"),
        "{}",
        stderr(&out)
    );
    let _ = w.kill();
    let _ = w.wait();
}

#[test]
fn programs_the_target_runs_get_no_agent_messages() {
    // A program linked with jemalloc gets the companion library from
    // `heapdump run`; the programs it runs inherit LD_PRELOAD, but the
    // agent's messages must not land in their output.
    if !real_dependency(
        "libjemalloc-dev",
        heapdump_tests::has_header("jemalloc/jemalloc.h"),
    ) {
        return;
    }
    let exe = heapdump_tests::compile_c_variant("runs_true", "jemalloc", &["-ljemalloc"]);
    let out = Command::new(bin())
        .args(["run", "--"])
        .arg(&exe)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let all = format!("{}{}", stdout(&out), stderr(&out));
    assert!(out.status.success(), "{all}");
    assert!(
        stdout(&out).contains("true exited 0"),
        "the program did not run /bin/true: {all}"
    );
    assert!(
        !all.contains("heapdump:"),
        "agent messages in the output of programs the target ran:\n{all}"
    );
    // The same programs by hand, under both libraries and no `heapdump
    // run`: the companion still says what is wrong (the user asked).
    let by_hand = Command::new("/bin/true")
        .env(
            "LD_PRELOAD",
            format!(
                "{}:{}",
                preload_lib().display(),
                heapdump_tests::jemalloc_companion_lib().display()
            ),
        )
        .output()
        .unwrap();
    assert!(
        stderr(&by_hand).contains("no jemalloc follows it"),
        "{}",
        stderr(&by_hand)
    );
}

/// The row of `pid` in `heapdump list`, split on whitespace.
fn list_row(pid: u32) -> Vec<String> {
    let list = stdout(&heapdump(&["list"]));
    list.lines()
        .find(|l| l.split_whitespace().next() == Some(&pid.to_string()))
        .unwrap_or_else(|| panic!("pid {pid} not listed:\n{list}"))
        .split_whitespace()
        .map(str::to_string)
        .collect()
}

#[test]
fn a_sampled_fork_child_that_has_not_sampled_yet_is_listed_and_dumpable() {
    let exe = compile_c("fork_idle");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib())
        .env("HEAPDUMP_SAMPLE_RATE", "1GiB");
    let t = Target::spawn(cmd);
    let child: u32 = t.last_line()["ready ".len()..].parse().unwrap();
    let row = list_row(child);
    // PID NAME MODE LIVE(2 words) BLOCKS THREADS DROPPED
    assert_eq!(row[2], "~1/1.0GiB", "{row:?}");
    assert_eq!(row[3], "~0", "{row:?}");
    assert_eq!(row[5], "~0", "{row:?}");
    let dir = TempDir::new("sampled-idle-child");
    let j = snapshot_json(child, &dir, "s.json");
    assert_eq!(j["pid"], child);
    assert_eq!(j["totals"]["live_bytes"], 0);
    let notes = j["notes"].to_string();
    assert!(notes.contains("no allocation sampled yet"), "{notes}");
    assert!(!notes.contains("linked in statically"), "{notes}");
    assert!(t.finish().success());
}

#[test]
fn a_fork_childs_snapshot_shows_what_it_inherited_from_a_parent_of_one_thread() {
    // A daemon's start (nginx's master daemonizing, memcached -d) and
    // nginx's workers: what the parent built before the fork, the child
    // holds. The child's table started empty at the fork, so none of it
    // was shown anywhere once the parent exited. The agent now copies the
    // parent's records at the fork when that is exact (the parent runs one
    // thread): the child's snapshot is its live set, the blocks it freed
    // since the fork gone, its own added.
    let exe = compile_c("daemonize");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let child = t.line_pid().unwrap();
    let dir = TempDir::new("fork-inherits");
    // The parent waits for the child: its table is as at the fork.
    // Live blocks and bytes at a leaf function (a site with no live
    // block may be listed for what it allocated).
    let at = |sites: &std::collections::BTreeMap<String, (u64, u64)>, leaf: &str| {
        sites.get(leaf).copied().unwrap_or((0, 0))
    };
    let p = snapshot_json(t.pid(), &dir, "parent.json");
    let parent = live_by_leaf(&p);
    assert_eq!(at(&parent, "site_config"), (40, 40_000), "{parent:#?}");
    assert_eq!(at(&parent, "site_dropped"), (10, 3_000), "{parent:#?}");
    assert_eq!(at(&parent, "site_child"), (0, 0), "{parent:#?}");
    let c = snapshot_json(child, &dir, "child.json");
    let sites = live_by_leaf(&c);
    assert_eq!(at(&sites, "site_config"), (40, 40_000), "{sites:#?}");
    assert_eq!(
        at(&sites, "site_dropped"),
        (0, 0),
        "freed by the child: {sites:#?}"
    );
    assert_eq!(at(&sites, "site_child"), (5, 1_000), "{sites:#?}");
    // Every block the parent held, less the 10 freed, plus the 5 new.
    let live = |j: &Value, what: &str| j["totals"][what].as_u64().unwrap();
    assert_eq!(live(&c, "live_blocks"), live(&p, "live_blocks") - 10 + 5);
    assert_eq!(
        live(&c, "live_bytes"),
        live(&p, "live_bytes") - 3_000 + 1_000
    );
    let notes = c["notes"].to_string();
    assert!(
        notes.contains(&format!(
            "forked from pid {}: the {} blocks it held at the fork were copied",
            t.pid(),
            live(&p, "live_blocks")
        )),
        "{notes}"
    );
    // `list` notes what a row may miss: nothing here.
    let list = stdout(&heapdump(&["list"]));
    let first_words: Vec<&str> = list
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(first_words.contains(&child.to_string().as_str()), "{list}");
    assert!(
        !first_words.contains(&format!("{child}:").as_str()),
        "{list}"
    );
    assert!(t.finish().success());
    // A parent running two threads: no copy (the other thread could
    // change the table while it is made), and the note says why.
    let mut cmd = Command::new(&exe);
    cmd.arg("thread").env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let child = t.line_pid().unwrap();
    let c = snapshot_json(child, &dir, "child-of-two.json");
    let sites = live_by_leaf(&c);
    assert_eq!(at(&sites, "site_config"), (0, 0), "{sites:#?}");
    assert_eq!(at(&sites, "site_child"), (5, 1_000), "{sites:#?}");
    let notes = c["notes"].to_string();
    assert!(
        notes.contains("only from a parent running one thread"),
        "{notes}"
    );
    assert!(t.finish().success());
}

#[test]
fn a_fork_childs_snapshot_says_its_inherited_blocks_are_its_parents() {
    // A daemon that forks (nginx's master daemonizing, its workers,
    // postgres's backends) from a parent running several threads: the
    // child's table starts empty at the fork, and its snapshot said "no
    // allocation recorded: ... an allocator linked in statically", as if
    // the agent saw nothing. It now names the parent, whose table holds
    // what the child inherited.
    let exe = compile_c("fork_idle");
    let mut cmd = Command::new(&exe);
    cmd.arg("thread").env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let child: u32 = t.last_line()["ready ".len()..].parse().unwrap();
    let dir = TempDir::new("fork-child-notes");
    let j = snapshot_json(child, &dir, "child.json");
    assert_eq!(j["totals"]["live_blocks"], 0);
    let notes = j["notes"].to_string();
    assert!(
        notes.contains(&format!("forked from pid {}:", t.pid())),
        "{notes}"
    );
    assert!(
        notes.contains("no allocation recorded since the fork"),
        "{notes}"
    );
    assert!(!notes.contains("linked in statically"), "{notes}");
    let list = stdout(&heapdump(&["list"]));
    assert!(
        list.contains(&format!("{child}: forked from pid {}:", t.pid())),
        "{list}"
    );
    // The parent holds its 64-byte block (and its thread's) and is no
    // fork child.
    let p = snapshot_json(t.pid(), &dir, "parent.json");
    assert_eq!(live_by_leaf(&p).get("main"), Some(&(1, 64)), "{p}");
    assert!(
        !p["notes"].to_string().contains("forked from"),
        "{}",
        p["notes"]
    );
    assert!(t.finish().success());
    // A daemon's start: the parent (an instrumented bash) forks a
    // subshell and exits.
    let mut bash = Command::new("bash")
        // (An asynchronous command's stdin is /dev/null unless redirected.)
        .args([
            "-c",
            "exec 3<&0; ( echo \"daemon $BASHPID\"; read -r _ <&3 ) &",
        ])
        .env("LD_PRELOAD", preload_lib())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let parent = bash.id();
    let out = Lines::new(bash.stdout.take().unwrap());
    // Printed by the child once forked (its regions made at the fork).
    let daemon: u32 = out.next()["daemon ".len()..].parse().unwrap();
    // Kept open (`wait` would close it): the daemon reads it.
    let mut stdin = bash.stdin.take().unwrap();
    assert!(bash.wait().unwrap().success());
    // bash runs one thread: what the subshell inherited was copied.
    let j = snapshot_json(daemon, &dir, "daemon.json");
    let notes = j["notes"].to_string();
    assert!(
        notes.contains(&format!("forked from pid {parent}: the ")),
        "{notes}"
    );
    assert!(j["totals"]["live_blocks"].as_u64().unwrap() > 0, "{notes}");
    // Its read ends at the newline.
    std::io::Write::write_all(&mut stdin, b"\n").unwrap();
}

#[test]
fn sampled_list_shows_the_estimates_a_snapshot_shows() {
    let exe = compile_c("sampled");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib())
        .env("HEAPDUMP_SAMPLE_RATE", "64KiB")
        .env("HEAPDUMP_SAMPLE_SEED", "3");
    let t = Target::spawn(cmd);
    let pid = t.pid();
    let row = list_row(pid);
    let dir = TempDir::new("sampled-list");
    let j = snapshot_json(pid, &dir, "s.json");
    // The target is quiet: the list's estimate and the snapshot's agree
    // exactly (raw sampled blocks would be a few hundred, not ~200 000).
    let blocks = j["totals"]["live_blocks"].as_u64().unwrap();
    assert_eq!(row[5], format!("~{blocks}"), "{row:?} vs {}", j["totals"]);
    assert!(blocks > 100_000, "{}", j["totals"]);
    assert_eq!(row[2], "~1/64.0KiB", "{row:?}");
    assert!(row[3].starts_with('~'), "{row:?}");
    assert!(t.finish().success());
}

#[test]
fn a_stripped_binarys_static_function_is_shown_as_module_plus_offset() {
    use object::{Object, ObjectSegment, ObjectSymbol};
    let unstripped =
        heapdump_tests::compile_c_variant("stripped_static", "rdynamic", &["-rdynamic"]);
    let stripped = unstripped.with_file_name(format!(
        "{}-stripped",
        unstripped.file_name().unwrap().to_string_lossy()
    ));
    let st = Command::new("strip")
        .arg("--strip-all")
        .arg("-o")
        .arg(&stripped)
        .arg(&unstripped)
        .status()
        .expect("run strip (binutils)");
    assert!(st.success());
    // Ground truth from the unstripped twin (same code, same layout):
    // hidden_site's extent as file offsets.
    let data = std::fs::read(&unstripped).unwrap();
    let elf = object::File::parse(&*data).unwrap();
    let sym = elf
        .symbols()
        .find(|s| s.name() == Ok("hidden_site"))
        .expect("hidden_site in the unstripped binary");
    let seg = elf
        .segments()
        .find(|s| (s.address()..s.address() + s.size()).contains(&sym.address()))
        .unwrap();
    let file_off = |vaddr: u64| vaddr - seg.address() + seg.file_range().0;
    let extent = file_off(sym.address())..file_off(sym.address() + sym.size());

    let mut cmd = Command::new(&stripped);
    cmd.env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let dir = TempDir::new("stripped");
    let j = snapshot_json(t.pid(), &dir, "s.json");
    let site = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .find(|s| s["live_blocks"] == 10 && s["live_bytes"] == 43_210)
        .unwrap_or_else(|| panic!("hidden_site's 10 blocks: {:#}", j["sites"]));
    let leaf = &site["frames"][0];
    assert!(
        leaf["function"].is_null(),
        "a frame no symbol covers was named: {leaf}"
    );
    let off = u64::from_str_radix(
        leaf["module_offset"]
            .as_str()
            .expect("module_offset")
            .trim_start_matches("0x"),
        16,
    )
    .unwrap();
    // A return address: the byte after the call, inside hidden_site (or
    // just past its end when the call is its last instruction).
    assert!(
        extent.start < off && off <= extent.end,
        "{off:#x} not in hidden_site {extent:x?}"
    );
    let text = stdout(&heapdump(&["snapshot", &t.pid().to_string()]));
    let name = stripped.file_name().unwrap().to_string_lossy().to_string();
    assert!(
        text.contains(&format!("{name}+{off:#x}")),
        "text report should name the frame {name}+{off:#x}:\n{text}"
    );
    assert!(!text.contains("exported_small"), "{text}");
    assert!(t.finish().success());
}
