//! `Agent`: a `GlobalAlloc` that records every block of an inner allocator.

use std::alloc::{GlobalAlloc, Layout, System};

use crate::recorder::{self, Role};
use crate::stack_capture::caller_frame;

/// Wraps an inner allocator (the system allocator, jemalloc, mimalloc...)
/// and records every live block in heapdump's shared regions.
///
/// With [`Agent::with_block_headers`], each block carries an 8-byte
/// header just before it (see there).
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
    /// Blocks carry a header word naming their record (see
    /// [`Agent::with_block_headers`]).
    headers: bool,
}

impl Agent<System> {
    /// The agent over the system allocator, usable in a `static`.
    pub const fn system() -> Self {
        Agent {
            inner: System,
            hold_back: true,
            headers: false,
        }
    }
}

impl<A> Agent<A> {
    /// The agent over any allocator, usable in a `static`.
    pub const fn new(inner: A) -> Self {
        Agent {
            inner,
            hold_back: false,
            headers: false,
        }
    }

    /// The same agent, putting an 8-byte header before each block that
    /// names the block's record, so a free finds the record without
    /// looking its address up: one cache miss fewer per free in a large
    /// heap (`bench/churn`: 80-130 ns less per malloc+free pair at 100 000
    /// live blocks on this project's 2.1 GHz machine). The inner
    /// allocator sees each size 8 bytes larger (a block aligned to more
    /// than 8 bytes: its alignment larger).
    ///
    /// Only for programs that free every block through the global
    /// allocator: a block handed to C code that frees it with `free(3)`,
    /// or measured with `malloc_usable_size(3)`, would be given a pointer
    /// the system allocator never returned (with the plain agent such code
    /// keeps working on top of `System`).
    ///
    /// ```no_run
    /// #[global_allocator]
    /// static A: heapdump_agent::Agent = heapdump_agent::Agent::system().with_block_headers();
    /// ```
    pub const fn with_block_headers(mut self) -> Self {
        self.headers = true;
        self
    }

    /// The inner allocator.
    pub fn inner(&self) -> &A {
        &self.inner
    }
}

/// Bytes the `Agent` puts before a block of alignment `align`: 8 for the
/// header word, more only to keep the block's alignment.
#[inline(always)]
const fn pad_for(align: usize) -> usize {
    if align > 8 {
        align
    } else {
        8
    }
}

/// Reads the header word before `p` (the record's token, 0 = unrecorded).
///
/// # Safety
/// `p` was returned by this `Agent` (so the 8 bytes before it are its
/// header, inside the inner allocator's block and 8-aligned).
#[inline(always)]
unsafe fn token_of(p: *mut u8) -> u64 {
    // SAFETY: per the contract, `p - 8` is an aligned word of the block.
    unsafe { (p.sub(8) as *const u64).read() }
}

/// Writes the header word before `p`.
///
/// # Safety
/// As for [`token_of`]; the block is not yet (or no longer) visible to the
/// program, or the word is the agent's own.
#[inline(always)]
unsafe fn set_token(p: *mut u8, token: u64) {
    // SAFETY: per the contract, `p - 8` is an aligned word of the block.
    unsafe { (p.sub(8) as *mut u64).write(token) }
}

