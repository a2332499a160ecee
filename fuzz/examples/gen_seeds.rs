//! Writes seed corpora for the fuzz targets from real regions made by the
//! table's writers: `gen_seeds OUT_DIR` fills `OUT_DIR/<target>/`.
//!
//! The regions are tiny (a few pages: few buckets, one or two shards, small
//! capacity) so each seed is a complete, valid region image whose header
//! size matches its length, and a file stays small.

use std::path::Path;

use heapdump_fuzz::join_pair;
use heapdump_table::stack_compression::encode;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsWriter, RegionWriter, ResourceKey,
    ResourcesWriter,
};

fn bytes_of(r: &RegionWriter) -> Vec<u8> {
    let view = r.view();
    let mut out = Vec::new();
    view.copy_bytes(0, view.len(), &mut out)
        .expect("whole region");
    out
}

fn trace(i: u64, frames: u64) -> Vec<u8> {
    let f: Vec<u64> = (0..frames)
        .map(|k| 0x5555_5555_0000 + i * 0x1234 + k * 0x48)
        .collect();
    let mut out = Vec::new();
    encode(&f, &mut out);
    out
}

/// A resources region with `stacks` traces and `threads` thread records;
/// returns its image and the keys.
fn resources(
    size: u64,
    buckets: u64,
    stacks: u64,
    threads: u64,
) -> (Vec<u8>, Vec<ResourceKey>, Vec<ResourceKey>) {
    let r = ResourcesWriter::create_region(size, buckets).expect("resources region");
    let w = ResourcesWriter::new(&r).expect("writer");
    let mut sk = Vec::new();
    for i in 0..stacks {
        match w.intern_stack_trace(&trace(i, 1 + i % 12)) {
            Ok((k, _)) => {
                w.record_allocation(k, 16 * (i + 1));
                sk.push(k);
            }
            Err(_) => break,
        }
    }
    let mut tk = Vec::new();
    for t in 0..threads {
        let name = format!("worker-{t}");
        if let Ok(k) = w.insert_thread_info(1000 + t, name.as_bytes()) {
            tk.push(k);
        }
    }
    (bytes_of(&r), sk, tk)
}

/// An allocations region holding `live` records (and `freed` inserted then
/// removed), keys drawn from `stacks`/`threads`.
fn allocations(
    capacity: u64,
    shards: u64,
    live: u64,
    freed: u64,
    stacks: &[ResourceKey],
    threads: &[ResourceKey],
) -> Vec<u8> {
    let r = AllocationsWriter::create_region(AllocationsConfig { capacity, shards })
        .expect("allocations region");
    let w = AllocationsWriter::new(&r).expect("writer");
    let pick = |v: &[ResourceKey], i: u64| {
        if v.is_empty() {
            ResourceKey(8192)
        } else {
            v[i as usize % v.len()]
        }
    };
    for i in 0..live + freed {
        let rec = AllocationRecord {
            address: 0x7f00_0000_1000 + i * 0x40,
            size: 8 + i * 24,
            stack: pick(stacks, i),
            thread: pick(threads, i),
            timestamp_us: 1000 + i,
        };
        let _ = w.insert(&rec);
    }
    for i in live..live + freed {
        w.remove(0x7f00_0000_1000 + i * 0x40);
    }
    w.counters().request_snapshot("seed", 42);
    bytes_of(&r)
}

fn write(dir: &Path, target: &str, name: &str, bytes: &[u8]) {
    let d = dir.join(target);
    std::fs::create_dir_all(&d).expect("create corpus dir");
    std::fs::write(d.join(name), bytes).expect("write seed");
}

fn main() {
    let out = std::env::args().nth(1).unwrap_or_else(|| "corpus".into());
    let out = Path::new(&out);

    // Resources: 3-4 pages each.
    let (res_a, sk_a, tk_a) = resources(4 * 4096, 64, 40, 3);
    let (res_b, _, _) = resources(3 * 4096, 8, 200, 2); // fills up
    let (res_c, _, _) = resources(3 * 4096, 1, 12, 1); // one long chain
    let (res_empty, _, _) = resources(3 * 4096, 8, 0, 0);
    for (name, img) in [
        ("stacks_threads", &res_a),
        ("full", &res_b),
        ("one_bucket", &res_c),
        ("empty", &res_empty),
    ] {
        write(out, "resources_lookup", name, img);
    }

    // Allocations: 4-7 pages each.
    let alloc_a = allocations(64, 1, 40, 10, &sk_a, &tk_a);
    let alloc_b = allocations(32, 2, 40, 0, &sk_a, &tk_a); // overfull
    let alloc_c = allocations(16, 1, 0, 16, &sk_a, &tk_a); // all freed
    for (name, img) in [("live", &alloc_a), ("full", &alloc_b), ("freed", &alloc_c)] {
        write(out, "allocations_walk", name, img);
    }

    // Headers: both kinds, plus a foreign version and a wrong size.
    write(out, "region_header", "resources", &res_c);
    write(out, "region_header", "allocations", &alloc_c);
    let mut v2 = alloc_c.clone();
    v2[8] = 2;
    write(out, "region_header", "version2", &v2);
    write(out, "region_header", "short", &res_c[..4096]);

    // Pairs, as a dumper sees a process.
    write(
        out,
        "snapshot_pipeline",
        "pair",
        &join_pair(&res_a, &alloc_a),
    );
    write(
        out,
        "snapshot_pipeline",
        "pair_freed",
        &join_pair(&res_a, &alloc_c),
    );

    // Compressed traces: a max-frames byte, then the encoding.
    for (i, frames) in [(0u64, 0u64), (1, 1), (2, 7), (3, 64)] {
        let mut seed = vec![64u8];
        seed.extend(trace(i, frames));
        write(out, "stack_decode", &format!("trace{frames}"), &seed);
    }
    let mut extreme = vec![64u8];
    let mut e = Vec::new();
    encode(&[u64::MAX, 0, 1 << 63, 1], &mut e);
    extreme.extend(e);
    write(out, "stack_decode", "extreme", &extreme);
    eprintln!("seeds written to {}", out.display());
}
