#!/usr/bin/env bash
# Where a Qwen3-TTS Talker frame's time goes on the GPU (issue 26), on the GPU
# host, carrying cuda-bin/stages-tests.xz (scripts/cuda/build.sh with WITH_TESTS=1):
#
#   OUT=$OUT/profile bash scripts/qwen3_tts/talker_profile.sh
#
# 1. For each of VARIANTS (folders of deploy/qwen3_tts_released/bench; random
#    bf16 weights at the released shapes), the step parts alone on the GPU at
#    ROWS rows (`profile_tts_talker_steps`): the code predictor's graphed frame,
#    the graphed Talker decode, each eagerly, and the whole step the stage runs;
#    once for each of KNOBS, space-separated settings of the kernels' variables
#    (`VAR=value`, several joined by commas; "-" for the defaults), e.g.
#    KNOBS="OMNISTREAM_FUSED_DECODE_ROWS=0 OMNISTREAM_FUSED_DECODE_ROWS=8".
# 2. Nsight Compute over one whole step of the first variant at each of NCU_ROWS
#    rows (a profiler range around it: nothing else is profiled), summed by
#    kernel (scripts/cuda/ncu_table.py --by-name): which kernels a frame
#    launches, how many, and how long each runs on the GPU.
set -uo pipefail
cd "$(dirname "$0")/../.."
OUT=${OUT:-bench-out/talker-profile}
VARIANTS=${VARIANTS:-1.7b-customvoice 0.6b-customvoice}
ROWS=${ROWS:-1,8,16,32,48,64}
NCU_ROWS=${NCU_ROWS-1 48}
KNOBS=${KNOBS:--}
mkdir -p "$OUT"
xz -dkf cuda-bin/stages-tests.xz && chmod +x cuda-bin/stages-tests
# The test binary reads deploy/ where it was built: that path leads here.
built=$(grep -aom1 -E '/[[:alnum:]_/-]+/stages\.\./tests/fixtures' cuda-bin/stages-tests | sed 's|/stages\.\./tests/fixtures$||')
built=${built:-/work/main}
mkdir -p "$(dirname "$built")" && { [ -e "$built" ] || ln -s "$PWD" "$built"; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
t=cuda-bin/stages-tests
for v in $VARIANTS; do
  for k in $KNOBS; do
    echo "=== steps: $v, $k ($(date +%T))"
    # shellcheck disable=SC2046
    env $([ "$k" = - ] || echo "${k//,/ }") OMNISTREAM_TTS_VARIANT=$v OMNISTREAM_PROFILE_ROWS=$ROWS \
      timeout 300 $t profile_tts_talker_steps --ignored --nocapture 2>&1 | grep -E "^talker|^[0-9.]+b-|panicked|error"
  done
done
first=${VARIANTS%% *}
for r in $NCU_ROWS; do
  echo "=== ncu: $first, one step of $r rows ($(date +%T))"
  OMNISTREAM_TTS_VARIANT=$first OMNISTREAM_PROFILE_ROWS=$r OMNISTREAM_PROFILE_RANGE=1 timeout 400 \
    ncu --clock-control none --profile-from-start off --csv \
    --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
    $t profile_tts_talker_steps --ignored --test-threads 1 >"$OUT/ncu-$r.csv" 2>"$OUT/ncu-$r.err"
  python3 scripts/cuda/ncu_table.py --by-name "$OUT/ncu-$r.csv" | tee "$OUT/ncu-$r.txt" | head -40
  tail -3 "$OUT/ncu-$r.err"
done
