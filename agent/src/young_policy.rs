//! Whether a thread's next allocation goes through its young ring or
//! straight into the shared index (exact mode).
//!
//! The young ring (`heapdump_table::allocations_table`'s `young.rs`) keeps
//! a thread's last 16 blocks out of the shared index, so a block freed
//! soon by the same thread (97-98 % of redis's frees) costs no shard lock
//! and no index probe. A block that outlives the ring pays for it twice
//! instead: its ring entry, then its promotion into the index, which costs
//! more than inserting it there at once. `bench/instructions` measured the
//! difference per malloc+free pair (2026-11-27, valgrind): the ring saves
//! ~196 instructions on blocks freed young and costs ~165 on blocks that
//! outlive it (the shallow loop and the churn, whose blocks all do).
//!
//! So each thread watches what its ring does: over a window of
//! [`WINDOW`] allocations it counts the ring inserts that had to promote
//! the entry's previous block (still live [`heapdump_table::YOUNG`]
//! allocations later). When at least [`BYPASS_AT`] of them did, the
//! thread's next [`BYPASS_WINDOWS`] windows go straight into the index,
//! and its frees look there first; then the ring is tried again for a
//! window. A service whose blocks die young never leaves the ring; a
//! thread whose blocks live long spends one window in 33 on it.
//!
//! Invariants:
//! - The policy decides where a block is *put*, never whether it is
//!   found: a free looks in the calling thread's ring, the index and every
//!   other ring whichever mode the thread is in (only the order differs),
//!   so blocks left in the ring when the thread starts bypassing it are
//!   found and removed as before.
//! - The state is the thread's own (in `ThreadState`), plain counters in
//!   `Cell`s, no atomics.

use std::cell::Cell;

/// Allocations per measuring window (a thread's allocations are counted
/// in `ThreadState::allocs`; a window ends at each multiple).
pub const WINDOW: u64 = 256;
/// Promotions in a window from which the thread bypasses the ring (3/4:
/// the ring pays off from about half of its blocks dying young).
pub const BYPASS_AT: u32 = 192;
/// Windows that bypass the ring after one that asked for it.
pub const BYPASS_WINDOWS: u32 = 32;

/// One thread's policy state (see the module doc). All zeroes: the ring
/// is used, nothing counted yet.
#[derive(Debug, Default)]
pub struct YoungPolicy {
    /// Windows left that bypass the ring (0: the ring is used).
    bypass_windows: Cell<u32>,
    /// Ring inserts in the current window that promoted an older block.
    promoted: Cell<u32>,
}

impl YoungPolicy {
    /// The initial state: the ring is used.
    pub const fn new() -> Self {
        YoungPolicy {
            bypass_windows: Cell::new(0),
            promoted: Cell::new(0),
        }
    }

    /// Whether the ring is bypassed now (the thread's frees then look in
    /// the index first).
    #[inline(always)]
    pub fn bypassing(&self) -> bool {
        self.bypass_windows.get() != 0
    }

    /// Counts a ring insert; `promoted`: it moved the entry's previous
    /// block into the index.
    #[inline(always)]
    pub fn after_insert(&self, promoted: bool) {
        self.promoted.set(self.promoted.get() + u32::from(promoted));
    }

    /// Ends a window of [`WINDOW`] allocations: the next one bypasses the
    /// ring when this one's ring inserts promoted at least [`BYPASS_AT`]
    /// blocks, or when it is one of the [`BYPASS_WINDOWS`] after such a
    /// window.
    #[inline(never)]
    #[cold]
    pub fn window_end(&self) {
        let left = self.bypass_windows.get();
        if left != 0 {
            self.bypass_windows.set(left - 1);
        } else if self.promoted.get() >= BYPASS_AT {
            self.bypass_windows.set(BYPASS_WINDOWS);
        }
        self.promoted.set(0);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A window of ring inserts, `promoted` of which promoted a block.
    fn window(p: &YoungPolicy, promoted: u32) {
        assert!(!p.bypassing(), "a window of ring inserts");
        for i in 0..WINDOW as u32 {
            p.after_insert(i < promoted);
        }
        p.window_end();
    }

    #[test]
    fn a_thread_whose_blocks_die_young_keeps_its_ring() {
        let p = YoungPolicy::new();
        for _ in 0..100 {
            window(&p, BYPASS_AT - 1);
            assert!(!p.bypassing());
        }
        assert_eq!(p.promoted.get(), 0);
    }

    #[test]
    fn a_thread_whose_blocks_outlive_the_ring_bypasses_it_then_measures_again() {
        let p = YoungPolicy::new();
        window(&p, BYPASS_AT);
        for _ in 0..BYPASS_WINDOWS {
            assert!(p.bypassing());
            p.window_end();
        }
        assert!(!p.bypassing(), "the ring is tried again");
        // A window of young blocks keeps it.
        window(&p, 0);
        assert!(!p.bypassing());
        // One of long-lived blocks leaves it again.
        window(&p, WINDOW as u32);
        assert!(p.bypassing());
    }
}
