//! The resources table: append-only, deduplicated stack traces and thread
//! records, addressed by [`ResourceKey`] (the byte offset of a record).
//!
//! Layout (after the header page):
//! `[bucket heads: bucket_count x u64][pad to page][records ... data_end)`.
//! `layout[0]` = bucket count (power of two), `layout[1]` = bucket array
//! offset, `layout[2]` = first record offset, `layout[3]` = end of data.
//! Dynamic words: `KIND_WORDS+0` = bump pointer (next free offset),
//! `+8` = head of the thread-record list, `+16` stack count, `+24` thread
//! count, `+32` = head of the stack-cache (counter-block) list, `+40` = head of the
//! peak-block list (format 1.4).
//!
//! Records are 8-aligned: word 0 = `tag | len << 32`, word 1 = `next`
//! (bucket chain or thread list, 0 = end). A stack record then has
//! `crc | frames << 32`, `alloc_count`, `alloc_bytes` and `len` payload bytes
//! (the compressed trace); a thread record has `tid`, `serial`, and `len`
//! name bytes. A thread renamed after its first record gets a record with
//! its new name and the same `serial` (since format 1.6: one thread, one
//! serial; the thread count word counts threads, not records).
//!
//! **Stack caches** (format 1.6; counter blocks before) take the
//! per-stack cumulative counters off the allocation path's shared cache
//! lines: a writer thread claims a block (word 2 = owner, CAS from 0),
//! finds the trace it captured by the trace's hash in one of its 4-way
//! sets of 32-byte slots (`stack key, count, bytes, trace hash`), and adds
//! to that slot with plain relaxed load+store: one writer per block, no
//! locked instruction, no line shared with another thread, and no line
//! for the counts besides the one the lookup read. A released block
//! keeps its slots and sums and is reused by the next thread that claims
//! one, so blocks follow the number of threads alive at once. Readers add
//! every block's slots to the stacks they name: a stack's cumulative count
//! is its own record's counters plus its slots in all blocks. Counter
//! blocks of formats 1.1-1.5 (`stack key, count, bytes` slots, 24 bytes)
//! are still read.
//!
//! Invariants:
//! - A record is fully written before it is published (CAS of a list head
//!   with `Release`), and never changes afterwards except for the two
//!   cumulative counters of a stack record (relaxed atomic adds).
//! - Space is reserved by an atomic bump of one word; a record that loses a
//!   publication race to a twin is left unlinked (a little wasted space,
//!   never a second copy in the bucket): before each retry the writer
//!   re-scans the entries that were published since its last look.
//! - Readers need only a key: they check it lies in the data area below
//!   the bump pointer, is aligned, has the right tag and a length that fits,
//!   before copying anything. Walks over bucket chains are bounded by the
//!   number of records the data area could hold and refuse to revisit a
//!   key, so a cyclic or hostile list ends.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{fence, Ordering};

use crc::{Crc, Table, CRC_32_ISCSI};

use crate::error::TableError;
use crate::header::{offsets, parse_header, RegionKind, HEADER_SIZE};
use crate::region::{RegionReader, RegionWriter};
use crate::shared_view::SharedView;
use crate::stack_compression::{self, MAX_ENCODED_LEN, MAX_FRAMES};

/// The offset of a record in the resources region; 0 means "none".
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Default)]
pub struct ResourceKey(pub u64);

const TAG_STACK: u32 = 0x4b43_5453; // "STCK"
const TAG_THREAD: u32 = 0x4452_4854; // "THRD"
const STACK_HEADER: u64 = 40;
const THREAD_HEADER: u64 = 32;
/// Longest thread name stored (Linux names are at most 15 bytes).
pub const MAX_THREAD_NAME: usize = 64;

const W_BUMP: u64 = offsets::KIND_WORDS;
const W_THREADS: u64 = offsets::KIND_WORDS + 8;
const W_STACK_COUNT: u64 = offsets::KIND_WORDS + 16;
const W_THREAD_COUNT: u64 = offsets::KIND_WORDS + 24;
const W_COUNTERS: u64 = offsets::KIND_WORDS + 32;
const W_PEAK_BLOCKS: u64 = offsets::KIND_WORDS + 40;
const TAG_PEAK: u32 = 0x524b_4650; // "PFKR"

/// **Peak blocks** (format 1.4) count, per writer thread and stack, the
/// blocks freed since the heap's last peak that had been allocated before
/// it (see `crate::peak`): with the live blocks allocated before the peak,
/// they give the heap's composition at the peak. Laid out as counter
/// blocks (one owner, `stack key, count, bytes` slots), with header word 3
/// the peak generation the slots belong to: the owner empties its block
/// when it first adds in a new generation, and readers take only blocks of
/// the current one.
const PEAK_GEN_WORD: u64 = 24;

/// Counter blocks of formats 1.1 to 1.5 (`stack key, count, bytes`
/// slots found by hashing the key): no longer written, still read.
const TAG_COUNTERS: u32 = 0x5254_4e43; // "CNTR"
const COUNTERS_HEADER: u64 = 32;
const COUNTER_SLOT: u64 = 24;
/// Slots in a counter, peak or stack-cache block (a power of two).
pub const COUNTER_SLOTS: u64 = 1024;
// Slot numbers travel as u16 hints, `u16::MAX` meaning none
// (`ResourcesWriter::cache_find_hinted`).
const _: () = assert!(COUNTER_SLOTS < u16::MAX as u64);
/// Longest probe for a stack's slot in a peak block.
const COUNTER_PROBE: u64 = 8;

/// **Stack-cache blocks** (format 1.6) replace the counter blocks on the
/// counter-block list: a writer thread's cache of the traces it captured
/// *and* its per-stack cumulative counters, in one 32-byte slot per
/// trace (`stack key, count, bytes, trace hash`), [`CACHE_WAYS`] slots
/// per set, the set picked by the trace's hash. The thread looks its
/// trace's hash up there and adds the allocation to the slot it found:
/// the counts sit in the line the lookup has just read, so counting costs
/// no line of its own. Slots never move while they hold a key (a reader
/// may be summing them); a slot is only emptied and reused (eviction).
const TAG_STACK_CACHE: u32 = 0x4341_4353; // "SCAC"
/// Header of a stack-cache block: one cache line, so that with the block
/// placed on a line boundary every set of four 32-byte slots is two
/// whole lines.
const CACHE_HEADER: u64 = 64;
const CACHE_SLOT: u64 = 32;
/// Sets of a stack-cache block.
pub const CACHE_SETS: u64 = COUNTER_SLOTS / CACHE_WAYS;
/// Slots per set of a stack-cache block.
pub const CACHE_WAYS: u64 = 4;
/// Slot words of a stack-cache block.
const C_KEY: u64 = 0;
const C_COUNT: u64 = 1;
const C_BYTES: u64 = 2;
const C_HASH: u64 = 3;

/// The shape of one kind of per-thread block (all share the list links
/// and header words 0-2: `tag | slots << 32`, next, owner).
#[derive(Clone, Copy, Debug)]
struct BlockKind {
    tag: u32,
    header: u64,
    slot: u64,
    /// Alignment of the block's offset (the region is page-aligned).
    align: u64,
}

impl BlockKind {
    const COUNTERS: BlockKind = BlockKind {
        tag: TAG_COUNTERS,
        header: COUNTERS_HEADER,
        slot: COUNTER_SLOT,
        align: 8,
    };
    const PEAK: BlockKind = BlockKind {
        tag: TAG_PEAK,
        header: COUNTERS_HEADER,
        slot: COUNTER_SLOT,
        align: 8,
    };
    const STACK_CACHE: BlockKind = BlockKind {
        tag: TAG_STACK_CACHE,
        header: CACHE_HEADER,
        slot: CACHE_SLOT,
        align: 64,
    };

    /// Bytes of a block of [`COUNTER_SLOTS`] slots.
    const fn size(self) -> u64 {
        self.header + COUNTER_SLOTS * self.slot
    }

    /// The kind a reader accepts on `list` with tag `tag`.
    fn read_as(list: u64, tag: u32) -> Option<BlockKind> {
        match (list, tag) {
            (W_COUNTERS, TAG_STACK_CACHE) => Some(Self::STACK_CACHE),
            (W_COUNTERS, TAG_COUNTERS) => Some(Self::COUNTERS),
            (W_PEAK_BLOCKS, TAG_PEAK) => Some(Self::PEAK),
            _ => None,
        }
    }
}

