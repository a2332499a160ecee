//! Hooking after the fact: for an agent loaded into a running process
//! (`heapdump attach` has the process `dlopen` this library, then call
//! [`crate::attach::heapdump_attach`]), symbol interposition does not apply: every
//! reference to `malloc` is already bound. So the relocation slots that
//! hold them are redirected: in every loaded module, each GOT slot
//! (`R_X86_64_JUMP_SLOT`, `R_X86_64_GLOB_DAT`) whose symbol is an entry
//! point this library exports is made to point at our hook; the hooks
//! forward to the program's own definitions (`next_allocator::rebind_for_attach`).
//!
//! Those definitions are read from the slots themselves before any is
//! redirected: a slot the loader bound holds the definition the program
//! calls. `dlsym(RTLD_DEFAULT)` is not enough: in a non-PIE executable
//! that takes `malloc`'s address (Debian's python3) it answers with the
//! executable's canonical PLT stub, which jumps through a slot we redirect,
//! so the hook would forward to itself. Only values that are the entry of
//! a defined symbol (`next_allocator::is_definition_entry`) are taken: a
//! lazily bound slot still holds a PLT trampoline, and forwarding to it
//! would run the loader's resolver, which rewrites the (redirected) slot.
//!
//! Invariants:
//! - The forwarding slots are bound before any relocation slot points at a
//!   hook, so a hook never runs unbound.
//! - A relocation slot is one aligned word, written with one atomic store:
//!   a thread calling through it concurrently reaches either the old
//!   definition or the hook, both valid for any block (the hooks forward
//!   frees of blocks they never recorded unchanged).
//! - A slot in a module's RELRO range (read-only after start in full-RELRO
//!   modules such as redis) is written by making its page writable for the
//!   write and read-only again after; other pages are left as they were.
//! - This library's own slots and the dynamic loader's are never touched
//!   (our own calls must reach the allocator, not ourselves).
//! - Every read of a module's dynamic section, symbol and string tables is
//!   of memory the loader mapped for that module, found through
//!   `dl_iterate_phdr` while the loader's lock is held.
//!
//! x86_64 only (relocation numbers); elsewhere `heapdump_attach` refuses.

use std::ffi::{c_int, c_void, CStr};
use std::sync::atomic::Ordering;

use crate::bound_definitions::HOOKED;

/// Our hook for each name of [`HOOKED`] (0: not exported here).
pub struct Hooks {
    addrs: [usize; HOOKED.len()],
    /// Base address of this library (its slots are never redirected).
    own_base: usize,
}

/// An ELF64 dynamic section entry (`Elf64_Dyn`: a tag and a value).
#[repr(C)]
struct Elf64Dyn {
    d_tag: i64,
    d_un: u64,
}

const PT_DYNAMIC: u32 = 2;
const PT_GNU_RELRO: u32 = 0x6474_e552;
const DT_NULL: i64 = 0;
const DT_PLTRELSZ: i64 = 2;
const DT_STRTAB: i64 = 5;
const DT_SYMTAB: i64 = 6;
const DT_RELA: i64 = 7;
const DT_RELASZ: i64 = 8;
const DT_STRSZ: i64 = 10;
const DT_JMPREL: i64 = 23;
const R_X86_64_GLOB_DAT: u64 = 6;
const R_X86_64_JUMP_SLOT: u64 = 7;

/// One pass over the modules: `visit(hook index, slot address, RELRO
/// range)` for every relocation slot of a [`HOOKED`] name, in every module
/// but ours and the dynamic loader's, in load order (the executable first).
struct Pass<'a> {
    own_base: usize,
    visit: &'a mut dyn FnMut(usize, usize, Option<(usize, usize)>),
}

/// The address the dynamic section gives for a table: absolute after the
/// loader relocated it (glibc does on x86_64), else relative to `base`.
fn table_addr(d_ptr: u64, base: usize) -> usize {
    if (d_ptr as usize) < base {
        base + d_ptr as usize
    } else {
        d_ptr as usize
    }
}

