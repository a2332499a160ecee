//! Stack walking through code built without frame pointers, from each
//! module's call-frame information (`.eh_frame`, found through
//! `.eh_frame_hdr`), with the frame pointer as the fallback where a
//! program counter has none (JIT code, a module without `.eh_frame`).
//!
//! On x86_64 and aarch64: "rbp" below is the frame pointer (`x29` on
//! aarch64) and the return address is aarch64's link register `x30` where
//! saved. The walk starts at the hook's caller: from the hook's frame
//! record on x86_64; on aarch64, where the record's place in a frame is
//! the compiler's choice, through the hook's own CFI (`hook_caller`).
//! x86_64 crosses signal frames; on aarch64 one ends the walk.
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
//!   with glibc's lock-free `_dl_find_object` (before glibc 2.35: the
//!   agent's [`crate::module_table`]), only for a program counter
//!   taken from this thread's own stack: the thread is executing inside
//!   that module's call chain, so the module cannot be unloaded while it is
//!   read (unloading it would be the program's own use-after-free).
//! - Nothing here allocates or takes a lock: gimli's parsers run on
//!   borrowed slices with a fixed-size [`UnwindContext`] on the stack of a
//!   cold, non-inlined function. One exception, before glibc 2.35 only: a
//!   rule-cache miss for a counter in no module the agent's table knows,
//!   or while another thread rebuilds the table,
//!   asks the loader (`dl_iterate_phdr`, whose lock is recursive and is
//!   never held by a thread waiting on this one: see `module_table`),
//!   as libgcc's unwinder does for every C++ exception on those systems.
//! - Cached rules are forgotten when a module is unloaded: the preload
//!   library's `dlclose` bumps [`GENERATION`], and a thread that sees a new
//!   generation clears its cache before walking (a stale rule could only
//!   give a wrong stack, never a fault).

use std::cell::Cell;
use std::ffi::c_void;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EndianSlice, LittleEndian, Pointer, Register,
    RegisterRule, UnwindContext, UnwindContextStorage, UnwindSection, UnwindTableRow,
};

use crate::stack_capture::{is_return_address, TraceHash};
use crate::stack_memo::{End, StackMemo, StackMemos, Step, Visited, MEMO_ENTRIES};
use crate::trace_shortcut::{Answer, Shortcuts, SHORTCUT_WORDS};
use heapdump_table::stack_compression::MAX_FRAMES;

/// The DWARF registers the walk follows, per architecture: the stack
/// pointer, the frame pointer (named `rbp` throughout this module) and
/// the return address (x86_64's pseudo-register, aarch64's link register).
#[cfg(target_arch = "x86_64")]
mod regs {
    pub const SP: gimli::Register = gimli::X86_64::RSP;
    pub const FP: gimli::Register = gimli::X86_64::RBP;
    pub const RA: gimli::Register = gimli::X86_64::RA;
}
#[cfg(target_arch = "aarch64")]
mod regs {
    pub const SP: gimli::Register = gimli::AArch64::SP;
    pub const FP: gimli::Register = gimli::AArch64::X29;
    pub const RA: gimli::Register = gimli::AArch64::X30;
}

/// Bumped when a module may have been unloaded (see the module doc).
pub static GENERATION: AtomicU64 = AtomicU64::new(0);

/// glibc's `_dl_find_object` (2.35 and later), or 0 when absent.
static FIND_OBJECT: AtomicUsize = AtomicUsize::new(0);

/// `struct dl_find_object` of `<dlfcn.h>` on x86_64 and aarch64 (no `dlfo_eh_dbase`,
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

/// Looks `_dl_find_object` up, and without it (glibc before 2.35) builds
/// the agent's own module table ([`crate::module_table`]). May allocate
/// (dlsym): call during set-up only. `table_only`: use the table even
/// where glibc has `_dl_find_object` (`HEAPDUMP_MODULE_LOOKUP=table`).
/// Returns whether CFI unwinding is possible in this process.
pub fn init(table_only: bool) -> bool {
    let f = if table_only {
        0
    } else {
        // SAFETY: dlsym with a NUL-terminated name; the result is only
        // stored.
        unsafe { libc::dlsym(libc::RTLD_DEFAULT, c"_dl_find_object".as_ptr()) as usize }
    };
    FIND_OBJECT.store(f, Ordering::Relaxed);
    f != 0 || crate::module_table::init()
}

/// Tells the unwinder a module may have been unloaded.
pub fn module_unloaded() {
    GENERATION.fetch_add(1, Ordering::Relaxed);
}

