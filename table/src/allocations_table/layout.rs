//! Where everything lives in an allocations region: the sizing asked for
//! ([`AllocationsConfig`]), the layout words in the header and the offsets
//! they give ([`Layout`]), and the constants of the node, shard and index
//! encodings.
//!
//! Invariants:
//! - A [`Layout`] read from a header is validated against the region size
//!   before any offset is used: every shard, index window and node it
//!   names lies inside the region.
//! - Shard field offsets are fixed: readers rely on the counters' places
//!   (`S_TOTAL_ALLOCS`, `S_TOTAL_BYTES`, `S_LIVE_BYTES`, `S_LEN`).

use super::*;

pub(super) const NODE_SIZE: u64 = 32;
pub(super) const SHARD_SIZE: u64 = 64;
/// Smallest index window in use: one page of `u32` slots. A window's first
/// page is never returned to the system, so small shards rehash (clearing
/// tombstones) without a system call or a page fault.
pub(super) const MIN_CAP_LOG2: u32 = 10;
pub(super) const EMPTY: u32 = 0;
pub(super) const TOMBSTONE: u32 = u32::MAX;
pub(super) const NODE_BITS: u32 = 27;
/// Largest node capacity the index encoding allows.
pub const MAX_NODES: u64 = (1 << NODE_BITS) - 2;
pub(super) const NODE_MASK: u32 = (1 << NODE_BITS) - 1;
pub(super) const CHUNK: u32 = 16;
pub(super) const SIZE_MASK: u64 = (1 << 48) - 1;
pub(super) const W_NODE_HW: u64 = offsets::KIND_WORDS;

// Shard field offsets (each a u32).
pub(super) const S_LOCK: u64 = 0;
pub(super) const S_WINDOW: u64 = 4;
pub(super) const S_CAP_LOG2: u64 = 8;
pub(super) const S_LEN: u64 = 12;
pub(super) const S_TOMBS: u64 = 16;
pub(super) const S_FREE: u64 = 20;
// Per-shard cumulative counters (u64, written under the shard lock, read
// racily by readers and summed over shards).
pub(super) const S_TOTAL_ALLOCS: u64 = 24;
pub(super) const S_TOTAL_BYTES: u64 = 32;
// Live bytes of the shard (u64, under the shard lock): summed by readers,
// so the allocation path touches no process-wide live counter.
pub(super) const S_LIVE_BYTES: u64 = 40;
// Writers only (u32, set under the shard lock, never cleared): this shard
// once had no index room for a block of its address group, which then went
// to its spill shard; lookups that miss here must look there too.
pub(super) const S_SPILLED: u64 = 48;
// Writers only (u32, under the shard lock): live blocks of the shard
// inserted *direct* (found by node, not through the index; see
// [`AllocationsWriter::insert_direct`]). `S_LEN` counts every live block
// (readers sum it); the index holds `S_LEN - S_DIRECT` of them.
pub(super) const S_DIRECT: u64 = 52;
/// Size of one writer counter line (see `young.rs`).
pub(super) const LINE_SIZE: u64 = 64;
/// Writer counter lines in a region this version creates: one per young
/// ring, and line 0 shared by threads that have none.
pub(super) const WRITER_LINES: u64 = YOUNG_RINGS as u64 + 1;
/// Most writer lines a reader accepts.
pub(super) const MAX_LINES: u64 = 1 << 16;
/// Addresses in one aligned range of this size share a shard group: glibc
/// gives each thread's arena heaps of 64 MiB, aligned, so threads mostly
/// write disjoint shards (their lock, counters and index lines stay in one
/// core's cache).
pub(super) const GROUP_SHIFT: u32 = 26;

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
pub(super) struct Layout {
    pub(super) shards: u64,
    pub(super) shards_off: u64,
    pub(super) slots_max: u64,
    pub(super) index_off: u64,
    pub(super) nodes_off: u64,
    pub(super) capacity: u64,
    /// Writer counter lines (see `young.rs`): offset, 0 when the region
    /// has none (written before format 1.5).
    pub(super) lines_off: u64,
    /// Number of writer counter lines (0 = none).
    pub(super) lines: u64,
}

pub(super) fn page_up(n: u64) -> u64 {
    n.div_ceil(4096) * 4096
}

impl Layout {
    pub(super) fn new(cfg: AllocationsConfig) -> Result<(Self, u64), TableError> {
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
        let lines_off = page_up(nodes_off + cfg.capacity * NODE_SIZE);
        let end = page_up(lines_off + WRITER_LINES * LINE_SIZE);
        let l = Layout {
            shards,
            shards_off,
            slots_max,
            index_off,
            nodes_off,
            capacity: cfg.capacity,
            lines_off,
            lines: WRITER_LINES,
        };
        l.check(end)?;
        Ok((l, end))
    }

    pub(super) fn from_header(w: &[u64; 8], region_size: u64) -> Result<Self, TableError> {
        let l = Layout {
            shards: w[0],
            shards_off: w[1],
            slots_max: w[2],
            index_off: w[3],
            nodes_off: w[4],
            capacity: w[5],
            lines_off: w[6],
            lines: w[7],
        };
        l.check(region_size)?;
        Ok(l)
    }

    pub(super) fn check(&self, region_size: u64) -> Result<(), TableError> {
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
            || !self.index_off.is_multiple_of(4096)
        {
            return bad("shard array placement");
        }
        // Every field is untrusted: no arithmetic may overflow. shards <=
        // 2^16 and slots_max <= 2^32 (checked above), so the product fits.
        let index_fits = match (self.shards * 2 * self.slots_max * 4).checked_add(self.index_off) {
            Some(index_end) => self.nodes_off >= index_end,
            None => false,
        };
        if !index_fits || !self.nodes_off.is_multiple_of(4096) {
            return bad("index placement");
        }
        let nodes_end = match (self.capacity * NODE_SIZE).checked_add(self.nodes_off) {
            Some(end) if end <= region_size => end,
            _ => return bad("nodes do not fit in the region"),
        };
        if self.lines == 0 {
            return Ok(());
        }
        // lines <= MAX_LINES, so the product cannot overflow.
        let lines_fit = self.lines <= MAX_LINES
            && self.lines_off >= nodes_end
            && self.lines_off.is_multiple_of(LINE_SIZE)
            && self
                .lines_off
                .checked_add(self.lines * LINE_SIZE)
                .is_some_and(|end| end <= region_size);
        if !lines_fit {
            return bad("writer lines placement");
        }
        Ok(())
    }

    pub(super) fn words(&self) -> [u64; 8] {
        [
            self.shards,
            self.shards_off,
            self.slots_max,
            self.index_off,
            self.nodes_off,
            self.capacity,
            self.lines_off,
            self.lines,
        ]
    }
}
