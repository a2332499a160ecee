//! The per-shard address index: an open-addressed table of `u32` slots
//! (`tag << 27 | node + 1`, linear probing, tombstones) in one of two
//! windows per shard, grown and shrunk by rehashing into the other window.
//!
//! Invariants:
//! - Touched only by writers, under the shard's lock; readers never read
//!   an index.
//! - Each window keeps at least one empty slot, so every probe sequence
//!   ends; probes are also bounded by the window's capacity.
//! - A removal leaves a tombstone only when a probe sequence may run
//!   through the slot; a rehash returns the old window's pages beyond its
//!   first (`MADV_REMOVE`), so index memory follows the live count.

use super::*;

#[inline]
pub(super) fn hash(addr: u64) -> u64 {
    // A strong 64-bit mixer (splitmix64 finaliser): malloc addresses share
    // their low bits, and all of the hash's bits are used.
    let mut z = addr;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// Asks the CPU to start loading the cache line at `p` (a hint: it never
/// faults, whatever `p` is).
#[inline(always)]
pub fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: PREFETCHT0 is a hint that cannot fault or change memory, for
    // any address; SSE is part of the x86_64 baseline.
    unsafe {
        core::arch::x86_64::_mm_prefetch(p as *const i8, core::arch::x86_64::_MM_HINT_T0);
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// What [`AllocationsWriter::prefetch`] computed for an address, for the
/// insert that follows.
#[derive(Clone, Copy, Debug)]
pub struct Prefetched {
    pub(super) address: u64,
    pub(super) hash: u64,
}

impl AllocationsWriter<'_> {
    #[inline]
    pub(super) fn slot(&self, shard: u64, window: u32, i: u64) -> &AtomicU32 {
        let w = shard * 2 + u64::from(window);
        self.u32_at(self.layout.index_off + (w * self.layout.slots_max + i) * 4)
    }

    pub(super) fn tag(h: u64) -> u32 {
        ((h >> 32) & 0x1f) as u32
    }

    /// Probes for `addr`; returns (slot index, node) if found. Inlined
    /// into the remove path (a call here cost the free path ~10% of its
    /// instructions when the remove path grew and the compiler stopped
    /// inlining it: callgrind on bench/churn).
    #[inline(always)]
    pub(super) fn find(
        &self,
        shard: u64,
        window: u32,
        cap: u64,
        h: u64,
        addr: u64,
    ) -> Option<(u64, u32)> {
        let mask = cap - 1;
        let tag = Self::tag(h);
        let mut i = h & mask;
        for _ in 0..cap {
            let s = self.slot(shard, window, i).load(Ordering::Relaxed);
            if s == EMPTY {
                return None;
            }
            if s != TOMBSTONE && s >> NODE_BITS == tag {
                let node = (s & NODE_MASK).wrapping_sub(1);
                if self.node_addr(node) == addr {
                    return Some((i, node));
                }
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// Probes for `addr`: `Err` if it is present, else the first empty or
    /// tombstone slot on its probe path (`None` only if there is none).
    #[inline]
    pub(super) fn probe_for_insert(
        &self,
        shard: u64,
        window: u32,
        cap: u64,
        h: u64,
        addr: u64,
    ) -> Result<Option<u64>, ()> {
        let mask = cap - 1;
        let tag = Self::tag(h);
        let mut i = h & mask;
        let mut first_tomb = None;
        for _ in 0..cap {
            let s = self.slot(shard, window, i).load(Ordering::Relaxed);
            if s == EMPTY {
                return Ok(Some(first_tomb.unwrap_or(i)));
            }
            if s == TOMBSTONE {
                first_tomb.get_or_insert(i);
            } else if s >> NODE_BITS == tag && self.node_addr((s & NODE_MASK) - 1) == addr {
                return Err(());
            }
            i = (i + 1) & mask;
        }
        Ok(first_tomb)
    }

    /// First empty or tombstone slot for `h` (the caller ensured one exists).
    pub(super) fn free_slot(&self, shard: u64, window: u32, cap: u64, h: u64) -> Option<u64> {
        let mask = cap - 1;
        let mut i = h & mask;
        for _ in 0..cap {
            let s = self.slot(shard, window, i).load(Ordering::Relaxed);
            if s == EMPTY || s == TOMBSTONE {
                return Some(i);
            }
            i = (i + 1) & mask;
        }
        None
    }

    /// The shard's index capacity (log2). Clamped to the window size: the
    /// writer's offsets are unchecked, so a shard word scribbled over by a
    /// wild write in the program must not send a probe outside its window.
    #[inline(always)]
    pub(super) fn cap_log2(&self, shard: u64) -> u32 {
        // `max` then `min`, not `clamp`: the same bound without clamp's
        // check that its limits are ordered (a compare and a panic path
        // on every insert and remove); the `min` last keeps the result
        // within the window whatever the limits are.
        self.shard_field(shard, S_CAP_LOG2)
            .load(Ordering::Relaxed)
            .max(MIN_CAP_LOG2)
            .min(self.max_cap_log2)
    }

    /// Hints the CPU to fetch the index slot where `addr` would start its
    /// probe, so a following [`Self::insert`] or [`Self::remove`] finds it
    /// in cache. Reads two shard words without the lock (a racing rehash
    /// only makes the hint useless, never unsafe: the slot offset stays
    /// inside the shard's windows) and never writes.
    #[inline]
    ///
    /// Returns the address's hash, so the insert that follows
    /// ([`Self::insert_cached_prefetched`]) does not compute it again.
    pub fn prefetch(&self, addr: u64) -> Prefetched {
        let h = hash(addr);
        let shard = self.home_shard(addr, h);
        let cap = 1u64 << self.cap_log2(shard);
        let slot = self.slot(shard, self.window(shard), h & (cap - 1));
        prefetch_line(slot as *const AtomicU32 as *const u8);
        Prefetched {
            address: addr,
            hash: h,
        }
    }

    /// The shard's current index window (0 or 1, whatever the word holds).
    #[inline]
    pub(super) fn window(&self, shard: u64) -> u32 {
        self.shard_field(shard, S_WINDOW).load(Ordering::Relaxed) & 1
    }

    /// Rehashes `shard` into its other window with room for `need` entries.
    /// Caller holds the lock. Returns false if `need` cannot fit.
    #[cold]
    #[inline(never)]
    pub(super) fn rehash(&self, shard: u64, need: u64) -> bool {
        let old_cap = 1u64 << self.cap_log2(shard);
        let old_win = self.window(shard);
        let mut new_cap = (need * 3)
            .div_ceil(2)
            .next_power_of_two()
            .max(1 << MIN_CAP_LOG2);
        if new_cap > self.layout.slots_max {
            new_cap = self.layout.slots_max;
        }
        // Hard limit 7/8 so probes stay short and one slot stays empty.
        if need * 8 > new_cap * 7 {
            return false;
        }
        let new_win = old_win ^ 1;
        for i in 0..new_cap {
            self.slot(shard, new_win, i).store(EMPTY, Ordering::Relaxed);
        }
        let mask = new_cap - 1;
        for i in 0..old_cap {
            let s = self.slot(shard, old_win, i).load(Ordering::Relaxed);
            if s == EMPTY || s == TOMBSTONE {
                continue;
            }
            let node = (s & NODE_MASK).wrapping_sub(1);
            let mut j = hash(self.node_addr(node)) & mask;
            while self.slot(shard, new_win, j).load(Ordering::Relaxed) != EMPTY {
                j = (j + 1) & mask;
            }
            self.slot(shard, new_win, j).store(s, Ordering::Relaxed);
        }
        self.shard_field(shard, S_WINDOW)
            .store(new_win, Ordering::Relaxed);
        self.shard_field(shard, S_CAP_LOG2)
            .store(new_cap.trailing_zeros(), Ordering::Relaxed);
        self.shard_field(shard, S_TOMBS).store(0, Ordering::Relaxed);
        // Return the old window's pages to the system, except the first
        // (see MIN_CAP_LOG2).
        let win_off =
            self.layout.index_off + (shard * 2 + u64::from(old_win)) * self.layout.slots_max * 4;
        let used = page_up(old_cap * 4);
        if used > 4096 {
            self.region.release_range(win_off + 4096, used - 4096);
        }
        true
    }

    /// Empties slot `i` of a linear-probing window. If the next slot is
    /// empty, no probe sequence runs through `i`, so it becomes empty
    /// rather than a tombstone, and so do the tombstones just before it.
    /// This keeps tombstones (and the rehashes that clear them, which read
    /// every live node) rare. Caller holds the lock.
    #[inline(always)]
    pub(super) fn clear_slot(&self, shard: u64, win: u32, cap: u64, i: u64) {
        let mask = cap - 1;
        if self
            .slot(shard, win, (i + 1) & mask)
            .load(Ordering::Relaxed)
            != EMPTY
        {
            self.slot(shard, win, i).store(TOMBSTONE, Ordering::Relaxed);
            self.bump_locked(shard, S_TOMBS, u32::wrapping_add);
            return;
        }
        self.slot(shard, win, i).store(EMPTY, Ordering::Relaxed);
        let tombs = self.shard_field(shard, S_TOMBS);
        let mut j = i;
        // Bounded: at most `cap` steps, and the window always has an empty
        // slot that is not a tombstone.
        for _ in 0..cap {
            j = j.wrapping_sub(1) & mask;
            let s = self.slot(shard, win, j);
            if s.load(Ordering::Relaxed) != TOMBSTONE {
                break;
            }
            s.store(EMPTY, Ordering::Relaxed);
            tombs.store(
                tombs.load(Ordering::Relaxed).wrapping_sub(1),
                Ordering::Relaxed,
            );
        }
    }

    /// Entries of the shard's index: its live blocks less the direct ones.
    /// Caller holds the lock.
    #[inline]
    pub(super) fn index_len(&self, shard: u64) -> u64 {
        let len = self.shard_field(shard, S_LEN).load(Ordering::Relaxed);
        let direct = self.shard_field(shard, S_DIRECT).load(Ordering::Relaxed);
        u64::from(len.saturating_sub(direct))
    }
}
