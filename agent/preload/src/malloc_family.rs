//! The C allocation entry points: `malloc`, `free`, `calloc`, `realloc`,
//! `reallocarray`, `memalign`, `posix_memalign`, `aligned_alloc`, `valloc`,
//! `pvalloc`, and C23's `free_sized` / `free_aligned_sized`.
//!
//! `malloc_usable_size` is not among them: it only asks the allocator
//! about a block, so the program's call reaches the allocator directly,
//! as `sallocx` does (see `libheapdump_jemalloc.so`). Programs such as
//! redis call it on every allocation and free; forwarding it cost them a
//! call, a range check and an indirect jump each time, for the sake of
//! arena blocks only, which only allocations made inside the binding's own
//! `dlsym` get (the loader's and libc's internal buffers, which never ask
//! their usable size).
//!
//! Invariants:
//! - Each forwards to the same entry point of the next allocator
//!   ([`next_allocator`]); where that allocator lacks it, to the nearest
//!   equivalent it has (`pvalloc` as `memalign` of whole pages, say). The
//!   block is exactly the next allocator's: nothing is added before or
//!   after it, so that allocator's own calls (`mallctl`, `sallocx`,
//!   `tc_*`, `mi_*`...) keep working on it.
//! - A block is recorded after the allocator returned it, and removed from
//!   the table before the allocator gets it back (free, and realloc, which
//!   may move it), so an address reused by another thread is never removed
//!   by a late free.
//! - While the next allocator is being bound, calls are served by the
//!   [`bootstrap_arena`]; arena blocks are never recorded and never handed
//!   to the next allocator.
//! - Each entry point takes its own frame pointer with
//!   [`caller_frame`] (never by reading `rbp` in place, which an optimised
//!   build may do before the prologue) before any recording: the stack
//!   walk starts there, so none of this library's frames are reported.
//! - Sampled mode: `malloc`, `calloc`, `realloc` and `free` have a fast
//!   path for a block that is not sampled. It decides before calling the
//!   allocator (the countdown depends only on the size asked for; the
//!   filter only on the address) and then tail-calls it: a few
//!   instructions and a jump, with no frame of ours left under the
//!   allocator. Everything else (exact mode, a sampled block, binding
//!   under way, arena blocks) goes to the entry point's slow path, which
//!   is the complete hook. It is called with an ordinary call (never a
//!   tail call, see [`not_tail_called`]) and takes the entry point's frame
//!   pointer from its own frame ([`caller_parent_frame`]), so the walk
//!   starts at the entry point's frame however the compiler laid the
//!   entry point out. An allocation is counted down exactly once: the
//!   fast path counts it down only when it takes it.

use std::ffi::{c_int, c_void};

use heapdump_agent::recorder::{
    not_sampled, on_alloc, on_alloc_inlined, on_free, on_free_deferred, sampled_out, Role,
};
use heapdump_agent::stack_capture::{caller_frame, caller_parent_frame};

use crate::bootstrap_arena as arena;
use crate::next_allocator as next;

fn set_errno(e: c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    unsafe { *libc::__errno_location() = e };
}

fn page_size() -> usize {
    // SAFETY: sysconf has no preconditions.
    let p = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
    if p <= 0 {
        4096
    } else {
        p as usize
    }
}

/// Returns `p`, which a slow path just returned, in a way the compiler
/// cannot see through, so that the call to the slow path stays an
/// ordinary call and the entry point's frame (with its return address
/// into the program) stays under the slow path's: the slow path finds
/// it with [`caller_parent_frame`]. Costs no instruction.
#[inline(always)]
pub(crate) fn not_tail_called(mut p: *mut c_void) -> *mut c_void {
    // SAFETY: an empty assembly block that claims to read and write the
    // register holding `p` (and, for all the compiler knows, the memory
    // `p` points to); it does nothing. It runs on slow paths only.
    unsafe { std::arch::asm!("/* {0} */", inout(reg) p, options(nostack, preserves_flags)) };
    p
}

/// Records `p` (if an allocation of the next allocator) and returns it.
/// In sampled mode, a block that is not sampled costs only the countdown
/// here (the hooks without a fast path of their own, such as `memalign`,
/// rely on that): the recording path is out of line.
#[inline(always)]
fn recorded(p: *mut c_void, size: usize, fp: usize) -> *mut c_void {
    // A failed allocation is not counted down either.
    if !p.is_null() && !sampled_out(size) {
        record(p, size, fp);
    }
    p
}

