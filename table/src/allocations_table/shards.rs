//! Shards: which shard an address belongs to (its 64 MiB group, then a
//! hash), the writers' spin lock, spilling into another shard when a
//! shard's index is full, and the per-shard counters readers sum.
//!
//! Invariants:
//! - A shard's lock is taken by writers only, with Acquire, and released
//!   with Release ([`ShardGuard`]): everything written under it is seen by
//!   the next writer. Readers never touch it.
//! - `S_SPILLED` is set under the home shard's lock and never cleared: a
//!   lookup that misses in a spilled shard also looks in its spill shard.
//! - The counters are written under the lock with plain stores and read
//!   racily by readers ([`add_shard_counters`]), which sum them: bounded by
//!   the shard count.

use super::*;

pub(super) struct ShardGuard<'w> {
    lock: &'w AtomicU32,
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        // Release: everything written under the lock is visible to the
        // next writer that acquires it.
        self.lock.store(0, Ordering::Release);
    }
}

impl AllocationsWriter<'_> {
    /// The shard a block at `addr` (hash `h`) lives in: a group chosen by
    /// the address's 64 MiB range, a shard in the group by the hash.
    #[inline]
    pub(super) fn home_shard(&self, addr: u64, h: u64) -> u64 {
        let sub = (h >> 48) & self.sub_mask;
        if self.group_bits == 0 {
            return sub;
        }
        // The top bits of a product: consecutive ranges land in unrelated
        // groups.
        let group =
            (addr >> GROUP_SHIFT).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - self.group_bits);
        group << self.sub_bits | sub
    }

    /// Where a block goes when its home shard has no index room: a shard
    /// chosen by the hash alone, so one crowded address range spreads over
    /// the whole table, but never in the home shard's own group (which is
    /// the crowded one).
    #[inline]
    pub(super) fn spill_shard(&self, addr: u64, h: u64) -> u64 {
        let spill = (h >> 48) & self.shard_mask;
        if self.group_bits == 0 {
            return spill;
        }
        let home_group = self.home_shard(addr, h) >> self.sub_bits;
        if spill >> self.sub_bits == home_group {
            spill ^ 1 << self.sub_bits
        } else {
            spill
        }
    }

    /// How many shards ever spilled blocks into other shard groups (an
    /// address range held more blocks than its group's indexes could).
    pub fn spilled_shards(&self) -> u64 {
        (0..self.layout.shards).filter(|s| self.spilled(*s)).count() as u64
    }

    /// True when `shard` ever spilled (see `S_SPILLED`). Relaxed: it is set
    /// under the shard's lock before the spilled block is inserted, and a
    /// lookup of that block happens after its insert.
    #[inline]
    pub(super) fn spilled(&self, shard: u64) -> bool {
        self.shard_field(shard, S_SPILLED).load(Ordering::Relaxed) != 0
    }

    #[inline]
    pub(super) fn shard_field(&self, shard: u64, field: u64) -> &AtomicU32 {
        self.u32_at(self.layout.shards_off + shard * SHARD_SIZE + field)
    }

    /// Adds 1 to (or subtracts 1 from) a u32 shard field and returns the new
    /// value. Caller holds the shard lock, so a load and a store suffice
    /// (no locked instruction).
    #[inline]
    pub(super) fn bump_locked(&self, shard: u64, field: u64, op: fn(u32, u32) -> u32) -> u32 {
        let f = self.shard_field(shard, field);
        let v = op(f.load(Ordering::Relaxed), 1);
        f.store(v, Ordering::Relaxed);
        v
    }

    /// Counts one allocation of `size` bytes in the shard's cumulative
    /// counters. Caller holds the shard lock.
    #[inline]
    pub(super) fn count_alloc_locked(&self, shard: u64, size: u64) {
        let base = self.layout.shards_off + shard * SHARD_SIZE;
        let n = self.u64_at(base + S_TOTAL_ALLOCS);
        n.store(n.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
        let b = self.u64_at(base + S_TOTAL_BYTES);
        b.store(
            b.load(Ordering::Relaxed).wrapping_add(size),
            Ordering::Relaxed,
        );
    }

    /// The process-wide counters as a reader would see them (header words
    /// plus the per-shard sums).
    pub fn stats(&self) -> Counters {
        read_counters(&self.view)
    }

    #[inline]
    pub(super) fn lock(&self, shard: u64) -> ShardGuard<'_> {
        let lock = self.shard_field(shard, S_LOCK);
        // Uncontended fast path: one CAS (a load first would fetch the line
        // shared, then need a second transaction to own it).
        // Acquire pairs with the Release in ShardGuard::drop.
        if lock
            .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
        {
            return ShardGuard { lock };
        }
        Self::lock_contended(lock)
    }

    /// The lock's slow path, out of line so the fast path stays small.
    #[cold]
    #[inline(never)]
    pub(super) fn lock_contended(lock: &AtomicU32) -> ShardGuard<'_> {
        let mut spins = 0u32;
        loop {
            if lock.load(Ordering::Relaxed) == 0
                && lock
                    .compare_exchange_weak(0, 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return ShardGuard { lock };
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                // The holder may be descheduled: give it the CPU. No
                // allocation, so safe inside malloc.
                std::thread::yield_now();
            }
        }
    }

    /// Whether `addr` is recorded in the spill shard of `home` (out of
    /// line: only shards that ever spilled get here).
    #[cold]
    #[inline(never)]
    pub(super) fn in_spill_shard(&self, home: u64, h: u64, addr: u64) -> bool {
        let spill = self.spill_shard(addr, h);
        if spill == home {
            return false;
        }
        let _g = self.lock(spill);
        let cap = 1u64 << self.cap_log2(spill);
        self.find(spill, self.window(spill), cap, h, addr).is_some()
    }

    /// Inserts into the spill shard a block whose home shard `home` has no
    /// index room, marking `home` as spilled first (out of line: rare).
    #[cold]
    #[inline(never)]
    pub(super) fn insert_spilled(
        &self,
        home: u64,
        h: u64,
        (t32, w1, w2, w3): (u32, u64, u64, u64),
        pre: Option<u32>,
    ) -> Result<(), Locked> {
        let spill = self.spill_shard(w1, h);
        if spill == home {
            return Err(Locked::IndexFull);
        }
        // Marked before the block goes there, under the home lock, so any
        // later lookup of the block sees the mark.
        {
            let _g = self.lock(home);
            self.shard_field(home, S_SPILLED)
                .store(1, Ordering::Relaxed);
        }
        let _g = self.lock(spill);
        let r = self.insert_locked(spill, h, t32, w1, w2, w3, pre);
        if r.is_ok() {
            let size = w2 & SIZE_MASK;
            self.count_alloc_locked(spill, size);
            self.add_live_locked(spill, size, 0);
        }
        r
    }

    /// Removes `addr` from the spill shard of `home` (out of line: only
    /// misses in shards that ever spilled get here).
    #[cold]
    #[inline(never)]
    pub(super) fn remove_spilled(
        &self,
        home: u64,
        h: u64,
        addr: u64,
        keep: bool,
    ) -> Option<(Freed, Option<u32>)> {
        let spill = self.spill_shard(addr, h);
        if spill == home {
            return None;
        }
        let _g = self.lock(spill);
        self.remove_locked(spill, h, addr, keep)
    }

    /// Adjusts the shard's live bytes. Caller holds the shard lock.
    #[inline]
    pub(super) fn add_live_locked(&self, shard: u64, add: u64, sub: u64) {
        let f = self.u64_at(self.layout.shards_off + shard * SHARD_SIZE + S_LIVE_BYTES);
        f.store(
            f.load(Ordering::Relaxed)
                .wrapping_add(add)
                .wrapping_sub(sub),
            Ordering::Relaxed,
        );
    }

    /// Adds to the header's running live total and, in exact mode, moves
    /// the peak when live bytes pass it (`crate::peak`) and offers the
    /// memory curve a point when one is due (`crate::timeline`): a coarse
    /// clock read and a few loads; the counters are summed only for a
    /// point or a peak that is taken. In sampled mode the agent feeds both
    /// its estimates instead.
    #[inline]
    pub(super) fn fold_live(&self, add: u64, sub: u64) {
        let live = self.counters.live_bytes_changed(add, sub);
        if live > i64::MAX as u64 || self.view.load_u64(offsets::SAMPLE_RATE).unwrap_or(0) != 0 {
            return;
        }
        let curve_due = |now| crate::timeline::due(&self.view, now, live);
        let peak_due = crate::peak::due(&self.view, live);
        let now = crate::region::clock_ns(libc::CLOCK_MONOTONIC_COARSE);
        if !peak_due && !curve_due(now) {
            return;
        }
        let c = crate::header::read_counters(&self.view);
        if peak_due {
            // Record times are microseconds since the clock base, read
            // from the same coarse clock (see the agent's recorder).
            let base = self.region.header().clock_monotonic_ns;
            crate::peak::offer(
                &self.view,
                now.saturating_sub(base) / 1000,
                live,
                c.live_blocks,
            );
        }
        if curve_due(now) {
            crate::timeline::append(
                &self.view,
                crate::timeline::Point {
                    time_ns: now,
                    live_bytes: c.live_bytes,
                    live_blocks: c.live_blocks,
                    alloc_bytes: c.total_bytes,
                },
            );
        }
    }

    /// Folds a live-bytes change into the header's running total: at once
    /// without a cache, in batches of [`LIVE_BATCH`] with one.
    #[inline(always)]
    pub(super) fn live_changed(&self, cache: Option<&mut NodeCache>, delta: i64) {
        match cache {
            None => self.fold_live_delta(delta),
            Some(c) => {
                c.pending_live = c.pending_live.wrapping_add(delta);
                if c.pending_live >= LIVE_BATCH || c.pending_live <= -LIVE_BATCH {
                    let p = std::mem::take(&mut c.pending_live);
                    self.fold_live_delta(p);
                }
            }
        }
    }

    /// [`Self::fold_live`] of a signed change (out of line: the batched
    /// path above reaches it once per [`LIVE_BATCH`] bytes).
    #[inline(never)]
    fn fold_live_delta(&self, delta: i64) {
        if delta >= 0 {
            self.fold_live(delta as u64, 0)
        } else {
            self.fold_live(0, delta.unsigned_abs())
        }
    }
}