unsafe extern "C" fn each_module(
    info: *mut libc::dl_phdr_info,
    _size: usize,
    data: *mut c_void,
) -> c_int {
    // SAFETY: `data` is the `Pass` passed by `for_each_slot`, and the
    // loader hands a valid `info` for the duration of the call.
    let (pass, info) = unsafe { (&mut *(data as *mut Pass), &*info) };
    let base = info.dlpi_addr as usize;
    if !info.dlpi_name.is_null() {
        // SAFETY: the loader's NUL-terminated module name.
        let name = unsafe { CStr::from_ptr(info.dlpi_name) }.to_bytes();
        if name.windows(6).any(|w| w == b"ld-lin") || name.starts_with(b"linux-vdso") {
            return 0;
        }
    }
    if base == pass.own_base {
        return 0;
    }
    // SAFETY: `dlpi_phdr` points at `dlpi_phnum` program headers of a
    // loaded module.
    let phdrs = unsafe { std::slice::from_raw_parts(info.dlpi_phdr, info.dlpi_phnum as usize) };
    if !fully_loaded(base, phdrs) {
        // Being loaded by a `dlopen` on another thread: its relocations
        // may not be applied yet, nor its RELRO protection; the loader
        // writes both, so it is left alone until a later pass.
        return 0;
    }
    let Some(dynamic) = phdrs.iter().find(|p| p.p_type == PT_DYNAMIC) else {
        return 0;
    };
    let relro = phdrs.iter().find(|p| p.p_type == PT_GNU_RELRO).map(|p| {
        (
            base + p.p_vaddr as usize,
            base + (p.p_vaddr + p.p_memsz) as usize,
        )
    });
    let (mut symtab, mut strtab, mut strsz) = (0usize, 0usize, 0usize);
    let (mut jmprel, mut pltrelsz, mut rela, mut relasz) = (0usize, 0usize, 0usize, 0usize);
    let mut d = (base + dynamic.p_vaddr as usize) as *const Elf64Dyn;
    // A dynamic section has a few dozen entries; 4096 bounds a damaged one.
    for _ in 0..4096 {
        // SAFETY: inside the module's PT_DYNAMIC, which ends with DT_NULL.
        let e = unsafe { &*d };
        let v = e.d_un;
        match e.d_tag {
            DT_NULL => break,
            DT_SYMTAB => symtab = table_addr(v, base),
            DT_STRTAB => strtab = table_addr(v, base),
            DT_STRSZ => strsz = v as usize,
            DT_JMPREL => jmprel = table_addr(v, base),
            DT_PLTRELSZ => pltrelsz = v as usize,
            DT_RELA => rela = table_addr(v, base),
            DT_RELASZ => relasz = v as usize,
            _ => {}
        }
        // SAFETY: the next entry of the same array (bounded above).
        d = unsafe { d.add(1) };
    }
    if symtab == 0 || strtab == 0 {
        return 0;
    }
    for (table, size) in [(jmprel, pltrelsz), (rela, relasz)] {
        if table == 0 {
            continue;
        }
        let n = size / std::mem::size_of::<libc::Elf64_Rela>();
        // SAFETY: the module's relocation table, `size` bytes, as its
        // dynamic section describes it.
        let relas = unsafe { std::slice::from_raw_parts(table as *const libc::Elf64_Rela, n) };
        for r in relas {
            let kind = r.r_info & 0xffff_ffff;
            if kind != R_X86_64_JUMP_SLOT && kind != R_X86_64_GLOB_DAT {
                continue;
            }
            let sym_index = (r.r_info >> 32) as usize;
            // SAFETY: the symbol table entry the relocation names.
            let sym = unsafe { &*(symtab as *const libc::Elf64_Sym).add(sym_index) };
            let name_off = sym.st_name as usize;
            if name_off == 0 || (strsz != 0 && name_off >= strsz) {
                continue;
            }
            // SAFETY: a NUL-terminated name inside the string table.
            let name = unsafe { CStr::from_ptr((strtab + name_off) as *const libc::c_char) };
            if let Some(i) = HOOKED.iter().position(|h| *h == name) {
                (pass.visit)(i, base + r.r_offset as usize, relro);
            }
        }
    }
    0
}

