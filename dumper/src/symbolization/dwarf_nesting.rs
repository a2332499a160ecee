//! How deeply a file's DWARF nests its entries, checked before addr2line
//! reads it.
//!
//! addr2line (0.25) reads the inlined calls of a function by recursion, one
//! call level per nested entry, with no bound. A target's library whose
//! `.debug_info` nests `DW_TAG_inlined_subroutine` entries ten thousand
//! deep (one byte each: 20 KB) overflowed the stack of root's heapdump and
//! aborted it, in `snapshot` as in a `watch --all` serving every other
//! process of the host. Compilers nest a few dozen levels (namespaces,
//! classes, lexical blocks, inlined calls); [`MAX_DEPTH`] allows far more.
//!
//! Invariants:
//! - A unit is handed to addr2line only after [`within_bounds`] read all of
//!   its entries and found none nested deeper than [`MAX_DEPTH`]; a file with
//!   one unit deeper than that keeps its symbol table only (the snapshot says
//!   so).
//! - The check itself never recurses: gimli's raw entry reader, one pass,
//!   each entry's attributes skipped by their forms; it ends at the end of
//!   the unit's bytes, at the first entry deeper than the bound, or at the
//!   first malformed entry (which addr2line would stop at too), so its work
//!   is bounded by the section's size, itself within the file's read budget.

use gimli::ReaderOffset as _;

/// Deepest nesting of entries accepted in a unit (the unit's own entry is
/// at depth 0). addr2line's recursion takes at most ~3 KiB of stack a
/// level in a debug build (measured: a library nesting 3 000 levels was
/// symbolized on an 8 MiB main thread, 10 000 overflowed it), so 512
/// levels stay within a 2 MiB thread's stack.
pub const MAX_DEPTH: isize = 512;

/// Why a file's DWARF was not used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NestingError {
    /// A unit nests entries deeper than [`MAX_DEPTH`].
    #[error(
        "its DWARF nests entries deeper than {MAX_DEPTH} levels (unit at .debug_info offset \
         {unit_offset:#x}), which no compiler writes: read from its symbol table only"
    )]
    TooDeep {
        /// Where the unit starts in `.debug_info`.
        unit_offset: usize,
    },
}

/// Whether every unit of `dwarf` nests its entries at most [`MAX_DEPTH`]
/// deep (see the module doc). Units whose header or abbreviations cannot
/// be read are skipped: addr2line cannot read them either.
pub fn within_bounds<R: gimli::Reader>(dwarf: &gimli::Dwarf<R>) -> Result<(), NestingError> {
    let mut units = dwarf.units();
    while let Ok(Some(header)) = units.next() {
        let unit_offset = header
            .offset()
            .as_debug_info_offset()
            .map_or(0, |o| o.0.into_u64() as usize);
        let Ok(abbreviations) = dwarf.abbreviations(&header) else {
            continue;
        };
        if !unit_within_bounds(&header, &abbreviations) {
            return Err(NestingError::TooDeep { unit_offset });
        }
    }
    Ok(())
}

/// Whether one unit's entries nest at most [`MAX_DEPTH`] deep.
fn unit_within_bounds<R: gimli::Reader>(
    header: &gimli::UnitHeader<R>,
    abbreviations: &gimli::Abbreviations,
) -> bool {
    let Ok(mut entries) = header.entries_raw(abbreviations, None) else {
        return true;
    };
    while !entries.is_empty() {
        let depth = entries.next_depth();
        match entries.read_abbreviation() {
            Ok(Some(abbreviation)) => {
                if depth > MAX_DEPTH {
                    return false;
                }
                if entries.skip_attributes(abbreviation.attributes()).is_err() {
                    return true;
                }
            }
            // A null entry: the end of a list of children (one level
            // deeper than an entry that has none).
            Ok(None) => {}
            Err(_) => return true,
        }
    }
    true
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
        let mut info = Vec::new();
        info.extend_from_slice(&((2 + 4 + 1 + body.len()) as u32).to_le_bytes());
        info.extend_from_slice(&4u16.to_le_bytes());
        info.extend_from_slice(&0u32.to_le_bytes());
        info.push(8);
        info.extend_from_slice(&body);
        (info, abbrev)
    }

    fn check(levels: usize) -> Result<(), NestingError> {
        let (info, abbrev) = nested(levels);
        let dwarf = gimli::Dwarf::load(|id| {
            Ok::<_, gimli::Error>(EndianSlice::new(
                match id {
                    gimli::SectionId::DebugInfo => &info[..],
                    gimli::SectionId::DebugAbbrev => &abbrev[..],
                    _ => &[][..],
                },
                LittleEndian,
            ))
        })
        .unwrap();
        within_bounds(&dwarf)
    }

    #[test]
    fn units_nested_as_deep_as_the_bound_are_read_and_deeper_ones_refused() {
        // The subprogram is at depth 1, the last inlined call at 1 + levels.
        assert_eq!(check(0), Ok(()));
        assert_eq!(check(MAX_DEPTH as usize - 1), Ok(()));
        assert_eq!(
            check(MAX_DEPTH as usize),
            Err(NestingError::TooDeep { unit_offset: 0 })
        );
        assert_eq!(
            check(1_000_000),
            Err(NestingError::TooDeep { unit_offset: 0 })
        );
    }
}
