#!/usr/bin/env python3
"""Long-running services from Debian's packages, each started bare, under
`heapdump run` in exact mode and in sampled mode, and started bare then
attached with `heapdump attach` once it serves (every process of it), loaded on loopback with
a bounded load, checked to serve exactly as bare (every request answered,
the same answers), and, under the agent, every one of its instrumented
processes snapshotted while it serves.

    scripts/compat_services.py BINDIR [SERVICE...]

BINDIR holds `heapdump` and `libheapdump_preload.so`. Prints one table row
per service and mode, and `N passed, M failed`; exits non-zero when any
row failed. Services: varnish (in front of a tiny Python backend, loaded
with ab), memcached (memcslap), named (a test zone queried with dig),
nginx (ab), postgres (pgbench, as the postgres user), and a program that
closes every descriptor and forks (tests/c/closefds_fork.c).
"""
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

BINDIR = os.path.abspath(sys.argv[1])
HEAPDUMP = os.path.join(BINDIR, "heapdump")
PRELOAD = os.path.join(BINDIR, "libheapdump_preload.so")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ATTACH = {"attach": True}  # the mode whose processes start bare and are attached
MODES = [("bare", None), ("exact", {}), ("sampled 512KiB", {"HEAPDUMP_SAMPLE_RATE": "512KiB"}),
         ("attached", ATTACH)]
# In attached mode: the pids attached, and what failed.
ATTACHED = {"on": False, "pids": [], "errors": []}
# What the last load client wrote to stderr (shown in a failed row: the
# service's own log says nothing about a query the client saw fail).
CLIENT = {"stderr": ""}
GUARD = 120  # seconds: a hang guard, never a synchronisation


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    return port


def wait_port(port, proc, what):
    """Until something accepts on 127.0.0.1:port (bounded); False if the
    process died first."""
    deadline = time.monotonic() + GUARD
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            return False
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return True
        except OSError:
            time.sleep(0.05)
    raise RuntimeError(f"{what}: port {port} never opened")


def descendants(root):
    """`root` and every process below it (by parent pid: postgres's
    postmaster starts a session of its own, so sessions would miss it)."""
    parent = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = open(f"/proc/{d}/stat").read()
        except OSError:
            continue
        parent[int(d)] = int(stat[stat.rfind(")") + 2:].split()[1])
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += [c for c, pp in parent.items() if pp == pid]
    return out


def alive(pid):
    """True while `pid` runs (not gone, not a zombie); a process may exit
    while it is read."""
    try:
        stat = open(f"/proc/{pid}/stat").read()
    except OSError:
        return False
    return stat[stat.rfind(")") + 2:].split()[0] != "Z"


def instrumented(pid):
    try:
        return any(" rw-s " in l and "/memfd:heapdump.allocations" in l
                   for l in open(f"/proc/{pid}/maps"))
    except OSError:
        return False


# Snapshots are written here, a directory of our own: root's heapdump
# refuses to write into a service's directory owned by another user (the
# postgres rows chown theirs to postgres).
SNAPDIR = tempfile.mkdtemp(prefix="heapdump-svc-snaps-")


def snapshot_all(root, work, peak=False):
    """Snapshots every instrumented process under `root` (with `peak`, also
    `snapshot --peak`, checked against it): (count, errors, live bytes of
    the largest)."""
    pids = [p for p in descendants(root) if instrumented(p)]
    errors, largest = [], 0
    for pid in pids:
        out = os.path.join(SNAPDIR, f"snap-{pid}.json")
        p = subprocess.run([HEAPDUMP, "snapshot", str(pid), "-o", out], capture_output=True,
                           text=True, timeout=GUARD)
        if p.returncode != 0:
            if os.path.exists(f"/proc/{pid}"):
                errors.append(f"pid {pid}: {p.stderr.strip()[:300]}")
            continue
        s = json.load(open(out))
        if s.get("partial"):
            errors.append(f"pid {pid}: partial: {s['partial']}")
        largest = max(largest, s["totals"]["live_bytes"])
        if peak:
            errors += peak_check(pid, work, s)
    return len(pids), errors, largest


