//! Root's heapdump against targets that try to steer, hang or kill it
//! (issue 28; the rules are in docs/safety.md). Each target runs as
//! `nobody` (`tests/c/hostile.c` under the preload agent, or bare for
//! attach) and heapdump as root; every heapdump run is bounded by a hang
//! guard, so a hang fails the test instead of stalling the suite.

mod common;

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::*;
use heapdump_tests::{compile_c, preload_lib, real_dependency, Target};

const NOBODY: u32 = 65534;

/// A user no other test runs a process as (`bin` on Debian): the tests of
/// a collector's read budget run their targets as it, so that what the
/// collector reads of other tests' processes (all `nobody`'s) is charged
/// to another user's share.
const ALONE: u32 = 2;

fn is_root() -> bool {
    // SAFETY: geteuid has no preconditions.
    unsafe { libc::geteuid() == 0 }
}

/// These tests need root (to be the root heapdump, and to run targets as
/// another user); with HEAPDUMP_REQUIRE_REAL_PROGRAMS they fail without it.
fn root_here(what: &str) -> bool {
    real_dependency(
        &format!("root and setpriv ({what})"),
        is_root() && Path::new("/usr/bin/setpriv").exists(),
    )
}

/// A directory of `nobody`'s inside `t` (mode 0755).
fn nobody_dir(t: &TempDir, name: &str) -> PathBuf {
    let d = t.path(name);
    std::fs::create_dir_all(&d).unwrap();
    chown_nobody(&d);
    std::fs::set_permissions(&d, std::fs::Permissions::from_mode(0o755)).unwrap();
    d
}

fn chown_nobody(p: &Path) {
    std::os::unix::fs::lchown(p, Some(NOBODY), Some(NOBODY)).unwrap();
}

/// `exe` run as `nobody`.
fn as_nobody(exe: &Path) -> Command {
    let mut c = Command::new("/usr/bin/setpriv");
    c.args([
        "--reuid=65534",
        "--regid=65534",
        "--clear-groups",
        "--inh-caps=-all",
        "--",
    ])
    .arg(exe);
    c.env_remove("LD_PRELOAD");
    c
}

/// A bash `script` run as `nobody` (`$1`... are the arguments added).
fn nobody_bash(script: &str) -> Command {
    let mut c = as_nobody(Path::new("bash"));
    c.arg("-c").arg(script);
    c
}

/// `exe` run as user `uid` (group too) under the preload agent. The agent
/// is loaded into `exe` only (`env` sets it for it), not into `setpriv`
/// before: a collector could adopt `setpriv` and see its `exec` (which
/// `a_process_that_executes_another_program_is_followed_by_watch_collector_and_server`
/// pins down), and the tests that wait for a target's snapshot want the
/// program's.
fn as_user_recorded(exe: &Path, uid: u32) -> Command {
    let mut c = Command::new("/usr/bin/setpriv");
    c.arg(format!("--reuid={uid}"))
        .arg(format!("--regid={uid}"))
        .args(["--clear-groups", "--inh-caps=-all", "--", "/usr/bin/env"])
        .arg(format!("LD_PRELOAD={}", preload_lib().display()))
        .arg(exe);
    c.env_remove("LD_PRELOAD");
    c
}

/// `exe` run as `nobody` under the preload agent (loaded into `exe` only,
/// see [`as_user_recorded`]).
fn as_nobody_recorded(exe: &Path) -> Command {
    as_user_recorded(exe, NOBODY)
}

/// Runs heapdump; a run that outlives the hang guard is killed and fails
/// the test.
fn bounded(args: &[&str]) -> Output {
    bounded_with(args, &[])
}

/// [`bounded`], with environment variables set.
fn bounded_with(args: &[&str], env: &[(&str, &str)]) -> Output {
    let child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run heapdump");
    let pid = child.id();
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let _ = tx.send(child.wait_with_output());
    });
    match rx.recv_timeout(HANG_GUARD) {
        Ok(out) => out.expect("wait heapdump"),
        Err(_) => {
            // SAFETY: kill takes a pid and a signal.
            unsafe { libc::kill(pid as i32, libc::SIGKILL) };
            panic!("heapdump {args:?} hung (killed after {HANG_GUARD:?})");
        }
    }
}

/// A long-running heapdump (`watch`, `serve`) with `args` and `env`: the
/// process (killed if the test ends before it) and its stdout's lines
/// (its stderr is the test's).
fn running(args: &[&str], env: &[(&str, &str)]) -> (KilledOnDrop, Lines) {
    let mut child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = Lines::new(child.stdout.take().unwrap());
    (KilledOnDrop(child), lines)
}

/// `heapdump serve` on a port of loopback, unsymbolized: the process, its
/// address, and its stdout's lines (kept: a closed stdout would fail its
/// writes).
fn server_of_heaps() -> (KilledOnDrop, String, Lines) {
    let (server, lines) = running(&["serve", "--listen", "127.0.0.1:0", "--no-symbolize"], &[]);
    let addr = listening_addr(&lines.next());
    (server, addr, lines)
}

/// The live blocks the server at `addr` answers for process `pid`
/// (`/debug/pprof/heap`).
fn served_live_blocks(addr: &str, pid: u32) -> i64 {
    let (head, body) = http_get_with(addr, &format!("/debug/pprof/heap?pid={pid}"), "");
    assert!(head.contains(" 200 "), "{head}");
    let p = heapdump::formats::pprof::decode(&body).expect("pprof body");
    p.sample.iter().map(|s| s.value[2]).sum::<i64>()
}

/// A collector (`watch --all`, scanning every 20 ms) writing JSON into
/// `dir`, with `env`: the process and its stdout's lines.
fn collector(dir: &Path, env: &[(&str, &str)]) -> (KilledOnDrop, Lines) {
    running(
        &[
            "watch",
            "--all",
            "--scan",
            "20ms",
            "--poll",
            "5ms",
            "-f",
            "json",
            "-d",
            &dir.to_string_lossy(),
        ],
        env,
    )
}

/// `heapdump watch PID -f json -d DIR`, started and past its "watching"
/// line: the process and its stdout's lines (each "wrote PATH").
fn watch_json(pid: &str, dir: &Path) -> (KilledOnDrop, Lines) {
    let (watch, lines) = running(
        &["watch", pid, "-f", "json", "-d", &dir.to_string_lossy()],
        &[],
    );
    assert!(lines.next().starts_with("watching "));
    (watch, lines)
}

/// The next snapshot file a `watch` writing into `dir` wrote of process
/// `pid` (its `wrote PATH` line). A collector (`--all`) also adopts other
/// tests' processes: their lines are skipped.
fn next_written(lines: &Lines, dir: &Path, pid: u32) -> PathBuf {
    let prefix = format!("wrote {}/heapdump-{pid}-", dir.display());
    loop {
        if let Some(path) = lines.next().strip_prefix(&prefix) {
            return PathBuf::from(format!("{}/heapdump-{pid}-{path}", dir.display()));
        }
    }
}

fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "heapdump failed: {}\n{}",
        stderr(out),
        stdout(out)
    );
    stdout(out)
}

/// Runs a compiler command, which must succeed.
fn cc(cmd: &mut Command) {
    let status = cmd.status().expect("run cc");
    assert!(status.success(), "{cmd:?} failed");
}

fn mkfifo(p: &Path) {
    let c = std::ffi::CString::new(p.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: a valid path string.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o666) }, 0, "{p:?}");
    chown_nobody(p);
}

/// A copy of the hostile program, compiled with split DWARF (so the
/// symbolizer has reason to look for `PROG.dwp`), at `dir/name`.
fn hostile_copy(dir: &Path, name: &str) -> PathBuf {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/hostile.c");
    let out = dir.join(name);
    let status = Command::new("cc")
        .args([
            "-O1",
            "-g",
            "-gsplit-dwarf",
            "-fno-omit-frame-pointer",
            "-pthread",
        ])
        .arg("-o")
        .arg(&out)
        .arg(&src)
        .arg("-ldl")
        .current_dir(dir)
        .status()
        .unwrap();
    assert!(status.success());
    chown_nobody(&out);
    out
}

#[test]
fn fifos_beside_the_program_never_hang_snapshot_list_watch_or_attach() {
    if !root_here("FIFO targets") {
        return;
    }
    let t = TempDir::new("hostile-fifo");
    let d = nobody_dir(&t, "app");
    // A program whose name holds a newline: /proc/PID/maps shows it as
    // `prog\012x`, and a FIFO has that literal name; FIFOs also wait
    // where split DWARF packages and debug links are looked for.
    let exe = hostile_copy(&d, "prog\nx");
    for fifo in [
        "prog\\012x",
        "prog\nx.dwp",
        "prog\\012x.dwp",
        "prog\nx.debug",
    ] {
        mkfifo(&d.join(fifo));
    }
    let mut target = Target::spawn(as_nobody_recorded(&exe));
    target.send("alloc");
    target.wait_line("allocated");
    let pid = target.pid().to_string();
    let text = ok(&bounded(&["snapshot", &pid]));
    assert!(text.contains("site_hostile"), "{text}");
    ok(&bounded(&["snapshot", &pid, "--no-symbolize"]));
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    assert_eq!(live_by_leaf(&j).get("site_hostile"), Some(&(100, 30_000)));
    let list = ok(&bounded(&["list"]));
    assert!(list.contains(&pid), "{list}");

    // The collector adopts it, keeps serving, and stops on SIGTERM.
    let out_dir = t.path("collected");
    let mut watch = Command::new(bin())
        .args(["watch", "--all", "--scan", "100ms", "-f", "json", "-d"])
        .arg(&out_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lines = Lines::new(watch.stdout.take().unwrap());
    loop {
        let l = lines.next();
        if l == format!("watching {pid} (prog\\x0ax)") || l.starts_with(&format!("watching {pid} "))
        {
            break;
        }
    }
    target.send("request");
    target.wait_line("requested");
    loop {
        if lines.next().starts_with("wrote ") {
            break;
        }
    }
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let status = watch.wait().unwrap();
    assert!(status.success(), "watch --all after SIGTERM: {status:?}");

    // attach, on a copy of the program started bare.
    let mut bare = Target::spawn(as_nobody(&exe));
    let bpid = bare.pid().to_string();
    let lib = preload_lib();
    ok(&bounded(&[
        "attach",
        &bpid,
        "--library",
        lib.to_str().unwrap(),
    ]));
    bare.send("alloc");
    bare.wait_line("allocated");
    ok(&bounded(&["snapshot", &bpid]));
    ok(&bounded(&["detach", &bpid]));
    bare.send("quit");
    target.send("quit");
}

#[test]
fn a_planted_agent_library_is_never_loaded_nor_written_through() {
    if !root_here("planted library")
        || !real_dependency("unshare", Path::new("/usr/bin/unshare").exists())
    {
        return;
    }
    let t = TempDir::new("hostile-plant");
    let lib = preload_lib();
    let bytes = std::fs::read(&lib).unwrap();
    let name = heapdump::attach::library_placement::content_name(&bytes);
    let planted_dir = PathBuf::from(format!("/tmp/heapdump-agent-{name}"));
    let marker = t.path("constructor-ran");
    // nobody's shared object: its constructor writes the marker; padded
    // to the agent's size, under the agent's name.
    let evil_src = t.path("evil.c");
    std::fs::write(
        &evil_src,
        format!(
            "#include <stdio.h>\n__attribute__((constructor)) static void run(void) {{ \
             FILE *f = fopen(\"{}\", \"w\"); if (f) fclose(f); }}\n",
            marker.display()
        ),
    )
    .unwrap();
    let evil = t.path("evil.so");
    cc(Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&evil)
        .arg(&evil_src));
    let mut evil_bytes = std::fs::read(&evil).unwrap();
    evil_bytes.resize(bytes.len(), 0);
    let hidden = t.path("lib");
    std::fs::create_dir_all(&hidden).unwrap();
    let our_lib = hidden.join("libheapdump_preload.so");
    std::fs::copy(&lib, &our_lib).unwrap();
    // The marker's directory must be writable by the target (nobody).
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o777)).unwrap();

    for variant in ["directory", "symlink"] {
        let _ = std::fs::remove_dir_all(&planted_dir);
        let _ = std::fs::remove_file(&planted_dir);
        let nobodys = nobody_dir(&t, &format!("nobodys-{variant}"));
        let planted_file = match variant {
            "directory" => {
                std::fs::create_dir(&planted_dir).unwrap();
                chown_nobody(&planted_dir);
                planted_dir.join("libheapdump_preload.so")
            }
            _ => {
                std::os::unix::fs::symlink(&nobodys, &planted_dir).unwrap();
                chown_nobody(&planted_dir);
                nobodys.join("libheapdump_preload.so")
            }
        };
        std::fs::write(&planted_file, &evil_bytes).unwrap();
        chown_nobody(&planted_file);
        let exe = compile_c("poll_single");
        // The target, in its own mount namespace where the agent's own
        // directory is hidden: attach must place a copy in its /tmp.
        let mut cmd = Command::new("/usr/bin/unshare");
        cmd.args(["-m", "--propagation", "private", "--", "sh", "-c"])
            .arg(format!(
                "mount -t tmpfs none {} && exec setpriv --reuid=65534 --regid=65534 \
                 --clear-groups {}",
                hidden.display(),
                exe.display()
            ))
            .env_remove("LD_PRELOAD");
        let mut target = Target::spawn(cmd);
        let pid = target.last_line()["ready ".len()..].to_string();
        let out = bounded(&["attach", &pid, "--library", our_lib.to_str().unwrap()]);
        assert!(out.status.success(), "{variant}: {}", stderr(&out));
        assert!(
            !marker.exists(),
            "{variant}: the planted library's constructor ran in the target"
        );
        assert_eq!(
            std::fs::read(&planted_file).unwrap(),
            evil_bytes,
            "{variant}: the planted file was written"
        );
        assert_eq!(std::fs::metadata(&planted_file).unwrap().uid(), NOBODY);
        let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
        let loaded = maps
            .lines()
            .find(|l| l.contains("libheapdump_preload"))
            .expect("the agent is mapped");
        assert!(
            loaded.contains(&format!("/tmp/heapdump-agent-{name}-")),
            "{variant}: loaded from {loaded}"
        );
        target.send("alloc");
        target.wait_line("allocated");
        let text = ok(&bounded(&["snapshot", &pid]));
        assert!(text.contains("site_poll"), "{text}");
        ok(&bounded(&["detach", &pid]));
        target.send("quit");
        target.wait_line("eintr ");
    }
    let _ = std::fs::remove_dir_all(&planted_dir);
    let _ = std::fs::remove_file(&planted_dir);
}

#[test]
fn a_decoy_library_under_the_agents_name_neither_fails_nor_answers_detach() {
    if !root_here("decoy library") {
        return;
    }
    let t = TempDir::new("hostile-decoy");
    // The marker's directory must be writable by the target (nobody).
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o777)).unwrap();
    let marker = t.path("decoy-detach-ran");
    let nobodys = nobody_dir(&t, "nobodys");
    // nobody's library under the agent's name, with the agent's detach
    // entry point: loaded after the attach, it maps below the agent and
    // comes first in /proc/PID/maps.
    let src = nobodys.join("decoy.c");
    std::fs::write(
        &src,
        format!(
            "#include <stdio.h>\n#include <stdlib.h>\n\
             const char pad[4 << 20] = {{1}};\n\
             void plugin_alloc(int n) {{ (void)n; }}\n\
             int heapdump_detach(void) {{ FILE *f = fopen(\"{}\", \"w\"); \
             if (f) fclose(f); return 4242; }}\n",
            marker.display()
        ),
    )
    .unwrap();
    let decoy = nobodys.join("libheapdump_preload_decoy.so");
    cc(Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&decoy)
        .arg(&src));
    chown_nobody(&decoy);

    let exe = hostile_copy(&nobodys, "prog");
    let mut target = Target::spawn(as_nobody(&exe));
    let pid = target.pid().to_string();
    let lib = preload_lib();
    ok(&bounded(&[
        "attach",
        &pid,
        "--library",
        lib.to_str().unwrap(),
    ]));
    target.send(&format!("plugin {}", decoy.display()));
    target.wait_line("loaded");
    target.send("alloc");
    target.wait_line("allocated");
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    let first = maps
        .lines()
        .find(|l| l.contains("libheapdump_preload"))
        .expect("a library under the agent's name is mapped");
    assert!(
        first.ends_with("libheapdump_preload_decoy.so"),
        "the decoy is not the first candidate, so this test would not bite:\n{maps}"
    );

    let out = ok(&bounded(&["detach", &pid]));
    assert!(out.contains("detached from"), "{out}");
    assert!(
        !marker.exists(),
        "root's detach called the decoy's heapdump_detach"
    );
    // Detached for real: blocks allocated afterwards are not recorded.
    target.send("alloc");
    target.wait_line("allocated");
    let roots = t.path("roots");
    std::fs::create_dir(&roots).unwrap();
    let json = roots.join("after.json");
    ok(&bounded(&["snapshot", &pid, "-o", json.to_str().unwrap()]));
    let j = read_json(&json);
    assert_eq!(live_by_leaf(&j).get("site_hostile"), Some(&(100, 30_000)));
    target.send("quit");
}

