//! `heapdump symbolize SNAPSHOT.json`: symbolize a snapshot taken with
//! `--no-symbolize`, later or elsewhere, each mapped file found by the
//! build ID the snapshot recorded; then write it in any format.

use anyhow::Result;
use clap::Args;

use crate::commands::args::{ReportArgs, EXIT_PARTIAL};
use crate::process::snapshot;
use crate::symbolization::maps;
use crate::symbolization::symbolizer::Symbolizer;
use std::io::IsTerminal as _;
use std::path::PathBuf;

/// Options of `heapdump symbolize`.
#[derive(Args, Debug)]
pub struct SymbolizeArgs {
    /// A JSON snapshot, typically written with `snapshot --no-symbolize -o
    /// FILE.json` on the machine that ran the program.
    pub(crate) input: String,
    /// A directory to search (recursively) for the program's and
    /// libraries' files, matched by build ID (repeatable). A mapping whose
    /// own path exists here with the same build ID is found without it.
    #[arg(long, value_name = "DIR")]
    pub(crate) binaries: Vec<PathBuf>,
    #[command(flatten)]
    pub(crate) report: ReportArgs,
    /// pprof: split live values per allocating thread with a `thread` label.
    #[arg(long)]
    pub(crate) per_thread: bool,
    /// Keep the allocator plumbing frames at the leaf end of each stack
    /// (see `snapshot --help`).
    #[arg(long)]
    pub(crate) keep_allocator_frames: bool,
}

/// `heapdump symbolize`: returns the exit status (0, or [`EXIT_PARTIAL`]).
pub fn command(a: SymbolizeArgs) -> Result<i32> {
    let format = a.report.format()?;
    let mut snap = crate::formats::json::read_snapshot(&a.input)?;
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
        snap.notes.extend(sym.take_notes());
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
