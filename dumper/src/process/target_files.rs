//! Files of a target process, opened so that nothing the target controls
//! decides what heapdump opens, how long it waits, or how much it reads.
//!
//! heapdump runs as root against processes it must not trust: a
//! compromised service, another user's program, a container. The paths in
//! `/proc/PID/maps`, the names in its ELF files (`.gnu_debuglink`, split
//! DWARF), the files beside them and their sizes are all the target's to
//! choose. Every file of a target is opened here, under these rules:
//!
//! - **Where.** A mapped file is opened through `/proc/PID/map_files/
//!   START-END`, the very inode the process maps, never by its name when
//!   that works. A name is resolved inside the target's root with
//!   `openat2(RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS)` relative to a
//!   descriptor of `/proc/PID/root`, so an absolute symbolic link in a
//!   container points into the container, never at the host. On a kernel
//!   without `openat2` (before 5.6) the name is walked one component at a
//!   time with `O_NOFOLLOW`, and a symbolic link or `..` is refused.
//!   Nothing on a user-space file system (FUSE) is entered or opened: its
//!   server answers every request and could stall heapdump for ever
//!   ([`UserSpaceMounts`]).
//! - **What.** Every open is first an `O_PATH` open, which has no side
//!   effect (a FIFO does not block, a device is not opened, a terminal
//!   does not become ours); it is `fstat`-ed and only a regular file is
//!   reopened for reading, `O_RDONLY | O_NONBLOCK | O_NOCTTY | O_CLOEXEC`.
//! - **How much.** Contents are read with `pread` into private memory,
//!   never mapped: a target that truncates its file afterwards makes a
//!   read come back short (an error, the file left unsymbolized) instead
//!   of killing heapdump with SIGBUS. Every read is charged to the file's
//!   [`ReadBudget`] *before* any memory is set aside for it, so a sparse
//!   file with a 4 GiB section costs nothing but the refusal.

use std::cell::{Cell, RefCell};
use std::collections::HashSet;
use std::ffi::CString;
use std::fs::File;
use std::io;
use std::ops::Range;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::os::unix::fs::FileExt;
use std::path::{Component, Path};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

use object::read::{ReadCache, ReadCacheOps, ReadRef};

use super::user_space_mounts::UserSpaceMounts;

/// Most bytes read from one file of a target (its sections, symbol
/// tables, debug information), unless `HEAPDUMP_MAX_FILE_READ` (bytes)
/// says otherwise. Distributions' largest debug files (a browser's) are
/// around this size; a target's file that asks for more is left
/// unsymbolized.
pub const DEFAULT_MAX_FILE_READ: u64 = 2 << 30;

/// Most bytes of one note section or segment read while looking for a
/// build ID (a real `.note.gnu.build-id` is 36 bytes).
pub const MAX_NOTE_BYTES: u64 = 64 << 10;

/// The total read budget in force for everything one symbolizer reads
/// of targets' files and keeps (`HEAPDUMP_MAX_TOTAL_READ`, bytes), else
/// [`default_total_read`] of the memory heapdump may use: this machine's,
/// or less where heapdump's own control group is limited (a container).
/// Each file has its own budget besides ([`max_file_read`]): this one
/// bounds what many files together cost (eight libraries of 20 KB on
/// disk, each a sparse 64 MiB `.debug_info` holding one unit, took 633 MB
/// of root's heapdump, and a target maps as many as it likes).
pub fn max_total_read() -> u64 {
    std::env::var("HEAPDUMP_MAX_TOTAL_READ")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| {
            let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
                let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
                let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
                Some(kib.saturating_mul(1024))
            });
            let own = std::fs::read_to_string("/proc/self/cgroup")
                .ok()
                .and_then(|c| cgroup_memory_limit(&c, Path::new("/sys/fs/cgroup")));
            let usable = match (total, own) {
                (Some(t), Some(c)) => Some(t.min(c)),
                (t, c) => t.or(c),
            };
            usable.map_or(DEFAULT_MAX_FILE_READ, default_total_read)
        })
}

/// The total read budget for `usable` bytes of memory: a quarter of it,
/// but at least [`DEFAULT_MAX_FILE_READ`] (one big debug file) or half of
/// it, whichever is less (a 1 GiB container: 512 MiB; 8 GiB: 2 GiB; 64
/// GiB: 16 GiB).
pub fn default_total_read(usable: u64) -> u64 {
    (usable / 4).max(DEFAULT_MAX_FILE_READ.min(usable / 2))
}