/// What [`ResourcesWriter::add_peak_freed`] did.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PeakAdd {
    /// Counted.
    Added,
    /// Counted, in a block emptied first (its counts were of an older
    /// generation): the owner's other peak blocks are stale now too.
    AddedInNewGeneration,
    /// The block had no room near the stack's place: not counted.
    Full,
}

/// A peak block claimed by one writer thread (see [`TAG_PEAK`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CounterBlock(u64);

/// A stack-cache block claimed by one writer thread (see
/// [`TAG_STACK_CACHE`]): only that thread looks up, counts in or inserts
/// into it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct StackCache(std::num::NonZeroU64);

/// A slot of a [`StackCache`] (its offset in the region: only made by
/// [`ResourcesWriter::cache_find`] and [`ResourcesWriter::cache_insert`],
/// so always inside a claimed block).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CacheSlot(std::num::NonZeroU64);

/// Default number of bucket heads.
pub const DEFAULT_BUCKETS: u64 = 1 << 16;
/// Chains [`ResourcesWriter::intern_stack_trace_compact`] uses: one page
/// of list heads.
pub const COMPACT_CHAINS: u64 = 512;
/// Largest bucket count a region may declare.
pub const MAX_BUCKETS: u64 = 1 << 24;

// Slice-by-16 tables: several times faster than byte-at-a-time on the
// 50-200 byte traces interned on the allocation path; same CRC values.
static CRC32C: Crc<u32, Table<16>> = Crc::<u32, Table<16>>::new(&CRC_32_ISCSI);

/// Adds `v` to a counter word only the calling thread writes (a slot of
/// its stack cache or peak block): a load and a store, no locked
/// instruction (readers load it atomically).
#[inline(always)]
fn add_owned(word: &std::sync::atomic::AtomicU64, v: u64) {
    word.store(
        word.load(Ordering::Relaxed).wrapping_add(v),
        Ordering::Relaxed,
    );
}

fn round8(n: u64) -> u64 {
    (n + 7) & !7
}

/// Parsed and validated layout parameters.
#[derive(Clone, Copy, Debug)]
struct Layout {
    buckets: u64,
    buckets_off: u64,
    data_off: u64,
    data_end: u64,
}

impl Layout {
    fn new(region_size: u64, buckets: u64) -> Result<Self, TableError> {
        if !buckets.is_power_of_two() || buckets > MAX_BUCKETS {
            return Err(TableError::CorruptHeader(
                "resources layout: bucket count is not a power of two up to 2^24".into(),
            ));
        }
        let data_off = (HEADER_SIZE + buckets * 8).div_ceil(4096) * 4096;
        let l = Layout {
            buckets,
            buckets_off: HEADER_SIZE,
            data_off,
            data_end: region_size,
        };
        l.check(region_size)?;
        Ok(l)
    }

    fn from_header(layout: &[u64; 8], region_size: u64) -> Result<Self, TableError> {
        let l = Layout {
            buckets: layout[0],
            buckets_off: layout[1],
            data_off: layout[2],
            data_end: layout[3],
        };
        l.check(region_size)?;
        Ok(l)
    }

    fn check(&self, region_size: u64) -> Result<(), TableError> {
        let bad = |m: &str| Err(TableError::CorruptHeader(format!("resources layout: {m}")));
        if !self.buckets.is_power_of_two() || self.buckets > MAX_BUCKETS {
            return bad("bucket count is not a power of two up to 2^24");
        }
        if self.buckets_off != HEADER_SIZE {
            return bad("bucket array not right after the header");
        }
        if !self.data_off.is_multiple_of(8) || self.data_off < self.buckets_off + self.buckets * 8 {
            return bad("data area overlaps the buckets");
        }
        if self.data_end != region_size || self.data_end < self.data_off {
            return bad("data area does not end at the region's end");
        }
        Ok(())
    }

    fn as_words(&self) -> [u64; 8] {
        [
            self.buckets,
            self.buckets_off,
            self.data_off,
            self.data_end,
            0,
            0,
            0,
            0,
        ]
    }
}

/// Writer handle for the resources table of this process.
#[derive(Clone, Copy, Debug)]
pub struct ResourcesWriter<'a> {
    view: SharedView,
    layout: Layout,
    _region: &'a RegionWriter,
}

impl<'a> ResourcesWriter<'a> {
    /// Creates a resources region of `size` bytes with `buckets` bucket
    /// heads (a power of two).
    pub fn create_region(size: u64, buckets: u64) -> Result<RegionWriter, TableError> {
        let layout = Layout::new(size, buckets)?;
        let region = RegionWriter::create(RegionKind::Resources, size, layout.as_words())?;
        region
            .view()
            .atomic_u64(W_BUMP)
            .expect("header word")
            .store(layout.data_off, Ordering::Release);
        Ok(region)
    }

    /// Wraps a region made by [`Self::create_region`].
    pub fn new(region: &'a RegionWriter) -> Result<Self, TableError> {
        let h = region.header();
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(ResourcesWriter {
            view: region.view(),
            layout,
            _region: region,
        })
    }

    fn word(&self, off: u64) -> &std::sync::atomic::AtomicU64 {
        self.view.atomic_u64(off).expect("offset checked by caller")
    }

    fn reserve(&self, size: u64) -> Result<u64, TableError> {
        // Relaxed: the bump only hands out disjoint space; publication of
        // the contents is ordered by the Release CAS on a list head.
        let bump = self.word(W_BUMP);
        let mut cur = bump.load(Ordering::Relaxed);
        loop {
            if cur < self.layout.data_off || cur.saturating_add(size) > self.layout.data_end {
                return Err(TableError::Full("resources region"));
            }
            match bump.compare_exchange_weak(cur, cur + size, Ordering::Relaxed, Ordering::Relaxed)
            {
                Ok(_) => return Ok(cur),
                Err(now) => cur = now,
            }
        }
    }

    fn write_payload(&self, at: u64, bytes: &[u8]) {
        let mut chunks = bytes.chunks(8);
        let mut off = at;
        for c in &mut chunks {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            self.word(off)
                .store(u64::from_le_bytes(w), Ordering::Relaxed);
            off += 8;
        }
    }

    fn payload_equals(&self, at: u64, bytes: &[u8]) -> bool {
        let mut off = at;
        for c in bytes.chunks(8) {
            let mut w = [0u8; 8];
            w[..c.len()].copy_from_slice(c);
            match self.view.load_u64(off) {
                Some(v) if v == u64::from_le_bytes(w) => {}
                _ => return false,
            }
            off += 8;
        }
        true
    }

    /// Searches the chain from `from` up to (not including) `until` for a
    /// stack record equal to `bytes`.
    fn find_in_chain(&self, from: u64, until: u64, bytes: &[u8], crc: u32) -> Option<u64> {
        let want0 = u64::from(TAG_STACK) | (bytes.len() as u64) << 32;
        let mut cur = from;
        let mut steps = 0u64;
        let limit = (self.layout.data_end - self.layout.data_off) / STACK_HEADER + 1;
        while cur != 0 && cur != until && steps < limit {
            steps += 1;
            let w0 = self.view.load_u64(cur)?;
            if w0 == want0
                && self.view.load_u64(cur + 16).map(|w| w as u32) == Some(crc)
                && self.payload_equals(cur + STACK_HEADER, bytes)
            {
                return Some(cur);
            }
            cur = self.view.load_u64(cur + 8)?;
        }
        None
    }

    /// Returns the key of the stack trace with these compressed bytes,
    /// storing it first if it is new (`true` when this call stored it).
    /// Lock-free; never allocates. A full region returns
    /// [`TableError::Full`] and counts nothing: the caller records the
    /// event as dropped ([`crate::DroppedReason::ResourcesFull`]) where its
    /// dumper looks for drops (the allocations region's header).
    pub fn intern_stack_trace(&self, bytes: &[u8]) -> Result<(ResourceKey, bool), TableError> {
        self.intern_in_chains(bytes, self.layout.buckets)
    }

    /// [`Self::intern_stack_trace`] into the first [`COMPACT_CHAINS`]
    /// chains (one page of list heads) whatever the hash: for many stacks
    /// stored at once, most never looked up again (a fork child's
    /// inherited stacks), which would otherwise touch a page of heads each
    /// (the heads are spread over 512 KiB). Readers walk every chain, so
    /// they find these; a later [`Self::intern_stack_trace`] of the same
    /// bytes looks in its own chain and stores a twin, which readers fold
    /// into one stack ([`ResourcesReader::stacks`]).
    pub fn intern_stack_trace_compact(
        &self,
        bytes: &[u8],
    ) -> Result<(ResourceKey, bool), TableError> {
        self.intern_in_chains(bytes, self.layout.buckets.min(COMPACT_CHAINS))
    }