/// True when the loader has finished loading the module (relocated it and
/// applied its RELRO protection). glibc's `_dl_find_object` (2.35+) knows
/// a module only from the end of its `dlopen`, after relocation; the
/// modules loaded at start-up it knows from the start. Without it (older
/// glibc) only the modules present at start-up are trusted: those are the
/// ones `dl_iterate_phdr` lists before any `dlopen` could add more, which
/// we cannot tell apart afterwards, so every module is taken, as before.
fn fully_loaded(base: usize, phdrs: &[libc::Elf64_Phdr]) -> bool {
    const PT_LOAD: u32 = 1;
    type FindObject = unsafe extern "C" fn(*mut c_void, *mut [u64; 32]) -> c_int;
    static FIND: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);
    let mut f = FIND.load(Ordering::Relaxed);
    if f == 1 {
        // SAFETY: dlsym with a NUL-terminated name (off the hot path).
        f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) } as usize;
        FIND.store(f, Ordering::Relaxed);
    }
    if f == 0 {
        return true;
    }
    let Some(load) = phdrs.iter().find(|p| p.p_type == PT_LOAD) else {
        return false;
    };
    // SAFETY: `f` is glibc's `_dl_find_object(void *pc, struct
    // dl_find_object *result)`; the result struct is 32 bytes of fields
    // plus reserved words, well inside 256 bytes; it only reads the
    // loader's tables.
    let mut out = [0u64; 32];
    unsafe {
        let f: FindObject = std::mem::transmute(f);
        f((base + load.p_vaddr as usize) as *mut c_void, &mut out) == 0
    }
}

/// Runs `visit` on every relocation slot of a [`HOOKED`] name (see
/// [`Pass`]).
fn for_each_slot(own_base: usize, visit: &mut dyn FnMut(usize, usize, Option<(usize, usize)>)) {
    let mut pass = Pass { own_base, visit };
    // SAFETY: the callback only reads the modules' loaded tables and calls
    // `visit`; `pass` outlives the call.
    unsafe { libc::dl_iterate_phdr(Some(each_module), (&mut pass as *mut Pass).cast()) };
}

/// Stores `value` into the word at `slot`, making its page writable for
/// the store when it lies in the module's RELRO range (and read-only
/// again after). False if the page could not be made writable.
fn write_slot(slot: usize, value: usize, relro: Option<(usize, usize)>) -> bool {
    let in_relro = relro.is_some_and(|(s, e)| (s..e).contains(&slot));
    let page = slot & !4095;
    if in_relro {
        // SAFETY: mprotect of one page of the module's own mapping.
        if unsafe {
            libc::mprotect(
                page as *mut c_void,
                4096,
                libc::PROT_READ | libc::PROT_WRITE,
            )
        } != 0
        {
            return false;
        }
    }
    // SAFETY: an aligned, writable word of a relocation table (the GOT);
    // the store is atomic, so a concurrent call through the slot reads the
    // old or the new target, never a torn one.
    unsafe {
        (*(slot as *const std::sync::atomic::AtomicUsize))
            .store(value, std::sync::atomic::Ordering::Release);
    }
    if in_relro {
        // SAFETY: as above; back to what RELRO made it.
        unsafe { libc::mprotect(page as *mut c_void, 4096, libc::PROT_READ) };
    }
    true
}

/// Our hooks' addresses, looked up in this library itself.
fn our_hooks() -> Option<Hooks> {
    let mut info: libc::Dl_info = unsafe {
        // SAFETY: an all-zero Dl_info is a valid out-value.
        std::mem::zeroed()
    };
    let here = our_hooks as *const () as *const c_void;
    // SAFETY: dladdr fills `info` for an address of this library.
    if unsafe { libc::dladdr(here, &mut info) } == 0 || info.dli_fname.is_null() {
        return None;
    }
    // SAFETY: our own file name; RTLD_NOLOAD only returns a handle to the
    // already loaded library (it never loads anything).
    let handle = unsafe { libc::dlopen(info.dli_fname, libc::RTLD_LAZY | libc::RTLD_NOLOAD) };
    if handle.is_null() {
        return None;
    }
    let mut addrs = [0usize; HOOKED.len()];
    for (a, name) in addrs.iter_mut().zip(HOOKED) {
        let ours = crate::jemalloc_attached::hook_name(name).unwrap_or(name);
        // SAFETY: dlsym on our own handle finds our own definition first.
        *a = unsafe { libc::dlsym(handle, ours.as_ptr()) } as usize;
    }
    // SAFETY: the handle from dlopen above (only drops the reference count
    // it added).
    unsafe { libc::dlclose(handle) };
    Some(Hooks {
        addrs,
        own_base: info.dli_fbase as usize,
    })
}

