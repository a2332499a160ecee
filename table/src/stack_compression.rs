//! Compression of stack traces (lists of return addresses).
//!
//! Each frame is stored as the difference from the previous frame (the
//! first from 0), mapped to unsigned by zigzag, and written as an LEB128
//! varint. Neighbouring frames usually lie in the same module, so most
//! frames take 2-4 bytes instead of 8.
//!
//! Invariants:
//! - `encode` then `decode` returns the input exactly, for any `u64`s
//!   (wrapping arithmetic: `0`, `u64::MAX`, decreasing addresses).
//! - `decode` never panics, never reads past its input and never returns
//!   more than `max_frames` frames: overlong varints (more than 10 bytes,
//!   or a 10th byte carrying bits above 64), truncated input and too many
//!   frames are errors.

/// Default and maximum number of frames kept per trace.
pub const MAX_FRAMES: usize = 64;
/// Longest encoding of one frame.
pub const MAX_VARINT_LEN: usize = 10;
/// Longest encoding of a trace of [`MAX_FRAMES`] frames: the longest trace
/// payload the resources table accepts.
pub const MAX_ENCODED_LEN: usize = MAX_FRAMES * MAX_VARINT_LEN;

/// Why a compressed trace could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum DecodeError {
    /// Input ended inside a varint.
    #[error("truncated varint at byte {0}")]
    Truncated(usize),
    /// A varint is longer than 10 bytes or overflows 64 bits.
    #[error("overlong varint at byte {0}")]
    Overlong(usize),
    /// More frames than allowed.
    #[error("more than {0} frames")]
    TooManyFrames(usize),
}

#[inline]
fn zigzag(v: i64) -> u64 {
    ((v << 1) ^ (v >> 63)) as u64
}

#[inline]
fn unzigzag(v: u64) -> i64 {
    ((v >> 1) as i64) ^ -((v & 1) as i64)
}

/// Appends the encoding of `frames` to `out`. No allocation beyond `out`'s
/// growth; callers on the allocation path pass a stack buffer via
/// [`encode_into`] instead.
pub fn encode(frames: &[u64], out: &mut Vec<u8>) {
    let mut buf = [0u8; MAX_VARINT_LEN];
    let mut prev = 0u64;
    for &f in frames {
        let n = write_varint(zigzag(f.wrapping_sub(prev) as i64), &mut buf);
        out.extend_from_slice(&buf[..n]);
        prev = f;
    }
}

/// Encodes `frames` into `out`, returning the number of bytes written, or
/// `None` if `out` is too small. Never allocates (safe inside `malloc`).
#[inline]
pub fn encode_into(frames: &[u64], out: &mut [u8]) -> Option<usize> {
    let mut pos = 0;
    let mut prev = 0u64;
    for &f in frames {
        // Bytes straight into `out` (no per-frame memcpy call).
        let mut v = zigzag(f.wrapping_sub(prev) as i64);
        loop {
            let byte = (v & 0x7f) as u8;
            v >>= 7;
            let slot = out.get_mut(pos)?;
            pos += 1;
            if v == 0 {
                *slot = byte;
                break;
            }
            *slot = byte | 0x80;
        }
        prev = f;
    }
    Some(pos)
}

#[inline]
fn write_varint(mut v: u64, buf: &mut [u8; MAX_VARINT_LEN]) -> usize {
    let mut i = 0;
    loop {
        let byte = (v & 0x7f) as u8;
        v >>= 7;
        if v == 0 {
            buf[i] = byte;
            return i + 1;
        }
        buf[i] = byte | 0x80;
        i += 1;
    }
}

