//! Per-thread state of the agent: the re-entrancy flag, the thread's
//! record key, its stack bounds, its stack cache (a block of the
//! resources region), and the thread's tables (CFI rules, the stack memo),
//! which live outside thread-local storage (see `thread_tables`).
//!
//! Invariants:
//! - The state is a `const`-initialised thread-local without a destructor,
//!   so touching it never allocates and it stays valid until the thread's
//!   memory is released (also while TLS destructors of other libraries run).
//!   [`with`] relies on it: in the preload library it keeps the state's
//!   address in an initial-exec word, so a hook reaches the state without
//!   a call to `__tls_get_addr`.
//! - It stays small (a few hundred bytes): a library loaded at start has
//!   its thread-locals in the static TLS block that glibc takes out of
//!   every thread's stack, so every byte here is a byte less for threads
//!   created with small stacks.
//! - `busy` is set while the agent works on this thread; any allocation
//!   that happens meanwhile (from the agent's own set-up, or from a signal
//!   handler that interrupted it) passes through unrecorded.
//! - Cached keys belong to one generation of regions (a new generation
//!   starts in a forked child); a stale generation lets go of the stack
//!   cache (the next event claims one in the new generation's region).

use std::cell::{Cell, UnsafeCell};

use heapdump_table::allocations_table::NodeCache;
use heapdump_table::resources_table::{CounterBlock, StackCache};

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
    /// The value of `allocs` at which the recorder next looks at the
    /// thread's registration, stack top and name (`recorder::prepare_thread`):
    /// 0 at first and after a reset, so the first event looks.
    pub next_look: Cell<u64>,
    /// Name bytes last registered (Linux names are up to 15 bytes).
    pub name: Cell<[u8; 16]>,
    /// `recorder::NAME_EPOCH` when the name was last looked at.
    pub name_epoch: Cell<u64>,
    /// Top of this thread's stack (0 = unknown: no frames are captured).
    pub stack_hi: Cell<usize>,
    /// The stack top has been looked up.
    pub stack_known: Cell<bool>,
    /// This thread's stack cache, rule cache and memo (see
    /// `thread_tables`); null until its first recorded event, and again
    /// once given back at thread exit. Only touched through
    /// [`ThreadState::tables`] while `busy` is set.
    tables: Cell<*mut crate::thread_tables::ThreadTables>,
    /// This thread's stack cache, which also holds its per-stack
    /// cumulative counters (in the resources region: see
    /// `heapdump_table::resources_table`); `None` when the region had no
    /// room for one (every trace is then interned and counted on the
    /// shared records).
    pub stack_cache: Cell<Option<StackCache>>,
    /// This thread's peak block: per stack, the blocks it freed since the
    /// heap's peak that were allocated before it (`heapdump_table::peak`);
    /// taken at its first such free.
    pub peak_block: Cell<Option<CounterBlock>>,
    /// The peak generation in which every peak block this thread may hold
    /// was full (0: none): its later frees from before the peak are then
    /// counted as uncounted at once, without looking again.
    pub peak_full_gen: Cell<u64>,
    /// Free table nodes and pending live bytes of this thread. Only
    /// touched through [`ThreadState::nodes`] while `busy` is set.
    nodes: UnsafeCell<NodeCache>,
    /// Blocks this thread freed (already out of the table) whose release
    /// to the allocator waits for the thread's next frees, newest first;
    /// 0 = empty. See `recorder::on_free_deferred`.
    pub deferred: Cell<[usize; DEFER_DEPTH]>,
    /// The thread is exiting: frees are released at once from now on.
    pub no_defer: Cell<bool>,
    /// Whether this thread may hold freed blocks back now (see
    /// `recorder::can_hold_back`): set when the recorder looks at the
    /// thread, so a free tests one flag.
    pub defers: Cell<bool>,
    /// Sampled mode's countdown and random source (see `sampling`).
    pub sampler: crate::sampling::SamplerState,
    /// This thread's young ring (`recorder::YOUNG`) + 1: 0 = none claimed
    /// yet, [`NO_RING`] = none to be had (all taken, or the thread is
    /// exiting); with `recorder::BYPASSING` set beside the number while
    /// the thread bypasses its ring.
    pub young: Cell<u32>,
    /// Whether this thread is to bypass its young ring, and for how long
    /// (see `young_policy`; while it does, `young` carries the
    /// recorder's `BYPASSING` flag).
    pub young_policy: crate::young_policy::YoungPolicy,
    /// This thread's owner table (`recorder::YOUNG`'s, see `young_policy`):
    /// its number plus one in the low 16 bits, and in the high bits the
    /// number plus one of the young ring whose writer line counts it
    /// (and `recorder`'s `DRAINED_TABLE` while it is empty); 0 = none
    /// claimed yet, [`NO_RING`] = none to be had.
    pub owner_table: Cell<u32>,
}

/// [`ThreadState::young`] when the thread records without a young ring.
pub const NO_RING: u32 = u32::MAX;

/// How many freed blocks a thread keeps back from the allocator.
pub const DEFER_DEPTH: usize = 2;

thread_local! {
    /// This thread's agent state.
    pub static THREAD: ThreadState = const {
        ThreadState {
            busy: Cell::new(false),
            internal: Cell::new(false),
            generation: Cell::new(0),
            thread_key: Cell::new(0),
            allocs: Cell::new(0),
            next_look: Cell::new(0),
            name: Cell::new([0; 16]),
            name_epoch: Cell::new(0),
            stack_hi: Cell::new(0),
            stack_known: Cell::new(false),
            tables: Cell::new(std::ptr::null_mut()),
            stack_cache: Cell::new(None),
            peak_block: Cell::new(None),
            peak_full_gen: Cell::new(0),
            nodes: UnsafeCell::new(NodeCache::new()),
            deferred: Cell::new([0; DEFER_DEPTH]),
            no_defer: Cell::new(false),
            defers: Cell::new(false),
            sampler: crate::sampling::SamplerState::new(),
            young: Cell::new(0),
            young_policy: crate::young_policy::YoungPolicy::new(),
            owner_table: Cell::new(0),
        }
    };
}

