//! Churn workload with heapdump's `Agent` as global allocator, its blocks
//! carrying headers that name their records (`Agent::with_block_headers`).
#[path = "../churn.rs"]
mod churn;

#[global_allocator]
static A: heapdump_agent::Agent = heapdump_agent::Agent::system().with_block_headers();

fn main() {
    churn::main_reporting(Some(|| {
        let s = heapdump_agent::stats();
        (s.enabled, s.total_allocs)
    }));
}
