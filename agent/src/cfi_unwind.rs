//! Stack walking through code built without frame pointers, from each
//! module's call-frame information (`.eh_frame`, found through
//! `.eh_frame_hdr`), with the frame pointer as the fallback where a
//! program counter has none (JIT code, a module without `.eh_frame`).
//!
//! How a frame is stepped: the rule for a program counter (where the
//! canonical frame address is, where the return address and the caller's
//! `rbp` are saved) comes from the thread's rule cache ([`RuleCache`], one
//! lookup and one load when the counter was seen before); on a miss it is
//! computed from the module's CFI ([`rule_for`]) and cached. A rule is a
//! packed `u64` ([`Rule`]).
//!
//! Invariants:
//! - The walk never faults: every stack word it reads lies in `[sp, hi)`,
//!   the live part of the current thread's stack (the caller establishes
//!   it, as for the frame-pointer walk), and each step's new stack pointer
//!   must be above the previous one, so the walk ends in at most
//!   `(hi - sp) / 8` steps, and at `out.len()` frames anyway.
//! - CFI is read from modules' mapped `.eh_frame_hdr` / `.eh_frame`, found
//!   with glibc's lock-free `_dl_find_object`, only for a program counter
//!   taken from this thread's own stack: the thread is executing inside
//!   that module's call chain, so the module cannot be unloaded while it is
//!   read (unloading it would be the program's own use-after-free).
//! - Nothing here allocates or takes a lock: gimli's parsers run on
//!   borrowed slices with a fixed-size [`UnwindContext`] on the stack of a
//!   cold, non-inlined function.
//! - Cached rules are forgotten when a module is unloaded: the preload
//!   library's `dlclose` bumps [`GENERATION`], and a thread that sees a new
//!   generation clears its cache before walking (a stale rule could only
//!   give a wrong stack, never a fault).

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, Pointer, Register,
    RegisterRule, UnwindContext, UnwindContextStorage, UnwindSection, UnwindTableRow, X86_64,
};

use crate::stack_capture::{TraceHash, MAX_RETURN_ADDRESS, MIN_RETURN_ADDRESS};

/// Bumped when a module may have been unloaded (see the module doc).
pub static GENERATION: AtomicU64 = AtomicU64::new(0);

/// glibc's `_dl_find_object` (2.35 and later), or 0 when absent.
static FIND_OBJECT: AtomicUsize = AtomicUsize::new(0);

/// `struct dl_find_object` of `<dlfcn.h>` on x86_64 (no `dlfo_eh_dbase`,
/// no `dlfo_eh_count`), with generous reserved room.
#[repr(C)]
struct DlFindObject {
    flags: u64,
    map_start: *mut c_void,
    map_end: *mut c_void,
    link_map: *mut c_void,
    eh_frame: *mut c_void,
    reserved: [u64; 16],
}

/// Looks `_dl_find_object` up (may allocate: call during set-up only).
/// Returns whether CFI unwinding is possible in this process.
pub fn init() -> bool {
    // SAFETY: dlsym with a NUL-terminated name; the result is only stored.
    let f = unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) } as usize;
    FIND_OBJECT.store(f, Ordering::Relaxed);
    f != 0
}

/// Tells the unwinder a module may have been unloaded.
pub fn module_unloaded() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// How to step out of one frame, packed in a `u64`:
/// bits 0..3 the kind, 3..5 where the caller's `rbp` is, 8..32 the CFA
/// offset (signed), 32..48 the return address's offset from the CFA,
/// 48..64 the saved `rbp`'s offset (both signed).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rule(u64);

const K_EMPTY: u64 = 0;
/// CFA = rsp + off.
const K_CFA_RSP: u64 = 1;
/// CFA = rbp + off.
const K_CFA_RBP: u64 = 2;
/// CFA = *(rbp + off) (a frame that realigned its stack).
const K_CFA_DEREF_RBP: u64 = 3;
/// A signal trampoline (`__restore_rt`): the interrupted registers are in
/// the `ucontext_t` at the stack pointer.
const K_SIGNAL: u64 = 4;
/// No CFI for this counter: use the frame pointer (mode `auto`).
const K_NO_CFI: u64 = 5;
/// The outermost frame (return address undefined), or a rule this walker
/// cannot follow: the walk ends.
const K_STOP: u64 = 6;
/// A frame that keeps a frame pointer: CFA = rbp + 16, the return address
/// at CFA - 8, the caller's rbp at CFA - 16. Stepped exactly like a
/// frame-pointer walk (two loads), the most common rule in code built with
/// frame pointers.
const K_FP_FRAME: u64 = 7;

