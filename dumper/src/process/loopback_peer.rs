//! Who is at the other end of a TCP connection over loopback: the user
//! that owns the client's socket, as the kernel's socket diagnostics
//! (`NETLINK_SOCK_DIAG`, the one socket asked for by its two ends) or,
//! where those cannot be asked, its tables `/proc/net/tcp` and
//! `/proc/net/tcp6` say (TCP has no `SO_PEERCRED`), and whether that user
//! may read a given process.
//!
//! `serve` on loopback without a token answers any local user: without
//! this, a user of the machine read the heap profiles (call stacks, thread
//! names, sizes) of every other user's processes, root's daemons
//! included, through a server root started. DESIGN §2 keeps the regions
//! to those who may read the process's memory; this keeps `serve`'s
//! answers to them too.
//!
//! Invariants:
//! - The lookup reads the tables of heapdump's own network namespace
//!   (`/proc/self/net`), where a loopback client of its listening socket
//!   is; it matches the connection's two ends exactly (address and port
//!   of both), so another connection's owner is never taken for it.
//! - The kernel is asked for the one socket (its hash table looked up, as
//!   `ss` does with a full filter): any local user decides how many sockets
//!   the host has (a million: 150 MB of table text, which the kernel
//!   writes at each read), and a lookup that read the whole table would
//!   cost serve that much at every request. Only where the diagnostics
//!   cannot be asked (the `tcp_diag` module missing) are the tables read,
//!   a line at a time, at most [`MAX_LINES`] lines each.
//! - "May read" is the kernel's rule for reading a process's memory, as
//!   far as `/proc` shows it: every one of the process's user ids is the
//!   peer's, and its `/proc/PID` is the peer's (the kernel gives a process
//!   that is not dumpable, a set-user-id program's, to root there). Root
//!   may read every process.

use std::io::BufRead;
use std::net::{IpAddr, SocketAddr};
use std::os::unix::fs::MetadataExt;

/// Most lines read of one socket table (a host with a million sockets
/// has a million lines; a connection that was just accepted is found long
/// before on any real host).
pub const MAX_LINES: usize = 4 << 20;

/// The user id owning the client socket of the TCP connection whose
/// client end is `peer` and server end `local`, or `None` when it is not
/// listed (not a local connection, or gone).
pub fn peer_uid(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    match sock_diag::owner(peer, local) {
        Ok(found) => found,
        Err(sock_diag::Unavailable) => owner_in_table(peer, local),
    }
}

/// [`peer_uid`] from the socket tables, read a line at a time.
fn owner_in_table(peer: SocketAddr, local: SocketAddr) -> Option<u32> {
    let table = match peer.ip() {
        IpAddr::V4(_) => "/proc/self/net/tcp",
        IpAddr::V6(_) => "/proc/self/net/tcp6",
    };
    let (want_local, want_remote) = (hex_endpoint(peer), hex_endpoint(local));
    let file = std::fs::File::open(table).ok()?;
    let mut lines = std::io::BufReader::new(file).lines();
    // The header line.
    lines.next()?.ok()?;
    for line in lines.take(MAX_LINES) {
        let line = line.ok()?;
        if let Some(uid) = owner_if(&line, &want_local, &want_remote) {
            return Some(uid);
        }
    }
    None
}

/// The uid field of a socket table `line` whose local and remote
/// addresses are the ones asked for.
fn owner_if(line: &str, local: &str, remote: &str) -> Option<u32> {
    // sl local_address rem_address st tx:rx tr:when retrnsmt uid ...
    let mut f = line.split_whitespace();
    let _sl = f.next()?;
    if !f.next()?.eq_ignore_ascii_case(local) || !f.next()?.eq_ignore_ascii_case(remote) {
        return None;
    }
    f.nth(4)?.parse().ok()
}

