//! The writer: [`AllocationsWriter`]'s public operations (insert, remove,
//! replace, direct blocks), node allocation, and the per-thread
//! [`NodeCache`].
//!
//! Invariants:
//! - Every change to a block happens under its home shard's lock (or its
//!   spill shard's), inside a node seqlock write (`record.rs`).
//! - A block is removed before its memory can be reused: the caller removes
//!   first, then frees; an insert of an address already present reports
//!   [`InsertError::Duplicate`] and changes nothing.
//! - Nodes are handed to shards in chunks of 16 from the high-water mark
//!   and freed nodes stay with their shard (or a thread's [`NodeCache`]),
//!   so node memory follows the peak live count.

use super::*;

/// What a removed record held (besides its address).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Freed {
    /// Block size.
    pub size: u64,
    /// Its stack.
    pub stack: ResourceKey,
    /// Its allocation time (microseconds since the clock base).
    pub timestamp_us: u64,
}

/// Free nodes a [`NodeCache`] holds.
pub const NODE_CACHE: usize = 32;
/// A [`NodeCache`] folds live-byte changes into the header's running total
/// (which drives the peak) once they add up to this much.
pub const LIVE_BATCH: i64 = 64 << 10;

/// Per-writer-thread state for [`AllocationsWriter::insert_cached`] and
/// [`AllocationsWriter::remove_cached`]: a few free nodes, so the node a
/// thread just freed (hot in its cache) is the one its next insert writes,
/// and a pending live-bytes delta, so threads do not all hit one counter.
///
/// The header's running live total (and so the peak) lags the truth by at
/// most [`LIVE_BATCH`] bytes per thread; [`AllocationsWriter::flush_cache`]
/// settles it (call it when the thread exits). Live bytes as reported by
/// readers are exact (per-shard sums).
#[derive(Debug)]
pub struct NodeCache {
    pub(super) nodes: [u32; NODE_CACHE],
    pub(super) len: usize,
    pub(super) pending_live: i64,
}

impl NodeCache {
    /// An empty cache (usable in a `const` thread-local initialiser).
    pub const fn new() -> Self {
        NodeCache {
            nodes: [0; NODE_CACHE],
            len: 0,
            pending_live: 0,
        }
    }

    /// Forgets everything (the regions it referred to are gone, e.g. in a
    /// forked child).
    pub fn clear(&mut self) {
        self.len = 0;
        self.pending_live = 0;
    }

    /// The last node pushed. One unsigned compare covers both an empty
    /// cache (the index wraps) and the bound (no panic path: the cache
    /// is on every insert's path).
    #[inline(always)]
    pub(super) fn pop(&mut self) -> Option<u32> {
        let i = self.len.wrapping_sub(1);
        let node = *self.nodes.get(i)?;
        self.len = i;
        Some(node)
    }

    /// Keeps `node` unless the cache is full (false).
    #[inline(always)]
    pub(super) fn push(&mut self, node: u32) -> bool {
        match self.nodes.get_mut(self.len) {
            Some(slot) => {
                *slot = node;
                self.len += 1;
                true
            }
            None => false,
        }
    }
}

impl Default for NodeCache {
    fn default() -> Self {
        Self::new()
    }
}

/// Why an insert did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum InsertError {
    /// The address is already in the table.
    #[error("address already recorded")]
    Duplicate,
    /// No node or index slot left; counted as dropped.
    #[error("allocations table full")]
    Full,
    /// Address 0, or a key the node encoding cannot hold.
    #[error("record cannot be stored (zero address or key out of range)")]
    Unrepresentable,
}

/// Why an insert under a shard's lock did not happen.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) enum Locked {
    /// The address is already in this shard.
    Duplicate,
    /// The shard's index has no room (at its largest window).
    IndexFull,
    /// No node left anywhere.
    NoNode,
}

/// Writer handle for this process's allocations table.
#[derive(Clone, Copy, Debug)]
pub struct AllocationsWriter<'a> {
    pub(super) view: SharedView,
    pub(super) layout: Layout,
    /// `shards - 1`: the shard is the top 16 bits of the hash, masked
    /// (shards <= 2^16, so they never overlap the slot and tag bits below
    /// bit 37).
    pub(super) shard_mask: u64,
    /// log2 of the index window size (the largest capacity).
    pub(super) max_cap_log2: u32,
    /// Shard groups are `2^group_bits` (half the shard bits, rounded down);
    /// each group has `sub_mask + 1` shards.
    pub(super) group_bits: u32,
    pub(super) sub_bits: u32,
    pub(super) sub_mask: u64,
    pub(super) region: &'a RegionWriter,
    pub(super) counters: HeaderCounters,
}

