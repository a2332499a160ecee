//! What of a target's DWARF addr2line may be handed: bounds on how deeply
//! its entries nest and on the memory addr2line's tables for it would take.
//!
//! addr2line (0.25) trusts the DWARF it reads, and a target's files are
//! anyone's:
//! - It reads a function's inlined calls by recursion, one level per
//!   nested entry, with no bound: a library whose `.debug_info` nested
//!   inlined calls ten thousand deep (one byte each: 20 KB) overflowed root's
//!   heapdump's stack and aborted it (`snapshot`, and a `watch --all` with
//!   every other process's snapshots). Compilers nest a few dozen levels
//!   (62 in heapdump's own debug build); [`MAX_DEPTH`] allows far more.
//! - It builds tables that the DWARF's size does not bound: each row of a
//!   unit's line program becomes 24 bytes (a special opcode is one byte);
//!   each file of a line program's header becomes a path, the unit's
//!   compilation directory in front (a 5-byte entry and a shared 1 MB
//!   directory string make 1 MB: a 17 KB compressed library took 2 GB of
//!   root's heapdump); each function gets its entries, and an entry per
//!   range of every range list it names, however many functions name the
//!   same list.
//!
//! Invariants:
//! - A file's DWARF is handed to addr2line only after [`admit`] read every
//!   unit once, found no entry nested deeper than [`MAX_DEPTH`], and
//!   charged the file's read budget (`HEAPDUMP_MAX_FILE_READ`) with at
//!   least what addr2line's tables for all its units would take (the costs
//!   below follow addr2line 0.25's layouts: review them when it is
//!   upgraded). Otherwise the file is named from its symbol table only,
//!   and the snapshot's notes say why.
//! - The check never recurses; it allocates only gimli's parse of each
//!   unit's first entry and line program header (bounded by their bytes)
//!   and one count per distinct range list; its time is linear in the
//!   sections' sizes (each range list is counted once).

use std::collections::HashMap;

use gimli::ReaderOffset as _;

/// Deepest nesting of entries accepted in a unit (the unit's own entry is
/// at depth 0). addr2line's recursion takes at most ~3 KiB of stack a
/// level in a debug build (measured: a library nesting 3 000 levels was
/// symbolized on an 8 MiB main thread, 10 000 overflowed it), so 512
/// levels stay within a 2 MiB thread's stack.
pub const MAX_DEPTH: isize = 512;

/// addr2line's memory per line row (address, file index, line, column).
const ROW_BYTES: u64 = 24;
/// Per sequence of rows (start, end, the rows' slice).
const SEQUENCE_BYTES: u64 = 32;
/// Per file of a line program: the rendered path's `String`, plus its
/// bytes (counted apart).
const FILE_BYTES: u64 = 24;
/// Per function: its lazily parsed entry (offset, name, its inlined
/// calls' slices, the parse's state) and its address entry.
const FUNCTION_BYTES: u64 = 224;
/// Per inlined call: its entry (offset, name, call file, line, column)
/// and its address entry.
const INLINED_BYTES: u64 = 112;
/// Per address range of a function, an inlined call or a unit.
const RANGE_BYTES: u64 = 32;
/// Per unit (its lazily parsed state).
const UNIT_BYTES: u64 = 1024;

/// Why a file's DWARF was not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    /// A unit nests entries deeper than [`MAX_DEPTH`].
    #[error(
        "its DWARF nests entries deeper than {MAX_DEPTH} levels (unit at .debug_info offset \
         {unit_offset:#x}), which no compiler writes: read from its symbol table only"
    )]
    TooDeep {
        /// Where the unit starts in `.debug_info`.
        unit_offset: usize,
    },
    /// The tables addr2line would build exceed the file's budget.
    #[error(
        "its DWARF would take more than {bytes} bytes of tables to read, past what is left of \
         the file's budget (HEAPDUMP_MAX_FILE_READ) or of all files' \
         (HEAPDUMP_MAX_TOTAL_READ): read from its symbol table only"
    )]
    TooBig {
        /// The estimate when it went past the budget (saturating).
        bytes: u64,
    },
}