/// The least memory limit of a control group and its parents (cgroup v2's
/// `memory.max`, v1's `memory.limit_in_bytes`), for the process whose
/// `/proc/PID/cgroup` text is `membership`, under the hierarchy mounted at
/// `root`; `None` where none is set or none can be read.
fn cgroup_memory_limit(membership: &str, root: &Path) -> Option<u64> {
    let mut least: Option<u64> = None;
    for line in membership.lines() {
        let mut f = line.splitn(3, ':');
        let (Some(_id), Some(controllers), Some(path)) = (f.next(), f.next(), f.next()) else {
            continue;
        };
        let (dir, file) = if controllers.is_empty() {
            (root.to_path_buf(), "memory.max")
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), "memory.limit_in_bytes")
        } else {
            continue;
        };
        // The group and each parent up to the hierarchy's root (a group's
        // limit holds for everything under it). Paths are the kernel's,
        // `..` never among them; at most as deep as they are long.
        let mut at = Some(Path::new(path.trim_end()));
        while let Some(p) = at {
            let here = dir.join(p.strip_prefix("/").unwrap_or(p)).join(file);
            if let Some(v) = std::fs::read_to_string(here)
                .ok()
                .and_then(|v| v.trim().parse::<u64>().ok())
            {
                least = Some(least.map_or(v, |l| l.min(v)));
            }
            at = p.parent();
        }
    }
    least
}

/// The per-file read budget in force (`HEAPDUMP_MAX_FILE_READ`, else
/// [`DEFAULT_MAX_FILE_READ`]).
pub fn max_file_read() -> u64 {
    std::env::var("HEAPDUMP_MAX_FILE_READ")
        .ok()
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_MAX_FILE_READ)
}

fn cstring(path: &Path) -> io::Result<CString> {
    CString::new(path.as_os_str().as_bytes())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte"))
}

fn check(ret: libc::c_int) -> io::Result<OwnedFd> {
    if ret < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `ret` is a descriptor the kernel just returned to us; nothing
    // else owns it.
    Ok(unsafe { OwnedFd::from_raw_fd(ret) })
}

/// `open(path, O_PATH | O_CLOEXEC)`: following the final link (the magic
/// links of `/proc/PID/map_files` and `/proc/PID/fd` are how those files
/// are reached), with no side effect on what it names.
fn open_path(path: &Path) -> io::Result<OwnedFd> {
    let c = cstring(path)?;
    // SAFETY: `c` is a valid NUL-terminated string for the call's duration.
    check(unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_CLOEXEC) })
}

/// What `fd` is, in words, when it is not a regular file.
fn not_regular(mode: libc::mode_t) -> Option<&'static str> {
    match mode & libc::S_IFMT {
        libc::S_IFREG => None,
        libc::S_IFIFO => Some("a FIFO"),
        libc::S_IFCHR => Some("a character device"),
        libc::S_IFBLK => Some("a block device"),
        libc::S_IFSOCK => Some("a socket"),
        libc::S_IFDIR => Some("a directory"),
        libc::S_IFLNK => Some("a symbolic link"),
        _ => Some("not a regular file"),
    }
}

/// `fstat` of a descriptor.
pub fn fstat(fd: &impl AsRawFd) -> io::Result<libc::stat> {
    // SAFETY: an all-zero `stat` is a valid value of the plain C struct.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: `fd` is an open descriptor and `st` a valid place to write.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } < 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(st)
}

/// Reopens an `O_PATH` descriptor for reading if, and only if, it names a
/// regular file.
fn reopen_regular(opath: OwnedFd, shown: &Path) -> io::Result<File> {
    let st = fstat(&opath)?;
    if let Some(what) = not_regular(st.st_mode) {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "{} is {what}, not a regular file: not opened",
                shown.display()
            ),
        ));
    }
    let via = cstring(Path::new(&format!("/proc/self/fd/{}", opath.as_raw_fd())))?;
    // SAFETY: `via` is a valid NUL-terminated string; reopening our own
    // O_PATH descriptor names the inode it holds, which is the regular
    // file just checked (the descriptor pins it).
    let fd = check(unsafe {
        libc::open(
            via.as_ptr(),
            libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY | libc::O_CLOEXEC,
        )
    })?;
    Ok(File::from(fd))
}

