//! The memory curve: points of (time, live bytes, live blocks, bytes
//! allocated so far) in the allocations region's header page, from the
//! start of recording to now, in bounded space for a process that runs for
//! months.
//!
//! Layout (bytes of the allocations region, inside its header page,
//! format 1.4; zero in regions of older writers, which read as "no
//! points"): at [`TIMELINE_OFF`] eight words: `seq` (a seqlock: odd while a
//! writer changes the points), `lock` (writers' try-lock: a writer that
//! finds it taken skips its point, never waits), `count`, `thinned`
//! (points removed so far), and the writer's view of the last point
//! (`last time`, `last live`) and the highest point's live bytes; then
//! [`CAPACITY`] points of four words each, oldest first.
//!
//! Invariants:
//! - Nothing here allocates: writers run inside the agent's allocation
//!   hooks.
//! - Writers never wait: one that finds the lock taken drops its point
//!   (the next one comes at the next change), so the allocation path
//!   never blocks on the curve.
//! - Points are appended in time order. When the array is full, the older
//!   half is thinned (every other point dropped), except the first point
//!   and the highest: the whole history stays, coarser the older it is,
//!   fine-grained for the recent past, and the peak is never thinned away.
//! - Readers take the points between two equal even `seq` readings, bound
//!   `count` by [`CAPACITY`], and drop a point whose time goes backwards:
//!   whatever the bytes, a reader returns at most [`CAPACITY`] points and
//!   never reads outside the header page.

use std::sync::atomic::{fence, Ordering};

use crate::header::{offsets, HEADER_SIZE};
use crate::shared_view::SharedView;

/// Where the curve starts in the allocations region (in the header page).
pub const TIMELINE_OFF: u64 = 1536;
const W_SEQ: u64 = TIMELINE_OFF;
const W_LOCK: u64 = TIMELINE_OFF + 8;
const W_COUNT: u64 = TIMELINE_OFF + 16;
const W_THINNED: u64 = TIMELINE_OFF + 24;
const W_LAST_TIME: u64 = TIMELINE_OFF + 32;
const W_LAST_LIVE: u64 = TIMELINE_OFF + 40;
const W_MAX_LIVE: u64 = TIMELINE_OFF + 48;
const POINTS_OFF: u64 = TIMELINE_OFF + 64;
const POINT_SIZE: u64 = 32;
/// Points the curve holds before it thins.
pub const CAPACITY: u64 = (HEADER_SIZE - POINTS_OFF) / POINT_SIZE;
// The curve lies after every header word and inside the header page.
const _: () = assert!(TIMELINE_OFF >= first_free_after_words());
const _: () = assert!(POINTS_OFF + CAPACITY * POINT_SIZE <= HEADER_SIZE);
const _: () = assert!(CAPACITY >= 64);

/// A point is taken when live bytes moved by more than 1/`MOVE` of the
/// last point's...
pub const MOVE: u64 = 32;
/// ...or rose more than 1/`RISE` above the highest point (so the curve's
/// highest point is within 1/`RISE` of the true peak's running total)...
pub const RISE: u64 = 64;
/// ...or this long passed since the last point (checked at a change).
pub const PERIOD_NS: u64 = 1_000_000_000;
/// At most one point per this long, except a new high.
pub const MIN_GAP_NS: u64 = 10_000_000;

/// One point of the curve.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Point {
    /// `CLOCK_MONOTONIC`, ns (convert with the header's clock base).
    pub time_ns: u64,
    /// Live bytes.
    pub live_bytes: u64,
    /// Live blocks.
    pub live_blocks: u64,
    /// Bytes allocated so far (cumulative).
    pub alloc_bytes: u64,
}

/// The curve as read.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Curve {
    /// Points, oldest first.
    pub points: Vec<Point>,
    /// Points thinned away so far.
    pub thinned: u64,
}

fn word(view: &SharedView, off: u64) -> &std::sync::atomic::AtomicU64 {
    // The curve lies inside the header page, which every region has (its
    // creator checked the size), so this cannot fail.
    view.atomic_u64(off)
        .expect("timeline word inside the header page")
}

fn point_at(view: &SharedView, i: u64) -> Point {
    let base = POINTS_OFF + i * POINT_SIZE;
    let ld = |o| word(view, base + o).load(Ordering::Relaxed);
    Point {
        time_ns: ld(0),
        live_bytes: ld(8),
        live_blocks: ld(16),
        alloc_bytes: ld(24),
    }
}

fn store_point(view: &SharedView, i: u64, p: Point) {
    let base = POINTS_OFF + i * POINT_SIZE;
    let st = |o, v| word(view, base + o).store(v, Ordering::Relaxed);
    st(0, p.time_ns);
    st(8, p.live_bytes);
    st(16, p.live_blocks);
    st(24, p.alloc_bytes);
}

