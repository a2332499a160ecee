//! Who is at the other end of a TCP connection over loopback: the user
//! that owns the client's socket, as the kernel lists it in
//! `/proc/net/tcp` and `/proc/net/tcp6` (TCP has no `SO_PEERCRED`), and
//! whether that user may read a given process.
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
//! - The tables are read a line at a time, at most [`MAX_LINES`] lines
//!   each: no whole copy of a table a busy host makes large.
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
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let server = listener.local_addr().unwrap();
        let client = std::net::TcpStream::connect(server).unwrap();
        let (_accepted, peer) = listener.accept().unwrap();
        assert_eq!(peer, client.local_addr().unwrap());
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        assert_eq!(peer_uid(peer, server), Some(me));
        // The server's end is not a client of the client.
        let mut other = peer;
        other.set_port(if peer.port() == 1 { 2 } else { 1 });
        assert_eq!(peer_uid(other, server), None);
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
