//! Whole stacks through code built without frame pointers (CFI
//! unwinding): programs and a shared library built `-O2
//! -fomit-frame-pointer` with known call chains, a recursion 41 frames
//! deep, an allocating signal handler, C++ containers growing inside
//! libstdc++, `dlopen`/`dlclose` while other threads allocate, and
//! Debian's own python3 running a script. Each site's stack is checked
//! function by function against the chain the program made.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::{heapdump, stderr};
use heapdump_tests::{preload_lib, profile_dir, real_dependency, Target};
use serde_json::Value;

/// Compiles `tests/c/nofp/SRC` without frame pointers (and without
/// sibling calls, so every frame of the chain stays on the stack) into
/// `OUT` in the profile directory, with `extra` arguments.
fn compile_nofp(src: &str, out: &str, extra: &[&str]) -> PathBuf {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/nofp");
    let out_dir = profile_dir().join("c-test-programs");
    std::fs::create_dir_all(&out_dir).unwrap();
    let out = out_dir.join(format!("{out}-{}", std::process::id()));
    let compiler = if src.ends_with(".cpp") { "g++" } else { "cc" };
    let status = Command::new(compiler)
        .args([
            "-O2",
            "-g",
            "-fomit-frame-pointer",
            "-fno-optimize-sibling-calls",
            "-pthread",
        ])
        .arg("-o")
        .arg(&out)
        .arg(dir.join(src))
        .args(extra)
        .status()
        .unwrap_or_else(|e| panic!("run {compiler}: {e}"));
    assert!(status.success(), "{compiler} failed for {src}");
    out
}

/// The chain program and its library, built once per test process (the
/// tests using it run in parallel).
fn chain_program() -> PathBuf {
    static BUILT: std::sync::OnceLock<PathBuf> = std::sync::OnceLock::new();
    BUILT.get_or_init(build_chain_program).clone()
}

fn build_chain_program() -> PathBuf {
    let lib = compile_nofp("chain_lib.c", "libchain.so", &["-fPIC", "-shared"]);
    // Linked by path with an rpath to its directory: the library's file
    // name carries the pid, so link it under a fixed name next to it.
    let fixed = lib.with_file_name(format!("libchain-{}.so", std::process::id()));
    std::fs::rename(&lib, &fixed).unwrap();
    let dir = fixed.parent().unwrap().display().to_string();
    compile_nofp(
        "chain.c",
        "chain",
        &[fixed.to_str().unwrap(), &format!("-Wl,-rpath,{dir}")],
    )
}

fn under_agent(exe: &Path, unwind: &str) -> Target {
    under_agent_finding_modules_by(exe, unwind, "auto")
}

/// `lookup`: `HEAPDUMP_MODULE_LOOKUP` (`table`: the agent's own module
/// table, what glibc before 2.35 gets, instead of `_dl_find_object`).
fn under_agent_finding_modules_by(exe: &Path, unwind: &str, lookup: &str) -> Target {
    let mut cmd = Command::new(exe);
    cmd.env("LD_PRELOAD", preload_lib())
        .env("HEAPDUMP_UNWIND", unwind)
        .env("HEAPDUMP_MODULE_LOOKUP", lookup);
    Target::spawn(cmd)
}

fn snapshot(pid: u32, name: &str) -> Value {
    let path = std::env::temp_dir().join(format!(
        "heapdump-unwind-{}-{name}.json",
        std::process::id()
    ));
    let out = heapdump(&[
        "snapshot",
        &pid.to_string(),
        "--format",
        "json",
        "-o",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let v: Value = serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
    let _ = std::fs::remove_file(&path);
    v
}

/// Function names of a site's frames, leaf first, without inlined-frame
/// duplicates' parameters (C++ names are cut at the first '(').
fn functions(site: &Value) -> Vec<String> {
    site["frames"]
        .as_array()
        .unwrap()
        .iter()
        .map(|f| {
            let name = f["function"].as_str().unwrap_or("?");
            name.split('(').next().unwrap_or(name).to_string()
        })
        .collect()
}

/// The live sites whose frames contain `function`.
fn sites_with<'a>(j: &'a Value, function: &str) -> Vec<&'a Value> {
    j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["live_blocks"].as_u64().unwrap_or(0) > 0)
        .filter(|s| functions(s).iter().any(|f| f == function))
        .collect()
}

