#!/usr/bin/env bash
# Snapshot benchmark against the real agent: `heapdump __bench-workload`
# (a hidden subcommand) runs under the preload agent and holds BLOCKS live
# blocks (default 1 M, 16-79 bytes) allocated from STACKS distinct call
# stacks (default 10 000, recursion 3-12 frames deep). Each snapshot is a
# fresh `heapdump snapshot` process (cold symbolization cache), with
# heapdump's own timings on stderr: table walk, symbolization (with
# plumbing removal), total (including rendering and writing the file) and
# the dumper's peak RSS (VmHWM; it counts the pages of the target's table
# that the walk reads through the shared mapping).
#
#   dumper/scripts/bench-snapshot.sh [BLOCKS [STACKS]]
set -euo pipefail
blocks=${1:-1000000}
stacks=${2:-10000}
cd "$(dirname "$0")/../.."
cargo build --release -q -p heapdump -p heapdump-preload
target_dir=${CARGO_TARGET_DIR:-target}
bin="$target_dir/release/heapdump"
preload="$target_dir/release/libheapdump_preload.so"
work=$(mktemp -d)
pid=
trap 'exec 9>&- 2>/dev/null || true; [ -n "$pid" ] && kill "$pid" 2>/dev/null; rm -rf "$work"' EXIT
mkfifo "$work/in"
LD_PRELOAD="$preload" "$bin" __bench-workload "$blocks" "$stacks" <"$work/in" >"$work/out" &
pid=$!
exec 9>"$work/in"
# Wait for the workload's "ready" line (bounded: filling 1 M blocks takes
# well under a second; the bound is only a hang guard).
for _ in $(seq 1 1200); do
  grep -q ready "$work/out" 2>/dev/null && break
  kill -0 "$pid" 2>/dev/null || { echo "workload died" >&2; exit 1; }
  sleep 0.1
done
grep -q ready "$work/out" || { echo "workload not ready" >&2; exit 1; }
echo "workload pid $pid: $(cat "$work/out")"
echo "== symbolized pprof (3 runs)"
for _ in 1 2 3; do
  "$bin" snapshot "$pid" --timings -o "$work/heap.pb.gz" 2>&1 | grep timings
done
echo "== symbolized JSON"
"$bin" snapshot "$pid" --timings -o "$work/heap.json" 2>&1 | grep timings
echo "== unsymbolized JSON"
"$bin" snapshot "$pid" --timings --no-symbolize -o "$work/heap-raw.json" 2>&1 | grep timings
