//! `heapdump run`: start a program under the preload agent
//! (`LD_PRELOAD=libheapdump_preload.so`), pass its exit status through.
//!
//! The agent goes first in `LD_PRELOAD` (so it wraps whatever allocator
//! comes after it: the program's own, or a user's preloaded one, which are
//! kept in their order after it), followed by `libheapdump_jemalloc.so`
//! when the program links jemalloc. Children inherit the variable. Before
//! starting, the program's ELF files are read for what the agent could not
//! see ([`crate::process::visibility`]), which is said on stderr.
//!
//! The preload library is found, in order: `$HEAPDUMP_PRELOAD`; next to
//! the `heapdump` executable; in the parent directory (cargo's `deps/` and
//! `examples/` layouts put binaries one level below the library); in
//! `../lib/heapdump/` of a `bin/` directory (the Debian package); else the
//! libraries a release executable carries ([`crate::agent_bundle`]) are
//! written out and used.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

use crate::commands::args::AgentArgs;
use crate::commands::watch::WatchOptions;
use crate::formats::{Format, RenderOptions};
use crate::process::age::AgeFilter;
use anyhow::Context as _;
use clap::Args;
use std::time::Duration;

/// File name of the preload agent.
pub const PRELOAD_NAME: &str = "libheapdump_preload.so";
/// File name of the companion library for jemalloc's `*allocx` calls,
/// expected next to the preload agent.
pub const JEMALLOC_COMPANION_NAME: &str = "libheapdump_jemalloc.so";

/// Errors of `run`.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The preload library was not found.
    #[error(
        "cannot find {PRELOAD_NAME} (looked in: {looked}). Build it with `cargo build -p \
         heapdump-agent` (it lands next to the heapdump binary in target/<profile>/), or point \
         HEAPDUMP_PRELOAD at it"
    )]
    PreloadNotFound {
        /// Places searched.
        looked: String,
    },
    /// The libraries this executable carries could not be used.
    #[error("{0}")]
    Bundle(String),
    /// `HEAPDUMP_PRELOAD` names a missing file.
    #[error("HEAPDUMP_PRELOAD={0} does not exist")]
    PreloadEnvMissing(String),
    /// Nothing to run.
    #[error("no command given: use `heapdump run -- CMD ARGS...`")]
    NoCommand,
    /// The program could not be started.
    #[error("cannot start {cmd}: {source}")]
    Spawn {
        /// Program.
        cmd: String,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// Agent settings passed through the environment.
#[derive(Clone, Debug, Default)]
pub struct AgentEnv {
    /// `HEAPDUMP_SIGNAL`: signal (name or number) that requests a snapshot.
    pub signal: Option<String>,
    /// `HEAPDUMP_MAX_FRAMES`.
    pub max_frames: Option<u32>,
    /// `HEAPDUMP_SAMPLE_RATE` in bytes.
    pub sample_rate: Option<u64>,
    /// Explicit preload library path (overrides discovery).
    pub preload: Option<PathBuf>,
}

/// Finds the preload library (see the module doc).
pub fn find_preload(explicit: Option<&Path>) -> Result<PathBuf, RunError> {
    if let Some(p) = explicit {
        return if p.is_file() {
            Ok(p.to_path_buf())
        } else {
            Err(RunError::PreloadEnvMissing(p.display().to_string()))
        };
    }
    if let Some(p) = std::env::var_os("HEAPDUMP_PRELOAD") {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(RunError::PreloadEnvMissing(p.display().to_string()))
        };
    }
    let mut looked = Vec::new();
    if let Ok(exe) = std::env::current_exe() {
        let exe = exe.canonicalize().unwrap_or(exe);
        let mut dir = exe.parent().map(Path::to_path_buf);
        // A package's layout: /usr/bin/heapdump, /usr/lib/heapdump/.
        let package = exe
            .parent()
            .filter(|d| d.ends_with("bin"))
            .and_then(Path::parent)
            .map(|p| p.join("lib").join("heapdump"));
        let mut candidates = Vec::new();
        for _ in 0..2 {
            let Some(d) = dir else { break };
            dir = d.parent().map(Path::to_path_buf);
            candidates.push(d);
        }
        candidates.extend(package);
        for d in candidates {
            let cand = d.join(PRELOAD_NAME);
            if cand.is_file() {
                return Ok(cand);
            }
            looked.push(d.display().to_string());
        }
    }
    match crate::agent_bundle::extract_own() {
        Ok(Some(p)) => Ok(p),
        Ok(None) => Err(RunError::PreloadNotFound {
            looked: looked.join(", "),
        }),
        Err(e) => Err(RunError::Bundle(format!("{e:#}"))),
    }
}

/// `LD_PRELOAD` for a program: the agent, the jemalloc companion when
/// given, then the entries of `user` (the caller's `LD_PRELOAD`, split on
/// colons and spaces as the dynamic linker does) that are neither.
pub fn preload_list(preload: &Path, companion: Option<&Path>, user: &str) -> String {
    let ours = |e: &str| e.ends_with(PRELOAD_NAME) || e.ends_with(JEMALLOC_COMPANION_NAME);
    let mut list = vec![preload.display().to_string()];
    list.extend(companion.map(|c| c.display().to_string()));
    list.extend(
        user.split([':', ' '])
            .filter(|e| !e.is_empty() && !ours(e))
            .map(str::to_string),
    );
    list.join(":")
}

