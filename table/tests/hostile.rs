//! Hostile bytes: whatever a region holds, every read returns an error or a
//! partial result, never a panic, a hang, or a read outside the mapping.
//!
//! Images are made by real writers, copied into heap buffers, then
//! scribbled over (random words, plausible offsets, cycles) and read with
//! the `from_view` constructors; a few cases go through real sealed memfds.

use std::os::fd::AsRawFd;
use std::sync::OnceLock;

use heapdump_table::header::{offsets, HEADER_SIZE};
use heapdump_table::stack_compression::encode;
use heapdump_table::{
    AllocationRecord, AllocationsConfig, AllocationsReader, AllocationsWriter, RegionKind,
    RegionReader, RegionWriter, ResourceKey, ResourcesReader, ResourcesWriter, SharedView,
    TableError, FORMAT_MAJOR,
};
use proptest::prelude::*;

// Static header field offsets (see header::StaticHeader).
const H_VERSION_MAJOR: usize = 8;
const H_KIND: usize = 12;
const H_REGION_SIZE: usize = 16;
const H_HEADER_SIZE: usize = 24;
const H_LAYOUT: usize = 56;

/// An 8-aligned heap copy of a region.
#[derive(Clone)]
struct Image(Vec<u64>);

impl Image {
    fn of(region: &RegionWriter) -> Image {
        let v = region.view();
        let mut words = vec![0u64; v.len() / 8];
        for (i, w) in words.iter_mut().enumerate() {
            *w = v.load_u64(i as u64 * 8).unwrap();
        }
        Image(words)
    }
    fn len(&self) -> usize {
        self.0.len() * 8
    }
    fn view(&self) -> SharedView {
        // SAFETY: the buffer is 8-aligned (Vec<u64>) and outlives every use
        // of the view in these tests (views never escape `self`'s borrow).
        unsafe { SharedView::new(self.0.as_ptr() as *const u8, self.len()) }
    }
    fn set_u64(&mut self, off: usize, v: u64) {
        self.0[off / 8] = v;
    }
    fn get_u64(&self, off: usize) -> u64 {
        self.0[off / 8]
    }
    fn set_u32(&mut self, off: usize, v: u32) {
        let w = &mut self.0[off / 8];
        let shift = (off % 8) * 8;
        *w = (*w & !(0xffff_ffffu64 << shift)) | u64::from(v) << shift;
    }
    fn set_u16(&mut self, off: usize, v: u16) {
        let w = &mut self.0[off / 8];
        let shift = (off % 8) * 8;
        *w = (*w & !(0xffffu64 << shift)) | u64::from(v) << shift;
    }
}

fn trace(i: u64) -> Vec<u8> {
    let frames: Vec<u64> = (0..1 + i % 12)
        .map(|k| 0x5555_0000_0000 + i * 0x777 + k * 0x30)
        .collect();
    let mut out = Vec::new();
    encode(&frames, &mut out);
    out
}

struct Resources {
    image: Image,
    stack_keys: Vec<ResourceKey>,
    thread_keys: Vec<ResourceKey>,
}

/// A small resources region (64 buckets, long chains) with stacks and
/// threads.
fn resources() -> &'static Resources {
    static R: OnceLock<Resources> = OnceLock::new();
    R.get_or_init(|| {
        let region = ResourcesWriter::create_region(64 * 1024, 64).unwrap();
        let w = ResourcesWriter::new(&region).unwrap();
        let stack_keys = (0..150)
            .map(|i| {
                let k = w.intern_stack_trace(&trace(i)).unwrap().0;
                w.record_allocation(k, i);
                k
            })
            .collect();
        let thread_keys = (0..20)
            .map(|i| w.insert_thread_info(i, format!("t{i}").as_bytes()).unwrap())
            .collect();
        Resources {
            image: Image::of(&region),
            stack_keys,
            thread_keys,
        }
    })
}

