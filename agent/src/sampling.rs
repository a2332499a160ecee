//! Sampled mode (`HEAPDUMP_SAMPLE_RATE=BYTES`): a Poisson process over
//! allocated bytes, so the agent records about one allocation per `R`
//! bytes and every sum a snapshot reports is an unbiased estimate.
//!
//! Each thread counts down the bytes to its next sample, drawn from an
//! exponential distribution of mean `R`; an allocation of `s` bytes that
//! reaches zero is sampled, and a fresh distance is drawn. By the
//! exponential's lack of memory, an allocation of `s` bytes is sampled
//! with probability `p(s) = 1 - exp(-s/R)` whatever came before it (large
//! allocations by the same rule: `p` tends to 1). A sampled block stands
//! for `w(s) = 1 / p(s)` blocks of its size: `E[sum over sampled blocks of
//! w(s) * f(s)] = sum over all blocks of f(s)`, which makes every live and
//! cumulative sum unbiased. The dumper computes `w(s)` from each live
//! block's size and the rate in the header (both exact, so the live
//! estimate needs nothing stored per block); the cumulative per-stack
//! counters are incremented here by `w(s)` rounded at random to an integer
//! (`floor(w)` or `floor(w) + 1` with the fraction's probability: still
//! unbiased).
//!
//! Invariants:
//! - An allocation that is not sampled costs a compare and a subtraction
//!   on this thread's countdown ([`skips`]: an initial-exec thread-local
//!   word, see `initial_exec_tls`), before any other thread state is
//!   touched; its free costs one load of the sampled-address filter
//!   ([`maybe_sampled`]), which always answers "maybe" for an address
//!   that was recorded (and for the preload's bootstrap-arena blocks,
//!   which it marks so that no fast path hands them to the allocator),
//!   never "no". In exact mode [`EXACT`] is set before anything is
//!   recorded ([`configure`]) and answers "maybe" for every address
//!   without touching the filter: one load of a flag that is never
//!   written again (a line every core keeps), where a slot of the 32 KiB
//!   filter would be a random line per free, evicting the program's own
//!   data from the L1 cache (+1.3 misses per malloc+free pair on
//!   `bench/instructions`' churn when it was read in exact mode too).
//! - The countdown is 0 until the thread's first draw, and every
//!   allocation that reaches it goes to [`SamplerState::reached`]. An
//!   allocation made while the agent is busy on this thread (its own, or
//!   the `malloc` inside a forwarded C++ `new`) also counts down; if it
//!   reaches the sample point it is not recorded, and a fresh distance is
//!   drawn ([`SamplerState::redraw`]). By the exponential's lack of memory
//!   the next allocation's chance is still `p(s)`: its weight stays right.
//! - The random source is a per-thread xorshift generator (no lock, no
//!   system call); `HEAPDUMP_SAMPLE_SEED` makes it reproducible (seeded
//!   from the seed and the order in which threads first allocate).

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, Ordering};

/// Mean bytes between samples for the process; 0 = exact mode. Set once
/// at start (Relaxed: a free that reads 0 before start takes the exact
/// path, which is always correct).
static RATE: AtomicU64 = AtomicU64::new(0);
/// Exact mode is configured: every address may hold a recorded block
/// (see [`maybe_sampled`]). False before [`configure`], when nothing is
/// recorded yet, and in sampled mode. Set once (Relaxed: as [`RATE`]).
static EXACT: AtomicBool = AtomicBool::new(false);
/// `HEAPDUMP_SAMPLE_SEED` (0: seeded from the clock).
static SEED: AtomicU64 = AtomicU64::new(0);
/// Threads seeded so far (makes per-thread seeds distinct).
static THREADS: AtomicU64 = AtomicU64::new(0);

/// The sampled-address filter: a counting filter, whose slot counts the
/// live recorded blocks whose address hashes to it. 32 KiB, so it stays
/// in the L1 cache of a thread that frees often; a slot that reaches 255
/// stays there (answers "maybe" for good), which only costs lookups.
struct AddressFilter([AtomicU8; FILTER_SLOTS]);

const FILTER_SLOTS: usize = 1 << 15;

impl AddressFilter {
    const fn new() -> Self {
        Self([const { AtomicU8::new(0) }; FILTER_SLOTS])
    }

    #[inline(always)]
    fn slot(&self, addr: usize) -> &AtomicU8 {
        let h = (addr as u64 >> 4).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 49;
        &self.0[h as usize % FILTER_SLOTS]
    }

