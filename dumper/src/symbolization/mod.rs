//! From return addresses to functions, files and lines: the target's
//! mappings with build IDs, ELF/DWARF symbolization (inlined frames,
//! demangling, separate debug files), and the allocator frames trimmed
//! from the leaf end of each stack.

pub mod dwarf_limits;
pub mod maps;
pub mod perf_map;
pub mod plumbing;
pub mod symbolizer;
