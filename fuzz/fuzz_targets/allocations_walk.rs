//! An allocations region image (size field fixed up to the input length):
//! the node walk with its seqlock retries, counters, request slot. Node
//! sequence words are made even unless the last byte is odd (see
//! `even_seqs_unless_flagged`).
#![no_main]

use heapdump_fuzz::{even_seqs_unless_flagged, exercise_allocations, fix_region_size, Image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    fix_region_size(&mut bytes);
    even_seqs_unless_flagged(&mut bytes);
    let image = Image::new(&bytes);
    exercise_allocations(image.view());
});
