//! The preload agent wraps the allocator a program already uses: glibc,
//! jemalloc (linked), tcmalloc (linked) and mimalloc (preloaded after the
//! agent). For each, a program calling every exported entry point has its
//! exact live set, every kept block belongs to that allocator (its own
//! ownership call says so), and nothing freed through any release entry
//! point is live; the threaded C pattern has its exact live set per site
//! and thread on each allocator too.
//!
//! jemalloc, tcmalloc and mimalloc come from Debian's packages
//! (`libjemalloc-dev`, `libgoogle-perftools-dev`, `libmimalloc-dev`,
//! installed by `.ci/run`, where these tests must run).

use std::path::{Path, PathBuf};
use std::process::Command;

use heapdump_tests::*;

/// How a program reaches its allocator.
enum Allocator {
    Glibc,
    Jemalloc,
    Tcmalloc,
    /// `libmimalloc.so` preloaded after the agent.
    MimallocPreloaded(PathBuf),
}

impl Allocator {
    fn name(&self) -> &'static str {
        match self {
            Allocator::Glibc => "glibc",
            Allocator::Jemalloc => "jemalloc",
            Allocator::Tcmalloc => "tcmalloc",
            Allocator::MimallocPreloaded(_) => "mimalloc",
        }
    }

    /// The allocator if it is installed (see [`real_dependency`]).
    fn available(kind: &str) -> Option<Allocator> {
        match kind {
            "glibc" => Some(Allocator::Glibc),
            "jemalloc" => real_dependency(
                "jemalloc (libjemalloc-dev)",
                has_header("jemalloc/jemalloc.h"),
            )
            .then_some(Allocator::Jemalloc),
            "tcmalloc" => real_dependency(
                "tcmalloc (libgoogle-perftools-dev)",
                has_header("gperftools/malloc_extension_c.h"),
            )
            .then_some(Allocator::Tcmalloc),
            "mimalloc" => {
                let lib = system_lib("libmimalloc.so.2").or_else(|| system_lib("libmimalloc.so"));
                real_dependency("mimalloc (libmimalloc-dev)", lib.is_some())
                    .then(|| Allocator::MimallocPreloaded(lib.unwrap()))
            }
            _ => unreachable!(),
        }
    }

    /// Compiler arguments for a program that links this allocator.
    fn compile_args(&self) -> &'static [&'static str] {
        match self {
            Allocator::Jemalloc => &["-DUSE_JEMALLOC", "-ljemalloc"],
            Allocator::Tcmalloc => &["-DUSE_TCMALLOC", "-ltcmalloc"],
            _ => &[],
        }
    }

    /// `LD_PRELOAD` for a program on this allocator, as `heapdump run`
    /// builds it (agent first, then the jemalloc companion or the user's
    /// allocator).
    fn ld_preload(&self) -> String {
        let agent = preload_lib().display().to_string();
        match self {
            Allocator::Jemalloc => format!("{agent}:{}", jemalloc_companion_lib().display()),
            Allocator::MimallocPreloaded(lib) => format!("{agent}:{}", lib.display()),
            _ => agent,
        }
    }

    fn command(&self, exe: &Path) -> Command {
        let mut cmd = Command::new(exe);
        cmd.env("LD_PRELOAD", self.ld_preload());
        cmd
    }
}