/// The one live site whose leaf frame is `leaf`, with its (blocks, bytes).
/// (Sites with no live block keep their cumulative counts; their
/// addresses are symbolized against what is mapped now.)
fn site<'a>(j: &'a Value, leaf: &str) -> (&'a Value, u64, u64) {
    let found: Vec<_> = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["live_blocks"].as_u64().unwrap_or(0) > 0)
        .filter(|s| functions(s).first().is_some_and(|f| f == leaf))
        .collect();
    assert_eq!(found.len(), 1, "sites with leaf {leaf}: {found:#?}");
    let s = found[0];
    (
        s,
        s["live_blocks"].as_u64().unwrap(),
        s["live_bytes"].as_u64().unwrap(),
    )
}

/// `functions` of a site, up to and including `main`.
fn down_to_main(site: &Value) -> Vec<String> {
    let f = functions(site);
    let end = f
        .iter()
        .position(|n| n == "main")
        .unwrap_or_else(|| panic!("main missing from {f:?}"));
    f[..=end].to_vec()
}

fn check_chain_program(unwind: &str, lookup: &str) {
    let exe = chain_program();
    let mut target = under_agent_finding_modules_by(&exe, unwind, lookup);
    let j = snapshot(target.pid(), &format!("chain-{unwind}-{lookup}"));
    assert!(j["partial"].is_null());
    assert_eq!(
        j["unwinder"],
        if unwind == "cfi" { "cfi" } else { "cfi+fp" }
    );

    let (s, blocks, bytes) = site(&j, "lib_leaf");
    assert_eq!((blocks, bytes), (100, 100 * 1000));
    assert_eq!(
        down_to_main(s),
        [
            "lib_leaf",
            "lib_mid",
            "lib_enter",
            "chain_b",
            "chain_a",
            "main"
        ]
    );

    let (s, blocks, bytes) = site(&j, "recurse");
    assert_eq!((blocks, bytes), (10, 10 * 2000));
    let mut expected = vec!["recurse"; 41];
    expected.push("main");
    assert_eq!(down_to_main(s), expected);

    // Allocated in a signal handler interrupting raise() (glibc, no frame
    // pointers) called from spin_nofp: the stack crosses the signal frame.
    let (s, blocks, bytes) = site(&j, "on_signal");
    assert_eq!((blocks, bytes), (5, 5 * 777));
    let f = down_to_main(s);
    assert!(
        f.ends_with(&["spin_nofp".to_string(), "main".to_string()]),
        "{f:?}"
    );
    assert!(f.len() >= 4, "{f:?}");

    // The same two frames at the same stack depth under two callers,
    // alternately: each allocation is under its own caller (a walk that
    // took the previous walk's outer frames without checking the return
    // address below shared_mid would give both sites one stack).
    for (caller, size) in [("via_left", 300), ("via_right", 301)] {
        let found: Vec<_> = sites_with(&j, caller)
            .into_iter()
            .filter(|s| functions(s)[0] == "shared_leaf")
            .collect();
        assert_eq!(found.len(), 1, "{caller}: {found:#?}");
        assert_eq!(
            (
                found[0]["live_blocks"].as_u64(),
                found[0]["live_bytes"].as_u64()
            ),
            (Some(60), Some(60 * size)),
            "{caller}"
        );
        assert_eq!(
            down_to_main(found[0]),
            ["shared_leaf", "shared_mid", caller, "main"]
        );
    }
    // The live set is exact: these and the few blocks of stdio and
    // the loader, nothing from the sites twice.
    let total: u64 = sites_with(&j, "main")
        .iter()
        .map(|s| s["live_blocks"].as_u64().unwrap())
        .sum();
    assert!(total >= 235, "{total}");
    target.send("done");
    assert!(target.finish().success());
}

#[test]
fn whole_chains_through_an_executable_and_library_without_frame_pointers() {
    check_chain_program("auto", "auto");
}

#[test]
fn the_agents_module_table_for_old_glibc_gives_the_same_chains() {
    check_chain_program("auto", "table");
}

#[test]
fn cfi_only_mode_gives_the_same_chains() {
    check_chain_program("cfi", "auto");
}

#[test]
fn frame_pointer_mode_is_recorded_as_such() {
    let exe = chain_program();
    let mut target = under_agent(&exe, "fp");
    let j = snapshot(target.pid(), "chain-fp");
    assert_eq!(j["unwinder"], "fp");
    target.send("done");
    assert!(target.finish().success());
}

