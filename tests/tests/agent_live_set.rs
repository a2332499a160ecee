//! The agent records the exact live set of real processes, read from
//! another process through `/proc/PID/fd`: a C program under the preload
//! library and a Rust program with the `Agent` global allocator, each with
//! a known allocation pattern (sites, sizes, threads, frees, reallocs).

use std::process::Command;

use heapdump_tests::*;

fn check_c_pattern(hold: bool) {
    let exe = compile_c("pattern");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    if hold {
        cmd.arg("hold");
    }
    check_c_pattern_run(&exe, cmd);
}

#[test]
fn c_program_under_preload_exact_live_set_after_threads_exit() {
    check_c_pattern(false);
}

#[test]
fn c_program_under_preload_exact_live_set_with_threads_alive() {
    check_c_pattern(true);
}

/// Runs `tests/c/NAME` under the preload until it is ready and quiet,
/// dumps it (or the process whose pid its `ready` line names), and checks
/// the exact live set: nothing at `freed` (a site all
/// of whose blocks were freed), each of `kept` (site, blocks, size of each)
/// exactly, the header's counters (shards plus the threads' writer lines)
/// equal to the blocks walked, at least `min_allocs` allocations counted
/// and nothing dropped. Then lets it free the rest and finish.
fn check_c_live_set(name: &str, freed: &str, kept: &[(&str, u64, u64)], min_allocs: u64) {
    check_c_live_set_of_run(name, &[], Some(freed), kept, min_allocs);
}

/// [`check_c_live_set`] of a run with arguments `args`, where no site
/// need have been freed whole (`freed`: `None`).
fn check_c_live_set_of_run(
    name: &str,
    args: &[&str],
    freed: Option<&str>,
    kept: &[(&str, u64, u64)],
    min_allocs: u64,
) {
    let exe = compile_c(name);
    let mut cmd = Command::new(&exe);
    cmd.args(args).env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn(cmd);
    // The process that printed `ready PID` (a forked child, for some).
    let pid = target.line_pid().unwrap_or(target.pid());
    check_live_set_of(&exe, pid, freed, kept, min_allocs);
    target.send("go");
    target.wait_line("done");
    assert!(target.finish().success());
}

