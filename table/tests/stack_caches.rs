//! Per-thread stack caches of the resources table (counter blocks before
//! format 1.6): a stack's cumulative count is its record's own counters
//! plus its slots in every block, across claims, releases, reuse by
//! another thread, replacement in full sets, and threads counting at once;
//! counter blocks written by format 1.5 agents are still read.

use heapdump_table::header::offsets::KIND_WORDS;
use heapdump_table::resources_table::{CACHE_SETS, CACHE_WAYS, COUNTER_SLOTS};
use heapdump_table::stack_compression::encode;
use heapdump_table::{RegionKind, ResourceKey, ResourcesReader, ResourcesWriter};
use std::sync::atomic::Ordering;

fn key_of(w: &ResourcesWriter, i: u64) -> ResourceKey {
    let mut b = Vec::new();
    encode(&[0x5555_0000_0000 + i * 16, 0x5555_0001_0000], &mut b);
    w.intern_stack_trace(&b).unwrap().0
}

/// A trace hash for stack `i` (never 0), spread over the sets.
fn hash_of(i: u64) -> u64 {
    (i + 1).wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1
}

/// Counts one allocation of `bytes` from stack `i` the way the agent does:
/// found by its hash, else put into its set (each set's ways in turn).
fn count(
    w: &ResourcesWriter,
    cache: heapdump_table::resources_table::StackCache,
    next: &mut [u8],
    i: u64,
    key: ResourceKey,
    bytes: u64,
) {
    let h = hash_of(i);
    let slot = match w.cache_find(cache, h) {
        Some((slot, k)) => {
            assert_eq!(k, key, "a hit gives the key the trace was put in with");
            slot
        }
        None => {
            let set = ResourcesWriter::cache_set_of(h);
            let slot = w.cache_insert(cache, h, key, next[set]);
            next[set] = next[set].wrapping_add(1);
            assert_eq!(w.cache_find(cache, h), Some((slot, key)));
            slot
        }
    };
    // SAFETY: `slot` is from this writer, just now.
    unsafe { w.cache_count(slot, 1, bytes) };
}

