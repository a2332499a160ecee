//! serve's HTTP/1.1 connections: accepting them, how many each client may
//! hold, reading their requests and writing the answers.
//!
//! serve ran on `tiny_http`, whose accepting thread starts a thread per
//! connection with no limit and ends for good at the first failed
//! `accept`. Any local user (a profiled process included) opened a few
//! hundred idle connections over loopback: serve ran out of descriptors
//! (two per connection), its accepting thread ended, and serve exited,
//! for everyone. This module owns the accepting loop instead; requests are
//! parsed by `httparse`, the parser of the Rust HTTP stack.
//!
//! Invariants:
//! - The accepting thread never ends while serve runs: a failed `accept`
//!   (out of descriptors or memory) is waited out ([`ACCEPT_BACKOFF`]) and
//!   accepting goes on.
//! - A client is a user, for a connection over loopback whose user the
//!   kernel names ([`loopback_peer`]), else an address (an IPv6 address's
//!   /64, which one host commonly holds whole). A client serve does not
//!   trust holds at most [`CONNECTIONS_PER_CLIENT`] connections; all such
//!   clients together hold at most [`MAX_CONNECTIONS`]. A connection past
//!   either is answered 503 (if its socket takes it at once) and closed.
//!   Trusted, and not counted (so that no flood of others' connections
//!   locks them out): root and serve's own user, over loopback.
//! - Each connection has one thread, which reads one request at a time:
//!   its head within [`HEAD_DEADLINE`] of its first byte, at most
//!   [`MAX_HEAD`] bytes, after at most [`IDLE`] of silence. It reads the
//!   next request only once the previous one was answered or dropped, so
//!   a connection has at most one request waiting in serve, and answers
//!   go out in order. A request with a body is the connection's last (the
//!   body is never read).
//! - A [`Request`] dropped unanswered, or one whose answer could not be
//!   written in full, closes its connection.
//! - Every write to a client blocks at most [`WRITE_STALL`]; an answer is
//!   written until its deadline at most, then the connection is closed.

use std::collections::HashMap;
use std::io::{self, Read, Write};
use std::net::{IpAddr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender, SyncSender};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use crate::process::loopback_peer;

/// Most connections open at once, all untrusted clients together.
pub const MAX_CONNECTIONS: usize = 512;
/// Most connections one client serve does not trust holds at once (a
/// scraper keeps one or two; `go tool pprof` one).
pub const CONNECTIONS_PER_CLIENT: usize = 16;
/// Longest a connection may stay silent between two requests.
pub const IDLE: Duration = Duration::from_secs(60);
/// Longest a request's head may take to arrive, from its first byte.
pub const HEAD_DEADLINE: Duration = Duration::from_secs(10);
/// Largest request head read (request line and headers).
pub const MAX_HEAD: usize = 16 << 10;
/// Most headers a request may carry.
const MAX_HEADERS: usize = 64;
/// Longest one write to a client may block (the send timeout).
pub const WRITE_STALL: Duration = Duration::from_secs(2);
/// How long the accepting thread waits after `accept` failed.
pub const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);
/// Stack of a connection's thread (it parses heads into a heap buffer).
const CONNECTION_STACK: usize = 256 << 10;
/// Bytes written at a time, each write checking the answer's deadline.
const WRITE_CHUNK: usize = 64 << 10;

/// Who holds a connection, for [`CONNECTIONS_PER_CLIENT`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
enum Client {
    /// The user owning the client's socket, over loopback.
    User(u32),
    /// The client's address (an IPv6 address's first 64 bits).
    Address(IpAddr),
}

impl Client {
    fn of(peer: SocketAddr, uid: Option<u32>) -> Client {
        match (uid, peer.ip()) {
            (Some(uid), _) => Client::User(uid),
            (None, IpAddr::V6(v6)) if v6.to_ipv4_mapped().is_none() => {
                let bits = u128::from(v6) & !((1u128 << 64) - 1);
                Client::Address(IpAddr::V6(bits.into()))
            }
            (None, IpAddr::V6(v6)) => {
                Client::Address(IpAddr::V4(v6.to_ipv4_mapped().expect("checked just above")))
            }
            (None, ip) => Client::Address(ip),
        }
    }
}

/// Open connections of untrusted clients, counted per client.
#[derive(Debug, Default)]
struct Counts {
    total: usize,
    per_client: HashMap<Client, usize>,
}

/// A connection's place in [`Counts`] (`None`: a trusted client's, not
/// counted), given back when dropped.
struct Held {
    counts: Arc<Mutex<Counts>>,
    client: Option<Client>,
}