/// Opens `path` (a path of heapdump's own, such as a magic link under
/// `/proc/PID/`) for reading only if it is a regular file, with no side
/// effect on anything else: a FIFO swapped in by the target is refused,
/// not waited on, and so is a file on one of the user-space file systems
/// `mounts` (checked before any request could reach its server).
pub fn open_regular(path: &Path, mounts: &UserSpaceMounts) -> io::Result<File> {
    let opath = open_path(path)?;
    mounts.check_fd(&opath, path)?;
    reopen_regular(opath, path)
}

/// The root directory a target's names are resolved in, with the
/// user-space file systems mounted there (never entered, see
/// [`UserSpaceMounts`]).
#[derive(Debug)]
pub struct TargetRoot {
    fd: OwnedFd,
    mounts: UserSpaceMounts,
}

impl TargetRoot {
    /// The root of process `pid` (`/proc/PID/root`), held open: it stays
    /// usable after the process exits.
    pub fn of_process(pid: u32) -> io::Result<TargetRoot> {
        let mut root = Self::open_dir(Path::new(&format!("/proc/{pid}/root")))?;
        root.mounts = UserSpaceMounts::of_process(pid);
        Ok(root)
    }

    /// heapdump's own root (files named by the user, or a snapshot
    /// symbolized later, elsewhere): the same rules on what is opened.
    pub fn own() -> io::Result<TargetRoot> {
        Self::open_dir(Path::new("/"))
    }

    /// The user-space file systems mounted in this root.
    pub fn mounts(&self) -> &UserSpaceMounts {
        &self.mounts
    }

    fn open_dir(path: &Path) -> io::Result<TargetRoot> {
        let c = cstring(path)?;
        // SAFETY: `c` is a valid NUL-terminated string.
        let fd = check(unsafe {
            libc::open(
                c.as_ptr(),
                libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC,
            )
        })?;
        Ok(TargetRoot {
            fd,
            mounts: UserSpaceMounts::none(),
        })
    }

    /// An `O_PATH` descriptor of `path` resolved inside this root
    /// (symbolic links followed inside it, unless `no_symlinks` or a
    /// user-space file system is mounted in it), never on nor through a
    /// user-space file system.
    pub fn resolve(&self, path: &Path, no_symlinks: bool) -> io::Result<OwnedFd> {
        // A root on a detached mount that may be a user-space one (a
        // process chrooted into its FUSE mount, then lazily unmounted):
        // every lookup in it would be a request.
        self.mounts.check_fd(&self.fd, path)?;
        self.mounts.check_path(path)?;
        let fd = self.resolve_unchecked(path, no_symlinks || self.mounts.strict())?;
        self.mounts.check_fd(&fd, path)?;
        Ok(fd)
    }

    fn resolve_unchecked(&self, path: &Path, no_symlinks: bool) -> io::Result<OwnedFd> {
        let mut resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
        if no_symlinks {
            resolve |= libc::RESOLVE_NO_SYMLINKS;
        }
        let c = cstring(path)?;
        // SAFETY: an all-zero `open_how` is valid (no flags, mode 0).
        let mut how: libc::open_how = unsafe { std::mem::zeroed() };
        how.flags = (libc::O_PATH | libc::O_CLOEXEC) as u64;
        how.resolve = resolve;
        // SAFETY: `c` and `how` are valid for the call; the size passed is
        // the struct's.
        let ret = unsafe {
            libc::syscall(
                libc::SYS_openat2,
                self.fd.as_raw_fd(),
                c.as_ptr(),
                &how as *const libc::open_how,
                std::mem::size_of::<libc::open_how>(),
            )
        };
        if ret >= 0 {
            return check(ret as libc::c_int);
        }
        let err = io::Error::last_os_error();
        if err.raw_os_error() == Some(libc::ENOSYS) {
            return self.walk_without_links(path);
        }
        Err(err)
    }

    /// The fallback of [`resolve`](Self::resolve) on kernels without
    /// `openat2`: component by component from the root, `O_NOFOLLOW`
    /// each, no `..`; a symbolic link anywhere is refused (`ELOOP`).
    fn walk_without_links(&self, path: &Path) -> io::Result<OwnedFd> {
        let mut dir: Option<OwnedFd> = None;
        for c in path.components() {
            let name = match c {
                Component::RootDir | Component::CurDir => continue,
                Component::Normal(n) => n,
                _ => {
                    return Err(io::Error::new(
                        io::ErrorKind::InvalidInput,
                        format!("{} has a `..`: not resolved", path.display()),
                    ))
                }
            };
            let at = dir.as_ref().unwrap_or(&self.fd).as_raw_fd();
            let c = CString::new(name.as_bytes()).map_err(|_| {
                io::Error::new(io::ErrorKind::InvalidInput, "a path with a NUL byte")
            })?;
            // SAFETY: `at` is an open directory descriptor, `c` a valid
            // string.
            let fd = check(unsafe {
                libc::openat(
                    at,
                    c.as_ptr(),
                    libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC,
                )
            })?;
            if fstat(&fd)?.st_mode & libc::S_IFMT == libc::S_IFLNK {
                return Err(io::Error::from_raw_os_error(libc::ELOOP));
            }
            dir = Some(fd);
        }
        // A path of the root itself: a descriptor of the root.
        match dir {
            Some(d) => Ok(d),
            None => self.fd.try_clone(),
        }
    }

