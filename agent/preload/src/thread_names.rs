//! `pthread_setname_np` and `prctl`, interposed only to learn that a thread
//! was renamed, so the blocks it allocates next carry its new name (a
//! daemon typically names its threads just after they start, after their
//! first allocations).
//!
//! Invariants:
//! - Each call is forwarded unchanged to the next definition (glibc's),
//!   bound once with `dlsym(RTLD_NEXT)`, and its result returned as is; the
//!   agent is told after the call returns (`recorder::thread_renamed`).
//! - `prctl` is variadic in C; glibc's reads four further `unsigned long`
//!   arguments whatever the option, and on x86_64 and aarch64 (Linux) a
//!   variadic integer argument is passed exactly like a named one, so
//!   declaring and forwarding four `c_ulong`s is the same call.

use std::ffi::{c_char, c_int, c_ulong, CStr};
use std::sync::atomic::{AtomicUsize, Ordering};

use heapdump_agent::recorder::thread_renamed;

/// Looks `name` up after this library once; Relaxed suffices (a code
/// address of a loaded library publishes no data; two threads racing
/// store the same value).
fn next(slot: &AtomicUsize, name: &CStr) -> usize {
    let f = slot.load(Ordering::Relaxed);
    if f != 0 {
        return f;
    }
    // SAFETY: dlsym with RTLD_NEXT and a NUL-terminated name.
    let f = unsafe { libc::dlsym(libc::RTLD_NEXT, name.as_ptr()) } as usize;
    slot.store(f, Ordering::Relaxed);
    f
}

static SETNAME: AtomicUsize = AtomicUsize::new(0);
static PRCTL: AtomicUsize = AtomicUsize::new(0);

/// Binds both now (from the library's constructor), so the agent's own
/// `prctl(PR_GET_NAME)` inside a hook never looks a name up.
pub fn bind() {
    next(&SETNAME, c"pthread_setname_np");
    next(&PRCTL, c"prctl");
}

/// `pthread_setname_np(3)`.
#[no_mangle]
pub unsafe extern "C" fn pthread_setname_np(thread: libc::pthread_t, name: *const c_char) -> c_int {
    let f = next(&SETNAME, c"pthread_setname_np");
    if f == 0 {
        return libc::ENOSYS;
    }
    // SAFETY: glibc's pthread_setname_np, of this signature.
    let f: unsafe extern "C" fn(libc::pthread_t, *const c_char) -> c_int =
        unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded with the caller's arguments.
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
    let f = next(&PRCTL, c"prctl");
    if f == 0 {
        // SAFETY: the raw system call takes the same five arguments.
        return unsafe { libc::syscall(libc::SYS_prctl, option, a2, a3, a4, a5) } as c_int;
    }
    // SAFETY: glibc's prctl, called with the same five register arguments
    // (see the module doc).
    let f: unsafe extern "C" fn(c_int, c_ulong, c_ulong, c_ulong, c_ulong) -> c_int =
        unsafe { std::mem::transmute(f) };
    // SAFETY: forwarded with the caller's arguments.
    let r = unsafe { f(option, a2, a3, a4, a5) };
    if option == libc::PR_SET_NAME && r == 0 {
        thread_renamed();
    }
    r
}
