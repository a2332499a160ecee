//! Knowing that this process is a fork child however it was made, so that
//! it never writes into its parent's regions.
//!
//! `fork()` runs the atfork handlers, where the recorder lets go of the
//! parent's regions (`recorder::after_fork_child`). A child made without
//! them does not: glibc's `_Fork`, the raw `fork` or `clone` system call
//! (container runtimes, some spawners and sandboxes make children so).
//! Such a child kept writing into its parent's regions: its frees of the
//! blocks it inherited took the parent's live records out, and its own
//! blocks showed in the parent's snapshots (`tests/c/raw_fork.c`).
//!
//! The guard is one word in a private anonymous page the kernel zeroes
//! in every child, however it is made (`MADV_WIPEONFORK`, Linux 4.14):
//! [`arm`] sets it when a process's regions are made, and the recorder
//! asks [`forked`] each time it is about to use its regions
//! (`recorder::writers`: a load and a compare). A child that was not told
//! reads 0, lets go of its parent's regions and makes its own, as the
//! atfork handler does.
//!
//! Invariants:
//! - [`WORD`] always points to a readable word: the guard page once
//!   [`arm`] made it, else [`UNGUARDED`], which is never 0 (a kernel
//!   without `MADV_WIPEONFORK`, or a failed `mmap`: no child is detected
//!   this way, as before the guard).
//! - The word is stored (Release) after the regions' writers and before
//!   READY; [`forked`] loads it with Acquire, so a thread that reads it set
//!   also sees the writers stored before it (a fork child's thread that
//!   read the parent's READY sees its own child's writers, or 0).
//! - The page is never unmapped (a thread may be reading the word).

use std::sync::atomic::{AtomicPtr, AtomicU64, Ordering};

/// The word when no guard page could be made: never 0.
static UNGUARDED: AtomicU64 = AtomicU64::new(1);

/// The guard word (see the module doc).
static WORD: AtomicPtr<AtomicU64> =
    AtomicPtr::new(&UNGUARDED as *const AtomicU64 as *mut AtomicU64);

/// Makes the guard page if there is none yet (a system call or two, once
/// per process and its forked children's first arming: the page's
/// mapping is inherited, only its content is wiped), then sets the word:
/// from now on, a child reads 0. Called while making the regions, after
/// their writers are stored and before they are published.
pub fn arm() {
    let mut word = WORD.load(Ordering::Relaxed);
    if std::ptr::eq(word, &UNGUARDED) {
        if let Some(page) = guard_page() {
            WORD.store(page, Ordering::Relaxed);
            word = page;
        }
    }
    // SAFETY: `word` is `UNGUARDED` or the guard page's first word, both
    // valid for the life of the process (the page is never unmapped).
    unsafe { &*word }.store(1, Ordering::Release);
}

/// True in a fork child that was not told of the fork (its guard word was
/// wiped), until its regions are made again and [`arm`] is called.
#[inline(always)]
pub fn forked() -> bool {
    // SAFETY: `WORD` always points to a valid word (module invariants).
    unsafe { &*WORD.load(Ordering::Relaxed) }.load(Ordering::Acquire) == 0
}

/// A private anonymous page the kernel zeroes in every child.
#[cold]
fn guard_page() -> Option<*mut AtomicU64> {
    const MADV_WIPEONFORK: libc::c_int = 18;
    // SAFETY: a fresh anonymous mapping; no existing memory is affected.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            4096,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS,
            -1,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return None;
    }
    // SAFETY: `p` is the page just mapped, of this length.
    if unsafe { libc::madvise(p, 4096, MADV_WIPEONFORK) } != 0 {
        // SAFETY: the page just mapped, unused.
        unsafe { libc::munmap(p, 4096) };
        return None;
    }
    Some(p.cast())
}

// Not under qemu-user, where CI runs the aarch64 tests: it answers
// `madvise` with success and does nothing (the guard then finds no child,
// as without it).
#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    #[test]
    fn an_armed_guard_reads_zero_only_in_a_child_made_without_handlers() {
        arm();
        assert!(!forked());
        // SAFETY: the raw clone system call as a fork (SIGCHLD, no new
        // stack); the child only reads memory and exits with `_exit` (no
        // allocation, no unwinding).
        let pid = unsafe { libc::syscall(libc::SYS_clone, libc::SIGCHLD, 0, 0, 0, 0) };
        if pid == 0 {
            let code = if forked() { 0 } else { 1 };
            // SAFETY: ends the child at once.
            unsafe { libc::_exit(code) };
        }
        assert!(pid > 0);
        let mut status = 0;
        // SAFETY: waits for the child just made.
        assert_eq!(
            unsafe { libc::waitpid(pid as libc::pid_t, &mut status, 0) },
            pid as i32
        );
        assert!(libc::WIFEXITED(status));
        assert_eq!(libc::WEXITSTATUS(status), 0, "the child did not read 0");
        assert!(!forked(), "the parent's word was wiped");
    }
}
