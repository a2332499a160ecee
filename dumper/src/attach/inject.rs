//! The injector: runs `dlopen` of the agent library, then one of its entry
//! points, in one thread of a running process, through `ptrace`, and puts
//! that thread back exactly as it was.
//!
//! How, and why it is safe:
//! 1. Threads are stopped one at a time (`PTRACE_SEIZE` + `PTRACE_INTERRUPT`:
//!    no signal is sent, the process never sees a `SIGSTOP`). A stopped
//!    thread is judged ([`safe_point::judge`]): its whole call chain,
//!    unwound from outside, must be outside the allocator and the loader.
//!    One that is not is let go at once and the next is tried; after a
//!    round with none, the injector waits a little and tries again, then
//!    gives up with the reasons, having changed nothing.
//! 2. Only the chosen thread is stopped while the calls run; every other
//!    thread runs on, so a lock one of them holds is released as it
//!    normally would be. The calls run on the thread's own stack, below its
//!    red zone, with return address 0: the call's `ret` faults at 0, which
//!    stops the thread (the fault is never delivered).
//! 3. Every register is saved first (the general ones, `orig_rax`, which
//!    carries the system-call restart state, and the whole `XSTATE` area)
//!    and restored before the thread goes. While a call runs, `orig_rax`
//!    is -1, so the kernel never "restarts" our call as a system call.
//! 4. A thread stopped in a system call the kernel does not restart after
//!    a stop (`epoll_wait`, `semop`, `sigtimedwait` return `EINTR` to a
//!    `PTRACE_INTERRUPT`) is put back to execute the `syscall`
//!    instruction again, when no signal of its own is pending: it never
//!    sees an `EINTR` it would not have seen.
//! 5. Signals that arrive for a stopped thread are held and sent again
//!    after it is let go.

use std::time::{Duration, Instant};

use nix::sys::ptrace;
use nix::sys::signal::Signal;
use nix::sys::wait::{waitpid, WaitPidFlag, WaitStatus};
use nix::unistd::Pid;

use crate::attach::remote_unwind::{Memory, Modules, Regs, TargetMappings};
use crate::attach::safe_point::{self, Danger, Verdict};

pub use crate::attach::injection::{Action, InjectError, Injected};

const RTLD_NOW: u64 = 2;
const RTLD_NOLOAD: u64 = 4;
const RTLD_NODELETE: u64 = 0x1000;
const EINTR: i64 = 4;
const ERESTART_RESTARTBLOCK: i64 = 516;
const NT_X86_XSTATE: libc::c_int = 0x202;
/// `PTRACE_EVENT_STOP`: the stop `PTRACE_INTERRUPT` causes.
const EVENT_STOP: i32 = 128;
/// Rounds over the threads before giving up.
const ROUNDS: u32 = 40;
/// Rounds in which a thread whose system call resumes through its restart
/// block is passed over, in case another thread comes to a safe point.
const RESTART_BLOCK_ROUNDS: u32 = 3;
/// How long a call into the target may take before it is abandoned.
const CALL_TIMEOUT: Duration = Duration::from_secs(20);

/// A thread held in a ptrace stop, with what is needed to let it go as it
/// was.
struct Held {
    tid: Pid,
    saved: libc::user_regs_struct,
    /// The registers it resumes with (`saved`, or rewound to repeat an
    /// interrupted system call).
    resume: libc::user_regs_struct,
    xstate: Vec<u8>,
    /// Signals that arrived while it was held.
    pending: Vec<Signal>,
    since: Instant,
}

