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
//! - Every connection serve accepts has a send timeout of [`WRITE_STALL`]
//!   and a receive timeout of [`READ_IDLE`] (longer than any delta profile
//!   takes): they are set on the listening
//!   socket, whose options Linux copies to each socket it accepts.
//! - A response's body is read for at most [`RESPONSE_DEADLINE`] (then
//!   the writing fails), so writing one ends within `RESPONSE_DEADLINE +
//!   WRITE_STALL` whatever the client does.
//! - A connection a response could not be written to in time is written
//!   nothing more: its further requests (a client may pipeline thousands
//!   on one connection) are closed unanswered, none waiting `WRITE_STALL`.
//! - The time spent writing to a client of a user serve does not trust
//!   (see `serve`'s `per_user`) is that user's debt ([`UserShares`]): a
//!   user whose clients stall their responses has its connections closed
//!   unanswered until the debt is paid back, so it holds serve a quarter
//!   of the time at most.

use std::collections::VecDeque;
use std::io::{self, Cursor, Read};
use std::net::{SocketAddr, TcpListener};
use std::os::fd::AsRawFd;
use std::time::{Duration, Instant};

use tiny_http::{Request, Response};

use crate::commands::cost_pacing::UserShares;

/// Longest one write to a client may block (the send timeout).
pub const WRITE_STALL: Duration = Duration::from_secs(2);
/// Longest a connection may stay silent while serve's side reads it (the
/// receive timeout): ends idle keep-alive connections and their threads.
/// Longer than the longest delta profile a client waits for
/// ([`MAX_DELTA_SECONDS`](crate::commands::serve::MAX_DELTA_SECONDS)):
/// its connection is read meanwhile, for its next request, and a timeout
/// there ended it with a `500` (a 35 s delta failed at 30 s).
pub const READ_IDLE: Duration = Duration::from_secs(crate::commands::serve::MAX_DELTA_SECONDS + 60);
/// Longest a response is written for (its body is not read after it).
pub const RESPONSE_DEADLINE: Duration = Duration::from_secs(20);
/// Connections remembered as stalled (the oldest forgotten first).
const STALLED_KEPT: usize = 1024;

/// Binds `addr` with the timeouts of the module doc set on the listening
/// socket, for every connection it accepts.
pub fn listener(addr: &str) -> io::Result<TcpListener> {
    let listener = TcpListener::bind(addr)?;
    set_timeout(&listener, libc::SO_SNDTIMEO, WRITE_STALL)?;
    set_timeout(&listener, libc::SO_RCVTIMEO, READ_IDLE)?;
    Ok(listener)
}

fn set_timeout(socket: &TcpListener, option: libc::c_int, d: Duration) -> io::Result<()> {
    let tv = libc::timeval {
        tv_sec: d.as_secs() as libc::time_t,
        tv_usec: d.subsec_micros() as libc::suseconds_t,
    };
    // SAFETY: a valid socket descriptor (borrowed from `socket`, open for
    // the call), and a pointer to a `timeval` of the size passed, which
    // the kernel only reads.
    let r = unsafe {
        libc::setsockopt(
            socket.as_raw_fd(),
            libc::SOL_SOCKET,
            option,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// A response body that fails to be read after its deadline.
struct Deadline<R> {
    inner: R,
    until: Instant,
}

impl<R: Read> Read for Deadline<R> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if Instant::now() >= self.until {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read the response in time",
            ));
        }
        self.inner.read(buf)
    }
}

/// Writes serve's responses within the bounds of the module doc.
#[derive(Debug)]
pub struct Responder {
    /// Connections (their client's address) a response could not be
    /// written to in time, and when, most recent last. Forgotten after
    /// [`READ_IDLE`]: by then a connection that sent nothing more was
    /// closed, and its address may be a new connection's (tiny_http
    /// reports a client that closed its end as written, so only a client
    /// that kept its connection and read nothing is here).
    stalled: VecDeque<(SocketAddr, Instant)>,
    /// Each untrusted user's writing time.
    users: UserShares,
}

impl Default for Responder {
    fn default() -> Self {
        Responder {
            stalled: VecDeque::new(),
            users: UserShares::new(UserShares::DEFAULT_BURST),
        }
    }
}

impl Responder {
    /// `req` back if it may be answered, a request of a client of
    /// untrusted user `user` (`None`: trusted); `None` when its connection
    /// stalled a response before or `user` is held back: the connection is
    /// then closed with nothing written, and nothing is to be done for the
    /// request (asked before any work for it).
    pub fn admit(&self, req: Request, user: Option<u32>) -> Option<Request> {
        let stalled = req.remote_addr().is_some_and(|p| {
            self.stalled
                .iter()
                .any(|(a, at)| a == p && at.elapsed() < READ_IDLE)
        });
        if stalled || self.users.holding(user).is_some() {
            // Taking the writer away leaves the request nothing to write
            // an error with when dropped.
            drop(req.into_writer());
            return None;
        }
        Some(req)
    }

    /// Writes `reply` to `req`'s client, a client of untrusted user `user`
    /// (`None`: trusted, not charged), admitted by [`Self::admit`], within
    /// the deadlines of the module doc, and charges `user` the time it
    /// took.
    pub fn respond(&mut self, req: Request, reply: Response<Cursor<Vec<u8>>>, user: Option<u32>) {
        let peer = req.remote_addr().copied();
        let started = Instant::now();
        let status = reply.status_code();
        let headers = reply.headers().to_vec();
        let length = reply.data_length();
        let body = Deadline {
            inner: reply.into_reader(),
            until: started + RESPONSE_DEADLINE,
        };
        let written = req.respond(Response::new(status, headers, body, length, None));
        self.users.charge(user, started.elapsed());
        if written.is_err() {
            if let Some(p) = peer {
                if self.stalled.len() >= STALLED_KEPT {
                    self.stalled.pop_front();
                }
                self.stalled.push_back((p, Instant::now()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_body_past_its_deadline_fails_to_be_read() {
        let mut late = Deadline {
            inner: Cursor::new(vec![1u8; 10]),
            until: Instant::now(),
        };
        let mut buf = [0u8; 4];
        assert_eq!(
            late.read(&mut buf).unwrap_err().kind(),
            io::ErrorKind::TimedOut
        );
        let mut early = Deadline {
            inner: Cursor::new(vec![1u8; 10]),
            until: Instant::now() + Duration::from_secs(3600),
        };
        assert_eq!(early.read(&mut buf).unwrap(), 4);
    }

    #[test]
    fn accepted_connections_have_the_listeners_timeouts() {
        let l = listener("127.0.0.1:0").unwrap();
        let _client = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (accepted, _) = l.accept().unwrap();
        assert_eq!(accepted.write_timeout().unwrap(), Some(WRITE_STALL));
        assert_eq!(accepted.read_timeout().unwrap(), Some(READ_IDLE));
    }
}