/// How to step out of one frame, packed in a `u64`:
/// bits 0..4 the kind, 4..6 where the caller's `rbp` is, 8..32 the CFA
/// offset (signed), 32..48 the return address's offset from the CFA,
/// 48..64 the saved `rbp`'s offset (both signed).
///
/// The two kinds that make up nearly every frame are stepped by the walk's
/// own loop without decoding the rest: [`K_FP_FRAME`] (compared as a whole
/// word) and [`K_RSP_RA8`] (its return address's offset is kept beside it
/// in the [`RuleCache`]).
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
/// the `ucontext_t` at the stack pointer. x86_64 only: on aarch64 a
/// signal frame ends the walk (its `ucontext_t` layout is not read).
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
/// The common rule of code without frame pointers, in canonical form:
/// CFA = rsp + off with `off` a positive multiple of 8 (bits 8..32, the
/// bits above them zero but for the rbp offset), the return address at
/// CFA - 8, and the caller's `rbp` either unchanged (rbp offset 0) or saved
/// at CFA + off with `-off` a multiple of 8 in `[16, cfa offset]`. So every
/// read it implies lies in `[rsp, CFA)` and the new stack pointer (the
/// CFA) is above the old one: the walk checks only that the CFA is within
/// the stack. Made by [`Rule::new`] from a [`K_CFA_RSP`] rule that fits.
const K_RSP_RA8: u64 = 8;

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

    /// A rule, or [`Rule::STOP`] when an offset does not fit its field. A
    /// [`K_CFA_RSP`] rule of the canonical shape becomes [`K_RSP_RA8`].
    fn new(kind: u64, rbp: u64, cfa_off: i64, ra_off: i64, rbp_off: i64) -> Rule {
        let fits = |v: i64, bits: u32| v >= -(1 << (bits - 1)) && v < 1 << (bits - 1);
        if !fits(cfa_off, 24) || !fits(ra_off, 16) || !fits(rbp_off, 16) {
            return Rule::STOP;
        }
        let canonical = kind == K_CFA_RSP
            && ra_off == -8
            && cfa_off >= 8
            && cfa_off % 8 == 0
            && match rbp {
                RBP_SAME => true,
                RBP_AT_CFA => rbp_off <= -16 && rbp_off % 8 == 0 && cfa_off + rbp_off >= 0,
                _ => false,
            };
        if canonical {
            let rbp_off = if rbp == RBP_SAME { 0 } else { rbp_off };
            return Rule(K_RSP_RA8 | (cfa_off as u64) << 8 | ((rbp_off as u64) & 0xffff) << 48);
        }
        Rule(
            kind | rbp << 4
                | ((cfa_off as u64) & 0xff_ffff) << 8
                | ((ra_off as u64) & 0xffff) << 32
                | ((rbp_off as u64) & 0xffff) << 48,
        )
    }

    fn kind(self) -> u64 {
        self.0 & 15
    }
    fn rbp_where(self) -> u64 {
        (self.0 >> 4) & 3
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

/// Entries in a thread's rule cache (direct-mapped, 24 bytes each).
pub const RULE_CACHE_ENTRIES: usize = 512;

/// Set in a cache key (and in [`Frame::pc`]) for a counter that a
/// signal interrupted (defined with the memo, which strips it from the
/// frames it keeps).
use crate::stack_memo::EXACT;

/// One entry of a [`RuleCache`]: key, rule and offset side by side, so a
/// lookup reads one cache line (two for the quarter of entries that
/// straddle one), not one per field.
#[repr(C)]
struct RuleEntry {
    /// The counter (tagged with [`EXACT`] where so) the entry is for; 0
    /// for an empty entry (no counter is 0).
    key: Cell<u64>,
    /// The entry's rule.
    rule: Cell<Rule>,
    /// For a [`K_RSP_RA8`] rule, its CFA offset minus 8: where the return
    /// address is from the stack pointer (else unused).
    ra_offset: Cell<u32>,
}

/// A thread's cache from program counter to [`Rule`].
///
/// The entry's index is the counter's low bits (a mask and a multiply by
/// three, scaled by the load itself), and [`K_RSP_RA8`]'s CFA offset is
/// kept decoded beside the rule, so the walk's next load waits for the
/// index, one load and an add, not for the rule to be decoded. Return
/// addresses vary in their low bits; a multiplicative hash spread them
/// better but cost more on that chain than its conflicts saved. (Three
/// parallel arrays, before, saved the multiply but made a lookup read
/// three lines: on the churn 0.8 of its L1 misses per pair.)
pub struct RuleCache {
    entries: [RuleEntry; RULE_CACHE_ENTRIES],
    generation: Cell<u64>,
}

impl RuleCache {
    /// An empty cache (usable in a `const` thread-local initialiser).
    #[allow(clippy::declare_interior_mutable_const)]
    pub const fn new() -> Self {
        const E: RuleEntry = RuleEntry {
            key: Cell::new(0),
            rule: Cell::new(Rule::EMPTY),
            ra_offset: Cell::new(0),
        };
        RuleCache {
            entries: [E; RULE_CACHE_ENTRIES],
            generation: Cell::new(0),
        }
    }

    fn clear(&self) {
        for e in &self.entries {
            e.key.set(0);
        }
    }

    /// The rule for `key` (a return address, or an interrupted counter
    /// tagged with [`EXACT`]) and, for a [`K_RSP_RA8`] rule, the return
    /// address's offset from the stack pointer (loaded whatever the rule,
    /// so that load waits only for the key).
    #[inline(always)]
    fn rule(&self, key: u64) -> (Rule, u32) {
        let i = key as usize % RULE_CACHE_ENTRIES;
        let e = &self.entries[i];
        let (k, r, o) = (e.key.get(), e.rule.get(), e.ra_offset.get());
        if k == key {
            (r, o)
        } else {
            self.fill(i, key)
        }
    }

    /// A miss: computes the rule and caches it.
    #[cold]
    #[inline(never)]
    fn fill(&self, i: usize, key: u64) -> (Rule, u32) {
        let addr = if key & EXACT != 0 {
            key & !EXACT
        } else {
            key - 1
        };
        let Some(r) = rule_for(addr) else {
            // Not known right now (see `module_table`): the frame pointer
            // for this frame, and nothing cached.
            return (Rule::NO_CFI, 0);
        };
        let o = if r.kind() == K_RSP_RA8 {
            (r.0 >> 8) as u32 - 8
        } else {
            0
        };
        let e = &self.entries[i];
        e.key.set(key);
        e.rule.set(r);
        e.ra_offset.set(o);
        (r, o)
    }
}

impl Default for RuleCache {
    fn default() -> Self {
        Self::new()
    }
}

/// Fixed-size storage for gimli's unwind context: x86_64 CFI names at most
/// the 17 general registers and the return address, aarch64's at most the
/// 31 general registers and `d8`-`d15`; two rows cover
/// `DW_CFA_remember_state` as compilers emit it.
struct StoreOnStack;

/// Register rules one row may hold (see [`StoreOnStack`]).
const MAX_REGISTER_RULES: usize = if cfg!(target_arch = "aarch64") {
    40
} else {
    24
};

impl<T: gimli::ReaderOffset> UnwindContextStorage<T> for StoreOnStack {
    type Rules = [(Register, RegisterRule<T>); MAX_REGISTER_RULES];
    type Stack = [UnwindTableRow<T, Self>; 2];
}

type Slice = EndianSlice<'static, LittleEndian>;

/// `DW_OP_bregN` of the frame pointer (x86_64's `DW_OP_breg6`: rbp +
/// SLEB offset) and `DW_OP_deref`, as bytes.
const DW_OP_BREG_FP: u8 = gimli::DW_OP_breg0.0 + regs::FP.0 as u8;
const DW_OP_DEREF: u8 = gimli::DW_OP_deref.0;

/// `rbp + off` if `expr` is exactly `DW_OP_breg6 off` (and then, with
/// `deref`, `DW_OP_deref`): the forms GCC emits for frames that realign
/// their stack.
fn fp_breg_expression(expr: &[u8], deref: bool) -> Option<i64> {
    let (&op, rest) = expr.split_first()?;
    if op != DW_OP_BREG_FP {
        return None;
    }
    let mut r = EndianSlice::new(rest, LittleEndian);
    let off = gimli::leb128::read::signed(&mut r).ok()?;
    match (r.slice(), deref) {
        ([], false) => Some(off),
        ([DW_OP_DEREF], true) => Some(off),
        _ => None,
    }
}

/// The rule for program counter `addr`, computed from its module's CFI;
/// `None` when its module cannot be told right now (the answer must not
/// be cached). Cold: runs once per counter per thread (then the cache
/// answers).
#[cold]
#[inline(never)]
fn rule_for(addr: u64) -> Option<Rule> {
    let f = FIND_OBJECT.load(Ordering::Relaxed);
    if f == 0 {
        // glibc before 2.35: the agent's own module table.
        return match crate::module_table::find(addr as usize) {
            crate::module_table::Lookup::Found { end, hdr, .. } if hdr != 0 => {
                Some(rule_from_module(addr, hdr, end).unwrap_or(Rule::NO_CFI))
            }
            crate::module_table::Lookup::Transient => None,
            _ => Some(Rule::NO_CFI),
        };
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
        return Some(Rule::NO_CFI);
    };
    let hdr = dlfo.eh_frame as usize;
    let end = dlfo.map_end as usize;
    if hdr == 0 || end <= hdr {
        return Some(Rule::NO_CFI);
    }
    Some(rule_from_module(addr, hdr, end).unwrap_or(Rule::NO_CFI))
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
        // aarch64: the kernel's trampoline is not crossed (see K_SIGNAL).
        return Some(if cfg!(target_arch = "x86_64") {
            Rule::SIGNAL
        } else {
            Rule::STOP
        });
    }
    let mut ctx: UnwindContext<usize, StoreOnStack> = UnwindContext::new_in();
    let row = fde
        .unwind_info_for_address(&eh_frame, &bases, &mut ctx, addr)
        .ok()?;
    let ra_off = match row.register(regs::RA) {
        RegisterRule::Offset(o) => o,
        // The outermost frame (`_start`, a thread's start routine) marks
        // its return address undefined.
        _ => return Some(Rule::STOP),
    };
    let (rbp, rbp_off) = match row.register(regs::FP) {
        RegisterRule::Undefined | RegisterRule::SameValue => (RBP_SAME, 0),
        RegisterRule::Offset(o) => (RBP_AT_CFA, o),
        RegisterRule::Expression(e) => match e
            .get(&eh_frame)
            .ok()
            .and_then(|x| fp_breg_expression(x.0.slice(), false))
        {
            Some(o) => (RBP_AT_RBP, o),
            None => (RBP_UNKNOWN, 0),
        },
        _ => (RBP_UNKNOWN, 0),
    };
    let rule = match row.cfa() {
        CfaRule::RegisterAndOffset { register, offset } if *register == regs::SP => {
            Rule::new(K_CFA_RSP, rbp, *offset, ra_off, rbp_off)
        }
        CfaRule::RegisterAndOffset { register, offset } if *register == regs::FP => {
            if (*offset, ra_off, rbp, rbp_off) == (16, -8, RBP_AT_CFA, -16) {
                Rule::FP_FRAME
            } else {
                Rule::new(K_CFA_RBP, rbp, *offset, ra_off, rbp_off)
            }
        }
        CfaRule::Expression(e) => match e
            .get(&eh_frame)
            .ok()
            .and_then(|x| fp_breg_expression(x.0.slice(), true))
        {
            Some(o) => Rule::new(K_CFA_DEREF_RBP, rbp, o, ra_off, rbp_off),
            None => Rule::STOP,
        },
        _ => Rule::STOP,
    };
    Some(rule)
}

