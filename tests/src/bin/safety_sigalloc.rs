//! Signals arriving while the agent is inside the allocator: a handler for
//! SIGUSR1 and SIGALRM that itself allocates and frees (its first 200 000
//! invocations), fired at a high
//! rate by an interval timer and by another thread's `pthread_kill`, while
//! the main thread allocates in a loop (keeping every 100th block from
//! `site_kept`). Prints `ready PID hits=N`, then waits for stdin.
//!
//! The agent wraps a lock-free bump allocator (frees are no-ops), so the
//! handler's allocations are async-signal-safe below the agent: any
//! deadlock or crash would be the agent's. (glibc's malloc is not
//! async-signal-safe, so a C handler calling it could deadlock glibc
//! itself, agent or not.)

use std::alloc::{GlobalAlloc, Layout};
use std::hint::black_box;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

struct Bump;

const ARENA: usize = 1 << 30;
static BASE: AtomicUsize = AtomicUsize::new(0);
static NEXT: AtomicUsize = AtomicUsize::new(0);

fn base() -> usize {
    let b = BASE.load(Ordering::Acquire);
    if b != 0 {
        return b;
    }
    // SAFETY: an anonymous private mapping with no address hint; the result
    // is checked. Sparse: untouched pages cost nothing.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            ARENA,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE,
            -1,
            0,
        )
    };
    assert!(p != libc::MAP_FAILED, "mmap arena");
    match BASE.compare_exchange(0, p as usize, Ordering::AcqRel, Ordering::Acquire) {
        Ok(_) => p as usize,
        Err(won) => {
            // SAFETY: our own mapping, never handed out.
            unsafe { libc::munmap(p, ARENA) };
            won
        }
    }
}

// SAFETY: `alloc` hands out disjoint, suitably aligned ranges of a private
// mapping that is never unmapped (an atomic bump: async-signal-safe), or
// null when the arena is exhausted; `dealloc` does nothing.
unsafe impl GlobalAlloc for Bump {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let base = base();
        let align = layout.align().max(16);
        let mut cur = NEXT.load(Ordering::Relaxed);
        loop {
            let start = (base + cur).next_multiple_of(align) - base;
            let end = start + layout.size().max(1);
            if end > ARENA {
                return std::ptr::null_mut();
            }
            match NEXT.compare_exchange_weak(cur, end, Ordering::Relaxed, Ordering::Relaxed) {
                Ok(_) => return (base + start) as *mut u8,
                Err(now) => cur = now,
            }
        }
    }
    unsafe fn dealloc(&self, _ptr: *mut u8, _layout: Layout) {}
}

#[global_allocator]
static A: heapdump_agent::Agent<Bump> = heapdump_agent::Agent::new(Bump);

static HITS: AtomicU64 = AtomicU64::new(0);
static STOP: AtomicBool = AtomicBool::new(false);

/// Handler invocations that allocate. The arena never reuses memory and
/// the pinger signals as fast as it can, so without a bound the handler
/// could exhaust the arena on a slow machine (with CFI unwinding, each
/// handler allocation's stack crosses the signal frame into a different
/// interrupted instruction: a new trace to intern, dearer than the
/// frame-pointer walk that stopped at the signal frame).
const ALLOCATING_HITS: usize = 200_000;

extern "C" fn handler(_sig: libc::c_int) {
    let n = HITS.fetch_add(1, Ordering::Relaxed) as usize;
    if n >= ALLOCATING_HITS {
        return;
    }
    let v: Vec<u8> = Vec::with_capacity(64 + n % 512);
    black_box(&v);
    let b = Box::new(n);
    black_box(&b);
}

#[inline(never)]
fn site_kept(n: usize) -> Vec<u8> {
    black_box(Vec::with_capacity(n))
}

#[inline(never)]
fn site_temp(n: usize) {
    drop(black_box(Vec::<u8>::with_capacity(n)));
}

fn set_timer(us: libc::suseconds_t) {
    let t = libc::itimerval {
        it_interval: libc::timeval {
            tv_sec: 0,
            tv_usec: us,
        },
        it_value: libc::timeval {
            tv_sec: 0,
            tv_usec: us,
        },
    };
    // SAFETY: valid itimerval; a null old-value pointer is allowed.
    unsafe { libc::setitimer(libc::ITIMER_REAL, &t, std::ptr::null_mut()) };
}

fn main() {
    let iterations: usize = std::env::args()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(200_000);
    for sig in [libc::SIGUSR1, libc::SIGALRM] {
        // SAFETY: a zeroed sigaction is valid; we set the handler and
        // SA_RESTART (read/write in the loop are restarted), empty mask.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = handler as extern "C" fn(libc::c_int) as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            assert_eq!(libc::sigaction(sig, &sa, std::ptr::null_mut()), 0);
        }
    }
    // SAFETY: pthread_self has no preconditions.
    let main_thread = unsafe { libc::pthread_self() } as usize;
    let pinger = std::thread::spawn(move || {
        while !STOP.load(Ordering::Relaxed) {
            // SAFETY: the main thread outlives this one (joined below).
            unsafe { libc::pthread_kill(main_thread as libc::pthread_t, libc::SIGUSR1) };
            std::thread::yield_now();
        }
    });
    set_timer(50);
    let mut kept = Vec::with_capacity(iterations / 100 + 1);
    for i in 0..iterations {
        if i % 100 == 0 {
            kept.push(site_kept(100 + (i / 100) % 50));
        } else {
            site_temp(24 + i % 300);
        }
    }
    set_timer(0);
    STOP.store(true, Ordering::Relaxed);
    pinger.join().unwrap();
    println!(
        "ready {} hits={} kept={}",
        std::process::id(),
        HITS.load(Ordering::Relaxed),
        kept.len()
    );
    let mut buf = [0u8; 64];
    // SAFETY: reading into a valid local buffer.
    unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
    black_box(kept);
}
