//! Frame-pointer stack capture, bounded by the current thread's stack.
//!
//! Invariants:
//! - Only addresses inside `[sp, hi)` are read, where `hi` is the top of
//!   the current thread's stack, and only when the caller has established
//!   that `sp` is on that stack (not on a signal alternate stack), so the
//!   whole range is mapped for as long as the thread runs: a broken or
//!   hostile frame chain can end the walk early but never fault.
//! - Each next frame pointer must be strictly above the previous one and
//!   8-aligned, so the walk ends in at most `(hi - sp) / 16` steps, and it
//!   stops at `max` frames anyway.
//! - A return address outside `[MIN_RETURN_ADDRESS, MAX_RETURN_ADDRESS)`
//!   ends the walk and is not reported: no code is mapped there, so the
//!   chain has run into a function without frame pointers (glibc's, say)
//!   whose frame-pointer register held data.
//! - The walk starts at the frame pointer of the agent's hook, so the first
//!   address reported is the return address into the hook's caller: the
//!   agent's own frames are never part of the trace.
//! - Finding `hi` never allocates and never takes a lock: glibc's
//!   `pthread_getattr_np` does both (it calls `realloc` and `fopen` while
//!   holding the thread's lock), so calling it from inside `malloc` can
//!   deadlock; it is not used.

/// Stacks deeper than this are checked with `sigaltstack(2)` before being
/// walked (a deep `sp` may be a signal alternate stack).
pub const FAST_WINDOW: usize = 256 << 10;

/// Largest distance between `sp` and a stack top that is believed.
const MAX_STACK: usize = 1 << 30;

extern "C" {
    /// Set by the dynamic linker: the stack pointer at process entry, just
    /// below the main thread's arguments and environment.
    static __libc_stack_end: *const libc::c_void;
}

/// Reads the current frame pointer register.
#[inline(always)]
pub fn frame_pointer() -> usize {
    let fp: usize;
    // SAFETY: reading a register has no side effects.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        core::arch::asm!("mov {}, rbp", out(reg) fp, options(nomem, nostack, preserves_flags));
        #[cfg(target_arch = "aarch64")]
        core::arch::asm!("mov {}, x29", out(reg) fp, options(nomem, nostack, preserves_flags));
    }
    fp
}

/// The frame pointer of the function that calls this one: where a hook's
/// stack walk starts, so that none of the hook's own frames are reported.
///
/// Use this rather than [`frame_pointer`] in a hook. Inline assembly that
/// reads `rbp` runs wherever the compiler puts it, and an optimising
/// compiler may sink a function's prologue below the read (shrink
/// wrapping, as LLVM did to a hook whose fast path makes no call): the
/// read then gives the *caller's* frame, and the walk loses the hook's
/// call site. A call cannot run before the caller's prologue (it needs the
/// caller's frame), and this function has no prologue of its own (it is
/// naked), so the value it returns is always the caller's frame.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
pub extern "C" fn caller_frame() -> usize {
    // Returns the caller's rbp untouched: no frame of its own, no stack
    // use, no memory access.
    core::arch::naked_asm!("mov rax, rbp", "ret")
}

/// See the x86_64 version.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
pub extern "C" fn caller_frame() -> usize {
    core::arch::naked_asm!("mov x0, x29", "ret")
}

/// The frame pointer of the function that called the caller of this one
/// (the saved `rbp` in the caller's frame). For a hook's slow path: an
/// `#[inline(never)]` function that the hook's entry point calls with an
/// ordinary call, never a tail call (the entry point uses the result
/// after the call), gets the entry point's frame, whether or not the
/// entry point's fast path has a frame of its own. See [`caller_frame`]
/// for why a call is needed.
#[cfg(target_arch = "x86_64")]
#[unsafe(naked)]
pub extern "C" fn caller_parent_frame() -> usize {
    // The caller has run its prologue (it is making a call), so its rbp
    // points at the saved rbp of its own caller: a word of the stack that
    // is live for as long as the caller runs.
    core::arch::naked_asm!("mov rax, qword ptr [rbp]", "ret")
}

/// See the x86_64 version.
#[cfg(target_arch = "aarch64")]
#[unsafe(naked)]
pub extern "C" fn caller_parent_frame() -> usize {
    core::arch::naked_asm!("ldr x0, [x29]", "ret")
}

/// Reads the current stack pointer.
#[inline(always)]
pub fn stack_pointer() -> usize {
    let sp: usize;
    // SAFETY: reading a register has no side effects.
    unsafe {
        #[cfg(target_arch = "x86_64")]
        core::arch::asm!("mov {}, rsp", out(reg) sp, options(nomem, nostack, preserves_flags));
        #[cfg(target_arch = "aarch64")]
        core::arch::asm!("mov {}, sp", out(reg) sp, options(nomem, nostack, preserves_flags));
    }
    sp
}

