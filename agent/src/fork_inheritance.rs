//! What a fork child inherits: the live records its parent held at the
//! fork, copied into the child's own table when that copy can be exact.
//!
//! A fork child lets go of its parent's regions and starts its own
//! (`recorder::after_fork_child`), so its table held only what it
//! allocated after the fork. A daemon's start is a fork whose parent
//! exits at once (nginx, memcached `-d`, a `Type=forking` service): what
//! the daemon built before it (its configuration, nginx's cycle pools)
//! was then shown nowhere, though the daemon holds it for its whole life.
//! nginx's workers, forked from the master, held the master's
//! configuration unseen too.
//!
//! A copy made in the child would race with the parent: the parent's
//! table is shared memory, and the parent's threads go on allocating and
//! freeing while the child reads it, so the child would keep records of
//! blocks the parent allocated after the fork (which the child does not
//! hold) and miss blocks the parent freed. So the copy is made in the
//! parent, in the fork's prepare handler, and only when the parent has
//! one thread (the forking one, inside `fork`, not inside the agent):
//! then nothing changes the table while the copy is made, and the child,
//! whose memory is the parent's at that instant, holds exactly the blocks
//! copied. The copy goes into private anonymous memory, which the child
//! inherits; the child inserts it into its own table once its regions
//! are made, and the parent unmaps its copy when `fork` returns.
//!
//! Invariants:
//! - A copy is made only when `/proc/thread-self/status` says the process
//!   has one thread (and no seccomp filter newer than the regions), the
//!   forking thread is not inside the agent, and the node
//!   walk found no node mid-update (`for_each_live_unshared`); otherwise
//!   the child's table starts empty, as before, and its snapshots say so.
//! - At most [`MAX_NODES`] nodes are walked (a table that once held more
//!   is not copied): the walk costs the parent's `fork` about 3 ms per
//!   100 000 live blocks, the copy 40 bytes per live block, and the
//!   child's inserts about 0.2 µs per block (`bench/fork`, release
//!   build, a 2-vCPU Xeon: 1 M blocks took 26 ms in the parent and
//!   0.17 s in the child).
//! - The copy is private memory of the process that made it: unmapped in
//!   the parent when `fork` returns ([`release`]), in the child once
//!   inserted. It keeps no descriptor (the status file is opened and
//!   closed at once, as the seccomp check at a fork always did).
//! - The statics below are written and read by one thread: the forking
//!   one, in the parent's prepare and parent handlers and, the same
//!   thread after the fork, in the child's handler (Relaxed suffices).
//! - What the copy cannot see: a block allocated or freed between this
//!   prepare handler and the fork itself, by a prepare handler registered
//!   before the agent's (they run after it). A block allocated there is
//!   detected (the thread's allocation count moved, and the copy is
//!   dropped); one freed there would stay recorded in the child. The agent
//!   registers its handlers when it starts, at the program's first
//!   allocation, before most libraries register theirs (under `heapdump
//!   attach`, late: handlers registered before then run after its
//!   prepare handler; the allocators' own take locks and allocate
//!   nothing).

use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use heapdump_table::{AllocationRecord, AllocationsWriter};

/// Most nodes walked at a fork (a table whose high-water mark is above is
/// not copied).
pub const MAX_NODES: u64 = 1 << 20;

/// The copy: its mapping's address (0: none), length in bytes, the
/// records in it, and the forking thread's allocation count when it was
/// made.
static MAP: AtomicUsize = AtomicUsize::new(0);
static MAP_LEN: AtomicUsize = AtomicUsize::new(0);
static RECORDS: AtomicUsize = AtomicUsize::new(0);
static ALLOCS_AT: AtomicU64 = AtomicU64::new(0);

