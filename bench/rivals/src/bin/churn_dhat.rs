//! Churn workload under dhat-rs (`dhat::Alloc`, `Profiler::new_heap()`):
//! writes `dhat-heap.json` in the working directory at exit.
#[path = "../../../src/churn.rs"]
mod churn;

#[global_allocator]
static A: dhat::Alloc = dhat::Alloc;

fn main() {
    let _profiler = dhat::Profiler::new_heap();
    churn::main();
}
