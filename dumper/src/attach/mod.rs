//! `heapdump attach`: loading the agent into a process that is already
//! running, through heapdump's own `ptrace` injection (no debugger).
//!
//! - [`remote_unwind`]: a stopped thread's call chain, unwound from outside
//!   with the CFI of the files it maps;
//! - [`safe_point`]: whether that chain is clear of the allocator and the
//!   loader, so the thread may run `dlopen`;
//! - [`inject`]: stopping threads, running `dlopen` and the agent's entry
//!   point in the chosen one, and putting every register back.
//!
//! x86_64 Linux with glibc only; elsewhere [`inject`] is a refusal
//! (`inject_unsupported.rs`), so the rest of heapdump builds and runs on
//! every architecture.

#[cfg(target_arch = "x86_64")]
pub mod inject;
#[cfg(not(target_arch = "x86_64"))]
#[path = "inject_unsupported.rs"]
pub mod inject;
pub mod injection;
pub mod library_placement;
pub mod remote_unwind;
pub mod safe_point;
