#!/usr/bin/env bash
# One command on a fresh Debian machine: set up, then ask the default pipeline
# (real small models, CPU) a question; prints the answer as it streams, its
# TTFT/TTFP/RTF, and writes the spoken answer to answer.wav.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
exec target/release/omnistream chat --profile deploy/tiny-cpu.yaml \
  "${1:-What is the capital of France? Answer in one sentence.}" -o answer.wav
