#!/usr/bin/env bash
# Compatibility: real programs nobody here wrote, from Debian's packages,
# run bare and under the preload agent (`heapdump run`). Each must exit
# with the same status and print exactly the same output; the longer-running
# ones (a python3 and a node process holding memory, redis-server) are also
# snapshotted while they run, and the snapshot must be clean and hold the
# memory they were told to keep.
#
#   scripts/compat.sh [--release]
#
# Prints a table (also written to target/compat.md) and exits non-zero if
# any program behaved differently. CI runs it; the programs are installed
# by .ci/run (python3, nodejs, perl, git, sqlite3, g++, default-jre-headless,
# curl, redis-server; and the services of scripts/compat_services.py:
# varnish, memcached, libmemcached-tools, bind9, bind9-dnsutils, nginx,
# apache2-utils, postgresql).
set -euo pipefail
cd "$(dirname "$0")/.."
profile=debug
if [ "${1:-}" = "--release" ]; then
    profile=release
    cargo build --release -q -p heapdump -p heapdump-preload -p heapdump-preload-jemalloc
else
    cargo build -q -p heapdump -p heapdump-preload -p heapdump-preload-jemalloc
fi
bindir="$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')/$profile"
status=0
python3 - "$bindir" <<'PY' || status=1
import json, os, shutil, subprocess, sys, tempfile

bindir = os.path.abspath(sys.argv[1])
heapdump = os.path.join(bindir, "heapdump")
preload = os.path.join(bindir, "libheapdump_preload.so")
work = tempfile.mkdtemp(prefix="heapdump-compat-")
cpp = os.path.join(work, "hello.cpp")
with open(cpp, "w") as f:
    f.write('#include <map>\n#include <string>\n#include <iostream>\n'
            'int main(){std::map<std::string,int> m; for(int i=0;i<1000;i++) m[std::to_string(i)]=i;'
            ' std::cout << m.size() << "\\n";}\n')

# name, argv, compare stderr too (programs that print to stderr only)
SHORT = [
    ("python3", ["/usr/bin/python3", "-c",
                 "import json,hashlib; d=[str(i)*10 for i in range(100000)];"
                 "print(len(json.dumps(d)), hashlib.sha256(''.join(d).encode()).hexdigest())"], False),
    ("node", ["node", "-e",
              "const a=[];for(let i=0;i<200000;i++)a.push({i,s:'x'+i});"
              "console.log(JSON.stringify(a).length)"], False),
    ("perl", ["perl", "-e", 'my %h; $h{$_} = $_ x 3 for 1..100000; print scalar(keys %h), "\\n"'], False),
    ("git", ["sh", "-c", "rm -rf r && /usr/bin/git init -q r && cd r && echo hi > f && /usr/bin/git add f && "
             "/usr/bin/git -c user.name=a -c user.email=a@b commit -qm first && /usr/bin/git log --format=%s"], False),
    ("sqlite3", ["sqlite3", ":memory:",
                 "create table t(a); with recursive c(x) as (select 1 union all select x+1 from c where x<100000) "
                 "insert into t select x from c; select count(*), sum(a) from t;"], False),
    ("g++ (cc1plus)", ["sh", "-c", f"g++ -O2 -o hello {cpp} && ./hello"], False),
    ("java -version", ["java", "-version"], True),
    ("curl --version", ["curl", "--version"], False),
    ("redis-server --version", ["redis-server", "--version"], False),
]

def run(argv, agent):
    cmd = ([heapdump, "run", "--"] if agent else []) + argv
    env = dict(os.environ, HEAPDUMP_PRELOAD=preload)
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, timeout=600, env=env)
    return p.returncode, p.stdout, p.stderr

rows, failed = [], 0
for name, argv, with_stderr in SHORT:
    if shutil.which(argv[0]) is None and not os.path.exists(argv[0]):
        rows.append((name, "-", "-", "MISSING", "")); failed += 1; continue
    b = run(argv, False)
    a = run(argv, True)
    same = b[0] == a[0] and b[1] == a[1] and (not with_stderr or b[2] == a[2])
    ok = same and b[0] == 0
    detail = "" if ok else f"stdout bare {b[1][:60]!r} agent {a[1][:60]!r} stderr {a[2][-200:]!r}"
    rows.append((name, str(b[0]), str(a[0]), "same" if same else "DIFFERENT", detail))
    failed += not ok

def snapshot(pid):
    out = os.path.join(work, f"snap-{pid}.json")
    p = subprocess.run([heapdump, "snapshot", str(pid), "--format", "json", "-o", out],
                       capture_output=True, text=True, timeout=300)
    if p.returncode != 0:
        return None, p.stderr.strip()
    s = json.load(open(out))
    return s, ""