    #[inline]
    fn note_recorded(&self, addr: usize) {
        // Relaxed: a free of this block happens after the allocation
        // returned (the program's own synchronisation hands the pointer
        // over), so it reads this increment or a later value.
        let _ = self
            .slot(addr)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v < u8::MAX).then(|| v + 1)
            });
    }

    #[inline]
    fn note_removed(&self, addr: usize) {
        // A saturated slot no longer knows its count: it stays "maybe".
        let _ = self
            .slot(addr)
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |v| {
                (v != 0 && v != u8::MAX).then(|| v - 1)
            });
    }

    /// Every slot "maybe", for good (tests: a slot at 255 stays there).
    #[cfg(test)]
    fn saturate(&self) {
        for slot in &self.0 {
            slot.store(u8::MAX, Ordering::Relaxed);
        }
    }

    #[inline(always)]
    fn maybe(&self, addr: usize) -> bool {
        self.slot(addr).load(Ordering::Relaxed) != 0
    }
}

/// The process's filter (see [`maybe_sampled`]).
static FILTER: AddressFilter = AddressFilter::new();

/// Turns sampled mode on with mean `rate` bytes between samples (0: off).
/// Called before the agent records anything.
///
/// In exact mode [`EXACT`] is set, which sends every free to the table:
/// [`maybe_sampled`] then answers for both modes, and a hook's `free`
/// needs no rate check. (Before this call nothing is recorded, so the
/// empty filter's "no" is right then too. The stores are Relaxed: the
/// agent publishes its writers with a Release store after this call, and
/// a block's free happens after its recording, which came after an
/// Acquire load of that state.)
pub fn configure(rate: u64, seed: u64) {
    SEED.store(seed, Ordering::Relaxed);
    RATE.store(rate, Ordering::Relaxed);
    EXACT.store(rate == 0, Ordering::Relaxed);
}

/// The sample rate in force (0: exact mode).
#[inline]
pub fn rate() -> u64 {
    RATE.load(Ordering::Relaxed)
}

/// Marks `addr` as a recorded block (after its insert).
#[inline]
pub fn note_recorded(addr: usize) {
    FILTER.note_recorded(addr)
}

/// Unmarks `addr` (after its record was removed).
#[inline]
pub fn note_removed(addr: usize) {
    FILTER.note_removed(addr)
}

/// False only when no recorded block can be at `addr`: then a free needs
/// no table lookup. Always true in exact mode once the agent is
/// configured (see [`configure`]), without a look at the filter.
#[inline(always)]
pub fn maybe_sampled(addr: usize) -> bool {
    EXACT.load(Ordering::Relaxed) || FILTER.maybe(addr)
}

/// Whether an allocation of `size` bytes is certainly not sampled: then
/// it has been counted down and needs nothing more. False means "ask
/// [`SamplerState::reached`]" (the sample point is reached, or this
/// thread has not drawn yet). Always false in exact mode and before the
/// agent starts: only [`SamplerState`] sets the countdown, and only in
/// sampled mode, so a hook may ask this before anything else, with no
/// [`rate`] check.
///
/// One unsigned compare: the countdown is never negative (every store
/// is a draw, at least 1, or a positive remainder), so `left > size`
/// also says `left > 0`.
#[inline(always)]
pub fn skips(size: u64) -> bool {
    let p = crate::initial_exec_tls::sample_countdown();
    // SAFETY: this thread's own countdown word, valid while the thread
    // runs, touched by no other thread.
    unsafe {
        let left = *p as u64;
        if left > size {
            *p = (left - size) as i64;
            return true;
        }
    }
    false
}

/// This thread's countdown (see [`skips`]).
fn countdown() -> i64 {
    // SAFETY: as in `skips`.
    unsafe { *crate::initial_exec_tls::sample_countdown() }
}

fn set_countdown(v: i64) {
    // SAFETY: as in `skips`.
    unsafe { *crate::initial_exec_tls::sample_countdown() = v }
}

/// A thread's sampling state (in its `ThreadState`); the countdown itself
/// is an initial-exec thread-local word (see [`skips`]).
pub struct SamplerState {
    /// xorshift64* state; 0: not seeded yet, so no distance has been
    /// drawn on this thread either (a draw seeds it).
    rng: Cell<u64>,
}

impl SamplerState {
    /// A fresh state (usable in a `const` thread-local initialiser).
    pub const fn new() -> Self {
        SamplerState { rng: Cell::new(0) }
    }

