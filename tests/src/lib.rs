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
    static BUILT: std::sync::Mutex<Vec<(String, PathBuf)>> = std::sync::Mutex::new(Vec::new());
    let mut built = BUILT.lock().unwrap_or_else(|e| e.into_inner());
    if let Some((_, p)) = built.iter().find(|(n, _)| n == name) {
        return p.clone();
    }
    let p = compile_c_uncached(name);
    built.push((name.to_string(), p.clone()));
    p
}

fn compile_c_uncached(name: &str) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("c");
    let (src, compiler) = if dir.join(format!("{name}.cpp")).exists() {
        (dir.join(format!("{name}.cpp")), "g++")
    } else {
        (dir.join(format!("{name}.c")), "cc")
    };
    let out_dir = profile_dir().join("c-test-programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    // One output per test process avoids races between test binaries.
    let out = out_dir.join(format!("{name}-{}", std::process::id()));
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
        .status()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(status.success(), "{compiler} failed for {}", src.display());
    out
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
