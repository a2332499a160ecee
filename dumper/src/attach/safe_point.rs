//! Whether a stopped thread may run `dlopen`: none of its frames may be
//! inside code that can hold a lock `dlopen` or the agent's start needs
//! (the allocator's, the loader's, `fork`'s, the thread-stack cache's).
//! Running `dlopen` in a thread that holds one of them deadlocks the
//! process: the classic failure of debugger-driven injection.
//!
//! Invariants:
//! - The answer errs on the side of "no": a chain the unwinder could not
//!   finish counts every word of the rest of the stack as a possible
//!   return address; a thread with little stack left is refused.
//! - Dangerous code is found by file (the loader, allocator libraries) and
//!   by symbol: glibc's malloc, as the span of `libc.so.6` between the
//!   exported functions around its malloc family (Debian's libc has only
//!   `.dynsym`, and `_int_malloc` and the other static helpers of
//!   `malloc.c` sit between them), and its `dl*`, `fork`, thread creation,
//!   exit and backtrace functions.

use crate::attach::remote_unwind::{self, Memory, Modules, Regs};

/// Address ranges of the target in which no frame of the chosen thread
/// may be, each with the reason shown when one is.
#[derive(Debug, Default)]
pub struct Danger {
    ranges: Vec<(u64, u64, String)>,
}

/// Allocator libraries, by file-name prefix.
const ALLOCATOR_FILES: &[&str] = &[
    "libjemalloc",
    "libtcmalloc",
    "libmimalloc",
    "libhoard",
    "libsnmalloc",
    "libheapdump_",
];

/// glibc's exported functions of `malloc.c`.
const MALLOC_FAMILY: &[&str] = &[
    "malloc",
    "free",
    "cfree",
    "calloc",
    "realloc",
    "reallocarray",
    "memalign",
    "aligned_alloc",
    "posix_memalign",
    "valloc",
    "pvalloc",
    "malloc_usable_size",
    "malloc_trim",
    "mallopt",
    "mallinfo",
    "mallinfo2",
    "malloc_stats",
    "malloc_info",
    "__libc_malloc",
    "__libc_free",
    "__libc_calloc",
    "__libc_realloc",
    "__libc_memalign",
    "__libc_valloc",
    "__libc_pvalloc",
    "__libc_mallinfo",
    "__libc_mallopt",
    "__malloc_fork_lock_parent",
    "__malloc_fork_unlock_parent",
    "__malloc_fork_unlock_child",
];

/// Other glibc functions that hold a lock `dlopen` or a new thread needs.
fn dangerous_libc_function(name: &str) -> bool {
    let name = name.split('@').next().unwrap_or(name);
    name.starts_with("dl")
        || name.starts_with("_dl")
        || name.starts_with("__libc_dl")
        || name.starts_with("__dl")
        || matches!(
            name,
            "fork"
                | "_Fork"
                | "__fork"
                | "__libc_fork"
                | "vfork"
                | "pthread_create"
                | "pthread_join"
                | "pthread_tryjoin_np"
                | "pthread_timedjoin_np"
                | "pthread_clockjoin_np"
                | "pthread_detach"
                | "pthread_exit"
                | "exit"
                | "_exit"
                | "quick_exit"
                | "__cxa_finalize"
                | "__cxa_atexit"
                | "__cxa_thread_atexit_impl"
                | "atexit"
                | "on_exit"
                | "backtrace"
                | "__backtrace"
                | "backtrace_symbols"
                | "__libc_freeres"
                | "__libc_thread_freeres"
                | "iconv_open"
                | "setlocale"
                | "newlocale"
                | "getaddrinfo"
                | "getpwnam"
                | "getpwuid"
                | "getpwnam_r"
                | "getpwuid_r"
                | "gethostbyname"
                | "gethostbyname_r"
        )
}

impl Danger {
    /// The dangerous ranges of a process, from its mappings and files.
    pub fn of(modules: &mut Modules) -> Danger {
        let mut d = Danger::default();
        let maps = modules.maps.clone();
        for m in &maps {
            let base = m.basename();
            if super::is_glibc_library(base, "ld") {
                d.ranges
                    .push((m.start, m.end, "in the dynamic loader".to_string()));
                continue;
            }
            if let Some(lib) = ALLOCATOR_FILES.iter().find(|p| base.starts_with(**p)) {
                d.ranges.push((
                    m.start,
                    m.end,
                    format!("inside the allocator ({})", lib.trim_end_matches('_')),
                ));
                continue;
            }
            let is_libc = super::is_glibc_library(base, "libc");
            let is_cxx = base.starts_with("libstdc++") || base.starts_with("libc++");
            let is_dl = super::is_glibc_library(base, "libdl")
                || super::is_glibc_library(base, "libpthread");
            if !(is_libc || is_cxx || is_dl) {
                continue;
            }
            let Some(file) = modules.file(m) else {
                // An unreadable libc: nothing can be told of it; count it
                // all, so that no thread inside it is chosen.
                d.ranges
                    .push((m.start, m.end, format!("inside {base} (unreadable)")));
                continue;
            };
            let Some(bias) = file.bias(m) else { continue };
            let mut add = |start: u64, end: u64, why: String| {
                let (s, e) = (start.wrapping_add(bias), end.wrapping_add(bias));
                if s < m.end && e > m.start {
                    d.ranges.push((s.max(m.start), e.min(m.end), why));
                }
            };
            if is_cxx {
                for f in &file.funcs {
                    if ["_Znw", "_Zna", "_Zdl", "_Zda"]
                        .iter()
                        .any(|p| f.name.starts_with(p))
                    {
                        add(f.start, f.end, format!("in C++ {}", f.name));
                    }
                }
                continue;
            }
            for f in &file.funcs {
                if dangerous_libc_function(&f.name) {
                    add(f.start, f.end, format!("in {}", f.name));
                }
            }
            if is_libc {
                if let Some((s, e)) = malloc_span(&file.funcs) {
                    add(s, e, "inside glibc's malloc".to_string());
                }
            }
        }
        d
    }

