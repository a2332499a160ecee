//! The live-allocations table: one record per live heap block.
//!
//! Layout (after the header page):
//! `[shards: shard_count x 64 B][index windows][nodes: node_capacity x 32 B]`.
//! `layout[0]` shard count (power of two), `[1]` shards offset, `[2]` slots
//! per index window (power of two, >= 1024), `[3]` index offset, `[4]` nodes
//! offset, `[5]` node capacity. Dynamic word `KIND_WORDS+0` is the node
//! high-water mark (nodes handed out so far).
//!
//! **Nodes** are what readers read. A node is 4 words:
//! `w0 = seq | thread_key/8 << 32`, `w1 = address` (0 = free),
//! `w2 = size (48 bits) | timestamp_us >> 32 << 48`,
//! `w3 = stack_key/8 | (timestamp_us & 0xffff_ffff) << 32`
//! (for a free node `w3` holds the next free node + 1).
//! A live block keeps the same node from insert to remove, so a reader that
//! scans the node array once sees each block that stays live exactly once.
//!
//! **Shards** (64 bytes, one cache line, so writers on different shards
//! never share a line) are chosen by address: a *group* of shards by the
//! address's 64 MiB range (glibc gives each thread's arena heaps of that
//! size, so threads mostly write disjoint shards and a shard's lines stay in
//! one core's cache), a shard within the group by a hash of the address.
//! When a shard's index is at its largest and full, the block goes to its
//! *spill shard* (chosen by the hash alone, over the whole table) and the
//! home shard is marked as having spilled (`S_SPILLED`, never cleared);
//! lookups that miss in a spilled shard look in the spill shard too. The
//! choice of shard is the writers' business only.
//!
//! Each shard holds a writer spin lock, a free-node list, and an
//! open-addressed index (linear probing, tombstones) of `u32` slots
//! `tag << 27 | node + 1` mapping addresses to nodes, and the shard's share
//! of the process-wide counters (live blocks = index length, total
//! allocations and bytes at bytes 24 and 32, live bytes at 40), written
//! under the lock with plain stores so the allocation path hits no shared
//! counter. [`crate::header::read_counters`] sums them. A removal leaves a
//! tombstone only when a probe sequence may run through the slot (the next
//! slot is not empty); otherwise the slot, and the tombstones just before
//! it, become empty again. The index lives in one of two per-shard
//! windows; it grows and shrinks by rehashing into the other window and
//! returning the old window's pages (`MADV_REMOVE`), so index memory
//! follows the live count. Readers read only the shards' counters, never
//! their locks or indexes.
//!
//! **Direct blocks.** A writer that can keep a block's node number with
//! the block itself (the Rust `Agent` puts it in a header before each
//! block) inserts with [`AllocationsWriter::insert_direct`] and removes
//! with [`AllocationsWriter::remove_direct`]: the node is written and
//! counted under the home shard's lock as usual, but no index slot is used,
//! so a free costs no index probe. Such blocks are invisible to address
//! lookups (`remove`, `replace`, duplicate checks); a writer uses one mode
//! per block. Readers see no difference.
//!
//! Invariants:
//! - A node's words change only under its shard's lock, always inside a
//!   seqlock write: `seq` made odd, a Release fence, the words, then `seq`
//!   made even with a Release store. A reader accepts a node only between
//!   two equal even readings of `seq` (Acquire fence between data and the
//!   second reading), so it never reports a torn record.
//! - Writers never wait on readers; readers never write. A reader's walk
//!   is bounded by the node capacity from the validated layout; it retries
//!   a changing node a bounded number of times and otherwise reports the
//!   walk as partial (a target killed inside an update leaves `seq` odd).
//! - The index always keeps at least one empty slot per window, so every
//!   probe sequence ends; probes are also bounded by the capacity.
//! - Node memory is proportional to the peak number of live blocks (free
//!   nodes are reused, per shard); index memory to the current number.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::error::TableError;
use crate::header::{
    offsets, parse_header, read_counters, Counters, DroppedReason, HeaderCounters, RegionKind,
    HEADER_SIZE,
};
use crate::region::{RegionReader, RegionWriter};
use crate::resources_table::ResourceKey;
use crate::shared_view::SharedView;

const NODE_SIZE: u64 = 32;
const SHARD_SIZE: u64 = 64;
/// Smallest index window in use: one page of `u32` slots. A window's first
/// page is never returned to the system, so small shards rehash (clearing
/// tombstones) without a system call or a page fault.
const MIN_CAP_LOG2: u32 = 10;
const EMPTY: u32 = 0;
const TOMBSTONE: u32 = u32::MAX;
const NODE_BITS: u32 = 27;
/// Largest node capacity the index encoding allows.
pub const MAX_NODES: u64 = (1 << NODE_BITS) - 2;
const NODE_MASK: u32 = (1 << NODE_BITS) - 1;
const CHUNK: u32 = 16;
const SIZE_MASK: u64 = (1 << 48) - 1;
const W_NODE_HW: u64 = offsets::KIND_WORDS;

// Shard field offsets (each a u32).
const S_LOCK: u64 = 0;
const S_WINDOW: u64 = 4;
const S_CAP_LOG2: u64 = 8;
const S_LEN: u64 = 12;
const S_TOMBS: u64 = 16;
const S_FREE: u64 = 20;
// Per-shard cumulative counters (u64, written under the shard lock, read
// racily by readers and summed over shards).
const S_TOTAL_ALLOCS: u64 = 24;
const S_TOTAL_BYTES: u64 = 32;
// Live bytes of the shard (u64, under the shard lock): summed by readers,
// so the allocation path touches no process-wide live counter.
const S_LIVE_BYTES: u64 = 40;
// Writers only (u32, set under the shard lock, never cleared): this shard
// once had no index room for a block of its address group, which then went
// to its spill shard; lookups that miss here must look there too.
const S_SPILLED: u64 = 48;
// Writers only (u32, under the shard lock): live blocks of the shard
// inserted *direct* (found by node, not through the index; see
// [`AllocationsWriter::insert_direct`]). `S_LEN` counts every live block
// (readers sum it); the index holds `S_LEN - S_DIRECT` of them.
const S_DIRECT: u64 = 52;
/// Addresses in one aligned range of this size share a shard group: glibc
/// gives each thread's arena heaps of 64 MiB, aligned, so threads mostly
/// write disjoint shards (their lock, counters and index lines stay in one
/// core's cache).
const GROUP_SHIFT: u32 = 26;

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
    nodes: [u32; NODE_CACHE],
    len: usize,
    pending_live: i64,
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

    fn pop(&mut self) -> Option<u32> {
        if self.len == 0 {
            return None;
        }
        self.len -= 1;
        Some(self.nodes[self.len])
    }

    fn push(&mut self, node: u32) -> bool {
        if self.len == NODE_CACHE {
            return false;
        }
        self.nodes[self.len] = node;
        self.len += 1;
        true
    }
}

