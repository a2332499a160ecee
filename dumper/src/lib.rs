//! `heapdump`: the out-of-process side of the heapdump heap profiler.
//!
//! A process instrumented by `heapdump-agent` publishes its live heap in two
//! sealed memfd regions (see `heapdump-table`). This crate finds them through
//! `/proc/PID/fd` ([`discovery`]), maps them read-only, walks the live table
//! without ever stopping or blocking the target ([`snapshot`]), symbolizes
//! the stack traces out of process from `/proc/PID/maps` and each mapped
//! file's ELF/DWARF ([`maps`], [`symbolize`]), and writes the result in the
//! formats people use: text top-N ([`text`]), gzipped pprof in Go's heap
//! layout ([`pprof`]), a stable JSON schema ([`json_format`]), DHAT JSON
//! ([`dhat`]), folded stacks and SVG flamegraphs ([`flamegraph`]). Around
//! that sit the long-running modes: [`watch`] (a snapshot per request and
//! one at exit), [`serve`] (HTTP `/debug/pprof/heap`), [`diff`] (growth per
//! stack) and [`run`] (start a program under the preload agent).
//!
//! The dumper never writes to a region: every mapping it makes is
//! `PROT_READ`.

#![deny(missing_docs)]

pub mod age;
pub mod bench_workload;
pub mod demo;
pub mod dhat;
pub mod diff;
pub mod discovery;
pub mod fake_target;
pub mod flamegraph;
pub mod json_format;
pub mod maps;
pub mod output;
pub mod plumbing;
pub mod pprof;
pub mod run;
pub mod serve;
pub mod snapshot;
pub mod symbolize;
pub mod text;
pub mod top;
pub mod visibility;
pub mod watch;
