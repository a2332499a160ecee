//! The `heapdump` command line. Parsing with clap's derive API (the
//! standard, well-kept Rust CLI crate: complete `--help` from the doc
//! comments below); errors with anyhow, with context saying what to do.

use std::io::{IsTerminal, Write};
use std::path::PathBuf;
use std::sync::atomic::AtomicBool;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::{Args, Parser, Subcommand};

use heapdump::age::{self, AgeFilter, When};
use heapdump::discovery;
use heapdump::fake_target::{self, Corruption, FakeOptions};
use heapdump::maps::{self, read_maps, BuildIds};
use heapdump::output::{self, Format, RenderOptions};
use heapdump::run::{self, AgentEnv};
use heapdump::snapshot;
use heapdump::symbolize::Symbolizer;
use heapdump::text::{human_bytes, TextOptions};
use heapdump::top::{self, Baseline, SortBy, TopOptions};
use heapdump::watch::{self, WatchOptions};

/// heapdump: heap snapshots of running Linux processes.
///
/// A process instrumented by heapdump's agent (`heapdump run -- CMD`,
/// LD_PRELOAD=libheapdump_preload.so, or the heapdump_agent::Agent global
/// allocator) records every live heap allocation in shared memory. This
/// tool maps that memory read-only and turns it into snapshots at any
/// moment, without stopping the process. Inspecting a process needs the
/// same permission as debugging it (same user, or root).
#[derive(Parser, Debug)]
#[command(name = "heapdump", version, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// List instrumented processes: pid, name, live bytes and blocks,
    /// threads, dropped events.
    List,
    /// Take one snapshot of a process: a text top-N report on stdout, or a
    /// file with -o.
    ///
    /// Exit status: 0 on success, 1 on error, 2 when the snapshot was
    /// written but is partial (the walk was not clean; the reason is in
    /// the output and on stderr).
    Snapshot(SnapshotArgs),
    /// Write a snapshot for every snapshot request of the target(s) (signal
    /// or API), optionally every --interval, and a final one when a target
    /// exits (even when killed).
    Watch(WatchArgs),
    /// A live view of a process's heap, refreshed like `top`: the sites
    /// holding most memory now, how much each grew since the view started,
    /// the age of each site's oldest block, and the allocation rate.
    Top(TopArgs),
    /// Serve Go-compatible `GET /debug/pprof/heap` over HTTP for `go tool
    /// pprof`, Pyroscope / Grafana Alloy and Parca.
    ///
    /// Query parameters: `pid=N` (which target, when several are served),
    /// `per_thread=1` (a `thread` label), `older_than=WHEN` /
    /// `newer_than=WHEN` (only the live blocks allocated before / at or
    /// after WHEN: a duration before the request such as `1h`, or an RFC
    /// 3339 time). `/debug/pprof/heap.json` serves heapdump's JSON.
    Serve(ServeArgs),
    /// Growth per stack between two JSON snapshots (B minus A), as text
    /// or as pprof (-o FILE.pb.gz).
    Diff(DiffArgs),
    /// Symbolize a snapshot taken with --no-symbolize, later or on another
    /// machine: each mapped file is found by the build ID the snapshot
    /// recorded; then write it in any format (also re-renders a
    /// symbolized JSON snapshot in another format).
    Symbolize(SymbolizeArgs),
    /// Run a program under the preload agent; exits with its status.
    Run(RunArgs),
    /// Start a bundled example workload under the agent, snapshot it
    /// live, print the top allocation sites and write the snapshot files.
    Demo(DemoArgs),
    /// Test helper: a fake instrumented process with a known live set.
    #[command(name = "__fake-target", hide = true)]
    FakeTarget {
        /// Damage the regions after writing them.
        #[arg(long, value_enum)]
        corrupt: Option<Corruption>,
        /// Publish only an unsealed memfd.
        #[arg(long)]
        unsealed: bool,
        /// Keep two threads allocating and freeing.
        #[arg(long)]
        churn: bool,
        /// Extra live blocks (benchmarks).
        #[arg(long, default_value_t = 0)]
        blocks: u64,
    },
    /// The demo's workload.
    #[command(name = "__demo-workload", hide = true)]
    DemoWorkload,
    /// Benchmark workload (run under the preload agent): N live blocks
    /// from about STACKS distinct call stacks; prints `ready PID` and holds
    /// them until stdin closes.
    #[command(name = "__bench-workload", hide = true)]
    BenchWorkload {
        /// Live blocks.
        blocks: usize,
        /// Distinct call stacks.
        stacks: usize,
    },
}

