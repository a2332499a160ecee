//! What one stack frame costs each unwinder, warm: the agent's two walkers
//! called directly (no allocator, no table) at the bottom of a C recursion
//! built with and without frame pointers, at two depths; the difference
//! divided by the difference in frames is the cost of a frame.
//!
//!     cargo run --release -p heapdump-bench --bin walk_cost [-- --rounds N]
//!
//! The CFI walk is measured twice: with the thread's memo of its previous
//! walk kept (every walk repeats the previous one, so all its frames are
//! replayed from the memo: what a frame costs that the walk shares with
//! an earlier one, as the outer part of a real stack does), and with the
//! memo cleared before every walk (each frame is stepped through its rule;
//! the walk is recorded for the next on the first misses, then on every
//! 16th: what a frame costs that the walk shares with no earlier one).
//!
//! Prints a markdown table. Each (code, walker) cell is the median over
//! rounds of the per-frame cost; configurations are interleaved round by
//! round so machine noise hits them alike. The frame counts are checked:
//! a walker that did not see every level of the recursion fails the run.
//!
//! x86_64 only: the agent's CFI unwinder is (elsewhere it walks frame
//! pointers).

#[cfg(target_arch = "x86_64")]
mod x86_64 {

    use std::ffi::c_void;
    use std::time::Instant;

    use heapdump_agent::{cfi_unwind, stack_capture, stack_memo};

    type Callback = extern "C" fn(*mut c_void);

    // Built by bench/build.rs (it also tells cargo where the archives are).
    #[link(name = "chain_fp", kind = "static")]
    extern "C" {
        fn chain_fp(n: i32, cb: Callback, arg: *mut c_void) -> i32;
    }
    #[link(name = "chain_nofp", kind = "static")]
    extern "C" {
        fn chain_nofp(n: i32, cb: Callback, arg: *mut c_void) -> i32;
    }

    const SHALLOW: i32 = 4;
    const DEEP: i32 = 36;
    const WALKS: u32 = 200_000;

    #[derive(Clone, Copy, PartialEq)]
    enum Walker {
        FramePointer,
        /// The memo cleared before every walk.
        CfiUnshared,
        /// The memo kept from walk to walk.
        CfiShared,
    }

