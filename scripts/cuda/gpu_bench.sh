#!/usr/bin/env bash
# Runs on the GPU host, in the repository root, with the CUDA build carried in
# cuda-bin/ (scripts/cuda/build.sh; carry cuda-bin/*.xz and cuda-bin/libopus.so.0):
# the GPU tests and per-layer timings, then `bench-engine` on the released shapes
# and the transformers reference, one after the other (each holds ~70 GB of
# weights). STEPS picks what runs, in this order:
#
#   tests      cuda-bin/stages-tests cuda_tests on_gpu (GPU against CPU/eager paths)
#   profile    per-layer timings, eager and graphed, engine kernels and candle's ops
#   code2wav   Code2Wav alone: first chunk and 4-frame chunks of 1, 8, 32 streams,
#              then the time of each part of a step of 8 and 32
#   talker     the Talker alone: the code predictor's frame and the decode step,
#              graphed, at 1 to 32 rows, and the whole step the stage runs
#   talker-sort the same with OMNISTREAM_TOPK_MERGE=0 (the top-k draws sort whole rows)
#   ncu        Nsight Compute: each kernel of a decoder layer's decode step at 1, 8
#              and 32 rows (duration, DRAM throughput), by scripts/cuda/ncu_table.py
#   ncu-prefill the same for one prefill layer: 32 prompts of 100, one of 2,500
#   text       chat text-only c=1,32, the engine's decode kernels
#   candle     the same with OMNISTREAM_DECODE_KERNELS=candle (side by side)
#   eager      the same with --enforce-eager
#   gemv       the same with each MoE GEMV variant in GEMV, rows a warp:blocks a
#              multiprocessor (default "4:4 8:3 16:6 16:8"; 16:4 is the engine's
#              default; OMNISTREAM_MOE_GEMV_ROWS, OMNISTREAM_MOE_GEMV_BLOCKS)
#   tc2        the same with the two-stage tensor-core MoE (OMNISTREAM_MOE_TC_STAGES=2;
#              3 is the default)
#   text-t     text-only as `text` with the answers sampled at TEMP (default 1.0,
#              a Gumbel-max draw on the device): rows keep apart, where greedy
#              answers of random weights converge to the same tokens
#   chat       chat with audio, c=1,8,32 (deploy/qwen3-omni-h200.yaml): one audio
#              frame (80 ms) per text vector: 199 frames (15.9 s) for 200 tokens
#   speech     the same with SPEECH_FRAMES (default 768) frames an answer: speech at
#              a person's pace, the Talker going on past the text on tts_pad as the
#              model does (vLLM-Omni's published c=32 figures: 3.84 frames a token)
#   speech-sort the same with OMNISTREAM_TOPK_MERGE=0: the code predictor's top-k
#              draws sort the whole row (side by side with the default merge)
#   chat-c2w, speech-c2w  the same with OMNISTREAM_STAGE_PRIORITY=code2wav: Code2Wav's
#              graphed steps overlap the Thinker's (the Talker's still go first)
#   chunks     chat and speech with Code2Wav's later chunks CHUNKS frames long (default
#              "4 16"; the profile's are 8), each from a copy of the profile
#   chat-t     the same sampled at TEMP
#   chat-wait  the same with the Thinker's wait for the audio path capped at
#              WAIT_MS (default 100) instead of 10 ms
#   chat-nopri the same with OMNISTREAM_STAGE_PRIORITY=off (side by side)
#   chat-overlap the same with OMNISTREAM_STAGE_PRIORITY=eager: the Thinker waits for
#              the audio path's eager work only, its graphed steps overlap (run 20)
#   voice      chat with audio, deploy/qwen3-omni-h200-voice.yaml
#   long       prompt 2,500, answer 900, audio on, c=1,8
#   long-chunk the same with the Thinker's chunked prefill (prefill_chunk_tokens:
#              PREFILL_CHUNK, default 512, in a copy of the profile), and chat at
#              c=32 with it: a long prompt prefilled a chunk a step between decodes
#   reference  scripts/cuda/reference_gpu.py (transformers, batch 1)
#   split      through `omnistream serve` + `omnistream bench` (HTTP), side by side
#              in one run: the single process (deploy/qwen3-omni-h200.yaml) against
#              the Thinker in the gateway and the Talker + Code2Wav in one stage
#              process on the same GPU, over a nats-server on loopback
#              (deploy/distributed/qwen3-omni-h200.yaml; carry cuda-bin/nats-server.xz):
#              TTFP, RTF and the rest at SPLIT_C (default 1,32), SPLIT_N requests
#              a level (default 32), prompts of 100 words, answers of 200 tokens
#   split-mps  the same with the CUDA MPS daemon started for the run (both
#              sides through it), when the host has nvidia-cuda-mps-control
#   layout3    vLLM-Omni's 3-GPU layout (a host with 3 GPUs or more): the Thinker on
#              GPU 0, two Talker and two Code2Wav replicas on GPUs 1 and 2, in one
#              process (deploy/qwen3-omni-3gpu.yaml) against one process a GPU over
#              NATS (deploy/distributed/qwen3-omni-3gpu.yaml; carry
#              cuda-bin/nats-server.xz), side by side: chat at LAYOUT_C (default
#              1,8,32,64), LAYOUT_N requests a level (default 64), then the long
#              workload (2,500 -> 900) at c=32
#   layout3-dry the same two layouts with every device cuda:0 (one GPU, several
#              processes; an H200 holds it): they start and answer, at c=1 and 8
#   replicas   whole pipelines replicated: one `omnistream serve` a GPU
#              (deploy/qwen3-omni-h200.yaml, CUDA_VISIBLE_DEVICES=i), and one
#              `omnistream bench --url` over all of them (leastconn, no balancer in
#              front), for each count in REPLICA_GPUS (default "1 2 4 8", those the
#              host has): chat with audio, 100-word prompts, 200 tokens, at
#              REPLICA_C requests in flight a GPU (default "8 16 32 48 64"), twice
#              as many requests a level; then scripts/cuda/scaling.py: per count
#              the load where p90 TTFP stays within 500 ms, audio-s/s, req/s and
#              the share of linear scaling
#   replicas-1p the same with one `omnistream serve` for all the GPUs: a copy of
#              deploy/qwen3-omni-8gpu.yaml with N replicas of every stage on
#              cuda:0..N-1 (a request stays on its Thinker's GPU), one URL
#   serve      what a user sees: one `omnistream serve` (deploy/qwen3-omni-h200.yaml,
#              server VAD on; carry models/silero-vad) driven by `omnistream bench`
#              over loopback, one run after another against the same server:
#              SERVE_RUNS picks them (default all, in this order):
#                chat       HTTP SSE chat, 100-word prompts (CHAT_WORDS; the test
#                           tokenizer makes 100 words about 400 tokens, 25 about
#                           100), 200 tokens, audio:
#                           c=1 (8 requests), 8 (32), 32 (64), 64 (128); CHAT_C
#                           picks others ("8:32 32:64": concurrency:requests)
#                text       text only, sampled at TEMP (default 1.0), c=32 (64)
#                rt         Realtime, typed turns, audio: c=1 (8), 32 (64)
#                spoken     spoken questions (scripts/cuda/make_questions.sh wrote
#                           gpu-questions/ here; it travels untracked): chat
#                           input_audio and Realtime turns paced as a microphone
#                           with server VAD (silence 200 ms), 100 tokens: c=1 (6),
#                           8 (16), 32 (32) each
#                long       625-word prompts (LONG_WORDS; about 2,500 tokens), 900
#                           tokens, audio: c=1 (2), 32 (32); LONG_C picks others
#
# Everything printed goes to $OUT/log.txt; the JSON reports to $OUT/json.tar.gz
# ($OUT, or bench-out/gpu; at most 8 files come back from the device tool).
set -uo pipefail
OUT=${OUT:-bench-out/gpu}
STEPS=${STEPS:-tests profile text candle chat voice long reference}
mkdir -p "$OUT/json"
exec > >(tee "$OUT/log.txt") 2>&1
export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/cuda-cache} CUDA_CACHE_MAXSIZE=4294967296
for f in cuda-bin/*.xz; do xz -dkf "$f"; done
chmod +x cuda-bin/omnistream cuda-bin/stages-tests 2>/dev/null
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
has() { [[ " $STEPS " == *" $1 "* ]]; }
step() { echo; echo "=== $* ($(date +%T))"; }
# The test binary finds the fixtures where it was built (a worktree, say):
# that path, read from the binary, leads here.
if [ -x cuda-bin/stages-tests ]; then
  built=$(grep -aom1 -E '/[[:alnum:]_/-]+/stages\.\./tests/fixtures' cuda-bin/stages-tests | sed 's|/stages\.\./tests/fixtures$||')
  built=${built:-/work/main}
  mkdir -p "$(dirname "$built")" && [ -e "$built" ] || ln -s "$PWD" "$built"
  echo "fixtures: $built -> $PWD"
  if has tests; then
    step tests
    timeout 240 cuda-bin/stages-tests on_gpu cuda_tests --test-threads 1 --nocapture
  fi
  if has profile; then
    step profile
    timeout 120 cuda-bin/stages-tests profile_released --ignored --nocapture
  fi
  if has code2wav; then
    step code2wav
    timeout 120 cuda-bin/stages-tests profile_code2wav --ignored --nocapture
  fi
  if has talker; then
    step talker
    timeout 120 cuda-bin/stages-tests profile_talker_steps --ignored --nocapture
  fi
  if has talker-sort; then
    step talker-sort
    OMNISTREAM_TOPK_MERGE=0 timeout 120 cuda-bin/stages-tests profile_talker_steps --ignored --nocapture
  fi
  if has ncu; then
    step ncu
    timeout 300 ncu --clock-control none --csv \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      cuda-bin/stages-tests profile_decode_kernels --ignored --test-threads 1 >"$OUT/ncu.csv" 2>/dev/null
    python3 scripts/cuda/ncu_table.py "$OUT/ncu.csv"
  fi
  if has ncu-prefill; then
    step ncu-prefill
    timeout 240 ncu --clock-control none --csv \
      --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed \
      cuda-bin/stages-tests profile_prefill_kernels --ignored --test-threads 1 >"$OUT/ncu.csv" 2>/dev/null
    python3 scripts/cuda/ncu_table.py "$OUT/ncu.csv"
  fi
fi
export RUST_BACKTRACE=0
bench() {
  local s=$1
  shift
  step bench-engine "$@"
  timeout "$s" cuda-bin/omnistream bench-engine --out "$OUT/json" "$@" 2>&1 | grep -v '^\s*$' | tail -14
}
H200=(--profile deploy/qwen3-omni-h200.yaml)
CHAT=(--prompt-tokens 100 --output-tokens 200)
TEXT_C=${TEXT_C:-1,32}
has text && bench "${TEXT_S:-150}" "${H200[@]}" --name chat "${CHAT[@]}" --concurrency "$TEXT_C" --text-only
has candle && OMNISTREAM_DECODE_KERNELS=candle bench "${TEXT_S:-150}" "${H200[@]}" --name chat-candle "${CHAT[@]}" --concurrency "$TEXT_C" --text-only
has eager && bench "${TEXT_S:-150}" "${H200[@]}" --name chat-eager --enforce-eager "${CHAT[@]}" --concurrency "$TEXT_C" --text-only
if has gemv; then
  for v in ${GEMV:-4:4 8:3 16:6 16:8}; do
    OMNISTREAM_MOE_GEMV_ROWS=${v%:*} OMNISTREAM_MOE_GEMV_BLOCKS=${v#*:} bench "${TEXT_S:-150}" "${H200[@]}" \
      --name "chat-gemv-r${v%:*}b${v#*:}" "${CHAT[@]}" --concurrency "$TEXT_C" --text-only
  done
fi
has tc2 && OMNISTREAM_MOE_TC_STAGES=2 bench "${TEXT_S:-150}" "${H200[@]}" --name chat-tc2 "${CHAT[@]}" --concurrency "$TEXT_C" --text-only
has text-t && bench "${TEXT_S:-150}" "${H200[@]}" --name chat-t "${CHAT[@]}" --temperature "${TEMP:-1.0}" --concurrency "$TEXT_C" --text-only
has chat && bench "${CHAT_S:-200}" "${H200[@]}" --name chat "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has speech && bench "${CHAT_S:-200}" "${H200[@]}" --name speech "${CHAT[@]}" --audio-frames "${SPEECH_FRAMES:-768}" --concurrency "${CHAT_C:-1,8,32}"
has speech-sort && OMNISTREAM_TOPK_MERGE=0 bench "${CHAT_S:-200}" "${H200[@]}" --name speech-sort "${CHAT[@]}" --audio-frames "${SPEECH_FRAMES:-768}" --concurrency "${CHAT_C:-1,8,32}"
has chat-c2w && OMNISTREAM_STAGE_PRIORITY=code2wav bench "${CHAT_S:-200}" "${H200[@]}" --name chat-c2w "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has speech-c2w && OMNISTREAM_STAGE_PRIORITY=code2wav bench "${CHAT_S:-200}" "${H200[@]}" --name speech-c2w "${CHAT[@]}" --audio-frames "${SPEECH_FRAMES:-768}" --concurrency "${CHAT_C:-1,8,32}"
if has chunks; then
  for n in ${CHUNKS:-4 16}; do
    # Beside the profile: its paths are relative to its folder.
    p=deploy/.qwen3-omni-h200-chunk$n.yaml
    # Not initial_codec_chunk_frames: the key right after a space.
    sed -E "s/ codec_chunk_frames: [0-9]+/ codec_chunk_frames: $n/" deploy/qwen3-omni-h200.yaml >"$p"
    grep -q " codec_chunk_frames: $n[ ,]" "$p" || echo "no codec_chunk_frames in the profile"
    bench "${CHAT_S:-200}" --profile "$p" --name "chat-chunk$n" "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
    bench "${CHAT_S:-200}" --profile "$p" --name "speech-chunk$n" "${CHAT[@]}" --audio-frames "${SPEECH_FRAMES:-768}" --concurrency "${CHAT_C:-1,8,32}"
    rm -f "$p"
  done
fi
has chat-t && bench "${CHAT_S:-200}" "${H200[@]}" --name chat-t "${CHAT[@]}" --temperature "${TEMP:-1.0}" --concurrency "${CHAT_C:-1,8,32}"
has chat-wait && OMNISTREAM_STAGE_PRIORITY=${WAIT_MS:-100} bench "${CHAT_S:-200}" "${H200[@]}" --name chat-wait "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has chat-nopri && OMNISTREAM_STAGE_PRIORITY=off bench "${CHAT_S:-200}" "${H200[@]}" --name chat-nopri "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has chat-overlap && OMNISTREAM_STAGE_PRIORITY=eager bench "${CHAT_S:-200}" "${H200[@]}" --name chat-overlap "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has voice && bench "${CHAT_S:-200}" --profile deploy/qwen3-omni-h200-voice.yaml --name chat-voice "${CHAT[@]}" --concurrency "${CHAT_C:-1,8,32}"
has long && bench "${LONG_S:-240}" "${H200[@]}" --name long --prompt-tokens 2500 --output-tokens 900 --concurrency "${LONG_C:-1,8}"
if has long-chunk; then
  p=deploy/.qwen3-omni-h200-prefill-chunk.yaml
  sed -E "s/^( *)max_prefill_tokens: ([0-9]+)/\1max_prefill_tokens: \2\n\1prefill_chunk_tokens: ${PREFILL_CHUNK:-512}/" \
    deploy/qwen3-omni-h200.yaml >"$p"
  grep -q "prefill_chunk_tokens: ${PREFILL_CHUNK:-512}" "$p" || echo "no prefill_chunk_tokens in the profile"
  bench "${LONG_S:-240}" --profile "$p" --name long-chunk --prompt-tokens 2500 --output-tokens 900 --concurrency "${LONG_C:-1,8}"
  bench "${CHAT_S:-200}" --profile "$p" --name chat-chunk-prefill "${CHAT[@]}" --concurrency 32
  rm -f "$p"
fi
# Two profiles side by side through `omnistream bench --compare` (it starts NATS
# and the stage processes a split profile names): NAME SECONDS A B [bench args].
compare() {
  local name=$1 s=$2 a=$3 b=$4
  shift 4
  step "$name"
  PATH=$PWD/cuda-bin:$PATH timeout "$s" cuda-bin/omnistream bench --compare "$a" "$b" \
    --voice ethan --no-plots --out "$OUT/json/$name" "$@" 2>&1 | grep -v '^\s*$' | tail -40
  cat "$OUT/json/$name/bench.md"
  tail -n 5 "$OUT/json/$name"/*.log
}
split() {
  compare "$1" "${SPLIT_S:-560}" deploy/qwen3-omni-h200.yaml deploy/distributed/qwen3-omni-h200.yaml \
    --concurrency "${SPLIT_C:-1,32}" --num-prompts "${SPLIT_N:-32}" --input-len 100 --output-len 200
}
has split && split split
if has split-mps; then
  if command -v nvidia-cuda-mps-control >/dev/null; then
    export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
    mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
    nvidia-cuda-mps-control -d && split split-mps
    echo quit | nvidia-cuda-mps-control
    unset CUDA_MPS_PIPE_DIRECTORY CUDA_MPS_LOG_DIRECTORY
  else
    step split-mps
    echo "no nvidia-cuda-mps-control on this host: MPS not tried"
  fi
fi
LAYOUT=(deploy/qwen3-omni-3gpu.yaml deploy/distributed/qwen3-omni-3gpu.yaml)
if has layout3; then
  compare layout3 "${LAYOUT_S:-580}" "${LAYOUT[@]}" --concurrency "${LAYOUT_C:-1,8,32,64}" \
    --num-prompts "${LAYOUT_N:-64}" --input-len 100 --output-len 200
  compare layout3-long "${LAYOUT_S:-580}" "${LAYOUT[@]}" --concurrency 32 --num-prompts 32 \
    --input-len 2500 --output-len 900
fi
if has layout3-dry; then
  # Beside the profiles: their paths are relative to their folders.
  dry=(deploy/.qwen3-omni-3gpu-dry.yaml deploy/distributed/.qwen3-omni-3gpu-dry.yaml)
  for i in 0 1; do sed -E 's/cuda:[0-9]/cuda:0/g' "${LAYOUT[$i]}" >"${dry[$i]}"; done
  compare layout3-dry "${LAYOUT_S:-400}" "${dry[@]}" --concurrency 1,8 --num-prompts 8 \
    --input-len 100 --output-len 200
  rm -f "${dry[@]}"
fi
# Waits until the server logging to LOG (pid PID) listens, exits, or SECONDS
# pass; prints its last lines about it.
wait_listening() {
  local log=$1 pid=$2 secs=${3:-300}
  for _ in $(seq 1 "$secs"); do
    grep -q "omnistream listening" "$log" && break
    kill -0 "$pid" 2>/dev/null || break
    sleep 1
  done
  grep -E "listening|rror" "$log" | tail -3
}
# One level of a replicas sweep: NAME, URL(S), requests in flight a GPU, GPUs.
replica_level() {
  local name=$1 url=$2 c=$3 n=$4
  timeout "${REPLICA_S:-240}" cuda-bin/omnistream bench --url "$url" --voice ethan --no-plots \
    --out "$OUT/json/$name" --endpoint chat --input-len 100 --output-len 200 \
    --concurrency $((c * n)) --num-prompts $((2 * c * n)) --warmup 1 2>&1 | grep -v '^\s*$' | tail -3
  sed -n '/^| load/,/^$/p' "$OUT/json/$name/bench.md"
}
if has replicas; then
  ngpu=$(nvidia-smi -L | wc -l)
  for n in ${REPLICA_GPUS:-1 2 4 8}; do
    [ "$n" -le "$ngpu" ] || { echo "replicas: $n GPUs asked, the host has $ngpu"; continue; }
    step "replicas: $n GPUs"
    pids=() urls=()
    for ((i = 0; i < n; i++)); do
      port=$((8100 + i))
      CUDA_VISIBLE_DEVICES=$i cuda-bin/omnistream serve "${H200[@]}" --port $port \
        >"$OUT/replicas-$n-$i.log" 2>&1 &
      pids+=($!) urls+=("http://127.0.0.1:$port")
    done
    for ((i = 0; i < n; i++)); do
      wait_listening "$OUT/replicas-$n-$i.log" "${pids[$i]}"
    done
    url=$(IFS=,; echo "${urls[*]}")
    for c in ${REPLICA_C:-8 16 32 48 64}; do
      replica_level "replicas-n$n-c$c" "$url" "$c" "$n"
    done
    kill "${pids[@]}"; wait "${pids[@]}" 2>/dev/null
  done
  step "replicas: scaling"
  python3 scripts/cuda/scaling.py "$OUT"/json/replicas-n*/bench.json
