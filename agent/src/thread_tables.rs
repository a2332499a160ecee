//! The per-thread tables too big for thread-local storage: the CFI rule
//! cache (12 KiB), the stack memos (4 x 5 KiB), the trace shortcut
//! (51 KiB) and the stack cache's
//! replacement state (the cache itself is in the resources region, see
//! `recorder::stack_key`).
//!
//! Why not thread-local: a library loaded at start (the preload agent is)
//! has its thread-local storage in every thread's static TLS block, which
//! glibc carves out of the thread's stack. A thread created with a small
//! stack (node asks for 32 KiB) then fails with `EINVAL` when the static
//! TLS no longer leaves it room. So each thread that records gets one
//! [`ThreadTables`] block from a process-wide pool, or a fresh anonymous
//! mapping, at its first recorded event, and gives it back at exit.
//!
//! Invariants:
//! - All-zero bytes are every table's empty state (the `new()` of each is
//!   all zeros: key 0 = empty entry, `Rule::EMPTY` = 0, length 0, false),
//!   so a fresh mapping (zero-filled by the kernel) needs no initialising,
//!   and a block taken from the pool is zeroed in place (never built on the
//!   stack: 82 KiB would not fit a small thread's stack), all but the
//!   trace shortcut's entries (50 KiB), which only its zeroed keys lead
//!   to: a thread touches the pages of the entries it fills, not all.
//! - A block is owned by one thread from [`acquire`] to [`release`], and
//!   only touched by it, with its `busy` flag set; a block in the pool is
//!   touched only under the pool's lock.
//! - Blocks are never unmapped: the pool holds at most as many blocks as
//!   threads that recorded at the same time.
//! - The pool's lock is a spin lock held for a few instructions, never
//!   while allocating or calling out. A thread that holds it cannot be
//!   re-entered by a signal handler's allocation (its `busy` flag is set,
//!   which makes the hooks pass such allocations through). A child of
//!   `fork` starts with an empty, unlocked pool ([`after_fork_child`]).

use std::cell::Cell;
use std::cell::UnsafeCell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use heapdump_table::resources_table::CACHE_SETS;

use crate::trace_shortcut::Shortcuts;

/// One thread's tables (see the module doc).
#[repr(C)]
pub struct ThreadTables {
    /// Per set of the thread's stack cache, the way its next miss
    /// replaces (modulo the ways; see `recorder::stack_key`).
    pub next_way: [Cell<u8>; CACHE_SETS as usize],
    /// CFI rules of recently seen program counters.
    pub rules: crate::cfi_unwind::RuleCache,
    /// Earlier CFI walks of the thread (see `stack_memo`).
    memo: UnsafeCell<crate::stack_memo::StackMemos>,
    /// The next block of the pool while this one is in it (under the
    /// pool's lock only).
    next: Cell<*mut ThreadTables>,
    /// The thread's recent walks by their start (see `trace_shortcut`).
    /// Last: its last [`Shortcuts::UNZEROED`] bytes need no zeroing.
    shortcuts: UnsafeCell<Shortcuts>,
}

/// The bytes of a block that a reused block must have zeroed: all but the
/// tail that the trace shortcut reaches only through its (zeroed) keys.
const ZEROED: usize = std::mem::size_of::<ThreadTables>() - Shortcuts::UNZEROED;
const _: () = assert!(
    std::mem::offset_of!(ThreadTables, shortcuts) + std::mem::size_of::<Shortcuts>()
        == std::mem::size_of::<ThreadTables>()
);

impl ThreadTables {
    /// The thread's trace shortcut.
    ///
    /// # Safety
    /// As for [`ThreadTables::memo`].
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn shortcuts(&self) -> &mut Shortcuts {
        // SAFETY: uniqueness per the contract (a field of its own, so it
        // never aliases the memos).
        unsafe { &mut *self.shortcuts.get() }
    }

    /// The thread's earlier CFI walks.
    ///
    /// # Safety
    /// Only by the owning thread, with its `busy` flag set (see
    /// `ThreadState::nodes`): the returned reference is then unique.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn memo(&self) -> &mut crate::stack_memo::StackMemos {
        // SAFETY: uniqueness per the contract above.
        unsafe { &mut *self.memo.get() }
    }

    /// Forgets the stack cache's replacement state (regions of a new
    /// generation).
    pub fn clear_next_way(&self) {
        for r in &self.next_way {
            r.set(0);
        }
    }
}

/// The free blocks: a list linked through [`ThreadTables::next`].
struct Pool {
    locked: AtomicBool,
    head: Cell<*mut ThreadTables>,
}

// SAFETY: `head` and the `next` links of pooled blocks are only read or
// written by the thread holding `locked` (Acquire on taking it, Release
// on giving it back, so each holder sees the previous holder's writes).
unsafe impl Sync for Pool {}

static POOL: Pool = Pool::new();

/// Blocks mapped by [`acquire`] in this process (since its last `fork`):
/// the most threads that held tables at once, as blocks are never
/// unmapped and a released one is reused before a new one is mapped.
static MAPPED: AtomicU64 = AtomicU64::new(0);

