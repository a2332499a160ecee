//! Live blocks by age: when each block was allocated, and selecting blocks
//! by it (`--older-than WHEN`, `--newer-than WHEN`).
//!
//! Every live record carries its allocation time in microseconds since its
//! region's clock base (`clock_monotonic_ns` in the header). The agent reads
//! `CLOCK_MONOTONIC_COARSE`, so a recorded time can be up to one kernel
//! tick (1-10 ms) earlier than the allocation; never later, but for a
//! block allocated in the tick the heap's peak was recorded in, after it,
//! stamped 1 µs after the peak (`heapdump_table::peak`).
//!
//! Invariants:
//! - A bound is converted once into record microseconds, so the walk
//!   compares integers: a block is selected by `--older-than T` when its
//!   recorded time is before T, by `--newer-than T` when it is at or after
//!   T (both: between the two).
//! - Wall time and monotonic time are related by the dumper's own two
//!   clocks read together at the snapshot (the offset the kernel applies
//!   now), not by the pair the agent wrote at start, from which a daemon
//!   running for days may have drifted (NTP slews the wall clock).
//! - A bound before the regions' clock base selects nothing for
//!   `--older-than` and everything for `--newer-than`; no arithmetic
//!   overflows whatever the header holds (all of it is done in `i128`).

use std::path::Path;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// A moment given on the command line.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum When {
    /// This long before the snapshot (`90s`, `1h 30m`, `2d`).
    Ago(Duration),
    /// A wall-clock time (an RFC 3339 time, or a saved snapshot's time).
    At(SystemTime),
}

/// Parses a `--older-than` / `--newer-than` value: a duration before the
/// snapshot (`90s`, `1h30m`, `2days`), an RFC 3339 time (UTC unless an
/// offset is given: `2026-11-22T10:00:00Z`, `2026-11-22 10:00:00`), or the
/// path of a JSON snapshot, meaning the time that snapshot was taken.
pub fn parse_when(s: &str) -> Result<When, String> {
    parse_when_value(s, true)
}

/// [`parse_when`], taking a snapshot file's path only if `files`.
pub fn parse_when_value(s: &str, files: bool) -> Result<When, String> {
    if let Ok(d) = humantime::parse_duration(s) {
        return Ok(When::Ago(d));
    }
    if let Ok(t) = humantime::parse_rfc3339_weak(s) {
        return Ok(When::At(t));
    }
    if let Ok(t) = rfc3339_with_offset(s) {
        return Ok(When::At(t));
    }
    if files && Path::new(s).is_file() {
        return snapshot_time(s).map(When::At);
    }
    Err(format!(
        "{s:?} is neither a duration (90s, 1h30m, 2days), an RFC 3339 time \
         (2026-11-22T10:00:00Z){}",
        if files {
            " nor a JSON snapshot file"
        } else {
            ""
        }
    ))
}

/// An RFC 3339 time with a numeric offset (`2026-11-22T10:00:00+01:00`),
/// which `humantime` does not take: the offset is applied by hand.
fn rfc3339_with_offset(s: &str) -> Result<SystemTime, ()> {
    let (body, sign, off) = match s.len().checked_sub(6) {
        Some(i) if s.is_char_boundary(i) => {
            let (b, o) = s.split_at(i);
            match o.as_bytes()[0] {
                b'+' => (b, 1i64, &o[1..]),
                b'-' => (b, -1i64, &o[1..]),
                _ => return Err(()),
            }
        }
        _ => return Err(()),
    };
    let (h, m) = off.split_once(':').ok_or(())?;
    let two_digits = |v: &str| v.len() == 2 && v.bytes().all(|b| b.is_ascii_digit());
    if !two_digits(h) || !two_digits(m) {
        return Err(());
    }
    let (h, m): (u64, u64) = (h.parse().map_err(|_| ())?, m.parse().map_err(|_| ())?);
    if h > 23 || m > 59 {
        return Err(());
    }
    let local = humantime::parse_rfc3339_weak(body).map_err(|_| ())?;
    let off = Duration::from_secs(h * 3600 + m * 60);
    // Local time = UTC + offset, so UTC = local - offset.
    if sign > 0 {
        local.checked_sub(off).ok_or(())
    } else {
        local.checked_add(off).ok_or(())
    }
}

