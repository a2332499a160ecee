//! Young blocks: a writer thread's last [`YOUNG`] allocations stay out of
//! the shared index, in the thread's own [`YoungRing`], so that a block
//! its own thread frees soon after allocating it (97-98 % of redis's
//! frees, `bench/lifetimes`) costs no shard lock and no index probe.
//!
//! A young block has its node written exactly as any other (readers scan
//! nodes, never the index or the rings: nothing changes for them); only
//! the address -> node pair is kept in the ring instead of an index slot.
//! The allocation that finds its ring entry still occupied by a block
//! [`YOUNG`] allocations old *promotes* that block: its node (already
//! written) gets an index slot under its shard's lock, as if it had just
//! been inserted. Its counts move from the thread's line to the shard.
//!
//! Counters: a young block is counted in its thread's *writer line* (a
//! 64-byte line of the region, one per ring, written by that thread only
//! with plain stores): allocations and bytes at insert; frees and freed
//! bytes when it is freed or promoted (its shard then counts it live).
//! Readers add every line's `allocs - frees` and `bytes - freed_bytes` to
//! the shards' live counts (`shards.rs`), so the header's counters are
//! exact whenever no thread is between two updates. Line 0 belongs to no
//! ring: threads without one count there with atomic adds.
//!
//! Invariants:
//! - A ring is owned by one thread at a time ([`YoungRegistry::claim`],
//!   [`YoungRegistry::release`]); only its owner stores a non-zero address
//!   into an entry, and only while that entry is empty. A released ring
//!   keeps its entries (their blocks are live and still found, below);
//!   the next owner inherits them with the ring's writer line.
//! - An entry is *claimed* by the one write that turns its address to 0,
//!   and the claimant alone then owns the entry's node: the owner freeing
//!   its own block (a compare-and-swap), the owner promoting it (under the
//!   block's shard lock: a load and a store), or another thread freeing it
//!   (a block handed to another thread: a compare-and-swap under the same
//!   shard lock). Only a double free could race the owner's own claim with
//!   another's; the compare-and-swaps make one of them lose. A node is written without a shard lock only by the
//!   owner of the entry that holds it (before publishing it, or after
//!   claiming it), so every node still has exactly one writer at a time,
//!   inside its seqlock (`record.rs`).
//! - Before a claimant reads an entry's node it has read the entry's
//!   address with Acquire (the owner writes node, tag, then address with
//!   Release); another thread reads the node *before* its claiming CAS
//!   (AcqRel), and the owner writes a new node into an entry only after
//!   reading (Acquire) that the entry is empty, so the node read is the
//!   claimed block's.
//! - A block is in exactly one of: its owner's ring, its owner's table
//!   (`owner_table.rs`, the same rules), the shared index, or neither
//!   (freed). A free that finds it in neither the calling thread's ring,
//!   its table nor the index looks through every ring and table, then the
//!   index again: a promotion or eviction (ring or table -> index, under
//!   the shard lock, claim inside the lock) may have moved it between the
//!   first two looks, and the second index look, under the same lock,
//!   sees it. Blocks only ever move towards the index, so the one pass
//!   over the rings and tables cannot miss a block that stays put. A writer may also put
//!   blocks straight into the index while it owns a ring (the agent does
//!   while its blocks outlive the ring), and free without naming its ring
//!   (`own` = `None`): its ring is then searched after the index with the
//!   others, and such a free is counted in line 0.
//! - A block its owner resizes in place (the allocator kept its address:
//!   the agent's `realloc` on jemalloc) keeps its entry and node: the
//!   owner claims the entry as for a free ([`OwnClaim`]), rewrites the
//!   node in one seqlock write, and stores the address back, as it would
//!   into an empty entry. Readers, who read nodes only, see the old block
//!   or the new one throughout; a lookup meanwhile finds nothing, as it
//!   would during a `realloc` that moves the block.
//! - Blocks are found by address: a block freed behind the allocator's
//!   back (a free the hooks never saw) whose address is allocated again
//!   leaves a stale record until that address is promoted, when the stale
//!   record is replaced (an index insert of a present address today
//!   replaces it at once).

use super::*;

/// Allocations a thread keeps out of the shared index (its ring's size).
pub const YOUNG: usize = 16;
/// Rings a process can hand out (a thread beyond them records through the
/// shared index alone). Bounds the work of a free that finds its block
/// nowhere else (see the module doc).
pub const YOUNG_RINGS: usize = 128;

// Writer line fields (u64).
pub(super) const L_ALLOCS: u64 = 0;
pub(super) const L_BYTES: u64 = 8;
pub(super) const L_FREES: u64 = 16;
pub(super) const L_FREED_BYTES: u64 = 24;
/// In line 0 only: the highest line any ring has used, so readers sum
/// only the lines in use.
pub(super) const L_USED: u64 = 32;