impl Held {
    /// A place for a connection of `client` (`trusted`: not counted), or
    /// `None` past the bounds of the module doc.
    fn take(counts: &Arc<Mutex<Counts>>, client: Client, trusted: bool) -> Option<Held> {
        if trusted {
            return Some(Held {
                counts: counts.clone(),
                client: None,
            });
        }
        let mut c = counts.lock().unwrap_or_else(|p| p.into_inner());
        let mine = c.per_client.get(&client).copied().unwrap_or(0);
        if c.total >= MAX_CONNECTIONS || mine >= CONNECTIONS_PER_CLIENT {
            return None;
        }
        c.total += 1;
        *c.per_client.entry(client).or_insert(0) += 1;
        Some(Held {
            counts: counts.clone(),
            client: Some(client),
        })
    }
}

impl Drop for Held {
    fn drop(&mut self) {
        let Some(client) = self.client else {
            return;
        };
        let mut c = self.counts.lock().unwrap_or_else(|p| p.into_inner());
        c.total -= 1;
        if let Some(n) = c.per_client.get_mut(&client) {
            *n -= 1;
            if *n == 0 {
                c.per_client.remove(&client);
            }
        }
    }
}

/// No request can come any more: the accepting thread ended (it does not
/// while serve runs).
#[derive(Debug)]
pub struct AcceptingEnded;

/// serve's listening socket and its connections' requests.
pub struct Server {
    requests: Receiver<Request>,
    local: SocketAddr,
}

impl Server {
    /// Binds `addr` and starts accepting; `trusted` are the users whose
    /// connections over loopback are not counted.
    pub fn bind(addr: &str, trusted: &[u32]) -> io::Result<Server> {
        let listener = TcpListener::bind(addr)?;
        let local = listener.local_addr()?;
        let (tx, rx) = mpsc::channel();
        let trusted = trusted.to_vec();
        std::thread::Builder::new()
            .name("serve-accept".into())
            .spawn(move || accept_forever(listener, tx, trusted))?;
        Ok(Server {
            requests: rx,
            local,
        })
    }

    /// The address bound.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// The next request; `None` only if accepting ended (it does not
    /// while serve runs).
    pub fn recv(&self) -> Option<Request> {
        self.requests.recv().ok()
    }

    /// The next request within `wait` (`Ok(None)`: none came).
    pub fn recv_timeout(&self, wait: Duration) -> Result<Option<Request>, AcceptingEnded> {
        match self.requests.recv_timeout(wait) {
            Ok(r) => Ok(Some(r)),
            Err(RecvTimeoutError::Timeout) => Ok(None),
            Err(RecvTimeoutError::Disconnected) => Err(AcceptingEnded),
        }
    }
}

fn accept_forever(listener: TcpListener, requests: Sender<Request>, trusted: Vec<u32>) {
    let counts = Arc::new(Mutex::new(Counts::default()));
    loop {
        let (stream, peer) = match listener.accept() {
            Ok(c) => c,
            // A connection gone before it was taken, or a signal: the
            // next one at once (a client cannot slow accepting down by
            // aborting connections).
            Err(e)
                if e.kind() == io::ErrorKind::Interrupted
                    || e.raw_os_error() == Some(libc::ECONNABORTED) =>
            {
                continue;
            }
            Err(_) => {
                // Out of descriptors or memory (they come back as
                // connections close): wait, then go on.
                std::thread::sleep(ACCEPT_BACKOFF);
                continue;
            }
        };
        let local = stream.local_addr().ok();
        let uid = match local {
            Some(local) if peer.ip().is_loopback() => loopback_peer::peer_uid(peer, local),
            _ => None,
        };
        let client = Client::of(peer, uid);
        let trusted = uid.is_some_and(|u| trusted.contains(&u));
        let Some(held) = Held::take(&counts, client, trusted) else {
            refuse(stream);
            continue;
        };
        let requests = requests.clone();
        let started = std::thread::Builder::new()
            .name("serve-conn".into())
            .stack_size(CONNECTION_STACK)
            .spawn(move || serve_connection(stream, peer, uid, requests, held));
        if started.is_err() {
            // No thread to be had now: the connection (moved into the
            // failed closure) was dropped, so closed, and its place given
            // back. Threads come back as connections end.
            std::thread::sleep(ACCEPT_BACKOFF);
        }
    }
}

