//! `libheapdump_preload.so`: heapdump's agent for any dynamically linked
//! program (C, C++, Rust), loaded with `LD_PRELOAD`.
//!
//! It exports the malloc family ([`malloc_family`]) and every C++ global
//! `operator new` / `operator delete` ([`cxx`]), records each event with
//! `heapdump-agent`'s recorder, and forwards the call to the allocator the
//! program would use without it: the next definition in the dynamic lookup
//! order ([`next_allocator`]: glibc, jemalloc, tcmalloc, mimalloc, or a
//! library preloaded after this one), bound once with `dlsym(RTLD_NEXT)`.
//! Allocations made while binding come from a static
//! [`bootstrap_arena`]. A block stays exactly the allocator's (no header,
//! no tail), so allocator-specific calls this library does not export
//! (`mallctl`, `sallocx`, `tc_*`, `mi_*`...) keep working on it.
//! jemalloc's non-standard `*allocx` calls are recorded by a companion
//! library, `libheapdump_jemalloc.so`, through [`internal_api`].
//!
//! Every entry point has a frame pointer (the workspace builds with
//! `-C force-frame-pointers=yes`), which the stack walk starts from, so
//! none of this library's frames are reported.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};

pub mod attach;
pub mod bootstrap_arena;
pub mod bound_definitions;
pub mod cxx;
pub mod dlclose_hook;
pub mod in_place_realloc;
pub mod internal_api;
pub mod jemalloc_attached;
pub mod malloc_family;
pub mod next_allocator;
pub mod preloaded;
pub mod sandbox;
pub mod slot_redirection;
pub mod thread_names;

fn stderr(msg: &[u8]) {
    // SAFETY: write(2) on fd 2 with a valid buffer; the result is ignored
    // (a closed stderr must not matter).
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// Runs at load time: binds the next allocator, starts the agent (regions,
/// signal handler) before `main` so a snapshot signal never finds it
/// absent, and says once on stderr when the program's `malloc` is not
/// ours (so nothing would be recorded).
extern "C" fn preload_init() {
    use heapdump_agent::recorder::forwarding;
    let preloaded = preloaded::preloaded();
    // `forwarding`: what the loader allocates for these look-ups is the
    // agent's own doing, not the program's, and is not recorded.
    forwarding(|| {
        next_allocator::bind();
        // Loaded by `dlopen` (heapdump attach): nothing reaches the hooks
        // until `heapdump_attach` rebinds to the program's own allocator,
        // which then makes these choices.
        if preloaded {
            choose_forwarding();
        }
    });
    if !preloaded {
        // Loaded by `dlopen`: the agent starts at `heapdump_attach`, with
        // the settings the attach gives.
        return;
    }
    heapdump_agent::start();
    let (config, _) = heapdump_agent::config::Config::from_env();
    if !config.quiet && !config.disabled {
        forwarding(warn_if_not_first);
    }
}

/// Choices that depend on which allocator the hooks forward to: how C++
/// operators forward, and whether frees may be held back.
pub(crate) fn choose_forwarding() {
    // Held-back frees (see `recorder::on_free_deferred`) were designed
    // and measured for glibc: its free reads the chunk header just below
    // the block, which the recorder prefetches while the release waits.
    // Other allocators keep their metadata elsewhere, and their own
    // statistics (jemalloc's `stats.allocated`, which programs such as
    // redis report) should move when the program frees, so every other
    // allocator gets each free at once.
    cxx::note_next_operators();
    in_place_realloc::choose();
    if next_allocator::next_is_glibc() {
        if let Some(f) = next_allocator::free() {
            heapdump_agent::recorder::set_release(f);
        }
    }
}

/// Says on stderr when `malloc` resolves, for the program, to a definition
/// found before this library (the executable's own, or a library preloaded
/// before it): then the program's allocations never reach the agent.
fn warn_if_not_first() {
    // SAFETY: dlsym with a NUL-terminated name; used for this diagnosis
    // only, never to forward a call.
    let global = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"malloc".as_ptr()) } as usize;
    // Compared by defining object, not by address: inside this library the
    // address of our own `malloc` is read through the GOT, so it is the
    // interposed one too.
    let here = &INIT as *const _ as usize;
    if global == 0
        || next_allocator::object_base_of(global) == next_allocator::object_base_of(here)
        // A non-PIE executable's PLT stub for malloc, not its own malloc
        // (an earlier preload is then told by `heapdump list` from the
        // environment instead).
        || !next_allocator::defines_symbol_at(global)
    {
        return;
    }
    let mut name = [0u8; 512];
    let n = next_allocator::object_name_of(global, &mut name);
    let mut msg = [0u8; 1024];
    let mut cur = std::io::Cursor::new(&mut msg[..]);
    let _ = std::io::Write::write_fmt(
        &mut cur,
        format_args!(
            "heapdump: this process's malloc comes from {} (found before \
             libheapdump_preload.so), so the agent sees none of its allocations; \
             put libheapdump_preload.so first in LD_PRELOAD (heapdump run does)\n",
            if n == 0 {
                "the executable"
            } else {
                std::str::from_utf8(&name[..n]).unwrap_or("another library")
            }
        ),
    );
    let len = cur.position() as usize;
    stderr(&msg[..len]);
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = preload_init;

/// `heapdump_request_snapshot(name)`: asks a watching dumper for a
/// snapshot. `name` may be NULL.
#[no_mangle]
pub unsafe extern "C" fn heapdump_request_snapshot(name: *const c_char) {
    let s = if name.is_null() {
        ""
    } else {
        // SAFETY: the caller passes a NUL-terminated string.
        unsafe { CStr::from_ptr(name) }.to_str().unwrap_or("")
    };
    heapdump_agent::request_snapshot(s);
}

/// `struct heapdump_stats` of `include/heapdump.h` (fields only ever
/// added at the end).
#[repr(C)]
struct CStats {
    live_bytes: u64,
    live_blocks: u64,
    peak_live_bytes: u64,
    total_allocs: u64,
    total_bytes: u64,
    dropped: u64,
    enabled: u32,
    reserved: u32,
}

/// `heapdump_stats(out, size)`: writes the first `size` bytes of the
/// process's heap numbers to `out`. Returns 0 when the agent records, 1
/// when it does not (all zeros), -1 when `out` is NULL. Never allocates.
#[no_mangle]
pub unsafe extern "C" fn heapdump_stats(out: *mut c_void, size: usize) -> c_int {
    if out.is_null() {
        return -1;
    }
    let s = heapdump_agent::stats();
    let c = CStats {
        live_bytes: s.live_bytes,
        live_blocks: s.live_blocks,
        peak_live_bytes: s.peak_live_bytes,
        total_allocs: s.total_allocs,
        total_bytes: s.total_bytes,
        dropped: s.dropped,
        enabled: u32::from(s.enabled),
        reserved: 0,
    };
    let n = size.min(std::mem::size_of::<CStats>());
    // SAFETY: the caller provides `size` writable bytes at `out` (the
    // header's contract); `n <= size` bytes are copied from a local value,
    // and the two never overlap.
    unsafe {
        std::ptr::copy_nonoverlapping((&c as *const CStats).cast::<u8>(), out.cast::<u8>(), n)
    };
    if s.enabled {
        0
    } else {
        1
    }
}
