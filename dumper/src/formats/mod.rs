//! Output formats: choosing one (flag or file name), rendering a snapshot
//! in it, and writing files privately (mode 0600: a heap snapshot can
//! reveal a lot about a service). One module per format.

use std::io::{self, Write};
use std::path::Path;

use clap::ValueEnum;

pub mod dhat;
pub mod flamegraph;
pub mod html;
pub mod json;
pub mod pprof;
pub mod private_output;
pub mod prometheus;
pub mod site_names;
pub mod text;

use private_output::PrivateFile;

use crate::formats::text::TextOptions;
use crate::process::snapshot::Snapshot;

/// A snapshot file format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Format {
    /// Gzipped pprof protobuf in Go's heap layout (`go tool pprof`).
    Pprof,
    /// heapdump's stable JSON schema.
    Json,
    /// DHAT JSON for valgrind's dh_view.html.
    Dhat,
    /// Folded stacks of live bytes (flamegraph.pl / inferno input).
    Folded,
    /// SVG flamegraph of live bytes.
    Svg,
    /// Human-readable top-N report.
    Text,
}

impl Format {
    /// The usual file extension.
    pub fn extension(self) -> &'static str {
        match self {
            Format::Pprof => "pb.gz",
            Format::Json => "json",
            Format::Dhat => "dhat.json",
            Format::Folded => "folded",
            Format::Svg => "svg",
            Format::Text => "txt",
        }
    }

    /// Infers the format from a file name, where unambiguous:
    /// `.pb.gz`/`.pb`/`.pprof` pprof, `.dhat.json` or `dhat*.json` DHAT,
    /// other `.json` JSON, `.folded`, `.svg`, `.txt`.
    pub fn from_path(path: &Path) -> Option<Format> {
        let name = path.file_name()?.to_str()?.to_ascii_lowercase();
        let ends = |s: &str| name.ends_with(s);
        if ends(".pb.gz") || ends(".pb") || ends(".pprof") || ends(".pprof.gz") {
            Some(Format::Pprof)
        } else if ends(".dhat.json") || (name.starts_with("dhat") && ends(".json")) {
            Some(Format::Dhat)
        } else if ends(".json") {
            Some(Format::Json)
        } else if ends(".folded") {
            Some(Format::Folded)
        } else if ends(".svg") {
            Some(Format::Svg)
        } else if ends(".txt") {
            Some(Format::Text)
        } else {
            None
        }
    }
}

/// Rendering options shared by the formats.
#[derive(Clone, Copy, Debug, Default)]
pub struct RenderOptions {
    /// Text report size.
    pub text: TextOptions,
    /// pprof: split live values per thread with a `thread` label.
    pub per_thread: bool,
}

/// Renders `s` in `format`.
pub fn render(s: &Snapshot, format: Format, opts: RenderOptions) -> Vec<u8> {
    match format {
        Format::Pprof => crate::formats::pprof::render(s, opts.per_thread),
        Format::Json => crate::formats::json::render(s),
        Format::Dhat => crate::formats::dhat::render(s),
        Format::Folded => crate::formats::flamegraph::folded(s).into_bytes(),
        Format::Svg => crate::formats::flamegraph::svg(s),
        Format::Text => crate::formats::text::render(s, opts.text).into_bytes(),
    }
}

/// `s` with every control character a target could have put in a name
/// (C0, DEL, C1) written as `\xNN`, so that text output cannot move the
/// cursor, retitle or clear a terminal, and XML stays well-formed.
pub fn escape_controls(s: &str) -> std::borrow::Cow<'_, str> {
    let is_control = |c: char| c.is_control();
    if !s.chars().any(is_control) {
        return std::borrow::Cow::Borrowed(s);
    }
    let mut out = String::with_capacity(s.len() + 8);
    for c in s.chars() {
        if is_control(c) {
            out.push_str(&format!("\\x{:02x}", c as u32));
        } else {
            out.push(c);
        }
    }
    std::borrow::Cow::Owned(out)
}

/// Writes `bytes` to `path` privately (mode 0600, created without
/// following links and renamed into place; see [`private_output`]).
pub fn write_private(path: &Path, bytes: &[u8]) -> io::Result<()> {
    let mut f = PrivateFile::create(path)?;
    f.file().write_all(bytes)?;
    f.commit()
}

/// Writes `s` rendered in `format` to `path` as [`write_private`] does.
/// JSON is serialized straight into the file (a large symbolized snapshot
/// is hundreds of MB of text, never held in memory whole); the other
/// formats are rendered first.
pub fn write_snapshot(
    path: &Path,
    s: &Snapshot,
    format: Format,
    opts: RenderOptions,
) -> io::Result<()> {
    let mut f = PrivateFile::create(path)?;
    {
        let mut w = io::BufWriter::with_capacity(1 << 20, f.file());
        match format {
            Format::Json => crate::formats::json::write(s, &mut w)?,
            _ => w.write_all(&render(s, format, opts))?,
        }
        w.flush()?;
    }
    f.commit()
}

pub use private_output::create_private_dir;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn control_characters_are_escaped() {
        assert_eq!(escape_controls("plain name"), "plain name");
        assert_eq!(
            escape_controls("x\u{1b}]0;T\u{7}y\u{7f}\u{9b}z\n"),
            "x\\x1b]0;T\\x07y\\x7f\\x9bz\\x0a"
        );
    }

    #[test]
    fn formats_from_names() {
        let f = |s: &str| Format::from_path(Path::new(s));
        assert_eq!(f("heap.pb.gz"), Some(Format::Pprof));
        assert_eq!(f("heap.pprof"), Some(Format::Pprof));
        assert_eq!(f("x/heap.json"), Some(Format::Json));
        assert_eq!(f("heap.dhat.json"), Some(Format::Dhat));
        assert_eq!(f("dhat-heap.json"), Some(Format::Dhat));
        assert_eq!(f("a.svg"), Some(Format::Svg));
        assert_eq!(f("a.folded"), Some(Format::Folded));
        assert_eq!(f("a.txt"), Some(Format::Text));
        assert_eq!(f("a.out"), None);
    }
}