/// One thread's young blocks (see the module doc): 16 entries in three
/// cache lines.
#[repr(C, align(64))]
#[derive(Debug)]
pub struct YoungRing {
    /// Block address of each entry, 0 = empty.
    addrs: [AtomicU64; YOUNG],
    /// Node of each entry (meaningful while its address is not 0).
    nodes: [AtomicU32; YOUNG],
    /// One byte per entry, a hash of its address ([`tag`]), so a lookup
    /// compares 16 bytes in two words before it reads any address.
    tags: [AtomicU64; 2],
    /// Blocks inserted (owner only): the next entry is `head % YOUNG`, the
    /// oldest one.
    head: AtomicU32,
    /// 1 while a thread owns the ring.
    owner: AtomicU32,
}

/// A block of the calling thread's own ring that the thread has claimed
/// ([`AllocationsWriter::claim_own_young`]): its entry reads as empty to
/// every lookup, its node still as the live block to readers. Give it to
/// exactly one of [`AllocationsWriter::free_claimed`],
/// [`AllocationsWriter::unclaim`] or [`AllocationsWriter::rewrite_claimed`]
/// before the thread's next insert.
#[must_use = "a claimed entry must be freed, given back or rewritten"]
#[derive(Debug)]
pub struct OwnClaim {
    ring: u32,
    entry: u32,
    node: u32,
    addr: u64,
}

impl YoungRing {
    const fn new() -> Self {
        YoungRing {
            addrs: [const { AtomicU64::new(0) }; YOUNG],
            nodes: [const { AtomicU32::new(0) }; YOUNG],
            tags: [const { AtomicU64::new(0) }; 2],
            head: AtomicU32::new(0),
            owner: AtomicU32::new(0),
        }
    }

    /// Entries whose tag matches `addr`'s, as bits (bit i = entry i). The
    /// tags are read with two atomic loads (the owner may be writing
    /// them), then compared at once: on x86_64 with one SSE2 compare
    /// (part of the baseline), elsewhere bytewise in each word.
    #[inline(always)]
    fn candidates(&self, addr: u64) -> u32 {
        self.tag_matches(tag(addr))
    }

    /// Entries whose tag is `t`, as bits (see [`Self::candidates`]).
    #[inline(always)]
    fn tag_matches(&self, t: u8) -> u32 {
        let lo = self.tags[0].load(Ordering::Relaxed);
        let hi = self.tags[1].load(Ordering::Relaxed);
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::*;
            // SAFETY: register operations only (SSE2 is always present on
            // x86_64).
            unsafe {
                let tags = _mm_set_epi64x(hi as i64, lo as i64);
                let eq = _mm_cmpeq_epi8(tags, _mm_set1_epi8(t as i8));
                _mm_movemask_epi8(eq) as u32
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            let t = u64::from(t) * 0x0101_0101_0101_0101;
            zero_bytes(lo ^ t) | zero_bytes(hi ^ t) << 8
        }
    }

    /// [`Self::candidates`] for the ring's owner, which alone writes the
    /// tags (so a plain read of them races with no write): on x86_64 one
    /// 16-byte load and compare.
    #[inline(always)]
    fn own_candidates(&self, addr: u64) -> u32 {
        self.own_tag_matches(tag(addr))
    }

