//! Access to an instrumented process: finding it and its regions, the
//! snapshot walk, selection by allocation time, and what the agent cannot
//! see in its program.

pub mod age;
pub mod discovery;
pub mod loopback_peer;
pub mod mappings;
pub mod maps_lines;
pub mod proc_text;
pub mod snapshot;
pub mod target_files;
pub mod user_space_mounts;
pub mod visibility;
