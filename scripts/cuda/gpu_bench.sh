#!/usr/bin/env bash
# Runs on the GPU host, in the repository root, with the CUDA build carried in
# cuda-bin/ (scripts/cuda/build.sh): the GPU tests and per-layer timings, then
# `bench-engine` on the released shapes (deploy/qwen3-omni-h200.yaml, graphs and
# eager side by side; the voice profile) and the transformers reference,
# one after the other (each holds ~70 GB of weights). Results go to $OUT (or
# bench-out/gpu).
set -uo pipefail
OUT=${OUT:-bench-out/gpu}
mkdir -p "$OUT"
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/cuda-cache} CUDA_CACHE_MAXSIZE=4294967296
for f in cuda-bin/*.xz; do xz -dkf "$f"; done
chmod +x cuda-bin/omnistream cuda-bin/stages-tests 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$OUT/gpu.txt"
# The test binary finds the fixtures where it was built.
if [ -x cuda-bin/stages-tests ]; then
  mkdir -p /work && [ -e /work/main ] || ln -s "$PWD" /work/main
  { timeout 180 cuda-bin/stages-tests cuda_tests on_gpu --test-threads 1 --nocapture
    timeout 60 cuda-bin/stages-tests profile_released --ignored --nocapture; } 2>&1 | tee "$OUT/gpu-tests.txt"
fi
export RUST_BACKTRACE=0
bench() { timeout "$1" cuda-bin/omnistream bench-engine --out "$OUT" "${@:2}" 2>&1 | grep -v '^\s*$' | tail -12; }
H200=(--profile deploy/qwen3-omni-h200.yaml)
CHAT=(--prompt-tokens 100 --output-tokens 200)
bench "${TEXT_S:-120}" "${H200[@]}" --name chat "${CHAT[@]}" --concurrency "${TEXT_C:-1,32}" --text-only
bench "${TEXT_S:-120}" "${H200[@]}" --name chat-eager --enforce-eager "${CHAT[@]}" --concurrency "${TEXT_C:-1,32}" --text-only
bench "${CHAT_S:-200}" "${H200[@]}" --name chat "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
bench "${CHAT_S:-200}" --profile deploy/qwen3-omni-h200-voice.yaml --name chat-voice "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
bench "${LONG_S:-200}" "${H200[@]}" --name long --prompt-tokens 2500 --output-tokens 900 --concurrency "${LONG_C:-1,8}"
[ -n "${SKIP_REFERENCE:-}" ] || timeout "${REF_S:-240}" python3 scripts/cuda/reference_gpu.py 2>&1 | tail -20 | tee "$OUT/reference.json"
rm -f "$OUT"/*.md "$OUT"/*.png   # the tables are printed above; at most 8 files come back