def peak_check(pid, work, now):
    """`snapshot --peak` of `pid` answers, and gives the same one peak as
    the snapshot just taken (within the stated tolerance): the errors."""
    out = os.path.join(SNAPDIR, f"peak-{pid}.json")
    p = subprocess.run([HEAPDUMP, "snapshot", str(pid), "--peak", "-o", out],
                       capture_output=True, text=True, timeout=GUARD)
    if p.returncode != 0:
        return [f"pid {pid}: --peak: {p.stderr.strip()[:300]}"] if alive(pid) else []
    s = json.load(open(out))
    at, tol = s["peak"]["live_bytes"], s["peak"]["tolerance"]
    figure = s["totals"]["peak_bytes"]
    curve = max(pt["live_bytes"] for pt in s["timeline"])
    errors = []
    if not (at <= figure <= at + tol) or curve != figure:
        errors.append(f"pid {pid}: --peak {at} (tolerance {tol}), peak {figure}, curve {curve}")
    # The heap only grows between the two snapshots' peaks.
    if figure + tol < now["totals"]["peak_bytes"]:
        errors.append(f"pid {pid}: the peak fell from {now['totals']['peak_bytes']} to {figure}")
    return errors


def serving(proc):
    """Called by each service once it serves, before its load: in attached
    mode, attaches heapdump to every process of it."""
    if not ATTACHED["on"]:
        return
    for pid in descendants(proc.pid):
        if not alive(pid) or instrumented(pid):
            continue
        r = subprocess.run([HEAPDUMP, "attach", str(pid), "--library", PRELOAD],
                           capture_output=True, text=True, timeout=GUARD)
        if r.returncode == 0:
            ATTACHED["pids"].append(pid)
        elif alive(pid):
            ATTACHED["errors"].append(f"attach {pid}: {r.stderr.strip()[:300]}")
    if not ATTACHED["pids"]:
        ATTACHED["errors"].append("no process attached")


def detach_all():
    """Detaches every attached process still running; the errors."""
    errors = []
    for pid in ATTACHED["pids"]:
        if not alive(pid):
            continue
        r = subprocess.run([HEAPDUMP, "detach", str(pid)], capture_output=True, text=True,
                           timeout=GUARD)
        if r.returncode != 0 and alive(pid):
            errors.append(f"detach {pid}: {r.stderr.strip()[:300]}")
    return errors


def start(argv, mode_env, work, user=None, cwd=None):
    """Starts argv bare or under `heapdump run` in a session of its own
    (attached mode starts it bare; `serving` attaches)."""
    env = dict(os.environ, HEAPDUMP_PRELOAD=PRELOAD)
    env.pop("LD_PRELOAD", None)
    if mode_env is ATTACH:
        mode_env = None
    if mode_env is not None:
        env.update(mode_env)
        argv = [HEAPDUMP, "run", "--"] + argv
    if user:
        argv = ["runuser", "-u", user, "--", "env",
                *[f"{k}={v}" for k, v in env.items() if k.startswith("HEAPDUMP_")]] + argv
    log = open(os.path.join(work, "service.log"), "a")
    return subprocess.Popen(argv, env=env, cwd=cwd or work, stdin=subprocess.DEVNULL,
                            stdout=log, stderr=log, start_new_session=True)


def stop(proc):
    tree = descendants(proc.pid)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    # Whatever is left of the tree (a postmaster waits for its children).
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and any(alive(p) for p in tree):
        time.sleep(0.05)
    for pid in tree:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if proc.poll() is None:
        proc.wait(timeout=30)


def ab(port, path, n=2000):
    """ab's result: (complete, failed, non-2xx) or an error string."""
    p = subprocess.run(["ab", "-n", str(n), "-c", "8", f"http://127.0.0.1:{port}{path}"],
                       capture_output=True, text=True, timeout=GUARD)
    get = lambda key: next((int(l.split()[-1]) for l in p.stdout.splitlines()  # noqa: E731
                            if l.startswith(key)), None)
    return (get("Complete requests:"), get("Failed requests:"), get("Non-2xx responses:") or 0)


# ------------------------------------------------------------ services

