//! Test helpers: the fake target process and running `heapdump`.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::Duration;

/// Hang guard for any single wait in a test.
pub const HANG_GUARD: Duration = Duration::from_secs(120);

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_heapdump")
}

/// Reads lines of a child's stdout (or stderr) on a thread, so tests can
/// wait for a line with a hang guard.
pub struct Lines {
    rx: mpsc::Receiver<String>,
}

impl Lines {
    pub fn new(out: impl std::io::Read + Send + 'static) -> Self {
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Lines { rx }
    }

    /// The next line (panics after the hang guard or at end of output).
    pub fn next(&self) -> String {
        self.rx
            .recv_timeout(HANG_GUARD)
            .expect("expected a line from the child (hang guard or EOF)")
    }

    /// Next line, or None at end of output.
    pub fn next_or_eof(&self) -> Option<String> {
        match self.rx.recv_timeout(HANG_GUARD) {
            Ok(l) => Some(l),
            Err(mpsc::RecvTimeoutError::Disconnected) => None,
            Err(e) => panic!("hang guard: {e}"),
        }
    }
}

/// The fake instrumented process (`heapdump __fake-target`).
pub struct FakeTarget {
    pub child: Child,
    pub stdin: Option<ChildStdin>,
    pub lines: Lines,
}

impl FakeTarget {
    pub fn start(args: &[&str]) -> FakeTarget {
        let mut child = Command::new(bin())
            .arg("__fake-target")
            .args(args)
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .expect("start fake target");
        let stdin = child.stdin.take();
        let lines = Lines::new(child.stdout.take().expect("stdout"));
        let ready = lines.next();
        assert_eq!(ready, "ready");
        FakeTarget {
            child,
            stdin,
            lines,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends a command and waits for its `ok`.
    pub fn cmd(&mut self, line: &str) {
        let stdin = self.stdin.as_mut().expect("stdin open");
        writeln!(stdin, "{line}").expect("write command");
        stdin.flush().expect("flush");
        assert_eq!(self.lines.next(), "ok");
    }

    pub fn kill9(&mut self) {
        self.child.kill().expect("SIGKILL");
        self.child.wait().expect("reap");
    }
}

impl Drop for FakeTarget {
    fn drop(&mut self) {
        drop(self.stdin.take());
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Runs heapdump to completion.
pub fn heapdump(args: &[&str]) -> Output {
    Command::new(bin())
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("run heapdump")
}

pub fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

pub fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// A fresh temporary directory under the target dir (removed on drop).
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new(name: &str) -> TempDir {
        let dir = std::env::temp_dir().join(format!(
            "heapdump-test-{}-{name}-{}",
            std::process::id(),
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos()
        ));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.0.join(name)
    }

    pub fn str(&self, name: &str) -> String {
        self.path(name).display().to_string()
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

pub fn read_json(path: &Path) -> serde_json::Value {
    serde_json::from_slice(&std::fs::read(path).expect("read json")).expect("parse json")
}

/// Whether `go` can be used; with HEAPDUMP_REQUIRE_GO=1 a missing `go`
/// fails the test instead of skipping its Go part.
pub fn go_available() -> bool {
    let ok = Command::new("go")
        .arg("version")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !ok && std::env::var("HEAPDUMP_REQUIRE_GO").as_deref() == Ok("1") {
        panic!("HEAPDUMP_REQUIRE_GO=1 but `go` is not installed (apt-get install golang-go)");
    }
    if !ok {
        eprintln!("note: `go` not installed; skipping the go tool pprof check");
    }
    ok
}

/// Runs `go tool pprof ARGS` and returns stdout (panics on failure).
pub fn go_pprof(args: &[&str]) -> String {
    let mut cmd = Command::new("go");
    cmd.arg("tool").arg("pprof").args(args);
    if std::env::var_os("HOME").is_none() {
        cmd.env("HOME", std::env::temp_dir());
    }
    let out = cmd.output().expect("run go tool pprof");
    assert!(
        out.status.success(),
        "go tool pprof {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The memory curve of a JSON snapshot: (live bytes, RFC 3339 time) per
/// point, oldest first.
pub fn curve_points(j: &serde_json::Value) -> Vec<(u64, String)> {
    j["timeline"]
        .as_array()
        .expect("a timeline")
        .iter()
        .map(|p| {
            (
                p["live_bytes"].as_u64().unwrap(),
                p["time"].as_str().unwrap().to_string(),
            )
        })
        .collect()
}

/// The highest point of a JSON snapshot's curve, in live bytes.
pub fn curve_max(j: &serde_json::Value) -> u64 {
    curve_points(j)
        .into_iter()
        .map(|(b, _)| b)
        .max()
        .expect("a point")
}

/// Live (blocks, bytes) by leaf function (the first frame's function) of a
/// JSON snapshot, summed over its sites.
pub fn live_by_leaf(j: &serde_json::Value) -> std::collections::BTreeMap<String, (u64, u64)> {
    let mut t = std::collections::BTreeMap::<String, (u64, u64)>::new();
    for s in j["sites"].as_array().expect("sites") {
        let leaf = s["frames"][0]["function"]
            .as_str()
            .unwrap_or("")
            .to_string();
        let e = t.entry(leaf).or_default();
        e.0 += s["live_blocks"].as_u64().unwrap();
        e.1 += s["live_bytes"].as_u64().unwrap();
    }
    t
}

/// Live blocks of a JSON snapshot's sites that have `function` among
/// their frames.
pub fn live_blocks_through(j: &serde_json::Value, function: &str) -> u64 {
    live_blocks_with_frame(j, |f| f["function"].as_str() == Some(function))
}

/// Live blocks of the sites of JSON snapshot `j` with a frame for which
/// `frame` holds.
pub fn live_blocks_with_frame(
    j: &serde_json::Value,
    frame: impl Fn(&serde_json::Value) -> bool,
) -> u64 {
    j["sites"]
        .as_array()
        .expect("sites")
        .iter()
        .filter(|s| s["frames"].as_array().is_some_and(|f| f.iter().any(&frame)))
        .map(|s| s["live_blocks"].as_u64().unwrap_or(0))
        .sum()
}

/// The `HOST:PORT` of `heapdump serve`'s first line
/// (`listening on http://HOST:PORT/...`).
pub fn listening_addr(line: &str) -> String {
    line.strip_prefix("listening on http://")
        .unwrap_or_else(|| panic!("not serve's first line: {line}"))
        .split('/')
        .next()
        .unwrap()
        .to_string()
}

/// An HTTP/1.0 `GET` of `path` at `addr` with extra `headers` (each line
/// ending in CRLF): the response's head and body.
pub fn http_get_with(addr: &str, path: &str, headers: &str) -> (String, Vec<u8>) {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(HANG_GUARD)).unwrap();
    write!(s, "GET {path} HTTP/1.0\r\nHost: {addr}\r\n{headers}\r\n").unwrap();
    let mut resp = Vec::new();
    s.read_to_end(&mut resp).unwrap();
    let split = resp
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&resp[..split]).into_owned();
    (head, resp[split + 4..].to_vec())
}

/// The value of the first sample of `metric` in a `/metrics` text whose
/// labels contain every one of `labels` (`name="value"` strings).
pub fn sample(text: &str, metric: &str, labels: &[&str]) -> Option<f64> {
    text.lines()
        .filter(|l| l.starts_with(&format!("{metric}{{")))
        .find(|l| labels.iter().all(|want| l.contains(want)))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

/// A child process killed and reaped when dropped, so that a test that
/// fails while its `watch` or `serve` runs leaves none behind (one would
/// go on adopting other tests' processes and hold the test's output
/// open). Derefs to the [`std::process::Child`].
pub struct KilledOnDrop(pub std::process::Child);

impl std::ops::Deref for KilledOnDrop {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for KilledOnDrop {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for KilledOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}
