//! A program built with split DWARF (`-gsplit-dwarf`, its debug
//! information packed into `PROG.dwp` beside it by `llvm-dwp`): the
//! symbolizer reads the package, so a function inlined into the
//! allocating one shows as its own frame; without the package (the same
//! running program, a fresh `heapdump`) it does not.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;
use heapdump_tests::{preload_lib, real_dependency, Target};

fn leaf_functions(j: &serde_json::Value) -> Vec<Vec<String>> {
    j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["live_blocks"] == 40)
        .map(|s| {
            s["frames"]
                .as_array()
                .unwrap()
                .iter()
                .take(2)
                .map(|f| f["function"].as_str().unwrap_or("").to_string())
                .collect()
        })
        .collect()
}

#[test]
fn a_split_dwarf_package_beside_the_program_gives_its_inlined_frames() {
    if !real_dependency(
        "llvm-dwp (Debian's llvm)",
        Path::new("/usr/bin/llvm-dwp").exists(),
    ) {
        return;
    }
    let dir = TempDir::new("split-dwarf");
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/c/split_dwarf.c");
    let run = |cmd: &mut Command| {
        let st = cmd.current_dir(&dir.0).status().unwrap();
        assert!(st.success(), "{cmd:?}");
    };
    run(Command::new("cc")
        .args([
            "-O1",
            "-g",
            "-gsplit-dwarf",
            "-fno-omit-frame-pointer",
            "-c",
            "-o",
        ])
        .arg(dir.path("prog.o"))
        .arg(&src));
    run(Command::new("cc")
        .arg("-o")
        .arg(dir.path("prog"))
        .arg(dir.path("prog.o")));
    run(Command::new("llvm-dwp").args(["-e", "prog", "-o", "prog.dwp"]));
    // Only the package holds the debug information now.
    for f in std::fs::read_dir(&dir.0).unwrap() {
        let p = f.unwrap().path();
        if p.extension().is_some_and(|e| e == "dwo") {
            std::fs::remove_file(p).unwrap();
        }
    }
    let mut cmd = Command::new(dir.path("prog"));
    cmd.env("LD_PRELOAD", preload_lib());
    let t = Target::spawn(cmd);
    let pid = t.pid().to_string();
    let snap = |name: &str| {
        let out = dir.str(name);
        let o = heapdump(&["snapshot", &pid, "-o", &out]);
        assert!(o.status.success(), "{}", stderr(&o));
        read_json(Path::new(&out))
    };
    let with = leaf_functions(&snap("with.json"));
    assert_eq!(
        with,
        [vec!["inlined_helper".to_string(), "site_split".to_string()]],
        "with the package"
    );
    std::fs::rename(dir.path("prog.dwp"), dir.path("moved.dwp")).unwrap();
    let without = leaf_functions(&snap("without.json"));
    assert_eq!(
        without,
        [vec!["site_split".to_string(), "main".to_string()]],
        "without the package"
    );
}
