//! `heapdump attach PID` / `heapdump detach PID`: start and stop recording
//! in a process that is already running, without restarting it.
//!
//! Everything that can be refused is refused before any `ptrace` call
//! (the process is gone, stopped, traced, already recorded, static, or
//! links an allocator under its own names); then [`crate::attach::inject`]
//! runs the agent library's entry point in one of its threads.

use std::ops::ControlFlow;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::attach::inject::{self, Action, InjectError};
use crate::commands::run::find_preload;

/// Options of `heapdump attach`.
#[derive(Args, Debug)]
pub struct AttachArgs {
    /// The process to record.
    pub pid: u32,
    /// Sampled mode: record one allocation per SIZE allocated on average
    /// (`512KiB`), each an unbiased estimate; default: every allocation.
    #[arg(long, value_name = "SIZE", value_parser = parse_size)]
    pub sample_rate: Option<u64>,
    /// How the agent walks stacks: auto (CFI, frame pointers where there is
    /// none), cfi or fp.
    #[arg(long, value_parser = ["auto", "cfi", "fp"])]
    pub unwind: Option<String>,
    /// Snapshot-request signal for the process (name or number, `none`);
    /// default SIGUSR2, unless the process handles that one itself.
    #[arg(long)]
    pub signal: Option<String>,
    /// Deepest stack recorded (1-64).
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=64))]
    pub max_frames: Option<u32>,
    /// Record for this long (`30s`, `10m`), then detach; Ctrl-C detaches
    /// sooner. Without it, recording goes on until `heapdump detach`.
    #[arg(long = "for", value_name = "DURATION", value_parser = humantime::parse_duration)]
    pub duration: Option<Duration>,
    /// The agent library (default: as `heapdump run` finds it).
    #[arg(long, value_name = "PATH")]
    pub library: Option<PathBuf>,
    /// Attach even though a thread of the process runs under a seccomp
    /// filter: the agent's system calls (memfd_create, mmap, ...) may then
    /// be denied (the attach fails) or, with a filter that kills, end the
    /// process.
    #[arg(long)]
    pub despite_seccomp: bool,
}

/// Options of `heapdump detach`.
#[derive(Args, Debug)]
pub struct DetachArgs {
    /// The process to stop recording in.
    pub pid: u32,
}

fn parse_size(s: &str) -> Result<u64, String> {
    heapdump_table::byte_size::parse_byte_size(s).map_err(|e| e.to_string())
}

/// What a process says of the agent.
#[derive(Debug, PartialEq, Eq)]
enum AgentState {
    /// No agent.
    None,
    /// Started under the preload agent.
    Preloaded,
    /// Instrumented by the Rust `Agent` global allocator.
    RustAgent,
    /// Attached and recording.
    Attached,
    /// Attached once, detached now.
    Detached,
}

fn agent_state(pid: u32) -> AgentState {
    match crate::process::discovery::open_target(pid) {
        Ok(t) => {
            let view = t.allocations.view();
            let w = heapdump_table::header::read_attach(&view);
            // The agent says which it is; one from before that word is
            // told by the library's usual name in the process's mappings
            // (a renamed preload library then reads as the Rust agent:
            // refused either way).
            let preload = match heapdump_table::header::read_agent_kind(&view) {
                Some(kind) => kind == heapdump_table::header::AgentKind::Preload,
                None => maps_any_file(pid, |path| path.contains("libheapdump_preload")),
            };
            match (preload, w.attached_at != 0, w.detached_at != 0) {
                (false, _, _) => AgentState::RustAgent,
                (true, false, _) => AgentState::Preloaded,
                (true, true, false) => AgentState::Attached,
                (true, true, true) => AgentState::Detached,
            }
        }
        // The library loaded but no regions: an attach that did not start.
        Err(_) => AgentState::None,
    }
}

