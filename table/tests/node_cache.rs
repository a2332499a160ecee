//! The per-thread `NodeCache` paths of the allocations table: same live set
//! and counters as the plain paths, nodes reused, live bytes settled by a
//! flush, and several threads with caches at once.

use std::collections::HashMap;

use heapdump_table::allocations_table::{NodeCache, LIVE_BATCH};
use heapdump_table::{AllocationRecord, AllocationsConfig, AllocationsWriter, ResourceKey};

fn rec(addr: u64, size: u64) -> AllocationRecord {
    AllocationRecord {
        address: addr,
        size,
        stack: ResourceKey(8 * (addr % 1000 + 1)),
        thread: ResourceKey(8 * (addr % 7 + 1)),
        timestamp_us: addr % 12345,
    }
}

#[test]
fn cached_and_plain_paths_agree_with_a_model() {
    let region = AllocationsWriter::create_region(AllocationsConfig {
        capacity: 50_000,
        shards: 16,
    })
    .unwrap();
    let w = AllocationsWriter::new(&region).unwrap();
    let reader_region = heapdump_table::RegionReader::from_file(
        std::fs::File::from(
            region
                .fd()
                .expect("own memfd")
                .try_clone_to_owned()
                .unwrap(),
        ),
        heapdump_table::RegionKind::Allocations,
    )
    .unwrap();
    let r = heapdump_table::AllocationsReader::new(&reader_region).unwrap();
    let mut cache = NodeCache::new();
    let mut model: HashMap<u64, u64> = HashMap::new();
    let mut x = 7u64;
    for i in 0..200_000u64 {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let addr = 0x10_0000 + (x >> 40) % 20_000 * 16;
        let cached = i % 3 != 0;
        if let std::collections::hash_map::Entry::Occupied(e) = model.entry(addr) {
            let size = *e.get();
            let got = if cached {
                w.remove_cached(addr, &mut cache)
            } else {
                w.remove(addr)
            };
            assert_eq!(got, Some(size));
            e.remove();
        } else {
            let size = 1 + x % 5000;
            if cached {
                w.insert_cached(&rec(addr, size), &mut cache).unwrap();
            } else {
                w.insert(&rec(addr, size)).unwrap();
            }
            model.insert(addr, size);
        }
    }
    let (live, stats) = r.snapshot();
    assert_eq!(stats.partial_reason(), None);
    let got: HashMap<u64, u64> = live.iter().map(|b| (b.address, b.size)).collect();
    assert_eq!(got, model);
    for b in &live {
        assert_eq!(*b, rec(b.address, b.size), "fields intact");
    }
    let c = r.counters();
    let total: u64 = model.values().sum();
    assert_eq!(c.live_bytes, total, "live bytes are exact without a flush");
    assert_eq!(c.live_blocks, model.len() as u64);
    w.flush_cache(&mut cache);
    assert!(c.peak_live_bytes + LIVE_BATCH as u64 >= total);
    // Reuse: the node high-water mark stays near the peak live count.
    assert!(
        stats.nodes <= 20_000 + 16 * 16 + 32,
        "{} nodes",
        stats.nodes
    );
}

#[test]
fn threads_with_their_own_caches_leave_an_exact_table() {
    let region = AllocationsWriter::create_region(AllocationsConfig {
        capacity: 100_000,
        shards: 64,
    })
    .unwrap();
    let w = AllocationsWriter::new(&region).unwrap();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let w = &w;
            s.spawn(move || {
                let mut cache = NodeCache::new();
                let base = 0x1000_0000 * (t + 1);
                for round in 0..20u64 {
                    for i in 0..1000 {
                        w.insert_cached(&rec(base + i * 32, 10 + round), &mut cache)
                            .unwrap();
                    }
                    for i in 0..1000 {
                        if round == 19 && i % 2 == 0 {
                            continue;
                        }
                        assert_eq!(w.remove_cached(base + i * 32, &mut cache), Some(10 + round));
                    }
                }
                w.flush_cache(&mut cache);
            });
        }
    });
    let c = w.stats();
    assert_eq!(c.live_blocks, 4 * 500);
    assert_eq!(c.live_bytes, 4 * 500 * 29);
    assert_eq!(c.total_allocs, 4 * 20 * 1000);
}
