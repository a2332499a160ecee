//! Entry points for heapdump's companion preload libraries (today
//! `libheapdump_jemalloc.so`, which exports jemalloc's `*allocx` calls):
//! they record through this library's agent, so one process keeps one pair
//! of regions. Not a public interface: names and signatures may change
//! with the libraries, which are always built together.
//!
//! Invariant: same rules as the hooks in [`crate::malloc_family`]: record
//! after the allocator returned a block, remove before it gets the block
//! back; `fp` is the frame pointer of the companion's hook, where the
//! stack walk starts.

use std::ffi::c_int;

use heapdump_agent::recorder::{on_alloc, on_free, Role};

/// Records a block of `size` bytes at `addr` (0: nothing), allocated by
/// the hook whose frame pointer is `fp`.
#[no_mangle]
pub extern "C" fn heapdump_internal_on_alloc(addr: usize, size: usize, fp: usize) {
    on_alloc(addr, size, fp, Role::Preload);
}

/// Takes the block at `addr` out of the table. Returns 1 and writes its
/// recorded size to `*size_out` (when not null) if it was recorded, else 0.
///
/// # Safety
/// `size_out` is null or valid for one write.
#[no_mangle]
pub unsafe extern "C" fn heapdump_internal_on_free(addr: usize, size_out: *mut u64) -> c_int {
    match on_free(addr) {
        Some(size) => {
            if !size_out.is_null() {
                // SAFETY: the caller passes a valid out-pointer or null.
                unsafe { *size_out = size };
            }
            1
        }
        None => 0,
    }
}
