"""What every benchmark script shares, so none of them can measure a bare
program and call it heapdump's:

- the build's real output directory (`cargo metadata`'s
  `target_directory`, which honours CARGO_TARGET_DIR and config), never a
  hard-coded `target/release` that may hold a stale or no build;
- a library or program that is to be measured must exist, or the script
  stops with a message;
- a run attributed to the agent must have been recorded by it: the churn
  workloads print the agent's own word (`agent: recording allocs=N`, from
  `heapdump_stats` / `heapdump_agent::stats`), and a server's
  `/proc/PID/maps` must map the preload library and its writable
  `heapdump.allocations` region; a bare run must show no agent;
- a tool a column needs (heaptrack) is there, or the script says the
  column is left out, and why.
"""
import json
import os
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def die(msg):
    print(f"bench: {msg}", file=sys.stderr)
    sys.exit(2)


def target_dir():
    """The workspace's build directory, as cargo itself resolves it."""
    out = subprocess.run(["cargo", "metadata", "--format-version", "1", "--no-deps"],
                         cwd=ROOT, check=True, capture_output=True, text=True).stdout
    return json.loads(out)["target_directory"]


def release_dir():
    rel = os.path.join(target_dir(), "release")
    print(f"bench: measuring the build in {rel}", file=sys.stderr)
    return rel


def build(*packages):
    """`cargo build --release` of `packages`; returns the release directory."""
    args = ["cargo", "build", "--release", "-q"]
    for p in packages:
        args += ["-p", p]
    subprocess.run(args, check=True, cwd=ROOT)
    return release_dir()


def require_file(path, what):
    """`path`, which must exist (a library, a program)."""
    if not os.path.isfile(path):
        die(f"{what} {path} does not exist (built into another directory? "
            f"cargo says the target directory is {target_dir()})")
    return os.path.abspath(path)


def agent_word(output):
    """The churn's `agent:` line: ('recording', N) or ('absent', 0)."""
    for line in output.splitlines():
        if line.startswith("agent: recording allocs="):
            return "recording", int(line.rsplit("=", 1)[1])
        if line.startswith("agent: absent"):
            return "absent", 0
    return None, 0


def check_churn_run(output, expect_agent, what, sampled=False):
    """Stops the script unless the churn's own report matches: a run
    attributed to heapdump's agent was recorded by it (in exact mode, with
    allocations recorded; a sampled run at a large rate may sample none),
    and a bare (or other profiler's) run was not."""
    word, allocs = agent_word(output)
    if word is None:
        die(f"{what}: the workload printed no 'agent:' line (an old build?)")
    if expect_agent and (word != "recording" or (allocs == 0 and not sampled)):
        die(f"{what}: attributed to heapdump's agent, but the agent did not record it "
            f"(agent: {word}, {allocs} allocations): the library was not loaded or is disabled")
    if not expect_agent and word != "absent":
        die(f"{what}: meant to run without heapdump's agent, but the agent recorded it")


def check_preload_loaded(pid, library, what):
    """Stops the script unless process `pid` maps `library` and a writable
    heapdump allocations region (the agent was loaded and started)."""
    try:
        maps = open(f"/proc/{pid}/maps").read()
    except OSError as e:
        die(f"{what}: cannot read /proc/{pid}/maps: {e}")
    real = os.path.realpath(library)
    if real not in maps:
        die(f"{what}: {library} is not loaded in pid {pid} (the dynamic loader ignores a "
            f"preload it cannot open, with only a warning)")
    if not any(" rw-s " in l and "/memfd:heapdump.allocations" in l for l in maps.splitlines()):
        die(f"{what}: the agent is loaded in pid {pid} but has no region: it is not recording")


def check_no_agent(pid, what):
    """Stops the script if process `pid` has heapdump's agent loaded."""
    try:
        maps = open(f"/proc/{pid}/maps").read()
    except OSError as e:
        die(f"{what}: cannot read /proc/{pid}/maps: {e}")
    if "libheapdump_preload" in maps:
        die(f"{what}: meant to run bare, but libheapdump_preload.so is loaded")


def tool(name, column):
    """The path of `name`, or None after saying that `column` is left out."""
    path = shutil.which(name)
    if path is None:
        print(f"bench: {name} is not installed: the {column} column is left out "
              f"(Debian: apt-get install {name})", file=sys.stderr)
    return path


def cpu_name():
    """The CPU's model name and how many CPUs this machine has, for a
    benchmark's heading."""
    name = "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} CPUs"


def redis_under_callgrind(out, library, tests, requests, fill, cwd, dump_instr=False):
    """Runs Debian's redis-server under valgrind's callgrind (writing `out`)
    with `library` preloaded (None: bare), loads it with `redis-benchmark
    -P 16 -n REQUESTS -t TESTS` and shuts it down. With lpop or rpop among
    `tests`, the list is first filled with `fill` LPUSHes (popping an empty
    list allocates nearly nothing, while a real pop shrinks the list's
    listpack with a `realloc`); a caller that compares two runs gives both
    the same `fill`, so its cost cancels. Stops the script if the server
    does not answer, or if the agent is (or is not) loaded as asked."""
    import socket
    import time
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("HEAPDUMP_") and k != "LD_PRELOAD"}
    if library:
        env["LD_PRELOAD"] = library
    cmd = ["valgrind", "--tool=callgrind", "--cache-sim=yes", f"--callgrind-out-file={out}"]
    if dump_instr:
        cmd.append("--dump-instr=yes")
    server = subprocess.Popen(
        cmd + ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
               "--appendonly", "no", "--logfile", ""],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, cwd=cwd)
    # Wait (bounded) until it answers; under valgrind it starts slowly.
    for _ in range(600):
        r = subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True)
        if r.stdout.strip() == "PONG":
            break
        if server.poll() is not None:
            die("redis-server exited before answering")
        time.sleep(0.2)
    else:
        server.kill()
        die("redis-server did not answer within 2 minutes")
    what = "redis-server under callgrind"
    if library:
        check_preload_loaded(server.pid, library, what)
    else:
        check_no_agent(server.pid, what)
    if {"lpop", "rpop"} & set(tests.lower().split(",")):
        subprocess.run(["redis-benchmark", "-p", str(port), "-P", "16", "-n", str(fill),
                        "-t", "lpush", "-q"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["redis-benchmark", "-p", str(port), "-P", "16", "-n", str(requests),
                    "-t", tests, "-q"], check=True, stdout=subprocess.DEVNULL)
    subprocess.run(["redis-cli", "-p", str(port), "shutdown", "nosave"], capture_output=True)
    server.wait(timeout=300)
