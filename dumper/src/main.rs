//! The `heapdump` command line: argument parsing and dispatch only. Each
//! command's options and work live in `heapdump::commands::<name>`.
//! Parsing with clap's derive API (the standard, well-kept Rust CLI crate:
//! complete `--help` from the doc comments); errors with anyhow, with
//! context saying what to do.

use std::io::Write;

use anyhow::Result;
use clap::{Parser, Subcommand};

use heapdump::commands::attach::{AttachArgs, DetachArgs};
use heapdump::commands::demo::DemoArgs;
use heapdump::commands::diff::DiffArgs;
use heapdump::commands::report::ReportArgs;
use heapdump::commands::run::RunArgs;
use heapdump::commands::serve::ServeArgs;
use heapdump::commands::snapshot::SnapshotArgs;
use heapdump::commands::symbolize::SymbolizeArgs;
use heapdump::commands::top::TopArgs;
use heapdump::commands::watch::WatchArgs;
use heapdump::commands::{
    attach, demo, diff, list, report, run, serve, snapshot, symbolize, top, watch,
};
use heapdump::testing::fake_target::{self, Corruption, FakeOptions};

/// heapdump: heap snapshots of running Linux processes.
///
/// A process instrumented by heapdump's agent (`heapdump run -- CMD`,
/// LD_PRELOAD=libheapdump_preload.so, or the heapdump_agent::Agent global
/// allocator) records every live heap allocation in shared memory. This
/// tool maps that memory read-only and turns it into snapshots at any
/// moment, without stopping the process. Inspecting a process needs the
/// same permission as debugging it (same user, or root).
#[derive(Parser, Debug)]
#[command(name = "heapdump", version, long_version = long_version(), propagate_version = true)]
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
    /// One self-contained HTML page (opens without a network): memory over
    /// time, the top sites now and at the peak with their stacks, an
    /// interactive flamegraph, leak suspects and the process's facts; from
    /// a live process, a JSON snapshot, or a directory of JSON snapshots
    /// (`watch --interval --format json`).
    Report(ReportArgs),
    /// Run a program under the preload agent; exits with its status.
    Run(RunArgs),
    /// Start recording in a process that is already running, without
    /// restarting it: loads the agent into it (heapdump's own ptrace
    /// injection, no debugger) at a moment when the thread chosen holds no
    /// allocator or loader lock. Blocks allocated before are never counted.
    ///
    /// Needs the same permission as a debugger (same user with
    /// kernel.yama.ptrace_scope 0, or root / CAP_SYS_PTRACE). The target's
    /// threads are stopped for milliseconds; one is borrowed while the
    /// library loads.
    Attach(AttachArgs),
    /// Stop recording in a process `heapdump attach` started recording in:
    /// every redirected call goes to the allocator directly again; what was
    /// recorded stays readable.
    Detach(DetachArgs),
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
    /// Release helper: write OUT, this executable (or --exe) followed by
    /// the agent libraries, so that OUT alone is all a host needs.
    #[command(name = "__bundle", hide = true)]
    Bundle {
        /// libheapdump_preload.so to carry.
        #[arg(long)]
        preload: std::path::PathBuf,
        /// libheapdump_jemalloc.so to carry.
        #[arg(long)]
        jemalloc: Option<std::path::PathBuf>,
        /// The executable to carry them (default: this one).
        #[arg(long)]
        exe: Option<std::path::PathBuf>,
        /// The file to write.
        #[arg(short, long)]
        output: std::path::PathBuf,
    },
    /// Release helper: write the man pages (DIR/man1/*.1) and the shell
    /// completions (DIR/completions/{heapdump.bash,_heapdump,heapdump.fish})
    /// generated from these very definitions.
    #[command(name = "__generate-docs", hide = true)]
    GenerateDocs {
        /// Output directory.
        dir: std::path::PathBuf,
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

/// Writes the man pages (one per visible command, `heapdump-snapshot.1`
/// and so on, as git does) and the bash, zsh and fish completions.
fn generate_docs(dir: &std::path::Path) -> Result<()> {
    use anyhow::Context as _;
    use clap::CommandFactory;
    let man = dir.join("man1");
    let comp = dir.join("completions");
    for d in [&man, &comp] {
        std::fs::create_dir_all(d).with_context(|| format!("creating {}", d.display()))?;
    }
    let cmd = Cli::command();
    clap_mangen::generate_to(cmd.clone(), &man).context("writing the man pages")?;
    for shell in [
        clap_complete::Shell::Bash,
        clap_complete::Shell::Zsh,
        clap_complete::Shell::Fish,
    ] {
        clap_complete::generate_to(shell, &mut cmd.clone(), "heapdump", &comp)
            .with_context(|| format!("writing the {shell} completions"))?;
    }
    Ok(())
}

/// `--version`'s text (computed once; clap wants a `'static` string).
fn long_version() -> &'static str {
    static TEXT: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    TEXT.get_or_init(heapdump::build_info::long_version)
}

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
    // Rust ignores SIGPIPE, so a closed stdout (`heapdump list | head`)
    // makes the next print panic with a backtrace. Commands that only
    // print end quietly by SIGPIPE instead, as Unix tools do; those with a
    // promise to keep when their output goes away (attach --for detaches,
    // watch and serve go on collecting, run waits for its program) keep
    // SIGPIPE ignored and write without panicking.
    if !matches!(
        cli.cmd,
        Cmd::Attach(_) | Cmd::Detach(_) | Cmd::Watch(_) | Cmd::Serve(_) | Cmd::Run(_)
    ) {
        // SAFETY: restoring a signal's default action before any thread
        // is started.
        unsafe { libc::signal(libc::SIGPIPE, libc::SIG_DFL) };
    }
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
        Cmd::List => list::command(),
        Cmd::Snapshot(a) => snapshot::command(a),
        Cmd::Watch(a) => watch::command(a),
        Cmd::Top(a) => top::command(a),
        Cmd::Serve(a) => serve::command(a),
        Cmd::Diff(a) => diff::command(a),
        Cmd::Symbolize(a) => symbolize::command(a),
        Cmd::Run(a) => run::command(a),
        Cmd::Report(a) => report::command(a),
        Cmd::Attach(a) => attach::attach(a),
        Cmd::Detach(a) => attach::detach(a),
        Cmd::Demo(a) => demo::command(a),
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
        Cmd::Bundle {
            preload,
            jemalloc,
            exe,
            output,
        } => {
            use anyhow::Context as _;
            let read = |p: &std::path::Path| {
                std::fs::read(p).with_context(|| format!("reading {}", p.display()))
            };
            let libs = heapdump::agent_bundle::AgentLibraries {
                preload: read(&preload)?,
                jemalloc: jemalloc.as_deref().map(read).transpose()?,
            };
            let exe = exe.unwrap_or_else(|| "/proc/self/exe".into());
            heapdump::agent_bundle::write_bundle(&exe, &libs, &output)?;
            Ok(0)
        }
        Cmd::GenerateDocs { dir } => {
            generate_docs(&dir)?;
            Ok(0)
        }
        Cmd::DemoWorkload => {
            heapdump::commands::demo::workload();
            Ok(0)
        }
        Cmd::BenchWorkload { blocks, stacks } => {
            heapdump::testing::bench_workload::run(blocks, stacks);
            Ok(0)
        }
    }
}
