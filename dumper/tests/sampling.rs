//! Sampled mode (`HEAPDUMP_SAMPLE_RATE`): a program with known sites (many
//! small blocks, many medium, a few huge, and churn that is all freed)
//! snapshotted under sampling: each site's estimate lies within six
//! standard deviations of the truth (derived from the sampling variance
//! below), huge blocks are exact, freed churn is never live, the snapshot
//! says it is sampled, and `go tool pprof` reads a profile whose period is
//! the rate and whose values are already scaled.
//!
//! Flakiness: `HEAPDUMP_SAMPLE_SEED` fixes the random source, so a run is
//! deterministic. For any seed, each bound fails with probability below
//! 2e-9 (a normal tail at 6 sd; each estimate sums ~200 independent
//! weighted samples, close enough to normal), about 1e-8 for the test.

mod common;

use std::process::Command;

use common::{go_available, go_pprof, heapdump, read_json, stderr, TempDir};
use heapdump_tests::{compile_c, preload_lib, Target};
use serde_json::Value;

const RATE: u64 = 64 << 10;

/// The live (blocks, bytes) estimate of the site whose first frame is
/// `leaf`, or zeros.
fn site(j: &Value, leaf: &str) -> (u64, u64) {
    j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == leaf)
        .map(|s| {
            (
                s["live_blocks"].as_u64().unwrap(),
                s["live_bytes"].as_u64().unwrap(),
            )
        })
        .fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1))
}

/// Standard deviation of the estimated count of `n` blocks of `size`:
/// each is kept with p = 1 - exp(-size/R) and weighted 1/p, so the
/// estimate's variance is n (1 - p) / p (bytes: times size^2).
fn sd(n: u64, size: u64) -> f64 {
    let p = -(-(size as f64) / RATE as f64).exp_m1();
    (n as f64 * (1.0 - p) / p).sqrt()
}

fn within(site: (u64, u64), n: u64, size: u64, name: &str) {
    let bound = 6.0 * sd(n, size);
    assert!(
        (site.0 as f64 - n as f64).abs() <= bound + 1.0,
        "{name}: {} blocks estimated for {n} (6 sd = {bound:.0})",
        site.0
    );
    assert!(
        (site.1 as f64 - (n * size) as f64).abs() <= (bound + 1.0) * size as f64,
        "{name}: {} bytes estimated for {}",
        site.1,
        n * size
    );
}

/// Starts `tests/c/NAME` under the preload agent sampled at [`RATE`] with
/// `seed`, and snapshots it as JSON: the running target, its pid, the
/// snapshot's directory and the snapshot.
fn sampled_snapshot(name: &str, seed: &str) -> (Target, String, TempDir, Value) {
    let exe = compile_c(name);
    let mut cmd = Command::new(&exe);
    cmd.env("LD_PRELOAD", preload_lib())
        .env("HEAPDUMP_SAMPLE_RATE", "64KiB")
        .env("HEAPDUMP_SAMPLE_SEED", seed);
    let target = Target::spawn(cmd);
    let pid = target.pid().to_string();
    let dir = TempDir::new(name);
    let json = dir.str("s.json");
    let out = heapdump(&["snapshot", &pid, "--format", "json", "-o", &json]);
    assert!(out.status.success(), "{}", stderr(&out));
    let j = read_json(std::path::Path::new(&json));
    (target, pid, dir, j)
}

#[test]
fn sampled_estimates_are_within_their_variance_and_freed_churn_is_never_live() {
    let (mut target, pid, dir, j) = sampled_snapshot("sampled", "42");
    assert_eq!(j["sampling"]["rate_bytes"], RATE);
    assert_eq!(j["sampling"]["estimated"], true);
    assert!(j["partial"].is_null());

    within(site(&j, "site_small"), 200_000, 64, "site_small");
    within(site(&j, "site_medium"), 2000, 8192, "site_medium");
    // 4 MiB blocks at R = 64 KiB: p = 1 - exp(-64), every one sampled, w = 1.
    assert_eq!(site(&j, "site_huge"), (5, 5 * (4 << 20)));
    assert_eq!(site(&j, "site_churn"), (0, 0), "freed churn counted live");
    // The churn is counted cumulatively (100 000 x 1000 bytes, estimated).
    let churn_alloc: u64 = j["sites"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|s| s["frames"][0]["function"] == "site_churn")
        .map(|s| s["alloc_blocks"].as_u64().unwrap())
        .sum();
    let bound = 6.0 * sd(100_000, 1000) + 1.0;
    assert!(
        (churn_alloc as f64 - 100_000.0).abs() <= bound,
        "churn allocations estimated {churn_alloc}"
    );

    // The text report says so; pprof carries the rate as its period and
    // the scaled values.
    let text = heapdump(&["snapshot", &pid]);
    assert!(
        String::from_utf8_lossy(&text.stdout).contains("sampled: one allocation per 64.0 KiB"),
        "{}",
        String::from_utf8_lossy(&text.stdout)
    );
    let pb = dir.str("s.pb.gz");
    let out = heapdump(&["snapshot", &pid, "-o", &pb]);
    assert!(out.status.success(), "{}", stderr(&out));
    if go_available() {
        let raw = go_pprof(&["-raw", &pb]);
        assert!(raw.contains("PeriodType: space bytes"), "{raw}");
        assert!(raw.contains(&format!("Period: {RATE}")), "{raw}");
        let top = go_pprof(&["-top", "-unit=B", "-sample_index=inuse_space", &pb]);
        let total = j["totals"]["live_bytes"].as_u64().unwrap();
        assert!(top.contains(&format!("{total}B total")), "{top}");
    }
    target.send("done");
    assert!(target.finish().success());
}

/// C++ `new` under sampling: the agent's `new` forwards to libstdc++'s,
/// whose `malloc` passes through the agent's `malloc` hook as well (which
/// counts down too, see `sampling`); each block must still be sampled with
/// probability `p = 1 - exp(-s/R)`, or the estimate drifts by far more
/// than 6 sd (deciding twice would give `p^2`, about 1 % of the truth at
/// this size; keeping a sample point reached inside `new`'s `malloc` gave
/// 3x the truth). Same false-failure bound as above.
#[test]
fn sampled_cxx_new_estimates_are_unbiased() {
    let (mut target, _pid, _dir, j) = sampled_snapshot("sampled_cxx", "7");
    within(site(&j, "site_new()"), 100_000, 512, "site_new");
    assert_eq!(
        site(&j, "site_new_churn()"),
        (0, 0),
        "freed churn counted live"
    );
    target.send("done");
    assert!(target.finish().success());
}