    /// [`Self::tag_matches`] for the ring's owner (see
    /// [`Self::own_candidates`]).
    #[inline(always)]
    fn own_tag_matches(&self, t: u8) -> u32 {
        #[cfg(target_arch = "x86_64")]
        {
            use core::arch::x86_64::*;
            // SAFETY: `tags` is 16 bytes (two u64, no padding) that only
            // this thread writes (the caller owns the ring); an unaligned
            // 16-byte load of them is in bounds. SSE2 is always present
            // on x86_64.
            unsafe {
                let tags = _mm_loadu_si128(self.tags.as_ptr().cast());
                let eq = _mm_cmpeq_epi8(tags, _mm_set1_epi8(t as i8));
                _mm_movemask_epi8(eq) as u32
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        self.tag_matches(t)
    }

    /// The owner's [`Self::find`] (see [`Self::own_candidates`]).
    #[inline(always)]
    fn find_own(&self, addr: u64) -> Option<usize> {
        self.find_own_among(addr, self.own_candidates(addr))
    }

    /// The entry among candidates `m` (owner's view) that holds `addr`.
    #[inline(always)]
    fn find_own_among(&self, addr: u64, mut m: u32) -> Option<usize> {
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            if self.addrs[i].load(Ordering::Relaxed) == addr {
                return Some(i);
            }
        }
        None
    }

    /// Entry holding `addr` (verified), if any. `order` for the address
    /// loads: Acquire for another thread's ring.
    #[inline(always)]
    fn find(&self, addr: u64, order: Ordering) -> Option<usize> {
        self.find_among(addr, self.candidates(addr), order)
    }

    /// The entry among candidates `m` that holds `addr` (see
    /// [`Self::find`]).
    #[inline(always)]
    fn find_among(&self, addr: u64, mut m: u32, order: Ordering) -> Option<usize> {
        while m != 0 {
            let i = m.trailing_zeros() as usize;
            m &= m - 1;
            if self.addrs[i].load(order) == addr {
                return Some(i);
            }
        }
        None
    }

    /// The tag word holding entry `i`'s tag, and the tag's shift in it.
    #[inline(always)]
    fn tag_at(&self, i: usize) -> (&AtomicU64, usize) {
        (&self.tags[i / 8], (i % 8) * 8)
    }

    /// Sets entry `i`'s tag to `addr`'s (owner only).
    #[cfg(test)]
    #[inline(always)]
    fn set_tag(&self, i: usize, addr: u64) {
        self.set_tag_byte(i, tag(addr));
    }

    /// Sets entry `i`'s tag to `t` (owner only).
    #[inline(always)]
    fn set_tag_byte(&self, i: usize, t: u8) {
        let (word, shift) = self.tag_at(i);
        let v = word.load(Ordering::Relaxed) & !(0xff << shift) | u64::from(t) << shift;
        word.store(v, Ordering::Relaxed);
    }

    /// Makes entry `i`'s tag differ from that of `addr`, the address it
    /// held (owner only, after freeing it): an allocator hands a freed
    /// address out again soon, and a stale entry with the same tag would
    /// be a candidate at every later lookup of it (on redis ~1.5 false
    /// candidates per free before this).
    #[inline(always)]
    fn unset_tag(&self, i: usize, addr: u64) {
        let (word, shift) = self.tag_at(i);
        let v = word.load(Ordering::Relaxed) ^ 0xff << shift;
        debug_assert_ne!((v >> shift) as u8, tag(addr));
        word.store(v, Ordering::Relaxed);
    }

    /// Empties every entry (a forked child's rings name its parent's
    /// regions).
    fn clear(&self) {
        for a in &self.addrs {
            a.store(0, Ordering::Relaxed);
        }
        self.head.store(0, Ordering::Relaxed);
    }
}

/// A byte of `addr`'s bits for [`YoungRing::candidates`]: the granule
/// bits above 16-byte alignment, folded with the page bits, so
/// neighbouring small blocks differ.
#[inline(always)]
pub(super) fn tag(addr: u64) -> u8 {
    ((addr >> 4) ^ (addr >> 12)) as u8
}

/// Bit k set exactly when byte k of `x` is zero (no false positives: the
/// carry-free form).
#[cfg_attr(target_arch = "x86_64", allow(dead_code))]
#[inline(always)]
fn zero_bytes(x: u64) -> u32 {
    const LOW7: u64 = 0x7f7f_7f7f_7f7f_7f7f;
    let y = !(((x & LOW7) + LOW7) | x | LOW7);
    // The high bit of each zero byte, gathered into one byte.
    ((y >> 7).wrapping_mul(0x0102_0408_1020_4080) >> 56) as u32
}

/// The process's young rings (a `static` of the agent's): a thread claims
/// one at its first young allocation and gives it back at exit.
#[derive(Debug)]
pub struct YoungRegistry {
    rings: [YoungRing; YOUNG_RINGS],
    /// Rings ever claimed: lookups across rings stop here.
    high: AtomicU32,
    /// The threads' owner tables (`owner_table.rs`).
    pub(super) owners: OwnerTables,
}

impl Default for YoungRegistry {
    fn default() -> Self {
        Self::new()
    }
}

impl YoungRegistry {
    /// Empty rings (usable in a `static`).
    pub const fn new() -> Self {
        YoungRegistry {
            rings: [const { YoungRing::new() }; YOUNG_RINGS],
            high: AtomicU32::new(0),
            owners: OwnerTables::new(),
        }
    }

    /// Claims a ring for the calling thread; `None` when all are owned.
    /// The ring may hold blocks of a thread that exited: they are the new
    /// owner's now.
    pub fn claim(&self) -> Option<u32> {
        for (k, r) in self.rings.iter().enumerate() {
            // Acquire: the last owner's entries (released with Release).
            if r.owner.load(Ordering::Relaxed) == 0
                && r.owner
                    .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                // Release: a thread that sees the new bound sees the ring
                // owned; its entries are published with their own Release.
                self.high.fetch_max(k as u32 + 1, Ordering::Release);
                return Some(k as u32);
            }
        }
        None
    }

    /// Gives ring `k` back (its blocks stay in it, still found).
    pub fn release(&self, k: u32) {
        if let Some(r) = self.rings.get(k as usize) {
            r.owner.store(0, Ordering::Release);
        }
    }

    /// Gives owner table `k` back (its blocks stay in it, still found).
    pub fn release_owner_table(&self, k: u32) {
        self.owners.release(k);
    }

    /// Blocks held in owner table `k` now (for tests and statistics).
    pub fn held_in_owner_table(&self, k: u32) -> usize {
        self.owners.held(k)
    }

