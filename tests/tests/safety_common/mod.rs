//! Helpers shared by the `safety_*` tests: the built `heapdump` binary, and
//! running it under a hang guard.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;

use heapdump_tests::{profile_dir, HANG_GUARD};

/// Path of a binary built by `cargo build --workspace` (heapdump, tests'
/// bins).
pub fn built_bin(name: &str) -> PathBuf {
    let p = profile_dir().join(name);
    assert!(
        p.exists(),
        "{} is missing: run `cargo build --workspace` before `cargo test`",
        p.display()
    );
    p
}

/// The `heapdump` binary.
pub fn heapdump() -> PathBuf {
    built_bin("heapdump")
}

/// What a finished dumper run left.
#[derive(Debug)]
pub struct Run {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

impl Run {
    /// Exit code; panics (with the output) if the process died by a signal.
    pub fn code(&self) -> i32 {
        match self.status.code() {
            Some(c) => c,
            None => panic!(
                "heapdump died by a signal: {:?}\n{}",
                self.status, self.stderr
            ),
        }
    }
}

/// Runs `cmd` to completion; if it has not ended after [`HANG_GUARD`], it is
/// killed and the test fails (a hang guard, never synchronisation).
pub fn run_guarded(mut cmd: Command) -> Run {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let child = cmd.spawn().expect("spawn");
    let pid = child.id();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(HANG_GUARD) {
        Ok(out) => {
            let out = out.expect("wait");
            Run {
                status: out.status,
                stdout: String::from_utf8_lossy(&out.stdout).into_owned(),
                stderr: String::from_utf8_lossy(&out.stderr).into_owned(),
            }
        }
        Err(_) => {
            // SAFETY: kill(2) on the pid of our own child, which has not
            // been reaped (the waiting thread is still blocked on it).
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("hang: {cmd:?} did not finish within {HANG_GUARD:?}");
        }
    }
}

/// A fresh scratch directory for one test.
pub fn scratch(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("heapdump-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `heapdump snapshot PID --format json -o OUT` (plus `extra` flags).
pub fn snapshot_json(pid: u32, out: &std::path::Path, extra: &[&str]) -> Run {
    let mut cmd = Command::new(heapdump());
    cmd.arg("snapshot")
        .arg(pid.to_string())
        .args(["--format", "json", "-o"])
        .arg(out)
        .args(extra);
    run_guarded(cmd)
}

/// Checks the contract for one snapshot run: 0 (clean file), 2 (file marked
/// partial), or 1 with an error message; never a signal.
pub fn check_outcome(run: &Run, out: &std::path::Path) -> i32 {
    let code = run.code();
    match code {
        0 | 2 => {
            let text = std::fs::read_to_string(out)
                .unwrap_or_else(|e| panic!("exit {code} but no snapshot file ({e}): {run:?}"));
            assert!(
                text.contains("\"format\": \"heapdump-snapshot\""),
                "{text:.200}"
            );
            let clean = text.contains("\"partial\": null");
            assert_eq!(clean, code == 0, "exit {code} vs partial field: {run:?}");
            if code == 2 {
                assert!(run.stderr.contains("PARTIAL"), "{run:?}");
            }
        }
        1 => {
            let msg = run
                .stderr
                .lines()
                .find(|l| l.starts_with("heapdump: error: "))
                .unwrap_or_else(|| panic!("exit 1 without an error line: {run:?}"));
            assert!(msg.len() > "heapdump: error: ".len() + 10, "{msg}");
            assert!(!run.stderr.contains("panicked"), "{run:?}");
        }
        c => panic!("unexpected exit {c}: {run:?}"),
    }
    let _ = std::fs::remove_file(out);
    code
}
