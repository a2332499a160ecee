#!/usr/bin/env bash
# Snapshot benchmark: a fake target with N live blocks (default 1 M) over
# ~100 stacks, snapshotted a few times as symbolized pprof and as
# unsymbolized JSON; prints heapdump's own timings (table walk,
# symbolization, total, dumper peak RSS).
#
#   dumper/scripts/bench-snapshot.sh [BLOCKS]
set -euo pipefail
blocks=${1:-1000000}
cd "$(dirname "$0")/../.."
cargo build --release -q -p heapdump
target_dir=${CARGO_TARGET_DIR:-target}
bin="$target_dir/release/heapdump"
work=$(mktemp -d)
trap 'exec 9>&- 2>/dev/null || true; kill "$pid" 2>/dev/null || true; rm -rf "$work"' EXIT
mkfifo "$work/in"
"$bin" __fake-target --blocks "$blocks" <"$work/in" >"$work/out" &
pid=$!
exec 9>"$work/in"
# Wait for the target's "ready" line (bounded).
for _ in $(seq 1 600); do
  grep -q ready "$work/out" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || { echo "target died" >&2; exit 1; }
  sleep 0.1
done
grep -q ready "$work/out" || { echo "target not ready" >&2; exit 1; }
echo "target pid $pid with $blocks extra live blocks"
for i in 1 2 3; do
  "$bin" snapshot "$pid" --timings -o "$work/heap.pb.gz" 2>&1 | grep timings
done
"$bin" snapshot "$pid" --timings --no-symbolize -o "$work/heap.json" 2>&1 | grep timings