#[test]
fn cxx_containers_growing_inside_libstdcxx_show_the_function_that_grew_them() {
    let exe = compile_nofp("strings.cpp", "strings", &[]);
    let mut target = under_agent(&exe, "auto");
    let j = snapshot(target.pid(), "strings");
    // The vector's buffer and the string's: each a site through std::
    // frames (the string's in libstdc++.so itself) down to build_things.
    let grown = sites_with(&j, "build_things");
    let vector = grown
        .iter()
        .find(|s| functions(s).iter().any(|f| f.contains("vector<long")))
        .unwrap_or_else(|| panic!("no vector site: {grown:#?}"));
    let string = grown
        .iter()
        .find(|s| functions(s)[0].contains("basic_string"))
        .unwrap_or_else(|| panic!("no string site: {grown:#?}"));
    for s in [vector, string] {
        let f = down_to_main(s);
        assert_eq!(f[f.len() - 2..], ["build_things", "main"], "{f:?}");
        assert!(f.len() >= 3, "{f:?}");
    }
    assert_eq!(vector["live_blocks"], 1);
    assert_eq!(string["live_bytes"], 8001);
    target.send("done");
    assert!(target.finish().success());
}

#[test]
fn debian_python3_allocations_reach_py_bytesmain_through_the_interpreter() {
    let python = Path::new("/usr/bin/python3");
    if !real_dependency("Debian's python3 (/usr/bin/python3)", python.exists()) {
        return;
    }
    let script = "import sys\n\
                  keep = [bytearray(1000) for _ in range(20000)]\n\
                  print('ready', flush=True)\n\
                  sys.stdin.readline()\n";
    let mut cmd = Command::new(python);
    cmd.arg("-c").arg(script).env("LD_PRELOAD", preload_lib());
    let mut target = Target::spawn(cmd);
    let j = snapshot(target.pid(), "python");
    let sites = j["sites"].as_array().unwrap();
    let biggest = sites
        .iter()
        .max_by_key(|s| s["live_bytes"].as_u64().unwrap_or(0))
        .unwrap();
    assert!(
        biggest["live_blocks"].as_u64().unwrap() >= 20000,
        "{biggest:#}"
    );
    let f = functions(biggest);
    for needed in ["_PyEval_EvalFrameDefault", "Py_RunMain", "Py_BytesMain"] {
        assert!(f.iter().any(|n| n == needed), "{needed} missing from {f:?}");
    }
    assert!(
        f.iter().position(|n| n == "_PyEval_EvalFrameDefault")
            < f.iter().position(|n| n == "Py_BytesMain")
    );
    target.send("done");
    assert!(target.finish().success());
}

#[test]
fn dlclose_while_threads_allocate_then_another_library_at_the_same_place() {
    check_dlclose_stress("auto");
}

#[test]
fn dlclose_and_a_library_at_the_same_place_with_the_agents_module_table() {
    check_dlclose_stress("table");
}

fn check_dlclose_stress(lookup: &str) {
    // Built per test (the two run in parallel in one process).
    let a = compile_nofp(
        "dl_a.c",
        &format!("libdl_a-{lookup}.so"),
        &["-fPIC", "-shared"],
    );
    let b = compile_nofp(
        "dl_b.c",
        &format!("libdl_b-{lookup}.so"),
        &["-fPIC", "-shared"],
    );
    let exe = compile_nofp("dlstress.c", &format!("dlstress-{lookup}"), &["-ldl"]);
    let mut cmd = Command::new(&exe);
    cmd.arg(&a)
        .arg(&b)
        .env("LD_PRELOAD", preload_lib())
        .env("HEAPDUMP_MODULE_LOOKUP", lookup);
    let mut target = Target::spawn(cmd);
    let j = snapshot(target.pid(), &format!("dlstress-{lookup}"));
    assert!(j["partial"].is_null());
    // B's blocks, whatever address B took (the program says; usually A's):
    // 2 threads x 50 blocks, the stack through B's function and the
    // thread that called it.
    let (s, blocks, bytes) = site(&j, "alloc_from_b");
    assert_eq!((blocks, bytes), (100, 100 * 4321));
    let f = functions(s);
    assert_eq!(f[1], "use_b", "{f:?}");
    // Everything allocated through A was freed before A was closed.
    assert!(sites_with(&j, "alloc_from_a").is_empty());
    let line = target.last_line().to_string();
    assert!(line == "ready SAME" || line == "ready MOVED", "{line}");
    target.send("done");
    assert!(target.finish().success());
}
