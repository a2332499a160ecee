//! Whether a thread's next allocation goes through its young ring, its
//! owner table or straight into the shared index (exact mode).
//!
//! The young ring (`heapdump_table::allocations_table`'s `young.rs`) keeps
//! a thread's last 16 blocks out of the shared index, so a block freed
//! soon by the same thread (97-98 % of redis's frees) costs no shard lock
//! and no index probe. A block that outlives the ring pays for it twice
//! instead: its ring entry, then its promotion into the index, which costs
//! more than inserting it there at once. A throwaway build without any
//! ring measured the difference per malloc+free pair (2026-11-27,
//! callgrind on `bench/churn.c`): the ring saves ~196 instructions on
//! blocks freed young and costs ~165 on blocks that outlive it (the
//! shallow loop and the churn, whose blocks all do).
//!
//! So each thread watches what its ring does, at no cost to a block that
//! dies young: only an insert that promotes an older block (still live
//! [`heapdump_table::allocations_table::YOUNG`] allocations later) is counted. At the first
//! promotion [`WINDOW`] or more allocations after a window began, the
//! window is judged: when at least 3/4 of its allocations promoted a
//! block, the thread's next allocations go straight into the index, and
//! its frees look there first; then the ring is tried again. The bypass
//! lasts [`WINDOW`] allocations, then twice as many each time the window
//! after it asks again, up to [`MAX_BYPASS`]. A service whose blocks die
//! young never leaves the ring; one whose blocks outlive it for a while
//! leaves it about as long; a thread whose blocks always live long spends
//! one window in 33 on it.
//!
//! A bypassed block goes into the thread's *owner table* (`owner_table.rs`
//! in `heapdump_table::allocations_table`: 16 384 entries hashed by
//! address, the thread's own, so its own free of the block takes no lock
//! and probes no shared index), when the thread could claim one. A block
//! that takes the entry of a still-live one evicts that one into the
//! index, as a ring promotes. The table *fails* when at least 1/4 of a
//! bypass's blocks evicted one, when it holds all it takes (8 192: the
//! thread's blocks outlive even the table, as the churn's 100 000 do), or
//! when other threads free a quarter as many of its blocks as it takes
//! (a producer's, whose frees would search every table). It is then
//! *drained* (its blocks moved into the index, so that frees skip it) and
//! the rest of the bypass and the next [`FIRST_TABLE_BACKOFF`] bypasses go
//! straight into the index; then twice as many, up to
//! [`MAX_TABLE_BACKOFF`], each time the table fails again, and back to
//! [`FIRST_TABLE_BACKOFF`] once a bypass into it succeeds.
//!
//! Invariants:
//! - The policy decides where a block is *put*, never whether it is
//!   found: a free looks in the calling thread's ring, the index and every
//!   other ring whichever mode the thread is in (only the order differs),
//!   so blocks left in the ring when the thread starts bypassing it are
//!   found and removed as before.
//! - The state is the thread's own (in `ThreadState`), plain counters in
//!   `Cell`s, no atomics. Whether the thread bypasses its ring right now
//!   is a flag beside its ring number (`recorder::BYPASSING`), so a thread
//!   that does not pays nothing on its allocations and frees: the
//!   recorder looks at this state only when an insert promotes a block
//!   ([`YoungPolicy::promoted`]) and for a bypassed allocation
//!   ([`YoungPolicy::bypassed_one`]).

use std::cell::Cell;

/// Allocations a window spans at least.
pub const WINDOW: u64 = 256;
/// Most allocations a bypass lasts (32 windows).
pub const MAX_BYPASS: u64 = 32 * WINDOW;
/// Bypasses in a row that go into the index after the first one into the
/// owner table that evicted too much (then twice as many each time, up to
/// [`MAX_TABLE_BACKOFF`]): a thread whose blocks outlived its table once
/// likely keeps them long, and a failed try costs the table's inserts and
/// draining it (up to 8 192 blocks, 2-4 M instructions on
/// `bench/churn.c`).
pub const FIRST_TABLE_BACKOFF: u64 = 16;
/// Most bypasses in a row that go into the index after one into the owner
/// table evicted too much.
pub const MAX_TABLE_BACKOFF: u64 = 128;