def varnish(work, mode_env):
    os.makedirs(os.path.join(work, "www"), exist_ok=True)
    with open(os.path.join(work, "www", "page.html"), "w") as f:
        f.write("hello from the backend\n" * 100)
    bport, port = free_port(), free_port()
    backend = subprocess.Popen([sys.executable, "-m", "http.server", str(bport), "--bind",
                                "127.0.0.1", "--directory", os.path.join(work, "www")],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               start_new_session=True)
    try:
        wait_port(bport, backend, "backend")
        p = start(["varnishd", "-F", "-a", f"127.0.0.1:{port}", "-b", f"127.0.0.1:{bport}",
                   "-n", os.path.join(work, "varnish"), "-s", "malloc,32m", "-T", "none"],
                  mode_env, work)
        try:
            if not wait_port(port, p, "varnishd"):
                return None, "exited before listening"
            serving(p)
            result = ab(port, "/page.html")
            return result, p
        except Exception:
            stop(p)
            raise
    finally:
        stop(backend)


def memcached(work, mode_env):
    port = free_port()
    p = start(["memcached", "-p", str(port), "-l", "127.0.0.1", "-U", "0", "-u", "root",
               "-m", "64", "-t", "2"], mode_env, work)
    if not wait_port(port, p, "memcached"):
        return None, "exited before listening"
    serving(p)
    r = subprocess.run(["memcslap", f"--servers=127.0.0.1:{port}", "--concurrency=4",
                        "--execute-number=2000", "--binary"], capture_output=True, text=True,
                       timeout=GUARD)
    return (r.returncode, "Failed" in r.stdout), p


def named(work, mode_env):
    port = free_port()
    zone = os.path.join(work, "test.zone")
    with open(zone, "w") as f:
        f.write("$TTL 300\n@ IN SOA ns.test. admin.test. 1 3600 600 86400 300\n"
                "@ IN NS ns.test.\nns IN A 127.0.0.1\n"
                + "".join(f"host{i} IN A 192.0.2.{i % 250 + 1}\n" for i in range(200)))
    conf = os.path.join(work, "named.conf")
    with open(conf, "w") as f:
        f.write(f'options {{ directory "{work}"; listen-on port {port} {{ 127.0.0.1; }}; '
                f'listen-on-v6 {{ none; }}; pid-file none; recursion no; '
                f'dnssec-validation no; }};\ncontrols {{ }};\n'
                f'zone "test." {{ type master; file "{zone}"; }};\n')
    p = start(["named", "-g", "-4", "-n", "2", "-c", conf], mode_env, work)
    deadline = time.monotonic() + GUARD
    answers = []
    while time.monotonic() < deadline:
        if p.poll() is not None:
            return None, "exited"
        # Ready when it answers from the zone (before that dig prints its
        # errors on stdout, or nothing while the zone loads).
        r = subprocess.run(["dig", "@127.0.0.1", "-p", str(port), "host0.test", "+short",
                            "+time=1", "+tries=1"], capture_output=True, text=True)
        if r.stdout.strip() == "192.0.2.1":
            break
        time.sleep(0.1)
    serving(p)
    for i in range(200):
        # A line of dig's own (";; Warning: query response not set", seen
        # once in a bare run in CI) is not the server's answer: ask again,
        # a few times at most (a wrong address still fails the row).
        for _ in range(3):
            r = subprocess.run(["dig", "@127.0.0.1", "-p", str(port), f"host{i}.test", "+short"],
                               capture_output=True, text=True, timeout=GUARD)
            if not r.stdout.lstrip().startswith(";;"):
                break
        answers.append(r.stdout.strip())
    wrong = [(i, a) for i, a in enumerate(answers) if a != f"192.0.2.{i % 250 + 1}"]
    return ("200 answers", "right" if not wrong else f"wrong: {wrong[:5]}"), p


def nginx(work, mode_env):
    port = free_port()
    www = os.path.join(work, "www")
    os.makedirs(www, exist_ok=True)
    with open(os.path.join(www, "index.html"), "w") as f:
        f.write("hello from nginx\n" * 100)
    conf = os.path.join(work, "nginx.conf")
    tmp = os.path.join(work, "nginx-tmp")
    os.makedirs(tmp, exist_ok=True)
    with open(conf, "w") as f:
        f.write(f"daemon off; master_process on; worker_processes 2; user root;\n"
                f"error_log {work}/nginx-error.log; pid {work}/nginx.pid;\n"
                f"events {{ worker_connections 256; }}\n"
                f"http {{ access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp}; "
                f"fastcgi_temp_path {tmp}; uwsgi_temp_path {tmp}; scgi_temp_path {tmp};\n"
                f"  server {{ listen 127.0.0.1:{port}; root {www}; }} }}\n")
    p = start(["nginx", "-c", conf, "-p", work], mode_env, work)
    if not wait_port(port, p, "nginx"):
        return None, "exited before listening"
    serving(p)
    return ab(port, "/index.html"), p


