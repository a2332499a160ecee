//! The injector where heapdump has none: on every architecture but
//! x86_64, `heapdump attach` refuses before touching the process, with a
//! message saying what works instead (the agent itself runs there:
//! `heapdump run`, `LD_PRELOAD`). The aarch64 injector (registers, system
//! call restart, `R_AARCH64_JUMP_SLOT`/`GLOB_DAT`) is not written: qemu-user,
//! on which this project can run aarch64 code, cannot trace a guest, so it
//! could not be tested here.

pub use crate::attach::injection::{Action, InjectError, Injected};

/// The refusal.
fn unsupported() -> InjectError {
    crate::attach::injection::architecture_refusal().expect("not x86_64")
}

/// Always false here: no library can be loaded into a running process.
pub fn has_dlopen(_pid: u32) -> bool {
    false
}

/// Refuses (see the module's comment).
pub fn inject(_pid: u32, _library: &str, _action: &Action) -> Result<Injected, InjectError> {
    Err(unsupported())
}

/// Why `ptrace` was refused, in words.
pub fn permission_hint(_pid: u32, e: nix::errno::Errno) -> String {
    e.to_string()
}
