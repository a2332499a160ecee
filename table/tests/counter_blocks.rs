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

#[test]
fn a_busy_stack_takes_a_slot_from_rarely_counted_ones_in_a_full_block() {
    // A program with more stacks than a block has slots, most counted
    // once at start (redis: ~2 200): its busiest stacks still get slots,
    // so they are counted with plain stores, not shared atomic adds.
    let region = ResourcesWriter::create_region(64 << 20, 1024).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let cold: Vec<ResourceKey> = (0..3 * COUNTER_SLOTS).map(|i| key_of(&w, i)).collect();
    let hot: Vec<ResourceKey> = (0..64).map(|i| key_of(&w, 1_000_000 + i)).collect();
    let block = w.claim_counters(7).unwrap();
    for k in &cold {
        w.count_allocation(block, *k, 3, u32::MAX);
    }
    let mut hints = vec![u32::MAX; hot.len()];
    for round in 0..100u64 {
        for (i, k) in hot.iter().enumerate() {
            let got = w.count_allocation(block, *k, 5, hints[i]);
            let slot = got.expect("a busy stack has a slot");
            if round > 0 {
                assert_eq!(slot, hints[i], "and keeps it");
            }
            hints[i] = slot;
        }
    }
    let rr = region.open_reader().unwrap();
    let r = ResourcesReader::new(&rr).unwrap();
    let cat = r.stacks();
    assert_eq!(cat.partial, None);
    for k in &cold {
        let s = &cat.stacks[cat.by_key[k]];
        assert_eq!((s.alloc_count, s.alloc_bytes), (1, 3));
    }
    for k in &hot {
        let s = &cat.stacks[cat.by_key[k]];
        assert_eq!((s.alloc_count, s.alloc_bytes), (100, 500));
    }
}

#[test]
fn a_reader_never_credits_a_stack_with_counts_of_the_stack_that_took_its_slot() {
    // One writer keeps evicting (eight times more stacks than slots, each
    // counted in one burst) while a reader sums all along. A slot's counts
    // credited to the wrong stack, or twice (its slot and then its record),
    // show as a stack counted more than its one burst.
    use std::sync::atomic::{AtomicBool, Ordering};
    let region = ResourcesWriter::create_region(64 << 20, 1024).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let keys: Vec<ResourceKey> = (0..8 * COUNTER_SLOTS).map(|i| key_of(&w, i)).collect();
    const BURST: u64 = 50;
    let (started, done) = (AtomicBool::new(false), AtomicBool::new(false));
    let mut reads = 0;
    std::thread::scope(|s| {
        s.spawn(|| {
            // Starts once the reader does (without waiting for it if it
            // never does: the check below needs no overlap to pass).
            for _ in 0..1_000_000 {
                if started.load(Ordering::Acquire) {
                    break;
                }
                std::hint::spin_loop();
            }
            let block = w.claim_counters(9).unwrap();
            for k in &keys {
                let mut hint = u32::MAX;
                for _ in 0..BURST {
                    if let Some(h) = w.count_allocation(block, *k, 1, hint) {
                        hint = h;
                    }
                }
            }
            done.store(true, Ordering::Release);
        });
        let rr = region.open_reader().unwrap();
        let r = ResourcesReader::new(&rr).unwrap();
        started.store(true, Ordering::Release);
        while !done.load(Ordering::Acquire) || reads == 0 {
            let cat = r.stacks();
            for st in &cat.stacks {
                assert!(st.alloc_count <= BURST, "over-counted: {}", st.alloc_count);
                assert!(
                    st.alloc_bytes <= BURST,
                    "over-counted: {} bytes",
                    st.alloc_bytes
                );
            }
            reads += 1;
        }
    });
    let rr = region.open_reader().unwrap();
    let cat = ResourcesReader::new(&rr).unwrap().stacks();
    for k in &keys {
        let st = &cat.stacks[cat.by_key[k]];
        assert_eq!((st.alloc_count, st.alloc_bytes), (BURST, BURST));
    }
}
