#!/usr/bin/env python3
"""The Qwen3-TTS Talker step's roofline (issue 26): what one frame costs at the
least, from a checkpoint's config.json, against what `omnistream bench` measured.

One frame of a request is one Talker decode step (28 layers for 1.7B) and the
code predictor's 15 steps (its 5 layers and one of its 15 heads each), so the
bound per frame, for a batch of B requests whose KV is L positions long, is

    memory:  weights read once for the batch (bf16) + every row's KV
    compute: 2 x weights x B + attention (4 x layers x heads x head_dim x L x B)

and the step takes at least the larger of bytes / HBM bandwidth and FLOPs /
tensor-core rate. A frame is 80 ms of speech, so the bound gives the best RTF
at batch 1 and the most audio-s/s at batch B.

Measured: for each bench.json given, each level's Talker step time is the
stage's busy share x the level's wall time / its steps (this counts time the
Talker waits for Code2Wav's kernels on the same GPU, so it is an upper bound on
the Talker's own).

    python3 scripts/qwen3_tts/roofline.py deploy/qwen3_tts_released/bench/1.7b-customvoice \
        [--gpu h100|h200] [--kv 200] [--bench run/json/*/bench.json ...]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

# Dense bf16 tensor-core rate and HBM bandwidth, from the vendors' data sheets
# (SXM parts).
GPUS = {
    "h100": {"tflops": 989.0, "tb_s": 3.35, "name": "H100 SXM (80 GB HBM3)"},
    "h200": {"tflops": 989.0, "tb_s": 4.8, "name": "H200 SXM (141 GB HBM3e)"},
}
FRAME_S = 0.08  # 12.5 Hz
BF16 = 2


def decoder_params(c: dict) -> tuple[int, int]:
    """(weights, KV elements a position) of a Qwen3 decoder config."""
    h, hd = c["hidden_size"], c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    attn = h * q + 2 * h * kv + q * h + 2 * hd  # q/k/v/o, q/k norms
    mlp = 3 * h * c["intermediate_size"]
    layer = attn + mlp + 2 * h
    return c["num_hidden_layers"] * layer + h, c["num_hidden_layers"] * 2 * kv


def frame_cost(cfg: dict, batch: int, kv_len: int) -> dict:
    t = cfg["talker_config"]
    cp = t["code_predictor_config"]
    groups = t["num_code_groups"]
    talker_w, talker_kv = decoder_params(t)
    talker_w += t["hidden_size"] * t["vocab_size"]  # codec head
    cp_w, cp_kv = decoder_params(cp)
    proj = t["hidden_size"] * cp["hidden_size"] if t["hidden_size"] != cp["hidden_size"] else 0
    head = cp["hidden_size"] * cp["vocab_size"]
    steps = groups - 1
    # Weights: the Talker once, the predictor's layers and one head a code.
    weights = talker_w + proj + steps * (cp_w + head)
    kv_bytes = batch * kv_len * talker_kv * BF16 + batch * steps * groups * cp_kv * BF16
    hd_t = t.get("head_dim") or t["hidden_size"] // t["num_attention_heads"]
    attn_flops = 4 * t["num_hidden_layers"] * t["num_attention_heads"] * hd_t * kv_len * batch
    return {
        "weights": weights,
        "bytes": weights * BF16 + kv_bytes,
        "flops": 2 * weights * batch + attn_flops,
    }


def bound_ms(c: dict, gpu: dict) -> tuple[float, float]:
    """(memory, compute) bound of a frame cost, ms."""
    return c["bytes"] / (gpu["tb_s"] * 1e12) * 1e3, c["flops"] / (gpu["tflops"] * 1e12) * 1e3


def measured(paths: list[str]) -> list[tuple[str, float, float]]:
    """(label, mean batch, ms a Talker step) for each level of each bench.json."""
    rows = []
    for p in paths:
        d = json.loads(Path(p).read_text())
        for run in d["runs"]:
            for lv in run["levels"]:
                st = next((s for s in lv.get("stages") or [] if s["stage"] == "talker"), None)
                if not st or not st["steps"]:
                    continue
                ms = st["busy_fraction"] * lv["wall_s"] / st["steps"] * 1e3
                load = lv["load"]
                c = load.get("concurrency") if isinstance(load, dict) else load
                rows.append((f"{Path(p).parent.name} (c={c})", st["mean_batch"], ms))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variant", help="a folder with the checkpoint's config.json")
    ap.add_argument("--gpu", choices=sorted(GPUS), default="h100")
    ap.add_argument("--kv", type=int, default=200, help="KV positions a row (prompt + frames so far)")
    ap.add_argument("--bench", nargs="*", default=[], help="bench.json files to set against the bound")
    a = ap.parse_args()
    cfg = json.loads((Path(a.variant) / "config.json").read_text())
    gpu = GPUS[a.gpu]
    print(f"{Path(a.variant).name} on {gpu['name']}: {gpu['tb_s']} TB/s, {gpu['tflops']:.0f} TFLOPS bf16; "
          f"KV {a.kv} positions a row")
    print("| batch | weights read (M) | bytes (GB) | GFLOP | memory bound ms | compute bound ms | "
          "bound ms a step | best RTF | most audio-s/s |")
    print("|---|---|---|---|---|---|---|---|---|")
    for b in (1, 8, 16, 32, 48, 64):
        c = frame_cost(cfg, b, a.kv)
        mem, comp = bound_ms(c, gpu)
        bound = max(mem, comp)
        print(f"| {b} | {c['weights'] / 1e6:.0f} | {c['bytes'] / 1e9:.2f} | {c['flops'] / 1e9:.1f} | "
              f"{mem:.3f} | {comp:.3f} | {bound:.3f} | {bound / 1e3 / FRAME_S:.4f} | "
              f"{b * FRAME_S / (bound / 1e3):.0f} |")
    rows = measured(a.bench)
    if rows:
        print()
        print("| measured | mean batch | ms a Talker step | bound ms (nearest batch) | share of the bound |")
        print("|---|---|---|---|---|")
        for label, batch, ms in rows:
            bound = max(bound_ms(frame_cost(cfg, max(1, round(batch)), a.kv), gpu))
            print(f"| {label} | {batch:.1f} | {ms:.2f} | {bound:.3f} | {bound / ms:.0%} |")


if __name__ == "__main__":
    main()
