//! Refuses to build the library without frame pointers. Each hook's slow
//! path reads the hook's frame record (`caller_parent_frame`) to start the
//! stack walk: built without frame pointers, that read follows whatever
//! `rbp` holds, and a program loaded with such a library crashed at its
//! first `malloc` (tried: a build run with `--manifest-path` from another
//! directory). The workspace sets `-C force-frame-pointers=yes` in
//! `.cargo/config.toml`, but Cargo drops that when `RUSTFLAGS` is set or
//! when it runs from another directory (`--manifest-path`).

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    println!("cargo:rerun-if-env-changed=CARGO_ENCODED_RUSTFLAGS");
    let flags = std::env::var("CARGO_ENCODED_RUSTFLAGS").unwrap_or_default();
    let mut kept = false;
    let mut args = flags.split('\x1f');
    while let Some(a) = args.next() {
        // `-C force-frame-pointers=V`, `-Cforce-frame-pointers=V`; the
        // last one wins, as for rustc.
        let v = match a.strip_prefix("-C") {
            Some("") => args.next().unwrap_or_default(),
            Some(v) => v,
            None => continue,
        };
        if let Some(value) = v.strip_prefix("force-frame-pointers") {
            kept = !matches!(value, "=no" | "=n" | "=false" | "=off");
        }
    }
    if !kept {
        eprintln!(
            "error: libheapdump_preload.so would be built without frame pointers, and every \
             program it is loaded into would crash at its first malloc (each hook reads its \
             own frame record). Build from the repository's directory (its \
             .cargo/config.toml sets -C force-frame-pointers=yes), or add \
             -C force-frame-pointers=yes to RUSTFLAGS (which replaces the workspace's setting)."
        );
        std::process::exit(1);
    }
}