/// Waits for a state change of thread `tid`, polling until `deadline`.
fn wait(tid: Pid, deadline: Instant) -> Option<WaitStatus> {
    loop {
        match waitpid(tid, Some(WaitPidFlag::__WALL | WaitPidFlag::WNOHANG)) {
            Ok(WaitStatus::StillAlive) => {}
            Ok(s) => return Some(s),
            Err(nix::errno::Errno::EINTR) => {}
            Err(_) => return None,
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(Duration::from_micros(50));
    }
}

fn get_xstate(tid: Pid) -> Vec<u8> {
    let mut buf = vec![0u8; 16 << 10];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: PTRACE_GETREGSET writes at most `iov_len` bytes into `buf`
    // and sets `iov_len` to what it wrote; the thread is stopped by us.
    let r = unsafe {
        libc::ptrace(
            libc::PTRACE_GETREGSET,
            tid.as_raw(),
            NT_X86_XSTATE as usize as *mut libc::c_void,
            &mut iov as *mut libc::iovec,
        )
    };
    if r != 0 {
        return Vec::new();
    }
    buf.truncate(iov.iov_len);
    buf
}

fn set_xstate(tid: Pid, state: &[u8]) {
    if state.is_empty() {
        return;
    }
    let mut iov = libc::iovec {
        iov_base: state.as_ptr() as *mut libc::c_void,
        iov_len: state.len(),
    };
    // SAFETY: PTRACE_SETREGSET only reads `iov_len` bytes from the buffer,
    // which is the area GETREGSET gave for this thread.
    unsafe {
        libc::ptrace(
            libc::PTRACE_SETREGSET,
            tid.as_raw(),
            NT_X86_XSTATE as usize as *mut libc::c_void,
            &mut iov as *mut libc::iovec,
        );
    }
}

/// Signals of its own pending for thread `tid` and not blocked by it.
fn own_signal_pending(pid: u32, tid: Pid) -> bool {
    let Ok(status) = crate::process::proc_text::read(format!("/proc/{pid}/task/{tid}/status"))
    else {
        return true;
    };
    let mask = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
            .unwrap_or(0)
    };
    (mask("SigPnd:") | mask("ShdPnd:")) & !mask("SigBlk:") != 0
}

/// Stops thread `tid`; `Ok(None)` if it is gone.
fn hold(pid: u32, tid: Pid, mem: &Memory) -> Result<Option<Held>, InjectError> {
    match ptrace::seize(tid, ptrace::Options::empty()) {
        Ok(()) => {}
        Err(nix::errno::Errno::ESRCH) => return Ok(None),
        Err(e) => return Err(InjectError::Permission(permission_hint(pid, e))),
    }
    let since = Instant::now();
    let mut pending = Vec::new();
    if ptrace::interrupt(tid).is_err() {
        let _ = ptrace::detach(tid, None);
        return Ok(None);
    }
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        match wait(tid, deadline) {
            Some(WaitStatus::PtraceEvent(_, _, EVENT_STOP)) => break,
            Some(WaitStatus::Stopped(_, sig)) => {
                // A signal of its own reached it first: hold it, send it
                // again when the thread goes.
                pending.push(sig);
                let _ = ptrace::cont(tid, None);
            }
            Some(WaitStatus::PtraceEvent(..)) => {
                let _ = ptrace::cont(tid, None);
            }
            Some(WaitStatus::Exited(..)) | Some(WaitStatus::Signaled(..)) => return Ok(None),
            Some(_) => {}
            None => {
                // A thread that does not stop (in an uninterruptible
                // sleep): leave it.
                let _ = ptrace::detach(tid, None);
                resend(pid, tid, &pending);
                return Ok(None);
            }
        }
    }
    let Ok(saved) = ptrace::getregs(tid) else {
        let _ = ptrace::detach(tid, None);
        resend(pid, tid, &pending);
        return Ok(None);
    };
    let xstate = get_xstate(tid);
    let mut resume = saved;
    let mut before = [0u8; 2];
    if saved.orig_rax as i64 >= 0
        && saved.rax as i64 == -EINTR
        && pending.is_empty()
        && mem.read(saved.rip.wrapping_sub(2), &mut before)
        && before == [0x0f, 0x05]
        && !own_signal_pending(pid, tid)
    {
        // Interrupted by our stop alone: execute the system call again.
        resume.rax = saved.orig_rax;
        resume.rip = saved.rip - 2;
    }
    Ok(Some(Held {
        tid,
        saved,
        resume,
        xstate,
        pending,
        since,
    }))
}

fn resend(pid: u32, tid: Pid, pending: &[Signal]) {
    for sig in pending {
        // SAFETY: tgkill with the target's pid and one of its thread ids.
        unsafe {
            libc::syscall(
                libc::SYS_tgkill,
                pid as libc::c_long,
                tid.as_raw() as libc::c_long,
                *sig as libc::c_long,
            )
        };
    }
}

