//! Helpers for heapdump's whole-process tests: locating the built agent,
//! compiling C test programs, spawning instrumented children, reading their
//! regions from outside with `heapdump-table`'s readers, and mapping stack
//! frames back to the test programs' functions (`nm`) for ground truth.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use heapdump_table::header::{read_request, SnapshotRequest};
use heapdump_table::{
    AllocationsReader, Counters, RegionKind, RegionReader, ResourcesReader, ThreadRecord,
};

/// Generous guard against hangs (never used as synchronisation).
pub const HANG_GUARD: Duration = Duration::from_secs(120);

/// The cargo profile directory the tests run from (`target/debug`).
pub fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("current exe");
    let mut dir = exe.parent().expect("exe dir").to_path_buf();
    if dir.ends_with("deps") {
        dir.pop();
    }
    dir
}

/// Path of `libheapdump_preload.so` built by `cargo build --workspace`.
pub fn preload_lib() -> PathBuf {
    let p = profile_dir().join("libheapdump_preload.so");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test` (README's test command does)",
        p.display()
    );
    p
}

/// Compiles `tests/c/NAME.c` or `NAME.cpp` (with frame pointers, non-PIE) into the
/// profile directory once per test process and returns its path.
pub fn compile_c(name: &str) -> PathBuf {
    compile_cached(name, name, &[])
}

/// Compiles `tests/c/NAME.c` or `NAME.cpp` like [`compile_c`], with
/// `extra` compiler arguments (defines, libraries), under the name
/// `NAME-VARIANT`.
pub fn compile_c_variant(name: &str, variant: &str, extra: &[&str]) -> PathBuf {
    compile_cached(name, &format!("{name}-{variant}"), extra)
}

/// Compiles once per test process and output name.
fn compile_cached(name: &str, out_name: &str, extra: &[&str]) -> PathBuf {
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = built.iter().find(|(n, _)| n == out_name) {
        return p.clone();
    }
    let p = compile_c_with(name, out_name, extra);
    built.push((out_name.to_string(), p.clone()));
    p
}

fn compile_c_with(name: &str, out_name: &str, extra: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("c");
    let (src, compiler) = if dir.join(format!("{name}.cpp")).exists() {
        (dir.join(format!("{name}.cpp")), "g++")
    } else {
        (dir.join(format!("{name}.c")), "cc")
    };
    let out_dir = profile_dir().join("c-test-programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    // One output per test process avoids races between test binaries.
    let out = out_dir.join(format!("{out_name}-{}", std::process::id()));
    let status = Command::new(compiler)
        .args([
            "-O1",
            "-g",
            "-fno-omit-frame-pointer",
            "-no-pie",
            "-pthread",
        ])
        // The preload agent's C header (heapdump.h).
        .arg(format!(
            "-I{}",
            Path::new(env!("CARGO_MANIFEST_DIR"))
                .join("../agent/preload/include")
                .display()
        ))
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .args(extra)
        .arg("-ldl")
        .status()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(status.success(), "{compiler} failed for {}", src.display());
    out
}

/// Path of `libheapdump_jemalloc.so` (the companion for jemalloc's
/// `*allocx` calls) built by `cargo build --workspace`.
pub fn jemalloc_companion_lib() -> PathBuf {
    let p = profile_dir().join("libheapdump_jemalloc.so");
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace`",
        p.display()
    );
    p
}

/// Set by `.ci/run`: tests that need real programs and libraries from
/// Debian's packages (redis, jemalloc, tcmalloc, mimalloc, python3) fail
/// when they are missing instead of being skipped.
pub const REQUIRE_REAL_ENV: &str = "HEAPDUMP_REQUIRE_REAL_PROGRAMS";

/// Whether a test that needs `what` can run: true if `present`; else a
/// skip note on stderr, or a panic when [`REQUIRE_REAL_ENV`] is set.
pub fn real_dependency(what: &str, present: bool) -> bool {
    if present {
        return true;
    }
    if std::env::var_os(REQUIRE_REAL_ENV).is_some_and(|v| v == "1") {
        panic!("{what} is missing and {REQUIRE_REAL_ENV}=1 (.ci/run installs it)");
    }
    eprintln!("skipping: {what} is not installed");
    false
}

