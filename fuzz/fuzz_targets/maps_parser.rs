//! `/proc/PID/maps` text as a target shapes it (its file names are its
//! own: newlines written `\012`, spaces, ` (deleted)`): parsed without a
//! panic, every mapping non-empty, lookups bounded.
#![no_main]

use heapdump::symbolization::maps::{find, parse_maps};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let text = String::from_utf8_lossy(data);
    let maps = parse_maps(&text);
    for m in &maps {
        assert!(m.start < m.end);
        assert!(find(&maps, m.start).is_some());
        let _ = m.basename();
    }
});