/// Bits 32..64 of a rule whose return address is at CFA - 8 and whose
/// saved-rbp offset is 0 (unused).
const RSP_RA8_TAIL: u64 = 0xfff8;

/// The caller's `rbp` is this frame's (not saved).
const RBP_SAME: u64 = 0;
/// The caller's `rbp` is saved at CFA + off.
const RBP_AT_CFA: u64 = 1;
/// The caller's `rbp` is saved at rbp + off.
const RBP_AT_RBP: u64 = 2;
/// The caller's `rbp` cannot be told.
const RBP_UNKNOWN: u64 = 3;

impl Rule {
    const EMPTY: Rule = Rule(K_EMPTY);
    const NO_CFI: Rule = Rule(K_NO_CFI);
    const STOP: Rule = Rule(K_STOP);
    const SIGNAL: Rule = Rule(K_SIGNAL);
    const FP_FRAME: Rule = Rule(K_FP_FRAME);

    /// A rule, or [`Rule::STOP`] when an offset does not fit its field.
    fn new(kind: u64, rbp: u64, cfa_off: i64, ra_off: i64, rbp_off: i64) -> Rule {
        let fits = |v: i64, bits: u32| v >= -(1 << (bits - 1)) && v < 1 << (bits - 1);
        if !fits(cfa_off, 24) || !fits(ra_off, 16) || !fits(rbp_off, 16) {
            return Rule::STOP;
        }
        Rule(
            kind | rbp << 3
                | ((cfa_off as u64) & 0xff_ffff) << 8
                | ((ra_off as u64) & 0xffff) << 32
                | ((rbp_off as u64) & 0xffff) << 48,
        )
    }

    fn kind(self) -> u64 {
        self.0 & 7
    }
    fn rbp_where(self) -> u64 {
        (self.0 >> 3) & 3
    }
    fn cfa_off(self) -> i64 {
        ((self.0 << 32) as i64) >> 40
    }
    fn ra_off(self) -> i64 {
        ((self.0 << 16) as i64) >> 48
    }
    fn rbp_off(self) -> i64 {
        (self.0 as i64) >> 48
    }
}

/// Entries in a thread's rule cache (direct-mapped, 16 bytes each).
pub const RULE_CACHE_ENTRIES: usize = 512;

/// A thread's cache from program counter to [`Rule`].
pub struct RuleCache {
    entries: [Cell<(u64, Rule)>; RULE_CACHE_ENTRIES],
    generation: Cell<u64>,
}

impl RuleCache {
    /// An empty cache (usable in a `const` thread-local initialiser).
    #[allow(clippy::declare_interior_mutable_const)]
    pub const fn new() -> Self {
        const E: Cell<(u64, Rule)> = Cell::new((0, Rule::EMPTY));
        RuleCache {
            entries: [E; RULE_CACHE_ENTRIES],
            generation: Cell::new(0),
        }
    }

    fn clear(&self) {
        for e in &self.entries {
            e.set((0, Rule::EMPTY));
        }
    }

    /// The rule for looking up `addr` (a return address - 1, or an exact
    /// counter after a signal frame).
    #[inline(always)]
    fn rule(&self, addr: u64) -> Rule {
        let i = (addr.wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 55) as usize % RULE_CACHE_ENTRIES;
        let (k, r) = self.entries[i].get();
        if k == addr && r != Rule::EMPTY {
            return r;
        }
        let r = rule_for(addr);
        self.entries[i].set((addr, r));
        r
    }
}

impl Default for RuleCache {
    fn default() -> Self {
        Self::new()
    }
}