/// Offsets in the `ucontext_t` that a signal frame's stack pointer points
/// at (x86_64 Linux; aarch64 signal frames end the walk):
/// `uc_mcontext.gregs` starts at byte 40; `REG_RBP` is greg 10, `REG_RSP`
/// 15, `REG_RIP` 16.
#[cfg(target_arch = "x86_64")]
const UC_GREGS: usize = 40;
#[cfg(target_arch = "x86_64")]
const REG_RBP: usize = 10;
#[cfg(target_arch = "x86_64")]
const REG_RSP: usize = 15;
#[cfg(target_arch = "x86_64")]
const REG_RIP: usize = 16;

/// Registers of one frame while walking.
#[derive(Clone, Copy, Debug)]
struct Frame {
    /// Program counter: a return address, or (after a signal frame) the
    /// interrupted instruction tagged with [`EXACT`]: its rule is looked
    /// up at the counter itself, a return address's at the byte before it
    /// (the call instruction's last). Kept in one register with its tag:
    /// the loop is short of registers.
    pc: u64,
    /// Stack pointer in this frame: a multiple of 8 in `[sp, hi]` (the
    /// walk's bounds), strictly rising from frame to frame.
    sp: usize,
    /// `rbp` in this frame, 0 when unknown (0 is never a readable address,
    /// so every use of an unknown `rbp` fails its bounds check).
    rbp: usize,
}

/// Walks the stack from the frame of a hook built with frame pointers
/// (`fp`, the hook's frame pointer), writing return addresses into `out`
/// (at most [`MAX_FRAMES`] of them); returns how many were written and a
/// 64-bit hash of them (never 0), as [`crate::stack_capture::walk`] does.
/// `fallback_fp`: use the frame pointer where a counter has no CFI (mode
/// `auto`). `memo` holds an earlier walk of this thread: the walk takes
/// the frames it shares with it from there (see [`crate::stack_memo`]),
/// and records itself there when it shared little.
///
/// The caller guarantees `[sp, hi)` is this thread's live, mapped stack
/// (see [`crate::stack_capture::walkable`]); `sp` is the current stack
/// pointer. `cache` and `memo` are this thread's own.
///
/// The loop is shaped for the processor: the two common rules are stepped
/// inline, and the next frame's loads depend on the cached rule only
/// through a branch (predicted), so for frame-pointer frames the walk's
/// critical path is the same chain of loads as the frame-pointer walk's.
pub fn walk(
    fp: usize,
    sp: usize,
    hi: usize,
    out: &mut [u64],
    cache: &RuleCache,
    memos: &mut StackMemos,
    fallback_fp: bool,
) -> (usize, u64) {
    let t = walk_trace(fp, sp, hi, out, cache, memos, None, fallback_fp);
    (t.fill(out, memos), t.hash)
}