/// Whether heapdump may look into `pid` as a debugger would: reading its
/// `/proc/PID/maps` takes the same permission as `ptrace` (a denial there
/// used to surface later as a false reason, "maps no dlopen").
fn check_access(pid: u32) -> Result<()> {
    match std::fs::File::open(format!("/proc/{pid}/maps")) {
        Ok(_) => Ok(()),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied => {
            let name = crate::process::discovery::process_name(pid);
            bail!(
                "heapdump may not look into process {pid} ({name}): attaching takes the \
                 permission a debugger needs ({})",
                crate::attach::inject::permission_hint(pid, nix::errno::Errno::EACCES)
            )
        }
        Err(e) => Err(e).with_context(|| format!("reading /proc/{pid}/maps")),
    }
}

/// Refusals that need no ptrace: (process state, tracer).
fn check_process(pid: u32) -> Result<()> {
    // SAFETY: getpid has no preconditions.
    if pid == unsafe { libc::getpid() } as u32 {
        bail!("pid {pid} is heapdump itself");
    }
    let name = crate::process::discovery::process_name(pid);
    let stat = crate::process::proc_text::read(format!("/proc/{pid}/stat"))
        .with_context(|| format!("no process {pid}"))?;
    let state = stat
        .rsplit_once(')')
        .and_then(|(_, r)| r.trim().chars().next())
        .unwrap_or('?');
    match state {
        'Z' | 'X' => bail!("process {pid} ({name}) has exited"),
        'T' | 't' => bail!(
            "process {pid} ({name}) is stopped (state {state}); continue it first \
             (kill -CONT {pid}) or detach its debugger"
        ),
        _ => {}
    }
    let status = crate::process::proc_text::read(format!("/proc/{pid}/status"))
        .with_context(|| format!("reading /proc/{pid}/status"))?;
    let tracer = status
        .lines()
        .find_map(|l| l.strip_prefix("TracerPid:"))
        .and_then(|v| v.trim().parse::<u32>().ok())
        .unwrap_or(0);
    if tracer != 0 {
        bail!(
            "process {pid} ({name}) is being traced by pid {tracer} ({}); a process has one \
             tracer at a time: detach that debugger or tool first",
            crate::process::discovery::process_name(tracer)
        );
    }
    Ok(())
}

/// The seccomp mode of the process's threads that is the most
/// restrictive (0: none, 1: strict, 2: filter), from each thread's
/// `Seccomp:` line (a filter is per thread; the injector borrows any
/// one, and the agent's later calls run on every thread). 0 when the
/// kernel does not say.
fn seccomp_mode(pid: u32) -> u32 {
    let Ok(tasks) = std::fs::read_dir(format!("/proc/{pid}/task")) else {
        return 0;
    };
    // Bounded: a process has finitely many threads, each read once.
    tasks
        .flatten()
        .filter_map(|task| {
            let status = crate::process::proc_text::read(task.path().join("status")).ok()?;
            status
                .lines()
                .find_map(|l| l.strip_prefix("Seccomp:"))
                .and_then(|v| v.trim().parse::<u32>().ok())
        })
        .max()
        .unwrap_or(0)
}

/// Refuses a process whose threads run under seccomp (unless `despite`,
/// for a filter): the filter decides the fate of every system call the
/// injected code and the agent make, and one that kills on a call it does
/// not allow (systemd's `SystemCallFilter=` does by default) would end the
/// service. Nothing here can tell which calls a filter allows.
fn check_seccomp(pid: u32, despite: bool) -> Result<()> {
    let name = crate::process::discovery::process_name(pid);
    match seccomp_mode(pid) {
        0 => Ok(()),
        1 => bail!(
            "process {pid} ({name}) runs in seccomp strict mode: any system call but read, \
             write, exit and sigreturn kills it, so nothing can be loaded into it"
        ),
        _ if despite => Ok(()),
        _ => bail!(
            "not attaching to {pid} ({name}): it runs under a seccomp filter (Seccomp: 2 in \
             /proc/{pid}/status), which may deny the agent's system calls (memfd_create, mmap, \
             mprotect, ...) or kill the process on one of them (systemd's SystemCallFilter= \
             does by default); start it under heapdump run instead, or pass \
             --despite-seccomp if its filter allows them (a filter that kills would end it)"
        ),
    }
}