/// The error of an access to the target's memory that outlived its
/// deadline.
fn stalled(pid: u32) -> InjectError {
    InjectError::Stalled(format!(
        "a read of process {pid}'s memory took longer than {} s (a page of a file served by a \
         user-space file system that does not answer?); the thread was let go as it was, and \
         heapdump's helper that was reading stays until whatever holds it lets go",
        crate::attach::memory_access::DEADLINE.as_secs()
    ))
}

/// Lets a held thread go as it was; returns how long it was held.
fn release(pid: u32, h: Held) -> Duration {
    let _ = ptrace::setregs(h.tid, h.resume);
    set_xstate(h.tid, &h.xstate);
    let _ = ptrace::detach(h.tid, None);
    resend(pid, h.tid, &h.pending);
    h.since.elapsed()
}

/// Why `ptrace` was refused, and what to do.
pub fn permission_hint(pid: u32, e: nix::errno::Errno) -> String {
    let scope = std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope")
        .ok()
        .and_then(|s| s.trim().parse::<u32>().ok());
    // SAFETY: geteuid has no preconditions.
    let euid = unsafe { libc::geteuid() };
    let mut why = format!("ptrace: {e}");
    // The effective uid, the second of the `Uid:` line.
    let target_uid = crate::process::discovery::process_uids(pid).map(|ids| ids[1]);
    if euid != 0 && target_uid.is_some_and(|u| u != euid) {
        why += &format!(
            "; the process belongs to uid {}, you are uid {euid}: run heapdump as that user or \
             as root",
            target_uid.unwrap_or(0)
        );
    }
    match scope {
        Some(1) if euid != 0 => {
            why += "; kernel.yama.ptrace_scope is 1 (only a process's ancestors may trace it): \
                    run as root (CAP_SYS_PTRACE) or set `sysctl kernel.yama.ptrace_scope=0`"
        }
        Some(2) if euid != 0 => {
            why += "; kernel.yama.ptrace_scope is 2: only root (CAP_SYS_PTRACE) may attach"
        }
        Some(3) => why += "; kernel.yama.ptrace_scope is 3: no process may be traced until reboot",
        _ => {
            why += "; if permissions look right, a seccomp filter or a security module \
                    (AppArmor, SELinux) may forbid ptrace, or heapdump lacks CAP_SYS_PTRACE in \
                    its container"
        }
    }
    why
}

/// The thread ids of `pid`, the main thread first, then those asleep in
/// the kernel (state S), then the rest.
fn threads(pid: u32) -> Vec<Pid> {
    let mut out: Vec<(u8, i32)> = Vec::new();
    if let Ok(dir) = std::fs::read_dir(format!("/proc/{pid}/task")) {
        for e in dir.flatten() {
            let Some(tid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
                continue;
            };
            let state = crate::process::proc_text::read(format!("/proc/{pid}/task/{tid}/stat"))
                .ok()
                .and_then(|s| {
                    s.rsplit_once(')')
                        .and_then(|(_, r)| r.trim().chars().next())
                })
                .unwrap_or('?');
            let rank = if tid as u32 == pid {
                0
            } else if state == 'S' {
                1
            } else {
                2
            };
            out.push((rank, tid));
        }
    }
    out.sort();
    out.into_iter().map(|(_, t)| Pid::from_raw(t)).collect()
}

/// The address of `name` defined in a mapped glibc library of one of
/// `libs` (stems, see [`super::is_glibc_library`]; the first found).
fn function_in(modules: &mut Modules, libs: &[&str], name: &str) -> Option<u64> {
    let maps = modules.maps.clone();
    for lib in libs {
        for m in maps
            .iter()
            .filter(|m| super::is_glibc_library(m.basename(), lib))
        {
            let Some(file) = modules.file(m) else {
                continue;
            };
            let Some(bias) = file.bias(m) else { continue };
            if let Some(f) = file
                .funcs
                .iter()
                .find(|f| f.name.split('@').next() == Some(name))
            {
                return Some(f.start.wrapping_add(bias));
            }
        }
    }
    None
}