    /// Interning into the chain of `bytes`' hash among the first `chains`
    /// (a power of two, at most the bucket count).
    fn intern_in_chains(
        &self,
        bytes: &[u8],
        chains: u64,
    ) -> Result<(ResourceKey, bool), TableError> {
        if bytes.len() > MAX_ENCODED_LEN {
            return Err(TableError::TooLarge(
                "stack trace longer than the format allows",
            ));
        }
        let crc = CRC32C.checksum(bytes);
        let bucket = self.layout.buckets_off + 8 * (u64::from(crc) & (chains - 1));
        let head_word = self.word(bucket);
        // Acquire pairs with the publishing CAS: records reachable from the
        // head are fully written.
        let mut head = head_word.load(Ordering::Acquire);
        if let Some(k) = self.find_in_chain(head, 0, bytes, crc) {
            return Ok((ResourceKey(k), false));
        }
        let size = STACK_HEADER + round8(bytes.len() as u64);
        let off = self.reserve(size)?;
        let frames = bytes.iter().filter(|b| **b & 0x80 == 0).count() as u64;
        self.word(off).store(
            u64::from(TAG_STACK) | (bytes.len() as u64) << 32,
            Ordering::Relaxed,
        );
        self.word(off + 16)
            .store(u64::from(crc) | frames << 32, Ordering::Relaxed);
        self.write_payload(off + STACK_HEADER, bytes);
        loop {
            self.word(off + 8).store(head, Ordering::Relaxed);
            // Release publishes the record's words written above.
            match head_word.compare_exchange(head, off, Ordering::Release, Ordering::Acquire) {
                Ok(_) => {
                    self.word(W_STACK_COUNT).fetch_add(1, Ordering::Relaxed);
                    return Ok((ResourceKey(off), true));
                }
                Err(now) => {
                    // Someone published first: look at just the new entries.
                    if let Some(k) = self.find_in_chain(now, head, bytes, crc) {
                        return Ok((ResourceKey(k), false));
                    }
                    head = now;
                }
            }
        }
    }

    /// Stores a thread record (tid and name, truncated to
    /// [`MAX_THREAD_NAME`] bytes) and returns its key. Never allocates.
    pub fn insert_thread_info(&self, tid: u64, name: &[u8]) -> Result<ResourceKey, TableError> {
        self.insert_thread_record(tid, name, None)
    }

    /// Stores the record of a thread that took a new name since its
    /// record `earlier` (a key [`Self::insert_thread_info`] or this call
    /// returned for the same thread): `tid`, the new name, and the serial
    /// of `earlier`, so that readers show the thread once, under its
    /// latest name (a tid alone cannot tell a rename from a later thread
    /// given the same tid). A fresh serial if `earlier` is not a thread
    /// record of `tid`. Never allocates.
    pub fn insert_renamed_thread_info(
        &self,
        earlier: ResourceKey,
        tid: u64,
        name: &[u8],
    ) -> Result<ResourceKey, TableError> {
        let k = earlier.0;
        let serial = (k.is_multiple_of(8)
            && k >= self.layout.data_off
            && k.saturating_add(THREAD_HEADER) <= self.layout.data_end
            && self.word(k).load(Ordering::Relaxed) as u32 == TAG_THREAD
            && self.word(k + 16).load(Ordering::Relaxed) == tid)
            .then(|| self.word(k + 24).load(Ordering::Relaxed));
        self.insert_thread_record(tid, name, serial)
    }

    fn insert_thread_record(
        &self,
        tid: u64,
        name: &[u8],
        serial: Option<u64>,
    ) -> Result<ResourceKey, TableError> {
        let name = &name[..name.len().min(MAX_THREAD_NAME)];
        let size = THREAD_HEADER + round8(name.len() as u64);
        let off = self.reserve(size)?;
        let serial =
            serial.unwrap_or_else(|| self.word(W_THREAD_COUNT).fetch_add(1, Ordering::Relaxed));
        self.word(off).store(
            u64::from(TAG_THREAD) | (name.len() as u64) << 32,
            Ordering::Relaxed,
        );
        self.word(off + 16).store(tid, Ordering::Relaxed);
        self.word(off + 24).store(serial, Ordering::Relaxed);
        self.write_payload(off + THREAD_HEADER, name);
        let head_word = self.word(W_THREADS);
        let mut head = head_word.load(Ordering::Relaxed);
        loop {
            self.word(off + 8).store(head, Ordering::Relaxed);
            match head_word.compare_exchange_weak(head, off, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return Ok(ResourceKey(off)),
                Err(now) => head = now,
            }
        }
    }

    /// Adds one allocation of `size` bytes to the cumulative counters of
    /// the stack `key` (from [`Self::intern_stack_trace`]). Lock-free.
    #[inline]
    pub fn record_allocation(&self, key: ResourceKey, size: u64) {
        self.record_allocations(key, 1, size);
    }

    /// [`Self::record_allocation`] for `count` allocations totalling `bytes`
    /// at once (a sampled allocation standing for several).
    pub fn record_allocations(&self, key: ResourceKey, count: u64, bytes: u64) {
        let k = key.0;
        // Never panic on the allocation path, whatever the key: compare
        // without overflowing.
        if k < self.layout.data_off
            || !k.is_multiple_of(8)
            || k > self.layout.data_end.saturating_sub(STACK_HEADER)
        {
            return;
        }
        self.word(k + 24).fetch_add(count, Ordering::Relaxed);
        self.word(k + 32).fetch_add(bytes, Ordering::Relaxed);
    }

    /// Claims a stack-cache block for the calling thread (`owner` is any
    /// non-zero id, e.g. the tid): a released one if there is one (its
    /// slots stay valid: same region, same keys), else a new one. `None`
    /// when the region is full (callers then intern every trace and count
    /// with [`Self::record_allocations`]). Lock-free; never allocates.
    pub fn claim_stack_cache(&self, owner: u64) -> Option<StackCache> {
        // Blocks are in the data area, never at offset 0.
        self.claim_block(W_COUNTERS, BlockKind::STACK_CACHE, owner)
            .and_then(std::num::NonZeroU64::new)
            .map(StackCache)
    }

    /// Releases a stack cache claimed by this thread (its sums stay).
    pub fn release_stack_cache(&self, cache: StackCache) {
        self.release_block(cache.0.get());
    }

    /// Claims a peak block (see [`TAG_PEAK`]) for the calling thread, like
    /// [`Self::claim_stack_cache`]. Release it with [`Self::release_counters`].
    pub fn claim_peak_block(&self, owner: u64) -> Option<CounterBlock> {
        self.claim_block(W_PEAK_BLOCKS, BlockKind::PEAK, owner)
            .map(CounterBlock)
    }

    fn claim_block(&self, list: u64, kind: BlockKind, owner: u64) -> Option<u64> {
        let owner = owner.max(1);
        let mut claimed = None;
        self.for_each_block(list, kind, |cur| {
            let Some(w) = self.view.atomic_u64(cur + 16) else {
                return true;
            };
            if w.load(Ordering::Relaxed) == 0
                && w.compare_exchange(0, owner, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                claimed = Some(cur);
            }
            claimed.is_some()
        });
        if claimed.is_some() {
            return claimed;
        }
        // Reserved with room to start on an `align` boundary (the bump
        // pointer is 8-aligned; the region is page-aligned).
        let start = self.reserve(kind.size() + kind.align - 8).ok()?;
        let off = start.next_multiple_of(kind.align);
        self.word(off)
            .store(u64::from(kind.tag) | COUNTER_SLOTS << 32, Ordering::Relaxed);
        self.word(off + 16).store(owner, Ordering::Relaxed);
        let head_word = self.word(list);
        let mut head = head_word.load(Ordering::Relaxed);
        loop {
            self.word(off + 8).store(head, Ordering::Relaxed);
            // Release publishes the block's header (slots are zero pages).
            match head_word.compare_exchange_weak(head, off, Ordering::Release, Ordering::Relaxed) {
                Ok(_) => return Some(off),
                Err(now) => head = now,
            }
        }
    }

    /// Releases a peak block claimed by this thread (its sums stay).
    pub fn release_counters(&self, block: CounterBlock) {
        self.release_block(block.0);
    }

    fn release_block(&self, off: u64) {
        if let Some(w) = self.view.atomic_u64(off + 16) {
            // Release: our slot writes happen-before the next owner's.
            w.store(0, Ordering::Release);
        }
    }

