"""The Hugging Face reference on the GPU at the released shapes, random bf16
weights, batch 1: the Thinker's decode speed and a whole non-streaming
`generate` (its first audio comes with its last), beside omnistream's
`bench-engine` in the same GPU run (scripts/cuda/gpu_bench.sh).

    python3 scripts/cuda/reference_gpu.py [--prompt 100] [--tokens 64] [--frames 100]
"""

import argparse
import json
import pathlib
import time

import torch
import transformers
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

ROOT = pathlib.Path(__file__).resolve().parents[2]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompt", type=int, default=100)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--frames", type=int, default=100)
    a = ap.parse_args()
    torch.set_grad_enabled(False)
    torch.manual_seed(0)
    cfg = Qwen3OmniMoeConfig.from_pretrained(ROOT / "deploy/qwen3_omni_moe")
    t0 = time.perf_counter()
    with torch.device("cuda"):
        model = Qwen3OmniMoeForConditionalGeneration._from_config(cfg, dtype=torch.bfloat16)
    model.eval()
    load_s = time.perf_counter() - t0
    # <|im_start|>user\n ... <|im_end|>\n<|im_start|>assistant\n, the body random text ids.
    nl = 198
    body = torch.randint(1000, 100000, (a.prompt - 8,)).tolist()
    ids = [cfg.im_start_token_id, cfg.user_token_id, nl, *body, cfg.im_end_token_id, nl,
           cfg.im_start_token_id, cfg.assistant_token_id, nl]
    x = torch.tensor([ids], device="cuda")
    out = {"transformers": transformers.__version__, "torch": torch.__version__,
           "gpu": torch.cuda.get_device_name(0), "prompt_tokens": len(ids), "init_s": load_s}
    # Thinker alone: warm once, then time a forced-length greedy decode.
    model.thinker.generate(input_ids=x, max_new_tokens=4, do_sample=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    g = model.thinker.generate(input_ids=x, max_new_tokens=a.tokens, min_new_tokens=a.tokens, do_sample=False)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    n = g.shape[1] - x.shape[1]
    out.update(thinker_tokens=n, thinker_s=dt, thinker_tok_s=n / dt)
    # Whole generate: text then speech, audio only at the end.
    t0 = time.perf_counter()
    _, audio = model.generate(input_ids=x, speaker="ethan", thinker_max_new_tokens=a.tokens,
                              thinker_do_sample=False, talker_max_new_tokens=a.frames)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    secs = audio.numel() / 24000 if audio is not None else 0.0
    out.update(generate_s=dt, first_audio_s=dt, audio_s=secs, rtf=dt / secs if secs else None)
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