/// The `taken_at` time of a JSON snapshot file.
fn snapshot_time(path: &str) -> Result<SystemTime, String> {
    #[derive(serde::Deserialize)]
    struct Head {
        format: String,
        taken_at: String,
    }
    let bytes = std::fs::read(path).map_err(|e| format!("cannot read {path}: {e}"))?;
    let head: Head = serde_json::from_slice(&bytes)
        .map_err(|e| format!("{path} is not a heapdump JSON snapshot: {e}"))?;
    if head.format != "heapdump-snapshot" {
        return Err(format!("{path} is not a heapdump JSON snapshot"));
    }
    humantime::parse_rfc3339(&head.taken_at).map_err(|e| {
        format!(
            "{path}: its taken_at {:?} is not a time: {e}",
            head.taken_at
        )
    })
}

/// Which blocks a snapshot keeps, by allocation time.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct AgeFilter {
    /// Keep blocks allocated before this.
    pub older_than: Option<When>,
    /// Keep blocks allocated at or after this.
    pub newer_than: Option<When>,
}

impl AgeFilter {
    /// Whether the filter selects anything less than every block.
    pub fn is_set(&self) -> bool {
        self.older_than.is_some() || self.newer_than.is_some()
    }
}

/// An [`AgeFilter`] in record microseconds: a block is kept when
/// `from_us <= t < below_us`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Bounds {
    /// Earliest recorded time kept.
    pub from_us: u64,
    /// First recorded time no longer kept (exclusive).
    pub below_us: u64,
}

impl Default for Bounds {
    fn default() -> Self {
        Bounds {
            from_us: 0,
            below_us: u64::MAX,
        }
    }
}

impl Bounds {
    /// Whether a block recorded at `t_us` is kept. `u64::MAX` is kept when
    /// nothing is asked (the default bounds keep every block).
    #[inline]
    pub fn admits(&self, t_us: u64) -> bool {
        self.from_us <= t_us && (t_us < self.below_us || self.below_us == u64::MAX)
    }
}

/// The target's time base seen from the dumper's clocks at one moment.
#[derive(Clone, Copy, Debug)]
pub struct Clock {
    /// `CLOCK_MONOTONIC` of the regions' clock base (record time 0), ns.
    base_mono_ns: i128,
    /// `CLOCK_MONOTONIC` now, ns.
    now_mono_ns: i128,
    /// `CLOCK_REALTIME - CLOCK_MONOTONIC` now, ns.
    offset_ns: i128,
}

fn clock_ns(id: libc::clockid_t) -> i128 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime writes one timespec into a valid out-pointer.
    unsafe { libc::clock_gettime(id, &mut ts) };
    i128::from(ts.tv_sec) * 1_000_000_000 + i128::from(ts.tv_nsec)
}

fn unix_ns(t: SystemTime) -> i128 {
    match t.duration_since(UNIX_EPOCH) {
        Ok(d) => d.as_nanos() as i128,
        Err(e) => -(e.duration().as_nanos() as i128),
    }
}

impl Clock {
    /// The clocks now, for regions whose clock base is `base_mono_ns`.
    pub fn now(base_mono_ns: u64) -> Clock {
        // Realtime read between two monotonic reads: the offset is good to
        // the few nanoseconds between them.
        let m0 = clock_ns(libc::CLOCK_MONOTONIC);
        let r = clock_ns(libc::CLOCK_REALTIME);
        let m1 = clock_ns(libc::CLOCK_MONOTONIC);
        Clock::at(base_mono_ns, m1, r - (m0 + m1) / 2)
    }

    /// A clock with given readings (for tests): monotonic now and the
    /// realtime-minus-monotonic offset, in nanoseconds.
    pub fn at(base_mono_ns: u64, now_mono_ns: i128, offset_ns: i128) -> Clock {
        Clock {
            base_mono_ns: i128::from(base_mono_ns),
            now_mono_ns,
            offset_ns,
        }
    }

    /// The wall time of "now".
    pub fn now_wall(&self) -> Option<SystemTime> {
        wall(self.now_mono_ns + self.offset_ns)
    }

    /// The wall time of record time `t_us`.
    pub fn wall_of(&self, t_us: u64) -> Option<SystemTime> {
        wall(self.base_mono_ns + i128::from(t_us) * 1000 + self.offset_ns)
    }

