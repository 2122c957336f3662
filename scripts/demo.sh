#!/usr/bin/env bash
# One command on a fresh Debian machine: set up (apt packages, models, release
# build), ask the default pipeline (real small models, CPU) one question —
# printing the answer as it streams with its TTFT/TTFP/RTF and writing the spoken
# answer to answer.wav — then serve the demo page and print its URL.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
BIN=target/release/omnistream
"$BIN" chat --profile deploy/tiny-cpu.yaml \
  "${1:-What is the capital of France? Answer in one sentence.}" -o answer.wav
echo "==> serving (ctrl-c to stop)"
exec "$BIN" serve --profile deploy/tiny-cpu.yaml --host "${OMNISTREAM_HOST:-127.0.0.1}" --port "${OMNISTREAM_PORT:-8091}"