/// The recording path of [`recorded`]. `fp` is the hook's frame pointer:
/// the walk starts there. Inlined: what it adds to a hook is the exact-mode
/// check and a call (the recording itself is out of line in the recorder).
#[inline(always)]
fn record(p: *mut c_void, size: usize, fp: usize) {
    on_alloc(p as usize, size, fp, Role::Preload);
}

/// An arena block (binding under way), with errno set when there is none.
#[cold]
fn from_arena(size: usize, align: usize) -> *mut c_void {
    let p = arena::alloc(size, align);
    if p.is_null() {
        set_errno(libc::ENOMEM);
    }
    p.cast()
}

/// The next allocator's `malloc` (the arena while binding), unrecorded.
#[inline(always)]
pub(crate) fn raw_malloc(size: usize) -> *mut c_void {
    match next::malloc() {
        // SAFETY: the next allocator's malloc, same contract.
        Some(f) => unsafe { f(size) },
        None => from_arena(size, 16),
    }
}

/// The next allocator's `memalign` (the arena while binding), unrecorded.
#[inline(always)]
pub(crate) fn raw_memalign(align: usize, size: usize) -> *mut c_void {
    match next::memalign() {
        // SAFETY: the next allocator's memalign, same contract.
        Some(f) => unsafe { f(align, size) },
        None if align <= 4096 => from_arena(size, align),
        None => std::ptr::null_mut(),
    }
}

/// Hands `p` (not null, not an arena block, out of the table) to the
/// next allocator's `free`.
#[inline(always)]
pub(crate) fn raw_free(p: *mut c_void) {
    if let Some(f) = next::free() {
        // SAFETY: the next allocator's free; `p` is a block it made that
        // the program released (exactly once).
        unsafe { f(p) }
    }
}

/// `malloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn malloc(size: usize) -> *mut c_void {
    // Sampled mode, not sampled (see the module doc): the slot first, so
    // that nothing is counted down when the slow path will count again.
    if let Some(f) = next::loaded::malloc() {
        if sampled_out(size) {
            // SAFETY: the next allocator's malloc, same contract.
            return unsafe { f(size) };
        }
        // Counted down already: the slow path need not ask again.
        return not_tail_called(malloc_slow::<true>(size));
    }
    not_tail_called(malloc_slow::<false>(size))
}

/// The complete [`malloc`] hook (see [`not_tail_called`]); `COUNTED`: the
/// caller has asked [`sampled_out`] for this allocation (and it said no).
#[inline(never)]
fn malloc_slow<const COUNTED: bool>(size: usize) -> *mut c_void {
    let fp = caller_parent_frame();
    match next::malloc() {
        Some(f) if COUNTED => {
            // SAFETY: the next allocator's malloc, same contract.
            let p = unsafe { f(size) };
            on_alloc_inlined(p as usize, size, fp, Role::Preload);
            p
        }
        // SAFETY: the next allocator's malloc, same contract.
        Some(f) => recorded(unsafe { f(size) }, size, fp),
        None => from_arena(size, 16),
    }
}

/// `free(3)`: the block leaves the table before the memory is released.
#[no_mangle]
pub unsafe extern "C" fn free(p: *mut c_void) {
    // Sampled mode, a block that was not sampled: straight to the next
    // allocator (free(NULL) included, a no-op there too). The filter
    // answers "maybe" for arena blocks (`bootstrap_arena` marks them), so
    // none takes this path.
    if not_sampled(p as usize) {
        if let Some(f) = next::loaded::free() {
            // SAFETY: the next allocator's free; `p` is a block it made
            // (not an arena block, see above) that the program releases.
            return unsafe { f(p) };
        }
    }
    free_recorded(p);
}

/// The complete [`free`] hook (also libstdc++'s `operator delete`, see
/// `cxx`).
#[inline(never)]
pub(crate) fn free_recorded(p: *mut c_void) {
    if p.is_null() || arena::contains(p as usize) {
        return;
    }
    // The release may be held back by a couple of frees (glibc only, see
    // `lib.rs`); the block is out of the table either way.
    let release = on_free_deferred(p as usize);
    if release != 0 {
        raw_free(release as *mut c_void);
    }
}

/// C23 `free_sized(3)`: forwarded as such where the next allocator has
/// it, else to its `free`.
#[no_mangle]
pub unsafe extern "C" fn free_sized(p: *mut c_void, size: usize) {
    if p.is_null() || arena::contains(p as usize) {
        return;
    }
    on_free(p as usize);
    match next::free_sized() {
        // SAFETY: the next allocator's free_sized, same contract.
        Some(f) => unsafe { f(p, size) },
        None => raw_free(p),
    }
}

