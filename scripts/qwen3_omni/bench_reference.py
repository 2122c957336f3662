"""Times the reference (transformers 5.24, CPU, float32) on the tiny model's
`generate` for the fixture cases, for a side-by-side with omnistream's
(`cargo test -p omnistream-stages --lib qwen3_omni::omni::tests::bench_generate -- --ignored --nocapture`).

    python scripts/qwen3_omni/bench_reference.py [--threads 2] [--repeat 5]
"""

import argparse
import json
import os
import statistics
import sys
import time

import torch
from transformers import WhisperFeatureExtractor

sys.path.insert(0, os.path.dirname(__file__))
import tiny  # noqa: E402
from safetensors.torch import load_file  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    torch.set_grad_enabled(False)
    model = tiny.tiny_model()
    io = load_file(os.path.join(tiny.ROOT, "generate", "io.safetensors"))
    meta = json.load(open(os.path.join(tiny.ROOT, "generate", "io.json")))
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    out = {}
    for i, case in enumerate(meta["cases"]):
        extra = {}
        if f"c{i}_pcm" in io:
            f = fe(io[f"c{i}_pcm"].numpy(), sampling_rate=16000, padding=True, truncation=False,
                   return_attention_mask=True, return_tensors="pt")
            extra = dict(input_features=f["input_features"], feature_attention_mask=f["attention_mask"])
        times = []
        for _ in range(a.repeat + 1):
            t0 = time.perf_counter()
            model.generate(input_ids=io[f"c{i}_input_ids"], speaker=case["speaker"], thinker_max_new_tokens=20,
                           thinker_do_sample=False, thinker_eos_token_id=tiny.IDS["im_end_token_id"],
                           talker_do_sample=False, talker_max_new_tokens=24, **extra)
            times.append(time.perf_counter() - t0)
        out[case["speaker"]] = statistics.median(times[1:]) * 1e3
        print(f"reference generate, case {i} ({case['speaker']}): median {out[case['speaker']]:.1f} ms over {a.repeat}")
    print(json.dumps({"reference_ms": out, "threads": a.threads}))


if __name__ == "__main__":
    main()