/// Top of the calling thread's stack, seen from stack pointer `sp`, or
/// `None` if it cannot be told safely. Never allocates or locks.
///
/// glibc places a thread's descriptor (what `pthread_self` returns) at the
/// top of the thread's stack block, above its static TLS, for every thread
/// it creates (also with a user-supplied stack), so `[sp, pthread_self())`
/// is stack. The initial thread's descriptor lives elsewhere; its stack
/// ends at `__libc_stack_end`.
pub fn thread_stack_top(sp: usize) -> Option<usize> {
    // SAFETY: pthread_self has no preconditions.
    let tcb = unsafe { libc::pthread_self() } as usize;
    if tcb > sp && tcb - sp < MAX_STACK {
        return Some(tcb);
    }
    // SAFETY: reading a pointer-sized static the dynamic linker set before
    // any code of ours ran.
    let end = unsafe { __libc_stack_end } as usize;
    if end > sp && end - sp < MAX_STACK {
        return Some(end);
    }
    None
}

/// True when the thread runs on its signal alternate stack right now (one
/// system call; used only for deep stack pointers).
pub fn on_alternate_stack() -> bool {
    // SAFETY: sigaltstack with a null new stack only reads the current one
    // into `ss`, a valid out-pointer.
    unsafe {
        let mut ss: libc::stack_t = std::mem::zeroed();
        if libc::sigaltstack(std::ptr::null(), &mut ss) != 0 {
            return true; // cannot tell: do not walk
        }
        ss.ss_flags & libc::SS_ONSTACK != 0
    }
}

/// Reads this function's return address through its frame pointer, if the
/// frame pointer lies in `[sp, hi - 16]` (else `None`). Not inlined, and
/// not a leaf (it calls `keep_non_leaf`), so a build with frame pointers,
/// even "non-leaf" ones, gives it a frame record.
#[inline(never)]
fn return_address_via_frame_pointer(hi: usize) -> Option<usize> {
    let fp = frame_pointer();
    let sp = stack_pointer();
    let ret = (sp <= fp && fp.is_multiple_of(8) && hi >= 16 && fp <= hi - 16).then(|| {
        // SAFETY: [fp, fp + 16) lies in [sp, hi), the live part of this
        // thread's stack (the caller found `hi` for it).
        unsafe { std::ptr::read_volatile((fp + 8) as *const usize) }
    });
    keep_non_leaf();
    ret
}

#[inline(never)]
fn keep_non_leaf() {
    std::hint::black_box(());
}

/// Whether this build keeps frame pointers, which the hooks need: each
/// hook reads its own frame pointer, and without one it would read its
/// caller's (traces would lose their innermost frames) or a stray value.
/// Cargo drops the workspace's `-C force-frame-pointers=yes` when
/// `RUSTFLAGS` is set. `None` when the stack cannot be told safely.
#[inline(never)]
pub fn frame_pointers_kept() -> Option<bool> {
    let hi = thread_stack_top(stack_pointer())?;
    let ret = return_address_via_frame_pointer(hi);
    // With frame pointers, the return address is in this function's body.
    let here = frame_pointers_kept as *const () as usize;
    Some(ret.is_some_and(|r| r > here && r - here < 4096))
}

/// Whether a walk from `sp` up to `hi` stays on mapped stack.
#[inline]
pub fn walkable(sp: usize, hi: usize) -> bool {
    hi > sp && (hi - sp <= FAST_WINDOW || (hi - sp < MAX_STACK && !on_alternate_stack()))
}

/// Lowest return address believed: Linux maps nothing below
/// `vm.mmap_min_addr` (64 KiB by default), so smaller values are data.
pub const MIN_RETURN_ADDRESS: usize = 0x1_0000;
/// Highest return address believed (exclusive): user space ends below 2^56
/// even with 5-level page tables.
pub const MAX_RETURN_ADDRESS: usize = 1 << 56;

/// Whether `pc` is a believable return address (one compare for both
/// bounds, 0 included).
#[inline(always)]
pub fn is_return_address(pc: u64) -> bool {
    (pc as usize).wrapping_sub(MIN_RETURN_ADDRESS) < MAX_RETURN_ADDRESS - MIN_RETURN_ADDRESS
}

