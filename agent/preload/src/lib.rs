//! `libheapdump_preload.so`: heapdump's agent for any dynamically linked
//! program (C, C++, Rust), loaded with `LD_PRELOAD`.
//!
//! It interposes the malloc family (`malloc`, `free`, `calloc`, `realloc`,
//! `reallocarray`, `memalign`, `posix_memalign`, `aligned_alloc`, `valloc`,
//! `pvalloc`, `malloc_usable_size`) and the C++ global `operator new` /
//! `operator delete` (so the stack trace starts at the code that called
//! `new`, not inside libstdc++, which has no frame pointers), and records
//! each event with `heapdump-agent`'s recorder.
//!
//! The real allocator is reached through glibc's `__libc_*` entry points,
//! which the dynamic linker binds at load time: there is no `dlsym`
//! bootstrap during which an allocation could recurse. (Only
//! `malloc_usable_size` and the C++ failure paths are looked up with
//! `dlsym(RTLD_NEXT)`, lazily, outside any allocation.) Consequence: under
//! this library the program uses glibc's malloc even if another malloc was
//! preloaded before it. Every entry point has a frame pointer (the
//! workspace builds with `-C force-frame-pointers=yes`), which the stack
//! walk starts from, so none of this library's frames are reported.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::recorder::{on_alloc, on_free, on_free_deferred, Role};
use heapdump_agent::stack_capture::frame_pointer;

extern "C" {
    fn __libc_malloc(size: usize) -> *mut c_void;
    fn __libc_free(p: *mut c_void);
    fn __libc_calloc(n: usize, size: usize) -> *mut c_void;
    fn __libc_realloc(p: *mut c_void, size: usize) -> *mut c_void;
    fn __libc_memalign(align: usize, size: usize) -> *mut c_void;
}

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

/// Runs at load time: start the agent (regions, signal handler) before
/// `main`, so a snapshot signal never finds it absent.
extern "C" fn preload_init() {
    heapdump_agent::recorder::set_release(__libc_free);
    heapdump_agent::start();
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = preload_init;

/// `malloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    let fp = frame_pointer();
    // SAFETY: glibc's malloc, same contract.
    let p = unsafe { __libc_malloc(size) };
    on_alloc(p as usize, size, fp, Role::Preload);
    p
}

/// `free(3)`: the block leaves the table before the memory is released.
#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    free_block(p)
}

/// Takes `p` (a glibc block, or null) out of the table and hands it, or
/// a block this thread held back earlier, to glibc (`free` and C++
/// `delete`).
#[inline(always)]
fn free_block(p: *mut c_void) {
    if p.is_null() {
        return;
    }
    let release = on_free_deferred(p as usize);
    if release != 0 {
        // SAFETY: glibc's free, same contract: `release` is `p` or a block
        // this thread freed earlier and held back (never released twice),
        // and every block here came from glibc.
        unsafe { __libc_free(release as *mut c_void) }
    }
}

/// `calloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    let fp = frame_pointer();
    // SAFETY: glibc's calloc (it checks n * size for overflow).
    let p = unsafe { __libc_calloc(n, size) };
    on_alloc(p as usize, n.wrapping_mul(size), fp, Role::Preload);
    p
}

#[inline(always)]
unsafe fn realloc_impl(p: *mut c_void, size: usize, fp: usize) -> *mut c_void {
    if p.is_null() {
        // SAFETY: glibc's malloc.
        let q = unsafe { __libc_malloc(size) };
        on_alloc(q as usize, size, fp, Role::Preload);
        return q;
    }
    // The block may move (and its address be reused by another thread at
    // once): take it out of the table first.
    let old = on_free(p as usize);
    // SAFETY: glibc's realloc, same contract as ours.
    let q = unsafe { __libc_realloc(p, size) };
    if q.is_null() {
        if size != 0 {
            // Failed: the old block is untouched and still live.
            if let Some(old_size) = old {
                on_alloc(p as usize, old_size as usize, fp, Role::Preload);
            }
        }
    } else {
        on_alloc(q as usize, size, fp, Role::Preload);
    }
    q
}

/// `realloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    let fp = frame_pointer();
    // SAFETY: same contract as realloc.
    unsafe { realloc_impl(p, size, fp) }
}

/// `reallocarray(3)`.
#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    let fp = frame_pointer();
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    // SAFETY: same contract as realloc.
    unsafe { realloc_impl(p, total, fp) }
}

#[inline(always)]
fn aligned(align: usize, size: usize, fp: usize) -> *mut c_void {
    // SAFETY: glibc's memalign accepts any alignment (rounding it up to a
    // power of two) and any size.
    let p = unsafe { __libc_memalign(align, size) };
    on_alloc(p as usize, size, fp, Role::Preload);
    p
}

/// `memalign(3)`.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    aligned(align, size, frame_pointer())
}

/// `aligned_alloc(3)`: alignment must be a power of two.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    let fp = frame_pointer();
    if !align.is_power_of_two() {
        set_errno(libc::EINVAL);
        return std::ptr::null_mut();
    }
    aligned(align, size, fp)
}

/// `posix_memalign(3)`.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    let fp = frame_pointer();
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let p = aligned(align, size, fp);
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller passes a valid out-pointer (posix_memalign's
    // contract).
    unsafe { *out = p };
    0
}

/// `valloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    aligned(page_size(), size, frame_pointer())
}

/// `pvalloc(3)`: page-aligned, size rounded up to whole pages.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let fp = frame_pointer();
    let page = page_size();
    let Some(rounded) = size.max(1).checked_next_multiple_of(page) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    aligned(page, rounded, fp)
}

static REAL_USABLE_SIZE: AtomicUsize = AtomicUsize::new(0);

/// `malloc_usable_size(3)`: forwarded to glibc (blocks are not altered).
#[no_mangle]
pub unsafe extern "C" fn malloc_usable_size(p: *mut c_void) -> usize {
    let mut f = REAL_USABLE_SIZE.load(Ordering::Relaxed);
    if f == 0 {
        // SAFETY: dlsym with a valid NUL-terminated name.
        f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"malloc_usable_size".as_ptr()) } as usize;
        REAL_USABLE_SIZE.store(f, Ordering::Relaxed);
    }
    if f == 0 {
        return 0;
    }
    // SAFETY: `f` is glibc's malloc_usable_size, of this exact signature.
    let real: unsafe extern "C" fn(*mut c_void) -> usize = unsafe { std::mem::transmute(f) };
    // SAFETY: same contract as ours.
    unsafe { real(p) }
}

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

mod cxx;
