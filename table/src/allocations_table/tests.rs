//! Unit and property tests of the allocations table (writer, index,
//! shards and reader together, against models).

use super::*;
use crate::allocations_table::reader::NodeRead;
use proptest::prelude::*;
use std::collections::HashMap;

fn region(capacity: u64, shards: u64) -> RegionWriter {
    AllocationsWriter::create_region(AllocationsConfig { capacity, shards }).unwrap()
}

fn rec(address: u64, size: u64) -> AllocationRecord {
    AllocationRecord {
        address,
        size,
        stack: ResourceKey((address % 1000) * 8 + 8192),
        thread: ResourceKey((size % 77) * 8),
        timestamp_us: address ^ size,
    }
    .normalized()
}

impl AllocationRecord {
    fn normalized(mut self) -> Self {
        self.timestamp_us &= SIZE_MASK;
        self
    }
}

/// The table's content, via a real read-only mapping.
fn walk_map(r: &RegionWriter) -> HashMap<u64, AllocationRecord> {
    let rr = r.open_reader().unwrap();
    let reader = AllocationsReader::new(&rr).unwrap();
    let mut out = HashMap::new();
    let stats = reader.walk(|rec| {
        assert!(out.insert(rec.address, *rec).is_none(), "reported twice");
    });
    assert_eq!(stats.unstable, 0);
    assert_eq!(stats.reported as usize, out.len());
    out
}

#[derive(Default)]
struct Model {
    live: HashMap<u64, AllocationRecord>,
    live_bytes: u64,
    peak: u64,
    total_allocs: u64,
    total_bytes: u64,
}

impl Model {
    fn alloc(&mut self, r: AllocationRecord) {
        self.live.insert(r.address, r);
        self.live_bytes += r.size;
        self.peak = self.peak.max(self.live_bytes);
        self.total_allocs += 1;
        self.total_bytes += r.size;
    }
    fn free(&mut self, addr: u64) -> Option<u64> {
        let r = self.live.remove(&addr)?;
        self.live_bytes -= r.size;
        Some(r.size)
    }
    fn check(&self, r: &RegionWriter) {
        self.check_peak(r, true);
    }
    /// `exact_peak: false` with node caches: the peak follows a running
    /// total that each cache folds into every `LIVE_BATCH` bytes, so it
    /// may trail, or lead by the frees still pending in other caches (at
    /// most one batch for each of the up to four caches a test uses).
    fn check_peak(&self, r: &RegionWriter, exact_peak: bool) {
        assert_eq!(walk_map(r), self.live);
        let rr = r.open_reader().unwrap();
        let c = AllocationsReader::new(&rr).unwrap().counters();
        assert_eq!(c.live_blocks, self.live.len() as u64);
        assert_eq!(c.live_bytes, self.live_bytes);
        if exact_peak {
            assert_eq!(c.peak_live_bytes, self.peak);
        } else {
            let lead = 4 * LIVE_BATCH as u64;
            assert!(
                c.peak_live_bytes <= self.peak + lead && c.peak_live_bytes >= self.live_bytes,
                "peak {} model peak {} live {}",
                c.peak_live_bytes,
                self.peak,
                self.live_bytes
            );
        }
        assert_eq!(c.total_allocs, self.total_allocs);
        assert_eq!(c.total_bytes, self.total_bytes);
        assert_eq!(AllocationsWriter::new(r).unwrap().stats(), c);
    }
}

