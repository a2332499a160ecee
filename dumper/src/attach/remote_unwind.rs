//! Unwinding a stopped thread of another process from outside: its call
//! chain, from the registers `ptrace` gives and the stack words
//! `/proc/PID/mem` gives, with the call-frame information (`.eh_frame`) of
//! the files it has mapped, read from disk.
//!
//! Used to choose the thread `heapdump attach` runs `dlopen` in: every
//! frame of its chain must be outside the allocator and the loader
//! ([`crate::attach::safe_point`]).
//!
//! Invariants:
//! - Every read of the target's memory goes through [`Memory`], which
//!   answers `None` for an address it cannot read; nothing here trusts a
//!   value read from the target beyond using it as the next address to
//!   read or look up.
//! - Every walk is bounded: at most [`MAX_FRAMES`] frames, each step must
//!   move the stack pointer up (except across a signal frame, whose saved
//!   registers are taken as they are, at most [`MAX_SIGNAL_FRAMES`] times).
//! - A walk that cannot go on with certainty (no CFI for a counter, a rule
//!   this code does not evaluate, an unreadable word) says so
//!   ([`Walk::complete`] false) and where the unknown part of the stack
//!   starts, so the caller can treat every word above as a possible return
//!   address.

use std::collections::HashMap;
use std::sync::Arc;

use gimli::{
    BaseAddresses, CfaRule, EhFrame, EhFrameHdr, EhFrameOffset, LittleEndian, Pointer,
    RegisterRule, UnwindContext, UnwindSection, X86_64,
};
use object::{Object, ObjectSection, ObjectSegment, ObjectSymbol, SymbolKind};

use crate::process::user_space_mounts::UserSpaceMounts;
use crate::symbolization::maps::Mapping;

/// Most frames followed in one walk.
pub const MAX_FRAMES: usize = 512;
/// Most signal frames crossed in one walk.
pub const MAX_SIGNAL_FRAMES: usize = 8;

/// The target's memory, through `/proc/PID/mem` (readable by its tracer).
///
/// Never touches a page of a file on a user-space file system (FUSE): a
/// page the target never touched is read from the file's server when we
/// touch it, and a server that does not answer would hold heapdump in
/// uninterruptible sleep (see `process::user_space_mounts`). Such
/// mappings, as the target's maps showed them last ([`Memory::refresh`]),
/// are neither read nor written: to this code they are unreadable.
pub struct Memory {
    access: crate::attach::memory_access::MemoryAccess,
    /// Pages read while a judgement runs ([`Memory::judging`]), by page
    /// address (`None`: could not be read); `None` outside one.
    pages: std::cell::RefCell<Option<PageCache>>,
    mounts: UserSpaceMounts,
    /// Address ranges mapped from files on user-space file systems.
    served: Vec<(u64, u64)>,
}

/// The target's mappings as an attach round needs them: each one's range
/// (and whether it is the main thread's growable `[stack]`), and those
/// mapped from files on user-space file systems.
///
/// Read a mapping at a time ([`crate::process::mappings`]), never as the
/// whole maps text: the target decides how long that text is (up to
/// `vm.max_map_count` lines of 4 KiB paths, 250 MB that the kernel formats
/// at every read), and attach reads the mappings again at each of its up
/// to 40 rounds. What is kept is 24 bytes a mapping.
#[derive(Debug, Default)]
pub struct TargetMappings {
    /// (start, end, is the `[stack]`), in address order.
    ranges: Vec<(u64, u64, bool)>,
    /// Ranges mapped from files on the user-space file systems.
    served: Vec<(u64, u64)>,
}

impl TargetMappings {
    /// The mappings of process `pid` now; `mounts` are its user-space file
    /// systems. The error is the maps file's (a process that is gone).
    pub fn read(pid: u32, mounts: &UserSpaceMounts) -> std::io::Result<TargetMappings> {
        let mut m = TargetMappings::default();
        crate::process::mappings::for_each(
            pid,
            crate::process::mappings::Wanted::default(),
            |l| {
                m.add(l, mounts);
                std::ops::ControlFlow::Continue(())
            },
        )?;
        Ok(m)
    }