/// C23 `free_aligned_sized(3)`: forwarded as such where the next
/// allocator has it, else to its `free`.
#[no_mangle]
pub unsafe extern "C" fn free_aligned_sized(p: *mut c_void, align: usize, size: usize) {
    if p.is_null() || arena::contains(p as usize) {
        return;
    }
    on_free(p as usize);
    match next::free_aligned_sized() {
        // SAFETY: the next allocator's free_aligned_sized, same contract.
        Some(f) => unsafe { f(p, align, size) },
        None => raw_free(p),
    }
}

/// `calloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn calloc(n: usize, size: usize) -> *mut c_void {
    // Sampled mode, not sampled (see `malloc`); an overflowing product
    // takes the slow path, where the allocator fails it.
    if let (Some(f), Some(total)) = (next::loaded::calloc(), n.checked_mul(size)) {
        if sampled_out(total) {
            // SAFETY: the next allocator's calloc, same contract.
            return unsafe { f(n, size) };
        }
    }
    not_tail_called(calloc_slow(n, size))
}

/// The complete [`calloc`] hook (see [`not_tail_called`]).
#[inline(never)]
fn calloc_slow(n: usize, size: usize) -> *mut c_void {
    let fp = caller_parent_frame();
    match next::calloc() {
        // SAFETY: the next allocator's calloc (it checks n * size).
        Some(f) => recorded(unsafe { f(n, size) }, n.wrapping_mul(size), fp),
        None => match n.checked_mul(size) {
            // Arena blocks are zero: the arena starts zeroed, never reused.
            Some(total) => from_arena(total, 16),
            None => {
                set_errno(libc::ENOMEM);
                std::ptr::null_mut()
            }
        },
    }
}

/// A resize of arena block `p`: a new block (never freed back to the
/// arena) with the old contents.
#[cold]
fn realloc_arena_block(p: *mut c_void, size: usize, fp: usize) -> *mut c_void {
    let old = arena::usable_size(p as usize);
    let q = raw_malloc(size);
    if !q.is_null() {
        // SAFETY: `p` has `old` readable bytes, `q` at least `size`
        // writable ones, and they are distinct blocks.
        unsafe { std::ptr::copy_nonoverlapping(p.cast::<u8>(), q.cast::<u8>(), old.min(size)) };
        if !arena::contains(q as usize) {
            on_alloc(q as usize, size, fp, Role::Preload);
        }
    }
    q
}

/// `realloc` and `reallocarray` alike: `resize` is the next allocator's
/// call on `p` (not null, not an arena block).
#[inline(always)]
fn resize_impl(
    p: *mut c_void,
    size: usize,
    fp: usize,
    resize: impl FnOnce() -> Option<*mut c_void>,
) -> *mut c_void {
    // The block may move (and its address be reused by another thread at
    // once): take it out of the table first.
    let old = on_free(p as usize);
    let Some(q) = resize() else {
        // Binding under way on another thread: no block of the next
        // allocator can be resized yet. Report failure; `p` is untouched.
        if let Some(old_size) = old {
            on_alloc(p as usize, old_size as usize, fp, Role::Preload);
        }
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if q.is_null() {
        if size != 0 {
            // Failed: the old block is untouched and still live.
            if let Some(old_size) = old {
                on_alloc(p as usize, old_size as usize, fp, Role::Preload);
            }
        }
    } else {
        on_alloc(q as usize, size, fp, Role::Preload);
    }
    q
}

/// `realloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn realloc(p: *mut c_void, size: usize) -> *mut c_void {
    // Sampled mode, an unsampled block resized to an unsampled one (see
    // `malloc` and `free`): straight to the allocator. A null `p` may
    // pass too (the filter may say "no" for it): `realloc(NULL, n)` is
    // then an unsampled `malloc(n)`.
    if not_sampled(p as usize) {
        if let Some(f) = next::loaded::realloc() {
            if sampled_out(size) {
                // SAFETY: the next allocator's realloc on a block it made
                // (not an arena block: the filter marks those), or null.
                return unsafe { f(p, size) };
            }
        }
    }
    not_tail_called(realloc_slow(p, size))
}

/// The complete [`realloc`] hook (see [`not_tail_called`]).
#[inline(never)]
fn realloc_slow(p: *mut c_void, size: usize) -> *mut c_void {
    let fp = caller_parent_frame();
    if p.is_null() {
        // realloc(NULL, n) is malloc(n).
        return recorded_or_arena(raw_malloc(size), size, fp);
    }
    if arena::contains(p as usize) {
        return realloc_arena_block(p, size, fp);
    }
    // jemalloc, a block that stays where it is: its record is kept.
    let mut refused = false;
    if crate::in_place_realloc::resized(p, size, fp, &mut refused) {
        return p;
    }
    resize_impl(p, size, fp, || {
        // jemalloc, a block that stays where it is: `xallocx`, cheaper
        // (unless jemalloc was just asked and would move it).
        if !refused && crate::in_place_realloc::kept_in_place(p, size) {
            return Some(p);
        }
        // SAFETY: the next allocator's realloc on a block it made.
        next::realloc().map(|f| unsafe { f(p, size) })
    })
}