#[derive(Args, Debug, Clone)]
struct SymArgs {
    /// Do not symbolize: frames carry addresses and modules only (mappings
    /// and build IDs are still recorded, for symbolizing later).
    #[arg(long)]
    no_symbolize: bool,
    /// pprof: split live values per allocating thread with a `thread` label.
    #[arg(long)]
    per_thread: bool,
    /// Keep the allocator plumbing frames (alloc::raw_vec::..., __rust_alloc,
    /// std::allocator<T>::allocate, operator new, ...) at the leaf end of
    /// each stack. By default they are dropped and the sites that become
    /// identical are merged, so each stack starts at the code that asked
    /// for memory.
    #[arg(long)]
    keep_allocator_frames: bool,
}

/// Which live blocks a snapshot shows, by when they were allocated.
#[derive(Args, Debug, Clone)]
struct AgeArgs {
    /// Only blocks allocated before WHEN: a duration before the snapshot
    /// (`1h`: blocks live for at least an hour, the usual leak suspects),
    /// an RFC 3339 time (`2026-11-22T10:00:00Z`), or a JSON snapshot file
    /// (the time it was taken). Sites, threads and every format count only
    /// these blocks; the totals stay the whole heap's. Allocation times come
    /// from a coarse clock: up to one kernel tick (1-10 ms) early.
    #[arg(long, value_name = "WHEN", value_parser = age::parse_when)]
    older_than: Option<When>,
    /// Only blocks allocated at or after WHEN (same forms: `10m`, the last
    /// ten minutes; `A.json`, since snapshot A was taken, still live now).
    #[arg(long, value_name = "WHEN", value_parser = age::parse_when)]
    newer_than: Option<When>,
}

impl AgeArgs {
    fn filter(&self) -> AgeFilter {
        AgeFilter {
            older_than: self.older_than,
            newer_than: self.newer_than,
        }
    }
}

/// Where a report goes and in which format (`snapshot`, `symbolize`,
/// `diff`).
#[derive(Args, Debug)]
struct ReportArgs {
    /// Write to FILE (mode 0600) instead of a text report on stdout. The
    /// format follows the name when clear: .pb.gz/.pprof pprof, .json JSON,
    /// .dhat.json DHAT, .folded, .svg, .txt.
    #[arg(short, long, value_name = "FILE")]
    output: Option<PathBuf>,
    /// Output format (default: from the file name, else text).
    #[arg(short, long, value_enum)]
    format: Option<Format>,
    /// Number of sites in the text report.
    #[arg(short = 'n', long, default_value_t = 10)]
    top: usize,
    /// Frames shown per site in the text report.
    #[arg(long, default_value_t = 6)]
    depth: usize,
}

impl ReportArgs {
    /// The format asked for: the flag, else the file name's, else text.
    fn format(&self) -> Result<Format> {
        match (self.format, &self.output) {
            (Some(f), _) => Ok(f),
            (None, None) => Ok(Format::Text),
            (None, Some(p)) => Format::from_path(p).with_context(|| {
                format!(
                    "cannot tell the format from the name {}: add --format \
                     pprof|json|dhat|folded|svg|text",
                    p.display()
                )
            }),
        }
    }

    /// Writes `snap` in `format` to the file (saying so on stderr) or to
    /// stdout.
    fn write(&self, snap: &snapshot::Snapshot, format: Format, per_thread: bool) -> Result<()> {
        let render = RenderOptions {
            text: TextOptions {
                top: self.top,
                depth: self.depth,
            },
            per_thread,
        };
        match &self.output {
            Some(p) => {
                output::write_snapshot(p, snap, format, render)
                    .with_context(|| format!("writing {}", p.display()))?;
                eprintln!(
                    "wrote {} ({:?}): {} live in {} blocks, {} sites{}",
                    p.display(),
                    format,
                    human_bytes(snap.totals.live_bytes),
                    snap.totals.live_blocks,
                    snap.sites.len(),
                    snap.partial
                        .as_ref()
                        .map_or(String::new(), |r| format!(", PARTIAL: {r}"))
                );
            }
            None => {
                let mut out = std::io::BufWriter::new(std::io::stdout().lock());
                match format {
                    Format::Json => heapdump::json_format::write(snap, &mut out)?,
                    _ => out.write_all(&output::render(snap, format, render))?,
                }
                out.flush()?;
            }
        }
        Ok(())
    }
}

