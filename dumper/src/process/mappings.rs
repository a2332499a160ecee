//! A process's mappings, read one at a time, never as one text.
//!
//! `/proc/PID/maps` is the target's to grow: up to `vm.max_map_count`
//! (65 530) lines, each with a path of up to 4 KiB, so 250 MB of text that
//! the kernel formats (escaping every path byte by byte) at every read. A
//! target with 60 000 mappings of a file under a 3.6 KB path made each of
//! a snapshot's three reads take 1.4 s of kernel time and 223 MB of
//! heapdump's memory, and `watch --all` reads every process's mappings at
//! every scan. Here:
//!
//! - On Linux 6.11 and later the kernel is asked for the mappings one at a
//!   time (`PROCMAP_QUERY` on the maps file): it skips, itself, the ones a
//!   reader does not want (anonymous, not shared, not executable; see
//!   [`Wanted`]), and formats no text, only the wanted mappings' paths.
//! - Before, the text is read line by line through a small buffer, so
//!   what heapdump holds is one line, never the whole text.
//!
//! Both give the same [`MapsLine`]s for the same mappings (the path as the
//! maps text shows it: a newline written `\012`, ` (deleted)` after an
//! unlinked file; a path that is not UTF-8 with replacement characters),
//! in address order, and a reader may stop at any mapping.
//!
//! Invariant: every walk is bounded by the process's number of mappings
//! (each query starts past the end of the mapping before it, and a reply
//! that does not move forward ends the walk).

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::ops::ControlFlow;
use std::os::fd::AsRawFd;

use super::maps_lines::MapsLine;

/// Which mappings a reader wants: each `true` is required of a mapping
/// (the kernel filters with them when it is asked one at a time).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Wanted {
    /// Mappings of a file (not anonymous memory, the heap, the stack).
    pub file_backed: bool,
    /// Writable mappings.
    pub writable: bool,
    /// Executable mappings.
    pub executable: bool,
    /// Shared mappings (`s` in the maps text).
    pub shared: bool,
}

impl Wanted {
    /// Whether a mapping passes the filter.
    fn admits(&self, l: &MapsLine<'_>) -> bool {
        let p = l.perms.as_bytes();
        let flag = |i: usize, c: u8| p.get(i) == Some(&c);
        (!self.file_backed || l.inode != 0)
            && (!self.writable || flag(1, b'w'))
            && (!self.executable || flag(2, b'x'))
            && (!self.shared || flag(3, b's'))
    }

    /// The filter as `PROCMAP_QUERY` flags.
    fn query_flags(&self) -> u64 {
        let mut f = query::COVERING_OR_NEXT_VMA;
        if self.file_backed {
            f |= query::FILE_BACKED_VMA;
        }
        if self.writable {
            f |= query::VMA_WRITABLE;
        }
        if self.executable {
            f |= query::VMA_EXECUTABLE;
        }
        if self.shared {
            f |= query::VMA_SHARED;
        }
        f
    }
}