    /// The next 64 random bits.
    fn next(&self) -> u64 {
        let mut x = self.rng.get();
        if x == 0 {
            let mut seed = SEED.load(Ordering::Relaxed);
            if seed == 0 {
                seed = heapdump_table::region::clock_ns(libc::CLOCK_MONOTONIC);
            }
            x = splitmix(seed ^ splitmix(THREADS.fetch_add(1, Ordering::Relaxed)));
            if x == 0 {
                x = 1;
            }
        }
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.rng.set(x);
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// A uniform number in (0, 1].
    fn uniform(&self) -> f64 {
        ((self.next() >> 11) + 1) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// An exponential distance of mean `rate` bytes (at least 1).
    fn draw(&self, rate: u64) -> i64 {
        let d = -self.uniform().ln() * rate as f64;
        (d.min(i64::MAX as f64 / 2.0) as i64).max(1)
    }

    /// For an allocation of `size` bytes that [`skips`] did not skip:
    /// whether it is sampled, and if so how many allocations it stands for
    /// in the cumulative counters (`w(size)` rounded at random, see the
    /// module doc). Must be called on the thread that owns this state.
    #[inline]
    pub fn reached(&self, size: u64, rate: u64) -> Option<u64> {
        let mut left = countdown();
        if self.rng.get() == 0 {
            // This thread's first allocation: its first distance.
            left = self.draw(rate);
        }
        left = left.saturating_sub(size.min(i64::MAX as u64) as i64);
        if left > 0 {
            set_countdown(left);
            return None;
        }
        self.sampled(size, rate)
    }

    /// An allocation that reached the sample point while the agent could
    /// not record it (see the module doc): a fresh distance.
    #[cold]
    pub fn redraw(&self, rate: u64) {
        set_countdown(self.draw(rate));
    }

    #[cold]
    fn sampled(&self, size: u64, rate: u64) -> Option<u64> {
        set_countdown(self.draw(rate));
        let w = weight(size, rate);
        let whole = w.floor();
        let extra = u64::from(self.uniform() <= w - whole);
        Some(whole as u64 + extra)
    }
}

impl Default for SamplerState {
    fn default() -> Self {
        Self::new()
    }
}

pub use heapdump_table::sampling::weight;

fn splitmix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sampled_fraction_and_the_weighted_count_match_the_model() {
        // 400 000 allocations of 256 bytes at R = 64 KiB: p = 1 -
        // exp(-1/256), about 1 560 samples; the weighted count estimates
        // 400 000. Its standard deviation is sqrt(N (1-p)/p) ~ 10 100
        // (2.5 %); the bound is 6 of them: with a fixed seed the test is
        // deterministic, and for any seed it fails with probability < 1e-8.
        // A thread of its own: the countdown is per thread.
        std::thread::spawn(sampled_fraction_matches_the_model)
            .join()
            .unwrap();
    }

    fn sampled_fraction_matches_the_model() {
        let s = SamplerState::new();
        let (n, size, rate) = (400_000u64, 256u64, 64u64 << 10);
        s.rng.set(0x1234_5678_9abc_def1);
        set_countdown(s.draw(rate));
        let mut samples = 0u64;
        let mut estimate = 0u64;
        for _ in 0..n {
            if skips(size) {
                continue;
            }
            if let Some(k) = s.reached(size, rate) {
                samples += 1;
                estimate += k;
            }
        }
        let p = 1.0 - (-(size as f64) / rate as f64).exp();
        let sd = (n as f64 * (1.0 - p) / p).sqrt();
        assert!(
            (estimate as f64 - n as f64).abs() < 6.0 * sd,
            "{estimate} vs {n}"
        );
        let expected = n as f64 * p;
        assert!(
            (samples as f64 - expected).abs() < 6.0 * expected.sqrt(),
            "{samples}"
        );
    }

    #[test]
    fn the_filter_answers_maybe_for_recorded_addresses_until_removed() {
        // A filter of its own: the process's is in use once an agent in
        // this test binary starts in sampled mode.
        let f = Box::new(AddressFilter::new());
        let a = 0x7f00_dead_b000usize;
        assert!(!f.maybe(a));
        f.note_recorded(a);
        f.note_recorded(a);
        assert!(f.maybe(a));
        f.note_removed(a);
        assert!(f.maybe(a));
        f.note_removed(a);
        assert!(!f.maybe(a));
        f.note_removed(a); // never below zero
        assert!(!f.maybe(a));
        // Saturated: "maybe" everywhere, for good.
        f.saturate();
        for addr in (0..1 << 20).step_by(16).map(|x| a + x) {
            assert!(f.maybe(addr));
        }
        f.note_recorded(a); // no overflow past 255
        f.note_removed(a);
        assert!(f.maybe(a));
    }
}
