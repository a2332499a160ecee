#!/usr/bin/env bash
# Soak test: an instrumented multi-threaded service under load for N
# minutes while heapdump snapshots it every 100 ms.
#
#   scripts/soak.sh [MINUTES] [INTERVAL_MS]        # default 10 min, 100 ms
#
# The service is `rust_pattern churn` (tests crate: the Agent as global
# allocator, two threads allocating and freeing without pause, ~20 000
# live blocks). Each snapshot is `heapdump snapshot PID --format json`
# (symbolized) and must be clean: exit 0, `partial` null, totals equal to
# the sums over sites. The script records the service's RSS (VmRSS) and
# the resident size of its heapdump memfd mappings (/proc/PID/smaps)
# against live blocks, checks the service is alive throughout and stops
# cleanly at the end (no deadlock), and prints a table of figures.
# Exit status: 0 when every check held.
set -euo pipefail
cd "$(dirname "$0")/.."
minutes=${1:-10}
interval_ms=${2:-100}
target_dir=${CARGO_TARGET_DIR:-target}
cargo build --release -q -p heapdump -p heapdump-tests
exec python3 - "$minutes" "$interval_ms" "$target_dir/release" <<'PY'
import json, os, subprocess, sys, tempfile, time

minutes, interval_ms, bindir = float(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
heapdump = os.path.join(bindir, "heapdump")
service = subprocess.Popen([os.path.join(bindir, "rust_pattern"), "churn"],
                           stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
ready = service.stdout.readline()
assert ready.startswith("ready"), ready
pid = service.pid

def memory():
    rss = 0
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) * 1024
    regions, current = 0, False
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:          # a mapping header
                current = "/memfd:heapdump." in line
            elif current and parts[0] == "Rss:":
                regions += int(parts[1]) * 1024
    return rss, regions

tmp = tempfile.mkdtemp(prefix="heapdump-soak-")
out = os.path.join(tmp, "snap.json")
taken = failures = 0
times, samples, problems = [], [], []
deadline = time.monotonic() + minutes * 60
next_at = time.monotonic()
while time.monotonic() < deadline:
    now = time.monotonic()
    if now < next_at:
        time.sleep(next_at - now)
    next_at += interval_ms / 1000
    if service.poll() is not None:
        problems.append(f"service exited with {service.returncode}")
        break
    t0 = time.monotonic()
    try:
        r = subprocess.run([heapdump, "snapshot", str(pid), "--format", "json", "-o", out],
                           capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        failures += 1
        problems.append("snapshot hung (over 60 s)")
        continue
    dt = time.monotonic() - t0
    taken += 1
    times.append(dt)
    why = None
    if r.returncode != 0:
        why = f"exit {r.returncode}: {r.stderr.strip()[:200]}"
    else:
        with open(out) as f:
            s = json.load(f)
        t = s["totals"]
        if s["partial"] is not None:
            why = f"partial: {s['partial']}"
        elif t["live_bytes"] != sum(x["live_bytes"] for x in s["sites"]):
            why = "live_bytes != sum over sites"
        elif t["live_blocks"] != sum(x["live_blocks"] for x in s["sites"]):
            why = "live_blocks != sum over sites"
        else:
            rss, regions = memory()
            samples.append((time.monotonic(), t["live_blocks"], rss, regions, s["dropped"]["total"]))
    if why:
        failures += 1
        if len(problems) < 10:
            problems.append(why)

alive = service.poll() is None
service.stdin.write("stop\n")
service.stdin.flush()
try:
    code = service.wait(timeout=60)
except subprocess.TimeoutExpired:
    service.kill()
    code = "hung (killed)"
    problems.append("service did not stop: deadlock?")
if code != 0:
    problems.append(f"service exit status {code}")
for p in (out,):
    if os.path.exists(p):
        os.remove(p)
os.rmdir(tmp)

def per_block(s):
    return s[3] / max(s[1], 1)
# "Start" figures after a warm-up (the service's rings fill in the first
# seconds): the first sample 10 s in, or a tenth of the run if shorter.
warm = samples[0][0] + min(10.0, (samples[-1][0] - samples[0][0]) / 10)
first = next(s for s in samples if s[0] >= warm)
last = samples[-1]
times.sort()
mib = lambda b: f"{b / 2**20:.1f} MiB"
rows = [
    ("duration", f"{minutes:g} min, a snapshot every {interval_ms} ms (start figures after warm-up)"),
    ("snapshots taken", taken),
    ("failures (error, partial, totals != sites)", failures),
    ("snapshot time median / p99 / max",
     f"{times[len(times)//2]*1e3:.0f} / {times[int(len(times)*0.99)]*1e3:.0f} / {times[-1]*1e3:.0f} ms"),
    ("live blocks start / end", f"{first[1]} / {last[1]}"),
    ("region resident start / end", f"{mib(first[3])} / {mib(last[3])}"),
    ("region bytes per live block start / end", f"{per_block(first):.1f} / {per_block(last):.1f}"),
    ("service RSS start / end / max", f"{mib(first[2])} / {mib(last[2])} / {mib(max(s[2] for s in samples))}"),
    ("service RSS growth", f"{(last[2] - first[2]) / 2**20:+.1f} MiB"),
    ("region growth", f"{(last[3] - first[3]) / 2**20:+.1f} MiB"),
    ("dropped events at end", last[4]),
    ("service alive until stopped, clean exit", f"{alive}, status {code}"),
]
w = max(len(r[0]) for r in rows)
print("\nheapdump soak")
for k, v in rows:
    print(f"  {k:<{w}}  {v}")
for p in problems:
    print("  PROBLEM:", p)
sys.exit(0 if failures == 0 and alive and code == 0 and not problems else 1)
PY