/// Answers a connection past its client's share 503 if its socket takes
/// the answer at once, and closes it.
fn refuse(stream: TcpStream) {
    let body = "too many connections from this client; close some\n";
    let answer = format!(
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    if stream.set_nonblocking(true).is_ok() {
        let _ = (&stream).write(answer.as_bytes());
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// Reads `stream`'s requests one at a time and hands each to serve.
fn serve_connection(
    stream: TcpStream,
    peer: SocketAddr,
    uid: Option<u32>,
    requests: Sender<Request>,
    _held: Held,
) {
    let stream = Arc::new(stream);
    if stream.set_write_timeout(Some(WRITE_STALL)).is_err() {
        return;
    }
    let mut buf = Vec::with_capacity(4096);
    // Until the client closes, is silent too long, or the connection
    // breaks.
    while let Ok(Some(head)) = read_head(&stream, &mut buf) {
        let head = match head {
            Ok(h) => h,
            Err(status) => {
                let reply = Reply::text(status, "malformed or oversized request\n".into());
                let _ = write_reply(&stream, "HTTP/1.1", false, false, &reply, None);
                break;
            }
        };
        let (done, answered) = mpsc::sync_channel(1);
        let keep_alive = head.keep_alive;
        let req = Request {
            head,
            peer,
            uid,
            stream: stream.clone(),
            done,
        };
        if requests.send(req).is_err() {
            break;
        }
        // Answered (true: in full, and the connection stays), or dropped.
        match answered.recv() {
            Ok(true) if keep_alive => {}
            _ => break,
        }
    }
    let _ = stream.shutdown(Shutdown::Both);
}

/// A parsed request head.
#[derive(Debug)]
struct Head {
    method: String,
    url: String,
    /// `HTTP/1.0` or `HTTP/1.1`, answered in kind.
    version: &'static str,
    headers: Vec<(String, String)>,
    keep_alive: bool,
}

/// Reads the next request's head from `stream` into `buf` (which keeps
/// what follows it: a pipelined request). `Ok(None)`: the connection
/// ended or was silent for [`IDLE`]; `Ok(Some(Err(status)))`: a head that
/// is malformed or too large, to be answered `status`.
fn read_head(stream: &TcpStream, buf: &mut Vec<u8>) -> io::Result<Option<Result<Head, u16>>> {
    let mut first_byte: Option<Instant> = (!buf.is_empty()).then(Instant::now);
    loop {
        if !buf.is_empty() {
            let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
            let mut req = httparse::Request::new(&mut headers);
            match req.parse(buf) {
                Ok(httparse::Status::Complete(len)) => {
                    let head = to_head(&req);
                    buf.drain(..len);
                    return Ok(Some(head));
                }
                Ok(httparse::Status::Partial) => {}
                Err(httparse::Error::TooManyHeaders) => return Ok(Some(Err(431))),
                Err(_) => return Ok(Some(Err(400))),
            }
            if buf.len() >= MAX_HEAD {
                return Ok(Some(Err(431)));
            }
        }
        let wait = match first_byte {
            None => IDLE,
            Some(at) => match HEAD_DEADLINE.checked_sub(at.elapsed()) {
                Some(left) if !left.is_zero() => left,
                _ => return Ok(None),
            },
        };
        stream.set_read_timeout(Some(wait))?;
        let mut chunk = [0u8; 4096];
        let room = (MAX_HEAD - buf.len()).min(chunk.len());
        let n = match (&*stream).read(&mut chunk[..room]) {
            Ok(0) => return Ok(None),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e)
                if matches!(
                    e.kind(),
                    io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
                ) =>
            {
                return Ok(None)
            }
            Err(e) => return Err(e),
        };
        first_byte.get_or_insert_with(Instant::now);
        buf.extend_from_slice(&chunk[..n]);
    }
}

fn to_head(req: &httparse::Request) -> Result<Head, u16> {
    let (Some(method), Some(url), Some(minor)) = (req.method, req.path, req.version) else {
        return Err(400);
    };
    let mut headers = Vec::with_capacity(req.headers.len());
    for h in req.headers.iter() {
        let Ok(value) = std::str::from_utf8(h.value) else {
            return Err(400);
        };
        headers.push((h.name.to_string(), value.trim().to_string()));
    }
    fn named<'a>(
        headers: &'a [(String, String)],
        name: &'a str,
    ) -> impl Iterator<Item = &'a str> + 'a {
        headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }
    let connection = |token: &str| {
        named(&headers, "Connection")
            .any(|v| v.split(',').any(|t| t.trim().eq_ignore_ascii_case(token)))
    };
    let has_body = named(&headers, "Transfer-Encoding").next().is_some()
        || named(&headers, "Content-Length").any(|v| v != "0");
    let keep_alive = !has_body
        && if minor == 0 {
            connection("keep-alive")
        } else {
            !connection("close")
        };
    Ok(Head {
        method: method.to_string(),
        url: url.to_string(),
        version: if minor == 0 { "HTTP/1.0" } else { "HTTP/1.1" },
        keep_alive,
        headers,
    })
}

/// One request, to be answered ([`Request::respond`]) or dropped (its
/// connection is then closed).
pub struct Request {
    head: Head,
    peer: SocketAddr,
    uid: Option<u32>,
    stream: Arc<TcpStream>,
    /// Tells the connection's thread the answer was written in full
    /// (`true`); dropped unsent, the connection is closed.
    done: SyncSender<bool>,
}

impl std::fmt::Debug for Request {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Request")
            .field("head", &self.head)
            .field("peer", &self.peer)
            .field("uid", &self.uid)
            .finish()
    }
}