    fn add(&mut self, l: &crate::process::maps_lines::MapsLine<'_>, mounts: &UserSpaceMounts) {
        self.ranges.push((l.start, l.end, l.path == "[stack]"));
        if l.inode != 0 && mounts.has_device(l.dev) {
            self.served.push((l.start, l.end));
        }
    }

    /// The mapping holding `addr`: (start, end, whether it is the main
    /// thread's growable `[stack]`).
    pub fn holding(&self, addr: u64) -> Option<(u64, u64, bool)> {
        let i = self.ranges.partition_point(|&(_, end, _)| end <= addr);
        self.ranges
            .get(i)
            .copied()
            .filter(|&(start, end, _)| (start..end).contains(&addr))
    }
}

/// Pages of the target's memory by address, `None` where unreadable.
type PageCache = HashMap<u64, Option<Box<[u8]>>>;

impl Memory {
    /// Opens `/proc/PID/mem` for reading and writing (writing only works
    /// while the process is traced by us), read and written by a helper
    /// process under a deadline.
    pub fn open(pid: u32) -> std::io::Result<Memory> {
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .open(format!("/proc/{pid}/mem"))?;
        let mut mem = Memory {
            access: crate::attach::memory_access::MemoryAccess::start(file)?,
            pages: Default::default(),
            mounts: UserSpaceMounts::of_process(pid),
            served: Vec::new(),
        };
        if let Ok(maps) = TargetMappings::read(pid, &mem.mounts) {
            mem.refresh(&maps);
        }
        Ok(mem)
    }

    /// The target's user-space file systems (to read its mappings with).
    pub fn mounts(&self) -> &UserSpaceMounts {
        &self.mounts
    }

    /// Takes the target's mappings anew.
    pub fn refresh(&mut self, maps: &TargetMappings) {
        self.served.clone_from(&maps.served);
    }

    /// Whether `[addr, addr + len)` touches no mapping of a file on a
    /// user-space file system.
    fn touchable(&self, addr: u64, len: usize) -> bool {
        let end = addr.saturating_add(len as u64);
        !self.served.iter().any(|&(s, e)| addr < e && end > s)
    }

    /// Whether an access outlived its deadline (see
    /// [`crate::attach::memory_access`]): nothing can be read or written
    /// any more.
    pub fn stalled(&self) -> bool {
        self.access.stalled()
    }

    /// Runs `judge`, a judgement of a held thread that only reads, with
    /// the pages it reads kept: each page is fetched from the helper once
    /// (a walk reads words one by one, and each fetch is a round trip to
    /// another process), and the judgement sees each page as it was at
    /// its first read. Nothing is kept past it: the target runs after.
    pub fn judging<T>(&self, judge: impl FnOnce(&Self) -> T) -> T {
        *self.pages.borrow_mut() = Some(HashMap::new());
        let verdict = judge(self);
        *self.pages.borrow_mut() = None;
        verdict
    }

    /// Reads `buf.len()` bytes at `addr`; false if any could not be read.
    pub fn read(&self, addr: u64, buf: &mut [u8]) -> bool {
        if !self.touchable(addr, buf.len()) {
            return false;
        }
        let mut pages = self.pages.borrow_mut();
        let Some(pages) = pages.as_mut() else {
            return matches!(self.access.read_at(buf, addr), Some(n) if n == buf.len());
        };
        const PAGE: u64 = 4096;
        let mut done = 0;
        while done < buf.len() {
            let at = addr.wrapping_add(done as u64);
            let page = at & !(PAGE - 1);
            let bytes = pages.entry(page).or_insert_with(|| {
                let mut b = vec![0u8; PAGE as usize].into_boxed_slice();
                // A mapping is whole pages: the page is readable whole or
                // not at all (and on no user-space file system if `addr`'s
                // bytes are not, checked above).
                matches!(self.access.read_at(&mut b, page), Some(n) if n == b.len()).then_some(b)
            });
            let Some(bytes) = bytes else {
                return false;
            };
            let off = (at - page) as usize;
            let n = (buf.len() - done).min(PAGE as usize - off);
            buf[done..done + n].copy_from_slice(&bytes[off..off + n]);
            done += n;
        }
        true
    }

