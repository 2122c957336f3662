#!/usr/bin/env bash
# Fuzzes the codecs' parsers of untrusted input (fuzz/, cargo-fuzz layout):
# ogg_opus, wav and rtp_payload, each for SECONDS_PER_TARGET (default 30).
#
#   scripts/fuzz.sh [SECONDS_PER_TARGET]
#
# Any crash (panic, sanitizer report, leak, out-of-memory, timeout) fails the
# script after all targets ran; the input that did it is saved under
# fuzz/artifacts/TARGET/ and can be replayed with
#   (cd fuzz && RUSTC_BOOTSTRAP=1 cargo fuzz run TARGET artifacts/TARGET/FILE)
# The corpus grows in fuzz/corpus/TARGET/ (git-ignored) from the seeds
# committed in fuzz/seeds/TARGET/, so later runs start where earlier ones
# stopped.
set -euo pipefail
cd "$(dirname "$0")/.."

secs="${1:-30}"
if ! [[ "$secs" =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: scripts/fuzz.sh [SECONDS_PER_TARGET]" >&2
    exit 2
fi

if ! cargo fuzz --version >/dev/null 2>&1; then
    echo "==> cargo install cargo-fuzz --locked"
    cargo install cargo-fuzz --locked
fi

# cargo-fuzz passes nightly-only flags (-Zsanitizer, sanitizer-coverage);
# RUSTC_BOOTSTRAP lets the stable toolchain accept them.
export RUSTC_BOOTSTRAP=1
cd fuzz

# AddressSanitizer first (it also checks the unsafe code of the C libraries'
# bindings); if this toolchain cannot build with it, fuzz without.
sanitizer="${FUZZ_SANITIZER:-address}"
echo "==> cargo fuzz build --sanitizer $sanitizer"
if ! cargo fuzz build --sanitizer "$sanitizer"; then
    if [[ "$sanitizer" == none ]]; then
        exit 1
    fi
    echo "==> the $sanitizer sanitizer build failed; building with --sanitizer none"
    sanitizer=none
    cargo fuzz build --sanitizer none
fi

failed=()
for target in $(cargo fuzz list); do
    mkdir -p "corpus/$target"
    seeds=()
    if [[ -d "seeds/$target" ]]; then
        seeds=("seeds/$target")
    fi
    echo "==> $target: ${secs}s (sanitizer: $sanitizer)"
    start=$(date +%s)
    # The first corpus directory collects new inputs; the seeds are read only.
    # -timeout: one input may take 10 s at most (a hang is a failure too).
    if cargo fuzz run --sanitizer "$sanitizer" "$target" "corpus/$target" "${seeds[@]}" -- \
        -max_total_time="$secs" -timeout=10 -print_final_stats=1; then
        echo "==> $target: no crash in $(($(date +%s) - start))s"
    else
        echo "==> $target: FAILED (input saved under fuzz/artifacts/$target/)"
        failed+=("$target")
    fi
done

if ((${#failed[@]})); then
    echo "==> crashes in: ${failed[*]}" >&2
    exit 1
fi
echo "==> all targets ran ${secs}s without a crash"
