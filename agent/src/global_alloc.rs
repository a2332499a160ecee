//! `Agent`: a `GlobalAlloc` that records every block of an inner allocator.

use std::alloc::{GlobalAlloc, Layout, System};

use crate::recorder::{self, Role};
use crate::stack_capture::frame_pointer;

/// Wraps an inner allocator (the system allocator, jemalloc, mimalloc...)
/// and records every live block in heapdump's shared regions.
///
/// ```no_run
/// #[global_allocator]
/// static A: heapdump_agent::Agent = heapdump_agent::Agent::system();
/// ```
#[derive(Debug, Default)]
pub struct Agent<A = System> {
    inner: A,
    /// Blocks go back through `libc::free` (true only over `System`,
    /// whose `dealloc` is exactly that on Unix), so their release may be
    /// held back like the preload library's (see
    /// `recorder::on_free_deferred`).
    hold_back: bool,
}

impl Agent<System> {
    /// The agent over the system allocator, usable in a `static`.
    pub const fn system() -> Self {
        Agent {
            inner: System,
            hold_back: true,
        }
    }
}

impl<A> Agent<A> {
    /// The agent over any allocator, usable in a `static`.
    pub const fn new(inner: A) -> Self {
        Agent {
            inner,
            hold_back: false,
        }
    }

    /// The inner allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }
}

// SAFETY: every method forwards to the inner allocator with the caller's
// arguments and returns its result unchanged; the recording on the side
// never touches the block's memory, never allocates through `self`
// (re-entrant calls pass straight through), and never unwinds.
unsafe impl<A: GlobalAlloc> GlobalAlloc for Agent<A> {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let fp = frame_pointer();
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { self.inner.alloc(layout) };
        recorder::on_alloc(p as usize, layout.size(), fp, Role::GlobalAlloc);
        p
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let fp = frame_pointer();
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { self.inner.alloc_zeroed(layout) };
        recorder::on_alloc(p as usize, layout.size(), fp, Role::GlobalAlloc);
        p
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        if self.hold_back {
            // `System` on Unix deallocates every layout with `free`, so a
            // block held back now can be released later with `free` alone.
            recorder::use_release(libc::free);
            let release = recorder::on_free_deferred(ptr as usize);
            if release != 0 {
                // SAFETY: `release` is `ptr` or a block this thread freed
                // earlier and held back, allocated by `System` (malloc,
                // calloc, posix_memalign), released exactly once.
                unsafe { libc::free(release as *mut libc::c_void) }
            }
            return;
        }
        // Remove first: once freed, the address may be handed to another
        // thread, whose record must not be removed by us.
        recorder::on_free(ptr as usize);
        // SAFETY: forwarded with the caller's guarantees.
        unsafe { self.inner.dealloc(ptr, layout) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let fp = frame_pointer();
        let old = recorder::on_free(ptr as usize);
        // SAFETY: forwarded with the caller's guarantees.
        let p = unsafe { self.inner.realloc(ptr, layout, new_size) };
        if p.is_null() {
            // The old block is still live: record it again.
            if old.is_some() {
                recorder::on_alloc(ptr as usize, layout.size(), fp, Role::GlobalAlloc);
            }
        } else {
            recorder::on_alloc(p as usize, new_size, fp, Role::GlobalAlloc);
        }
        p
    }
}
