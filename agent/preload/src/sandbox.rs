//! `syscall(3)`, interposed only to see the program install a seccomp
//! filter through it (libseccomp's `seccomp_load` does): the agent stops recording *before* the filter
//! applies (`recorder::sandboxed`), so no later call of the agent's
//! (naming threads, mapping their tables, a child's regions) can meet a
//! filter that kills on it. `prctl(PR_SET_SECCOMP)` is seen the same way
//! in `thread_names`.
//!
//! Invariants:
//! - Every call is forwarded unchanged to the next definition (glibc's),
//!   its result and `errno` returned as they are; while that definition is
//!   not bound yet (the agent's start, on another thread), the system call
//!   is made directly, with glibc's convention for the result (-1 and
//!   `errno` on an error).
//! - `syscall` is variadic in C; glibc's reads six further `long`
//!   arguments whatever the number, and on x86_64 and aarch64 (Linux) a
//!   variadic integer argument is passed exactly like a named one (on
//!   x86_64 the sixth on the stack, where a seventh named one is), so
//!   declaring and forwarding six `c_long`s is the same call.
//! - Only the preloaded agent exports it: `heapdump attach` does not
//!   redirect `syscall` (it refuses a process under seccomp instead).

use std::ffi::c_long;

use crate::next_allocator as next;

/// `SECCOMP_SET_MODE_STRICT` and `SECCOMP_SET_MODE_FILTER` of
/// `<linux/seccomp.h>`: the operations of `seccomp(2)` that install one.
const SECCOMP_SET_MODE_STRICT: c_long = 0;
const SECCOMP_SET_MODE_FILTER: c_long = 1;

/// Whether `syscall(number, a1, ...)` installs a seccomp filter or enters
/// strict mode.
fn installs_seccomp(number: c_long, a1: c_long) -> bool {
    number == libc::SYS_seccomp && (a1 == SECCOMP_SET_MODE_STRICT || a1 == SECCOMP_SET_MODE_FILTER)
        || number == libc::SYS_prctl && a1 == libc::PR_SET_SECCOMP as c_long
}

/// `syscall(3)`.
#[no_mangle]
pub unsafe extern "C" fn syscall(
    number: c_long,
    a1: c_long,
    a2: c_long,
    a3: c_long,
    a4: c_long,
    a5: c_long,
    a6: c_long,
) -> c_long {
    if installs_seccomp(number, a1) {
        // Before the filter applies to the agent's own calls.
        heapdump_agent::recorder::sandboxed();
    }
    match next::syscall() {
        // SAFETY: glibc's syscall, called with the same seven arguments
        // (see the module doc).
        Some(f) => unsafe { f(number, a1, a2, a3, a4, a5, a6) },
        // SAFETY: the raw system call with the caller's arguments.
        None => unsafe { raw_syscall(number, [a1, a2, a3, a4, a5, a6]) },
    }
}

/// The system call itself, with `syscall(3)`'s convention for the result.
///
/// # Safety
/// As for the system call `number` with these arguments.
unsafe fn raw_syscall(number: c_long, a: [c_long; 6]) -> c_long {
    let ret: c_long;
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the Linux x86_64 system call convention: number in rax,
    // arguments in rdi, rsi, rdx, r10, r8, r9; rcx and r11 are clobbered;
    // the caller vouches for the call itself.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") number => ret,
            in("rdi") a[0], in("rsi") a[1], in("rdx") a[2],
            in("r10") a[3], in("r8") a[4], in("r9") a[5],
            lateout("rcx") _, lateout("r11") _,
            options(nostack),
        );
    }
    #[cfg(target_arch = "aarch64")]
    // SAFETY: the Linux aarch64 system call convention: number in x8,
    // arguments in x0-x5, the result in x0; the caller vouches for the
    // call itself.
    unsafe {
        std::arch::asm!(
            "svc 0",
            in("x8") number,
            inlateout("x0") a[0] => ret,
            in("x1") a[1], in("x2") a[2], in("x3") a[3], in("x4") a[4], in("x5") a[5],
            options(nostack),
        );
    }
    if (-4095..0).contains(&ret) {
        // SAFETY: errno is this thread's own variable.
        unsafe { *libc::__errno_location() = (-ret) as i32 };
        return -1;
    }
    ret
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_calls_that_install_a_filter_or_strict_mode_are_seen() {
        assert!(installs_seccomp(libc::SYS_seccomp, SECCOMP_SET_MODE_FILTER));
        assert!(installs_seccomp(libc::SYS_seccomp, SECCOMP_SET_MODE_STRICT));
        assert!(installs_seccomp(
            libc::SYS_prctl,
            libc::PR_SET_SECCOMP as c_long
        ));
        // libseccomp's probes (SECCOMP_GET_ACTION_AVAIL = 2, ...) and
        // anything else.
        assert!(!installs_seccomp(libc::SYS_seccomp, 2));
        assert!(!installs_seccomp(
            libc::SYS_prctl,
            libc::PR_SET_NAME as c_long
        ));
        assert!(!installs_seccomp(libc::SYS_gettid, 0));
    }

    #[test]
    fn the_raw_call_keeps_syscalls_convention() {
        // SAFETY: getpid and close(-1) have no preconditions.
        unsafe {
            assert_eq!(
                raw_syscall(libc::SYS_getpid, [0; 6]),
                libc::getpid() as c_long
            );
            assert_eq!(raw_syscall(libc::SYS_close, [-1, 0, 0, 0, 0, 0]), -1);
            assert_eq!(*libc::__errno_location(), libc::EBADF);
        }
    }
}