impl Request {
    /// The request's target: path and query.
    pub fn url(&self) -> &str {
        &self.head.url
    }

    /// The values of the headers named `name` (any case).
    pub fn header<'a>(&'a self, name: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.head
            .headers
            .iter()
            .filter(move |(n, _)| n.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The user owning the client's socket, over loopback, as the kernel
    /// named it when the connection was accepted.
    pub fn peer_uid(&self) -> Option<u32> {
        self.uid
    }

    /// Writes `reply` until `deadline` at most; `Err` when it could not be
    /// written in full (the connection is then closed).
    pub fn respond(self, reply: &Reply, deadline: Instant) -> io::Result<()> {
        let head_only = self.head.method.eq_ignore_ascii_case("HEAD");
        let written = write_reply(
            &self.stream,
            self.head.version,
            self.head.keep_alive,
            head_only,
            reply,
            Some(deadline),
        );
        let _ = self.done.send(written.is_ok());
        written
    }
}

/// An answer: status, headers and body.
#[derive(Clone, Debug)]
pub struct Reply {
    status: u16,
    headers: Vec<(&'static str, String)>,
    body: Vec<u8>,
}

impl Reply {
    /// A `200` carrying `body`.
    pub fn new(body: Vec<u8>) -> Reply {
        Reply {
            status: 200,
            headers: Vec::new(),
            body,
        }
    }

    /// A plain text answer.
    pub fn text(status: u16, body: String) -> Reply {
        Reply::new(body.into_bytes())
            .with_status(status)
            .with_header("Content-Type", "text/plain; charset=utf-8")
    }

    /// The same answer with status `status`.
    pub fn with_status(mut self, status: u16) -> Reply {
        self.status = status;
        self
    }