/// A finished walk whose outer frames may still be only in the memo: its
/// frame count and hash are known, and [`Trace::fill`] writes the frames
/// into `out` when they are needed (the caller's trace was not in its
/// stack cache). Most walks of a thread meet its memo and most traces are
/// in the cache: copying frames nobody reads cost ~30 instructions per
/// allocation (a `memcpy` call) on redis.
#[must_use]
pub struct Trace {
    /// Frames of the whole trace.
    pub frames: usize,
    /// Its hash (see [`walk`]).
    pub hash: u64,
    /// `(n, b, k)`: `out[n..frames]` are entry `b`'s frames and below in
    /// memo `k`, not written yet.
    unfilled: Option<(usize, usize, usize)>,
}

impl Trace {
    /// A trace whose frames are all in `out` already.
    pub fn whole((frames, hash): (usize, u64)) -> Trace {
        Trace {
            frames,
            hash,
            unfilled: None,
        }
    }

    /// Completes `out[..frames]` (from `memos`, which must be the walk's,
    /// not recorded over since) and returns `frames`.
    #[inline]
    pub fn fill(&self, out: &mut [u64], memos: &StackMemos) -> usize {
        if let Some((n, b, k)) = self.unfilled {
            let f = memos.memo(k).fill(out, n, b);
            debug_assert_eq!(f, self.frames);
        }
        self.frames
    }
}

/// The trace shortcut's answer (frame count and hash, see
/// `crate::trace_shortcut`) for the walk [`walk_trace`] would make from
/// the hook whose frame pointer is `fp` (same arguments), if the thread's
/// `shortcuts` hold it. x86_64 only: there the hook's caller's state is
/// two words at `fp`; on aarch64 it takes the hook's CFI (left to the
/// walk, which then keeps nothing there either).
#[inline(always)]
pub fn shortcut(fp: usize, sp: usize, hi: usize, shortcuts: &mut Shortcuts) -> Option<Answer> {
    if !SHORTCUT {
        return None;
    }
    // The same bounds and record as `walk_trace`'s start (a helper shared
    // by both measured +6 instructions per pair in callgrind, the
    // recording function's registers laid out otherwise).
    if hi < 16 || sp > hi - 16 || fp < sp || fp > hi - 16 || !fp.is_multiple_of(8) {
        return None;
    }
    let generation = GENERATION.load(Ordering::Relaxed);
    // SAFETY: `sp <= fp` and `fp + 16 <= hi`: both words lie in `[sp, hi)`,
    // the live part of this thread's own stack, mapped and readable (the
    // caller's guarantee). Volatile: nothing may be assumed of them.
    let (caller_rbp, ret) = unsafe {
        (
            std::ptr::read_volatile(fp as *const usize),
            std::ptr::read_volatile((fp + 8) as *const usize),
        )
    };
    // SAFETY: the caller's stack pointer `fp + 16` is in `[sp, hi]`, so
    // `[fp + 16, hi)` (`top = hi - 8`) is readable (as above).
    unsafe { shortcuts.answer(ret as u64, fp + 16, caller_rbp, hi - 8, generation) }
}

/// Whether walks keep and use the trace shortcut (see [`shortcut`]).
pub const SHORTCUT: bool = cfg!(target_arch = "x86_64");

/// [`walk`] without writing the frames taken from the memo (see
/// [`Trace`]). With `shortcuts` (the thread's), a walk that replays a memo
/// whole is kept there, for [`shortcut`] to answer the next walk from the
/// same start (`crate::trace_shortcut`).
#[allow(clippy::too_many_arguments)] // the walk's bounds and the thread's tables
pub fn walk_trace(
    fp: usize,
    sp: usize,
    hi: usize,
    out: &mut [u64],
    cache: &RuleCache,
    memos: &mut StackMemos,
    mut shortcuts: Option<&mut Shortcuts>,
    fallback_fp: bool,
) -> Trace {
    let h = TraceHash::new();
    let generation = GENERATION.load(Ordering::Relaxed);
    if cache.generation.get() != generation {
        cache.clear();
        cache.generation.set(generation);
    }
    // `top`: the highest address of a readable stack word.
    if hi < 16 || sp > hi - 16 || fp < sp || fp > hi - 16 || !fp.is_multiple_of(8) {
        return Trace::whole(h.finish(0));
    }
    let top = hi - 8;
    // SAFETY: `sp <= fp` and `fp + 16 <= hi`: both words lie in `[sp, hi)`,
    // the live part of this thread's own stack, mapped and readable (the
    // caller's guarantee). Volatile: nothing may be assumed of them.
    let (caller_rbp, ret) = unsafe {
        (
            std::ptr::read_volatile(fp as *const usize),
            std::ptr::read_volatile((fp + 8) as *const usize),
        )
    };
    // x86_64: the hook's frame record sits just below its caller's stack
    // pointer (the return address pushed by the call, then rbp).
    #[cfg(target_arch = "x86_64")]
    let f = Frame {
        pc: ret as u64,
        sp: fp + 16,
        rbp: caller_rbp,
    };
    // aarch64: where the record sits in the hook's frame is the compiler's
    // choice; the hook's CFI says where its caller's stack pointer is.
    #[cfg(target_arch = "aarch64")]
    let f = hook_caller(fp, sp, top, cache, fallback_fp).unwrap_or(Frame {
        pc: ret as u64,
        sp: fp + 16,
        rbp: caller_rbp,
    });
    let max = out.len().min(MAX_FRAMES);
    let mut visited = [const { std::mem::MaybeUninit::<Visited>::uninit() }; MEMO_ENTRIES];
    // Another memo of the thread may start at this very frame (see
    // `StackMemos`): the whole trace from there, before any step.
    if let Some((k, b)) = memos.other_start(f.pc, f.sp, f.rbp, top, generation) {
        let served = memos.memo(k).follow(b, &mut out[..max], 0, h, f.sp, top);
        if let Some((frames, hash, filled)) = served {
            memos.other_served(k);
            if let (Some(s), false) = (shortcuts.as_deref_mut().filter(|s| s.fill_due()), filled) {
                let classify = |rule| replay_step(Rule(rule), fallback_fp);
                keep_shortcut(
                    s,
                    memos.memo(k),
                    b,
                    &[],
                    f,
                    (top, generation),
                    (frames, hash),
                    classify,
                );
            }
            return Trace {
                frames,
                hash,
                unfilled: (!filled).then_some((0, b, k)),
            };
        }
    }
    let memo = memos.main();
    let memo_start = memo.start(top, generation);
    let walked = walk_from(
        f,
        sp,
        top,
        &mut out[..max],
        cache,
        fallback_fp,
        h,
        memo,
        memo_start,
        &mut visited,
    );
    // SAFETY: `walk_from` wrote `visited[..walked.visited]` (it says so).
    let visited =
        unsafe { std::slice::from_raw_parts(visited.as_ptr() as *const Visited, walked.visited) };
    let classify = |rule| replay_step(Rule(rule), fallback_fp);
    match walked.outcome {
        Outcome::Ended { end, frames, hash } => {
            memos.after_miss(visited, end, classify);
            Trace::whole(hash.finish(frames))
        }
        Outcome::Replayed {
            entry,
            rbp,
            replayed: (frames, hash, filled),
        } => {
            if let (Some(s), false) = (shortcuts.filter(|s| s.fill_due()), filled) {
                // Before `after_replay`, which may record over the memo.
                keep_shortcut(
                    s,
                    memos.memo(0),
                    entry,
                    visited,
                    f,
                    (top, generation),
                    (frames, hash),
                    classify,
                );
            }
            let mut unfilled = (!filled).then_some((visited.len(), entry, 0));
            if memos.refresh_due(visited.len()) {
                // The frames first: recording moves the main memo's entries.
                if let Some((n, b, k)) = unfilled.take() {
                    memos.memo(k).fill(out, n, b);
                }
            }
            // The memo need not be the newest walk, only one of this
            // thread's (a replay checks every word it relies on): the set
            // records this walk only when it had to step through a few
            // frames itself, and only now and then (see
            // `StackMemos::after_replay`).
            memos.after_replay(entry, rbp, visited, classify);
            Trace {
                frames,
                hash,
                unfilled,
            }
        }
    }
}

