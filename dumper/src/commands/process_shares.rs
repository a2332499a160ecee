//! How many instrumented processes a long-running command keeps open at
//! once (the collector, `watch --all`, each process it watches; `serve`,
//! each process it served), and each user's share of them.
//!
//! A process kept open holds about [`DESCRIPTORS_PER_PROCESS`] of the
//! command's descriptors (its two regions, its root directory, and for
//! the collector its pidfd) until it exits. Any user can start hundreds
//! of instrumented processes (`LD_PRELOAD` is theirs to set): with a
//! 1 024-descriptor limit, 250 sleeping ones exhausted a collector's
//! descriptors, and every process started after them, root's daemons
//! included, went unwatched, silently: no answer to its requests, no final
//! snapshot.
//!
//! Invariants:
//! - At most [`Shares::budget`] processes are kept open: what the
//!   descriptor limit holds beyond [`RESERVED_DESCRIPTORS`] (kept for the
//!   work of snapshots: files read, files written; serve leaves out what
//!   its untrusted connections may hold besides).
//! - A user other than root has at most an eighth of them kept open, and
//!   such users together at most three quarters: one user's processes
//!   (or six users') never leave root's new processes unwatched. A
//!   process whose user cannot be read counts as one user.
//! - The collector does not open a process past its user's share: it is
//!   looked at again at the next scan, and adopted once its user's
//!   processes left room; the log says so once per user each time the
//!   share fills. serve opens such a process for the one request, and
//!   closes it after.

use std::collections::HashSet;

/// Descriptors a process kept open holds (the collector's, with its
/// pidfd; serve's hold one fewer).
pub const DESCRIPTORS_PER_PROCESS: u64 = 4;
/// Descriptors kept for the work of snapshots.
pub const RESERVED_DESCRIPTORS: u64 = 128;

/// Why a process is not kept open now.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Full {
    /// All the processes the budget holds are kept open.
    Collector,
    /// The process's user has its share kept open.
    User,
    /// Users other than root together have theirs.
    Others,
}

/// The budget of processes kept open and who may use it.
#[derive(Debug)]
pub struct Shares {
    budget: usize,
    /// Users the log told their share is full (told again once one of
    /// their processes is adopted).
    told: HashSet<Option<u32>>,
}

impl Shares {
    /// The shares of a command allowed `descriptors` open descriptors.
    pub fn new(descriptors: u64) -> Shares {
        let budget = descriptors.saturating_sub(RESERVED_DESCRIPTORS) / DESCRIPTORS_PER_PROCESS;
        Shares {
            budget: (budget as usize).max(8),
            told: HashSet::new(),
        }
    }

    /// Most processes kept open at once.
    pub fn budget(&self) -> usize {
        self.budget
    }

    /// Most processes of one user other than root kept open at once.
    pub fn per_user(&self) -> usize {
        (self.budget / 8).max(1)
    }

    /// Whether a process of `uid` (`None`: unreadable) may be kept open,
    /// the users of the processes kept open now being `kept`.
    pub fn admits(
        &self,
        uid: Option<u32>,
        kept: impl Iterator<Item = Option<u32>>,
    ) -> Result<(), Full> {
        let (mut total, mut others, mut mine) = (0usize, 0usize, 0usize);
        for u in kept {
            total += 1;
            others += usize::from(u != Some(0));
            mine += usize::from(u == uid);
        }
        if total >= self.budget {
            return Err(Full::Collector);
        }
        if uid == Some(0) {
            return Ok(());
        }
        if mine >= self.per_user() {
            return Err(Full::User);
        }
        if others >= self.budget / 4 * 3 {
            return Err(Full::Others);
        }
        Ok(())
    }

    /// Whether the log is to say `uid`'s process was not kept open (once
    /// until one of its processes is adopted again).
    pub fn tell(&mut self, uid: Option<u32>) -> bool {
        self.told.insert(uid)
    }

    /// A process of `uid` was adopted.
    pub fn adopted(&mut self, uid: Option<u32>) {
        self.told.remove(&uid);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_user_fills_its_eighth_and_root_is_watched_past_all_others() {
        // 1 024 descriptors: 224 processes, 28 per user, 168 of others.
        let s = Shares::new(1024);
        assert_eq!((s.budget(), s.per_user()), (224, 28));
        let mut watched: Vec<Option<u32>> = vec![];
        while s.admits(Some(65534), watched.iter().copied()).is_ok() {
            watched.push(Some(65534));
        }
        assert_eq!(watched.len(), 28);
        assert_eq!(
            s.admits(Some(65534), watched.iter().copied()),
            Err(Full::User)
        );
        // Other users fill the others' three quarters...
        for uid in 1000.. {
            match s.admits(Some(uid), watched.iter().copied()) {
                Ok(()) => watched.push(Some(uid)),
                Err(e) => {
                    assert_eq!(e, Full::Others);
                    break;
                }
            }
        }
        assert_eq!(watched.len(), 168);
        // ...and root's processes take the rest, up to the budget.
        while s.admits(Some(0), watched.iter().copied()).is_ok() {
            watched.push(Some(0));
        }
        assert_eq!(watched.len(), 224);
        assert_eq!(
            s.admits(Some(0), watched.iter().copied()),
            Err(Full::Collector)
        );
        // Unreadable processes count as one user.
        let none = vec![None; 28];
        assert_eq!(s.admits(None, none.iter().copied()), Err(Full::User));
    }

    #[test]
    fn a_tiny_limit_still_watches_a_few() {
        let s = Shares::new(64);
        assert_eq!((s.budget(), s.per_user()), (8, 1));
        assert!(s.admits(Some(0), std::iter::empty()).is_ok());
    }

    #[test]
    fn the_log_tells_a_user_once_until_it_is_watched_again() {
        let mut s = Shares::new(1024);
        assert!(s.tell(Some(5)));
        assert!(!s.tell(Some(5)));
        s.adopted(Some(5));
        assert!(s.tell(Some(5)));
    }
}
