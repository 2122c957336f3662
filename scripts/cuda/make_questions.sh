#!/usr/bin/env bash
# Spoken questions for the GPU bench's spoken-input runs (gpu_bench.sh's
# `serve` steps, `omnistream bench --spoken-input`): six questions of 5 to 10 s
# in omnistream's own voice (Piper, CPU), written to gpu-questions/ (or $1).
# Run here, before the device call: the folder travels with the working tree
# (untracked, not ignored); delete it afterwards.
set -euo pipefail
cd "$(dirname "$0")/../.."
DIR=${1:-gpu-questions}
BIN=${BIN:-target/debug/omnistream}
mkdir -p "$DIR"
i=0
while IFS= read -r q; do
  "$BIN" say "$q" -o "$DIR/q$i.wav"
  i=$((i + 1))
done <<'QUESTIONS'
Could you tell me how honey bees find their way back to the hive after they have been out collecting nectar all day? Do they use the sun, or do they remember the flowers?
I am planning a trip to the mountains next week. What should I pack to stay warm and dry if the weather turns bad?
Why does the sky look blue during the day but red and orange when the sun goes down in the evening, and why are the clouds white?
My tomato plants have yellow leaves near the bottom. What could be causing that, and how do I fix it?
Explain in simple words how a train can stay on its tracks when it goes around a sharp curve at high speed. I always wondered why it does not simply slide off.
What are three easy dinners I can cook in under twenty minutes with rice, eggs and some vegetables?
QUESTIONS
