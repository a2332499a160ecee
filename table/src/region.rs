//! Creating a region (writer side) and mapping one read-only (reader side).
//!
//! Invariants:
//! - A region is a `memfd` created with `MFD_CLOEXEC | MFD_ALLOW_SEALING`
//!   (so it never leaks into an `exec`ed image), sized once with
//!   `ftruncate` (sparse: untouched pages cost nothing), its static header
//!   written, then sealed with `F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL`
//!   before anything else can see it.
//! - A reader maps a region only after checking that the shrink and grow
//!   seals are present, and maps exactly the file's size, so the writer can
//!   never make the reader's mapping fault (SIGBUS) by truncating the file.
//! - The reader's mapping is `PROT_READ`: the dumper cannot write a region.
//! - The writer owns no file descriptor *number*. Programs close every fd
//!   (`close_range`, daemonizing) and reuse the numbers, so the memfd's
//!   number may name the program's socket a moment later. The writer
//!   remembers the memfd's identity (device and inode: unique while the
//!   mapping keeps the inode alive) and touches the number (close, dup)
//!   only after `fstat` proves it still names that memfd. The mapping, not
//!   the descriptor, is what the writer writes through; the dumper finds a
//!   region whose descriptor is gone through the mapping
//!   (`/proc/PID/map_files`).

use std::fs::File;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::path::Path;

use memmap2::{MmapOptions, MmapRaw};
use nix::fcntl::{fcntl, FcntlArg, SealFlag};
use zerocopy::IntoBytes;

use crate::error::TableError;
use crate::header::{
    parse_header, HeaderCounters, RegionKind, StaticHeader, FORMAT_MAJOR, FORMAT_MINOR,
    HEADER_SIZE, MAGIC,
};
use crate::shared_view::SharedView;

/// Reads a clock in nanoseconds (async-signal-safe: `clock_gettime`).
pub fn clock_ns(clock: libc::clockid_t) -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid out-pointer; clock_gettime has no other
    // preconditions and cannot fail for these clock ids.
    unsafe { libc::clock_gettime(clock, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// `CLOCK_MONOTONIC` in nanoseconds: the timebase of every table timestamp.
pub fn monotonic_ns() -> u64 {
    clock_ns(libc::CLOCK_MONOTONIC)
}

/// Device and inode of an open file: what tells our memfd from whatever
/// file a program later opened under the same descriptor number.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct FileIdentity {
    dev: u64,
    ino: u64,
}

impl FileIdentity {
    /// The identity of the file `fd` names now, if `fd` is open.
    fn of(fd: RawFd) -> Option<FileIdentity> {
        let mut st = std::mem::MaybeUninit::<libc::stat>::uninit();
        // SAFETY: fstat writes a `struct stat` to a valid out-pointer; on
        // an fd that is not open it fails with EBADF and writes nothing.
        if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
            return None;
        }
        // SAFETY: fstat returned 0, so it initialised the whole struct.
        let st = unsafe { st.assume_init() };
        Some(FileIdentity {
            dev: st.st_dev,
            ino: st.st_ino,
        })
    }
}

/// The writable side of a region, owned by the instrumented process.
#[derive(Debug)]
pub struct RegionWriter {
    /// The memfd's number when it was created: the program may have closed
    /// it since, and reused the number (see the module's invariants).
    fd: RawFd,
    identity: FileIdentity,
    map: MmapRaw,
    view: SharedView,
    header: StaticHeader,
}