/// Dumps process `pid` (running `exe`) and checks its exact live set as
/// [`check_c_live_set`] says.
fn check_live_set_of(
    exe: &std::path::Path,
    pid: u32,
    freed: Option<&str>,
    kept: &[(&str, u64, u64)],
    min_allocs: u64,
) {
    let d = dump(pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(exe, pid);
    let t = by_site(&d, &syms, "site_");
    if let Some(freed) = freed {
        assert!(!t.contains_key(freed), "freed blocks reported: {t:#?}");
    }
    for &(site, blocks, size) in kept {
        let got = t.get(site).map(|e| (e.0, e.1, e.2.clone()));
        assert_eq!(
            got,
            Some((blocks, blocks * size, vec![size])),
            "{site}: {t:#?}"
        );
    }
    let live: u64 = d.blocks.iter().map(|b| b.size).sum();
    assert_eq!(d.counters.live_blocks, d.blocks.len() as u64);
    assert_eq!(d.counters.live_bytes, live);
    assert!(d.counters.total_allocs >= min_allocs);
    assert_eq!(d.counters.dropped_total(), 0, "{:?}", d.counters.dropped);
}

#[test]
fn a_child_forked_without_the_atfork_handlers_never_writes_into_its_parents_regions() {
    // tests/c/raw_fork.c: a child made by the raw fork system call (no
    // atfork handler runs) frees every block it inherited and keeps its
    // own; the parent's snapshot afterwards must still hold exactly its
    // blocks, and the child is recorded in regions of its own
    // (agent/src/fork_guard.rs).
    let exe = compile_c("raw_fork");
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn_until(cmd, "child");
    let child = target.line_pid().expect("child pid");
    check_live_set_of(
        &exe,
        child,
        Some("site_parent"),
        &[("site_child", 5_000, 24)],
        5_000,
    );
    target.send("go");
    target.wait_line("ready");
    assert_eq!(target.last_line(), format!("ready {}", target.pid()));
    check_live_set_of(
        &exe,
        target.pid(),
        Some("site_child"),
        &[("site_parent", 3_000, 40)],
        20_000 + 3_000,
    );
    target.send("go");
    target.wait_line("done");
    assert!(target.finish().success());
}

#[test]
fn blocks_freed_by_other_threads_while_young_leave_the_exact_live_set() {
    // tests/c/handoff.c: threads free each other's blocks while they are
    // still young in their allocator's ring (or just promoted), and main
    // frees blocks left young in the rings of threads that have exited.
    check_c_live_set(
        "handoff",
        "site_churn",
        &[("site_kept", 100, 777)],
        4 * (30_000 + 50),
    );
}

#[test]
fn blocks_that_outlive_the_young_ring_then_die_young_leave_the_exact_live_set() {
    // tests/c/outlive_ring.c: one thread's blocks die young, then outlive
    // its young ring (the agent then puts them straight into the index,
    // `agent/src/young_policy.rs`), and are freed while the ring still
    // holds the last ones it took; then they die young again.
    check_c_live_set(
        "outlive_ring",
        "site_young",
        &[("site_long", 1500, 100), ("site_mixed", 750, 48)],
        5_000 + 3_000 + 20_000 + 3_000,
    );
}

#[test]
fn threads_that_exit_while_bypassing_their_young_rings_leave_the_exact_live_set() {
    // tests/c/outlive_ring_threads.c: threads whose blocks outlive their
    // young rings exit while bypassing them; main frees half of their
    // blocks, some still in the rings of threads that are gone; new
    // threads then take the rings up again.
    check_c_live_set(
        "outlive_ring_threads",
        "site_young",
        &[("site_long", 8000, 200)],
        4 * (4_000 + 1_000 + 20_000),
    );
}

#[test]
fn blocks_in_owner_tables_full_drained_and_inherited_leave_the_exact_live_set() {
    // tests/c/outlive_table.c: a thread's medium-lived blocks live and die
    // in its owner table, another's long-lived ones overflow its table
    // (drained into the index); main and a later thread (which takes the
    // first one's table up with the blocks it holds) free blocks of a
    // thread that is gone.
    check_c_live_set(
        "outlive_table",
        "site_none",
        &[
            ("site_huge", 10_000, 64),
            ("site_fifo", 500, 32),
            ("site_fifo_b", 2_000, 200),
        ],
        2 * (2_000 + 30_000) + 20_000,
    );
}

#[test]
fn a_forked_child_never_sees_its_parents_owner_table_entries() {
    // tests/c/fork_tables.c: the parent's owner table holds blocks when it
    // forks; the child runs the same pattern itself, taking that table up,
    // then frees half of the parent's blocks. With a second thread in the
    // parent, the child's table starts empty (those frees are of blocks
    // never recorded there, which the stale table entries must not match).
    check_c_live_set_of_run(
        "fork_tables",
        &["thread"],
        Some("site_parent"),
        &[("site_child", 2_000, 48)],
        2_000 + 30_000,
    );
    // With one thread, the child's table starts with the parent's blocks
    // (`fork_inheritance`): the half it did not free stays, exactly.
    check_c_live_set_of_run(
        "fork_tables",
        &[],
        None,
        &[("site_child", 2_000, 48), ("site_parent", 1_000, 32)],
        2_000 + 30_000,
    );
}

fn check_rust_pattern(hold: bool) {
    check_rust_program(env!("CARGO_BIN_EXE_rust_pattern"), "rust_pattern", hold);
}

/// The Rust pattern (`tests/src/rust_pattern_body.rs`) built as program
/// `name` (which is also its crate and main thread's name).
fn check_rust_program(exe: &str, name: &str, hold: bool) {
    let mut cmd = Command::new(exe);
    if hold {
        cmd.arg("hold");
    }
    let mut target = Target::spawn(cmd);
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(exe.as_ref(), pid);
    let t = by_site(&d, &syms, &format!("{name}::site_"));
    expect_site(&t, "site_vec", 100, 1000, name);
    expect_site(&t, "site_zeroed", 50, 24, name);
    expect_site(&t, "site_realloc", 10, 4096, name);
    expect_site(&t, "site_free_half", 100, 32, name);
    expect_site(&t, "site_thread1", 30, 512, "worker-1");
    expect_site(&t, "site_thread2", 20, 2048, "worker-2");
    assert!(!t.contains_key("site_freed_all"));
    let live: u64 = d.blocks.iter().map(|b| b.size).sum();
    assert_eq!(d.counters.live_bytes, live);
    assert_eq!(d.counters.dropped_total(), 0, "{:?}", d.counters.dropped);
    target.send("go");
    let line = target.wait_line("stats");
    assert!(line.contains("dropped=0"), "{line}");
    assert!(target.finish().success());
}

#[test]
fn rust_program_with_agent_exact_live_set_after_threads_exit() {
    check_rust_pattern(false);
}

#[test]
fn rust_program_with_agent_exact_live_set_with_threads_alive() {
    check_rust_pattern(true);
}

#[test]
fn rust_program_with_block_headers_exact_live_set() {
    // Records found through block headers instead of by address.
    check_rust_program(env!("CARGO_BIN_EXE_rust_headers"), "rust_headers", true);
    check_rust_program(env!("CARGO_BIN_EXE_rust_headers"), "rust_headers", false);
}

#[test]
fn rust_program_without_agent_under_preload() {
    let exe = env!("CARGO_BIN_EXE_rust_plain");
    let mut cmd = Command::new(exe);
    cmd.env("LD_PRELOAD", preload_lib());
    let target = Target::spawn(cmd);
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(exe.as_ref(), pid);
    let mut per_thread = std::collections::BTreeMap::new();
    for b in &d.blocks {
        if syms.site(&b.frames, "rust_plain::plain_site").is_some() && b.size == 700 {
            *per_thread.entry(b.thread.name.clone()).or_insert(0) += 1;
        }
    }
    let want: std::collections::BTreeMap<String, i32> =
        (0..3).map(|i| (format!("plain-{i}"), 40)).collect();
    assert_eq!(per_thread, want);
    assert!(target.finish().success());
}

#[test]
fn c_programs_read_exact_heap_numbers_through_the_header() {
    let exe = compile_c("stats");
    let run = |preload: bool| {
        let mut cmd = Command::new(&exe);
        if preload {
            cmd.env("LD_PRELOAD", preload_lib());
        }
        let out = cmd.output().expect("run stats");
        assert!(out.status.success(), "{out:?}");
        String::from_utf8(out.stdout).unwrap()
    };
    assert_eq!(
        run(true),
        "start\n\
         returned 0 enabled 1 dropped 0\n\
         grew 10000 bytes 10 blocks\n\
         shrank 10000 bytes 10 blocks\n\
         allocated 10000 bytes 10 blocks\n\
         peak covers live 1\n\
         short 1\n\
         null -1\n"
    );
    // Built with the header, it runs without the agent too.
    assert_eq!(run(false), "start\nno agent\n");
}