/// `addr` as the socket tables print it: the address's bytes in the
/// kernel's memory order, as 32-bit words in hex (`%08X` each, words of
/// host order), then `:` and the port in hex.
fn hex_endpoint(addr: SocketAddr) -> String {
    let words: Vec<u32> = match addr.ip() {
        IpAddr::V4(a) => vec![u32::from_ne_bytes(a.octets())],
        IpAddr::V6(a) => a
            .octets()
            .chunks_exact(4)
            .map(|c| u32::from_ne_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
    };
    let mut s: String = words.iter().map(|w| format!("{w:08X}")).collect();
    s.push_str(&format!(":{:04X}", addr.port()));
    s
}

/// The kernel's socket diagnostics asked for one TCP socket by its two
/// ends (`inet_diag_req_v2` without `NLM_F_DUMP`: the kernel looks it up
/// in its hash table, answering in constant time however many sockets
/// the host has). Hand-written: the request is one fixed struct, and a
/// netlink crate would bring a whole message model for one lookup.
mod sock_diag {
    use std::net::{IpAddr, SocketAddr};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

    /// The diagnostics could not be asked (or answered nonsense): the
    /// caller reads the socket tables instead.
    #[derive(Debug, PartialEq, Eq)]
    pub struct Unavailable;

    const NETLINK_SOCK_DIAG: i32 = 4;
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    const NLMSG_ERROR: u16 = 2;
    /// `INET_DIAG_NOCOOKIE`: any socket with these ends.
    const NO_COOKIE: [u32; 2] = [u32::MAX, u32::MAX];

    /// `struct nlmsghdr`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Header {
        len: u32,
        kind: u16,
        flags: u16,
        seq: u32,
        pid: u32,
    }

    /// `struct inet_diag_sockid`: ports and addresses in network order.
    #[repr(C)]
    #[derive(Clone, Copy, PartialEq, Eq)]
    struct SockId {
        sport: u16,
        dport: u16,
        src: [u32; 4],
        dst: [u32; 4],
        iface: u32,
        cookie: [u32; 2],
    }

    /// `struct nlmsghdr` then `struct inet_diag_req_v2`.
    #[repr(C)]
    struct Request {
        header: Header,
        family: u8,
        protocol: u8,
        ext: u8,
        pad: u8,
        states: u32,
        id: SockId,
    }

    /// The head of `struct inet_diag_msg`, up to its `idiag_uid`.
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Reply {
        family: u8,
        state: u8,
        timer: u8,
        retrans: u8,
        id: SockId,
        expires: u32,
        rqueue: u32,
        wqueue: u32,
        uid: u32,
    }

    /// An address's bytes, in network order, as the kernel's four words.
    fn words(ip: IpAddr) -> [u32; 4] {
        let mut w = [0u32; 4];
        match ip {
            IpAddr::V4(a) => w[0] = u32::from_ne_bytes(a.octets()),
            IpAddr::V6(a) => {
                for (slot, c) in w.iter_mut().zip(a.octets().chunks_exact(4)) {
                    *slot = u32::from_ne_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
        w
    }

    /// The user owning the TCP socket whose own end is `peer` and whose
    /// other end is `local`; `Ok(None)` when the kernel has no such socket.
    pub fn owner(peer: SocketAddr, local: SocketAddr) -> Result<Option<u32>, Unavailable> {
        // SAFETY: socket(2) with constant arguments; the descriptor it
        // returns (checked) is owned here alone.
        let fd = unsafe {
            libc::socket(
                libc::AF_NETLINK,
                libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
                NETLINK_SOCK_DIAG,
            )
        };
        if fd < 0 {
            return Err(Unavailable);
        }
        // SAFETY: `fd` is a fresh descriptor nothing else owns.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        // The kernel answers at once; a second bounds it anyway.
        let timeout = libc::timeval {
            tv_sec: 1,
            tv_usec: 0,
        };
        // SAFETY: `timeout` is a valid `timeval` of the size given.
        unsafe {
            libc::setsockopt(
                fd.as_raw_fd(),
                libc::SOL_SOCKET,
                libc::SO_RCVTIMEO,
                (&raw const timeout).cast(),
                std::mem::size_of::<libc::timeval>() as libc::socklen_t,
            )
        };
        let id = SockId {
            sport: peer.port().to_be(),
            dport: local.port().to_be(),
            src: words(peer.ip()),
            dst: words(local.ip()),
            iface: 0,
            cookie: NO_COOKIE,
        };
        let family = match peer.ip() {
            IpAddr::V4(_) => libc::AF_INET,
            IpAddr::V6(_) => libc::AF_INET6,
        } as u8;
        let request = Request {
            header: Header {
                len: std::mem::size_of::<Request>() as u32,
                kind: SOCK_DIAG_BY_FAMILY,
                flags: NLM_F_REQUEST,
                seq: 1,
                pid: 0,
            },
            family,
            protocol: libc::IPPROTO_TCP as u8,
            ext: 0,
            pad: 0,
            states: u32::MAX,
            id,
        };
        // SAFETY: `request` is a plain C struct of the length given; an
        // unconnected netlink socket sends to the kernel.
        let sent = unsafe {
            libc::send(
                fd.as_raw_fd(),
                (&raw const request).cast(),
                std::mem::size_of::<Request>(),
                0,
            )
        };
        if sent != std::mem::size_of::<Request>() as isize {
            return Err(Unavailable);
        }
        let mut buf = [0u8; 8192];
        // SAFETY: `buf` is writable for its length.
        let got = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
        let got = usize::try_from(got).map_err(|_| Unavailable)?;
        parse(&buf[..got], family, &id)
    }

    /// The answer to a request for socket `id` of `family`: its owner,
    /// `Ok(None)` for "no such socket" (`ENOENT`).
    fn parse(answer: &[u8], family: u8, id: &SockId) -> Result<Option<u32>, Unavailable> {
        let header_len = std::mem::size_of::<Header>();
        if answer.len() < header_len {
            return Err(Unavailable);
        }
        // SAFETY: `answer` holds at least a `Header`, a plain C struct any
        // bytes are a value of; read unaligned.
        let header: Header = unsafe { std::ptr::read_unaligned(answer.as_ptr().cast()) };
        if header.seq != 1 || (header.len as usize) > answer.len() {
            return Err(Unavailable);
        }
        let body = &answer[header_len..header.len as usize];
        match header.kind {
            NLMSG_ERROR if body.len() >= 4 => {
                let errno = -i32::from_ne_bytes([body[0], body[1], body[2], body[3]]);
                if errno == libc::ENOENT {
                    Ok(None)
                } else {
                    Err(Unavailable)
                }
            }
            SOCK_DIAG_BY_FAMILY if body.len() >= std::mem::size_of::<Reply>() => {
                // SAFETY: `body` holds at least a `Reply`, a plain C
                // struct any bytes are a value of; read unaligned.
                let reply: Reply = unsafe { std::ptr::read_unaligned(body.as_ptr().cast()) };
                // The socket asked for, exactly (the cookie aside).
                let same = |a: &SockId| (a.sport, a.dport, a.src, a.dst);
                if reply.family == family && same(&reply.id) == same(id) {
                    Ok(Some(reply.uid))
                } else {
                    Err(Unavailable)
                }
            }
            _ => Err(Unavailable),
        }
    }

    #[cfg(test)]
    mod tests {
        use super::*;

        #[test]
        fn the_kernel_names_the_owner_of_one_socket_by_its_two_ends() {
            for host in ["127.0.0.1:0", "[::1]:0"] {
                let Ok(listener) = std::net::TcpListener::bind(host) else {
                    continue;
                };
                let server = listener.local_addr().unwrap();
                let client = std::net::TcpStream::connect(server).unwrap();
                let (_accepted, peer) = listener.accept().unwrap();
                assert_eq!(peer, client.local_addr().unwrap());
                // SAFETY: geteuid has no preconditions.
                let me = unsafe { libc::geteuid() };
                assert_eq!(owner(peer, server), Ok(Some(me)), "{host}");
                let mut other = peer;
                other.set_port(if peer.port() == 1 { 2 } else { 1 });
                assert_eq!(owner(other, server), Ok(None), "{host}");
            }
        }

        #[test]
        fn an_answer_for_another_socket_or_truncated_is_not_taken() {
            let id = SockId {
                sport: 1,
                dport: 2,
                src: [3, 0, 0, 0],
                dst: [4, 0, 0, 0],
                iface: 0,
                cookie: NO_COOKIE,
            };
            let answer = |reply_id: SockId, len: usize| {
                let mut b = vec![0u8; 16 + std::mem::size_of::<Reply>()];
                let header = Header {
                    len: b.len() as u32,
                    kind: SOCK_DIAG_BY_FAMILY,
                    flags: 0,
                    seq: 1,
                    pid: 0,
                };
                let reply = Reply {
                    family: 2,
                    state: 1,
                    timer: 0,
                    retrans: 0,
                    id: reply_id,
                    expires: 0,
                    rqueue: 0,
                    wqueue: 0,
                    uid: 1000,
                };
                // SAFETY: `b` has room for a `Header` then a `Reply`,
                // written unaligned.
                unsafe {
                    std::ptr::write_unaligned(b.as_mut_ptr().cast(), header);
                    std::ptr::write_unaligned(b.as_mut_ptr().add(16).cast(), reply);
                }
                b.truncate(len);
                b
            };
            let full = 16 + std::mem::size_of::<Reply>();
            assert_eq!(parse(&answer(id, full), 2, &id), Ok(Some(1000)));
            let other = SockId { sport: 9, ..id };
            assert_eq!(parse(&answer(other, full), 2, &id), Err(Unavailable));
            assert_eq!(parse(&answer(id, full), 10, &id), Err(Unavailable));
            assert_eq!(parse(&answer(id, full - 1), 2, &id), Err(Unavailable));
            assert_eq!(parse(&answer(id, 8), 2, &id), Err(Unavailable));
        }
    }
}

/// Whether user `uid` may read process `pid`'s heap (see the module doc);
/// `false` when the process is gone or `/proc` says nothing.
pub fn may_read(uid: u32, pid: u32) -> bool {
    if uid == 0 {
        return true;
    }
    let owner = std::fs::metadata(format!("/proc/{pid}")).map(|m| m.uid());
    if owner.ok() != Some(uid) {
        return false;
    }
    super::discovery::process_uids(pid).is_some_and(|ids| ids.iter().all(|&id| id == uid))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn endpoints_are_written_as_the_socket_tables_write_them() {
        // 127.0.0.1:6060 on a little-endian machine: 0100007F:17AC.
        let v4: SocketAddr = "127.0.0.1:6060".parse().unwrap();
        let expect = if cfg!(target_endian = "little") {
            "0100007F:17AC"
        } else {
            "7F000001:17AC"
        };
        assert_eq!(hex_endpoint(v4), expect);
        let v6: SocketAddr = "[::1]:80".parse().unwrap();
        let one = if cfg!(target_endian = "little") {
            "01000000"
        } else {
            "00000001"
        };
        assert_eq!(hex_endpoint(v6), format!("{}{one}:0050", "0".repeat(24)));
    }

    #[test]
    fn the_owner_of_this_processs_own_connection_is_found_and_no_other() {
        // Through the diagnostics (see `sock_diag`'s own test), and in
        // the tables.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(server).unwrap();
        let (_accepted, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(peer_uid(peer, server), Some(me));
        assert_eq!(owner_in_table(peer, server), Some(me));
        // The server's end is not a client of the client.
        let mut other = peer;
        other.set_port(if peer.port() == 1 { 2 } else { 1 });
        assert_eq!(peer_uid(other, server), None);
        assert_eq!(owner_in_table(other, server), None);
    }

    #[test]
    fn a_user_may_read_its_own_processes_root_every_one() {
        let me = std::process::id();
        // SAFETY: getuid has no preconditions.
        let uid = unsafe { libc::getuid() };
        assert!(may_read(uid, me));
        assert!(may_read(0, me));
        assert!(!may_read(uid.wrapping_add(12345), me));
        // pid 1 (root's), for a user that is not root.
        assert!(!may_read(65534, 1));
    }
}
