//! A Rust program with heapdump's `Agent` as global allocator and a known
//! allocation pattern (see `c/pattern.c`, of which it is the twin). Prints
//! `ready` when the pattern is in place, then waits for a line on stdin.
//! Subcommands: `pattern` (default), `churn N` (keeps allocating on two
//! threads until stdin closes), `full` (tiny table: fills it).

#[global_allocator]
static A: heapdump_agent::Agent = heapdump_agent::Agent::system();

include!("../rust_pattern_body.rs");
