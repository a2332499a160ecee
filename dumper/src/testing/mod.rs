//! Helpers behind `heapdump`'s hidden subcommands, for the tests and
//! benchmarks only: a fake instrumented process with a known (or damaged)
//! live set, and a benchmark workload. Not part of the product's surface.

pub mod bench_workload;
pub mod fake_target;