    /// The same answer with one more header (line breaks in `value` are
    /// written as spaces).
    pub fn with_header(mut self, name: &'static str, value: impl Into<String>) -> Reply {
        let value: String = value
            .into()
            .chars()
            .map(|c| if c == '\r' || c == '\n' { ' ' } else { c })
            .collect();
        self.headers.push((name, value));
        self
    }
}

fn reason(status: u16) -> &'static str {
    match status {
        200 => "OK",
        400 => "Bad Request",
        401 => "Unauthorized",
        403 => "Forbidden",
        404 => "Not Found",
        405 => "Method Not Allowed",
        429 => "Too Many Requests",
        431 => "Request Header Fields Too Large",
        500 => "Internal Server Error",
        503 => "Service Unavailable",
        _ => "Status",
    }
}

/// Writes `reply` to `stream` (its head only for a `HEAD` request), until
/// `deadline` if any.
fn write_reply(
    stream: &TcpStream,
    version: &str,
    keep_alive: bool,
    head_only: bool,
    reply: &Reply,
    deadline: Option<Instant>,
) -> io::Result<()> {
    let mut head = format!(
        "{version} {} {}\r\nContent-Length: {}\r\n",
        reply.status,
        reason(reply.status),
        reply.body.len()
    );
    for (name, value) in &reply.headers {
        head.push_str(&format!("{name}: {value}\r\n"));
    }
    head.push_str(if keep_alive {
        if version == "HTTP/1.0" {
            "Connection: keep-alive\r\n\r\n"
        } else {
            "\r\n"
        }
    } else {
        "Connection: close\r\n\r\n"
    });
    let body: &[u8] = if head_only { &[] } else { &reply.body };
    let mut stream = stream;
    for part in std::iter::once(head.as_bytes()).chain(body.chunks(WRITE_CHUNK)) {
        if deadline.is_some_and(|d| Instant::now() >= d) {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "the client did not read the answer in time",
            ));
        }
        stream.write_all(part)?;
    }
    stream.flush()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(text: &str) -> Result<Head, u16> {
        let mut headers = [httparse::EMPTY_HEADER; MAX_HEADERS];
        let mut req = httparse::Request::new(&mut headers);
        assert!(req.parse(text.as_bytes()).unwrap().is_complete());
        to_head(&req)
    }

    #[test]
    fn a_connection_is_kept_as_http_versions_say() {
        assert!(parse("GET / HTTP/1.1\r\n\r\n").unwrap().keep_alive);
        assert!(
            !parse("GET / HTTP/1.1\r\nConnection: close\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(!parse("GET / HTTP/1.0\r\n\r\n").unwrap().keep_alive);
        assert!(
            parse("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        // A body is never read: the connection ends after the answer.
        assert!(
            !parse("GET / HTTP/1.1\r\nContent-Length: 3\r\n\r\n")
                .unwrap()
                .keep_alive
        );
        assert!(
            parse("GET / HTTP/1.1\r\nContent-Length: 0\r\n\r\n")
                .unwrap()
                .keep_alive
        );
    }

    #[test]
    fn clients_are_users_over_loopback_and_addresses_or_64_bit_prefixes_elsewhere() {
        let v4: SocketAddr = "10.1.2.3:5000".parse().unwrap();
        assert_eq!(Client::of(v4, Some(7)), Client::User(7));
        assert_eq!(Client::of(v4, None), Client::Address(v4.ip()));
        let a: SocketAddr = "[2001:db8:1:2:aaaa::1]:80".parse().unwrap();
        let b: SocketAddr = "[2001:db8:1:2:bbbb::9]:81".parse().unwrap();
        let c: SocketAddr = "[2001:db8:1:3::1]:80".parse().unwrap();
        assert_eq!(Client::of(a, None), Client::of(b, None));
        assert_ne!(Client::of(a, None), Client::of(c, None));
        let mapped: SocketAddr = "[::ffff:10.1.2.3]:80".parse().unwrap();
        assert_eq!(Client::of(mapped, None), Client::Address(v4.ip()));
    }

    #[test]
    fn an_answer_past_its_deadline_is_not_written() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut client = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (server_end, _) = l.accept().unwrap();
        let reply = Reply::text(200, "x".repeat(100));
        let late = write_reply(
            &server_end,
            "HTTP/1.1",
            true,
            false,
            &reply,
            Some(Instant::now()),
        );
        assert_eq!(late.unwrap_err().kind(), io::ErrorKind::TimedOut);
        let far = Instant::now() + Duration::from_secs(3600);
        write_reply(&server_end, "HTTP/1.0", false, false, &reply, Some(far)).unwrap();
        drop(server_end);
        let mut got = String::new();
        client.read_to_string(&mut got).unwrap();
        assert!(
            got.starts_with("HTTP/1.0 200 OK\r\nContent-Length: 100\r\n"),
            "{got}"
        );
        assert!(got.contains("Connection: close\r\n\r\n"), "{got}");
        assert!(
            got.ends_with(&"x".repeat(100)),
            "only the answer in time was written"
        );
    }

    #[test]
    fn untrusted_clients_hold_their_share_and_trusted_ones_are_never_locked_out() {
        let counts = Arc::new(Mutex::new(Counts::default()));
        let user = |u| Client::User(u);
        let mut held: Vec<Held> = (0..CONNECTIONS_PER_CLIENT)
            .map(|_| Held::take(&counts, user(1000), false).unwrap())
            .collect();
        assert!(
            Held::take(&counts, user(1000), false).is_none(),
            "past its share"
        );
        held.pop();
        held.push(Held::take(&counts, user(1000), false).expect("a place given back"));
        // Other clients fill what is left of the total.
        for u in 1001.. {
            match Held::take(&counts, user(u), false) {
                Some(h) => held.push(h),
                None => break,
            }
        }
        assert_eq!(held.len(), MAX_CONNECTIONS);
        assert!(
            Held::take(&counts, user(5), false).is_none(),
            "past the total"
        );
        // Root's connection, over all that.
        let root = Held::take(&counts, user(0), true).expect("trusted");
        drop(root);
        drop(held);
        let c = counts.lock().unwrap();
        assert_eq!(
            (c.total, c.per_client.len()),
            (0, 0),
            "every place given back"
        );
    }

    #[test]
    fn a_reply_header_cannot_break_into_another_line() {
        let r = Reply::new(vec![]).with_header("X", "a\r\nInjected: 1");
        assert_eq!(r.headers[0].1, "a  Injected: 1");
    }
}