    /// The 8-byte word at `addr`.
    pub fn read_u64(&self, addr: u64) -> Option<u64> {
        let mut b = [0u8; 8];
        self.read(addr, &mut b).then(|| u64::from_le_bytes(b))
    }

    /// Writes `bytes` at `addr` (the target must be stopped by us).
    pub fn write(&self, addr: u64, bytes: &[u8]) -> std::io::Result<()> {
        if !self.touchable(addr, bytes.len()) {
            return Err(std::io::Error::other(
                "the place is mapped from a file on a user-space file system: not written",
            ));
        }
        let Some(n) = self.access.write_at(bytes, addr) else {
            return Err(std::io::Error::other(if self.stalled() {
                "reading or writing the target's memory stalled"
            } else {
                "the target's memory could not be written there"
            }));
        };
        if n != bytes.len() {
            return Err(std::io::Error::other("short write to the target's memory"));
        }
        Ok(())
    }
}

/// A function symbol of a module: file virtual addresses `[start, end)`.
#[derive(Clone, Debug)]
pub struct Func {
    /// First address (file virtual address).
    pub start: u64,
    /// One past the last.
    pub end: u64,
    /// The symbol's name.
    pub name: String,
}

/// What is read once from a mapped file: its CFI sections and function
/// symbols.
pub struct ModuleFile {
    data: Vec<u8>,
    /// `.eh_frame_hdr`: file virtual address and byte range in `data`.
    eh_frame_hdr: Option<(u64, std::ops::Range<usize>)>,
    /// `.eh_frame`: file virtual address and byte range in `data`.
    eh_frame: Option<(u64, std::ops::Range<usize>)>,
    /// `PT_LOAD` segments: (virtual address, file offset, file size).
    loads: Vec<(u64, u64, u64)>,
    /// Function symbols (`.symtab` and `.dynsym`), by start address.
    pub funcs: Vec<Func>,
}

impl ModuleFile {
    /// Reads the whole file into private memory, within the read budget
    /// of a target's file (see [`crate::process::target_files`]).
    pub fn read(local: &crate::symbolization::maps::LocalFile) -> Option<ModuleFile> {
        use crate::process::target_files;
        let file = local.open().ok()?;
        let data = target_files::read_capped(
            &file,
            target_files::max_file_read(),
            std::path::Path::new(&local.key()),
        )
        .ok()?;
        let (eh_frame_hdr, eh_frame, loads, mut funcs) = {
            let obj = object::File::parse(&*data).ok()?;
            let section = |name: &str| {
                let s = obj.section_by_name(name)?;
                let (off, size) = s.file_range()?;
                let (off, size) = (off as usize, size as usize);
                (off.checked_add(size)? <= data.len()).then_some((s.address(), off..off + size))
            };
            let loads = obj
                .segments()
                .map(|s| {
                    let (off, size) = s.file_range();
                    (s.address(), off, size)
                })
                .collect::<Vec<_>>();
            let mut funcs = Vec::new();
            for sym in obj.symbols().chain(obj.dynamic_symbols()) {
                if sym.kind() == SymbolKind::Text && sym.is_definition() && sym.address() != 0 {
                    if let Ok(name) = sym.name() {
                        funcs.push(Func {
                            start: sym.address(),
                            end: sym.address().saturating_add(sym.size().max(1)),
                            name: name.to_string(),
                        });
                    }
                }
            }
            (section(".eh_frame_hdr"), section(".eh_frame"), loads, funcs)
        };
        funcs.sort_by_key(|f| f.start);
        funcs.dedup_by(|a, b| a.start == b.start && a.name == b.name);
        Some(ModuleFile {
            data,
            eh_frame_hdr,
            eh_frame,
            loads,
            funcs,
        })
    }

    /// The load bias of a mapping of this file: runtime address minus file
    /// virtual address.
    pub fn bias(&self, m: &Mapping) -> Option<u64> {
        let (vaddr, off, _) = self
            .loads
            .iter()
            .find(|(_, off, size)| (*off..off.saturating_add(*size.max(&1))).contains(&m.offset))?;
        Some(m.start.wrapping_sub(vaddr.wrapping_add(m.offset - off)))
    }
}