    /// The wall time of `CLOCK_MONOTONIC` reading `ns` (a request's time).
    pub fn wall_of_monotonic(&self, ns: u64) -> Option<SystemTime> {
        wall(i128::from(ns) + self.offset_ns)
    }

    /// The wall time a bound stands for.
    pub fn wall_of_when(&self, w: When) -> Option<SystemTime> {
        wall(self.mono_of(w) + self.offset_ns)
    }

    fn mono_of(&self, w: When) -> i128 {
        match w {
            When::Ago(d) => self.now_mono_ns - d.as_nanos() as i128,
            When::At(t) => unix_ns(t) - self.offset_ns,
        }
    }

    /// Record microseconds of bound `w`, rounded up (a block recorded at or
    /// after it is at or after the moment), clamped to `0..=u64::MAX - 1`.
    fn record_us(&self, w: When) -> u64 {
        let ns = self.mono_of(w) - self.base_mono_ns;
        let us = ns.div_euclid(1000) + i128::from(ns.rem_euclid(1000) != 0);
        us.clamp(0, i128::from(u64::MAX - 1)) as u64
    }

    /// The filter in record microseconds.
    pub fn bounds(&self, f: &AgeFilter) -> Bounds {
        let mut b = Bounds::default();
        if let Some(w) = f.newer_than {
            b.from_us = self.record_us(w);
        }
        if let Some(w) = f.older_than {
            b.below_us = self.record_us(w);
        }
        b
    }
}

fn wall(unix_ns: i128) -> Option<SystemTime> {
    let ns = u64::try_from(unix_ns).ok()?;
    UNIX_EPOCH.checked_add(Duration::from_nanos(ns))
}