/// A shared library of the system by file name (Debian's multiarch
/// directories first).
pub fn system_lib(name: &str) -> Option<PathBuf> {
    [
        "/usr/lib/x86_64-linux-gnu",
        "/lib/x86_64-linux-gnu",
        "/usr/lib/aarch64-linux-gnu",
        "/usr/lib64",
        "/usr/lib",
    ]
    .iter()
    .map(|d| Path::new(d).join(name))
    .find(|p| p.exists())
}

/// True when a C header is installed (`/usr/include/PATH`).
pub fn has_header(path: &str) -> bool {
    Path::new("/usr/include").join(path).exists()
}

/// A child process that prints `ready ...` once its pattern is in place
/// and then waits for a line on stdin.
pub struct Target {
    /// The process.
    pub child: Child,
    stdin: Option<ChildStdin>,
    lines: mpsc::Receiver<String>,
    last: String,
}

impl Target {
    /// Spawns `cmd` (stdout piped) and waits for its `ready` line.
    pub fn spawn(cmd: Command) -> Target {
        Self::spawn_until(cmd, "ready")
    }

    /// Spawns `cmd` (stdout piped) and waits for a line starting with
    /// `prefix` (see [`Self::last_line`]).
    pub fn spawn_until(mut cmd: Command, prefix: &str) -> Target {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
        let mut child = cmd.spawn().expect("spawn target");
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let stdin = child.stdin.take();
        let mut t = Target {
            child,
            stdin,
            lines: rx,
            last: String::new(),
        };
        t.wait_line(prefix);
        t
    }

    /// The last line returned by a wait.
    pub fn last_line(&self) -> &str {
        &self.last
    }

    /// The pid the last line names as its second word (`ready PID`,
    /// `child PID`), if it does.
    pub fn line_pid(&self) -> Option<u32> {
        self.last.split_whitespace().nth(1)?.parse().ok()
    }

    /// Waits for a stdout line starting with `prefix` and returns it.
    pub fn wait_line(&mut self, prefix: &str) -> String {
        loop {
            match self.lines.recv_timeout(HANG_GUARD) {
                Ok(l) if l.starts_with(prefix) => {
                    self.last = l.clone();
                    return l;
                }
                Ok(_) => continue,
                Err(e) => {
                    let _ = self.child.kill();
                    panic!("target did not print {prefix:?}: {e}");
                }
            }
        }
    }

    /// Pid of the child.
    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a line on the child's stdin.
    pub fn send(&mut self, line: &str) {
        let s = self.stdin.as_mut().expect("stdin");
        // One write, so a reader that takes one read(2) gets the whole line.
        if let Err(e) = s.write_all(format!("{line}\n").as_bytes()) {
            let status = self.child.try_wait();
            panic!("cannot write to the target's stdin ({e}); target status: {status:?}");
        }
    }

