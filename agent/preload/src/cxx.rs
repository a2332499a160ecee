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
//! - When the next plain and sized operators are libstdc++'s
//!   ([`LIBSTDCXX`]), a plain `new` or `new[]` is the next `malloc` of at
//!   least one byte, and a plain or sized `delete` is the next `free`
//!   (through the `free` hook's own path, `free_recorded`): that is what
//!   libstdc++'s operators do (its `new` calls the new-handler and throws
//!   only when `malloc` fails, which then goes to its full `new`; its
//!   `new[]` and sized `delete`s end in the same calls), without a `malloc`
//!   or `free` hook run inside the operator, nor the per-thread state that
//!   [`forwarding`] needs (a C++ pair cost ~350 instructions more than a C
//!   one before: the nested hooks and the forwarding state). In sampled
//!   mode a `new` that is not sampled is counted down once and served so
//!   at once, and a `delete` of a block that was not sampled goes straight
//!   to the next `free`. Every other case (another C++ runtime such as
//!   tcmalloc's, the aligned and nothrow operators) takes the full path.

use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, Ordering};

use heapdump_agent::recorder::{
    decide, forwarding, not_sampled, on_alloc_decided, on_free, sampled_out, Role,
};
use heapdump_agent::stack_capture::{caller_frame, caller_parent_frame};

use crate::bootstrap_arena as arena;
use crate::malloc_family::{
    free_recorded, not_tail_called, raw_free, raw_malloc, raw_memalign, recorded_or_arena,
};
use crate::next_allocator as next;

/// Whether the next `operator new`, `new[]`, `delete`, `delete[]` and the
/// two sized `delete`s are all libstdc++'s (see the module doc). Set once
/// at load time, after binding; false until then, which only means the
/// full path. Relaxed: it publishes nothing but itself.
static LIBSTDCXX: AtomicBool = AtomicBool::new(false);

/// Looks at the next operators (after binding) and sets [`LIBSTDCXX`].
pub fn note_next_operators() {
    let all = [
        next::new().map(|f| f as usize),
        next::new_array().map(|f| f as usize),
        next::delete().map(|f| f as usize),
        next::delete_array().map(|f| f as usize),
        next::delete_sized().map(|f| f as usize),
        next::delete_array_sized().map(|f| f as usize),
    ];
    let libstdcxx = all
        .iter()
        .all(|f| f.is_some_and(|f| next::defined_in(f, b"libstdc++.so")));
    LIBSTDCXX.store(libstdcxx, Ordering::Relaxed);
}

/// Sampled mode, libstdc++'s operators: a `new` of `size` bytes that is
/// not sampled, served by the next `malloc` (see the module doc); `None`
/// when the full path must serve it.
#[inline(always)]
fn unsampled_new(size: usize) -> Option<*mut c_void> {
    if !LIBSTDCXX.load(Ordering::Relaxed) {
        return None;
    }
    let f = next::loaded::malloc()?;
    // libstdc++'s `new` asks `malloc` for at least one byte.
    let size = size.max(1);
    if !sampled_out(size) {
        return None;
    }
    // SAFETY: the next allocator's malloc, same contract.
    let p = unsafe { f(size) };
    // Out of memory: the full path runs libstdc++'s `new`, with its
    // new-handler and `std::bad_alloc`.
    (!p.is_null()).then_some(p)
}

/// libstdc++'s operators, a block to record: what its `new` would return,
/// served by the next `malloc` (see the module doc), so that no `malloc`
/// hook runs inside the operator (nor [`forwarding`] around it); `None`
/// when the full path must serve it (another C++ runtime, or `malloc`
/// failed: libstdc++'s `new` then runs its new-handler or throws).
#[inline(always)]
fn libstdcxx_new(size: usize) -> Option<*mut c_void> {
    if !LIBSTDCXX.load(Ordering::Relaxed) {
        return None;
    }
    let f = next::loaded::malloc()?;
    // SAFETY: the next allocator's malloc, same contract; libstdc++'s
    // `new` asks it for at least one byte.
    let p = unsafe { f(size.max(1)) };
    (!p.is_null()).then_some(p)
}