/// Calls `each` with every mapping of process `pid` that `wanted` admits,
/// in address order, until it returns `Break`. The error is the opening
/// of `/proc/PID/maps` (a process that is gone, or not ours to read) or a
/// read of it failing.
pub fn for_each(
    pid: u32,
    wanted: Wanted,
    each: impl FnMut(&MapsLine<'_>) -> ControlFlow<()>,
) -> io::Result<()> {
    let file = File::open(format!("/proc/{pid}/maps"))?;
    for_each_in(&file, wanted, each, true)
}

/// [`for_each`] on an open maps file; `ask_kernel` false reads the text
/// even where the kernel could be asked (tests compare the two).
fn for_each_in(
    file: &File,
    wanted: Wanted,
    mut each: impl FnMut(&MapsLine<'_>) -> ControlFlow<()>,
    ask_kernel: bool,
) -> io::Result<()> {
    if ask_kernel {
        match query::walk(file, wanted, &mut each) {
            // Before 6.11 (ENOTTY), or under an emulator that does not pass
            // the question on (qemu-user): the text, from its start.
            Err(query::Unanswered) => {}
            Ok(done) => return done,
        }
    }
    let mut reader = BufReader::with_capacity(64 << 10, file);
    let mut line = Vec::with_capacity(256);
    loop {
        line.clear();
        if reader.read_until(b'\n', &mut line)? == 0 {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&line);
        let Some(l) = MapsLine::parse(text.trim_end_matches('\n')) else {
            continue;
        };
        if wanted.admits(&l) && each(&l).is_break() {
            return Ok(());
        }
    }
}

/// `PROCMAP_QUERY` (Linux 6.11, `include/uapi/linux/fs.h`).
mod query {
    use super::*;

    pub const VMA_READABLE: u64 = 0x01;
    pub const VMA_WRITABLE: u64 = 0x02;
    pub const VMA_EXECUTABLE: u64 = 0x04;
    pub const VMA_SHARED: u64 = 0x08;
    pub const COVERING_OR_NEXT_VMA: u64 = 0x10;
    pub const FILE_BACKED_VMA: u64 = 0x20;

    /// `struct procmap_query`.
    #[repr(C)]
    #[derive(Default)]
    struct ProcmapQuery {
        size: u64,
        query_flags: u64,
        query_addr: u64,
        vma_start: u64,
        vma_end: u64,
        vma_flags: u64,
        vma_page_size: u64,
        vma_offset: u64,
        inode: u64,
        dev_major: u32,
        dev_minor: u32,
        vma_name_size: u32,
        build_id_size: u32,
        vma_name_addr: u64,
        build_id_addr: u64,
    }

    /// `_IOWR('f', 17, struct procmap_query)`.
    const PROCMAP_QUERY: u64 = 0xC000_0000 | ((size_of::<ProcmapQuery>() as u64) << 16) | 0x6611;
    const _: () = assert!(PROCMAP_QUERY == 0xC068_6611);

    /// A path's room: the kernel's `d_path` gives at most `PATH_MAX`
    /// (4 096) bytes with its NUL, ` (deleted)` included.
    const NAME_ROOM: usize = 4096 + 64;

    /// The first question found no answer but "no such mapping": nothing
    /// was passed to the reader, which may read the text instead.
    #[derive(Debug)]
    pub struct Unanswered;

    /// Asks for every wanted mapping in turn: `Err(Unanswered)` when the
    /// first question fails (a kernel without `PROCMAP_QUERY` answers
    /// ENOTTY), else how the walk ended.
    pub fn walk(
        file: &File,
        wanted: Wanted,
        each: &mut impl FnMut(&MapsLine<'_>) -> ControlFlow<()>,
    ) -> Result<io::Result<()>, Unanswered> {
        let mut first = true;
        let r = walk_from(file, wanted, &mut |l| {
            first = false;
            each(l)
        });
        match r {
            Err(e) if first && e.raw_os_error() != Some(libc::ENOENT) => Err(Unanswered),
            r => Ok(r),
        }
    }

    fn walk_from(
        file: &File,
        wanted: Wanted,
        each: &mut impl FnMut(&MapsLine<'_>) -> ControlFlow<()>,
    ) -> io::Result<()> {
        let mut name = vec![0u8; NAME_ROOM];
        let mut addr = 0u64;
        loop {
            let q = match ask(file, wanted, addr, Some(&mut name)) {
                Ok(Some(q)) => q,
                // No mapping past `addr` is wanted.
                Ok(None) => return Ok(()),
                // A path longer than the room: nothing is named so; the
                // mapping is passed over (asked for again without its
                // name, for its end).
                Err(e) if e.raw_os_error() == Some(libc::ENAMETOOLONG) => {
                    match ask(file, wanted, addr, None)? {
                        Some(q) if q.vma_end > addr => {
                            addr = q.vma_end;
                            continue;
                        }
                        _ => return Ok(()),
                    }
                }
                Err(e) => return Err(e),
            };
            if q.vma_end <= addr || q.vma_start >= q.vma_end {
                return Ok(()); // not forward: ends the walk (invariant)
            }
            let flag = |bit: u64, set: u8, unset: u8| {
                if q.vma_flags & bit != 0 {
                    set
                } else {
                    unset
                }
            };
            let perms = [
                flag(VMA_READABLE, b'r', b'-'),
                flag(VMA_WRITABLE, b'w', b'-'),
                flag(VMA_EXECUTABLE, b'x', b'-'),
                flag(VMA_SHARED, b's', b'p'),
            ];
            // The size counts the NUL; 0 when the mapping has no name.
            let len = (q.vma_name_size as usize).saturating_sub(1).min(name.len());
            let path = shown_path(&name[..len]);
            let line = MapsLine {
                start: q.vma_start,
                end: q.vma_end,
                perms: std::str::from_utf8(&perms).unwrap_or("----"),
                offset: q.vma_offset,
                dev: (q.dev_major, q.dev_minor),
                inode: q.inode,
                path: &path,
            };
            if each(&line).is_break() {
                return Ok(());
            }
            addr = q.vma_end;
        }
    }

    /// One question: the first wanted mapping at or after `addr`, its path
    /// written into `name` when given; `None` when there is none.
    fn ask(
        file: &File,
        wanted: Wanted,
        addr: u64,
        name: Option<&mut [u8]>,
    ) -> io::Result<Option<ProcmapQuery>> {
        let (name_addr, name_size) = name.map_or((0, 0), |n| (n.as_mut_ptr() as u64, n.len()));
        let mut q = ProcmapQuery {
            size: size_of::<ProcmapQuery>() as u64,
            query_flags: wanted.query_flags(),
            query_addr: addr,
            vma_name_size: name_size as u32,
            vma_name_addr: name_addr,
            ..ProcmapQuery::default()
        };
        // SAFETY: `q` is a valid `struct procmap_query` whose `size` says
        // so; the kernel writes at most `vma_name_size` bytes at
        // `vma_name_addr`, which is 0 (no name asked) or points at `name`,
        // borrowed mutably, alive and that long for the call's duration;
        // no build ID is asked for (size 0, address 0). A kernel without
        // the ioctl answers ENOTTY.
        let r = unsafe { libc::ioctl(file.as_raw_fd(), PROCMAP_QUERY as _, &mut q) };
        if r < 0 {
            let e = io::Error::last_os_error();
            return match e.raw_os_error() {
                Some(libc::ENOENT) => Ok(None),
                _ => Err(e),
            };
        }
        Ok(Some(q))
    }

    /// A path as the maps text shows it: a newline as `\012` (the only
    /// byte the kernel escapes there), bytes that are not UTF-8 replaced.
    fn shown_path(raw: &[u8]) -> String {
        String::from_utf8_lossy(raw).replace('\n', "\\012")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every mapping `wanted` admits, as owned lines, asked of the kernel
    /// (`None` on a kernel before 6.11) and read from the text.
    fn both_ways(pid: u32, wanted: Wanted) -> (Option<Vec<String>>, Vec<String>) {
        let file = File::open(format!("/proc/{pid}/maps")).unwrap();
        let keep = |out: &mut Vec<String>, l: &MapsLine<'_>| {
            out.push(format!(
                "{:x}-{:x} {} {:x} {:x}:{:x} {} {}",
                l.start, l.end, l.perms, l.offset, l.dev.0, l.dev.1, l.inode, l.path
            ));
            ControlFlow::Continue(())
        };
        let mut asked = Vec::new();
        let asked = match query::walk(&file, wanted, &mut |l| keep(&mut asked, l)) {
            Err(query::Unanswered) => None,
            Ok(r) => {
                r.unwrap();
                Some(asked)
            }
        };
        let mut read = Vec::new();
        for_each_in(&file, wanted, |l| keep(&mut read, l), false).unwrap();
        (asked, read)
    }

    #[test]
    fn the_kernels_answers_and_the_text_name_the_same_mappings() {
        // A file of our own mapped shared and writable, under a name with a
        // newline and a space, then unlinked; and one mapped executable.
        let dir = std::env::temp_dir().join(format!("heapdump-mappings-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("odd\nname x");
        std::fs::write(&p, vec![0u8; 8192]).unwrap();
        let f = File::options().read(true).write(true).open(&p).unwrap();
        // SAFETY: a fresh shared mapping of a file we own, unmapped below.
        let at = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                8192,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED,
                f.as_raw_fd(),
                0,
            )
        };
        assert_ne!(at, libc::MAP_FAILED);
        std::fs::remove_file(&p).unwrap();
        let me = std::process::id();
        let shared = Wanted {
            file_backed: true,
            writable: true,
            shared: true,
            ..Wanted::default()
        };
        for wanted in [
            Wanted::default(),
            shared,
            Wanted {
                file_backed: true,
                executable: true,
                ..Wanted::default()
            },
        ] {
            let (asked, read) = both_ways(me, wanted);
            // The test's own threads may map or unmap between the two
            // readings; the files' mappings stay.
            let files = |v: &[String]| -> Vec<String> {
                v.iter().filter(|l| l.contains(" /")).cloned().collect()
            };
            assert!(!files(&read).is_empty());
            match asked {
                Some(asked) => assert_eq!(files(&asked), files(&read), "{wanted:?}"),
                None => eprintln!("no PROCMAP_QUERY here (Linux before 6.11): text only"),
            }
        }
        // The main thread's stack by its pseudo-name (attach knows it so),
        // both ways; its start moves as it grows, not its end.
        let (asked, read) = both_ways(me, Wanted::default());
        let stack = |v: &[String]| -> Vec<String> {
            v.iter()
                .filter(|l| l.ends_with(" [stack]"))
                .map(|l| l.split_once('-').unwrap().1.to_string())
                .collect()
        };
        assert_eq!(stack(&read).len(), 1, "{read:?}");
        if let Some(asked) = asked {
            assert_eq!(stack(&asked), stack(&read));
        }
        let (asked, read) = both_ways(me, shared);
        let ours = format!("{:x}-", at as u64);
        for lines in asked.iter().chain([&read]) {
            let line = lines.iter().find(|l| l.starts_with(&ours)).unwrap();
            assert!(
                line.contains(" rw-s ") && line.ends_with("/odd\\012name x (deleted)"),
                "{line}"
            );
        }
        // A reader that stops is not asked again.
        let mut calls = 0;
        for_each(me, Wanted::default(), |_| {
            calls += 1;
            ControlFlow::Break(())
        })
        .unwrap();
        assert_eq!(calls, 1);
        // SAFETY: the mapping made above.
        unsafe { libc::munmap(at, 8192) };
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_process_that_is_not_there_is_an_error() {
        let e = for_each(u32::MAX - 1, Wanted::default(), |_| {
            ControlFlow::Continue(())
        });
        assert_eq!(e.unwrap_err().kind(), io::ErrorKind::NotFound);
    }
}