/// The 64-bit hash of a trace that both walkers compute frame by frame,
/// finalised with the frame count: the agent's per-thread stack cache
/// takes equal hashes as equal traces.
///
/// A polynomial over the frames' mixed addresses, outermost frame last:
/// `H = c * P^n + sum over i of mix(pc_i) * P^(n - 1 - i)`, computed
/// innermost first as `h = h * P + mix(pc)`. Its chain is a multiply and
/// an add per frame (`mix` is off it), which runs in the shadow of the
/// walk's loads; and a trace's outer part contributes a sum that does not
/// depend on the frames above it, so a walk that reuses the outer part of
/// an earlier walk (see `stack_memo`) finishes the hash with one
/// multiply-add ([`TraceHash::then`]). `mix` is a bijection (an odd
/// multiply, then an xor-shift), so traces that differ in one frame never
/// collide; the xor-shift makes the sum non-linear in the addresses.
#[derive(Clone, Copy, Debug)]
pub struct TraceHash(u64);

impl TraceHash {
    /// The polynomial's base (odd).
    pub const P: u64 = 0x9e37_79b9_7f4a_7c15;
    const K: u64 = 0xff51_afd7_ed55_8ccd;

    /// The hash of no frame yet.
    #[inline(always)]
    pub fn new() -> Self {
        TraceHash(0xc2b2_ae3d_27d4_eb4f)
    }

    /// One frame's return address, mixed.
    #[inline(always)]
    pub fn mix(ret: u64) -> u64 {
        let x = ret.wrapping_mul(Self::K);
        x ^ (x >> 32)
    }

    /// Mixes in the next frame's return address.
    #[inline(always)]
    pub fn add(&mut self, ret: u64) {
        self.0 = self.0.wrapping_mul(Self::P).wrapping_add(Self::mix(ret));
    }

    /// Mixes in `k` more frames at once, given `pow = P^k` and `sum`, the
    /// frames' own hash from 0 (what `k` calls of [`TraceHash::add`] would
    /// add to a hash that was 0).
    #[inline(always)]
    pub fn then(self, pow: u64, sum: u64) -> Self {
        TraceHash(self.0.wrapping_mul(pow).wrapping_add(sum))
    }

    /// `(n, hash)` of a trace of `n` frames; the hash is never 0.
    #[inline(always)]
    pub fn finish(self, n: usize) -> (usize, u64) {
        let h = (self.0 ^ n as u64).wrapping_mul(Self::K);
        (n, (h ^ (h >> 29)) | 1)
    }
}

impl Default for TraceHash {
    fn default() -> Self {
        Self::new()
    }
}