/// Keeps in the thread's trace shortcut (if due, see
/// [`Shortcuts::fill`]) a walk that started in state `start` with `top`
/// and rule generation (`at`), stepped through `visited` itself, then
/// replayed `memo` whole from entry `b`, finding `(frames, hash)`: the
/// words the replay checked, then those of its own steps.
#[allow(clippy::too_many_arguments)] // one walk's facts
#[inline(never)]
fn keep_shortcut(
    shortcuts: &mut Shortcuts,
    memo: &StackMemo,
    b: usize,
    visited: &[Visited],
    start: Frame,
    (top, generation): (usize, u64),
    (frames, hash): (usize, u64),
    classify: impl Fn(u64) -> Step,
) {
    // At most two words per step of its own (a return address, a saved
    // `rbp`): a walk that may depend on more is not kept, before any cost.
    if memo.replay_word_count(b) + 2 * visited.len() > SHORTCUT_WORDS {
        return;
    }
    let Some(mut fill) = shortcuts.fill(start.pc, start.sp, top, generation) else {
        return;
    };
    let (below_sp, needs_rbp) = memo.replay_words(b, &mut fill);
    let uses_rbp = fill.steps(visited, below_sp, needs_rbp, |v| (v.sp, classify(v.rule)));
    fill.finish(start.rbp, uses_rbp, frames, hash);
}

/// aarch64: the state of the hook's caller, from the hook's frame pointer
/// `fp`. The frame record chain from this function up leads to a record
/// whose saved frame pointer is `fp`: the return address beside it lies in
/// the hook, and the hook's CFI row there locates its CFA (the caller's
/// stack pointer, `x29`-based in code that keeps frame pointers, as the
/// agent does), the caller's `x29` and the return address. `None` when
/// the chain or the rule does not allow it. Every read lies in `[lo, top +
/// 8)`, `lo` being this function's own stack pointer: the readable stack,
/// the frames of the agent's calls under way below the walk's `sp`
/// included.
#[cfg(target_arch = "aarch64")]
#[inline(never)]
fn hook_caller(
    fp: usize,
    sp: usize,
    top: usize,
    cache: &RuleCache,
    fallback_fp: bool,
) -> Option<Frame> {
    let lo = crate::stack_capture::stack_pointer().min(sp);
    let read = |a: usize| -> Option<usize> {
        if a < lo || a > top || !a.is_multiple_of(8) {
            return None;
        }
        // SAFETY: `[a, a + 8)` lies in `[lo, top + 8)`: from this
        // function's own stack pointer up to the top of the live part of
        // this thread's stack (the caller's guarantee for `[sp, top + 8)`;
        // from `lo` to `sp` lie the frames of the calls under way).
        Some(unsafe { std::ptr::read_volatile(a as *const usize) })
    };
    let mut r = crate::stack_capture::frame_pointer();
    let mut in_hook = None;
    // A handful of the agent's frames lie between here and the hook.
    for _ in 0..32 {
        // Records below the hook's, rising towards it.
        if r >= fp || r.checked_add(16)? > fp {
            return None;
        }
        let next = read(r)?;
        if next == fp {
            in_hook = Some(read(r + 8)?);
            break;
        }
        if next <= r {
            return None;
        }
        r = next;
    }
    let in_hook = in_hook? as u64;
    if !is_return_address(in_hook) {
        return None;
    }
    let (rule, _) = cache.rule(in_hook);
    // The hook's stack pointer is at least the end of the record found
    // (its callee's CFA is at or above it).
    let f = Frame {
        pc: in_hook,
        sp: r + 16,
        rbp: fp,
    };
    match rule.kind() {
        K_FP_FRAME | K_CFA_RBP => step_other(rule, f, sp, top, fallback_fp),
        _ => None,
    }
}

/// How the memo replays a step by `rule` (see [`Step`]).
#[inline(always)]
fn replay_step(rule: Rule, fallback_fp: bool) -> Step {
    // Tested in order of frequency (an if-chain predicts better here than
    // the jump table a `match` becomes).
    let kind = rule.kind();
    if kind == K_RSP_RA8 {
        Step::Rsp {
            rbp_off: rule.rbp_off(),
        }
    } else if kind == K_FP_FRAME || (kind == K_NO_CFI && fallback_fp) {
        Step::FramePointer
    } else if kind == K_STOP || kind == K_NO_CFI {
        Step::End
    } else {
        Step::Other
    }
}

