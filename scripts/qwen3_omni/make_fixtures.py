"""Writes the Qwen3-Omni reference fixtures under tests/fixtures/qwen3_omni/.

    python scripts/qwen3_omni/make_fixtures.py            # every component
    python scripts/qwen3_omni/make_fixtures.py code2wav   # one (the model is rebuilt identically)

Needs torch and transformers==5.24.0 (CPU is enough). The tiny model is built once
from a fixed seed and saved to tests/fixtures/qwen3_omni/model/ in the real
checkpoint's layout; each component module (`<name>.py` beside this file) has
`make(model, out_dir)` that writes `<out_dir>/io.safetensors` (inputs and the
reference's outputs) from that same model.
"""

import importlib
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
import tiny  # noqa: E402

COMPONENTS = ["tokenizer", "thinker", "audio_encoder", "talker", "code_predictor", "code2wav", "generate"]


def main(names):
    torch.set_grad_enabled(False)
    model = tiny.tiny_model()
    tiny.save_model(model, "model")
    for name in names or COMPONENTS:
        path = os.path.join(os.path.dirname(__file__), f"{name}.py")
        if not os.path.exists(path):
            print(f"skip {name}: no {name}.py yet")
            continue
        mod = importlib.import_module(name)
        torch.manual_seed(1234)
        mod.make(model, tiny.out_dir(name))
        print(f"wrote {name}")


if __name__ == "__main__":
    main(sys.argv[1:])
