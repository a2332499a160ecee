//! Warns at build time when the library would be built without frame
//! pointers. Each hook reads its own frame pointer to start the stack walk;
//! without one, every trace loses its innermost frames. The workspace sets
//! `-C force-frame-pointers=yes` in `.cargo/config.toml`, but Cargo drops
//! that when `RUSTFLAGS` is set or when it runs from another directory
//! (`--manifest-path`). (The library also says so on stderr at start.)

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
        println!(
            "cargo:warning=libheapdump_preload.so is being built without frame pointers: \
             its stack traces would miss their innermost frames. Build from the repository's \
             directory, or add -C force-frame-pointers=yes to RUSTFLAGS (which replaces the \
             workspace's setting)."
        );
    }
}