impl Default for NodeCache {
    fn default() -> Self {
        Self::new()
    }
}

/// One live block, as stored and as reported.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct AllocationRecord {
    /// Block address (never 0).
    pub address: u64,
    /// Block size in bytes (at most 2^48 - 1).
    pub size: u64,
    /// Stack trace key in the resources region.
    pub stack: ResourceKey,
    /// Thread record key in the resources region.
    pub thread: ResourceKey,
    /// Microseconds since the region's monotonic clock base (48 bits).
    pub timestamp_us: u64,
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
enum Locked {
    /// The address is already in this shard.
    Duplicate,
    /// The shard's index has no room (at its largest window).
    IndexFull,
    /// No node left anywhere.
    NoNode,
}

/// Sizing of an allocations region.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AllocationsConfig {
    /// Most live blocks the region can hold (nodes). Nodes are handed to
    /// shards in chunks of 16 and freed nodes stay with their shard, so
    /// when nearly full, up to 15 nodes per shard may be unusable by other
    /// shards: size with a margin of `16 * shards`.
    pub capacity: u64,
    /// Number of shards (power of two); more shards, less writer contention.
    pub shards: u64,
}

impl Default for AllocationsConfig {
    fn default() -> Self {
        AllocationsConfig {
            capacity: 16 << 20,
            shards: 256,
        }
    }
}

#[derive(Clone, Copy, Debug)]
struct Layout {
    shards: u64,
    shards_off: u64,
    slots_max: u64,
    index_off: u64,
    nodes_off: u64,
    capacity: u64,
}

fn page_up(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

impl Layout {
    fn new(cfg: AllocationsConfig) -> Result<(Self, u64), TableError> {
        let shards = cfg.shards;
        if !shards.is_power_of_two() || !(1..=65536).contains(&shards) {
            return Err(TableError::CorruptHeader(
                "shard count must be a power of two from 1 to 65536".into(),
            ));
        }
        if cfg.capacity == 0 || cfg.capacity > MAX_NODES {
            return Err(TableError::TooLarge("capacity must be 1..=2^27-2 blocks"));
        }
        // Room for twice the average share of each shard: hashing spreads
        // addresses evenly, and the 7/8 hard load limit adds more headroom.
        let per_shard = cfg.capacity.div_ceil(shards);
        let slots_max = (per_shard * 2).next_power_of_two().max(1024);
        let shards_off = HEADER_SIZE;
        let index_off = page_up(shards_off + shards * SHARD_SIZE);
        let nodes_off = page_up(index_off + shards * 2 * slots_max * 4);
        let end = page_up(nodes_off + cfg.capacity * NODE_SIZE);
        let l = Layout {
            shards,
            shards_off,
            slots_max,
            index_off,
            nodes_off,
            capacity: cfg.capacity,
        };
        l.check(end)?;
        Ok((l, end))
    }

    fn from_header(w: &[u64; 8], region_size: u64) -> Result<Self, TableError> {
        let l = Layout {
            shards: w[0],
            shards_off: w[1],
            slots_max: w[2],
            index_off: w[3],
            nodes_off: w[4],
            capacity: w[5],
        };
        l.check(region_size)?;
        Ok(l)
    }

    fn check(&self, region_size: u64) -> Result<(), TableError> {
        let bad = |m: &str| {
            Err(TableError::CorruptHeader(format!(
                "allocations layout: {m}"
            )))
        };
        if !self.shards.is_power_of_two() || self.shards > 65536 {
            return bad("shard count");
        }
        if !self.slots_max.is_power_of_two() || self.slots_max < 1024 || self.slots_max > 1 << 32 {
            return bad("index window size");
        }
        if self.capacity == 0 || self.capacity > MAX_NODES {
            return bad("node capacity");
        }
        if self.shards_off != HEADER_SIZE
            || self.index_off < self.shards_off + self.shards * SHARD_SIZE
            || self.index_off % 4096 != 0
        {
            return bad("shard array placement");
        }
        // Every field is untrusted: no arithmetic may overflow. shards <=
        // 2^16 and slots_max <= 2^32 (checked above), so the product fits.
        let index_fits = match (self.shards * 2 * self.slots_max * 4).checked_add(self.index_off) {
            Some(index_end) => self.nodes_off >= index_end,
            None => false,
        };
        if !index_fits || self.nodes_off % 4096 != 0 {
            return bad("index placement");
        }
        match (self.capacity * NODE_SIZE).checked_add(self.nodes_off) {
            Some(end) if end <= region_size => Ok(()),
            _ => bad("nodes do not fit in the region"),
        }
    }

    fn words(&self) -> [u64; 8] {
        [
            self.shards,
            self.shards_off,
            self.slots_max,
            self.index_off,
            self.nodes_off,
            self.capacity,
            0,
            0,
        ]
    }
}

#[inline]
fn hash(addr: u64) -> u64 {
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
    address: u64,
    hash: u64,
}

/// Writer handle for this process's allocations table.
#[derive(Clone, Copy, Debug)]
pub struct AllocationsWriter<'a> {
    view: SharedView,
    layout: Layout,
    /// `shards - 1`: the shard is the top 16 bits of the hash, masked
    /// (shards <= 2^16, so they never overlap the slot and tag bits below
    /// bit 37).
    shard_mask: u64,
    /// log2 of the index window size (the largest capacity).
    max_cap_log2: u32,
    /// Shard groups are `2^group_bits` (half the shard bits, rounded down);
    /// each group has `sub_mask + 1` shards.
    group_bits: u32,
    sub_bits: u32,
    sub_mask: u64,
    region: &'a RegionWriter,
    counters: HeaderCounters,
}

struct ShardGuard<'w> {
    lock: &'w AtomicU32,
}

