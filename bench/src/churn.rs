//! The Rust twin of `bench/churn.c`: each event frees the oldest block of
//! a ring and allocates a new one from one of 16 call sites reached through
//! a recursion of depth 8..32 (or a fixed depth), sizes 16..4096. Shared by `churn_bare`
//! (system allocator) and `churn_agent` (heapdump's `Agent`), and by the
//! other profilers' bins in `bench/rivals` (see `bench/compare`).
//!
//! `CHURN_MAX_SIZE=N` in the environment (17..1048576) makes the sizes
//! 16..N instead of 16..4096, as for `bench/churn.c`.
//!
//! With `CHURN_PAUSE=1` in the environment, after the loop (the ring still
//! live) it prints its line and `ready`, and waits for a line (or EOF) on
//! stdin before dropping the ring: time for a profiler's snapshot of the
//! live heap. The timed loop is the same either way.

use std::hint::black_box;
use std::sync::{Arc, Barrier};
use std::time::Instant;

// Each leaf passes its own number through `black_box`: identical bodies
// would be merged into one function by LLVM (one call site, not 16).
macro_rules! leaves {
    ($($name:ident = $n:literal),*) => {
        $(#[inline(never)] fn $name(size: usize) -> Vec<u8> {
            black_box($n);
            black_box(Vec::with_capacity(size))
        })*
        const LEAVES: [fn(usize) -> Vec<u8>; 16] = [$($name),*];
    };
}
leaves!(
    l0 = 0,
    l1 = 1,
    l2 = 2,
    l3 = 3,
    l4 = 4,
    l5 = 5,
    l6 = 6,
    l7 = 7,
    l8 = 8,
    l9 = 9,
    l10 = 10,
    l11 = 11,
    l12 = 12,
    l13 = 13,
    l14 = 14,
    l15 = 15
);

#[inline(never)]
fn descend(depth: u32, site: u32, size: usize) -> Vec<u8> {
    let v = if depth == 0 {
        LEAVES[(site % 16) as usize](size)
    } else {
        descend(depth - 1, site, size)
    };
    black_box(v)
}

fn next(x: &mut u32) -> u32 {
    *x = x.wrapping_mul(1_103_515_245).wrapping_add(12345);
    *x
}

fn event(x: &mut u32, fixed_depth: u32, size_span: u32) -> Vec<u8> {
    let r = next(x);
    let depth = if fixed_depth > 0 {
        fixed_depth
    } else {
        8 + (r >> 8) % 25
    };
    descend(depth, r >> 16, 16 + ((r >> 4) % size_span) as usize)
}

/// Sizes are `16..16 + span`: 4081 by default, `CHURN_MAX_SIZE - 15`.
fn size_span() -> u32 {
    match std::env::var("CHURN_MAX_SIZE")
        .ok()
        .and_then(|v| v.parse::<u32>().ok())
    {
        Some(m) if (17..=1_048_576).contains(&m) => m - 15,
        Some(_) => {
            eprintln!("CHURN_MAX_SIZE: 17..1048576");
            std::process::exit(2)
        }
        None => 4081,
    }
}

/// The agent's own word on a run: `Some((recording, allocations recorded))`
/// from a binary built with heapdump's `Agent`; `None` elsewhere.
pub type AgentReport = Option<fn() -> (bool, u64)>;

/// Runs the churn with `args` = [threads, events, ring, depth] (depth 0:
/// 8..32 levels of recursion); prints whether the agent recorded it
/// (`agent: recording allocs=N` or `agent: absent`, as `bench/churn.c`
/// does) and then the result.
pub fn main_reporting(agent: AgentReport) {
    let args: Vec<u64> = std::env::args()
        .skip(1)
        .filter_map(|a| a.parse().ok())
        .collect();
    let threads = *args.first().unwrap_or(&1) as usize;
    let events = *args.get(1).unwrap_or(&2_000_000);
    let ring = *args.get(2).unwrap_or(&100_000);
    let depth = (*args.get(3).unwrap_or(&0)).min(200) as u32;
    let pause = std::env::var("CHURN_PAUSE").is_ok_and(|v| !v.is_empty() && v != "0");
    let span = size_span();
    let barrier = Arc::new(Barrier::new(threads + 1));
    let hs: Vec<_> = (0..threads)
        .map(|t| {
            let b = barrier.clone();
            let (ev, rl) = (events / threads as u64, ring / threads as u64);
            std::thread::spawn(move || {
                let mut x = 12345u32 + 777 * t as u32;
                let mut ring: Vec<Vec<u8>> = (0..rl).map(|_| event(&mut x, depth, span)).collect();
                b.wait();
                for i in 0..ev {
                    let slot = (i % rl) as usize;
                    ring[slot] = Vec::new();
                    ring[slot] = event(&mut x, depth, span);
                }
                b.wait();
                if pause {
                    b.wait(); // released after `ready`
                }
                drop(black_box(ring));
            })
        })
        .collect();
    barrier.wait();
    let t0 = Instant::now();
    barrier.wait();
    let dt = t0.elapsed();
    match agent.map(|f| f()) {
        Some((true, allocs)) => println!("agent: recording allocs={allocs}"),
        _ => println!("agent: absent"),
    }
    println!(
        "churn threads={threads} events={events} ring={ring} depth={depth} ns_per_pair={:.1}",
        dt.as_nanos() as f64 / events as f64 * threads as f64
    );
    if pause {
        use std::io::{BufRead, Write};
        println!("ready");
        std::io::stdout().flush().ok();
        let mut line = String::new();
        std::io::stdin().lock().read_line(&mut line).ok(); // EOF also releases
        barrier.wait();
    }
    for h in hs {
        h.join().unwrap();
    }
}

/// [`main_reporting`] for a binary without heapdump's agent.
#[allow(dead_code)]
pub fn main() {
    main_reporting(None);
}