/// Fixed-size storage for gimli's unwind context: x86_64 CFI names at most
/// the 17 general registers and the return address; two rows cover
/// `DW_CFA_remember_state` as compilers emit it.
struct StoreOnStack;

impl<T: gimli::ReaderOffset> UnwindContextStorage<T> for StoreOnStack {
    type Rules = [(Register, RegisterRule<T>); 24];
    type Stack = [UnwindTableRow<T, Self>; 2];
}

type Slice = EndianSlice<'static, LittleEndian>;

/// `DW_OP_breg6` (rbp + SLEB offset) and `DW_OP_deref`.
const DW_OP_BREG6: u8 = 0x76;
const DW_OP_DEREF: u8 = 0x06;

/// Reads a SLEB128 at the start of `b`: the value and its length.
fn sleb128(b: &[u8]) -> Option<(i64, usize)> {
    let mut v: i64 = 0;
    let mut shift = 0;
    for (i, byte) in b.iter().enumerate().take(10) {
        v |= i64::from(byte & 0x7f) << shift;
        shift += 7;
        if byte & 0x80 == 0 {
            if shift < 64 && byte & 0x40 != 0 {
                v |= -1 << shift;
            }
            return Some((v, i + 1));
        }
    }
    None
}

/// `rbp + off` if `expr` is exactly `DW_OP_breg6 off` (and then, with
/// `deref`, `DW_OP_deref`): the forms GCC emits for frames that realign
/// their stack.
fn breg6_expression(expr: &[u8], deref: bool) -> Option<i64> {
    let (&op, rest) = expr.split_first()?;
    if op != DW_OP_BREG6 {
        return None;
    }
    let (off, n) = sleb128(rest)?;
    match (&rest[n..], deref) {
        ([], false) => Some(off),
        ([DW_OP_DEREF], true) => Some(off),
        _ => None,
    }
}

/// The rule for program counter `addr`, computed from its module's CFI.
/// Cold: runs once per counter per thread (then the cache answers).
#[cold]
#[inline(never)]
fn rule_for(addr: u64) -> Rule {
    let f = FIND_OBJECT.load(Ordering::Relaxed);
    if f == 0 {
        return Rule::NO_CFI;
    }
    // SAFETY: `f` is glibc's `int _dl_find_object(void *pc, struct
    // dl_find_object *result)`, which is lock-free and async-signal-safe;
    // `dlfo` is a valid out-pointer of at least the struct's size.
    let found = unsafe {
        let find: unsafe extern "C" fn(*mut c_void, *mut DlFindObject) -> libc::c_int =
            std::mem::transmute(f);
        let mut dlfo: DlFindObject = std::mem::zeroed();
        (find(addr as *mut c_void, &mut dlfo) == 0).then_some(dlfo)
    };
    let Some(dlfo) = found else {
        return Rule::NO_CFI;
    };
    let hdr = dlfo.eh_frame as usize;
    let end = dlfo.map_end as usize;
    if hdr == 0 || end <= hdr {
        return Rule::NO_CFI;
    }
    rule_from_module(addr, hdr, end).unwrap_or(Rule::NO_CFI)
}