/// What the preload agent cannot see in this program: refused before
/// anything is injected.
fn check_visibility(pid: u32) -> Result<()> {
    use crate::process::visibility::{inspect_process, BlindSpot};
    let info = inspect_process(pid);
    let fatal: Vec<String> = info
        .blind_spots
        .iter()
        .filter(|b| !matches!(b, BlindSpot::PreloadedBefore(_)))
        .map(ToString::to_string)
        .collect();
    if !fatal.is_empty() {
        bail!(
            "not attaching to {pid}: {}; the agent would see nothing (or only a part) of its heap",
            fatal.join("; ")
        );
    }
    Ok(())
}

/// The path of the agent library the target has loaded, for detach to
/// name it to the target's `dlopen(RTLD_NOLOAD)`.
///
/// The target chooses what it maps and under which names: a library of its
/// own called `libheapdump_preload_x.so`, mapped before ours, must neither
/// make root's detach fail nor have root call its `heapdump_detach`. So a
/// mapping counts only when the file behind it, opened through
/// `/proc/PID/map_files` (never on a user-space file system, whose server
/// the target may run), can be changed by no one but root or heapdump's
/// user, as the library attach loads always is (see
/// [`crate::attach::library_placement`]). The path is as the target sees
/// it: a target in another root shows in our `/proc/PID/maps` under that
/// root's path, which is taken off.
fn loaded_library(pid: u32) -> Option<String> {
    let mounts = crate::process::user_space_mounts::UserSpaceMounts::of_process(pid);
    let root = std::fs::read_link(format!("/proc/{pid}/root")).ok();
    let mut found = None;
    crate::process::mappings::for_each(pid, file_mappings(), |l| {
        let path = crate::symbolization::maps::unescape_path(l.path);
        let named = std::path::Path::new(&path)
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with("libheapdump_preload"));
        if !named {
            return ControlFlow::Continue(());
        }
        let via = format!("/proc/{pid}/map_files/{:x}-{:x}", l.start, l.end);
        let trusted =
            crate::process::target_files::open_regular(std::path::Path::new(&via), &mounts)
                .and_then(|f| crate::process::target_files::fstat(&f))
                .is_ok_and(|st| crate::attach::library_placement::trusted(&st));
        if !trusted {
            return ControlFlow::Continue(());
        }
        found = Some(path);
        ControlFlow::Break(())
    })
    .ok()?;
    found.map(|path| as_seen_inside(&path, root.as_deref()))
}

/// The filter for mappings of files (read a mapping at a time: the
/// target decides how long its maps text is, see
/// [`crate::process::mappings`]).
fn file_mappings() -> crate::process::mappings::Wanted {
    crate::process::mappings::Wanted {
        file_backed: true,
        ..Default::default()
    }
}

/// Whether process `pid` maps a file whose path (as the maps text shows
/// it) passes `test`.
fn maps_any_file(pid: u32, test: impl Fn(&str) -> bool) -> bool {
    let mut any = false;
    let _ = crate::process::mappings::for_each(pid, file_mappings(), |l| {
        any = test(l.path);
        if any {
            ControlFlow::Break(())
        } else {
            ControlFlow::Continue(())
        }
    });
    any
}

/// `path`, as our `/proc/PID/maps` shows it, as a process whose root
/// directory is `root` (as `/proc/PID/root` reads to us) names it.
fn as_seen_inside(path: &str, root: Option<&std::path::Path>) -> String {
    match root.and_then(|r| std::path::Path::new(path).strip_prefix(r).ok()) {
        Some(rest) if root != Some(std::path::Path::new("/")) => {
            format!("/{}", rest.display())
        }
        _ => path.to_string(),
    }
}