/// Whether a point with `live` bytes at `now_ns` is due, from the writer's
/// last point (cheap: three relaxed loads; no lock).
#[inline]
pub fn due(view: &SharedView, now_ns: u64, live: u64) -> bool {
    let last_t = word(view, W_LAST_TIME).load(Ordering::Relaxed);
    if last_t == 0 {
        return true;
    }
    let max = word(view, W_MAX_LIVE).load(Ordering::Relaxed);
    if live > max.saturating_add(max / RISE) {
        return true;
    }
    let gap = now_ns.saturating_sub(last_t);
    if gap < MIN_GAP_NS {
        return false;
    }
    let last = word(view, W_LAST_LIVE).load(Ordering::Relaxed);
    gap >= PERIOD_NS || live.abs_diff(last) > last / MOVE
}

/// Appends `p` if no other writer is appending (else drops it), thinning
/// the older half first when the array is full. Returns whether it was
/// appended.
pub fn append(view: &SharedView, p: Point) -> bool {
    let lock = word(view, W_LOCK);
    // Acquire: the previous writer's points and words are seen.
    if lock
        .compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed)
        .is_err()
    {
        return false;
    }
    let seq = word(view, W_SEQ);
    let s = seq.load(Ordering::Relaxed);
    seq.store(s.wrapping_add(1) | 1, Ordering::Relaxed);
    // Release fence after making `seq` odd: a reader that sees any point
    // written below also sees the odd `seq` and retries.
    fence(Ordering::Release);
    let mut count = word(view, W_COUNT).load(Ordering::Relaxed).min(CAPACITY);
    let last_time = word(view, W_LAST_TIME).load(Ordering::Relaxed);
    let p = Point {
        // Time order, even if clocks of racing writers interleave.
        time_ns: p.time_ns.max(last_time),
        ..p
    };
    if count == CAPACITY {
        count = thin(view, count);
    }
    store_point(view, count, p);
    word(view, W_COUNT).store(count + 1, Ordering::Relaxed);
    word(view, W_LAST_TIME).store(p.time_ns, Ordering::Relaxed);
    word(view, W_LAST_LIVE).store(p.live_bytes, Ordering::Relaxed);
    let max = word(view, W_MAX_LIVE);
    if p.live_bytes > max.load(Ordering::Relaxed) {
        max.store(p.live_bytes, Ordering::Relaxed);
    }
    // Release: the points are written before `seq` is even again.
    seq.store(s.wrapping_add(2) & !1, Ordering::Release);
    lock.store(0, Ordering::Release);
    true
}

/// Drops every other point of the older half, keeping the first point and
/// the highest; returns the new count. Caller holds the lock.
fn thin(view: &SharedView, count: u64) -> u64 {
    // On the stack: this runs inside an allocation hook, where allocating
    // would recurse into it.
    let mut points = [Point::default(); CAPACITY as usize];
    let count = count.min(CAPACITY);
    for (i, p) in points.iter_mut().enumerate().take(count as usize) {
        *p = point_at(view, i as u64);
    }
    let points = &points[..count as usize];
    let peak = points
        .iter()
        .enumerate()
        .max_by_key(|(i, p)| (p.live_bytes, std::cmp::Reverse(*i)))
        .map_or(0, |(i, _)| i);
    let half = count / 2;
    let mut kept = 0u64;
    for (i, p) in points.iter().enumerate() {
        let i_u = i as u64;
        if i == 0 || i == peak || i_u >= half || i_u.is_multiple_of(2) {
            // `kept <= i`: a point is never written over before it is read.
            store_point(view, kept, *p);
            kept += 1;
        }
    }
    word(view, W_THINNED).fetch_add(count - kept, Ordering::Relaxed);
    kept
}

/// Reads the curve (see the module invariants). `None` when no stable
/// reading was had in a bounded number of tries (a writer kept it busy,
/// or the words are damaged).
pub fn read(view: &SharedView) -> Option<Curve> {
    if (view.len() as u64) < HEADER_SIZE {
        return None;
    }
    for _ in 0..1000 {
        let s1 = word(view, W_SEQ).load(Ordering::Acquire);
        if s1 & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let count = word(view, W_COUNT).load(Ordering::Relaxed).min(CAPACITY);
        let thinned = word(view, W_THINNED).load(Ordering::Relaxed);
        let points: Vec<Point> = (0..count).map(|i| point_at(view, i)).collect();
        // Acquire fence: the loads above happen before `seq` is read again.
        fence(Ordering::Acquire);
        if word(view, W_SEQ).load(Ordering::Relaxed) != s1 {
            continue;
        }
        let mut out = Vec::with_capacity(points.len());
        for p in points {
            if out.last().is_some_and(|l: &Point| p.time_ns < l.time_ns) || p.time_ns == 0 {
                continue;
            }
            out.push(p);
        }
        return Some(Curve {
            points: out,
            thinned,
        });
    }
    None
}

/// Whether a region's writer keeps the curve (format 1.4 and later).
pub fn kept_by(version_minor: u16) -> bool {
    version_minor >= 4
}