/// What [`walk_from`] did: it wrote the states it stepped through itself
/// into `visited[..visited]`, and ended as `outcome` says.
struct Walked {
    visited: usize,
    outcome: Outcome,
}

/// How [`walk_from`] ended.
enum Outcome {
    /// By itself, after writing `frames` frames hashed into `hash`.
    Ended {
        end: End,
        frames: usize,
        hash: TraceHash,
    },
    /// By taking the rest from memo entry `entry`, met with `rbp`: the
    /// finished `(frames, hash, filled)` of [`StackMemo::follow`].
    Replayed {
        entry: usize,
        rbp: usize,
        replayed: (usize, u64, bool),
    },
}

/// The walk's loop, from the hook's caller's frame `f` (see [`walk`]).
/// Every read lies in `[f.sp, top + 8)` for the frame being stepped, and
/// `[sp, top + 8)` is the caller's readable stack. Writes each state it
/// visits into `visited`, and stops stepping as soon as the memo can tell
/// the rest (candidates below `p`).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn walk_from(
    mut f: Frame,
    sp: usize,
    top: usize,
    out: &mut [u64],
    cache: &RuleCache,
    fallback_fp: bool,
    mut h: TraceHash,
    memo: &StackMemo,
    mut p: usize,
    visited: &mut [std::mem::MaybeUninit<Visited>; MEMO_ENTRIES],
) -> Walked {
    let mut n = 0;
    let end = 'walk: loop {
        // Walk until the memo may tell the rest (`break b`) or the walk ends.
        let b = loop {
            if n == out.len() {
                break 'walk End::Limit;
            }
            let pc = f.pc & !EXACT;
            if !is_return_address(pc) {
                visited[n].write(Visited {
                    pc: f.pc,
                    sp: f.sp,
                    rbp: f.rbp,
                    rule: 0,
                });
                return Walked {
                    visited: n + 1,
                    outcome: Outcome::Ended {
                        end: End::BadCounter,
                        frames: n,
                        hash: h,
                    },
                };
            }
            if let Some(b) = memo.candidate(&mut p, f.pc, f.sp, f.rbp) {
                break b;
            }
            out[n] = pc;
            h.add(pc);
            let (rule, ra_offset) = cache.rule(f.pc);
            visited[n].write(Visited {
                pc: f.pc,
                sp: f.sp,
                rbp: f.rbp,
                rule: rule.0,
            });
            n += 1;
            if rule == Rule::FP_FRAME {
                let rbp = f.rbp;
                if rbp < f.sp || rbp > top - 8 || !rbp.is_multiple_of(8) {
                    break 'walk End::Stepped;
                }
                // SAFETY: `f.sp <= rbp` and `rbp + 16 <= top + 8`: both
                // words lie in the readable stack (see above).
                let (next_rbp, ra) = unsafe {
                    (
                        std::ptr::read_volatile(rbp as *const usize),
                        std::ptr::read_volatile((rbp + 8) as *const usize),
                    )
                };
                // The new sp, rbp + 16, is above f.sp and at most top + 8.
                f = Frame {
                    pc: ra as u64,
                    sp: rbp + 16,
                    rbp: next_rbp,
                };
            } else if rule.kind() == K_RSP_RA8 {
                // The canonical form (see K_RSP_RA8): the CFA offset is
                // positive and a multiple of 8; the return address lies 8
                // below the CFA, `ra_offset` above the stack pointer.
                let at = f.sp + ra_offset as usize;
                if at > top {
                    break 'walk End::Stepped;
                }
                // SAFETY: `f.sp <= at <= top`: the word lies in the
                // readable stack; aligned since `f.sp` and the offset are
                // multiples of 8.
                let ra = unsafe { std::ptr::read_volatile(at as *const usize) };
                let cfa = at + 8;
                let rbp_off = rule.rbp_off();
                let rbp = if rbp_off == 0 {
                    f.rbp
                } else {
                    // SAFETY: `-rbp_off` is a multiple of 8 in `[16,
                    // offset]`, so `cfa + rbp_off` lies in `[f.sp, cfa -
                    // 16]`.
                    unsafe {
                        std::ptr::read_volatile(
                            cfa.wrapping_add_signed(rbp_off as isize) as *const usize
                        )
                    }
                };
                f = Frame {
                    pc: ra as u64,
                    sp: cfa,
                    rbp,
                };
            } else {
                match step_other(rule, f, sp, top, fallback_fp) {
                    Some(next) => f = next,
                    None => break 'walk End::Stepped,
                }
            }
        };
        if let Some(replayed) = memo.follow(b, out, n, h, f.sp, top) {
            return Walked {
                visited: n,
                outcome: Outcome::Replayed {
                    entry: b,
                    rbp: f.rbp,
                    replayed,
                },
            };
        }
        // A word below changed: walk on, and record this walk instead.
        p = 0;
    };
    Walked {
        visited: n,
        outcome: Outcome::Ended {
            end,
            frames: n,
            hash: h,
        },
    }
}