/// An age for people: the two largest units (`2d 3h`, `3h 12m`, `5m 2s`,
/// `12s`, `0.3s`).
pub fn human_age(d: Duration) -> String {
    let s = d.as_secs();
    let (day, hour, min) = (86_400, 3_600, 60);
    if s >= day {
        format!("{}d {}h", s / day, s % day / hour)
    } else if s >= hour {
        format!("{}h {}m", s / hour, s % hour / min)
    } else if s >= min {
        format!("{}m {}s", s / min, s % min)
    } else if s >= 10 {
        format!("{s}s")
    } else {
        format!("{:.1}s", d.as_secs_f64())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SEC: i128 = 1_000_000_000;

    #[test]
    fn when_takes_durations_times_and_snapshot_files() {
        assert_eq!(
            parse_when("1h30m"),
            Ok(When::Ago(Duration::from_secs(5400)))
        );
        assert_eq!(
            parse_when("2days"),
            Ok(When::Ago(Duration::from_secs(172_800)))
        );
        let t = UNIX_EPOCH + Duration::from_secs(1_795_000_000);
        let s = humantime::format_rfc3339(t).to_string();
        assert_eq!(parse_when(&s), Ok(When::At(t)));
        assert_eq!(
            parse_when("2026-11-22 10:00:00"),
            parse_when("2026-11-22T10:00:00Z")
        );
        assert_eq!(
            parse_when("2026-11-22T11:30:00+01:30"),
            parse_when("2026-11-22T10:00:00Z")
        );
        assert_eq!(
            parse_when("2026-11-22T08:00:00-02:00"),
            parse_when("2026-11-22T10:00:00Z")
        );
        let dir = std::env::temp_dir().join(format!("heapdump-age-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let snap = dir.join("a.json");
        std::fs::write(
            &snap,
            format!(r#"{{"format": "heapdump-snapshot", "taken_at": "{s}", "pid": 1}}"#),
        )
        .unwrap();
        assert_eq!(parse_when(snap.to_str().unwrap()), Ok(When::At(t)));
        let other = dir.join("b.json");
        std::fs::write(&other, r#"{"format": "dhat"}"#).unwrap();
        let e = parse_when(other.to_str().unwrap()).unwrap_err();
        assert!(e.contains("not a heapdump JSON snapshot"), "{e}");
        let e = parse_when("yesterday-ish").unwrap_err();
        assert!(e.contains("neither a duration"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn odd_values_are_refused_not_panicked_on() {
        for s in [
            "",
            "+01:00",
            "-",
            "\u{e9}\u{e9}\u{e9}+01:00",
            "2026-11-22T10:00:00+24:00",
            "2026-11-22T10:00:00+01:60",
            "2026-11-22T10:00:00+\u{e9}:0",
            "x-99:99",
            "2026-11-22T10:00:00+1:000",
            "\u{1F600}\u{1F600}",
            "/",
            "/nonexistent/a.json",
        ] {
            assert!(parse_when(s).is_err(), "{s:?}");
        }
        // A directory is not a snapshot file.
        assert!(parse_when(std::env::temp_dir().to_str().unwrap()).is_err());
    }

    #[test]
    fn bounds_are_record_microseconds_and_select_half_open_ranges() {
        // Regions created at monotonic 100 s; now is monotonic 160 s; the
        // wall clock is monotonic + 1 000 000 s.
        let c = Clock::at(100 * SEC as u64, 160 * SEC, 1_000_000 * SEC);
        let ago = |s| Some(When::Ago(Duration::from_secs(s)));
        let b = c.bounds(&AgeFilter {
            older_than: ago(20),
            newer_than: None,
        });
        assert_eq!(b.below_us, 40_000_000);
        assert!(b.admits(39_999_999) && !b.admits(40_000_000));
        let b = c.bounds(&AgeFilter {
            older_than: None,
            newer_than: ago(20),
        });
        assert_eq!(b.from_us, 40_000_000);
        assert!(!b.admits(39_999_999) && b.admits(40_000_000) && b.admits(u64::MAX));
        // A wall-clock time: 1 000 130.5 s wall = 130.5 s monotonic.
        let at = UNIX_EPOCH + Duration::from_millis(1_000_130_500);
        let b = c.bounds(&AgeFilter {
            older_than: Some(When::At(at)),
            newer_than: ago(50),
        });
        assert_eq!((b.from_us, b.below_us), (10_000_000, 30_500_000));
        assert_eq!(c.wall_of(30_500_000), Some(at));
        assert_eq!(c.wall_of_monotonic(130_500_000_000), Some(at));
        assert_eq!(c.wall_of_when(When::At(at)), Some(at));
        // Before the clock base: older selects nothing, newer everything.
        let b = c.bounds(&AgeFilter {
            older_than: ago(1000),
            newer_than: ago(1000),
        });
        assert_eq!((b.from_us, b.below_us), (0, 0));
        assert!(!b.admits(0));
        // Far in the future: older selects everything recorded so far.
        let b = c.bounds(&AgeFilter {
            older_than: Some(When::At(UNIX_EPOCH + Duration::from_secs(1 << 40))),
            newer_than: None,
        });
        assert!(b.admits(60_000_000));
        // Sub-microsecond bounds round up.
        let c = Clock::at(0, 10 * SEC, 0);
        let b = c.bounds(&AgeFilter {
            older_than: Some(When::At(UNIX_EPOCH + Duration::from_nanos(1_500))),
            newer_than: None,
        });
        assert_eq!(b.below_us, 2);
        assert_eq!(Bounds::default(), c.bounds(&AgeFilter::default()));
    }

    #[test]
    fn hostile_clock_bases_do_not_overflow() {
        for base in [0, u64::MAX, 1 << 63] {
            let c = Clock::at(base, 5 * SEC, i128::from(u64::MAX));
            let f = AgeFilter {
                older_than: Some(When::Ago(Duration::MAX)),
                newer_than: Some(When::At(UNIX_EPOCH)),
            };
            let b = c.bounds(&f);
            assert!(b.from_us < u64::MAX && b.below_us < u64::MAX);
            let _ = c.wall_of(u64::MAX);
            let _ = c.wall_of_when(When::Ago(Duration::MAX));
        }
    }

    #[test]
    fn ages_read_with_two_units() {
        assert_eq!(human_age(Duration::from_millis(300)), "0.3s");
        assert_eq!(human_age(Duration::from_secs(42)), "42s");
        assert_eq!(human_age(Duration::from_secs(302)), "5m 2s");
        assert_eq!(
            human_age(Duration::from_secs(3 * 3600 + 12 * 60 + 9)),
            "3h 12m"
        );
        assert_eq!(
            human_age(Duration::from_secs(2 * 86_400 + 3 * 3600)),
            "2d 3h"
        );
    }
}
