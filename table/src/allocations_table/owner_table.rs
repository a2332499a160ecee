//! Owner tables: a thread's blocks that outlive its young ring, kept by the
//! thread in a table of its own instead of the shared index, so that the
//! thread's own free of such a block takes no shard lock and probes no
//! shared index either (issue 30's shallow loop: 4 096 blocks live per
//! thread, freed by the thread that allocated them).
//!
//! A table is [`OWNER_SETS`] sets of [`OWNER_WAYS`] entries; a block's set
//! is chosen by a hash of its address. A set is a small ring in one cache
//! line (addresses, nodes, one tag byte per entry, a head: a ring's three
//! lines per operation cost twice the misses), and every rule of
//! `young.rs` holds for its entries unchanged: only the table's owner stores a non-zero address
//! into an entry, and only while that entry is empty; an entry is claimed
//! by the one write that turns its address to 0 (the owner's own free, a
//! compare-and-swap; the owner's eviction into the index, under the
//! block's shard lock; another thread's free, a compare-and-swap under the
//! same lock); a claimant reads the entry's node after an Acquire load of
//! its address (the owner publishes node, tag, then address with Release).
//! So a reader of the nodes sees nothing new, and a free that finds the
//! block neither in its own ring, its own table nor the index looks
//! through the other rings and tables, then the index again, as for young
//! blocks.
//!
//! What differs from a ring is which entry a new block takes: an entry
//! whose tag is 0 (empty: never used, or freed by the owner, who zeroes
//! the tag; a tag of a live block is never 0, [`owner_tag`]); else the
//! entry at the set's head, which advances, its block (if still live)
//! *evicted* into the shared index exactly as a ring promotes its oldest.
//! An entry another thread freed keeps its tag until the head reaches it:
//! the owner then finds its address 0 and takes it without an eviction.
//!
//! Each table counts the inserts into it and, on a line of their own, the
//! frees other threads made of its blocks; when those are a quarter of
//! the inserts or more (a producer whose blocks its consumers free), an
//! insert answers [`OwnedInsert::FreedElsewhere`] and records nothing: such
//! frees search every ring and table, where the index would find the
//! block at once.
//!
//! Tables are claimed by a thread (the agent's policy decides when: see
//! its `young_policy`), given back at its exit, and inherited with their
//! blocks by the next claimant, as rings are. Their memory is mapped
//! (private, anonymous) when a table is first claimed, 256 KiB each, at
//! most [`OWNER_TABLES`] of them: the agent's memory, not the region's
//! (readers never look at them). A forked child forgets every table at
//! once (memory stores only), and empties them (`MADV_DONTNEED`) once it
//! knows it will record; until then none can be claimed.
//!
//! Invariants (beyond `young.rs`'s):
//! - A table's pointer, once published (Release, non-null), never changes
//!   and its memory is never unmapped, so a lookup that loaded it
//!   (Acquire) may read it at any later time.
//! - At most one thread owns a table (`owned`, claimed by compare-and-swap
//!   with Acquire, given back with Release); only the owner writes the
//!   table's `held`, `inserts` and `remote_seen` and the sets' heads and
//!   tags. `held` bounds the entries with a tag from above (the owner
//!   counts its inserts into empty entries and its own frees; another
//!   thread's free leaves the count, and the entry's tag, as they were),
//!   so a table whose `held` is 0 holds no block.

use super::*;

use std::sync::atomic::{AtomicBool, AtomicPtr};

/// Sets in an owner table (4 entries each: 16 384 blocks).
pub const OWNER_SETS: usize = 4096;
/// Entries in a set: one cache line holds them all, so an insert or a
/// free touches one line of the table.
pub const OWNER_WAYS: usize = 4;
/// Most blocks a table takes (half its entries: with addresses spread
/// evenly, a set is then full at an insert ~14 % of the time, against ~2 %
/// at a quarter: P(X >= 4) for a Poisson count of mean 2 and 1; computed,
/// not measured).
pub const OWNER_HOLDS: usize = OWNER_SETS * OWNER_WAYS / 2;
/// Owner tables a process can hand out (256 KiB each, at most 2 MiB of
/// the agent's memory).
pub const OWNER_TABLES: usize = 8;

