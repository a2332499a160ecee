//! Permissions (issue 5): a target running as one user, a dumper running as
//! another. Another non-root user can neither open the target's regions
//! through /proc/PID/fd nor snapshot it (heapdump explains the ptrace
//! permission refusal), and snapshot files are mode 0600, unreadable by
//! other users. Needs root to switch users; skips otherwise (CI is root).

mod safety_common;

use std::os::unix::fs::PermissionsExt;
use std::os::unix::process::CommandExt;
use std::process::Command;

use heapdump_tests::*;
use safety_common::{built_bin, heapdump, run_guarded, scratch, snapshot_json};

/// `nobody` runs the target; `daemon` is the other, unprivileged user.
const TARGET_UID: u32 = 65534;
const OTHER_UID: u32 = 1;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

fn as_user(mut cmd: Command, uid: u32) -> Command {
    // std drops supplementary groups and sets gid then uid before exec.
    cmd.uid(uid).gid(uid);
    cmd
}

#[test]
fn another_user_cannot_read_regions_or_snapshots() {
    if !is_root() {
        eprintln!("skipped: needs root to run processes as other users");
        return;
    }
    let mut cmd = Command::new(built_bin("rust_pattern"));
    cmd.arg("pattern");
    let target = Target::spawn(as_user(cmd, TARGET_UID));
    let pid = target.pid();
    let (res, alloc) = find_regions(pid).expect("target has regions");

    // The regions: not through /proc/PID/fd as another user...
    for path in [&res, &alloc] {
        let mut cat = Command::new("cat");
        cat.arg(path);
        let run = run_guarded(as_user(cat, OTHER_UID));
        assert_ne!(run.code(), 0, "other user read {}", path.display());
        assert!(run.stderr.contains("Permission denied"), "{}", run.stderr);
    }
    // ...and heapdump run as that user says why.
    let mut snap = Command::new(heapdump());
    snap.args(["snapshot", &pid.to_string()]);
    let run = run_guarded(as_user(snap, OTHER_UID));
    assert_eq!(run.code(), 1, "{run:?}");
    assert!(
        run.stderr.contains("permission denied") && run.stderr.contains("ptrace"),
        "{}",
        run.stderr
    );
    assert!(run.stdout.is_empty());

    // Root (CAP_SYS_PTRACE) can; the file is 0600 even over an existing
    // world-readable one, and the other user cannot read it.
    let dir = scratch("perm");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o755)).unwrap();
    let out = dir.join("snap.json");
    std::fs::write(&out, b"old").unwrap();
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o644)).unwrap();
    let run = snapshot_json(pid, &out, &["--no-symbolize"]);
    assert_eq!(run.code(), 0, "{run:?}");
    let mode = std::fs::metadata(&out).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "snapshot file mode {mode:o}");
    let mut cat = Command::new("cat");
    cat.arg(&out);
    let run = run_guarded(as_user(cat, OTHER_UID));
    assert_ne!(run.code(), 0, "other user read the snapshot");
    // A new file too.
    let fresh = dir.join("fresh.pb.gz");
    let mut snap = Command::new(heapdump());
    snap.args(["snapshot", &pid.to_string(), "--no-symbolize", "-o"])
        .arg(&fresh);
    assert_eq!(run_guarded(snap).code(), 0);
    let mode = std::fs::metadata(&fresh).unwrap().permissions().mode() & 0o777;
    assert_eq!(mode, 0o600, "snapshot file mode {mode:o}");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(target.finish().success());
}
