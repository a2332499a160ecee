//! Where each loaded module's CFI is, for glibc before 2.35: the CFI
//! unwinder's stand-in for `_dl_find_object` (RHEL 8 and 9, Debian 11,
//! Ubuntu 20.04 and older have none).
//!
//! A table of the loaded modules (mapping range and `.eh_frame_hdr`),
//! built with `dl_iterate_phdr` off the hot path and read lock-free by
//! [`crate::cfi_unwind`] when a thread's rule cache misses.
//!
//! Invariants:
//! - One writer at a time (a try-lock: a thread that finds another
//!   rebuilding does not wait). Readers never wait either: the table is a
//!   seqlock (odd while being written). A lookup that overlaps another
//!   thread's rebuild asks the loader itself for the one module holding its
//!   counter (`dl_iterate_phdr`, as the rebuild would have, had this thread
//!   won the try-lock), so that two threads missing at once both get the
//!   module: a `Transient` answer there made the loser's walk stop at that
//!   frame, and the walk's memo and trace shortcut kept the short stack for
//!   every later allocation from the same place (seen in CI: 50 blocks of
//!   one thread with a one-frame stack).
//! - Every entry describes a module that was loaded when the table was
//!   built. A module can leave only through `dlclose`: the preload's
//!   `dlclose` hook calls [`closing`] before forwarding and [`closed`]
//!   after; lookups answer [`Lookup::Transient`] in between (the caller
//!   must not cache that answer; walks kept meanwhile are forgotten when
//!   the `dlclose` ends, which bumps the unwinder's generation). Both
//!   bump `CLOSES`, and a table is used only if the `CLOSES` its rebuild read before
//!   asking the loader is the current one: a table whose listing may have
//!   overlapped a `dlclose` (or predates one) is rebuilt first. So a
//!   lookup never returns a range of an unloaded module, and a program
//!   counter on the caller's own stack, found inside an entry's range, is
//!   inside that module, which stays loaded while it runs (as with
//!   `_dl_find_object`).
//! - A program counter in no entry (a module loaded since the table was
//!   built, or JIT code) makes the lookup ask the loader whether modules
//!   were added or removed since (`dl_iterate_phdr`'s `dlpi_adds` and
//!   `dlpi_subs`, read from the first module only) and rebuild if so; JIT
//!   code then answers `Missing`, which the rule cache keeps.
//! - `dl_iterate_phdr` takes the loader's (recursive) lock: called only
//!   on a rule-cache miss, never while this thread holds one of the
//!   agent's locks or is inside the allocator, and its callback neither
//!   allocates nor locks.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

/// Most modules the table holds; modules beyond it have no CFI here (the
/// frame pointer is used for their frames).
pub const MAX_MODULES: usize = 2048;

/// One module: `[start, end)` spans its loaded segments, `hdr` is the
/// address of its `.eh_frame_hdr` (0: none).
struct Entry {
    start: AtomicUsize,
    end: AtomicUsize,
    hdr: AtomicUsize,
}

#[allow(clippy::declare_interior_mutable_const)]
const EMPTY: Entry = Entry {
    start: AtomicUsize::new(0),
    end: AtomicUsize::new(0),
    hdr: AtomicUsize::new(0),
};

/// Entries sorted by `start`, `LEN` of them valid.
static ENTRIES: [Entry; MAX_MODULES] = [EMPTY; MAX_MODULES];
static LEN: AtomicUsize = AtomicUsize::new(0);
/// Seqlock over `ENTRIES` and `LEN`: odd while a rebuild writes them.
static SEQ: AtomicU64 = AtomicU64::new(0);
/// The writers' try-lock.
static WRITING: AtomicBool = AtomicBool::new(false);
/// `dlclose` calls under way (see the module doc).
static CLOSING: AtomicUsize = AtomicUsize::new(0);
/// Bumped at the start and at the end of every `dlclose`.
static CLOSES: AtomicU64 = AtomicU64::new(0);
/// `CLOSES` as the rebuild that made the table read it before listing
/// the modules (under the seqlock with the entries).
static TABLE_CLOSES: AtomicU64 = AtomicU64::new(u64::MAX);
/// The loader's `adds + subs` when the table was last built.
static BUILT_AT: AtomicU64 = AtomicU64::new(u64::MAX);
/// Whether the table is in use (set by [`init`]).
static ENABLED: AtomicBool = AtomicBool::new(false);