/// One set: the addresses, nodes and tags of [`OWNER_WAYS`] entries and
/// the head (the next entry to evict), in one cache line.
#[repr(C, align(64))]
pub(super) struct OwnerSet {
    addrs: [AtomicU64; OWNER_WAYS],
    nodes: [AtomicU32; OWNER_WAYS],
    /// One byte per entry: 0 = empty, else [`owner_tag`] of its address.
    tags: AtomicU32,
    /// Owner only: the entry the next insert into a full set takes.
    head: AtomicU32,
}

/// One thread's table (see the module doc).
#[repr(C)]
pub(super) struct OwnerTable {
    /// Owner only: an upper bound of the blocks the table holds (entries
    /// with a tag), so a free skips an empty table without reading it.
    held: AtomicU64,
    /// Owner only: blocks inserted, and [`Self::remote`] when last looked
    /// at (every [`OWNER_CHECK`] inserts).
    inserts: AtomicU64,
    remote_seen: AtomicU64,
    /// Blocks of this table freed by other threads (their line, not the
    /// owner's).
    remote: RemoteCount,
    sets: [OwnerSet; OWNER_SETS],
}

/// A counter other threads add to, on a line of its own.
#[repr(C, align(64))]
struct RemoteCount(AtomicU64);

/// Inserts between two looks at how many of a table's blocks other
/// threads freed: when they freed at least a quarter as many as were
/// inserted meanwhile, the table is the wrong place for the owner's blocks
/// (each such free searches every ring and table), and the insert answers
/// [`OwnedInsert::FreedElsewhere`].
pub const OWNER_CHECK: u64 = 256;

/// A live block's tag in an owner table: never 0, which marks an empty
/// entry.
#[inline(always)]
pub(super) fn owner_tag(addr: u64) -> u8 {
    tag(addr).max(1)
}

/// The high bit of each byte of `x` that is zero (no false positives).
#[inline(always)]
fn zero_bytes32(x: u32) -> u32 {
    const LOW7: u32 = 0x7f7f_7f7f;
    !(((x & LOW7) + LOW7) | x | LOW7)
}

impl OwnerSet {
    /// Entries whose tag is `t`, as the high bit of each one's byte.
    /// Relaxed: another thread may read while the owner writes.
    #[inline(always)]
    fn matching(&self, t: u8) -> u32 {
        zero_bytes32(self.tags.load(Ordering::Relaxed) ^ (u32::from(t) * 0x0101_0101))
    }

    /// The entry among `m` (from [`Self::matching`]) that holds `addr`.
    #[inline(always)]
    fn find_among(&self, addr: u64, mut m: u32, order: Ordering) -> Option<usize> {
        while m != 0 {
            let i = m.trailing_zeros() as usize / 8;
            m &= m - 1;
            if self.addrs[i].load(order) == addr {
                return Some(i);
            }
        }
        None
    }

    /// Sets entry `i`'s tag (owner only).
    #[inline(always)]
    fn set_tag(&self, i: usize, t: u8) {
        let shift = i * 8;
        let v = self.tags.load(Ordering::Relaxed) & !(0xff << shift) | u32::from(t) << shift;
        self.tags.store(v, Ordering::Relaxed);
    }

    /// Entry `i`'s address and node words.
    #[inline(always)]
    fn entry(&self, i: usize) -> (&AtomicU64, &AtomicU32) {
        (&self.addrs[i], &self.nodes[i])
    }
}

impl OwnerTable {
    /// The set that holds `addr` (a multiplicative hash of its 16-byte
    /// granule: its top bits).
    #[inline(always)]
    fn set_of(&self, addr: u64) -> &OwnerSet {
        let s =
            (addr >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> (64 - OWNER_SETS.trailing_zeros());
        &self.sets[s as usize % OWNER_SETS]
    }
}

/// The process's owner tables (part of [`YoungRegistry`]).
#[derive(Debug)]
pub(super) struct OwnerTables {
    /// Each table's memory, null until first claimed.
    tables: [AtomicPtr<OwnerTable>; OWNER_TABLES],
    /// 1 while a thread owns the table.
    owned: [AtomicU32; OWNER_TABLES],
    /// Tables ever published: lookups across tables stop here.
    high: AtomicU32,
    /// The tables hold a parent's entries (a forked child between
    /// [`Self::forget`] and [`Self::empty_all`]): none is claimed.
    stale: AtomicBool,
}

impl OwnerTables {
    pub(super) const fn new() -> Self {
        OwnerTables {
            tables: [const { AtomicPtr::new(std::ptr::null_mut()) }; OWNER_TABLES],
            owned: [const { AtomicU32::new(0) }; OWNER_TABLES],
            high: AtomicU32::new(0),
            stale: AtomicBool::new(false),
        }
    }

