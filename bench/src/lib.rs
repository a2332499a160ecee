//! Benchmark workloads for heapdump (binaries `churn_bare`, `churn_agent`;
//! the driver script is `bench/churn`).