fn allocations() -> &'static Image {
    static A: OnceLock<Image> = OnceLock::new();
    A.get_or_init(|| {
        let region = AllocationsWriter::create_region(AllocationsConfig {
            capacity: 512,
            shards: 4,
        })
        .unwrap();
        let w = AllocationsWriter::new(&region).unwrap();
        for i in 1..=300u64 {
            w.insert(&AllocationRecord {
                address: i * 64,
                size: i,
                stack: ResourceKey(8192 + i * 8),
                thread: ResourceKey(8192),
                timestamp_us: i,
            })
            .unwrap();
        }
        for i in (1..=300u64).step_by(3) {
            w.remove(i * 64).unwrap();
        }
        Image::of(&region)
    })
}

/// Reads everything a dumper would read from a resources image.
fn read_resources(image: &Image, extra_keys: &[u64]) {
    // SAFETY: `image` outlives the reader.
    let Ok(r) = (unsafe { ResourcesReader::from_view(image.view()) }) else {
        return;
    };
    let cat = r.stacks();
    for key in cat.by_key.keys() {
        let _ = r.stack(*key);
    }
    let (threads, _) = r.threads();
    for (k, _) in threads {
        let _ = r.thread(k);
    }
    let res = resources();
    for k in res
        .stack_keys
        .iter()
        .chain(&res.thread_keys)
        .map(|k| k.0)
        .chain(extra_keys.iter().copied())
    {
        let _ = r.stack(ResourceKey(k));
        let _ = r.stack_bytes(ResourceKey(k));
        let _ = r.thread(ResourceKey(k));
    }
    let _ = r.stack_count();
}

/// Reads everything a dumper would read from an allocations image.
fn read_allocations(image: &Image) -> Option<heapdump_table::WalkStats> {
    // SAFETY: `image` outlives the reader.
    let r = unsafe { AllocationsReader::from_view(image.view()) }.ok()?;
    let _ = r.counters();
    let mut n = 0u64;
    let stats = r.walk(|_| n += 1);
    assert!(n <= r.capacity());
    assert_eq!(n, stats.reported);
    Some(stats)
}

/// A value that is likely to be interpreted as something: offsets near the
/// data, bounds, self references, extremes.
fn hostile_word(len: usize) -> impl Strategy<Value = u64> {
    let len = len as u64;
    prop_oneof![
        any::<u64>(),
        (0..len).prop_map(|v| v & !7),
        (0..len),
        Just(0u64),
        Just(u64::MAX),
        Just(u64::MAX - 7),
        Just(len),
        Just(len - 8),
        (0u64..64).prop_map(move |d| len - d),
        (0u32..40).prop_map(|s| 1u64 << s),
        any::<u32>().prop_map(|v| u64::from(v) << 32 | 0x4b43_5453), // stack tag
        any::<u32>().prop_map(|v| u64::from(v) << 32 | 0x4452_4854), // thread tag
        any::<u64>().prop_map(|v| v | 1),                            // odd seq
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(300))]

    #[test]
    fn mutated_resources_never_crash(
        muts in proptest::collection::vec(
            (0usize..64 * 1024 / 8, hostile_word(64 * 1024)), 1..40),
        in_header in proptest::collection::vec((0usize..1024 / 8, hostile_word(64 * 1024)), 0..3),
        keys in proptest::collection::vec(hostile_word(64 * 1024), 0..8),
    ) {
        let mut img = resources().image.clone();
        for (w, v) in muts.iter().chain(&in_header) {
            img.0[*w] = *v;
        }
        read_resources(&img, &keys);
    }

    #[test]
    fn mutated_allocations_never_crash(
        muts in proptest::collection::vec((0usize..allocations().0.len(), hostile_word(allocations().len())), 1..60),
        in_header in proptest::collection::vec((0usize..1024 / 8, hostile_word(allocations().len())), 0..3),
    ) {
        let mut img = allocations().clone();
        for (w, v) in muts.iter().chain(&in_header) {
            img.0[*w] = *v;
        }
        read_allocations(&img);
    }

    #[test]
    fn random_layouts_never_crash(layout in proptest::array::uniform8(hostile_word(64 * 1024))) {
        for base in [&resources().image, allocations()] {
            let mut img = base.clone();
            for (i, v) in layout.iter().enumerate() {
                img.set_u64(H_LAYOUT + 8 * i, *v);
            }
            read_resources(&img, &[]);
            read_allocations(&img);
        }
    }

    #[test]
    fn random_bytes_are_refused(words in proptest::collection::vec(any::<u64>(), 512..1024), keep_magic in any::<bool>()) {
        let mut img = Image(words);
        if keep_magic {
            img.0[0] = u64::from_le_bytes(*b"HEAPDUMP");
        }
        read_resources(&img, &[0, 8, 4096]);
        read_allocations(&img);
    }
}