/// Sites of `tests/c/allocators.cpp`: (function, blocks, bytes each).
fn expected_sites(a: &Allocator) -> Vec<(&'static str, u64, u64)> {
    let mut v = vec![
        ("site_malloc", 8, 100),
        ("site_calloc", 8, 100),
        ("site_realloc", 8, 300),
        ("site_realloc_same_class", 8, 110),
        ("site_realloc_grown", 8, 5000),
        ("site_realloc_shrunk", 8, 40),
        ("site_memalign", 8, 100),
        ("site_posix_memalign", 8, 100),
        ("site_aligned_alloc", 8, 128),
        ("site_valloc", 8, 100),
        ("site_new", 8, 100),
        ("site_new_array", 8, 100),
        ("site_new_aligned", 8, 100),
        ("site_new_array_aligned", 8, 100),
        ("site_new_nothrow", 8, 100),
        ("site_new_array_nothrow", 8, 100),
        ("site_new_aligned_nothrow", 8, 100),
        ("site_new_array_aligned_nothrow", 8, 100),
    ];
    if matches!(a, Allocator::Jemalloc) {
        v.extend([
            ("site_mallocx", 8, 100),
            ("site_rallocx", 8, 300),
            ("site_xallocx", 8, 100),
        ]);
    } else {
        // jemalloc has neither (see the program's comment).
        v.extend([("site_reallocarray", 8, 300), ("site_pvalloc", 8, 4096)]);
    }
    v
}

fn check_every_entry_point(kind: &str) {
    let Some(a) = Allocator::available(kind) else {
        return;
    };
    let exe = compile_c_variant("allocators", a.name(), a.compile_args());
    let mut target = Target::spawn_until(a.command(&exe), "owner");
    let owner = target.last_line().to_string();
    let expected = expected_sites(&a);
    assert_eq!(
        owner,
        format!(
            "owner {} ok {}",
            a.name(),
            expected.iter().map(|e| e.1).sum::<u64>()
        ),
        "the program's blocks are not its allocator's"
    );
    target.wait_line("ready");
    let pid = target.pid();
    let d = dump(pid);
    assert_eq!(d.partial, None);
    assert_eq!(d.counters.dropped_total(), 0, "{:?}", d.counters.dropped);
    // The header's counters agree with the records (a realloc in place
    // counts its block's free and allocation itself).
    assert_eq!(d.counters.live_blocks, d.blocks.len() as u64);
    assert_eq!(
        d.counters.live_bytes,
        d.blocks.iter().map(|b| b.size).sum::<u64>()
    );
    let syms = Symbols::of_process(&exe, pid);
    let t = by_site(&d, &syms, "site_");
    let thread = d
        .blocks
        .iter()
        .find(|b| syms.site(&b.frames, "site_malloc").is_some())
        .map(|b| b.thread.name.clone())
        .expect("site_malloc's blocks");
    for (site, blocks, size) in &expected {
        expect_site(&t, site, *blocks, *size, &thread);
    }
    assert_eq!(t.len(), expected.len(), "unexpected sites: {t:#?}");
    let freed = by_site(&d, &syms, "freed_");
    assert!(freed.is_empty(), "freed blocks are live: {freed:#?}");
    assert!(target.finish().success());
}

#[test]
fn every_entry_point_is_recorded_exactly_on_glibc() {
    check_every_entry_point("glibc");
}

#[test]
fn every_entry_point_is_recorded_exactly_on_linked_jemalloc() {
    check_every_entry_point("jemalloc");
}

#[test]
fn every_entry_point_is_recorded_exactly_on_linked_tcmalloc() {
    check_every_entry_point("tcmalloc");
}

#[test]
fn every_entry_point_is_recorded_exactly_with_mimalloc_preloaded_after_the_agent() {
    check_every_entry_point("mimalloc");
}

fn check_threaded_pattern(kind: &str) {
    let Some(a) = Allocator::available(kind) else {
        return;
    };
    let exe = compile_c_variant("pattern", a.name(), a.compile_args());
    let mut cmd = a.command(&exe);
    cmd.arg("hold");
    check_c_pattern_run(&exe, cmd);
}

#[test]
fn threaded_pattern_is_exact_on_linked_jemalloc() {
    check_threaded_pattern("jemalloc");
}

#[test]
fn threaded_pattern_is_exact_on_linked_tcmalloc() {
    check_threaded_pattern("tcmalloc");
}

#[test]
fn threaded_pattern_is_exact_with_mimalloc_preloaded_after_the_agent() {
    check_threaded_pattern("mimalloc");
}