impl<'a> AllocationsWriter<'a> {
    /// Creates an allocations region sized for `cfg`.
    pub fn create_region(cfg: AllocationsConfig) -> Result<RegionWriter, TableError> {
        let (layout, size) = Layout::new(cfg)?;
        RegionWriter::create(RegionKind::Allocations, size, layout.words())
    }

    /// Wraps a region made by [`Self::create_region`].
    pub fn new(region: &'a RegionWriter) -> Result<Self, TableError> {
        let h = region.header();
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        let shard_bits = layout.shards.trailing_zeros();
        let group_bits = shard_bits / 2;
        let sub_bits = shard_bits - group_bits;
        Ok(AllocationsWriter {
            view: region.view(),
            layout,
            shard_mask: layout.shards - 1,
            max_cap_log2: layout.slots_max.trailing_zeros(),
            group_bits,
            sub_bits,
            sub_mask: (1u64 << sub_bits) - 1,
            region,
            counters: region.counters(),
        })
    }

    /// The header counters this table maintains.
    pub fn counters(&self) -> HeaderCounters {
        self.counters
    }

    #[inline]
    pub(super) fn u32_at(&self, off: u64) -> &AtomicU32 {
        // SAFETY: every writer offset is computed from the layout validated
        // in `new` (shard < shards, window < 2, slot < cap <= slots_max,
        // node < capacity, fixed field offsets), which `Layout::check`
        // proved lies inside the region, and is 4-aligned by construction.
        unsafe { self.view.atomic_u32_unchecked(off) }
    }

    #[inline]
    pub(super) fn u64_at(&self, off: u64) -> &AtomicU64 {
        // SAFETY: as in `u32_at`, 8-aligned by construction.
        unsafe { self.view.atomic_u64_unchecked(off) }
    }

    /// Takes a free node for `shard` (caller holds the lock).
    #[cold]
    #[inline(never)]
    pub(super) fn take_node(&self, shard: u64) -> Option<u32> {
        let free = self.shard_field(shard, S_FREE);
        let head = free.load(Ordering::Relaxed);
        if head != 0 {
            let node = head.wrapping_sub(1);
            let next = self.node_word(node, 3).load(Ordering::Relaxed) as u32;
            free.store(next, Ordering::Relaxed);
            return Some(node);
        }
        // Grab a chunk of fresh nodes: the only shared counter touched, once
        // per CHUNK new nodes. Relaxed: nodes are zero pages until written
        // under this shard's lock.
        let hw = self.u64_at(W_NODE_HW);
        let mut start = hw.load(Ordering::Relaxed);
        let count = loop {
            if start >= self.layout.capacity {
                return None;
            }
            let n = (self.layout.capacity - start).min(u64::from(CHUNK));
            match hw.compare_exchange_weak(start, start + n, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => break n,
                Err(now) => start = now,
            }
        };
        // Chain the rest onto the shard's free list (w3 = next + 1).
        let first = start as u32;
        let mut next = free.load(Ordering::Relaxed);
        for k in (1..count as u32).rev() {
            let node = first + k;
            self.write_node(node, 0, 0, 0, u64::from(next));
            next = node + 1;
        }
        free.store(next, Ordering::Relaxed);
        Some(first)
    }

    /// Records a new live block. Refuses an address already recorded. A
    /// full table counts the event as dropped. Never allocates.
    pub fn insert(&self, rec: &AllocationRecord) -> Result<(), InsertError> {
        self.insert_impl(rec, hash(rec.address), None)
    }

    /// [`Self::insert`] taking its node from (and settling live bytes in)
    /// the calling thread's `cache`.
    pub fn insert_cached(
        &self,
        rec: &AllocationRecord,
        cache: &mut NodeCache,
    ) -> Result<(), InsertError> {
        self.insert_impl(rec, hash(rec.address), Some(cache))
    }

    /// [`Self::insert_cached`] reusing the hash [`Self::prefetch`] computed
    /// for the same address (a token for another address is ignored).
    pub fn insert_cached_prefetched(
        &self,
        rec: &AllocationRecord,
        prefetched: Prefetched,
        cache: &mut NodeCache,
    ) -> Result<(), InsertError> {
        let h = if prefetched.address == rec.address {
            prefetched.hash
        } else {
            hash(rec.address)
        };
        self.insert_impl(rec, h, Some(cache))
    }