/// What [`find`] knows of a program counter.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Lookup {
    /// In this loaded module: its mapping `[start, end)` and its
    /// `.eh_frame_hdr` (0: none).
    Found {
        /// The module's lowest mapped address.
        start: usize,
        /// Its end.
        end: usize,
        /// Its `.eh_frame_hdr`, or 0.
        hdr: usize,
    },
    /// In no module (JIT code, or the table is full).
    Missing,
    /// Not known right now (a rebuild or a `dlclose` under way): use the
    /// frame pointer for this frame and do not cache the answer.
    Transient,
}

/// Builds the table; from then on [`find`] answers. Returns whether a
/// table could be built. Call during set-up. Again in a fork child (the
/// agent starts afresh there) it keeps the parent's table, which
/// describes the modules the child inherited, and calls nothing: the
/// loader's lock may be held by a parent thread that the child does not
/// have (see [`after_fork_child`]).
pub fn init() -> bool {
    if ENABLED.swap(true, Ordering::Relaxed) {
        return true;
    }
    rebuild() && LEN.load(Ordering::Relaxed) > 0
}

/// In a fork child (single-threaded, from the atfork handler): a rebuild
/// or a `dlclose` of a parent thread that was under way is not the
/// child's; the table is then emptied, to be rebuilt at the first lookup
/// that misses (the loader's counters will not match).
pub fn after_fork_child() {
    let in_flux = WRITING.load(Ordering::Relaxed)
        || SEQ.load(Ordering::Relaxed) & 1 != 0
        || CLOSING.load(Ordering::Relaxed) != 0;
    if in_flux {
        LEN.store(0, Ordering::Relaxed);
        BUILT_AT.store(u64::MAX, Ordering::Relaxed);
        TABLE_CLOSES.store(u64::MAX, Ordering::Relaxed);
        if SEQ.load(Ordering::Relaxed) & 1 != 0 {
            SEQ.fetch_add(1, Ordering::Relaxed);
        }
        CLOSING.store(0, Ordering::Relaxed);
        WRITING.store(false, Ordering::Release);
    }
}

/// The module holding `pc`.
pub fn find(pc: usize) -> Lookup {
    if !ENABLED.load(Ordering::Relaxed) {
        return Lookup::Missing;
    }
    let rebuild_first = match read(pc) {
        Read::Closing => return Lookup::Transient,
        Read::Busy => return ask_loader(pc),
        // The table may predate a `dlclose`.
        Read::Stale => true,
        // A module loaded since the table was built? Ask the loader.
        Read::Known(Lookup::Missing) => loader_changes() != Some(BUILT_AT.load(Ordering::Relaxed)),
        Read::Known(known) => return known,
    };
    if !rebuild_first {
        return Lookup::Missing;
    }
    if !rebuild() {
        // Another thread is rebuilding.
        return ask_loader(pc);
    }
    match read(pc) {
        Read::Known(known) => known,
        Read::Closing => Lookup::Transient,
        // Another rebuild, or a whole `dlclose`, since ours.
        Read::Busy | Read::Stale => ask_loader(pc),
    }
}

/// Called by the `dlclose` hook before it forwards the call.
pub fn closing() {
    CLOSING.fetch_add(1, Ordering::SeqCst);
    CLOSES.fetch_add(1, Ordering::SeqCst);
}

/// Called by the `dlclose` hook after the call returned: every table
/// built so far is stale (its listing may have seen the closed module),
/// and the next lookup rebuilds it.
pub fn closed() {
    CLOSES.fetch_add(1, Ordering::SeqCst);
    CLOSING.fetch_sub(1, Ordering::SeqCst);
}