/// Evaluates the CFI of the module whose `.eh_frame_hdr` is at `hdr` (its
/// mapping ending at `end`) for `addr`.
fn rule_from_module(addr: u64, hdr: usize, end: usize) -> Option<Rule> {
    // SAFETY: `[hdr, end)` is the rest of a loaded module's mapping, found
    // by `_dl_find_object` for a counter on this thread's stack (the module
    // stays loaded, see the module doc). gimli reads only the parts the
    // section headers and FDE offsets point at, each checked against the
    // slice's length.
    let hdr_bytes: &'static [u8] =
        unsafe { std::slice::from_raw_parts(hdr as *const u8, end - hdr) };
    let bases = BaseAddresses::default().set_eh_frame_hdr(hdr as u64);
    let parsed = EhFrameHdr::new(hdr_bytes, LittleEndian)
        .parse(&bases, 8)
        .ok()?;
    let eh_frame_addr = match parsed.eh_frame_ptr() {
        Pointer::Direct(a) => a as usize,
        Pointer::Indirect(_) => return None,
    };
    if eh_frame_addr < hdr.saturating_sub(1 << 30) || eh_frame_addr >= end {
        return None;
    }
    // SAFETY: as above; `.eh_frame` lies in the same module's mapping.
    let eh_bytes: &'static [u8] =
        unsafe { std::slice::from_raw_parts(eh_frame_addr as *const u8, end - eh_frame_addr) };
    let bases = bases.set_eh_frame(eh_frame_addr as u64);
    let eh_frame: EhFrame<Slice> = EhFrame::new(eh_bytes, LittleEndian);
    let table = parsed.table()?;
    let fde = table
        .fde_for_address(&eh_frame, &bases, addr, EhFrame::cie_from_offset)
        .ok()?;
    if fde.is_signal_trampoline() {
        return Some(Rule::SIGNAL);
    }
    let mut ctx: UnwindContext<usize, StoreOnStack> = UnwindContext::new_in();
    let row = fde
        .unwind_info_for_address(&eh_frame, &bases, &mut ctx, addr)
        .ok()?;
    let ra_off = match row.register(X86_64::RA) {
        RegisterRule::Offset(o) => o,
        // The outermost frame (`_start`, a thread's start routine) marks
        // its return address undefined.
        _ => return Some(Rule::STOP),
    };
    let (rbp, rbp_off) = match row.register(X86_64::RBP) {
        RegisterRule::Undefined | RegisterRule::SameValue => (RBP_SAME, 0),
        RegisterRule::Offset(o) => (RBP_AT_CFA, o),
        RegisterRule::Expression(e) => match e
            .get(&eh_frame)
            .ok()
            .and_then(|x| breg6_expression(x.0.slice(), false))
        {
            Some(o) => (RBP_AT_RBP, o),
            None => (RBP_UNKNOWN, 0),
        },
        _ => (RBP_UNKNOWN, 0),
    };
    let rule = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RSP => {
            Rule::new(K_CFA_RSP, rbp, *offset, ra_off, rbp_off)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == X86_64::RBP => {
            if (*offset, ra_off, rbp, rbp_off) == (16, -8, RBP_AT_CFA, -16) {
                Rule::FP_FRAME
            } else {
                Rule::new(K_CFA_RBP, rbp, *offset, ra_off, rbp_off)
            }
        }
        CfaRule::Expression(e) => match e
            .get(&eh_frame)
            .ok()
            .and_then(|x| breg6_expression(x.0.slice(), true))
        {
            Some(o) => Rule::new(K_CFA_DEREF_RBP, rbp, o, ra_off, rbp_off),
            None => Rule::STOP,
        },
        _ => Rule::STOP,
    };
    Some(rule)
}

/// Registers of one frame while walking.
#[derive(Clone, Copy, Debug)]
struct Frame {
    /// Program counter: a return address (or, after a signal frame, the
    /// interrupted instruction).
    pc: u64,
    /// Stack pointer in this frame.
    sp: usize,
    /// `rbp` in this frame, if known.
    rbp: Option<usize>,
    /// `pc` is exact (after a signal frame), not a return address.
    exact: bool,
}

/// Offsets in the `ucontext_t` that a signal frame's stack pointer points
/// at (x86_64 Linux): `uc_mcontext.gregs` starts at byte 40; `REG_RBP` is
/// greg 10, `REG_RSP` 15, `REG_RIP` 16.
const UC_GREGS: usize = 40;
const REG_RBP: usize = 10;
const REG_RSP: usize = 15;
const REG_RIP: usize = 16;