    struct Job<'a> {
        walker: Walker,
        cache: &'a cfi_unwind::RuleCache,
        memo: &'a mut stack_memo::StackMemos,
        ns_per_walk: f64,
        frames: usize,
    }

    extern "C" fn at_bottom(arg: *mut c_void) {
        // SAFETY: `arg` is the `&mut Job` that `measure` passed down the chain,
        // alive for the whole call.
        let job = unsafe { &mut *(arg as *mut Job) };
        let sp = stack_capture::stack_pointer();
        let hi = stack_capture::thread_stack_top(sp).expect("stack top");
        let fp = stack_capture::frame_pointer();
        let mut out = [0u64; 64];
        let mut frames = 0;
        let t = Instant::now();
        for _ in 0..WALKS {
            let (n, _) = match job.walker {
                Walker::FramePointer => stack_capture::walk(fp, sp, hi, &mut out),
                Walker::CfiUnshared => {
                    job.memo.clear();
                    cfi_unwind::walk(fp, sp, hi, &mut out, job.cache, job.memo, true)
                }
                Walker::CfiShared => {
                    cfi_unwind::walk(fp, sp, hi, &mut out, job.cache, job.memo, true)
                }
            };
            frames = std::hint::black_box(n);
        }
        job.ns_per_walk = t.elapsed().as_nanos() as f64 / f64::from(WALKS);
        job.frames = frames;
    }

    fn measure(
        nofp: bool,
        walker: Walker,
        depth: i32,
        cache: &cfi_unwind::RuleCache,
        memo: &mut stack_memo::StackMemos,
    ) -> (f64, usize) {
        let mut job = Job {
            walker,
            cache,
            memo,
            ns_per_walk: 0.0,
            frames: 0,
        };
        let arg = &mut job as *mut Job as *mut c_void;
        // SAFETY: the chains are the C functions of bench/c/walk_chain.c; they
        // call `at_bottom(arg)` once at the given depth and return.
        unsafe {
            if nofp {
                chain_nofp(depth, at_bottom, arg);
            } else {
                chain_fp(depth, at_bottom, arg);
            }
        }
        (job.ns_per_walk, job.frames)
    }

    fn median(v: &mut [f64]) -> f64 {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    }

    pub fn main() {
        let mut rounds = 9;
        let mut args = std::env::args().skip(1);
        while let Some(a) = args.next() {
            match a.as_str() {
                "--rounds" => {
                    rounds = args
                        .next()
                        .and_then(|v| v.parse().ok())
                        .expect("--rounds N")
                }
                _ => panic!("usage: walk_cost [--rounds N]"),
            }
        }
        assert!(
            cfi_unwind::init(false),
            "CFI unwinding needs glibc's _dl_find_object"
        );
        let cache = Box::new(cfi_unwind::RuleCache::new());
        let mut memo = Box::new(stack_memo::StackMemos::new());
        let cells = [
            (
                "frame pointers",
                false,
                Walker::FramePointer,
                "frame-pointer walk",
            ),
            (
                "frame pointers",
                false,
                Walker::CfiUnshared,
                "CFI walk, memo cleared before each walk (nothing shared)",
            ),
            (
                "frame pointers",
                false,
                Walker::CfiShared,
                "CFI walk, memo of the previous walk kept (every frame replayed)",
            ),
            (
                "no frame pointers",
                true,
                Walker::CfiUnshared,
                "CFI walk, memo cleared before each walk (nothing shared)",
            ),
            (
                "no frame pointers",
                true,
                Walker::CfiShared,
                "CFI walk, memo of the previous walk kept (every frame replayed)",
            ),
        ];
        let mut per_frame = vec![Vec::new(); cells.len()];
        let mut per_walk = vec![Vec::new(); cells.len()];
        for round in 0..rounds {
            let order: Vec<usize> = if round % 2 == 0 {
                (0..cells.len()).collect()
            } else {
                (0..cells.len()).rev().collect()
            };
            for i in order {
                let (_, nofp, walker, _) = cells[i];
                let (t_shallow, n_shallow) = measure(nofp, walker, SHALLOW, &cache, &mut memo);
                let (t_deep, n_deep) = measure(nofp, walker, DEEP, &cache, &mut memo);
                assert_eq!(
                    n_deep - n_shallow,
                    (DEEP - SHALLOW) as usize,
                    "the walk did not see every level of the recursion ({n_shallow} and {n_deep} frames)"
                );
                per_frame[i].push((t_deep - t_shallow) / f64::from(DEEP - SHALLOW));
                per_walk[i].push(t_deep);
            }
        }
        let cpu = std::fs::read_to_string("/proc/cpuinfo")
            .ok()
            .and_then(|s| {
                s.lines()
                    .find(|l| l.starts_with("model name"))
                    .and_then(|l| l.split_once(':'))
                    .map(|(_, v)| v.trim().to_string())
            })
            .unwrap_or_else(|| "?".into());
        println!(
            "stack walk per frame, warm rule cache; {SHALLOW} and {DEEP} C levels, {WALKS} walks each; median of {rounds} interleaved rounds; CPU: {cpu}"
        );
        println!();
        println!(
            "| code | walker | ns per frame | x frame-pointer walk | ns per walk at depth {DEEP} |"
        );
        println!("|---|---|---|---|---|");
        let base = median(&mut per_frame[0].clone());
        for (i, (code, _, _, walker)) in cells.iter().enumerate() {
            let f = median(&mut per_frame[i]);
            let w = median(&mut per_walk[i]);
            println!("| {code} | {walker} | {f:.2} | {:.2} | {w:.0} |", f / base);
        }
    }
}

#[cfg(target_arch = "x86_64")]
fn main() {
    x86_64::main();
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("walk_cost measures the agent's CFI unwinder, which is x86_64 only");
}
