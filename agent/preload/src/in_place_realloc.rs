//! `realloc` in place on jemalloc: a block the allocator can resize
//! without moving keeps its record (rewritten with the new size, the
//! `realloc`'s stack and time: `recorder::on_realloc_in_place`) instead of
//! being removed from the table and inserted again. redis's `LPOP` shrinks
//! the head list node's listpack with a `realloc` on every request, 98 %
//! of them within the block's size class (measured with a counting shim
//! on `redis-benchmark -t lpop`), where jemalloc leaves the block where it
//! is. What this saves there is the removal and insert (their entry,
//! node cache, counters), and jemalloc's own `realloc`, which for a block
//! that stays in its size class costs ~200 instructions more than
//! `nallocx` and `xallocx` (callgrind on redis `LPOP`, preload and jemalloc
//! together: 4 493 instructions a request before, 4 390 with the record
//! kept but jemalloc's `realloc` called, 4 207 with `xallocx`).
//!
//! Only jemalloc: a form for every allocator was measured and not kept
//! (claim the block, call the allocator's `realloc`, keep the record if the
//! block stayed): on a glibc loop of young blocks grown and shrunk it
//! saved 1 % of the preload's instructions (2 143 -> 2 120 a round), since
//! the claim and rewrite cost what the removal and insert cost, while it
//! called the allocator with the thread busy and let a moved block's old
//! record outlive its release for an instant.
//!
//! Invariants:
//! - Used only when `xallocx` and `nallocx` are defined in the very object
//!   that defines the `realloc` the hooks forward to (chosen once by
//!   [`choose`], where the loader may be called: at load, or at attach),
//!   so jemalloc's calls only ever see jemalloc's blocks. Every other
//!   allocator (glibc, tcmalloc, mimalloc) has no call that resizes in
//!   place exactly when its `realloc` would, and takes the usual path.
//! - The block is resized in place only when jemalloc's `realloc` would
//!   have given the same block: `xallocx(p, size, 0, 0)` (which never
//!   moves a block) leaves it with the usable size `nallocx(size, 0)`
//!   names, the usable size of the block `realloc(p, size)` returns. When
//!   it cannot (a small block shrinking into a smaller size class, which
//!   `xallocx` refuses and `realloc` moves; a growth past what follows the
//!   block), the block is as it was and the usual `realloc` runs, so the
//!   program's memory use is what it would be without the agent.
//! - The record is kept in exact mode only, and only for a block in the
//!   calling thread's young ring (see the recorder). Every other `realloc`
//!   on jemalloc takes the usual path (out of the table, resized, recorded
//!   again), where the resize is also `xallocx` first ([`kept_in_place`]):
//!   until the block is recorded again the program still holds it, so no
//!   other thread can be handed its address.

use std::ffi::{c_int, c_void};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::jemalloc_calls::Xallocx;
use heapdump_agent::recorder::on_realloc_in_place;

use crate::next_allocator as next;

/// `size_t nallocx(size_t, int)`.
type Nallocx = unsafe extern "C" fn(usize, c_int) -> usize;

/// jemalloc's `xallocx` and `nallocx`, or 0 (see the module doc).
static XALLOCX: AtomicUsize = AtomicUsize::new(0);
static NALLOCX: AtomicUsize = AtomicUsize::new(0);

/// Looks for `xallocx` and `nallocx` in the object that defines the next
/// `realloc`. May call the loader (`dladdr`, `dlopen` of an object already
/// loaded, `dlsym`): call it where the hooks' binding does, before the
/// hooks can run on another thread.
pub(crate) fn choose() {
    let (x, n) = jemalloc_calls().unwrap_or((0, 0));
    // Written before any hook reads them (see above); Relaxed suffices for
    // code addresses of a library that stays loaded, as for the slots of
    // `next_allocator`.
    NALLOCX.store(n, Ordering::Relaxed);
    XALLOCX.store(x, Ordering::Relaxed);
}

