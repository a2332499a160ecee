//! `heapdump attach`: loading the agent into a process that is already
//! running, through heapdump's own `ptrace` injection (no debugger).
//!
//! - [`remote_unwind`]: a stopped thread's call chain, unwound from outside
//!   with the CFI of the files it maps;
//! - [`safe_point`]: whether that chain is clear of the allocator and the
//!   loader, so the thread may run `dlopen`;
//! - [`inject`]: stopping threads, running `dlopen` and the agent's entry
//!   point in the chosen one, and putting every register back.
//!
//! x86_64 Linux with glibc only; elsewhere [`inject`] is a refusal
//! (`inject_unsupported.rs`), so the rest of heapdump builds and runs on
//! every architecture.

#[cfg(target_arch = "x86_64")]
pub mod inject;
#[cfg(not(target_arch = "x86_64"))]
#[path = "inject_unsupported.rs"]
pub mod inject;
pub mod injection;
pub mod library_placement;
pub mod memory_access;
pub mod remote_unwind;
pub mod safe_point;

/// Whether `base`, a mapped file's name, is glibc's library `stem`
/// (`"libc"`, `"libdl"`, `"libpthread"`, `"ld"`): under its soname
/// (`libc.so.6`), or, as distributions before glibc 2.34 install them and
/// `/proc/PID/maps` shows the file a soname links to, under its versioned
/// name (`libc-2.23.so`, `ld-2.28.so`).
pub fn is_glibc_library(base: &str, stem: &str) -> bool {
    let Some(rest) = base.strip_prefix(stem) else {
        return false;
    };
    if stem == "ld" && rest.starts_with("-linux") {
        // ld-linux-x86-64.so.2, ld-linux-aarch64.so.1
        return true;
    }
    rest.starts_with(".so")
        || rest
            .strip_prefix('-')
            .is_some_and(|v| v.starts_with(|c: char| c.is_ascii_digit()) && v.ends_with(".so"))
}

#[cfg(test)]
mod tests {
    use super::is_glibc_library;

    #[test]
    fn glibc_libraries_are_known_by_soname_and_by_versioned_file_name() {
        for (base, stem) in [
            ("libc.so.6", "libc"),
            ("libc-2.23.so", "libc"),
            ("libdl.so.2", "libdl"),
            ("libdl-2.17.so", "libdl"),
            ("libpthread-2.28.so", "libpthread"),
            ("ld-linux-x86-64.so.2", "ld"),
            ("ld-2.23.so", "ld"),
        ] {
            assert!(is_glibc_library(base, stem), "{base} is {stem}");
        }
        for (base, stem) in [
            ("libcrypto.so.3", "libc"),
            ("libc-client.so", "libc"),
            ("libdlt.so.2", "libdl"),
            ("ldap.so", "ld"),
            ("libc++.so.1", "libc"),
        ] {
            assert!(!is_glibc_library(base, stem), "{base} is not {stem}");
        }
    }
}
