//! `heapdump demo`: the README's first command. Starts a bundled example
//! workload (this binary's hidden `__demo-workload`) under the preload
//! agent, snapshots it live, prints the top allocation sites and writes
//! the snapshot in every format, saying where.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use crate::commands::run::{self, AgentEnv, RunError};
use crate::formats::{self, Format, RenderOptions};
use crate::process::discovery::{open_target, DiscoveryError};
use crate::process::snapshot::{self, Snapshot};
use crate::symbolization::maps::{read_maps, BuildIds};
use crate::symbolization::symbolizer::Symbolizer;

use crate::commands::args::AgentArgs;
use anyhow::Context as _;
use clap::Args;

/// Errors of the demo.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// Starting the workload failed.
    #[error(transparent)]
    Run(#[from] RunError),
    /// The workload never became instrumented.
    #[error("the demo workload did not become instrumented: {0}")]
    Discovery(#[from] DiscoveryError),
    /// The workload ended before it was ready.
    #[error("the demo workload exited before it was ready (is the preload agent working?)")]
    WorkloadDied,
    /// Snapshot failed.
    #[error("snapshot failed: {0}")]
    Snapshot(#[from] heapdump_table::TableError),
    /// Writing files failed.
    #[error("writing {path}: {source}")]
    Write {
        /// File.
        path: PathBuf,
        /// Cause.
        #[source]
        source: std::io::Error,
    },
}

/// What the demo produced.
#[derive(Debug)]
pub struct DemoReport {
    /// The snapshot taken.
    pub snapshot: Snapshot,
    /// Files written, with their format.
    pub files: Vec<(Format, PathBuf)>,
}

/// Runs the demo, writing files into `dir`.
pub fn demo(dir: &Path, env: &AgentEnv) -> Result<DemoReport, DemoError> {
    let exe = std::env::current_exe().map_err(|source| RunError::Spawn {
        cmd: "heapdump".into(),
        source,
    })?;
    let argv = vec![exe.display().to_string(), "__demo-workload".to_string()];
    let mut child = run::spawn(&argv, env, true)?;
    let pid = child.id();
    let stdout = child.stdout.take().expect("piped");
    let mut lines = BufReader::new(stdout).lines();
    let ready = matches!(lines.next(), Some(Ok(l)) if l.trim() == "ready");
    if !ready {
        let _ = child.kill();
        let _ = child.wait();
        return Err(DemoError::WorkloadDied);
    }
    let result = (|| {
        crate::commands::watch::wait_instrumented(pid, Duration::from_secs(10))?;
        let target = open_target(pid)?;
        let maps = read_maps(pid, &mut BuildIds::default()).unwrap_or_default();
        let mut sym = Symbolizer::new();
        let snap = snapshot::take(
            &target,
            &maps,
            snapshot::Options {
                peak: false,
                symbolizer: Some(&mut sym),
                progress: true,
                request: None,
                keep_allocator_frames: false,
                ages: Default::default(),
                addresses_only: false,
            },
        )?;
        formats::create_private_dir(dir).map_err(|source| DemoError::Write {
            path: dir.to_path_buf(),
            source,
        })?;
        let mut files = Vec::new();
        for f in [
            Format::Pprof,
            Format::Json,
            Format::Svg,
            Format::Dhat,
            Format::Text,
        ] {
            let path = dir.join(format!("heapdump-demo.{}", f.extension()));
            formats::write_snapshot(&path, &snap, f, RenderOptions::default()).map_err(
                |source| DemoError::Write {
                    path: path.clone(),
                    source,
                },
            )?;
            files.push((f, path));
        }
        Ok(DemoReport {
            snapshot: snap,
            files,
        })
    })();
    // Closing stdin ends the workload.
    drop(child.stdin.take());
    let _ = child.wait();
    result
}

/// A recognizable allocation site: an index of strings.
#[inline(never)]
pub fn demo_build_index(n: usize) -> HashMap<String, Vec<u32>> {
    (0..n)
        .map(|i| (format!("key-{i:06}"), vec![i as u32; 8]))
        .collect()
}

/// A recognizable allocation site: a cache of blobs.
#[inline(never)]
pub fn demo_cache_blobs(n: usize, size: usize) -> Vec<Vec<u8>> {
    (0..n).map(|i| vec![(i % 251) as u8; size]).collect()
}

/// A recognizable allocation site: per-thread session logs.
#[inline(never)]
pub fn demo_session_log(thread: usize, n: usize) -> Vec<String> {
    (0..n)
        .map(|i| format!("thread {thread} event {i}"))
        .collect()
}

/// The bundled workload: allocates at a few recognizable sites on several
/// threads, prints `ready`, and holds its heap until stdin ends.
pub fn workload() {
    let index = demo_build_index(20_000);
    let blobs = demo_cache_blobs(64, 64 * 1024);
    let logs: Vec<Vec<String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..2)
            .map(|t| {
                std::thread::Builder::new()
                    .name(format!("demo-worker-{t}"))
                    .spawn_scoped(s, move || demo_session_log(t, 5_000))
                    .expect("spawn")
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect()
    });
    println!("ready");
    let _ = std::io::stdout().flush();
    let mut line = String::new();
    while std::io::stdin().read_line(&mut line).unwrap_or(0) > 0 {
        line.clear();
    }
    std::hint::black_box((&index, &blobs, &logs));
}

/// Options of `heapdump demo`.
#[derive(Args, Debug)]
pub struct DemoArgs {
    /// Directory for the snapshot files.
    #[arg(short, long, default_value = "heapdump-demo")]
    pub(crate) dir: PathBuf,
    #[command(flatten)]
    pub(crate) agent: AgentArgs,
}

/// `heapdump demo`: returns the exit status.
pub fn command(a: DemoArgs) -> anyhow::Result<i32> {
    let report = crate::commands::demo::demo(&a.dir, &a.agent.env()).context("heapdump demo")?;
    let text = crate::formats::text::render(
        &report.snapshot,
        crate::formats::text::TextOptions { top: 5, depth: 4 },
    );
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