#[test]
fn insert_remove_replace() {
    let r = region(1024, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut m = Model::default();
    let a = rec(0x1000, 10);
    w.insert(&a).unwrap();
    m.alloc(a);
    assert_eq!(w.insert(&rec(0x1000, 99)), Err(InsertError::Duplicate));
    assert_eq!(w.remove(0x2000), None);
    m.check(&r);
    // In place.
    let a2 = rec(0x1000, 20);
    assert_eq!(w.replace(0x1000, &a2), Ok(Some(10)));
    m.free(0x1000);
    m.alloc(a2);
    m.check(&r);
    // Moving.
    let b = rec(0x3000, 30);
    assert_eq!(w.replace(0x1000, &b), Ok(Some(20)));
    m.free(0x1000);
    m.alloc(b);
    m.check(&r);
    // Replacing an unknown address inserts.
    let c = rec(0x5000, 5);
    assert_eq!(w.replace(0x4000, &c), Ok(None));
    m.alloc(c);
    assert_eq!(w.replace(0x5000, &rec(0x5000, 6)), Ok(Some(5)));
    m.free(0x5000);
    m.alloc(rec(0x5000, 6));
    // Moving onto a live address: the old one is gone, the new refused.
    assert_eq!(
        w.replace(0x5000, &rec(0x3000, 1)),
        Err(InsertError::Duplicate)
    );
    m.free(0x5000);
    m.check(&r);
    assert_eq!(w.remove(0x3000), Some(30));
    assert_eq!(w.remove(0x3000), None);
    m.free(0x3000);
    m.check(&r);
}

#[test]
fn extreme_fields_round_trip() {
    let r = region(64, 1);
    let w = AllocationsWriter::new(&r).unwrap();
    let max = AllocationRecord {
        address: u64::MAX,
        size: SIZE_MASK,
        stack: ResourceKey((1 << 35) - 8),
        thread: ResourceKey((1 << 35) - 8),
        timestamp_us: SIZE_MASK,
    };
    let min = AllocationRecord {
        address: 1,
        size: 0,
        stack: ResourceKey(0),
        thread: ResourceKey(0),
        timestamp_us: 0,
    };
    w.insert(&max).unwrap();
    w.insert(&min).unwrap();
    let got = walk_map(&r);
    assert_eq!(got[&u64::MAX], max);
    assert_eq!(got[&1], min);
    // Unrepresentable records are refused, not mangled.
    for bad in [
        AllocationRecord { address: 0, ..min },
        AllocationRecord {
            stack: ResourceKey(12),
            ..min
        },
        AllocationRecord {
            thread: ResourceKey(1 << 35),
            ..min
        },
        AllocationRecord {
            stack: ResourceKey(u64::MAX - 7),
            ..min
        },
    ] {
        assert_eq!(w.insert(&bad), Err(InsertError::Unrepresentable));
    }
    // Sizes above 48 bits are clamped, and the counters agree.
    w.insert(&AllocationRecord {
        address: 2,
        size: u64::MAX,
        ..min
    })
    .unwrap();
    assert_eq!(w.remove(2), Some(SIZE_MASK));
    assert_eq!(w.remove(u64::MAX), Some(SIZE_MASK));
    assert_eq!(w.remove(1), Some(0));
    assert_eq!(w.stats().live_bytes, 0);
    assert_eq!(w.stats().live_blocks, 0);
}

#[test]
fn full_table_counts_drops() {
    let r = region(8, 1);
    let w = AllocationsWriter::new(&r).unwrap();
    for i in 1..=8 {
        w.insert(&rec(i * 16, i)).unwrap();
    }
    assert_eq!(w.insert(&rec(0x1000, 1)), Err(InsertError::Full));
    assert_eq!(w.insert(&rec(0x2000, 1)), Err(InsertError::Full));
    // A duplicate is reported as such, not as a drop.
    assert_eq!(w.insert(&rec(16, 1)), Err(InsertError::Duplicate));
    let c = w.stats();
    assert_eq!(c.dropped[DroppedReason::AllocationsFull as usize], 2);
    assert_eq!(c.dropped_total(), 2);
    assert_eq!(c.live_blocks, 8);
    // Moving replace when full: the old block goes, the new one fits.
    assert_eq!(w.replace(16, &rec(0x3000, 3)), Ok(Some(1)));
    assert_eq!(w.remove(32), Some(2));
    w.insert(&rec(0x1000, 1)).unwrap();
    assert_eq!(walk_map(&r).len(), 8);
}

/// A small deterministic random sequence (xorshift64) from `seed`.
fn xorshift(mut x: u64) -> impl FnMut() -> u64 {
    move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    }
}

#[test]
fn many_operations_match_a_model() {
    let r = region(1 << 15, 8);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut m = Model::default();
    let mut next = xorshift(0x1234_5678_9abc_def0u64);
    // Grow to ~20k live (index windows grow), churn, then shrink to a
    // few hundred (windows shrink), checking against the model.
    for round in 0..3 {
        for _ in 0..20_000 {
            let addr = 0x5555_0000_0000 + (next() % 60_000) * 16;
            let size = next() % 5000;
            let op = next() % 10;
            let target = if round == 2 { 1 } else { 6 };
            if op < target {
                let res = w.insert(&rec(addr, size));
                if m.live.contains_key(&addr) {
                    assert_eq!(res, Err(InsertError::Duplicate));
                } else {
                    res.unwrap();
                    m.alloc(rec(addr, size));
                }
            } else if op < 9 {
                assert_eq!(w.remove(addr), m.free(addr));
            } else {
                let new = if next().is_multiple_of(2) {
                    addr
                } else {
                    addr + 8
                };
                let res = w.replace(addr, &rec(new, size));
                let old = m.free(addr);
                if m.live.contains_key(&new) {
                    assert_eq!(res, Err(InsertError::Duplicate));
                } else {
                    assert_eq!(res, Ok(old));
                    m.alloc(rec(new, size));
                }
            }
        }
        m.check(&r);
        assert_eq!(
            unshared_map(&w),
            m.live,
            "round {round}: the writer's own walk"
        );
    }
    // Empty it: nothing left, index memory returned.
    let before = r.resident_bytes().unwrap();
    let addrs: Vec<u64> = m.live.keys().copied().collect();
    for a in addrs {
        assert_eq!(w.remove(a), m.free(a));
    }
    m.check(&r);
    assert!(r.resident_bytes().unwrap() <= before);
}

/// The table's content, as the writer's own walk (no reader) gives it.
fn unshared_map(w: &AllocationsWriter) -> HashMap<u64, AllocationRecord> {
    let mut out = HashMap::new();
    w.for_each_live_unshared(|rec| {
        assert!(out.insert(rec.address, rec).is_none(), "reported twice");
    })
    .unwrap();
    out
}

#[test]
fn the_writers_own_walk_stops_at_a_node_mid_update() {
    let r = region(1 << 10, 1);
    let w = AllocationsWriter::new(&r).unwrap();
    w.insert(&rec(0x1000, 10)).unwrap();
    w.insert(&rec(0x2000, 20)).unwrap();
    assert_eq!(unshared_map(&w).len(), 2);
    assert!(w.node_high_water() >= 2);
    // A writer preempted inside its seqlock write (seq odd): the walk
    // cannot tell what the node holds.
    let seq = w.node_word(0, 0);
    let before = seq.load(Ordering::Relaxed);
    seq.store(before | 1, Ordering::Relaxed);
    assert_eq!(
        w.for_each_live_unshared(|_| {}),
        Err(UnsharedWalkError::Changing)
    );
    seq.store(before, Ordering::Relaxed);
    assert_eq!(unshared_map(&w).len(), 2);
}

