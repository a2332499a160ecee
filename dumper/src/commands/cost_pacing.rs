//! Pacing by cost: how the long-running commands (`watch --all`, `serve`)
//! keep one process, or one user's processes, from taking all their time.
//! A target decides what reading it costs (libraries of big debug
//! information cycled through, each read anew within its user's read
//! share: seconds a snapshot), and both commands are one thread.
//!
//! Invariants:
//! - A process whose last reading started at `t` and took `c` is not read
//!   again before `t + COST_PACE * c` ([`cost_allows`]): at most a
//!   quarter of the command's time for one process.
//! - `watch`: a user's next snapshot waits for the user's last one as for
//!   its own ([`UserPace`]).
//! - `serve`: every reading of a user's process is charged to the user
//!   ([`UserShares`]), a debt paid back at `1 / COST_PACE` of the time
//!   that passes; while the debt is over its burst (`serve --user-burst`,
//!   [`UserShares::DEFAULT_BURST`]) none of the
//!   user's processes is read afresh. A user's processes together take at
//!   most a quarter of the server's time (and two seconds at once, plus the
//!   reading that ran the debt up), however many there are, and a user
//!   whose processes read cheaply (a scrape of fifty processes at 30 ms
//!   each) is never held back.
//! - Users are told apart by the process's real user id; a process whose
//!   user cannot be read is paced by its own cost only (in `serve`, root's
//!   processes too: see `serve::user_of`).

use std::collections::HashMap;
use std::time::{Duration, Instant};

/// How many times as long as its last snapshot took a target waits,
/// from that snapshot's start, before its next one (request, interval or
/// exec): so that one process takes at most a quarter of the collector's
/// time, whatever it makes a snapshot cost, and the others' snapshots come
/// in between.
pub const COST_PACE: u32 = 4;

/// Whether a target whose last snapshot started `since_start` ago and took
/// `last_cost` may have another one now ([`COST_PACE`]).
pub fn cost_allows(since_start: Duration, last_cost: Duration) -> bool {
    since_start >= last_cost.saturating_mul(COST_PACE)
}

/// The last snapshot of each user's processes: when it started and how
/// long it took. A process's next snapshot waits for its user's as for its
/// own ([`cost_allows`]), so that one user's many costly processes take a
/// quarter of the collector's time together, not each.
#[derive(Debug, Default)]
pub struct UserPace(HashMap<u32, (Instant, Duration)>);

impl UserPace {
    /// Records a snapshot of a process of `uid`.
    pub fn took(&mut self, uid: Option<u32>, started: Instant, cost: Duration) {
        if let Some(uid) = uid {
            self.0.insert(uid, (started, cost));
        }
    }

    /// The cost of the last snapshot of a process of `uid` when it still
    /// holds the next one back.
    pub fn holding(&self, uid: Option<u32>) -> Option<Duration> {
        let (started, cost) = self.0.get(&uid?)?;
        (!cost_allows(started.elapsed(), *cost)).then_some(*cost)
    }
}

/// Each user's reading time in `serve`, as a debt paid back at
/// `1 / COST_PACE` of the time that passes (see the module doc). Unlike
/// [`UserPace`], cheap readings add up: a user cannot slip many processes
/// each just under a threshold past it, and a burst of cheap ones (a
/// scrape) is never held back.
#[derive(Debug)]
pub struct UserShares {
    debts: HashMap<u32, (Instant, Duration)>,
    burst: Duration,
}

impl UserShares {
    /// Shares whose users may each run up a debt of `burst` before their
    /// processes are held back.
    pub fn new(burst: Duration) -> Self {
        UserShares {
            debts: HashMap::new(),
            burst,
        }
    }

    /// The debt a user may run up before its processes are held back, by
    /// default:
    /// what a scrape of a user's many processes costs, with room (a
    /// process of a million live blocks reads in ~35 ms, most in a few),
    /// well under a scrape's timeout (Prometheus' default: 10 s).
    pub const DEFAULT_BURST: Duration = Duration::from_secs(2);