/// One step by any rule but the two the loop takes inline: a general CFI
/// rule, a signal frame, or (mode `auto`) the frame pointer where there is
/// no CFI. `None` ends the walk. The new frame's stack pointer is checked
/// to rise, to stay within the stack and to be a multiple of 8.
#[inline(never)]
fn step_other(rule: Rule, f: Frame, sp: usize, top: usize, fallback_fp: bool) -> Option<Frame> {
    // Reads the stack word at `a` if it lies in `[lo, top + 8)` (`lo >= sp`).
    let read = |a: usize, lo: usize| -> Option<usize> {
        if a < lo || a < sp || a > top || !a.is_multiple_of(8) {
            return None;
        }
        // SAFETY: `[a, a + 8)` lies inside `[sp, top + 8)`, the live part of
        // this thread's own stack, mapped and readable (the caller's
        // guarantee). Volatile: nothing may be assumed of it.
        Some(unsafe { std::ptr::read_volatile(a as *const usize) })
    };
    let known = |rbp: usize| (rbp != 0).then_some(rbp);
    let next = match rule.kind() {
        K_CFA_RSP | K_CFA_RBP | K_CFA_DEREF_RBP => {
            let cfa = match rule.kind() {
                K_CFA_RSP => f.sp.checked_add_signed(rule.cfa_off() as isize)?,
                K_CFA_RBP => known(f.rbp)?.checked_add_signed(rule.cfa_off() as isize)?,
                _ => read(
                    known(f.rbp)?.checked_add_signed(rule.cfa_off() as isize)?,
                    sp,
                )?,
            };
            let ra = read(cfa.checked_add_signed(rule.ra_off() as isize)?, f.sp)?;
            let rbp = match rule.rbp_where() {
                RBP_SAME => Some(f.rbp),
                RBP_AT_CFA => read(cfa.checked_add_signed(rule.rbp_off() as isize)?, f.sp),
                RBP_AT_RBP => read(
                    known(f.rbp)?.checked_add_signed(rule.rbp_off() as isize)?,
                    f.sp,
                ),
                _ => None,
            };
            Frame {
                pc: ra as u64,
                sp: cfa,
                rbp: rbp.unwrap_or(0),
            }
        }
        #[cfg(target_arch = "x86_64")]
        K_SIGNAL => {
            let uc = f.sp + UC_GREGS;
            Frame {
                pc: read(uc + REG_RIP * 8, f.sp)? as u64 | EXACT,
                sp: read(uc + REG_RSP * 8, f.sp)?,
                rbp: read(uc + REG_RBP * 8, f.sp)?,
            }
        }
        K_FP_FRAME | K_NO_CFI if rule.kind() == K_FP_FRAME || fallback_fp => {
            let rbp = known(f.rbp)?;
            Frame {
                pc: read(rbp.checked_add(8)?, f.sp)? as u64,
                sp: rbp + 16,
                rbp: read(rbp, f.sp)?,
            }
        }
        _ => return None,
    };
    // The stack pointer must rise: the walk cannot loop, and it ends
    // within the stack.
    (next.sp > f.sp && next.sp <= top + 8 && next.sp.is_multiple_of(8)).then_some(next)
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
    fn rsp_rules_of_the_canonical_shape_take_the_inline_step() {
        let r = Rule::new(K_CFA_RSP, RBP_SAME, 56, -8, 0);
        assert_eq!((r.kind(), r.0 >> 8, r.rbp_off()), (K_RSP_RA8, 56, 0));
        let r = Rule::new(K_CFA_RSP, RBP_AT_CFA, 48, -8, -16);
        assert_eq!(
            (r.kind(), (r.0 >> 8) as u32, r.rbp_off()),
            (K_RSP_RA8, 48, -16)
        );
        // Anything the inline step could not bound stays general.
        for (rbp, cfa, ra, rbp_off) in [
            (RBP_SAME, 4, -8, 0),      // offset below 8
            (RBP_SAME, 20, -8, 0),     // not a multiple of 8
            (RBP_SAME, 16, -16, 0),    // return address elsewhere
            (RBP_AT_CFA, 16, -8, -24), // saved rbp below the stack pointer
            (RBP_AT_CFA, 32, -8, -8),  // saved rbp in the return address
            (RBP_AT_RBP, 32, -8, -16), // rbp-relative
        ] {
            assert_eq!(
                Rule::new(K_CFA_RSP, rbp, cfa, ra, rbp_off).kind(),
                K_CFA_RSP
            );
        }
    }

    #[test]
    #[cfg(target_arch = "x86_64")]
    fn gcc_realignment_expressions_are_recognised() {
        // DW_OP_breg6 -8; DW_OP_deref
        assert_eq!(fp_breg_expression(&[0x76, 0x78, 0x06], true), Some(-8));
        assert_eq!(fp_breg_expression(&[0x76, 0x78], false), Some(-8));
        assert_eq!(fp_breg_expression(&[0x76, 0x00], false), Some(0));
        assert_eq!(fp_breg_expression(&[0x77, 0x78, 0x06], true), None);
        assert_eq!(fp_breg_expression(&[0x76, 0x78, 0x06, 0x06], true), None);
        assert_eq!(fp_breg_expression(&[], true), None);
    }

    #[inline(never)]
    fn recurse(n: u32, out: &mut [u64], cache: &RuleCache, fallback: bool) -> usize {
        recurse_with(n, out, cache, &mut StackMemos::new(), fallback).0
    }

    /// Walks at the bottom of a recursion `n` deep, with `memo`.
    #[inline(never)]
    fn recurse_with(
        n: u32,
        out: &mut [u64],
        cache: &RuleCache,
        memo: &mut StackMemos,
        fallback: bool,
    ) -> (usize, u64) {
        if n == 0 {
            let sp = crate::stack_capture::stack_pointer();
            let hi = crate::stack_capture::thread_stack_top(sp).unwrap();
            walk(
                crate::stack_capture::caller_frame(),
                sp,
                hi,
                out,
                cache,
                memo,
                fallback,
            )
        } else {
            std::hint::black_box(recurse_with(n - 1, out, cache, memo, fallback))
        }
    }

    #[test]
    fn walks_that_reuse_the_previous_walk_equal_fresh_walks() {
        assert!(init(false));
        let cache = RuleCache::new();
        let mut memo = Box::new(StackMemos::new());
        // Depths that share the outer frames with the walk before them in
        // every way: deeper, shallower, equal, and past the frame limit
        // (the memo then reaches the limit before its end).
        for depth in [20, 20, 10, 30, 15, 15, 70, 60, 70, 5, 20] {
            // One call site for both walks, so their outer frames are the
            // same (an opaque slice: a release build would unroll a loop
            // over a literal array into two call sites).
            let mut walks = Vec::new();
            for &kept in std::hint::black_box(&[true, false][..]) {
                let mut fresh = Box::new(StackMemos::new());
                let m = if kept { &mut *memo } else { &mut *fresh };
                let mut out = [0u64; MAX_FRAMES];
                let (n, h) = recurse_with(depth, &mut out, &cache, m, true);
                walks.push((out[..n].to_vec(), h));
            }
            assert_eq!(walks[0], walks[1], "depth {depth}");
            assert!(
                walks[0].0.len() > depth.min(60) as usize,
                "depth {depth}: {} frames",
                walks[0].0.len()
            );
        }
        // The hash is the frame-by-frame one.
        let mut out = [0u64; MAX_FRAMES];
        let (n, h) = recurse_with(12, &mut out, &cache, &mut memo, true);
        let mut by_frame = TraceHash::new();
        for &pc in &out[..n] {
            by_frame.add(pc);
        }
        assert_eq!(by_frame.finish(n), (n, h));
    }

    /// At the bottom of a recursion `n` deep: the trace shortcut's answer
    /// (if any), then the walk (keeping it in `shortcuts` when the
    /// shortcut did not answer, as `recorder::stack_key` does).
    #[inline(never)]
    fn shortcut_then_walk(
        n: u32,
        cache: &RuleCache,
        memo: &mut StackMemos,
        shortcuts: &mut Shortcuts,
    ) -> (Option<(usize, u64)>, (usize, u64)) {
        if n == 0 {
            let sp = crate::stack_capture::stack_pointer();
            let hi = crate::stack_capture::thread_stack_top(sp).unwrap();
            let fp = crate::stack_capture::caller_frame();
            let answer = shortcut(fp, sp, hi, shortcuts).map(|a| (a.frames, a.hash));
            let keep = answer.is_none().then_some(shortcuts);
            let mut out = [0u64; MAX_FRAMES];
            let t = walk_trace(fp, sp, hi, &mut out, cache, memo, keep, true);
            (answer, (t.frames, t.hash))
        } else {
            std::hint::black_box(shortcut_then_walk(n - 1, cache, memo, shortcuts))
        }
    }

    #[test]
    fn the_trace_shortcut_answers_repeated_walks_with_what_the_walk_finds() {
        assert!(init(false));
        let cache = RuleCache::new();
        let mut memo = Box::new(StackMemos::new());
        let mut shortcuts = Box::new(Shortcuts::new());
        let mut answered = 0;
        // One call site; depths that repeat and alternate (each depth is
        // its own start state: the recursion's frames differ in `sp`).
        for depth in [1, 1, 1, 1, 4, 4, 4, 1, 4, 1, 2, 2, 2, 2, 1] {
            let (answer, walked) = shortcut_then_walk(
                std::hint::black_box(depth),
                &cache,
                &mut memo,
                &mut shortcuts,
            );
            if let Some(a) = answer {
                assert_eq!(a, walked, "depth {depth}");
                answered += 1;
            }
        }
        if SHORTCUT {
            // Kept after the first replay of each depth, answered after.
            assert!(answered >= 7, "{answered} answers");
        } else {
            assert_eq!(answered, 0);
        }
    }

    #[test]
    fn cfi_walk_sees_the_recursion_and_its_callers_and_repeats_exactly() {
        assert!(init(false), "_dl_find_object is present in glibc >= 2.35");
        let cache = RuleCache::new();
        let mut runs = Vec::new();
        // One call site, so every run walks the same frames: the first
        // fills the cache, the second answers from it, the third comes
        // after a (simulated) dlclose emptied it, with the FP fallback on.
        // (Opaque values: a release build would otherwise unroll or peel
        // the loop into several call sites.)
        for run in 0..std::hint::black_box(3) {
            let after_dlclose = std::hint::black_box(run) == 2;
            if after_dlclose {
                module_unloaded();
            }
            let mut out = [0u64; 64];
            let n = recurse(20, &mut out, &cache, after_dlclose);
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

    #[test]
    fn the_module_table_finds_the_same_rules_as_dl_find_object() {
        let _one_at_a_time = crate::module_table::TEST_LOCK
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        assert!(init(false), "_dl_find_object is present in glibc >= 2.35");
        assert!(crate::module_table::init());
        let f = FIND_OBJECT.load(Ordering::Relaxed);
        // Counters in this test binary, in libc, and in the loader.
        let mut pcs = vec![
            the_module_table_finds_the_same_rules_as_dl_find_object as *const () as usize + 4,
            recurse as *const () as usize + 8,
            libc::malloc as *const () as usize + 16,
            libc::qsort as *const () as usize + 12,
            libc::dlsym as *const () as usize + 4,
        ];
        let mut out = [0u64; 64];
        let n = recurse(5, &mut out, &RuleCache::new(), false);
        pcs.extend(out[..n].iter().map(|&pc| pc as usize - 1));
        let mut compared = 0;
        for pc in pcs {
            // SAFETY: as in `rule_for`.
            let dlfo = unsafe {
                let find: unsafe extern "C" fn(*mut c_void, *mut DlFindObject) -> libc::c_int =
                    std::mem::transmute(f);
                let mut dlfo: DlFindObject = std::mem::zeroed();
                (find(pc as *mut c_void, &mut dlfo) == 0).then_some(dlfo)
            }
            .expect("every counter here is in a loaded module");
            let crate::module_table::Lookup::Found { start, end, hdr } =
                crate::module_table::find(pc)
            else {
                panic!("{pc:#x} not in the module table");
            };
            // The same module and CFI; the table's end is the end of the
            // highest segment in memory (`.bss` included), which glibc's
            // `map_end` may stop short of for the main program.
            assert_eq!(
                (start, hdr),
                (dlfo.map_start as usize, dlfo.eh_frame as usize),
                "{pc:#x}"
            );
            assert!(end >= dlfo.map_end as usize && pc < end, "{pc:#x}");
            compared += 1;
        }
        assert!(compared >= 8);
    }

    #[test]
    #[cfg(target_arch = "aarch64")]
    fn the_hooks_caller_is_found_through_the_hooks_own_cfi() {
        assert!(init(false), "_dl_find_object is present in glibc >= 2.35");
        #[inline(never)]
        fn inner(fp: usize, sp: usize, top: usize, cache: &RuleCache) -> Option<Frame> {
            std::hint::black_box(hook_caller(fp, sp, top, cache, true))
        }
        /// Plays the hook: its frame record, and the walk called below it.
        #[inline(never)]
        fn hook(cache: &RuleCache) -> (Option<Frame>, usize, usize, usize) {
            let fp = crate::stack_capture::frame_pointer();
            let sp = crate::stack_capture::stack_pointer();
            let hi = crate::stack_capture::thread_stack_top(sp).expect("stack top");
            let f = inner(fp, sp, hi - 8, cache);
            // SAFETY: this function's own frame record, two words at `fp`.
            let (saved, ret) = unsafe { (*(fp as *const usize), *((fp + 8) as *const usize)) };
            (f, fp, saved, ret)
        }
        let (f, fp, saved, ret) = hook(&RuleCache::new());
        let f = f.expect("the hook's caller found through its CFI");
        assert_eq!((f.pc, f.rbp), (ret as u64, saved));
        assert!(f.sp >= fp + 16, "{:#x} {fp:#x}", f.sp);
    }
}