    #[inline]
    pub(super) fn insert_impl(
        &self,
        rec: &AllocationRecord,
        h: u64,
        mut cache: Option<&mut NodeCache>,
    ) -> Result<(), InsertError> {
        let Some((t32, w1, w2, w3)) = Self::encode(rec) else {
            return Err(InsertError::Unrepresentable);
        };
        let home = self.home_shard(w1, h);
        // The stored (and later returned) size is clamped to 48 bits; count
        // the same value so live bytes return to zero.
        let size = rec.size.min(SIZE_MASK);
        if self.spilled(home) && self.in_spill_shard(home, h, w1) {
            // A stale record of this address (a free never seen).
            return Err(InsertError::Duplicate);
        }
        let pre = cache.as_mut().and_then(|c| c.pop());
        let mut r = {
            let _g = self.lock(home);
            let r = self.insert_locked(home, h, t32, w1, w2, w3, pre);
            if r.is_ok() {
                self.count_alloc_locked(home, size);
                self.add_live_locked(home, size, 0);
            }
            r
        };
        if r == Err(Locked::IndexFull) {
            r = self.insert_spilled(home, h, (t32, w1, w2, w3), pre);
        }
        match r {
            Ok(()) => {
                self.live_changed(cache, size as i64);
                Ok(())
            }
            Err(e) => {
                if let (Some(node), Some(c)) = (pre, cache) {
                    // Not consumed on failure: keep it.
                    c.push(node);
                }
                if e == Locked::Duplicate {
                    return Err(InsertError::Duplicate);
                }
                self.counters.on_dropped(DroppedReason::AllocationsFull);
                Err(InsertError::Full)
            }
        }
    }

    /// Returns the cache's nodes to the shared free lists and settles its
    /// pending live bytes. Call when the owning thread exits.
    pub fn flush_cache(&self, cache: &mut NodeCache) {
        while let Some(node) = cache.pop() {
            self.give_back_node(node);
        }
        let p = std::mem::take(&mut cache.pending_live);
        if p != 0 {
            self.live_changed(None, p);
        }
    }

    /// Puts an empty node (a cached one, or a young block's once a
    /// thread's cache is full) on a shard's free list.
    #[cold]
    #[inline(never)]
    pub(super) fn give_back_node(&self, node: u32) {
        let shard = u64::from(node) & (self.layout.shards - 1);
        let _g = self.lock(shard);
        let free = self.shard_field(shard, S_FREE);
        self.write_node(node, 0, 0, 0, u64::from(free.load(Ordering::Relaxed)));
        free.store(node + 1, Ordering::Relaxed);
    }

    #[allow(clippy::too_many_arguments)] // the encoded record's words
    #[inline(always)]
    pub(super) fn insert_locked(
        &self,
        shard: u64,
        h: u64,
        t32: u32,
        w1: u64,
        w2: u64,
        w3: u64,
        pre: Option<u32>,
    ) -> Result<(), Locked> {
        let (win, i) = self.index_room_locked(shard, h, w1)?;
        let node = match pre {
            Some(n) => n,
            None => match self.take_node(shard) {
                Some(n) => n,
                None => return Err(Locked::NoNode),
            },
        };
        self.write_node(node, t32, w1, w2, w3);
        self.link_slot_locked(shard, win, i, h, node);
        Ok(())
    }

    /// The index slot (window, slot) where `addr` (hash `h`) goes in
    /// `shard`, growing the index if it is too full; `Duplicate` if the
    /// address is there already. Caller holds the lock.
    #[inline(always)]
    pub(super) fn index_room_locked(
        &self,
        shard: u64,
        h: u64,
        addr: u64,
    ) -> Result<(u32, u64), Locked> {
        let mut cap = 1u64 << self.cap_log2(shard);
        let mut win = self.window(shard);
        // One probe finds a duplicate or the slot to use.
        let mut free = match self.probe_for_insert(shard, win, cap, h, addr) {
            Err(()) => return Err(Locked::Duplicate),
            Ok(free) => free,
        };
        let len = self.index_len(shard);
        let tombs = u64::from(self.shard_field(shard, S_TOMBS).load(Ordering::Relaxed));
        if (len + tombs + 1) * 4 > cap * 3 {
            if !self.rehash(shard, len + 1) {
                // At the window's limit: allow up to 7/8 after clearing
                // tombstones, else the table is full for this shard.
                if (len + 1) * 8 > cap * 7 || (tombs > 0 && !self.rehash(shard, len)) {
                    return Err(Locked::IndexFull);
                }
            }
            cap = 1u64 << self.cap_log2(shard);
            win = self.window(shard);
            free = self.free_slot(shard, win, cap, h);
        }
        match free {
            Some(i) => Ok((win, i)),
            None => Err(Locked::IndexFull),
        }
    }