impl Drop for ShardGuard<'_> {
    fn drop(&mut self) {
        // Release: everything written under the lock is visible to the
        // next writer that acquires it.
        self.lock.store(0, Ordering::Release);
    }
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
    fn u32_at(&self, off: u64) -> &AtomicU32 {
        // SAFETY: every writer offset is computed from the layout validated
        // in `new` (shard < shards, window < 2, slot < cap <= slots_max,
        // node < capacity, fixed field offsets), which `Layout::check`
        // proved lies inside the region, and is 4-aligned by construction.
        unsafe { self.view.atomic_u32_unchecked(off) }
    }

    #[inline]
    fn u64_at(&self, off: u64) -> &AtomicU64 {
        // SAFETY: as in `u32_at`, 8-aligned by construction.
        unsafe { self.view.atomic_u64_unchecked(off) }
    }

    /// The shard a block at `addr` (hash `h`) lives in: a group chosen by
    /// the address's 64 MiB range, a shard in the group by the hash.
    #[inline]
    fn home_shard(&self, addr: u64, h: u64) -> u64 {
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
    fn spill_shard(&self, addr: u64, h: u64) -> u64 {
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
    fn spilled(&self, shard: u64) -> bool {
        self.shard_field(shard, S_SPILLED).load(Ordering::Relaxed) != 0
    }

    #[inline]
    fn shard_field(&self, shard: u64, field: u64) -> &AtomicU32 {
        self.u32_at(self.layout.shards_off + shard * SHARD_SIZE + field)
    }

    /// Adds 1 to (or subtracts 1 from) a u32 shard field and returns the new
    /// value. Caller holds the shard lock, so a load and a store suffice
    /// (no locked instruction).
    #[inline]
    fn bump_locked(&self, shard: u64, field: u64, op: fn(u32, u32) -> u32) -> u32 {
        let f = self.shard_field(shard, field);
        let v = op(f.load(Ordering::Relaxed), 1);
        f.store(v, Ordering::Relaxed);
        v
    }

    /// Counts one allocation of `size` bytes in the shard's cumulative
    /// counters. Caller holds the shard lock.
    #[inline]
    fn count_alloc_locked(&self, shard: u64, size: u64) {
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
    fn lock(&self, shard: u64) -> ShardGuard<'_> {
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
    fn lock_contended(lock: &AtomicU32) -> ShardGuard<'_> {
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

    #[inline]
    fn slot(&self, shard: u64, window: u32, i: u64) -> &AtomicU32 {
        let w = shard * 2 + u64::from(window);
        self.u32_at(self.layout.index_off + (w * self.layout.slots_max + i) * 4)
    }

    #[inline]
    fn node_word(&self, node: u32, w: u64) -> &AtomicU64 {
        // Node numbers are read back from the region (index slots, free
        // lists). Only this process writes them, but clamping keeps even a
        // region scribbled over by a wild write in the program in bounds
        // (one conditional move).
        debug_assert!(u64::from(node) < self.layout.capacity);
        let node = u64::from(node).min(self.layout.capacity - 1);
        self.u64_at(self.layout.nodes_off + node * NODE_SIZE + w * 8)
    }

    #[inline]
    fn node_addr(&self, node: u32) -> u64 {
        self.node_word(node, 1).load(Ordering::Relaxed)
    }

    /// Seqlock write of a node's four words.
    #[inline]
    fn write_node(&self, node: u32, thread32: u32, w1: u64, w2: u64, w3: u64) {
        let w0 = self.node_word(node, 0);
        let cur = w0.load(Ordering::Relaxed);
        let seq = cur as u32;
        let old_thread = cur & !0xffff_ffff;
        // Make seq odd first; the Release fence orders it before the data
        // stores, so a reader that sees new data also sees a changed seq.
        w0.store(old_thread | u64::from(seq | 1), Ordering::Relaxed);
        fence(Ordering::Release);
        self.node_word(node, 1).store(w1, Ordering::Relaxed);
        self.node_word(node, 2).store(w2, Ordering::Relaxed);
        self.node_word(node, 3).store(w3, Ordering::Relaxed);
        // Release: data stores happen-before the even seq a reader acquires.
        let next = (seq | 1).wrapping_add(1);
        w0.store(
            u64::from(thread32) << 32 | u64::from(next),
            Ordering::Release,
        );
    }

    fn tag(h: u64) -> u32 {
        ((h >> 32) & 0x1f) as u32
    }

    /// Probes for `addr`; returns (slot index, node) if found.
    fn find(&self, shard: u64, window: u32, cap: u64, h: u64, addr: u64) -> Option<(u64, u32)> {
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
    fn probe_for_insert(
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
    fn free_slot(&self, shard: u64, window: u32, cap: u64, h: u64) -> Option<u64> {
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
    fn cap_log2(&self, shard: u64) -> u32 {
        self.shard_field(shard, S_CAP_LOG2)
            .load(Ordering::Relaxed)
            .clamp(MIN_CAP_LOG2, self.max_cap_log2)
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
    fn window(&self, shard: u64) -> u32 {
        self.shard_field(shard, S_WINDOW).load(Ordering::Relaxed) & 1
    }

    /// Rehashes `shard` into its other window with room for `need` entries.
    /// Caller holds the lock. Returns false if `need` cannot fit.
    #[cold]
    #[inline(never)]
    fn rehash(&self, shard: u64, need: u64) -> bool {
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

    /// Takes a free node for `shard` (caller holds the lock).
    #[cold]
    #[inline(never)]
    fn take_node(&self, shard: u64) -> Option<u32> {
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

    fn encode(rec: &AllocationRecord) -> Option<(u32, u64, u64, u64)> {
        let sk = rec.stack.0;
        let tk = rec.thread.0;
        if rec.address == 0 || sk % 8 != 0 || tk % 8 != 0 || sk >> 35 != 0 || tk >> 35 != 0 {
            return None;
        }
        let ts = rec.timestamp_us & SIZE_MASK;
        let w2 = rec.size.min(SIZE_MASK) | (ts >> 32) << 48;
        let w3 = (sk / 8) | (ts & 0xffff_ffff) << 32;
        Some(((tk / 8) as u32, rec.address, w2, w3))
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
    fn insert_impl(
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

    /// Whether `addr` is recorded in the spill shard of `home` (out of
    /// line: only shards that ever spilled get here).
    #[cold]
    #[inline(never)]
    fn in_spill_shard(&self, home: u64, h: u64, addr: u64) -> bool {
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
    fn insert_spilled(
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
    fn remove_spilled(
        &self,
        home: u64,
        h: u64,
        addr: u64,
        keep: bool,
    ) -> Option<(u64, Option<u32>)> {
        let spill = self.spill_shard(addr, h);
        if spill == home {
            return None;
        }
        let _g = self.lock(spill);
        self.remove_locked(spill, h, addr, keep)
    }

    /// Adjusts the shard's live bytes. Caller holds the shard lock.
    #[inline]
    fn add_live_locked(&self, shard: u64, add: u64, sub: u64) {
        let f = self.u64_at(self.layout.shards_off + shard * SHARD_SIZE + S_LIVE_BYTES);
        f.store(
            f.load(Ordering::Relaxed)
                .wrapping_add(add)
                .wrapping_sub(sub),
            Ordering::Relaxed,
        );
    }

    /// Folds a live-bytes change into the header's running total: at once
    /// without a cache, in batches of [`LIVE_BATCH`] with one.
    #[inline]
    fn live_changed(&self, cache: Option<&mut NodeCache>, delta: i64) {
        match cache {
            None => {
                if delta >= 0 {
                    self.counters.live_bytes_changed(delta as u64, 0)
                } else {
                    self.counters.live_bytes_changed(0, delta.unsigned_abs())
                }
            }
            Some(c) => {
                c.pending_live = c.pending_live.wrapping_add(delta);
                if c.pending_live >= LIVE_BATCH || c.pending_live <= -LIVE_BATCH {
                    let p = std::mem::take(&mut c.pending_live);
                    self.live_changed(None, p);
                }
            }
        }
    }

    /// Returns the cache's nodes to the shared free lists and settles its
    /// pending live bytes. Call when the owning thread exits.
    pub fn flush_cache(&self, cache: &mut NodeCache) {
        while let Some(node) = cache.pop() {
            let shard = u64::from(node) & (self.layout.shards - 1);
            let _g = self.lock(shard);
            let free = self.shard_field(shard, S_FREE);
            self.write_node(node, 0, 0, 0, u64::from(free.load(Ordering::Relaxed)));
            free.store(node + 1, Ordering::Relaxed);
        }
        let p = std::mem::take(&mut cache.pending_live);
        if p != 0 {
            self.live_changed(None, p);
        }
    }

    #[allow(clippy::too_many_arguments)] // the encoded record's words
    #[inline(always)]
    fn insert_locked(
        &self,
        shard: u64,
        h: u64,
        t32: u32,
        w1: u64,
        w2: u64,
        w3: u64,
        pre: Option<u32>,
    ) -> Result<(), Locked> {
        let mut cap = 1u64 << self.cap_log2(shard);
        let mut win = self.window(shard);
        // One probe finds a duplicate or the slot to use.
        let mut free = match self.probe_for_insert(shard, win, cap, h, w1) {
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
        let Some(i) = free else {
            return Err(Locked::IndexFull);
        };
        let node = match pre {
            Some(n) => n,
            None => match self.take_node(shard) {
                Some(n) => n,
                None => return Err(Locked::NoNode),
            },
        };
        self.write_node(node, t32, w1, w2, w3);
        let slot = self.slot(shard, win, i);
        if slot.load(Ordering::Relaxed) == TOMBSTONE {
            self.bump_locked(shard, S_TOMBS, u32::wrapping_sub);
        }
        slot.store(Self::tag(h) << NODE_BITS | (node + 1), Ordering::Relaxed);
        self.bump_locked(shard, S_LEN, u32::wrapping_add);
        Ok(())
    }

    /// Empties slot `i` of a linear-probing window. If the next slot is
    /// empty, no probe sequence runs through `i`, so it becomes empty
    /// rather than a tombstone, and so do the tombstones just before it.
    /// This keeps tombstones (and the rehashes that clear them, which read
    /// every live node) rare. Caller holds the lock.
    fn clear_slot(&self, shard: u64, win: u32, cap: u64, i: u64) {
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

    /// Removes `addr`; returns its size and, when `keep_node`, the freed
    /// node (marked free but not put on the shard's free list).
    #[inline(always)]
    fn remove_locked(
        &self,
        shard: u64,
        h: u64,
        addr: u64,
        keep_node: bool,
    ) -> Option<(u64, Option<u32>)> {
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
    fn free_node_locked(&self, shard: u64, node: u32, keep_node: bool) -> (u64, Option<u32>) {
        let size = self.node_word(node, 2).load(Ordering::Relaxed) & SIZE_MASK;
        let kept = if keep_node {
            self.write_node(node, 0, 0, 0, 0);
            Some(node)
        } else {
            let free = self.shard_field(shard, S_FREE);
            self.write_node(node, 0, 0, 0, u64::from(free.load(Ordering::Relaxed)));
            free.store(node + 1, Ordering::Relaxed);
            None
        };
        self.add_live_locked(shard, 0, size);
        self.bump_locked(shard, S_LEN, u32::wrapping_sub);
        (size, kept)
    }

    /// Entries of the shard's index: its live blocks less the direct ones.
    /// Caller holds the lock.
    #[inline]
    fn index_len(&self, shard: u64) -> u64 {
        let len = self.shard_field(shard, S_LEN).load(Ordering::Relaxed);
        let direct = self.shard_field(shard, S_DIRECT).load(Ordering::Relaxed);
        u64::from(len.saturating_sub(direct))
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
        if addr == 0 || u64::from(node) >= self.layout.capacity {
            return None;
        }
        let home = self.home_shard(addr, hash(addr));
        let keep = cache.len < NODE_CACHE;
        let (size, kept) = {
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
        self.live_changed(Some(cache), -(size as i64));
        Some(size)
    }

    /// Removes the block at `addr`, returning its size, or `None` if the
    /// table does not hold it. Never allocates.
    pub fn remove(&self, addr: u64) -> Option<u64> {
        self.remove_impl(addr, None)
    }

    /// [`Self::remove`] keeping the freed node in the calling thread's
    /// `cache` (for its next insert) and settling live bytes there.
    pub fn remove_cached(&self, addr: u64, cache: &mut NodeCache) -> Option<u64> {
        self.remove_impl(addr, Some(cache))
    }

    #[inline]
    fn remove_impl(&self, addr: u64, mut cache: Option<&mut NodeCache>) -> Option<u64> {
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
        let (size, kept) = r?;
        if let (Some(node), Some(c)) = (kept, cache.as_mut()) {
            c.push(node);
        }
        self.live_changed(cache, -(size as i64));
        Some(size)
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
                self.counters.live_bytes_changed(rec.size.min(SIZE_MASK), s);
                Ok(Some(s))
            }
            None => self.insert(rec).map(|()| None),
        }
    }
}

/// Adds the per-shard counters of an allocations region (live blocks,
/// total allocations and bytes) to `c`. Does nothing when the header or
/// layout does not validate. Bounded by the shard count (at most 2^16).
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

/// Most nodes a walk puts aside for a patient second look.
pub const WALK_MAX_DEFERRED: usize = 1024;
/// Total retries a walk spends on nodes that were changing.
pub const WALK_RETRY_BUDGET: u32 = 200_000;
/// Longest a walk spends re-reading nodes that were changing.
pub const WALK_RETRY_TIME: std::time::Duration = std::time::Duration::from_millis(500);

/// The outcome of a walk over the live table.
#[derive(Clone, Debug, Default)]
pub struct WalkStats {
    /// Nodes examined (the high-water mark at the start of the walk).
    pub nodes: u64,
    /// Live records reported.
    pub reported: u64,
    /// Nodes that never read consistently (writer mid-update the whole
    /// time, or killed mid-update).
    pub unstable: u64,
}

impl WalkStats {
    /// Why the walk is incomplete, if it is.
    pub fn partial_reason(&self) -> Option<String> {
        (self.unstable > 0).then(|| {
            format!(
                "{} record(s) were being modified throughout the walk (target killed mid-update, or hostile)",
                self.unstable
            )
        })
    }
}

/// Read-only access to an allocations region (the dumper's side).
#[derive(Clone, Copy, Debug)]
pub struct AllocationsReader<'a> {
    view: SharedView,
    layout: Layout,
    _region: std::marker::PhantomData<&'a ()>,
}

enum NodeRead {
    Free,
    Live(AllocationRecord),
    Changing,
}

impl<'a> AllocationsReader<'a> {
    /// Validates the layout of a mapped allocations region.
    pub fn new(region: &'a RegionReader) -> Result<Self, TableError> {
        let h = region.header();
        if region.kind() != RegionKind::Allocations {
            return Err(TableError::WrongKind {
                found: h.kind,
                expected: RegionKind::Allocations as u32,
            });
        }
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(AllocationsReader {
            view: region.view(),
            layout,
            _region: std::marker::PhantomData,
        })
    }

    /// Reads any bytes as an allocations region (fuzzing, tests).
    ///
    /// # Safety
    /// `view` must stay mapped for `'a`.
    pub unsafe fn from_view(view: SharedView) -> Result<Self, TableError> {
        let h = parse_header(&view, RegionKind::Allocations)?;
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(AllocationsReader {
            view,
            layout,
            _region: std::marker::PhantomData,
        })
    }

    /// The process-wide counters in this region's header.
    pub fn counters(&self) -> Counters {
        read_counters(&self.view)
    }

    /// Capacity in blocks.
    pub fn capacity(&self) -> u64 {
        self.layout.capacity
    }

    #[inline]
    fn read_node(&self, i: u64) -> NodeRead {
        let base = self.layout.nodes_off + i * NODE_SIZE;
        // All four words lie inside the validated node area.
        let ld = |w: u64| self.view.load_u64(base + w * 8).unwrap_or(0);
        let a = ld(0);
        fence(Ordering::Acquire);
        if a & 1 == 1 {
            return NodeRead::Changing;
        }
        let w1 = ld(1);
        let w2 = ld(2);
        let w3 = ld(3);
        // Acquire fence: the data loads above complete before the second
        // seq reading, so equal even readings mean no writer intervened.
        fence(Ordering::Acquire);
        if ld(0) != a {
            return NodeRead::Changing;
        }
        if w1 == 0 {
            return NodeRead::Free;
        }
        NodeRead::Live(AllocationRecord {
            address: w1,
            size: w2 & SIZE_MASK,
            stack: ResourceKey((w3 & 0xffff_ffff) * 8),
            thread: ResourceKey((a >> 32) * 8),
            timestamp_us: (w2 >> 48) << 32 | w3 >> 32,
        })
    }

    /// Reads node `i` up to `tries` times; spins for the first
    /// `spin_tries`, then yields the CPU between tries (a writer preempted
    /// mid-update needs it). Returns the outcome and the tries used.
    ///
    /// Yielding stops at `deadline`: on a loaded machine one `yield_now`
    /// can cost a whole scheduler slice, so a try count alone would not
    /// bound the time spent on a node that never settles.
    fn read_node_retrying(
        &self,
        i: u64,
        tries: u32,
        spin_tries: u32,
        deadline: Option<std::time::Instant>,
    ) -> (NodeRead, u32) {
        for attempt in 0..tries {
            match self.read_node(i) {
                NodeRead::Changing => {
                    if attempt < spin_tries {
                        std::hint::spin_loop();
                    } else if deadline.is_some_and(|d| std::time::Instant::now() >= d) {
                        return (NodeRead::Changing, attempt + 1);
                    } else {
                        std::thread::yield_now();
                    }
                }
                r => return (r, attempt + 1),
            }
        }
        (NodeRead::Changing, tries)
    }

    /// Calls `f` for every live record, each read consistently. Never
    /// blocks the writers; bounded by the node capacity. Nodes that keep
    /// changing are retried once more at the end (giving a descheduled
    /// writer time to finish) and otherwise counted as `unstable`.
    ///
    /// Every retry is bounded: a first pass spins briefly on a changing
    /// node; at most [`WALK_MAX_DEFERRED`] nodes are put aside for a
    /// patient second look, which has a total budget of
    /// [`WALK_RETRY_BUDGET`] tries and [`WALK_RETRY_TIME`] of wall time.
    /// So a region whose nodes all look mid-update (a target killed at the
    /// wrong moment, or hostile bytes) costs one quick pass, not a hang.
    pub fn walk(&self, mut f: impl FnMut(&AllocationRecord)) -> WalkStats {
        let hw = self.view.load_u64(W_NODE_HW).unwrap_or(0);
        fence(Ordering::Acquire);
        let n = hw.min(self.layout.capacity);
        let mut stats = WalkStats {
            nodes: n,
            ..Default::default()
        };
        let mut later = Vec::new();
        for i in 0..n {
            match self.read_node_retrying(i, 16, u32::MAX, None).0 {
                NodeRead::Free => {}
                NodeRead::Live(r) => {
                    stats.reported += 1;
                    f(&r);
                }
                NodeRead::Changing if later.len() < WALK_MAX_DEFERRED => later.push(i),
                NodeRead::Changing => stats.unstable += 1,
            }
        }
        if later.is_empty() {
            return stats;
        }
        let started = std::time::Instant::now();
        let mut budget = WALK_RETRY_BUDGET;
        for i in later {
            let tries = if budget == 0 || started.elapsed() > WALK_RETRY_TIME {
                1
            } else {
                budget.min(20_000)
            };
            let (r, used) = self.read_node_retrying(i, tries, 32, Some(started + WALK_RETRY_TIME));
            budget = budget.saturating_sub(used);
            match r {
                NodeRead::Free => {}
                NodeRead::Live(r) => {
                    stats.reported += 1;
                    f(&r);
                }
                NodeRead::Changing => stats.unstable += 1,
            }
        }
        stats
    }

    /// Collects every live record (see [`Self::walk`]).
    pub fn snapshot(&self) -> (Vec<AllocationRecord>, WalkStats) {
        let mut v = Vec::new();
        let stats = self.walk(|r| v.push(*r));
        (v, stats)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::HashMap;

    fn region(capacity: u64, shards: u64) -> RegionWriter {
        AllocationsWriter::create_region(AllocationsConfig { capacity, shards }).unwrap()
    }

    fn rec(address: u64, size: u64) -> AllocationRecord {
        AllocationRecord {
            address,
            size,
            stack: ResourceKey((address % 1000) * 8 + 8192),
            thread: ResourceKey((size % 77) * 8),
            timestamp_us: address ^ size,
        }
        .normalized()
    }

    impl AllocationRecord {
        fn normalized(mut self) -> Self {
            self.timestamp_us &= SIZE_MASK;
            self
        }
    }

    /// The table's content, via a real read-only mapping.
    fn walk_map(r: &RegionWriter) -> HashMap<u64, AllocationRecord> {
        let rr = r.open_reader().unwrap();
        let reader = AllocationsReader::new(&rr).unwrap();
        let mut out = HashMap::new();
        let stats = reader.walk(|rec| {
            assert!(out.insert(rec.address, *rec).is_none(), "reported twice");
        });
        assert_eq!(stats.unstable, 0);
        assert_eq!(stats.reported as usize, out.len());
        out
    }

    #[derive(Default)]
    struct Model {
        live: HashMap<u64, AllocationRecord>,
        live_bytes: u64,
        peak: u64,
        total_allocs: u64,
        total_bytes: u64,
    }

    impl Model {
        fn alloc(&mut self, r: AllocationRecord) {
            self.live.insert(r.address, r);
            self.live_bytes += r.size;
            self.peak = self.peak.max(self.live_bytes);
            self.total_allocs += 1;
            self.total_bytes += r.size;
        }
        fn free(&mut self, addr: u64) -> Option<u64> {
            let r = self.live.remove(&addr)?;
            self.live_bytes -= r.size;
            Some(r.size)
        }
        fn check(&self, r: &RegionWriter) {
            self.check_peak(r, true);
        }
        /// `exact_peak: false` with node caches: the peak follows a running
        /// total folded every `LIVE_BATCH` bytes, so it may trail.
        fn check_peak(&self, r: &RegionWriter, exact_peak: bool) {
            assert_eq!(walk_map(r), self.live);
            let rr = r.open_reader().unwrap();
            let c = AllocationsReader::new(&rr).unwrap().counters();
            assert_eq!(c.live_blocks, self.live.len() as u64);
            assert_eq!(c.live_bytes, self.live_bytes);
            if exact_peak {
                assert_eq!(c.peak_live_bytes, self.peak);
            } else {
                assert!(c.peak_live_bytes <= self.peak && c.peak_live_bytes >= self.live_bytes);
            }
            assert_eq!(c.total_allocs, self.total_allocs);
            assert_eq!(c.total_bytes, self.total_bytes);
            assert_eq!(AllocationsWriter::new(r).unwrap().stats(), c);
        }
    }

    #[test]
    fn insert_remove_replace() {
        let r = region(1024, 4);
        let w = AllocationsWriter::new(&r).unwrap();
        let mut m = Model::default();
        let a = rec(0x1000, 10);
        w.insert(&a).unwrap();
        m.alloc(a);
        assert_eq!(w.insert(&rec(0x1000, 99)), Err(InsertError::Duplicate));
        assert_eq!(w.remove(0x2000), None);
        m.check(&r);
        // In place.
        let a2 = rec(0x1000, 20);
        assert_eq!(w.replace(0x1000, &a2), Ok(Some(10)));
        m.free(0x1000);
        m.alloc(a2);
        m.check(&r);
        // Moving.
        let b = rec(0x3000, 30);
        assert_eq!(w.replace(0x1000, &b), Ok(Some(20)));
        m.free(0x1000);
        m.alloc(b);
        m.check(&r);
        // Replacing an unknown address inserts.
        let c = rec(0x5000, 5);
        assert_eq!(w.replace(0x4000, &c), Ok(None));
        m.alloc(c);
        assert_eq!(w.replace(0x5000, &rec(0x5000, 6)), Ok(Some(5)));
        m.free(0x5000);
        m.alloc(rec(0x5000, 6));
        // Moving onto a live address: the old one is gone, the new refused.
        assert_eq!(
            w.replace(0x5000, &rec(0x3000, 1)),
            Err(InsertError::Duplicate)
        );
        m.free(0x5000);
        m.check(&r);
        assert_eq!(w.remove(0x3000), Some(30));
        assert_eq!(w.remove(0x3000), None);
        m.free(0x3000);
        m.check(&r);
    }

    #[test]
    fn extreme_fields_round_trip() {
        let r = region(64, 1);
        let w = AllocationsWriter::new(&r).unwrap();
        let max = AllocationRecord {
            address: u64::MAX,
            size: SIZE_MASK,
            stack: ResourceKey((1 << 35) - 8),
            thread: ResourceKey((1 << 35) - 8),
            timestamp_us: SIZE_MASK,
        };
        let min = AllocationRecord {
            address: 1,
            size: 0,
            stack: ResourceKey(0),
            thread: ResourceKey(0),
            timestamp_us: 0,
        };
        w.insert(&max).unwrap();
        w.insert(&min).unwrap();
        let got = walk_map(&r);
        assert_eq!(got[&u64::MAX], max);
        assert_eq!(got[&1], min);
        // Unrepresentable records are refused, not mangled.
        for bad in [
            AllocationRecord { address: 0, ..min },
            AllocationRecord {
                stack: ResourceKey(12),
                ..min
            },
            AllocationRecord {
                thread: ResourceKey(1 << 35),
                ..min
            },
            AllocationRecord {
                stack: ResourceKey(u64::MAX - 7),
                ..min
            },
        ] {
            assert_eq!(w.insert(&bad), Err(InsertError::Unrepresentable));
        }
        // Sizes above 48 bits are clamped, and the counters agree.
        w.insert(&AllocationRecord {
            address: 2,
            size: u64::MAX,
            ..min
        })
        .unwrap();
        assert_eq!(w.remove(2), Some(SIZE_MASK));
        assert_eq!(w.remove(u64::MAX), Some(SIZE_MASK));
        assert_eq!(w.remove(1), Some(0));
        assert_eq!(w.stats().live_bytes, 0);
        assert_eq!(w.stats().live_blocks, 0);
    }

    #[test]
    fn full_table_counts_drops() {
        let r = region(8, 1);
        let w = AllocationsWriter::new(&r).unwrap();
        for i in 1..=8 {
            w.insert(&rec(i * 16, i)).unwrap();
        }
        assert_eq!(w.insert(&rec(0x1000, 1)), Err(InsertError::Full));
        assert_eq!(w.insert(&rec(0x2000, 1)), Err(InsertError::Full));
        // A duplicate is reported as such, not as a drop.
        assert_eq!(w.insert(&rec(16, 1)), Err(InsertError::Duplicate));
        let c = w.stats();
        assert_eq!(c.dropped[DroppedReason::AllocationsFull as usize], 2);
        assert_eq!(c.dropped_total(), 2);
        assert_eq!(c.live_blocks, 8);
        // Moving replace when full: the old block goes, the new one fits.
        assert_eq!(w.replace(16, &rec(0x3000, 3)), Ok(Some(1)));
        assert_eq!(w.remove(32), Some(2));
        w.insert(&rec(0x1000, 1)).unwrap();
        assert_eq!(walk_map(&r).len(), 8);
    }

    /// A small deterministic random sequence (xorshift64) from `seed`.
    fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        }
    }

    #[test]
    fn many_operations_match_a_model() {
        let r = region(1 << 15, 8);
        let w = AllocationsWriter::new(&r).unwrap();
        let mut m = Model::default();
        let mut next = xorshift(0x1234_5678_9abc_def0u64);
        // Grow to ~20k live (index windows grow), churn, then shrink to a
        // few hundred (windows shrink), checking against the model.
        for round in 0..3 {
            for _ in 0..20_000 {
                let addr = 0x5555_0000_0000 + (next() % 60_000) * 16;
                let size = next() % 5000;
                let op = next() % 10;
                let target = if round == 2 { 1 } else { 6 };
                if op < target {
                    let res = w.insert(&rec(addr, size));
                    if m.live.contains_key(&addr) {
                        assert_eq!(res, Err(InsertError::Duplicate));
                    } else {
                        res.unwrap();
                        m.alloc(rec(addr, size));
                    }
                } else if op < 9 {
                    assert_eq!(w.remove(addr), m.free(addr));
                } else {
                    let new = if next() % 2 == 0 { addr } else { addr + 8 };
                    let res = w.replace(addr, &rec(new, size));
                    let old = m.free(addr);
                    if m.live.contains_key(&new) {
                        assert_eq!(res, Err(InsertError::Duplicate));
                    } else {
                        assert_eq!(res, Ok(old));
                        m.alloc(rec(new, size));
                    }
                }
            }
            m.check(&r);
        }
        // Empty it: nothing left, index memory returned.
        let before = r.resident_bytes().unwrap();
        let addrs: Vec<u64> = m.live.keys().copied().collect();
        for a in addrs {
            assert_eq!(w.remove(a), m.free(a));
        }
        m.check(&r);
        assert!(r.resident_bytes().unwrap() <= before);
    }

    #[test]
    fn direct_and_indexed_blocks_mix_exactly() {
        // Half the blocks direct (by node), half through the index, in the
        // same shards; the index's load factor counts only its own, so it
        // neither grows for the direct blocks nor overflows.
        let r = region(1 << 15, 4);
        let w = AllocationsWriter::new(&r).unwrap();
        let mut cache = NodeCache::new();
        let mut m = Model::default();
        let mut direct: HashMap<u64, u32> = HashMap::new();
        let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
        for round in 0..3 {
            for _ in 0..20_000 {
                let addr = 0x7777_0000_0000 + (next() % 30_000) * 16;
                let size = next() % 3000 + 1;
                let grow = if round == 2 { 2 } else { 6 };
                if m.live.contains_key(&addr) {
                    if next() % 10 >= grow {
                        let got = match direct.remove(&addr) {
                            Some(node) => {
                                // The index does not know a direct block.
                                assert_eq!(w.remove(addr), None);
                                w.remove_direct(addr, node, &mut cache)
                            }
                            None => w.remove_cached(addr, &mut cache),
                        };
                        assert_eq!(got, m.free(addr));
                    }
                } else if next() % 2 == 0 {
                    let node = w.insert_direct(&rec(addr, size), &mut cache).unwrap();
                    direct.insert(addr, node);
                    m.alloc(rec(addr, size));
                } else {
                    w.insert_cached(&rec(addr, size), &mut cache).unwrap();
                    m.alloc(rec(addr, size));
                }
            }
            w.flush_cache(&mut cache);
            m.check_peak(&r, false);
        }
        // A node that does not hold the address removes nothing.
        if let Some((&addr, &node)) = direct.iter().next() {
            assert_eq!(w.remove_direct(addr + 16, node, &mut cache), None);
            assert_eq!(w.remove_direct(addr, node ^ 1, &mut cache), None);
            assert_eq!(w.remove_direct(addr, u32::MAX, &mut cache), None);
            assert_eq!(w.remove_direct(0, node, &mut cache), None);
        }
        for (addr, node) in direct.drain() {
            assert_eq!(w.remove_direct(addr, node, &mut cache), m.free(addr));
        }
        let rest: Vec<u64> = m.live.keys().copied().collect();
        for a in rest {
            assert_eq!(w.remove_cached(a, &mut cache), m.free(a));
        }
        w.flush_cache(&mut cache);
        m.check_peak(&r, false);
    }

    #[test]
    fn a_crowded_address_range_spills_and_every_block_stays_exact() {
        // 8 shards: 2 groups of 4. Each shard's index holds at most 896
        // blocks (1024-slot windows at 7/8), so one 64 MiB range (one
        // group) overflows past 3584 live blocks and spills.
        let r = region(4096, 8);
        let w = AllocationsWriter::new(&r).unwrap();
        let mut m = Model::default();
        let addr = |i: u64| 0x7f00_0000_0000 + i * 48;
        for i in 0..3900 {
            w.insert(&rec(addr(i), 16 + i)).unwrap();
            m.alloc(rec(addr(i), 16 + i));
        }
        m.check(&r);
        assert!(
            (0..8).any(|s| w.spilled(s)),
            "the crowded group never spilled"
        );
        let mut x = 0x2545_f491_4f6c_dd1du64;
        for round in 0..4 {
            for i in 0..3000u64 {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                let a = addr(x % 3950);
                let size = 16 + x % 4000;
                match (x >> 40) % 4 {
                    0 => {
                        let res = w.insert(&rec(a, size));
                        if m.live.contains_key(&a) {
                            assert_eq!(res, Err(InsertError::Duplicate));
                        } else {
                            assert_eq!(res, Ok(()), "insert {i} of round {round}");
                            m.alloc(rec(a, size));
                        }
                    }
                    1 => assert_eq!(w.remove(a), m.free(a)),
                    _ => {
                        // realloc in place: a spilled block is rewritten
                        // where it lives
                        let res = w.replace(a, &rec(a, size));
                        let old = m.free(a);
                        assert_eq!(res, Ok(old));
                        m.alloc(rec(a, size));
                    }
                }
            }
            m.check(&r);
        }
        for a in m.live.keys().copied().collect::<Vec<_>>() {
            assert_eq!(w.remove(a), m.free(a));
        }
        m.check(&r);
    }

    #[test]
    fn blocks_of_two_address_ranges_use_disjoint_shard_groups() {
        let r = region(1 << 16, 256);
        let w = AllocationsWriter::new(&r).unwrap();
        // Two 64 MiB ranges whose groups differ (found, not assumed).
        let a = 0x7f00_0000_0000u64;
        let b = (1..64)
            .map(|k| a + (k << GROUP_SHIFT))
            .find(|b| w.home_shard(*b, 0) >> w.sub_bits != w.home_shard(a, 0) >> w.sub_bits)
            .expect("another group");
        let shards = |base: u64| -> std::collections::HashSet<u64> {
            (0..4096u64)
                .map(|i| {
                    let addr = base + i * 64;
                    w.home_shard(addr, hash(addr))
                })
                .collect()
        };
        let (sa, sb) = (shards(a), shards(b));
        assert_eq!(sa.len(), 16, "a group's 16 shards all get blocks");
        assert!(sa.is_disjoint(&sb));
    }

    #[test]
    fn index_memory_follows_live_count() {
        let r = region(1 << 17, 4);
        let w = AllocationsWriter::new(&r).unwrap();
        let base = r.resident_bytes().unwrap();
        for i in 0..100_000u64 {
            w.insert(&rec(0x7000_0000 + i * 32, 24)).unwrap();
        }
        let full = r.resident_bytes().unwrap();
        for i in 0..100_000u64 {
            assert_eq!(w.remove(0x7000_0000 + i * 32), Some(24));
        }
        let after = r.resident_bytes().unwrap();
        // Nodes stay (free lists), index windows shrink back to a page.
        let nodes = 100_000 * NODE_SIZE;
        assert!(full - base >= nodes);
        assert!(
            after - base < nodes + 64 * 4096,
            "base {base} full {full} after {after}"
        );
        // At least 4 bytes of index per live block were given back.
        assert!(full - after > 100_000 * 4, "full {full} after {after}");
    }

    #[derive(Debug, Clone)]
    enum Op {
        Insert(u64, u64),
        Remove(u64),
        Replace(u64, u64, u64),
    }

    fn addr() -> impl Strategy<Value = u64> {
        prop_oneof![
            // A small pool: many collisions, duplicates and misses.
            (1u64..48).prop_map(|i| 0x5555_0000_1000 + i * 16),
            // Same low bits, different high bits.
            (1u64..16).prop_map(|i| i << 40 | 0x10),
            any::<u64>().prop_map(|a| a.max(1)),
        ]
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            4 => (addr(), 0u64..1 << 20).prop_map(|(a, s)| Op::Insert(a, s)),
            3 => addr().prop_map(Op::Remove),
            2 => (addr(), addr(), 0u64..1 << 20).prop_map(|(a, b, s)| Op::Replace(a, b, s)),
            1 => (addr(), 0u64..1 << 20).prop_map(|(a, s)| Op::Replace(a, a, s)),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(64))]
        #[test]
        fn random_operations_match_a_model(ops in proptest::collection::vec(op(), 0..400), shards in prop_oneof![Just(1u64), Just(2), Just(64)]) {
            let r = region(4096, shards);
            let w = AllocationsWriter::new(&r).unwrap();
            let mut m = Model::default();
            for op in ops {
                match op {
                    Op::Insert(a, s) => {
                        let res = w.insert(&rec(a, s));
                        if m.live.contains_key(&a) {
                            prop_assert_eq!(res, Err(InsertError::Duplicate));
                        } else {
                            prop_assert_eq!(res, Ok(()));
                            m.alloc(rec(a, s));
                        }
                    }
                    Op::Remove(a) => prop_assert_eq!(w.remove(a), m.free(a)),
                    Op::Replace(a, b, s) => {
                        let res = w.replace(a, &rec(b, s));
                        let old = m.free(a);
                        if m.live.contains_key(&b) {
                            prop_assert_eq!(res, Err(InsertError::Duplicate));
                        } else {
                            prop_assert_eq!(res, Ok(old));
                            m.alloc(rec(b, s));
                        }
                    }
                }
            }
            m.check(&r);
        }
    }

    #[test]
    fn retries_on_a_node_that_never_settles_stop_at_the_deadline() {
        // Regression (found by fuzz/region_header under load): the second
        // pass allowed 20 000 yields per node and checked the walk's time
        // limit only between nodes; one yield can take a scheduler slice,
        // so a node left mid-update (target killed, or hostile) could hold
        // a snapshot for minutes. With the deadline in the retry loop, even
        // an unbounded try count ends.
        let r = region(64, 1);
        let w = AllocationsWriter::new(&r).unwrap();
        w.insert(&rec(0x1000, 8)).unwrap();
        let nodes_off = r.header().layout[4];
        let view = r.view();
        // The writer "killed" mid-update: its node's sequence word odd.
        view.atomic_u64(nodes_off)
            .unwrap()
            .fetch_or(1, Ordering::Relaxed);
        let rr = r.open_reader().unwrap();
        let reader = AllocationsReader::new(&rr).unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_millis(20);
        let (res, used) = reader.read_node_retrying(0, u32::MAX, 32, Some(deadline));
        assert!(matches!(res, NodeRead::Changing));
        assert!(used < u32::MAX);
        let stats = reader.walk(|_| {});
        assert_eq!((stats.reported, stats.unstable), (0, 1));
    }
}