#[test]
fn direct_and_indexed_blocks_mix_exactly() {
    // Half the blocks direct (by node), half through the index, in the
    // same shards; the index's load factor counts only its own, so it
    // neither grows for the direct blocks nor overflows.
    let r = region(1 << 15, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut cache = NodeCache::new();
    let mut m = Model::default();
    let mut direct: HashMap<u64, u32> = HashMap::new();
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15u64);
    for round in 0..3 {
        for _ in 0..20_000 {
            let addr = 0x7777_0000_0000 + (next() % 30_000) * 16;
            let size = next() % 3000 + 1;
            let grow = if round == 2 { 2 } else { 6 };
            if m.live.contains_key(&addr) {
                if next() % 10 >= grow {
                    let got = match direct.remove(&addr) {
                        Some(node) => {
                            // The index does not know a direct block.
                            assert_eq!(w.remove(addr), None);
                            w.remove_direct(addr, node, &mut cache)
                        }
                        None => w.remove_cached(addr, &mut cache),
                    };
                    assert_eq!(got, m.free(addr));
                }
            } else if next().is_multiple_of(2) {
                let node = w.insert_direct(&rec(addr, size), &mut cache).unwrap();
                direct.insert(addr, node);
                m.alloc(rec(addr, size));
            } else {
                w.insert_cached(&rec(addr, size), &mut cache).unwrap();
                m.alloc(rec(addr, size));
            }
        }
        w.flush_cache(&mut cache);
        m.check_peak(&r, false);
    }
    // A node that does not hold the address removes nothing.
    if let Some((&addr, &node)) = direct.iter().next() {
        assert_eq!(w.remove_direct(addr + 16, node, &mut cache), None);
        assert_eq!(w.remove_direct(addr, node ^ 1, &mut cache), None);
        assert_eq!(w.remove_direct(addr, u32::MAX, &mut cache), None);
        assert_eq!(w.remove_direct(0, node, &mut cache), None);
    }
    for (addr, node) in direct.drain() {
        assert_eq!(w.remove_direct(addr, node, &mut cache), m.free(addr));
    }
    let rest: Vec<u64> = m.live.keys().copied().collect();
    for a in rest {
        assert_eq!(w.remove_cached(a, &mut cache), m.free(a));
    }
    w.flush_cache(&mut cache);
    m.check_peak(&r, false);
}

#[test]
fn a_crowded_address_range_spills_and_every_block_stays_exact() {
    // 8 shards: 2 groups of 4. Each shard's index holds at most 896
    // blocks (1024-slot windows at 7/8), so one 64 MiB range (one
    // group) overflows past 3584 live blocks and spills.
    let r = region(4096, 8);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut m = Model::default();
    let addr = |i: u64| 0x7f00_0000_0000 + i * 48;
    for i in 0..3900 {
        w.insert(&rec(addr(i), 16 + i)).unwrap();
        m.alloc(rec(addr(i), 16 + i));
    }
    m.check(&r);
    assert!(
        (0..8).any(|s| w.spilled(s)),
        "the crowded group never spilled"
    );
    let mut x = 0x2545_f491_4f6c_dd1du64;
    for round in 0..4 {
        for i in 0..3000u64 {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            let a = addr(x % 3950);
            let size = 16 + x % 4000;
            match (x >> 40) % 4 {
                0 => {
                    let res = w.insert(&rec(a, size));
                    if m.live.contains_key(&a) {
                        assert_eq!(res, Err(InsertError::Duplicate));
                    } else {
                        assert_eq!(res, Ok(()), "insert {i} of round {round}");
                        m.alloc(rec(a, size));
                    }
                }
                1 => assert_eq!(w.remove(a), m.free(a)),
                _ => {
                    // realloc in place: a spilled block is rewritten
                    // where it lives
                    let res = w.replace(a, &rec(a, size));
                    let old = m.free(a);
                    assert_eq!(res, Ok(old));
                    m.alloc(rec(a, size));
                }
            }
        }
        m.check(&r);
    }
    for a in m.live.keys().copied().collect::<Vec<_>>() {
        assert_eq!(w.remove(a), m.free(a));
    }
    m.check(&r);
}

#[test]
fn blocks_of_two_address_ranges_use_disjoint_shard_groups() {
    let r = region(1 << 16, 256);
    let w = AllocationsWriter::new(&r).unwrap();
    // Two 64 MiB ranges whose groups differ (found, not assumed).
    let a = 0x7f00_0000_0000u64;
    let b = (1..64)
        .map(|k| a + (k << GROUP_SHIFT))
        .find(|b| w.home_shard(*b, 0) >> w.sub_bits != w.home_shard(a, 0) >> w.sub_bits)
        .expect("another group");
    let shards = |base: u64| -> std::collections::HashSet<u64> {
        (0..4096u64)
            .map(|i| {
                let addr = base + i * 64;
                w.home_shard(addr, hash(addr))
            })
            .collect()
    };
    let (sa, sb) = (shards(a), shards(b));
    assert_eq!(sa.len(), 16, "a group's 16 shards all get blocks");
    assert!(sa.is_disjoint(&sb));
}

