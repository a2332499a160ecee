//! C++ global `operator new` / `operator delete` (Itanium ABI names).
//!
//! libstdc++'s own operators have no frame pointers, so a trace taken
//! inside `malloc` would skip the function that called `new`. Interposing
//! them here starts the walk at that function. On allocation failure the
//! *next* definition (libstdc++'s) is called, which runs the new-handler
//! and throws `std::bad_alloc` as the language requires (its internal
//! `malloc` is recorded by our `malloc`).

use std::ffi::{c_void, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::recorder::{on_alloc, Role};
use heapdump_agent::stack_capture::frame_pointer;

use crate::{__libc_malloc, __libc_memalign};

struct Next {
    name: &'static CStr,
    addr: AtomicUsize,
}

impl Next {
    const fn new(name: &'static CStr) -> Self {
        Next {
            name,
            addr: AtomicUsize::new(0),
        }
    }

    fn get(&self) -> usize {
        let mut f = self.addr.load(Ordering::Relaxed);
        if f == 0 {
            // SAFETY: dlsym with a valid NUL-terminated name.
            f = unsafe { libc::dlsym(libc::RTLD_NEXT, self.name.as_ptr()) } as usize;
            self.addr.store(f, Ordering::Relaxed);
        }
        f
    }
}

static NEW: Next = Next::new(c"_Znwm");
static NEW_ARRAY: Next = Next::new(c"_Znam");
static NEW_ALIGNED: Next = Next::new(c"_ZnwmSt11align_val_t");
static NEW_ARRAY_ALIGNED: Next = Next::new(c"_ZnamSt11align_val_t");

#[inline(always)]
fn new_impl(size: usize, fp: usize, next: &Next) -> *mut c_void {
    // SAFETY: glibc's malloc; operator new(0) must return a unique pointer,
    // which malloc(0) does in glibc.
    let p = unsafe { __libc_malloc(size) };
    if p.is_null() {
        return fail(size, next);
    }
    on_alloc(p as usize, size, fp, Role::Preload);
    p
}

#[cold]
fn fail(size: usize, next: &Next) -> *mut c_void {
    let f = next.get();
    if f == 0 {
        // No libstdc++ (cannot happen in a C++ program): behave like
        // std::terminate would.
        // SAFETY: abort has no preconditions.
        unsafe { libc::abort() }
    }
    // SAFETY: `f` is libstdc++'s operator new of this signature; it either
    // returns memory or throws through our frame (extern "C-unwind").
    let real: unsafe extern "C-unwind" fn(usize) -> *mut c_void = unsafe { std::mem::transmute(f) };
    // SAFETY: same contract.
    unsafe { real(size) }
}

#[inline(always)]
fn new_aligned_impl(size: usize, align: usize, fp: usize, next: &Next) -> *mut c_void {
    // SAFETY: glibc's memalign; `align` is a power of two per C++.
    let p = unsafe { __libc_memalign(align, size) };
    if p.is_null() {
        let f = next.get();
        if f == 0 {
            // SAFETY: abort has no preconditions.
            unsafe { libc::abort() }
        }
        // SAFETY: libstdc++'s aligned operator new of this signature.
        let real: unsafe extern "C-unwind" fn(usize, usize) -> *mut c_void =
            unsafe { std::mem::transmute(f) };
        // SAFETY: same contract.
        return unsafe { real(size, align) };
    }
    on_alloc(p as usize, size, fp, Role::Preload);
    p
}

#[inline(always)]
fn nothrow(size: usize, align: usize, fp: usize) -> *mut c_void {
    // SAFETY: glibc allocators; null is a valid nothrow result.
    let p = unsafe {
        if align == 0 {
            __libc_malloc(size)
        } else {
            __libc_memalign(align, size)
        }
    };
    on_alloc(p as usize, size, fp, Role::Preload);
    p
}

/// The pointer came from one of the operators above (or libstdc++'s,
/// which use malloc), so glibc's free releases it.
#[inline(always)]
fn delete(p: *mut c_void) {
    crate::free_block(p)
}

/// `operator new(size_t)`.
#[no_mangle]
pub extern "C-unwind" fn _Znwm(size: usize) -> *mut c_void {
    new_impl(size, frame_pointer(), &NEW)
}
/// `operator new[](size_t)`.
#[no_mangle]
pub extern "C-unwind" fn _Znam(size: usize) -> *mut c_void {
    new_impl(size, frame_pointer(), &NEW_ARRAY)
}
/// `operator new(size_t, align_val_t)`.
#[no_mangle]
pub extern "C-unwind" fn _ZnwmSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    new_aligned_impl(size, align, frame_pointer(), &NEW_ALIGNED)
}
/// `operator new[](size_t, align_val_t)`.
#[no_mangle]
pub extern "C-unwind" fn _ZnamSt11align_val_t(size: usize, align: usize) -> *mut c_void {
    new_aligned_impl(size, align, frame_pointer(), &NEW_ARRAY_ALIGNED)
}
/// `operator new(size_t, nothrow_t const&)`.
#[no_mangle]
pub extern "C" fn _ZnwmRKSt9nothrow_t(size: usize, _nt: *const c_void) -> *mut c_void {
    nothrow(size, 0, frame_pointer())
}
/// `operator new[](size_t, nothrow_t const&)`.
#[no_mangle]
pub extern "C" fn _ZnamRKSt9nothrow_t(size: usize, _nt: *const c_void) -> *mut c_void {
    nothrow(size, 0, frame_pointer())
}
/// `operator new(size_t, align_val_t, nothrow_t const&)`.
#[no_mangle]
pub extern "C" fn _ZnwmSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    _nt: *const c_void,
) -> *mut c_void {
    nothrow(size, align.max(1), frame_pointer())
}
/// `operator new[](size_t, align_val_t, nothrow_t const&)`.
#[no_mangle]
pub extern "C" fn _ZnamSt11align_val_tRKSt9nothrow_t(
    size: usize,
    align: usize,
    _nt: *const c_void,
) -> *mut c_void {
    nothrow(size, align.max(1), frame_pointer())
}

macro_rules! deletes {
    ($($name:ident ( $($arg:ident : $ty:ty),* );)*) => {$(
        /// A C++ global `operator delete` overload.
        #[no_mangle]
        pub extern "C" fn $name(p: *mut c_void $(, $arg: $ty)*) {
            $(let _ = $arg;)*
            delete(p)
        }
    )*};
}

deletes! {
    _ZdlPv();
    _ZdaPv();
    _ZdlPvm(size: usize);
    _ZdaPvm(size: usize);
    _ZdlPvSt11align_val_t(align: usize);
    _ZdaPvSt11align_val_t(align: usize);
    _ZdlPvmSt11align_val_t(size: usize, align: usize);
    _ZdaPvmSt11align_val_t(size: usize, align: usize);
    _ZdlPvRKSt9nothrow_t(nt: *const c_void);
    _ZdaPvRKSt9nothrow_t(nt: *const c_void);
    _ZdlPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
    _ZdaPvSt11align_val_tRKSt9nothrow_t(align: usize, nt: *const c_void);
}