    /// Opens `path`, resolved inside this root, for reading if it is a
    /// regular file (see the module's rules).
    pub fn open(&self, path: &Path) -> io::Result<File> {
        reopen_regular(self.resolve(path, false)?, path)
    }

    /// Opens `path`, resolved inside this root with no symbolic link
    /// anywhere in it, for reading if it is a regular file owned by one of
    /// `owners`: for a file the target writes in a directory others can
    /// write too (`/tmp/perf-PID.map`), where a link or another user's file
    /// put in its place must not be what root reads.
    pub fn open_owned(&self, path: &Path, owners: &[u32]) -> io::Result<File> {
        let opath = self.resolve(path, true)?;
        let owner = fstat(&opath)?.st_uid;
        if !owners.contains(&owner) {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                format!(
                    "{} belongs to uid {owner}, not to the process: not opened",
                    path.display()
                ),
            ));
        }
        reopen_regular(opath, path)
    }

    /// Whether `path` inside this root is a regular file (resolved as
    /// [`open`](Self::open) would, without opening it).
    pub fn is_file(&self, path: &Path) -> bool {
        self.resolve(path, false)
            .and_then(|fd| fstat(&fd))
            .is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFREG)
    }
}

/// How many bytes may still be read from one file (and, with a
/// [`TotalBudget`], from all the files that share it).
#[derive(Debug)]
pub struct ReadBudget {
    left: Cell<u64>,
    total: Option<TotalBudget>,
}

impl ReadBudget {
    /// A budget of `bytes`.
    pub fn new(bytes: u64) -> Self {
        ReadBudget {
            left: Cell::new(bytes),
            total: None,
        }
    }

    /// Takes `n` bytes from the budget (and from the total it shares, if
    /// any); false (and nothing taken) if they are not there.
    pub fn take(&self, n: u64) -> bool {
        let Some(rest) = self.left.get().checked_sub(n) else {
            return false;
        };
        if self.total.as_ref().is_some_and(|t| !t.take(n)) {
            return false;
        }
        self.left.set(rest);
        true
    }
}

/// Bytes that many files' [`ReadBudget`]s share: what a symbolizer may
/// read of targets' files and keep, all together (its cache keeps what it
/// read; see [`max_total_read`]). Clones share the same count.
///
/// What is kept is given back when it is dropped: charges go to an
/// [`account`](Self::account), one per thing kept (a module with its
/// files), and return to the total when the last clone of that account
/// goes. So a long-running collector that forgets the files of processes
/// it no longer watches can read new ones (library upgrades, new
/// programs) for as long as it runs.
///
/// A [`share`](Self::share) of the total is a smaller count inside it: a
/// charge through the share must fit both, and goes back to both.
#[derive(Debug, Clone)]
pub struct TotalBudget {
    /// The counts a charge is taken from: the total first, then each
    /// share inside it, innermost last.
    counts: Vec<Arc<AtomicU64>>,
    /// Charges refused so far (of the total and all its shares).
    refusals: Arc<AtomicU64>,
    /// Where this clone's charges are counted, to be given back.
    account: Option<Arc<Account>>,
}

/// Charges to a [`TotalBudget`] that go back to it (to each of its
/// counts) when the account (its last clone) is dropped.
#[derive(Debug)]
struct Account {
    counts: Vec<Arc<AtomicU64>>,
    taken: AtomicU64,
}

/// Gives `n` bytes back to `count`. Saturating: a total made with
/// `u64::MAX` ("no limit") never overflows, and nothing is ever given
/// back that was not taken.
fn give(count: &AtomicU64, n: u64) {
    let _ = count.fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| {
        Some(l.saturating_add(n))
    });
}

