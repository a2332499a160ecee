//! Debian's `redis-server` (linked against `libjemalloc.so.2`), a service
//! nobody here wrote, under the preload agent through `heapdump run`:
//! loaded by `redis-benchmark -P 16` and snapshotted during the load and
//! after a `BGSAVE` fork, it keeps answering, every snapshot is clean, and
//! its own `INFO memory` matches a run without the agent at the same
//! point. Loopback only. Needs `redis-server`, `redis-cli` and
//! `redis-benchmark` (Debian's `redis-server` and `redis-tools`, installed
//! by `.ci/run`, where this test must run).

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use heapdump_tests::{real_dependency, HANG_GUARD};

fn have(cmd: &str) -> bool {
    Command::new(cmd)
        .arg("--version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// A loopback port nobody listens on right now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Redis {
    child: Child,
    port: u16,
    /// redis-server's own pid (under `heapdump run`, `child` is the
    /// dumper and redis its child).
    server_pid: u32,
}

impl Redis {
    /// Starts redis-server on loopback (with the agent through
    /// `heapdump run` when `agent`), and waits for its "Ready to accept
    /// connections" log line.
    fn start(agent: bool, dir: &Path) -> Redis {
        let port = free_port();
        let redis_args = [
            "redis-server".to_string(),
            "--port".into(),
            port.to_string(),
            "--bind".into(),
            "127.0.0.1".into(),
            "--save".into(),
            "".into(),
            "--appendonly".into(),
            "no".into(),
            "--dir".into(),
            dir.display().to_string(),
            "--enable-debug-command".into(),
            "local".into(),
            "--logfile".into(),
            "".into(),
        ];
        let mut cmd = if agent {
            let mut c = Command::new(common::bin());
            c.arg("run").arg("--").args(&redis_args);
            c
        } else {
            let mut c = Command::new(&redis_args[0]);
            c.args(&redis_args[1..]);
            c
        };
        cmd.env("HEAPDUMP_PRELOAD", heapdump_tests::preload_lib());
        let mut child = cmd
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("start redis-server");
        let out = child.stdout.take().unwrap();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut ready = Some(tx);
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if line.contains("Ready to accept connections") {
                    if let Some(tx) = ready.take() {
                        let _ = tx.send(());
                    }
                }
            }
        });
        rx.recv_timeout(HANG_GUARD)
            .expect("redis-server did not become ready");
        let mut r = Redis {
            child,
            port,
            server_pid: 0,
        };
        r.server_pid = r.info_u64("server", "process_id") as u32;
        r
    }

    fn cli(&self, args: &[&str]) -> String {
        let out = Command::new("redis-cli")
            .args(["-h", "127.0.0.1", "-p", &self.port.to_string()])
            .args(args)
            .output()
            .expect("run redis-cli");
        assert!(out.status.success(), "redis-cli {args:?}: {out:?}");
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    /// A field of `INFO SECTION`.
    fn info(&self, section: &str, field: &str) -> String {
        let info = self.cli(&["INFO", section]);
        info.lines()
            .find_map(|l| l.strip_prefix(&format!("{field}:")))
            .unwrap_or_else(|| panic!("no {field} in INFO {section}: {info}"))
            .trim()
            .to_string()
    }

    fn info_u64(&self, section: &str, field: &str) -> u64 {
        self.info(section, field).parse().expect("a number")
    }

    /// jemalloc's `stats.allocated` now (INFO's `allocator_allocated` is
    /// refreshed by redis's cron, so it can lag a moment behind).
    fn jemalloc_allocated(&self) -> u64 {
        assert!(!self
            .cli(&["DEBUG", "MALLCTL", "epoch", "1"])
            .trim()
            .is_empty());
        self.cli(&["DEBUG", "MALLCTL", "stats.allocated"])
            .trim()
            .parse()
            .expect("a number")
    }

    /// The same deterministic data set in every run.
    fn populate(&self) {
        assert_eq!(
            self.cli(&["DEBUG", "POPULATE", "100000", "key", "100"])
                .trim(),
            "OK"
        );
    }

    fn stop(mut self) {
        let _ = self.cli(&["SHUTDOWN", "NOSAVE"]);
        let status = self.child.wait().unwrap();
        assert!(status.success(), "redis exited with {status:?}");
    }
}