/// Whether this system gives a region's pages back on `MADV_REMOVE` (a
/// Linux kernel does; qemu-user, where CI runs the aarch64 tests, ignores
/// the advice).
fn pages_are_given_back_here() -> bool {
    let r = region(1 << 17, 4);
    let before = r.resident_bytes().unwrap();
    let view = r.view();
    let end = view.len() as u64 / 4096 * 4096;
    let (off, len) = (end - 64 * 4096, 64 * 4096);
    for p in (off..end).step_by(4096) {
        view.atomic_u64(p).unwrap().store(1, Ordering::Relaxed);
    }
    let touched = r.resident_bytes().unwrap();
    r.release_range(off, len);
    let after = r.resident_bytes().unwrap();
    touched > before && after < touched
}

#[test]
fn index_memory_follows_live_count() {
    if !pages_are_given_back_here() {
        eprintln!("skipped: this system does not give pages back on MADV_REMOVE (qemu-user)");
        return;
    }
    let r = region(1 << 17, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let base = r.resident_bytes().unwrap();
    for i in 0..100_000u64 {
        w.insert(&rec(0x7000_0000 + i * 32, 24)).unwrap();
    }
    let full = r.resident_bytes().unwrap();
    for i in 0..100_000u64 {
        assert_eq!(w.remove(0x7000_0000 + i * 32), Some(24));
    }
    let after = r.resident_bytes().unwrap();
    // Nodes stay (free lists), index windows shrink back to a page.
    let nodes = 100_000 * NODE_SIZE;
    assert!(full - base >= nodes);
    assert!(
        after - base < nodes + 64 * 4096,
        "base {base} full {full} after {after}"
    );
    // At least 4 bytes of index per live block were given back.
    assert!(full - after > 100_000 * 4, "full {full} after {after}");
}

#[derive(Debug, Clone)]
enum Op {
    Insert(u64, u64),
    Remove(u64),
    Replace(u64, u64, u64),
}

fn addr() -> impl Strategy<Value = u64> {
    prop_oneof![
        // A small pool: many collisions, duplicates and misses.
        (1u64..48).prop_map(|i| 0x5555_0000_1000 + i * 16),
        // Same low bits, different high bits.
        (1u64..16).prop_map(|i| i << 40 | 0x10),
        any::<u64>().prop_map(|a| a.max(1)),
    ]
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (addr(), 0u64..1 << 20).prop_map(|(a, s)| Op::Insert(a, s)),
        3 => addr().prop_map(Op::Remove),
        2 => (addr(), addr(), 0u64..1 << 20).prop_map(|(a, b, s)| Op::Replace(a, b, s)),
        1 => (addr(), 0u64..1 << 20).prop_map(|(a, s)| Op::Replace(a, a, s)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn random_operations_match_a_model(ops in proptest::collection::vec(op(), 0..400), shards in prop_oneof![Just(1u64), Just(2), Just(64)]) {
        let r = region(4096, shards);
        let w = AllocationsWriter::new(&r).unwrap();
        let mut m = Model::default();
        for op in ops {
            match op {
                Op::Insert(a, s) => {
                    let res = w.insert(&rec(a, s));
                    if m.live.contains_key(&a) {
                        prop_assert_eq!(res, Err(InsertError::Duplicate));
                    } else {
                        prop_assert_eq!(res, Ok(()));
                        m.alloc(rec(a, s));
                    }
                }
                Op::Remove(a) => prop_assert_eq!(w.remove(a), m.free(a)),
                Op::Replace(a, b, s) => {
                    let res = w.replace(a, &rec(b, s));
                    let old = m.free(a);
                    if m.live.contains_key(&b) {
                        prop_assert_eq!(res, Err(InsertError::Duplicate));
                    } else {
                        prop_assert_eq!(res, Ok(old));
                        m.alloc(rec(b, s));
                    }
                }
            }
        }
        m.check(&r);
    }
}

#[test]
fn retries_on_a_node_that_never_settles_stop_at_the_deadline() {
    // Regression (found by fuzz/region_header under load): the second
    // pass allowed 20 000 yields per node and checked the walk's time
    // limit only between nodes; one yield can take a scheduler slice,
    // so a node left mid-update (target killed, or hostile) could hold
    // a snapshot for minutes. With the deadline in the retry loop, even
    // an unbounded try count ends.
    let r = region(64, 1);
    let w = AllocationsWriter::new(&r).unwrap();
    w.insert(&rec(0x1000, 8)).unwrap();
    let nodes_off = r.header().layout[4];
    let view = r.view();
    // The writer "killed" mid-update: its node's sequence word odd.
    view.atomic_u64(nodes_off)
        .unwrap()
        .fetch_or(1, Ordering::Relaxed);
    let rr = r.open_reader().unwrap();
    let reader = AllocationsReader::new(&rr).unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_millis(20);
    let (res, used) = reader.read_node_retrying(0, u32::MAX, 32, Some(deadline));
    assert!(matches!(res, NodeRead::Changing));
    assert!(used < u32::MAX);
    let stats = reader.walk(|_| {});
    assert_eq!((stats.reported, stats.unstable), (0, 1));
}

#[test]
fn a_forged_high_water_mark_costs_the_reader_no_memory() {
    // The target writes the node high-water mark itself: set to the
    // capacity (here 4 M nodes, 128 MiB of node array), a walk that read
    // every node would fault in 128 MiB of the memfd, charged to the
    // reader. It reads only pages holding data.
    let r = region(4 << 20, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    for i in 0..1000u64 {
        w.insert(&rec(0x7000_0000 + i * 32, 24)).unwrap();
    }
    let layout = w.layout;
    // What a hostile target writes into its own header.
    r.view()
        .atomic_u64(W_NODE_HW)
        .unwrap()
        .store(layout.capacity, Ordering::Relaxed);
    let rr = r.open_reader().unwrap();
    let before = r.resident_bytes().unwrap();
    let reader = AllocationsReader::new(&rr).unwrap();
    let mut n = 0;
    let stats = reader.walk(|_| n += 1);
    let after = r.resident_bytes().unwrap();
    assert_eq!(n, 1000);
    assert_eq!(stats.nodes, layout.capacity);
    assert!(
        after - before < 1 << 20,
        "the walk faulted in {} bytes",
        after - before
    );
}

#[test]
fn young_blocks_match_a_model_whoever_frees_them_in_either_order() {
    // Three writer "threads" (rings) and one without a ring insert and
    // free in one order, each freeing blocks the others allocated too, so
    // blocks are freed while young in their own ring, young in another's,
    // after promotion, and never. The threads with a ring also put a third
    // of their blocks straight into the index, and free half the time
    // without naming their ring (as one bypassing its ring does, see the
    // agent's `young_policy`): the same blocks are found either way.
    let r = region(1 << 14, 8);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let rings: Vec<u32> = (0..3).map(|_| w.claim_young(&reg).unwrap()).collect();
    let mut caches: Vec<NodeCache> = (0..4).map(|_| NodeCache::new()).collect();
    let mut m = Model::default();
    let mut next = xorshift(0x2545_f491_4f6c_dd1d);
    for round in 0..4 {
        for _ in 0..20_000 {
            let addr = 0x6666_0000_0000 + (next() % 4_000) * 16;
            let who = (next() % 4) as usize;
            let own = rings.get(who).copied();
            if m.live.contains_key(&addr) {
                let named = own.filter(|_| next().is_multiple_of(2));
                let got = w.remove_any(addr, &reg, named, &mut caches[who]);
                assert_eq!(got.map(|f| f.size), m.free(addr));
            } else if round < 3 || next().is_multiple_of(3) {
                let size = next() % 3000 + 1;
                match own.filter(|_| !next().is_multiple_of(3)) {
                    Some(k) => w.insert_young(&rec(addr, size), &reg, k, &mut caches[who]),
                    None => w.insert_cached(&rec(addr, size), &mut caches[who]),
                }
                .unwrap();
                m.alloc(rec(addr, size));
            } else {
                // Not recorded anywhere: nothing to remove.
                assert_eq!(w.remove_any(addr, &reg, own, &mut caches[who]), None);
            }
        }
        for c in caches.iter_mut() {
            w.flush_cache(c);
        }
        m.check_peak(&r, false);
    }
    // The rings hold young blocks; freeing everything empties them.
    assert!(rings.iter().any(|k| reg.held(*k) > 0));
    let rest: Vec<u64> = m.live.keys().copied().collect();
    for (n, a) in rest.into_iter().enumerate() {
        let who = n % 4;
        let named = rings.get(who).copied().filter(|_| n % 8 < 4);
        let got = w.remove_any(a, &reg, named, &mut caches[who]);
        assert_eq!(got.map(|f| f.size), m.free(a));
    }
    for c in caches.iter_mut() {
        w.flush_cache(c);
    }
    m.check_peak(&r, false);
    assert!(rings.iter().all(|k| reg.held(*k) == 0));
}

#[test]
fn a_young_free_returns_what_the_record_held() {
    let r = region(1024, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let k = w.claim_young(&reg).unwrap();
    let mut cache = NodeCache::new();
    let a = rec(0x4000_0010, 77);
    w.insert_young(&a, &reg, k, &mut cache).unwrap();
    assert_eq!(reg.held(k), 1);
    let f = w.remove_any(a.address, &reg, Some(k), &mut cache).unwrap();
    assert_eq!(
        (f.size, f.stack, f.timestamp_us),
        (a.size, a.stack, a.timestamp_us)
    );
    assert_eq!(reg.held(k), 0);
    assert_eq!(w.remove_any(a.address, &reg, Some(k), &mut cache), None);
}

#[test]
fn a_young_block_resized_in_place_keeps_one_record_with_the_new_contents() {
    // A block the allocator resized in place: claimed, rewritten (size,
    // stack, thread, time), given back as the ring's newest block
    // (promoting the oldest); counted as a free and an allocation, found
    // again by its address, freed as any other. A claim given back
    // unchanged and a claim freed leave the model's table.
    let r = region(1024, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let k = w.claim_young(&reg).unwrap();
    let mut cache = NodeCache::new();
    let mut m = Model::default();
    let blocks: Vec<AllocationRecord> = (0..YOUNG as u64)
        .map(|j| rec(0x5000_0000 + j * 4096, 100 + j))
        .collect();
    for b in &blocks {
        w.insert_young(b, &reg, k, &mut cache).unwrap();
        m.alloc(*b);
    }
    // Block 5 grows: it takes the head's entry, whose block (0, the
    // oldest) goes to the index. Block 1, the oldest now, shrinks in its
    // own entry, which is the head's.
    for (b, size) in [(blocks[5], 5000), (blocks[1], 7)] {
        let c = w.claim_own_young(b.address, &reg, k).unwrap();
        // Claimed: no other lookup of the owner's finds it meanwhile.
        assert!(w.claim_own_young(b.address, &reg, k).is_none());
        let new = AllocationRecord {
            size,
            stack: ResourceKey(b.stack.0 + 8),
            thread: ResourceKey(8),
            timestamp_us: b.timestamp_us + 1,
            ..b
        };
        let old = w.rewrite_claimed(c, &new, &reg, None, &mut cache).unwrap();
        assert_eq!(
            (old.size, old.stack, old.timestamp_us),
            (b.size, b.stack, b.timestamp_us)
        );
        m.free(b.address);
        m.alloc(new);
        m.check_peak(&r, false);
    }
    // Block 0 was promoted: the owner's ring no longer holds it.
    assert!(w.claim_own_young(blocks[0].address, &reg, k).is_none());
    // Block 2: claimed and given back as it was.
    let c = w.claim_own_young(blocks[2].address, &reg, k).unwrap();
    w.unclaim(c, &reg);
    // Block 3: claimed, then freed.
    let c = w.claim_own_young(blocks[3].address, &reg, k).unwrap();
    assert_eq!(w.free_claimed(c, &reg, &mut cache).size, blocks[3].size);
    m.free(blocks[3].address);
    // Block 4: a rewrite naming another address frees it instead.
    let c = w.claim_own_young(blocks[4].address, &reg, k).unwrap();
    let elsewhere = rec(0x5100_0000, 1);
    assert_eq!(
        w.rewrite_claimed(c, &elsewhere, &reg, None, &mut cache)
            .map_err(|f| f.size),
        Err(104)
    );
    m.free(blocks[4].address);
    // Not in the ring: nothing claimed.
    assert!(w.claim_own_young(0x5200_0000, &reg, k).is_none());
    // Every live block but the promoted one is in the ring.
    assert_eq!(reg.held(k), m.live.len() - 1);
    w.flush_cache(&mut cache);
    m.check_peak(&r, false);
    // Every block still recorded is found by address and freed once.
    let live: Vec<u64> = m.live.keys().copied().collect();
    for a in live {
        let f = w.remove_any(a, &reg, Some(k), &mut cache).unwrap();
        assert_eq!(Some(f.size), m.free(a));
    }
    assert_eq!(reg.held(k), 0);
    w.flush_cache(&mut cache);
    m.check_peak(&r, false);
}

#[test]
fn a_thread_freeing_without_naming_its_ring_still_frees_its_young_blocks() {
    // A thread that started bypassing its ring frees the blocks its ring
    // still holds without naming the ring: found after the index, and the
    // counters come back to nothing.
    let r = region(1024, 4);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let k = w.claim_young(&reg).unwrap();
    let mut cache = NodeCache::new();
    let mut m = Model::default();
    let young: Vec<AllocationRecord> = (0..YOUNG as u64)
        .map(|j| rec(0x7000_0000 + j * 48, j + 1))
        .collect();
    for a in &young {
        w.insert_young(a, &reg, k, &mut cache).unwrap();
        m.alloc(*a);
    }
    let direct = rec(0x7100_0000, 999);
    w.insert_cached(&direct, &mut cache).unwrap();
    m.alloc(direct);
    assert_eq!(reg.held(k), YOUNG);
    for a in young.iter().rev().chain([&direct]) {
        let f = w.remove_any(a.address, &reg, None, &mut cache).unwrap();
        assert_eq!((f.size, f.stack), (a.size, a.stack));
        assert_eq!(m.free(a.address), Some(a.size));
        assert_eq!(w.remove_any(a.address, &reg, None, &mut cache), None);
    }
    assert_eq!(reg.held(k), 0);
    w.flush_cache(&mut cache);
    m.check_peak(&r, false);
}

#[test]
fn promotion_replaces_a_stale_record_of_the_same_address() {
    // A free the hooks never saw: the index still holds 0x9000 when the
    // address is allocated again as a young block. Once promoted, the
    // young block's record is the only one.
    let r = region(1024, 2);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let k = w.claim_young(&reg).unwrap();
    let mut cache = NodeCache::new();
    let mut m = Model::default();
    w.insert(&rec(0x9000, 5)).unwrap();
    w.insert_young(&rec(0x9000, 6), &reg, k, &mut cache)
        .unwrap();
    m.alloc(rec(0x9000, 6));
    for j in 1..=YOUNG as u64 {
        w.insert_young(&rec(0x9000 + j * 64, 1), &reg, k, &mut cache)
            .unwrap();
        m.alloc(rec(0x9000 + j * 64, 1));
    }
    w.flush_cache(&mut cache);
    // The stale record's allocation was counted too.
    m.total_allocs += 1;
    m.total_bytes += 5;
    m.peak += 5;
    m.check_peak(&r, false);
    let f = w.remove_any(0x9000, &reg, Some(k), &mut cache).unwrap();
    assert_eq!(f.size, 6);
    assert_eq!(w.remove_any(0x9000, &reg, Some(k), &mut cache), None);
}

#[test]
fn a_forked_childs_reset_empties_every_ring() {
    let reg = Box::new(YoungRegistry::new());
    let r = region(1024, 2);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut cache = NodeCache::new();
    let k = w.claim_young(&reg).unwrap();
    w.insert_young(&rec(0x1230, 5), &reg, k, &mut cache)
        .unwrap();
    reg.reset();
    assert_eq!(reg.held(k), 0);
    assert_eq!(reg.claim(), Some(0), "every ring is free again");
}

#[test]
fn threads_freeing_each_others_young_blocks_leave_the_exact_live_set() {
    // Four threads, each with a ring, allocate from their own address
    // range; a third of their blocks are handed to the next thread, which
    // frees them (young or promoted, racing with the owner's promotions);
    // the rest they free themselves soon (young) or keep. A reader walks
    // the table all along: never a torn record. At the end (no writer
    // running) the table and its counters are exactly the kept blocks.
    threads_free_each_others_blocks(false);
}

#[test]
fn threads_freeing_each_others_owner_table_blocks_leave_the_exact_live_set() {
    // The same with every block put in its thread's owner table: handed
    // blocks are claimed from another thread's table, racing with its
    // owner's evictions (sets fill up: the kept blocks stay) and drains;
    // once a table holds all it takes, blocks go into the index, as the
    // agent puts them.
    threads_free_each_others_blocks(true);
}

fn threads_free_each_others_blocks(owned: bool) {
    use std::sync::mpsc;
    use std::sync::Arc;
    const THREADS: u64 = 4;
    let r = Arc::new(region(1 << 16, 16));
    let reg: Arc<YoungRegistry> = Arc::new(YoungRegistry::new());
    let (txs, rxs): (Vec<_>, Vec<_>) = (0..THREADS).map(|_| mpsc::channel::<u64>()).unzip();
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let reader = {
        let (r, stop) = (r.clone(), stop.clone());
        std::thread::spawn(move || {
            let rr = r.open_reader().unwrap();
            let t = AllocationsReader::new(&rr).unwrap();
            let mut walks = 0;
            while !stop.load(Ordering::Relaxed) || walks == 0 {
                t.walk(|got| {
                    assert_eq!(*got, rec(got.address, got.size), "a torn record");
                });
                walks += 1;
            }
        })
    };
    let mut rxs: Vec<Option<mpsc::Receiver<u64>>> = rxs.into_iter().map(Some).collect();
    let handles: Vec<_> = (0..THREADS)
        .map(|t| {
            let (r, reg) = (r.clone(), reg.clone());
            let tx = txs[((t + 1) % THREADS) as usize].clone();
            let rx = rxs[t as usize].take().unwrap();
            std::thread::spawn(move || {
                let w = AllocationsWriter::new(&r).unwrap();
                let k = w.claim_young(&reg).unwrap();
                let table = owned.then(|| w.claim_owner_table(&reg, k).unwrap());
                let mut cache = NodeCache::new();
                let mut next = xorshift(0x1000 + t);
                let mut mine: Vec<u64> = Vec::new();
                let mut kept = Vec::new();
                let base = 0x7000_0000_0000 + (t << 32);
                for n in 0..30_000u64 {
                    let addr = base + n * 32;
                    let size = addr % 1000 + 1;
                    let r = rec(addr, size);
                    match table {
                        Some(tb) => {
                            if n % 9_000 == 8_999 {
                                w.drain_owner_table(&reg, tb, k, &mut cache);
                            }
                            if matches!(
                                w.insert_owned(&r, &reg, tb, k, &mut cache).unwrap(),
                                OwnedInsert::Full | OwnedInsert::FreedElsewhere
                            ) {
                                w.insert_cached(&r, &mut cache).unwrap();
                            }
                        }
                        None => w.insert_young(&r, &reg, k, &mut cache).unwrap(),
                    }
                    match next() % 6 {
                        0 | 1 => tx.send(addr).unwrap(),
                        2 => kept.push(addr),
                        _ => mine.push(addr),
                    }
                    let own = table.map(|tb| (tb, k));
                    if mine.len() > 4 + (next() % 20) as usize {
                        let a = mine.remove(0);
                        assert!(w
                            .remove_any_owned(a, &reg, Some(k), own, &mut cache)
                            .is_some());
                    }
                    while let Ok(a) = rx.try_recv() {
                        assert!(w
                            .remove_any_owned(a, &reg, Some(k), own, &mut cache)
                            .is_some());
                    }
                }
                drop(tx);
                let own = table.map(|tb| (tb, k));
                for a in rx {
                    assert!(w
                        .remove_any_owned(a, &reg, Some(k), own, &mut cache)
                        .is_some());
                }
                for a in mine {
                    assert!(w
                        .remove_any_owned(a, &reg, Some(k), own, &mut cache)
                        .is_some());
                }
                w.flush_cache(&mut cache);
                reg.release(k);
                if let Some(tb) = table {
                    reg.release_owner_table(tb);
                }
                kept
            })
        })
        .collect();
    drop(txs);
    let mut m = Model::default();
    let mut allocs = 0;
    let mut bytes = 0;
    for h in handles {
        for a in h.join().unwrap() {
            m.alloc(rec(a, a % 1000 + 1));
        }
    }
    stop.store(true, Ordering::Relaxed);
    reader.join().unwrap();
    for t in 0..THREADS {
        for n in 0..30_000u64 {
            let a = 0x7000_0000_0000 + (t << 32) + n * 32;
            allocs += 1;
            bytes += a % 1000 + 1;
        }
    }
    m.total_allocs = allocs;
    m.total_bytes = bytes;
    // The peak of a concurrent run is not modelled: at most every byte.
    m.peak = bytes;
    m.check_peak(&r, false);
}

#[test]
fn owner_table_blocks_match_a_model_whoever_frees_them_and_after_drains() {
    // Three "threads" with a ring and an owner table, and one with
    // neither, insert into their table (or, once it is full, the index),
    // their ring or the index, and free blocks whoever allocated them,
    // naming their ring and table or not; now and then a table is drained.
    // Addresses are dense (neighbouring granules), so sets fill and evict.
    // Every free returns exactly what the model holds, and the counters
    // match it after every round.
    let r = region(1 << 16, 8);
    let w = AllocationsWriter::new(&r).unwrap();
    let reg = Box::new(YoungRegistry::new());
    let rings: Vec<u32> = (0..3).map(|_| w.claim_young(&reg).unwrap()).collect();
    let tables: Vec<u32> = rings
        .iter()
        .map(|k| w.claim_owner_table(&reg, *k).unwrap())
        .collect();
    let mut caches: Vec<NodeCache> = (0..4).map(|_| NodeCache::new()).collect();
    let mut m = Model::default();
    let mut next = xorshift(0x9e37_79b9_7f4a_7c15);
    let mut evictions = 0;
    for round in 0..4 {
        for _ in 0..40_000 {
            let addr = 0x5555_0000_0000 + (next() % 24_000) * 16;
            let who = (next() % 4) as usize;
            let own = rings.get(who).copied();
            let table = tables.get(who).copied().zip(own);
            if m.live.contains_key(&addr) {
                let named = next().is_multiple_of(2);
                let got = w.remove_any_owned(
                    addr,
                    &reg,
                    own.filter(|_| named),
                    table.filter(|_| named),
                    &mut caches[who],
                );
                assert_eq!(got.map(|f| f.size), m.free(addr));
            } else if round < 3 || next().is_multiple_of(3) {
                let size = next() % 3000 + 1;
                let a = rec(addr, size);
                match (table, next() % 4) {
                    (Some((t, k)), 0 | 1) => match w.insert_owned(&a, &reg, t, k, &mut caches[who])
                    {
                        Ok(OwnedInsert::Full | OwnedInsert::FreedElsewhere) => {
                            w.insert_cached(&a, &mut caches[who]).unwrap()
                        }
                        Ok(OwnedInsert::Evicted) => evictions += 1,
                        Ok(OwnedInsert::Kept) => {}
                        Err(e) => panic!("{e:?}"),
                    },
                    (Some((_, k)), 2) => w.insert_young(&a, &reg, k, &mut caches[who]).unwrap(),
                    _ => w.insert_cached(&a, &mut caches[who]).unwrap(),
                }
                m.alloc(a);
            } else {
                assert_eq!(
                    w.remove_any_owned(addr, &reg, own, table, &mut caches[who]),
                    None
                );
            }
            if next().is_multiple_of(10_000) {
                let t = (next() % 3) as usize;
                w.drain_owner_table(&reg, tables[t], rings[t], &mut caches[t]);
                assert_eq!(reg.held_in_owner_table(tables[t]), 0);
            }
        }
        for c in caches.iter_mut() {
            w.flush_cache(c);
        }
        m.check_peak(&r, false);
    }
    assert!(evictions > 0, "no set ever filled up");
    assert!(tables.iter().any(|t| reg.held_in_owner_table(*t) > 0));
    let rest: Vec<u64> = m.live.keys().copied().collect();
    for (n, a) in rest.into_iter().enumerate() {
        let who = n % 4;
        let own = rings.get(who).copied().filter(|_| n % 8 < 4);
        let table = tables.get(who).copied().zip(own);
        let got = w.remove_any_owned(a, &reg, own, table, &mut caches[who]);
        assert_eq!(got.map(|f| f.size), m.free(a));
    }
    for c in caches.iter_mut() {
        w.flush_cache(c);
    }
    m.check_peak(&r, false);
    assert!(tables.iter().all(|t| reg.held_in_owner_table(*t) == 0));
}

#[test]
fn a_forked_childs_reset_empties_every_owner_table() {
    let reg = Box::new(YoungRegistry::new());
    let r = region(1024, 2);
    let w = AllocationsWriter::new(&r).unwrap();
    let mut cache = NodeCache::new();
    let k = w.claim_young(&reg).unwrap();
    let t = w.claim_owner_table(&reg, k).unwrap();
    assert_eq!(
        w.insert_owned(&rec(0x1230, 5), &reg, t, k, &mut cache),
        Ok(OwnedInsert::Kept)
    );
    assert_eq!(reg.held_in_owner_table(t), 1);
    reg.reset();
    let k = w.claim_young(&reg).unwrap();
    assert_eq!(w.claim_owner_table(&reg, k), None, "stale until emptied");
    reg.empty_owner_tables();
    assert_eq!(reg.held_in_owner_table(t), 0);
    assert_eq!(
        w.claim_owner_table(&reg, k),
        Some(t),
        "every table is free again"
    );
    // The emptied table takes blocks again, and finds them.
    assert_eq!(
        w.insert_owned(&rec(0x1230, 6), &reg, t, k, &mut cache),
        Ok(OwnedInsert::Kept)
    );
    let f = w
        .remove_any_owned(0x1230, &reg, None, Some((t, k)), &mut cache)
        .unwrap();
    assert_eq!(f.size, 6);
}
