//! jemalloc's `*allocx` calls in an attached process: the hooks a
//! program's relocation slots of `mallocx`, `rallocx`, `xallocx`,
//! `dallocx` and `sdallocx` are redirected to (`slot_redirection`). They
//! are exported under this library's own names (`heapdump_attached_*`),
//! so that a program probing for `mallocx` (weak references, `dlsym`) finds
//! nothing new; under `LD_PRELOAD` the companion `libheapdump_jemalloc.so`
//! does this job instead. The rules are `heapdump_agent::jemalloc_calls`'s.
//!
//! Invariant: the forwarding targets are set by [`bind`] before any slot
//! points at a hook (the attach calls it from `slot_redirection::prepare`),
//! and a hook with no target (jemalloc absent) is never installed: a slot
//! of a name jemalloc does not define holds no definition to forward to.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::jemalloc_calls::{self as calls, Record};
use heapdump_agent::recorder::{on_alloc, on_free, Role};
use heapdump_agent::stack_capture::caller_frame;

/// The names redirected, in the order of [`TARGETS`].
pub const NAMES: [&CStr; 5] = [c"mallocx", c"rallocx", c"xallocx", c"dallocx", c"sdallocx"];

/// jemalloc's definition of each of [`NAMES`] (0: none).
static TARGETS: [AtomicUsize; 5] = [const { AtomicUsize::new(0) }; 5];

/// Our hook's name for a redirected name, if it is one of [`NAMES`].
pub fn hook_name(name: &CStr) -> Option<&'static CStr> {
    let i = NAMES.iter().position(|n| *n == name)?;
    Some(
        [
            c"heapdump_attached_mallocx",
            c"heapdump_attached_rallocx",
            c"heapdump_attached_xallocx",
            c"heapdump_attached_dallocx",
            c"heapdump_attached_sdallocx",
        ][i],
    )
}

/// Finds jemalloc's definitions: the ones the program's bound slots hold,
/// else the global ones if they are real definitions. Returns whether
/// `name` has one (its slots may then be redirected).
pub fn bind() {
    for (i, name) in NAMES.iter().enumerate() {
        let f = crate::bound_definitions::bound_definition(name).unwrap_or_else(|| {
            // SAFETY: dlsym with a NUL-terminated name (attach time, not a
            // hook).
            let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) } as usize;
            if f != 0 && crate::next_allocator::defines_symbol_at(f) {
                f
            } else {
                0
            }
        });
        TARGETS[i].store(f, Ordering::Relaxed);
    }
}

/// Whether `name` (one of [`NAMES`]) has a definition to forward to.
pub fn bound(name: &CStr) -> bool {
    NAMES
        .iter()
        .position(|n| *n == name)
        .is_some_and(|i| TARGETS[i].load(Ordering::Relaxed) != 0)
}

fn target(i: usize) -> usize {
    // Relaxed: set before any slot leads here (see the module invariant).
    TARGETS[i].load(Ordering::Relaxed)
}

/// Records through this library's agent.
struct Here;

impl Record for Here {
    fn alloc(&self, p: usize, size: usize, fp: usize) {
        on_alloc(p, size, fp, Role::Preload);
    }
    fn free(&self, p: usize) -> Option<u64> {
        on_free(p)
    }
}

/// `mallocx`, attached.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attached_mallocx(size: usize, flags: c_int) -> *mut c_void {
    let fp = caller_frame();
    // SAFETY: target(0) is jemalloc's mallocx (never 0 once a slot leads
    // here); forwarded with the caller's arguments.
    unsafe {
        calls::mallocx(
            std::mem::transmute::<usize, calls::Mallocx>(target(0)),
            size,
            flags,
            fp,
            &Here,
        )
    }
}

/// `rallocx`, attached.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attached_rallocx(
    p: *mut c_void,
    size: usize,
    flags: c_int,
) -> *mut c_void {
    let fp = caller_frame();
    // SAFETY: as in `heapdump_attached_mallocx`.
    unsafe {
        calls::rallocx(
            std::mem::transmute::<usize, calls::Rallocx>(target(1)),
            p,
            size,
            flags,
            fp,
            &Here,
        )
    }
}

/// `xallocx`, attached.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attached_xallocx(
    p: *mut c_void,
    size: usize,
    extra: usize,
    flags: c_int,
) -> usize {
    let fp = caller_frame();
    // SAFETY: as in `heapdump_attached_mallocx`.
    unsafe {
        calls::xallocx(
            std::mem::transmute::<usize, calls::Xallocx>(target(2)),
            p,
            size,
            extra,
            flags,
            fp,
            &Here,
        )
    }
}

/// `dallocx`, attached.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attached_dallocx(p: *mut c_void, flags: c_int) {
    // SAFETY: as in `heapdump_attached_mallocx`.
    unsafe {
        calls::dallocx(
            std::mem::transmute::<usize, calls::Dallocx>(target(3)),
            p,
            flags,
            &Here,
        )
    }
}

/// `sdallocx`, attached.
#[no_mangle]
pub unsafe extern "C" fn heapdump_attached_sdallocx(p: *mut c_void, size: usize, flags: c_int) {
    // SAFETY: as in `heapdump_attached_mallocx`.
    unsafe {
        calls::sdallocx(
            std::mem::transmute::<usize, calls::Sdallocx>(target(4)),
            p,
            size,
            flags,
            &Here,
        )
    }
}
