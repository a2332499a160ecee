//! Build facts `heapdump --version` reports: the git revision the binary
//! was built from (`unknown` outside a git checkout) and the target.

fn main() {
    let rev = std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into());
    let dirty = std::process::Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .is_some_and(|o| !o.stdout.is_empty());
    let rev = if dirty {
        format!("{rev}-modified")
    } else {
        rev
    };
    println!("cargo:rustc-env=HEAPDUMP_GIT_REVISION={rev}");
    println!(
        "cargo:rustc-env=HEAPDUMP_TARGET={}",
        std::env::var("TARGET").unwrap_or_default()
    );
    // Rebuilt when HEAD moves (a commit, a checkout).
    for f in ["../.git/HEAD", "../.git/index"] {
        if std::path::Path::new(f).exists() {
            println!("cargo:rerun-if-changed={f}");
        }
    }
}
