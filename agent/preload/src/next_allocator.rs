//! What the program would call without heapdump: for each entry point the
//! preload library exports, the definition that comes after it in the
//! dynamic lookup order, found with `dlsym(RTLD_NEXT, name)`. For the
//! allocation calls that is the program's allocator (glibc, jemalloc,
//! tcmalloc, mimalloc, or a library preloaded after ours); the few other
//! calls interposed only to observe them (`pthread_setname_np`, `prctl`,
//! `dlclose`) are glibc's.
//!
//! Invariants:
//! - Every entry point is looked up once, by the one thread that wins the
//!   `UNBOUND -> BINDING` CAS, and stored in an atomic slot; `BOUND` is
//!   published with Release after every slot is written. A hook never looks
//!   a name up itself, and never through `RTLD_DEFAULT`.
//! - While binding is under way, on any thread (the binder's own `dlsym`
//!   allocates; another thread may race into its first `malloc`), the
//!   accessors return `None` and the hooks serve the call from the
//!   [`bootstrap_arena`](crate::bootstrap_arena). Nobody waits for the
//!   binder, so no lock the binder needs (the loader's) can be held by a
//!   thread that waits on it: no deadlock.
//! - A slot holds 0 only before binding or when the next allocator has no
//!   such entry point (jemalloc has no `pvalloc`, glibc 2.36 no
//!   `free_sized`); the hooks then fall back to an equivalent call. The
//!   core five (`malloc`, `free`, `calloc`, `realloc`, `memalign`) fall back
//!   to glibc's `__libc_*` names if the plain ones are missing.
//! - Relaxed loads of a slot suffice on the hot path: a non-zero slot is
//!   the address of code in a library that is already loaded and is never
//!   unloaded while the process allocates (the allocator), so no other data
//!   is published through it.

use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

const UNBOUND: u8 = 0;
const BINDING: u8 = 1;
const BOUND: u8 = 2;

static STATE: AtomicU8 = AtomicU8::new(UNBOUND);

/// Set when this library arrived by `dlopen` into a running process
/// (`heapdump attach`): it is then not in the lookup order at all, and the
/// program's own definition is the global one (`RTLD_DEFAULT`), not the
/// next one after us (`RTLD_NEXT` would give our own dependencies', glibc's
/// even in a jemalloc program).
static ATTACHED: AtomicBool = AtomicBool::new(false);

/// Looks `name` up after this library (preloaded), or as the program calls
/// it (attached: the definition its bound slots hold; else the global one
/// if that is a real definition, never a canonical PLT stub, which would
/// lead back through a redirected slot to the hook itself).
fn lookup(name: &CStr) -> usize {
    if !ATTACHED.load(Ordering::Relaxed) {
        // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name; it may
        // allocate, which the hooks serve from the arena while BINDING.
        return unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize };
    }
    if let Some(f) = crate::bound_definitions::bound_definition(name) {
        return f;
    }
    // SAFETY: as above, with RTLD_DEFAULT.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, name.as_ptr()) as usize };
    if f != 0 && object_base_of(f) == object_base_of(lookup as *const () as usize) {
        // RTLD_DEFAULT searches the global scope, then ours: a name the
        // global scope does not define (glibc before 2.34 defines
        // `pthread_setname_np` in libpthread, which a program that did not
        // link it loads only as our dependency) is our own hook, and
        // forwarding to it would recurse. The next definition after us
        // in our scope is the one.
        // SAFETY: as above, with RTLD_NEXT.
        let next = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) as usize };
        return if next != 0 && object_base_of(next) != object_base_of(f) {
            next
        } else {
            0
        };
    }
    if f != 0 && defines_symbol_at(f) {
        f
    } else {
        0
    }
}

/// Binds every slot again, to the definitions the program itself calls
/// (see [`lookup`]), for an agent loaded into a running process, after
/// `slot_redirection` read them from the bound slots. Must run before any
/// relocation slot points at a hook: until then no call reaches the hooks
/// (the load-time binding has finished, in the library's initialiser), so
/// no thread reads the slots while they change. Returns false if `malloc`
/// or `free` has no definition to forward to.
pub fn rebind_for_attach() -> bool {
    ATTACHED.store(true, Ordering::Relaxed);
    bind_all();
    // Release: the new slots are written before the relocation slots that
    // lead to the hooks are (those writes are ordered after this one).
    STATE.store(BOUND, Ordering::Release);
    SLOTS.malloc.load(Ordering::Relaxed) != 0 && SLOTS.free.load(Ordering::Relaxed) != 0
}