impl Drop for Redis {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            if self.server_pid != 0 {
                // SAFETY: kill(2) on the redis-server this test started (it
                // is still running: its parent has not been reaped).
                unsafe { libc::kill(self.server_pid as i32, libc::SIGKILL) };
            }
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// A JSON snapshot of `pid`, checked clean.
fn snapshot(pid: u32, dir: &Path, name: &str) -> serde_json::Value {
    let file = dir.join(format!("{name}.json"));
    let out = common::heapdump(&[
        "snapshot",
        &pid.to_string(),
        "--format",
        "json",
        "-o",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "snapshot {name}: {out:?}");
    let v: serde_json::Value = serde_json::from_slice(&std::fs::read(&file).unwrap()).unwrap();
    assert!(v["partial"].is_null(), "{name}: partial {}", v["partial"]);
    assert_eq!(v["dropped"]["total"], 0, "{name}: dropped {}", v["dropped"]);
    assert!(
        v["notes"].as_array().is_none_or(|n| n.is_empty()),
        "{name}: {}",
        v["notes"]
    );
    assert!(v["sites"].as_array().is_some_and(|s| !s.is_empty()));
    v
}

fn within(a: u64, b: u64, percent: u64) -> bool {
    a.abs_diff(b) * 100 <= b * percent
}

#[test]
fn redis_on_jemalloc_runs_under_the_agent_with_clean_snapshots_and_its_own_numbers() {
    if !real_dependency(
        "redis (redis-server, redis-tools)",
        have("redis-server") && have("redis-cli") && have("redis-benchmark"),
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("heapdump-redis-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();

    // Without the agent: redis's own numbers after the same data set.
    let bare = Redis::start(false, &dir);
    bare.populate();
    let bare_used = bare.info_u64("memory", "used_memory");
    let bare_alloc = bare.jemalloc_allocated();
    bare.stop();

    let redis = Redis::start(true, &dir);
    let pid = redis.server_pid;
    redis.populate();
    let used = redis.info_u64("memory", "used_memory");
    let alloc = redis.jemalloc_allocated();
    assert!(
        within(used, bare_used, 3) && within(alloc, bare_alloc, 3),
        "under the agent: used_memory {used}, jemalloc's stats.allocated {alloc}; \
         without: {bare_used}, {bare_alloc}"
    );
    // The agent's view of the same heap: requested sizes, so at most what
    // jemalloc reports (usable sizes), and most of it.
    let first = snapshot(pid, &dir, "populated");
    let live = first["totals"]["live_bytes"].as_u64().unwrap();
    assert!(
        live <= alloc + alloc / 20 && live >= alloc / 2,
        "heapdump sees {live} live bytes, jemalloc {alloc}"
    );

    // Snapshots while redis-benchmark loads it.
    let bench = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &redis.port.to_string()])
        .args(["-P", "16", "-n", "300000", "-t", "set,get,lpush,lpop", "-q"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run redis-benchmark");
    for i in 0..3 {
        snapshot(pid, &dir, &format!("load-{i}"));
        assert_eq!(redis.cli(&["PING"]).trim(), "PONG");
    }
    let out = bench.wait_with_output().unwrap();
    assert!(out.status.success(), "redis-benchmark: {out:?}");
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(report.contains("requests per second"), "{report}");
    // After the load the agent's records still agree with jemalloc's
    // numbers: LPOP shrinks a list node with a realloc on every request,
    // which jemalloc does in place and the agent records by rewriting the
    // block's record (a record left with a wrong size, or left behind,
    // would drift with every request).
    let loaded = snapshot(pid, &dir, "after-load");
    let live = loaded["totals"]["live_bytes"].as_u64().unwrap();
    let alloc = redis.jemalloc_allocated();
    assert!(
        live <= alloc + alloc / 20 && live >= alloc / 2,
        "after the load heapdump sees {live} live bytes, jemalloc {alloc}"
    );

    // A BGSAVE forks: the child writes the dump and must not touch the
    // parent's regions.
    assert!(redis.cli(&["BGSAVE"]).contains("Background saving started"));
    let start = Instant::now();
    while redis.info_u64("persistence", "rdb_bgsave_in_progress") != 0 {
        assert!(start.elapsed() < HANG_GUARD, "BGSAVE never finished");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(redis.info("persistence", "rdb_last_bgsave_status"), "ok");
    assert!(dir.join("dump.rdb").exists());
    snapshot(pid, &dir, "after-bgsave");
    assert!(redis.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap() >= 100_000);
    redis.stop();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Whether a client besides the one asking is connected (redis-benchmark
/// still running).
fn bench_running(redis: &Redis) -> bool {
    redis
        .cli(&["INFO", "clients"])
        .lines()
        .find_map(|l| l.strip_prefix("connected_clients:"))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 1)
}

#[test]
fn redis_started_bare_is_attached_under_load_records_what_follows_and_serves_on_after_detach() {
    if !real_dependency(
        "redis (redis-server, redis-tools)",
        have("redis-server") && have("redis-cli") && have("redis-benchmark"),
    ) {
        return;
    }
    let dir = std::env::temp_dir().join(format!("heapdump-redis-attach-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let redis = Redis::start(false, &dir);
    let pid = redis.server_pid;
    redis.populate();
    let bench = Command::new("redis-benchmark")
        .args(["-h", "127.0.0.1", "-p", &redis.port.to_string()])
        .args(["-P", "16", "-n", "600000", "-t", "set,get", "-q"])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run redis-benchmark");
    // Attached under load: once redis-benchmark's commands arrive (a
    // bounded poll of redis's own count, not a sleep).
    let commands = || -> u64 {
        redis
            .cli(&["INFO", "stats"])
            .lines()
            .find_map(|l| l.strip_prefix("total_commands_processed:"))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or(0)
    };
    let before = commands();
    let guard = std::time::Instant::now();
    while commands() < before + 20_000 {
        assert!(
            guard.elapsed() < heapdump_tests::HANG_GUARD,
            "the load never started"
        );
        std::thread::yield_now();
    }
    let lib = heapdump_tests::preload_lib();
    let out = common::heapdump(&[
        "attach",
        &pid.to_string(),
        "--library",
        lib.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "attach: {}", common::stderr(&out));
    // A 1 MiB value made after the attach is seen.
    let value = dir.join("value");
    std::fs::write(&value, vec![b'v'; 1 << 20]).unwrap();
    let set = Command::new("redis-cli")
        .args([
            "-h",
            "127.0.0.1",
            "-p",
            &redis.port.to_string(),
            "-x",
            "SET",
            "big",
        ])
        .stdin(std::fs::File::open(&value).unwrap())
        .output()
        .unwrap();
    assert!(set.status.success(), "{set:?}");
    let j = snapshot(pid, &dir, "attached");
    let biggest = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s["live_bytes"].as_u64().unwrap())
        .max()
        .unwrap_or(0);
    assert!(
        biggest >= 1 << 20,
        "the 1 MiB value: biggest site {biggest}"
    );
    // The 100 000 keys from before the attach are not counted.
    assert!(
        j["totals"]["live_blocks"].as_u64().unwrap() < 100_000,
        "{}",
        j["totals"]
    );
    assert!(j["recording"]["attached_at"].is_string());
    // The load ran on while attached.
    let attached = commands();
    let guard = std::time::Instant::now();
    while commands() < attached + 20_000 && bench_running(&redis) {
        assert!(
            guard.elapsed() < heapdump_tests::HANG_GUARD,
            "the load stalled while attached"
        );
        std::thread::yield_now();
    }
    let out = common::heapdump(&["detach", &pid.to_string()]);
    assert!(out.status.success(), "detach: {}", common::stderr(&out));
    assert_eq!(redis.cli(&["PING"]).trim(), "PONG");
    let out = bench.wait_with_output().unwrap();
    assert!(out.status.success(), "redis-benchmark: {out:?}");
    assert_eq!(redis.cli(&["STRLEN", "big"]).trim(), (1 << 20).to_string());
    assert!(redis.cli(&["DBSIZE"]).trim().parse::<u64>().unwrap() >= 100_000);
    redis.stop();
    let _ = std::fs::remove_dir_all(&dir);
}