/// Runs `f` with this thread's agent state; `None` when the thread's TLS
/// is gone (never, for this state: it has no destructor, see the module
/// doc; the `Option` keeps the callers honest should that change).
///
/// With initial-exec TLS (the preload library) the state's address is
/// kept in an initial-exec word after the thread's first call, so the
/// hooks reach it in a few instructions instead of a call to
/// `__tls_get_addr` each time (the general-dynamic model every
/// `thread_local!` of a shared library uses).
#[inline(always)]
pub fn with<R>(f: impl FnOnce(&ThreadState) -> R) -> Option<R> {
    let p = address()?;
    // SAFETY: `address` gives this thread's `THREAD`, valid while the
    // thread runs (see there). Shared access only, for the duration of
    // `f`, as `LocalKey::with` gives.
    Some(f(unsafe { &*p }))
}

/// The address of this thread's `THREAD`: valid (and only shared
/// references to it may be made) for as long as the calling thread runs,
/// to its last TLS destructor, since `THREAD` has no destructor of its
/// own. `None` when the thread's TLS is gone (never today, see [`with`]).
#[inline(always)]
fn address() -> Option<*const ThreadState> {
    match crate::initial_exec_tls::thread_state_slot() {
        Some(slot) => {
            // SAFETY: `slot` is this thread's word, valid while the thread
            // lives; only this thread reads or writes it.
            let p = unsafe { *slot };
            if p == 0 {
                first_address(slot)
            } else {
                // The address of this thread's `THREAD`, stored by
                // `first_address` on this thread (a forked child's thread
                // inherits both the word and the state, at the same
                // addresses). The library is `STATIC_TLS` (see
                // `initial_exec_tls`): the word and the state live in the
                // same static TLS block, so whenever the word can be read
                // the state is there.
                Some(p as *const ThreadState)
            }
        }
        None => THREAD.try_with(|t| t as *const ThreadState).ok(),
    }
}

/// This thread's state's address on its first call to [`with`], kept in
/// `slot` for the next ones.
#[cold]
#[inline(never)]
fn first_address(slot: *mut usize) -> Option<*const ThreadState> {
    let p = THREAD.try_with(|t| t as *const ThreadState).ok()?;
    // SAFETY: `slot` is this thread's word (see `with`).
    unsafe { *slot = p as usize };
    Some(p)
}

impl ThreadState {
    /// Forgets every key (regions of a new generation).
    pub fn reset(&self, generation: u64) {
        // SAFETY: called with `busy` set (see `tables`).
        if let Some(t) = unsafe { self.tables() } {
            t.clear_next_way();
        }
        self.thread_key.set(0);
        self.defers.set(false);
        self.allocs.set(0);
        self.next_look.set(0);
        self.stack_cache.set(None);
        self.peak_block.set(None);
        self.peak_full_gen.set(0);
        self.generation.set(generation);
        // A new generation's rings are all free (a forked child reset
        // them; the first generation claimed none).
        self.young.set(0);
        self.young_policy.reset();
        self.owner_table.set(0);
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

    /// This thread's tables, if it has taken them ([`Self::acquire_tables`]).
    ///
    /// # Safety
    /// As for [`ThreadState::nodes`]: only while this thread's `busy` flag
    /// is set by the caller.
    pub unsafe fn tables(&self) -> Option<&crate::thread_tables::ThreadTables> {
        // SAFETY: a non-null block is this thread's from `acquire` until
        // `release_tables`, and lives as long as the process.
        unsafe { self.tables.get().as_ref() }
    }

    /// Takes tables for this thread, from the pool or a new mapping;
    /// `None` only when there is no memory for them.
    ///
    /// # Safety
    /// As for [`ThreadState::tables`], and the thread has none
    /// ([`ThreadState::tables`] is `None`).
    pub unsafe fn acquire_tables(&self) -> Option<&crate::thread_tables::ThreadTables> {
        debug_assert!(self.tables.get().is_null());
        self.tables.set(crate::thread_tables::acquire());
        // SAFETY: as in `tables`.
        unsafe { self.tables() }
    }

    /// Gives this thread's tables back to the pool (at thread exit). A
    /// later event on this thread takes a block again.
    ///
    /// # Safety
    /// As for [`ThreadState::tables`], and no reference from `tables` may
    /// be live.
    pub unsafe fn release_tables(&self) {
        let b = self.tables.replace(std::ptr::null_mut());
        // SAFETY: `b` is this thread's block (or null), no longer used.
        unsafe { crate::thread_tables::release(b) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn with_reaches_this_threads_own_state_every_time() {
        let here = |t: &ThreadState| t as *const ThreadState as usize;
        let first = with(here).unwrap();
        // The second call takes the kept address (initial-exec builds).
        assert_eq!(with(here), Some(first));
        assert_eq!(THREAD.with(|t| here(t)), first);
        with(|t| t.allocs.set(7)).unwrap();
        let (other, allocs) =
            std::thread::spawn(move || (with(here).unwrap(), with(|t| t.allocs.get()).unwrap()))
                .join()
                .unwrap();
        assert_ne!(other, first);
        assert_eq!(allocs, 0, "a new thread's state starts fresh");
        assert_eq!(with(|t| t.allocs.get()), Some(7));
        if let Some(slot) = crate::initial_exec_tls::thread_state_slot() {
            // SAFETY: this thread's word.
            assert_eq!(unsafe { *slot }, first);
        }
    }
}
