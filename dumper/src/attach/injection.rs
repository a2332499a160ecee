//! What an injection is asked to do and what came of it: the types
//! `heapdump attach` shares with the injector of each architecture
//! ([`crate::attach::inject`]).

use std::time::Duration;

/// Why an injection did not happen (in each case the target was left as
/// it was).
#[derive(Debug, thiserror::Error)]
pub enum InjectError {
    /// The process (or every thread tried) exited.
    #[error("the process exited")]
    Gone,
    /// `ptrace` was refused.
    #[error("cannot trace the process: {0}")]
    Permission(String),
    /// No thread was at a safe point in time.
    #[error("no thread of the process was at a safe point ({0})")]
    NoSafePoint(String),
    /// The loader refused the library.
    #[error("the process could not load the agent library: {0}")]
    LoadFailed(String),
    /// A call into the process failed.
    #[error("{0}")]
    CallFailed(String),
    /// The agent's own entry point failed after its library was loaded:
    /// the library stays (it cannot be unloaded) and may have started.
    #[error("{0}")]
    AgentFailed(String),
    /// Reading or writing the target's memory outlived its deadline.
    #[error("{0}")]
    Stalled(String),
    /// Something the injector needs is missing.
    #[error("{0}")]
    Unsupported(String),
}

/// What the chosen thread is asked to do.
#[derive(Clone, Debug)]
pub enum Action {
    /// `dlopen(library)` then `heapdump_attach(settings)`.
    Attach {
        /// `HEAPDUMP_*=value` lines.
        settings: String,
    },
    /// `dlopen(library, RTLD_NOLOAD)` then `heapdump_detach()`.
    Detach,
}

/// What happened.
#[derive(Clone, Debug)]
pub struct Injected {
    /// The entry point's result (`heapdump_attach`: slots redirected or a
    /// refusal code; `heapdump_detach`: slots restored or -1).
    pub result: i64,
    /// The thread that ran the calls.
    pub thread: u32,
    /// How long that thread was stopped.
    pub stopped: Duration,
    /// The longest any other thread was stopped while being judged.
    pub others_stopped: Duration,
}

/// On an architecture heapdump has no injector for (every one but
/// x86_64), the refusal; `None` where `heapdump attach` works.
pub fn architecture_refusal() -> Option<InjectError> {
    (!cfg!(target_arch = "x86_64")).then(|| {
        InjectError::Unsupported(format!(
            "heapdump attach is implemented for x86_64 only, not {}: start the program under \
             the agent instead (heapdump run -- PROGRAM, or LD_PRELOAD=libheapdump_preload.so)",
            std::env::consts::ARCH
        ))
    })
}
