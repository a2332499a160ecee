//! The open-descriptor limit of heapdump's long-running commands.
//!
//! A collector (`watch --all`) keeps each watched process's regions, pidfd
//! and root directory open until the process exits and its final snapshot
//! is written, and `serve` holds a descriptor per connection. The soft
//! limit a service gets is commonly 1 024 while its hard limit is far
//! higher (systemd: 524 288); like Go's runtime, these commands raise the
//! soft limit to the hard one. `run` does not: the program it starts
//! would inherit it.
//!
//! Invariant: only the soft limit changes, and never down.

/// Most the soft limit is raised to (a million descriptors is far past
/// what a host's instrumented processes need).
pub const MOST: u64 = 1 << 20;

/// `RLIMIT_NOFILE`, if it can be read.
fn limits() -> Option<libc::rlimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one `rlimit` through the pointer given, a
    // valid local.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim)
}

/// The soft `RLIMIT_NOFILE` in force (1 024 if it cannot be read).
pub fn current() -> u64 {
    limits().map_or(1024, |l| l.rlim_cur)
}

/// Raises the soft `RLIMIT_NOFILE` to the hard limit (at most [`MOST`]);
/// returns the soft limit in force after.
pub fn raise() -> u64 {
    let Some(lim) = limits() else {
        return 1024;
    };
    let want = lim.rlim_max.min(MOST);
    if want > lim.rlim_cur {
        let raised = libc::rlimit {
            rlim_cur: want,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: setrlimit reads one `rlimit` through the pointer given,
        // a valid local; a soft limit up to the hard one needs no
        // privilege.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            return want;
        }
    }
    lim.rlim_cur
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_soft_limit_is_raised_to_the_hard_one_and_never_lowered() {
        let before = super::limits().unwrap();
        let now = super::raise();
        assert!(now >= before.rlim_cur);
        assert_eq!(now, before.rlim_max.min(super::MOST).max(before.rlim_cur));
        assert_eq!(super::current(), now);
    }
}
