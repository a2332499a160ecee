//! `libheapdump_jemalloc.so`: records the allocations a program makes
//! through jemalloc's non-standard API (`mallocx`, `rallocx`, `xallocx`,
//! `dallocx`, `sdallocx`), for programs linked against jemalloc (bind9's
//! libisc, for one). Load it *after* `libheapdump_preload.so`:
//! `LD_PRELOAD="libheapdump_preload.so libheapdump_jemalloc.so"`;
//! `heapdump run` adds it by itself when the program links jemalloc.
//!
//! Why a separate library: programs probe for jemalloc by looking these
//! names up (weak references, `dlsym`). If `libheapdump_preload.so` defined
//! them, every program would seem to have jemalloc. This one is loaded only
//! where jemalloc is.
//!
//! Invariants:
//! - Each call forwards to the next definition (jemalloc's), bound once
//!   with `dlsym(RTLD_NEXT)`; the block is jemalloc's, untouched.
//! - Events are recorded through `libheapdump_preload.so`'s internal entry
//!   points, so the process keeps one agent and one pair of regions. Without
//!   that library nothing is recorded (and it says so once on stderr).
//! - Recorded after jemalloc returns a block, removed before jemalloc gets
//!   it back; the stack walk starts at the hook's own frame pointer.
//! - `sallocx` and `nallocx` only ask jemalloc about sizes: they are not
//!   wrapped and reach jemalloc directly.

#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::jemalloc_calls::{self as calls, Record};
use heapdump_agent::stack_capture::caller_frame;

/// A function bound once by name; 0 until then (or if absent).
struct Bound {
    name: &'static CStr,
    /// Look up with RTLD_NEXT (jemalloc) or RTLD_DEFAULT (the preload's
    /// internal entry points, defined before this library).
    next: bool,
    addr: AtomicUsize,
}

impl Bound {
    const fn new(name: &'static CStr, next: bool) -> Self {
        Bound {
            name,
            next,
            addr: AtomicUsize::new(0),
        }
    }

    /// The address (0: absent), looked up on first use only: an absent
    /// symbol is remembered as [`ABSENT`], so a misconfigured process does
    /// not pay a `dlsym` on every call. Two threads may both look it up and
    /// store the same value; Relaxed suffices (code addresses of loaded
    /// libraries publish no data).
    #[inline]
    fn get(&self) -> usize {
        match self.addr.load(Ordering::Relaxed) {
            0 => self.look_up(),
            ABSENT => 0,
            f => f,
        }
    }

    #[cold]
    fn look_up(&self) -> usize {
        let handle = if self.next {
            libc::RTLD_NEXT
        } else {
            libc::RTLD_DEFAULT
        };
        // SAFETY: dlsym with a NUL-terminated name. It may call malloc,
        // which is libheapdump_preload.so's or jemalloc's, never ours.
        let f = unsafe { libc::dlsym(handle, self.name.as_ptr()) } as usize;
        self.addr
            .store(if f == 0 { ABSENT } else { f }, Ordering::Relaxed);
        f
    }
}

/// [`Bound::addr`] of a symbol looked up and not found (no code is at
/// address 1).
const ABSENT: usize = 1;

static MALLOCX: Bound = Bound::new(c"mallocx", true);
static RALLOCX: Bound = Bound::new(c"rallocx", true);
static XALLOCX: Bound = Bound::new(c"xallocx", true);
static DALLOCX: Bound = Bound::new(c"dallocx", true);
static SDALLOCX: Bound = Bound::new(c"sdallocx", true);
static ON_ALLOC: Bound = Bound::new(c"heapdump_internal_on_alloc", false);
static ON_FREE: Bound = Bound::new(c"heapdump_internal_on_free", false);

/// Records through `libheapdump_preload.so`'s internal entry points.
struct ThroughPreload;

impl Record for ThroughPreload {
    fn alloc(&self, p: usize, size: usize, fp: usize) {
        let f = ON_ALLOC.get();
        if f != 0 {
            // SAFETY: `heapdump_internal_on_alloc(usize, usize, usize)` of
            // libheapdump_preload.so, built with this library.
            let f: extern "C" fn(usize, usize, usize) = unsafe { std::mem::transmute(f) };
            f(p, size, fp);
        }
    }

