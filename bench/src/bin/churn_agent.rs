//! Churn workload with heapdump's `Agent` as global allocator.
#[path = "../churn.rs"]
mod churn;

#[global_allocator]
static A: heapdump_agent::Agent = heapdump_agent::Agent::system();

fn main() {
    churn::main_reporting(Some(|| {
        let s = heapdump_agent::stats();
        (s.enabled, s.total_allocs)
    }));
}
