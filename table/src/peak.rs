//! The heap at its peak: which moment the heap was highest at, so that a
//! reader can rebuild the heap's composition then.
//!
//! The heap at time `T` is every block allocated at or before `T` and
//! freed after it. The live table holds those still live (their
//! allocation times are recorded); the rest, freed since `T`, are counted
//! per stack by the writers in *peak blocks* of the resources region
//! (`ResourcesWriter::add_peak_freed`). So the writers only keep `T`
//! current: each time live bytes pass the last peak by more than
//! 1/[`TOLERANCE_DIV`], the peak moves to now and its *generation* is
//! bumped, which makes every peak block's old counts stale (a logarithmic
//! number of times however long the process runs). A free then costs one
//! comparison of the block's allocation time with `T`, and, for a block
//! from before the peak, one slot update in its thread's peak block.
//!
//! Layout (bytes of the allocations region, inside its header page,
//! format 1.4, zero in older regions): at [`PEAK_OFF`] six words: `seq` (a
//! seqlock over the next four), `lock` (writers' try-lock), `generation`
//! (0: no peak yet), `time` (microseconds since the region's clock base,
//! from the coarse clock record times use), and the running live bytes
//! and blocks when the peak was taken.
//!
//! Tolerance: the heap's highest point may be above the recorded peak by
//! up to 1/[`TOLERANCE_DIV`] of it (a rise smaller than that does not move
//! the peak), plus what the writers' running total lags (a 64 KiB batch
//! per thread).
//!
//! One clock tick: `T` and record times are coarse (a tick is 1-10 ms), so
//! a block allocated after the peak moved, in the same tick, would read
//! `T` too and, freed later, count as live at the peak: blocks that never
//! coexisted (a buffer freed and allocated again) would add up there,
//! above any height the heap reached. Writers stamp a record no earlier
//! than [`PeakProbe::first_after_us`] (`T` + 1 µs) instead, so a block
//! allocated once its thread sees the move is after the peak; one
//! allocated by a thread that has not seen it yet counts as before it (the
//! moment of staleness every peak reading has). A move in the tick of the
//! last one is recorded 1 µs after it (never before a block stamped since
//! then, which the heap at the move holds): the peak's time runs ahead of
//! the clock by at most a microsecond per move within one tick.
//!
//! Invariants:
//! - Writers never wait: one that finds the lock taken leaves the peak to
//!   the next rise.
//! - Readers take the words between two equal even `seq` readings, a
//!   bounded number of tries.

use std::sync::atomic::{fence, AtomicU64, Ordering};

use crate::shared_view::SharedView;

/// Where the peak words start in the allocations region (header page).
pub const PEAK_OFF: u64 = 1280;
const W_SEQ: u64 = PEAK_OFF;
const W_LOCK: u64 = PEAK_OFF + 8;
const W_GEN: u64 = PEAK_OFF + 16;
const W_TIME: u64 = PEAK_OFF + 24;
const W_LIVE: u64 = PEAK_OFF + 32;
const W_BLOCKS: u64 = PEAK_OFF + 40;
// The peak words lie between the header words and the curve.
const _: () = assert!(PEAK_OFF >= crate::timeline::first_free_after_words());
const _: () = assert!(W_BLOCKS + 8 <= crate::timeline::TIMELINE_OFF);

/// The peak moves when live bytes pass it by more than 1/`TOLERANCE_DIV`.
pub const TOLERANCE_DIV: u64 = 64;

/// The recorded peak.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Peak {
    /// Generation (bumped at each move; the peak blocks' tag).
    pub generation: u64,
    /// Microseconds since the region's clock base (coarse clock).
    pub time_us: u64,
    /// The writers' running live bytes then.
    pub live_bytes: u64,
    /// Live blocks then.
    pub live_blocks: u64,
}

fn word(view: &SharedView, off: u64) -> &AtomicU64 {
    // Inside the header page, which every region has.
    view.atomic_u64(off)
        .expect("peak word inside the header page")
}

/// Whether live bytes `live` pass the recorded peak by enough to move it
/// (one relaxed load).
#[inline]
pub fn due(view: &SharedView, live: u64) -> bool {
    let p = word(view, W_LIVE).load(Ordering::Relaxed);
    live > p.saturating_add(p / TOLERANCE_DIV)
}

