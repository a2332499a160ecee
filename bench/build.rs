//! Compiles bench/c/walk_chain.c twice, with and without frame pointers,
//! for the `walk_cost` benchmark.
fn main() {
    println!("cargo:rerun-if-changed=c/walk_chain.c");
    for (name, flag) in [
        ("chain_fp", "-fno-omit-frame-pointer"),
        ("chain_nofp", "-fomit-frame-pointer"),
    ] {
        cc::Build::new()
            .file("c/walk_chain.c")
            .opt_level(2)
            .flag(flag)
            .define("CHAIN", name)
            .compile(name);
    }
}
