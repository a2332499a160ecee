//! Per-thread counter blocks of the resources table: a stack's cumulative
//! count is its record's own counters plus its slots in every block, across
//! claims, releases, reuse by another thread, probe overflow, and threads
//! counting at once.

use heapdump_table::resources_table::COUNTER_SLOTS;
use heapdump_table::stack_compression::encode;
use heapdump_table::{RegionKind, ResourceKey, ResourcesReader, ResourcesWriter};

fn key_of(w: &ResourcesWriter, i: u64) -> ResourceKey {
    let mut b = Vec::new();
    encode(&[0x5555_0000_0000 + i * 16, 0x5555_0001_0000], &mut b);
    w.intern_stack_trace(&b).unwrap().0
}

#[test]
fn blocks_add_up_exactly_across_threads_reuse_and_overflow() {
    let region = ResourcesWriter::create_region(64 << 20, 1024).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let n_stacks = 3 * COUNTER_SLOTS; // more stacks than a block has slots
    let keys: Vec<ResourceKey> = (0..n_stacks).map(|i| key_of(&w, i)).collect();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (w, keys) = (&w, &keys);
            s.spawn(move || {
                // Two claims per thread: the second may reuse a block another
                // thread released, and keeps adding to its sums.
                for round in 0..2u64 {
                    let block = w.claim_counters(100 + t).expect("room for a block");
                    let mut hints = vec![u32::MAX; keys.len()];
                    for rep in 0..3u64 {
                        for (i, k) in keys.iter().enumerate() {
                            let size = 1 + (i as u64 % 7) + rep + round;
                            if let Some(h) = w.count_allocation(block, *k, size, hints[i]) {
                                hints[i] = h;
                            }
                        }
                    }
                    w.release_counters(block);
                }
            });
        }
    });
    // Plain atomic path too.
    w.record_allocation(keys[0], 1000);
    let reader_region = region.open_reader().unwrap();
    assert_eq!(reader_region.kind(), RegionKind::Resources);
    let r = ResourcesReader::new(&reader_region).unwrap();
    let cat = r.stacks();
    assert_eq!(cat.partial, None);
    for (i, k) in keys.iter().enumerate() {
        let s = &cat.stacks[cat.by_key[k]];
        let mut bytes = 0;
        for _t in 0..4u64 {
            for round in 0..2u64 {
                for rep in 0..3u64 {
                    bytes += 1 + (i as u64 % 7) + rep + round;
                }
            }
        }
        let (extra_n, extra_b) = if i == 0 { (1, 1000) } else { (0, 0) };
        assert_eq!(s.alloc_count, 4 * 2 * 3 + extra_n, "stack {i}");
        assert_eq!(s.alloc_bytes, bytes + extra_b, "stack {i}");
    }
    // Blocks were reused: no more than one per thread alive at once.
    assert!(w.claim_counters(1).is_some());
}

#[test]
fn overlapping_hostile_counter_blocks_end_quickly_and_say_partial() {
    let region = ResourcesWriter::create_region(8 << 20, 64).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let k = key_of(&w, 1);
    let block = w.claim_counters(7).unwrap();
    w.count_allocation(block, k, 10, u32::MAX);
    // Forge thousands of blocks, one every 8 bytes, each claiming the
    // largest slot count, all chained: they overlap each other.
    let view = region.view();
    let start = heapdump_table::header::HEADER_SIZE + 64 * 8 + 4096 * 2;
    let end = start + 8 * 20_000;
    let mut prev = 0u64;
    let mut off = start;
    while off < end {
        view.atomic_u64(off).unwrap().store(
            u64::from(0x5254_4e43u32) | (1u64 << 16) << 32,
            std::sync::atomic::Ordering::Relaxed,
        );
        view.atomic_u64(off + 8)
            .unwrap()
            .store(prev, std::sync::atomic::Ordering::Relaxed);
        prev = off;
        off += 8;
    }
    // Head of the counter-block list (KIND_WORDS + 32).
    view.atomic_u64(heapdump_table::header::offsets::KIND_WORDS + 32)
        .unwrap()
        .store(prev, std::sync::atomic::Ordering::Relaxed);
    let rr = region.open_reader().unwrap();
    let r = ResourcesReader::new(&rr).unwrap();
    let cat = r.stacks();
    assert!(cat.partial.is_some());
}
