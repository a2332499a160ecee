//! Churn workload under mod-alloc (`ModAlloc` with its `backtraces`
//! feature: per-call-site counts from a frame-pointer walk of 8 frames):
//! writes `dhat-heap.json` (its DHAT-compatible report, symbolized) in the
//! working directory at exit.
#[path = "../../../src/churn.rs"]
mod churn;

#[global_allocator]
static A: mod_alloc::ModAlloc = mod_alloc::ModAlloc::new();

fn main() {
    churn::main();
    A.write_dhat_json(std::path::Path::new("dhat-heap.json"))
        .expect("write dhat-heap.json");
}
