//! C++ global `operator new` / `operator delete`, every variant (plain,
//! array, nothrow, sized, aligned and their combinations; Itanium ABI
//! names).
//!
//! Invariants:
//! - Each forwards to the next definition of the same operator
//!   (libstdc++'s, or jemalloc's / tcmalloc's where the program links
//!   them), so the program keeps the `new` it would have without us,
//!   including its new-handler and `std::bad_alloc`.
//! - The forwarded call runs under [`forwarding`]: libstdc++'s `new` calls
//!   `malloc` and its `delete` calls `free`, which pass through our hooks
//!   unrecorded, so each block is counted once, by the operator, with a
//!   stack that starts at the code that called `new` (libstdc++ has no
//!   frame pointers: a walk from inside its `malloc` would skip that
//!   function).
//! - A throwing `new` unwinds through our frame (`extern "C-unwind"`);
//!   [`forwarding`] restores the thread's state on the way out.
//! - Without a next definition (only while the next allocator is being
//!   bound, or in a process with no C++ runtime), `new` uses the next
//!   `malloc` / `memalign` and aborts on failure, as a C++ runtime without
//!   exceptions would; `delete` uses the next `free`.

use std::ffi::c_void;

use heapdump_agent::recorder::{forwarding, on_free};
use heapdump_agent::stack_capture::frame_pointer;

use crate::bootstrap_arena as arena;
use crate::malloc_family::{raw_free, raw_malloc, raw_memalign, recorded_or_arena};
use crate::next_allocator as next;

/// The no-next-definition path of a throwing `new`.
#[cold]
fn new_without_runtime(size: usize, align: usize) -> *mut c_void {
    let p = if align == 0 {
        raw_malloc(size)
    } else {
        raw_memalign(align, size)
    };
    if p.is_null() {
        // No C++ runtime to throw std::bad_alloc: what
        // std::terminate would do.
        // SAFETY: abort has no preconditions.
        unsafe { libc::abort() }
    }
    p
}

/// The no-next-definition path of a nothrow `new`.
#[cold]
fn nothrow_without_runtime(size: usize, align: usize) -> *mut c_void {
    if align == 0 {
        raw_malloc(size)
    } else {
        raw_memalign(align, size)
    }
}

/// Takes `p` out of the table before `release` hands it back.
#[inline(always)]
fn delete_with(p: *mut c_void, release: impl FnOnce()) {
    if p.is_null() || arena::contains(p as usize) {
        return;
    }
    on_free(p as usize);
    forwarding(release);
}

/// `operator new(size_t)`.
#[no_mangle]
pub extern "C-unwind" fn _Znwm(size: usize) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new() {
        // SAFETY: the next operator new, same contract (may throw).
        Some(f) => forwarding(|| unsafe { f(size) }),
        None => new_without_runtime(size, 0),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new[](size_t)`.
#[no_mangle]
pub extern "C-unwind" fn _Znam(size: usize) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_array() {
        // SAFETY: the next operator new[], same contract (may throw).
        Some(f) => forwarding(|| unsafe { f(size) }),
        None => new_without_runtime(size, 0),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new(size_t, align_val_t)`.
#[no_mangle]
pub extern "C-unwind" fn _ZnwmSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_aligned() {
        // SAFETY: the next aligned operator new, same contract.
        Some(f) => forwarding(|| unsafe { f(size, align) }),
        None => new_without_runtime(size, align),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new[](size_t, align_val_t)`.
#[no_mangle]
pub extern "C-unwind" fn _ZnamSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_array_aligned() {
        // SAFETY: the next aligned operator new[], same contract.
        Some(f) => forwarding(|| unsafe { f(size, align) }),
        None => new_without_runtime(size, align),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new(size_t, nothrow_t const&)`.
#[no_mangle]
pub unsafe extern "C-unwind" fn _ZnwmRKSt9nothrow_t(size: usize, nt: *const c_void) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_nothrow() {
        // SAFETY: the next nothrow operator new, same contract.
        Some(f) => forwarding(|| unsafe { f(size, nt) }),
        None => nothrow_without_runtime(size, 0),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new[](size_t, nothrow_t const&)`.
#[no_mangle]
pub unsafe extern "C-unwind" fn _ZnamRKSt9nothrow_t(size: usize, nt: *const c_void) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_array_nothrow() {
        // SAFETY: the next nothrow operator new[], same contract.
        Some(f) => forwarding(|| unsafe { f(size, nt) }),
        None => nothrow_without_runtime(size, 0),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new(size_t, align_val_t, nothrow_t const&)`.
#[no_mangle]
pub unsafe extern "C-unwind" fn _ZnwmSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    nt: *const c_void,
) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_aligned_nothrow() {
        // SAFETY: the next aligned nothrow operator new, same contract.
        Some(f) => forwarding(|| unsafe { f(size, align, nt) }),
        None => nothrow_without_runtime(size, align.max(1)),
    };
    recorded_or_arena(p, size, fp)
}

/// `operator new[](size_t, align_val_t, nothrow_t const&)`.
#[no_mangle]
pub unsafe extern "C-unwind" fn _ZnamSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    nt: *const c_void,
) -> *mut c_void {
    let fp = frame_pointer();
    let p = match next::new_array_aligned_nothrow() {
        // SAFETY: the next aligned nothrow operator new[], same contract.
        Some(f) => forwarding(|| unsafe { f(size, align, nt) }),
        None => nothrow_without_runtime(size, align.max(1)),
    };
    recorded_or_arena(p, size, fp)
}

/// Defines `operator delete` overloads that forward to the next
/// definition of the same overload (`$next`), or to the next `free`.
macro_rules! deletes {
    ($($name:ident = $next:ident ( $($arg:ident : $ty:ty),* );)*) => {$(
        /// A C++ global `operator delete` overload.
        #[no_mangle]
        pub unsafe extern "C-unwind" fn $name(p: *mut c_void $(, $arg: $ty)*) {
            delete_with(p, || match next::$next() {
                // SAFETY: the next definition of this operator delete, on
                // a block the matching operator new returned.
                Some(f) => unsafe { f(p $(, $arg)*) },
                None => raw_free(p),
            })
        }
    )*};
}

deletes! {
    _ZdlPv = delete();
    _ZdaPv = delete_array();
    _ZdlPvm = delete_sized(size: usize);
    _ZdaPvm = delete_array_sized(size: usize);
    _ZdlPvSt11align_val_t = delete_aligned(align: usize);
    _ZdaPvSt11align_val_t = delete_array_aligned(align: usize);
    _ZdlPvmSt11align_val_t = delete_sized_aligned(size: usize, align: usize);
    _ZdaPvmSt11align_val_t = delete_array_sized_aligned(size: usize, align: usize);
    _ZdlPvRKSt9nothrow_t = delete_nothrow(nt: *const c_void);
    _ZdaPvRKSt9nothrow_t = delete_array_nothrow(nt: *const c_void);
    _ZdlPvSt11align_val_tRKSt9nothrow_t = delete_aligned_nothrow(align: usize, nt: *const c_void);
    _ZdaPvSt11align_val_tRKSt9nothrow_t = delete_array_aligned_nothrow(align: usize, nt: *const c_void);
}
