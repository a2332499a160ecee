//! `dlclose`, interposed only to tell the CFI unwinder that a module may
//! be gone, so that no thread applies a cached rule of an unloaded module
//! to a new one loaded at the same address, and (glibc before 2.35) that
//! the agent's module table must be rebuilt (`heapdump_agent::module_table`).
//!
//! Invariant: the call is forwarded unchanged to the next definition
//! (glibc's, bound with the others in `next_allocator`); the unwinder is told
//! after it returns (a thread walking meanwhile cannot be inside the
//! module being closed, see `heapdump_agent::cfi_unwind`).

use std::ffi::{c_int, c_void};

use crate::next_allocator as next;

/// `dlclose(3)`.
#[no_mangle]
pub unsafe extern "C" fn dlclose(handle: *mut c_void) -> c_int {
    let Some(f) = next::dlclose() else {
        return -1;
    };
    heapdump_agent::module_table::closing();
    // SAFETY: glibc's dlclose, forwarded with the caller's argument.
    let r = unsafe { f(handle) };
    heapdump_agent::module_table::closed();
    heapdump_agent::cfi_unwind::module_unloaded();
    r
}