def postgres(work, mode_env):
    bindir = sorted(os.listdir("/usr/lib/postgresql"))[-1]
    pgbin = os.path.join("/usr/lib/postgresql", bindir, "bin")
    data = os.path.join(work, "pg")
    sock = os.path.join(work, "pgsock")
    os.makedirs(sock, exist_ok=True)
    shutil.chown(work, "postgres")
    shutil.chown(sock, "postgres")
    if not os.path.exists(data):
        subprocess.run(["runuser", "-u", "postgres", "--", os.path.join(pgbin, "initdb"), "-D",
                        data, "-A", "trust"], check=True, capture_output=True, timeout=GUARD)
    port = free_port()
    p = start([os.path.join(pgbin, "postgres"), "-D", data, "-p", str(port), "-k", sock,
               "-c", "listen_addresses=127.0.0.1"], mode_env, work, user="postgres")
    if not wait_port(port, p, "postgres"):
        return None, "exited before listening"
    serving(p)
    pg = ["runuser", "-u", "postgres", "--", "pgbench", "-h", sock, "-p", str(port)]
    subprocess.run(pg + ["-i", "-s", "1", "-q", "postgres"], check=True, capture_output=True,
                   timeout=GUARD)
    # -C: a new connection, so a forked backend, per transaction (800
    # forks of a possibly attached postmaster).
    r = subprocess.run(pg + ["-C", "-c", "4", "-t", "200", "postgres"], capture_output=True,
                       text=True, timeout=GUARD)
    done = next((l for l in r.stdout.splitlines()
                 if l.startswith("number of transactions actually processed")), "")
    return (r.returncode, done.split(":")[-1].strip()), p


def closefds(work, mode_env):
    if mode_env is ATTACH:
        return "skip", None  # it runs to its end at once: nothing to attach to
    exe = os.path.join(work, "closefds_fork")
    if not os.path.exists(exe):
        subprocess.run(["cc", "-O1", "-o", exe, os.path.join(ROOT, "tests", "c",
                                                             "closefds_fork.c")], check=True)
    p = start([exe], mode_env, work)
    # It waits on stdin, which is /dev/null: it runs to the end at once.
    code = p.wait(timeout=GUARD)
    log = open(os.path.join(work, "service.log")).read()
    return (code, "child socket ok" in log), None


def haproxy(work, mode_env):
    port = free_port()
    conf = os.path.join(work, "haproxy.cfg")
    with open(conf, "w") as f:
        f.write("global\n  maxconn 256\n"
                "defaults\n  mode http\n  timeout connect 5s\n  timeout client 30s\n"
                "  timeout server 30s\n"
                f"frontend web\n  bind 127.0.0.1:{port}\n"
                "  http-request return status 200 content-type text/plain string hello\n")
    # Master-worker mode: a master and a worker process, both attached.
    # haproxy's master takes SIGUSR2 (reload) and re-executes itself with
    # it ignored: snapshot requests use another signal, as a user would
    # choose (the agent says so when it finds the signal taken).
    if mode_env is not None and mode_env is not ATTACH:
        mode_env = dict(mode_env, HEAPDUMP_SIGNAL="SIGRTMIN+3")
    p = start(["haproxy", "-W", "-db", "-f", conf], mode_env, work)
    if not wait_port(port, p, "haproxy"):
        return None, "exited before listening"
    serving(p)
    return ab(port, "/"), p


