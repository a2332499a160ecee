//! Frame-pointer stack capture, bounded by the current thread's stack.
//!
//! Invariants:
//! - Only addresses inside `[sp, stack_hi)` of the *current* thread are
//!   read, and only when `sp` itself lies inside the thread's known stack
//!   `[stack_lo, stack_hi)` (not on a signal alternate stack). That range
//!   is mapped for as long as the thread runs, so a broken or hostile
//!   frame chain can end the walk early but never fault.
//! - Each next frame pointer must be strictly above the previous one and
//!   8-aligned, so the walk ends in at most `(stack_hi - sp) / 16` steps,
//!   and it stops at `max` frames anyway.
//! - The walk starts at the frame pointer of the agent's hook, so the first
//!   address reported is the return address into the hook's caller: the
//!   agent's own frames are never part of the trace.

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

/// Bounds of the calling thread's stack, from `pthread_getattr_np`.
/// May allocate (glibc reads `/proc/self/maps` for the main thread): call
/// it with the agent's re-entrancy guard held.
pub fn current_thread_stack() -> Option<(usize, usize)> {
    // SAFETY: `attr` is initialised by pthread_getattr_np before use and
    // destroyed after; the out-pointers are valid locals.
    unsafe {
        let mut attr: libc::pthread_attr_t = std::mem::zeroed();
        if libc::pthread_getattr_np(libc::pthread_self(), &mut attr) != 0 {
            return None;
        }
        let mut addr: *mut libc::c_void = std::ptr::null_mut();
        let mut size: libc::size_t = 0;
        let rc = libc::pthread_attr_getstack(&attr, &mut addr, &mut size);
        libc::pthread_attr_destroy(&mut attr);
        if rc != 0 || addr.is_null() || size == 0 {
            return None;
        }
        let lo = addr as usize;
        Some((lo, lo.checked_add(size)?))
    }
}

/// Walks the frame chain from `fp`, writing return addresses into `out`;
/// returns how many were written.
///
/// `stack` is the thread's `[lo, hi)`; `sp` the current stack pointer.
#[inline]
pub fn walk(fp: usize, sp: usize, stack: (usize, usize), out: &mut [u64]) -> usize {
    let (lo, hi) = stack;
    if sp < lo || sp >= hi || hi < 16 {
        // On a signal alternate stack or an unknown stack: reading above sp
        // could leave mapped memory, so record no frames.
        return 0;
    }
    let limit = hi - 16;
    let mut fp = fp;
    if fp < sp {
        return 0;
    }
    let mut n = 0;
    // Loop invariant: sp <= fp (frame pointers only increase).
    while n < out.len() {
        if !fp.is_multiple_of(8) || fp > limit {
            break;
        }
        // SAFETY: sp <= fp and fp + 16 <= hi, so fp..fp+16 lies inside
        // [sp, hi), the live part of this thread's own stack, which is
        // mapped and readable. Volatile: the compiler must not assume
        // anything about these words.
        let (next, ret) = unsafe {
            (
                std::ptr::read_volatile(fp as *const usize),
                std::ptr::read_volatile((fp + 8) as *const usize),
            )
        };
        if ret == 0 {
            break;
        }
        out[n] = ret as u64;
        n += 1;
        if next <= fp {
            break;
        }
        fp = next;
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    #[inline(never)]
    fn depth(n: u32, out: &mut [u64]) -> usize {
        if n == 0 {
            let stack = current_thread_stack().expect("stack bounds");
            walk(frame_pointer(), stack_pointer(), stack, out)
        } else {
            let r = depth(n - 1, out);
            std::hint::black_box(r)
        }
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
    fn broken_chain_stops_without_faulting() {
        let stack = current_thread_stack().unwrap();
        let sp = stack_pointer();
        let mut out = [0u64; 8];
        assert_eq!(walk(0, sp, stack, &mut out), 0);
        assert_eq!(walk(usize::MAX - 4, sp, stack, &mut out), 0);
        assert_eq!(walk(sp + 3, sp, stack, &mut out), 0);
        // sp outside the stack: nothing is read.
        assert_eq!(walk(sp, 8, stack, &mut out), 0);
    }
}