    /// Word `w` of slot `i` of stack cache `cache`; `i` is masked to the
    /// block's slots.
    #[inline(always)]
    fn cache_word(&self, cache: StackCache, i: u64, w: u64) -> &std::sync::atomic::AtomicU64 {
        let off =
            cache.0.get() + CACHE_HEADER + (i & (COUNTER_SLOTS - 1)) * CACHE_SLOT + (w & 3) * 8;
        // SAFETY: a `StackCache` is only made by `claim_block`, from a
        // block of `BlockKind::STACK_CACHE.size()` bytes it reserved (or
        // found, validated by `for_each_block`) inside the data area; `i`
        // is masked to COUNTER_SLOTS - 1 and `w` to 3, so `off` is in
        // bounds and 8-aligned.
        unsafe { self.view.atomic_u64_unchecked(off) }
    }

    /// The set of trace `hash` in a stack cache (`0..CACHE_SETS`): a
    /// writer keeps per-set state of its own by this number (see
    /// [`Self::cache_insert`]).
    #[inline(always)]
    pub fn cache_set_of(hash: u64) -> usize {
        ((hash >> 20) & (CACHE_SETS - 1)) as usize
    }

    /// The first slot of the set of trace `hash` in a stack cache.
    #[inline(always)]
    fn cache_set(hash: u64) -> u64 {
        Self::cache_set_of(hash) as u64 * CACHE_WAYS
    }

    /// The slot and stack key of trace `hash` in `cache` (one of the
    /// calling thread's), if it holds them. `hash` is not 0.
    #[inline(always)]
    pub fn cache_find(&self, cache: StackCache, hash: u64) -> Option<(CacheSlot, ResourceKey)> {
        let (i, key) = self.cache_scan(cache, hash)?;
        Some((Self::slot_at(cache, i), ResourceKey(key)))
    }

    /// The slot number and key of trace `hash` in its set of `cache`.
    #[inline(always)]
    fn cache_scan(&self, cache: StackCache, hash: u64) -> Option<(u64, u64)> {
        let set = Self::cache_set(hash);
        for way in 0..CACHE_WAYS {
            let i = set + way;
            // Relaxed: only this thread writes the block (a block inherited
            // from an exited thread was handed over with Release/Acquire).
            if self.cache_word(cache, i, C_HASH).load(Ordering::Relaxed) == hash {
                let key = self.cache_word(cache, i, C_KEY).load(Ordering::Relaxed);
                if key != 0 {
                    return Some((i, key));
                }
            }
        }
        None
    }

    /// [`Self::cache_find`] that first tries slot `hint` (a number this
    /// call returned for `hash` before; any value is safe: the slot is
    /// checked as any other, and a slot past the block's is not tried).
    /// Returns the slot's number too, the hint for next time. A trace
    /// found in a set's last way (its set filled by others before it) then
    /// costs one probe, not four.
    #[inline(always)]
    pub fn cache_find_hinted(
        &self,
        cache: StackCache,
        hash: u64,
        hint: u16,
    ) -> Option<(CacheSlot, ResourceKey, u16)> {
        let i = u64::from(hint);
        // Relaxed: as in `cache_scan`.
        if i < COUNTER_SLOTS && self.cache_word(cache, i, C_HASH).load(Ordering::Relaxed) == hash {
            let key = self.cache_word(cache, i, C_KEY).load(Ordering::Relaxed);
            if key != 0 {
                return Some((Self::slot_at(cache, i), ResourceKey(key), hint));
            }
        }
        let (i, key) = self.cache_scan(cache, hash)?;
        Some((Self::slot_at(cache, i), ResourceKey(key), i as u16))
    }

    /// Slot `i` of `cache` (masked to the block's slots).
    #[inline(always)]
    fn slot_at(cache: StackCache, i: u64) -> CacheSlot {
        let off = cache.0.get() + CACHE_HEADER + (i & (COUNTER_SLOTS - 1)) * CACHE_SLOT;
        // The block is in the data area, past offset 0.
        CacheSlot(std::num::NonZeroU64::new(off).unwrap_or(cache.0))
    }

    /// Adds `count` allocations of `bytes` in all to `slot` of one of the
    /// calling thread's stack caches. Single writer: a load and a store
    /// each, no locked instruction.
    ///
    /// # Safety
    /// `slot` came from [`Self::cache_find`] or [`Self::cache_insert`] of a
    /// writer of this same region (it is an unchecked offset: the hot
    /// path's count costs no bounds check).
    #[inline(always)]
    pub unsafe fn cache_count(&self, slot: CacheSlot, count: u64, bytes: u64) {
        // SAFETY: per the contract, `slot` is the offset of a slot of a
        // claimed stack-cache block of this region (see `cache_word`), so
        // its count and bytes words are in bounds and 8-aligned.
        let (c, b) = unsafe {
            (
                self.view.atomic_u64_unchecked(slot.0.get() + C_COUNT * 8),
                self.view.atomic_u64_unchecked(slot.0.get() + C_BYTES * 8),
            )
        };
        add_owned(c, count);
        add_owned(b, bytes);
    }

    /// Puts trace `hash`, interned as `key`, into its set of `cache` (one
    /// of the calling thread's) with zero counts, and returns its slot.
    /// The slot taken is an empty one, else way `next % CACHE_WAYS` (the
    /// caller's turn); the counts of a stack it held go to that stack's
    /// record (atomic adds, as for a stack with no slot), once the slot
    /// is emptied.
    ///
    /// A reader reading the slot meanwhile sees its key change (see
    /// `block_sums`) and skips it: the evicted counts are missing from
    /// that one reading (they are moved after the slot is emptied), never
    /// counted for the wrong stack.
    #[cold]
    #[inline(never)]
    pub fn cache_insert(
        &self,
        cache: StackCache,
        hash: u64,
        key: ResourceKey,
        next: u8,
    ) -> CacheSlot {
        let set = Self::cache_set(hash);
        let victim = (set..set + CACHE_WAYS)
            .find(|&i| self.cache_word(cache, i, C_KEY).load(Ordering::Relaxed) == 0)
            .unwrap_or(set + u64::from(next) % CACHE_WAYS);
        let old = self
            .cache_word(cache, victim, C_KEY)
            .load(Ordering::Relaxed);
        let count = self
            .cache_word(cache, victim, C_COUNT)
            .load(Ordering::Relaxed);
        let bytes = self
            .cache_word(cache, victim, C_BYTES)
            .load(Ordering::Relaxed);
        // Key 0 first (a reader skips an empty slot), Release so that a
        // reader who sees the counts zeroed sees the key changed; the new
        // key with Release once the counts are zero.
        self.cache_word(cache, victim, C_KEY)
            .store(0, Ordering::Relaxed);
        fence(Ordering::Release);
        self.cache_word(cache, victim, C_COUNT)
            .store(0, Ordering::Relaxed);
        self.cache_word(cache, victim, C_BYTES)
            .store(0, Ordering::Relaxed);
        self.cache_word(cache, victim, C_HASH)
            .store(hash, Ordering::Relaxed);
        self.cache_word(cache, victim, C_KEY)
            .store(key.0, Ordering::Release);
        if old != 0 && (count != 0 || bytes != 0) {
            self.record_allocations(ResourceKey(old), count, bytes);
        }
        Self::slot_at(cache, victim)
    }

    /// Word `w` (0: key, 1: count, 2: bytes) of slot `i` of peak block
    /// `block`, one of this region's (`add_peak_freed`'s contract); `i` is
    /// masked to the block's slots.
    #[inline(always)]
    fn slot_word(&self, block: CounterBlock, i: u64, w: u64) -> &std::sync::atomic::AtomicU64 {
        debug_assert!(w < 3);
        let off =
            block.0 + COUNTERS_HEADER + (i & (COUNTER_SLOTS - 1)) * COUNTER_SLOT + (w % 3) * 8;
        // SAFETY: a `CounterBlock` is only made by `claim_block`, from a
        // block of COUNTERS_HEADER + COUNTER_SLOTS * COUNTER_SLOT bytes it
        // reserved (or found, validated) inside the data area of this
        // region (the callers' contract); `i` is masked to
        // COUNTER_SLOTS - 1 and `w` < 3, so `off` is in bounds and
        // 8-aligned.
        unsafe { self.view.atomic_u64_unchecked(off) }
    }

