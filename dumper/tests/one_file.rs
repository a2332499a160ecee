//! One file for a host: the `heapdump` executable with the agent libraries
//! appended (`heapdump __bundle`, what `scripts/release` ships), copied
//! alone into an empty directory, runs a program under the agent, attaches
//! to a running one and snapshots both, with no library beside it and no
//! `HEAPDUMP_PRELOAD`; a damaged bundle is a clear error.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use heapdump_tests::{compile_c, jemalloc_companion_lib, preload_lib, Target};

/// A bundle in a directory of its own, holding nothing else.
fn bundle(dir: &TempDir) -> PathBuf {
    let out = dir.path("heapdump");
    let o = heapdump(&[
        "__bundle",
        "--preload",
        preload_lib().to_str().unwrap(),
        "--jemalloc",
        jemalloc_companion_lib().to_str().unwrap(),
        "-o",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let entries: Vec<_> = std::fs::read_dir(&dir.0).unwrap().collect();
    assert_eq!(entries.len(), 1, "the directory holds only the bundle");
    out
}

/// Runs the bundled `heapdump` with nothing pointing it at a library.
fn run_bundled(exe: &Path, args: &[&str]) -> Output {
    Command::new(exe)
        .args(args)
        .env_remove("HEAPDUMP_PRELOAD")
        .env_remove("LD_PRELOAD")
        .stdin(Stdio::null())
        .output()
        .expect("run the bundled heapdump")
}

/// The bundle's JSON snapshot of an attach_target that ran `alloc`, by
/// leaf function, its 50 blocks at site_after_malloc checked.
fn after_alloc_sites(
    exe: &Path,
    pid: u32,
    dir: &TempDir,
    name: &str,
) -> std::collections::BTreeMap<String, (u64, u64)> {
    let file = dir.str(&format!("{name}.json"));
    let o = run_bundled(exe, &["snapshot", &pid.to_string(), "-o", &file]);
    assert!(o.status.success(), "{}", stderr(&o));
    let sites = live_by_leaf(&read_json(&dir.path(&format!("{name}.json"))));
    assert_eq!(
        sites.get("site_after_malloc"),
        Some(&(50, 50_000)),
        "{name}: {sites:#?}"
    );
    sites
}

/// The agent library the process mapped: the very library the bundle
/// carries, written out into a directory whose path starts with `under`.
fn mapped_agent_is_the_bundled_one(pid: u32, under: &str) {
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let path = maps
        .lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .find(|p| p.ends_with("/libheapdump_preload.so"))
        .unwrap_or_else(|| panic!("no agent mapped in {pid}:\n{maps}"))
        .to_string();
    assert!(
        path.starts_with(under),
        "the agent was loaded from {path}, not from the bundle's copy under {under}"
    );
    assert_eq!(
        std::fs::read(&path).unwrap(),
        std::fs::read(preload_lib()).unwrap(),
        "{path} is not the library the bundle carries"
    );
}

#[test]
fn the_bundled_heapdump_alone_runs_attaches_and_snapshots_a_c_program() {
    let home = TempDir::new("one-file");
    let exe = bundle(&home);
    let v = run_bundled(&exe, &["--version"]);
    assert!(
        stdout(&v).contains("agent libraries carried in this file"),
        "{}",
        stdout(&v)
    );
    let out = TempDir::new("one-file-out");

    // run: the program is recorded from its start.
    let mut cmd = Command::new(&exe);
    cmd.args(["run", "--", compile_c("attach_target").to_str().unwrap()])
        .env_remove("HEAPDUMP_PRELOAD")
        .env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    // The program's own pid (heapdump run is its parent).
    let pid: u32 = t.last_line()["ready ".len()..].trim().parse().unwrap();
    t.send("alloc");
    t.wait_line("allocated");
    mapped_agent_is_the_bundled_one(pid, "/tmp/heapdump-agent-");
    after_alloc_sites(&exe, pid, &out, "run");
    t.send("quit");
    t.wait_line("eintr ");
    assert!(t.finish().success());

    // attach: a process started bare.
    let mut cmd = Command::new(compile_c("attach_target"));
    cmd.env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    let pid = t.pid();
    let o = run_bundled(&exe, &["attach", &pid.to_string()]);
    assert!(o.status.success(), "attach failed: {}", stderr(&o));
    t.send("alloc");
    t.wait_line("allocated");
    mapped_agent_is_the_bundled_one(pid, "/tmp/heapdump-agent-");
    let sites = after_alloc_sites(&exe, pid, &out, "attach");
    assert_eq!(sites.get("pre_attach"), None, "{sites:#?}");
    let o = run_bundled(&exe, &["detach", &pid.to_string()]);
    assert!(o.status.success(), "detach failed: {}", stderr(&o));
    t.send("quit");
    assert_eq!(t.wait_line("eintr "), "eintr 0");
    assert!(t.finish().success());
}

#[test]
fn a_damaged_bundle_is_refused_with_a_clear_error_and_runs_nothing() {
    let home = TempDir::new("one-file-damaged");
    let exe = bundle(&home);
    let mut bytes = std::fs::read(&exe).unwrap();
    // A byte inside the carried libraries (just before the footer and the
    // jemalloc companion's last bytes).
    let n = bytes.len();
    bytes[n - 64 - 100] ^= 0xff;
    let damaged = home.path("damaged");
    std::fs::write(&damaged, &bytes).unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&damaged, std::fs::Permissions::from_mode(0o755)).unwrap();
    let marker = home.path("ran");
    let o = run_bundled(&damaged, &["run", "--", "touch", marker.to_str().unwrap()]);
    assert!(!o.status.success());
    let e = stderr(&o);
    assert!(e.contains("damaged") && e.contains("checksum"), "{e}");
    assert!(!marker.exists(), "the program ran without its agent");
}

#[test]
fn where_tmp_is_mounted_noexec_the_libraries_go_to_var_tmp() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !heapdump_tests::real_dependency(
        "root and unshare (a private mount namespace)",
        root && Path::new("/usr/bin/unshare").exists(),
    ) {
        return;
    }
    // Outside /tmp (a tmpfs is mounted over it below, and the checkout
    // itself may be under /tmp), with no agent library in the directory
    // or its parent (where `run` would otherwise find one).
    let top = Path::new("/var/tmp").join(format!("heapdump-test-noexec-{}", std::process::id()));
    let home = top.join("bin-dir");
    let _ = std::fs::remove_dir_all(&home);
    std::fs::create_dir_all(&home).unwrap();
    let tmp_home = TempDir::new("one-file-noexec");
    let built = bundle(&tmp_home);
    let exe = home.join("heapdump");
    std::fs::copy(&built, &exe).unwrap();
    let prog = home.join("attach_target");
    std::fs::copy(compile_c("attach_target"), &prog).unwrap();
    let mut cmd = Command::new("/usr/bin/unshare");
    cmd.args(["-m", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!(
            "mount -t tmpfs -o noexec none /tmp && exec {} run -- {}",
            exe.display(),
            prog.display()
        ))
        .env_remove("HEAPDUMP_PRELOAD")
        .env_remove("LD_PRELOAD");
    let mut t = Target::spawn(cmd);
    let pid: u32 = t.last_line()["ready ".len()..].trim().parse().unwrap();
    t.send("alloc");
    t.wait_line("allocated");
    mapped_agent_is_the_bundled_one(pid, "/var/tmp/heapdump-agent-");
    let out = TempDir::new("one-file-noexec-out");
    after_alloc_sites(&exe, pid, &out, "noexec");
    t.send("quit");
    t.wait_line("eintr ");
    assert!(t.finish().success());
    let _ = std::fs::remove_dir_all(&top);
}