#[derive(Args, Debug)]
struct SnapshotArgs {
    /// The instrumented process: its pid, or its name if only one
    /// instrumented process has it.
    #[arg(value_name = "PID|NAME", value_parser = discovery::resolve_target)]
    pid: u32,
    #[command(flatten)]
    report: ReportArgs,
    /// Print timings on stderr: table walk, symbolization, total, and the
    /// dumper's peak memory.
    #[arg(long)]
    timings: bool,
    #[command(flatten)]
    sym: SymArgs,
    #[command(flatten)]
    ages: AgeArgs,
}

#[derive(Args, Debug)]
struct WatchArgs {
    /// Processes to watch: pids, or names each of only one instrumented
    /// process.
    #[arg(required = true, value_name = "PID|NAME", value_parser = discovery::resolve_target)]
    pids: Vec<u32>,
    /// Directory for the snapshot files (created with mode 0700). Files are
    /// named heapdump-PID-SEQ-REASON-TIME.EXT.
    #[arg(short, long, default_value = ".")]
    dir: PathBuf,
    /// Formats written for each snapshot (repeatable).
    #[arg(short, long, value_enum, default_values_t = [Format::Pprof])]
    format: Vec<Format>,
    /// Also take a snapshot every DURATION (e.g. 30s, 5m).
    #[arg(long, value_parser = humantime::parse_duration)]
    interval: Option<Duration>,
    /// With --interval: keep only the newest N periodic snapshots of each
    /// target, deleting the files of older ones (snapshots answering a
    /// request, and the final one, are always kept).
    #[arg(long, value_name = "N", requires = "interval", value_parser = clap::value_parser!(u64).range(1..))]
    keep: Option<u64>,
    /// How often requests and exits are checked.
    #[arg(long, default_value = "15ms", value_parser = humantime::parse_duration)]
    poll: Duration,
    /// Also answer a request the target made before the watch began (one
    /// snapshot, named after the latest such request, taken now). By
    /// default only requests made after `watching ...` is printed are
    /// answered, since the heap at an earlier request is gone.
    #[arg(long)]
    answer_pending: bool,
    #[command(flatten)]
    sym: SymArgs,
    #[command(flatten)]
    ages: AgeArgs,
}

#[derive(Args, Debug)]
struct TopArgs {
    /// The instrumented process: its pid, or its name if only one
    /// instrumented process has it.
    #[arg(value_name = "PID|NAME", value_parser = discovery::resolve_target)]
    pid: u32,
    /// Time between reports (e.g. 2s, 500ms).
    #[arg(short, long, default_value = "2s", value_parser = humantime::parse_duration)]
    interval: Duration,
    /// Sites shown.
    #[arg(short = 'n', long, default_value_t = 15)]
    top: usize,
    /// Frames shown per site, on one line (callee < caller).
    #[arg(long, default_value_t = 3)]
    depth: usize,
    /// Order of the sites.
    #[arg(long, value_enum, default_value_t = SortBy::Live)]
    sort: SortBy,
    /// Stop after N reports (default: when the target exits, after a last
    /// report of its heap at exit, or on Ctrl-C).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u64).range(1..))]
    iterations: Option<u64>,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    keep_allocator_frames: bool,
}

#[derive(Args, Debug)]
struct ServeArgs {
    /// Address to listen on, e.g. 127.0.0.1:6060 (port 0: any free port).
    #[arg(short, long, default_value = "127.0.0.1:6060")]
    listen: String,
    /// Serve only these pids (default: every instrumented process; then
    /// ?pid=N selects one when there are several).
    pids: Vec<u32>,
    /// Do not symbolize.
    #[arg(long)]
    no_symbolize: bool,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    keep_allocator_frames: bool,
}

#[derive(Args, Debug)]
struct DiffArgs {
    /// The earlier JSON snapshot.
    a: String,
    /// The later JSON snapshot.
    b: String,
    #[command(flatten)]
    report: ReportArgs,
}

