//! Per-thread state of the agent: the re-entrancy flag, the thread's
//! record key, its stack bounds and a small cache of stacks already
//! interned.
//!
//! Invariants:
//! - The state is a `const`-initialised thread-local without a destructor,
//!   so touching it never allocates and it stays valid until the thread's
//!   memory is released (also while TLS destructors of other libraries run).
//! - `busy` is set while the agent works on this thread; any allocation
//!   that happens meanwhile (from the agent's own set-up, or from a signal
//!   handler that interrupted it) passes through unrecorded.
//! - Cached keys belong to one generation of regions (a new generation
//!   starts in a forked child); a stale generation clears the cache.

use std::cell::{Cell, UnsafeCell};

use heapdump_table::allocations_table::NodeCache;
use heapdump_table::resources_table::CounterBlock;

/// Entries in the per-thread stack cache: 4-way set associative, 16 KiB
/// per thread. A hit skips encoding, hashing with CRC and the shared table.
pub const CACHE_SIZE: usize = 1024;
/// Ways per set (kept in most-recently-used order).
pub const CACHE_WAYS: usize = 4;

/// One cache entry: the hash of a captured trace and its resource key.
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheEntry {
    /// Hash of (frames, depth); 0 = empty.
    pub hash: u64,
    /// Resource key of the interned trace.
    pub key: u64,
    /// Slot of this trace in the thread's counter block, last time.
    pub slot: u32,
}

/// Everything the agent keeps per thread.
pub struct ThreadState {
    /// The agent is running on this thread.
    pub busy: Cell<bool>,
    /// The agent is doing its own set-up on this thread: allocations it
    /// causes are its own, not the program's, and are not counted dropped.
    pub internal: Cell<bool>,
    /// Generation of the regions the keys below belong to.
    pub generation: Cell<u64>,
    /// Thread record key (0 = not registered in this generation).
    pub thread_key: Cell<u64>,
    /// Allocations recorded by this thread (drives name re-checks).
    pub allocs: Cell<u64>,
    /// Name bytes last registered (Linux names are up to 15 bytes).
    pub name: Cell<[u8; 16]>,
    /// Top of this thread's stack (0 = unknown: no frames are captured).
    pub stack_hi: Cell<usize>,
    /// The stack top has been looked up.
    pub stack_known: Cell<bool>,
    /// Interned traces seen by this thread.
    pub cache: [Cell<CacheEntry>; CACHE_SIZE],
    /// This thread's block of per-stack cumulative counters.
    pub counters: Cell<Option<CounterBlock>>,
    /// Free table nodes and pending live bytes of this thread. Only
    /// touched through [`ThreadState::nodes`] while `busy` is set.
    nodes: UnsafeCell<NodeCache>,
}

// A `const` item (not a static) on purpose: it is the array initialiser,
// copied into each thread's state, never shared.
#[allow(clippy::declare_interior_mutable_const)]
const EMPTY_ENTRY: Cell<CacheEntry> = Cell::new(CacheEntry {
    hash: 0,
    key: 0,
    slot: 0,
});

thread_local! {
    /// This thread's agent state.
    pub static THREAD: ThreadState = const {
        ThreadState {
            busy: Cell::new(false),
            internal: Cell::new(false),
            generation: Cell::new(0),
            thread_key: Cell::new(0),
            allocs: Cell::new(0),
            name: Cell::new([0; 16]),
            stack_hi: Cell::new(0),
            stack_known: Cell::new(false),
            cache: [EMPTY_ENTRY; CACHE_SIZE],
            counters: Cell::new(None),
            nodes: UnsafeCell::new(NodeCache::new()),
        }
    };
}

impl ThreadState {
    /// Forgets every key (regions of a new generation).
    pub fn reset(&self, generation: u64) {
        for c in &self.cache {
            c.set(CacheEntry::default());
        }
        self.thread_key.set(0);
        self.allocs.set(0);
        self.counters.set(None);
        self.generation.set(generation);
        // SAFETY: called with `busy` set (see `nodes`).
        unsafe { self.nodes() }.clear();
    }

    /// The thread's node cache.
    ///
    /// # Safety
    /// Only while this thread's `busy` flag is set by the caller: `busy`
    /// keeps every other use on this thread (re-entrant allocation, signal
    /// handlers) out, and no other thread can reach this thread's state,
    /// so the returned reference is unique for as long as it is used.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn nodes(&self) -> &mut NodeCache {
        // SAFETY: uniqueness per the contract above.
        unsafe { &mut *self.nodes.get() }
    }
}