def mariadb(work, mode_env):
    data = os.path.join(work, "mariadb")
    sock = os.path.join(work, "mariadb.sock")
    if not os.path.exists(data):
        subprocess.run(["mariadb-install-db", "--no-defaults", f"--datadir={data}", "--user=root",
                        "--auth-root-authentication-method=normal", "--skip-test-db"],
                       check=True, capture_output=True, timeout=GUARD)
    port = free_port()
    p = start(["mariadbd", "--no-defaults", f"--datadir={data}", f"--socket={sock}",
               f"--port={port}", "--bind-address=127.0.0.1", "--user=root",
               f"--pid-file={work}/mariadb.pid", "--skip-log-bin", "--innodb-buffer-pool-size=32M"],
              mode_env, work)
    if not wait_port(port, p, "mariadbd"):
        return None, "exited before listening"
    serving(p)
    r = subprocess.run(["mariadb-slap", f"--socket={sock}", "--user=root", "--concurrency=4",
                        "--iterations=2", "--number-of-queries=400", "--auto-generate-sql"],
                       capture_output=True, text=True, timeout=GUARD)
    CLIENT["stderr"] = r.stderr
    return (r.returncode, "Average number of seconds" in r.stdout), p


SERVICES = [
    ("varnish (ab through a backend)", varnish, "varnishd"),
    ("memcached (memcslap)", memcached, "memcached"),
    ("named (dig, test zone)", named, "named"),
    ("nginx (ab)", nginx, "nginx"),
    ("postgres (pgbench, user postgres)", postgres, "pgbench"),
    ("haproxy (master and worker, ab)", haproxy, "haproxy"),
    ("mariadb (mariadb-slap)", mariadb, "mariadbd"),
    ("closes every fd, then forks", closefds, "cc"),
]


def main():
    rows, failed = [], 0
    only = sys.argv[2:]  # names (or parts of them) of the services to run
    for name, fn, need in SERVICES:
        if only and not any(o in name for o in only):
            continue
        if shutil.which(need) is None:
            rows.append((name, "-", "MISSING", f"{need} is not installed"))
            failed += 1
            continue
        work = tempfile.mkdtemp(prefix="heapdump-svc-")
        os.chmod(work, 0o755)
        bare = None
        for mode, mode_env in MODES:
            detail, ok, snaps = "", False, ""
            open(os.path.join(work, "service.log"), "w").close()
            ATTACHED.update(on=mode_env is ATTACH, pids=[], errors=[])
            CLIENT["stderr"] = ""
            try:
                result, p = fn(work, mode_env)
                if result == "skip":
                    continue
                try:
                    if result is None:
                        detail = f"did not start: {p}"
                    elif mode == "bare":
                        bare = result
                        ok = True
                    else:
                        ok = result == bare
                        if not ok:
                            detail = f"served {result}, bare {bare}"
                    if p is not None and mode_env is not None and result is not None:
                        n, errors, largest = snapshot_all(p.pid, work,
                                                          peak=mode_env is ATTACH)
                        snaps = f"{n} processes snapshotted, largest {largest / 2**20:.1f} MiB"
                        if n == 0 or errors:
                            ok = False
                            detail += f" snapshots: {n} instrumented, errors {errors}"
                    if mode_env is ATTACH:
                        errors = ATTACHED["errors"] + detach_all()
                        snaps += f", {len(ATTACHED['pids'])} attached and detached"
                        if errors:
                            ok = False
                            detail += f" attach: {errors}"
                finally:
                    if p is not None and not isinstance(p, str):
                        stop(p)
                # The agent's messages never land in a service's output (nor
                # in the programs it runs: varnishd compiles with cc).
                said = [line for line in open(os.path.join(work, "service.log"))
                        if line.startswith("heapdump:")]
                if said:
                    ok = False
                    detail += f" agent messages in the service's output: {said[:3]}"
            except Exception as e:  # a failure of the harness is a failed row too
                detail = f"{type(e).__name__}: {e}"
            if mode == "bare" and bare is not None:
                detail = f"served {bare}"
            if not ok:
                if CLIENT["stderr"].strip():
                    detail += " | client: " + CLIENT["stderr"].strip()[-400:]
                try:
                    detail += " | log: " + open(os.path.join(work, "service.log")).read()[-400:]
                except OSError:
                    pass
            rows.append((name, mode, "ok" if ok else "FAILED", (snaps + " " + detail).strip()))
            failed += not ok
            if mode == "bare" and not ok:
                break
        shutil.rmtree(work, ignore_errors=True)
    print("| service | mode | result | detail |")
    print("|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(x.replace("|", "/").replace("\n", " ") for x in r) + " |")
    print(f"{len(rows) - failed} passed, {failed} failed")
    shutil.rmtree(SNAPDIR, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