/// Whether a copy may be made now, as the calling thread's `/proc` status
/// says (read once): the process runs exactly one thread, under the
/// seccomp filters the regions were made under (a newer filter may
/// forbid the calls the copy makes: see `seccomp_guard`). False when it
/// cannot tell. Never inlined: its 4 KiB buffer stays off the callers'
/// frames.
#[cold]
#[inline(never)]
pub fn may_copy() -> bool {
    let mut buf = [0u8; 4096];
    let Some(n) = crate::small_file::read_into(c"/proc/thread-self/status", &mut buf) else {
        return false;
    };
    let text = &buf[..n];
    use crate::seccomp_guard::{filters_in, same_as_start_in, status_number};
    status_number(text, b"Threads:") == Some(1) && same_as_start_in(filters_in(text))
}

/// Copies the live records of `table` into private memory for the child
/// of the fork about to happen, `allocs` being the forking thread's
/// allocation count. The caller has checked the conditions of the module
/// doc (one thread, not inside the agent). Never allocates.
pub fn copy(table: &AllocationsWriter, allocs: u64) {
    release();
    let nodes = table.node_high_water();
    if nodes == 0 || nodes > MAX_NODES {
        return;
    }
    let len = nodes as usize * std::mem::size_of::<AllocationRecord>();
    // SAFETY: a fresh private anonymous mapping; no address is imposed.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    if map == libc::MAP_FAILED {
        return;
    }
    let out = map.cast::<AllocationRecord>();
    let mut n = 0usize;
    let walked = table.for_each_live_unshared(|rec| {
        // At most one live record per node, so `n` stays below `nodes`.
        if n < nodes as usize {
            // SAFETY: `n < nodes`: inside the mapping, which is aligned
            // to a page and so to the record.
            unsafe { out.add(n).write(rec) };
            n += 1;
        }
    });
    if walked.is_err() {
        // SAFETY: the mapping made above, of `len` bytes, unused elsewhere.
        unsafe { libc::munmap(map, len) };
        return;
    }
    MAP_LEN.store(len, Ordering::Relaxed);
    RECORDS.store(n, Ordering::Relaxed);
    ALLOCS_AT.store(allocs, Ordering::Relaxed);
    MAP.store(map as usize, Ordering::Relaxed);
}

/// The copy made for this fork, in the child: the records, if a copy was
/// made and the forking thread (whose allocation count is now `allocs`)
/// allocated nothing since. Call [`release`] once done with them.
///
/// # Safety
/// The returned slice is valid until [`release`] (or [`copy`]) runs; the
/// caller must not hold it past that.
pub unsafe fn records(allocs: u64) -> Option<&'static [AllocationRecord]> {
    let map = MAP.load(Ordering::Relaxed);
    if map == 0 || ALLOCS_AT.load(Ordering::Relaxed) != allocs {
        return None;
    }
    let n = RECORDS.load(Ordering::Relaxed);
    // SAFETY: `copy` wrote `n` records at `map` and published the address
    // last (same thread: the forking one, or the child made by it); the
    // mapping lives until `release`, as the caller promises.
    Some(unsafe { std::slice::from_raw_parts(map as *const AllocationRecord, n) })
}

/// Unmaps the copy, if there is one (the parent once `fork` returned, the
/// child once it inserted the records).
pub fn release() {
    let map = MAP.swap(0, Ordering::Relaxed);
    if map != 0 {
        let len = MAP_LEN.load(Ordering::Relaxed);
        // SAFETY: the mapping `copy` made, of `len` bytes; its address was
        // taken out of `MAP`, so it is unmapped once, and nobody holds the
        // records (see `records`).
        unsafe { libc::munmap(map as *mut libc::c_void, len) };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn no_copy_is_made_while_another_thread_runs() {
        // A second thread, alive until the checks are done.
        let (tx, rx) = std::sync::mpsc::channel::<()>();
        let other = std::thread::spawn(move || rx.recv());
        let status = std::fs::read("/proc/thread-self/status").unwrap();
        let threads = crate::seccomp_guard::status_number(&status, b"Threads:").unwrap();
        assert!(threads >= 2, "{threads}");
        assert!(!may_copy());
        drop(tx);
        let _ = other.join();
    }

    #[test]
    fn without_a_copy_a_child_gets_no_records() {
        release();
        // SAFETY: nothing is held past the call.
        assert!(unsafe { records(0) }.is_none());
    }
}