    /// Table `k`, if it has memory. Acquire: its pages (zero, or as the
    /// last owner left them) before any read of them.
    #[inline(always)]
    fn get(&self, k: u32) -> Option<&OwnerTable> {
        let p = self.tables.get(k as usize)?.load(Ordering::Acquire);
        // SAFETY: a non-null pointer was published by `claim` after
        // mapping `size_of::<OwnerTable>()` bytes of zeroed memory (all
        // zero is a valid `OwnerTable`: atomics only), and is never
        // unmapped (module invariant), so the reference lives as long as
        // `self`.
        unsafe { p.as_ref() }
    }

    /// Claims a table for the calling thread, mapping its memory the
    /// first time; `None` when every table is owned or no memory could be
    /// mapped.
    pub(super) fn claim(&self) -> Option<u32> {
        if self.stale.load(Ordering::Acquire) {
            return None;
        }
        for k in 0..OWNER_TABLES {
            let owned = &self.owned[k];
            if owned.load(Ordering::Relaxed) != 0
                || owned
                    .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_err()
            {
                continue;
            }
            if self.tables[k].load(Ordering::Acquire).is_null() {
                // SAFETY: an anonymous private mapping at an address of
                // the kernel's choice touches no existing memory; the
                // result is checked.
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        std::mem::size_of::<OwnerTable>(),
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                if p == libc::MAP_FAILED {
                    owned.store(0, Ordering::Release);
                    return None;
                }
                // Release: the zeroed pages before the pointer (only the
                // owner of `owned[k]` ever stores it).
                self.tables[k].store(p.cast(), Ordering::Release);
            }
            self.high.fetch_max(k as u32 + 1, Ordering::Release);
            return Some(k as u32);
        }
        None
    }

    /// Gives table `k` back (its blocks stay in it, still found).
    pub(super) fn release(&self, k: u32) {
        if let Some(o) = self.owned.get(k as usize) {
            o.store(0, Ordering::Release);
        }
    }

    /// Frees every table and marks them all stale: none can be claimed
    /// until [`Self::empty_all`] empties them. Memory stores only (a forked
    /// child may be under a seccomp filter that kills on any other system
    /// call: it must not make one before it knows). Only in a process with
    /// one thread (a forked child, before it records anything).
    pub(super) fn forget(&self) {
        for o in &self.owned {
            o.store(0, Ordering::Relaxed);
        }
        self.high.store(0, Ordering::Release);
        self.stale.store(true, Ordering::Release);
    }

    /// Empties every table (after [`Self::forget`]): their pages read as
    /// zero again (`MADV_DONTNEED`, which also lets go of the pages a
    /// forked child shares with its parent). Only in a process with one
    /// thread.
    pub(super) fn empty_all(&self) {
        for t in &self.tables {
            let p = t.load(Ordering::Relaxed);
            if p.is_null() {
                continue;
            }
            // SAFETY: `p` is our private anonymous mapping of this size;
            // MADV_DONTNEED makes its pages read as zero (all entries
            // empty) and nobody else uses them (one thread).
            let r = unsafe {
                libc::madvise(
                    p.cast(),
                    std::mem::size_of::<OwnerTable>(),
                    libc::MADV_DONTNEED,
                )
            };
            if r != 0 {
                // Cannot happen for our own mapping; zero it by hand
                // rather than keep the parent's entries.
                // SAFETY: as above, the whole mapping is ours.
                unsafe {
                    std::ptr::write_bytes(p.cast::<u8>(), 0, std::mem::size_of::<OwnerTable>())
                };
            }
        }
        self.stale.store(false, Ordering::Release);
    }

