//! A small static arena that serves allocations made while the next
//! allocator's entry points are being bound (`dlsym` and `dlerror` allocate,
//! and so may the loader or another thread racing into its first `malloc`).
//!
//! Invariants:
//! - Space is taken by an atomic bump of `NEXT`; it is never reused, so a
//!   block handed out stays valid (and its size readable) for the life of
//!   the process. `free` of an arena block does nothing.
//! - Each block is preceded by an 8-byte word holding its size, at
//!   `block - 8`, inside the arena: `usable_size` reads it back.
//! - [`contains`] is a pure address-range test: every entry point that takes
//!   a pointer (`free`, `realloc`, C++ `delete`, the jemalloc calls) asks
//!   it, or the sampled-address filter (below), before
//!   handing a block to the next allocator, which did not make arena blocks.
//! - Every block is marked in the sampled-address filter
//!   (`heapdump_agent::sampling::note_recorded`) before it is handed out
//!   and never unmarked, so the filter always answers "maybe" for it: the
//!   sampled-mode fast paths of `free` and `realloc`, which skip the range
//!   test, send it to their slow path.
//! - `malloc_usable_size` is not interposed (see `malloc_family`), so it
//!   must never be asked about an arena block. It is not: arena blocks go
//!   to what allocates inside the binding's `dlsym` (the loader's and
//!   libc's own buffers). The one way a program could get one, a thread
//!   allocating while another binds, needs two threads before the first
//!   allocation of the process has returned, and glibc's
//!   `pthread_create` allocates (the new thread's TLS vector).
//! - When the arena is exhausted `alloc` returns null (an allocation failure
//!   the caller reports as such); binding needs a few hundred bytes, the
//!   arena holds 256 KiB.

use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicUsize, Ordering};

const ARENA_BYTES: usize = 256 << 10;

#[repr(C, align(4096))]
struct Arena(UnsafeCell<[u8; ARENA_BYTES]>);

// SAFETY: disjoint ranges of the array are handed to callers by an atomic
// bump (each byte belongs to at most one block), and the arena itself never
// reads or writes a block after handing it out, except the size word before
// it, which is written once before the block is returned.
unsafe impl Sync for Arena {}

static ARENA: Arena = Arena(UnsafeCell::new([0; ARENA_BYTES]));
/// Offset of the first free byte.
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn base() -> usize {
    ARENA.0.get() as usize
}

/// True if `p` is a block of the arena.
#[inline]
pub fn contains(p: usize) -> bool {
    p.wrapping_sub(base()) < ARENA_BYTES
}

/// A block of `size` bytes aligned to `align` (a power of two, at most a
/// page), zero-filled (the arena starts zeroed and is never reused), or
/// null when the arena is exhausted.
pub fn alloc(size: usize, align: usize) -> *mut u8 {
    let align = align.clamp(16, 4096);
    let mut cur = NEXT.load(Ordering::Relaxed);
    loop {
        // The block starts at the first `align` boundary leaving 8 bytes
        // for the size word.
        let start = (base() + cur + 8).next_multiple_of(align) - base();
        let Some(end) = start.checked_add(size.max(1)) else {
            return std::ptr::null_mut();
        };
        if end > ARENA_BYTES {
            return std::ptr::null_mut();
        }
        // Relaxed: the bump only needs atomicity (disjoint ranges); the
        // block's bytes are published to other threads by whatever the
        // program uses to share the pointer.
        match NEXT.compare_exchange_weak(cur, end, Ordering::Relaxed, Ordering::Relaxed) {
            Ok(_) => {
                let p = (base() + start) as *mut u8;
                // SAFETY: [start - 8, end) lies inside the arena and belongs
                // to this block alone (won by the CAS above); the size word
                // is 8-aligned because `start` is 16-aligned.
                unsafe { p.sub(8).cast::<usize>().write(size) };
                heapdump_agent::sampling::note_recorded(p as usize);
                return p;
            }
            Err(now) => cur = now,
        }
    }
}

/// The size asked for when arena block `p` was made.
pub fn usable_size(p: usize) -> usize {
    debug_assert!(contains(p));
    // SAFETY: `p` is an arena block (the caller checked with `contains`),
    // so its size word at `p - 8` was written before `p` was handed out.
    unsafe { ((p - 8) as *const usize).read() }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_are_aligned_disjoint_recognised_and_know_their_size() {
        let a = alloc(10, 1) as usize;
        let b = alloc(100, 64) as usize;
        let c = alloc(0, 4096) as usize;
        assert!(contains(a) && contains(b) && contains(c));
        assert_eq!((a % 16, b % 64, c % 4096), (0, 0, 0));
        assert!(b >= a + 10 && c >= b + 100);
        assert_eq!(
            (usable_size(a), usable_size(b), usable_size(c)),
            (10, 100, 0)
        );
        assert!(!contains(base() + ARENA_BYTES) && !contains(base().wrapping_sub(1)));
        let local = 0u8;
        assert!(!contains(&local as *const u8 as usize));
    }

    #[test]
    fn an_exhausted_arena_returns_null() {
        assert!(alloc(ARENA_BYTES, 16).is_null());
        assert!(alloc(usize::MAX - 64, 16).is_null());
    }
}