impl Drop for Account {
    fn drop(&mut self) {
        let taken = *self.taken.get_mut();
        for c in &self.counts {
            give(c, taken);
        }
    }
}

impl TotalBudget {
    /// A total of `bytes`.
    pub fn new(bytes: u64) -> Self {
        TotalBudget {
            counts: vec![Arc::new(AtomicU64::new(bytes))],
            refusals: Arc::new(AtomicU64::new(0)),
            account: None,
        }
    }

    /// A share of at most `bytes` of this budget: charges through it (and
    /// its clones and accounts) are taken from both, so what one user's
    /// targets read cannot take all of a collector's total from another's.
    pub fn share(&self, bytes: u64) -> TotalBudget {
        let mut counts = self.counts.clone();
        counts.push(Arc::new(AtomicU64::new(bytes)));
        TotalBudget {
            counts,
            refusals: self.refusals.clone(),
            account: None,
        }
    }

    /// The same budget, charges made through the result (and its clones)
    /// counted apart and given back when the last of them is dropped.
    pub fn account(&self) -> TotalBudget {
        TotalBudget {
            account: Some(Arc::new(Account {
                counts: self.counts.clone(),
                taken: AtomicU64::new(0),
            })),
            ..self.clone()
        }
    }

    /// Takes `n` bytes from every count; false (nothing taken from any,
    /// and one more of [`Self::refusals`]) if one has not got them.
    pub fn take(&self, n: u64) -> bool {
        for (i, c) in self.counts.iter().enumerate() {
            let ok = c
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| l.checked_sub(n))
                .is_ok();
            if !ok {
                for taken in &self.counts[..i] {
                    give(taken, n);
                }
                self.refusals.fetch_add(1, Ordering::Relaxed);
                return false;
            }
        }
        if let Some(a) = &self.account {
            a.taken.fetch_add(n, Ordering::Relaxed);
        }
        true
    }

    /// Bytes left (the least of its counts).
    pub fn left(&self) -> u64 {
        self.counts
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .min()
            .unwrap_or(0)
    }

    /// Whether nothing is taken from this share now (its own count is
    /// back to `bytes`): a share nobody holds anything of can be dropped.
    pub fn is_untouched(&self, bytes: u64) -> bool {
        self.counts
            .last()
            .is_some_and(|c| c.load(Ordering::Relaxed) == bytes)
    }

    /// Charges refused so far.
    pub fn refusals(&self) -> u64 {
        self.refusals.load(Ordering::Relaxed)
    }
}

impl Default for TotalBudget {
    /// No limit.
    fn default() -> Self {
        TotalBudget::new(u64::MAX)
    }
}

/// A target's file read with `pread` (so a file truncated under us gives
/// short reads, never a fault), its length fixed when opened.
struct PositionedFile {
    file: File,
    len: u64,
    pos: u64,
}

impl ReadCacheOps for PositionedFile {
    fn len(&mut self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn seek(&mut self, pos: u64) -> Result<u64, ()> {
        self.pos = pos;
        Ok(pos)
    }

    fn read(&mut self, buf: &mut [u8]) -> Result<usize, ()> {
        loop {
            match self.file.read_at(buf, self.pos) {
                Ok(n) => {
                    self.pos += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => return Err(()),
            }
        }
    }

    fn read_exact(&mut self, mut buf: &mut [u8]) -> Result<(), ()> {
        while !buf.is_empty() {
            let n = self.read(buf)?;
            if n == 0 {
                // The file shrank since it was opened.
                return Err(());
            }
            buf = &mut buf[n..];
        }
        Ok(())
    }
}

/// A target's file as `object` reads it: pieces read on demand into
/// private memory, each charged to the file's [`ReadBudget`] before
/// anything is allocated for it (a piece read twice is charged once).
pub struct BoundedFile {
    cache: ReadCache<PositionedFile>,
    len: u64,
    budget: ReadBudget,
    charged: RefCell<HashSet<(u64, u64)>>,
}

impl std::fmt::Debug for BoundedFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BoundedFile")
            .field("len", &self.len)
            .finish()
    }
}

impl BoundedFile {
    /// Wraps an open file with a read budget of `budget` bytes.
    pub fn new(file: File, budget: u64) -> io::Result<BoundedFile> {
        let len = fstat(&file)?.st_size.max(0) as u64;
        Ok(BoundedFile {
            cache: ReadCache::new(PositionedFile { file, len, pos: 0 }),
            len,
            budget: ReadBudget::new(budget),
            charged: RefCell::new(HashSet::new()),
        })
    }