    /// Releases the child (closes stdin) and waits for it to exit.
    pub fn finish(mut self) -> std::process::ExitStatus {
        drop(self.stdin.take());
        self.child.wait().unwrap()
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// `/proc/PID/fd` paths of the process's regions (resources, allocations).
pub fn find_regions(pid: u32) -> Option<(PathBuf, PathBuf)> {
    let mut res = None;
    let mut alloc = None;
    for e in std::fs::read_dir(format!("/proc/{pid}/fd")).ok()? {
        let Ok(e) = e else { continue };
        let Ok(target) = std::fs::read_link(e.path()) else {
            continue;
        };
        match RegionKind::from_link_target(&target.to_string_lossy()) {
            Some(RegionKind::Resources) => res = Some(e.path()),
            Some(RegionKind::Allocations) => alloc = Some(e.path()),
            None => {}
        }
    }
    Some((res?, alloc?))
}

/// One live block as read from outside.
#[derive(Clone, Debug)]
pub struct LiveBlock {
    /// Address.
    pub address: u64,
    /// Size.
    pub size: u64,
    /// Return addresses, leaf first.
    pub frames: Vec<u64>,
    /// Thread record.
    pub thread: ThreadRecord,
}

/// Everything read from a process's regions.
#[derive(Debug)]
pub struct Dump {
    /// Live blocks.
    pub blocks: Vec<LiveBlock>,
    /// Header counters.
    pub counters: Counters,
    /// Snapshot request slot.
    pub request: SnapshotRequest,
    /// Writer pid in the allocations header.
    pub writer_pid: u32,
    /// Walk incomplete?
    pub partial: Option<String>,
}

/// Reads a live process's regions through `/proc/PID/fd`.
pub fn dump(pid: u32) -> Dump {
    let (res_path, alloc_path) = find_regions(pid).expect("target has heapdump regions");
    let res_region = RegionReader::open(&res_path, RegionKind::Resources).expect("open resources");
    let alloc_region =
        RegionReader::open(&alloc_path, RegionKind::Allocations).expect("open allocations");
    let res = ResourcesReader::new(&res_region).unwrap();
    let alloc = AllocationsReader::new(&alloc_region).unwrap();
    let (records, stats) = alloc.snapshot();
    let mut threads = HashMap::new();
    let mut blocks = Vec::with_capacity(records.len());
    for r in records {
        let stack = res.stack(r.stack).expect("valid stack key");
        let thread = threads
            .entry(r.thread)
            .or_insert_with(|| res.thread(r.thread).expect("valid thread key"))
            .clone();
        blocks.push(LiveBlock {
            address: r.address,
            size: r.size,
            frames: stack.frames,
            thread,
        });
    }
    Dump {
        blocks,
        counters: alloc.counters(),
        request: read_request(&alloc_region.view()),
        writer_pid: alloc_region.header().writer_pid,
        partial: stats.partial_reason(),
    }
}

/// Function symbols of an executable, relocated for a running process.
pub struct Symbols {
    funcs: Vec<(u64, u64, String)>,
}

impl Symbols {
    /// Reads `nm -S -C` of `exe` and relocates by the load base found in
    /// `/proc/PID/maps` when the executable is position-independent.
    pub fn of_process(exe: &Path, pid: u32) -> Symbols {
        let bytes = std::fs::read(exe).unwrap();
        let is_pie = u16::from_le_bytes([bytes[16], bytes[17]]) == 3; // ET_DYN
        let base = if is_pie {
            let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
            let canon = std::fs::canonicalize(exe).unwrap();
            maps.lines()
                .find(|l| l.ends_with(canon.to_str().unwrap()))
                .and_then(|l| {
                    let range = l.split_whitespace().next()?;
                    u64::from_str_radix(range.split('-').next()?, 16).ok()
                })
                .expect("executable mapped")
        } else {
            0
        };
        let out = Command::new("nm")
            .args(["-S", "-C", "--defined-only"])
            .arg(exe)
            .output()
            .expect("run nm");
        let mut funcs = Vec::new();
        for line in String::from_utf8_lossy(&out.stdout).lines() {
            let mut parts = line.splitn(4, ' ');
            let (Some(a), Some(s), Some(kind), Some(name)) =
                (parts.next(), parts.next(), parts.next(), parts.next())
            else {
                continue;
            };
            if !matches!(kind, "T" | "t") {
                continue;
            }
            let (Ok(a), Ok(s)) = (u64::from_str_radix(a, 16), u64::from_str_radix(s, 16)) else {
                continue;
            };
            funcs.push((base + a, s, name.to_string()));
        }
        Symbols { funcs }
    }

    /// Name of the function containing return address `ret`.
    pub fn function_of(&self, ret: u64) -> Option<&str> {
        let pc = ret.wrapping_sub(1);
        self.funcs
            .iter()
            .find(|(a, s, _)| pc >= *a && pc < a + s)
            .map(|(_, _, n)| n.as_str())
    }

    /// The first frame (leaf first) whose function name contains `needle`,
    /// as that function's name.
    pub fn site<'a>(&'a self, frames: &[u64], needle: &str) -> Option<&'a str> {
        frames
            .iter()
            .filter_map(|f| self.function_of(*f))
            .find(|n| n.contains(needle))
    }
}