/// One thread's policy state (see the module doc). All zeroes: the ring
/// is used, nothing counted yet.
#[derive(Debug, Default)]
pub struct YoungPolicy {
    /// Allocations left that bypass the ring (0: the ring is used).
    bypass_left: Cell<u64>,
    /// The thread's allocation count when the current window began.
    window_start: Cell<u64>,
    /// Ring inserts in the current window that promoted an older block.
    promoted: Cell<u64>,
    /// How long the next bypass lasts, in windows (0 reads as 1).
    next_windows: Cell<u64>,
    /// How many allocations the current bypass lasts.
    bypass_len: Cell<u64>,
    /// Blocks the current bypass evicted from the owner table.
    evicted: Cell<u64>,
    /// Bypasses (the current one included) that go into the index, not
    /// the owner table.
    index_bypasses: Cell<u64>,
    /// How many the next failed bypass into the table sends there (0
    /// reads as [`FIRST_TABLE_BACKOFF`]).
    next_backoff: Cell<u64>,
    /// The bypass that just ended evicted too much: the table is to be
    /// drained.
    drain_due: Cell<bool>,
}

impl YoungPolicy {
    /// The initial state: the ring is used.
    pub const fn new() -> Self {
        YoungPolicy {
            bypass_left: Cell::new(0),
            window_start: Cell::new(0),
            promoted: Cell::new(0),
            next_windows: Cell::new(0),
            bypass_len: Cell::new(0),
            evicted: Cell::new(0),
            index_bypasses: Cell::new(0),
            next_backoff: Cell::new(0),
            drain_due: Cell::new(false),
        }
    }

    /// Forgets everything (the thread's allocation count starts again: a
    /// new generation of regions, in a forked child).
    pub fn reset(&self) {
        self.bypass_left.set(0);
        self.window_start.set(0);
        self.promoted.set(0);
        self.next_windows.set(0);
        self.bypass_len.set(0);
        self.evicted.set(0);
        self.index_bypasses.set(0);
        self.next_backoff.set(0);
        self.drain_due.set(false);
    }

    /// Whether the current bypass puts blocks into the owner table (else
    /// straight into the index).
    #[inline(always)]
    pub fn into_owner_table(&self) -> bool {
        self.index_bypasses.get() == 0
    }

    /// True once after a bypass into the owner table evicted too much:
    /// the caller drains its table.
    #[inline(always)]
    pub fn take_drain(&self) -> bool {
        self.drain_due.replace(false)
    }

    /// Counts an owner-table insert that evicted a live block.
    #[inline(always)]
    pub fn evicted_one(&self) {
        self.evicted.set(self.evicted.get() + 1);
    }

    /// Counts an allocation that bypassed the ring (call only after
    /// [`Self::promoted`] started a bypass): true when that was the
    /// bypass's last, and the ring is to be used again.
    #[inline(always)]
    pub fn bypassed_one(&self) -> bool {
        let left = self.bypass_left.get().saturating_sub(1);
        self.bypass_left.set(left);
        if left == 0 {
            self.bypass_over();
        }
        left == 0
    }

    /// The owner table holds all it takes, or other threads free its
    /// blocks: the current bypass goes into the index from now on, as after
    /// a bypass that evicted too much, and the caller drains the table now
    /// (not [`Self::take_drain`]).
    #[cold]
    #[inline(never)]
    pub fn table_full(&self) {
        self.fail_table();
        self.drain_due.set(false);
    }

    /// A bypass into the table failed: the next few go into the index.
    fn fail_table(&self) {
        let n = self.next_backoff.get().max(FIRST_TABLE_BACKOFF);
        // The current bypass, then `n` more.
        self.index_bypasses.set(n + 1);
        self.next_backoff.set((n * 2).min(MAX_TABLE_BACKOFF));
        self.drain_due.set(true);
        self.evicted.set(0);
    }

    /// Judges the bypass that just ended (see the module doc).
    #[cold]
    #[inline(never)]
    fn bypass_over(&self) {
        let index = self.index_bypasses.get();
        if index > 0 {
            self.index_bypasses.set(index - 1);
        } else if self.evicted.get().saturating_mul(4) >= self.bypass_len.get().max(1) {
            self.fail_table();
            // Only the next `n`: this one is over.
            self.index_bypasses.set(self.index_bypasses.get() - 1);
        } else {
            self.next_backoff.set(0);
        }
        self.evicted.set(0);
    }

