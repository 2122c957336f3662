"""Writes deploy/qwen3_omni_moe_bench/config.json: the released Qwen3-Omni shapes
(deploy/qwen3_omni_moe/config.json) with the chat and tts token ids of the
tokenizer the benchmark runs with (tests/fixtures/qwen3_omni/tokenizer): the
released tokenizer can't be downloaded here, and with random weights only the
shapes matter. Codec ids stay the released ones.

    python3 scripts/cuda/bench_config.py
"""
import json
import pathlib

root = pathlib.Path(__file__).resolve().parents[2]
real = json.loads((root / "deploy/qwen3_omni_moe/config.json").read_text())
tiny = json.loads((root / "tests/fixtures/qwen3_omni/model/config.json").read_text())


def copy_ids(dst, src):
    for k, v in src.items():
        if isinstance(v, dict) and isinstance(dst.get(k), dict):
            copy_ids(dst[k], v)
        elif k.endswith(("token_id", "token_index")) and not k.startswith("codec") and k in dst:
            dst[k] = v


copy_ids(real, tiny)
out = root / "deploy/qwen3_omni_moe_bench/config.json"
out.parent.mkdir(parents=True, exist_ok=True)
out.write_text(json.dumps(real, indent=2) + "\n")
print(f"wrote {out}")
