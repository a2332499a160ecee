//! The snapshot-request signal.
//!
//! Invariants:
//! - The handler is installed only if the program has none for that
//!   signal (disposition `SIG_DFL`); an existing handler or `SIG_IGN` is
//!   never replaced, and the agent says so once on stderr.
//! - The handler is async-signal-safe: it reads a clock and bumps atomic
//!   counters in the header, and preserves `errno`.

extern "C" fn on_signal(_sig: libc::c_int) {
    // SAFETY: __errno_location returns this thread's errno slot.
    let saved = unsafe { *libc::__errno_location() };
    crate::recorder::request_snapshot_from_signal();
    // SAFETY: as above.
    unsafe { *libc::__errno_location() = saved };
}

/// Installs the handler for `sig` (0 = none) unless the program has one.
pub(crate) fn install(sig: libc::c_int, quiet: bool) {
    if sig <= 0 {
        return;
    }
    // SAFETY: sigaction with a null new action only reads the current one
    // into `old`, a valid out-pointer; the second call installs a handler
    // that is an `extern "C" fn(c_int)` as SA_RESTART (no SA_SIGINFO).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(sig, std::ptr::null(), &mut old) != 0 {
            return;
        }
        if old.sa_sigaction != libc::SIG_DFL {
            if !quiet {
                let msg = b"heapdump: the program handles the snapshot signal itself; not installing heapdump's handler (set HEAPDUMP_SIGNAL to another signal)\n";
                libc::write(2, msg.as_ptr().cast(), msg.len());
            }
            return;
        }
        let mut act: libc::sigaction = std::mem::zeroed();
        act.sa_sigaction = on_signal as extern "C" fn(libc::c_int) as usize;
        act.sa_flags = libc::SA_RESTART;
        libc::sigemptyset(&mut act.sa_mask);
        libc::sigaction(sig, &act, std::ptr::null_mut());
    }
}