/// One step's rule for a counter, as far as this unwinder evaluates it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Rule {
    /// CFA = register (rsp or rbp) + offset; return address at CFA +
    /// `ra`; the caller's rbp at CFA + offset, or unchanged.
    Frame {
        cfa_rbp: bool,
        cfa_off: i64,
        ra: i64,
        rbp: Option<i64>,
    },
    /// The outermost frame: the return address is undefined.
    Outermost,
    /// A signal trampoline (`__restore_rt`): the interrupted registers are
    /// in the `ucontext_t` at the stack pointer.
    Signal,
}

impl ModuleFile {
    /// The rule for file virtual address `addr`, if the CFI gives one this
    /// unwinder evaluates.
    /// Evaluates the CFI rule of `addr` and reports only whether there is
    /// one (fuzzing: any bytes read as a module must never crash or hang).
    #[doc(hidden)]
    pub fn has_rule(&self, addr: u64) -> bool {
        self.rule(addr).is_some()
    }

    fn rule(&self, addr: u64) -> Option<Rule> {
        let (hdr_addr, hdr_range) = self.eh_frame_hdr.clone()?;
        let (eh_addr, eh_range) = self.eh_frame.clone()?;
        let bases = BaseAddresses::default()
            .set_eh_frame_hdr(hdr_addr)
            .set_eh_frame(eh_addr);
        let hdr = EhFrameHdr::new(&self.data[hdr_range], LittleEndian)
            .parse(&bases, 8)
            .ok()?;
        if !matches!(hdr.eh_frame_ptr(), Pointer::Direct(a) if a == eh_addr) {
            return None;
        }
        let eh_frame = EhFrame::new(&self.data[eh_range], LittleEndian);
        let table = hdr.table()?;
        // gimli's `fde_for_address` subtracts the section's address from
        // the table's pointer unchecked (a panic with overflow checks on
        // a hostile table, found by fuzzing): the pointer is checked here.
        let Pointer::Direct(fde_at) = table.lookup(addr, &bases).ok()? else {
            return None;
        };
        let offset = usize::try_from(fde_at.checked_sub(eh_addr)?).ok()?;
        let fde = eh_frame
            .fde_from_offset(&bases, EhFrameOffset(offset), EhFrame::cie_from_offset)
            .ok()?;
        if !fde.contains(addr) {
            return None;
        }
        if fde.is_signal_trampoline() {
            return Some(Rule::Signal);
        }
        let mut ctx: Box<UnwindContext<usize>> = Box::new(UnwindContext::new());
        let row = fde
            .unwind_info_for_address(&eh_frame, &bases, &mut ctx, addr)
            .ok()?;
        let ra = match row.register(X86_64::RA) {
            RegisterRule::Offset(o) => o,
            RegisterRule::Undefined => return Some(Rule::Outermost),
            _ => return None,
        };
        let rbp = match row.register(X86_64::RBP) {
            RegisterRule::Offset(o) => Some(o),
            RegisterRule::Undefined | RegisterRule::SameValue => None,
            _ => return None,
        };
        match row.cfa() {
            CfaRule::RegisterAndOffset { register, offset }
                if *register == X86_64::RSP || *register == X86_64::RBP =>
            {
                Some(Rule::Frame {
                    cfa_rbp: *register == X86_64::RBP,
                    cfa_off: *offset,
                    ra,
                    rbp,
                })
            }
            _ => None,
        }
    }
}

/// A counter's file and its file virtual address.
pub type Located = (Arc<ModuleFile>, u64);

/// The target's executable mappings and the files behind them, read once
/// per attach.
pub struct Modules {
    /// Executable, file-backed mappings.
    pub maps: Vec<Mapping>,
    files: HashMap<Arc<str>, Option<Arc<ModuleFile>>>,
}

impl Modules {
    /// The executable mappings of `pid`.
    pub fn of(pid: u32) -> std::io::Result<Modules> {
        let mut ids = crate::symbolization::maps::BuildIds::default();
        Ok(Modules {
            maps: crate::symbolization::maps::read_maps(pid, &mut ids)?,
            files: HashMap::new(),
        })
    }