/// Checks `dwarf` before addr2line reads it (see the module doc): the
/// bytes addr2line's tables would take at most (to be charged to the
/// file's budget), once every unit was read, its nesting found within
/// [`MAX_DEPTH`] and the estimate within `available` bytes. Stops at the
/// first unit past either bound, so its own work is bounded by the
/// sections' sizes and `available` (see [`range_count`]). Units whose
/// headers, abbreviations or first entry cannot be read are skipped
/// (addr2line skips them too); a unit's entries or line program are read
/// up to their first malformed part.
pub fn admit<R: gimli::Reader>(dwarf: &gimli::Dwarf<R>, available: u64) -> Result<u64, Refusal> {
    let mut estimate = Estimate {
        bytes: 0,
        available,
    };
    let mut range_lists = HashMap::new();
    let mut units = dwarf.units();
    while let Ok(Some(header)) = units.next() {
        let unit_offset = header
            .offset()
            .as_debug_info_offset()
            .map_or(0, |o| o.0.into_u64() as usize);
        let Ok(unit) = dwarf.unit(header) else {
            continue;
        };
        let unit = unit.unit_ref(dwarf);
        estimate.add(UNIT_BYTES)?;
        entries_cost(unit, unit_offset, &mut range_lists, &mut estimate)?;
        lines_cost(unit, &mut estimate)?;
    }
    Ok(estimate.bytes)
}

/// The running estimate of addr2line's tables, and what it may reach.
struct Estimate {
    bytes: u64,
    available: u64,
}

impl Estimate {
    /// Adds `n` bytes; `TooBig` once past what is available.
    fn add(&mut self, n: u64) -> Result<(), Refusal> {
        self.bytes = self.bytes.saturating_add(n);
        if self.bytes > self.available {
            return Err(Refusal::TooBig { bytes: self.bytes });
        }
        Ok(())
    }

    /// Entries of [`RANGE_BYTES`] that still fit, plus one (the one that
    /// does not).
    fn ranges_left(&self) -> u64 {
        (self.available - self.bytes) / RANGE_BYTES + 1
    }
}

/// Adds what addr2line's function tables for a unit take at most;
/// `TooDeep` when an entry nests deeper than [`MAX_DEPTH`].
/// `range_lists`: entries of each range list counted so far, by unit (a
/// list is read with its unit's address size and bases) and offset.
fn entries_cost<R: gimli::Reader>(
    unit: gimli::UnitRef<'_, R>,
    unit_offset: usize,
    range_lists: &mut HashMap<(usize, R::Offset), u64>,
    estimate: &mut Estimate,
) -> Result<(), Refusal> {
    let Ok(mut entries) = unit.entries_raw(None) else {
        return Ok(());
    };
    while !entries.is_empty() {
        let depth = entries.next_depth();
        let abbreviation = match entries.read_abbreviation() {
            Ok(Some(a)) => a,
            // A null entry: the end of a list of children (one level
            // deeper than an entry that has none).
            Ok(None) => continue,
            Err(_) => break,
        };
        if depth > MAX_DEPTH {
            return Err(Refusal::TooDeep { unit_offset });
        }
        let cost = match abbreviation.tag() {
            gimli::DW_TAG_subprogram => FUNCTION_BYTES,
            gimli::DW_TAG_inlined_subroutine => INLINED_BYTES,
            // Its ranges, if a list, are the unit's (counted below).
            gimli::DW_TAG_compile_unit => 0,
            _ => {
                if entries.skip_attributes(abbreviation.attributes()).is_err() {
                    break;
                }
                continue;
            }
        };
        estimate.add(cost)?;
        for spec in abbreviation.attributes() {
            let Ok(attr) = entries.read_attribute(*spec) else {
                return Ok(());
            };
            if attr.name() != gimli::DW_AT_ranges {
                continue;
            }
            let Ok(Some(offset)) = unit.attr_ranges_offset(attr.value()) else {
                continue;
            };
            let most = estimate.ranges_left();
            let ranges = *range_lists
                .entry((unit_offset, offset.0))
                .or_insert_with(|| range_count(unit, offset, most));
            estimate.add(ranges.saturating_mul(RANGE_BYTES))?;
        }
    }
    Ok(())
}

