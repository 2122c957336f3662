"""The scaling curve of whole-pipeline replicas from `omnistream bench`
reports (bench.json, any number): the servers a run drove (its `--url` list)
are its GPUs, unless the report is given as N:PATH (N GPUs behind one
server, deploy/qwen3-omni-8gpu.yaml's replicas). Per GPU count, the highest load whose p90 TTFP stays within
--ttfp-ms, its audio-s/s and req/s, per GPU, and the share of linear scaling
from the smallest count. Prints a markdown table.

    python3 scripts/cuda/scaling.py bench-out/*/bench.json [--ttfp-ms 500]
    python3 scripts/cuda/scaling.py 1:one/bench.json 2:two/bench.json
"""

from __future__ import annotations

import argparse
import json
import sys


def levels(paths):
    """(servers, level) of every level of every run."""
    for arg in paths:
        gpus, sep, p = arg.partition(":")
        if not (sep and gpus.isdigit()):
            gpus, p = None, arg
        with open(p) as f:
            report = json.load(f)
        for run in report["runs"]:
            n = int(gpus) if gpus else len([u for u in run["url"].split(",") if u])
            for lv in run["levels"]:
                yield n, lv


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("reports", nargs="+")
    ap.add_argument("--ttfp-ms", type=float, default=500.0)
    a = ap.parse_args()
    best: dict[int, dict] = {}
    seen: dict[int, int] = {}
    for n, lv in levels(a.reports):
        seen[n] = seen.get(n, 0) + 1
        t = lv["ttfp_ms"]
        if lv["failed"] or not t.get("n") or t["p90"] > a.ttfp_ms:
            continue
        if n not in best or lv["audio_throughput"] > best[n]["audio_throughput"]:
            best[n] = lv
    if not seen:
        print("no levels in the reports", file=sys.stderr)
        return 1
    print(f"| GPUs (servers) | load within p90 TTFP {a.ttfp_ms:.0f} ms | p90 TTFP ms | mean TTFP ms "
          "| audio-s/s | req/s | audio-s/s a GPU | of linear |")
    print("|---|---|---|---|---|---|---|---|")
    base = None
    for n in sorted(seen):
        lv = best.get(n)
        if lv is None:
            print(f"| {n} | none of {seen[n]} levels | | | | | | |")
            continue
        per_gpu = lv["audio_throughput"] / n
        if base is None:
            base = per_gpu
        load = lv["load"]
        name = (f"c={load['concurrency']}" if load["mode"] == "closed"
                else f"rate={load.get('rate') or 'inf'}")
        print(f"| {n} | {name} | {lv['ttfp_ms']['p90']:.0f} | {lv['ttfp_ms']['mean']:.0f} "
              f"| {lv['audio_throughput']:.1f} | {lv['req_s']:.2f} | {per_gpu:.1f} "
              f"| {100 * per_gpu / base:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
