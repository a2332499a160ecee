//! The target's memory, read and written by a helper process of ours
//! under a deadline, so that no page of the target can hold `heapdump
//! attach` for ever.
//!
//! A read of `/proc/PID/mem` faults the target's pages in as the target
//! would; a page of a file on a user-space file system (FUSE) is then a
//! request to that file system's server, and once the server has taken
//! it the reader waits, uninterruptibly, until it answers. Attach refuses
//! the mappings the target's maps show on such file systems
//! ([`crate::attach::remote_unwind::Memory`]), but the target's other
//! threads run while one is judged: one can map such a file over the
//! held thread's stack between attach's reading of the maps and of the
//! stack. A thread of heapdump stuck that way cannot be ended (nor can
//! heapdump, whose exit waits for its threads), so the reads and writes
//! are made by a child process, each answered within [`DEADLINE`] or the
//! child is killed and abandoned: it ends when the server answers or dies,
//! heapdump goes on and says why.
//!
//! Invariants:
//! - The child is forked right after `/proc/PID/mem` is opened (the
//!   permission is the opener's, checked at open) and, forked from a
//!   process that may have threads, makes only raw system calls on
//!   descriptors and a buffer it inherited: no allocation, no lock.
//! - One request at a time, each at most [`CHUNK`] bytes; every wait of
//!   ours on the child (writing a request, reading its answer) is a
//!   `poll` bounded by what is left of the request's deadline.
//! - After a deadline passed, or the child ended, every access fails at
//!   once ([`MemoryAccess::stalled`] says so): a half-answered protocol is
//!   never resumed.
//! - The child keeps no descriptor of ours but its three (a stalled
//!   helper must not hold heapdump's output open for whoever reads it).
//! - The child ignores the signals a terminal or a supervisor sends
//!   (Ctrl-C must let `attach --for` detach through it) and dies with us
//!   (`PR_SET_PDEATHSIG`).

use std::cell::Cell;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::time::{Duration, Instant};

/// How long one read or write of the target's memory may take.
pub const DEADLINE: Duration = Duration::from_secs(5);

/// Most bytes one request moves (a request's header and data fit in the
/// smallest pipe buffer the kernel gives, one page, only in parts: every
/// write of ours is polled, so a smaller buffer costs turns, not a hang).
pub const CHUNK: usize = 32 << 10;

const OP_READ: u64 = 0;
const OP_WRITE: u64 = 1;
/// Header: operation, address, length (three native-endian words).
const HEADER: usize = 24;

/// Reads and writes of one process's memory through a helper child.
#[derive(Debug)]
pub struct MemoryAccess {
    child: libc::pid_t,
    requests: OwnedFd,
    answers: OwnedFd,
    stalled: Cell<bool>,
}

fn pipe() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid place for two descriptors.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both descriptors were just made by the kernel and are owned
    // here alone.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

