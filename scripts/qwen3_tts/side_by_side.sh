#!/usr/bin/env bash
# Several `gpu_bench.sh` runs in one device call, one after the other, each a
# line of RUNS: `label binary VAR=value ...` (the variables gpu_bench.sh reads:
# VARIANTS, LOADS, XVECTOR, ...). Each run's log goes to $WORK/<label>.txt and
# its files to $WORK/<label>/ (WORK: /tmp/side-by-side, as a device call brings
# back only a few files); the load rows of every run are gathered in
# $OUT/summary.txt and everything so far is packed into $OUT/all.tgz after each
# run (a call cut short keeps what finished). Runs that would start after
# DEADLINE seconds are skipped.
#
#   RUNS=$'a cuda-bin-a/omnistream VARIANTS=1.7b-base LOADS="1:6 64:128"\nb cuda-bin/omnistream VARIANTS=1.7b-base ...' \
#     OUT=$OUT bash scripts/qwen3_tts/side_by_side.sh
set -uo pipefail
cd "$(dirname "$0")/../.."
DEADLINE=${DEADLINE:-540}
WORK=${WORK:-/tmp/side-by-side}
mkdir -p "$OUT" "$WORK"
while read -r label bin vars; do
  [ -z "$label" ] && continue
  if [ "$SECONDS" -ge "$DEADLINE" ]; then
    echo "skipped $label: ${SECONDS}s gone" | tee -a "$OUT/summary.txt"
    continue
  fi
  mkdir -p "$WORK/$label"
  eval "env OUT=$WORK/$label BIN=$bin REF_FRAMES=0 SB_S=90 $vars bash scripts/qwen3_tts/gpu_bench.sh" </dev/null >"$WORK/$label.txt" 2>&1
  {
    echo "## $label ($bin $vars) at ${SECONDS}s"
    grep -E "^=== (serve|bench)|^\| c=[0-9]+ \| [0-9]|^\| c=[0-9]+ \| (talker|code2wav)|batch_clips_(sum|count)|encode_seconds_(sum|count)|WARN|ERROR" "$WORK/$label.txt"
  } >>"$OUT/summary.txt"
  tar -C "$WORK" -czf "$OUT/all.tgz" --exclude='*.csv' .
done <<<"$RUNS"