/// `xallocx` and `nallocx` of the object defining the next `realloc`.
fn jemalloc_calls() -> Option<(usize, usize)> {
    let realloc = next::realloc()? as usize;
    let base = next::object_base_of(realloc);
    let mut name = [0u8; 1024];
    let len = next::object_name_of(realloc, &mut name);
    // The executable has no name here; a path this long is cut short.
    if base == 0 || len == 0 || len >= name.len() {
        return None;
    }
    name[len] = 0;
    // SAFETY: dlopen of a NUL-terminated path with RTLD_NOLOAD only finds
    // an object that is already loaded (the allocator), taking a reference
    // that is never given back: the allocator is never unloaded while the
    // program allocates anyway, and our own `dlclose` is a hook.
    let handle = unsafe { libc::dlopen(name.as_ptr().cast(), libc::RTLD_NOLOAD | libc::RTLD_LAZY) };
    if handle.is_null() {
        return None;
    }
    // SAFETY: dlsym on a valid handle with NUL-terminated names. A handle's
    // lookup also searches the object's dependencies: the object check
    // below keeps only the allocator's own definitions.
    let (x, n) = unsafe {
        (
            libc::dlsym(handle, c"xallocx".as_ptr()) as usize,
            libc::dlsym(handle, c"nallocx".as_ptr()) as usize,
        )
    };
    (x != 0 && n != 0 && next::object_base_of(x) == base && next::object_base_of(n) == base)
        .then_some((x, n))
}

/// Resizes `p` (a block of the next allocator's that the program passes
/// to `realloc`: not null, not an arena block) to `size` bytes in place
/// and keeps its record, if the allocator is jemalloc and the block stays
/// where it is (see the module doc). False: nothing changed; the caller
/// `realloc`s the usual way, and need not ask [`kept_in_place`] again if
/// `refused` was set (jemalloc was asked and would move the block). `fp`
/// is the hook's frame pointer.
#[inline(always)]
pub(crate) fn resized(p: *mut c_void, size: usize, fp: usize, refused: &mut bool) -> bool {
    if XALLOCX.load(Ordering::Relaxed) == 0 {
        return false;
    }
    on_realloc_in_place(p as usize, size, fp, || {
        let kept = kept_in_place(p, size);
        *refused = !kept;
        kept
    })
}

/// Whether jemalloc resized `p` to `size` bytes where it is, as its
/// `realloc` would have (see the module doc); false, with the block
/// unchanged, when the allocator is not jemalloc, `size` is 0, or
/// `realloc` would move the block. For the usual path too: a block taken
/// out of the table, not yet given back to the allocator (so no other
/// thread can be handed its address), is resized by `xallocx` where that
/// is what `realloc` would do, which costs jemalloc ~200 instructions
/// fewer than its `realloc` (see the module doc), and recorded again at
/// the same address.
#[inline(always)]
pub(crate) fn kept_in_place(p: *mut c_void, size: usize) -> bool {
    let (x, n) = (
        XALLOCX.load(Ordering::Relaxed),
        NALLOCX.load(Ordering::Relaxed),
    );
    if x == 0 || n == 0 || size == 0 {
        return false;
    }
    // SAFETY: `choose` stored the addresses `dlsym` gave for jemalloc's
    // `xallocx` and `nallocx`, whose C signatures these are.
    let (xallocx, nallocx) = unsafe {
        (
            std::mem::transmute::<usize, Xallocx>(x),
            std::mem::transmute::<usize, Nallocx>(n),
        )
    };
    // SAFETY: jemalloc's own calls: `size` is not 0, and `xallocx` runs
    // only when `nallocx` found it a size jemalloc can allocate; `p` is a
    // live block the program passes to `realloc`, which is jemalloc's
    // (`choose` took these calls from the object that defines it), and not
    // an arena block (the caller's contract).
    let usable = unsafe { nallocx(size, 0) };
    usable != 0 && unsafe { xallocx(p, size, 0, 0) } == usable
}
