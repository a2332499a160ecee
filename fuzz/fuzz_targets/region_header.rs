//! Raw bytes as a region of either kind: header validation (magic,
//! version, kind, sizes, layout) and, when it passes, every reader entry
//! point. No fix-ups: the size checks are under test too.
#![no_main]

use heapdump_fuzz::{candidate_keys, exercise_allocations, exercise_resources, Image};
use heapdump_table::header::parse_header;
use heapdump_table::RegionKind;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let image = Image::new(data);
    let view = image.view();
    for kind in [RegionKind::Resources, RegionKind::Allocations] {
        if let Err(e) = parse_header(&view, kind) {
            // Every refusal renders as a message.
            assert!(!e.to_string().is_empty());
        }
    }
    exercise_allocations(view);
    exercise_resources(view, &candidate_keys(data));
});