/// What one read of the table tells of a program counter.
#[derive(Debug, PartialEq, Eq)]
enum Read {
    /// The table's answer (`Found` or `Missing`).
    Known(Lookup),
    /// A `dlclose` is under way: nothing can be told.
    Closing,
    /// Another thread is rebuilding the table (no `dlclose` was under way
    /// when the read began).
    Busy,
    /// The table may predate a `dlclose` (see the module doc).
    Stale,
}

/// One lock-free read of the table.
fn read(pc: usize) -> Read {
    // SeqCst: ordered with the dlclose hook's increment, so a lookup that
    // starts after a `dlclose` began sees it.
    if CLOSING.load(Ordering::SeqCst) != 0 {
        return Read::Closing;
    }
    let s1 = SEQ.load(Ordering::Acquire);
    if s1 & 1 != 0 {
        return Read::Busy;
    }
    let len = LEN.load(Ordering::Relaxed).min(MAX_MODULES);
    // The last entry starting at or below `pc` (entries sorted by start).
    let (mut lo, mut hi) = (0, len);
    while lo < hi {
        let mid = (lo + hi) / 2;
        if ENTRIES[mid].start.load(Ordering::Relaxed) <= pc {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    let built_at = TABLE_CLOSES.load(Ordering::Relaxed);
    let found = lo.checked_sub(1).map(|i| {
        let e = &ENTRIES[i];
        (
            e.start.load(Ordering::Relaxed),
            e.end.load(Ordering::Relaxed),
            e.hdr.load(Ordering::Relaxed),
        )
    });
    // The seqlock's read side: the loads above happen before this fence,
    // and a writer that started meanwhile has bumped SEQ before its stores.
    std::sync::atomic::fence(Ordering::Acquire);
    if CLOSING.load(Ordering::SeqCst) != 0 {
        return Read::Closing;
    }
    if SEQ.load(Ordering::Relaxed) != s1 {
        return Read::Busy;
    }
    // SeqCst: a lookup that sees a `dlclose` ended (CLOSING back to 0)
    // sees both of its bumps.
    if built_at != CLOSES.load(Ordering::SeqCst) {
        return Read::Stale;
    }
    Read::Known(match found {
        Some((start, end, hdr)) if start <= pc && pc < end => Lookup::Found { start, end, hdr },
        _ => Lookup::Missing,
    })
}

/// The module holding `pc`, asked of the loader directly, without the
/// table (another thread is writing it). Same conditions as a rebuild
/// (see the module doc): a rule-cache miss, no `dlclose` seen under way.
fn ask_loader(pc: usize) -> Lookup {
    struct Search {
        pc: usize,
        found: Option<(usize, usize, usize)>,
    }
    unsafe extern "C" fn holding(
        info: *mut libc::dl_phdr_info,
        _size: usize,
        data: *mut c_void,
    ) -> c_int {
        // SAFETY: `data` is the `Search` below; `info` is the loader's, valid
        // while the callback runs (see `module_range`).
        let (s, i) = unsafe { (&mut *(data as *mut Search), &*info) };
        // SAFETY: as above.
        match unsafe { module_range(i) } {
            Some((start, end, hdr)) if start <= s.pc && s.pc < end => {
                s.found = Some((start, end, hdr));
                1 // found: stop
            }
            _ => 0,
        }
    }
    let mut s = Search { pc, found: None };
    // SAFETY: `holding` matches the callback type and only writes `s`.
    unsafe { libc::dl_iterate_phdr(Some(holding), &mut s as *mut Search as *mut c_void) };
    match s.found {
        Some((start, end, hdr)) => Lookup::Found { start, end, hdr },
        None => Lookup::Missing,
    }
}

/// A module's `[start, end)` (its loaded segments) and `.eh_frame_hdr`
/// address (0: none), from the loader's description; `None` when it has
/// no usable range.
///
/// # Safety
/// `i` is a `dl_phdr_info` passed by `dl_iterate_phdr` to a callback that
/// is still running (its program headers are mapped meanwhile).
unsafe fn module_range(i: &libc::dl_phdr_info) -> Option<(usize, usize, usize)> {
    if i.dlpi_phdr.is_null() {
        return None;
    }
    // SAFETY: the caller's contract: `dlpi_phnum` headers at `dlpi_phdr`.
    let phdrs = unsafe { std::slice::from_raw_parts(i.dlpi_phdr, i.dlpi_phnum as usize) };
    let bias = i.dlpi_addr as usize;
    let (mut start, mut end, mut hdr) = (usize::MAX, 0usize, 0usize);
    for p in phdrs {
        match p.p_type {
            libc::PT_LOAD => {
                let s = bias.wrapping_add(p.p_vaddr as usize);
                start = start.min(s);
                end = end.max(s.wrapping_add(p.p_memsz as usize));
            }
            libc::PT_GNU_EH_FRAME => hdr = bias.wrapping_add(p.p_vaddr as usize),
            _ => {}
        }
    }
    (start < end && (hdr == 0 || (start..end).contains(&hdr))).then_some((start, end, hdr))
}

/// The loader's count of modules added and removed so far (`None` when
/// it cannot be told).
fn loader_changes() -> Option<u64> {
    unsafe extern "C" fn first(
        info: *mut libc::dl_phdr_info,
        size: usize,
        data: *mut c_void,
    ) -> c_int {
        if size >= std::mem::size_of::<libc::dl_phdr_info>() - 16 {
            // SAFETY: the loader passes a valid `info` of `size` bytes,
            // which covers `dlpi_adds` and `dlpi_subs` (checked above);
            // `data` is the `Option<u64>` below.
            unsafe {
                let i = &*info;
                *(data as *mut Option<u64>) = Some(i.dlpi_adds.wrapping_add(i.dlpi_subs));
            }
        }
        1 // stop after the first module
    }
    let mut out: Option<u64> = None;
    // SAFETY: `first` matches the callback type and only writes `out`.
    unsafe { libc::dl_iterate_phdr(Some(first), &mut out as *mut Option<u64> as *mut c_void) };
    out
}

/// Rebuilds the table from the loader's list. False when another thread
/// is writing it.
fn rebuild() -> bool {
    if WRITING
        .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    // Odd: readers from now on answer `Transient`. The fence orders this
    // store before the entries' stores (the seqlock's write side).
    SEQ.fetch_add(1, Ordering::Relaxed);
    std::sync::atomic::fence(Ordering::Release);
    // Read before the loader lists the modules (see the module doc).
    let closes = CLOSES.load(Ordering::SeqCst);
    let mut b = Builder {
        len: 0,
        changes: None,
    };
    // SAFETY: `collect` matches the callback type and only touches the
    // builder and the table, which this thread writes alone (WRITING).
    unsafe { libc::dl_iterate_phdr(Some(collect), &mut b as *mut Builder as *mut c_void) };
    sort(b.len);
    LEN.store(b.len, Ordering::Relaxed);
    TABLE_CLOSES.store(closes, Ordering::Relaxed);
    BUILT_AT.store(b.changes.unwrap_or(u64::MAX), Ordering::Relaxed);
    SEQ.fetch_add(1, Ordering::Release);
    WRITING.store(false, Ordering::Release);
    true
}

struct Builder {
    len: usize,
    changes: Option<u64>,
}

/// `dl_iterate_phdr`'s callback: one module into the table.
unsafe extern "C" fn collect(
    info: *mut libc::dl_phdr_info,
    size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the rebuild's `Builder`; the loader passes a valid
    // `info` whose program headers (`dlpi_phdr`, `dlpi_phnum` of them) are
    // mapped for as long as the callback runs.
    let (b, i) = unsafe { (&mut *(data as *mut Builder), &*info) };
    if b.changes.is_none() && size >= std::mem::size_of::<libc::dl_phdr_info>() - 16 {
        b.changes = Some(i.dlpi_adds.wrapping_add(i.dlpi_subs));
    }
    if b.len == MAX_MODULES {
        return 0;
    }
    // SAFETY: `i` is the loader's, inside its callback.
    if let Some((start, end, hdr)) = unsafe { module_range(i) } {
        let e = &ENTRIES[b.len];
        e.start.store(start, Ordering::Relaxed);
        e.end.store(end, Ordering::Relaxed);
        e.hdr.store(hdr, Ordering::Relaxed);
        b.len += 1;
    }
    0
}

/// Sorts `ENTRIES[..len]` by start (insertion sort, in place: no
/// allocation; the loader's list is nearly sorted already).
fn sort(len: usize) {
    let get = |i: usize| {
        let e = &ENTRIES[i];
        (
            e.start.load(Ordering::Relaxed),
            e.end.load(Ordering::Relaxed),
            e.hdr.load(Ordering::Relaxed),
        )
    };
    let set = |i: usize, v: (usize, usize, usize)| {
        let e = &ENTRIES[i];
        e.start.store(v.0, Ordering::Relaxed);
        e.end.store(v.1, Ordering::Relaxed);
        e.hdr.store(v.2, Ordering::Relaxed);
    };
    for i in 1..len {
        let v = get(i);
        let mut j = i;
        while j > 0 && get(j - 1).0 > v.0 {
            set(j, get(j - 1));
            j -= 1;
        }
        set(j, v);
    }
}

/// Held by the unit tests that look modules up or play a `dlclose` or a
/// rebuild (they share the process's one table and run in parallel).
#[cfg(test)]
pub(crate) static TEST_LOCK: std::sync::Mutex<()> = std::sync::Mutex::new(());

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_loaded_modules_misses_the_heap_and_waits_out_a_dlclose() {
        let _one_at_a_time = TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        assert!(init());
        let here =
            finds_loaded_modules_misses_the_heap_and_waits_out_a_dlclose as *const () as usize;
        let Lookup::Found { start, end, hdr } = find(here) else {
            panic!("{:?}", find(here));
        };
        assert!(start <= here && here < end && hdr != 0 && (start..end).contains(&hdr));
        assert!(matches!(
            find(libc::malloc as *const () as usize),
            Lookup::Found { .. }
        ));
        let heap = Box::new(0u64);
        assert_eq!(find(&*heap as *const u64 as usize), Lookup::Missing);
        closing();
        assert_eq!(find(libc::malloc as *const () as usize), Lookup::Transient);
        // A rebuild while the dlclose is under way (another thread's) may
        // have listed the closing module: not used once it ended.
        assert!(rebuild());
        closed();
        assert_eq!(read(libc::malloc as *const () as usize), Read::Stale);
        assert!(matches!(
            find(libc::malloc as *const () as usize),
            Lookup::Found { .. }
        ));
    }

    #[test]
    fn a_lookup_while_another_thread_rebuilds_asks_the_loader_itself() {
        let _one_at_a_time = TEST_LOCK.lock().unwrap_or_else(|e| e.into_inner());
        assert!(init());
        let here =
            a_lookup_while_another_thread_rebuilds_asks_the_loader_itself as *const () as usize;
        let known = find(here);
        assert!(matches!(known, Lookup::Found { .. }), "{known:?}");
        // Play the other thread, halfway through its rebuild: the try-lock
        // held, the seqlock odd.
        assert!(WRITING
            .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
            .is_ok());
        SEQ.fetch_add(1, Ordering::Relaxed);
        assert_eq!(read(here), Read::Busy);
        assert!(!rebuild());
        let during = find(here);
        let malloc = find(libc::malloc as *const () as usize);
        let heap = Box::new(0u64);
        let nowhere = find(&*heap as *const u64 as usize);
        // A table that predates a dlclose, while the other thread rebuilds.
        CLOSES.fetch_add(2, Ordering::SeqCst);
        let stale_and_busy = find(here);
        SEQ.fetch_add(1, Ordering::Release);
        WRITING.store(false, Ordering::Release);
        assert_eq!(during, known);
        assert!(matches!(malloc, Lookup::Found { .. }), "{malloc:?}");
        assert_ne!(malloc, known);
        assert_eq!(nowhere, Lookup::Missing);
        assert_eq!(stale_and_busy, known);
        // The table itself was not touched: the next lookup rebuilds it
        // (it predates the "dlclose") and answers the same.
        assert_eq!(read(here), Read::Stale);
        assert_eq!(find(here), known);
    }
}