    /// The slot of `key` in `block` (one of the holder thread's): found
    /// within [`COUNTER_PROBE`] slots of its place, or an empty one taken
    /// there (its counts are zero; the key is published with Release).
    #[inline]
    fn find_slot(&self, block: CounterBlock, key: ResourceKey) -> Option<u64> {
        let start = (key.0 >> 3).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 54;
        for p in 0..COUNTER_PROBE {
            let i = (start + p) & (COUNTER_SLOTS - 1);
            let k = self.slot_word(block, i, 0).load(Ordering::Relaxed);
            if k == key.0 {
                return Some(i);
            }
            if k == 0 {
                self.slot_word(block, i, 0).store(key.0, Ordering::Release);
                return Some(i);
            }
        }
        None
    }

    /// Adds to slot `i`'s counts. Single writer (the block's holder): a
    /// load and a store each, no locked instruction.
    #[inline(always)]
    fn add_to_slot(&self, block: CounterBlock, i: u64, count: u64, bytes: u64) {
        add_owned(self.slot_word(block, i, 1), count);
        add_owned(self.slot_word(block, i, 2), bytes);
    }

    /// Adds `count` blocks of `bytes` from stack `key`, freed since the
    /// peak of generation `gen` and allocated before it, to `block` (a peak
    /// block only the calling thread holds). The block is emptied first if
    /// it holds another generation's counts. Never allocates.
    ///
    /// # Safety
    /// `block` came from [`Self::claim_peak_block`] of a writer of this same
    /// region (its slots are unchecked offsets: a block of another
    /// region's writer could lie outside this one).
    pub unsafe fn add_peak_freed(
        &self,
        block: CounterBlock,
        gen: u64,
        key: ResourceKey,
        count: u64,
        bytes: u64,
    ) -> PeakAdd {
        // SAFETY: the header word of a claimed peak block of this region
        // (the caller's contract; see `slot_word`).
        let gen_word = unsafe { self.view.atomic_u64_unchecked(block.0 + PEAK_GEN_WORD) };
        let mut emptied = false;
        if gen_word.load(Ordering::Relaxed) != gen {
            // Another generation's counts: mark the block as being emptied
            // (generation 0: readers skip it), empty it, then publish the
            // new generation with Release.
            gen_word.store(0, Ordering::Relaxed);
            fence(Ordering::Release);
            for i in 0..COUNTER_SLOTS {
                for w in 0..3 {
                    self.slot_word(block, i, w).store(0, Ordering::Relaxed);
                }
            }
            gen_word.store(gen, Ordering::Release);
            emptied = true;
        }
        let Some(i) = self.find_slot(block, key) else {
            return PeakAdd::Full;
        };
        self.add_to_slot(block, i, count, bytes);
        if emptied {
            PeakAdd::AddedInNewGeneration
        } else {
            PeakAdd::Added
        }
    }

    /// Calls `f` with each peak block `owner` holds besides `keep`, until
    /// `f` returns true (a bounded walk of the list; a damaged list ends it
    /// early). Never allocates: the agent calls it while freeing.
    pub fn for_other_peak_blocks(
        &self,
        owner: u64,
        keep: CounterBlock,
        mut f: impl FnMut(CounterBlock) -> bool,
    ) {
        let owner = owner.max(1);
        self.for_each_block(W_PEAK_BLOCKS, BlockKind::PEAK, |cur| {
            cur != keep.0 && self.view.load_u64(cur + 16) == Some(owner) && f(CounterBlock(cur))
        });
    }

    /// Calls `f` with the offset of each block of the writer's list at
    /// `list` (blocks of `kind`), until `f` returns true. Only
    /// well-formed blocks inside the data area are handed out (the
    /// counting path trusts a claimed block's bounds); the walk is bounded
    /// and a damaged block ends it. The next link is read before `f` runs
    /// (`f` may give the block back). Never allocates.
    fn for_each_block(&self, list: u64, kind: BlockKind, mut f: impl FnMut(u64) -> bool) {
        let mut cur = self.word(list).load(Ordering::Acquire);
        let mut steps = 0u64;
        let limit = (self.layout.data_end - self.layout.data_off) / COUNTERS_HEADER + 1;
        while cur != 0 && steps < limit {
            steps += 1;
            let well_formed = cur.is_multiple_of(kind.align)
                && cur >= self.layout.data_off
                && cur
                    .checked_add(kind.size())
                    .is_some_and(|e| e <= self.layout.data_end)
                && self.view.load_u64(cur) == Some(u64::from(kind.tag) | COUNTER_SLOTS << 32);
            if !well_formed {
                return;
            }
            let next = self.view.load_u64(cur + 8);
            if f(cur) {
                return;
            }
            let Some(next) = next else {
                return;
            };
            cur = next;
        }
    }

    /// Bytes of the data area in use.
    pub fn used_bytes(&self) -> u64 {
        self.word(W_BUMP).load(Ordering::Relaxed) - self.layout.data_off
    }
}

/// A decoded stack record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StackRecord {
    /// Return addresses, innermost (leaf) first.
    pub frames: Vec<u64>,
    /// Allocations ever made from this stack. From [`ResourcesReader::stack`]:
    /// those counted in the record itself; from [`ResourcesReader::stacks`]:
    /// also those in the writers' counter blocks (the full count).
    pub alloc_count: u64,
    /// Bytes ever allocated from this stack.
    pub alloc_bytes: u64,
}

/// A decoded thread record.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ThreadRecord {
    /// Kernel thread id.
    pub tid: u64,
    /// Order in which the thread was registered (0 first).
    pub serial: u64,
    /// Thread name (lossy UTF-8).
    pub name: String,
}

/// All stack records of a region, twins folded together.
#[derive(Clone, Debug, Default)]
pub struct StackCatalog {
    /// One entry per distinct trace.
    pub stacks: Vec<StackRecord>,
    /// Every key seen, to its index in `stacks`.
    pub by_key: HashMap<ResourceKey, usize>,
    /// Why the walk was incomplete, if it was.
    pub partial: Option<String>,
}

/// Read-only access to a resources region (the dumper's side).
#[derive(Clone, Copy, Debug)]
pub struct ResourcesReader<'a> {
    view: SharedView,
    layout: Layout,
    _region: std::marker::PhantomData<&'a ()>,
}

impl<'a> ResourcesReader<'a> {
    /// Validates the layout of a mapped resources region.
    pub fn new(region: &'a RegionReader) -> Result<Self, TableError> {
        let h = region.header();
        if region.kind() != RegionKind::Resources {
            return Err(TableError::WrongKind {
                found: h.kind,
                expected: RegionKind::Resources as u32,
            });
        }
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(ResourcesReader {
            view: region.view(),
            layout,
            _region: std::marker::PhantomData,
        })
    }

    /// Reads any bytes as a resources region (fuzzing, tests): validates
    /// the header first.
    ///
    /// # Safety
    /// `view` must stay mapped for `'a`.
    pub unsafe fn from_view(view: SharedView) -> Result<Self, TableError> {
        let h = parse_header(&view, RegionKind::Resources)?;
        let layout = Layout::from_header(&h.layout, h.region_size)?;
        Ok(ResourcesReader {
            view,
            layout,
            _region: std::marker::PhantomData,
        })
    }

    /// End of the published data (bump pointer, clamped to the region).
    fn limit(&self) -> u64 {
        let b = self.view.load_u64(W_BUMP).unwrap_or(0);
        fence(Ordering::Acquire);
        b.clamp(self.layout.data_off, self.layout.data_end)
    }

    fn check_key(&self, key: ResourceKey, tag: u32, hdr: u64) -> Result<(u64, u64), TableError> {
        let k = key.0;
        let bad = |why| Err(TableError::BadKey { key: k, why });
        if !k.is_multiple_of(8) {
            return bad("misaligned");
        }
        let limit = self.limit();
        if k < self.layout.data_off || k.saturating_add(hdr) > limit {
            return bad("outside the data area");
        }
        let w0 = self.view.load_u64(k).unwrap_or(0);
        if w0 as u32 != tag {
            return bad("wrong record type");
        }
        let len = w0 >> 32;
        let max = if tag == TAG_STACK {
            MAX_ENCODED_LEN as u64
        } else {
            MAX_THREAD_NAME as u64
        };
        if len > max || k + hdr + len > limit {
            return bad("length does not fit");
        }
        Ok((k, len))
    }

    /// The compressed bytes of the stack `key`.
    pub fn stack_bytes(&self, key: ResourceKey) -> Result<Vec<u8>, TableError> {
        let mut buf = [0u8; MAX_ENCODED_LEN];
        let n = self.stack_bytes_into(key, &mut buf)?;
        Ok(buf[..n].to_vec())
    }

