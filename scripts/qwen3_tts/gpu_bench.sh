#!/usr/bin/env bash
# Qwen3-TTS on one GPU (issue 26), run on the GPU host in the repository root:
# for each released variant, `omnistream serve` with its profile
# (deploy/qwen3_tts_released/<variant>.yaml: random bf16 weights at the released
# shapes) driven by `omnistream bench --endpoint speech` over loopback at c=1 and
# c=64, then the reference (qwen-tts 0.1.1's generate + decode, batch 1,
# scripts/qwen3_tts/ref_bench.py) on the same GPU, one after the other.
#
# Carry cuda-bin/omnistream.xz, cuda-bin/libopus.so.0 (scripts/cuda/build.sh) and
# target/refwheels (scripts/qwen3_tts/ref_wheels.sh). Then:
#   OUT=$OUT VARIANTS="1.7b-customvoice 1.7b-base" bash scripts/qwen3_tts/gpu_bench.sh
#
# BIN (default cuda-bin/omnistream, or its .xz) picks the server binary, so two
# builds can run side by side in one device call (each with its own OUT).
#
# Every request speaks exactly FRAMES codec frames (default 125: 10 s), so the
# runs do equal work (random weights would end anywhere). Base variants clone a
# voice in context in every request: a 5 s clip and its words sent as
# `ref_audio` and `ref_text`, encoded by the server each time (speaker encoder
# and codec encoder; the reference: both of its own, each run).
set -uo pipefail
VARIANTS=${VARIANTS:-1.7b-customvoice 1.7b-base}
FRAMES=${FRAMES:-125}
REF_FRAMES=${REF_FRAMES:-50}
LOADS=${LOADS:-1:8 64:128}
mkdir -p "$OUT/json"
exec > >(tee "$OUT/log.txt") 2>&1
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/cuda-cache} CUDA_CACHE_MAXSIZE=4294967296
BIN=${BIN:-cuda-bin/omnistream}
for f in cuda-bin/*.xz; do [ -f "$f" ] && xz -dkf "$f"; done
# A binary from elsewhere (another build, side by side).
case $BIN in cuda-bin/*) ;; *) [ -f "$BIN.xz" ] && xz -dkf "$BIN.xz" ;; esac
# Beside the binary: libopus.so.0 ($ORIGIN is on its rpath).
[ -f "$(dirname "$BIN")/libopus.so.0" ] || cp cuda-bin/libopus.so.0 "$(dirname "$BIN")/"
chmod +x "$BIN"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
step() { echo; echo "=== $* ($(date +%T))"; }

# The reference's Python packages (its pins, beside the host's PyTorch).
REF=/tmp/qwen-tts-ref
if [ -n "${REF_FRAMES}" ] && [ "$REF_FRAMES" != 0 ] && [ ! -d "$REF/qwen_tts" ]; then
  python3 -m pip install -q --no-index --no-deps --target "$REF" target/refwheels/*.whl 2>&1 | tail -2
fi

# The reference clip: 5 s of a voiced, syllable-paced signal, 16-bit WAV.
python3 - "$OUT/ref.wav" <<'EOF'
import math, sys, wave
import numpy as np
t = np.arange(5 * 24000) / 24000
f0 = 120 + 40 * np.sin(2 * math.pi * 0.5 * t)
phase = 2 * math.pi * np.cumsum(f0) / 24000
x = sum(np.sin(k * phase) / k for k in range(1, 12)) * 0.5 * (1 - np.cos(2 * math.pi * 4 * t))
x += 0.05 * np.random.default_rng(0).standard_normal(t.shape)
x = x / np.abs(x).max() * 0.8
with wave.open(sys.argv[1], "wb") as w:
    w.setnchannels(1); w.setsampwidth(2); w.setframerate(24000)
    w.writeframes((x * 32767).astype("<i2").tobytes())
EOF

REF_TEXT="The reference clip's words."
PORT=8094
for v in $VARIANTS; do
  step "serve $v"
  "$BIN" serve --profile "deploy/qwen3_tts_released/$v.yaml" --port $PORT > "$OUT/serve-$v.log" 2>&1 &
  SERVER=$!
  for _ in $(seq 1 300); do
    grep -q "omnistream listening" "$OUT/serve-$v.log" && break
    kill -0 "$SERVER" 2>/dev/null || break
    sleep 1
  done
  grep -E "listening|captured|rror" "$OUT/serve-$v.log" | tail -5
  case $v in
    # In-context cloning (qwen-tts's default for a clip with its words).
    *base) ARGS=(--ref-audio "$OUT/ref.wav" --ref-text "$REF_TEXT" --voice alloy); MODE=clone
      # XVECTOR=1: from the clip alone (its x-vector, no codes in the prompt).
      [ "${XVECTOR:-0}" = 1 ] && ARGS=(--ref-audio "$OUT/ref.wav" --voice alloy) ;;
    # A voice described in words, in every request.
    *voicedesign) ARGS=(--instructions "A calm, warm female voice, low and unhurried." --voice alloy); MODE=design ;;
    *) ARGS=(--voice vivian); MODE=custom ;;
  esac
  for c in $LOADS; do
    name="$v-c${c%:*}"
    step "bench $name"
    timeout "${SB_S:-200}" "$BIN" bench --url "http://127.0.0.1:$PORT" --endpoint speech \
      --input-len 30 --speech-frames "$FRAMES" "${ARGS[@]}" --concurrency "${c%:*}" \
      --num-prompts "${c#*:}" --warmup 2 --no-plots --out "$OUT/json/$name" 2>&1 | grep -v '^\s*$' | tail -3
    sed -n '/^| load/,/^$/p' "$OUT/json/$name/bench.md"
    grep -E '\| (TTFP|audio RTF)' "$OUT/json/$name/bench.md"
    # Where a cloned voice's encode goes, and how many clips a batch took
    # (summed since the server started).
    python3 -c "import urllib.request as u; print(u.urlopen('http://127.0.0.1:$PORT/metrics').read().decode())" |
      grep -E '^omnistream_voice_encode_(seconds|batch_clips)_(sum|count)'
  done
  kill "$SERVER"; wait "$SERVER"
  grep -iE "warn|error" "$OUT/serve-$v.log" | tail -5
  if [ "$REF_FRAMES" != 0 ]; then
    step "reference $v ($MODE, batch 1, $REF_FRAMES frames)"
    PYTHONPATH="$REF" timeout "${REF_S:-240}" python3 scripts/qwen3_tts/ref_bench.py \
      --variant "deploy/qwen3_tts_released/bench/$v" --mode "$MODE" $([ "$MODE" = clone ] && echo --icl) --frames "$REF_FRAMES" \
      --runs 3 --warmup 1 --out "$OUT/json/reference-$v.json" 2>&1 | grep -vE "pad_token_id|flash-attn" | tail -6
  fi
done
for d in "$OUT"/json/*/; do cp "$d/bench.md" "$OUT/$(basename "$d").md" 2>/dev/null; done
tar -C "$OUT" -czf "$OUT/json.tar.gz" json && rm -rf "$OUT/json"
step done