#[derive(Args, Debug)]
struct SymbolizeArgs {
    /// A JSON snapshot, typically written with `snapshot --no-symbolize -o
    /// FILE.json` on the machine that ran the program.
    input: String,
    /// A directory to search (recursively) for the program's and
    /// libraries' files, matched by build ID (repeatable). A mapping whose
    /// own path exists here with the same build ID is found without it.
    #[arg(long, value_name = "DIR")]
    binaries: Vec<PathBuf>,
    #[command(flatten)]
    report: ReportArgs,
    /// pprof: split live values per allocating thread with a `thread` label.
    #[arg(long)]
    per_thread: bool,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    keep_allocator_frames: bool,
}

#[derive(Args, Debug, Clone)]
struct AgentArgs {
    /// Signal (name or number) that makes the target request a snapshot
    /// (HEAPDUMP_SIGNAL; the agent's default is SIGUSR2).
    #[arg(long)]
    signal: Option<String>,
    /// Deepest stack recorded (HEAPDUMP_MAX_FRAMES).
    #[arg(long)]
    max_frames: Option<u32>,
    /// Path of libheapdump_preload.so (default: $HEAPDUMP_PRELOAD, else
    /// next to this executable).
    #[arg(long)]
    preload: Option<PathBuf>,
}

impl AgentArgs {
    fn env(&self) -> AgentEnv {
        AgentEnv {
            signal: self.signal.clone(),
            max_frames: self.max_frames,
            preload: self.preload.clone(),
        }
    }
}

#[derive(Args, Debug)]
struct RunArgs {
    #[command(flatten)]
    agent: AgentArgs,
    /// Also watch the program, writing snapshots into DIR (as `watch
    /// --answer-pending`: a request the program makes before the watch
    /// attaches is answered too).
    #[arg(long, value_name = "DIR")]
    watch: Option<PathBuf>,
    /// Formats written with --watch (repeatable).
    #[arg(short, long, value_enum, default_values_t = [Format::Pprof])]
    format: Vec<Format>,
    /// With --watch: keep the allocator plumbing frames at the leaf end of
    /// each stack (see `snapshot --help`).
    #[arg(long)]
    keep_allocator_frames: bool,
    /// The program and its arguments (after `--`).
    #[arg(last = true, required = true, value_name = "CMD")]
    command: Vec<String>,
}

#[derive(Args, Debug)]
struct DemoArgs {
    /// Directory for the snapshot files.
    #[arg(short, long, default_value = "heapdump-demo")]
    dir: PathBuf,
    #[command(flatten)]
    agent: AgentArgs,
}

/// Exit status of `snapshot` when the snapshot was written but is partial
/// (the walk was not clean: target killed mid-update, or a damaged region).
const EXIT_PARTIAL: i32 = 2;

/// The error and its causes, `: `-separated, leaving out a cause whose text
/// the message before it already contains (typed errors often embed their
/// source in their own message).
fn error_chain(e: &anyhow::Error) -> String {
    let mut out = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if out.contains(&text) {
            continue;
        }
        if !out.is_empty() {
            out.push_str(": ");
        }
        out.push_str(&text);
    }
    out
}

fn main() {
    let cli = Cli::parse();
    let code = match dispatch(cli) {
        Ok(code) => code,
        Err(e) => {
            let _ = std::io::stdout().flush();
            eprintln!("heapdump: error: {}", error_chain(&e));
            1
        }
    };
    // process::exit does not run destructors: flush what is buffered.
    let _ = std::io::stdout().flush();
    std::process::exit(code);
}

fn dispatch(cli: Cli) -> Result<i32> {
    match cli.cmd {
        Cmd::List => list(),
        Cmd::Snapshot(a) => snapshot_cmd(a),
        Cmd::Watch(a) => watch_cmd(a),
        Cmd::Top(a) => top_cmd(a),
        Cmd::Serve(a) => serve_cmd(a),
        Cmd::Diff(a) => diff_cmd(a),
        Cmd::Symbolize(a) => symbolize_cmd(a),
        Cmd::Run(a) => run_cmd(a),
        Cmd::Demo(a) => demo_cmd(a),
        Cmd::FakeTarget {
            corrupt,
            unsealed,
            churn,
            blocks,
        } => {
            fake_target::run(FakeOptions {
                corrupt,
                unsealed,
                churn,
                blocks,
            })
            .map_err(|e| anyhow::anyhow!("fake target: {e}"))?;
            Ok(0)
        }
        Cmd::DemoWorkload => {
            heapdump::demo::workload();
            Ok(0)
        }
        Cmd::BenchWorkload { blocks, stacks } => {
            heapdump::bench_workload::run(blocks, stacks);
            Ok(0)
        }
    }
}

