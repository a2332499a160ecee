//! Benchmarks of the shared-memory tables (`cargo bench -p heapdump-table`).
//!
//! - `intern/hit`, `intern/miss`: interning a 24-frame compressed trace that
//!   is already stored / new.
//! - `insert_remove/*`: one insert plus one remove of the same block on one
//!   thread, with about 1 M other blocks live in the table, and with an
//!   almost empty table; and per thread with two threads at once. Each
//!   also through a per-thread `NodeCache` (`*_cached`, as the agent does).
//! - `walk/1M`: a reader walk over 1 M live blocks (criterion reports
//!   elements per second = blocks per second).
//! - bytes per live block at 1 M live blocks: printed (criterion does not
//!   measure memory), from the resident pages of both regions.

use std::hint::black_box;
use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use heapdump_table::allocations_table::NodeCache;
use heapdump_table::resources_table::DEFAULT_BUCKETS;
use heapdump_table::stack_compression::encode;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsReader, AllocationsWriter, RegionWriter,
    ResourceKey, ResourcesWriter,
};

const LIVE: usize = 1 << 20;
const RESOURCES_SIZE: u64 = 256 << 20;

/// splitmix64: a small deterministic generator.
struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
}

/// A realistic compressed trace: `frames` return addresses in a few
/// modules, varied by `seed`.
fn trace(seed: u64, frames: usize) -> Vec<u8> {
    let mut rng = Rng(seed);
    let f: Vec<u64> = (0..frames)
        .map(|i| {
            let module = [0x5555_5555_0000u64, 0x7f3a_1200_0000, 0x7f3a_1a00_0000][i % 3];
            module + (rng.next() % 0x20_0000)
        })
        .collect();
    let mut out = Vec::new();
    encode(&f, &mut out);
    out
}

/// `n` malloc-like blocks: a bump through a heap, sizes mostly small,
/// 16-byte aligned, with a 16-byte chunk header between blocks.
fn malloc_like_blocks(n: usize, base: u64, seed: u64) -> Vec<(u64, u64)> {
    let mut rng = Rng(seed);
    let mut at = base;
    (0..n)
        .map(|_| {
            let r = rng.next();
            let size = match r % 100 {
                0..=59 => 8 + r % 56,
                60..=89 => 64 + r % 448,
                90..=98 => 512 + r % 3584,
                _ => 4096 + r % 61440,
            };
            let addr = at;
            at += (size + 16).div_ceil(16) * 16;
            (addr, size)
        })
        .collect()
}

fn record(addr: u64, size: u64, stack: ResourceKey, thread: ResourceKey) -> AllocationRecord {
    AllocationRecord {
        address: addr,
        size,
        stack,
        thread,
        timestamp_us: addr >> 4,
    }
}

struct Loaded {
    res_region: RegionWriter,
    alloc_region: RegionWriter,
}

/// Both regions, with `live` malloc-like blocks from 4096 distinct stacks.
fn loaded(live: usize) -> Loaded {
    let res_region = ResourcesWriter::create_region(RESOURCES_SIZE, DEFAULT_BUCKETS).unwrap();
    let alloc_region = AllocationsWriter::create_region(AllocationsConfig::default()).unwrap();
    {
        let res = ResourcesWriter::new(&res_region).unwrap();
        let allocs = AllocationsWriter::new(&alloc_region).unwrap();
        let thread = res.insert_thread_info(1, b"main").unwrap();
        let stacks: Vec<ResourceKey> = (0..4096)
            .map(|s| res.intern_stack_trace(&trace(s, 24)).unwrap().0)
            .collect();
        for (i, (addr, size)) in malloc_like_blocks(live, 0x5555_5600_0000, 7)
            .into_iter()
            .enumerate()
        {
            let stack = stacks[i % stacks.len()];
            res.record_allocation(stack, size);
            allocs.insert(&record(addr, size, stack, thread)).unwrap();
        }
    }
    Loaded {
        res_region,
        alloc_region,
    }
}

fn bench_intern(c: &mut Criterion) {
    let mut g = c.benchmark_group("intern");
    let region = ResourcesWriter::create_region(RESOURCES_SIZE, DEFAULT_BUCKETS).unwrap();
    let res = ResourcesWriter::new(&region).unwrap();
    let known: Vec<Vec<u8>> = (0..4096).map(|s| trace(s, 24)).collect();
    for t in &known {
        res.intern_stack_trace(t).unwrap();
    }
    let mut i = 0usize;
    g.bench_function("hit", |b| {
        b.iter(|| {
            i = (i + 1) % known.len();
            black_box(res.intern_stack_trace(black_box(&known[i])).unwrap())
        })
    });
    // Misses: fresh traces each time. Regions are refilled outside the
    // timed part so the table never fills up.
    const CHUNK: usize = 100_000;
    let mut seed = 1u64 << 40;
    g.bench_function("miss", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            let mut left = iters as usize;
            while left > 0 {
                let n = left.min(CHUNK);
                let region = ResourcesWriter::create_region(64 << 20, DEFAULT_BUCKETS).unwrap();
                let res = ResourcesWriter::new(&region).unwrap();
                // Pre-fill like a running process, so chains are realistic.
                for t in &known {
                    res.intern_stack_trace(t).unwrap();
                }
                let fresh: Vec<Vec<u8>> = (0..n)
                    .map(|_| {
                        seed += 1;
                        trace(seed, 24)
                    })
                    .collect();
                let t0 = Instant::now();
                for t in &fresh {
                    black_box(res.intern_stack_trace(black_box(t)).unwrap());
                }
                total += t0.elapsed();
                left -= n;
            }
            total
        })
    });
    g.finish();
}