/// How many blocks [`acquire`] has mapped (see [`MAPPED`]): an upper bound
/// of the threads that recorded at the same time.
pub fn mapped() -> u64 {
    MAPPED.load(Ordering::Relaxed)
}

impl Pool {
    const fn new() -> Self {
        Pool {
            locked: AtomicBool::new(false),
            head: Cell::new(std::ptr::null_mut()),
        }
    }

    fn with<R>(&self, f: impl FnOnce(&Cell<*mut ThreadTables>) -> R) -> R {
        while self
            .locked
            .compare_exchange_weak(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_err()
        {
            std::hint::spin_loop();
        }
        let r = f(&self.head);
        self.locked.store(false, Ordering::Release);
        r
    }
}

/// A block of empty tables for the calling thread, from the pool or a new
/// mapping; null if the system has no memory for one.
pub fn acquire() -> *mut ThreadTables {
    acquire_from(&POOL)
}

fn acquire_from(pool: &Pool) -> *mut ThreadTables {
    let pooled = pool.with(|head| {
        let b = head.get();
        if !b.is_null() {
            // SAFETY: `b` is a pooled block (a live mapping, see the module
            // doc) and we hold the lock, which covers its `next` link.
            head.set(unsafe { (*b).next.get() });
        }
        b
    });
    if !pooled.is_null() {
        // SAFETY: the block left the pool under the lock, so this thread
        // owns it alone; zeroing its bytes gives the empty tables (see the
        // module doc; the shortcut's entries, past `ZEROED`, are reached
        // only through its keys, which are zeroed). It is zeroed in place,
        // with no copy on the stack, and the untouched tail's pages stay
        // as resident as the last thread left them.
        unsafe { std::ptr::write_bytes(pooled.cast::<u8>(), 0, ZEROED) };
        return pooled;
    }
    // SAFETY: an anonymous private mapping, no address hint; the result is
    // checked for MAP_FAILED.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            std::mem::size_of::<ThreadTables>(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return std::ptr::null_mut();
    }
    MAPPED.fetch_add(1, Ordering::Relaxed);
    // A fresh mapping is zero-filled: the empty tables, page-aligned.
    p.cast()
}

/// Gives the calling thread's block back to the pool.
///
/// # Safety
/// `b` came from [`acquire`] on this thread, which no longer uses it.
pub unsafe fn release(b: *mut ThreadTables) {
    // SAFETY: the caller's contract.
    unsafe { release_to(&POOL, b) }
}

/// [`release`] into `pool`.
///
/// # Safety
/// As for [`release`].
unsafe fn release_to(pool: &Pool, b: *mut ThreadTables) {
    if b.is_null() {
        return;
    }
    pool.with(|head| {
        // SAFETY: the caller owns `b` (a live mapping) and hands it to the
        // pool, whose lock we hold.
        unsafe { (*b).next.set(head.get()) };
        head.set(b);
    });
}

/// In the child of `fork` (one thread): another thread of the parent may
/// have held the pool's lock, and its list may be half-updated; start
/// with an empty pool (the blocks it held stay mapped, unused).
pub fn after_fork_child() {
    POOL.head.set(std::ptr::null_mut());
    POOL.locked.store(false, Ordering::Release);
    // The child's one thread may hold a block of its own (taken in the
    // parent, never acquired again): counted.
    MAPPED.store(1, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tables_from_the_pool_are_empty_again_and_blocks_are_reused() {
        // A pool of the test's own: other tests may use the process's.
        let pool = Pool::new();
        {
            let a = acquire_from(&pool);
            assert!(!a.is_null());
            assert_eq!(a as usize % 4096, 0);
            // SAFETY: `a` is this thread's block until released.
            let t = unsafe { &*a };
            assert!(t.next_way.iter().all(|r| r.get() == 0));
            t.next_way[3].set(5);
            // An entry with no words (none is read): a key set.
            // SAFETY: this thread's block, no other reference to it.
            let s = unsafe { t.shortcuts() };
            s.fill(0x5000, 0x1000, 0x2000, 1)
                .unwrap()
                .finish(0, false, 1, 7);
            assert!(!s.is_empty());
            // SAFETY: no longer used below.
            unsafe { release_to(&pool, a) };
            let b = acquire_from(&pool);
            assert_eq!(b, a, "the pooled block is handed out again");
            // SAFETY: `b` is this thread's block.
            let t = unsafe { &*b };
            assert_eq!(t.next_way[3].get(), 0, "and comes back empty");
            // The shortcut's keys are zeroed, its entries left as they were.
            // SAFETY: as above.
            assert!(unsafe { t.shortcuts() }.is_empty());
            let c = acquire_from(&pool);
            assert!(!c.is_null() && c != b, "an empty pool maps a new block");
            // SAFETY: both are this test's, unused from here (they stay
            // mapped, as pooled blocks do).
            unsafe {
                release_to(&pool, b);
                release_to(&pool, c);
            }
        }
    }
}