def held_bound(s, count, size):
    """The least live-byte figure a snapshot may show for `count` held
    blocks of `size` bytes: all of them in exact mode; in sampled mode
    (HEAPDUMP_SAMPLE_RATE in the environment) the estimate less 6 standard
    deviations of its sampling error (each block sampled with probability
    p = 1 - exp(-size/R) and weighted 1/p, so the variance is
    count * size^2 * (1 - p) / p): a false failure has odds below 1e-8."""
    held = count * size
    sampling = s.get("sampling") if s else None
    if not sampling:
        return held
    import math
    p = 1 - math.exp(-size / sampling["rate_bytes"])
    return held - 6 * math.sqrt(count * size * size * (1 - p) / p)

# Longer-running programs: started under the agent, snapshotted while they
# hold a known amount of memory, then released; they must exit cleanly.
LONG = [
    ("python3 (holds 20000 x 10 KiB)", ["/usr/bin/python3", "-c",
      "import sys\nkeep=[bytearray(10240) for _ in range(20000)]\nprint('ready', flush=True)\nsys.stdin.readline()"],
     (20000, 10240)),
    ("node (holds 200 x 1 MiB)", ["node", "-e",
      "const keep=[];for(let i=0;i<200;i++)keep.push(Buffer.alloc(1<<20,1));console.log('ready');"
      "process.stdin.once('data',()=>process.exit(0));"],
     (200, 1 << 20)),
]
for name, argv, (count, size) in LONG:
    env = dict(os.environ, LD_PRELOAD=preload)
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    line = p.stdout.readline()
    s, err = snapshot(p.pid) if line.startswith("ready") else (None, f"printed {line!r}")
    p.stdin.write("go\n"); p.stdin.flush()
    code = p.wait(timeout=300)
    live = s["totals"]["live_bytes"] if s else 0
    bound = held_bound(s, count, size)
    ok = s is not None and s["partial"] is None and live >= bound and code == 0
    rows.append((name, "-", str(code), f"live {live / 2**20:.1f} MiB",
                 "" if ok else f"snapshot: {err or (s and s['partial']) or ''} "
                               f"(at least {bound / 2**20:.1f} MiB expected)"))
    failed += not ok

# redis-server: snapshot while it holds 100 000 keys (the tests load it
# harder; see dumper/tests/real_services.rs).
if shutil.which("redis-server"):
    import socket
    sock = socket.socket(); sock.bind(("127.0.0.1", 0)); port = sock.getsockname()[1]; sock.close()
    env = dict(os.environ, LD_PRELOAD=preload)
    r = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                          "--enable-debug-command", "local", "--logfile", ""],
                         stdout=subprocess.PIPE, text=True, env=env)
    for line in r.stdout:
        if "Ready to accept connections" in line:
            break
    cli = ["redis-cli", "-p", str(port)]
    subprocess.run(cli + ["DEBUG", "POPULATE", "100000"], check=True, capture_output=True)
    s, err = snapshot(r.pid)
    subprocess.run(cli + ["SHUTDOWN", "NOSAVE"], capture_output=True)
    code = r.wait(timeout=300)
    live = s["totals"]["live_bytes"] if s else 0
    # At least 5 MiB of keys and values, in blocks of ~128 bytes. Sampled,
    # so few blocks are drawn (about one per rate's bytes) that the bound
    # less 6 standard deviations may be below zero: then only a clean
    # snapshot is asked for.
    bound = held_bound(s, (5 << 20) // 128, 128)
    ok = s is not None and s["partial"] is None and code == 0 and live >= bound
    rows.append(("redis-server (100 000 keys)", "-", str(code), f"live {live / 2**20:.1f} MiB",
                 "" if ok else f"snapshot: {err} (at least {bound / 2**20:.1f} MiB expected)"))
    failed += not ok
else:
    rows.append(("redis-server", "-", "-", "MISSING", "")); failed += 1

table = ["| program | exit bare | exit under agent | result | detail |", "|---|---|---|---|---|"]
table += [f"| {' | '.join(r)} |" for r in rows]
text = "\n".join(table)
print(text)
os.makedirs("target", exist_ok=True)
with open("target/compat.md", "w") as f:
    f.write(text + "\n")
shutil.rmtree(work, ignore_errors=True)
print(f"{len(rows) - failed} passed, {failed} failed")
sys.exit(1 if failed else 0)
PY

# Long-running services (varnish, memcached, named, nginx, postgres, a
# program that closes every fd and forks), bare and under the agent in
# both modes, loaded and snapshotted (scripts/compat_services.py).
scripts/compat_services.py "$bindir" | tee -a target/compat.md || status=1
exit $status