/// A `Command` for `argv` with the agent preloaded and configured, and
/// what the agent will not see in the program (see [`crate::process::visibility`]).
pub fn program_command(
    argv: &[String],
    env: &AgentEnv,
) -> Result<(Command, crate::process::visibility::ProgramInfo), RunError> {
    let (prog, args) = argv.split_first().ok_or(RunError::NoCommand)?;
    let preload = find_preload(env.preload.as_deref())?;
    let info = crate::process::visibility::resolve_program(prog)
        .map(|p| crate::process::visibility::inspect_program(&p))
        .unwrap_or_default();
    let companion = preload.with_file_name(JEMALLOC_COMPANION_NAME);
    let companion = (info.links_jemalloc && companion.is_file()).then_some(companion);
    let mut cmd = Command::new(prog);
    cmd.args(args);
    let user = std::env::var("LD_PRELOAD").unwrap_or_default();
    cmd.env(
        "LD_PRELOAD",
        preload_list(&preload, companion.as_deref(), &user),
    );
    // The agent speaks (on stderr) only in the program started here, not in
    // the programs that program runs (see heapdump_agent's `speaks_here`).
    cmd.env("HEAPDUMP_RUN_PID", std::process::id().to_string());
    if let Some(s) = &env.signal {
        cmd.env("HEAPDUMP_SIGNAL", s);
    }
    if let Some(r) = env.sample_rate {
        cmd.env("HEAPDUMP_SAMPLE_RATE", r.to_string());
    }
    if let Some(n) = env.max_frames {
        cmd.env("HEAPDUMP_MAX_FRAMES", n.to_string());
    }
    Ok((cmd, info))
}

/// Starts `argv` under the agent with the given stdio.
pub fn spawn(argv: &[String], env: &AgentEnv, piped: bool) -> Result<Child, RunError> {
    let (mut cmd, info) = program_command(argv, env)?;
    for b in &info.blind_spots {
        eprintln!("heapdump: warning: {b}");
    }
    if piped {
        cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    }
    cmd.spawn().map_err(|source| RunError::Spawn {
        cmd: argv[0].clone(),
        source,
    })
}

/// The shell-style exit code of a finished child: its code, or 128 + the
/// signal that killed it.
pub fn exit_code(status: ExitStatus) -> i32 {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(c), _) => c,
        (None, Some(s)) => 128 + s,
        (None, None) => 1,
    }
}

/// While the child runs, the terminal's SIGINT/SIGQUIT reach it (same
/// process group); the dumper ignores them so that it can report the
/// child's own exit status.
pub fn ignore_terminal_signals() {
    use nix::sys::signal::{signal, SigHandler, Signal};
    for s in [Signal::SIGINT, Signal::SIGQUIT] {
        // SAFETY: SIG_IGN installs no handler code.
        let _ = unsafe { signal(s, SigHandler::SigIgn) };
    }
}

/// Options of `heapdump run`.
#[derive(Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub(crate) agent: AgentArgs,
    /// Also watch the program, writing snapshots into DIR (as `watch
    /// --answer-pending`: a request the program makes before the watch
    /// attaches is answered too).
    #[arg(long, value_name = "DIR")]
    pub(crate) watch: Option<PathBuf>,
    /// Formats written with --watch (repeatable).
    #[arg(short, long, value_enum, default_values_t = [Format::Pprof])]
    pub(crate) format: Vec<Format>,
    /// With --watch: keep the allocator plumbing frames at the leaf end of
    /// each stack (see `snapshot --help`).
    #[arg(long)]
    pub(crate) keep_allocator_frames: bool,
    /// The program and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    pub(crate) command: Vec<String>,
}

/// `heapdump run`: returns the program's exit status.
pub fn command(a: RunArgs) -> anyhow::Result<i32> {
    let mut child = spawn(&a.command, &a.agent.env(), false)?;
    let pid = child.id();
    let watcher = match a.watch {
        Some(dir) => {
            let opts = WatchOptions {
                dir,
                formats: a.format,
                interval: None,
                symbolize: true,
                render: RenderOptions::default(),
                poll: Duration::from_millis(15),
                keep_allocator_frames: a.keep_allocator_frames,
                // The program was started by us: every request it made
                // before the watch attached is ours to answer.
                answer_pending: true,
                keep: None,
                ages: AgeFilter::default(),
                all: false,
                peak: false,
                scan: Duration::from_secs(1),
                max_total: None,
                // The user's own program, started here: every request is
                // answered as it comes.
                min_request_interval: Duration::ZERO,
                keep_requests: None,
            };
            Some(std::thread::spawn(move || -> anyhow::Result<()> {
                crate::commands::watch::wait_instrumented(pid, Duration::from_secs(30))?;
                crate::commands::watch::watch(
                    &[pid],
                    &opts,
                    &std::sync::atomic::AtomicBool::new(false),
                    crate::commands::watch::print_written,
                )?;
                Ok(())
            }))
        }
        None => None,
    };
    ignore_terminal_signals();
    let status = child.wait().context("waiting for the program")?;
    if let Some(w) = watcher {
        match w.join() {
            Ok(Err(e)) => eprintln!("heapdump: watch: {e:#}"),
            Err(_) => eprintln!("heapdump: watch thread panicked"),
            Ok(Ok(())) => {}
        }
    }
    Ok(exit_code(status))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_agent_goes_first_and_the_users_preloads_follow_in_order() {
        let ours = Path::new("/opt/hd/libheapdump_preload.so");
        let comp = Path::new("/opt/hd/libheapdump_jemalloc.so");
        assert_eq!(
            preload_list(ours, None, ""),
            "/opt/hd/libheapdump_preload.so"
        );
        assert_eq!(
            preload_list(
                ours,
                Some(comp),
                "/x/libmimalloc.so /old/libheapdump_preload.so:/y/libz.so"
            ),
            "/opt/hd/libheapdump_preload.so:/opt/hd/libheapdump_jemalloc.so:\
             /x/libmimalloc.so:/y/libz.so"
        );
    }
}