    /// Empties and frees every ring, and frees every owner table, which
    /// cannot be claimed again until [`Self::empty_owner_tables`]. Memory
    /// stores only. Only in a process with one thread (a forked child,
    /// before it records anything).
    pub fn reset(&self) {
        self.owners.forget();
        let high = self.high.load(Ordering::Relaxed) as usize;
        for r in self.rings.iter().take(high) {
            r.clear();
            r.owner.store(0, Ordering::Relaxed);
        }
        self.high.store(0, Ordering::Release);
    }

    /// Empties every owner table after [`Self::reset`] (a system call per
    /// table: call once the process is known to record). Only in a process
    /// with one thread.
    pub fn empty_owner_tables(&self) {
        self.owners.empty_all();
    }

    /// Blocks held in ring `k` now (for tests and statistics).
    pub fn held(&self, k: u32) -> usize {
        self.rings.get(k as usize).map_or(0, |r| {
            r.addrs
                .iter()
                .filter(|a| a.load(Ordering::Relaxed) != 0)
                .count()
        })
    }
}

impl AllocationsWriter<'_> {
    /// Whether this region has a writer line for ring `k` (a region
    /// written before format 1.5 has none: young recording is off).
    #[inline(always)]
    pub(super) fn has_line(&self, k: u32) -> bool {
        u64::from(k) + 1 < self.layout.lines
    }

    #[inline(always)]
    fn line_word(&self, line: u32, field: u64) -> &AtomicU64 {
        debug_assert!(u64::from(line) < self.layout.lines);
        self.u64_at(self.layout.lines_off + u64::from(line) * LINE_SIZE + field)
    }

    /// Claims a young ring of `reg` for the calling thread (see
    /// [`YoungRegistry::claim`]) and marks its writer line as in use;
    /// `None` when every ring is taken or this region has no lines.
    pub fn claim_young(&self, reg: &YoungRegistry) -> Option<u32> {
        if self.layout.lines < 2 {
            return None;
        }
        let k = reg.claim()?;
        if !self.has_line(k) {
            reg.release(k);
            return None;
        }
        self.line_word(0, L_USED)
            .fetch_max(u64::from(k) + 1, Ordering::Relaxed);
        Some(k)
    }

    /// Counts one block of `bytes` in writer line `line`: `pair` is
    /// [`L_ALLOCS`] (allocations, then bytes) or [`L_FREES`] (frees, then
    /// freed bytes). A load and a store each on the owner's own line, an
    /// atomic add each on the shared line 0. Both words' addresses are
    /// taken before either store (after one, the compiler would load the
    /// writer's base and layout again).
    #[inline(always)]
    fn line_count(&self, line: u32, pair: u64, bytes: u64) {
        let (n, b) = (self.line_word(line, pair), self.line_word(line, pair + 8));
        if line == 0 {
            n.fetch_add(1, Ordering::Relaxed);
            b.fetch_add(bytes, Ordering::Relaxed);
        } else {
            n.store(n.load(Ordering::Relaxed).wrapping_add(1), Ordering::Relaxed);
            b.store(
                b.load(Ordering::Relaxed).wrapping_add(bytes),
                Ordering::Relaxed,
            );
        }
    }

    /// Records a new live block as young in ring `ring` of `reg`, which
    /// the calling thread owns (see the module doc), promoting the ring's
    /// oldest block to the index if its entry is still occupied. The node
    /// comes from `cache`. Never allocates. In a region without writer
    /// lines this is [`Self::insert_cached`].
    #[inline]
    pub fn insert_young(
        &self,
        rec: &AllocationRecord,
        reg: &YoungRegistry,
        ring: u32,
        cache: &mut NodeCache,
    ) -> Result<(), InsertError> {
        self.insert_young_prefetched(rec, reg, ring, None, cache)
    }

    /// [`Self::insert_young`] reusing the hash [`Self::prefetch_young`]
    /// computed for the block to promote (a token for another address is
    /// ignored).
    #[inline]
    pub fn insert_young_prefetched(
        &self,
        rec: &AllocationRecord,
        reg: &YoungRegistry,
        ring: u32,
        prefetched: Option<Prefetched>,
        cache: &mut NodeCache,
    ) -> Result<(), InsertError> {
        let Some(r) = reg.rings.get(ring as usize) else {
            return self.insert_cached(rec, cache);
        };
        if !self.has_line(ring) {
            return self.insert_cached(rec, cache);
        }
        let line = ring + 1;
        let Some((t32, w1, w2, w3)) = Self::encode(rec) else {
            return Err(InsertError::Unrepresentable);
        };
        let head = r.head.load(Ordering::Relaxed);
        let i = head as usize % YOUNG;
        self.empty_head(r, i, prefetched, line, cache);
        self.fill_entry(
            (&r.addrs[i], &r.nodes[i]),
            || r.set_tag_byte(i, tag(w1)),
            (t32, w1, w2, w3),
            line,
            cache,
        )?;
        r.head.store(head.wrapping_add(1), Ordering::Relaxed);
        Ok(())
    }

    /// Makes entry `i` of the caller's ring `r` (the one at its head)
    /// empty for a new block: the block it still holds, if any, is
    /// promoted into the index (counted out of writer line `line`), with
    /// the hash `prefetched` ([`Self::prefetch_young`]) computed for it.
    #[inline(always)]
    fn empty_head(
        &self,
        r: &YoungRing,
        i: usize,
        prefetched: Option<Prefetched>,
        line: u32,
        cache: &mut NodeCache,
    ) {
        // Only this thread stores a non-zero address here; another thread
        // may have claimed the entry (stored 0) meanwhile, which is fine.
        // Acquire: such a claimant read the entry's node before its claim
        // (Release), so that read comes before our store of a new node.
        let old = r.addrs[i].load(Ordering::Acquire);
        if old != 0 {
            let h = match prefetched {
                Some(p) if p.address == old => p.hash,
                _ => hash(old),
            };
            self.promote((&r.addrs[i], &r.nodes[i]), old, h, line, cache);
        }
    }

    /// Writes a new block (its encoded words) into an entry (its address
    /// and node words) that the calling thread owns and has seen empty (an
    /// Acquire load, or its own claim), and counts it in writer line
    /// `line`. `set_tag` sets the entry's tag, between the node and the
    /// address.
    #[inline(always)]
    pub(super) fn fill_entry(
        &self,
        (entry, node_word): (&AtomicU64, &AtomicU32),
        set_tag: impl FnOnce(),
        (t32, w1, w2, w3): (u32, u64, u64, u64),
        line: u32,
        cache: &mut NodeCache,
    ) -> Result<(), InsertError> {
        let node = match cache.pop() {
            Some(n) => n,
            None => match self.fresh_node(w1) {
                Some(n) => n,
                None => {
                    self.counters.on_dropped(DroppedReason::AllocationsFull);
                    return Err(InsertError::Full);
                }
            },
        };
        self.write_node(node, t32, w1, w2, w3);
        node_word.store(node, Ordering::Relaxed);
        set_tag();
        // Release: node, tag and node word before the address that
        // another thread's lookup acquires.
        entry.store(w1, Ordering::Release);
        let size = w2 & SIZE_MASK;
        self.line_count(line, L_ALLOCS, size);
        self.live_changed(Some(cache), size as i64);
        Ok(())
    }

    /// Hints the CPU to fetch the index slot that the next
    /// [`Self::insert_young`] into ring `ring` will use to promote the
    /// ring's oldest block, if it is still live (the caller's ring; for
    /// another ring or a stale number it is only a useless hint). Call it
    /// early: the allocation's stack walk then hides the miss, as
    /// [`Self::prefetch`] does for a block inserted straight into the
    /// index.
    ///
    /// Returns the hash it computed, for [`Self::insert_young_prefetched`].
    #[inline(always)]
    pub fn prefetch_young(&self, reg: &YoungRegistry, ring: u32) -> Option<Prefetched> {
        let r = reg.rings.get(ring as usize)?;
        let head = r.head.load(Ordering::Relaxed);
        let old = r.addrs[head as usize % YOUNG].load(Ordering::Relaxed);
        (old != 0).then(|| self.prefetch(old))
    }

    /// A node for a young block when the thread's cache is empty: from the
    /// home shard's free list or a fresh chunk, under its lock.
    #[cold]
    #[inline(never)]
    fn fresh_node(&self, addr: u64) -> Option<u32> {
        let home = self.home_shard(addr, hash(addr));
        let _g = self.lock(home);
        self.take_node(home)
    }

    /// Moves the block in an entry (its address and node words) of the
    /// caller's ring or owner table (address `addr`, hash `h`) into the
    /// shared index, unless another thread claimed it first (it is freeing
    /// it). Its counts move from writer line `line` to the shard.
    #[inline(never)]
    pub(super) fn promote(
        &self,
        (entry, node_word): (&AtomicU64, &AtomicU32),
        addr: u64,
        h: u64,
        line: u32,
        cache: &mut NodeCache,
    ) {
        // Read before the claim (see the module doc).
        let node = node_word.load(Ordering::Relaxed);
        let home = self.home_shard(addr, h);
        let size = {
            let _g = self.lock(home);
            // Claimed inside the lock, so a thread whose claim then fails
            // finds the block in the index under the same lock. A load and
            // a store, no CAS: every other thread claims under this lock
            // too (`remove_elsewhere`), and the owner's own frees come
            // before or after this on this thread.
            if entry.load(Ordering::Acquire) != addr {
                return;
            }
            entry.store(0, Ordering::Release);
            let size = self.node_word(node, 2).load(Ordering::Relaxed) & SIZE_MASK;
            match self.link_locked(home, h, addr, node) {
                Ok(()) => {
                    self.add_live_locked(home, size, 0);
                    Some(size)
                }
                Err(_) => None,
            }
        };
        let size = match size {
            Some(s) => s,
            None => match self.promote_spilled(home, h, addr, node) {
                Some(s) => s,
                None => {
                    // No index room anywhere: the block is dropped, as an
                    // insert into a full table is.
                    let f = self.free_young_node(node, line, cache);
                    self.live_changed(Some(cache), -(f.size as i64));
                    self.counters.on_dropped(DroppedReason::AllocationsFull);
                    return;
                }
            },
        };
        self.line_count(line, L_FREES, size);
    }

    /// Gives the (claimed) young block in `node` an index slot in
    /// `shard`, replacing a stale record of the same address (a free that
    /// was never seen). Caller holds the lock.
    #[inline(always)]
    fn link_locked(&self, shard: u64, h: u64, addr: u64, node: u32) -> Result<(), Locked> {
        match self.index_room_locked(shard, h, addr) {
            Err(Locked::Duplicate) => {
                self.remove_locked(shard, h, addr, false);
                let (win, i) = self.index_room_locked(shard, h, addr)?;
                self.link_slot_locked(shard, win, i, h, node);
                Ok(())
            }
            Err(e) => Err(e),
            Ok((win, i)) => {
                self.link_slot_locked(shard, win, i, h, node);
                Ok(())
            }
        }
    }

    /// [`Self::link_locked`] into the spill shard of `home` (its index is
    /// full). Returns the block's size, `None` when there is no room.
    #[cold]
    #[inline(never)]
    fn promote_spilled(&self, home: u64, h: u64, addr: u64, node: u32) -> Option<u64> {
        let spill = self.spill_shard(addr, h);
        if spill == home {
            return None;
        }
        {
            let _g = self.lock(home);
            self.shard_field(home, S_SPILLED)
                .store(1, Ordering::Relaxed);
        }
        let _g = self.lock(spill);
        self.link_locked(spill, h, addr, node).ok()?;
        let size = self.node_word(node, 2).load(Ordering::Relaxed) & SIZE_MASK;
        self.add_live_locked(spill, size, 0);
        Some(size)
    }

    /// Empties the node of a claimed young block and counts the free in
    /// writer line `line`; the node goes to `cache` (or back to a shard
    /// when the cache is full). The caller settles live bytes.
    #[inline(always)]
    pub(super) fn free_young_node(&self, node: u32, line: u32, cache: &mut NodeCache) -> Freed {
        let freed = self.node_contents(node);
        if !cache.push(node) {
            self.give_back_node(node);
        } else {
            self.empty_node(node);
        }
        self.line_count(line, L_FREES, freed.size);
        freed
    }

    /// Claims the block at `addr` in the calling thread's own ring `own`
    /// (the first half of [`Self::remove_own_young`]): its entry's address
    /// becomes 0, while its node, untouched, still reads as the live block
    /// to readers. `None` when the ring does not hold it (nothing changed).
    ///
    /// The claim must be given to exactly one of [`Self::free_claimed`],
    /// [`Self::unclaim`] or [`Self::rewrite_claimed`] before the thread
    /// inserts into its ring again: an entry left claimed is taken as
    /// empty by the next insert into it, and its node, never emptied,
    /// would be read as a live block for ever.
    #[inline(always)]
    pub fn claim_own_young(&self, addr: u64, reg: &YoungRegistry, own: u32) -> Option<OwnClaim> {
        if !self.has_line(own) {
            return None;
        }
        let r = &reg.rings[own as usize % YOUNG_RINGS];
        let i = r.find_own(addr)?;
        let node = r.nodes[i].load(Ordering::Relaxed);
        // A CAS, not a store: a double free racing on another thread must
        // not free the node twice.
        r.addrs[i]
            .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
            .ok()?;
        Some(OwnClaim {
            ring: own,
            entry: i as u32,
            node,
            addr,
        })
    }

    /// Frees a claimed block (the second half of
    /// [`Self::remove_own_young`]): its node goes to `cache`.
    #[inline(always)]
    pub fn free_claimed(&self, c: OwnClaim, reg: &YoungRegistry, cache: &mut NodeCache) -> Freed {
        let r = &reg.rings[c.ring as usize % YOUNG_RINGS];
        r.unset_tag(c.entry as usize, c.addr);
        let f = self.free_young_node(c.node, c.ring + 1, cache);
        self.live_changed(Some(cache), -(f.size as i64));
        f
    }

    /// Gives a claimed block back to its entry unchanged.
    #[inline]
    pub fn unclaim(&self, c: OwnClaim, reg: &YoungRegistry) {
        let r = &reg.rings[c.ring as usize % YOUNG_RINGS];
        // The entry is the owner's and empty (its claim): the owner may
        // store an address into it. Release, as at insert.
        r.addrs[c.entry as usize].store(c.addr, Ordering::Release);
    }

    /// Replaces a claimed block by `rec`, a block at the same address (one
    /// resized in place by the allocator): one seqlock write of the node it
    /// keeps, so a reader sees the old block or the new one, never neither
    /// and never both. Counted as a free of the old block and an
    /// allocation of the new one, which becomes the ring's newest block,
    /// as after the free and insert of a `realloc` that moves it: it takes
    /// the entry at the ring's head (promoting the block there, if any, as
    /// an insert does), and its own entry stays empty until the head
    /// reaches it. (Left in its entry, a block resized over and over, like
    /// redis's list nodes, would be promoted into the index every [`YOUNG`]
    /// allocations.) Returns what the old block held; when `rec` cannot be
    /// stored (it names another address, or a key out of range) the old
    /// block is freed instead, and the answer is `Err` with what it held.
    /// `prefetched`: [`Self::prefetch_young`]'s answer for the ring, as
    /// for [`Self::insert_young_prefetched`].
    #[inline]
    pub fn rewrite_claimed(
        &self,
        c: OwnClaim,
        rec: &AllocationRecord,
        reg: &YoungRegistry,
        prefetched: Option<Prefetched>,
        cache: &mut NodeCache,
    ) -> Result<Freed, Freed> {
        let Some((t32, w1, w2, w3)) = Self::encode(rec).filter(|e| e.1 == c.addr) else {
            return Err(self.free_claimed(c, reg, cache));
        };
        let old = self.node_contents(c.node);
        self.write_node(c.node, t32, w1, w2, w3);
        let r = &reg.rings[c.ring as usize % YOUNG_RINGS];
        let line = c.ring + 1;
        let head = r.head.load(Ordering::Relaxed);
        let i = head as usize % YOUNG;
        let own = c.entry as usize;
        if i != own {
            self.empty_head(r, i, prefetched, line, cache);
            r.unset_tag(own, c.addr);
            r.nodes[i].store(c.node, Ordering::Relaxed);
            r.set_tag_byte(i, tag(w1));
        }
        // Release: the node's new words, node word and tag before the
        // address that another thread's lookup acquires (as at insert).
        r.addrs[i].store(c.addr, Ordering::Release);
        r.head.store(head.wrapping_add(1), Ordering::Relaxed);
        let size = w2 & SIZE_MASK;
        self.line_count(line, L_FREES, old.size);
        self.line_count(line, L_ALLOCS, size);
        self.live_changed(Some(cache), size as i64 - old.size as i64);
        Ok(old)
    }

    /// What node `node` holds (its size, stack and time), read by the
    /// thread that owns it.
    #[inline(always)]
    fn node_contents(&self, node: u32) -> Freed {
        let w2 = self.node_word(node, 2).load(Ordering::Relaxed);
        let w3 = self.node_word(node, 3).load(Ordering::Relaxed);
        Freed {
            size: w2 & SIZE_MASK,
            stack: ResourceKey((w3 & 0xffff_ffff) * 8),
            timestamp_us: (w2 >> 48) << 32 | w3 >> 32,
        }
    }

    /// Removes the block at `addr` wherever it is recorded: in the calling
    /// thread's ring `own` (no lock), in the shared index, or in another
    /// thread's ring or owner table. Returns what it held, `None` if it is
    /// not recorded. Never allocates. The node goes to `cache`.
    #[inline(always)]
    pub fn remove_any(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: Option<u32>,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        self.remove_any_owned(addr, reg, own, None, cache)
    }

    /// [`Self::remove_any`] for a thread that also owns an owner table
    /// (`table`: the table and the young ring whose writer line counts
    /// it), looked in after its ring and before the index.
    #[inline(always)]
    pub fn remove_any_owned(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: Option<u32>,
        table: Option<(u32, u32)>,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        if let Some(k) = own {
            if let Some(f) = self.remove_own_young(addr, reg, k, cache) {
                return Some(f);
            }
        }
        self.remove_any_but_own_young(addr, reg, own, table, cache)
    }

    /// The first step of [`Self::remove_any_owned`]: the block at `addr`
    /// if it is in the calling thread's own ring `own`. A caller that
    /// handles this common case apart (the agent's free) then calls
    /// [`Self::remove_any_but_own_young`] with the same arguments.
    #[inline(always)]
    pub fn remove_own_young(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: u32,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        let c = self.claim_own_young(addr, reg, own)?;
        Some(self.free_claimed(c, reg, cache))
    }

    /// The rest of [`Self::remove_any_owned`] once
    /// [`Self::remove_own_young`] did not find the block in ring `own`:
    /// the caller's table, the index, the other rings and tables.
    #[inline(always)]
    pub fn remove_any_but_own_young(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: Option<u32>,
        table: Option<(u32, u32)>,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        let own = own.filter(|k| self.has_line(*k));
        let table = table.filter(|(_, k)| self.has_line(*k));
        if let Some((t, k)) = table {
            if let Some(f) = self.remove_owned(addr, reg, t, k + 1, cache) {
                return Some(f);
            }
        }
        if let Some(f) = self.remove_impl(addr, Some(cache)) {
            return Some(f);
        }
        if self.layout.lines == 0 {
            return None;
        }
        self.remove_elsewhere(addr, reg, own, table, cache)
    }

    /// Frees the block `addr` in another thread's ring or table entry
    /// (its address and node words, the address found equal with Acquire)
    /// for the calling thread, counting the free in writer line `line`;
    /// `None` when the entry's owner promoted or evicted it first (the
    /// index holds it now).
    #[inline(always)]
    pub(super) fn claim_elsewhere(
        &self,
        (entry, node_word): (&AtomicU64, &AtomicU32),
        addr: u64,
        line: u32,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        // Read before the claim (see the module doc).
        let node = node_word.load(Ordering::Relaxed);
        // Claimed under the block's shard lock, which the owner holds to
        // promote or evict it (see `promote`); a CAS against the owner's
        // own free of it, which only a double free would race with.
        let claimed = {
            let _g = self.lock(self.home_shard(addr, hash(addr)));
            entry
                .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
        };
        if !claimed {
            return None;
        }
        let f = self.free_young_node(node, line, cache);
        self.live_changed(Some(cache), -(f.size as i64));
        Some(f)
    }

    /// The rest of [`Self::remove_any_owned`] after the caller's ring, its
    /// table and the index missed: the other rings and tables, then the
    /// index again (see the module doc).
    #[cold]
    #[inline(never)]
    fn remove_elsewhere(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: Option<u32>,
        table: Option<(u32, u32)>,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        let line = own.or(table.map(|(_, k)| k)).map_or(0, |k| k + 1);
        let high = (reg.high.load(Ordering::Acquire) as usize).min(YOUNG_RINGS);
        if high == 0 {
            // No ring was ever claimed: no young block anywhere (an owner
            // table is claimed only by a thread that holds a ring).
            return None;
        }
        for (k, r) in reg.rings.iter().enumerate().take(high) {
            if Some(k as u32) == own {
                continue;
            }
            let Some(i) = r.find(addr, Ordering::Acquire) else {
                continue;
            };
            if let Some(f) = self.claim_elsewhere((&r.addrs[i], &r.nodes[i]), addr, line, cache) {
                return Some(f);
            }
            // Its owner promoted it meanwhile: the index look below finds
            // it, under the lock the promotion held.
            return self.remove_impl(addr, Some(cache));
        }
        // The owner tables (the caller's own was looked in first), then,
        // whether one held the block and its owner evicted it meanwhile or
        // none held it, the index again.
        if let Ok(Some(f)) =
            self.remove_from_other_tables(addr, reg, table.map(|(t, _)| t), line, cache)
        {
            return Some(f);
        }
        self.remove_impl(addr, Some(cache))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zero_bytes_marks_exactly_the_zero_bytes() {
        assert_eq!(zero_bytes(0), 0xff);
        assert_eq!(zero_bytes(u64::MAX), 0);
        assert_eq!(zero_bytes(0x0100_0000_0000_80ff), 0b0111_1100);
        // A byte of 0x01 above a zero byte is not a zero byte (the
        // borrowing form would say it is).
        assert_eq!(zero_bytes(0x0000_0000_0000_0100), 0b1111_1101);
        for k in 0..8 {
            let x = !(0xffu64 << (8 * k));
            assert_eq!(zero_bytes(x), 1 << k);
        }
    }

    #[test]
    fn a_ring_finds_each_entry_by_address_and_nothing_else() {
        let r = YoungRing::new();
        let addrs: Vec<u64> = (0..YOUNG as u64).map(|k| 0x5555_0000 + k * 4096).collect();
        for (i, a) in addrs.iter().enumerate() {
            r.set_tag(i, *a);
            r.addrs[i].store(*a, Ordering::Relaxed);
        }
        for (i, a) in addrs.iter().enumerate() {
            assert_eq!(r.find(*a, Ordering::Relaxed), Some(i));
            assert_eq!(r.find_own(*a), Some(i));
            assert_eq!(r.candidates(*a), r.own_candidates(*a));
        }
        assert_eq!(r.find(0x5555_0010, Ordering::Relaxed), None);
        assert_eq!(r.find_own(0x5555_0010), None);
        r.addrs[3].store(0, Ordering::Relaxed);
        assert_eq!(r.find(addrs[3], Ordering::Relaxed), None);
        assert_eq!(r.find_own(addrs[3]), None);
        // A freed entry's tag no longer names its address: no candidate.
        r.unset_tag(3, addrs[3]);
        assert_eq!(r.own_candidates(addrs[3]) & (1 << 3), 0);
        assert_eq!(r.candidates(addrs[3]) & (1 << 3), 0);
        for (i, a) in addrs.iter().enumerate().filter(|(i, _)| *i != 3) {
            assert_eq!(r.find_own(*a), Some(i));
        }
    }
}