    /// Why `pc` is dangerous, if it is.
    pub fn at(&self, pc: u64) -> Option<&str> {
        self.ranges
            .iter()
            .find(|(s, e, _)| (*s..*e).contains(&pc))
            .map(|(_, _, why)| why.as_str())
    }
}

/// The span of glibc's `malloc.c`: from the end of the last exported
/// function below its lowest family member to the start of the first one
/// above its highest (symbols at a family member's address are aliases).
fn malloc_span(funcs: &[remote_unwind::Func]) -> Option<(u64, u64)> {
    let is_family = |n: &str| MALLOC_FAMILY.contains(&n.split('@').next().unwrap_or(n));
    let family: Vec<&remote_unwind::Func> = funcs.iter().filter(|f| is_family(&f.name)).collect();
    let lo = family.iter().map(|f| f.start).min()?;
    let hi = family.iter().map(|f| f.end).max()?;
    let starts: std::collections::HashSet<u64> = family.iter().map(|f| f.start).collect();
    let others = funcs
        .iter()
        .filter(|f| !is_family(&f.name) && !starts.contains(&f.start));
    let mut below = 0u64;
    let mut above = u64::MAX;
    for f in others {
        if f.end <= lo {
            below = below.max(f.end);
        } else if f.start >= hi {
            above = above.min(f.start);
        } else if f.start < lo {
            below = below.max(f.start + 1);
        }
    }
    (above != u64::MAX).then_some((below, above))
}

/// Stack a thread must have left below its stack pointer to run `dlopen`
/// and the agent's start.
pub const STACK_NEEDED: u64 = 128 << 10;

/// The verdict on one thread.
#[derive(Debug)]
pub enum Verdict {
    /// It may run `dlopen`.
    Safe,
    /// It may not, and why.
    Unsafe(String),
}

/// Judges a stopped thread with registers `regs`. `stack` is the mapping
/// holding its stack pointer (start, end, whether it is the main thread's
/// growable `[stack]`).
pub fn judge(
    mem: &Memory,
    modules: &mut Modules,
    danger: &Danger,
    regs: Regs,
    stack: Option<(u64, u64, bool)>,
) -> Verdict {
    let Some((lo, hi, growable)) = stack else {
        return Verdict::Unsafe("its stack pointer is in no mapping".into());
    };
    if !growable && regs.rsp.saturating_sub(lo) < STACK_NEEDED {
        return Verdict::Unsafe(format!(
            "only {} KiB of stack left below its stack pointer (an alternate signal stack or a \
             coroutine's?)",
            regs.rsp.saturating_sub(lo) >> 10
        ));
    }
    let w = remote_unwind::walk(mem, modules, regs);
    for pc in &w.pcs {
        if let Some(why) = danger.at(*pc) {
            return Verdict::Unsafe(format!("{why} (pc {pc:#x})"));
        }
    }
    if let Some(from) = w.unknown_from {
        // The rest of the stack, up to its end, word by word: any value
        // pointing into dangerous code may be a return address.
        let end = hi.min(from.saturating_add(16 << 20));
        let mut buf = vec![0u8; 64 << 10];
        let mut at = from & !7;
        while at < end {
            let n = ((end - at) as usize).min(buf.len());
            if !mem.read(at, &mut buf[..n]) {
                return Verdict::Unsafe("part of its stack cannot be read".into());
            }
            for word in buf[..n].chunks_exact(8) {
                let v = u64::from_le_bytes(word.try_into().expect("8 bytes"));
                if let Some(why) = danger.at(v) {
                    return Verdict::Unsafe(format!(
                        "a word of its stack points {why} (the chain stopped at {})",
                        w.stopped.unwrap_or("an unknown frame")
                    ));
                }
            }
            at += n as u64;
        }
    }
    Verdict::Safe
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::attach::remote_unwind::Func;

    fn f(start: u64, end: u64, name: &str) -> Func {
        Func {
            start,
            end,
            name: name.into(),
        }
    }

    #[test]
    fn the_malloc_span_reaches_the_exported_neighbours() {
        let funcs = vec![
            f(0x100, 0x180, "strlen"),
            f(0x200, 0x280, "malloc"),
            f(0x200, 0x280, "__libc_malloc"),
            f(0x300, 0x380, "free"),
            f(0x500, 0x580, "memcpy"),
        ];
        // From strlen's end (static helpers may sit between it and
        // malloc) to memcpy's start.
        assert_eq!(malloc_span(&funcs), Some((0x180, 0x500)));
    }

    #[test]
    fn libc_lock_holders_are_named() {
        assert!(dangerous_libc_function("dlopen@@GLIBC_2.34"));
        assert!(dangerous_libc_function("dl_iterate_phdr"));
        assert!(dangerous_libc_function("fork"));
        assert!(!dangerous_libc_function("epoll_wait"));
        assert!(!dangerous_libc_function("read"));
    }
}
