//! A resources image and an allocations image together (see
//! `heapdump_fuzz::split_pair`), read the way the dumper builds a
//! snapshot: walk the live table, resolve each record's stack and thread.
#![no_main]

use heapdump_fuzz::{
    even_seqs_unless_flagged, exercise_pair, fix_region_size, fix_resources_end, split_pair, Image,
};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((mut res, mut alloc)) = split_pair(data) else {
        return;
    };
    fix_resources_end(&mut res);
    fix_region_size(&mut alloc);
    even_seqs_unless_flagged(&mut alloc);
    exercise_pair(&Image::new(&res), &Image::new(&alloc));
});