    /// [`Self::stack_bytes`] into `out` (which holds any stack's bytes),
    /// without allocating: the length written.
    pub fn stack_bytes_into(
        &self,
        key: ResourceKey,
        out: &mut [u8; MAX_ENCODED_LEN],
    ) -> Result<usize, TableError> {
        self.payload_into(key, TAG_STACK, STACK_HEADER, out)
    }

    /// The thread record `key`'s tid and name (into `name`, which holds
    /// any name; its length is returned), without allocating.
    pub fn thread_into(
        &self,
        key: ResourceKey,
        name: &mut [u8; MAX_THREAD_NAME],
    ) -> Result<(u64, usize), TableError> {
        let len = self.payload_into(key, TAG_THREAD, THREAD_HEADER, name)?;
        Ok((self.view.load_u64(key.0 + 16).unwrap_or(0), len))
    }

    /// The bytes after the `hdr`-byte header of record `key` of type
    /// `tag`, into `out` (as long as the type's longest: `check_key`
    /// bounds the length by it); their length.
    fn payload_into(
        &self,
        key: ResourceKey,
        tag: u32,
        hdr: u64,
        out: &mut [u8],
    ) -> Result<usize, TableError> {
        let (k, len) = self.check_key(key, tag, hdr)?;
        let len = len as usize;
        let bad = || TableError::BadKey {
            key: k,
            why: "payload outside the mapping",
        };
        let out = out.get_mut(..len).ok_or_else(bad)?;
        self.view.copy_into(k + hdr, out).ok_or_else(bad)?;
        Ok(len)
    }

    /// The stack `key`, decoded.
    pub fn stack(&self, key: ResourceKey) -> Result<StackRecord, TableError> {
        let bytes = self.stack_bytes(key)?;
        let frames = stack_compression::decode(&bytes, MAX_FRAMES)?;
        let k = key.0;
        Ok(StackRecord {
            frames,
            alloc_count: self.view.load_u64(k + 24).unwrap_or(0),
            alloc_bytes: self.view.load_u64(k + 32).unwrap_or(0),
        })
    }

    /// The thread record `key`.
    pub fn thread(&self, key: ResourceKey) -> Result<ThreadRecord, TableError> {
        let mut name = [0u8; MAX_THREAD_NAME];
        let (tid, len) = self.thread_into(key, &mut name)?;
        Ok(ThreadRecord {
            tid,
            serial: self.view.load_u64(key.0 + 24).unwrap_or(0),
            name: String::from_utf8_lossy(&name[..len]).into_owned(),
        })
    }

    fn max_records(&self) -> u64 {
        (self.layout.data_end - self.layout.data_off) / THREAD_HEADER + 1
    }