/// Walks the stack from the frame of a hook built with frame pointers
/// (`fp`, the hook's frame pointer), writing return addresses into `out`;
/// returns how many were written and a 64-bit hash of them (never 0), as
/// [`crate::stack_capture::walk`] does. `fallback_fp`: use the frame
/// pointer where a counter has no CFI (mode `auto`).
///
/// The caller guarantees `[sp, hi)` is this thread's live, mapped stack
/// (see [`crate::stack_capture::walkable`]); `sp` is the current stack
/// pointer.
pub fn walk(
    fp: usize,
    sp: usize,
    hi: usize,
    out: &mut [u64],
    cache: &RuleCache,
    fallback_fp: bool,
) -> (usize, u64) {
    let mut h = TraceHash::new();
    let generation = GENERATION.load(Ordering::Relaxed);
    if cache.generation.get() != generation {
        cache.clear();
        cache.generation.set(generation);
    }
    // Reads the stack word at `a` if `[a, a + 8)` lies in `[lo, hi)`.
    let read = |a: usize, lo: usize| -> Option<usize> {
        if a < lo || !a.is_multiple_of(8) || a > hi.checked_sub(8)? {
            return None;
        }
        // SAFETY: `[a, a + 8)` lies inside `[sp, hi)`, the live part of this
        // thread's own stack (`lo >= sp`), mapped and readable (the
        // caller's guarantee). Volatile: nothing may be assumed of it.
        Some(unsafe { std::ptr::read_volatile(a as *const usize) })
    };
    // The hook's own frame, by its frame pointer.
    let (Some(caller_rbp), Some(ret)) = (read(fp, sp), fp.checked_add(8).and_then(|a| read(a, sp)))
    else {
        return h.finish(0);
    };
    let mut f = Frame {
        pc: ret as u64,
        sp: fp + 16,
        rbp: Some(caller_rbp),
        exact: false,
    };
    let mut n = 0;
    while n < out.len() {
        let pc = f.pc as usize;
        if pc.wrapping_sub(MIN_RETURN_ADDRESS) >= MAX_RETURN_ADDRESS - MIN_RETURN_ADDRESS {
            break;
        }
        out[n] = f.pc;
        h.add(f.pc);
        n += 1;
        let lookup = if f.exact { f.pc } else { f.pc - 1 };
        let rule = cache.rule(lookup);
        let next = match rule.kind() {
            // The common rule of code without frame pointers: the CFA above
            // the stack pointer, the return address just below it, rbp
            // untouched. Stepped without decoding the rest of the rule.
            K_CFA_RSP if rule.0 >> 32 == RSP_RA8_TAIL && rule.rbp_where() == RBP_SAME => {
                let cfa = f.sp.wrapping_add(rule.cfa_off() as usize);
                let Some(ra) = read(cfa.wrapping_sub(8), f.sp) else {
                    break;
                };
                Some(Frame {
                    pc: ra as u64,
                    sp: cfa,
                    rbp: f.rbp,
                    exact: false,
                })
            }
            K_CFA_RSP | K_CFA_RBP | K_CFA_DEREF_RBP => step_cfi(rule, f, sp, &read),
            K_SIGNAL => {
                let uc = f.sp + UC_GREGS;
                let (Some(rip), Some(rsp), Some(rbp)) = (
                    read(uc + REG_RIP * 8, f.sp),
                    read(uc + REG_RSP * 8, f.sp),
                    read(uc + REG_RBP * 8, f.sp),
                ) else {
                    break;
                };
                Some(Frame {
                    pc: rip as u64,
                    sp: rsp,
                    rbp: Some(rbp),
                    exact: true,
                })
            }
            // A frame-pointer frame, or (mode auto) a counter without CFI.
            k if k == K_FP_FRAME || (k == K_NO_CFI && fallback_fp) => {
                let Some(rbp) = f.rbp else { break };
                match (
                    read(rbp, f.sp),
                    rbp.checked_add(8).and_then(|a| read(a, f.sp)),
                ) {
                    (Some(next_rbp), Some(ra)) => Some(Frame {
                        pc: ra as u64,
                        sp: rbp + 16,
                        rbp: Some(next_rbp),
                        exact: false,
                    }),
                    _ => None,
                }
            }
            _ => None,
        };
        let Some(next) = next else { break };
        // The stack pointer must rise: the walk cannot loop, and it ends
        // within the stack.
        if next.sp <= f.sp || next.sp > hi {
            break;
        }
        f = next;
    }
    h.finish(n)
}

