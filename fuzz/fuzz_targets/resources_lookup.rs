//! A resources region image (size and data end fixed up to the input
//! length): bucket walks (stacks), the thread list, and lookups of every
//! key found plus keys taken from the input's tail.
#![no_main]

use heapdump_fuzz::{candidate_keys, exercise_resources, fix_resources_end, Image};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut bytes = data.to_vec();
    fix_resources_end(&mut bytes);
    let image = Image::new(&bytes);
    exercise_resources(image.view(), &candidate_keys(&bytes));
});
