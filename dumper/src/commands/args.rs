//! Option groups shared by several commands (symbolization, selection by
//! age, where a report goes, the agent's settings) and the exit status of
//! a partial snapshot.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

use crate::commands::run::AgentEnv;
use crate::formats::text::{human_bytes, TextOptions};
use crate::formats::{self, Format, RenderOptions};
use crate::process::age::{self, AgeFilter, When};
use crate::process::snapshot;

/// Exit status of `snapshot` (and `symbolize`) when the snapshot was
/// written but is partial (the walk was not clean: target killed
/// mid-update, or a damaged region).
pub const EXIT_PARTIAL: i32 = 2;

/// How frames are symbolized and trimmed.
// The field docs are `--help` text, where `std::allocator<T>` reads right.
#[allow(rustdoc::invalid_html_tags)]
#[derive(Args, Debug, Clone)]
pub struct SymArgs {
    /// Do not symbolize: frames carry addresses and modules only (mappings
    /// and build IDs are still recorded, for symbolizing later).
    #[arg(long)]
    pub(crate) no_symbolize: bool,
    /// pprof: split live values per allocating thread with a `thread` label.
    #[arg(long)]
    pub(crate) per_thread: bool,
    /// Keep the allocator plumbing frames (alloc::raw_vec::..., __rust_alloc,
    /// std::allocator<T>::allocate, operator new, ...) at the leaf end of
    /// each stack. By default they are dropped and the sites that become
    /// identical are merged, so each stack starts at the code that asked
    /// for memory.
    #[arg(long)]
    pub(crate) keep_allocator_frames: bool,
}

/// Which live blocks a snapshot shows, by when they were allocated.
#[derive(Args, Debug, Clone)]
pub struct AgeArgs {
    /// Only blocks allocated before WHEN: a duration before the snapshot
    /// (`1h`: blocks live for at least an hour, the usual leak suspects),
    /// an RFC 3339 time (`2026-11-22T10:00:00Z`), or a JSON snapshot file
    /// (the time it was taken). Sites, threads and every format count only
    /// these blocks; the totals stay the whole heap's. Allocation times come
    /// from a coarse clock: up to one kernel tick (1-10 ms) early.
    #[arg(long, value_name = "WHEN", value_parser = age::parse_when)]
    pub(crate) older_than: Option<When>,
    /// Only blocks allocated at or after WHEN (same forms: `10m`, the last
    /// ten minutes; `A.json`, since snapshot A was taken, still live now).
    #[arg(long, value_name = "WHEN", value_parser = age::parse_when)]
    pub(crate) newer_than: Option<When>,
}

impl AgeArgs {
    pub(crate) fn filter(&self) -> AgeFilter {
        AgeFilter {
            older_than: self.older_than,
            newer_than: self.newer_than,
        }
    }
}

/// Where a report goes and in which format (`snapshot`, `symbolize`,
/// `diff`).
#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Write to FILE (mode 0600) instead of a text report on stdout. The
    /// format follows the name when clear: .pb.gz/.pprof pprof, .json JSON,
    /// .dhat.json DHAT, .folded, .svg, .txt.
    #[arg(short, long, value_name = "FILE")]
    pub(crate) output: Option<PathBuf>,
    /// Output format (default: from the file name, else text).
    #[arg(short, long, value_enum)]
    pub(crate) format: Option<Format>,
    /// Number of sites in the text report.
    #[arg(short = 'n', long, default_value_t = 10)]
    pub(crate) top: usize,
    /// Frames shown per site in the text report.
    #[arg(long, default_value_t = 6)]
    pub(crate) depth: usize,
}

impl ReportArgs {
    /// The format asked for: the flag, else the file name's, else text.
    pub(crate) fn format(&self) -> Result<Format> {
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
    pub(crate) fn write(
        &self,
        snap: &snapshot::Snapshot,
        format: Format,
        per_thread: bool,
    ) -> Result<()> {
        let render = RenderOptions {
            text: TextOptions {
                top: self.top,
                depth: self.depth,
            },
            per_thread,
        };
        match &self.output {
            Some(p) => {
                formats::write_snapshot(p, snap, format, render)
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
                    Format::Json => crate::formats::json::write(snap, &mut out)?,
                    _ => out.write_all(&formats::render(snap, format, render))?,
                }
                out.flush()?;
            }
        }
        Ok(())
    }
}

/// The agent's settings for a program started by `run` or `demo`.
#[derive(Args, Debug, Clone)]
pub struct AgentArgs {
    /// Signal (name or number) that makes the target request a snapshot
    /// (HEAPDUMP_SIGNAL; the agent's default is SIGUSR2).
    #[arg(long)]
    pub(crate) signal: Option<String>,
    /// Deepest stack recorded (HEAPDUMP_MAX_FRAMES).
    #[arg(long)]
    pub(crate) max_frames: Option<u32>,
    /// Record a sample of the allocations instead of every one: about one
    /// per BYTES allocated (e.g. 512KiB, 2MiB), each weighted so that every
    /// figure is an unbiased estimate (HEAPDUMP_SAMPLE_RATE; 0: every
    /// allocation, the default).
    #[arg(long, value_name = "BYTES", value_parser = heapdump_table::byte_size::parse_byte_size)]
    pub(crate) sample_rate: Option<u64>,
    /// Path of libheapdump_preload.so (default: $HEAPDUMP_PRELOAD, else
    /// next to this executable).
    #[arg(long)]
    pub(crate) preload: Option<PathBuf>,
}

impl AgentArgs {
    pub(crate) fn env(&self) -> AgentEnv {
        AgentEnv {
            signal: self.signal.clone(),
            max_frames: self.max_frames,
            sample_rate: self.sample_rate,
            preload: self.preload.clone(),
        }
    }
}
