//! A hostile "instrumented" process for the dumper's safety tests. It does
//! not use the agent: it creates heapdump regions with the table's writer
//! API directly, fills them with real records, prints `ready PID`, then
//! misbehaves until stdin closes:
//!
//! - `scribble [SEED]`: keeps rewriting its own regions with garbage:
//!   random words anywhere (headers included), cycles in the bucket chains
//!   and the thread list, huge record lengths, node sequence words left odd,
//!   absurd high-water marks, sizes and keys. Every so often it puts the
//!   static headers back, so some snapshots get past the header checks and
//!   meet the damaged tables.
//! - `unsealed`: a valid resources region and a `heapdump.allocations`
//!   memfd with a valid image but no seals.
//! - `version`: valid regions whose headers claim format major version 7.

use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};

use heapdump_table::header::{offsets, STATIC_HEADER_LEN};
use heapdump_table::stack_compression::encode;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsWriter, RegionWriter, ResourceKey,
    ResourcesWriter, SharedView,
};

static STOP: AtomicBool = AtomicBool::new(false);

/// xorshift64*: deterministic per seed, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

fn store(view: &SharedView, off: u64, v: u64) {
    if let Some(w) = view.atomic_u64(off & !7) {
        w.store(v, Ordering::Relaxed);
    }
}

fn load(view: &SharedView, off: u64) -> u64 {
    view.load_u64(off & !7).unwrap_or(0)
}

/// Both regions with real content: `threads` thread records, 64 stacks,
/// `blocks` live records.
fn make_regions(blocks: u64) -> (RegionWriter, RegionWriter, Vec<ResourceKey>) {
    let res = ResourcesWriter::create_region(1 << 20, 64).expect("resources region");
    let alloc = AllocationsWriter::create_region(AllocationsConfig {
        capacity: 4096,
        shards: 4,
    })
    .expect("allocations region");
    let mut keys = Vec::new();
    {
        let rw = ResourcesWriter::new(&res).expect("resources writer");
        let aw = AllocationsWriter::new(&alloc).expect("allocations writer");
        let mut threads = Vec::new();
        for t in 0..4u64 {
            let k = rw
                .insert_thread_info(
                    std::process::id() as u64 + t,
                    format!("hostile-{t}").as_bytes(),
                )
                .expect("thread record");
            threads.push(k);
            keys.push(k);
        }
        let mut stacks = Vec::new();
        for s in 0..64u64 {
            // Addresses inside this executable's text are not needed: the
            // dumper symbolizes what it can and keeps raw addresses.
            let frames: Vec<u64> = (0..1 + s % 20)
                .map(|f| 0x40_1000 + s * 0x100 + f * 8)
                .collect();
            let mut bytes = Vec::new();
            encode(&frames, &mut bytes);
            let (k, _) = rw.intern_stack_trace(&bytes).expect("stack record");
            stacks.push(k);
            keys.push(k);
        }
        for i in 0..blocks {
            let stack = stacks[(i % 64) as usize];
            rw.record_allocation(stack, 32 + i % 100);
            aw.insert(&AllocationRecord {
                address: 0x1000_0000 + i * 64,
                size: 32 + i % 100,
                stack,
                thread: threads[(i % 4) as usize],
                timestamp_us: i,
            })
            .expect("insert");
        }
    }
    (res, alloc, keys)
}

fn ready() {
    println!("ready {}", std::process::id());
    // Stop when stdin closes (or a line arrives).
    std::thread::spawn(|| {
        let mut buf = [0u8; 64];
        // SAFETY: reading into a valid local buffer.
        unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
        STOP.store(true, Ordering::Relaxed);
    });
}

fn wait_stop() {
    let mut buf = [0u8; 64];
    // SAFETY: reading into a valid local buffer.
    unsafe { libc::read(0, buf.as_mut_ptr().cast(), buf.len()) };
}

