//! Whether this library was preloaded (the process is recorded from its
//! start) or `dlopen`ed into a running process by `heapdump attach` (the
//! agent then starts at `heapdump_attach`).
//!
//! A library is preloaded when the dynamic loader loaded it before the
//! program started, from `LD_PRELOAD` or from `/etc/ld.so.preload` (a
//! host-wide install). Its file may have any name (a distribution's
//! package, a symlink): the test is whether one of those lists names the
//! file this library was loaded from, as the loader records it
//! (`dladdr`'s `dli_fname`: the entry itself when it holds a `/`, else the
//! path the loader found for it), with a name holding
//! `libheapdump_preload` in `LD_PRELOAD` also taken as ours (an older
//! agent's copy loaded by `heapdump attach` into a process preloaded with
//! this one then refuses to start a second agent).
//!
//! Invariants: never allocates (it runs in the library's initialiser,
//! before the next allocator is known, and in `heapdump_attach`); reads at
//! most [`PRELOAD_FILE_MAX`] bytes of `/etc/ld.so.preload`, a root-owned
//! file (`heapdump_agent::small_file`: a descriptor opened and closed
//! within the call).

use std::ffi::{c_void, CStr};

/// The most of `/etc/ld.so.preload` that is read (the loader's own limit
/// is the file; a host-wide preload list is a line or two).
pub const PRELOAD_FILE_MAX: usize = 4096;

/// True when this library was preloaded (see the module doc).
pub fn preloaded() -> bool {
    let env = ld_preload();
    if env
        .windows(b"libheapdump_preload".len())
        .any(|w| w == b"libheapdump_preload")
    {
        return true;
    }
    let Some(me) = own_path() else {
        return false;
    };
    if lists_library(env, me) {
        return true;
    }
    let mut buf = [0u8; PRELOAD_FILE_MAX];
    let n = heapdump_agent::small_file::read_into(c"/etc/ld.so.preload", &mut buf).unwrap_or(0);
    lists_library(&buf[..n], me)
}

/// The value of `LD_PRELOAD` (empty when unset).
fn ld_preload() -> &'static [u8] {
    // SAFETY: getenv with a NUL-terminated name; the result, if non-null,
    // is a NUL-terminated string of the environment block, which lives as
    // long as the process (nothing here changes the environment).
    unsafe {
        let v = libc::getenv(c"LD_PRELOAD".as_ptr());
        if v.is_null() {
            return b"";
        }
        CStr::from_ptr(v).to_bytes()
    }
}

/// The path this library was loaded from, as the loader recorded it.
fn own_path() -> Option<&'static [u8]> {
    // SAFETY: dladdr only reads the loader's tables and fills `info`; the
    // name it points to is the loader's record of this (never unloaded
    // while it runs) library.
    unsafe {
        let mut info: libc::Dl_info = std::mem::zeroed();
        let here = preloaded as *const () as *const c_void;
        if libc::dladdr(here, &mut info) == 0 || info.dli_fname.is_null() {
            return None;
        }
        Some(CStr::from_ptr(info.dli_fname).to_bytes())
    }
}

/// Whether a preload list (entries separated by `:`, spaces, tabs or
/// newlines, as the loader reads `LD_PRELOAD` and `/etc/ld.so.preload`)
/// names the library loaded from `me`: an entry holding a `/` is that
/// path, any other entry is a file name the loader searched for, which
/// `me` ends in.
pub fn lists_library(list: &[u8], me: &[u8]) -> bool {
    let base = me.rsplit(|b| *b == b'/').next().unwrap_or(me);
    list.split(|b| matches!(b, b':' | b' ' | b'\t' | b'\n' | b'\r'))
        .filter(|e| !e.is_empty())
        .any(|e| {
            if e.contains(&b'/') {
                e == me
            } else {
                e == base
            }
        })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_list_names_the_library_by_its_path_or_its_file_name() {
        let me = b"/usr/lib/heapdump/agent.so";
        assert!(lists_library(b"/usr/lib/heapdump/agent.so", me));
        assert!(lists_library(b"/opt/x.so:/usr/lib/heapdump/agent.so", me));
        assert!(lists_library(
            b"/lib/x.so\n/usr/lib/heapdump/agent.so\n",
            me
        ));
        assert!(lists_library(b"libfoo.so agent.so", me));
        assert!(lists_library(b"\t agent.so \n", me));
        // Another file of the same name elsewhere is not this one.
        assert!(!lists_library(b"/opt/agent.so", me));
        // A path that merely ends in the name.
        assert!(!lists_library(b"/usr/lib/heapdump/xagent.so", me));
        assert!(!lists_library(b"", me));
        assert!(!lists_library(b"::  \n", me));
        assert!(!lists_library(b"agent", me));
    }
}