/// `reallocarray(3)`: forwarded to the next definition (in a program
/// linked with jemalloc 5.3, which has none, that is glibc's, as without
/// the agent); `realloc` after the overflow check if there is none.
#[no_mangle]
pub unsafe extern "C" fn reallocarray(p: *mut c_void, n: usize, size: usize) -> *mut c_void {
    let fp = caller_frame();
    let Some(total) = n.checked_mul(size) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    if p.is_null() {
        return recorded_or_arena(raw_malloc(total), total, fp);
    }
    if arena::contains(p as usize) {
        return realloc_arena_block(p, total, fp);
    }
    resize_impl(p, total, fp, || match next::reallocarray() {
        // SAFETY: the next allocator's reallocarray on a block it made.
        Some(f) => Some(unsafe { f(p, n, size) }),
        // SAFETY: the next allocator's realloc on a block it made.
        None => next::realloc().map(|f| unsafe { f(p, total) }),
    })
}

/// Records `p` unless it is an arena block.
#[inline(always)]
pub(crate) fn recorded_or_arena(p: *mut c_void, size: usize, fp: usize) -> *mut c_void {
    if arena::contains(p as usize) {
        p
    } else {
        recorded(p, size, fp)
    }
}

/// `memalign(3)`.
#[no_mangle]
pub unsafe extern "C" fn memalign(align: usize, size: usize) -> *mut c_void {
    let fp = caller_frame();
    recorded_or_arena(raw_memalign(align, size), size, fp)
}

/// `aligned_alloc(3)`: the next allocator's, which checks the alignment.
#[no_mangle]
pub unsafe extern "C" fn aligned_alloc(align: usize, size: usize) -> *mut c_void {
    let fp = caller_frame();
    let p = match next::aligned_alloc() {
        // SAFETY: the next allocator's aligned_alloc, same contract.
        Some(f) => unsafe { f(align, size) },
        None if align.is_power_of_two() => raw_memalign(align, size),
        None => {
            set_errno(libc::EINVAL);
            std::ptr::null_mut()
        }
    };
    recorded_or_arena(p, size, fp)
}

/// `posix_memalign(3)`.
#[no_mangle]
pub unsafe extern "C" fn posix_memalign(out: *mut *mut c_void, align: usize, size: usize) -> c_int {
    let fp = caller_frame();
    if let Some(f) = next::posix_memalign() {
        // SAFETY: the next allocator's posix_memalign, same contract (the
        // caller passes a valid out-pointer).
        let r = unsafe { f(out, align, size) };
        if r == 0 {
            // SAFETY: on success the allocator wrote the block to `*out`.
            on_alloc(unsafe { *out } as usize, size, fp, Role::Preload);
        }
        return r;
    }
    if !align.is_power_of_two() || !align.is_multiple_of(std::mem::size_of::<*mut c_void>()) {
        return libc::EINVAL;
    }
    let p = recorded_or_arena(raw_memalign(align, size), size, fp);
    if p.is_null() {
        return libc::ENOMEM;
    }
    // SAFETY: the caller passes a valid out-pointer (posix_memalign's
    // contract).
    unsafe { *out = p };
    0
}

/// `valloc(3)`.
#[no_mangle]
pub unsafe extern "C" fn valloc(size: usize) -> *mut c_void {
    let fp = caller_frame();
    let p = match next::valloc() {
        // SAFETY: the next allocator's valloc, same contract.
        Some(f) => unsafe { f(size) },
        None => raw_memalign(page_size(), size),
    };
    recorded_or_arena(p, size, fp)
}

/// `pvalloc(3)`: page-aligned, size rounded up to whole pages.
#[no_mangle]
pub unsafe extern "C" fn pvalloc(size: usize) -> *mut c_void {
    let fp = caller_frame();
    let page = page_size();
    let Some(rounded) = size.max(1).checked_next_multiple_of(page) else {
        set_errno(libc::ENOMEM);
        return std::ptr::null_mut();
    };
    let p = match next::pvalloc() {
        // SAFETY: the next allocator's pvalloc, same contract.
        Some(f) => unsafe { f(size) },
        None => raw_memalign(page, rounded),
    };
    recorded_or_arena(p, rounded, fp)
}