fn scribble(seed: u64) {
    let (res, alloc, keys) = make_regions(3000);
    let rv = res.view();
    let av = alloc.view();
    let rlay = res.header().layout;
    let alay = alloc.header().layout;
    let (buckets, buckets_off, data_off) = (rlay[0], rlay[1], rlay[2]);
    let (shards_off, nodes_off, capacity) = (alay[1], alay[4], alay[5]);
    let mut saved_r = Vec::new();
    let mut saved_a = Vec::new();
    rv.copy_bytes(0, STATIC_HEADER_LEN, &mut saved_r)
        .expect("header");
    av.copy_bytes(0, STATIC_HEADER_LEN, &mut saved_a)
        .expect("header");
    let restore = |view: &SharedView, saved: &[u8]| {
        for (i, c) in saved.chunks_exact(8).enumerate() {
            store(
                view,
                8 * i as u64,
                u64::from_le_bytes(c.try_into().expect("8")),
            );
        }
    };
    let mut rng = Rng(seed | 1);
    ready();
    let mut round = 0u64;
    while !STOP.load(Ordering::Relaxed) {
        round += 1;
        let key = keys[rng.below(keys.len() as u64) as usize].0;
        match rng.below(16) {
            // Garbage anywhere in either region, headers included.
            0 => store(&rv, rng.below(rv.len() as u64), rng.next()),
            1 => store(&av, rng.below(av.len() as u64), rng.next()),
            // Static header words (magic, version, kind, sizes, layout).
            2 => store(&rv, 8 * rng.below(15), rng.next()),
            3 => store(&av, 8 * rng.below(15), rng.next()),
            // Cycles: a record pointing at itself or an earlier one, a
            // bucket head into the middle of a record.
            4 => store(&rv, key + 8, key),
            5 => store(&rv, key + 8, keys[0].0),
            6 => store(
                &rv,
                buckets_off + 8 * rng.below(buckets),
                key + 8 * rng.below(6),
            ),
            7 => store(&rv, offsets::KIND_WORDS + 8, key), // thread list head
            // Huge lengths and bad tags.
            8 => store(
                &rv,
                key,
                (load(&rv, key) & 0xffff_ffff) | (rng.next() << 32),
            ),
            9 => store(&rv, offsets::KIND_WORDS, rng.next()), // bump pointer
            10 => store(&av, offsets::KIND_WORDS, u64::MAX - rng.below(3)), // high-water mark
            // Nodes: odd sequence words (writer "killed mid-update"),
            // garbage addresses, sizes and keys.
            11 => {
                let n = nodes_off + 32 * rng.below(capacity);
                store(&av, n, load(&av, n) | 1);
            }
            12 => {
                let n = nodes_off + 32 * rng.below(capacity);
                for w in 1..4 {
                    store(&av, n + 8 * w, rng.next());
                }
            }
            13 => store(&av, shards_off + 8 * rng.below(64), rng.next()), // shard words
            14 => store(&av, offsets::REQUEST_NAME_LEN, rng.next()),
            // Put the static headers back now and then.
            _ => {
                restore(&rv, &saved_r);
                restore(&av, &saved_a);
                store(&rv, offsets::KIND_WORDS, data_off + (1 << 19));
            }
        }
        if round & 63 == 0 {
            std::thread::yield_now();
        }
    }
    drop((res, alloc));
}

fn unsealed() {
    let (res, alloc, _) = make_regions(100);
    let av = alloc.view();
    let mut image = Vec::new();
    av.copy_bytes(0, av.len(), &mut image).expect("image");
    // SAFETY: a valid NUL-terminated name; the flags ask for no sealing.
    let fd = unsafe { libc::memfd_create(c"heapdump.allocations".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0, "memfd_create: {}", std::io::Error::last_os_error());
    // SAFETY: `fd` is a fresh descriptor that nothing else owns.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    std::io::Write::write_all(&mut file, &image).expect("write image");
    drop(alloc); // only the unsealed one remains
                 // Mapped writable and shared, as a writer maps its region (that is
                 // what makes a process an instrumented one to the dumper).
                 // SAFETY: maps `image.len()` bytes of our own fresh memfd, which holds
                 // that many bytes and is never truncated; unmapped below.
    let map = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            image.len(),
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            file.as_raw_fd(),
            0,
        )
    };
    assert_ne!(
        map,
        libc::MAP_FAILED,
        "mmap: {}",
        std::io::Error::last_os_error()
    );
    println!("ready {} fd {}", std::process::id(), file.as_raw_fd());
    wait_stop();
    // SAFETY: the mapping made above, not used after this.
    unsafe { libc::munmap(map, image.len()) };
    drop((res, file));
}

fn version() {
    let (res, alloc, _) = make_regions(100);
    for view in [res.view(), alloc.view()] {
        // version_major is the u16 at byte 8 (little-endian).
        let w = load(&view, 8);
        store(&view, 8, (w & !0xffff) | 7);
    }
    println!("ready {}", std::process::id());
    wait_stop();
    drop((res, alloc));
}

fn main() {
    let mut args = std::env::args().skip(1);
    match args.next().as_deref() {
        Some("scribble") => scribble(args.next().and_then(|s| s.parse().ok()).unwrap_or(1)),
        Some("unsealed") => unsealed(),
        Some("version") => version(),
        other => {
            eprintln!("usage: hostile scribble [SEED] | unsealed | version (got {other:?})");
            std::process::exit(2);
        }
    }
}
