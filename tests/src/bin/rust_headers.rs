//! `rust_pattern` with `Agent::system().with_block_headers()`: the same
//! allocation pattern, its records found through block headers.

#[global_allocator]
static A: heapdump_agent::Agent = heapdump_agent::Agent::system().with_block_headers();

include!("../rust_pattern_body.rs");