/// The loader's entry points the calls need.
struct Loader {
    dlopen: u64,
    dlsym: u64,
    /// 0: none (the private entry points report no message).
    dlerror: u64,
    dlclose: u64,
}

impl Loader {
    /// `dlopen` and its kin: in libc.so.6 from glibc 2.34, in libdl.so.2
    /// before; else, in a program on an older glibc that does not link
    /// libdl, libc's own `__libc_dlopen_mode`, `__libc_dlsym` and
    /// `__libc_dlclose` (GLIBC_PRIVATE, the same loader calls without
    /// `dlerror`; what debuggers use to load a library into such a
    /// process).
    fn find(modules: &mut Modules) -> Option<Loader> {
        let libs = ["libc", "libdl"];
        let public = |modules: &mut Modules| -> Option<Loader> {
            Some(Loader {
                dlopen: function_in(modules, &libs, "dlopen")?,
                dlsym: function_in(modules, &libs, "dlsym")?,
                dlerror: function_in(modules, &libs, "dlerror")?,
                dlclose: function_in(modules, &libs, "dlclose")?,
            })
        };
        if let Some(l) = public(modules) {
            return Some(l);
        }
        Some(Loader {
            dlopen: function_in(modules, &["libc"], "__libc_dlopen_mode")?,
            dlsym: function_in(modules, &["libc"], "__libc_dlsym")?,
            dlerror: 0,
            dlclose: function_in(modules, &["libc"], "__libc_dlclose")?,
        })
    }
}

/// True when the process maps a library with `dlopen` (glibc 2.34+'s
/// libc, or libdl): what attach needs.
pub fn has_dlopen(pid: u32) -> bool {
    Modules::of(pid)
        .ok()
        .is_some_and(|mut m| Loader::find(&mut m).is_some())
}

/// Calls in a held thread.
struct Caller<'a> {
    pid: u32,
    mem: &'a Memory,
    held: &'a mut Held,
    /// Where the strings the calls use were written.
    scratch: u64,
}

impl Caller<'_> {
    /// Writes `bytes` below the thread's red zone; returns their address.
    fn place(pid: u32, mem: &Memory, held: &Held, bytes: &[u8]) -> Result<u64, InjectError> {
        // Below the 128-byte red zone, with room to spare.
        let top = (held.saved.rsp - 1024) & !15;
        let at = (top - bytes.len() as u64) & !15;
        mem.write(at, bytes).map_err(|e| {
            InjectError::CallFailed(format!(
                "cannot write the call's arguments on thread {}'s stack: {e} (pid {pid})",
                held.tid
            ))
        })?;
        Ok(at)
    }

    /// Calls `func(args...)` in the thread; its return value.
    fn call(&mut self, func: u64, args: &[u64]) -> Result<u64, InjectError> {
        let tid = self.held.tid;
        let mut r = self.held.saved;
        // The return address 0 sits just below the strings; the stack is
        // 16-byte aligned above it, as the ABI wants at a call's entry.
        let sp = (self.scratch & !15) - 8;
        self.mem
            .write(sp, &0u64.to_le_bytes())
            .map_err(|e| InjectError::CallFailed(format!("cannot write the stack: {e}")))?;
        r.rsp = sp;
        r.rip = func;
        r.rax = 0;
        r.orig_rax = u64::MAX;
        let regs = [&mut r.rdi, &mut r.rsi, &mut r.rdx, &mut r.rcx];
        for (reg, a) in regs.into_iter().zip(args) {
            *reg = *a;
        }
        ptrace::setregs(tid, r).map_err(|e| InjectError::CallFailed(format!("setregs: {e}")))?;
        ptrace::cont(tid, None).map_err(|e| InjectError::CallFailed(format!("cont: {e}")))?;
        let deadline = Instant::now() + CALL_TIMEOUT;
        loop {
            match wait(tid, deadline) {
                Some(WaitStatus::Stopped(_, Signal::SIGSEGV)) => {
                    let now = ptrace::getregs(tid)
                        .map_err(|e| InjectError::CallFailed(format!("getregs: {e}")))?;
                    if now.rip == 0 {
                        return Ok(now.rax);
                    }
                    return Err(InjectError::CallFailed(format!(
                        "the call faulted at {:#x} in thread {tid}; the thread was put back as it \
                         was",
                        now.rip
                    )));
                }
                Some(WaitStatus::Stopped(_, sig)) => {
                    self.held.pending.push(sig);
                    let _ = ptrace::cont(tid, None);
                }
                Some(WaitStatus::PtraceEvent(..)) => {
                    let _ = ptrace::cont(tid, None);
                }
                Some(WaitStatus::Exited(..)) | Some(WaitStatus::Signaled(..)) => {
                    return Err(InjectError::Gone)
                }
                Some(_) => {}
                None => {
                    // Stop it again where it is, so it can be put back.
                    let _ = ptrace::interrupt(tid);
                    let again = Instant::now() + Duration::from_secs(5);
                    while let Some(s) = wait(tid, again) {
                        if matches!(s, WaitStatus::PtraceEvent(..) | WaitStatus::Stopped(..)) {
                            break;
                        }
                    }
                    return Err(InjectError::CallFailed(format!(
                        "the call into pid {} did not return within {} s",
                        self.pid,
                        CALL_TIMEOUT.as_secs()
                    )));
                }
            }
        }
    }

    /// Reads a NUL-terminated string of the target (at most 4 KiB).
    fn string_at(&self, addr: u64) -> String {
        let mut buf = vec![0u8; 4096];
        let mut n = 0;
        while n < buf.len() {
            let chunk = (buf.len() - n).min(256);
            if !self.mem.read(addr + n as u64, &mut buf[n..n + chunk]) {
                break;
            }
            if let Some(z) = buf[n..n + chunk].iter().position(|b| *b == 0) {
                n += z;
                return String::from_utf8_lossy(&buf[..n]).into_owned();
            }
            n += chunk;
        }
        String::from_utf8_lossy(&buf[..n]).into_owned()
    }
}