macro_rules! next_functions {
    ($( $(#[$doc:meta])* $field:ident = $sym:literal $(or $fallback:literal)? : $ty:ty; )*) => {
        /// One slot per entry point of the next allocator.
        struct Slots {
            $( $field: AtomicUsize, )*
        }

        static SLOTS: Slots = Slots {
            $( $field: AtomicUsize::new(0), )*
        };

        fn bind_all() {
            $(
                #[allow(unused_mut)]
                let mut f = lookup($sym);
                $( if f == 0 { f = lookup($fallback); } )?
                SLOTS.$field.store(f, Ordering::Relaxed);
            )*
        }

        $(
            $(#[$doc])*
            /// `None` while binding is under way, or if the next allocator
            /// has no such entry point.
            #[inline(always)]
            pub fn $field() -> Option<$ty> {
                let mut f = SLOTS.$field.load(Ordering::Relaxed);
                if f == 0 {
                    f = slow_load(&SLOTS.$field);
                    if f == 0 {
                        return None;
                    }
                }
                // SAFETY: the slot holds the address `dlsym` gave for this
                // exact symbol, whose C (or C++ ABI) signature is `$ty`.
                Some(unsafe { std::mem::transmute::<usize, $ty>(f) })
            }
        )*

        /// The same accessors for a hook's fast path: one load of the slot,
        /// and `None` while it is 0, without starting the binding (the hook
        /// then takes its slow path, whose accessor does).
        pub mod loaded {
            #[allow(unused_imports)]
            use super::*;
            $(
                $(#[$doc])*
                #[inline(always)]
                pub fn $field() -> Option<$ty> {
                    match SLOTS.$field.load(Ordering::Relaxed) {
                        0 => None,
                        // SAFETY: as in the outer accessor of this name.
                        f => Some(unsafe { std::mem::transmute::<usize, $ty>(f) }),
                    }
                }
            )*
        }
    };
}

next_functions! {
    /// `malloc`.
    malloc = c"malloc" or c"__libc_malloc": unsafe extern "C" fn(usize) -> *mut c_void;
    /// `free`.
    free = c"free" or c"__libc_free": unsafe extern "C" fn(*mut c_void);
    /// `calloc`.
    calloc = c"calloc" or c"__libc_calloc": unsafe extern "C" fn(usize, usize) -> *mut c_void;
    /// `realloc`.
    realloc = c"realloc" or c"__libc_realloc":
        unsafe extern "C" fn(*mut c_void, usize) -> *mut c_void;
    /// `memalign`.
    memalign = c"memalign" or c"__libc_memalign":
        unsafe extern "C" fn(usize, usize) -> *mut c_void;
    /// `reallocarray`.
    reallocarray = c"reallocarray":
        unsafe extern "C" fn(*mut c_void, usize, usize) -> *mut c_void;
    /// `posix_memalign`.
    posix_memalign = c"posix_memalign":
        unsafe extern "C" fn(*mut *mut c_void, usize, usize) -> c_int;
    /// `aligned_alloc`.
    aligned_alloc = c"aligned_alloc": unsafe extern "C" fn(usize, usize) -> *mut c_void;
    /// `valloc`.
    valloc = c"valloc": unsafe extern "C" fn(usize) -> *mut c_void;
    /// `pvalloc`.
    pvalloc = c"pvalloc": unsafe extern "C" fn(usize) -> *mut c_void;
    /// C23 `free_sized`.
    free_sized = c"free_sized": unsafe extern "C" fn(*mut c_void, usize);
    /// C23 `free_aligned_sized`.
    free_aligned_sized = c"free_aligned_sized": unsafe extern "C" fn(*mut c_void, usize, usize);
    /// `operator new(size_t)`.
    new = c"_Znwm": unsafe extern "C-unwind" fn(usize) -> *mut c_void;
    /// `operator new[](size_t)`.
    new_array = c"_Znam": unsafe extern "C-unwind" fn(usize) -> *mut c_void;
    /// `operator new(size_t, align_val_t)`.
    new_aligned = c"_ZnwmSt11align_val_t": unsafe extern "C-unwind" fn(usize, usize) -> *mut c_void;
    /// `operator new[](size_t, align_val_t)`.
    new_array_aligned = c"_ZnamSt11align_val_t":
        unsafe extern "C-unwind" fn(usize, usize) -> *mut c_void;
    /// `operator new(size_t, nothrow_t const&)`.
    new_nothrow = c"_ZnwmRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(usize, *const c_void) -> *mut c_void;
    /// `operator new[](size_t, nothrow_t const&)`.
    new_array_nothrow = c"_ZnamRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(usize, *const c_void) -> *mut c_void;
    /// `operator new(size_t, align_val_t, nothrow_t const&)`.
    new_aligned_nothrow = c"_ZnwmSt11align_val_tRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(usize, usize, *const c_void) -> *mut c_void;
    /// `operator new[](size_t, align_val_t, nothrow_t const&)`.
    new_array_aligned_nothrow = c"_ZnamSt11align_val_tRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(usize, usize, *const c_void) -> *mut c_void;
    /// `operator delete(void*)`.
    delete = c"_ZdlPv": unsafe extern "C-unwind" fn(*mut c_void);
    /// `operator delete[](void*)`.
    delete_array = c"_ZdaPv": unsafe extern "C-unwind" fn(*mut c_void);
    /// `operator delete(void*, size_t)`.
    delete_sized = c"_ZdlPvm": unsafe extern "C-unwind" fn(*mut c_void, usize);
    /// `operator delete[](void*, size_t)`.
    delete_array_sized = c"_ZdaPvm": unsafe extern "C-unwind" fn(*mut c_void, usize);
    /// `operator delete(void*, align_val_t)`.
    delete_aligned = c"_ZdlPvSt11align_val_t": unsafe extern "C-unwind" fn(*mut c_void, usize);
    /// `operator delete[](void*, align_val_t)`.
    delete_array_aligned = c"_ZdaPvSt11align_val_t": unsafe extern "C-unwind" fn(*mut c_void, usize);
    /// `operator delete(void*, size_t, align_val_t)`.
    delete_sized_aligned = c"_ZdlPvmSt11align_val_t":
        unsafe extern "C-unwind" fn(*mut c_void, usize, usize);
    /// `operator delete[](void*, size_t, align_val_t)`.
    delete_array_sized_aligned = c"_ZdaPvmSt11align_val_t":
        unsafe extern "C-unwind" fn(*mut c_void, usize, usize);
    /// `operator delete(void*, nothrow_t const&)`.
    delete_nothrow = c"_ZdlPvRKSt9nothrow_t": unsafe extern "C-unwind" fn(*mut c_void, *const c_void);
    /// `operator delete[](void*, nothrow_t const&)`.
    delete_array_nothrow = c"_ZdaPvRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(*mut c_void, *const c_void);
    /// `operator delete(void*, align_val_t, nothrow_t const&)`.
    delete_aligned_nothrow = c"_ZdlPvSt11align_val_tRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(*mut c_void, usize, *const c_void);
    /// `operator delete[](void*, align_val_t, nothrow_t const&)`.
    delete_array_aligned_nothrow = c"_ZdaPvSt11align_val_tRKSt9nothrow_t":
        unsafe extern "C-unwind" fn(*mut c_void, usize, *const c_void);
    /// `pthread_setname_np(3)` (observed, see `thread_names`).
    pthread_setname_np = c"pthread_setname_np":
        unsafe extern "C" fn(libc::pthread_t, *const c_char) -> c_int;
    /// `prctl(2)` with its four further arguments (see `thread_names`).
    prctl = c"prctl": unsafe extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int;
    /// `dlclose(3)` (observed, see `dlclose_hook`).
    dlclose = c"dlclose": unsafe extern "C" fn(*mut c_void) -> c_int;
    /// `syscall(3)` with its six further arguments (observed, see
    /// `sandbox`).
    syscall = c"syscall": unsafe extern "C" fn(
        libc::c_long,
        libc::c_long,
        libc::c_long,
        libc::c_long,
        libc::c_long,
        libc::c_long,
        libc::c_long,
    ) -> libc::c_long;
}

/// The slot's value once binding is done (0: absent), or 0 while binding
/// is under way on some thread (the caller serves from the arena).
#[cold]
#[inline(never)]
fn slow_load(slot: &AtomicUsize) -> usize {
    if bind() {
        slot.load(Ordering::Relaxed)
    } else {
        0
    }
}

/// Binds every entry point if nobody has; true once they are bound, false
/// while another call (on this thread or another) is binding.
pub fn bind() -> bool {
    match STATE.load(Ordering::Acquire) {
        BOUND => return true,
        BINDING => return false,
        _ => {}
    }
    if STATE
        .compare_exchange(UNBOUND, BINDING, Ordering::Acquire, Ordering::Acquire)
        .is_err()
    {
        return STATE.load(Ordering::Acquire) == BOUND;
    }
    bind_all();
    // Release: every slot is written before any thread reads BOUND.
    STATE.store(BOUND, Ordering::Release);
    true
}

/// The file name of the object that defines code address `f` (`dladdr`),
/// written into `buf`; its length, or 0 if unknown. Never allocates.
pub fn object_name_of(f: usize, buf: &mut [u8]) -> usize {
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    let name = unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if f == 0 || libc::dladdr(f as *const c_void, &mut info) == 0 || info.dli_fname.is_null() {
            return 0;
        }
        CStr::from_ptr(info.dli_fname).to_bytes()
    };
    let n = name.len().min(buf.len());
    buf[..n].copy_from_slice(&name[..n]);
    n
}

/// The load address of the object containing address `a` (`dladdr`), or 0.
pub fn object_base_of(a: usize) -> usize {
    // SAFETY: dladdr only reads the loader's tables and fills `info`.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        if a == 0 || libc::dladdr(a as *const c_void, &mut info) == 0 {
            return 0;
        }
        info.dli_fbase as usize
    }
}

/// False when code address `a` is only a "canonical PLT entry": a
/// non-PIE executable that takes a function's address gets an undefined
/// symbol with a value (its PLT stub, which jumps to the real definition),
/// and `dlsym(RTLD_DEFAULT)` answers with that stub. True for a real
/// definition, or when it cannot be told.
pub fn defines_symbol_at(a: usize) -> bool {
    /// `RTLD_DL_SYMENT` of `<dlfcn.h>`: `extra` receives the `ElfW(Sym)`.
    const RTLD_DL_SYMENT: libc::c_int = 1;
    // SAFETY: dladdr1 fills `info` and stores a pointer to the matching
    // symbol-table entry (or null) into `sym`; the entry lives in the
    // loaded object, which is not unloaded while we read it (the
    // executable).
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let mut sym: *mut c_void = std::ptr::null_mut();
        if libc::dladdr1(a as *const c_void, &mut info, &mut sym, RTLD_DL_SYMENT) == 0
            || sym.is_null()
        {
            return true;
        }
        (*sym.cast::<libc::Elf64_Sym>()).st_shndx != 0
    }
}