/// Reads the definitions the program's bound slots hold into
/// [`crate::bound_definitions`].
fn collect_bound(hooks: &Hooks) {
    let own = hooks.own_base;
    for_each_slot(own, &mut |i, slot, _| {
        // SAFETY: an aligned word of a loaded module's relocation table.
        let v =
            unsafe { (*(slot as *const std::sync::atomic::AtomicUsize)).load(Ordering::Acquire) };
        let ours = crate::next_allocator::object_base_of(v) == own;
        if v != 0
            && !ours
            && crate::bound_definitions::get(i) == 0
            && crate::next_allocator::is_definition_entry(v)
        {
            crate::bound_definitions::set(i, v);
        }
    });
}

/// The value each redirected slot held before (slot address -> value),
/// for [`restore_all`]. Touched only by attach, detach and the
/// housekeeping pass, which the caller serialises (`attach::STATE`).
static SAVED: std::sync::Mutex<Vec<(usize, usize)>> = std::sync::Mutex::new(Vec::new());

/// Redirects every loaded module's slots of [`HOOKED`] that do not point
/// at our hooks yet (all of them at attach; those of libraries loaded
/// since, later), saving what each held. Returns how many were redirected.
pub fn redirect_all(hooks: &Hooks) -> usize {
    let mut redirected = 0;
    let mut saved = SAVED.lock().unwrap_or_else(|e| e.into_inner());
    for_each_slot(hooks.own_base, &mut |i, slot, relro| {
        let hook = hooks.addrs[i];
        // SAFETY: an aligned word of a loaded module's relocation table.
        let cur =
            unsafe { (*(slot as *const std::sync::atomic::AtomicUsize)).load(Ordering::Acquire) };
        if hook == 0 || cur == hook {
            return;
        }
        if write_slot(slot, hook, relro) {
            match saved.iter_mut().find(|(s, _)| *s == slot) {
                // A module loaded again at the same address since.
                Some(e) => e.1 = cur,
                None => saved.push((slot, cur)),
            }
            redirected += 1;
        }
    });
    redirected
}

/// Puts back every slot that still points at one of our hooks, in the
/// modules still loaded, to the value it held before [`redirect_all`].
/// Returns how many were restored. A thread already inside a hook finishes
/// its call there (the library stays loaded).
pub fn restore_all(hooks: &Hooks) -> usize {
    let mut restored = 0;
    let saved = SAVED.lock().unwrap_or_else(|e| e.into_inner());
    for_each_slot(hooks.own_base, &mut |i, slot, relro| {
        // SAFETY: an aligned word of a loaded module's relocation table.
        let cur =
            unsafe { (*(slot as *const std::sync::atomic::AtomicUsize)).load(Ordering::Acquire) };
        if cur != hooks.addrs[i] || cur == 0 {
            return;
        }
        if let Some((_, old)) = saved.iter().find(|(s, _)| *s == slot) {
            if write_slot(slot, *old, relro) {
                restored += 1;
            }
        }
    });
    restored
}

/// Everything `heapdump_attach` needs before the first slot is
/// redirected: our hooks, and the program's own definitions read from its
/// bound slots and bound for forwarding. `None` if our library or the
/// program's `malloc`/`free` cannot be found (then nothing was changed).
pub fn prepare() -> Option<Hooks> {
    if !cfg!(target_arch = "x86_64") {
        return None;
    }
    let mut hooks = our_hooks()?;
    collect_bound(&hooks);
    if !crate::next_allocator::rebind_for_attach() {
        return None;
    }
    crate::jemalloc_attached::bind();
    // A jemalloc call with no definition to forward to keeps its slots.
    for (a, name) in hooks.addrs.iter_mut().zip(HOOKED) {
        if crate::jemalloc_attached::hook_name(name).is_some()
            && !crate::jemalloc_attached::bound(name)
        {
            *a = 0;
        }
    }
    Some(hooks)
}
