//! Allocator plumbing frames: the functions between the code that asked for
//! memory and the allocator itself (`Vec`'s raw buffer, `alloc::alloc`,
//! `__rust_alloc`, `std::allocator<T>::allocate`, ...). They are the same
//! in nearly every stack, so they hide the allocation site: snapshots drop
//! them from the leaf end of each stack (`--keep-allocator-frames` keeps
//! them).
//!
//! Only *leading* frames are dropped: stripping stops at the first frame
//! that is not plumbing, so a user function called from allocator code
//! further up is never removed, and a stack made only of plumbing is kept
//! whole. Matching is on the demangled function name, by full path prefix
//! (ending in `::`, `<` or `(`) or exact symbol, so `alloc_buffer` or
//! `myalloc::Pool::alloc` never match. A qualified path such as
//! `<alloc::alloc::Global as core::alloc::Allocator>::allocate` or
//! `<alloc::raw_vec::RawVecInner>::grow_amortized` is matched on its self
//! type; any implementation of `GlobalAlloc` (a wrapper global allocator)
//! is plumbing too.
//!
//! The list:
//!
//! | matched | what |
//! |---|---|
//! | `alloc::alloc::`, `alloc::raw_vec::` | Rust's allocation entry points and `Vec`/`String`'s raw buffer |
//! | `core::alloc::`, `std::alloc::` | `Allocator`/`GlobalAlloc` glue, `System` |
//! | `std::sys::alloc::`, `std::sys::pal::unix::alloc::`, `std::sys::unix::alloc::` | `System`'s implementation (names of several Rust versions) |
//! | `__rust_alloc`, `__rust_alloc_zeroed`, `__rust_realloc`, `__rg_alloc`, `__rg_alloc_zeroed`, `__rg_realloc`, `__rdl_alloc`, `__rdl_alloc_zeroed`, `__rdl_realloc`, and anything under `__rustc::` (where recent compilers put them: `__rustc::__rust_alloc`) | the global allocator shims |
//! | `heapdump_agent::` | heapdump's own agent |
//! | `<... as core::alloc::global::GlobalAlloc>::`, `<impl core::alloc::global::GlobalAlloc for ...>` | any global allocator implementation |
//! | `std::__new_allocator<`, `__gnu_cxx::new_allocator<`, `std::allocator<`, `std::allocator_traits<`, `std::_Vector_base<` | libstdc++ allocators and `vector`'s buffer |
//! | `operator new(`, `operator new[](` | C++ `new` (calls `malloc`) |

use crate::symbolization::symbolizer::Frame;

/// Path prefixes of plumbing functions (matched against the name, or the
/// self type of a qualified `<T as Trait>::f` / `<T>::f` name).
pub const PREFIXES: &[&str] = &[
    "alloc::alloc::",
    "alloc::raw_vec::",
    "core::alloc::",
    "std::alloc::",
    "std::sys::alloc::",
    "std::sys::pal::unix::alloc::",
    "std::sys::unix::alloc::",
    "heapdump_agent::",
    "__rustc::",
    "std::__new_allocator<",
    "__gnu_cxx::new_allocator<",
    "std::allocator<",
    "std::allocator_traits<",
    "std::_Vector_base<",
    "operator new(",
    "operator new[](",
];

/// Exact names of plumbing symbols (the global allocator shims).
pub const SYMBOLS: &[&str] = &[
    "__rust_alloc",
    "__rust_alloc_zeroed",
    "__rust_realloc",
    "__rg_alloc",
    "__rg_alloc_zeroed",
    "__rg_realloc",
    "__rdl_alloc",
    "__rdl_alloc_zeroed",
    "__rdl_realloc",
];

/// Traits whose implementations are plumbing.
const TRAITS: &[&str] = &[
    "core::alloc::global::GlobalAlloc",
    "core::alloc::GlobalAlloc",
];

/// Whether the demangled function name `name` is allocator plumbing.
pub fn is_allocator_function(name: &str) -> bool {
    let name = name.trim();
    if SYMBOLS.contains(&name) {
        return true;
    }
    if PREFIXES.iter().any(|p| name.starts_with(p)) {
        return true;
    }
    // `<T as Trait>::f`, `<T>::f`, `<&T as Trait>::f`: match T, and Trait
    // against the allocator traits.
    if let Some(rest) = name.strip_prefix('<') {
        let rest = rest.trim_start_matches('&').trim_start_matches("mut ");
        if PREFIXES.iter().any(|p| rest.starts_with(p)) {
            return true;
        }
        if let Some(close) = qualified_end(rest) {
            let inner = &rest[..close];
            if let Some((_, tr)) = inner.split_once(" as ") {
                if TRAITS.iter().any(|t| tr.starts_with(t)) {
                    return true;
                }
            }
        }
    }
    // `path::<impl core::alloc::global::GlobalAlloc for T>::f`.
    TRAITS
        .iter()
        .any(|t| name.contains(&format!("<impl {t} for ")))
}

/// Index of the `>` that closes a qualified path opened just before `s`.
fn qualified_end(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    for (i, c) in s.char_indices() {
        match c {
            '<' => depth += 1,
            '>' if depth == 0 => return Some(i),
            '>' => depth -= 1,
            _ => {}
        }
    }
    None
}

/// Whether a symbolized frame is plumbing (an unsymbolized one is not).
pub fn is_allocator_frame(frame: &Frame) -> bool {
    frame.function.as_deref().is_some_and(is_allocator_function)
}

