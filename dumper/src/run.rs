//! `heapdump run`: start a program under the preload agent
//! (`LD_PRELOAD=libheapdump_preload.so`), pass its exit status through.
//!
//! The agent goes first in `LD_PRELOAD` (so it wraps whatever allocator
//! comes after it: the program's own, or a user's preloaded one, which are
//! kept in their order after it), followed by `libheapdump_jemalloc.so`
//! when the program links jemalloc. Children inherit the variable. Before
//! starting, the program's ELF files are read for what the agent could not
//! see ([`crate::visibility`]), which is said on stderr.
//!
//! The preload library is found, in order: `$HEAPDUMP_PRELOAD`; next to
//! the `heapdump` executable; in the parent directory (cargo's `deps/` and
//! `examples/` layouts put binaries one level below the library).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};

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
        for _ in 0..2 {
            let Some(d) = dir else { break };
            let cand = d.join(PRELOAD_NAME);
            if cand.is_file() {
                return Ok(cand);
            }
            looked.push(d.display().to_string());
            dir = d.parent().map(Path::to_path_buf);
        }
    }
    Err(RunError::PreloadNotFound {
        looked: looked.join(", "),
    })
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
/// what the agent will not see in the program (see [`crate::visibility`]).
pub fn command(
    argv: &[String],
    env: &AgentEnv,
) -> Result<(Command, crate::visibility::ProgramInfo), RunError> {
    let (prog, args) = argv.split_first().ok_or(RunError::NoCommand)?;
    let preload = find_preload(env.preload.as_deref())?;
    let info = crate::visibility::resolve_program(prog)
        .map(|p| crate::visibility::inspect_program(&p))
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
    if let Some(s) = &env.signal {
        cmd.env("HEAPDUMP_SIGNAL", s);
    }
    if let Some(n) = env.max_frames {
        cmd.env("HEAPDUMP_MAX_FRAMES", n.to_string());
    }
    Ok((cmd, info))
}

/// Starts `argv` under the agent with the given stdio.
pub fn spawn(argv: &[String], env: &AgentEnv, piped: bool) -> Result<Child, RunError> {
    let (mut cmd, info) = command(argv, env)?;
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