/// Adds the per-shard counters of an allocations region (live blocks,
/// total allocations and bytes), and its writer lines', to `c`. Does
/// nothing when the header or layout does not validate. Bounded by the
/// shard and line counts (at most 2^16 each).
pub(crate) fn add_shard_counters(view: &SharedView, c: &mut Counters) {
    let Ok(h) = parse_header(view, RegionKind::Allocations) else {
        return;
    };
    let Ok(l) = Layout::from_header(&h.layout, h.region_size) else {
        return;
    };
    let (mut blocks, mut allocs, mut bytes, mut live) = (0u64, 0u64, 0u64, 0u64);
    for s in 0..l.shards {
        let base = l.shards_off + s * SHARD_SIZE;
        blocks = blocks.wrapping_add(u64::from(view.load_u32(base + S_LEN).unwrap_or(0)));
        allocs = allocs.wrapping_add(view.load_u64(base + S_TOTAL_ALLOCS).unwrap_or(0));
        bytes = bytes.wrapping_add(view.load_u64(base + S_TOTAL_BYTES).unwrap_or(0));
        live = live.wrapping_add(view.load_u64(base + S_LIVE_BYTES).unwrap_or(0));
    }
    // Young blocks are counted in the writer lines (see `young.rs`): what
    // each line allocated less what it freed (or moved to a shard) is live.
    // Only the lines rings have used (line 0 says which), at most all.
    let used = match l.lines {
        0 => 0,
        n => view
            .load_u64(l.lines_off + L_USED)
            .unwrap_or(u64::MAX)
            .saturating_add(1)
            .min(n),
    };
    for k in 0..used {
        let base = l.lines_off + k * LINE_SIZE;
        let ld = |f| view.load_u64(base + f).unwrap_or(0);
        let (n, b) = (ld(L_ALLOCS), ld(L_BYTES));
        allocs = allocs.wrapping_add(n);
        bytes = bytes.wrapping_add(b);
        blocks = blocks.wrapping_add(n.wrapping_sub(ld(L_FREES)));
        live = live.wrapping_add(b.wrapping_sub(ld(L_FREED_BYTES)));
    }
    // Exact live bytes are the shard sums; the header word is the writers'
    // running total that drives the peak (it may lag by a batch per thread).
    c.live_bytes = live;
    // The running total lags by at most a batch per thread, so the peak
    // word may trail the exact live bytes just read: the peak is at least
    // what is live now.
    c.peak_live_bytes = c.peak_live_bytes.max(live);
    c.live_blocks = c.live_blocks.wrapping_add(blocks);
    c.total_allocs = c.total_allocs.wrapping_add(allocs);
    c.total_bytes = c.total_bytes.wrapping_add(bytes);
}