    /// Points slot `i` of window `win` (from [`Self::index_room_locked`])
    /// at `node` and counts the block in the shard's length. Caller holds
    /// the lock.
    #[inline(always)]
    pub(super) fn link_slot_locked(&self, shard: u64, win: u32, i: u64, h: u64, node: u32) {
        let slot = self.slot(shard, win, i);
        if slot.load(Ordering::Relaxed) == TOMBSTONE {
            self.bump_locked(shard, S_TOMBS, u32::wrapping_sub);
        }
        slot.store(Self::tag(h) << NODE_BITS | (node + 1), Ordering::Relaxed);
        self.bump_locked(shard, S_LEN, u32::wrapping_add);
    }

    /// Removes `addr`; returns its size and, when `keep_node`, the freed
    /// node (marked free but not put on the shard's free list).
    #[inline(always)]
    pub(super) fn remove_locked(
        &self,
        shard: u64,
        h: u64,
        addr: u64,
        keep_node: bool,
    ) -> Option<(Freed, Option<u32>)> {
        let cap = 1u64 << self.cap_log2(shard);
        let win = self.window(shard);
        let (i, node) = self.find(shard, win, cap, h, addr)?;
        self.clear_slot(shard, win, cap, i);
        let (size, kept) = self.free_node_locked(shard, node, keep_node);
        let len = self.index_len(shard);
        if cap > 1 << MIN_CAP_LOG2 && len * 8 < cap {
            // Shrink so index memory follows the live count.
            self.rehash(shard, len);
        }
        Some((size, kept))
    }

    /// Empties the live block in `node` of `shard` (its index slot, if it
    /// has one, is the caller's business): marks the node free, keeps it
    /// for the caller (`keep_node`, returned) or puts it on the shard's
    /// free list, and takes the block out of the shard's live counts.
    /// Returns the block's size. Caller holds the lock.
    #[inline(always)]
    pub(super) fn free_node_locked(
        &self,
        shard: u64,
        node: u32,
        keep_node: bool,
    ) -> (Freed, Option<u32>) {
        let w2 = self.node_word(node, 2).load(Ordering::Relaxed);
        let w3 = self.node_word(node, 3).load(Ordering::Relaxed);
        let size = w2 & SIZE_MASK;
        let freed = Freed {
            size,
            stack: ResourceKey((w3 & 0xffff_ffff) * 8),
            timestamp_us: (w2 >> 48) << 32 | w3 >> 32,
        };
        let kept = if keep_node {
            self.empty_node(node);
            Some(node)
        } else {
            let free = self.shard_field(shard, S_FREE);
            self.write_node(node, 0, 0, 0, u64::from(free.load(Ordering::Relaxed)));
            free.store(node + 1, Ordering::Relaxed);
            None
        };
        self.add_live_locked(shard, 0, size);
        self.bump_locked(shard, S_LEN, u32::wrapping_sub);
        (freed, kept)
    }

    /// Inserts `rec` as a *direct* block (see the module doc): no index
    /// slot, no duplicate check; returns the node, which the caller keeps
    /// with the block and hands back to [`Self::remove_direct`]. A free
    /// node comes from `cache` when it has one. Never allocates.
    #[inline]
    pub fn insert_direct(
        &self,
        rec: &AllocationRecord,
        cache: &mut NodeCache,
    ) -> Result<u32, InsertError> {
        let Some((t32, w1, w2, w3)) = Self::encode(rec) else {
            return Err(InsertError::Unrepresentable);
        };
        let home = self.home_shard(w1, hash(w1));
        let size = rec.size.min(SIZE_MASK);
        let pre = cache.pop();
        let node = {
            let _g = self.lock(home);
            let node = pre.or_else(|| self.take_node(home));
            if let Some(node) = node {
                self.write_node(node, t32, w1, w2, w3);
                self.bump_locked(home, S_LEN, u32::wrapping_add);
                self.bump_locked(home, S_DIRECT, u32::wrapping_add);
                self.count_alloc_locked(home, size);
                self.add_live_locked(home, size, 0);
            }
            node
        };
        let Some(node) = node else {
            self.counters.on_dropped(DroppedReason::AllocationsFull);
            return Err(InsertError::Full);
        };
        self.live_changed(Some(cache), size as i64);
        Ok(node)
    }

    /// Removes the direct block at `addr` that [`Self::insert_direct`] put
    /// in `node`, returning its size; `None` (and nothing changes) unless
    /// that node holds `addr`. So a node number read back from memory the
    /// program may have scribbled over can never remove another block: the
    /// only node that holds `addr` is the block's own. (A writer that mixes
    /// modes must never pass an indexed block here: its node would leave
    /// while its index slot stayed.) The node goes to `cache` for the
    /// thread's next insert while it has room. Never allocates.
    #[inline]
    pub fn remove_direct(&self, addr: u64, node: u32, cache: &mut NodeCache) -> Option<u64> {
        self.remove_direct_freed(addr, node, cache).map(|f| f.size)
    }