    /// Blocks held in table `k` now (for tests and statistics).
    pub(super) fn held(&self, k: u32) -> usize {
        self.get(k).map_or(0, |t| {
            t.sets
                .iter()
                .flat_map(|s| s.addrs.iter())
                .filter(|a| a.load(Ordering::Relaxed) != 0)
                .count()
        })
    }
}

impl Drop for OwnerTables {
    /// Unmaps the tables (a registry that is not a `static`: tests).
    fn drop(&mut self) {
        for t in &self.tables {
            let p = t.load(Ordering::Relaxed);
            if !p.is_null() {
                // SAFETY: `p` is our mapping of this size (`claim`), and
                // `&mut self` means no reference into it is left.
                unsafe { libc::munmap(p.cast(), std::mem::size_of::<OwnerTable>()) };
            }
        }
    }
}

/// What an owner-table insert did besides recording the block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum OwnedInsert {
    /// The block took an empty entry.
    Kept,
    /// The block took the entry of a live block, which moved to the index
    /// (or, with no table to use, went into the index itself).
    Evicted,
    /// Nothing was recorded: the table holds [`OWNER_HOLDS`] blocks.
    Full,
    /// Nothing was recorded: other threads free many of the table's blocks
    /// (see [`OWNER_CHECK`]).
    FreedElsewhere,
}