    /// [`BoundedFile::new`], every charge also taken from `total`.
    pub fn within(file: File, budget: u64, total: &TotalBudget) -> io::Result<BoundedFile> {
        let mut f = BoundedFile::new(file, budget)?;
        f.budget.total = Some(total.clone());
        Ok(f)
    }

    /// The file's length when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Whether the file was empty when opened.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Charges `n` bytes that `object` will set aside beyond what it reads
    /// (a compressed section's uncompressed size); false if over budget.
    pub fn charge_extra(&self, n: u64) -> bool {
        self.budget.take(n)
    }

    /// What is left of the file's read budget (the less of its own and
    /// the total it shares).
    pub fn budget_left(&self) -> u64 {
        let total = self
            .budget
            .total
            .as_ref()
            .map_or(u64::MAX, TotalBudget::left);
        self.budget.left.get().min(total)
    }

    fn charge(&self, offset: u64, size: u64) -> Result<(), ()> {
        let end = offset.checked_add(size).ok_or(())?;
        if end > self.len {
            return Err(());
        }
        if self.charged.borrow().contains(&(offset, size)) {
            return Ok(());
        }
        if !self.budget.take(size) {
            return Err(());
        }
        self.charged.borrow_mut().insert((offset, size));
        Ok(())
    }
}

impl<'a> ReadRef<'a> for &'a BoundedFile {
    fn len(self) -> Result<u64, ()> {
        Ok(self.len)
    }

    fn read_bytes_at(self, offset: u64, size: u64) -> Result<&'a [u8], ()> {
        if size == 0 {
            return Ok(&[]);
        }
        self.charge(offset, size)?;
        (&self.cache).read_bytes_at(offset, size)
    }

    fn read_bytes_at_until(self, range: Range<u64>, delimiter: u8) -> Result<&'a [u8], ()> {
        // Strings: `ReadCache` reads these in small pieces until the
        // delimiter; charge what came back.
        let found = (&self.cache).read_bytes_at_until(range, delimiter)?;
        if self.budget.take(found.len() as u64 + 1) {
            Ok(found)
        } else {
            Err(())
        }
    }
}