#[test]
fn pristine_images_read_back() {
    let res = resources();
    // SAFETY: the image outlives the reader.
    let r = unsafe { ResourcesReader::from_view(res.image.view()) }.unwrap();
    let cat = r.stacks();
    assert_eq!(cat.partial, None);
    assert_eq!(cat.stacks.len(), 150);
    assert_eq!(r.threads().0.len(), 20);
    let stats = read_allocations(allocations()).unwrap();
    assert_eq!(stats.reported, 200);
    assert_eq!(stats.unstable, 0);
}

fn expect_err<T>(r: Result<T, TableError>) -> TableError {
    match r {
        Ok(_) => panic!("accepted a bad region"),
        Err(e) => e,
    }
}

#[test]
fn bad_headers_are_refused_with_clear_errors() {
    let base = &resources().image;
    // SAFETY: each image outlives its reader (here and below).
    let read = |img: &Image| unsafe { ResourcesReader::from_view(img.view()) };

    let mut img = base.clone();
    img.set_u64(0, u64::from_le_bytes(*b"HEAPDUMQ"));
    assert!(matches!(expect_err(read(&img)), TableError::BadMagic));

    let mut img = base.clone();
    img.set_u16(H_VERSION_MAJOR, FORMAT_MAJOR + 1);
    let e = expect_err(read(&img));
    assert!(matches!(e, TableError::VersionMismatch { .. }));
    let msg = e.to_string();
    assert!(
        msg.contains(&format!(
            "{}.{}",
            FORMAT_MAJOR + 1,
            heapdump_table::FORMAT_MINOR
        )) && msg.contains(&format!("{FORMAT_MAJOR}.x")),
        "{msg}"
    );

    let mut img = base.clone();
    img.set_u32(H_KIND, RegionKind::Allocations as u32);
    assert!(matches!(
        expect_err(read(&img)),
        TableError::WrongKind { .. }
    ));
    // And the other way round.
    // SAFETY: the image outlives the reader.
    let e = expect_err(unsafe { AllocationsReader::from_view(base.view()) });
    assert!(matches!(
        e,
        TableError::WrongKind {
            found: 1,
            expected: 2
        }
    ));

    let mut img = base.clone();
    img.set_u64(H_REGION_SIZE, img.len() as u64 * 2);
    assert!(matches!(
        expect_err(read(&img)),
        TableError::Truncated { .. }
    ));

    let mut img = base.clone();
    img.set_u64(H_HEADER_SIZE, 8192);
    assert!(matches!(
        expect_err(read(&img)),
        TableError::CorruptHeader(_)
    ));

    // Truncated: shorter than the header, or than the size it claims.
    for len in [
        0usize,
        8,
        120,
        HEADER_SIZE as usize - 8,
        HEADER_SIZE as usize,
    ] {
        let img = Image(base.0[..len / 8].to_vec());
        assert!(read(&img).is_err(), "{len} bytes accepted");
    }
    let img = Image(base.0[..base.0.len() - 512].to_vec());
    assert!(matches!(
        expect_err(read(&img)),
        TableError::Truncated { .. }
    ));

    // Layouts that do not fit.
    for (i, v) in [
        (0, 3u64),
        (0, 1 << 30),
        (1, 0),
        (2, 8),
        (2, u64::MAX - 7),
        (3, 0),
    ] {
        let mut img = base.clone();
        img.set_u64(H_LAYOUT + 8 * i, v);
        assert!(
            matches!(expect_err(read(&img)), TableError::CorruptHeader(_)),
            "layout[{i}]={v:#x}"
        );
    }
    let a = allocations();
    for (i, v) in [
        (0, 3u64),
        (1, 0),
        (2, 1000),
        (3, u64::MAX - 4095),
        (4, 0),
        (5, 0),
        (5, 1 << 40),
    ] {
        let mut img = a.clone();
        img.set_u64(H_LAYOUT + 8 * i, v);
        // SAFETY: the image outlives the reader.
        let e = expect_err(unsafe { AllocationsReader::from_view(img.view()) });
        assert!(
            matches!(e, TableError::CorruptHeader(_)),
            "layout[{i}]={v:#x}: {e}"
        );
    }
}