/// Moves the peak to `time_us` with `live` bytes in `blocks` blocks, if
/// still due and no other writer is moving it. Returns whether it moved.
pub fn offer(view: &SharedView, time_us: u64, live: u64, blocks: u64) -> bool {
    if !due(view, live) {
        return false;
    }
    let lock = word(view, W_LOCK);
    if lock
        .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    let moved = due(view, live);
    if moved {
        // Never before a block allocated since the last move (stamped at
        // least 1 µs after it, see `PeakProbe::first_after_us`): the
        // heap now holds those blocks.
        let time_us = time_us.max(word(view, W_TIME).load(Ordering::Relaxed).wrapping_add(1));
        let seq = word(view, W_SEQ);
        let s = seq.load(Ordering::Relaxed);
        seq.store(s.wrapping_add(1) | 1, Ordering::Relaxed);
        fence(Ordering::Release);
        word(view, W_TIME).store(time_us, Ordering::Relaxed);
        word(view, W_LIVE).store(live, Ordering::Relaxed);
        word(view, W_BLOCKS).store(blocks, Ordering::Relaxed);
        // The generation last, with Release: a writer that sees the new
        // generation also sees the new time (see `current`).
        word(view, W_GEN).fetch_add(1, Ordering::Release);
        seq.store(s.wrapping_add(2) & !1, Ordering::Release);
    }
    lock.store(0, Ordering::Release);
    moved
}

/// The free path's view of the peak: its generation and time, two plain
/// loads with no range check (checked once, at construction).
#[derive(Clone, Copy, Debug)]
pub struct PeakProbe {
    view: SharedView,
}

impl PeakProbe {
    /// A probe of an allocations region's view; `None` if the view is
    /// smaller than a header page.
    pub fn new(view: SharedView) -> Option<PeakProbe> {
        ((view.len() as u64) >= crate::header::HEADER_SIZE).then_some(PeakProbe { view })
    }

    /// The current peak's generation and time (0: no peak yet). The pair
    /// may be a moment stale, which the tolerance covers.
    #[inline(always)]
    pub fn current(&self) -> (u64, u64) {
        // SAFETY: both words lie in the header page, which the view holds
        // (checked in `new`), at 8-aligned offsets.
        unsafe {
            let gen = self
                .view
                .atomic_u64_unchecked(W_GEN)
                .load(Ordering::Acquire);
            (
                gen,
                self.view
                    .atomic_u64_unchecked(W_TIME)
                    .load(Ordering::Relaxed),
            )
        }
    }

    /// The earliest time a block allocated now may be stamped with: 1 µs
    /// after the current peak's, so that a block allocated after the peak
    /// moved, in the peak's own clock tick, is not taken for one from
    /// before it (see the module's "One clock tick"). One relaxed load of
    /// the line the free path reads anyway; a stale value only leaves the
    /// block counted as before the peak.
    #[inline(always)]
    pub fn first_after_us(&self) -> u64 {
        // SAFETY: the word lies in the header page, which the view holds
        // (checked in `new`), at an 8-aligned offset.
        unsafe { self.view.atomic_u64_unchecked(W_TIME) }
            .load(Ordering::Relaxed)
            .wrapping_add(1)
    }
}

/// Reads the peak; `None` before the first one, or without a stable
/// reading in a bounded number of tries.
pub fn read(view: &SharedView) -> Option<Peak> {
    if (view.len() as u64) < crate::header::HEADER_SIZE {
        return None;
    }
    for _ in 0..1000 {
        let s1 = word(view, W_SEQ).load(Ordering::Acquire);
        if s1 & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let p = Peak {
            generation: word(view, W_GEN).load(Ordering::Relaxed),
            time_us: word(view, W_TIME).load(Ordering::Relaxed),
            live_bytes: word(view, W_LIVE).load(Ordering::Relaxed),
            live_blocks: word(view, W_BLOCKS).load(Ordering::Relaxed),
        };
        fence(Ordering::Acquire);
        if word(view, W_SEQ).load(Ordering::Relaxed) != s1 {
            continue;
        }
        return (p.generation != 0).then_some(p);
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_peak_moves_only_on_a_rise_past_the_tolerance() {
        let mut mem = vec![0u64; (crate::header::HEADER_SIZE / 8) as usize];
        // SAFETY: the vector outlives the view and is 8-aligned.
        let v = unsafe { SharedView::new(mem.as_mut_ptr().cast(), mem.len() * 8) };
        assert_eq!(read(&v), None);
        assert!(offer(&v, 10, 6400, 1));
        assert!(!offer(&v, 11, 6500, 2), "within 1/64");
        assert!(offer(&v, 12, 6501, 3));
        assert!(!offer(&v, 13, 100, 1), "a fall never moves it");
        // In the tick of the last move: after the blocks stamped since.
        assert!(offer(&v, 12, 7000, 4));
        assert_eq!(read(&v).unwrap().time_us, 13);
        let p = read(&v).unwrap();
        assert_eq!(
            (p.generation, p.time_us, p.live_bytes, p.live_blocks),
            (3, 13, 7000, 4)
        );
        assert_eq!(PeakProbe::new(v).unwrap().current(), (3, 13));
        assert_eq!(PeakProbe::new(v).unwrap().first_after_us(), 14);
        drop(mem);
    }
}