// With `headers`, every block the `Agent` hands out starts
// `pad_for(align)` bytes into a block of the inner allocator, with a
// header word just before it: the token of its record
// (`recorder::on_alloc_direct`), so a free finds the record without
// looking its address up. The program never sees the header (it lies
// before the block); a program writing before its block could change it,
// and then the free only fails to find the record (a token must name the
// record that holds exactly this address), never removes another.
// Without `headers`, blocks are the inner allocator's own and records are
// found by address.
//
// SAFETY: every method allocates from the inner allocator with the
// caller's layout (grown by the header, same alignment, with `headers`),
// returns a pointer inside that block aligned as asked with at least
// `layout.size()` bytes after it, and deallocates or reallocates the inner
// block with the matching layout. The recording on the side never touches
// the program's bytes, never allocates through `self` (re-entrant calls
// pass straight through), and never unwinds.
//
// The allocating methods are never inlined: the stack walk starts at the
// method's own frame, so the first address reported is the return into its
// caller. Inlined (into `__rust_alloc`, and that into the allocating
// function, as a release build may do), the walk would start one frame too
// far out and lose the frame that allocated (`bench/check-sites` checks
// this on release builds).
unsafe impl<A: GlobalAlloc> GlobalAlloc for Agent<A> {
    #[inline(never)]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // A call (not an inline read of rbp, which the compiler may
        // schedule above a shrink-wrapped prologue): this method's frame.
        let fp = caller_frame();
        let Some(inner) = self.inner_layout(layout, layout.size()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: forwarded with the caller's guarantees (a non-zero size,
        // grown by the header if any).
        let base = unsafe { self.inner.alloc(inner) };
        // SAFETY: a block just made by the inner allocator with `inner`.
        unsafe { self.after_alloc(base, layout.align(), layout.size(), fp) }
    }

    #[inline(never)]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        let fp = caller_frame(); // see `alloc`
        let Some(inner) = self.inner_layout(layout, layout.size()) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `alloc`.
        let base = unsafe { self.inner.alloc_zeroed(inner) };
        // SAFETY: as in `alloc` (a header is not the program's zeroed
        // bytes).
        unsafe { self.after_alloc(base, layout.align(), layout.size(), fp) }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this agent with `layout` (the caller's
        // guarantee).
        let (token, base) = unsafe { self.split(ptr, layout) };
        if self.hold_back {
            // `System` on Unix deallocates every layout with `free`, so a
            // block held back now can be released later with `free` alone.
            recorder::use_release(libc::free);
            let release = recorder::on_free_deferred_direct(ptr as usize, token, base as usize);
            if release != 0 {
                // SAFETY: `release` is `base` or the inner block of one this
                // thread freed earlier and held back, allocated by `System`
                // (malloc, calloc, posix_memalign), released exactly once.
                unsafe { libc::free(release as *mut libc::c_void) }
            }
            return;
        }
        // Remove first: once freed, the address may be handed to another
        // thread, whose record must not be removed by us.
        recorder::on_free_direct(ptr as usize, token);
        // SAFETY: the inner block and the layout `alloc` made it with.
        unsafe { self.inner.dealloc(base, self.made_layout(layout)) }
    }

    #[inline(never)]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        let fp = caller_frame(); // see `alloc`
                                 // Checked before anything changes: a size the header would make
                                 // invalid fails as the inner allocator would.
        let Some(new_inner) = self.inner_layout(layout, new_size) else {
            return std::ptr::null_mut();
        };
        // SAFETY: as in `dealloc`.
        let (token, base) = unsafe { self.split(ptr, layout) };
        // Remove first (see `dealloc`).
        let old = recorder::on_free_direct(ptr as usize, token);
        // SAFETY: the inner block and the layout `alloc` made it with, and
        // a valid new size (checked above); a header moves with the bytes.
        let nb = unsafe {
            self.inner
                .realloc(base, self.made_layout(layout), new_inner.size())
        };
        if nb.is_null() {
            // The old block is still live: record it again.
            if old.is_some() {
                self.record(ptr, layout.size(), fp);
            }
            return nb;
        }
        // SAFETY: a block of the inner allocator, made with `new_inner`.
        unsafe { self.after_alloc(nb, layout.align(), new_size, fp) }
    }
}

impl<A: GlobalAlloc> Agent<A> {
    /// Bytes before each block: the header's (see [`pad_for`]), or none.
    #[inline(always)]
    fn pad(&self, align: usize) -> usize {
        if self.headers {
            pad_for(align)
        } else {
            0
        }
    }

    /// The inner allocator's layout for `size` bytes aligned as `layout`,
    /// grown by the header if any; `None` if that is no valid layout.
    #[inline(always)]
    fn inner_layout(&self, layout: Layout, size: usize) -> Option<Layout> {
        Layout::from_size_align(size.checked_add(self.pad(layout.align()))?, layout.align()).ok()
    }