fn explain(e: InjectError, pid: u32) -> anyhow::Error {
    let name = crate::process::discovery::process_name(pid);
    if matches!(e, InjectError::AgentFailed(_)) {
        return anyhow::anyhow!("{e}").context(format!(
            "attaching to {pid} ({name}) failed inside the agent, after its library was \
             loaded: the library stays loaded (it cannot be unloaded) and the agent may have \
             started; heapdump detach {pid} puts back whatever it redirected"
        ));
    }
    anyhow::anyhow!("{e}").context(format!(
        "attaching to {pid} ({name}) failed; the process was left as it was"
    ))
}

/// Whether `pid` catches signal `sig` (`SigCgt` of /proc/PID/status).
fn catches(pid: u32, sig: i32) -> bool {
    crate::process::proc_text::read(format!("/proc/{pid}/status"))
        .ok()
        .and_then(|s| {
            s.lines()
                .find_map(|l| l.strip_prefix("SigCgt:"))
                .and_then(|v| u64::from_str_radix(v.trim(), 16).ok())
        })
        .is_some_and(|m| m & (1u64 << (sig - 1)) != 0)
}

/// The agent's settings for the attach. The agent is quiet in an attached
/// process: its stderr is the service's (a log), and what it would say
/// the dumper says here instead.
fn settings_of(a: &AttachArgs) -> String {
    let mut s = String::from("HEAPDUMP_QUIET=1\n");
    if let Some(sig) = &a.signal {
        s += &format!("HEAPDUMP_SIGNAL={sig}\n");
    }
    if let Some(r) = a.sample_rate {
        s += &format!("HEAPDUMP_SAMPLE_RATE={r}\n");
    }
    if let Some(u) = &a.unwind {
        s += &format!("HEAPDUMP_UNWIND={u}\n");
    }
    if let Some(n) = a.max_frames {
        s += &format!("HEAPDUMP_MAX_FRAMES={n}\n");
    }
    s
}

/// `heapdump attach`.
pub fn attach(a: AttachArgs) -> Result<i32> {
    // Held from the start: taken by the wait of --for (which then
    // detaches), or, without --for, delivered once the attach is done.
    let _ = ending_signals().thread_block();
    let pid = a.pid;
    let result = attach_held(a).map_err(|e| {
        // Whatever failed, a process that is gone is the reason to give.
        if std::path::Path::new(&format!("/proc/{pid}")).exists() {
            e
        } else {
            anyhow::anyhow!("process {pid} exited while heapdump was attaching to it")
        }
    });
    let _ = ending_signals().thread_unblock();
    result
}

