//! `dlclose`, interposed only to tell the CFI unwinder that a module may
//! be gone, so that no thread applies a cached rule of an unloaded module
//! to a new one loaded at the same address.
//!
//! Invariant: the call is forwarded unchanged to the next definition
//! (glibc's), bound once with `dlsym(RTLD_NEXT)`; the unwinder is told
//! after it returns (a thread walking meanwhile cannot be inside the
//! module being closed, see `heapdump_agent::cfi_unwind`).

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

static NEXT: AtomicUsize = AtomicUsize::new(0);

/// Binds the next `dlclose` (from the library's constructor).
pub fn bind() {
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, c"dlclose".as_ptr()) } as usize;
    NEXT.store(f, Ordering::Relaxed);
}

/// `dlclose(3)`.
#[no_mangle]
pub unsafe extern "C" fn dlclose(handle: *mut c_void) -> c_int {
    let mut f = NEXT.load(Ordering::Relaxed);
    if f == 0 {
        bind();
        f = NEXT.load(Ordering::Relaxed);
        if f == 0 {
            return -1;
        }
    }
    // SAFETY: glibc's dlclose, of this signature.
    let f: unsafe extern "C" fn(*mut c_void) -> c_int = unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded with the caller's argument.
    let r = unsafe { f(handle) };
    #[cfg(target_arch = "x86_64")]
    heapdump_agent::cfi_unwind::module_unloaded();
    r
}