    /// The inner allocator's layout of a block this agent made for
    /// `layout`.
    ///
    /// # Safety
    /// The block was made (so the grown layout was valid then, and is now).
    #[inline(always)]
    unsafe fn made_layout(&self, layout: Layout) -> Layout {
        // SAFETY: per the contract.
        unsafe {
            Layout::from_size_align_unchecked(
                layout.size() + self.pad(layout.align()),
                layout.align(),
            )
        }
    }

    /// The record's token (0 without headers) and the inner block of the
    /// agent's block `ptr`.
    ///
    /// # Safety
    /// `ptr` came from this agent with `layout`, so its header and its inner
    /// block are where `alloc` put them.
    #[inline(always)]
    unsafe fn split(&self, ptr: *mut u8, layout: Layout) -> (u64, *mut u8) {
        if self.headers {
            // SAFETY: per the contract.
            unsafe { (token_of(ptr), ptr.sub(pad_for(layout.align()))) }
        } else {
            (0, ptr)
        }
    }

    /// Records the block at `p` (writing its header with `headers`).
    #[inline(always)]
    fn record(&self, p: *mut u8, size: usize, fp: usize) {
        if self.headers {
            let token = recorder::on_alloc_direct(p as usize, size, fp, Role::GlobalAlloc);
            // SAFETY: `p` is this agent's block with a header.
            unsafe { set_token(p, token) };
        } else {
            recorder::on_alloc(p as usize, size, fp, Role::GlobalAlloc);
        }
    }

    /// The program's block of `size` bytes in the inner block `base` (null
    /// passes through), recorded (with its header written, if any).
    ///
    /// # Safety
    /// `base` is null or a block of the inner allocator made with
    /// `inner_layout` of `size` bytes aligned to `align`.
    #[inline(always)]
    unsafe fn after_alloc(&self, base: *mut u8, align: usize, size: usize, fp: usize) -> *mut u8 {
        if base.is_null() {
            return base;
        }
        // SAFETY: the pad fits in the block (its size is at least that);
        // the result is aligned as asked (base is, and the pad is 0, the
        // alignment, or 8 when that is at most 8).
        let p = unsafe { base.add(self.pad(align)) };
        self.record(p, size, fp);
        p
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_keep_their_alignment_contents_and_header_through_realloc() {
        let a = Agent::system().with_block_headers();
        for align in [1usize, 2, 8, 16, 64, 4096] {
            for size in [1usize, 7, 24, 1000, 70_000] {
                let l = Layout::from_size_align(size, align).unwrap();
                // SAFETY: non-zero size; every block is freed once with its
                // layout.
                unsafe {
                    let p = a.alloc(l);
                    assert!(!p.is_null());
                    assert_eq!(p as usize % align, 0, "{size} {align}");
                    p.write_bytes(0xab, size);
                    let z = a.alloc_zeroed(l);
                    assert!(std::slice::from_raw_parts(z, size).iter().all(|b| *b == 0));
                    a.dealloc(z, l);
                    let q = a.realloc(p, l, size * 3);
                    assert_eq!(q as usize % align, 0);
                    assert!(std::slice::from_raw_parts(q, size)
                        .iter()
                        .all(|b| *b == 0xab));
                    let l3 = Layout::from_size_align(size * 3, align).unwrap();
                    let r = a.realloc(q, l3, 1);
                    assert_eq!(*r, 0xab);
                    a.dealloc(r, Layout::from_size_align(1, align).unwrap());
                }
            }
        }
        // A size the header would push past what a layout allows fails
        // cleanly.
        let l = Layout::from_size_align(8, 8).unwrap();
        // SAFETY: as above.
        unsafe {
            let p = a.alloc(l);
            assert!(a.realloc(p, l, isize::MAX as usize).is_null());
            assert_eq!(token_of(p), token_of(p));
            a.dealloc(p, l);
        }
    }
}