/// Live blocks grouped by site: site name -> (blocks, bytes, sizes seen,
/// thread names seen).
pub type SiteTable = HashMap<String, (u64, u64, Vec<u64>, Vec<String>)>;

/// Groups a dump's blocks by the first frame whose function name contains
/// `needle` (e.g. `site_`); blocks from elsewhere are left out.
pub fn by_site(d: &Dump, syms: &Symbols, needle: &str) -> SiteTable {
    let mut t: SiteTable = HashMap::new();
    for b in &d.blocks {
        if let Some(site) = syms.site(&b.frames, needle) {
            let site = site.replace("::{{closure}}", "");
            let short = site
                .rsplit("::")
                .next()
                .unwrap_or(&site)
                .trim_end_matches("()")
                .to_string();
            let e = t.entry(short).or_default();
            e.0 += 1;
            e.1 += b.size;
            if !e.2.contains(&b.size) {
                e.2.push(b.size);
            }
            if !e.3.contains(&b.thread.name) {
                e.3.push(b.thread.name.clone());
            }
        }
    }
    t
}

/// Asserts a site of `t` has exactly `blocks` blocks of `size` bytes, all
/// allocated by thread `thread`.
pub fn expect_site(t: &SiteTable, site: &str, blocks: u64, size: u64, thread: &str) {
    let Some((n, bytes, sizes, threads)) = t.get(site) else {
        panic!("site {site} missing from {t:#?}");
    };
    assert_eq!(*n, blocks, "{site}: blocks ({t:#?})");
    assert_eq!(*bytes, blocks * size, "{site}: bytes {sizes:?}");
    assert_eq!(sizes, &vec![size], "{site}: sizes");
    assert_eq!(threads, &vec![thread.to_string()], "{site}: threads");
}

/// Runs `cmd`, the C pattern (`tests/c/pattern.c`, built as `exe`) under
/// the preload agent, and checks its exact live set: every site's blocks,
/// sizes and thread, the header counters, no dropped event.
pub fn check_c_pattern_run(exe: &Path, cmd: Command) {
    let target = Target::spawn(cmd);
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.writer_pid, pid);
    assert_eq!(d.partial, None);
    let syms = Symbols::of_process(exe, pid);
    let t = by_site(&d, &syms, "site_");
    expect_site(&t, "site_malloc", 100, 1000, "pattern-main");
    expect_site(&t, "site_calloc", 50, 24, "pattern-main");
    expect_site(&t, "site_realloc", 10, 4096, "pattern-main");
    expect_site(&t, "site_free_half", 100, 32, "pattern-main");
    expect_site(&t, "site_reallocarray", 7, 120, "pattern-main");
    expect_site(&t, "site_thread1", 30, 512, "worker-1");
    expect_site(&t, "site_thread2", 20, 2048, "worker-2");
    let (n, bytes, _, _) = t.get("site_aligned").expect("aligned site");
    assert_eq!((*n, *bytes), (20, 5 * (200 + 256 + 300 + 100)));
    assert!(!t.contains_key("site_freed_all"), "freed blocks reported");
    // Header counters agree with the table.
    let live: u64 = d.blocks.iter().map(|b| b.size).sum();
    assert_eq!(d.counters.live_bytes, live);
    assert_eq!(d.counters.live_blocks, d.blocks.len() as u64);
    assert!(
        d.counters.total_allocs >= 100 + 50 + 20 + 200 + 20 + 7 + 300 + 50,
        "{:?}",
        d.counters
    );
    assert!(d.counters.peak_live_bytes >= live);
    assert_eq!(d.counters.dropped_total(), 0, "{:?}", d.counters.dropped);
    // Addresses are unique.
    let mut addrs: Vec<u64> = d.blocks.iter().map(|b| b.address).collect();
    addrs.sort_unstable();
    addrs.dedup();
    assert_eq!(addrs.len(), d.blocks.len());
    assert!(target.finish().success());
}
