#!/usr/bin/env bash
# The distributed bench (docs/bench/distributed.md), on this machine:
#  1. in-process vs three processes over NATS on loopback, side by side in one
#     run of `omnistream bench --compare` (it starts NATS and the stage
#     processes for the split profile): TTFP, RTF and the rest as ratios;
#  2. per-hop latency and bytes per second of audio over NATS, read from the
#     gateway's /metrics after a sweep through the split pipeline.
#   scripts/bench_distributed.sh [OUT] [CONCURRENCY] [PROMPTS]
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${1:-bench-out/distributed}
CONC=${2:-1,4}
N=${3:-8}
BIN=target/release/omnistream
[[ -x $BIN ]] || cargo build --release -q -p omnistream
mkdir -p "$OUT"
SPLIT=deploy/distributed/tiny-cpu.yaml

$BIN bench --compare deploy/tiny-cpu.yaml $SPLIT --concurrency "$CONC" --num-prompts "$N" --out "$OUT"

# Per hop: the split pipeline alone, then its counters.
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
NP=$(free_port); GP=$(free_port)
printf 'listen: 127.0.0.1:%s\nmax_payload: 64MB\n' "$NP" > "$OUT/hops-nats.conf"
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
nats-server -c "$OUT/hops-nats.conf" 2>"$OUT/hops-nats.log" & pids+=($!)
for s in talker code2wav; do
  $BIN stage --profile $SPLIT --stage $s --nats nats://127.0.0.1:$NP >/dev/null 2>"$OUT/hops-$s.log" & pids+=($!)
done
$BIN serve --profile $SPLIT --nats nats://127.0.0.1:$NP --port "$GP" >/dev/null 2>"$OUT/hops-gateway.log" & pids+=($!)
until curl -sf "http://127.0.0.1:$GP/health" >/dev/null; do sleep 0.5; done
curl -s "http://127.0.0.1:$GP/metrics" > "$OUT/hops-before.txt"
$BIN bench --url "http://127.0.0.1:$GP" --concurrency "$CONC" --num-prompts "$N" --no-plots --out "$OUT/hops" >/dev/null
sleep 1 # the replicas' last announcements
curl -s "http://127.0.0.1:$GP/metrics" > "$OUT/hops-after.txt"
python3 - "$OUT" <<'PY'
import json, re, sys
out = sys.argv[1]
def read(f):
    m = {}
    for line in open(f):
        if line.startswith("#"):
            continue
        k, v = line.rsplit(" ", 1)
        m[k] = float(v)
    return m
a, b = read(f"{out}/hops-before.txt"), read(f"{out}/hops-after.txt")
d = lambda k: b.get(k, 0.0) - a.get(k, 0.0)
audio_s = sum(l["audio_seconds"]["mean"] * l["audio_seconds"]["n"]
              for r in json.load(open(f"{out}/hops/bench.json"))["runs"] for l in r["levels"])
rows = []
ev = d("omnistream_wire_events_in_total")
rows.append(("stage processes -> gateway (events)", ev, d("omnistream_wire_event_bytes_in_total"), d("omnistream_wire_event_seconds_total")))
for stage in ("talker", "code2wav"):
    keys = [k for k in b if k.startswith("omnistream_stage_replica{") and f'stage="{stage}"' in k]
    get = lambda m: sum(d(k) for k in keys if f'metric="{m}"' in k)
    rows.append((f"-> {stage} (payloads)", get("wire_messages_in_total"), get("wire_bytes_in_total"), get("wire_seconds_in_total")))
print("| hop | messages | bytes | mean latency ms |")
print("|---|---|---|---|")
for name, n, by, s in rows:
    print(f"| {name} | {n:.0f} | {by:.0f} | {1e3 * s / n if n else 0:.3f} |")
total = sum(r[2] for r in rows)
print(f"\naudio seconds produced: {audio_s:.1f}; bytes over NATS (the hops above): "
      f"{total:.0f}, {total / audio_s:.0f} bytes per second of audio")
PY