fn bench_insert_remove(c: &mut Criterion) {
    let mut g = c.benchmark_group("insert_remove");
    for (name, live) in [("1M_live", LIVE), ("small_table", 64)] {
        let l = loaded(live);
        let allocs = AllocationsWriter::new(&l.alloc_region).unwrap();
        // Blocks of another heap arena, cycled through (never live at once).
        let extra = malloc_like_blocks(4096, 0x7f3a_4000_0000, 11);
        let mut i = 0usize;
        g.bench_function(name, |b| {
            b.iter(|| {
                i = (i + 1) % extra.len();
                let (addr, size) = extra[i];
                allocs
                    .insert(&record(addr, size, ResourceKey(8192), ResourceKey(8192)))
                    .unwrap();
                black_box(allocs.remove(black_box(addr)))
            })
        });
        // The same through a per-thread NodeCache (what the agent uses).
        let mut cache = NodeCache::new();
        g.bench_function(format!("{name}_cached"), |b| {
            b.iter(|| {
                i = (i + 1) % extra.len();
                let (addr, size) = extra[i];
                let r = record(addr, size, ResourceKey(8192), ResourceKey(8192));
                allocs.insert_cached(&r, &mut cache).unwrap();
                black_box(allocs.remove_cached(black_box(addr), &mut cache))
            })
        });
        // Direct blocks (found by node, no index slot: the Rust agent's
        // block-header mode).
        g.bench_function(format!("{name}_direct"), |b| {
            b.iter(|| {
                i = (i + 1) % extra.len();
                let (addr, size) = extra[i];
                let r = record(addr, size, ResourceKey(8192), ResourceKey(8192));
                let node = allocs.insert_direct(&r, &mut cache).unwrap();
                black_box(allocs.remove_direct(black_box(addr), node, &mut cache))
            })
        });
        allocs.flush_cache(&mut cache);
    }
    // Two threads at once on the 1M-live table, each on its own blocks:
    // time per pair per thread (shared counters and shard locks contend).
    let l = loaded(LIVE);
    let allocs = AllocationsWriter::new(&l.alloc_region).unwrap();
    let extra: Vec<Vec<(u64, u64)>> = (0..2)
        .map(|t| malloc_like_blocks(4096, 0x7f3a_4000_0000 + (t << 32), 11 + t))
        .collect();
    for cached in [false, true] {
        let name = if cached {
            "1M_live_2_threads_cached"
        } else {
            "1M_live_2_threads"
        };
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let barrier = std::sync::Barrier::new(2);
                let times: Vec<Duration> = std::thread::scope(|s| {
                    let hs: Vec<_> = extra
                        .iter()
                        .map(|blocks| {
                            let barrier = &barrier;
                            s.spawn(move || {
                                let mut cache = NodeCache::new();
                                barrier.wait();
                                let t0 = Instant::now();
                                for k in 0..iters as usize {
                                    let (addr, size) = blocks[k % blocks.len()];
                                    let r =
                                        record(addr, size, ResourceKey(8192), ResourceKey(8192));
                                    if cached {
                                        allocs.insert_cached(&r, &mut cache).unwrap();
                                        black_box(allocs.remove_cached(addr, &mut cache));
                                    } else {
                                        allocs.insert(&r).unwrap();
                                        black_box(allocs.remove(addr));
                                    }
                                }
                                let t = t0.elapsed();
                                allocs.flush_cache(&mut cache);
                                t
                            })
                        })
                        .collect();
                    hs.into_iter().map(|h| h.join().unwrap()).collect()
                });
                times.into_iter().max().unwrap()
            })
        });
    }
    g.finish();
}

fn bench_walk_and_memory(c: &mut Criterion) {
    let l = loaded(LIVE);
    let res_bytes = l.res_region.resident_bytes().unwrap();
    let alloc_bytes = l.alloc_region.resident_bytes().unwrap();
    println!(
        "memory at {LIVE} live blocks: allocations region {alloc_bytes} B resident, \
         resources region {res_bytes} B resident: {:.1} bytes per live block \
         ({:.1} allocations only)",
        (alloc_bytes + res_bytes) as f64 / LIVE as f64,
        alloc_bytes as f64 / LIVE as f64,
    );
    let reader_region = l.alloc_region.open_reader().unwrap();
    let reader = AllocationsReader::new(&reader_region).unwrap();
    let mut g = c.benchmark_group("walk");
    g.sample_size(20);
    g.throughput(Throughput::Elements(LIVE as u64));
    g.bench_function("1M", |b| {
        b.iter(|| {
            let mut bytes = 0u64;
            let stats = reader.walk(|r| bytes += r.size);
            assert_eq!(stats.reported, LIVE as u64);
            black_box(bytes)
        })
    });
    g.finish();
}

criterion_group!(
    benches,
    bench_intern,
    bench_insert_remove,
    bench_walk_and_memory
);
criterion_main!(benches);