/// Builds `tests/c/attach_plugin.c` as a shared object at `out`.
fn plugin_at(out: &Path, extra: &[&str]) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/attach_plugin.c");
    cc(Command::new("cc")
        .args(["-O1", "-g", "-shared", "-fPIC", "-fno-omit-frame-pointer"])
        .args(extra)
        .arg("-o")
        .arg(out)
        .arg(&src));
    chown_nobody(out);
}

/// The hostile program, run as `nobody` under the agent, once it has
/// loaded each of `libs` (`plugin PATH`: 100 blocks from each library's
/// `site_plugin`).
fn hostile_with_plugins(libs: &[&Path]) -> Target {
    hostile_of_user_with_plugins(NOBODY, libs)
}

/// [`hostile_with_plugins`], run as user `uid`.
fn hostile_of_user_with_plugins(uid: u32, libs: &[&Path]) -> Target {
    let mut target = Target::spawn(as_user_recorded(&compile_c("hostile"), uid));
    for lib in libs {
        target.send(&format!("plugin {}", lib.display()));
        assert_eq!(target.wait_line(""), "loaded");
    }
    target
}

#[test]
fn watch_survives_a_truncated_mapped_library_and_writes_the_requested_snapshot() {
    if !root_here("truncated library") {
        return;
    }
    let t = TempDir::new("hostile-trunc");
    let d = nobody_dir(&t, "app");
    let plugin = d.join("libplugin.so");
    plugin_at(&plugin, &[]);
    let mut target = hostile_with_plugins(&[&plugin]);
    let pid = target.pid().to_string();
    let (mut watch, lines) = watch_json(&pid, &t.path("snaps"));
    // watch has opened the plugin; now it shrinks to nothing.
    target.send(&format!("truncate {}", plugin.display()));
    target.wait_line("truncated");
    target.send("request");
    target.wait_line("requested");
    let wrote = lines.next();
    assert!(wrote.starts_with("wrote "), "{wrote}");
    let j = read_json(Path::new(&wrote["wrote ".len()..]));
    assert_eq!(
        live_blocks_through(&j, "site_plugin"),
        100,
        "the plugin's blocks, symbolized from what was read before the truncation"
    );
    target.send("quit");
    let status = watch.wait().unwrap();
    assert!(status.success(), "watch died: {status:?}");
}

/// The sizes of every SHT_NOTE section of the ELF file `p` set to `size`
/// (the file extended, sparse, to hold them).
fn inflate_notes(p: &Path, size: u64) {
    let mut b = std::fs::read(p).unwrap();
    let mut end = 0;
    for h in section_headers(&b) {
        if h.kind == 7 {
            b[h.at + 0x20..h.at + 0x28].copy_from_slice(&size.to_le_bytes());
            end = end.max(h.offset + size);
        }
    }
    assert!(end > 0, "no note section");
    std::fs::write(p, &b).unwrap();
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(end)
        .unwrap();
}

/// One section header of a little-endian ELF64 file.
struct SectionHeader {
    /// Where the header itself lies in the file.
    at: usize,
    name: Vec<u8>,
    kind: u32,
    offset: u64,
    size: u64,
}

/// The section headers of the ELF64 file `b`.
fn section_headers(b: &[u8]) -> Vec<SectionHeader> {
    let u16_at = |o: usize| u16::from_le_bytes(b[o..o + 2].try_into().unwrap()) as usize;
    let u32_at = |o: usize| u32::from_le_bytes(b[o..o + 4].try_into().unwrap());
    let u64_at = |o: usize| u64::from_le_bytes(b[o..o + 8].try_into().unwrap());
    let shoff = u64_at(0x28) as usize;
    let (shentsize, shnum, shstrndx) = (u16_at(0x3a), u16_at(0x3c), u16_at(0x3e));
    let names = u64_at(shoff + shstrndx * shentsize + 0x18) as usize;
    (0..shnum)
        .map(|i| {
            let at = shoff + i * shentsize;
            let n = names + u32_at(at) as usize;
            SectionHeader {
                at,
                name: b[n..].split(|&c| c == 0).next().unwrap_or(&[]).to_vec(),
                kind: u32_at(at + 4),
                offset: u64_at(at + 0x18),
                size: u64_at(at + 0x20),
            }
        })
        .collect()
}

#[test]
fn a_sparse_4gib_note_and_a_1tib_debuglink_cost_little() {
    if !root_here("sparse files") {
        return;
    }
    // No collector of another test reads this target's files meanwhile.
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-sparse");
    let d = nobody_dir(&t, "app");
    // A library whose note sections claim 4 GiB (sparse on disk).
    let notes = d.join("libnotes.so");
    plugin_at(&notes, &[]);
    inflate_notes(&notes, 4 << 30);
    // A stripped library whose debug link names a 1 TiB sparse file.
    let linked = d.join("liblinked.so");
    plugin_at(&linked, &["-Wl,--build-id=none"]);
    let debug = d.join("liblinked.debug");
    std::fs::write(&debug, b"small").unwrap();
    assert!(Command::new("objcopy")
        .args(["--strip-debug", "--add-gnu-debuglink"])
        .arg(&debug)
        .arg(&linked)
        .current_dir(&d)
        .status()
        .unwrap()
        .success());
    std::fs::File::options()
        .write(true)
        .open(&debug)
        .unwrap()
        .set_len(1 << 40)
        .unwrap();
    chown_nobody(&debug);
    let mut target = hostile_with_plugins(&[&notes, &linked]);
    let pid = target.pid().to_string();
    let started = std::time::Instant::now();
    let json = t.str("s.json");
    let rss = measured(&["snapshot", &pid, "-o", &json], &[])
        .ok("snapshot")
        .rss;
    let took = started.elapsed();
    // The benchmark line (docs/safety.md quotes it).
    eprintln!(
        "bench: snapshot of a target with a 4 GiB note and a 1 TiB debug link: {:.2} s, \
         heapdump max RSS {} MiB",
        took.as_secs_f64(),
        rss >> 20
    );
    assert!(
        rss < 512 << 20,
        "heapdump used {} MiB reading the target's files",
        rss >> 20
    );
    let j = read_json(Path::new(&json));
    assert_eq!(live_blocks_through(&j, "site_plugin"), 200);
    target.send("quit");
}

/// DWARF a target may ship in place of its library's own (see
/// `craft_dwarf`).
enum Crafted {
    /// The function holds this many inlined calls, each inside the last
    /// (one byte each).
    Nested(usize),
    /// The unit's compilation directory is a string of this many bytes,
    /// and its line program's header names this many files (5 bytes
    /// each), every one rendered with that directory in front.
    Files { dir_len: usize, files: usize },
}

/// Replaces the DWARF of the shared object `lib` with one unit covering
/// its function `function`, shaped as `shape` says, its debug sections
/// compressed (so the file stays small whatever the sections hold) if
/// `compress`.
fn craft_dwarf(lib: &Path, function: &str, shape: Crafted, compress: bool) {
    let nm = Command::new("nm").arg("-S").arg(lib).output().unwrap();
    let (addr, size) = String::from_utf8_lossy(&nm.stdout)
        .lines()
        .find_map(|l| {
            let f: Vec<_> = l.split_whitespace().collect();
            (f.len() == 4 && f[3] == function).then(|| {
                (
                    u64::from_str_radix(f[0], 16).unwrap(),
                    u64::from_str_radix(f[1], 16).unwrap(),
                )
            })
        })
        .expect("the function's symbol");
    let mut sections: Vec<(&str, Vec<u8>)> = Vec::new();
    let mut body = Vec::new();
    match shape {
        Crafted::Nested(levels) => {
            // 1 compile unit, 2 subprogram (name, low_pc, high_pc as a
            // length), 3 inlined subroutine; all with children.
            sections.push((
                ".debug_abbrev",
                vec![
                    1, 0x11, 1, 0x11, 0x01, 0x12, 0x07, 0, 0, //
                    2, 0x2e, 1, 0x03, 0x08, 0x11, 0x01, 0x12, 0x07, 0, 0, //
                    3, 0x1d, 1, 0, 0, 0,
                ],
            ));
            body.push(1);
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&size.to_le_bytes());
            body.push(2);
            body.extend_from_slice(function.as_bytes());
            body.push(0);
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&size.to_le_bytes());
            body.extend(std::iter::repeat_n(3u8, levels));
            body.extend(std::iter::repeat_n(0u8, levels + 2));
        }
        Crafted::Files { dir_len, files } => {
            // 1 compile unit, no children: stmt_list, comp_dir (strp),
            // low_pc, high_pc as a length.
            sections.push((
                ".debug_abbrev",
                vec![
                    1, 0x11, 0, 0x10, 0x17, 0x1b, 0x0e, 0x11, 0x01, 0x12, 0x07, 0, 0, 0,
                ],
            ));
            body.push(1);
            body.extend_from_slice(&0u32.to_le_bytes());
            body.extend_from_slice(&0u32.to_le_bytes());
            body.extend_from_slice(&addr.to_le_bytes());
            body.extend_from_slice(&size.to_le_bytes());
            let mut dir = vec![b'/'];
            dir.extend(std::iter::repeat_n(b'd', dir_len));
            dir.push(0);
            sections.push((".debug_str", dir));
            // A DWARF 4 line program: its header (opcode base 13), the
            // files, then one row at the function and the sequence's end.
            let mut header = vec![1, 1, 1, (-5i8) as u8, 14, 13];
            header.extend_from_slice(&[0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1]);
            header.push(0);
            for _ in 0..files {
                header.extend_from_slice(b"a\0\0\0\0");
            }
            header.push(0);
            let mut after = 4u16.to_le_bytes().to_vec();
            after.extend_from_slice(&(header.len() as u32).to_le_bytes());
            after.extend_from_slice(&header);
            after.extend_from_slice(&[0, 9, 2]);
            after.extend_from_slice(&addr.to_le_bytes());
            after.extend_from_slice(&[1, 2, size as u8, 0, 1, 1]);
            let mut line = (after.len() as u32).to_le_bytes().to_vec();
            line.extend_from_slice(&after);
            sections.push((".debug_line", line));
        }
    }
    let mut info = ((2 + 4 + 1 + body.len()) as u32).to_le_bytes().to_vec();
    info.extend_from_slice(&4u16.to_le_bytes()); // DWARF 4
    info.extend_from_slice(&0u32.to_le_bytes()); // abbreviations at 0
    info.push(8); // address size
    info.extend_from_slice(&body);
    sections.push((".debug_info", info));
    let dir = lib.parent().unwrap();
    let mut objcopy = Command::new("objcopy");
    objcopy.args([
        "--remove-section=.debug_aranges",
        "--remove-section=.debug_rnglists",
    ]);
    for (name, bytes) in &sections {
        let file = format!("{}.bin", name.trim_start_matches('.'));
        std::fs::write(dir.join(&file), bytes).unwrap();
        objcopy
            .arg("--update-section")
            .arg(format!("{name}={file}"));
    }
    assert!(objcopy
        .arg(lib)
        .current_dir(dir)
        .status()
        .unwrap()
        .success());
    if compress {
        assert!(Command::new("objcopy")
            .arg("--compress-debug-sections=zlib")
            .arg(lib)
            .status()
            .unwrap()
            .success());
    }
    chown_nobody(lib);
}

#[test]
fn a_library_whose_dwarf_nests_a_million_levels_is_named_from_its_symbols() {
    if !root_here("nested DWARF") {
        return;
    }
    let t = TempDir::new("hostile-nesting");
    let d = nobody_dir(&t, "app");
    let lib = d.join("libnested.so");
    plugin_at(&lib, &[]);
    // addr2line reads inlined calls by recursion: this overflowed
    // heapdump's stack (abort) before the nesting was checked.
    craft_dwarf(&lib, "site_plugin", Crafted::Nested(1_000_000), true);
    let mut target = hostile_with_plugins(&[&lib]);
    let pid = target.pid().to_string();
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    assert_eq!(live_blocks_through(&j, "site_plugin"), 100);
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("libnested.so: its DWARF nests entries deeper than 512 levels"),
        "{notes}"
    );
    // The text report too (its own symbolization).
    let text = ok(&bounded(&["snapshot", &pid]));
    assert!(text.contains("site_plugin"), "{text}");
    target.send("quit");
}

#[test]
fn a_small_library_whose_line_table_would_fill_memory_is_named_from_its_symbols() {
    if !root_here("line table") {
        return;
    }
    // No collector of another test reads this target's files meanwhile
    // (with the default file budget that takes a gigabyte).
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-lines");
    let d = nobody_dir(&t, "app");
    let lib = d.join("libfiles.so");
    plugin_at(&lib, &[]);
    // 1 000 files under one 1 MB directory: 1 GB of paths once addr2line
    // renders them, from a file of a few kilobytes.
    craft_dwarf(
        &lib,
        "site_plugin",
        Crafted::Files {
            dir_len: 1 << 20,
            files: 1000,
        },
        true,
    );
    assert!(std::fs::metadata(&lib).unwrap().len() < 100_000);
    let mut target = hostile_with_plugins(&[&lib]);
    let pid = target.pid().to_string();
    let json = t.str("s.json");
    // A budget of 256 MiB a file (the default is 2 GiB).
    let rss = measured(
        &["snapshot", &pid, "-o", &json],
        &[("HEAPDUMP_MAX_FILE_READ", "268435456")],
    )
    .ok("snapshot")
    .rss;
    assert!(rss < 512 << 20, "heapdump used {} MiB", rss >> 20);
    let j = read_json(Path::new(&json));
    assert_eq!(live_blocks_through(&j, "site_plugin"), 100);
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("libfiles.so: its DWARF would take"),
        "{notes}"
    );
    target.send("quit");
}

/// Moves the section `name` of the ELF file `p` past the file's end and
/// makes it `size` bytes: its bytes, then zeros up to `size` in a sparse
/// extension of the file (no disk taken). Returns where it now starts.
fn inflate_section(p: &Path, name: &str, size: u64) -> u64 {
    let mut b = std::fs::read(p).unwrap();
    let h = section_headers(&b)
        .into_iter()
        .find(|h| h.name == name.as_bytes())
        .expect("the section");
    let at = (b.len() as u64).next_multiple_of(4096);
    let bytes = b[h.offset as usize..(h.offset + h.size) as usize].to_vec();
    b.resize(at as usize, 0);
    b.extend_from_slice(&bytes);
    b[h.at + 0x18..h.at + 0x20].copy_from_slice(&at.to_le_bytes());
    b[h.at + 0x20..h.at + 0x28].copy_from_slice(&size.to_le_bytes());
    std::fs::write(p, &b).unwrap();
    std::fs::File::options()
        .write(true)
        .open(p)
        .unwrap()
        .set_len(at + size)
        .unwrap();
    at
}

/// One heapdump run (within the hang guard): how it ended, its own largest
/// resident set in bytes, and what it wrote to stderr.
struct Measured {
    status: std::process::ExitStatus,
    rss: u64,
    stderr: String,
}

impl Measured {
    /// Panics with heapdump's stderr unless it succeeded.
    fn ok(&self, what: &str) -> &Self {
        assert!(
            self.status.success(),
            "{what}: {:?}\n{}",
            self.status,
            self.stderr
        );
        self
    }
}