fn attach_held(a: AttachArgs) -> Result<i32> {
    let pid = a.pid;
    refuse_other_architectures()?;
    check_process(pid)?;
    check_access(pid)?;
    let name = crate::process::discovery::process_name(pid);
    let state = agent_state(pid);
    match state {
        AgentState::Preloaded => bail!(
            "process {pid} ({name}) was started under the agent (heapdump run or LD_PRELOAD): \
             it is recorded since it started; nothing to attach (heapdump snapshot {pid})"
        ),
        AgentState::RustAgent => bail!(
            "process {pid} ({name}) is instrumented by heapdump_agent::Agent, its global \
             allocator: it is recorded already (heapdump snapshot {pid})"
        ),
        AgentState::Attached => bail!(
            "heapdump is attached to process {pid} ({name}) already; nothing was changed \
             (heapdump detach {pid} stops recording)"
        ),
        AgentState::None | AgentState::Detached => {}
    }
    check_visibility(pid)?;
    check_seccomp(pid, a.despite_seccomp)?;
    if !inject::has_dlopen(pid) {
        bail!(
            "process {pid} ({name}) maps no dlopen (neither glibc 2.34+'s libc.so.6 nor \
             libdl.so.2, nor an older libc's __libc_dlopen_mode), so the agent cannot be \
             loaded into it"
        );
    }
    // A process attached before and detached catches SIGUSR2 with the
    // agent's own handler (it stays installed): only a first attach can
    // tell the program's handler.
    if a.signal.is_none() && state == AgentState::None && catches(pid, libc::SIGUSR2) {
        eprintln!(
            "heapdump: note: process {pid} handles SIGUSR2 itself, so the agent leaves it alone \
             and snapshot requests by signal are off (--signal SIGNAL chooses another)"
        );
    }
    let lib = find_preload(a.library.as_deref()).context("finding libheapdump_preload.so")?;
    let placed = crate::attach::library_placement::place(pid, &lib)?;
    let (path, copied) = (placed.path, placed.copied_to);
    let settings = settings_of(&a);
    let done =
        inject::inject(pid, &path, &Action::Attach { settings }).map_err(|e| explain(e, pid))?;
    let mut resumed = None;
    match done.result as i32 {
        n if n > 0 => {}
        -6 => resumed = Some(wait_resumed(pid)?),
        -2 => bail!("heapdump is attached to process {pid} already; nothing was changed"),
        -3 => bail!(
            "process {pid} was attached before with other settings, and the recording mode \
             cannot change under the records it made: attach with the same settings"
        ),
        -4 => bail!("the agent could not start in {pid} (no shared memory?); it records nothing"),
        -5 => bail!("process {pid} runs the agent from its start (LD_PRELOAD)"),
        0 => bail!(
            "the agent was loaded into {pid}, but no module calls the allocator through a \
             relocation slot it could redirect: nothing would be recorded"
        ),
        n => bail!("the agent refused to attach to {pid} (code {n})"),
    }
    if let Some(dir) = &copied {
        eprintln!(
            "heapdump: the agent library's own path is not one the process sees, or not one \
             only root can change; it was copied to {dir} inside the process's root"
        );
    }
    let mode = match a.sample_rate {
        Some(r) if r > 0 => format!(
            "sampled mode, one allocation per {}",
            crate::formats::text::human_bytes(r)
        ),
        _ => "exact mode".to_string(),
    };
    let what = match resumed {
        None => format!("{} relocation slots redirected", done.result),
        Some(waited) => format!(
            "the agent's own thread forgot the previous attach's records and redirected the \
             slots in {:.1} ms",
            waited.as_secs_f64() * 1e3
        ),
    };
    say(&format!(
        "attached to {pid} ({name}): recording in {mode} from now on ({what}; thread {} ran the \
         load, stopped {:.1} ms; other threads stopped at most {:.1} ms)",
        done.thread,
        done.stopped.as_secs_f64() * 1e3,
        done.others_stopped.as_secs_f64() * 1e3
    ));
    let Some(d) = a.duration else {
        say(&format!("heapdump snapshot {pid} shows what it allocates; heapdump detach {pid} stops recording"));
        return Ok(0);
    };
    say(&format!(
        "recording for {}; Ctrl-C, SIGTERM or SIGHUP detaches sooner",
        humantime::format_duration(d)
    ));
    wait_or_interrupted(d);
    detach(DetachArgs { pid })
}

/// How long a re-attach may take the agent's own thread (forgetting the
/// records the previous attach left: a million in well under a second).
const RESUME_DEADLINE: Duration = Duration::from_secs(60);

