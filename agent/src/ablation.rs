//! Benchmark-only switches that leave out one part of the agent's work
//! per event, so `bench/ablate` can measure what each part costs on the
//! churn workload (the difference between the full agent and the agent
//! without that part, measured in the same run).
//!
//! Invariant: without the cargo feature `ablation` every switch is the
//! constant `false`, so the checks compile away and a normal build cannot
//! be told to record less than everything. With the feature, the switches
//! come from `HEAPDUMP_ABLATE` (a comma-separated list of part names) and
//! the snapshots of such a build are incomplete by design: it exists only
//! to be timed.

/// Leave out stack capture (walk, stack cache, interning): every block
/// gets one fixed trace.
pub const STACK: u8 = 1;
/// Leave out the live table (insert on allocation, remove on free).
pub const TABLE: u8 = 2;
/// Leave out the timestamp (the clock read).
pub const CLOCK: u8 = 4;
/// Leave out the per-stack cumulative counters.
pub const COUNTERS: u8 = 8;
/// Leave out everything after the hook's entry checks (interposition,
/// thread state and agent state only).
pub const ALL: u8 = 16;

/// Parses `HEAPDUMP_ABLATE` (`stack,table,clock,counters,all`); unknown
/// names are ignored.
pub fn parse(v: &[u8]) -> u8 {
    v.split(|b| *b == b',')
        .map(|p| match p.trim_ascii() {
            b"stack" => STACK,
            b"table" => TABLE,
            b"clock" => CLOCK,
            b"counters" => COUNTERS,
            b"all" => ALL,
            _ => 0,
        })
        .fold(0, |a, b| a | b)
}

/// True when `part` is left out (always false without the feature).
#[inline(always)]
pub fn off(mask: u8, part: u8) -> bool {
    cfg!(feature = "ablation") && mask & part != 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parts_parse_and_are_never_off_without_the_feature() {
        assert_eq!(parse(b"stack, table"), STACK | TABLE);
        assert_eq!(parse(b"clock,counters,bogus"), CLOCK | COUNTERS);
        assert_eq!(parse(b""), 0);
        assert_eq!(off(ALL, ALL), cfg!(feature = "ablation"));
    }
}