/// `memfd_create(2)` through the system call, not glibc's wrapper (added
/// in glibc 2.27): the agent runs on glibc 2.17 and later. On a kernel
/// without it (before Linux 3.17) this fails with `ENOSYS`, and the agent
/// says it cannot record (no region, no silent empty heap).
pub fn memfd_create(name: &std::ffi::CStr, flags: libc::c_uint) -> nix::Result<OwnedFd> {
    // SAFETY: a NUL-terminated name and plain flags; the kernel returns a
    // new descriptor or -1.
    let fd = unsafe { libc::syscall(libc::SYS_memfd_create, name.as_ptr(), flags) };
    if fd < 0 {
        return Err(nix::errno::Errno::last());
    }
    // SAFETY: a descriptor the kernel just gave us, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

impl RegionWriter {
    /// Creates, sizes, stamps and seals a new region of `size` bytes.
    pub fn create(kind: RegionKind, size: u64, layout: [u64; 8]) -> Result<Self, TableError> {
        if size < HEADER_SIZE || !size.is_multiple_of(4096) {
            return Err(TableError::CorruptHeader(format!(
                "region size {size} must be a multiple of 4096 and at least {HEADER_SIZE}"
            )));
        }
        let name = match kind {
            RegionKind::Resources => c"heapdump.resources",
            RegionKind::Allocations => c"heapdump.allocations",
        };
        let fd = memfd_create(name, libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING)
            .map_err(|e| TableError::io("memfd_create", e))?;
        nix::unistd::ftruncate(&fd, size as libc::off_t)
            .map_err(|e| TableError::io("ftruncate memfd", e))?;
        let map = MmapOptions::new()
            .len(size as usize)
            .map_raw(&fd)
            .map_err(|e| TableError::io("mmap region", e))?;
        // SAFETY: the mapping is `size` bytes, page-aligned, and lives as
        // long as `self` (the view is only handed out borrowed from `self`,
        // or copied by callers who keep the writer alive; see `view`).
        let view = unsafe { SharedView::new(map.as_ptr(), size as usize) };
        let header = StaticHeader {
            magic: MAGIC,
            version_major: FORMAT_MAJOR,
            version_minor: FORMAT_MINOR,
            kind: kind as u32,
            region_size: size,
            header_size: HEADER_SIZE,
            writer_pid: std::process::id(),
            reserved: 0,
            // The coarse clocks, which record times are read from: the
            // fine clock runs up to a tick (more on a tickless kernel)
            // ahead of the coarse one, so a fine base made every time
            // read before the coarse clock caught up with it 0, and
            // blocks allocated ticks apart compared as simultaneous (the
            // heap at the peak then counted blocks that never coexisted).
            clock_realtime_ns: clock_ns(libc::CLOCK_REALTIME_COARSE),
            clock_monotonic_ns: clock_ns(libc::CLOCK_MONOTONIC_COARSE),
            layout,
        };
        let bytes = header.as_bytes();
        // SAFETY: the header fits in the first page of a fresh mapping that
        // nobody else can see yet (the fd has not been shared), so a plain
        // copy races with nothing.
        unsafe {
            std::ptr::copy_nonoverlapping(bytes.as_ptr(), map.as_mut_ptr(), bytes.len());
        }
        fcntl(
            fd.as_raw_fd(),
            FcntlArg::F_ADD_SEALS(
                SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW | SealFlag::F_SEAL_SEAL,
            ),
        )
        .map_err(|e| TableError::io("seal memfd", e))?;
        let identity = FileIdentity::of(fd.as_raw_fd())
            .ok_or_else(|| TableError::io("fstat memfd", std::io::Error::last_os_error()))?;
        Ok(RegionWriter {
            fd: fd.into_raw_fd(),
            identity,
            map,
            view,
            header,
        })
    }

    /// The view of the whole region. Valid while `self` lives.
    pub fn view(&self) -> SharedView {
        self.view
    }

    /// The static header as written.
    pub fn header(&self) -> &StaticHeader {
        &self.header
    }

    /// The memfd, if its descriptor number still names it (the program
    /// may have closed it and reused the number). The answer holds until
    /// the program's next `close`/`dup2`; use it at once, on one thread.
    pub fn fd(&self) -> Option<BorrowedFd<'_>> {
        (FileIdentity::of(self.fd) == Some(self.identity))
            // SAFETY: `self.fd` is open and names our memfd (checked just
            // now); the borrow does not outlive `self`.
            .then(|| unsafe { BorrowedFd::borrow_raw(self.fd) })
    }

    /// Maps this region read-only through a duplicate of its fd, exactly as
    /// a dumper would (seal and header checks included). For tests and for
    /// in-process readers. Fails if the program closed the descriptor.
    pub fn open_reader(&self) -> Result<RegionReader, TableError> {
        let fd = self
            .fd()
            .ok_or_else(|| {
                TableError::io("region fd", std::io::Error::from_raw_os_error(libc::EBADF))
            })?
            .try_clone_to_owned()
            .map_err(|e| TableError::io("dup region fd", e))?;
        let kind = if self.header.kind == RegionKind::Resources as u32 {
            RegionKind::Resources
        } else {
            RegionKind::Allocations
        };
        RegionReader::from_file(File::from(fd), kind)
    }

    /// Records how the agent walks stacks (`offsets::UNWINDER`).
    pub fn set_unwinder(&self, code: u64) {
        if let Some(w) = self.view.atomic_u64(crate::header::offsets::UNWINDER) {
            w.store(code, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Records which agent writes the region (`offsets::AGENT_KIND`).
    pub fn set_agent_kind(&self, kind: crate::header::AgentKind) {
        if let Some(w) = self.view.atomic_u64(crate::header::offsets::AGENT_KIND) {
            w.store(kind.code(), std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Records the sample rate (`offsets::SAMPLE_RATE`; 0: exact mode).
    pub fn set_sample_rate(&self, rate: u64) {
        if let Some(w) = self.view.atomic_u64(crate::header::offsets::SAMPLE_RATE) {
            w.store(rate, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Stores `value` in a dynamic header word (`offset` one of
    /// [`crate::header::offsets`]; a word outside the header is ignored).
    pub fn set_header_word(&self, offset: u64, value: u64) {
        if offset < crate::header::HEADER_SIZE {
            if let Some(w) = self.view.atomic_u64(offset) {
                w.store(value, std::sync::atomic::Ordering::Relaxed);
            }
        }
    }

    /// Writer access to the process-wide counters in the header.
    pub fn counters(&self) -> HeaderCounters {
        HeaderCounters::new(self.view)
    }

    /// Bytes of the region actually backed by memory (resident pages of the
    /// memfd), measured with `mincore`.
    pub fn resident_bytes(&self) -> Result<u64, TableError> {
        let page = 4096usize;
        let pages = self.map.len().div_ceil(page);
        let mut vec = vec![0u8; pages];
        // SAFETY: the pointer and length describe our own live mapping, and
        // `vec` has one byte per page as mincore requires.
        let rc = unsafe {
            libc::mincore(
                self.map.as_mut_ptr() as *mut libc::c_void,
                self.map.len(),
                vec.as_mut_ptr(),
            )
        };
        if rc != 0 {
            return Err(TableError::io("mincore", std::io::Error::last_os_error()));
        }
        Ok(vec.iter().filter(|b| **b & 1 == 1).count() as u64 * page as u64)
    }

    /// Returns the physical pages of `offset..offset+len` (page-aligned) to
    /// the system: they read back as zeros. Used when a table moves data
    /// out of a range, so memory follows live data, not peaks.
    pub(crate) fn release_range(&self, offset: u64, len: u64) {
        if len == 0 || !offset.is_multiple_of(4096) || !len.is_multiple_of(4096) {
            return;
        }
        if offset.saturating_add(len) > self.map.len() as u64 {
            return;
        }
        // SAFETY: the range is page-aligned and inside our mapping (checked
        // above). MADV_REMOVE punches a hole in the memfd; the range stays
        // mapped and reads as zeros, so no pointer into it is invalidated.
        // Failure only means the memory is not returned, which is harmless.
        unsafe {
            libc::madvise(
                self.map.as_mut_ptr().add(offset as usize) as *mut libc::c_void,
                len as usize,
                libc::MADV_REMOVE,
            );
        }
    }
}

impl Drop for RegionWriter {
    /// Unmaps the region (the mapping drops after this) and closes the
    /// memfd's descriptor only if it still names the memfd: a number the
    /// program closed and reused is the program's, and is left alone.
    fn drop(&mut self) {
        if FileIdentity::of(self.fd) == Some(self.identity) {
            // SAFETY: the descriptor is open and names our memfd (checked
            // just now, and the callers drop a writer only where no other
            // thread runs: a fork child, or a test), so closing it closes
            // nothing of the program's.
            drop(unsafe { OwnedFd::from_raw_fd(self.fd) });
        }
    }
}

/// A region mapped read-only, validated, for the dumper.
#[derive(Debug)]
pub struct RegionReader {
    _file: File,
    _map: MmapRaw,
    view: SharedView,
    header: StaticHeader,
    kind: RegionKind,
}

impl RegionReader {
    /// The region's memfd (kept open as long as the reader).
    pub fn raw_fd(&self) -> std::os::fd::RawFd {
        self._file.as_raw_fd()
    }

    /// Opens a region by path (normally `/proc/PID/fd/N`).
    pub fn open(path: &Path, expected: RegionKind) -> Result<Self, TableError> {
        let file = File::open(path).map_err(|e| TableError::io("open region", e))?;
        Self::from_file(file, expected)
    }

    /// Maps an already open region file read-only.
    ///
    /// Refuses a region that is not sealed against shrink and grow, one
    /// whose header is not heapdump's, of another major version, or whose
    /// size disagrees with the file.
    pub fn from_file(file: File, expected: RegionKind) -> Result<Self, TableError> {
        let seals = fcntl(file.as_raw_fd(), FcntlArg::F_GET_SEALS)
            .map_err(|e| TableError::io("read memfd seals", e))?;
        let need = (SealFlag::F_SEAL_SHRINK | SealFlag::F_SEAL_GROW).bits();
        if seals & need != need {
            return Err(TableError::Unsealed { seals });
        }
        let len = file
            .metadata()
            .map_err(|e| TableError::io("stat region", e))?
            .len();
        if len < HEADER_SIZE {
            return Err(TableError::Truncated {
                what: format!("file is {len} bytes"),
            });
        }
        let map = MmapOptions::new()
            .len(len as usize)
            .map_raw_read_only(&file)
            .map_err(|e| TableError::io("mmap region read-only", e))?;
        // SAFETY: the mapping is `len` bytes, page-aligned, cannot shrink
        // (sealed, checked above) and lives as long as `self`, which owns it.
        let view = unsafe { SharedView::new(map.as_ptr(), len as usize) };
        let header = parse_header(&view, expected)?;
        Ok(RegionReader {
            _file: file,
            _map: map,
            view,
            header,
            kind: expected,
        })
    }

    /// The validated static header (copied at open).
    pub fn header(&self) -> &StaticHeader {
        &self.header
    }

    /// The region's kind.
    pub fn kind(&self) -> RegionKind {
        self.kind
    }

    /// The view of the mapping; valid while `self` lives.
    pub fn view(&self) -> SharedView {
        self.view
    }
}
