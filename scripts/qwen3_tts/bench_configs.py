"""The released Qwen3-TTS configs as the GPU benchmark profiles load them:
deploy/qwen3_tts_released/bench/<variant>/ is deploy/qwen3_tts_released/<variant>/
with the text tokens' ids (`im_start`, `im_end`, `tts_pad`, `tts_bos`, `tts_eos`,
`assistant`) taken from the test tokenizer (tests/fixtures/qwen3_omni/tokenizer),
which stands in for the released one (it cannot be downloaded here) and
numbers them otherwise. Every shape, codec id and setting is the released one's.
As scripts/cuda/bench_config.py does for Qwen3-Omni.

    python3 scripts/qwen3_tts/bench_configs.py           # write them
    python3 scripts/qwen3_tts/bench_configs.py --check   # exit 1 if they differ
"""

import json
import os
import shutil
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RELEASED = os.path.join(ROOT, "deploy", "qwen3_tts_released")
TOKENIZER = os.path.join(ROOT, "tests", "fixtures", "qwen3_omni", "tokenizer", "tokenizer.json")
VARIANTS = ["1.7b-customvoice", "1.7b-voicedesign", "1.7b-base", "0.6b-customvoice", "0.6b-base"]
TOKENS = {
    "im_start_token_id": "<|im_start|>",
    "im_end_token_id": "<|im_end|>",
    "tts_pad_token_id": "<|tts_pad|>",
    "tts_bos_token_id": "<|tts_bos|>",
    "tts_eos_token_id": "<|tts_eos|>",
    "assistant_token_id": "assistant",
}


def token_ids() -> dict:
    tok = json.load(open(TOKENIZER))
    ids = {t["content"]: t["id"] for t in tok["added_tokens"]}
    ids.update(tok["model"]["vocab"])
    return {key: ids[text] for key, text in TOKENS.items()}


def files(variant: str, ids: dict) -> dict:
    """Relative path -> text of each file of the bench folder."""
    src = os.path.join(RELEASED, variant)
    cfg = json.load(open(os.path.join(src, "config.json")))
    for key, value in ids.items():
        if key in cfg:
            cfg[key] = value
    out = {"config.json": json.dumps(cfg, indent=2, sort_keys=True) + "\n"}
    for rel in ["generation_config.json", os.path.join("speech_tokenizer", "config.json")]:
        out[rel] = open(os.path.join(src, rel)).read()
    return out


def main() -> int:
    check = "--check" in sys.argv[1:]
    ids = token_ids()
    bad = []
    for v in VARIANTS:
        dst = os.path.join(RELEASED, "bench", v)
        for rel, text in files(v, ids).items():
            path = os.path.join(dst, rel)
            if check:
                if not os.path.exists(path) or open(path).read() != text:
                    bad.append(path)
                continue
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                f.write(text)
    if check and bad:
        print("out of date (run scripts/qwen3_tts/bench_configs.py):", *bad, sep="\n  ")
        return 1
    print("checked" if check else "wrote", len(VARIANTS), "bench configs; text token ids:", ids)
    return 0


if __name__ == "__main__":
    sys.exit(main())