/// One step by a CFI rule (`K_CFA_*`).
#[inline(always)]
fn step_cfi(
    rule: Rule,
    f: Frame,
    sp: usize,
    read: &impl Fn(usize, usize) -> Option<usize>,
) -> Option<Frame> {
    let cfa = match rule.kind() {
        K_CFA_RSP => f.sp.checked_add_signed(rule.cfa_off() as isize)?,
        K_CFA_RBP => f.rbp?.checked_add_signed(rule.cfa_off() as isize)?,
        _ => read(f.rbp?.checked_add_signed(rule.cfa_off() as isize)?, sp)?,
    };
    let ra = read(cfa.checked_add_signed(rule.ra_off() as isize)?, f.sp)?;
    let rbp = match rule.rbp_where() {
        RBP_SAME => f.rbp,
        RBP_AT_CFA => read(cfa.checked_add_signed(rule.rbp_off() as isize)?, f.sp),
        RBP_AT_RBP => read(f.rbp?.checked_add_signed(rule.rbp_off() as isize)?, f.sp),
        _ => None,
    };
    Some(Frame {
        pc: ra as u64,
        sp: cfa,
        rbp,
        exact: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_pack_and_unpack_signed_offsets() {
        let r = Rule::new(K_CFA_RBP, RBP_AT_CFA, -4096, -8, -16);
        assert_eq!(
            (
                r.kind(),
                r.rbp_where(),
                r.cfa_off(),
                r.ra_off(),
                r.rbp_off()
            ),
            (K_CFA_RBP, RBP_AT_CFA, -4096, -8, -16)
        );
        let r = Rule::new(K_CFA_RSP, RBP_SAME, 1 << 20, 8, 0);
        assert_eq!((r.cfa_off(), r.ra_off()), (1 << 20, 8));
        assert_eq!(Rule::new(K_CFA_RSP, RBP_SAME, 1 << 24, -8, 0), Rule::STOP);
    }

    #[test]
    fn gcc_realignment_expressions_are_recognised() {
        // DW_OP_breg6 -8; DW_OP_deref
        assert_eq!(breg6_expression(&[0x76, 0x78, 0x06], true), Some(-8));
        assert_eq!(breg6_expression(&[0x76, 0x78], false), Some(-8));
        assert_eq!(breg6_expression(&[0x76, 0x00], false), Some(0));
        assert_eq!(breg6_expression(&[0x77, 0x78, 0x06], true), None);
        assert_eq!(breg6_expression(&[0x76, 0x78, 0x06, 0x06], true), None);
        assert_eq!(breg6_expression(&[], true), None);
    }

    #[inline(never)]
    fn recurse(n: u32, out: &mut [u64], cache: &RuleCache, fallback: bool) -> usize {
        if n == 0 {
            let sp = crate::stack_capture::stack_pointer();
            let hi = crate::stack_capture::thread_stack_top(sp).unwrap();
            walk(
                crate::stack_capture::frame_pointer(),
                sp,
                hi,
                out,
                cache,
                fallback,
            )
            .0
        } else {
            std::hint::black_box(recurse(n - 1, out, cache, fallback))
        }
    }

    #[test]
    fn cfi_walk_sees_the_recursion_and_its_callers_and_repeats_exactly() {
        assert!(init(), "_dl_find_object is present in glibc >= 2.35");
        let cache = RuleCache::new();
        let mut runs = Vec::new();
        // One call site, so every run walks the same frames: the first
        // fills the cache, the second answers from it, the third comes
        // after a (simulated) dlclose emptied it, with the FP fallback on.
        for run in 0..3 {
            if run == 2 {
                module_unloaded();
            }
            let mut out = [0u64; 64];
            let n = recurse(20, &mut out, &cache, run == 2);
            runs.push(out[..n].to_vec());
        }
        let first = &runs[0];
        assert!(first.len() > 21, "only {} frames by CFI", first.len());
        // The recursion's return addresses repeat.
        let same = first[1..20].windows(2).filter(|w| w[0] == w[1]).count();
        assert!(same >= 15, "{first:x?}");
        assert_eq!(&runs[1], first);
        assert_eq!(&runs[2], first);
    }
}
