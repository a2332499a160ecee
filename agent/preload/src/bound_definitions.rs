//! The entry points an attached agent redirects, and the definitions the
//! program's own relocation slots held for them before (what the hooks
//! forward to in attach mode).
//!
//! A module of its own so that the modules around it import in one
//! direction: `slot_redirection` fills the table, `next_allocator` and
//! `jemalloc_attached` read it, and neither of them imports
//! `slot_redirection`.
//!
//! Invariants:
//! - A definition is stored once per name, before any slot is redirected
//!   (`slot_redirection::collect_bound`), and read while binding; 0 means
//!   none was found.

use std::ffi::CStr;
use std::sync::atomic::{AtomicUsize, Ordering};

/// The entry points redirected: every name this library exports for the
/// malloc family and C++ `new`/`delete`.
pub const HOOKED: &[&CStr] = &[
    c"malloc",
    c"free",
    c"calloc",
    c"realloc",
    c"reallocarray",
    c"memalign",
    c"posix_memalign",
    c"aligned_alloc",
    c"valloc",
    c"pvalloc",
    c"free_sized",
    c"free_aligned_sized",
    c"_Znwm",
    c"_Znam",
    c"_ZnwmRKSt9nothrow_t",
    c"_ZnamRKSt9nothrow_t",
    c"_ZnwmSt11align_val_t",
    c"_ZnamSt11align_val_t",
    c"_ZnwmSt11align_val_tRKSt9nothrow_t",
    c"_ZnamSt11align_val_tRKSt9nothrow_t",
    c"_ZdlPv",
    c"_ZdaPv",
    c"_ZdlPvm",
    c"_ZdaPvm",
    c"_ZdlPvRKSt9nothrow_t",
    c"_ZdaPvRKSt9nothrow_t",
    c"_ZdlPvSt11align_val_t",
    c"_ZdaPvSt11align_val_t",
    c"_ZdlPvmSt11align_val_t",
    c"_ZdaPvmSt11align_val_t",
    c"_ZdlPvSt11align_val_tRKSt9nothrow_t",
    c"_ZdaPvSt11align_val_tRKSt9nothrow_t",
    // Observed only (forwarded unchanged): a module's unloading, so the
    // CFI unwinder drops its cached rules, and thread renames.
    c"dlclose",
    c"pthread_setname_np",
    c"prctl",
    // jemalloc's own calls, to hooks under our own names
    // (`jemalloc_attached`), only where jemalloc defines them.
    c"mallocx",
    c"rallocx",
    c"xallocx",
    c"dallocx",
    c"sdallocx",
];

/// For each [`HOOKED`] name, the definition the program calls: the first
/// slot value (in load order) that is the entry of a defined symbol outside
/// this library; 0 where no slot is bound to one. Filled before any slot is
/// redirected, read while binding (see [`bound_definition`]).
static BOUND: [AtomicUsize; HOOKED.len()] = [const { AtomicUsize::new(0) }; HOOKED.len()];

/// The definition of `name` read from the program's bound slots, if it is
/// a [`HOOKED`] name and one was found (what `next_allocator` binds to in
/// attach mode).
pub fn bound_definition(name: &CStr) -> Option<usize> {
    let i = HOOKED.iter().position(|h| *h == name)?;
    match BOUND[i].load(Ordering::Relaxed) {
        0 => None,
        f => Some(f),
    }
}

/// The definition stored for the `i`th name of [`HOOKED`] (0: none).
pub fn get(i: usize) -> usize {
    BOUND.get(i).map_or(0, |b| b.load(Ordering::Relaxed))
}

/// Stores the definition of the `i`th name of [`HOOKED`].
pub fn set(i: usize, definition: usize) {
    if let Some(b) = BOUND.get(i) {
        b.store(definition, Ordering::Relaxed);
    }
}