    /// `uid`'s debt at `now`.
    fn debt(&self, uid: u32, now: Instant) -> Duration {
        self.debts.get(&uid).map_or(Duration::ZERO, |(at, debt)| {
            debt.saturating_sub(now.saturating_duration_since(*at) / COST_PACE)
        })
    }

    /// Charges a reading of a process of `uid` that took `cost`.
    pub fn charge(&mut self, uid: Option<u32>, cost: Duration) {
        self.charge_at(uid, cost, Instant::now());
    }

    fn charge_at(&mut self, uid: Option<u32>, cost: Duration, now: Instant) {
        if let Some(uid) = uid {
            let debt = self.debt(uid, now).saturating_add(cost);
            self.debts.insert(uid, (now, debt));
        }
    }

    /// How long `uid`'s processes are still held back (`None`: they may be
    /// read now).
    pub fn holding(&self, uid: Option<u32>) -> Option<Duration> {
        self.holding_at(uid, Instant::now())
    }

    fn holding_at(&self, uid: Option<u32>, now: Instant) -> Option<Duration> {
        let over = self.debt(uid?, now).checked_sub(self.burst)?;
        (!over.is_zero()).then(|| over.saturating_mul(COST_PACE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_last_costly_snapshot_holds_its_processes_back_not_anothers() {
        let mut users = UserPace::default();
        let hour = Duration::from_secs(3600);
        users.took(Some(5), Instant::now(), hour);
        users.took(None, Instant::now(), hour);
        assert_eq!(users.holding(Some(5)), Some(hour));
        assert_eq!(users.holding(Some(6)), None);
        assert_eq!(users.holding(None), None);
        users.took(Some(5), Instant::now(), Duration::ZERO);
        assert_eq!(users.holding(Some(5)), None);
    }

    #[test]
    fn a_target_waits_four_times_its_last_snapshots_cost_from_its_start() {
        let ms = Duration::from_millis;
        assert!(cost_allows(ms(0), ms(0)));
        assert!(!cost_allows(ms(399), ms(100)));
        assert!(cost_allows(ms(400), ms(100)));
        // A cost beyond any interval does not wrap around.
        assert!(!cost_allows(Duration::MAX / 2, Duration::MAX));
    }

    #[test]
    fn a_users_readings_add_up_and_are_paid_back_at_a_quarter_of_the_time() {
        let ms = Duration::from_millis;
        let t0 = Instant::now();
        let mut shares = UserShares::new(UserShares::DEFAULT_BURST);
        // Ten cheap readings at once: within the burst, never held back.
        for _ in 0..10 {
            shares.charge_at(Some(7), ms(30), t0);
        }
        assert_eq!(shares.holding_at(Some(7), t0), None);
        // Many just-cheap ones add up: 40 x 240 ms is 9.6 s of debt, 7.6 s
        // over the burst, held back 4 x as long.
        for _ in 0..40 {
            shares.charge_at(Some(8), ms(240), t0);
        }
        assert_eq!(shares.holding_at(Some(8), t0), Some(ms(30_400)));
        // Paid back at a quarter of the time that passes.
        assert_eq!(shares.holding_at(Some(8), t0 + ms(4_000)), Some(ms(26_400)));
        assert_eq!(shares.holding_at(Some(8), t0 + ms(30_399)), Some(ms(1)));
        assert_eq!(shares.holding_at(Some(8), t0 + ms(30_400)), None);
        // Another user, and a process whose user is unknown, are free.
        assert_eq!(shares.holding_at(Some(7), t0), None);
        assert_eq!(shares.holding_at(None, t0), None);
        shares.charge_at(None, Duration::MAX, t0);
        assert_eq!(shares.holding_at(None, t0), None);
        // A debt past any time does not wrap around.
        shares.charge_at(Some(9), Duration::MAX, t0);
        shares.charge_at(Some(9), Duration::MAX, t0);
        assert!(shares.holding_at(Some(9), t0).is_some());
        // Without a burst, any reading holds its user back for four times
        // as long.
        let mut none = UserShares::new(Duration::ZERO);
        none.charge_at(Some(7), ms(30), t0);
        assert_eq!(none.holding_at(Some(7), t0), Some(ms(120)));
        assert_eq!(none.holding_at(Some(7), t0 + ms(120)), None);
    }
}