/// True when code address `a` is the first byte of a symbol some loaded
/// object defines: a function's entry, not a PLT stub or a lazy-binding
/// trampoline (`PLT + 6`, whose nearest symbol may well be defined), which
/// would run the loader's resolver and rewrite the slot it came from.
pub fn is_definition_entry(a: usize) -> bool {
    /// `RTLD_DL_SYMENT` of `<dlfcn.h>`.
    const RTLD_DL_SYMENT: libc::c_int = 1;
    // SAFETY: as in `defines_symbol_at`.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let mut sym: *mut c_void = std::ptr::null_mut();
        if a == 0
            || libc::dladdr1(a as *const c_void, &mut info, &mut sym, RTLD_DL_SYMENT) == 0
            || sym.is_null()
        {
            return false;
        }
        info.dli_saddr as usize == a && (*sym.cast::<libc::Elf64_Sym>()).st_shndx != 0
    }
}

/// True when the next `free` is glibc's (`libc.so.6`): its chunk layout
/// and cost are what the held-back frees were measured against.
pub fn next_is_glibc() -> bool {
    free().is_some_and(|f| defined_in(f as usize, b"libc.so"))
}

/// True when code address `f` lies in a loaded object whose file name
/// starts with `prefix` (`libc.so`, `libstdc++.so`). Never allocates.
pub fn defined_in(f: usize, prefix: &[u8]) -> bool {
    let mut buf = [0u8; 512];
    let n = object_name_of(f, &mut buf);
    let path = &buf[..n];
    let file = path.rsplit(|b| *b == b'/').next().unwrap_or(path);
    file.starts_with(prefix)
}
