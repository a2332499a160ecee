#!/usr/bin/env bash
# Runs each fuzz target for a fixed time, keeping the corpus in the
# repository (fuzz/corpus/<target>/, minimized after each run).
#
#   fuzz/run.sh [SECONDS] [TARGET...]     # default 60 s, every target
#
# cargo-fuzz needs nightly-only compiler flags (-Zsanitizer=address,
# coverage instrumentation); this workspace uses stable Rust, so the build
# sets RUSTC_BOOTSTRAP=1 to let the stable compiler accept them.
# Seeds (real region images from `cargo run --example gen_seeds -- seeds`) are
# in fuzz/seeds/<target>/ and are read, never written.
set -euo pipefail
cd "$(dirname "$0")"
secs=${1:-60}
shift || true
export RUSTC_BOOTSTRAP=1
command -v cargo-fuzz >/dev/null || cargo install --locked cargo-fuzz
if [ $# -gt 0 ]; then targets=("$@"); else mapfile -t targets < <(cargo fuzz list); fi
# -a: debug assertions (integer overflow on untrusted values is a finding).
# -timeout: one input taking over 10 s is a hang.
for t in "${targets[@]}"; do
    echo "== fuzz $t for ${secs}s"
    mkdir -p "corpus/$t"
    cargo fuzz run -a "$t" "corpus/$t" "seeds/$t" -- \
        -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1
    # Keep the stored corpus small: only inputs that add coverage.
    cargo fuzz cmin -a "$t" "corpus/$t" >/dev/null 2>&1
    # Region images are 12-36 KiB (mostly zeros, so git compresses them
    # well); cap each stored corpus at 100 files, dropping a random excess.
    excess=$(( $(ls "corpus/$t" | wc -l) - 100 ))
    if [ "$excess" -gt 0 ]; then
        ls "corpus/$t" | shuf -n "$excess" | sed "s#^#corpus/$t/#" | xargs rm -f
    fi
    echo "   corpus/$t: $(ls "corpus/$t" | wc -l) files, $(du -sh "corpus/$t" | cut -f1)"
done
