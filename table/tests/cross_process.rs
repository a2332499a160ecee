//! A child process writes both regions; the parent finds them in
//! `/proc/CHILD/fd`, maps them read-only and checks their exact content,
//! then again after the child has exited (the open mappings keep the
//! memory alive, as for a dumper watching a target that dies).
//!
//! The child is this test binary run again (`HEAPDUMP_TABLE_CHILD=1`,
//! only the `child` test). It prints `READY` on stdout once everything is
//! written and waits for stdin to close. Timeouts are hang guards only.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read};
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use heapdump_table::resources_table::DEFAULT_BUCKETS;
use heapdump_table::stack_compression::encode;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsReader, AllocationsWriter, DroppedReason,
    RegionKind, RegionReader, ResourcesReader, ResourcesWriter,
};

const CHILD_ENV: &str = "HEAPDUMP_TABLE_CHILD";
const GUARD: Duration = Duration::from_secs(120);

fn frames(i: u64) -> Vec<u64> {
    (0..1 + i % 20)
        .map(|k| 0x5555_1000_0000 + i * 0x100 + k * 8)
        .collect()
}

fn thread_name(t: u64) -> String {
    format!("worker-{t}")
}

/// The block `i` the child records (stack `i % 50`, thread `i % 4`).
fn block(i: u64) -> (u64, u64, u64, u64) {
    (0x7f00_0000_0000 + i * 48, 1 + i * 3, i % 50, i % 4)
}

const BLOCKS: u64 = 5_000;

/// Child side: write, announce, wait.
#[test]
fn child() {
    if std::env::var_os(CHILD_ENV).is_none() {
        return;
    }
    let res_region = ResourcesWriter::create_region(1 << 20, DEFAULT_BUCKETS).unwrap();
    let alloc_region = AllocationsWriter::create_region(AllocationsConfig {
        capacity: 1 << 14,
        shards: 16,
    })
    .unwrap();
    let res = ResourcesWriter::new(&res_region).unwrap();
    let allocs = AllocationsWriter::new(&alloc_region).unwrap();
    let stacks: Vec<_> = (0..50)
        .map(|i| {
            let mut bytes = Vec::new();
            encode(&frames(i), &mut bytes);
            res.intern_stack_trace(&bytes).unwrap().0
        })
        .collect();
    let threads: Vec<_> = (0..4)
        .map(|t| {
            res.insert_thread_info(1000 + t, thread_name(t).as_bytes())
                .unwrap()
        })
        .collect();
    for i in 0..BLOCKS {
        let (addr, size, s, t) = block(i);
        res.record_allocation(stacks[s as usize], size);
        allocs
            .insert(&AllocationRecord {
                address: addr,
                size,
                stack: stacks[s as usize],
                thread: threads[t as usize],
                timestamp_us: i,
            })
            .unwrap();
    }
    // Free every odd block again, count a drop, and make a named request.
    for i in (1..BLOCKS).step_by(2) {
        assert_eq!(allocs.remove(block(i).0), Some(block(i).1));
    }
    allocs.counters().on_dropped(DroppedReason::Reentrant);
    allocs.counters().request_snapshot("from-child", 12345);
    // On a line of its own (libtest prints "test child ... " first).
    println!("\nREADY {}", std::process::id());
    // Wait for the parent: stdin closes when it is done (or dies).
    let mut sink = Vec::new();
    let _ = std::io::stdin().read_to_end(&mut sink);
}

fn find_regions(pid: u32) -> HashMap<RegionKind, PathBuf> {
    let mut found = HashMap::new();
    for entry in std::fs::read_dir(format!("/proc/{pid}/fd")).unwrap() {
        let path = entry.unwrap().path();
        let Ok(target) = std::fs::read_link(&path) else {
            continue;
        };
        if let Some(kind) = RegionKind::from_link_target(&target.to_string_lossy()) {
            assert!(found.insert(kind, path).is_none(), "two {kind:?} regions");
        }
    }
    found
}

