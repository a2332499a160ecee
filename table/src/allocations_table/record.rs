//! Records (nodes) and their seqlock: how an [`AllocationRecord`] is
//! packed into a node's four words, and how a writer changes a node.
//!
//! Invariants:
//! - A node's words change only under its shard's lock (or by the thread
//!   holding a young block's ring entry, `young.rs`), inside a seqlock
//!   write: `seq` made odd, a Release fence, the words, then `seq` made
//!   even with a Release store. (The reader's side is in `reader.rs`: it
//!   accepts a node only between two equal even readings, and takes one
//!   whose address is 0 as free whatever its other words hold.)
//! - One change is a single store outside the seqlock: a block's free
//!   that keeps the node for its thread's cache stores 0 into the address
//!   word alone ([`AllocationsWriter::empty_node`]). A reader's reading of
//!   the node then holds either the old address with the block's other
//!   words, unchanged (the block, live at that instant), or address 0
//!   (free); nothing in between exists to tear. The node's next use is a
//!   seqlock write, which a reader that started before it sees as a
//!   change of `seq`.
//! - A live block keeps the same node from insert to remove; a free node
//!   in a shard's free list has address 0 and holds the next free node + 1
//!   in `w3`; one in a thread's cache has address 0 and stale words.

use super::*;

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

/// The record a node holds, from its four words as read (`None`: a free
/// node, whose address word is 0). The seqlock is the caller's business.
#[inline]
pub(super) fn decode_node(w0: u64, w1: u64, w2: u64, w3: u64) -> Option<AllocationRecord> {
    (w1 != 0).then(|| AllocationRecord {
        address: w1,
        size: w2 & SIZE_MASK,
        stack: ResourceKey((w3 & 0xffff_ffff) * 8),
        thread: ResourceKey((w0 >> 32) * 8),
        timestamp_us: (w2 >> 48) << 32 | w3 >> 32,
    })
}

/// Why [`AllocationsWriter::for_each_live_unshared`] stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum UnsharedWalkError {
    /// A node was mid-update: a writer is at work after all.
    Changing,
}

impl AllocationsWriter<'_> {
    /// Calls `f` with every live record, reading the node array directly.
    /// Only for a table no thread writes while it runs (the forking
    /// thread of a process with no other thread, in its fork's prepare
    /// handler): a node found mid-update (its `seq` odd) ends the walk with
    /// an error, since a writer is at work after all. Reads nothing but
    /// nodes below the high-water mark; never allocates.
    pub fn for_each_live_unshared(
        &self,
        mut f: impl FnMut(AllocationRecord),
    ) -> Result<(), UnsharedWalkError> {
        let hw = self.u64_at(W_NODE_HW).load(Ordering::Acquire);
        for node in 0..hw.min(self.layout.capacity) {
            let node = node as u32;
            let w0 = self.node_word(node, 0).load(Ordering::Acquire);
            if w0 & 1 == 1 {
                return Err(UnsharedWalkError::Changing);
            }
            let w = |i| self.node_word(node, i).load(Ordering::Relaxed);
            if let Some(rec) = decode_node(w0, w(1), w(2), w(3)) {
                f(rec);
            }
        }
        Ok(())
    }

    /// Nodes handed out so far (the bound of
    /// [`Self::for_each_live_unshared`]'s walk).
    pub fn node_high_water(&self) -> u64 {
        self.u64_at(W_NODE_HW)
            .load(Ordering::Relaxed)
            .min(self.layout.capacity)
    }

    #[inline]
    pub(super) fn node_word(&self, node: u32, w: u64) -> &AtomicU64 {
        // Node numbers are read back from the region (index slots, free
        // lists). Only this process writes them, but clamping keeps even a
        // region scribbled over by a wild write in the program in bounds
        // (one conditional move).
        debug_assert!(u64::from(node) < self.layout.capacity);
        let node = u64::from(node).min(self.layout.capacity - 1);
        self.u64_at(self.layout.nodes_off + node * NODE_SIZE + w * 8)
    }

    #[inline]
    pub(super) fn node_addr(&self, node: u32) -> u64 {
        self.node_word(node, 1).load(Ordering::Relaxed)
    }

    /// Seqlock write of a node's four words.
    #[inline]
    pub(super) fn write_node(&self, node: u32, thread32: u32, w1: u64, w2: u64, w3: u64) {
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

    /// Empties the node of a block being freed whose node stays with the
    /// freeing thread (its cache): the address word alone, one store (see
    /// the module doc). Relaxed: a reader that still sees the address
    /// reports a block that was live during its reading; the thread's own
    /// later write of the node is ordered after this store by program
    /// order.
    #[inline(always)]
    pub(super) fn empty_node(&self, node: u32) {
        self.node_word(node, 1).store(0, Ordering::Relaxed);
    }

    #[inline(always)]
    pub(super) fn encode(rec: &AllocationRecord) -> Option<(u32, u64, u64, u64)> {
        let sk = rec.stack.0;
        let tk = rec.thread.0;
        if rec.address == 0
            || !sk.is_multiple_of(8)
            || !tk.is_multiple_of(8)
            || sk >> 35 != 0
            || tk >> 35 != 0
        {
            return None;
        }
        let ts = rec.timestamp_us & SIZE_MASK;
        let w2 = rec.size.min(SIZE_MASK) | (ts >> 32) << 48;
        let w3 = (sk / 8) | (ts & 0xffff_ffff) << 32;
        Some(((tk / 8) as u32, rec.address, w2, w3))
    }
}