/// Runs heapdump with `args` and `env` and measures it: through
/// `tests/c/peak_rss.c`, a small process that forks and execs it, because
/// a program this test process spawns starts its largest resident set at
/// this process's own, and `RUSAGE_CHILDREN` keeps the largest of every
/// child the test process ever had (a collector of another test included).
fn measured(args: &[&str], env: &[(&str, &str)]) -> Measured {
    static RUNS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let dir = std::env::temp_dir();
    let peak = dir.join(format!("heapdump-peak-{}-{n}", std::process::id()));
    let errors = dir.join(format!("heapdump-peak-{}-{n}.err", std::process::id()));
    let child = Command::new(compile_c("peak_rss"))
        .arg(&peak)
        .arg(bin())
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&errors).unwrap())
        .process_group(0)
        .spawn()
        .expect("run heapdump");
    let group = child.id() as i32;
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut child = child;
        let _ = tx.send(child.wait());
    });
    let Ok(status) = rx.recv_timeout(HANG_GUARD) else {
        // SAFETY: kill takes a (negated: the group's) pid and a signal.
        unsafe { libc::kill(-group, libc::SIGKILL) };
        panic!("heapdump {args:?} hung (killed after {HANG_GUARD:?})");
    };
    let kib: u64 = std::fs::read_to_string(&peak)
        .ok()
        .and_then(|t| t.trim().parse().ok())
        .unwrap_or_else(|| panic!("peak_rss wrote no figure for heapdump {args:?}"));
    let stderr = std::fs::read_to_string(&errors).unwrap_or_default();
    let _ = std::fs::remove_file(&peak);
    let _ = std::fs::remove_file(&errors);
    Measured {
        status: status.unwrap(),
        rss: kib * 1024,
        stderr,
    }
}

/// Held by the tests whose targets make heapdump read tens of MiB (or would,
/// past a budget the test sets), and by those that run a collector (`watch
/// --all`): a collector adopts every instrumented process of the machine,
/// other tests' too, and reads their files (which takes its time, its
/// total, and the machine's memory).
static BIG_READS: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// A plugin of the hostile program at `lib` (owned by nobody) whose
/// `.debug_info` is `size` bytes: one unit, its entries then null entries
/// (zeros, which take no disk), so a 20 KB file costs `size` to read.
fn sparse_dwarf_library(lib: &Path, size: u64) -> PathBuf {
    plugin_at(lib, &[]);
    craft_dwarf(lib, "site_plugin", Crafted::Nested(0), false);
    let at = inflate_section(lib, ".debug_info", size);
    // The unit's length: the whole section.
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::File::options().write(true).open(lib).unwrap(),
        &(size as u32 - 4).to_le_bytes(),
        at,
    )
    .unwrap();
    chown_nobody(lib);
    lib.to_path_buf()
}

#[test]
fn many_sparse_libraries_cost_no_more_than_the_total_read_budget() {
    if !root_here("sparse libraries") {
        return;
    }
    let t = TempDir::new("hostile-total");
    let d = nobody_dir(&t, "app");
    // Eight libraries, each with a 32 MiB .debug_info: one unit, its
    // entries then null entries (zeros, which take no disk): heapdump read
    // and kept every one of them (256 MiB here; 2 GiB a file, as many
    // files as the target maps) before the total.
    let _big = BIG_READS.lock();
    let libs: Vec<PathBuf> = (0..8)
        .map(|i| sparse_dwarf_library(&d.join(format!("libsparse{i}.so")), 32 << 20))
        .collect();
    let mut target = hostile_with_plugins(&libs.iter().map(PathBuf::as_path).collect::<Vec<_>>());
    let pid = target.pid().to_string();
    let json = t.str("s.json");
    let rss = measured(
        &["snapshot", &pid, "-o", &json],
        &[("HEAPDUMP_MAX_TOTAL_READ", &(50u64 << 20).to_string())],
    )
    .ok("snapshot")
    .rss;
    // One library's 32 MiB (read, then copied out of the file's cache)
    // and heapdump's own; without the total: all eight, kept.
    assert!(rss < 250 << 20, "heapdump used {} MiB", rss >> 20);
    let j = read_json(Path::new(&json));
    assert_eq!(live_blocks_through(&j, "site_plugin"), 800);
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("not read whole: the files heapdump read reached HEAPDUMP_MAX_TOTAL_READ"),
        "{notes}"
    );
    target.send("quit");
}

/// Two libraries (48 MiB of DWARF each) of which one, with the files
/// every process maps (10-15 MiB without glibc's debug file), fits in a
/// user's share of a [`ONE_OF_TWO_TOTAL`] total (half of it), and both do
/// not: a user's targets can use up what a collector lets them read; once
/// they exited, what was read for them must come back. Their targets run
/// as a user of their own ([`ALONE`]): a collector also reads other
/// tests' processes (nobody's), whose files are charged to nobody's share.
fn one_of_two_fits(t: &TempDir) -> (PathBuf, PathBuf) {
    let d = nobody_dir(t, "app");
    (
        sparse_dwarf_library(&d.join("libfirst.so"), 48 << 20),
        sparse_dwarf_library(&d.join("libsecond.so"), 48 << 20),
    )
}

/// The total read budget of the tests of [`one_of_two_fits`], and where
/// their heapdump looks for debug files (nowhere: glibc's is read slowly
/// by a debug build, and the tests are about the libraries).
const ONE_OF_TWO_TOTAL: [(&str, &str); 2] = [
    ("HEAPDUMP_MAX_TOTAL_READ", "167772160"),
    ("HEAPDUMP_DEBUG_DIRS", "/nonexistent"),
];

#[test]
fn a_collector_gives_back_what_it_read_for_a_process_once_it_exited() {
    if !root_here("collector's total") {
        return;
    }
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-collector-total");
    let (first, second) = one_of_two_fits(&t);
    let out_dir = t.path("collected");
    let (mut watch, lines) = collector(&out_dir, &ONE_OF_TWO_TOTAL);
    let collected = |lib: &Path| {
        let mut target = hostile_of_user_with_plugins(ALONE, &[lib]);
        let pid = target.pid();
        while !lines.next().starts_with(&format!("watching {pid} ")) {}
        target.send("request");
        target.wait_line("requested");
        let requested = next_written(&lines, &out_dir, pid);
        target.send("quit");
        assert!(target.finish().success());
        // Its final snapshot, after which the collector forgets it.
        next_written(&lines, &out_dir, pid);
        read_json(&requested)
    };
    for (lib, j) in [(&first, collected(&first)), (&second, collected(&second))] {
        assert_eq!(
            live_blocks_through(&j, "site_plugin"),
            100,
            "{}",
            lib.display()
        );
        let notes = j["notes"].to_string();
        assert!(
            !notes.contains("HEAPDUMP_MAX_TOTAL_READ"),
            "{}: {notes}",
            lib.display()
        );
    }
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    assert!(watch.wait().unwrap().success());
}

#[test]
fn a_file_cut_short_by_another_process_of_its_user_is_read_whole_once_that_one_exited() {
    if !root_here("collector's re-reading") {
        return;
    }
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-collector-again");
    let (first, second) = one_of_two_fits(&t);
    let out_dir = t.path("collected");
    let (mut watch, lines) = collector(&out_dir, &ONE_OF_TWO_TOTAL);
    let requested = |target: &mut Target| {
        target.send("request");
        target.wait_line("requested");
        read_json(&next_written(&lines, &out_dir, target.pid()))
    };
    let short = |j: &serde_json::Value| j["notes"].to_string().contains("HEAPDUMP_MAX_TOTAL_READ");
    // Two processes of one user, both alive: the second's library does not
    // fit in what the first left of their user's share.
    let mut crowding = hostile_of_user_with_plugins(ALONE, &[&first]);
    while !lines
        .next()
        .starts_with(&format!("watching {} ", crowding.pid()))
    {}
    assert!(!short(&requested(&mut crowding)));
    let mut crowded = hostile_of_user_with_plugins(ALONE, &[&second]);
    while !lines
        .next()
        .starts_with(&format!("watching {} ", crowded.pid()))
    {}
    let j = requested(&mut crowded);
    assert!(short(&j), "{}", j["notes"]);
    // The first exits: what was read for it goes back to the share.
    let pid = crowding.pid();
    crowding.send("quit");
    assert!(crowding.finish().success());
    next_written(&lines, &out_dir, pid);
    // Before: the library stayed cut short for as long as its process ran.
    let j = requested(&mut crowded);
    assert!(!short(&j), "{}", j["notes"]);
    assert_eq!(live_blocks_through(&j, "site_plugin"), 100);
    crowded.send("quit");
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    assert!(watch.wait().unwrap().success());
}

#[test]
fn watch_of_several_processes_gives_back_what_it_read_for_one_that_exited() {
    if !root_here("watch's give-back") {
        return;
    }
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-watch-several");
    let (first, second) = one_of_two_fits(&t);
    let mut gone = hostile_of_user_with_plugins(ALONE, &[&first]);
    let mut stays = hostile_of_user_with_plugins(ALONE, &[&second]);
    let out_dir = t.path("snaps");
    let (gone_pid, stays_pid) = (gone.pid().to_string(), stays.pid().to_string());
    let (mut watch, lines) = running(
        &[
            "watch",
            &gone_pid,
            &stays_pid,
            "--poll",
            "5ms",
            "-f",
            "json",
            "-d",
            &out_dir.to_string_lossy(),
        ],
        &ONE_OF_TWO_TOTAL,
    );
    assert!(lines.next().starts_with("watching "));
    let short = |j: &serde_json::Value| j["notes"].to_string().contains("HEAPDUMP_MAX_TOTAL_READ");
    let requested = |target: &mut Target| {
        target.send("request");
        target.wait_line("requested");
        read_json(&next_written(&lines, &out_dir, target.pid()))
    };
    // Both libraries do not fit in their user's share: the second is cut
    // short while the first process lives.
    let j = requested(&mut stays);
    assert!(short(&j), "{}", j["notes"]);
    let pid = gone.pid();
    gone.send("quit");
    assert!(gone.finish().success());
    next_written(&lines, &out_dir, pid);
    // Before: `watch PID...` kept every target's files until all were
    // done, so the second library stayed cut short.
    let j = requested(&mut stays);
    assert!(!short(&j), "{}", j["notes"]);
    assert_eq!(live_blocks_through(&j, "site_plugin"), 100);
    stays.send("quit");
    assert!(stays.finish().success());
    assert!(watch.wait().unwrap().success());
}

#[test]
fn one_users_processes_cannot_take_all_of_a_collectors_total_read() {
    if !root_here("users' shares") {
        return;
    }
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-shares");
    let d = nobody_dir(&t, "app");
    // nobody's process maps four libraries of 32 MiB of DWARF (sparse:
    // nothing on disk), read before the files every process maps (20-30
    // MiB, glibc's debug file the most): together past a 200 MiB total.
    // Another user's process (uid 1, `daemon`) maps one such library.
    let hog: Vec<PathBuf> = (0..4)
        .map(|i| sparse_dwarf_library(&d.join(format!("libhog{i}.so")), 32 << 20))
        .collect();
    let other = sparse_dwarf_library(&d.join("libother.so"), 32 << 20);
    let mut hogging = hostile_with_plugins(&hog.iter().map(PathBuf::as_path).collect::<Vec<_>>());
    let mut victim = Target::spawn(as_user_recorded(&compile_c("hostile"), 1));
    victim.send(&format!("plugin {}", other.display()));
    assert_eq!(victim.wait_line(""), "loaded");
    // One collector for both, the hog's files read first.
    let (hpid, vpid) = (hogging.pid().to_string(), victim.pid().to_string());
    let out_dir = t.path("snaps");
    let (mut watch, lines) = running(
        &[
            "watch",
            &hpid,
            &vpid,
            "-f",
            "json",
            "-d",
            &out_dir.to_string_lossy(),
        ],
        &[("HEAPDUMP_MAX_TOTAL_READ", &(200u64 << 20).to_string())],
    );
    assert!(lines.next().starts_with("watching "));
    let snapshot_of = |target: &mut Target| {
        target.send("request");
        target.wait_line("requested");
        read_json(&next_written(&lines, &out_dir, target.pid()))
    };
    let v = snapshot_of(&mut victim);
    let h = snapshot_of(&mut hogging);
    // The other user's library is read whole: the hog took only its
    // user's half. So is libc, whose frames every stack holds: read first
    // for the hog, it did not fit in the hog's half, and is read again for
    // the other user.
    let notes = v["notes"].to_string();
    assert!(!notes.contains("HEAPDUMP_MAX_TOTAL_READ"), "{notes}");
    assert_eq!(live_blocks_through(&v, "site_plugin"), 100);
    // The hog's libraries past its half were not, and its snapshot says so.
    let notes = h["notes"].to_string();
    assert!(
        notes.contains("libhog") && notes.contains("HEAPDUMP_MAX_TOTAL_READ"),
        "{notes}"
    );
    assert_eq!(live_blocks_through(&h, "site_plugin"), 400);
    victim.send("quit");
    hogging.send("quit");
    assert!(watch.wait().unwrap().success());
}

#[test]
fn a_server_gives_back_what_it_read_for_a_process_once_it_exited() {
    if !root_here("server's total") {
        return;
    }
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-server-total");
    let (first, second) = one_of_two_fits(&t);
    // Two costly processes of one user, one after another: no user share
    // (`--user-burst`) holds the second back, what is read is the point.
    let (mut server, lines) = running(
        &["serve", "--listen", "127.0.0.1:0", "--user-burst", "3600"],
        &ONE_OF_TWO_TOTAL,
    );
    let addr = listening_addr(&lines.next());
    let served = |lib: &Path| {
        let mut target = hostile_of_user_with_plugins(ALONE, &[lib]);
        let (head, body) = http_get_with(
            &addr,
            &format!("/debug/pprof/heap?pid={}", target.pid()),
            "",
        );
        assert!(head.contains(" 200 "), "{head}");
        // The target exits and is not asked for again: the server must
        // still let go of what it read for it.
        target.send("quit");
        assert!(target.finish().success());
        heapdump::formats::pprof::decode(&body).expect("pprof body")
    };
    for (lib, p) in [(&first, served(&first)), (&second, served(&second))] {
        let comments: Vec<&str> = p
            .comment
            .iter()
            .map(|&i| p.string_table[i as usize].as_str())
            .collect();
        assert!(
            !comments
                .iter()
                .any(|c| c.contains("HEAPDUMP_MAX_TOTAL_READ")),
            "{}: {comments:?}",
            lib.display()
        );
        let plugin = p
            .function
            .iter()
            .any(|f| p.string_table[f.name as usize] == "site_plugin");
        assert!(plugin, "{}: site_plugin not named", lib.display());
    }
    let _ = server.kill();
    let _ = server.wait();
}

/// Spawns `cmd` as process `pid` (free now): the kernel's last pid is set
/// just below it before each try (`/proc/sys/kernel/ns_last_pid`, root's),
/// and a try that another fork of the machine beat is undone and made
/// again; `None` after 50 tries.
fn spawn_at_pid(pid: u32, mut cmd: impl FnMut() -> Command) -> Option<Target> {
    for _ in 0..50 {
        std::fs::write("/proc/sys/kernel/ns_last_pid", (pid - 1).to_string()).ok()?;
        let mut target = Target::spawn(cmd());
        if target.pid() == pid {
            return Some(target);
        }
        target.send("quit");
        let _ = target.finish();
    }
    None
}