/// The first byte after the header words of an allocations region (the
/// curve and the peak words lie after it: checked at compile time).
pub const fn first_free_after_words() -> u64 {
    offsets::KIND_WORDS + 8
}

#[cfg(test)]
mod tests {
    use super::*;

    fn page() -> (Vec<u64>, SharedView) {
        let mut mem = vec![0u64; (HEADER_SIZE / 8) as usize];
        // SAFETY: the vector outlives the view within each test and is
        // 8-aligned; nothing else touches it.
        let view = unsafe { SharedView::new(mem.as_mut_ptr().cast(), HEADER_SIZE as usize) };
        (mem, view)
    }

    fn pt(t: u64, live: u64) -> Point {
        Point {
            time_ns: t,
            live_bytes: live,
            live_blocks: live / 100,
            alloc_bytes: t,
        }
    }

    #[test]
    fn a_million_points_stay_bounded_with_the_first_the_peak_and_the_last() {
        let (_mem, v) = page();
        let mut peak = (0, 0);
        for i in 1..=1_000_000u64 {
            // A wave with one spike in the middle.
            let live = if i == 400_000 {
                10_000_000
            } else {
                1000 + (i % 1000) * 100
            };
            if live > peak.1 {
                peak = (i, live);
            }
            append(&v, pt(i, live));
        }
        let c = read(&v).unwrap();
        assert!(c.points.len() as u64 <= CAPACITY);
        assert_eq!(c.points[0].time_ns, 1, "the first point");
        assert_eq!(
            c.points.last().unwrap().time_ns,
            1_000_000,
            "the last point"
        );
        assert!(c.points.contains(&pt(peak.0, peak.1)), "the peak");
        assert!(c.points.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
        assert_eq!(c.thinned + c.points.len() as u64, 1_000_000);
        // The recent past stays fine-grained: the newest points are
        // consecutive.
        let n = c.points.len();
        assert_eq!(c.points[n - 1].time_ns - c.points[n - 10].time_ns, 9);
    }

    /// What a writer does: appends when due.
    fn offer(view: &SharedView, p: Point) -> bool {
        due(view, p.time_ns, p.live_bytes) && append(view, p)
    }

    #[test]
    fn points_come_on_moves_rises_and_time_not_on_every_change() {
        let (_mem, v) = page();
        assert!(offer(&v, pt(1_000_000_000, 1_000_000)));
        // A small move soon after: not due.
        assert!(!offer(&v, pt(1_020_000_000, 1_010_000)));
        // A move of more than 1/32 after the minimum gap: due.
        assert!(offer(&v, pt(1_030_000_000, 1_040_000)));
        // A new high within the minimum gap: due all the same.
        assert!(offer(&v, pt(1_031_000_000, 1_100_000)));
        // Nothing moved, but a second passed: due.
        assert!(!offer(&v, pt(1_500_000_000, 1_100_000)));
        assert!(offer(&v, pt(2_100_000_000, 1_100_000)));
        assert_eq!(read(&v).unwrap().points.len(), 4);
    }

    #[test]
    fn hostile_words_give_a_bounded_curve() {
        let (mut mem, v) = page();
        for w in mem.iter_mut().skip((TIMELINE_OFF / 8) as usize) {
            *w = 0xdead_beef_dead_beef;
        }
        // seq is odd: no stable reading.
        assert!(read(&v).is_none());
        mem[(W_SEQ / 8) as usize] = 2;
        let c = read(&v).unwrap();
        assert!(c.points.len() as u64 <= CAPACITY);
    }

    #[test]
    fn a_reader_racing_two_writers_sees_only_whole_ordered_points() {
        let (_mem, v) = page();
        std::thread::scope(|s| {
            for w in 0..2u64 {
                s.spawn(move || {
                    for i in 0..200_000u64 {
                        let t = i * 2 + w;
                        append(
                            &v,
                            Point {
                                time_ns: t + 1,
                                live_bytes: t,
                                live_blocks: t,
                                alloc_bytes: t,
                            },
                        );
                    }
                });
            }
            s.spawn(|| {
                for _ in 0..2000 {
                    if let Some(c) = read(&v) {
                        for p in &c.points {
                            // Whole points: every field from one write
                            // (a time raised to the previous point's keeps
                            // its own other fields).
                            assert_eq!(p.live_bytes, p.live_blocks);
                            assert_eq!(p.live_bytes, p.alloc_bytes);
                        }
                        assert!(c.points.windows(2).all(|w| w[0].time_ns <= w[1].time_ns));
                    }
                }
            });
        });
        // With the writers done, a read succeeds, and holds points: the
        // checks above ran on something (a reader that always failed
        // would have passed them).
        let c = read(&v).expect("a read with no writer succeeds");
        assert!(!c.points.is_empty());
        for p in &c.points {
            assert_eq!(p.live_bytes, p.alloc_bytes);
        }
    }
}
