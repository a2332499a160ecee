//! jemalloc's non-standard calls (`mallocx`, `rallocx`, `xallocx`,
//! `dallocx`, `sdallocx`): the forwarding and recording rules, shared by
//! the two ways they are wrapped: `libheapdump_jemalloc.so` (a companion
//! preload that exports the names) and an attached agent (which redirects
//! a program's relocation slots of these names to hooks under its own
//! names, so that a program probing for `mallocx` finds nothing new).
//!
//! Invariants:
//! - Each call forwards to jemalloc's definition given by the caller, with
//!   the caller's arguments; the block is jemalloc's, untouched.
//! - Recorded after jemalloc returns a block, removed before jemalloc gets
//!   it back; `fp` is the frame pointer of the exported hook, where the
//!   stack walk starts.

use std::ffi::{c_int, c_void};

/// How the wrapper records (the companion through the preload's internal
/// entry points, the attached agent through its recorder).
pub trait Record {
    /// Records a block of `size` bytes at `p` (never null).
    fn alloc(&self, p: usize, size: usize, fp: usize);
    /// Takes `p` out of the table; its recorded size, if it was recorded.
    fn free(&self, p: usize) -> Option<u64>;
}

/// `void *mallocx(size_t, int)`.
pub type Mallocx = unsafe extern "C" fn(usize, c_int) -> *mut c_void;
/// `void *rallocx(void *, size_t, int)`.
pub type Rallocx = unsafe extern "C" fn(*mut c_void, usize, c_int) -> *mut c_void;
/// `size_t xallocx(void *, size_t, size_t, int)`.
pub type Xallocx = unsafe extern "C" fn(*mut c_void, usize, usize, c_int) -> usize;
/// `void dallocx(void *, int)`.
pub type Dallocx = unsafe extern "C" fn(*mut c_void, c_int);
/// `void sdallocx(void *, size_t, int)`.
pub type Sdallocx = unsafe extern "C" fn(*mut c_void, usize, c_int);

/// `mallocx` through `f`, recorded.
///
/// # Safety
/// `f` is jemalloc's `mallocx`; the arguments are the caller's.
pub unsafe fn mallocx(
    f: Mallocx,
    size: usize,
    flags: c_int,
    fp: usize,
    r: &impl Record,
) -> *mut c_void {
    // SAFETY: the caller's contract.
    let p = unsafe { f(size, flags) };
    if !p.is_null() {
        r.alloc(p as usize, size, fp);
    }
    p
}

/// `rallocx` through `f`: the block may move; on failure the old one stays
/// (and keeps its record).
///
/// # Safety
/// `f` is jemalloc's `rallocx`; the arguments are the caller's.
pub unsafe fn rallocx(
    f: Rallocx,
    p: *mut c_void,
    size: usize,
    flags: c_int,
    fp: usize,
    r: &impl Record,
) -> *mut c_void {
    let old = if p.is_null() {
        None
    } else {
        r.free(p as usize)
    };
    // SAFETY: the caller's contract.
    let q = unsafe { f(p, size, flags) };
    if q.is_null() {
        if let Some(old) = old {
            r.alloc(p as usize, old as usize, fp);
        }
    } else {
        r.alloc(q as usize, size, fp);
    }
    q
}

/// `xallocx` through `f`: resizes in place to at least `size` (at most
/// `size + extra`) and returns the block's real size. The record keeps the
/// size the program can rely on: `size` when the resize reached it (the
/// most it asked for, `size + extra`, when the real size exceeds that),
/// else the old size.
///
/// # Safety
/// `f` is jemalloc's `xallocx`; the arguments are the caller's.
pub unsafe fn xallocx(
    f: Xallocx,
    p: *mut c_void,
    size: usize,
    extra: usize,
    flags: c_int,
    fp: usize,
    r: &impl Record,
) -> usize {
    let old = if p.is_null() {
        None
    } else {
        r.free(p as usize)
    };
    // SAFETY: the caller's contract.
    let real = unsafe { f(p, size, extra, flags) };
    if let Some(old) = old {
        let kept = if real >= size {
            real.min(size.saturating_add(extra))
        } else {
            old as usize
        };
        r.alloc(p as usize, kept, fp);
    }
    real
}

/// `dallocx` through `f`.
///
/// # Safety
/// `f` is jemalloc's `dallocx`; the arguments are the caller's.
pub unsafe fn dallocx(f: Dallocx, p: *mut c_void, flags: c_int, r: &impl Record) {
    if !p.is_null() {
        r.free(p as usize);
    }
    // SAFETY: the caller's contract.
    unsafe { f(p, flags) }
}

/// `sdallocx` through `f`.
///
/// # Safety
/// `f` is jemalloc's `sdallocx`; the arguments are the caller's.
pub unsafe fn sdallocx(f: Sdallocx, p: *mut c_void, size: usize, flags: c_int, r: &impl Record) {
    if !p.is_null() {
        r.free(p as usize);
    }
    // SAFETY: the caller's contract.
    unsafe { f(p, size, flags) }
}
