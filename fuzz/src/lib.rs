//! Shared code of heapdump's fuzz targets: an 8-aligned copy of the input
//! to read as a region, header fix-ups so mutated inputs reach the deep
//! layers, and one "exercise" function per reader that calls every entry
//! point the dumper uses and asserts the contract's invariants (DESIGN.md
//! §3 point 4: any bytes give an error or a partial result, never a crash,
//! a hang or a read outside the mapping).
//!
//! Out-of-bounds reads are caught by AddressSanitizer (cargo fuzz builds
//! with it): the image is a heap buffer of exactly the input's length
//! (rounded up to 8), so a read past the view is a heap-buffer-overflow.

use std::collections::HashSet;

use heapdump_table::header::{parse_header, read_counters, read_request};
use heapdump_table::stack_compression::{MAX_ENCODED_LEN, MAX_FRAMES};
use heapdump_table::{
    AllocationsReader, RegionKind, ResourceKey, ResourcesReader, SharedView, StackCatalog,
};

/// Offset of `region_size` in the static header.
pub const REGION_SIZE_AT: usize = 16;
/// Offset of `layout[0]` in the static header.
pub const LAYOUT_AT: usize = 56;

/// An 8-aligned heap copy of some bytes, readable through a [`SharedView`].
pub struct Image {
    words: Vec<u64>,
    len: usize,
}

impl Image {
    /// Copies `bytes` into a fresh 8-aligned buffer.
    pub fn new(bytes: &[u8]) -> Self {
        let mut words = vec![0u64; bytes.len().div_ceil(8)];
        for (w, c) in words.iter_mut().zip(bytes.chunks(8)) {
            let mut b = [0u8; 8];
            b[..c.len()].copy_from_slice(c);
            *w = u64::from_le_bytes(b);
        }
        Image {
            words,
            len: bytes.len(),
        }
    }

    /// A view of exactly the input's bytes. Valid while `self` lives.
    pub fn view(&self) -> SharedView {
        // SAFETY: `words` is a live heap allocation of at least `len` bytes
        // (len rounded up to 8), 8-aligned (u64 elements); it is never
        // reallocated while `self` lives and the views handed out are only
        // used inside the exercise functions, which borrow `self`.
        unsafe { SharedView::new(self.words.as_ptr().cast::<u8>(), self.len) }
    }
}

/// Makes the header's `region_size` agree with the input's length, so that
/// inputs whose length the fuzzer changed still reach the table layers.
pub fn fix_region_size(bytes: &mut [u8]) {
    let len = bytes.len() as u64;
    if let Some(w) = bytes.get_mut(REGION_SIZE_AT..REGION_SIZE_AT + 8) {
        w.copy_from_slice(&len.to_le_bytes());
    }
}

/// For a resources image: also makes `layout[3]` (end of data) agree.
pub fn fix_resources_end(bytes: &mut [u8]) {
    fix_region_size(bytes);
    let len = bytes.len() as u64;
    let at = LAYOUT_AT + 3 * 8;
    if let Some(w) = bytes.get_mut(at..at + 8) {
        w.copy_from_slice(&len.to_le_bytes());
    }
}

/// Candidate keys taken from the last 64 bytes of the input (the fuzzer can
/// steer them), plus a few fixed edge values.
pub fn candidate_keys(bytes: &[u8]) -> Vec<ResourceKey> {
    let tail = &bytes[bytes.len().saturating_sub(64)..];
    let mut keys: Vec<ResourceKey> = tail
        .chunks_exact(8)
        .map(|c| ResourceKey(u64::from_le_bytes(c.try_into().expect("8 bytes"))))
        .collect();
    let len = bytes.len() as u64;
    keys.extend(
        [
            0,
            8,
            4096,
            8192,
            len.saturating_sub(8),
            len,
            u64::MAX,
            u64::MAX - 7,
        ]
        .map(ResourceKey),
    );
    keys
}

/// Every allocations-region entry point the dumper uses.
pub fn exercise_allocations(view: SharedView) -> Option<Vec<heapdump_table::AllocationRecord>> {
    let _ = read_counters(&view);
    let _ = read_request(&view);
    // SAFETY: `view` stays mapped for the whole call (the caller's Image).
    let reader = unsafe { AllocationsReader::from_view(view) }.ok()?;
    let _ = reader.counters();
    let cap = reader.capacity();
    let (records, stats) = reader.snapshot();
    assert!(stats.nodes <= cap, "walk beyond capacity");
    assert_eq!(stats.reported as usize, records.len());
    assert!(stats.reported + stats.unstable <= stats.nodes);
    let mut seen = HashSet::new();
    for r in &records {
        assert_ne!(r.address, 0, "free node reported");
        assert!(r.size < 1 << 48);
        assert_eq!(r.stack.0 % 8, 0);
        assert_eq!(r.thread.0 % 8, 0);
        seen.insert(r.address);
    }
    let _ = stats.partial_reason();
    Some(records)
}