/// Reads the whole of `file` (at most `cap` bytes, else an error) into
/// private memory.
pub fn read_capped(file: &File, cap: u64, shown: &Path) -> io::Result<Vec<u8>> {
    let len = fstat(file)?.st_size.max(0) as u64;
    if len > cap {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{} is {len} bytes, more than the {cap} read from a target's file",
                shown.display()
            ),
        ));
    }
    let mut out = vec![0u8; len as usize];
    let mut done = 0usize;
    while done < out.len() {
        match file.read_at(&mut out[done..], done as u64) {
            Ok(0) => break,
            Ok(n) => done += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    out.truncate(done);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    fn scratch(name: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("heapdump-tf-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    #[test]
    fn fifos_and_devices_are_refused_without_being_opened() {
        let d = scratch("fifo");
        let fifo = d.join("prog.dwp");
        let c = cstring(&fifo).unwrap();
        // SAFETY: a valid path string.
        assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
        // Opening a FIFO for reading with no writer would block for ever;
        // here it is refused at once.
        let e = open_regular(&fifo, &UserSpaceMounts::none()).unwrap_err();
        assert!(e.to_string().contains("a FIFO"), "{e}");
        let root = TargetRoot::own().unwrap();
        assert!(root.open(&fifo).is_err());
        assert!(!root.is_file(&fifo));
        let e = root.open(Path::new("/dev/null")).unwrap_err();
        assert!(e.to_string().contains("character device"), "{e}");
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn absolute_links_resolve_inside_the_root() {
        let d = scratch("root");
        std::fs::create_dir_all(d.join("etc")).unwrap();
        std::fs::write(d.join("etc/hostname"), b"inside").unwrap();
        std::fs::create_dir_all(d.join("app")).unwrap();
        // In the container, /app/link -> /etc/hostname is the container's.
        symlink("/etc/hostname", d.join("app/link")).unwrap();
        symlink("../../../../../../etc/hostname", d.join("app/up")).unwrap();
        let root = TargetRoot::open_dir(&d).unwrap();
        let read = |p: &str| {
            let f = root.open(Path::new(p)).unwrap();
            read_capped(&f, 1 << 20, Path::new(p)).unwrap()
        };
        assert_eq!(read("/app/link"), b"inside");
        assert_eq!(read("/app/up"), b"inside");
        assert!(root.resolve(Path::new("/app/link"), true).is_err());
        assert!(root.walk_without_links(Path::new("/app/link")).is_err());
        assert!(root.walk_without_links(Path::new("/etc/hostname")).is_ok());
        assert!(root.walk_without_links(Path::new("/app/../etc")).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn owned_opens_take_only_the_owners_file_with_no_link_on_the_way() {
        let d = scratch("owned");
        std::fs::create_dir_all(d.join("tmp")).unwrap();
        std::fs::write(d.join("tmp/perf-7.map"), b"1000 10 name\n").unwrap();
        std::fs::write(d.join("secret"), b"2000 10 secret\n").unwrap();
        symlink("/secret", d.join("tmp/perf-8.map")).unwrap();
        let root = TargetRoot::open_dir(&d).unwrap();
        // SAFETY: geteuid has no preconditions.
        let me = unsafe { libc::geteuid() };
        let other = me.wrapping_add(1);
        let f = root
            .open_owned(Path::new("/tmp/perf-7.map"), &[other, me])
            .unwrap();
        assert_eq!(
            read_capped(&f, 1 << 20, Path::new("x")).unwrap(),
            b"1000 10 name\n"
        );
        // Another user's file in its place: refused.
        let e = root
            .open_owned(Path::new("/tmp/perf-7.map"), &[other])
            .unwrap_err();
        assert!(e.to_string().contains("belongs to uid"), "{e}");
        // A link to a file that is the owner's own: refused all the same
        // (`open` follows it).
        assert!(root.open(Path::new("/tmp/perf-8.map")).is_ok());
        assert!(root
            .open_owned(Path::new("/tmp/perf-8.map"), &[me])
            .is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn reads_are_refused_past_the_budget_before_memory_is_taken() {
        let d = scratch("budget");
        let p = d.join("sparse");
        let f = File::create(&p).unwrap();
        // 64 GiB of holes: reading it would cost 64 GiB.
        f.set_len(64 << 30).unwrap();
        drop(f);
        let bf =
            BoundedFile::new(open_regular(&p, &UserSpaceMounts::none()).unwrap(), 1 << 20).unwrap();
        assert_eq!(bf.len(), 64 << 30);
        assert!((&bf).read_bytes_at(0, 32 << 30).is_err());
        assert_eq!((&bf).read_bytes_at(0, 4096).unwrap().len(), 4096);
        // Read again: charged once.
        for _ in 0..1000 {
            assert!((&bf).read_bytes_at(0, 4096).is_ok());
        }
        assert!((&bf).read_bytes_at(4096, 1 << 20).is_err());
        assert!((&bf).read_bytes_at(u64::MAX - 1, 2).is_err());
        let f = open_regular(&p, &UserSpaceMounts::none()).unwrap();
        assert!(read_capped(&f, 1 << 20, &p).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn files_sharing_a_total_are_refused_past_it_and_a_refusal_takes_nothing() {
        let d = scratch("total");
        let p = d.join("sparse");
        File::create(&p).unwrap().set_len(1 << 30).unwrap();
        let open = || open_regular(&p, &UserSpaceMounts::none()).unwrap();
        let total = TotalBudget::new(3 << 20);
        let a = BoundedFile::within(open(), 2 << 20, &total).unwrap();
        let b = BoundedFile::within(open(), 2 << 20, &total).unwrap();
        // Each within its own budget; together past the total.
        assert!((&a).read_bytes_at(0, 2 << 20).is_ok());
        assert_eq!(total.left(), 1 << 20);
        assert_eq!(
            b.budget_left(),
            1 << 20,
            "the less of its own and the total"
        );
        assert!((&b).read_bytes_at(0, 2 << 20).is_err());
        assert_eq!(total.refusals(), 1);
        // The refusal took nothing from either.
        assert_eq!((total.left(), b.budget.left.get()), (1 << 20, 2 << 20));
        assert!((&b).read_bytes_at(0, 1 << 20).is_ok());
        assert!(!b.charge_extra(1));
        assert_eq!(total.refusals(), 2);
        // Its own budget still applies under a larger total.
        let c = BoundedFile::within(open(), 1 << 10, &TotalBudget::default()).unwrap();
        assert!((&c).read_bytes_at(0, 1 << 11).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn the_default_total_follows_the_least_memory_limit_of_heapdumps_cgroups() {
        let d = scratch("cgroup");
        // v2: a container's group under a limited slice; v1: a limit on
        // the memory hierarchy only.
        let v2 = d.join("v2");
        std::fs::create_dir_all(v2.join("slice/app")).unwrap();
        std::fs::write(v2.join("memory.max"), "max\n").unwrap();
        std::fs::write(v2.join("slice/memory.max"), "1073741824\n").unwrap();
        std::fs::write(v2.join("slice/app/memory.max"), "max\n").unwrap();
        assert_eq!(cgroup_memory_limit("0::/slice/app\n", &v2), Some(1 << 30));
        assert_eq!(cgroup_memory_limit("0::/\n", &v2), None);
        let v1 = d.join("v1");
        std::fs::create_dir_all(v1.join("memory/job")).unwrap();
        std::fs::write(
            v1.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        )
        .unwrap();
        std::fs::write(v1.join("memory/job/memory.limit_in_bytes"), "536870912\n").unwrap();
        let membership = "9:name=systemd:/\n5:cpu,cpuacct:/job\n4:memory:/job\n0::/\n";
        assert_eq!(cgroup_memory_limit(membership, &v1), Some(512 << 20));
        // A quarter, at least 2 GiB or half, whichever is less.
        assert_eq!(default_total_read(1 << 30), 512 << 20);
        assert_eq!(default_total_read(8 << 30), 2 << 30);
        assert_eq!(default_total_read(64 << 30), 16 << 30);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn an_accounts_charges_return_to_the_total_when_its_last_clone_is_dropped() {
        let d = scratch("account");
        let p = d.join("sparse");
        File::create(&p).unwrap().set_len(1 << 30).unwrap();
        let open = || open_regular(&p, &UserSpaceMounts::none()).unwrap();
        let total = TotalBudget::new(3 << 20);
        let kept = total.account();
        let a = BoundedFile::within(open(), 2 << 20, &kept).unwrap();
        assert!((&a).read_bytes_at(0, 2 << 20).is_ok());
        // A refusal is charged to nobody.
        let other = total.account();
        let b = BoundedFile::within(open(), 2 << 20, &other).unwrap();
        assert!((&b).read_bytes_at(0, 2 << 20).is_err());
        assert!((&b).read_bytes_at(0, 1 << 19).is_ok());
        assert_eq!(total.left(), 1 << 19);
        // The file goes, its account stays (what it read is kept): no
        // bytes come back yet.
        drop(a);
        assert_eq!(total.left(), 1 << 19);
        drop(kept);
        assert_eq!(total.left(), (2 << 20) + (1 << 19));
        drop((b, other));
        assert_eq!(total.left(), 3 << 20);
        // Charges made on the total itself are kept for good.
        let c = BoundedFile::within(open(), 2 << 20, &total).unwrap();
        assert!((&c).read_bytes_at(0, 1 << 20).is_ok());
        drop(c);
        assert_eq!(total.left(), 2 << 20);
        // A share: charges through it fit both it and the total, and come
        // back to both.
        let total = TotalBudget::new(3 << 20);
        let share = total.share(2 << 20);
        let kept = share.account();
        assert!(kept.take(1 << 20));
        assert!(!kept.take(3 << 19), "past the share, within the total");
        assert_eq!((total.left(), share.left()), (2 << 20, 1 << 20));
        assert!(total.take(3 << 19));
        assert!(!kept.take(1 << 20) && kept.take(1 << 19), "past the total");
        assert_eq!((total.left(), share.left()), (0, 0));
        assert!(!share.is_untouched(2 << 20));
        drop(kept);
        assert_eq!((total.left(), share.left()), (3 << 19, 3 << 19));
        assert!(share.is_untouched(2 << 20));
        // "No limit" stays no limit.
        let unlimited = TotalBudget::default();
        let e = unlimited.account();
        assert!(e.take(1 << 40));
        drop(e);
        assert_eq!(unlimited.left(), u64::MAX);
        std::fs::remove_dir_all(&d).unwrap();
    }

    #[test]
    fn a_file_truncated_after_opening_reads_short_instead_of_faulting() {
        let d = scratch("trunc");
        let p = d.join("lib.so");
        std::fs::write(&p, vec![7u8; 1 << 16]).unwrap();
        let bf =
            BoundedFile::new(open_regular(&p, &UserSpaceMounts::none()).unwrap(), 1 << 30).unwrap();
        File::options()
            .write(true)
            .open(&p)
            .unwrap()
            .set_len(0)
            .unwrap();
        assert!((&bf).read_bytes_at(4096, 4096).is_err());
        std::fs::remove_dir_all(&d).unwrap();
    }
}
