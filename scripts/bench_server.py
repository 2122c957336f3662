#!/usr/bin/env python3
"""TTFT/TTFP through a running `omnistream serve`, at several concurrencies.

Closed loop: C clients each send streaming chat completions with audio (the
official `openai` SDK) until N requests are done. TTFT = request start -> first
text/transcript delta; TTFP = request start -> first audio delta. Same
definitions as the server's /metrics and `omnistream bench-pipeline`.

    python3 scripts/bench_server.py --url http://127.0.0.1:8091 --concurrency 1,4,16 --requests 16
"""
import argparse
import json
import statistics
import threading
import time

from openai import OpenAI

PROMPTS = [
    "What is the capital of France?",
    "Name three colors of the rainbow.",
    "What do bees make?",
    "How many legs does a spider have?",
    "What is the opposite of hot?",
    "Which planet do we live on?",
    "What animal says moo?",
    "What season comes after winter?",
]


def one(client, i, max_tokens):
    t0 = time.perf_counter()
    ttft = ttfp = None
    stream = client.chat.completions.create(
        model="tiny-cpu",
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
        messages=[{"role": "user", "content": f"Question {i}: {PROMPTS[i % len(PROMPTS)]}"}],
        max_tokens=max_tokens,
        stream=True,
    )
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        audio = getattr(d, "audio", None)
        if audio is None and hasattr(d, "model_extra"):
            audio = (d.model_extra or {}).get("audio")
        if audio is not None and hasattr(audio, "model_dump"):
            audio = audio.model_dump()
        if isinstance(audio, dict):
            if audio.get("transcript") and ttft is None:
                ttft = time.perf_counter() - t0
            if audio.get("data") and ttfp is None:
                ttfp = time.perf_counter() - t0
    return ttft, ttfp, time.perf_counter() - t0


def pct(v, p):
    v = sorted(v)
    k = max(1, min(len(v), int(-(-p * len(v) // 1))))
    return v[k - 1]


def run(url, c, n, max_tokens):
    client = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=600)
    lock = threading.Lock()
    results, nxt = [], [0]

    def worker():
        while True:
            with lock:
                if nxt[0] >= n:
                    return
                i = nxt[0]
                nxt[0] += 1
            r = one(client, i, max_tokens)
            with lock:
                results.append(r)

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(c)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    wall = time.perf_counter() - t0
    ttft = [r[0] * 1e3 for r in results if r[0] is not None]
    ttfp = [r[1] * 1e3 for r in results if r[1] is not None]
    return {
        "concurrency": c,
        "requests": len(results),
        "ttft_ms": {"mean": statistics.mean(ttft), "p50": pct(ttft, 0.5), "p90": pct(ttft, 0.9)},
        "ttfp_ms": {"mean": statistics.mean(ttfp), "p50": pct(ttfp, 0.5), "p90": pct(ttfp, 0.9)},
        "req_per_s": len(results) / wall,
    }


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8091")
    ap.add_argument("--concurrency", default="1,4,16")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--warmup", type=int, default=2)
    a = ap.parse_args()
    client = OpenAI(base_url=a.url + "/v1", api_key="x", max_retries=0, timeout=600)
    for i in range(a.warmup):
        one(client, 1000 + i, a.max_tokens)
    rows = [run(a.url, int(c), a.requests, a.max_tokens) for c in a.concurrency.split(",")]
    print(json.dumps(rows, indent=2))
    print("\n| concurrency | requests | TTFT p50 ms | TTFT p90 ms | TTFP p50 ms | TTFP p90 ms | req/s |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['concurrency']} | {r['requests']} | {r['ttft_ms']['p50']:.0f} | {r['ttft_ms']['p90']:.0f} "
              f"| {r['ttfp_ms']['p50']:.0f} | {r['ttfp_ms']['p90']:.0f} | {r['req_per_s']:.2f} |")


if __name__ == "__main__":
    main()
