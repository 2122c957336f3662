#!/usr/bin/env bash
# Runs every test: formatting, lints, the Rust unit/integration/end-to-end
# tests (real models, real binary) and the Python checks.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh --dev
echo "==> cargo fmt --check"
cargo fmt --all -- --check
echo "==> cargo clippy -D warnings"
cargo clippy --workspace --all-targets --quiet -- -D warnings
echo "==> cargo test"
cargo test --workspace -- --test-threads=2
echo "==> fuzz the codecs' parsers (20 s per target)"
scripts/fuzz.sh 20