    fn free(&self, p: usize) -> Option<u64> {
        let f = ON_FREE.get();
        if f == 0 {
            return None;
        }
        // SAFETY: `heapdump_internal_on_free(usize, *mut u64) -> c_int` of
        // libheapdump_preload.so, built with this library.
        let f: unsafe extern "C" fn(usize, *mut u64) -> c_int = unsafe { std::mem::transmute(f) };
        let mut size = 0u64;
        // SAFETY: `size` is a valid out-pointer.
        (unsafe { f(p, &mut size) } == 1).then_some(size)
    }
}

/// jemalloc's `mallocx`.
#[no_mangle]
pub unsafe extern "C" fn mallocx(size: usize, flags: c_int) -> *mut c_void {
    let fp = caller_frame();
    let f = MALLOCX.get();
    if f == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: `f` is jemalloc's mallocx; forwarded with the caller's
    // arguments.
    unsafe {
        calls::mallocx(
            std::mem::transmute::<usize, calls::Mallocx>(f),
            size,
            flags,
            fp,
            &ThroughPreload,
        )
    }
}

/// jemalloc's `rallocx`.
#[no_mangle]
pub unsafe extern "C" fn rallocx(p: *mut c_void, size: usize, flags: c_int) -> *mut c_void {
    let fp = caller_frame();
    let f = RALLOCX.get();
    if f == 0 {
        return std::ptr::null_mut();
    }
    // SAFETY: as in `mallocx`.
    unsafe {
        calls::rallocx(
            std::mem::transmute::<usize, calls::Rallocx>(f),
            p,
            size,
            flags,
            fp,
            &ThroughPreload,
        )
    }
}

/// jemalloc's `xallocx`.
#[no_mangle]
pub unsafe extern "C" fn xallocx(p: *mut c_void, size: usize, extra: usize, flags: c_int) -> usize {
    let fp = caller_frame();
    let f = XALLOCX.get();
    if f == 0 {
        return 0;
    }
    // SAFETY: as in `mallocx`.
    unsafe {
        calls::xallocx(
            std::mem::transmute::<usize, calls::Xallocx>(f),
            p,
            size,
            extra,
            flags,
            fp,
            &ThroughPreload,
        )
    }
}

/// jemalloc's `dallocx`.
#[no_mangle]
pub unsafe extern "C" fn dallocx(p: *mut c_void, flags: c_int) {
    let f = DALLOCX.get();
    if f == 0 {
        return;
    }
    // SAFETY: as in `mallocx`.
    unsafe {
        calls::dallocx(
            std::mem::transmute::<usize, calls::Dallocx>(f),
            p,
            flags,
            &ThroughPreload,
        )
    }
}

/// jemalloc's `sdallocx`.
#[no_mangle]
pub unsafe extern "C" fn sdallocx(p: *mut c_void, size: usize, flags: c_int) {
    let f = SDALLOCX.get();
    if f == 0 {
        return;
    }
    // SAFETY: as in `mallocx`.
    unsafe {
        calls::sdallocx(
            std::mem::transmute::<usize, calls::Sdallocx>(f),
            p,
            size,
            flags,
            &ThroughPreload,
        )
    }
}

fn stderr(msg: &[u8]) {
    // SAFETY: write(2) on fd 2 with a valid buffer; the result is ignored.
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
    }
}

/// At load: bind everything, and say once what cannot work.
extern "C" fn init() {
    let quiet = heapdump_agent::config::Config::from_env().0.quiet;
    if MALLOCX.get() == 0 && !quiet {
        stderr(
            b"heapdump: libheapdump_jemalloc.so is loaded but no jemalloc follows it; \
              remove it from LD_PRELOAD (programs will think jemalloc is present)\n",
        );
    }
    for b in [&RALLOCX, &XALLOCX, &DALLOCX, &SDALLOCX] {
        b.get();
    }
    if (ON_ALLOC.get() == 0 || ON_FREE.get() == 0) && !quiet {
        stderr(
            b"heapdump: libheapdump_jemalloc.so needs libheapdump_preload.so before it in \
              LD_PRELOAD; jemalloc's *allocx calls are not recorded\n",
        );
    }
}

#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = init;
