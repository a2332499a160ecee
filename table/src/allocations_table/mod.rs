//! The live-allocations table: one record per live heap block.
//!
//! Layout (after the header page):
//! `[shards: shard_count x 64 B][index windows][nodes: node_capacity x 32 B]
//! [writer lines: line_count x 64 B]`.
//! `layout[0]` shard count (power of two), `[1]` shards offset, `[2]` slots
//! per index window (power of two, >= 1024), `[3]` index offset, `[4]` nodes
//! offset, `[5]` node capacity, `[6]` writer lines offset and `[7]` their
//! count (format 1.5; 0 before). Dynamic word `KIND_WORDS+0` is the node
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
//! **Young blocks** (`young.rs`). A writer thread's last 16 allocations
//! keep their address -> node pair in the thread's own ring instead of an
//! index slot, and are counted in the thread's *writer line* instead of a
//! shard; a free by the same thread (most frees) then takes no lock and
//! probes nothing. The 17th allocation promotes the oldest into the index.
//! Readers see no difference but the counters they sum (shards and lines).
//!
//! **Owner tables** (`owner_table.rs`). A thread whose blocks outlive its
//! ring keeps them, while the agent's policy says so, in a hashed table of
//! its own with the ring's entry protocol (counted in its writer line), so
//! its own free of such a block takes no lock either; a full set evicts
//! its oldest into the index. Readers see no difference.
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
//! - A node's words change only under its shard's lock (or, for a young
//!   or owner-table block, by the one thread that holds its ring or table
//!   entry, see `young.rs`),
//!   always inside a seqlock write: `seq` made odd, a Release fence, the words, then `seq`
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
//!
//! The code is one file per concept: `layout.rs` (sizing and offsets),
//! `record.rs` (nodes and their seqlock), `index.rs` (the per-shard
//! address index), `shards.rs` (shard choice, locks, spill, counters),
//! `writer.rs` (the writer's operations and node caches), `young.rs`
//! (young blocks and writer lines), `owner_table.rs` (a thread's blocks
//! that outlive its ring) and `reader.rs` (the walk); each states its own
//! invariants.

use std::sync::atomic::{fence, AtomicU32, AtomicU64, Ordering};

use crate::error::TableError;
use crate::header::{
    offsets, parse_header, read_counters, Counters, DroppedReason, HeaderCounters, RegionKind,
    HEADER_SIZE,
};
use crate::region::{RegionReader, RegionWriter};
use crate::resources_table::ResourceKey;
use crate::shared_view::SharedView;

mod index;
mod layout;
mod owner_table;
mod reader;
mod record;
mod shards;
mod writer;
mod young;

#[cfg(test)]
mod tests;

use index::*;
use layout::*;
use owner_table::*;
use writer::*;
use young::*;

pub use index::{prefetch_line, Prefetched};
pub use layout::{AllocationsConfig, MAX_NODES};
pub use owner_table::{
    OwnedInsert, OWNER_CHECK, OWNER_HOLDS, OWNER_SETS, OWNER_TABLES, OWNER_WAYS,
};
pub use reader::{
    AllocationsReader, WalkStats, WALK_MAX_DEFERRED, WALK_RETRY_BUDGET, WALK_RETRY_TIME,
};
pub use record::{AllocationRecord, UnsharedWalkError};
pub(crate) use shards::add_shard_counters;
pub use writer::{AllocationsWriter, Freed, InsertError, NodeCache, LIVE_BATCH, NODE_CACHE};
pub use young::{OwnClaim, YoungRegistry, YoungRing, YOUNG, YOUNG_RINGS};
