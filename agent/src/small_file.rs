//! Reading a small file without allocating: for the agent's few looks at
//! files (`/proc/thread-self/status`, `/etc/ld.so.preload`) from places
//! where the allocator may not be called (hooks, a library initialiser).
//!
//! Invariants: never allocates; the descriptor is opened close-on-exec,
//! non-blocking and without becoming a controlling terminal, and closed
//! before return (the agent owns no descriptor beyond the call); at most
//! `buf.len()` bytes are read.

use std::ffi::CStr;

/// Reads the start of the file at `path` into `buf` (up to its length);
/// the bytes read, `None` when the file cannot be opened.
pub fn read_into(path: &CStr, buf: &mut [u8]) -> Option<usize> {
    // SAFETY: open with a NUL-terminated path; reads into `buf` within its
    // length; the descriptor is ours from open to close.
    unsafe {
        let fd = libc::open(
            path.as_ptr(),
            libc::O_RDONLY | libc::O_CLOEXEC | libc::O_NOCTTY | libc::O_NONBLOCK,
        );
        if fd < 0 {
            return None;
        }
        let mut n = 0;
        while n < buf.len() {
            let r = libc::read(fd, buf[n..].as_mut_ptr().cast(), buf.len() - n);
            if r <= 0 {
                break;
            }
            n += r as usize;
        }
        libc::close(fd);
        Some(n)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_is_read_up_to_the_buffer_and_a_missing_one_is_none() {
        let mut buf = [0u8; 4];
        assert_eq!(read_into(c"/proc/self/stat", &mut buf), Some(4));
        let mut big = [0u8; 4096];
        let n = read_into(c"/proc/self/status", &mut big).unwrap();
        assert!(big[..n].starts_with(b"Name:"), "{:?}", &big[..n.min(16)]);
        assert_eq!(read_into(c"/nonexistent/heapdump", &mut big), None);
    }
}