    /// The mapping holding `pc`, its file (if readable) and the file
    /// virtual address of `pc`.
    pub fn locate(&mut self, pc: u64) -> Option<(Mapping, Option<Located>)> {
        let m = crate::symbolization::maps::find(&self.maps, pc)?.clone();
        let file = self.file(&m);
        let located = file.and_then(|f| {
            let bias = f.bias(&m)?;
            Some((f, pc.wrapping_sub(bias)))
        });
        Some((m, located))
    }

    /// Reads and parses the file of every executable mapping now. The
    /// injector calls it before it stops any thread: a thread held while
    /// a big executable (node's 90 MB) is read and parsed was stopped for a
    /// quarter of a second.
    pub fn read_all(&mut self) {
        for m in self.maps.clone() {
            self.file(&m);
        }
    }

    /// The parsed file behind a mapping, cached by path.
    pub fn file(&mut self, m: &Mapping) -> Option<Arc<ModuleFile>> {
        self.files
            .entry(m.path.clone())
            .or_insert_with(|| m.local.as_ref().and_then(ModuleFile::read).map(Arc::new))
            .clone()
    }
}

/// A thread's registers as the walk needs them.
#[derive(Clone, Copy, Debug)]
pub struct Regs {
    /// Program counter.
    pub rip: u64,
    /// Stack pointer.
    pub rsp: u64,
    /// Frame pointer register.
    pub rbp: u64,
}

/// The chain found by a walk.
#[derive(Clone, Debug, Default)]
pub struct Walk {
    /// Program counters, innermost first (return addresses after the
    /// first, and the interrupted counter after each signal frame).
    pub pcs: Vec<u64>,
    /// Signal frames crossed.
    pub signal_frames: usize,
    /// True when the walk reached the outermost frame; false when it had
    /// to stop (see `unknown_from`).
    pub complete: bool,
    /// Where the part of the stack the walk could not explain starts (its
    /// stack pointer there), when it is not complete.
    pub unknown_from: Option<u64>,
    /// Why the walk stopped short.
    pub stopped: Option<&'static str>,
}

/// `__restore_rt` on x86_64: `mov $15, %rax; syscall`.
const RESTORE_RT: [u8; 9] = [0x48, 0xc7, 0xc0, 0x0f, 0x00, 0x00, 0x00, 0x0f, 0x05];
/// Offsets in the `ucontext_t` a signal frame's stack pointer points at:
/// `uc_mcontext.gregs` starts at byte 40; `REG_RBP` is 10, `REG_RSP` 15,
/// `REG_RIP` 16.
const UC_GREGS: u64 = 40;