fn check_catalog(cat: &StackCatalog) {
    for s in &cat.stacks {
        assert!(s.frames.len() <= MAX_FRAMES);
    }
    for idx in cat.by_key.values() {
        assert!(*idx < cat.stacks.len());
    }
}

/// Every resources-region entry point the dumper uses; looks up
/// `extra_keys` too.
pub fn exercise_resources(view: SharedView, extra_keys: &[ResourceKey]) -> Option<()> {
    let _ = parse_header(&view, RegionKind::Resources);
    // SAFETY: `view` stays mapped for the whole call (the caller's Image).
    let reader = unsafe { ResourcesReader::from_view(view) }.ok()?;
    let _ = reader.stack_count();
    let cat = reader.stacks();
    check_catalog(&cat);
    let (threads, _partial) = reader.threads();
    let mut keys: Vec<ResourceKey> = cat.by_key.keys().copied().collect();
    keys.extend(threads.iter().map(|(k, _)| *k));
    keys.extend_from_slice(extra_keys);
    for k in keys {
        lookup(&reader, k);
    }
    Some(())
}

/// One key through every lookup, with the bounds the format promises.
pub fn lookup(reader: &ResourcesReader<'_>, k: ResourceKey) {
    if let Ok(b) = reader.stack_bytes(k) {
        assert!(b.len() <= MAX_ENCODED_LEN);
    }
    if let Ok(s) = reader.stack(k) {
        assert!(s.frames.len() <= MAX_FRAMES);
    }
    if let Ok(t) = reader.thread(k) {
        // Lossy UTF-8 turns each bad byte into a 3-byte U+FFFD.
        assert!(t.name.len() <= 3 * heapdump_table::resources_table::MAX_THREAD_NAME);
    }
}

/// A resources image and an allocations image packed into one input:
/// `[u32 LE resources length][resources][allocations]`.
pub fn split_pair(data: &[u8]) -> Option<(Vec<u8>, Vec<u8>)> {
    let n = u32::from_le_bytes(data.get(..4)?.try_into().ok()?) as usize;
    let rest = &data[4..];
    if n > rest.len() {
        return None;
    }
    let (a, b) = rest.split_at(n);
    Some((a.to_vec(), b.to_vec()))
}

/// Packs a pair for [`split_pair`].
pub fn join_pair(resources: &[u8], allocations: &[u8]) -> Vec<u8> {
    let mut out = (resources.len() as u32).to_le_bytes().to_vec();
    out.extend_from_slice(resources);
    out.extend_from_slice(allocations);
    out
}

/// What the dumper does with a pair: walk the live table, then resolve
/// every record's stack and thread key in the resources region.
pub fn exercise_pair(resources: &Image, allocations: &Image) {
    let records = exercise_allocations(allocations.view()).unwrap_or_default();
    // SAFETY: `resources` outlives this call.
    let Ok(reader) = (unsafe { ResourcesReader::from_view(resources.view()) }) else {
        return;
    };
    let cat = reader.stacks();
    check_catalog(&cat);
    let _ = reader.threads();
    for r in records.iter().take(4096) {
        // The dumper resolves through the catalog, falling back to a
        // direct lookup for keys the bucket walk did not reach.
        if !cat.by_key.contains_key(&r.stack) {
            lookup(&reader, r.stack);
        }
        lookup(&reader, r.thread);
    }
}

/// For an allocations image: makes every node's sequence word even (no
/// writer mid-update), unless the input's last byte is odd. Nodes that look
/// mid-update cost the walk its bounded retry time (up to half a second by
/// design); doing this for most inputs keeps the fuzzer fast on the rest of
/// the walk, while odd last bytes still exercise the retry path.
pub fn even_seqs_unless_flagged(bytes: &mut [u8]) {
    if bytes.last().is_none_or(|b| b & 1 == 1) {
        return;
    }
    let word = |b: &[u8], at: usize| {
        b.get(at..at + 8)
            .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
    };
    let (Some(nodes_off), Some(capacity)) = (
        word(bytes, LAYOUT_AT + 4 * 8),
        word(bytes, LAYOUT_AT + 5 * 8),
    ) else {
        return;
    };
    let len = bytes.len() as u64;
    if nodes_off % 8 != 0 || nodes_off >= len {
        return;
    }
    let nodes = capacity.min((len - nodes_off) / 32);
    for i in 0..nodes {
        let at = (nodes_off + 32 * i) as usize;
        bytes[at] &= !1;
    }
}
