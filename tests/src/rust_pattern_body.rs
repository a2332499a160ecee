// The body of the Rust pattern programs (`src/bin/rust_pattern.rs`,
// `src/bin/rust_headers.rs`), included by each after its choice of
// global allocator. Not a module of the library.

use std::hint::black_box;
use std::sync::{Arc, Barrier, Mutex};

static KEEP: Mutex<Vec<Vec<u8>>> = Mutex::new(Vec::new());

fn keep(v: Vec<u8>) {
    KEEP.lock().unwrap().push(v);
}

#[inline(never)]
fn site_vec() {
    for _ in 0..100 {
        keep(black_box(Vec::with_capacity(1000)));
    }
}

#[inline(never)]
fn site_zeroed() {
    for _ in 0..50 {
        keep(black_box(vec![0u8; 24]));
    }
}

#[inline(never)]
fn site_realloc() {
    for _ in 0..10 {
        let mut v: Vec<u8> = Vec::with_capacity(64);
        v.reserve_exact(4096);
        assert_eq!(v.capacity(), 4096);
        keep(black_box(v));
    }
}

#[inline(never)]
fn site_free_half() {
    let mut tmp: Vec<Vec<u8>> = (0..200).map(|_| Vec::with_capacity(32)).collect();
    let mut i = 0;
    tmp.retain(|_| {
        i += 1;
        i % 2 == 0
    });
    for v in tmp {
        keep(v);
    }
}

#[inline(never)]
fn site_freed_all() {
    for _ in 0..300 {
        drop(black_box(Vec::<u8>::with_capacity(777)));
    }
}

#[inline(never)]
fn site_thread1() {
    for _ in 0..30 {
        keep(black_box(Vec::with_capacity(512)));
    }
}

#[inline(never)]
fn site_thread2() {
    for _ in 0..20 {
        keep(black_box(Vec::with_capacity(2048)));
    }
}

/// Waits for a line (or EOF) on stdin with read(2): unlike `std::io::stdin`,
/// it allocates no buffer while the test is dumping us.
fn wait_stdin() {
    let mut buf = [0u8; 64];
    // SAFETY: reading into a valid local buffer.
    unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
}

fn pattern() {
    KEEP.lock().unwrap().reserve(1000);
    let hold = std::env::args().any(|a| a == "hold");
    let barrier = Arc::new(Barrier::new(3));
    let release = Arc::new(Barrier::new(3));
    let mut handles = Vec::new();
    for (name, f) in [
        ("worker-1", site_thread1 as fn()),
        ("worker-2", site_thread2 as fn()),
    ] {
        let (b, r) = (barrier.clone(), release.clone());
        handles.push(
            std::thread::Builder::new()
                .name(name.into())
                .spawn(move || {
                    f();
                    b.wait();
                    if hold {
                        r.wait();
                    }
                })
                .unwrap(),
        );
    }
    site_vec();
    site_zeroed();
    site_realloc();
    site_free_half();
    site_freed_all();
    barrier.wait();
    if !hold {
        for h in handles.drain(..) {
            h.join().unwrap();
        }
    }
    println!("ready {}", std::process::id());
    wait_stdin();
    if hold {
        release.wait();
        for h in handles {
            h.join().unwrap();
        }
    }
    let s = heapdump_agent::stats();
    println!(
        "stats live={} blocks={} peak={} total={} dropped={}",
        s.live_bytes, s.live_blocks, s.peak_live_bytes, s.total_allocs, s.dropped
    );
}

#[inline(never)]
fn churn_step(ring: &mut [Option<Vec<u8>>], i: usize, size: usize) {
    let slot = i % ring.len();
    ring[slot] = Some(Vec::with_capacity(size));
}

/// Allocates and frees on two threads until stdin closes; prints `ready`
/// once both threads are churning.
fn churn() {
    use std::sync::atomic::{AtomicBool, Ordering};
    static STOP: AtomicBool = AtomicBool::new(false);
    let started = Arc::new(Barrier::new(3));
    let mut hs = Vec::new();
    for t in 0..2 {
        let s = started.clone();
        hs.push(std::thread::spawn(move || {
            let mut ring: Vec<Option<Vec<u8>>> = (0..10_000).map(|_| None).collect();
            let mut i = 0usize;
            s.wait();
            while !STOP.load(Ordering::Relaxed) {
                churn_step(&mut ring, i, 16 + (i * 7 + t * 13) % 4000);
                i += 1;
            }
        }));
    }
    started.wait();
    println!("ready {}", std::process::id());
    wait_stdin();
    STOP.store(true, Ordering::Relaxed);
    for h in hs {
        h.join().unwrap();
    }
}

/// Fills a tiny table (run with HEAPDUMP_CAPACITY small): the program must
/// run on and the overflow must be counted as dropped.
fn full() {
    let mut v = Vec::new();
    for i in 0..5000 {
        v.push(vec![i as u8; 40]);
    }
    let s = heapdump_agent::stats();
    println!(
        "stats live={} blocks={} peak={} total={} dropped={}",
        s.live_bytes, s.live_blocks, s.peak_live_bytes, s.total_allocs, s.dropped
    );
    println!("ready {}", std::process::id());
    wait_stdin();
    black_box(v);
}

fn main() {
    match std::env::args().nth(1).as_deref() {
        Some("churn") => churn(),
        Some("full") => full(),
        Some("request") => {
            heapdump_agent::request_snapshot("from-api");
            println!("ready {}", std::process::id());
            wait_stdin();
        }
        _ => pattern(),
    }
}
