//! `pthread_setname_np` and `prctl`, interposed only to learn that a thread
//! was renamed, so the blocks it allocates next carry its new name (a
//! daemon typically names its threads just after they start, after their
//! first allocations), and, through `prctl(PR_SET_SECCOMP)`, that the
//! program sandboxes itself (`recorder::sandboxed`: recording stops
//! before the filter applies).
//!
//! Invariants:
//! - Each call is forwarded unchanged to the next definition (glibc's,
//!   bound with the others in `next_allocator`), its result returned as
//!   is; the agent is told after the call returns
//!   (`recorder::thread_renamed`).
//! - `prctl` is variadic in C; glibc's reads four further `unsigned long`
//!   arguments whatever the option, and on x86_64 and aarch64 (Linux) a
//!   variadic integer argument is passed exactly like a named one, so
//!   declaring and forwarding four `c_ulong`s is the same call.

use std::ffi::{c_char, c_int, c_ulong};

use heapdump_agent::recorder::thread_renamed;

use crate::next_allocator as next;

/// `pthread_setname_np(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_setname_np(thread: libc::pthread_t, name: *const c_char) -> c_int {
    let Some(f) = next::pthread_setname_np() else {
        return libc::ENOSYS;
    };
    // SAFETY: glibc's pthread_setname_np, forwarded with the caller's
    // arguments.
    let r = unsafe { f(thread, name) };
    if r == 0 {
        thread_renamed();
    }
    r
}

/// `prctl(2)`.
#[no_mangle]
pub unsafe extern "C" fn prctl(
    option: c_int,
    a2: c_ulong,
    a3: c_ulong,
    a4: c_ulong,
    a5: c_ulong,
) -> c_int {
    if option == libc::PR_SET_SECCOMP {
        // Before the filter applies to the agent's own calls.
        heapdump_agent::recorder::sandboxed();
    }
    let r = match next::prctl() {
        // SAFETY: glibc's prctl, called with the same five register
        // arguments (see the module doc).
        Some(f) => unsafe { f(option, a2, a3, a4, a5) },
        // SAFETY: the raw system call takes the same five arguments.
        None => (unsafe { libc::syscall(libc::SYS_prctl, option, a2, a3, a4, a5) }) as c_int,
    };
    if option == libc::PR_SET_NAME && r == 0 {
        thread_renamed();
    }
    r
}