type Mutation = Box<dyn Fn(&mut Image)>;

#[test]
fn cyclic_and_out_of_range_lists_end() {
    let res = resources();
    let buckets_off = HEADER_SIZE as usize;
    let data_off = res.image.get_u64(H_LAYOUT + 16) as usize;
    let k0 = res.stack_keys[0].0 as usize;
    let k1 = res.stack_keys[1].0 as usize;
    let cases: Vec<Mutation> = vec![
        // A record linking to itself.
        Box::new(move |img| img.set_u64(k0 + 8, k0 as u64)),
        // Two records linking to each other.
        Box::new(move |img| {
            img.set_u64(k0 + 8, k1 as u64);
            img.set_u64(k1 + 8, k0 as u64);
        }),
        // Every bucket pointing at the same record.
        Box::new(move |img| {
            for b in 0..64 {
                img.set_u64(buckets_off + 8 * b, k0 as u64);
            }
        }),
        // Links outside the data area, misaligned, past the end.
        Box::new(move |img| img.set_u64(k0 + 8, 8)),
        Box::new(move |img| img.set_u64(k0 + 8, k1 as u64 + 4)),
        Box::new(move |img| img.set_u64(k0 + 8, u64::MAX - 7)),
        Box::new(move |img| img.set_u64(buckets_off, (img.len() - 8) as u64)),
        // A record claiming a huge payload.
        Box::new(move |img| img.set_u64(k0, 0x4b43_5453 | 0xffff_ffff << 32)),
        // The bump pointer beyond the region, and before the data.
        Box::new(move |img| img.set_u64(offsets::KIND_WORDS as usize, u64::MAX)),
        Box::new(move |img| img.set_u64(offsets::KIND_WORDS as usize, 0)),
        // A cyclic thread list.
        Box::new(move |img| {
            let t = img.get_u64(offsets::KIND_WORDS as usize + 8) as usize;
            img.set_u64(t + 8, t as u64);
        }),
        // A chain through every record in the data area (long, bounded).
        Box::new(move |img| {
            let mut at = data_off;
            while at + 16 < img.len() {
                img.set_u64(at, 0x4b43_5453 | 8 << 32);
                img.set_u64(at + 8, (at + 16) as u64);
                at += 16;
            }
            img.set_u64(buckets_off, data_off as u64);
            img.set_u64(offsets::KIND_WORDS as usize, img.len() as u64);
        }),
    ];
    for (i, mutate) in cases.iter().enumerate() {
        let mut img = res.image.clone();
        mutate(&mut img);
        // SAFETY: the image outlives the reader.
        let r = unsafe { ResourcesReader::from_view(img.view()) }.unwrap();
        let cat = r.stacks();
        // Hostile records may overlap, but never more than one per 16 bytes.
        assert!(cat.stacks.len() <= img.len() / 16, "case {i}");
        let _ = r.threads();
        read_resources(&img, &[]);
    }
    // The self-cycle is reported as partial.
    let mut img = res.image.clone();
    img.set_u64(k0 + 8, k0 as u64);
    // SAFETY: the image outlives the reader.
    let r = unsafe { ResourcesReader::from_view(img.view()) }.unwrap();
    assert!(r.stacks().partial.is_some());
}

#[test]
fn out_of_range_keys_are_refused() {
    let res = resources();
    // SAFETY: the image outlives the reader.
    let r = unsafe { ResourcesReader::from_view(res.image.view()) }.unwrap();
    let len = res.image.len() as u64;
    for k in [
        0,
        1,
        8,
        4096,
        4100,
        len,
        len - 8,
        len + 8,
        u64::MAX,
        u64::MAX - 7,
        1 << 63,
    ] {
        assert!(
            matches!(r.stack(ResourceKey(k)), Err(TableError::BadKey { .. })),
            "{k:#x}"
        );
        assert!(
            matches!(r.thread(ResourceKey(k)), Err(TableError::BadKey { .. })),
            "{k:#x}"
        );
    }
}