fn list() -> Result<i32> {
    let (entries, denied) = discovery::scan();
    let mut out = std::io::stdout().lock();
    if entries.is_empty() {
        writeln!(out, "no instrumented processes found")?;
    } else {
        writeln!(
            out,
            "{:>8}  {:<16} {:>12} {:>10} {:>8} {:>8}",
            "PID", "NAME", "LIVE", "BLOCKS", "THREADS", "DROPPED"
        )?;
        for e in &entries {
            match &e.state {
                Ok((c, threads)) => writeln!(
                    out,
                    "{:>8}  {:<16} {:>12} {:>10} {:>8} {:>8}",
                    e.pid,
                    e.name,
                    human_bytes(c.live_bytes),
                    c.live_blocks,
                    threads.map_or("?".to_string(), |t| t.to_string()),
                    c.dropped_total()
                )?,
                Err(err) => writeln!(out, "{:>8}  {:<16} ({err})", e.pid, e.name)?,
            }
        }
        for e in &entries {
            if let Ok((c, _)) = &e.state {
                for note in heapdump::snapshot::notes(e.pid, c.total_allocs) {
                    writeln!(out, "{:>8}: {note}", e.pid)?;
                }
            }
        }
    }
    if denied > 0 {
        writeln!(
            out,
            "({denied} processes of other users could not be inspected; run as root to see them)"
        )?;
    }
    Ok(0)
}

fn snapshot_cmd(a: SnapshotArgs) -> Result<i32> {
    let format = a.report.format()?;
    let start = std::time::Instant::now();
    let target = discovery::open_target(a.pid)?;
    let maps = read_maps(a.pid, &mut BuildIds::default())
        .with_context(|| format!("reading /proc/{}/maps", a.pid))?;
    let mut sym = Symbolizer::new();
    let snap = snapshot::take(
        &target,
        &maps,
        snapshot::Options {
            symbolizer: (!a.sym.no_symbolize).then_some(&mut sym),
            progress: std::io::stderr().is_terminal(),
            request: None,
            keep_allocator_frames: a.sym.keep_allocator_frames,
            ages: a.ages.filter(),
        },
    )
    .with_context(|| format!("taking a snapshot of pid {}", a.pid))?;
    a.report.write(&snap, format, a.sym.per_thread)?;
    if a.timings {
        let t = &snap.timing;
        let walk = t.walk.as_secs_f64();
        eprintln!(
            "timings: walk {:.1} ms ({} live blocks, {:.1} M blocks/s over {} nodes), \
             symbolize {:.1} ms ({} sites), total {:.1} ms, dumper peak RSS {}",
            walk * 1e3,
            snap.totals.live_blocks,
            if walk > 0.0 {
                snap.totals.live_blocks as f64 / walk / 1e6
            } else {
                0.0
            },
            t.nodes,
            t.symbolize.as_secs_f64() * 1e3,
            snap.sites.len(),
            start.elapsed().as_secs_f64() * 1e3,
            peak_rss().map_or("?".to_string(), human_bytes),
        );
    }
    if let Some(reason) = &snap.partial {
        eprintln!("heapdump: the snapshot is PARTIAL: {reason}");
        return Ok(EXIT_PARTIAL);
    }
    Ok(0)
}

/// The dumper's peak resident memory (`VmHWM`), in bytes.
fn peak_rss() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kb: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kb * 1024)
}

fn print_written(w: &watch::Written) {
    for p in &w.paths {
        println!("wrote {}", p.display());
    }
    for p in &w.removed {
        println!("removed {}", p.display());
    }
    for (p, e) in &w.not_removed {
        eprintln!("heapdump: cannot remove {} (--keep): {e}", p.display());
    }
    if w.partial {
        eprintln!("heapdump: snapshot {} of pid {} is partial", w.seq, w.pid);
    }
    let _ = std::io::stdout().flush();
}

