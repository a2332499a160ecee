//! Any bytes as a target's mapped file, read by every reader of the
//! dumper that opens one: the symbolizer (ELF, DWARF, symbol tables,
//! debug links), the attach injector's CFI reader and the check of what
//! the agent can see. Each reads the file through heapdump's rules for a
//! target's files (private copies within a budget), so whatever the bytes
//! they must not crash, hang or read outside what they copied.
#![no_main]

use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use heapdump::attach::remote_unwind::ModuleFile;
use heapdump::process::target_files::TargetRoot;
use heapdump::process::visibility::inspect_program;
use heapdump::symbolization::maps::{LocalFile, Mapping};
use heapdump::symbolization::symbolizer::Symbolizer;
use libfuzzer_sys::fuzz_target;

fn scratch() -> &'static (PathBuf, Arc<TargetRoot>) {
    static S: OnceLock<(PathBuf, Arc<TargetRoot>)> = OnceLock::new();
    S.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("heapdump-fuzz-elf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        (dir, Arc::new(TargetRoot::own().unwrap()))
    })
}

fuzz_target!(|data: &[u8]| {
    let (dir, root) = scratch();
    // A fresh name each time: the symbolizer caches by file identity.
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let path = dir.join(format!("lib{n}.so"));
    std::fs::write(&path, data).unwrap();
    let local = LocalFile::own(path.clone(), root.clone());
    let maps = vec![Mapping {
        start: 0x10000,
        end: 0x90000,
        offset: 0,
        path: path.display().to_string().into(),
        build_id: heapdump::symbolization::maps::read_build_id(local.open().unwrap()),
        local: Some(local.clone()),
        file: None,
    }];
    let mut sym = Symbolizer::with_debug_dirs(vec![dir.clone()]);
    sym.begin();
    for a in [0x10001u64, 0x11000, 0x20010, 0x8ffff] {
        assert!(!sym.symbolize(a, &maps).is_empty());
    }
    if let Some(m) = ModuleFile::read(&local) {
        let _ = m.bias(&maps[0]);
        for a in [0u64, 0x1000, 0x10000, u64::MAX] {
            let _ = m.has_rule(a);
        }
    }
    let _ = inspect_program(&path);
    let _ = std::fs::remove_file(&path);
});