fn check(res: &RegionReader, alloc: &RegionReader, child_pid: u32) {
    assert_eq!(res.header().writer_pid, child_pid);
    assert_eq!(alloc.header().writer_pid, child_pid);
    let rr = ResourcesReader::new(res).unwrap();
    let ar = AllocationsReader::new(alloc).unwrap();

    let (records, stats) = ar.snapshot();
    assert_eq!(stats.partial_reason(), None);
    assert_eq!(records.len() as u64, BLOCKS / 2);
    let by_addr: HashMap<u64, AllocationRecord> = records.iter().map(|r| (r.address, *r)).collect();
    let mut per_stack: HashMap<u64, (u64, u64)> = HashMap::new();
    for i in 0..BLOCKS {
        let (addr, size, s, t) = block(i);
        let e = per_stack.entry(s).or_default();
        e.0 += 1;
        e.1 += size;
        if i % 2 == 1 {
            assert!(!by_addr.contains_key(&addr));
            continue;
        }
        let r = by_addr[&addr];
        assert_eq!((r.size, r.timestamp_us), (size, i));
        let stack = rr.stack(r.stack).unwrap();
        assert_eq!(stack.frames, frames(s));
        assert_eq!((stack.alloc_count, stack.alloc_bytes), per_stack_total(s));
        let thread = rr.thread(r.thread).unwrap();
        assert_eq!(
            (thread.tid, thread.name.as_str()),
            (1000 + t, thread_name(t).as_str())
        );
    }
    let cat = rr.stacks();
    assert_eq!(cat.partial, None);
    assert_eq!(cat.stacks.len(), 50);
    let (threads, partial) = rr.threads();
    assert_eq!(partial, None);
    assert_eq!(threads.len(), 4);

    let c = ar.counters();
    assert_eq!(c.live_blocks, BLOCKS / 2);
    let live: u64 = (0..BLOCKS).step_by(2).map(|i| block(i).1).sum();
    let total: u64 = (0..BLOCKS).map(|i| block(i).1).sum();
    assert_eq!(c.live_bytes, live);
    assert_eq!(c.total_allocs, BLOCKS);
    assert_eq!(c.total_bytes, total);
    assert_eq!(c.dropped[DroppedReason::Reentrant as usize], 1);
    let req = heapdump_table::header::read_request(&alloc.view());
    assert_eq!(req.count, 1);
    assert_eq!(req.name.as_deref(), Some("from-child"));
    assert_eq!(req.time_monotonic_ns, 12345);
}

fn per_stack_total(s: u64) -> (u64, u64) {
    (0..BLOCKS)
        .map(block)
        .filter(|b| b.2 == s)
        .fold((0, 0), |(n, b), x| (n + 1, b + x.1))
}

#[test]
fn parent_reads_child_regions_through_proc() {
    // Under an emulator (the aarch64 tests run in qemu-user, which cannot
    // run a guest program's exec of another guest program by itself),
    // the child goes through the same runner: HEAPDUMP_TEST_RUNNER, set by
    // scripts/aarch64-qemu.
    let runner = std::env::var("HEAPDUMP_TEST_RUNNER").unwrap_or_default();
    let mut argv: Vec<String> = runner.split_whitespace().map(str::to_string).collect();
    argv.push(std::env::current_exe().unwrap().display().to_string());
    let mut child = Command::new(&argv[0])
        .args(&argv[1..])
        .args(["--exact", "child", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, "1")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let pid = child.id();
    // Read the child's stdout on a thread so a silent child cannot hang us.
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if let Some(at) = line.find("READY ") {
                let _ = tx.send(line[at..].to_string());
            }
        }
    });
    let line = rx.recv_timeout(GUARD).expect("child never became ready");
    assert_eq!(line, format!("READY {pid}"));

    let paths = find_regions(pid);
    let res = RegionReader::open(&paths[&RegionKind::Resources], RegionKind::Resources).unwrap();
    let alloc =
        RegionReader::open(&paths[&RegionKind::Allocations], RegionKind::Allocations).unwrap();
    // Each region refuses to be read as the other kind.
    assert!(RegionReader::open(&paths[&RegionKind::Resources], RegionKind::Allocations).is_err());
    check(&res, &alloc, pid);

    // Let the child exit; the mappings stay readable and unchanged.
    drop(child.stdin.take());
    let (done_tx, done_rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = done_tx.send(child.wait());
    });
    let status = done_rx
        .recv_timeout(GUARD)
        .expect("child did not exit")
        .unwrap();
    assert!(status.success(), "child failed: {status}");
    check(&res, &alloc, pid);
}