fn watch_cmd(a: WatchArgs) -> Result<i32> {
    watch::install_stop_handlers();
    let opts = WatchOptions {
        dir: a.dir,
        formats: a.format,
        interval: a.interval,
        symbolize: !a.sym.no_symbolize,
        render: RenderOptions {
            text: TextOptions::default(),
            per_thread: a.sym.per_thread,
        },
        poll: a.poll,
        keep_allocator_frames: a.sym.keep_allocator_frames,
        answer_pending: a.answer_pending,
        keep: a.keep.map(|n| n as usize),
        ages: a.ages.filter(),
    };
    let dir = opts.dir.clone();
    let watcher = watch::Watcher::open(&a.pids, opts)?;
    // This line tells scripts (and the tests) that requests from now on
    // are answered.
    println!(
        "watching {} (snapshots into {})",
        a.pids
            .iter()
            .map(u32::to_string)
            .collect::<Vec<_>>()
            .join(" "),
        dir.display()
    );
    std::io::stdout().flush()?;
    watcher.run(&AtomicBool::new(false), print_written)?;
    Ok(0)
}

fn top_cmd(a: TopArgs) -> Result<i32> {
    watch::install_stop_handlers();
    let target = discovery::open_target(a.pid)?;
    let exit = watch::ExitWatch::new(a.pid);
    let mut build_ids = BuildIds::default();
    let mut maps = read_maps(a.pid, &mut build_ids)
        .with_context(|| format!("reading /proc/{}/maps", a.pid))?;
    let mut sym = Symbolizer::new();
    let tty = std::io::stdout().is_terminal();
    let opts = TopOptions {
        top: a.top,
        depth: a.depth,
        sort: a.sort,
    };
    let mut baseline = None;
    let mut previous: Option<snapshot::Snapshot> = None;
    let mut seq = 0u64;
    loop {
        let exited = exit.exited();
        if !exited {
            // New libraries may have been loaded; a dead target keeps the
            // last mappings read (its files stay open in the symbolizer).
            if let Ok(m) = read_maps(a.pid, &mut build_ids) {
                maps = m;
            }
            sym.open_modules(&maps);
        }
        let snap = snapshot::take(
            &target,
            &maps,
            snapshot::Options {
                symbolizer: Some(&mut sym),
                progress: tty && seq == 0,
                request: None,
                keep_allocator_frames: a.keep_allocator_frames,
                ages: AgeFilter::default(),
            },
        )
        .with_context(|| format!("taking a snapshot of pid {}", a.pid))?;
        seq += 1;
        let base = baseline.get_or_insert_with(|| Baseline::of(&snap));
        let before = previous
            .as_ref()
            .and_then(|p| top::between(p, &snap).map(|d| (p, d)));
        let report = top::render(&snap, base, before, seq, opts);
        let mut out = std::io::stdout().lock();
        if tty {
            // Home and clear, then the report: a screen that refreshes.
            let report = match top::terminal_width() {
                Some(w) => top::fit(&report, w),
                None => report,
            };
            write!(out, "\x1b[H\x1b[2J{report}")?;
        } else {
            writeln!(out, "{report}")?;
        }
        if exited {
            writeln!(out, "pid {} exited: this is its heap at exit", a.pid)?;
        }
        out.flush()?;
        drop(out);
        if exited || a.iterations.is_some_and(|n| seq >= n) || watch::stop_requested() {
            return Ok(0);
        }
        previous = Some(snap);
        // Wait for the next report, waking early for an exit or Ctrl-C.
        let until = std::time::Instant::now() + a.interval;
        while std::time::Instant::now() < until {
            if watch::stop_requested() {
                return Ok(0);
            }
            if exit.exited() {
                break;
            }
            std::thread::sleep(
                until
                    .saturating_duration_since(std::time::Instant::now())
                    .min(Duration::from_millis(20)),
            );
        }
    }
}

fn serve_cmd(a: ServeArgs) -> Result<i32> {
    let (server, bound) = heapdump::serve::bind(&a.listen)?;
    println!("listening on http://{bound}/debug/pprof/heap");
    std::io::stdout().flush()?;
    heapdump::serve::serve(
        server,
        heapdump::serve::ServeOptions {
            pids: a.pids,
            symbolize: !a.no_symbolize,
            keep_allocator_frames: a.keep_allocator_frames,
        },
    );
    Ok(0)
}

