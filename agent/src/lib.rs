//! `heapdump-agent`: the in-process side of heapdump.
//!
//! It records every live heap allocation of the process, with its stack
//! trace (CFI unwinding from `.eh_frame`, or the frame-pointer walk) and
//! thread, into two sealed shared-memory
//! regions (`heapdump.resources`, `heapdump.allocations`) that the
//! `heapdump` dumper maps read-only from outside. Use it as a Rust global
//! allocator ([`Agent`]), or through `libheapdump_preload.so` for any
//! program. It never allocates on its own path, never takes a lock a
//! reader holds, and turns every failure into a dropped-event count: it
//! must never be the reason a service crashes or hangs.
//!
//! Configuration is read from `HEAPDUMP_*` environment variables at start
//! (see [`config::Config`]).

#![deny(missing_docs)]

pub mod ablation;
pub mod cfi_unwind;
pub mod config;
pub mod fork_guard;
pub mod fork_inheritance;
mod global_alloc;
pub mod initial_exec_tls;
pub mod jemalloc_calls;
pub mod module_table;
pub mod recorder;
pub mod sampling;
pub mod seccomp_guard;
mod signal;
pub mod small_file;
pub mod stack_capture;
pub mod stack_memo;
pub mod thread_state;
pub mod thread_tables;
pub mod trace_shortcut;
pub mod young_policy;

pub use global_alloc::Agent;
pub use recorder::{request_snapshot, start, stats, Stats};
