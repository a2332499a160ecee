#!/usr/bin/env bash
# CI: runs every fuzz target for a short time (default 20 s each) from the
# stored corpus and seeds, writing new inputs to a scratch directory so the
# checkout is left as it was. Fails on any crash, hang or sanitizer report.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-20}
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT
cargo fuzz build -a
# A failed listing must fail CI, not fuzz nothing: `for t in $(...)` would
# ignore its exit status.
targets=$(cargo fuzz list)
[ -n "$targets" ] || { echo "fuzz/ci.sh: cargo fuzz list found no targets" >&2; exit 1; }
for t in $targets; do
    echo "== fuzz $t for ${secs}s"
    mkdir -p "$scratch/$t" "corpus/$t"
    cargo fuzz run -a "$t" "$scratch/$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048
done