fn diff_cmd(a: DiffArgs) -> Result<i32> {
    let format = match (a.report.format, &a.report.output) {
        (Some(f), _) => f,
        (None, Some(p)) => match Format::from_path(p) {
            Some(Format::Pprof) => Format::Pprof,
            _ => Format::Text,
        },
        (None, None) => Format::Text,
    };
    if !matches!(format, Format::Text | Format::Pprof) {
        bail!("diff writes text or pprof, not {format:?}");
    }
    let d = heapdump::diff::diff(
        heapdump::json_format::read_snapshot(&a.a)?,
        heapdump::json_format::read_snapshot(&a.b)?,
    );
    let bytes = match format {
        Format::Pprof => heapdump::diff::render_pprof(&d),
        _ => heapdump::diff::render_text(&d, a.report.top, a.report.depth).into_bytes(),
    };
    match &a.report.output {
        Some(p) => {
            output::write_private(p, &bytes).with_context(|| format!("writing {}", p.display()))?
        }
        None => std::io::stdout().lock().write_all(&bytes)?,
    }
    Ok(0)
}

fn symbolize_cmd(a: SymbolizeArgs) -> Result<i32> {
    let format = a.report.format()?;
    let mut snap = heapdump::json_format::read_snapshot(&a.input)?;
    if !snap.symbolized {
        for w in maps::locate_by_build_id(&mut snap.mappings, &a.binaries) {
            eprintln!("heapdump: {w}; its frames stay unsymbolized");
        }
        let mut sym = Symbolizer::new();
        let sites = std::mem::take(&mut snap.sites);
        snap.sites = snapshot::symbolize_sites(
            sites,
            &snap.mappings,
            Some(&mut sym),
            a.keep_allocator_frames,
            std::io::stderr().is_terminal(),
        );
        snap.symbolized = true;
    } else if !a.binaries.is_empty() {
        eprintln!(
            "heapdump: {} is symbolized already: re-rendering it as it is",
            a.input
        );
    }
    a.report.write(&snap, format, a.per_thread)?;
    Ok(if snap.partial.is_some() {
        EXIT_PARTIAL
    } else {
        0
    })
}

fn run_cmd(a: RunArgs) -> Result<i32> {
    let mut child = run::spawn(&a.command, &a.agent.env(), false)?;
    let pid = child.id();
    let watcher = match a.watch {
        Some(dir) => {
            let opts = WatchOptions {
                dir,
                formats: a.format,
                interval: None,
                symbolize: true,
                render: RenderOptions::default(),
                poll: Duration::from_millis(15),
                keep_allocator_frames: a.keep_allocator_frames,
                // The program was started by us: every request it made
                // before the watch attached is ours to answer.
                answer_pending: true,
                keep: None,
                ages: AgeFilter::default(),
            };
            Some(std::thread::spawn(move || -> Result<()> {
                watch::wait_instrumented(pid, Duration::from_secs(30))?;
                watch::watch(&[pid], &opts, &AtomicBool::new(false), print_written)?;
                Ok(())
            }))
        }
        None => None,
    };
    run::ignore_terminal_signals();
    let status = child.wait().context("waiting for the program")?;
    if let Some(w) = watcher {
        match w.join() {
            Ok(Err(e)) => eprintln!("heapdump: watch: {e:#}"),
            Err(_) => eprintln!("heapdump: watch thread panicked"),
            Ok(Ok(())) => {}
        }
    }
    Ok(run::exit_code(status))
}

fn demo_cmd(a: DemoArgs) -> Result<i32> {
    let report = heapdump::demo::demo(&a.dir, &a.agent.env()).context("heapdump demo")?;
    let text = heapdump::text::render(&report.snapshot, TextOptions { top: 5, depth: 4 });
    println!("{text}");
    println!("snapshot files:");
    for (f, p) in &report.files {
        println!("  {:<7} {}", format!("{f:?}").to_lowercase(), p.display());
    }
    println!(
        "\nexplore: go tool pprof -http=: {}\n         open the .svg in a browser; load the .dhat.json in valgrind's dh_view.html",
        report
            .files
            .first()
            .map_or(String::new(), |(_, p)| p.display().to_string())
    );
    Ok(0)
}