    /// Counts a ring insert that promoted an older block, the thread's
    /// `allocs`-th allocation, and judges the window when it is over: true
    /// when the thread is to bypass its ring from now on (for the
    /// allocations [`Self::bypassed_one`] counts).
    #[inline(never)]
    #[cold]
    pub fn promoted(&self, allocs: u64) -> bool {
        let start = self.window_start.get();
        if allocs < start {
            // The window begins after a bypass that ended early (the
            // thread's bypassed allocations were not all counted), or the
            // thread's count started again: begin one now.
            self.window_start.set(allocs);
            self.promoted.set(1);
            return false;
        }
        let promoted = self.promoted.get() + 1;
        let span = allocs - start;
        if span < WINDOW {
            self.promoted.set(promoted);
            return false;
        }
        // The window is over (it may have lasted long: a promotion ends
        // it, and a thread whose blocks die young promotes rarely).
        let bypass = promoted.saturating_mul(4) >= span.saturating_mul(3);
        if bypass {
            let windows = self.next_windows.get().max(1);
            self.bypass_left.set(windows * WINDOW);
            self.bypass_len.set(windows * WINDOW);
            self.evicted.set(0);
            self.next_windows
                .set((windows * 2).min(MAX_BYPASS / WINDOW));
        } else {
            self.bypass_left.set(0);
            self.next_windows.set(1);
        }
        // The next window starts after the bypass, if any.
        self.window_start
            .set(allocs.saturating_add(self.bypass_left.get()));
        self.promoted.set(0);
        bypass
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A thread's view of the policy: whether it bypasses its ring, as the
    /// recorder keeps it (a flag beside its ring number).
    #[derive(Default)]
    struct Thread {
        p: YoungPolicy,
        bypassing: bool,
        at: u64,
    }

    impl Thread {
        /// Runs `n` allocations: while bypassing, the bypass counts them;
        /// otherwise `promotes(i)` says whether the ring insert of the
        /// i-th promoted. Returns how many bypassed.
        fn run(&mut self, n: u64, promotes: impl Fn(u64) -> bool) -> u64 {
            let mut bypassed = 0;
            for i in 0..n {
                self.at += 1;
                if self.bypassing {
                    bypassed += 1;
                    self.bypassing = !self.p.bypassed_one();
                } else if promotes(i) && self.p.promoted(self.at) {
                    self.bypassing = true;
                }
            }
            bypassed
        }

        /// Allocations until the ring is used again.
        fn finish_bypass(&mut self) -> u64 {
            let mut n = 0;
            while self.bypassing {
                self.at += 1;
                n += 1;
                self.bypassing = !self.p.bypassed_one();
            }
            n
        }
    }

    #[test]
    fn a_thread_whose_blocks_die_young_keeps_its_ring() {
        let mut t = Thread::default();
        // Two blocks in three die young: never a bypass.
        assert_eq!(t.run(100_000, |i| i % 3 == 0), 0);
        // None promoted: nothing counted at all.
        assert_eq!(t.run(100_000, |_| false), 0);
    }

    #[test]
    fn a_thread_whose_blocks_outlive_the_ring_bypasses_it_longer_and_longer() {
        let mut t = Thread::default();
        let mut lengths = vec![];
        for _ in 0..8 {
            // Ring windows of long-lived blocks until a bypass begins.
            let mut n = t.run(WINDOW + 1, |_| true);
            n += t.finish_bypass();
            lengths.push(n / WINDOW);
        }
        assert_eq!(lengths, [1, 2, 4, 8, 16, 32, 32, 32]);
        // A while of young blocks, then long-lived ones again: one window.
        t.run(10 * WINDOW, |i| i % 5 == 0);
        assert!(!t.bypassing);
        let n = t.run(2 * WINDOW, |_| true) + t.finish_bypass();
        assert_eq!(n, WINDOW);
    }

    #[test]
    fn a_count_that_starts_again_begins_a_new_window_without_overflow() {
        let mut t = Thread::default();
        t.run(WINDOW + 1, |_| true);
        assert!(t.bypassing);
        // The thread's count starts again (a forked child's generation)
        // while a window is set to begin far ahead, or long after one
        // began: no overflow, and windows are judged as before.
        t.bypassing = false;
        t.at = 0;
        assert_eq!(t.run(10, |_| true), 0);
        t.at = u64::MAX - 5 * WINDOW;
        // The first promotion ends the window that began at 1 (no bypass:
        // 11 promotions in all that span); the next window asks for one.
        t.run(WINDOW + WINDOW / 2, |_| true);
        assert!(t.bypassing, "a window of long-lived blocks is judged");
        let p = YoungPolicy::new();
        assert!(!p.promoted(u64::MAX));
        p.reset();
        assert_eq!(p.window_start.get(), 0);
    }

    #[test]
    fn in_steady_long_lived_work_one_window_in_33_is_on_the_ring() {
        let mut t = Thread::default();
        let total = 1_000 * WINDOW;
        let on_ring = total - t.run(total, |_| true);
        assert!(
            on_ring * 33 <= total * 12 / 10,
            "{on_ring} of {total} on the ring"
        );
    }

    /// Runs one whole bypass (from a window that asks for it) into the
    /// table or the index, as the recorder does; `evicts(i)` says whether
    /// the i-th insert into the table evicted. Returns whether the bypass
    /// went into the table.
    fn bypass(t: &mut Thread, evicts: impl Fn(u64) -> bool) -> bool {
        t.run(WINDOW + 1, |_| true);
        assert!(t.bypassing);
        let into_table = t.p.into_owner_table();
        let mut i = 0;
        while t.bypassing {
            if t.p.into_owner_table() && evicts(i) {
                t.p.evicted_one();
            }
            i += 1;
            t.at += 1;
            t.bypassing = !t.p.bypassed_one();
        }
        into_table
    }

    #[test]
    fn a_table_whose_blocks_die_in_it_takes_every_bypass() {
        let mut t = Thread::default();
        for _ in 0..40 {
            // One insert in 20 evicts: well under a quarter.
            assert!(bypass(&mut t, |i| i % 20 == 0));
            assert!(!t.p.take_drain());
        }
    }

    #[test]
    fn a_failing_table_is_drained_and_skipped_for_longer_and_longer() {
        let mut t = Thread::default();
        // Every insert into the table evicts: each try fails.
        assert!(bypass(&mut t, |_| true));
        let mut runs = vec![];
        for _ in 0..7 {
            assert!(t.p.take_drain(), "a failed bypass drains the table");
            assert!(!t.p.take_drain(), "once");
            let mut skipped = 0;
            while !bypass(&mut t, |_| true) {
                skipped += 1;
            }
            runs.push(skipped);
        }
        assert_eq!(runs, [16, 32, 64, 128, 128, 128, 128]);
        // A bypass into the table that succeeds resets the backoff.
        let mut t = Thread::default();
        assert!(bypass(&mut t, |_| true));
        assert!(t.p.take_drain());
        let mut skipped = 0;
        while !bypass(&mut t, |_| false) {
            skipped += 1;
        }
        assert_eq!(skipped, FIRST_TABLE_BACKOFF);
        assert!(!t.p.take_drain());
        assert!(bypass(&mut t, |i| i % 2 == 0));
        let mut skipped = 0;
        while !bypass(&mut t, |_| false) {
            skipped += 1;
        }
        assert_eq!(skipped, FIRST_TABLE_BACKOFF, "back to the first backoff");
    }

    #[test]
    fn a_full_table_sends_the_rest_of_its_bypass_to_the_index() {
        let mut t = Thread::default();
        // Full at the 100th insert: the recorder drains at once (no
        // drain left due), the rest of the bypass goes to the index.
        t.run(WINDOW + 1, |_| true);
        let mut into_table = 0;
        let mut i = 0;
        while t.bypassing {
            if t.p.into_owner_table() {
                into_table += 1;
                if i == 100 {
                    t.p.table_full();
                }
            }
            i += 1;
            t.at += 1;
            t.bypassing = !t.p.bypassed_one();
        }
        assert_eq!(into_table, 101);
        assert!(!t.p.take_drain());
        let mut skipped = 0;
        while !bypass(&mut t, |_| false) {
            skipped += 1;
        }
        assert_eq!(skipped, FIRST_TABLE_BACKOFF);
    }
}
