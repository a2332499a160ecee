//! A JIT runtime's perf map (`/tmp/perf-PID.map`): `START SIZE NAME`
//! lines, hex numbers, as node's `--perf-basic-prof`, the JVM's `jcmd PID
//! Compiler.perfmap` and perf's own documentation write them; it names
//! the code the runtime compiled.
//!
//! The map is the target's file: what heapdump keeps of it must not grow
//! faster than the file. A string per entry did (a 100 MB map of
//! six-byte lines took 1.3 GB of root's heapdump, 13 bytes kept for each
//! byte read).
//!
//! Invariants:
//! - What a [`PerfMap`] keeps is the map's text (the caller reads at most
//!   [`MAX_PERF_MAP`] bytes of it) and 24 bytes per entry, at most
//!   [`MAX_ENTRIES`] entries: the map's last ones (a runtime appends as it
//!   compiles, so the newest code is last). Names are slices of the text.
//! - Entries are sorted by start; among entries that start at one
//!   address, the map's later line comes later (the sort is stable), and
//!   a lookup takes the latest that covers the address (a runtime reuses
//!   code space).

/// Largest perf map read (node's with `--perf-basic-prof` grows by a line
/// per compiled function; tens of MiB after days).
pub const MAX_PERF_MAP: u64 = 256 << 20;

/// Most entries kept (real maps at [`MAX_PERF_MAP`] hold about 3 million
/// lines of 60-100 bytes).
pub const MAX_ENTRIES: usize = 4 << 20;

/// One line: where its code starts, how long it is, and where its name
/// lies in the text.
#[derive(Clone, Copy)]
struct Entry {
    start: u64,
    size: u64,
    name_at: u32,
    name_len: u32,
}

/// A parsed perf map (see the module doc).
#[derive(Default)]
pub struct PerfMap {
    text: String,
    entries: Vec<Entry>,
    /// Lines past [`MAX_ENTRIES`] that were not kept.
    dropped: usize,
}

impl PerfMap {
    /// Parses a map's bytes (invalid UTF-8 replaced); unparsable lines are
    /// skipped.
    pub fn parse(bytes: Vec<u8>) -> PerfMap {
        let text = String::from_utf8(bytes)
            .unwrap_or_else(|e| String::from_utf8_lossy(e.as_bytes()).into_owned());
        // Only the last MAX_ENTRIES lines (counted before any is kept).
        let lines = text.lines().count();
        let dropped = lines.saturating_sub(MAX_ENTRIES);
        let mut entries = Vec::new();
        let base = text.as_ptr() as usize;
        for l in text.lines().skip(dropped) {
            let mut it = l.splitn(3, ' ');
            let parsed = (|| {
                let start = u64::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
                let size = u64::from_str_radix(it.next()?.trim_start_matches("0x"), 16).ok()?;
                let name = it.next()?.trim();
                (size > 0 && !name.is_empty()).then_some((start, size, name))
            })();
            let Some((start, size, name)) = parsed else {
                continue;
            };
            // A slice of `text`: its offset fits in u32 (the text is at
            // most MAX_PERF_MAP bytes; a longer one is not kept whole).
            let (Ok(name_at), Ok(name_len)) = (
                u32::try_from(name.as_ptr() as usize - base),
                u32::try_from(name.len()),
            ) else {
                break;
            };
            entries.push(Entry {
                start,
                size,
                name_at,
                name_len,
            });
        }
        entries.sort_by_key(|e| e.start);
        PerfMap {
            text,
            entries,
            dropped,
        }
    }

    /// Entries kept.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether no entry was kept.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// Lines past [`MAX_ENTRIES`] that were not kept (the map's first).
    pub fn dropped(&self) -> usize {
        self.dropped
    }

    /// The name of the code at `address`, if an entry covers it.
    pub fn name(&self, address: u64) -> Option<&str> {
        let i = self.entries.partition_point(|e| e.start <= address);
        // Later entries win (a runtime reuses code space): look back a few.
        self.entries[..i]
            .iter()
            .rev()
            .take(8)
            .find(|e| address < e.start.saturating_add(e.size))
            .and_then(|e| {
                let at = e.name_at as usize;
                self.text.get(at..at + e.name_len as usize)
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn entries_name_their_extent_and_the_latest_line_wins() {
        let map = PerfMap::parse(
            b"7f00aa001000 40 LazyCompile:*alloc app.js:3\n\
              7f00aa000000 100 Builtin:Foo\nnot a line\n7f00aa002000 0 empty\n\
              0x7f00aa000000 0x10 Builtin:Newer\n"
                .to_vec(),
        );
        assert_eq!(map.len(), 3);
        assert_eq!(
            map.name(0x7f00aa001010),
            Some("LazyCompile:*alloc app.js:3")
        );
        assert_eq!(map.name(0x7f00aa000008), Some("Builtin:Newer"));
        assert_eq!(map.name(0x7f00aa0000ff), Some("Builtin:Foo"));
        assert_eq!(map.name(0x7f00aa001040), None);
        assert_eq!(map.name(0x7f00a9ffffff), None);
        // Invalid UTF-8 is replaced, the line kept.
        let map = PerfMap::parse(b"1000 10 caf\xe9\n".to_vec());
        assert_eq!(map.name(0x1000), Some("caf\u{fffd}"));
    }

    #[test]
    fn only_the_last_entries_are_kept_at_24_bytes_each() {
        assert_eq!(std::mem::size_of::<Entry>(), 24);
        let mut text = String::new();
        for i in 0..MAX_ENTRIES + 10 {
            text.push_str(&format!("{:x} 1 f{i}\n", 0x1000 + i));
        }
        let map = PerfMap::parse(text.into_bytes());
        assert_eq!((map.len(), map.dropped()), (MAX_ENTRIES, 10));
        assert_eq!(map.name(0x1000), None);
        assert_eq!(map.name(0x1000 + 10), Some("f10"));
        let last = MAX_ENTRIES + 9;
        assert_eq!(
            map.name(0x1000 + last as u64),
            Some(format!("f{last}").as_str())
        );
    }
}