    /// Walks a list from `head`, bounded and cycle-safe; returns the keys
    /// and whether the walk was cut short.
    fn walk_list(
        &self,
        head: u64,
        seen: &mut HashSet<u64>,
        budget: &mut u64,
        out: &mut Vec<ResourceKey>,
    ) -> Option<&'static str> {
        let mut cur = head;
        while cur != 0 {
            if *budget == 0 {
                return Some("walk bound reached");
            }
            *budget -= 1;
            if !seen.insert(cur) {
                return Some("cycle in a list");
            }
            // `cur` is untrusted: compare without overflowing.
            if !cur.is_multiple_of(8)
                || cur < self.layout.data_off
                || cur > self.layout.data_end.saturating_sub(16)
            {
                return Some("link outside the data area");
            }
            out.push(ResourceKey(cur));
            match self.view.load_u64(cur + 8) {
                Some(n) => cur = n,
                None => return Some("link outside the mapping"),
            }
        }
        None
    }

    /// Every stack record, with twins (equal bytes stored twice by a race)
    /// folded into one entry whose counters are the sums.
    pub fn stacks(&self) -> StackCatalog {
        let mut seen = HashSet::new();
        let mut budget = self.max_records();
        let mut keys = Vec::new();
        let mut partial = None;
        for b in 0..self.layout.buckets {
            let head = self
                .view
                .load_u64(self.layout.buckets_off + 8 * b)
                .unwrap_or(0);
            fence(Ordering::Acquire);
            if let Some(why) = self.walk_list(head, &mut seen, &mut budget, &mut keys) {
                partial.get_or_insert_with(|| why.to_string());
                if budget == 0 {
                    break;
                }
            }
        }
        // Every record's own counters first, the blocks' slots after: a
        // writer that hands a slot's counts to the record (`evict_for`)
        // empties the slot first, so in this order a reading may miss
        // those counts but never counts them twice.
        let mut records = Vec::with_capacity(keys.len());
        for key in keys {
            let bytes = match self.stack_bytes(key) {
                Ok(b) => b,
                Err(e) => {
                    partial.get_or_insert_with(|| e.to_string());
                    continue;
                }
            };
            match self.stack(key) {
                Ok(r) => records.push((key, bytes, r)),
                Err(e) => {
                    partial.get_or_insert_with(|| e.to_string());
                }
            }
        }
        fence(Ordering::Acquire);
        let extra = self.counter_sums(&mut partial);
        let mut catalog = StackCatalog::default();
        let mut by_bytes: HashMap<Vec<u8>, usize> = HashMap::new();
        for (key, bytes, mut rec) in records {
            if let Some((c, b)) = extra.get(&key.0) {
                rec.alloc_count = rec.alloc_count.saturating_add(*c);
                rec.alloc_bytes = rec.alloc_bytes.saturating_add(*b);
            }
            let idx = match by_bytes.get(&bytes) {
                Some(&i) => {
                    let s = &mut catalog.stacks[i];
                    s.alloc_count = s.alloc_count.saturating_add(rec.alloc_count);
                    s.alloc_bytes = s.alloc_bytes.saturating_add(rec.alloc_bytes);
                    i
                }
                None => {
                    catalog.stacks.push(rec);
                    by_bytes.insert(bytes, catalog.stacks.len() - 1);
                    catalog.stacks.len() - 1
                }
            };
            catalog.by_key.insert(key, idx);
        }
        catalog.partial = partial;
        catalog
    }

    /// Sums of every counter block's slots, by stack key. Bounded and
    /// cycle-safe like every walk; a bad block marks the result partial.
    fn counter_sums(&self, partial: &mut Option<String>) -> HashMap<u64, (u64, u64)> {
        self.block_sums(W_COUNTERS, None, partial)
    }

    /// Per stack key, the blocks and bytes freed since the peak of
    /// generation `gen` that had been allocated before it (the peak blocks
    /// of that generation, summed), and whether the sums are partial.
    pub fn peak_freed(&self, gen: u64) -> (HashMap<ResourceKey, (u64, u64)>, Option<String>) {
        let mut partial = None;
        let sums = self.block_sums(W_PEAK_BLOCKS, Some(gen), &mut partial);
        (
            sums.into_iter().map(|(k, v)| (ResourceKey(k), v)).collect(),
            partial,
        )
    }

    /// Sums of the slots of every block on list `list` (of the kinds that
    /// list holds, [`BlockKind::read_as`]; with `gen`, only blocks whose
    /// header word 3 equals it), by key.
    fn block_sums(
        &self,
        list: u64,
        gen: Option<u64>,
        partial: &mut Option<String>,
    ) -> HashMap<u64, (u64, u64)> {
        let mut sums: HashMap<u64, (u64, u64)> = HashMap::new();
        let head = self.view.load_u64(list).unwrap_or(0);
        fence(Ordering::Acquire);
        let mut seen = HashSet::new();
        let mut budget = self.max_records();
        let mut blocks = Vec::new();
        if let Some(why) = self.walk_list(head, &mut seen, &mut budget, &mut blocks) {
            partial.get_or_insert_with(|| format!("counter blocks: {why}"));
        }
        let limit = self.limit();
        // Blocks laid out honestly cannot hold more slots than the data
        // area has room for; hostile overlapping blocks could claim far
        // more, so the total work is capped at that.
        let mut slot_budget = (limit - self.layout.data_off) / COUNTER_SLOT + 1;
        for b in blocks {
            let k = b.0;
            let w0 = self.view.load_u64(k).unwrap_or(0);
            let slots = w0 >> 32;
            let Some(kind) = BlockKind::read_as(list, w0 as u32) else {
                partial.get_or_insert_with(|| "a counter block is corrupt".to_string());
                continue;
            };
            let size = kind.header + slots.min(1 << 20) * kind.slot;
            if slots > 1 << 16 || k.saturating_add(size) > limit {
                partial.get_or_insert_with(|| "a counter block is corrupt".to_string());
                continue;
            }
            if let Some(g) = gen {
                // Acquire: the slots of the generation read are seen.
                let bg = self
                    .view
                    .atomic_u64(k + PEAK_GEN_WORD)
                    .map_or(0, |w| w.load(Ordering::Acquire));
                if bg != g {
                    continue;
                }
            }
            // Slots of any kind are at least COUNTER_SLOT bytes.
            if slots > slot_budget {
                partial.get_or_insert_with(|| "counter blocks overlap".to_string());
                break;
            }
            slot_budget -= slots;
            for i in 0..slots {
                // Key, count and bytes are the first three words of a
                // slot of every kind.
                let o = k + kind.header + i * kind.slot;
                let key = self.view.load_u64(o).unwrap_or(0);
                if key == 0 {
                    continue;
                }
                fence(Ordering::Acquire);
                let c = self.view.load_u64(o + 8).unwrap_or(0);
                let by = self.view.load_u64(o + 16).unwrap_or(0);
                fence(Ordering::Acquire);
                if self.view.load_u64(o).unwrap_or(0) != key {
                    // Taken by another stack meanwhile (its writer moved
                    // the counts to the old stack's record): they may be
                    // the old stack's or the new one's, so neither.
                    continue;
                }
                let e = sums.entry(key).or_default();
                e.0 = e.0.saturating_add(c);
                e.1 = e.1.saturating_add(by);
            }
        }
        sums
    }

    /// Every thread record (newest first), and why the walk was cut short
    /// if it was.
    pub fn threads(&self) -> (Vec<(ResourceKey, ThreadRecord)>, Option<String>) {
        let head = self.view.load_u64(W_THREADS).unwrap_or(0);
        fence(Ordering::Acquire);
        let mut seen = HashSet::new();
        let mut budget = self.max_records();
        let mut keys = Vec::new();
        let mut partial = self
            .walk_list(head, &mut seen, &mut budget, &mut keys)
            .map(str::to_string);
        let mut out = Vec::with_capacity(keys.len());
        for k in keys {
            match self.thread(k) {
                Ok(t) => out.push((k, t)),
                Err(e) => {
                    partial.get_or_insert_with(|| e.to_string());
                }
            }
        }
        (out, partial)
    }

    /// Number of stack records stored (as counted by the writer).
    pub fn stack_count(&self) -> u64 {
        self.view.load_u64(W_STACK_COUNT).unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stack_compression::encode;

    fn region(size: u64, buckets: u64) -> RegionWriter {
        ResourcesWriter::create_region(size, buckets).unwrap()
    }

    /// A distinct, realistic compressed trace for each `i`.
    fn trace(i: u64, frames: usize) -> Vec<u8> {
        let f: Vec<u64> = (0..frames as u64)
            .map(|k| 0x5555_0000_0000 + i * 0x1000 + k * 0x40)
            .collect();
        let mut out = Vec::new();
        encode(&f, &mut out);
        out
    }

    #[test]
    fn compact_interning_touches_one_page_of_heads_and_readers_fold_its_twins() {
        let r = region(4 << 20, DEFAULT_BUCKETS);
        let w = ResourcesWriter::new(&r).unwrap();
        let traces: Vec<Vec<u8>> = (0..2000).map(|i| trace(i, 3)).collect();
        let keys: Vec<ResourceKey> = traces
            .iter()
            .map(|t| w.intern_stack_trace_compact(t).unwrap().0)
            .collect();
        // Deduplicated among themselves.
        for (t, k) in traces.iter().zip(&keys) {
            assert_eq!(w.intern_stack_trace_compact(t).unwrap(), (*k, false));
        }
        // Only the first page of list heads was written.
        let heads = |range: std::ops::Range<u64>| {
            range
                .filter(|b| w.view.load_u64(HEADER_SIZE + 8 * b).unwrap() != 0)
                .count()
        };
        assert!(heads(0..COMPACT_CHAINS) > 400);
        assert_eq!(heads(COMPACT_CHAINS..DEFAULT_BUCKETS), 0);
        // The usual interning of one of them stores a twin (in its own
        // chain), which a reader folds into the same stack.
        let (twin, stored) = w.intern_stack_trace(&traces[7]).unwrap();
        assert!(stored);
        assert_ne!(twin, keys[7]);
        let rr = r.open_reader().unwrap();
        let cat = ResourcesReader::new(&rr).unwrap().stacks();
        assert_eq!(cat.partial, None);
        assert_eq!(cat.stacks.len(), traces.len());
        assert_eq!(cat.by_key[&twin], cat.by_key[&keys[7]]);
        assert!(keys.iter().all(|k| cat.by_key.contains_key(k)));
    }

    #[test]
    fn dedup_over_long_chains() {
        let r = region(1 << 20, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let n = 64 * 2 + 71; // more than twice the bucket count
        let traces: Vec<Vec<u8>> = (0..n).map(|i| trace(i, 1 + (i % 9) as usize)).collect();
        let keys: Vec<ResourceKey> = traces
            .iter()
            .map(|t| {
                let (k, inserted) = w.intern_stack_trace(t).unwrap();
                assert!(inserted);
                k
            })
            .collect();
        let distinct: HashSet<_> = keys.iter().collect();
        assert_eq!(distinct.len(), n as usize);
        // Re-interning, in another order, finds every key.
        for (t, k) in traces.iter().zip(&keys).rev() {
            assert_eq!(w.intern_stack_trace(t).unwrap(), (*k, false));
        }
        let used = w.used_bytes();
        for (t, k) in traces.iter().zip(&keys) {
            assert_eq!(w.intern_stack_trace(t).unwrap(), (*k, false));
        }
        assert_eq!(w.used_bytes(), used, "hits must not use space");

        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        assert_eq!(reader.stack_count(), n);
        for (t, k) in traces.iter().zip(&keys) {
            assert_eq!(&reader.stack_bytes(*k).unwrap(), t);
            let decoded = reader.stack(*k).unwrap();
            let mut again = Vec::new();
            encode(&decoded.frames, &mut again);
            assert_eq!(&again, t);
        }
        let cat = reader.stacks();
        assert_eq!(cat.partial, None);
        assert_eq!(cat.stacks.len(), n as usize);
        assert_eq!(cat.by_key.len(), n as usize);
        for k in &keys {
            assert!(cat.by_key.contains_key(k));
        }
    }

    #[test]
    fn empty_trace() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let (k, inserted) = w.intern_stack_trace(&[]).unwrap();
        assert!(inserted);
        assert_eq!(w.intern_stack_trace(&[]).unwrap(), (k, false));
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let s = reader.stack(k).unwrap();
        assert!(s.frames.is_empty());
        assert_eq!(reader.stacks().stacks.len(), 1);
    }

    #[test]
    fn longest_trace_and_one_byte_over() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let frames: Vec<u64> = (0..MAX_FRAMES)
            .map(|i| if i % 2 == 0 { 1u64 << 63 } else { 0 })
            .collect();
        let mut bytes = Vec::new();
        encode(&frames, &mut bytes);
        assert_eq!(bytes.len(), MAX_ENCODED_LEN);
        let (k, inserted) = w.intern_stack_trace(&bytes).unwrap();
        assert!(inserted);
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        assert_eq!(reader.stack(k).unwrap().frames, frames);
        let used = w.used_bytes();
        bytes.push(0);
        assert!(matches!(
            w.intern_stack_trace(&bytes),
            Err(TableError::TooLarge(_))
        ));
        assert_eq!(w.used_bytes(), used);
    }

    #[test]
    fn writing_until_full_loses_nothing() {
        // 16 KiB: header page, bucket page, then 8 KiB of records.
        let r = region(4 * 4096, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let mut stored = Vec::new();
        let mut i = 0;
        let full_at = loop {
            let t = trace(i, 5);
            match w.intern_stack_trace(&t) {
                Ok((k, true)) => stored.push((t, k)),
                Ok((_, false)) => panic!("distinct trace deduplicated"),
                Err(TableError::Full(_)) => break i,
                Err(e) => panic!("{e}"),
            }
            i += 1;
            assert!(i < 10_000, "never full");
        };
        assert!(full_at > 10);
        // Still full for new records, threads included...
        assert!(matches!(
            w.intern_stack_trace(&trace(full_at + 1, 7)),
            Err(TableError::Full(_))
        ));
        assert!(matches!(
            w.insert_thread_info(1, b"late"),
            Err(TableError::Full(_))
        ));
        // ...but a known trace is still found (no space needed).
        for (t, k) in &stored {
            assert_eq!(w.intern_stack_trace(t).unwrap(), (*k, false));
        }
        assert!(w.used_bytes() <= 2 * 4096);
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        for (t, k) in &stored {
            assert_eq!(&reader.stack_bytes(*k).unwrap(), t);
        }
        let cat = reader.stacks();
        assert_eq!(cat.partial, None);
        assert_eq!(cat.stacks.len(), stored.len());
    }

    #[test]
    fn a_renamed_threads_records_share_its_serial_and_only_its_own() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let first = w.insert_thread_info(10, b"java").unwrap();
        let other = w.insert_thread_info(11, b"other").unwrap();
        let renamed = w.insert_renamed_thread_info(first, 10, b"G1 Main").unwrap();
        let again = w
            .insert_renamed_thread_info(renamed, 10, b"G1 Again")
            .unwrap();
        // Not a record of that tid, not a record at all, out of range:
        // a fresh serial, never another thread's.
        let wrong_tid = w.insert_renamed_thread_info(other, 12, b"t12").unwrap();
        let not_record = w
            .insert_renamed_thread_info(ResourceKey(first.0 + 8), 10, b"x")
            .unwrap();
        let outside = w
            .insert_renamed_thread_info(ResourceKey(u64::MAX - 7), 10, b"y")
            .unwrap();
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let serial = |k| reader.thread(k).unwrap().serial;
        assert_eq!([serial(first), serial(renamed), serial(again)], [0; 3]);
        assert_eq!(serial(other), 1);
        assert_eq!(reader.thread(again).unwrap().name, "G1 Again");
        assert_eq!(
            [serial(wrong_tid), serial(not_record), serial(outside)],
            [2, 3, 4]
        );
    }

    #[test]
    fn thread_info_round_trip() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let long = vec![b'x'; MAX_THREAD_NAME + 10];
        let k1 = w.insert_thread_info(4242, b"main").unwrap();
        let k2 = w.insert_thread_info(u64::MAX, b"").unwrap();
        let k3 = w.insert_thread_info(7, &long).unwrap();
        let k4 = w.insert_thread_info(8, "wörker-é".as_bytes()).unwrap();
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let t1 = reader.thread(k1).unwrap();
        assert_eq!((t1.tid, t1.serial, t1.name.as_str()), (4242, 0, "main"));
        let t2 = reader.thread(k2).unwrap();
        assert_eq!((t2.tid, t2.serial, t2.name.as_str()), (u64::MAX, 1, ""));
        let t3 = reader.thread(k3).unwrap();
        assert_eq!(t3.name, "x".repeat(MAX_THREAD_NAME));
        assert_eq!(reader.thread(k4).unwrap().name, "wörker-é");
        let (all, partial) = reader.threads();
        assert_eq!(partial, None);
        let keys: Vec<_> = all.iter().map(|(k, _)| *k).collect();
        assert_eq!(keys, vec![k4, k3, k2, k1], "newest first");
        // A thread key is not a stack key and vice versa.
        let (sk, _) = w.intern_stack_trace(&trace(1, 3)).unwrap();
        assert!(matches!(reader.stack(k1), Err(TableError::BadKey { .. })));
        assert!(matches!(reader.thread(sk), Err(TableError::BadKey { .. })));
    }

    #[test]
    fn cumulative_counters() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let (a, _) = w.intern_stack_trace(&trace(1, 4)).unwrap();
        let (b, _) = w.intern_stack_trace(&trace(2, 4)).unwrap();
        for s in 1..=10 {
            w.record_allocation(a, s);
        }
        w.record_allocation(b, 1 << 40);
        // Keys that are not records are ignored, never a crash.
        w.record_allocation(ResourceKey(0), 5);
        w.record_allocation(ResourceKey(u64::MAX - 7), 5);
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let sa = reader.stack(a).unwrap();
        assert_eq!((sa.alloc_count, sa.alloc_bytes), (10, 55));
        let sb = reader.stack(b).unwrap();
        assert_eq!((sb.alloc_count, sb.alloc_bytes), (1, 1 << 40));
        let cat = reader.stacks();
        let ia = cat.by_key[&a];
        assert_eq!(cat.stacks[ia].alloc_count, 10);
        assert_eq!(cat.stacks[cat.by_key[&b]].alloc_bytes, 1 << 40);
    }

    #[test]
    fn bad_keys_are_refused() {
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let (k, _) = w.intern_stack_trace(&trace(1, 4)).unwrap();
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        for bad in [
            0,
            8,
            k.0 + 4,
            k.0 + 8,
            1 << 16,
            u64::MAX - 7,
            u64::MAX,
            4096,
        ] {
            assert!(
                matches!(
                    reader.stack(ResourceKey(bad)),
                    Err(TableError::BadKey { .. })
                ),
                "{bad:#x}"
            );
            assert!(reader.thread(ResourceKey(bad)).is_err());
        }
    }

    #[test]
    fn reader_folds_twins() {
        // A race in an older writer (or another implementation) may store
        // one trace twice; build such a twin by hand in another bucket.
        let r = region(1 << 16, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        let t = trace(9, 5);
        let (k1, _) = w.intern_stack_trace(&t).unwrap();
        let (other, _) = w.intern_stack_trace(&trace(10, 5)).unwrap();
        let size = STACK_HEADER + round8(t.len() as u64);
        let k2 = w.reserve(size).unwrap();
        for word in [0, 16] {
            let v = w.view.load_u64(k1.0 + word).unwrap();
            w.word(k2 + word).store(v, Ordering::Relaxed);
        }
        w.write_payload(k2 + STACK_HEADER, &t);
        let crc = CRC32C.checksum(&t);
        let bucket = HEADER_SIZE + 8 * ((u64::from(crc) + 1) & 63);
        let head = w.word(bucket).load(Ordering::Relaxed);
        w.word(k2 + 8).store(head, Ordering::Relaxed);
        w.word(bucket).store(k2, Ordering::Release);
        w.record_allocation(k1, 100);
        w.record_allocation(ResourceKey(k2), 20);
        w.record_allocation(ResourceKey(k2), 3);
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let cat = reader.stacks();
        assert_eq!(cat.partial, None);
        assert_eq!(cat.stacks.len(), 2);
        let i = cat.by_key[&k1];
        assert_eq!(cat.by_key[&ResourceKey(k2)], i);
        assert_ne!(cat.by_key[&other], i);
        assert_eq!(
            (cat.stacks[i].alloc_count, cat.stacks[i].alloc_bytes),
            (3, 123)
        );
    }

    #[test]
    fn concurrent_interning_agrees_on_keys() {
        let r = region(8 << 20, 64);
        let w = ResourcesWriter::new(&r).unwrap();
        const THREADS: u64 = 4;
        const PER: u64 = 600;
        let barrier = std::sync::Barrier::new(THREADS as usize);
        // Thread t interns traces t*PER/2 .. t*PER/2 + PER: each overlaps
        // its neighbours by half, in a different order per thread.
        let results: Vec<Vec<(u64, ResourceKey)>> = std::thread::scope(|s| {
            let handles: Vec<_> = (0..THREADS)
                .map(|t| {
                    let barrier = &barrier;
                    s.spawn(move || {
                        let mut ids: Vec<u64> = (t * PER / 2..t * PER / 2 + PER).collect();
                        if t % 2 == 1 {
                            ids.reverse();
                        }
                        barrier.wait();
                        ids.into_iter()
                            .map(|i| (i, w.intern_stack_trace(&trace(i, 6)).unwrap().0))
                            .collect()
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let mut by_id: HashMap<u64, ResourceKey> = HashMap::new();
        for (i, k) in results.into_iter().flatten() {
            assert_eq!(*by_id.entry(i).or_insert(k), k, "trace {i} got two keys");
        }
        let distinct = (THREADS - 1) * PER / 2 + PER;
        assert_eq!(by_id.len() as u64, distinct);
        let rr = r.open_reader().unwrap();
        let reader = ResourcesReader::new(&rr).unwrap();
        let cat = reader.stacks();
        assert_eq!(cat.partial, None);
        assert_eq!(cat.stacks.len() as u64, distinct);
        assert_eq!(reader.stack_count(), distinct);
        for (i, k) in &by_id {
            assert_eq!(reader.stack_bytes(*k).unwrap(), trace(*i, 6));
            assert!(cat.by_key.contains_key(k));
        }
    }
}