impl AllocationsWriter<'_> {
    /// Claims an owner table of `reg` for the calling thread, which owns
    /// young ring `ring` (whose writer line counts the table's blocks);
    /// `None` when every table is taken or no memory could be mapped.
    pub fn claim_owner_table(&self, reg: &YoungRegistry, ring: u32) -> Option<u32> {
        if !self.has_line(ring) {
            return None;
        }
        reg.owners.claim()
    }

    /// Records a new live block in owner table `table` of `reg`, which the
    /// calling thread owns (and its young ring `ring`: the block is
    /// counted in that ring's writer line). The node comes from `cache`.
    /// Never allocates.
    #[inline]
    pub fn insert_owned(
        &self,
        rec: &AllocationRecord,
        reg: &YoungRegistry,
        table: u32,
        ring: u32,
        cache: &mut NodeCache,
    ) -> Result<OwnedInsert, InsertError> {
        let (Some(t), true) = (reg.owners.get(table), self.has_line(ring)) else {
            return self
                .insert_cached(rec, cache)
                .map(|()| OwnedInsert::Evicted);
        };
        let line = ring + 1;
        let Some(words) = Self::encode(rec) else {
            return Err(InsertError::Unrepresentable);
        };
        let held = t.held.load(Ordering::Relaxed);
        if held >= OWNER_HOLDS as u64 {
            // Half full: from here, more and more sets would be full too
            // and evict. The caller decides (the agent drains the table).
            return Ok(OwnedInsert::Full);
        }
        let inserts = t.inserts.load(Ordering::Relaxed) + 1;
        t.inserts.store(inserts, Ordering::Relaxed);
        if inserts % OWNER_CHECK == 0 && self.freed_elsewhere(t) {
            return Ok(OwnedInsert::FreedElsewhere);
        }
        let addr = words.1;
        let set = t.set_of(addr);
        // Empty entries (tag 0): the owner zeroed them after its own
        // claim, or nobody ever used them; either way their address is 0
        // and only this thread may store one.
        let empty = set.matching(0);
        let mut how = OwnedInsert::Kept;
        let i = if empty != 0 {
            t.held
                .store(t.held.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
            empty.trailing_zeros() as usize / 8
        } else {
            // A full set: the head's entry is taken (its count in `held`
            // passes to the new block).
            let head = set.head.load(Ordering::Relaxed);
            set.head.store(head.wrapping_add(1), Ordering::Relaxed);
            let i = head as usize % OWNER_WAYS;
            // Acquire: as in `insert_young`, a thread that claimed this
            // entry read its node before; our new node comes after.
            let old = set.addrs[i].load(Ordering::Acquire);
            if old != 0 {
                self.promote(set.entry(i), old, hash(old), line, cache);
                how = OwnedInsert::Evicted;
            }
            i
        };
        self.fill_entry(
            set.entry(i),
            || set.set_tag(i, owner_tag(addr)),
            words,
            line,
            cache,
        )?;
        Ok(how)
    }

    /// Whether other threads freed at least a quarter of [`OWNER_CHECK`]
    /// of table `t`'s blocks since the owner last asked.
    #[cold]
    #[inline(never)]
    fn freed_elsewhere(&self, t: &OwnerTable) -> bool {
        let remote = t.remote.0.load(Ordering::Relaxed);
        let since = remote.wrapping_sub(t.remote_seen.load(Ordering::Relaxed));
        t.remote_seen.store(remote, Ordering::Relaxed);
        since.saturating_mul(4) >= OWNER_CHECK
    }

    /// Moves every block of owner table `table` (the calling thread's)
    /// into the index, counted out of writer line `ring + 1`: the thread's
    /// blocks outlive its table, and its frees then skip the empty table.
    #[cold]
    #[inline(never)]
    pub fn drain_owner_table(
        &self,
        reg: &YoungRegistry,
        table: u32,
        ring: u32,
        cache: &mut NodeCache,
    ) {
        let (Some(t), true) = (reg.owners.get(table), self.has_line(ring)) else {
            return;
        };
        if t.held.load(Ordering::Relaxed) == 0 {
            return;
        }
        for set in &t.sets {
            for i in 0..OWNER_WAYS {
                let old = set.addrs[i].load(Ordering::Acquire);
                if old != 0 {
                    self.promote(set.entry(i), old, hash(old), ring + 1, cache);
                }
            }
            set.tags.store(0, Ordering::Relaxed);
        }
        t.held.store(0, Ordering::Relaxed);
    }

    /// Removes the block at `addr` if owner table `table` (the calling
    /// thread's) holds it: no lock. The free is counted in writer line
    /// `line` and the node goes to `cache`.
    #[inline(always)]
    pub(super) fn remove_owned(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        table: u32,
        line: u32,
        cache: &mut NodeCache,
    ) -> Option<Freed> {
        let t = reg.owners.get(table)?;
        let held = t.held.load(Ordering::Relaxed);
        if held == 0 {
            return None;
        }
        let set = t.set_of(addr);
        let i = set.find_among(addr, set.matching(owner_tag(addr)), Ordering::Relaxed)?;
        let node = set.nodes[i].load(Ordering::Relaxed);
        // A CAS, not a store: a double free racing on another thread must
        // not free the node twice.
        if set.addrs[i]
            .compare_exchange(addr, 0, Ordering::AcqRel, Ordering::Relaxed)
            .is_err()
        {
            return None;
        }
        set.set_tag(i, 0);
        t.held.store(held - 1, Ordering::Relaxed);
        let f = self.free_young_node(node, line, cache);
        self.live_changed(Some(cache), -(f.size as i64));
        Some(f)
    }

    /// Looks for `addr` in every owner table but `own` and frees it there
    /// (see `young.rs`'s `remove_elsewhere`, which calls this after the
    /// other rings). `Err(())`: found, but its owner evicted it first (it
    /// is in the index now).
    #[inline(never)]
    pub(super) fn remove_from_other_tables(
        &self,
        addr: u64,
        reg: &YoungRegistry,
        own: Option<u32>,
        line: u32,
        cache: &mut NodeCache,
    ) -> Result<Option<Freed>, ()> {
        let high = (reg.owners.high.load(Ordering::Acquire) as usize).min(OWNER_TABLES);
        let t8 = owner_tag(addr);
        for k in 0..high as u32 {
            if Some(k) == own {
                continue;
            }
            let Some(t) = reg.owners.get(k) else {
                continue;
            };
            // An empty table (drained, or never used) holds nothing: skip
            // its set's line. `held` is at least 1 from the insert of a
            // block this thread was handed (that insert happened before)
            // until the owner drains it, which moves it to the index first.
            if t.held.load(Ordering::Relaxed) == 0 {
                continue;
            }
            let set = t.set_of(addr);
            let Some(i) = set.find_among(addr, set.matching(t8), Ordering::Acquire) else {
                continue;
            };
            let Some(f) = self.claim_elsewhere(set.entry(i), addr, line, cache) else {
                return Err(());
            };
            t.remote.0.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(f));
        }
        Ok(None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(capacity: u64) -> RegionWriter {
        AllocationsWriter::create_region(AllocationsConfig {
            capacity,
            shards: 2,
        })
        .unwrap()
    }

    fn rec(address: u64, size: u64) -> AllocationRecord {
        AllocationRecord {
            address,
            size,
            stack: ResourceKey(8),
            thread: ResourceKey(16),
            timestamp_us: 1,
        }
    }

    #[test]
    fn a_full_set_evicts_its_head_into_the_index_and_every_block_is_found() {
        let r = region(1024);
        let w = AllocationsWriter::new(&r).unwrap();
        let reg = Box::new(YoungRegistry::new());
        let k = w.claim_young(&reg).unwrap();
        let t = w.claim_owner_table(&reg, k).unwrap();
        let table = reg.owners.get(t).unwrap();
        // Five addresses of one set.
        let first = 0x7f00_0000_0000u64;
        let set = table.set_of(first) as *const OwnerSet;
        let same: Vec<u64> = (0..)
            .map(|j| first + j * 16)
            .filter(|a| std::ptr::eq(table.set_of(*a), set))
            .take(OWNER_WAYS + 1)
            .collect();
        let mut cache = NodeCache::new();
        for (j, a) in same.iter().enumerate() {
            let how = w.insert_owned(&rec(*a, j as u64 + 1), &reg, t, k, &mut cache);
            let want = if j < OWNER_WAYS {
                OwnedInsert::Kept
            } else {
                OwnedInsert::Evicted
            };
            assert_eq!(how, Ok(want), "insert {j}");
        }
        assert_eq!(reg.held_in_owner_table(t), OWNER_WAYS);
        // The first block (the head) went to the index; the owner finds
        // it there, another thread finds the others in the table.
        let f = w
            .remove_any_owned(same[0], &reg, Some(k), Some((t, k)), &mut cache)
            .unwrap();
        assert_eq!(f.size, 1);
        for (j, a) in same.iter().enumerate().skip(1) {
            let f = w.remove_any(*a, &reg, None, &mut cache).unwrap();
            assert_eq!(f.size, j as u64 + 1);
            assert_eq!(w.remove_any(*a, &reg, None, &mut cache), None);
        }
        assert_eq!(reg.held_in_owner_table(t), 0);
        // Entries freed by another thread are taken again by the owner.
        for (j, a) in same.iter().enumerate().take(OWNER_WAYS) {
            assert!(w
                .insert_owned(&rec(*a, 10 + j as u64), &reg, t, k, &mut cache)
                .is_ok());
        }
        assert_eq!(reg.held_in_owner_table(t), OWNER_WAYS);
    }

    #[test]
    fn a_table_takes_at_most_half_its_entries() {
        let r = region(1 << 16);
        let w = AllocationsWriter::new(&r).unwrap();
        let reg = Box::new(YoungRegistry::new());
        let k = w.claim_young(&reg).unwrap();
        let t = w.claim_owner_table(&reg, k).unwrap();
        let mut cache = NodeCache::new();
        let mut kept = 0;
        for j in 0..(OWNER_HOLDS as u64 + 10) {
            let how = w
                .insert_owned(&rec(0x10_0000 + j * 48, 8), &reg, t, k, &mut cache)
                .unwrap();
            if how == OwnedInsert::Full {
                break;
            }
            kept += 1;
        }
        assert_eq!(kept, OWNER_HOLDS);
        w.drain_owner_table(&reg, t, k, &mut cache);
        assert_eq!(reg.held_in_owner_table(t), 0);
        // Drained blocks are in the index.
        for j in 0..OWNER_HOLDS as u64 {
            assert!(w
                .remove_any(0x10_0000 + j * 48, &reg, None, &mut cache)
                .is_some());
        }
    }

    #[test]
    fn a_table_whose_blocks_other_threads_free_refuses_more() {
        let r = region(1 << 14);
        let w = AllocationsWriter::new(&r).unwrap();
        let reg = Box::new(YoungRegistry::new());
        let k = w.claim_young(&reg).unwrap();
        let t = w.claim_owner_table(&reg, k).unwrap();
        let mut owner = NodeCache::new();
        let mut other = NodeCache::new();
        // The owner frees its own blocks: never refused.
        for j in 0..4 * OWNER_CHECK {
            let a = 0x20_0000 + j * 64;
            assert_eq!(
                w.insert_owned(&rec(a, 8), &reg, t, k, &mut owner),
                Ok(OwnedInsert::Kept)
            );
            assert!(w
                .remove_any_owned(a, &reg, Some(k), Some((t, k)), &mut owner)
                .is_some());
        }
        // Another thread frees one block in three: refused at the next look.
        let mut refused = None;
        for j in 0..2 * OWNER_CHECK {
            let a = 0x40_0000 + j * 64;
            match w.insert_owned(&rec(a, 8), &reg, t, k, &mut owner) {
                Ok(OwnedInsert::FreedElsewhere) => {
                    refused = Some(j);
                    break;
                }
                Ok(OwnedInsert::Kept) => {}
                other => panic!("{other:?}"),
            }
            let (who, own) = if j % 3 == 0 {
                (&mut other, None)
            } else {
                (&mut owner, Some((t, k)))
            };
            assert!(w.remove_any_owned(a, &reg, None, own, who).is_some());
        }
        let j = refused.expect("never refused");
        assert!(j < OWNER_CHECK, "refused only at insert {j}");
    }
}