#[test]
fn a_server_never_answers_for_a_process_from_the_regions_of_one_that_had_its_pid() {
    if !root_here("pid used again") {
        return;
    }
    let last_pid = Path::new("/proc/sys/kernel/ns_last_pid");
    let settable = std::fs::OpenOptions::new()
        .write(true)
        .open(last_pid)
        .is_ok();
    if !real_dependency("a writable /proc/sys/kernel/ns_last_pid", settable) {
        return;
    }
    // serve keeps each target's regions open; it checked whether the pid
    // had exited with a pidfd opened there and then, which a process that
    // was given the same pid since passes: it was answered for from the
    // dead process's regions.
    let exe = compile_c("hostile");
    let mut first = Target::spawn(as_nobody_recorded(&exe));
    first.send("alloc");
    first.wait_line("allocated");
    let pid = first.pid();
    let (mut server, addr, _lines) = server_of_heaps();
    let live_blocks = || served_live_blocks(&addr, pid);
    let before = live_blocks();
    assert!(before >= 100, "{before}");
    first.send("quit");
    assert!(first.finish().success());
    // Another process, given the same pid, that allocated nothing of its
    // own yet.
    let Some(mut second) = spawn_at_pid(pid, || as_nobody_recorded(&exe)) else {
        panic!("pid {pid} could not be had again in 50 tries");
    };
    let after = live_blocks();
    assert!(
        after < before - 50,
        "served from the dead process: {after} of {before} blocks"
    );
    second.send("quit");
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn a_process_that_executes_another_program_is_followed_by_watch_collector_and_server() {
    if !root_here("exec") {
        return;
    }
    // A process whose agent made its regions, then executed a program
    // (itself here: a wrapper that `exec`s the service, `setpriv`, `sh -c
    // 'exec ...'`): its new program's regions are new ones. watch, the
    // collector and the server kept the first regions open, answered
    // nothing of the new program and snapshotted the old one forever.
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-exec");
    let blocks = |j: &serde_json::Value| live_blocks_through(j, "site_hostile");
    for all in [false, true] {
        let mut target = hostile_with_plugins(&[]);
        let pid = target.pid();
        target.send("alloc");
        target.wait_line("allocated");
        let out_dir = t.path(if all { "all" } else { "one" });
        let mut args = vec!["watch", "--scan", "20ms", "--poll", "5ms", "-f", "json"];
        let pid_arg = pid.to_string();
        args.push(if all { "--all" } else { &pid_arg });
        let dir_arg = out_dir.to_string_lossy().to_string();
        args.extend(["-d", &dir_arg]);
        let (mut watch, lines) = running(&args, &[]);
        while !lines.next().starts_with(&format!("watching {pid} ")) {}
        target.send("exec");
        target.wait_line("ready");
        // The program before: its last snapshot, its 100 blocks.
        let before = next_written(&lines, &out_dir, pid);
        assert!(before.to_string_lossy().contains("-exec-"), "{before:?}");
        assert_eq!(blocks(&read_json(&before)), 100, "all: {all}");
        // The new program, watched: its request answered from its own
        // regions (200 blocks of its own, none of the program before).
        while !lines.next().starts_with(&format!("watching {pid} ")) {}
        for _ in 0..2 {
            target.send("alloc");
            target.wait_line("allocated");
        }
        target.send("request");
        target.wait_line("requested");
        let answered = next_written(&lines, &out_dir, pid);
        assert!(
            answered.to_string_lossy().contains("-signal-"),
            "{answered:?}"
        );
        assert_eq!(blocks(&read_json(&answered)), 200, "all: {all}");
        target.send("quit");
        assert!(target.finish().success());
        let last = next_written(&lines, &out_dir, pid);
        assert!(last.to_string_lossy().contains("-exit-"), "{last:?}");
        assert_eq!(blocks(&read_json(&last)), 200, "all: {all}");
        if all {
            // SAFETY: kill takes a pid and a signal.
            unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
        }
        assert!(watch.wait().unwrap().success());
    }
    // The server: opened before the exec, asked after it.
    let mut target = hostile_with_plugins(&[]);
    let pid = target.pid();
    target.send("alloc");
    target.wait_line("allocated");
    let (mut server, addr, _lines) = server_of_heaps();
    let live_blocks = || served_live_blocks(&addr, pid);
    let before = live_blocks();
    assert!(before >= 100, "{before}");
    target.send("exec");
    target.wait_line("ready");
    let after = live_blocks();
    assert!(
        after < before - 50,
        "served from the program before: {after} of {before} blocks"
    );
    target.send("quit");
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn a_process_that_executes_itself_again_and_again_gets_no_more_files_than_keep_requests() {
    if !root_here("exec again and again") {
        return;
    }
    // Each exec of a watched process writes the program before's last
    // snapshot, and its new program was watched with a history of its
    // own: the exec snapshots were never rotated and the answers kept of
    // each program started again from none, so a process that executed
    // itself (or faked it, regions made anew) every second filled the
    // collector's directory with one file a second up to --max-total.
    let t = TempDir::new("hostile-exec-again");
    let dir = t.path("out");
    let dir_arg = dir.to_string_lossy().to_string();
    let args = [
        "watch",
        "--all",
        "--scan",
        "20ms",
        "--poll",
        "5ms",
        "--min-request-interval",
        "1ms",
        "--keep-requests",
        "2",
        "-f",
        "json",
        "-d",
        &dir_arg,
    ];
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    let pid = target.pid();
    let (mut watch, lines) = running(&args, &[]);
    let mut written = 0;
    for _ in 0..4 {
        while !lines.next().starts_with(&format!("watching {pid} ")) {}
        target.send("request");
        target.wait_line("requested");
        let answered = next_written(&lines, &dir, pid);
        assert!(
            answered.to_string_lossy().contains("-signal-"),
            "{answered:?}"
        );
        target.send("exec");
        target.wait_line("ready");
        let before = next_written(&lines, &dir, pid);
        assert!(before.to_string_lossy().contains("-exec-"), "{before:?}");
        written += 2;
    }
    while !lines.next().starts_with(&format!("watching {pid} ")) {}
    let kept: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with(&format!("heapdump-{pid}-")))
        .collect();
    assert_eq!(kept.len(), 2, "of {written} written, kept: {kept:?}");
    // The newest two: the last answer and the last exec, numbered on
    // from the program before (one process, one sequence).
    let seq = |n: &String| n.split('-').nth(2).unwrap().parse::<u64>().unwrap();
    let mut seqs: Vec<u64> = kept.iter().map(seq).collect();
    seqs.sort();
    assert_eq!(seqs, [written - 1, written], "{kept:?}");
    target.send("quit");
    assert!(target.finish().success());
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    assert!(watch.wait().unwrap().success());
}

#[test]
fn top_follows_a_process_that_executes_another_program() {
    if !root_here("exec under top") {
        return;
    }
    // Before: top went on showing the program before's heap, named from
    // the new program's mappings.
    let mut target = hostile_with_plugins(&[]);
    let pid = target.pid();
    target.send("alloc");
    target.wait_line("allocated");
    let (mut top, lines) = running(
        &["top", &pid.to_string(), "--interval", "20ms", "-n", "40"],
        &[],
    );
    // top prints a report every 20 ms whatever happens: the waits below
    // are bounded by the hang guard, not by its output ending.
    let deadline = std::time::Instant::now() + HANG_GUARD;
    let next = || {
        assert!(
            std::time::Instant::now() < deadline,
            "top never showed what was waited for"
        );
        lines.next()
    };
    // The site's live blocks in each report, as top prints them.
    let next_count = || loop {
        let l = next();
        if l.contains(" site_hostile (") {
            let cols: Vec<&str> = l.split_whitespace().collect();
            return cols[4].to_string();
        }
    };
    assert_eq!(next_count(), "100");
    target.send("exec");
    target.wait_line("ready");
    let said =
        format!("pid {pid} executed another program: this is the heap of the program before");
    while next() != said {}
    for _ in 0..2 {
        target.send("alloc");
        target.wait_line("allocated");
    }
    while next_count() != "200" {}
    target.send("quit");
    assert!(target.finish().success());
    assert!(top.wait().unwrap().success());
}

#[test]
fn a_process_with_more_mappings_than_kept_is_snapshotted_and_told_so() {
    if !root_here("many mappings") {
        return;
    }
    let t = TempDir::new("hostile-maps");
    let d = nobody_dir(&t, "app");
    let data = d.join("data");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    chown_nobody(&data);
    let mut target = hostile_with_plugins(&[]);
    target.send("alloc");
    target.wait_line("allocated");
    let n = heapdump::symbolization::maps::MAX_MAPPINGS + 100;
    target.send(&format!("mapmany {n} {}", data.display()));
    assert_eq!(target.wait_line(""), format!("mapped {n}"));
    let pid = target.pid().to_string();
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    // The program's own frames still named (its mapping is executable).
    assert_eq!(live_blocks_through(&j, "site_hostile"), 100);
    assert_eq!(
        j["mappings"].as_array().unwrap().len(),
        heapdump::symbolization::maps::MAX_MAPPINGS
    );
    let notes = j["notes"].to_string();
    assert!(notes.contains("file mappings or more"), "{notes}");
    target.send("quit");
}

/// A directory under `dir` whose path is about 3.5 KiB long (14 levels of
/// 250-byte names), owned by nobody.
fn long_path_dir(dir: &Path) -> PathBuf {
    let mut d = dir.to_path_buf();
    for _ in 0..14 {
        d.push("x".repeat(250));
        std::fs::create_dir(&d).unwrap();
        chown_nobody(&d);
    }
    d
}

#[test]
fn a_target_with_a_quarter_gigabyte_of_maps_text_costs_attach_and_snapshot_little() {
    if !root_here("long maps text") {
        return;
    }
    // 50 000 mappings of one file under a 3.5 KiB path: 180 MB of
    // /proc/PID/maps, which attach read whole at each of its rounds, and
    // of which root's attach and snapshot each kept the paths of the 16 Ki
    // mappings symbolization keeps, one copy per mapping (attach 454 MB,
    // snapshot 275 MB with 60 000, by hand; now 14 MB and 50 MB).
    let _big = BIG_READS.lock().unwrap_or_else(|e| e.into_inner());
    let t = TempDir::new("hostile-maps-text");
    let data = long_path_dir(&nobody_dir(&t, "app")).join("data");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    chown_nobody(&data);
    let mut target = Target::spawn(as_nobody(&compile_c("hostile")));
    let pid = target.pid().to_string();
    target.send(&format!("mapmany 50000 {}", data.display()));
    assert_eq!(target.wait_line(""), "mapped 50000");
    // Counted a piece at a time (not held: 180 MB).
    let mut maps = std::fs::File::open(format!("/proc/{pid}/maps")).unwrap();
    let text = std::io::copy(&mut maps, &mut std::io::sink()).unwrap();
    assert!(text > 150 << 20, "{text} bytes of maps text");
    let lib = preload_lib();
    let quiet = [("HEAPDUMP_DEBUG_DIRS", "/nonexistent")];
    let attach_rss = measured(
        &["attach", &pid, "--library", lib.to_str().unwrap()],
        &quiet,
    )
    .ok("attach")
    .rss;
    target.send("alloc");
    target.wait_line("allocated");
    // Folded stacks, not JSON: the JSON lists the 16 Ki kept mappings with
    // their paths (57 MB), more than this test needs to read.
    let folded = t.str("s.folded");
    let snapshot_rss = measured(
        &["snapshot", &pid, "--format", "folded", "-o", &folded],
        &quiet,
    )
    .ok("snapshot")
    .rss;
    let stacks = std::fs::read_to_string(&folded).unwrap();
    let site: Vec<&str> = stacks
        .lines()
        .filter(|l| l.contains("site_hostile"))
        .collect();
    assert_eq!(site.len(), 1, "{stacks}");
    assert!(site[0].ends_with(" 30000"), "{stacks}");
    let detach_rss = measured(&["detach", &pid], &quiet).ok("detach").rss;
    // Each well under one copy of the text, or of the kept mappings' paths
    // (16 Ki x 3.5 KiB = 57 MiB a copy).
    for (what, rss) in [
        ("attach", attach_rss),
        ("snapshot", snapshot_rss),
        ("detach", detach_rss),
    ] {
        assert!(rss < 48 << 20, "{what}: {} MiB resident", rss >> 20);
    }
    target.send("quit");
}

#[test]
fn a_flooding_process_cannot_delete_another_processes_snapshots() {
    if !root_here("flood") {
        return;
    }
    // Its collector adopts every process of the machine: one whose
    // libraries hold 64 MiB of DWARF each keeps it busy for seconds (a
    // debug build), and the test's lines would wait for that.
    let _big = BIG_READS.lock();
    let t = TempDir::new("hostile-flood");
    let out_dir = t.path("collected");
    let exe = compile_c("hostile");
    let mut victim = Target::spawn(as_nobody_recorded(&exe));
    let mut flooder = Target::spawn(as_nobody_recorded(&exe));
    victim.send("alloc");
    victim.wait_line("allocated");
    let (vpid, fpid) = (victim.pid(), flooder.pid());
    let mut watch = Command::new(bin())
        .args([
            "watch",
            "--all",
            "--scan",
            "50ms",
            "-f",
            "json",
            "--max-total",
            "64KiB",
            "-d",
        ])
        .arg(&out_dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Lines::new(watch.stdout.take().unwrap());
    let (mut seen_v, mut seen_f) = (false, false);
    while !(seen_v && seen_f) {
        let l = lines.next();
        seen_v |= l.starts_with(&format!("watching {vpid} "));
        seen_f |= l.starts_with(&format!("watching {fpid} "));
    }
    victim.send("request");
    victim.wait_line("requested");
    let evidence = next_written(&lines, &out_dir, vpid);
    flooder.send("flood 150");
    flooder.wait_line("flooded");
    // The flooder's last request is answered within the rate limit; wait
    // for the collector to write it.
    flooder.send("request");
    flooder.wait_line("requested");
    // At least two answers: the first request, and the last (made after
    // the flood ended, so answered once the interval has passed).
    for _ in 0..2 {
        next_written(&lines, &out_dir, fpid);
    }
    assert!(evidence.exists(), "the victim's snapshot was deleted");
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let out = watch.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains(&format!("pid {fpid} (")) && err.contains("asks for snapshots more often"),
        "{err}"
    );
    // At the stop, each process's final snapshot is its newest: the
    // victim still has one.
    let victims = std::fs::read_dir(&out_dir)
        .unwrap()
        .filter(|e| {
            e.as_ref()
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with(&format!("heapdump-{vpid}-"))
        })
        .count();
    assert!(victims >= 1, "every snapshot of the victim was deleted");
    victim.send("quit");
    flooder.send("quit");
}

/// A process of nobody's whose first snapshot costs seconds (in a debug
/// build): it maps a library whose `.debug_info` is 32 MiB (sparse), where
/// its site `site_plugin` lies; with the directory holding the library.
/// The caller holds [`BIG_READS`].
fn costly_target(name: &str) -> (TempDir, Target) {
    costly_target_of(name, NOBODY)
}

/// [`costly_target`], run as user `uid`.
fn costly_target_of(name: &str, uid: u32) -> (TempDir, Target) {
    let t = TempDir::new(name);
    let d = nobody_dir(&t, "app");
    let lib = sparse_dwarf_library(&d.join("libslow.so"), 32 << 20);
    let costly = hostile_of_user_with_plugins(uid, &[&lib]);
    (t, costly)
}

/// `exe` run as this test's user (root) under the preload agent.
fn as_root_recorded(exe: &Path) -> Command {
    let mut c = Command::new(exe);
    c.env("LD_PRELOAD", preload_lib());
    c
}

/// `heapdump list`, run by `as_user` (a command prefix, empty: root)
/// under `strace -e trace=SYSCALLS`: its output and the trace, written
/// into `dir` as `name`.
fn list_traced(dir: &TempDir, name: &str, syscalls: &str, as_user: &[&str]) -> (String, String) {
    traced(dir, name, syscalls, as_user, &["list"])
}

/// `heapdump ARGS` as [`list_traced`] runs `list`.
fn traced(
    dir: &TempDir,
    name: &str,
    syscalls: &str,
    as_user: &[&str],
    args: &[&str],
) -> (String, String) {
    let trace = dir.path(name);
    let out = Command::new("timeout")
        .arg(HANG_GUARD.as_secs().to_string())
        .args(["strace", "-f", "-qq", "-e"])
        .arg(format!("trace={syscalls}"))
        .arg("-o")
        .arg(&trace)
        .args(as_user)
        .arg(bin())
        .args(args)
        .output()
        .expect("strace (CI installs it)");
    assert!(out.status.success(), "{}", stderr(&out));
    (stdout(&out), std::fs::read_to_string(&trace).unwrap())
}

/// Whether `list`'s output shows `pid` recorded in exact mode.
fn listed_exact(listed: &str, pid: u32) -> bool {
    listed
        .lines()
        .any(|l| l.trim_start().starts_with(&format!("{pid} ")) && l.contains(" exact "))
}

#[test]
fn a_process_holding_many_descriptors_costs_finding_its_regions_none_of_them() {
    if !root_here("many descriptors") {
        return;
    }
    // Finding a process's regions read the link of every descriptor it
    // held (`/proc/PID/fd`): a process of nobody's holding half a million
    // (the hard limit systemd gives every user) made each `list`, each
    // scan of `watch --all` and each request of `serve` read half a
    // million links, seconds each (4.5 us a descriptor here). Root opens
    // the regions through their mappings (`/proc/PID/map_files`) and reads
    // no descriptor's link.
    let mut t = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    t.send("alloc");
    t.wait_line("allocated");
    t.send("fds 10000");
    let opened: usize = t.wait_line("opened ")[7..].parse().unwrap();
    assert!(opened >= 1000, "could open only {opened} descriptors");
    let dir = TempDir::new("hostile-fds");
    // The links `list` (as `as_user` runs it) read of the target's
    // descriptors.
    let links_read = |as_user: &[&str]| {
        let name = format!("trace-{}", as_user.len());
        let (listed, trace) = list_traced(&dir, &name, "readlink,readlinkat", as_user);
        assert!(listed_exact(&listed, t.pid()), "{as_user:?}: {listed}");
        trace
            .lines()
            .filter(|l| l.contains(&format!("/proc/{}/fd/", t.pid())))
            .count()
    };
    let links = links_read(&[]);
    assert!(
        links == 0,
        "root read {links} descriptors' links of a process holding {opened}"
    );
    // Its own user, who may not open mappings, reads the descriptors, but
    // only until both regions are found (the agent's are among the first
    // its process opened).
    let (uid, gid) = (format!("--reuid={NOBODY}"), format!("--regid={NOBODY}"));
    let links = links_read(&[
        "/usr/bin/setpriv",
        &uid,
        &gid,
        "--clear-groups",
        "--inh-caps=-all",
    ]);
    assert!(
        (1..16).contains(&links),
        "its user read {links} descriptors' links of a process holding {opened}"
    );
    t.send("quit");
}

#[test]
fn a_process_whose_mount_table_is_huge_is_listed_without_it_and_resolves_no_name() {
    if !root_here("a huge mount table") {
        return;
    }
    // Any user's own mount namespace holds up to `fs.mount-max` (100 000)
    // mounts, and the kernel writes each line of its mount table at a cost
    // the user decides (mounts stacked on one point: the stack walked for
    // each line, 9.5 s of kernel time for 23 000). Root read the whole
    // table of every instrumented process at every `list` (twice), scan
    // of `watch --all` and request of `serve` (18 s for one such process).
    // Now opening a process's regions reads no mount table, and a snapshot
    // reads at most 16 384 lines for at most a second; a table not read
    // whole may hide a FUSE mount anywhere, so no name is resolved in the
    // process's root (its perf map not read, and the snapshot says why).
    let dir = TempDir::new("hostile-mounts");
    let in_many_mounts = |mounts: u32| {
        let mut cmd = as_nobody_recorded(&compile_c("mount_many"));
        cmd.arg(mounts.to_string()).arg(compile_c("hostile"));
        let mut t = Target::spawn(cmd);
        for (ask, answer) in [("alloc", "allocated"), ("jit", "jitted")] {
            t.send(ask);
            t.wait_line(answer);
        }
        t
    };
    let named_jit = |t: &Target, name: &str| {
        let json = dir.str(&format!("{name}.json"));
        ok(&bounded(&["snapshot", &t.pid().to_string(), "-o", &json]));
        let j = read_json(Path::new(&json));
        (
            live_blocks_through(&j, "LazyCompile:*jsAllocate app.js:12"),
            live_blocks_through(&j, "site_hostile"),
            j["notes"].to_string(),
        )
    };
    // A few mounts: the table is read, the perf map too.
    let mut few = in_many_mounts(100);
    let (jit, hostile, notes) = named_jit(&few, "few");
    assert_eq!((jit, hostile), (10, 100), "{notes}");
    few.send("quit");
    let mut many = in_many_mounts(17_000);
    let pid = many.pid();
    let (listed, trace) = list_traced(&dir, "trace", "openat", &[]);
    assert!(listed_exact(&listed, pid), "{listed}");
    // Once, for what the agent cannot see in its program (its executable,
    // through its mapping); no more for opening its regions.
    let tables = trace.matches(&format!("/proc/{pid}/mountinfo")).count();
    assert!(tables <= 1, "list read its mount table {tables} times");
    // The snapshot: its own frames named (through the mappings), the
    // perf map not read, and said.
    let (jit, hostile, notes) = named_jit(&many, "many");
    assert_eq!((jit, hostile), (0, 100), "{notes}");
    assert!(
        notes.contains("perf-") && notes.contains("mount table was not read whole"),
        "{notes}"
    );
    many.send("quit");
}

#[test]
fn a_process_mapping_thousands_of_fake_regions_is_refused_without_opening_them() {
    if !root_here("fake regions") {
        return;
    }
    // Every file a process maps shared and writable under a region's name
    // was opened, checked for its seals and mapped at every opening of the
    // process (each `list`, scan of `watch --all`, request of `serve`): a
    // process of nobody's mapping thousands cost that many each time. An
    // agent makes two (and a fork child briefly holds its parent's): more
    // than 16 are refused unopened.
    let mut t = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    t.send("alloc");
    t.wait_line("allocated");
    t.send("memfds 2000");
    let made: usize = t.wait_line("made ")[5..].parse().unwrap();
    assert_eq!(made, 2000);
    let dir = TempDir::new("hostile-fake-regions");
    let (listed, trace) = list_traced(&dir, "trace", "openat", &[]);
    let pid = t.pid();
    assert!(
        listed.contains(&format!(
            "maps {} files named as heapdump regions",
            made + 2
        )),
        "{listed}"
    );
    // The one that tells whether mappings may be opened (when the process
    // is found, and when it is opened), no more.
    let opened = trace.matches(&format!("/proc/{pid}/map_files/")).count();
    assert!(opened <= 2, "{opened} mappings opened");
    let out = bounded(&["snapshot", &pid.to_string()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("more than a heapdump agent makes"),
        "{}",
        stderr(&out)
    );
    t.send("quit");
}

#[test]
fn a_file_mapped_thousands_of_times_is_opened_and_read_once_per_snapshot() {
    if !root_here("one file mapped many times") {
        return;
    }
    // Symbolization checked each kept mapping's `/proc/PID/map_files`
    // entry by opening it, and read each one's build ID (an open and an
    // ELF parse): a process of nobody's mapping one file thousands of
    // times cost a snapshot, and each round of an attach, that many
    // (60 000 mappings: attach 0.54 s, release). The mappings of one file
    // now share its first one's verdict and ID (attach 0.20 s).
    let mut t = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    t.send("alloc");
    t.wait_line("allocated");
    t.send("mapmany 2000 /etc/hostname");
    assert_eq!(t.wait_line("mapped "), "mapped 2000");
    let dir = TempDir::new("hostile-one-file");
    let pid = t.pid().to_string();
    let (out, trace) = traced(&dir, "trace", "openat", &[], &["snapshot", &pid]);
    assert!(out.contains("site_hostile"), "{out}");
    let opened = trace.matches(&format!("/proc/{pid}/map_files/")).count();
    assert!(opened < 100, "{opened} mappings opened");
    t.send("quit");
}

#[test]
fn a_process_whose_snapshots_cost_much_is_answered_in_proportion() {
    if !root_here("costly snapshots") {
        return;
    }
    // A process can make each of its snapshots cost the collector seconds
    // (libraries of big debug information, cycled through so that each is
    // read anew), and asked for one as soon as the request interval
    // allowed: the collector, one thread, spent its time on that process
    // and the others' requests waited. Now a process's next snapshot, and
    // the next one of any process of its user (many processes, each
    // costly once, would each take their share), waits four times as long
    // as the last one took, and the other users' are answered meanwhile.
    let _big = BIG_READS.lock().unwrap_or_else(|e| e.into_inner());
    // The costly process starts as root's and drops to nobody once
    // watched, as a daemon does: its cost is its user's now, not the
    // user it was adopted as (root's process is answered meanwhile).
    let (t, mut costly) = costly_target_of("hostile-costly", 0);
    let exe = compile_c("hostile");
    // Another process of nobody's, cheap itself.
    let mut sibling = Target::spawn(as_nobody_recorded(&exe));
    let mut other = Target::spawn(as_root_recorded(&exe));
    let (pid, sibling_pid, other_pid) = (costly.pid(), sibling.pid(), other.pid());
    let dir = t.path("out");
    let dir_arg = dir.to_string_lossy().to_string();
    let mut watch = Command::new(bin())
        .args(["watch", "--all", "--scan", "20ms", "--poll", "5ms"])
        .args([
            "--min-request-interval",
            "1ms",
            "-f",
            "json",
            "-d",
            &dir_arg,
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let lines = Lines::new(watch.stdout.take().unwrap());
    let mut unseen = vec![pid, sibling_pid, other_pid];
    while !unseen.is_empty() {
        let l = lines.next();
        unseen.retain(|p| !l.starts_with(&format!("watching {p} ")));
    }
    costly.send(&format!("setuid {NOBODY}"));
    assert_eq!(costly.wait_line("setuid "), "setuid ok");
    let count = |p: &Path| read_json(p)["request"]["count"].as_u64().unwrap();
    costly.send("request");
    costly.wait_line("requested");
    // Reads the 32 MiB of DWARF: the costly one (seconds).
    let first = next_written(&lines, &dir, pid);
    assert_eq!(count(&first), 1, "{first:?}");
    for target in [&mut costly, &mut sibling] {
        target.send("request");
        target.wait_line("requested");
    }
    // Two answers to root's process: the collector looked at the nobody's
    // two requests at least once since they were made (each pass looks at
    // every process), and answered neither.
    let file_of = |p: u32| format!("wrote {}/heapdump-{p}-", dir.display());
    for _ in 0..2 {
        other.send("request");
        other.wait_line("requested");
        loop {
            let l = lines.next();
            assert!(
                !l.starts_with(&file_of(pid)) && !l.starts_with(&file_of(sibling_pid)),
                "answered at once: {l}"
            );
            if l.starts_with(&file_of(other_pid)) {
                break;
            }
        }
    }
    // Answered later (the costly one with the request made after).
    costly.send("request");
    costly.wait_line("requested");
    let (mut second, mut sibling_answered) = (None, false);
    while second.is_none() || !sibling_answered {
        let l = lines.next();
        if let Some(path) = l.strip_prefix(&file_of(pid)) {
            second = Some(dir.join(format!("heapdump-{pid}-{path}")));
        }
        sibling_answered |= l.starts_with(&file_of(sibling_pid));
    }
    let second = second.unwrap();
    assert_eq!(count(&second), 3, "{second:?}");
    // SAFETY: kill takes a pid and a signal.
    unsafe { libc::kill(watch.id() as i32, libc::SIGTERM) };
    let out = watch.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    // Said once for each held back (its own last snapshot or its user's:
    // the collector also watches other tests' processes of nobody's).
    for held in [pid, sibling_pid] {
        assert!(
            err.lines()
                .any(|l| l.contains(&format!("pid {held} (")) && l.contains("4 times that")),
            "{err}"
        );
    }
    for target in [&mut costly, &mut sibling, &mut other] {
        target.send("quit");
    }
}

#[test]
fn a_process_whose_reading_costs_much_is_served_from_its_last_scrape_meanwhile() {
    if !root_here("costly scrapes") {
        return;
    }
    // /metrics reads every process and gives frames to its top sites: a
    // process whose top sites lie in libraries of big debug information
    // (cycled through, each read anew) made every scrape of the host
    // slow, past Prometheus's scrape timeout, and every process's series
    // were lost with it. Now a process whose reading took long is read
    // again once four times as long has passed; its last series are
    // served meanwhile (heapdump_scrape_age_seconds > 0), the others'
    // are read at each scrape.
    let _big = BIG_READS.lock().unwrap_or_else(|e| e.into_inner());
    let (_t, mut costly) = costly_target("hostile-costly-scrape");
    // Another user's (a process of nobody's would wait for nobody's share
    // of the server, see the next test).
    let mut other = Target::spawn(as_root_recorded(&compile_c("hostile")));
    other.send("alloc");
    other.wait_line("allocated");
    let (cl, ol) = (
        format!("pid=\"{}\"", costly.pid()),
        format!("pid=\"{}\"", other.pid()),
    );
    let (mut server, lines) = running(&["serve", "--listen", "127.0.0.1:0"], &[]);
    let addr = listening_addr(&lines.next());
    let metrics = || String::from_utf8(http_get_with(&addr, "/metrics", "").1).unwrap();
    let blocks = |text: &str, l: &str| sample(text, "heapdump_live_blocks", &[l]).unwrap();
    // Reads the 32 MiB of DWARF for the plugin's site: seconds.
    let first = metrics();
    assert!(
        sample(
            &first,
            "heapdump_site_live_bytes",
            &[&cl, "site=\"site_plugin"]
        )
        .is_some(),
        "{first}"
    );
    assert_eq!(
        sample(&first, "heapdump_scrape_age_seconds", &[&cl]),
        Some(0.0)
    );
    let (costly_before, other_before) = (blocks(&first, &cl), blocks(&first, &ol));
    for target in [&mut costly, &mut other] {
        target.send("alloc");
        target.wait_line("allocated");
    }
    // Scraped until the other process's 100 new blocks show: it was read
    // again; the costly one was not.
    let text = loop {
        let text = metrics();
        if blocks(&text, &ol) == other_before + 100.0 {
            break text;
        }
    };
    assert_eq!(blocks(&text, &cl), costly_before, "read again: {text}");
    let age = sample(&text, "heapdump_scrape_age_seconds", &[&cl]).unwrap();
    assert!(age > 0.0, "{text}");
    let _ = server.kill();
    let _ = server.wait();
    // The same for profiles (a continuous profiler scraping each process's
    // /debug/pprof/heap): a profile that cost much is served again until
    // four times as long has passed; it carries its own time. A server of
    // its own, which reads the DWARF anew.
    let (mut server, lines) = running(&["serve", "--listen", "127.0.0.1:0"], &[]);
    let addr = listening_addr(&lines.next());
    let profile = |pid: u32| {
        let (head, body) = http_get_with(&addr, &format!("/debug/pprof/heap?pid={pid}"), "");
        assert!(head.contains(" 200 "), "{head}");
        heapdump::formats::pprof::decode(&body).expect("pprof body")
    };
    let live =
        |p: &heapdump::formats::pprof::Profile| p.sample.iter().map(|s| s.value[2]).sum::<i64>();
    let first = profile(costly.pid());
    let other_first = profile(other.pid());
    for target in [&mut costly, &mut other] {
        target.send("alloc");
        target.wait_line("allocated");
    }
    loop {
        if live(&profile(other.pid())) == live(&other_first) + 100 {
            break;
        }
    }
    let again = profile(costly.pid());
    assert_eq!(live(&again), live(&first), "taken again");
    assert_eq!(again.time_nanos, first.time_nanos);
    costly.send("quit");
    other.send("quit");
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn one_users_costly_processes_share_a_quarter_of_serve_and_are_read_in_turn() {
    if !root_here("a user's costly scrapes") {
        return;
    }
    // Each process whose reading costs much is read at most once per four
    // times its cost, but a user's many such processes each had that
    // quarter: enough of them kept serve reading them and nothing else
    // (every scrape of the host past its timeout). Now every reading of a
    // user's processes is charged to the user, and while its share is
    // spent none of them is read afresh (`--user-burst 0` here: from the
    // first reading on); they are read in turn, longest unread first.
    let _big = BIG_READS.lock().unwrap_or_else(|e| e.into_inner());
    let (_ta, mut a) = costly_target("hostile-user-share-a");
    let (_tb, mut b) = costly_target("hostile-user-share-b");
    let mut r = Target::spawn(as_root_recorded(&compile_c("hostile")));
    for t in [&mut a, &mut b, &mut r] {
        t.send("alloc");
        t.wait_line("allocated");
    }
    let pids = [a.pid(), b.pid(), r.pid()].map(|p| p.to_string());
    let [al, bl, rl] = pids.clone().map(|p| format!("pid=\"{p}\""));
    let serve = || {
        let mut args = vec!["serve", "--listen", "127.0.0.1:0", "--user-burst", "0"];
        args.extend(pids.iter().map(String::as_str));
        running(&args, &[])
    };
    let (scraped, lines) = serve();
    let addr = listening_addr(&lines.next());
    let metrics = || String::from_utf8(http_get_with(&addr, "/metrics", "").1).unwrap();
    let age = |text: &str, l: &str| sample(text, "heapdump_scrape_age_seconds", &[l]);
    let held = format!("reason=\"{}\"", heapdump::commands::serve::HELD_BACK);
    // The first scrape reads the first of nobody's two (seconds: its
    // plugin's DWARF), holds the second back, and reads root's.
    let first = metrics();
    assert_eq!(age(&first, &al), Some(0.0), "{first}");
    assert_eq!(age(&first, &bl), None, "read with the first: {first}");
    assert_eq!(
        sample(&first, "heapdump_scrape_errors", &[&held]),
        Some(1.0),
        "{first}"
    );
    assert_eq!(age(&first, &rl), Some(0.0), "{first}");
    // Scraped until the second is read: never in the same scrape as the
    // first, whose last series are served meanwhile.
    let guard = std::time::Instant::now();
    loop {
        assert!(
            guard.elapsed() < HANG_GUARD,
            "the second process was never read"
        );
        let text = metrics();
        assert!(age(&text, &rl).is_some(), "{text}");
        if age(&text, &bl) == Some(0.0) {
            assert!(age(&text, &al).unwrap() > 0.0, "both read at once: {text}");
            break;
        }
        // Polled, not waited on: only spares the machine.
        std::thread::sleep(std::time::Duration::from_millis(100));
    }
    // Profiles alike, on a server of its own: after the first one's
    // costly profile, the second's is refused for now (503, Retry-After),
    // as is a delta of it; root's is answered.
    drop(scraped);
    let (_server, lines) = serve();
    let addr = listening_addr(&lines.next());
    let get = |pid: &str, extra: &str| {
        http_get_with(&addr, &format!("/debug/pprof/heap?pid={pid}{extra}"), "").0
    };
    let head = get(&pids[0], "");
    assert!(head.contains(" 200 "), "{head}");
    for extra in ["", "&seconds=1"] {
        let head = get(&pids[1], extra);
        assert!(head.contains(" 503 "), "{extra}: {head}");
        let retry: u64 = head
            .lines()
            .find_map(|l| l.strip_prefix("Retry-After: "))
            .and_then(|v| v.trim().parse().ok())
            .unwrap_or_else(|| panic!("no Retry-After: {head}"));
        assert!(retry >= 1, "{head}");
    }
    let head = get(&pids[2], "");
    assert!(head.contains(" 200 "), "{head}");
    for t in [&mut a, &mut b, &mut r] {
        t.send("quit");
    }
}

/// `GET path` from the server at `addr`, as user nobody (bash's
/// `/dev/tcp`): the whole answer, head and body.
fn get_as_nobody(addr: &str, path: &str) -> String {
    let (host, port) = addr.rsplit_once(':').unwrap();
    let out = Command::new("timeout")
        .arg(HANG_GUARD.as_secs().to_string())
        .args([
            "/usr/bin/setpriv",
            &format!("--reuid={NOBODY}"),
            &format!("--regid={NOBODY}"),
            "--clear-groups",
            "--inh-caps=-all",
            "bash",
            "-c",
        ])
        .arg(format!(
            "exec 3<>/dev/tcp/{host}/{port} && printf 'GET %s HTTP/1.0\\r\\n\\r\\n' \"$1\" >&3 \
             && cat <&3"
        ))
        .args(["_", path])
        .output()
        .unwrap();
    assert!(out.status.success(), "{}", stderr(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[test]
fn serve_over_loopback_without_a_token_gives_each_user_only_its_own_processes() {
    if !root_here("serve to another user") {
        return;
    }
    // serve, started by root on loopback without a token (as the docs
    // start it on a laptop), answered any user of the machine, for any
    // process: nobody read the heap profile of root's daemon (its call
    // stacks, thread names and sizes). Now each connection is served as
    // the user owning the client's socket: the processes that user may
    // read.
    let exe = compile_c("hostile");
    let mut roots = Target::spawn(as_root_recorded(&exe));
    let mut nobodys = Target::spawn(as_nobody_recorded(&exe));
    for t in [&mut roots, &mut nobodys] {
        t.send("alloc");
        t.wait_line("allocated");
    }
    let (rp, np) = (roots.pid(), nobodys.pid());
    let (mut server, addr, _lines) = server_of_heaps();
    let refused = get_as_nobody(&addr, &format!("/debug/pprof/heap?pid={rp}"));
    assert!(
        refused.starts_with("HTTP/1.0 403") && refused.contains("not yours to read"),
        "{refused}"
    );
    let own = get_as_nobody(&addr, &format!("/debug/pprof/heap?pid={np}"));
    assert!(
        own.starts_with("HTTP/1.0 200"),
        "{}",
        &own[..own.len().min(300)]
    );
    let metrics = get_as_nobody(&addr, "/metrics");
    assert!(metrics.contains(&format!("pid=\"{np}\"")), "{metrics}");
    assert!(!metrics.contains(&format!("pid=\"{rp}\"")), "{metrics}");
    let index = get_as_nobody(&addr, "/");
    assert!(!index.contains(&format!("  {rp} ")), "{index}");
    // Root (this test) is served both.
    let (_, body) = http_get_with(&addr, "/metrics", "");
    let metrics = String::from_utf8(body).unwrap();
    for pid in [rp, np] {
        assert!(metrics.contains(&format!("pid=\"{pid}\"")), "{metrics}");
    }
    assert!(served_live_blocks(&addr, rp) >= 100);
    roots.send("quit");
    nobodys.send("quit");
    let _ = server.kill();
    let _ = server.wait();
}

#[test]
fn output_through_a_planted_link_or_into_a_planted_file_leaves_both_alone() {
    if !root_here("planted output") {
        return;
    }
    let t = TempDir::new("hostile-output");
    // A shared directory (sticky, writable by all, as /tmp is).
    let shared = t.path("shared");
    std::fs::create_dir(&shared).unwrap();
    std::fs::set_permissions(&shared, std::fs::Permissions::from_mode(0o1777)).unwrap();
    let precious = t.path("precious");
    std::fs::write(&precious, b"root's file").unwrap();
    let link = shared.join("heap.json");
    std::os::unix::fs::symlink(&precious, &link).unwrap();
    chown_nobody(&link);
    let planted = shared.join("report.html");
    std::fs::write(&planted, b"nobody's").unwrap();
    chown_nobody(&planted);
    std::fs::set_permissions(&planted, std::fs::Permissions::from_mode(0o666)).unwrap();
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    let pid = target.pid().to_string();
    let out = bounded(&["snapshot", &pid, "-o", link.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(stderr(&out).contains("symbolic link"), "{}", stderr(&out));
    assert_eq!(std::fs::read(&precious).unwrap(), b"root's file");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    let out = bounded(&["report", &pid, "-o", planted.to_str().unwrap()]);
    assert!(!out.status.success());
    assert_eq!(std::fs::read(&planted).unwrap(), b"nobody's");
    assert_eq!(std::fs::metadata(&planted).unwrap().uid(), NOBODY);
    // A directory another user can write (not sticky) is refused, and so
    // is one of another user's for watch -d.
    let open = t.path("open");
    std::fs::create_dir(&open).unwrap();
    std::fs::set_permissions(&open, std::fs::Permissions::from_mode(0o777)).unwrap();
    let out = bounded(&[
        "snapshot",
        &pid,
        "-o",
        open.join("x.json").to_str().unwrap(),
    ]);
    assert!(
        stderr(&out).contains("writable by other users"),
        "{}",
        stderr(&out)
    );
    let theirs = nobody_dir(&t, "theirs");
    let out = bounded(&["watch", &pid, "-d", theirs.to_str().unwrap()]);
    assert!(!out.status.success());
    assert!(
        stderr(&out).contains("choose another with -d"),
        "{}",
        stderr(&out)
    );
    target.send("quit");
}

#[test]
fn control_characters_in_names_are_escaped_in_text_and_the_svg_is_well_formed() {
    if !root_here("names") {
        return;
    }
    let t = TempDir::new("hostile-names");
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    target.send("name x\\e]0;T\\ay\\e[2J");
    target.wait_line("named");
    let pid = target.pid().to_string();
    let text = ok(&bounded(&["snapshot", &pid]));
    assert!(!text.bytes().any(|b| b == 0x1b || b == 0x07), "{text:?}");
    assert!(text.contains("x\\x1b]0;T\\x07y\\x1b[2J"), "{text}");
    let list = ok(&bounded(&["list"]));
    assert!(!list.bytes().any(|b| b == 0x1b || b == 0x07));
    // Run as root, list never advises running as root.
    assert!(!list.contains("run as root"), "{list}");
    let svg = t.path("f.svg");
    ok(&bounded(&[
        "snapshot",
        &pid,
        "--per-thread",
        "-o",
        svg.to_str().unwrap(),
    ]));
    let bytes = std::fs::read(&svg).unwrap();
    assert!(
        !bytes
            .iter()
            .any(|&b| b < 0x20 && b != b'\n' && b != b'\r' && b != b'\t'),
        "a control character in the SVG makes it ill-formed XML"
    );
    let svg_text = String::from_utf8(bytes).unwrap();
    assert!(svg_text.contains("site_named"), "the flamegraph is empty");
    target.send("quit");
}

/// `name` in `dir`, with bytes that are not UTF-8.
fn not_utf8(dir: &Path, name: &[u8]) -> PathBuf {
    use std::os::unix::ffi::OsStrExt;
    dir.join(std::ffi::OsStr::from_bytes(name))
}

#[test]
fn a_target_named_in_bytes_that_are_not_utf8_is_listed_and_snapshotted() {
    if !root_here("names not UTF-8") {
        return;
    }
    // A file's name and a process's name are any bytes. One mapped file so
    // named hid the process from `list` and `watch --all` and failed its
    // snapshot ("reading /proc/PID/fd: stream did not contain valid
    // UTF-8"): the maps text was read as a string, whole or not at all.
    let t = TempDir::new("hostile-not-utf8");
    let d = nobody_dir(&t, "app");
    let data = not_utf8(&d, b"data\xff\xfe");
    std::fs::write(&data, vec![0u8; 4096]).unwrap();
    chown_nobody(&data);
    let link = d.join("link");
    std::os::unix::fs::symlink(&data, &link).unwrap();
    let mut target = hostile_with_plugins(&[]);
    target.send("alloc");
    target.wait_line("allocated");
    target.send(&format!("mapmany 1 {}", link.display()));
    assert_eq!(target.wait_line(""), "mapped 1");
    target.send("name n\\xffm");
    target.wait_line("named");
    let pid = target.pid().to_string();
    let list = ok(&bounded(&["list"]));
    assert!(
        list.lines()
            .any(|l| l.split_whitespace().next() == Some(&pid)),
        "{list}"
    );
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    assert_eq!(live_blocks_through(&j, "site_hostile"), 100);
    assert_eq!(live_blocks_through(&j, "site_named"), 10);
    assert_eq!(j["process"], "n\u{fffd}m", "{}", j["process"]);
    target.send("quit");
}

#[test]
fn the_agent_never_takes_a_fault_signal_for_requests() {
    if !root_here("agent signals") {
        return;
    }
    // HEAPDUMP_SIGNAL=11 would turn a null dereference into a handler
    // that returns to the faulting instruction for ever: refused, the
    // process dies of its fault.
    let mut cmd = as_nobody_recorded(&compile_c("hostile"));
    cmd.env("HEAPDUMP_SIGNAL", "11").stderr(Stdio::piped());
    let mut target = Target::spawn(cmd);
    target.send("crash");
    let (tx, rx) = std::sync::mpsc::channel();
    let mut child = std::mem::replace(&mut target.child, Command::new("true").spawn().unwrap());
    std::thread::spawn(move || {
        let _ = tx.send(child.wait());
    });
    let status = rx
        .recv_timeout(HANG_GUARD)
        .expect("the crash spun for ever")
        .unwrap();
    use std::os::unix::process::ExitStatusExt;
    assert_eq!(status.signal(), Some(libc::SIGSEGV), "{status:?}");
}

#[test]
fn agent_settings_are_ignored_in_set_user_id_programs() {
    if !root_here("setuid") {
        return;
    }
    // A program linked with the agent (so it loads even where LD_PRELOAD
    // is ignored), set-user-ID root, run by nobody with HEAPDUMP_SIGNAL:
    // the setting is not taken (SIGUSR2 stays the request signal).
    let t = TempDir::new("hostile-setuid");
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let lib = preload_lib();
    let libdir = t.path("lib");
    std::fs::create_dir(&libdir).unwrap();
    std::fs::copy(&lib, libdir.join("libheapdump_preload.so")).unwrap();
    let exe = t.path("suid");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/hostile.c");
    cc(Command::new("cc")
        .args(["-O1", "-g", "-pthread", "-o"])
        .arg(&exe)
        .arg(&src)
        .arg(format!("-L{}", libdir.display()))
        .arg("-l:libheapdump_preload.so")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .arg("-ldl"));
    // (caught signals, AT_SECURE) of the program run by nobody.
    let caught = |setuid: bool| -> (u64, bool) {
        let mode = if setuid { 0o4755 } else { 0o755 };
        std::fs::set_permissions(&exe, std::fs::Permissions::from_mode(mode)).unwrap();
        let mut cmd = as_nobody(&exe);
        cmd.env("HEAPDUMP_SIGNAL", "SIGUSR1");
        let mut target = Target::spawn(cmd);
        target.send("alloc");
        target.wait_line("allocated");
        let status = std::fs::read_to_string(format!("/proc/{}/status", target.pid())).unwrap();
        let auxv = std::fs::read(format!("/proc/{}/auxv", target.pid())).unwrap();
        let secure = auxv
            .chunks_exact(16)
            .map(|c| {
                (
                    u64::from_ne_bytes(c[..8].try_into().unwrap()),
                    u64::from_ne_bytes(c[8..].try_into().unwrap()),
                )
            })
            .any(|(k, v)| k == libc::AT_SECURE && v != 0);
        target.send("quit");
        let mask = status
            .lines()
            .find_map(|l| l.strip_prefix("SigCgt:"))
            .unwrap()
            .trim()
            .to_string();
        (u64::from_str_radix(&mask, 16).unwrap(), secure)
    };
    let bit = |sig: i32| 1u64 << (sig - 1);
    let (plain, _) = caught(false);
    assert!(
        plain & bit(libc::SIGUSR1) != 0,
        "the setting is honoured normally"
    );
    let (suid, secure) = caught(true);
    if !real_dependency(
        "a file system that honours set-user-ID (not nosuid)",
        secure,
    ) {
        return;
    }
    assert!(
        suid & bit(libc::SIGUSR1) == 0 && suid & bit(libc::SIGUSR2) != 0,
        "HEAPDUMP_SIGNAL was taken in a set-user-ID program (SigCgt {suid:x})"
    );
}

/// Whether root and `unshare` are here to make containers (see
/// [`root_here`]).
fn containers_here() -> bool {
    root_here("chroot")
        && real_dependency("unshare, chroot", Path::new("/usr/bin/unshare").exists())
}

/// A container's root in `t`: `root/usr` (the host's, bound in by
/// [`in_container`]), `lib`, `lib64` and `bin` linked into it, and an
/// empty `root/app`; returns (root, app).
fn container_root(t: &TempDir) -> (PathBuf, PathBuf) {
    std::fs::set_permissions(&t.0, std::fs::Permissions::from_mode(0o755)).unwrap();
    let root = t.path("root");
    let app = root.join("app");
    std::fs::create_dir_all(&app).unwrap();
    std::fs::create_dir_all(root.join("usr")).unwrap();
    for (l, to) in [
        ("lib", "usr/lib"),
        ("lib64", "usr/lib64"),
        ("bin", "usr/bin"),
    ] {
        std::os::unix::fs::symlink(to, root.join(l)).unwrap();
    }
    (root, app)
}

/// `command` (a shell command line) run as `nobody` in a mount namespace
/// of its own, chrooted into `root` with the host's /usr bound in.
fn in_container(root: &Path, command: &str) -> Command {
    let mut cmd = Command::new("/usr/bin/unshare");
    cmd.args(["-m", "--propagation", "private", "--", "sh", "-c"])
        .arg(format!(
            "mount --bind /usr {root}/usr && exec chroot {root} /usr/bin/setpriv \
             --reuid=65534 --regid=65534 --clear-groups {command}",
            root = root.display()
        ))
        .env_remove("LD_PRELOAD");
    cmd
}

#[test]
fn a_process_in_a_root_of_its_own_is_attached_and_detached() {
    if !containers_here() {
        return;
    }
    // A container's process: its own root (the host's /usr bound in), so
    // our /proc/PID/maps names the agent under the root's host path, which
    // is no path inside it; detach must name the library as the process
    // sees it (it used to fail: "the agent library is not loaded").
    let t = TempDir::new("chrooted-attach");
    let (root, app) = container_root(&t);
    let tmp = root.join("tmp");
    std::fs::create_dir_all(&tmp).unwrap();
    std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777)).unwrap();
    hostile_copy(&app, "prog");
    let mut target = Target::spawn(in_container(&root, "/app/prog"));
    let pid = target.last_line()["ready ".len()..].to_string();
    let lib = preload_lib();
    let out = bounded(&["attach", &pid, "--library", lib.to_str().unwrap()]);
    assert!(out.status.success(), "{}", stderr(&out));
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.contains(&format!("{}/tmp/heapdump-agent-", root.display())),
        "the agent is not mapped from the process's own /tmp:\n{maps}"
    );
    target.send("alloc");
    target.wait_line("allocated");
    let out = ok(&bounded(&["detach", &pid]));
    assert!(out.contains("detached from"), "{out}");
    target.send("alloc");
    target.wait_line("allocated");
    let json = t.path("after.json");
    ok(&bounded(&["snapshot", &pid, "-o", json.to_str().unwrap()]));
    let j = read_json(&json);
    assert_eq!(
        live_by_leaf(&j).get("site_hostile"),
        Some(&(100, 30_000)),
        "blocks allocated after the detach were recorded"
    );
    target.send("quit");
}

#[test]
fn links_in_a_containers_root_resolve_inside_it_never_on_the_host() {
    if !containers_here() {
        return;
    }
    // A container: a root of its own (the host's /usr bound in), a
    // stripped program whose debug link `prog.debug` is a symbolic link.
    // The debug file exists on the host at the link's absolute target; in
    // the container that path is nothing. Resolved inside the container's
    // root, the link leads nowhere and the program stays unsymbolized;
    // resolved on the host (as `/proc/PID/root/app/prog.debug` would be),
    // root would read a host file the container chose.
    let t = TempDir::new("hostile-container");
    let (root, app) = container_root(&t);
    let prog = hostile_copy(&app, "prog");
    let debug = t.path("prog.debug");
    assert!(Command::new("objcopy")
        .arg("--only-keep-debug")
        .arg(&prog)
        .arg(&debug)
        .status()
        .unwrap()
        .success());
    assert!(Command::new("objcopy")
        .args(["--strip-all", "--add-gnu-debuglink"])
        .arg(&debug)
        .arg(&prog)
        .status()
        .unwrap()
        .success());
    std::fs::copy(preload_lib(), app.join("libheapdump_preload.so")).unwrap();
    let start = |link_to: &Path| -> (Target, String) {
        let link = app.join("prog.debug");
        let _ = std::fs::remove_file(&link);
        std::os::unix::fs::symlink(link_to, &link).unwrap();
        let mut target = Target::spawn(in_container(
            &root,
            "env LD_PRELOAD=/app/libheapdump_preload.so /app/prog",
        ));
        let pid = target.last_line()["ready ".len()..].to_string();
        target.send("alloc");
        target.wait_line("allocated");
        (target, pid)
    };
    let symbolized = |pid: &str| ok(&bounded(&["snapshot", pid])).contains("site_hostile");
    // The control: the debug file inside the container, the link absolute
    // within it: found.
    std::fs::create_dir_all(app.join("debug")).unwrap();
    std::fs::copy(&debug, app.join("debug/prog.debug")).unwrap();
    let (mut inside, pid) = start(Path::new("/app/debug/prog.debug"));
    assert!(
        symbolized(&pid),
        "an absolute link inside the root is followed there"
    );
    inside.send("quit");
    std::fs::remove_dir_all(app.join("debug")).unwrap();
    // The link to the host's file: never read.
    let (mut pointing_out, pid) = start(&debug);
    assert!(
        !symbolized(&pid),
        "the container's link was resolved on the host: root read {}",
        debug.display()
    );
    pointing_out.send("quit");
}

/// `DIR/libtwo.so`, built without debug information: its one function,
/// `plugin_alloc`, allocates 5 x 1111 bytes at one place and 5 x 2222 at
/// another.
fn two_place_library(t: &TempDir, dir: &Path) -> PathBuf {
    let src = t.path("two.c");
    std::fs::write(
        &src,
        "#include <stdlib.h>\nvoid *keep[20];\n\
         void plugin_alloc(int n) { (void)n;\n\
         for (int i = 0; i < 5; i++) keep[i] = malloc(1111);\n\
         for (int i = 0; i < 5; i++) keep[5 + i] = malloc(2222); }\n",
    )
    .unwrap();
    let lib = dir.join("libtwo.so");
    cc(Command::new("cc")
        .args(["-O0", "-fno-omit-frame-pointer", "-shared", "-fPIC", "-o"])
        .arg(&lib)
        .arg(&src));
    lib
}

#[test]
fn frames_without_lines_print_their_offset_and_jit_code_is_named_only_from_the_targets_own_perf_map(
) {
    if !root_here("sites") {
        return;
    }
    // A library built without debug information whose one function
    // allocates at two places: two sites, told apart by the offset in the
    // function (`two_places+0x..`), as perf and gdb name such frames.
    let t = TempDir::new("hostile-sites");
    let d = nobody_dir(&t, "app");
    let lib = two_place_library(&t, &d);
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    target.send(&format!("plugin {}", lib.display()));
    assert_eq!(target.wait_line(""), "loaded");
    target.send("jit");
    target.wait_line("jitted");
    let pid = target.pid();
    let text = ok(&bounded(&["snapshot", &pid.to_string()]));
    let mut places: Vec<&str> = text
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with("plugin_alloc+0x"))
        .collect();
    places.sort();
    places.dedup();
    assert_eq!(
        places.len(),
        2,
        "two sites in one function print alike: {text}"
    );
    // The JIT frame, named as the runtime's perf map names it.
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid.to_string(), "-o", &json]));
    let j = read_json(Path::new(&json));
    assert_eq!(
        live_blocks_through(&j, "LazyCompile:*jsAllocate app.js:12"),
        10,
        "{text}"
    );
    // The target swaps its map for a link to a file of root's that names
    // its code: root must not read it (the map is only the target's own
    // file, reached by no link).
    let secret = t.path("root-only.map");
    target.send(&format!("jitlink {}", secret.display()));
    let linked = target.wait_line("linked ");
    let mut place = linked.split_whitespace().skip(1);
    let (addr, size) = (place.next().unwrap(), place.next().unwrap());
    std::fs::write(&secret, format!("{addr} {size} RootOnly:secret\n")).unwrap();
    std::fs::set_permissions(&secret, std::fs::Permissions::from_mode(0o600)).unwrap();
    let map = PathBuf::from(format!("/tmp/perf-{pid}.map"));
    let names_it = |name: &str| {
        ok(&bounded(&["snapshot", &pid.to_string(), "-o", &json]));
        live_blocks_through(&read_json(Path::new(&json)), name)
    };
    assert_eq!(
        names_it("RootOnly:secret"),
        0,
        "root read the file a target's link led to"
    );
    // Another user's file in its place (put there before the target wrote
    // its own): not read either.
    std::fs::remove_file(&map).unwrap();
    std::fs::write(&map, format!("{addr} {size} OtherUser:planted\n")).unwrap();
    std::os::unix::fs::chown(&map, Some(NOBODY + 1), None).unwrap();
    assert_eq!(
        names_it("OtherUser:planted"),
        0,
        "root read a map another user put in /tmp"
    );
    // The same file as the target's own: read (the addresses were right).
    std::os::unix::fs::chown(&map, Some(NOBODY), None).unwrap();
    assert_eq!(names_it("OtherUser:planted"), 10);
    let _ = std::fs::remove_file(&map);
    target.send("quit");
}

/// A FUSE mount served by `tests/c/fuse_stall.c`; the server killed and
/// the mount lazily unmounted when dropped (a failed test included), which
/// also ends any request of root's it was leaving unanswered.
struct StallingMount {
    server: std::process::Child,
    point: PathBuf,
}

impl Drop for StallingMount {
    fn drop(&mut self) {
        let _ = self.server.kill();
        let _ = self.server.wait();
        let _ = Command::new("umount").arg("-l").arg(&self.point).status();
    }
}

/// A FUSE mount in `t` whose server answers its user and stalls root,
/// serving a library (`libtwo.so`, 10 blocks from its `plugin_alloc`),
/// and `tests/c/hostile.c` run as `nobody` under the agent, which has
/// loaded it: (mount point, target, mount), `None` where no FUSE mount
/// can be made. The mount, last, is dropped before the target: a hung
/// heapdump holds the target, and only the server's end frees both.
fn loading_a_served_library(t: &TempDir) -> Option<(PathBuf, Target, StallingMount)> {
    let d = nobody_dir(t, "src");
    let lib = two_place_library(t, &d);
    let point = nobody_dir(t, "mnt");
    let mount = stalling_mount(&point, &lib)?;
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    target.send(&format!("plugin {}", point.join("libtwo.so").display()));
    assert_eq!(target.wait_line(""), "loaded");
    Some((point, target, mount))
}

#[test]
fn a_library_on_a_fuse_mount_whose_server_stalls_root_is_not_read() {
    if !root_here("fuse") {
        return;
    }
    // A user allowed to mount FUSE with allow_other serves their own
    // process's library and leaves every request of root's unanswered:
    // once taken, such a request keeps root's process in uninterruptible
    // sleep (not even SIGKILL ends it) until the server dies.
    let t = TempDir::new("hostile-fuse");
    let Some((point, mut target, mount)) = loading_a_served_library(&t) else {
        return;
    };
    let served = point.join("libtwo.so");
    let pid = target.pid().to_string();
    // Before: heapdump stat-ed and opened the library through
    // /proc/PID/map_files and hung there, unkillable.
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    let through_the_library = live_blocks_with_frame(&j, |f| {
        f["module"].as_str() == served.to_str() && f["function"].is_null()
    });
    assert_eq!(
        through_the_library, 10,
        "the plugin's 10 blocks, at its unread library's addresses: {j}"
    );
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("fuse.fuse_stall") && notes.contains("libtwo.so"),
        "the snapshot says why the library was not read: {notes}"
    );
    // The text report and attach's checks go through the same files.
    let text = ok(&bounded(&["snapshot", &pid]));
    assert!(text.contains("fuse.fuse_stall"), "{text}");
    // A long-running watch keeps its symbolizer across snapshots: each
    // snapshot still says why the library's frames are addresses, the
    // final one after the target's exit too.
    let (mut watch, lines) = watch_json(&pid, &t.path("snaps"));
    let mut written = Vec::new();
    for _ in 0..2 {
        target.send("request");
        target.wait_line("requested");
        written.push(lines.next());
    }
    target.send("quit");
    written.push(lines.next());
    for wrote in &written {
        let path = wrote
            .strip_prefix("wrote ")
            .unwrap_or_else(|| panic!("{wrote}"));
        let j = read_json(Path::new(path));
        let notes = j["notes"].to_string();
        assert!(
            notes.contains("fuse.fuse_stall") && notes.contains("libtwo.so"),
            "{path}: {notes}"
        );
        assert_eq!(
            live_blocks_with_frame(&j, |f| f["module"].as_str() == served.to_str()),
            10,
            "{path}"
        );
    }
    assert!(written[2].contains("-exit-"), "{written:?}");
    let status = watch.wait().unwrap();
    assert!(status.success(), "watch died: {status:?}");
    drop(mount);
}

#[test]
fn a_fuse_mount_whose_point_is_not_utf8_is_known_as_one() {
    if !root_here("fuse, point not UTF-8") {
        return;
    }
    // The mount point is the user's to name: one byte that is not UTF-8
    // made the whole mount table unreadable as a string, so heapdump knew
    // of no FUSE mount and opened the served library (and hung, as in the
    // test above).
    let t = TempDir::new("hostile-fuse-utf8");
    let lib = two_place_library(&t, &nobody_dir(&t, "src"));
    let parent = nobody_dir(&t, "mnt");
    let point = not_utf8(&parent, b"point\xff");
    std::fs::create_dir(&point).unwrap();
    chown_nobody(&point);
    let Some(mount) = stalling_mount(&point, &lib) else {
        return;
    };
    let link = parent.join("link");
    std::os::unix::fs::symlink(&point, &link).unwrap();
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    target.send(&format!("plugin {}", link.join("libtwo.so").display()));
    assert_eq!(target.wait_line(""), "loaded");
    let pid = target.pid().to_string();
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    let unread = live_blocks_with_frame(&j, |f| {
        f["module"]
            .as_str()
            .is_some_and(|m| m.ends_with("/libtwo.so"))
            && f["function"].is_null()
    });
    assert_eq!(unread, 10, "{j}");
    let notes = j["notes"].to_string();
    assert!(notes.contains("fuse.fuse_stall"), "{notes}");
    drop(mount);
    target.send("quit");
}

#[test]
fn a_library_on_a_lazily_unmounted_fuse_mount_is_not_read() {
    if !root_here("fuse") {
        return;
    }
    // The user then takes the mount out of every mount table
    // (`fusermount -uz`, here `umount -l`): the mapped library stays
    // served by the user's server, and its device is in no mountinfo.
    // heapdump used to find no user-space mount there, and hung on the
    // library's first page (snapshot, list and attach alike).
    let t = TempDir::new("hostile-fuse-detached");
    let Some((point, mut target, mount)) = loading_a_served_library(&t) else {
        return;
    };
    let status = Command::new("umount")
        .arg("-l")
        .arg(&point)
        .status()
        .unwrap();
    assert!(status.success(), "umount -l {point:?}");
    let pid = target.pid().to_string();
    let maps = std::fs::read_to_string(format!("/proc/{pid}/maps")).unwrap();
    assert!(
        maps.lines().any(|l| l.ends_with(" /libtwo.so")),
        "the detached library shows by its path inside the mount:\n{maps}"
    );
    let json = t.str("s.json");
    ok(&bounded(&["snapshot", &pid, "-o", &json]));
    let j = read_json(Path::new(&json));
    assert_eq!(
        live_blocks_with_frame(&j, |f| {
            f["module"].as_str() == Some("/libtwo.so") && f["function"].is_null()
        }),
        10,
        "the plugin's 10 blocks, at its unread library's addresses: {j}"
    );
    let notes = j["notes"].to_string();
    assert!(
        notes.contains("mounted nowhere") && notes.contains("/libtwo.so"),
        "the snapshot says why the library was not read: {notes}"
    );
    let list = ok(&bounded(&["list"]));
    assert!(list.contains(&pid), "{list}");
    target.send("quit");
    drop(mount);
}

/// A FUSE mount of `tests/c/fuse_stall.c` serving `file` at `point`, or
/// `None` where this machine cannot mount one (a failure where CI
/// requires it).
fn stalling_mount(point: &Path, file: &Path) -> Option<StallingMount> {
    if !real_dependency("FUSE (/dev/fuse)", Path::new("/dev/fuse").exists()) {
        return None;
    }
    let mut server = Command::new(compile_c("fuse_stall"))
        .arg(point)
        .arg(file)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("start the FUSE server");
    let stdout = server.stdout.take().unwrap();
    let mount = StallingMount {
        server,
        point: point.to_path_buf(),
    };
    let mut first = String::new();
    std::io::BufRead::read_line(&mut std::io::BufReader::new(stdout), &mut first).unwrap();
    real_dependency("a FUSE mount (mount(2) of fuse)", first.trim() == "mounted").then_some(mount)
}

#[test]
fn attach_neither_reads_nor_waits_for_a_stack_mapped_from_a_fuse_file() {
    if !root_here("fuse stack") {
        return;
    }
    // A thread whose stack is a private mapping of a file on the user's
    // FUSE mount, waiting in a system call from code without CFI: attach's
    // check of that stack would read its pages above the stack pointer,
    // which only the server has, and the server never answers root. The
    // pages of a mapping come from its file whoever touches them, so this
    // needs no allow_other (the server here has it for the other test).
    // Three ways: the mount in place; lazily unmounted once the stack is
    // mapped (`fusermount -uz`: its device then in no mount table); and
    // with heapdump's check of such file systems turned off
    // (HEAPDUMP_READ_FUSE=1), which is what a target gets when it maps
    // such a file over the held thread's stack after attach read its maps
    // (a race no check of the maps closes): every read of the target's
    // memory is made by a helper process under a deadline.
    let t = TempDir::new("hostile-fuse-stack");
    let d = nobody_dir(&t, "src");
    let file = d.join("stack.bin");
    std::fs::write(&file, vec![0u8; 1 << 20]).unwrap();
    for (way, env, said) in [
        ("mounted", None, "part of its stack cannot be read"),
        ("detached", None, "part of its stack cannot be read"),
        (
            "unchecked",
            Some(("HEAPDUMP_READ_FUSE", "1")),
            "took longer than 5 s",
        ),
    ] {
        let point = nobody_dir(&t, &format!("mnt-{way}"));
        let Some(mount) = stalling_mount(&point, &file) else {
            return;
        };
        let mut target = Target::spawn(as_nobody(&compile_c("hostile")));
        // Dropped before the target (declared after it): a hung heapdump
        // holds the target traced, and only the server's end frees both.
        let mount = mount;
        let pid = target.pid().to_string();
        target.send(&format!("fusestack {}", point.join("stack.bin").display()));
        assert_eq!(target.wait_line(""), "stacked");
        if way == "detached" {
            let status = Command::new("umount")
                .arg("-l")
                .arg(&point)
                .status()
                .unwrap();
            assert!(status.success(), "umount -l {point:?}");
        }
        // Before: heapdump read the stack through /proc/PID/mem and hung,
        // unkillable, with the target's thread held stopped.
        let lib = preload_lib();
        let out = bounded_with(
            &["attach", &pid, "--library", lib.to_str().unwrap()],
            env.as_slice(),
        );
        assert!(!out.status.success(), "{way}: attached: {}", stderr(&out));
        assert!(stderr(&out).contains(said), "{way}: {}", stderr(&out));
        // The target was left as it was: its read goes on.
        target.send("x");
        assert_eq!(target.wait_line("unstacked"), "unstacked 1", "{way}");
        target.send("quit");
        drop(mount);
    }
}

#[test]
fn sites_are_named_past_the_programs_own_allocation_wrapper() {
    if !root_here("wrappers") {
        return;
    }
    // Two sites allocate through the program's wrapper (as redis's every
    // site goes through zmalloc): each is named by the frames past it.
    let t = TempDir::new("hostile-wrapped");
    let mut target = Target::spawn(as_nobody_recorded(&compile_c("hostile")));
    target.send("wrapped");
    target.wait_line("wrapped");
    let pid = target.pid().to_string();
    let text = ok(&bounded(&["snapshot", &pid]));
    for site in ["site_wrapped_a", "site_wrapped_b"] {
        assert!(
            text.contains(&format!("site: {site} ← main (via xmalloc_checked)")),
            "{text}"
        );
    }
    let html = t.path("r.html");
    ok(&bounded(&["report", &pid, "-o", html.to_str().unwrap()]));
    let page = std::fs::read_to_string(&html).unwrap();
    assert!(
        page.contains("site_wrapped_a ← main <small>via xmalloc_checked</small>"),
        "the report names the site by its wrapper"
    );
    target.send("quit");
}

#[test]
fn a_client_that_reads_none_of_its_responses_holds_serve_for_a_bounded_time() {
    // Any local user may connect to serve over loopback. A client asked
    // for a large profile (the JSON of 16 384 stacks, ~90 MB), pipelined
    // 20 more requests on the connection and read nothing: serve wrote
    // until the client read, and every other client (every scrape) waited
    // for as long as the connection stayed open. Now a response is
    // written for 20 s at most (each write blocks 2 s at most), and a
    // connection that stalled one is written nothing more (its other 20
    // requests are closed unanswered, none waiting its turn).
    let mut cmd = Command::new(compile_c("peak_stacks"));
    cmd.args(["16384", "keep"]).env("LD_PRELOAD", preload_lib());
    let target = Target::spawn(cmd);
    let (server, lines) = running(&["serve", "--listen", "127.0.0.1:0"], &[]);
    let addr = listening_addr(&lines.next());
    let mut stalled = std::net::TcpStream::connect(&addr).unwrap();
    let request = format!(
        "GET /debug/pprof/heap.json?pid={} HTTP/1.1\r\nHost: {addr}\r\n\r\n",
        target.pid()
    );
    std::io::Write::write_all(&mut stalled, request.repeat(21).as_bytes()).unwrap();
    // The response's first bytes: serve is writing it (ninety megabytes,
    // which no socket buffer holds), and this client reads no more.
    let mut first = [0u8; 12];
    stalled.set_read_timeout(Some(HANG_GUARD)).unwrap();
    std::io::Read::read_exact(&mut stalled, &mut first).unwrap();
    assert_eq!(&first, b"HTTP/1.1 200");
    // Another client, while the first reads nothing: answered (before,
    // never: the hang guard's read timeout failed the get).
    let (head, body) = http_get_with(&addr, "/", "");
    assert!(head.contains(" 200 "), "{head}");
    assert!(
        String::from_utf8_lossy(&body).contains(&target.pid().to_string()),
        "the index lists the target"
    );
    drop(stalled);
    drop(server);
    drop(target);
}

#[test]
fn a_user_whose_client_stalled_a_response_has_its_connections_closed_while_it_pays_back() {
    if !root_here("serve to another user") {
        return;
    }
    // The time serve spends writing to another user's client is that
    // user's debt: nobody's client reads a large profile (90 MB) at a
    // trickle (256 KiB every 0.2 s), which holds serve writing until the
    // 20 s deadline, a debt far past the 2 s burst (paid back in 72 s);
    // then nobody's next connection is closed unanswered while root's is
    // answered. (A client that read nothing would stall the write at once:
    // 2 s of debt plus the few milliseconds that filled the socket, paid
    // back in a few tens of milliseconds, too short for this test to
    // observe.)
    let mut cmd = as_nobody_recorded(&compile_c("peak_stacks"));
    cmd.args(["16384", "keep"]);
    let target = Target::spawn(cmd);
    let (server, addr, _lines) = server_of_heaps();
    let (host, port) = addr.rsplit_once(':').unwrap();
    // Killed when dropped, a failed assertion included (its sleep would
    // hold the test's output open).
    let mut stalling = KilledOnDrop(
        nobody_bash(&format!(
            "exec 3<>/dev/tcp/{host}/{port} && printf 'GET %s HTTP/1.0\\r\\n\\r\\n' \"$1\" >&3 \
             && head -c 12 <&3 && echo \
             && while sleep 0.2 && [ \"$(head -c 262144 <&3 | wc -c)\" -gt 0 ]; do :; done; \
             echo closed; exec sleep 3600"
        ))
        .args(["_", &format!("/debug/pprof/heap.json?pid={}", target.pid())])
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let started = Lines::new(stalling.0.stdout.take().unwrap());
    assert_eq!(
        started.next(),
        "HTTP/1.0 200",
        "nobody's profile is being written"
    );
    // Root's request waits for the writing to end (20 s at most), and
    // serve closed nobody's connection at its deadline, the profile unread.
    let (head, _) = http_get_with(&addr, "/", "");
    assert!(head.contains(" 200 "), "{head}");
    assert_eq!(started.next(), "closed", "serve ended nobody's response");
    let answer = get_as_nobody(&addr, "/");
    assert_eq!(answer, "", "nobody's connection is closed unanswered");
    drop(stalling);
    drop(server);
    drop(target);
}

/// `heapdump serve` on a port of loopback, unsymbolized, allowed `fds`
/// open descriptors: the process, its address, and its stdout's lines.
fn server_with_descriptors(fds: u32) -> (KilledOnDrop, String, Lines) {
    let mut child = Command::new("prlimit")
        .arg(format!("--nofile={fds}:{fds}"))
        .arg(bin())
        .args(["serve", "--listen", "127.0.0.1:0", "--no-symbolize"])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let lines = Lines::new(child.stdout.take().unwrap());
    let server = KilledOnDrop(child);
    let addr = listening_addr(&lines.next());
    (server, addr, lines)
}

#[test]
fn a_user_holding_hundreds_of_idle_connections_does_not_stop_serve_for_others() {
    if !root_here("serve to another user") {
        return;
    }
    // serve ran a thread and held two descriptors per connection, with no
    // limit, and ended for good when `accept` first failed: any local user
    // (a profiled process included) opened a few hundred idle connections
    // and serve exited, for everyone. Now a user serve does not trust
    // holds 16 connections; the ones past them are closed (answered 503
    // if their socket takes it at once). (The server is allowed 128 descriptors, so that 300
    // connections are far past what it has.)
    let (server, addr, _lines) = server_with_descriptors(128);
    let (host, port) = addr.rsplit_once(':').unwrap();
    let mut holding = KilledOnDrop(
        nobody_bash(&format!(
            "for i in $(seq 300); do exec {{fd}}<>/dev/tcp/{host}/{port} || exit 1; done; \
                 echo held; exec sleep 3600"
        ))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap(),
    );
    let held = Lines::new(holding.0.stdout.take().unwrap());
    assert_eq!(held.next(), "held", "nobody opened its connections");
    // Before: refused (serve had exited). Accepted after nobody's
    // connections, so when it is answered serve has taken them all.
    let (head, _) = http_get_with(&addr, "/", "");
    assert!(head.contains(" 200 "), "{head}");
    // One thread per connection kept (before: 300 of them), besides
    // serve's own few.
    let threads = std::fs::read_dir(format!("/proc/{}/task", server.id()))
        .unwrap()
        .count();
    assert!(threads <= 16 + 4, "serve runs {threads} threads");
    drop(holding);
    drop(server);
}

#[test]
fn serve_outlives_running_out_of_descriptors() {
    // Connections from a trusted client (the test's own user) past what
    // the server's descriptors allow: `accept` fails meanwhile, and serve
    // answers again once they are closed (before, the first failed
    // `accept` ended serve).
    let (server, addr, _lines) = server_with_descriptors(64);
    let many: Vec<_> = (0..100)
        .map(|_| std::net::TcpStream::connect(&addr).unwrap())
        .collect();
    // A request on one more connection: not taken while serve's
    // descriptors are, answered once the others close.
    let mut late = std::net::TcpStream::connect(&addr).unwrap();
    std::io::Write::write_all(&mut late, b"GET / HTTP/1.0\r\n\r\n").unwrap();
    drop(many);
    late.set_read_timeout(Some(HANG_GUARD)).unwrap();
    let mut answer = String::new();
    std::io::Read::read_to_string(&mut late, &mut answer).unwrap();
    assert!(answer.starts_with("HTTP/1.0 200 "), "{answer}");
    let (head, _) = http_get_with(&addr, "/", "");
    assert!(head.contains(" 200 "), "{head}");
    drop(server);
}

#[test]
fn a_user_with_many_instrumented_processes_leaves_the_collector_room_for_roots() {
    if !root_here("users' shares of the collector") {
        return;
    }
    // A watched process holds four of the collector's descriptors until
    // it exits. Any user can start hundreds of instrumented processes: the
    // collector's descriptors ran out, and every process started after,
    // root's included, went unwatched without a word. Now a user other
    // than root has an eighth of what the collector can hold open (here,
    // allowed 160 descriptors: 8 processes, one of nobody's).
    let t = TempDir::new("hostile-collector-shares");
    let mut collector = KilledOnDrop(
        Command::new("prlimit")
            .arg("--nofile=160:160")
            .arg(bin())
            .args([
                "watch", "--all", "--scan", "20ms", "--poll", "5ms", "-f", "json", "-d",
            ])
            .arg(t.path("snaps"))
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap(),
    );
    let lines = Lines::new(collector.0.stdout.take().unwrap());
    let log = Lines::new(collector.0.stderr.take().unwrap());
    assert!(lines.next().starts_with("watching "), "the collector runs");
    let hog = NobodysCats::start(40);
    let said = log.next();
    assert!(
        said.contains("is not watched: its user (65534) has 1 processes watched"),
        "{said}"
    );
    // Root's process, started after them: watched.
    let mut cmd = Command::new(compile_c("hostile"));
    cmd.env("LD_PRELOAD", preload_lib());
    let mut root = Target::spawn(cmd);
    root.send("request");
    root.wait_line("requested");
    let mut nobodys = 0;
    loop {
        let line = lines.next();
        if line.starts_with(&format!("watching {} ", root.pid())) {
            break;
        }
        // (Other tests' processes, root's, may be adopted meanwhile.)
        let pid = line
            .strip_prefix("watching ")
            .and_then(|l| l.split(' ').next()?.parse().ok());
        nobodys += usize::from(pid.is_some_and(|p| process_uid(p) == Some(NOBODY)));
    }
    assert_eq!(nobodys, 1, "nobody's processes watched");
    root.send("quit");
    drop(hog);
    drop(collector);
}

/// `n` instrumented processes of nobody's, each a `cat` of a pipe the test
/// holds: they all end when this is dropped (a failed assertion
/// included).
struct NobodysCats(KilledOnDrop);

impl NobodysCats {
    fn start(n: usize) -> NobodysCats {
        NobodysCats(KilledOnDrop(
            nobody_bash(&format!(
                "exec 3<&0; for i in $(seq {n}); do LD_PRELOAD={} cat <&3 & done; wait",
                preload_lib().display()
            ))
            .stdin(Stdio::piped())
            .spawn()
            .unwrap(),
        ))
    }

    /// Their pids (children of the shell that started them), once each
    /// has its regions (the agent makes them at its first allocation).
    fn pids_instrumented(&self, n: usize) -> Vec<u32> {
        let deadline = std::time::Instant::now() + HANG_GUARD;
        loop {
            let pids: Vec<u32> = ok(&bounded(&["list"]))
                .lines()
                .filter(|l| l.split_whitespace().nth(1) == Some("cat"))
                .filter_map(|l| l.split_whitespace().next()?.parse().ok())
                .filter(|&p| status_field(p, "PPid:") == Some(self.0.id()))
                .collect();
            if pids.len() >= n {
                return pids;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "{} of {n} instrumented",
                pids.len()
            );
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
    }
}

impl Drop for NobodysCats {
    fn drop(&mut self) {
        // Their pipe closed, they read its end and exit.
        drop(self.0 .0.stdin.take());
    }
}

/// The real user id of process `pid`.
fn process_uid(pid: u32) -> Option<u32> {
    status_field(pid, "Uid:")
}

/// The first number of the line of `/proc/PID/status` starting with
/// `field`.
fn status_field(pid: u32, field: &str) -> Option<u32> {
    std::fs::read_to_string(format!("/proc/{pid}/status"))
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix(field))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()
}

#[test]
fn a_user_with_many_instrumented_processes_leaves_serve_room_for_roots() {
    if !root_here("users' shares of serve") {
        return;
    }
    // serve kept every process it served open (three descriptors each):
    // one scrape of nobody's sixty processes took all of a server allowed
    // 160 descriptors, and root's process, read last, could not be opened.
    // Now a process past its user's share (one here) is opened for the
    // request only.
    let hog = NobodysCats::start(60);
    let cats = hog.pids_instrumented(60);
    let mut cmd = Command::new(compile_c("hostile"));
    cmd.env("LD_PRELOAD", preload_lib());
    let mut root = Target::spawn(cmd);
    root.send("request");
    root.wait_line("requested");
    let (_server, addr, _lines) = server_with_descriptors(160);
    for round in 0..2 {
        let (head, body) = http_get_with(&addr, "/metrics", "");
        assert!(head.contains(" 200 "), "{head}");
        let text = String::from_utf8_lossy(&body);
        let served = |pid: u32| text.contains(&format!("heapdump_live_bytes{{pid=\"{pid}\""));
        assert!(
            served(root.pid()),
            "round {round}: root's process not served"
        );
        let cats_served = cats.iter().filter(|&&p| served(p)).count();
        assert_eq!(
            cats_served, 60,
            "round {round}: nobody's processes, each read"
        );
    }
    root.send("quit");
    drop(hog);
}