impl MemoryAccess {
    /// Starts the helper for `mem`, an open `/proc/PID/mem`.
    pub fn start(mem: File) -> io::Result<MemoryAccess> {
        let (req_r, req_w) = pipe()?;
        let (ans_r, ans_w) = pipe()?;
        // The child's only buffer, made before the fork.
        let mut buf = vec![0u8; CHUNK + 8];
        // SAFETY: the child runs `serve` only, which makes raw system
        // calls on inherited descriptors and `buf` and never returns (see
        // the module's invariants); the parent goes on as before.
        let child = unsafe { libc::fork() };
        if child < 0 {
            return Err(io::Error::last_os_error());
        }
        if child == 0 {
            serve(
                mem.as_raw_fd(),
                req_r.as_raw_fd(),
                ans_w.as_raw_fd(),
                &mut buf,
            );
        }
        drop((req_r, ans_w, mem));
        for fd in [&req_w, &ans_r] {
            // SAFETY: fcntl on a descriptor we own.
            unsafe {
                let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        Ok(MemoryAccess {
            child,
            requests: req_w,
            answers: ans_r,
            stalled: Cell::new(false),
        })
    }

    /// Whether an access outlived its deadline or the helper ended: no
    /// access works any more.
    pub fn stalled(&self) -> bool {
        self.stalled.get()
    }

    /// Reads `buf.len()` bytes at `addr`: the bytes read (fewer at the
    /// end of a mapping), `None` on an error or a stall.
    pub fn read_at(&self, buf: &mut [u8], addr: u64) -> Option<usize> {
        let mut done = 0;
        while done < buf.len() {
            let part = (buf.len() - done).min(CHUNK);
            let end = done + part;
            let n = self.request(OP_READ, addr + done as u64, &[], &mut buf[done..end])?;
            done += n;
            if n < part {
                break;
            }
        }
        Some(done)
    }

    /// Writes `bytes` at `addr`: the bytes written, `None` on an error or
    /// a stall.
    pub fn write_at(&self, bytes: &[u8], addr: u64) -> Option<usize> {
        let mut done = 0;
        while done < bytes.len() {
            let part = (bytes.len() - done).min(CHUNK);
            let n = self.request(
                OP_WRITE,
                addr + done as u64,
                &bytes[done..done + part],
                &mut [],
            )?;
            done += n;
            if n < part {
                break;
            }
        }
        Some(done)
    }

    /// One request: its header and `out`, then the answer's count and, for
    /// a read, that many bytes into `into`.
    fn request(&self, op: u64, addr: u64, out: &[u8], into: &mut [u8]) -> Option<usize> {
        if self.stalled.get() {
            return None;
        }
        let deadline = Instant::now() + DEADLINE;
        let len = (out.len().max(into.len())) as u64;
        let mut header = [0u8; HEADER];
        header[..8].copy_from_slice(&op.to_ne_bytes());
        header[8..16].copy_from_slice(&addr.to_ne_bytes());
        header[16..].copy_from_slice(&len.to_ne_bytes());
        let mut count = [0u8; 8];
        let answered = self.send(&header, deadline)
            && self.send(out, deadline)
            && self.receive(&mut count, deadline);
        if !answered {
            return self.give_up();
        }
        let n = i64::from_ne_bytes(count);
        if n < 0 {
            return None;
        }
        let n = (n as usize).min(len as usize);
        if op == OP_READ && !self.receive(&mut into[..n], deadline) {
            return self.give_up();
        }
        Some(n)
    }

    /// The helper is killed and abandoned (it ends when whatever holds it
    /// lets go); every later access fails at once.
    fn give_up(&self) -> Option<usize> {
        self.stalled.set(true);
        // SAFETY: kill takes a pid (our own child's) and a signal.
        unsafe { libc::kill(self.child, libc::SIGKILL) };
        None
    }

    fn send(&self, mut bytes: &[u8], deadline: Instant) -> bool {
        while !bytes.is_empty() {
            if !wait_for(self.requests.as_raw_fd(), libc::POLLOUT, deadline) {
                return false;
            }
            // SAFETY: `bytes` is valid for reading `bytes.len()` bytes.
            let n = unsafe {
                libc::write(
                    self.requests.as_raw_fd(),
                    bytes.as_ptr().cast(),
                    bytes.len(),
                )
            };
            match n {
                n if n > 0 => bytes = &bytes[n as usize..],
                _ if retry() => {}
                _ => return false,
            }
        }
        true
    }

    fn receive(&self, mut into: &mut [u8], deadline: Instant) -> bool {
        while !into.is_empty() {
            if !wait_for(self.answers.as_raw_fd(), libc::POLLIN, deadline) {
                return false;
            }
            // SAFETY: `into` is valid for writing `into.len()` bytes.
            let n = unsafe {
                libc::read(
                    self.answers.as_raw_fd(),
                    into.as_mut_ptr().cast(),
                    into.len(),
                )
            };
            match n {
                n if n > 0 => into = &mut into[n as usize..],
                0 => return false,
                _ if retry() => {}
                _ => return false,
            }
        }
        true
    }
}

/// Whether the last call failed for a reason worth trying again.
fn retry() -> bool {
    matches!(
        io::Error::last_os_error().raw_os_error(),
        Some(libc::EINTR) | Some(libc::EAGAIN)
    )
}

/// Waits until `fd` is ready for `events`, or `deadline` passed (false).
fn wait_for(fd: RawFd, events: libc::c_short, deadline: Instant) -> bool {
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return false;
        }
        let mut p = libc::pollfd {
            fd,
            events,
            revents: 0,
        };
        let ms = left.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut p, 1, ms) };
        if r > 0 {
            return true;
        }
        if r < 0 && !retry() {
            return false;
        }
    }
}