/// Walks the frame chain from `fp`, writing return addresses into `out`;
/// returns how many were written and a 64-bit hash of them (never 0).
///
/// The caller guarantees `[sp, hi)` is this thread's live, mapped stack
/// (see [`walkable`]); `sp` is the current stack pointer. The hash
/// ([`TraceHash`]) is computed in the same loop.
#[inline]
pub fn walk(fp: usize, sp: usize, hi: usize, out: &mut [u64]) -> (usize, u64) {
    let mut h = TraceHash::new();
    if hi < sp + 16 || fp < sp {
        return h.finish(0);
    }
    let limit = hi - 16;
    let mut fp = fp;
    let mut n = 0;
    // Loop invariant: sp <= fp (frame pointers only increase).
    while n < out.len() {
        if !fp.is_multiple_of(8) || fp > limit {
            break;
        }
        // SAFETY: sp <= fp and fp + 16 <= hi, so fp..fp+16 lies inside
        // [sp, hi), the live part of this thread's own stack, which the
        // caller guarantees is mapped and readable. Volatile: the compiler
        // must not assume anything about these words.
        let (next, ret) = unsafe {
            (
                std::ptr::read_volatile(fp as *const usize),
                std::ptr::read_volatile((fp + 8) as *const usize),
            )
        };
        if !is_return_address(ret as u64) {
            break;
        }
        out[n] = ret as u64;
        h.add(ret as u64);
        n += 1;
        if next <= fp {
            break;
        }
        fp = next;
    }
    h.finish(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn depth(n: u32, out: &mut [u64]) -> usize {
        if n == 0 {
            let sp = stack_pointer();
            let hi = thread_stack_top(sp).expect("stack top");
            assert!(walkable(sp, hi));
            walk(frame_pointer(), sp, hi, out).0
        } else {
            let r = depth(n - 1, out);
            std::hint::black_box(r)
        }
    }

    #[test]
    fn a_trace_hash_continued_by_a_sum_equals_the_frame_by_frame_hash() {
        let frames: Vec<u64> = (0..20).map(|i| 0x5555_0000 + i * 0x1234).collect();
        let mut whole = TraceHash::new();
        for &f in &frames {
            whole.add(f);
        }
        for split in 0..=frames.len() {
            let mut head = TraceHash::new();
            for &f in &frames[..split] {
                head.add(f);
            }
            let mut tail = TraceHash(0);
            for &f in &frames[split..] {
                tail.add(f);
            }
            let pow = (split..frames.len()).fold(1u64, |p, _| p.wrapping_mul(TraceHash::P));
            assert_eq!(head.then(pow, tail.0).finish(20), whole.finish(20));
        }
        // Traces differing in one frame never collide.
        let mut other = TraceHash::new();
        for (i, &f) in frames.iter().enumerate() {
            other.add(if i == 7 { f + 1 } else { f });
        }
        assert_ne!(other.finish(20), whole.finish(20));
    }

    #[test]
    fn this_build_keeps_frame_pointers() {
        assert_eq!(frame_pointers_kept(), Some(true));
        std::thread::spawn(|| assert_eq!(frame_pointers_kept(), Some(true)))
            .join()
            .unwrap();
    }

    #[test]
    fn stack_top_found_on_main_and_spawned_threads() {
        let main_top = thread_stack_top(stack_pointer());
        assert!(main_top.is_some());
        std::thread::spawn(|| {
            let sp = stack_pointer();
            let hi = thread_stack_top(sp).unwrap();
            assert!(hi > sp && hi - sp < 16 << 20);
            assert!(!on_alternate_stack());
        })
        .join()
        .unwrap();
    }

    #[test]
    fn walk_sees_recursive_frames_and_respects_the_limit() {
        let mut out = [0u64; 64];
        let n = depth(20, &mut out);
        assert!(n >= 20, "only {n} frames");
        // The recursion's return addresses repeat.
        let same = out[1..20].windows(2).filter(|w| w[0] == w[1]).count();
        assert!(same >= 15, "{:x?}", &out[..n]);
        let mut small = [0u64; 5];
        assert_eq!(depth(20, &mut small), 5);
    }

    #[test]
    fn walk_is_repeatable_and_its_hash_separates_depths() {
        let mut a = [0u64; 64];
        let mut b = [0u64; 64];
        let sp = stack_pointer();
        let hi = thread_stack_top(sp).unwrap();
        let fp = frame_pointer();
        let (n, h) = walk(fp, sp, hi, &mut a);
        assert_eq!(walk(fp, sp, hi, &mut b), (n, h));
        assert_eq!(a[..n], b[..n]);
        let (n2, h2) = walk(fp, sp, hi, &mut a[..n - 1]);
        assert_eq!(n2, n - 1);
        assert_ne!(h, h2);
        assert_ne!(h, 0);
    }

    #[test]
    fn a_return_address_where_no_code_can_be_ends_the_walk() {
        // Frame records laid out by hand, on this stack: [next, ret] pairs.
        let mut recs = [0usize; 8];
        let base = recs.as_ptr() as usize;
        let mut walk_with = |second_ret: usize| {
            recs[0] = base + 16; // -> record 1
            recs[1] = 0x5555_0000_1000;
            recs[2] = base + 32; // -> record 2
            recs[3] = second_ret;
            recs[4] = 0; // ends the chain (next below)
            recs[5] = 0x5555_0000_3000;
            let recs = std::hint::black_box(&recs);
            let sp = stack_pointer();
            let hi = thread_stack_top(sp).unwrap();
            let mut out = [0u64; 8];
            let n = walk(recs.as_ptr() as usize, sp, hi, &mut out).0;
            out[..n].to_vec()
        };
        assert_eq!(
            walk_with(0x5555_0000_2000),
            [0x5555_0000_1000, 0x5555_0000_2000, 0x5555_0000_3000]
        );
        for garbage in [
            0,
            0x78,
            MIN_RETURN_ADDRESS - 1,
            MAX_RETURN_ADDRESS,
            usize::MAX,
        ] {
            assert_eq!(walk_with(garbage), [0x5555_0000_1000], "{garbage:#x}");
        }
    }

    #[test]
    fn broken_chain_stops_without_faulting() {
        let sp = stack_pointer();
        let hi = thread_stack_top(sp).unwrap();
        let mut out = [0u64; 8];
        assert_eq!(walk(0, sp, hi, &mut out).0, 0);
        assert_eq!(walk(usize::MAX - 4, sp, hi, &mut out).0, 0);
        assert_eq!(walk(sp + 3, sp, hi, &mut out).0, 0);
        // An empty range: nothing is read.
        assert_eq!(walk(sp, sp, sp, &mut out).0, 0);
    }
}