fi
if has replicas-1p; then
  ngpu=$(nvidia-smi -L | wc -l)
  reports=()
  for n in ${REPLICA_GPUS:-1 2 4 8}; do
    [ "$n" -le "$ngpu" ] || { echo "replicas-1p: $n GPUs asked, the host has $ngpu"; continue; }
    step "replicas-1p: $n GPUs"
    # Beside the profile: its paths are relative to its folder.
    p=deploy/.qwen3-omni-${n}gpu.yaml
    devs=$(seq -s ', ' -f 'cuda:%g' 0 $((n - 1)))
    sed -E "s/replicas: 8/replicas: $n/; s/devices: \[[^]]*\]/devices: [$devs]/" deploy/qwen3-omni-8gpu.yaml >"$p"
    grep -c "replicas: $n" "$p"
    cuda-bin/omnistream serve --profile "$p" --port 8100 >"$OUT/replicas-1p-$n.log" 2>&1 &
    pid=$!
    wait_listening "$OUT/replicas-1p-$n.log" "$pid" 600
    for c in ${REPLICA_C:-8 16 32 48 64}; do
      replica_level "replicas1p-n$n-c$c" http://127.0.0.1:8100 "$c" "$n"
      reports+=("$n:$OUT/json/replicas1p-n$n-c$c/bench.json")
    done
    kill "$pid"; wait "$pid" 2>/dev/null
    rm -f "$p"
  done
  step "replicas-1p: scaling"
  python3 scripts/cuda/scaling.py "${reports[@]}"
