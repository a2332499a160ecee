//! Several writer threads insert, remove and replace (in place and moving;
//! one of them keeps its blocks direct, found by node)
//! while a reader walks the table over and over through a read-only
//! mapping. Every record's fields are functions of its address and size,
//! so a torn read (fields of two versions or two blocks) is detected.
//! Pinned blocks stay live the whole time (some are rewritten in place):
//! every walk reports each of them at most once, and exactly once when the
//! walk is complete. The final quiescent walk equals the model exactly.
//!
//! No sleeps: threads start together on a barrier, writers run a fixed
//! number of operations, and the reader stops when they are all done (after
//! a minimum number of walks).

use std::collections::hash_map::Entry;
use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Barrier;

use heapdump_table::allocations_table::NodeCache;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsReader, AllocationsWriter, ResourceKey,
};

const WRITERS: u64 = 3;
const OPS: u64 = 200_000;
const PINNED: u64 = 200;
const CHURN_ADDRS: u64 = 3_000;
const MIN_WALKS: usize = 20;

fn mix(mut z: u64) -> u64 {
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The record for `addr` at version `gen`: size carries the version, and
/// stack, thread and timestamp are functions of (address, size).
fn record(addr: u64, gen: u64) -> AllocationRecord {
    let size = (gen % 4096) << 20 | (mix(addr) & 0xf_ffff);
    let k = mix(addr ^ size.rotate_left(17));
    AllocationRecord {
        address: addr,
        size,
        stack: ResourceKey((k & 0xfff_ffff) * 8),
        thread: ResourceKey((k >> 32 & 0xfff_ffff) * 8),
        timestamp_us: mix(k) & ((1 << 48) - 1),
    }
}

fn check_relation(r: &AllocationRecord) {
    let expected = record(r.address, r.size >> 20);
    assert_eq!(*r, expected, "torn or corrupted record");
}

/// Where writer `t` puts its blocks: pinned blocks, then churn blocks (the
/// `CHURN_BIT` of an address says which).
struct Addresses {
    pinned: fn(u64, u64) -> u64,
    churn: fn(u64, u64) -> u64,
}

const CHURN_BIT: u64 = 0x10_0000;

/// Each writer in an address range of its own (its own shard group).
const OWN_RANGES: Addresses = Addresses {
    pinned: |t, i| 0x1000_0000_0000 * (t + 1) + 0x10 * i,
    churn: |t, i| 0x1000_0000_0000 * (t + 1) + CHURN_BIT + 0x20 * i,
};

/// All writers in one 64 MiB range (one shard group), 2 MiB apart.
const ONE_RANGE: Addresses = Addresses {
    pinned: |t, i| 0x7f00_0000_0000 + 0x20_0000 * t + 0x10 * i,
    churn: |t, i| 0x7f00_0000_0000 + 0x20_0000 * t + CHURN_BIT + 0x20 * i,
};

#[test]
fn writers_and_a_walking_reader() {
    // Few shards: writers contend on shard locks and indexes rehash.
    let cfg = AllocationsConfig {
        capacity: 1 << 16,
        shards: 4,
    };
    let spilled = exercise(cfg, &OWN_RANGES);
    assert_eq!(spilled, 0);
}

#[test]
fn writers_crowding_one_address_range_spill_while_a_reader_walks() {
    // 16 shards in 4 groups of 4, 1024-slot indexes holding 896 blocks
    // each: one group takes 3584 blocks, and the writers keep ~5 500 live
    // in one range, so the group spills into the others while the reader
    // walks and the writers remove, rewrite and move blocks.
    let cfg = AllocationsConfig {
        capacity: 8192,
        shards: 16,
    };
    let spilled = exercise(cfg, &ONE_RANGE);
    assert!(spilled > 0, "the crowded group never spilled");
}

/// Runs the writers and the reader; returns how many shards spilled.
fn exercise(cfg: AllocationsConfig, addrs: &Addresses) -> u64 {
    let (pinned_addr, churn_addr) = (addrs.pinned, addrs.churn);
    let region = AllocationsWriter::create_region(cfg).unwrap();
    let writer = AllocationsWriter::new(&region).unwrap();
    let reader_region = region.open_reader().unwrap();
    let reader = AllocationsReader::new(&reader_region).unwrap();

    let barrier = Barrier::new(WRITERS as usize + 1);
    let writers_done = AtomicUsize::new(0);

    let (models, walks) = std::thread::scope(|s| {
        let writers: Vec<_> = (0..WRITERS)
            .map(|t| {
                let barrier = &barrier;
                let writers_done = &writers_done;
                s.spawn(move || {
                    let mut model: HashMap<u64, AllocationRecord> = HashMap::new();
                    let mut gens: HashMap<u64, u64> = HashMap::new();
                    for i in 0..PINNED {
                        let r = record(pinned_addr(t, i), 0);
                        writer.insert(&r).unwrap();
                        model.insert(r.address, r);
                    }
                    // One writer goes through a per-thread node cache; one
                    // keeps its churn blocks direct (found by node, as the
                    // Rust agent's block headers do), never through the
                    // index.
                    let cached = t == 1;
                    let direct = t == 2;
                    let mut nodes: HashMap<u64, u32> = HashMap::new();
                    let mut cache = NodeCache::new();
                    barrier.wait();
                    let mut x = mix(t + 1);
                    for _ in 0..OPS {
                        x = mix(x);
                        let gen = {
                            let g = gens.entry(x % 997).or_insert(0);
                            *g += 1;
                            *g
                        };
                        match x >> 60 {
                            // Rewrite a pinned block in place.
                            0..=1 => {
                                let a = pinned_addr(t, (x >> 8) % PINNED);
                                let r = record(a, gen);
                                let old = writer.replace(a, &r).unwrap();
                                assert_eq!(old, Some(model[&a].size));
                                model.insert(a, r);
                            }
                            // Insert a churn block.
                            2..=7 if direct => {
                                let a = churn_addr(t, (x >> 8) % CHURN_ADDRS);
                                let r = record(a, gen);
                                // A direct writer never inserts a live
                                // address twice (no duplicate check).
                                if let Entry::Vacant(v) = model.entry(a) {
                                    let node = writer.insert_direct(&r, &mut cache).unwrap();
                                    nodes.insert(a, node);
                                    v.insert(r);
                                }
                            }
                            2..=7 => {
                                let a = churn_addr(t, (x >> 8) % CHURN_ADDRS);
                                let r = record(a, gen);
                                let res = if cached {
                                    writer.insert_cached(&r, &mut cache)
                                } else {
                                    writer.insert(&r)
                                };
                                match model.entry(a) {
                                    Entry::Occupied(_) => assert!(res.is_err()),
                                    Entry::Vacant(v) => {
                                        res.unwrap();
                                        v.insert(r);
                                    }
                                }
                            }
                            // Remove a churn block.
                            8..=12 if direct => {
                                let a = churn_addr(t, (x >> 8) % CHURN_ADDRS);
                                let want = model.remove(&a).map(|r| r.size);
                                // Not live: whatever node is named (here the
                                // last one this address had), nothing goes.
                                let node = nodes.remove(&a).unwrap_or(0);
                                assert_eq!(writer.remove_direct(a, node, &mut cache), want);
                            }
                            8..=12 => {
                                let a = churn_addr(t, (x >> 8) % CHURN_ADDRS);
                                let want = model.remove(&a).map(|r| r.size);
                                let got = if cached {
                                    writer.remove_cached(a, &mut cache)
                                } else {
                                    writer.remove(a)
                                };
                                assert_eq!(got, want);
                            }
                            // Direct: no replacing (the agent removes and
                            // inserts around a realloc).
                            _ if direct => {}
                            // Replace a churn block, moving or in place.
                            _ => {
                                let a = churn_addr(t, (x >> 8) % CHURN_ADDRS);
                                let b = if x & 1 == 0 {
                                    a
                                } else {
                                    churn_addr(t, (x >> 20) % CHURN_ADDRS)
                                };
                                let r = record(b, gen);
                                let old = model.remove(&a).map(|r| r.size);
                                match model.entry(b) {
                                    Entry::Occupied(_) => {
                                        assert!(writer.replace(a, &r).is_err())
                                    }
                                    Entry::Vacant(v) => {
                                        assert_eq!(writer.replace(a, &r).unwrap(), old);
                                        v.insert(r);
                                    }
                                }
                            }
                        }
                    }
                    writer.flush_cache(&mut cache);
                    writers_done.fetch_add(1, Ordering::Release);
                    model
                })
            })
            .collect();

        let reader_thread = s.spawn(|| {
            barrier.wait();
            let mut walks = 0usize;
            let mut complete_walks = 0usize;
            let mut seen: HashMap<u64, u32> = HashMap::new();
            // Bounded: writers run a fixed number of operations.
            while walks < MIN_WALKS || writers_done.load(Ordering::Acquire) < WRITERS as usize {
                seen.clear();
                let stats = reader.walk(|r| {
                    check_relation(r);
                    if r.address & CHURN_BIT == 0 {
                        *seen.entry(r.address).or_insert(0) += 1;
                    }
                });
                for (a, n) in &seen {
                    assert_eq!(*n, 1, "pinned block {a:#x} reported {n} times");
                }
                if stats.unstable == 0 {
                    complete_walks += 1;
                    assert_eq!(
                        seen.len() as u64,
                        WRITERS * PINNED,
                        "a pinned block was missed"
                    );
                }
                walks += 1;
            }
            (walks, complete_walks)
        });
        let models: Vec<_> = writers.into_iter().map(|h| h.join().unwrap()).collect();
        (models, reader_thread.join().unwrap())
    });
    assert!(walks.0 >= MIN_WALKS);
    assert!(walks.1 >= 1, "no complete walk at all");

    // Quiescent: the walk equals the model exactly, and so do the counters.
    let model: HashMap<u64, AllocationRecord> = models.into_iter().flatten().collect();
    let (records, stats) = reader.snapshot();
    assert_eq!(stats.unstable, 0);
    assert_eq!(stats.partial_reason(), None);
    let got: HashMap<u64, AllocationRecord> = records.iter().map(|r| (r.address, *r)).collect();
    assert_eq!(got.len(), records.len(), "a block reported twice");
    assert_eq!(got, model);
    let c = reader.counters();
    assert_eq!(c.live_blocks, model.len() as u64);
    assert_eq!(c.live_bytes, model.values().map(|r| r.size).sum::<u64>());
    assert_eq!(c.dropped_total(), 0);
    writer.spilled_shards()
}