/// Runs `action` with the library at `library` (a path as the target sees
/// it) in a thread of `pid` at a safe point.
pub fn inject(pid: u32, library: &str, action: &Action) -> Result<Injected, InjectError> {
    let mut modules =
        Modules::of(pid).map_err(|e| InjectError::Unsupported(format!("/proc/{pid}/maps: {e}")))?;
    let loader = Loader::find(&mut modules).ok_or_else(|| {
        InjectError::Unsupported(
            "the process has no dlopen (neither glibc 2.34+'s libc.so.6 nor libdl.so.2 is \
             mapped, nor an older libc's __libc_dlopen_mode), so no library can be loaded \
             into it"
                .into(),
        )
    })?;
    let danger = Danger::of(&mut modules);
    // Everything read from the target's files is read before the first
    // thread stops (CFI and symbols of every module).
    modules.read_all();
    let mut mem =
        Memory::open(pid).map_err(|e| InjectError::Permission(format!("/proc/{pid}/mem: {e}")))?;
    let mut passed_over: Vec<(u32, String)> = Vec::new();
    let mut others_stopped = Duration::ZERO;
    for round in 0..ROUNDS {
        let maps = TargetMappings::read(pid, mem.mounts()).map_err(|_| InjectError::Gone)?;
        mem.refresh(&maps);
        let tids = threads(pid);
        if tids.is_empty() {
            return Err(InjectError::Gone);
        }
        for tid in tids {
            let Some(mut held) = hold(pid, tid, &mem)? else {
                continue;
            };
            let regs = Regs {
                rip: held.saved.rip,
                rsp: held.saved.rsp,
                rbp: held.saved.rbp,
            };
            let in_restart_block =
                held.saved.orig_rax as i64 >= 0 && held.saved.rax as i64 == -ERESTART_RESTARTBLOCK;
            let verdict = if in_restart_block && round < RESTART_BLOCK_ROUNDS {
                // Its interrupted sleep resumes through the thread's
                // restart block, which a system call of ours could
                // change: prefer another thread while one may come.
                Verdict::Unsafe("in a sleep the kernel resumes through its restart block".into())
            } else {
                mem.judging(|mem| {
                    safe_point::judge(mem, &mut modules, &danger, regs, maps.holding(regs.rsp))
                })
            };
            if in_restart_block && matches!(verdict, Verdict::Safe) {
                // Chosen all the same (a single-threaded daemon asleep in
                // poll or nanosleep has no other thread): its system call
                // is made again from the start instead of through the
                // restart block, with its original arguments (a relative
                // timeout then starts over; an absolute one is exact).
                let mut before = [0u8; 2];
                if mem.read(held.saved.rip.wrapping_sub(2), &mut before) && before == [0x0f, 0x05] {
                    held.resume.rax = held.saved.orig_rax;
                    held.resume.rip = held.saved.rip - 2;
                } else {
                    others_stopped = others_stopped.max(release(pid, held));
                    continue;
                }
            }
            match verdict {
                Verdict::Safe => {
                    let result = run_calls(pid, &mem, &mut held, &loader, library, action);
                    let stopped = release(pid, held);
                    let result = match result {
                        Err(_) if mem.stalled() => Err(stalled(pid)),
                        other => other,
                    };
                    return result.map(|result| Injected {
                        result,
                        thread: tid.as_raw() as u32,
                        stopped,
                        others_stopped,
                    });
                }
                Verdict::Unsafe(why) => {
                    others_stopped = others_stopped.max(release(pid, held));
                    if mem.stalled() {
                        return Err(stalled(pid));
                    }
                    if round == 0 || round == ROUNDS - 1 {
                        passed_over.push((tid.as_raw() as u32, why));
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(2 + 3 * u64::from(round)));
    }
    let mut reasons: Vec<String> = passed_over
        .iter()
        .rev()
        .take(8)
        .map(|(t, why)| format!("thread {t}: {why}"))
        .collect();
    reasons.dedup();
    Err(InjectError::NoSafePoint(format!(
        "tried {ROUNDS} times; {}; nothing was changed, try again later",
        reasons.join("; ")
    )))
}

fn run_calls(
    pid: u32,
    mem: &Memory,
    held: &mut Held,
    loader: &Loader,
    library: &str,
    action: &Action,
) -> Result<i64, InjectError> {
    let (entry, settings) = match action {
        Action::Attach { settings } => ("heapdump_attach", settings.as_str()),
        Action::Detach => ("heapdump_detach", ""),
    };
    // Strings: library\0 entry\0 settings\0
    let mut bytes = Vec::new();
    bytes.extend_from_slice(library.as_bytes());
    bytes.push(0);
    let entry_off = bytes.len() as u64;
    bytes.extend_from_slice(entry.as_bytes());
    bytes.push(0);
    let settings_off = bytes.len() as u64;
    bytes.extend_from_slice(settings.as_bytes());
    bytes.push(0);
    let scratch = Caller::place(pid, mem, held, &bytes)?;
    let mut c = Caller {
        pid,
        mem,
        held,
        scratch,
    };
    let flags = match action {
        Action::Attach { .. } => RTLD_NOW | RTLD_NODELETE,
        Action::Detach => RTLD_NOW | RTLD_NOLOAD,
    };
    let handle = c.call(loader.dlopen, &[scratch, flags])?;
    if handle == 0 {
        if matches!(action, Action::Detach) {
            return Err(InjectError::CallFailed(
                "the agent library is not loaded in the process: it was never attached".into(),
            ));
        }
        let msg = if loader.dlerror == 0 {
            0
        } else {
            c.call(loader.dlerror, &[])?
        };
        let text = if msg == 0 {
            "dlopen failed without a message".to_string()
        } else {
            c.string_at(msg)
        };
        return Err(InjectError::LoadFailed(text));
    }
    let f = c.call(loader.dlsym, &[handle, scratch + entry_off])?;
    if f == 0 {
        return Err(InjectError::LoadFailed(format!(
            "{library} has no {entry}: is it heapdump's agent, of this version?"
        )));
    }
    let result = c.call(f, &[scratch + settings_off]).map_err(|e| match e {
        InjectError::CallFailed(m) => InjectError::AgentFailed(m),
        other => other,
    })? as u32 as i32 as i64;
    if matches!(action, Action::Detach) {
        // Drop the reference RTLD_NOLOAD took (the library is NODELETE).
        c.call(loader.dlclose, &[handle])?;
    }
    Ok(result)
}