fi
if has reference; then
  step reference
  timeout "${REF_S:-240}" python3 scripts/cuda/reference_gpu.py 2>&1 | tail -20 | tee "$OUT/json/reference.json"
fi
if has serve; then
  step serve
  PORT=8093
  cuda-bin/omnistream serve --profile "${SERVE_PROFILE:-deploy/qwen3-omni-h200.yaml}" --port $PORT > "$OUT/serve.log" 2>&1 &
  SERVER=$!
  # It prints this line once loaded, warmed up and listening.
  wait_listening "$OUT/serve.log" "$SERVER"
  # One bench against the running server: NAME, then its arguments.
  sb() {
    local name=$1; shift
    step "serve $name"
    timeout "${SB_S:-300}" cuda-bin/omnistream bench --url "http://127.0.0.1:$PORT" --voice ethan \
      --no-plots --out "$OUT/json/serve-$name" "$@" 2>&1 | grep -v '^\s*$' | tail -4
    sed -n '/^| load/,/^$/p;/^Playback/,/^$/p' "$OUT/json/serve-$name/bench.md"
    grep -E '\| (TTFT|TTFP|audio RTF|turn end)' "$OUT/json/serve-$name/bench.md"
  }
  runs=" ${SERVE_RUNS:-chat text rt spoken long} "
  CHAT=(--input-len "${CHAT_WORDS:-100}" --output-len 200)
  if [[ $runs == *" chat "* ]]; then
    for c in ${CHAT_C:-1:8 8:32 32:64 64:128}; do
      sb "chat-c${c%:*}" --endpoint chat "${CHAT[@]}" --concurrency "${c%:*}" --num-prompts "${c#*:}"
    done
  fi
  [[ $runs == *" text "* ]] && sb text-c32 --endpoint chat "${CHAT[@]}" --text-only \
    --temperature "${TEMP:-1.0}" --concurrency 32 --num-prompts 64
  if [[ $runs == *" rt "* ]]; then
    sb rt-c1 --endpoint realtime "${CHAT[@]}" --concurrency 1 --num-prompts 8
    sb rt-c32 --endpoint realtime "${CHAT[@]}" --concurrency 32 --num-prompts 64
  fi
  if [[ $runs == *" spoken "* ]]; then
    SPOKEN=(--spoken-input gpu-questions --output-len 100 --vad-silence-ms 200)
    for c in 1:6 8:16 32:32; do
      sb "spoken-chat-c${c%:*}" --endpoint chat "${SPOKEN[@]}" --concurrency "${c%:*}" --num-prompts "${c#*:}"
      sb "spoken-rt-c${c%:*}" --endpoint realtime "${SPOKEN[@]}" --concurrency "${c%:*}" --num-prompts "${c#*:}"
    done
  fi
  if [[ $runs == *" long "* ]]; then
    for c in ${LONG_C:-1:2 32:32}; do
      sb "long-c${c%:*}" --endpoint chat --input-len "${LONG_WORDS:-625}" --output-len 900 \
        --concurrency "${c%:*}" --num-prompts "${c#*:}" --warmup 1
    done
  fi
  kill "$SERVER"; wait "$SERVER"
  tail -n 20 "$OUT/serve.log"
fi
rm -f "$OUT"/json/*.md "$OUT"/json/*.png "$OUT/ncu.csv"
tar -C "$OUT" -czf "$OUT/json.tar.gz" json && rm -rf "$OUT/json"
step done
