//! Stack-trace decompression: any bytes decode or fail cleanly within the
//! frame limit; whatever decodes re-encodes to something that decodes to
//! the same frames; and frames taken from the input round-trip exactly.
#![no_main]

use heapdump_table::stack_compression::{decode, encode, encode_into, MAX_ENCODED_LEN, MAX_FRAMES};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, rest)) = data.split_first() else {
        return;
    };
    let max = usize::from(first) % (MAX_FRAMES + 2);
    if let Ok(frames) = decode(rest, max) {
        assert!(frames.len() <= max);
        let mut again = Vec::new();
        encode(&frames, &mut again);
        assert!(again.len() <= rest.len(), "canonical form is never longer");
        assert_eq!(decode(&again, max).as_ref(), Ok(&frames));
    }
    let frames: Vec<u64> = rest
        .chunks_exact(8)
        .take(MAX_FRAMES)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    let mut enc = Vec::new();
    encode(&frames, &mut enc);
    assert!(enc.len() <= MAX_ENCODED_LEN);
    let mut buf = [0u8; MAX_ENCODED_LEN];
    let n = encode_into(&frames, &mut buf).expect("fits");
    assert_eq!(&buf[..n], &enc[..]);
    assert_eq!(decode(&enc, MAX_FRAMES).as_deref(), Ok(&frames[..]));
    // A buffer one byte short refuses instead of writing past its end.
    if n > 0 {
        assert_eq!(encode_into(&frames, &mut buf[..n - 1]), None);
    }
});
