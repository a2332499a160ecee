//! Thread-local words that the allocation hooks reach in two instructions,
//! without a call.
//!
//! Rust's `thread_local!` in a shared library (the preload agent is one)
//! uses the general-dynamic TLS model: every access calls
//! `__tls_get_addr`, about a dozen instructions and a call on each hook.
//! Stable Rust cannot ask for another model, so the words the hottest
//! path needs are declared here in assembly, in `.tbss`, and reached by
//! the initial-exec model: the thread pointer (`%fs:0`) plus the word's
//! offset, which the dynamic loader writes into the GOT once at load time.
//!
//! Invariants:
//! - A word lives as long as its thread's static TLS block: from the
//!   thread's first instruction to its last, destructors included. It
//!   needs no lazy initialisation (it starts at 0) and no destructor.
//! - Only with the `initial-exec-tls` feature, which the preload library
//!   (loaded at start through `LD_PRELOAD`) turns on. The initial-exec
//!   model marks the whole library `STATIC_TLS`: all its thread-local
//!   storage (the agent's per-thread state, a few hundred bytes; its large
//!   tables live outside TLS, see `thread_tables`) must then sit in the
//!   static TLS block, which a library loaded at start does and a
//!   `dlopen`ed one cannot (glibc refuses it: "cannot allocate memory in
//!   static TLS block"). Without the feature (the Rust `Agent`, in an
//!   executable whose thread-locals are reached directly anyway, or in a
//!   library that may be `dlopen`ed) the word is a `thread_local!`.
//! - The symbols are hidden: not exported, never interposed.

/// This thread's sampled-mode countdown (bytes to the next sample; see
/// `sampling`), as a raw pointer valid for the calling thread's lifetime.
/// Starts at 0.
#[inline(always)]
pub fn sample_countdown() -> *mut i64 {
    imp::sample_countdown()
}

/// A word for the address of this thread's agent state (see
/// `thread_state::with`), valid for the calling thread's lifetime and
/// starting at 0; `None` without initial-exec TLS (the state is then
/// reached directly, and a word in a `thread_local!` would only add a
/// second access). A constant per build: the check compiles away.
#[inline(always)]
pub fn thread_state_slot() -> Option<*mut usize> {
    imp::thread_state_slot()
}

#[cfg(all(
    feature = "initial-exec-tls",
    target_arch = "x86_64",
    target_os = "linux"
))]
mod imp {
    /// Declares an 8-byte word in the thread-local BSS, global (so the
    /// inline assembly in any object file of the crate can name it) but
    /// hidden, and a function giving its address on the calling thread.
    macro_rules! initial_exec_word {
        ($fn_name:ident, $symbol:literal, $ty:ty) => {
            std::arch::global_asm!(
                ".pushsection .tbss,\"awT\",@nobits",
                ".p2align 3",
                concat!(".globl ", $symbol),
                concat!(".hidden ", $symbol),
                concat!(".type ", $symbol, ", @object"),
                concat!(".size ", $symbol, ", 8"),
                concat!($symbol, ":"),
                ".zero 8",
                ".popsection",
            );

            #[inline(always)]
            fn $fn_name() -> *mut $ty {
                let p: usize;
                // SAFETY: the initial-exec sequence: %fs:0 holds the thread
                // pointer (x86_64 TLS ABI), and the GOT entry the
                // `@GOTTPOFF` relocation names holds the word's offset from
                // it, filled in by the loader before any code of this
                // object runs. It reads no Rust memory and writes only `p`
                // (and the flags `add` sets).
                unsafe {
                    std::arch::asm!(
                        "mov {p}, qword ptr fs:[0]",
                        concat!("add {p}, qword ptr [rip + ", $symbol, "@GOTTPOFF]"),
                        p = out(reg) p,
                        options(pure, nomem, nostack),
                    );
                }
                p as *mut $ty
            }
        };
    }

    initial_exec_word!(countdown_word, "heapdump_agent_sample_countdown", i64);
    initial_exec_word!(thread_state_word, "heapdump_agent_thread_state", usize);

    #[inline(always)]
    pub fn sample_countdown() -> *mut i64 {
        countdown_word()
    }

    #[inline(always)]
    pub fn thread_state_slot() -> Option<*mut usize> {
        Some(thread_state_word())
    }
}

#[cfg(not(all(
    feature = "initial-exec-tls",
    target_arch = "x86_64",
    target_os = "linux"
)))]
mod imp {
    use std::cell::Cell;

    thread_local! {
        static COUNTDOWN: Cell<i64> = const { Cell::new(0) };
    }

    #[inline(always)]
    pub fn sample_countdown() -> *mut i64 {
        COUNTDOWN.with(|c| c.as_ptr())
    }

    #[inline(always)]
    pub fn thread_state_slot() -> Option<*mut usize> {
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn each_thread_has_its_own_word_starting_at_zero() {
        let p = sample_countdown();
        // SAFETY: this thread's word, valid while the thread lives.
        unsafe {
            assert_eq!(*p, 0);
            *p = 42;
        }
        let other = std::thread::spawn(|| {
            let q = sample_countdown();
            // SAFETY: as above, for the spawned thread.
            let v = unsafe { *q };
            (q as usize, v)
        })
        .join()
        .unwrap();
        assert_ne!(other.0, p as usize);
        assert_eq!(other.1, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { *p }, 42);
        assert_eq!(sample_countdown(), p);
    }

    #[test]
    fn the_thread_state_word_is_per_thread_and_starts_at_zero() {
        let Some(p) = thread_state_slot() else {
            return; // no initial-exec TLS in this build: nothing to test
        };
        // SAFETY: this thread's word, valid while the thread lives. (Put
        // back at the end: `thread_state::with` on this thread reads it.)
        let kept = unsafe { std::ptr::replace(p, 0x1234) };
        let other = std::thread::spawn(|| {
            let q = thread_state_slot().unwrap();
            // SAFETY: as above, for the spawned thread.
            (q as usize, unsafe { *q })
        })
        .join()
        .unwrap();
        assert_ne!(other.0, p as usize);
        assert_eq!(other.1, 0);
        // SAFETY: as above.
        assert_eq!(unsafe { *p }, 0x1234);
        assert_ne!(p as usize, sample_countdown() as usize);
        // SAFETY: as above.
        unsafe { *p = kept };
    }
}