impl Drop for MemoryAccess {
    fn drop(&mut self) {
        // SAFETY: kill and waitpid take our own child's pid. A child that
        // did not stall waits for a request or is about to answer one, and
        // ends at once; a stalled one is left to end on its own (waiting
        // for it could be waiting for ever).
        unsafe {
            libc::kill(self.child, libc::SIGKILL);
            if !self.stalled.get() {
                libc::waitpid(self.child, std::ptr::null_mut(), 0);
            }
        }
    }
}

/// The helper's loop: answers requests until its request pipe ends.
///
/// Runs in the forked child: raw system calls only, on the descriptors
/// and the buffer it was given (see the module's invariants). It keeps
/// those three descriptors only, as 0, 1 and 2: a stalled helper holding
/// heapdump's standard output would keep whoever reads it (a pipe, a
/// supervisor) waiting for its end.
fn serve(mem: RawFd, requests: RawFd, answers: RawFd, buf: &mut [u8]) -> ! {
    // SAFETY (for each call below): raw system calls with valid
    // descriptors, and pointers into `header` or `buf` with their lengths.
    unsafe {
        let high = [mem, requests, answers].map(|fd| libc::fcntl(fd, libc::F_DUPFD, 10));
        if high.iter().any(|&fd| fd < 0) {
            libc::_exit(1);
        }
        for (to, from) in high.into_iter().enumerate() {
            if libc::dup2(from, to as RawFd) < 0 {
                libc::_exit(1);
            }
        }
        let (mem, requests, answers) = (0, 1, 2);
        if libc::syscall(libc::SYS_close_range, 3u32, u32::MAX, 0u32) != 0 {
            // Before Linux 5.9: one by one, up to the descriptor limit.
            let mut lim: libc::rlimit = std::mem::zeroed();
            let max = if libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) == 0 {
                lim.rlim_cur.min(1 << 20) as RawFd
            } else {
                1 << 16
            };
            for fd in 3..max {
                libc::close(fd);
            }
        }
        libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
        for sig in [
            libc::SIGINT,
            libc::SIGTERM,
            libc::SIGHUP,
            libc::SIGQUIT,
            libc::SIGPIPE,
        ] {
            libc::signal(sig, libc::SIG_IGN);
        }
        let mut header = [0u8; HEADER];
        loop {
            if !read_exactly(requests, &mut header) {
                libc::_exit(0);
            }
            let word = |i: usize| {
                let mut w = [0u8; 8];
                w.copy_from_slice(&header[i * 8..i * 8 + 8]);
                u64::from_ne_bytes(w)
            };
            let (op, addr, len) = (word(0), word(1), word(2) as usize);
            if len > CHUNK || len + 8 > buf.len() {
                libc::_exit(1);
            }
            let n: i64 = if op == OP_WRITE {
                if !read_exactly(requests, &mut buf[..len]) {
                    libc::_exit(0);
                }
                libc::pwrite64(mem, buf.as_ptr().cast(), len, addr as i64) as i64
            } else {
                libc::pread64(mem, buf[8..].as_mut_ptr().cast(), len, addr as i64) as i64
            };
            buf[..8].copy_from_slice(&n.to_ne_bytes());
            let answer = if op == OP_READ && n > 0 {
                8 + n as usize
            } else {
                8
            };
            if !write_exactly(answers, &buf[..answer]) {
                libc::_exit(0);
            }
        }
    }
}