/// Removes the leading plumbing frames of a stack (leaf first); returns how
/// many were removed. A stack made only of plumbing is left whole.
pub fn strip_leading(frames: &mut Vec<Frame>) -> usize {
    let n = frames.iter().take_while(|f| is_allocator_frame(f)).count();
    if n == frames.len() {
        return 0;
    }
    frames.drain(..n);
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(address: u64, f: &str) -> Frame {
        Frame {
            address,
            function: Some(f.to_string()),
            ..Frame::default()
        }
    }

    #[test]
    fn rust_plumbing_matches() {
        for f in [
            "alloc::alloc::alloc",
            "alloc::alloc::realloc",
            "alloc::alloc::Global::alloc_impl_runtime",
            "<alloc::alloc::Global>::grow_impl",
            "<alloc::alloc::Global as core::alloc::Allocator>::allocate",
            "alloc::raw_vec::RawVecInner<A>::try_allocate_in",
            "<alloc::raw_vec::RawVecInner>::finish_grow",
            "<alloc::raw_vec::RawVecInner<_>>::reserve::do_reserve_and_handle::<alloc::alloc::Global>",
            "alloc::raw_vec::finish_grow",
            "__rust_alloc",
            "__rustc::__rust_alloc",
            "__rustc::__rust_realloc",
            "__rustc::__rust_alloc_zeroed",
            "__rustc::__rdl_alloc",
            "__rust_realloc",
            "__rust_alloc_zeroed",
            "__rg_alloc",
            "__rdl_alloc",
            "<heapdump_agent::global_alloc::Agent as core::alloc::global::GlobalAlloc>::alloc",
            "heapdump_agent::recorder::record",
            "<std::alloc::System as core::alloc::global::GlobalAlloc>::alloc",
            "std::alloc::System::alloc_impl",
            "core::alloc::layout::Layout::array",
            "std::sys::alloc::unix::<impl core::alloc::global::GlobalAlloc for std::alloc::System>::alloc",
            "std::sys::pal::unix::alloc::<impl core::alloc::global::GlobalAlloc for std::alloc::System>::realloc",
            "<myapp::CountingAlloc as core::alloc::global::GlobalAlloc>::alloc",
        ] {
            assert!(is_allocator_function(f), "{f} should be plumbing");
        }
    }

    #[test]
    fn cxx_plumbing_matches() {
        for f in [
            "std::__new_allocator<int>::allocate(unsigned long, void const*)",
            "std::allocator<int>::allocate(unsigned long)",
            "__gnu_cxx::new_allocator<char>::allocate(unsigned long, void const*)",
            "std::allocator_traits<std::allocator<int> >::allocate(std::allocator<int>&, unsigned long)",
            "std::_Vector_base<int, std::allocator<int> >::_M_allocate(unsigned long)",
            "operator new(unsigned long)",
            "operator new[](unsigned long)",
        ] {
            assert!(is_allocator_function(f), "{f} should be plumbing");
        }
    }

    #[test]
    fn user_code_never_matches() {
        for f in [
            "alloc_buffer",
            "myapp::alloc_buffer",
            "myapp::alloc::Pool::alloc",
            "alloc_utils::alloc::grow",
            "alloc::vec::Vec<T,A>::with_capacity_in",
            "alloc::vec::from_elem",
            "<alloc::vec::Vec<T> as core::iter::traits::collect::FromIterator<T>>::from_iter",
            "alloc::fmt::format",
            "hashbrown::raw::RawTable<T,A>::reserve_rehash",
            "<myapp::Arena as core::alloc::Allocator>::allocate_chunk",
            "<myapp::Buffer as core::clone::Clone>::clone",
            "core::iter::traits::iterator::Iterator::collect",
            "std::vector<int, std::allocator<int> >::push_back(int const&)",
            "std::__cxx11::basic_string<char, std::char_traits<char>, std::allocator<char> >::_M_create(unsigned long&, unsigned long)",
            "operator newline_handler(int)",
            "new_allocator_stats",
            "rust_allocate",
            "__rust_alloc_wrapper_of_mine",
            "__rustc_like::alloc",
            "site_malloc",
            "main",
        ] {
            assert!(!is_allocator_function(f), "{f} must not be plumbing");
        }
    }

    #[test]
    fn strips_only_leading_frames() {
        let mut frames = vec![
            frame(1, "alloc::alloc::alloc"),
            frame(
                1,
                "<alloc::alloc::Global as core::alloc::Allocator>::allocate",
            ),
            frame(1, "alloc::raw_vec::RawVecInner<A>::try_allocate_in"),
            frame(1, "alloc::vec::Vec<T>::with_capacity"),
            frame(2, "myapp::alloc_buffer"),
            frame(3, "alloc::alloc::alloc"),
            frame(4, "main"),
        ];
        assert_eq!(strip_leading(&mut frames), 3);
        let names: Vec<_> = frames
            .iter()
            .map(|f| f.function.as_deref().unwrap())
            .collect();
        assert_eq!(
            names,
            [
                "alloc::vec::Vec<T>::with_capacity",
                "myapp::alloc_buffer",
                "alloc::alloc::alloc",
                "main"
            ]
        );
    }

    #[test]
    fn keeps_all_plumbing_and_unsymbolized_stacks() {
        let mut all = vec![frame(1, "__rust_alloc"), frame(2, "alloc::alloc::alloc")];
        assert_eq!(strip_leading(&mut all), 0);
        assert_eq!(all.len(), 2);
        let mut unsym = vec![
            Frame {
                address: 5,
                ..Frame::default()
            },
            frame(6, "__rust_alloc"),
        ];
        assert_eq!(strip_leading(&mut unsym), 0);
        assert_eq!(unsym.len(), 2);
        let mut empty = Vec::new();
        assert_eq!(strip_leading(&mut empty), 0);
    }
}