/// Walks the chain of a thread stopped with `regs`.
pub fn walk(mem: &Memory, modules: &mut Modules, regs: Regs) -> Walk {
    let mut w = Walk::default();
    let (mut pc, mut sp, mut bp) = (regs.rip, regs.rsp, regs.rbp);
    // The first counter, and one restored from a signal frame, is where
    // the thread is, not a return address: look it up as it is.
    let mut exact = true;
    let stop = |w: &mut Walk, sp: u64, why: &'static str| {
        w.unknown_from = Some(sp);
        w.stopped = Some(why);
    };
    while w.pcs.len() < MAX_FRAMES {
        w.pcs.push(pc);
        let mut code = [0u8; 9];
        let at_restorer = mem.read(pc, &mut code) && code == RESTORE_RT;
        let rule = if at_restorer {
            Some(Rule::Signal)
        } else {
            match modules.locate(pc) {
                None => {
                    stop(
                        &mut w,
                        sp,
                        "a counter outside every mapped file (JIT code?)",
                    );
                    return w;
                }
                Some((_, None)) => {
                    stop(&mut w, sp, "a mapped file that cannot be read");
                    return w;
                }
                Some((_, Some((file, addr)))) => {
                    file.rule(if exact { addr } else { addr.wrapping_sub(1) })
                }
            }
        };
        let Some(rule) = rule else {
            stop(
                &mut w,
                sp,
                "no call-frame information this unwinder evaluates",
            );
            return w;
        };
        match rule {
            Rule::Outermost => {
                w.complete = true;
                return w;
            }
            Rule::Signal => {
                if w.signal_frames >= MAX_SIGNAL_FRAMES {
                    stop(&mut w, sp, "too many nested signal frames");
                    return w;
                }
                let greg = |i: u64| mem.read_u64(sp.wrapping_add(UC_GREGS + i * 8));
                let (Some(rbp), Some(rsp), Some(rip)) = (greg(10), greg(15), greg(16)) else {
                    stop(&mut w, sp, "an unreadable signal frame");
                    return w;
                };
                w.signal_frames += 1;
                (pc, sp, bp) = (rip, rsp, rbp);
                exact = true;
            }
            Rule::Frame {
                cfa_rbp,
                cfa_off,
                ra,
                rbp,
            } => {
                let cfa = (if cfa_rbp { bp } else { sp }).wrapping_add(cfa_off as u64);
                let Some(ret) = mem.read_u64(cfa.wrapping_add(ra as u64)) else {
                    stop(&mut w, sp, "an unreadable return address");
                    return w;
                };
                if let Some(off) = rbp {
                    match mem.read_u64(cfa.wrapping_add(off as u64)) {
                        Some(v) => bp = v,
                        None => {
                            stop(&mut w, sp, "an unreadable saved rbp");
                            return w;
                        }
                    }
                }
                if ret == 0 {
                    w.complete = true;
                    return w;
                }
                if cfa <= sp {
                    stop(&mut w, sp, "a frame that does not move up the stack");
                    return w;
                }
                (pc, sp) = (ret, cfa);
                exact = false;
            }
        }
    }
    stop(&mut w, sp, "too many frames");
    w
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mappings_of_files_on_user_space_file_systems_are_not_touched() {
        let mounts = UserSpaceMounts::from_mountinfo(
            "40 22 0:45 / /home/eve/mnt rw - fuse.sshfs eve@h: rw,allow_other\n",
        );
        // The device is hex in maps, decimal in mountinfo.
        let maps = "\
7f0000000000-7f0000100000 rw-p 00000000 00:2d 77 /home/eve/mnt/stack.bin
7f0000100000-7f0000200000 rw-p 00000000 00:00 0 [stack]
7f0000200000-7f0000300000 r-xp 00000000 08:01 12 /usr/lib/libc.so.6
7f0000300000-7f0000400000 rw-p 00000000 00:2d 0
";
        let of = |mounts: &UserSpaceMounts| {
            let mut m = TargetMappings::default();
            for l in crate::process::maps_lines::maps_lines(maps) {
                m.add(&l, mounts);
            }
            m
        };
        let m = of(&mounts);
        assert_eq!(m.served, [(0x7f00_0000_0000, 0x7f00_0010_0000)]);
        assert!(of(&UserSpaceMounts::none()).served.is_empty());
        // The mapping holding an address, the stack told as such.
        assert_eq!(
            m.holding(0x7f00_0010_0008),
            Some((0x7f00_0010_0000, 0x7f00_0020_0000, true))
        );
        assert_eq!(
            m.holding(0x7f00_0000_0000),
            Some((0x7f00_0000_0000, 0x7f00_0010_0000, false))
        );
        assert_eq!(m.holding(0x7eff_ffff_ffff), None);
        assert_eq!(m.holding(0x7f00_0040_0000), None);
        let mut mem = Memory {
            access: crate::attach::memory_access::MemoryAccess::start(
                std::fs::File::open("/dev/null").unwrap(),
            )
            .unwrap(),
            pages: Default::default(),
            served: Vec::new(),
            mounts,
        };
        mem.refresh(&m);
        let mut b = [0u8; 16];
        assert!(!mem.touchable(0x7f00_000f_fff8, 16));
        assert!(!mem.touchable(0x7eff_ffff_fff8, 16));
        assert!(mem.touchable(0x7f00_0010_0000, 16));
        assert!(mem.touchable(0x7eff_ffff_fff0, 16));
        assert!(!mem.read(0x7f00_0000_1000, &mut b));
        assert!(mem.write(0x7f00_0000_1000, &b).is_err());
    }
}