/// Reads all of `into` from `fd`; false at its end or on an error.
fn read_exactly(fd: RawFd, mut into: &mut [u8]) -> bool {
    while !into.is_empty() {
        // SAFETY: `into` is valid for writing `into.len()` bytes.
        let n = unsafe { libc::read(fd, into.as_mut_ptr().cast(), into.len()) };
        if n > 0 {
            into = &mut into[n as usize..];
        } else if n == 0 || !retry() {
            return false;
        }
    }
    true
}

/// Writes all of `bytes` to `fd`; false on an error.
fn write_exactly(fd: RawFd, mut bytes: &[u8]) -> bool {
    while !bytes.is_empty() {
        // SAFETY: `bytes` is valid for reading `bytes.len()` bytes.
        let n = unsafe { libc::write(fd, bytes.as_ptr().cast(), bytes.len()) };
        if n > 0 {
            bytes = &bytes[n as usize..];
        } else if !retry() {
            return false;
        }
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_go_through_the_helper() {
        let mem = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open("/proc/self/mem")
            .unwrap();
        let access = MemoryAccess::start(mem).unwrap();
        // A buffer of ours, larger than one request.
        let src: Vec<u8> = (0..CHUNK * 2 + 100).map(|i| (i % 251) as u8).collect();
        let mut seen = vec![0u8; src.len()];
        assert_eq!(
            access.read_at(&mut seen, src.as_ptr() as u64),
            Some(src.len())
        );
        assert_eq!(seen, src);
        // The child's writes land in its copy of our memory, not ours (a
        // fork): what is checked is that the answer comes back.
        assert_eq!(access.write_at(&[1, 2, 3], seen.as_ptr() as u64), Some(3));
        // Unmapped: an error, not a stall.
        let mut b = [0u8; 8];
        assert_eq!(access.read_at(&mut b, 8), None);
        assert!(!access.stalled());
        assert_eq!(
            access.read_at(&mut seen[..16], src.as_ptr() as u64),
            Some(16)
        );
    }

    #[test]
    fn a_helper_that_never_answers_is_given_up_after_the_deadline() {
        let (r, w) = pipe().unwrap();
        // A "helper" that reads nothing and answers nothing: a sleeping
        // child of ours.
        // SAFETY: the child only sleeps and exits.
        let child = unsafe { libc::fork() };
        assert!(child >= 0);
        if child == 0 {
            // SAFETY: raw calls in the forked child.
            unsafe {
                libc::sleep(600);
                libc::_exit(0);
            }
        }
        let (ans_r, ans_w) = pipe().unwrap();
        for fd in [&w, &ans_r] {
            // SAFETY: fcntl on descriptors we own.
            unsafe {
                let flags = libc::fcntl(fd.as_raw_fd(), libc::F_GETFL);
                libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, flags | libc::O_NONBLOCK);
            }
        }
        let access = MemoryAccess {
            child,
            requests: w,
            answers: ans_r,
            stalled: Cell::new(false),
        };
        let started = Instant::now();
        let mut b = [0u8; 8];
        assert_eq!(access.read_at(&mut b, 0x1000), None);
        assert!(access.stalled());
        assert!(started.elapsed() >= DEADLINE);
        // At once from now on.
        assert_eq!(access.read_at(&mut b, 0x1000), None);
        drop((r, ans_w));
        // SAFETY: reaping our killed child.
        unsafe { libc::waitpid(child, std::ptr::null_mut(), 0) };
    }
}