/// Decodes a trace, allowing at most `max_frames` frames.
pub fn decode(bytes: &[u8], max_frames: usize) -> Result<Vec<u64>, DecodeError> {
    let mut frames = Vec::with_capacity(bytes.len().min(max_frames));
    let mut prev = 0u64;
    let mut pos = 0;
    while pos < bytes.len() {
        if frames.len() == max_frames {
            return Err(DecodeError::TooManyFrames(max_frames));
        }
        let start = pos;
        let mut value = 0u64;
        let mut shift = 0u32;
        loop {
            let Some(&b) = bytes.get(pos) else {
                return Err(DecodeError::Truncated(start));
            };
            pos += 1;
            if shift == 63 && b > 1 {
                // The 10th byte may only carry the 64th bit.
                return Err(DecodeError::Overlong(start));
            }
            value |= u64::from(b & 0x7f) << shift;
            if b & 0x80 == 0 {
                break;
            }
            shift += 7;
            if shift > 63 {
                return Err(DecodeError::Overlong(start));
            }
        }
        let f = prev.wrapping_add(unzigzag(value) as u64);
        frames.push(f);
        prev = f;
    }
    Ok(frames)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn roundtrip(frames: &[u64]) {
        let mut out = Vec::new();
        encode(frames, &mut out);
        let mut fixed = [0u8; MAX_ENCODED_LEN];
        let n = encode_into(frames, &mut fixed).unwrap();
        assert_eq!(&fixed[..n], &out[..]);
        assert_eq!(decode(&out, MAX_FRAMES).unwrap(), frames);
    }

    #[test]
    fn extremes_round_trip() {
        roundtrip(&[]);
        roundtrip(&[0]);
        roundtrip(&[u64::MAX]);
        roundtrip(&[
            u64::MAX,
            0,
            u64::MAX,
            1,
            0x7fff_ffff_ffff_ffff,
            0x8000_0000_0000_0000,
        ]);
        roundtrip(&[0x5555_0000_1000, 0x5555_0000_0f00, 0x7fff_1234_5678]);
    }

    #[test]
    fn nearby_frames_are_short() {
        let mut out = Vec::new();
        encode(
            &[0x5555_5555_1000, 0x5555_5555_1040, 0x5555_5555_0f80],
            &mut out,
        );
        assert!(out.len() <= 7 + 2 + 2, "{} bytes", out.len());
    }

    #[test]
    fn worst_case_trace_fits_the_bound() {
        // Every delta (the first one from 0 included) is i64::MIN, whose
        // zigzag is u64::MAX: ten bytes per frame.
        let frames: Vec<u64> = (0..MAX_FRAMES)
            .map(|i| if i % 2 == 0 { 1u64 << 63 } else { 0 })
            .collect();
        let mut out = Vec::new();
        encode(&frames, &mut out);
        assert_eq!(out.len(), MAX_ENCODED_LEN);
        assert_eq!(encode_into(&frames, &mut [0u8; MAX_ENCODED_LEN - 1]), None);
    }

    #[test]
    fn malformed_input_is_rejected() {
        assert_eq!(decode(&[0x80], 64), Err(DecodeError::Truncated(0)));
        assert_eq!(decode(&[0x02, 0xff], 64), Err(DecodeError::Truncated(1)));
        // 11-byte varint.
        let mut long = vec![0x80u8; 10];
        long.push(0);
        assert_eq!(decode(&long, 64), Err(DecodeError::Overlong(0)));
        // 10th byte with bits above the 64th.
        let mut over = vec![0xffu8; 9];
        over.push(0x02);
        assert_eq!(decode(&over, 64), Err(DecodeError::Overlong(0)));
        // 10th byte with only the 64th bit is fine.
        let mut max = vec![0xffu8; 9];
        max.push(0x01);
        assert!(decode(&max, 64).is_ok());
        assert_eq!(decode(&[2, 2, 2], 2), Err(DecodeError::TooManyFrames(2)));
    }

    proptest! {
        #[test]
        fn any_trace_round_trips(frames in proptest::collection::vec(any::<u64>(), 0..=MAX_FRAMES)) {
            roundtrip(&frames);
        }

        #[test]
        fn decreasing_traces_round_trip(start in any::<u64>(), steps in proptest::collection::vec(0u64..1 << 40, 0..MAX_FRAMES)) {
            let mut f = start;
            let frames: Vec<u64> = steps.iter().map(|s| { f = f.wrapping_sub(*s); f }).collect();
            roundtrip(&frames);
        }

        #[test]
        fn decode_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..800)) {
            if let Ok(f) = decode(&bytes, MAX_FRAMES) {
                prop_assert!(f.len() <= MAX_FRAMES);
            }
        }
    }
}
