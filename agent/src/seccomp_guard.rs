//! Seccomp filters installed after the agent started.
//!
//! The agent creates its regions (`memfd_create`, `ftruncate`, `fcntl`
//! seals, `mmap`) when it starts, and again in every child the process
//! forks (a child must never write into its parent's regions). A program
//! may install a seccomp filter in between (a sandbox set up after start,
//! then workers forked): if that filter kills on a call the agent makes,
//! the child dies in the agent's fork handler, before its own code runs
//! (found with a program that forbids `memfd_create` and forks: its child
//! was killed by SIGSYS under the agent, and ran bare).
//!
//! So the agent remembers how many filters the thread that created the
//! regions ran under (`Seccomp_filters:` of `/proc/thread-self/status`,
//! Linux 5.9+; before that, the `Seccomp:` mode), and a fork child under
//! any other count records nothing: a filter that was there when the
//! regions were made let those calls through, a newer one may not. The
//! check itself opens and reads a `/proc` file, which a filter may
//! forbid too (those calls are far more often allowed than the agent's
//! own). A child that cannot read it (a daemon that chrooted away from
//! `/proc`) is recorded as before: only a count seen to differ stops it.
//!
//! Invariants: no allocation (the fork handler and the agent's start run
//! inside `malloc`); a fixed 4 KiB stack buffer; every failure reads as
//! "unknown".

use std::sync::atomic::{AtomicU64, Ordering};

/// Filters seen when the regions were made; [`UNKNOWN`] before that or
/// when the kernel did not say.
static AT_START: AtomicU64 = AtomicU64::new(UNKNOWN);

const UNKNOWN: u64 = u64::MAX;

/// The calling thread's seccomp filter count (or, before Linux 5.9, its
/// seccomp mode), `None` when it cannot be read. Never inlined: its 4 KiB
/// buffer must not grow the frame of a caller on the allocation path (a
/// frame past a page takes a stack probe at every call).
#[cold]
#[inline(never)]
pub fn filters_now() -> Option<u64> {
    let mut buf = [0u8; 4096];
    let n = crate::small_file::read_into(c"/proc/thread-self/status", &mut buf)?;
    parse_status(&buf[..n])
}

/// `Seccomp_filters:` from a status file's text, else `Seccomp:`.
fn parse_status(text: &[u8]) -> Option<u64> {
    status_number(text, b"Seccomp_filters:").or_else(|| status_number(text, b"Seccomp:"))
}

/// The number on the line of a `/proc` status file's `text` that starts
/// with `name` (`Threads:`), if there is one.
pub fn status_number(text: &[u8], name: &[u8]) -> Option<u64> {
    text.split(|&b| b == b'\n').find_map(|line| {
        let v = line.strip_prefix(name)?;
        let v = v.trim_ascii();
        if v.is_empty() || !v.iter().all(u8::is_ascii_digit) || v.len() > 18 {
            return None;
        }
        Some(v.iter().fold(0u64, |a, d| a * 10 + u64::from(d - b'0')))
    })
}

/// Notes the filters the regions were made under (call once they are).
#[cold]
#[inline(never)]
pub fn note_start() {
    AT_START.store(filters_now().unwrap_or(UNKNOWN), Ordering::Relaxed);
}

/// In a fork child: false when the child is seen to run under other
/// filters than the regions were made under (making its own may then be
/// refused, or punished); true otherwise, also when either count could
/// not be read (as before this check existed).
#[cold]
#[inline(never)]
pub fn same_as_start() -> bool {
    same_as_start_in(filters_now())
}

/// [`same_as_start`] from the count `now` read from the calling thread's
/// status (by [`status_number`], for a caller that reads it anyway).
pub fn same_as_start_in(now: Option<u64>) -> bool {
    let start = AT_START.load(Ordering::Relaxed);
    match now {
        Some(now) => now == start || start == UNKNOWN,
        None => true,
    }
}

/// The seccomp count in a status file's `text`, as [`filters_now`] reads
/// it.
pub fn filters_in(text: &[u8]) -> Option<u64> {
    parse_status(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_filter_count_is_read_from_the_status_text() {
        let s = b"Name:\tx\nSeccomp:\t2\nSeccomp_filters:\t3\nSpeculation_Store_Bypass:\tx\n";
        assert_eq!(parse_status(s), Some(3));
        // Before Linux 5.9: the mode.
        assert_eq!(parse_status(b"Name:\tx\nSeccomp:\t0\n"), Some(0));
        assert_eq!(parse_status(b"Name:\tx\n"), None);
        assert_eq!(parse_status(b"Seccomp_filters:\tlots\n"), None);
    }

    #[test]
    fn this_threads_filter_count_is_what_its_status_file_says() {
        let text = std::fs::read("/proc/thread-self/status").unwrap();
        assert!(parse_status(&text).is_some(), "no Seccomp line");
        assert_eq!(filters_now(), parse_status(&text));
    }
}