    /// [`Self::remove_direct`], returning what the record held.
    #[inline]
    pub fn remove_direct_freed(
        &self,
        addr: u64,
        node: u32,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        if addr == 0 || u64::from(node) >= self.layout.capacity {
            return None;
        }
        let home = self.home_shard(addr, hash(addr));
        let keep = cache.len < NODE_CACHE;
        let (freed, kept) = {
            let _g = self.lock(home);
            // Under the home shard's lock: a direct block of `addr` was
            // written under this lock, and no other live block has `addr`.
            if self.node_addr(node) != addr {
                return None;
            }
            self.bump_locked(home, S_DIRECT, u32::wrapping_sub);
            self.free_node_locked(home, node, keep)
        };
        if let Some(node) = kept {
            cache.push(node);
        }
        self.live_changed(Some(cache), -(freed.size as i64));
        Some(freed)
    }

    /// Removes the block at `addr`, returning its size, or `None` if the
    /// table does not hold it. Never allocates.
    pub fn remove(&self, addr: u64) -> Option<u64> {
        self.remove_impl(addr, None).map(|f| f.size)
    }

    /// [`Self::remove`] keeping the freed node in the calling thread's
    /// `cache` (for its next insert) and settling live bytes there.
    pub fn remove_cached(&self, addr: u64, cache: &mut NodeCache) -> Option<u64> {
        self.remove_impl(addr, Some(cache)).map(|f| f.size)
    }

    /// [`Self::remove_cached`], returning what the record held (its stack
    /// and allocation time, for the peak's accounting).
    #[inline]
    pub fn remove_cached_freed(&self, addr: u64, cache: &mut NodeCache) -> Option<Freed> {
        self.remove_impl(addr, Some(cache))
    }

    #[inline(always)]
    pub(super) fn remove_impl(
        &self,
        addr: u64,
        mut cache: Option<&mut NodeCache>,
    ) -> Option<Freed> {
        let h = hash(addr);
        let home = self.home_shard(addr, h);
        let keep = cache.as_ref().is_some_and(|c| c.len < NODE_CACHE);
        let mut r = {
            let _g = self.lock(home);
            self.remove_locked(home, h, addr, keep)
        };
        if r.is_none() && self.spilled(home) {
            r = self.remove_spilled(home, h, addr, keep);
        }
        let (freed, kept) = r?;
        if let (Some(node), Some(c)) = (kept, cache.as_mut()) {
            c.push(node);
        }
        self.live_changed(cache, -(freed.size as i64));
        Some(freed)
    }

    /// Replaces the block at `old` by `rec` (a `realloc`): in place when the
    /// address is unchanged (the node is rewritten under its seqlock, so a
    /// reader sees the old or the new record, never a mix), otherwise a
    /// remove and an insert. Returns the old size if `old` was recorded.
    pub fn replace(&self, old: u64, rec: &AllocationRecord) -> Result<Option<u64>, InsertError> {
        if old != rec.address {
            let old_size = self.remove(old);
            return self.insert(rec).map(|()| old_size);
        }
        let Some((t32, w1, w2, w3)) = Self::encode(rec) else {
            return Err(InsertError::Unrepresentable);
        };
        let h = hash(old);
        let home = self.home_shard(old, h);
        let spill = self.spill_shard(old, h);
        let rewrite = |shard: u64| {
            let _g = self.lock(shard);
            let cap = 1u64 << self.cap_log2(shard);
            let win = self.window(shard);
            match self.find(shard, win, cap, h, old) {
                Some((_, node)) => {
                    let s = self.node_word(node, 2).load(Ordering::Relaxed) & SIZE_MASK;
                    self.write_node(node, t32, w1, w2, w3);
                    self.count_alloc_locked(shard, rec.size.min(SIZE_MASK));
                    self.add_live_locked(shard, rec.size.min(SIZE_MASK), s);
                    Some(s)
                }
                None => None,
            }
        };
        let mut old_size = rewrite(home);
        if old_size.is_none() && spill != home && self.spilled(home) {
            old_size = rewrite(spill);
        }
        match old_size {
            Some(s) => {
                self.fold_live(rec.size.min(SIZE_MASK), s);
                Ok(Some(s))
            }
            None => self.insert(rec).map(|()| None),
        }
    }
}
