//! What a region's sample rate means to a reader: in sampled mode
//! (`offsets::SAMPLE_RATE` = R > 0) the agent recorded an allocation of
//! `s` bytes with probability `p(s) = 1 - exp(-s/R)` (a Poisson process
//! over allocated bytes), so each recorded block stands for
//! [`weight`]`(s, R) = 1 / p(s)` blocks of its size, and sums weighted so
//! are unbiased estimates of the whole heap's.
//!
//! Invariant: the agent and every reader use this one function, so the
//! weights a reader applies are exactly the inverse of the probabilities
//! the agent sampled with.

/// The largest sample rate (1 TiB): the agent refuses a larger
/// `HEAPDUMP_SAMPLE_RATE`, and a reader takes a larger header word for a
/// damaged one.
pub const MAX_RATE: u64 = 1 << 40;

/// `1 / (1 - exp(-s/R))`: how many blocks of `size` bytes one sampled block
/// stands for at `rate` (a block of 0 bytes counts as one of 1 byte).
pub fn weight(size: u64, rate: u64) -> f64 {
    let x = size.max(1) as f64 / rate.max(1) as f64;
    1.0 / -(-x).exp_m1()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_are_the_inverse_sampling_probability() {
        let r = 512 << 10;
        assert!((weight(r, r) - 1.0 / (1.0 - (-1.0f64).exp())).abs() < 1e-12);
        assert!((weight(64 << 20, r) - 1.0).abs() < 1e-12);
        // Small blocks: about R / s.
        assert!((weight(64, r) / (r as f64 / 64.0) - 1.0).abs() < 1e-3);
    }
}
