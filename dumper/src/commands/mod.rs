//! One module per `heapdump` command, each with its work (and, for the
//! commands whose flags `main.rs` parses, the options they take).

pub mod args;
pub mod attach;
pub mod cost_pacing;
pub mod demo;
pub mod descriptor_limit;
pub mod diff;
pub mod http_connections;
pub mod list;
pub mod process_shares;
pub mod report;
pub mod run;
pub mod serve;
pub mod slow_clients;
pub mod snapshot;
pub mod symbolize;
pub mod top;
pub mod watch;