/// Sampled mode, libstdc++'s operators: true when `p` was not sampled and
/// has been handed to the next `free` (see the module doc).
#[inline(always)]
fn unsampled_delete(p: *mut c_void) -> bool {
    if !LIBSTDCXX.load(Ordering::Relaxed) || !not_sampled(p as usize) {
        return false;
    }
    // The filter answers "maybe" for arena blocks, so `p` is not one.
    match next::loaded::free() {
        Some(f) => {
            // SAFETY: the next allocator's free on a block that its malloc
            // made (libstdc++'s `new` is that malloc) and the program
            // deletes.
            unsafe { f(p) };
            true
        }
        None => false,
    }
}

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
    if let Some(p) = unsampled_new(size) {
        return p;
    }
    not_tail_called(new_slow(size, next::new))
}

/// The next plain `operator new` or `new[]`.
type NextNew = unsafe extern "C-unwind" fn(usize) -> *mut c_void;

/// The full [`_Znwm`] or [`_Znam`], forwarding to `next`'s operator (see
/// `malloc_family::not_tail_called`).
#[inline(never)]
fn new_slow(size: usize, next: fn() -> Option<NextNew>) -> *mut c_void {
    let fp = caller_parent_frame();
    // Decided before the call: the fast path has already looked at the
    // countdown (see `recorder::Decision`).
    let decision = decide(size);
    let p = match libstdcxx_new(size) {
        Some(p) => p,
        None => match next() {
            // SAFETY: the next operator, same contract (may throw).
            Some(f) => forwarding(|| unsafe { f(size) }),
            None => new_without_runtime(size, 0),
        },
    };
    if !arena::contains(p as usize) {
        on_alloc_decided(p as usize, size, fp, Role::Preload, decision);
    }
    p
}

/// `operator new[](size_t)`.
#[no_mangle]
pub extern "C-unwind" fn _Znam(size: usize) -> *mut c_void {
    if let Some(p) = unsampled_new(size) {
        return p;
    }
    not_tail_called(new_slow(size, next::new_array))
}

/// `operator new(size_t, align_val_t)`.
#[no_mangle]
pub extern "C-unwind" fn _ZnwmSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    let fp = caller_frame();
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
    let fp = caller_frame();
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
    let fp = caller_frame();
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
    let fp = caller_frame();
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
    let fp = caller_frame();
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
    let fp = caller_frame();
    let p = match next::new_array_aligned_nothrow() {
        // SAFETY: the next aligned nothrow operator new[], same contract.
        Some(f) => forwarding(|| unsafe { f(size, align, nt) }),
        None => nothrow_without_runtime(size, align.max(1)),
    };
    recorded_or_arena(p, size, fp)
}

/// Defines `operator delete` overloads that forward to the next
/// definition of the same overload (`$next`), or to the next `free`;
/// those marked `fast` first try [`unsampled_delete`].
macro_rules! deletes {
    ($($name:ident = $next:ident ( $($arg:ident : $ty:ty),* ) $($fast:ident)?;)*) => {$(
        /// A C++ global `operator delete` overload.
        #[no_mangle]
        pub unsafe extern "C-unwind" fn $name(p: *mut c_void $(, $arg: $ty)*) {
            $(
                let _ = stringify!($fast);
                if unsampled_delete(p) {
                    return;
                }
                // libstdc++'s plain, array and sized deletes are its
                // `free`: the block goes as a `free` would, with no hook
                // run inside the operator (nor `forwarding` around it).
                if LIBSTDCXX.load(Ordering::Relaxed) {
                    free_recorded(p);
                    return;
                }
            )?
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
    _ZdlPv = delete() fast;
    _ZdaPv = delete_array() fast;
    _ZdlPvm = delete_sized(size: usize) fast;
    _ZdaPvm = delete_array_sized(size: usize) fast;
    _ZdlPvSt11align_val_t = delete_aligned(align: usize);
    _ZdaPvSt11align_val_t = delete_array_aligned(align: usize);
    _ZdlPvmSt11align_val_t = delete_sized_aligned(size: usize, align: usize);
    _ZdaPvmSt11align_val_t = delete_array_sized_aligned(size: usize, align: usize);
    _ZdlPvRKSt9nothrow_t = delete_nothrow(nt: *const c_void);
    _ZdaPvRKSt9nothrow_t = delete_array_nothrow(nt: *const c_void);
    _ZdlPvSt11align_val_tRKSt9nothrow_t = delete_aligned_nothrow(align: usize, nt: *const c_void);
    _ZdaPvSt11align_val_tRKSt9nothrow_t = delete_array_aligned_nothrow(align: usize, nt: *const c_void);
}