#[test]
fn caches_add_up_exactly_across_threads_reuse_and_replacement() {
    let region = ResourcesWriter::create_region(64 << 20, 1024).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let n_stacks = 3 * COUNTER_SLOTS; // more stacks than a cache has slots
    let keys: Vec<ResourceKey> = (0..n_stacks).map(|i| key_of(&w, i)).collect();
    std::thread::scope(|s| {
        for t in 0..4u64 {
            let (w, keys) = (&w, &keys);
            s.spawn(move || {
                // Two claims per thread: the second may reuse a cache another
                // thread released, and keeps adding to its sums.
                for round in 0..2u64 {
                    let cache = w.claim_stack_cache(100 + t).expect("room for a cache");
                    let mut next = vec![0u8; CACHE_SETS as usize];
                    for rep in 0..3u64 {
                        for (i, k) in keys.iter().enumerate() {
                            let size = 1 + (i as u64 % 7) + rep + round;
                            count(w, cache, &mut next, i as u64, *k, size);
                        }
                    }
                    w.release_stack_cache(cache);
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
    // Caches were reused: no more than one per thread alive at once.
    assert!(w.claim_stack_cache(1).is_some());
}

#[test]
fn a_released_cache_is_inherited_with_its_traces() {
    let region = ResourcesWriter::create_region(16 << 20, 64).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let k = key_of(&w, 3);
    let a = w.claim_stack_cache(5).unwrap();
    let mut next = vec![0u8; CACHE_SETS as usize];
    count(&w, a, &mut next, 3, k, 40);
    w.release_stack_cache(a);
    let b = w.claim_stack_cache(6).unwrap();
    assert_eq!(a, b, "the released cache is handed out again");
    assert!(
        w.cache_find(b, hash_of(3)).is_some_and(|(_, key)| key == k),
        "with the trace it held"
    );
    assert_eq!(w.cache_find(b, hash_of(4)), None);
    let other = w.claim_stack_cache(7).unwrap();
    assert_ne!(other, b, "a cache in use is not handed out twice");
    assert_eq!(
        w.cache_find(other, hash_of(3)),
        None,
        "a new cache is empty"
    );
}

#[test]
fn a_full_set_replaces_its_ways_in_turn_and_moves_the_counts_to_the_record() {
    let region = ResourcesWriter::create_region(16 << 20, 64).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let cache = w.claim_stack_cache(5).unwrap();
    // Hashes of one set: equal bits 20..28.
    let hashes: Vec<u64> = (0..CACHE_WAYS + 2).map(|i| (i << 40) | 1).collect();
    let keys: Vec<ResourceKey> = (0..hashes.len() as u64).map(|i| key_of(&w, i)).collect();
    let mut slots = Vec::new();
    for (i, (h, k)) in hashes.iter().zip(&keys).enumerate() {
        let slot = w.cache_insert(cache, *h, *k, i as u8);
        // SAFETY: the slot is this writer's.
        unsafe { w.cache_count(slot, 2, 20) };
        slots.push(slot);
    }
    // The first four took the empty ways; the fifth replaced way 4 % 4 = 0,
    // the sixth way 1: those stacks are no longer cached.
    assert_eq!(slots[4], slots[0]);
    assert_eq!(slots[5], slots[1]);
    assert_eq!(w.cache_find(cache, hashes[0]), None);
    assert_eq!(w.cache_find(cache, hashes[1]), None);
    for i in 2..hashes.len() {
        assert_eq!(w.cache_find(cache, hashes[i]), Some((slots[i], keys[i])));
    }
    let rr = region.open_reader().unwrap();
    let cat = ResourcesReader::new(&rr).unwrap().stacks();
    assert_eq!(cat.partial, None);
    for k in &keys {
        let s = &cat.stacks[cat.by_key[k]];
        assert_eq!((s.alloc_count, s.alloc_bytes), (2, 20), "every count kept");
    }
}

/// Forges `n` overlapping blocks with header word `w0`, chained, as the
/// head of the stack-cache list.
fn forge_overlapping_blocks(region: &heapdump_table::RegionWriter, w0: u64) {
    let view = region.view();
    let start = heapdump_table::header::HEADER_SIZE + 64 * 8 + 4096 * 2;
    let end = start + 8 * 20_000;
    let mut prev = 0u64;
    let mut off = start;
    while off < end {
        view.atomic_u64(off).unwrap().store(w0, Ordering::Relaxed);
        view.atomic_u64(off + 8)
            .unwrap()
            .store(prev, Ordering::Relaxed);
        prev = off;
        off += 8;
    }
    view.atomic_u64(KIND_WORDS + 32)
        .unwrap()
        .store(prev, Ordering::Relaxed);
}

#[test]
fn overlapping_hostile_blocks_end_quickly_and_say_partial() {
    // Thousands of blocks one every 8 bytes, each claiming the largest
    // slot count: of either kind the list holds.
    for tag in [0x4341_4353u32, 0x5254_4e43] {
        let region = ResourcesWriter::create_region(8 << 20, 64).unwrap();
        let w = ResourcesWriter::new(&region).unwrap();
        let k = key_of(&w, 1);
        let cache = w.claim_stack_cache(7).unwrap();
        let mut next = vec![0u8; CACHE_SETS as usize];
        count(&w, cache, &mut next, 1, k, 10);
        forge_overlapping_blocks(&region, u64::from(tag) | (1u64 << 16) << 32);
        let rr = region.open_reader().unwrap();
        let r = ResourcesReader::new(&rr).unwrap();
        let cat = r.stacks();
        assert!(cat.partial.is_some(), "tag {tag:#x}");
        // The writer's own walk of the list ends too (at the first block
        // that is not well formed) and makes a new cache.
        assert!(w.claim_stack_cache(8).is_some());
    }
}

#[test]
fn counter_blocks_of_format_1_5_are_still_read() {
    // A 1.5 agent's block: `CNTR | slots << 32`, next, owner, then 24-byte
    // slots (key, count, bytes). Forged in the space of a claimed cache
    // (inside the data area, below the bump pointer).
    let region = ResourcesWriter::create_region(16 << 20, 64).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let keys: Vec<ResourceKey> = (0..3).map(|i| key_of(&w, i)).collect();
    let cache = w.claim_stack_cache(5).unwrap();
    let mut next = vec![0u8; CACHE_SETS as usize];
    count(&w, cache, &mut next, 0, keys[0], 7);
    let view = region.view();
    let head = view.atomic_u64(KIND_WORDS + 32).unwrap();
    let ours = head.load(Ordering::Relaxed);
    // The old block goes just past our cache's end (which leaves it on
    // the list) in space reserved by a second cache.
    w.claim_stack_cache(6).unwrap();
    let old = head.load(Ordering::Relaxed);
    assert_ne!(old, ours);
    let word = |off: u64, v: u64| view.atomic_u64(off).unwrap().store(v, Ordering::Relaxed);
    word(old, 0x5254_4e43 | COUNTER_SLOTS << 32);
    word(old + 16, 0);
    for (i, (k, c, b)) in [(keys[1], 3, 30), (keys[2], 4, 400), (keys[0], 1, 1)]
        .into_iter()
        .enumerate()
    {
        let slot = old + 32 + 24 * (500 + i as u64);
        word(slot, k.0);
        word(slot + 8, c);
        word(slot + 16, b);
    }
    let rr = region.open_reader().unwrap();
    let cat = ResourcesReader::new(&rr).unwrap().stacks();
    assert_eq!(cat.partial, None);
    let got = |k: &ResourceKey| {
        let s = &cat.stacks[cat.by_key[k]];
        (s.alloc_count, s.alloc_bytes)
    };
    assert_eq!(
        got(&keys[0]),
        (2, 8),
        "the cache's slot and the old block's"
    );
    assert_eq!(got(&keys[1]), (3, 30));
    assert_eq!(got(&keys[2]), (4, 400));
    // A writer never claims the old block as a cache (its walk of the
    // list ends there, and it makes a new one).
    let again = w.claim_stack_cache(9).unwrap();
    assert_ne!(again, cache);
    assert!(w.cache_find(again, hash_of(0)).is_none());
}

#[test]
fn a_reader_never_credits_a_stack_with_counts_of_the_stack_that_took_its_slot() {
    // One writer keeps replacing (eight times more stacks than slots, each
    // counted in one burst) while a reader sums all along. A slot's counts
    // credited to the wrong stack, or twice (its slot and then its record),
    // show as a stack counted more than its one burst.
    use std::sync::atomic::AtomicBool;
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
            let cache = w.claim_stack_cache(9).unwrap();
            let mut next = vec![0u8; CACHE_SETS as usize];
            for (i, k) in keys.iter().enumerate() {
                for _ in 0..BURST {
                    count(&w, cache, &mut next, i as u64, *k, 1);
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

#[test]
fn a_hinted_lookup_finds_what_the_scan_finds_whatever_the_hint() {
    let region = ResourcesWriter::create_region(16 << 20, 64).unwrap();
    let w = ResourcesWriter::new(&region).unwrap();
    let cache = w.claim_stack_cache(9).unwrap();
    // Five traces of one set (four ways): the first is replaced by the
    // fifth, so a hint it gave once goes stale.
    let set = 17u64;
    let hash = |i: u64| (i + 1) << 40 | set << 20 | 1;
    let mut next = 0u8;
    let mut hints = Vec::new();
    for i in 0..5u64 {
        let key = key_of(&w, i);
        let slot = w.cache_insert(cache, hash(i), key, next);
        next = next.wrapping_add(1);
        let (s, k, hint) = w.cache_find_hinted(cache, hash(i), u16::MAX).unwrap();
        assert_eq!((s, k), (slot, key));
        hints.push(hint);
    }
    assert_eq!(hints[4], hints[0], "the fifth trace took the first's way");
    assert_eq!(w.cache_find_hinted(cache, hash(0), hints[0]), None);
    for i in 1..5u64 {
        let want = w.cache_find(cache, hash(i)).unwrap();
        let tries = (0..COUNTER_SLOTS as u16 + 8).chain([u16::MAX]);
        for hint in tries {
            let (s, k, h) = w.cache_find_hinted(cache, hash(i), hint).unwrap();
            assert_eq!(
                (s, k, h),
                (want.0, want.1, hints[i as usize]),
                "hint {hint}"
            );
        }
    }
    assert_eq!(w.cache_find_hinted(cache, hash(9), hints[1]), None);
}
