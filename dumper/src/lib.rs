//! `heapdump`: the out-of-process side of the heapdump heap profiler.
//!
//! A process instrumented by `heapdump-agent` publishes its live heap in two
//! sealed memfd regions (see `heapdump-table`). This crate is grouped by
//! role, in the order a snapshot flows through it:
//!
//! - [`process`]: finding instrumented processes and their regions through
//!   `/proc/PID/fd` ([`process::discovery`]), the walk that turns a live
//!   table into a [`process::snapshot::Snapshot`] without ever stopping or
//!   blocking the target, selection by allocation time ([`process::age`]),
//!   and what the agent cannot see in a program ([`process::visibility`]);
//! - [`symbolization`]: `/proc/PID/maps` with build IDs
//!   ([`symbolization::maps`]), ELF/DWARF symbolization with inlined frames
//!   and separate debug files ([`symbolization::symbolizer`]), and the
//!   allocator frames trimmed from each stack ([`symbolization::plumbing`]);
//! - [`formats`]: text, pprof in Go's heap layout, the stable JSON schema,
//!   DHAT, folded stacks and SVG flamegraphs;
//! - [`attach`]: loading the agent into a process that is already running
//!   (`heapdump attach`), through heapdump's own `ptrace` injection at a
//!   thread chosen by unwinding its stack from outside;
//! - [`commands`]: one module per `heapdump` command (`list`, `snapshot`,
//!   `watch`, `top`, `serve`, `diff`, `symbolize`, `run`, `demo`), each with
//!   its flags and its work; `main.rs` only parses and dispatches.
//!
//! The dumper never writes to a region: every mapping it makes is
//! `PROT_READ`.

#![deny(missing_docs)]

pub mod agent_bundle;
pub mod attach;
pub mod build_info;
pub mod commands;
pub mod formats;
pub mod process;
pub mod symbolization;
#[doc(hidden)]
pub mod testing;
