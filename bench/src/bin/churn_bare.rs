//! Churn workload on the system allocator (baseline).
#[path = "../churn.rs"]
mod churn;

fn main() {
    churn::main();
}