/// After a re-attach the agent finishes in its housekeeping thread (no
/// thread of the program is held meanwhile): waits, bounded, until its
/// header says attached; returns how long that took.
fn wait_resumed(pid: u32) -> Result<Duration> {
    let t0 = std::time::Instant::now();
    loop {
        match agent_state(pid) {
            AgentState::Attached => return Ok(t0.elapsed()),
            AgentState::Detached => {}
            _ => bail!("process {pid} exited, or its regions went, while the agent re-attached"),
        }
        if t0.elapsed() > RESUME_DEADLINE {
            bail!(
                "the agent in {pid} did not finish re-attaching within {}s (its housekeeping \
                 thread forgets the previous records first); heapdump list {pid} shows when it \
                 records",
                RESUME_DEADLINE.as_secs()
            );
        }
        // A bounded poll of the target's header (nothing the target is
        // asked to do): every 5 ms.
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// SIGINT, SIGTERM and SIGHUP: the signals `attach` holds while it works
/// (a signal that killed it with a thread of the target stopped, or before
/// `--for` detaches, would break its promise).
fn ending_signals() -> nix::sys::signal::SigSet {
    use nix::sys::signal::{SigSet, Signal};
    let mut set = SigSet::empty();
    set.add(Signal::SIGINT);
    set.add(Signal::SIGTERM);
    set.add(Signal::SIGHUP);
    set
}

/// Prints a line on stdout, never panicking: the reader may have gone
/// (`attach --for 3s | head -1`), and the detach must still happen.
fn say(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}").and_then(|()| out.flush());
}

/// Sleeps for `d`, or until SIGINT, SIGTERM or SIGHUP (then returns early).
fn wait_or_interrupted(d: Duration) {
    let set = ending_signals();
    let _ = set.thread_block();
    let ts = libc::timespec {
        tv_sec: d.as_secs() as libc::time_t,
        tv_nsec: d.subsec_nanos() as libc::c_long,
    };
    // SAFETY: sigtimedwait with a valid set and timeout; siginfo may be
    // NULL. The signals are blocked above, so they are taken here.
    unsafe { libc::sigtimedwait(set.as_ref(), std::ptr::null_mut(), &ts) };
}

/// On an architecture without an injector, the refusal, before anything is
/// looked at.
fn refuse_other_architectures() -> Result<()> {
    match crate::attach::injection::architecture_refusal() {
        Some(e) => Err(e.into()),
        None => Ok(()),
    }
}

/// `heapdump detach`.
pub fn detach(a: DetachArgs) -> Result<i32> {
    let pid = a.pid;
    refuse_other_architectures()?;
    check_process(pid)?;
    check_access(pid)?;
    let name = crate::process::discovery::process_name(pid);
    match agent_state(pid) {
        AgentState::Attached => {}
        AgentState::Detached => bail!("process {pid} ({name}) is detached already"),
        AgentState::Preloaded => bail!(
            "process {pid} ({name}) was started under the agent (LD_PRELOAD), not attached: \
             it cannot be detached"
        ),
        AgentState::RustAgent => {
            bail!("process {pid} ({name}) is instrumented by heapdump_agent::Agent, not attached")
        }
        AgentState::None => bail!("heapdump is not attached to process {pid} ({name})"),
    }
    let path = loaded_library(pid).with_context(|| {
        format!(
            "process {pid} maps no libheapdump_preload library that only root (or heapdump's \
             user) can change, so no agent heapdump attached: nothing to detach"
        )
    })?;
    let done = inject::inject(pid, &path, &Action::Detach).map_err(|e| {
        anyhow::anyhow!("{e}").context(format!(
            "detaching from {pid} ({name}) failed; the process was left as it was (still \
             recording)"
        ))
    })?;
    if done.result < 0 {
        bail!("heapdump is not attached to process {pid} ({name})");
    }
    say(&format!(
        "detached from {pid} ({name}): {} relocation slots put back; what was recorded stays \
         readable (heapdump snapshot {pid}); thread {} stopped {:.1} ms",
        done.result,
        done.thread,
        done.stopped.as_secs_f64() * 1e3
    ));
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::as_seen_inside;
    use std::path::Path;

    #[test]
    fn a_library_path_is_named_as_the_target_sees_it() {
        let lib = "/srv/jail/tmp/heapdump-agent-1/libheapdump_preload.so";
        assert_eq!(
            as_seen_inside(lib, Some(Path::new("/srv/jail"))),
            "/tmp/heapdump-agent-1/libheapdump_preload.so"
        );
        assert_eq!(as_seen_inside(lib, Some(Path::new("/"))), lib);
        assert_eq!(as_seen_inside(lib, None), lib);
        // A root that is not a whole-component prefix is not taken off.
        assert_eq!(as_seen_inside(lib, Some(Path::new("/srv/ja"))), lib);
        assert_eq!(as_seen_inside(lib, Some(Path::new("/elsewhere"))), lib);
    }
}