#[test]
fn nodes_stuck_mid_update_give_a_partial_walk_quickly() {
    // Every node's sequence odd, as if writers died mid-update everywhere:
    // the walk must end (bounded retries) and say it is partial.
    let mut img = allocations().clone();
    let nodes_off = img.get_u64(H_LAYOUT + 32) as usize;
    let capacity = img.get_u64(H_LAYOUT + 40) as usize;
    for n in 0..capacity {
        let w0 = img.get_u64(nodes_off + 32 * n);
        img.set_u64(nodes_off + 32 * n, w0 | 1);
    }
    img.set_u64(offsets::KIND_WORDS as usize, u64::MAX); // high-water mark
    let stats = read_allocations(&img).unwrap();
    assert_eq!(stats.reported, 0);
    assert_eq!(stats.unstable, capacity as u64);
    assert!(stats.partial_reason().is_some());
}

#[test]
fn unsealed_memfd_is_refused() {
    use nix::sys::memfd::{memfd_create, MemFdCreateFlag};
    // A memfd that could be sealed but is not.
    let fd = memfd_create(c"heapdump.allocations", MemFdCreateFlag::MFD_ALLOW_SEALING).unwrap();
    nix::unistd::ftruncate(&fd, 1 << 16).unwrap();
    let e = expect_err(RegionReader::from_file(
        std::fs::File::from(fd),
        RegionKind::Allocations,
    ));
    assert!(matches!(e, TableError::Unsealed { .. }), "{e}");
    assert!(e.to_string().contains("not sealed"));
    // One that cannot be sealed at all (F_SEAL_SEAL set from the start).
    let fd = memfd_create(c"heapdump.allocations", MemFdCreateFlag::empty()).unwrap();
    nix::unistd::ftruncate(&fd, 1 << 16).unwrap();
    let e = expect_err(RegionReader::from_file(
        std::fs::File::from(fd),
        RegionKind::Allocations,
    ));
    assert!(matches!(e, TableError::Unsealed { .. }), "{e}");
    // A regular file has no seals: an error, not a mapping.
    let f = std::fs::File::open("/proc/self/exe").unwrap();
    assert!(RegionReader::from_file(f, RegionKind::Allocations).is_err());
}

#[test]
fn sealed_region_with_scribbled_header_is_refused() {
    // A real region, its header overwritten in place through the writer's
    // shared mapping, then opened like a dumper does.
    let region = ResourcesWriter::create_region(64 * 1024, 64).unwrap();
    let path = format!(
        "/proc/self/fd/{}",
        region.fd().expect("own memfd").as_raw_fd()
    );
    let view = region.view();
    let major = view.atomic_u64(8).unwrap();
    let orig = major.load(std::sync::atomic::Ordering::Relaxed);
    major.store((orig & !0xffff) | 7, std::sync::atomic::Ordering::Relaxed);
    let e = expect_err(RegionReader::open(
        std::path::Path::new(&path),
        RegionKind::Resources,
    ));
    assert!(
        matches!(
            e,
            TableError::VersionMismatch {
                found_major: 7,
                supported_major: FORMAT_MAJOR,
                ..
            }
        ),
        "{e}"
    );
    major.store(orig, std::sync::atomic::Ordering::Relaxed);
    let rr = RegionReader::open(std::path::Path::new(&path), RegionKind::Resources).unwrap();
    assert!(matches!(
        expect_err(RegionReader::open(
            std::path::Path::new(&path),
            RegionKind::Allocations
        )),
        TableError::WrongKind { .. }
    ));
    // Scribble over the bucket heads and the bump pointer of the live,
    // mapped region: reads stay in bounds and end.
    for (off, v) in [
        (HEADER_SIZE, u64::MAX - 7),
        (HEADER_SIZE + 8, 4096),
        (offsets::KIND_WORDS, u64::MAX),
    ] {
        view.atomic_u64(off)
            .unwrap()
            .store(v, std::sync::atomic::Ordering::Relaxed);
    }
    let r = ResourcesReader::new(&rr).unwrap();
    let cat = r.stacks();
    assert!(cat.partial.is_some());
    let _ = r.threads();
}