/// The entries of one range list (up to its first malformed one), at
/// most `most` of them. Lists may overlap (each entry of one long list can
/// start a list of its own, named by a function of its own), so counting
/// them all could take time quadratic in the section's size; but every
/// entry counted is charged to the estimate, which ends the check once
/// past what is available, so all the counting together stays within
/// `available / RANGE_BYTES` entries, plus at most `most` for the list
/// that goes past.
fn range_count<R: gimli::Reader>(
    unit: gimli::UnitRef<'_, R>,
    offset: gimli::RangeListsOffset<R::Offset>,
    most: u64,
) -> u64 {
    let Ok(mut list) = unit.ranges(offset) else {
        return 0;
    };
    let mut n = 0u64;
    while n < most {
        match list.next() {
            Ok(Some(_)) => n += 1,
            Ok(None) | Err(_) => break,
        }
    }
    n
}

/// Adds what addr2line's line table for a unit takes at most: its rows
/// (one per change of address within a sequence, as addr2line keeps
/// them), its sequences, and each file's rendered path.
fn lines_cost<R: gimli::Reader>(
    unit: gimli::UnitRef<'_, R>,
    estimate: &mut Estimate,
) -> Result<(), Refusal> {
    let Some(program) = unit.line_program.clone() else {
        return Ok(());
    };
    let mut rows = program.rows();
    let mut last: Option<u64> = None;
    while let Ok(Some((_, row))) = rows.next_row() {
        if row.end_sequence() {
            estimate.add(SEQUENCE_BYTES)?;
            last = None;
        } else if last != Some(row.address()) {
            estimate.add(ROW_BYTES)?;
            last = Some(row.address());
        }
    }
    // The files as addr2line renders them (index 0, if any, then on),
    // those a program defined as it ran included.
    let header = rows.header();
    let comp_dir = unit.comp_dir.as_ref().map_or(0, |d| d.len().into_u64());
    let length =
        |v: gimli::AttributeValue<R>| unit.attr_string(v).map_or(0, |s| s.len().into_u64());
    let mut index = 0u64;
    loop {
        let Some(file) = header.file(index) else {
            if index == 0 {
                index = 1;
                continue;
            }
            break;
        };
        let dir = if file.directory_index() != 0 {
            file.directory(header).map_or(0, length)
        } else {
            0
        };
        let path = comp_dir + 1 + dir + 1 + length(file.path_name());
        estimate.add(FILE_BYTES.saturating_add(path))?;
        index += 1;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use gimli::{EndianSlice, LittleEndian};

    /// A DWARF 4 `.debug_info` with one unit: a compile unit, a
    /// subprogram, then `levels` inlined subroutines each inside the last
    /// (no attributes, one byte each), and its `.debug_abbrev`.
    fn nested(levels: usize) -> (Vec<u8>, Vec<u8>) {
        let abbrev = vec![
            1, 0x11, 1, 0, 0, // 1: compile unit, children
            2, 0x2e, 1, 0, 0, // 2: subprogram, children
            3, 0x1d, 1, 0, 0, // 3: inlined subroutine, children
            0,
        ];
        let mut body = vec![1, 2];
        body.extend(std::iter::repeat_n(3u8, levels));
        body.extend(std::iter::repeat_n(0u8, levels + 2));
        (unit(&body), abbrev)
    }

    /// A DWARF 4 unit of `body` (abbreviations at 0, 8-byte addresses).
    fn unit(body: &[u8]) -> Vec<u8> {
        let mut info = Vec::new();
        info.extend_from_slice(&((2 + 4 + 1 + body.len()) as u32).to_le_bytes());
        info.extend_from_slice(&4u16.to_le_bytes());
        info.extend_from_slice(&0u32.to_le_bytes());
        info.push(8);
        info.extend_from_slice(body);
        info
    }

    fn admit_sections(
        sections: &[(gimli::SectionId, &[u8])],
        budget: u64,
    ) -> (Result<(), Refusal>, u64) {
        let dwarf = gimli::Dwarf::load(|id| {
            Ok::<_, gimli::Error>(EndianSlice::new(
                sections.iter().find(|s| s.0 == id).map_or(&[][..], |s| s.1),
                LittleEndian,
            ))
        })
        .unwrap();
        match admit(&dwarf, budget) {
            Ok(bytes) => (Ok(()), bytes),
            Err(e) => {
                let bytes = match e {
                    Refusal::TooBig { bytes } => bytes,
                    Refusal::TooDeep { .. } => 0,
                };
                (Err(e), bytes)
            }
        }
    }

    fn check(levels: usize) -> Result<(), Refusal> {
        let (info, abbrev) = nested(levels);
        admit_sections(
            &[
                (gimli::SectionId::DebugInfo, &info),
                (gimli::SectionId::DebugAbbrev, &abbrev),
            ],
            u64::MAX,
        )
        .0
    }

    #[test]
    fn units_nested_as_deep_as_the_bound_are_read_and_deeper_ones_refused() {
        // The subprogram is at depth 1, the last inlined call at 1 + levels.
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(MAX_DEPTH as usize - 1), Ok(()));
        assert_eq!(
            check(MAX_DEPTH as usize),
            Err(Refusal::TooDeep { unit_offset: 0 })
        );
        assert_eq!(check(1_000_000), Err(Refusal::TooDeep { unit_offset: 0 }));
    }

    /// A unit whose compilation directory is a `dir_len`-byte string and
    /// whose line program names `files` files and has `rows` rows at
    /// successive addresses, and the sections that hold it.
    fn lines_unit(dir_len: usize, files: usize, rows: usize) -> [(gimli::SectionId, Vec<u8>); 4] {
        // 1: compile unit (stmt_list sec_offset, comp_dir strp).
        let abbrev = vec![1, 0x11, 0, 0x10, 0x17, 0x1b, 0x0e, 0, 0, 0];
        let mut body = vec![1];
        body.extend_from_slice(&0u32.to_le_bytes());
        body.extend_from_slice(&0u32.to_le_bytes());
        let mut strings = vec![b'd'; dir_len];
        strings.push(0);
        let mut rest = vec![1, 1, 1, (-5i8) as u8, 14, 13];
        rest.extend_from_slice(&[0, 1, 1, 1, 1, 0, 0, 0, 1, 0, 0, 1]);
        rest.push(0); // no include directories
        for _ in 0..files {
            rest.extend_from_slice(b"a\0\0\0\0");
        }
        rest.push(0);
        let mut program = vec![0, 9, 2];
        program.extend_from_slice(&0x1000u64.to_le_bytes());
        // Special opcode: address +1, line +0.
        program.extend(std::iter::repeat_n(5 + 14 + 13, rows));
        program.extend_from_slice(&[0, 1, 1]);
        let mut after = 4u16.to_le_bytes().to_vec();
        after.extend_from_slice(&(rest.len() as u32).to_le_bytes());
        after.extend_from_slice(&rest);
        after.extend_from_slice(&program);
        let mut line = (after.len() as u32).to_le_bytes().to_vec();
        line.extend_from_slice(&after);
        [
            (gimli::SectionId::DebugInfo, unit(&body)),
            (gimli::SectionId::DebugAbbrev, abbrev),
            (gimli::SectionId::DebugStr, strings),
            (gimli::SectionId::DebugLine, line),
        ]
    }

    fn charged_for(
        dir_len: usize,
        files: usize,
        rows: usize,
        budget: u64,
    ) -> (Result<(), Refusal>, u64) {
        let s = lines_unit(dir_len, files, rows);
        let refs: Vec<(gimli::SectionId, &[u8])> = s.iter().map(|(id, b)| (*id, &b[..])).collect();
        admit_sections(&refs, budget)
    }

    #[test]
    fn line_tables_are_charged_for_their_rows_and_every_files_whole_path() {
        let (_, base) = charged_for(10, 0, 0, u64::MAX);
        // Each row: 24 bytes.
        let (_, with_rows) = charged_for(10, 0, 1000, u64::MAX);
        assert_eq!(with_rows - base, 1000 * ROW_BYTES);
        // Each file: its path, the compilation directory in front.
        let (_, with_files) = charged_for(1_000_000, 100, 0, u64::MAX);
        let (_, no_files) = charged_for(1_000_000, 0, 0, u64::MAX);
        assert!(
            with_files - no_files >= 100 * 1_000_000,
            "{with_files} {no_files}"
        );
        // What a 1 MB directory named by 2 000 files of 5 bytes would take
        // is refused under a 1 GiB budget, not handed to addr2line.
        let (r, bytes) = charged_for(1_000_000, 2000, 0, 1 << 30);
        assert_eq!(r, Err(Refusal::TooBig { bytes }));
        assert!(bytes > 1 << 30);
    }

    /// A unit of `functions` functions, the k-th naming the range list
    /// that starts at the k-th entry of one list of `ranges` entries
    /// (DWARF 4 `.debug_ranges`), and the sections that hold it.
    fn overlapping_lists(functions: usize, ranges: usize) -> [(gimli::SectionId, Vec<u8>); 3] {
        // 1: compile unit, children; 2: subprogram, DW_AT_ranges sec_offset.
        let abbrev = vec![1, 0x11, 1, 0, 0, 2, 0x2e, 0, 0x55, 0x17, 0, 0, 0];
        let mut body = vec![1];
        for k in 0..functions {
            body.push(2);
            body.extend_from_slice(&((16 * k) as u32).to_le_bytes());
        }
        body.push(0);
        let mut list = Vec::new();
        for i in 0..ranges as u64 {
            list.extend_from_slice(&(0x1000 + i).to_le_bytes());
            list.extend_from_slice(&(0x1001 + i).to_le_bytes());
        }
        list.extend_from_slice(&[0; 16]);
        [
            (gimli::SectionId::DebugInfo, unit(&body)),
            (gimli::SectionId::DebugAbbrev, abbrev),
            (gimli::SectionId::DebugRanges, list),
        ]
    }

    #[test]
    fn every_function_is_charged_for_each_range_of_the_list_it_names() {
        let s = overlapping_lists(1000, 1000);
        let refs: Vec<(gimli::SectionId, &[u8])> = s.iter().map(|(id, b)| (*id, &b[..])).collect();
        // Function k's list holds 1000 - k ranges.
        let ranges: u64 = (1..=1000).sum();
        assert_eq!(
            admit_sections(&refs, u64::MAX),
            (
                Ok(()),
                UNIT_BYTES + 1000 * FUNCTION_BYTES + ranges * RANGE_BYTES
            )
        );
        // Counting stops once past the budget (the lists together hold
        // quadratically many entries).
        let s = overlapping_lists(100_000, 100_000);
        let refs: Vec<(gimli::SectionId, &[u8])> = s.iter().map(|(id, b)| (*id, &b[..])).collect();
        let (r, bytes) = admit_sections(&refs, 1 << 20);
        assert_eq!(r, Err(Refusal::TooBig { bytes }));
        assert!(bytes > 1 << 20 && bytes < 1 << 23, "{bytes}");
    }
}
