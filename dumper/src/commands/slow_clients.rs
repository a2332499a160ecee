//! What a client of `heapdump serve` can make it wait for.
//!
//! serve answers one request at a time. A response used to be written
//! until the client had read it all: a client that asked for a large
//! profile (a JSON document of thousands of stacks is tens of megabytes)
//! and read none of it held every other client, and every scrape, for as
//! long as it kept the connection open. Over loopback any local user may
//! connect, the profiled processes included.
//!
//! Invariants:
//! - Every write to a client blocks at most
//!   [`WRITE_STALL`](crate::commands::http_connections::WRITE_STALL), and
//!   a response is written for at most [`RESPONSE_DEADLINE`], so writing
//!   one ends within `RESPONSE_DEADLINE + WRITE_STALL` whatever the client
//!   does (`http_connections`).
//! - A connection a response could not be written to in time is closed:
//!   its further requests (a client may pipeline thousands on one
//!   connection) are never read.
//! - The time spent writing to a client of a user serve does not trust
//!   (see `serve`'s `per_user`) is that user's debt ([`UserShares`]): a
//!   user whose clients stall their responses has its connections closed
//!   unanswered until the debt is paid back, so it holds serve a quarter
//!   of the time at most.

use std::time::{Duration, Instant};

use crate::commands::cost_pacing::UserShares;
use crate::commands::http_connections::{Reply, Request};

/// Longest a response is written for (then its connection is closed).
pub const RESPONSE_DEADLINE: Duration = Duration::from_secs(20);

/// Writes serve's responses within the bounds of the module doc.
#[derive(Debug)]
pub struct Responder {
    /// Each untrusted user's writing time.
    users: UserShares,
}

impl Default for Responder {
    fn default() -> Self {
        Responder {
            users: UserShares::new(UserShares::DEFAULT_BURST),
        }
    }
}

impl Responder {
    /// `req` back if it may be answered, a request of a client of
    /// untrusted user `user` (`None`: trusted); `None` when `user` is held
    /// back: the connection is then closed with nothing written, and
    /// nothing is to be done for the request (asked before any work for
    /// it).
    pub fn admit(&self, req: Request, user: Option<u32>) -> Option<Request> {
        if self.users.holding(user).is_some() {
            // Dropped unanswered: its connection is closed.
            drop(req);
            return None;
        }
        Some(req)
    }

    /// Writes `reply` to `req`'s client, a client of untrusted user `user`
    /// (`None`: trusted, not charged), admitted by [`Self::admit`], within
    /// the deadlines of the module doc, and charges `user` the time it
    /// took.
    pub fn respond(&mut self, req: Request, reply: Reply, user: Option<u32>) {
        let started = Instant::now();
        // A failed write closed the connection: nothing more to do.
        let _ = req.respond(&reply, started + RESPONSE_DEADLINE);
        self.users.charge(user, started.elapsed());
    }
}
