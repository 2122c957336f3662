"""The reference side of the Qwen3-TTS GPU benchmark (issue 26): qwen-tts 0.1.1's
`generate` + the speech tokenizer's `decode`, batch 1, random bf16 weights at a
released checkpoint's shapes (deploy/qwen3_tts_released/<variant>), on one GPU.

qwen-tts generates the whole utterance before it returns, so its first audio
comes when everything is done: time to first audio = the whole time. Each run
speaks exactly --frames codec frames (12.5 a second): the end code is never
drawn and `generate` stops on one it suppresses, so random weights never stop
early.

  python3 scripts/qwen3_tts/ref_bench.py --variant deploy/qwen3_tts_released/1.7b-customvoice \
      --mode custom --frames 125 --runs 5 --out ref.json
  --mode clone: a new 5 s reference clip each run, its x-vector from the speaker
  encoder (and with --icl its codes from the codec encoder), as
  `generate_voice_clone` does.

On the GPU host the wheels come from scripts/qwen3_tts/ref_wheels.sh (carried),
installed with --target into a scratch folder put first on sys.path.
"""

import argparse
import json
import math
import os
import sys
import time
import types

# The 25 Hz v1 tokenizer (out of scope) imports onnxruntime at module level;
# nothing here runs it, and the GPU host has no onnxruntime.
try:
    import onnxruntime  # noqa: F401
except ImportError:
    sys.modules["onnxruntime"] = types.ModuleType("onnxruntime")

import torch  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402
from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig  # noqa: E402
from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration  # noqa: E402
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import (  # noqa: E402
    Qwen3TTSTokenizerV2Config,
)
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import (  # noqa: E402
    Qwen3TTSTokenizerV2Model,
)

TEXT = (
    "Streaming speech should start playing long before the answer is complete, "
    "so the listener never waits for the whole sentence to be written."
)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def speech_like(seconds: float, seed: int) -> torch.Tensor:
    """A voiced, syllable-paced signal (as make_fixtures.py): a reference clip."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(24000 * seconds), dtype=torch.float64) / 24000
    f0 = 120 + 40 * torch.sin(2 * math.pi * 0.5 * t) + seed % 7
    phase = 2 * math.pi * torch.cumsum(f0, 0) / 24000
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * 4 * t)).clamp(min=0)
    x = 0.3 * voiced * envelope + 0.05 * torch.randn(t.shape, generator=g, dtype=torch.float64)
    return (x / x.abs().max() * 0.8).float()


def build(variant: str, dtype, device):
    with open(os.path.join(variant, "config.json")) as f:
        raw = json.load(f)
    # A config saved by transformers writes `model_type` into the speaker
    # encoder's block, which the class does not take back.
    (raw.get("speaker_encoder_config") or {}).pop("model_type", None)
    cfg = Qwen3TTSConfig(**raw)
    tcfg = Qwen3TTSTokenizerV2Config.from_pretrained(os.path.join(variant, "speech_tokenizer"))
    for c in (cfg, cfg.talker_config, cfg.talker_config.code_predictor_config):
        c._attn_implementation = "sdpa"
    for c in (tcfg, tcfg.encoder_config, tcfg.decoder_config):
        c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen3TTSForConditionalGeneration(cfg).to(dtype).eval()
        tok = Qwen3TTSTokenizerV2Model(tcfg).to(dtype).eval()
    # Random weights whose codebooks are usable: the decoder divides embed_sum by
    # cluster_usage (as the engine's random weights draw it: 1).
    with torch.no_grad():
        for name, p in tok.named_parameters():
            if "cluster_usage" in name:
                p.fill_(1.0)
        for name, b in tok.named_buffers():
            if "cluster_usage" in name:
                b.fill_(1.0)
    return cfg, model, tok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--variant", required=True)
    ap.add_argument("--mode", choices=["custom", "design", "clone"], default="custom")
    ap.add_argument("--icl", action="store_true", help="clone in context (ref codes + text)")
    ap.add_argument("--frames", type=int, default=125)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (f32)")
    a = ap.parse_args()
    device = a.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    cfg, model, tok = build(a.variant, dtype, device)
    text_tok = Tokenizer.from_file(os.path.join(ROOT, "tests/fixtures/qwen3_omni/tokenizer/tokenizer.json"))

    def ids(s: str) -> torch.Tensor:
        return torch.tensor([text_tok.encode(s, add_special_tokens=False).ids], dtype=torch.long, device=device)

    tc = cfg.talker_config
    suppressed = tc.vocab_size - 1  # in `generate`'s suppress list: never drawn
    assert suppressed != tc.codec_eos_token_id
    # ... and the end code is never drawn either (as the server's ignore_eos):
    # every run speaks exactly --frames frames.
    talker_generate = model.talker.generate

    def fixed_length(**kw):
        return talker_generate(bad_words_ids=[[tc.codec_eos_token_id]], **kw)

    model.talker.generate = fixed_length
    speakers = sorted(tc.spk_id or {})
    results = []
    for run in range(a.warmup + a.runs):
        sync()
        t0 = time.perf_counter()
        speaker, instruct_ids, vcp, ref_ids = None, None, None, None
        if a.mode == "custom":
            speaker = speakers[run % len(speakers)] if speakers else None
        elif a.mode == "design":
            instruct_ids = [ids("<|im_start|>user\nA calm, warm voice.<|im_end|>\n")]
        else:
            clip = speech_like(5.0, seed=run)
            emb = model.extract_speaker_embedding(clip.numpy(), 24000)
            ref_code = None
            if a.icl:
                enc = tok.encode(clip.unsqueeze(0).to(device, dtype),
                                 padding_mask=torch.ones(1, clip.numel(), dtype=torch.long, device=device))
                ref_code = enc.audio_codes[0]
                ref_ids = [ids("<|im_start|>assistant\nThe reference clip's words.<|im_end|>\n")]
            vcp = dict(ref_code=[ref_code], ref_spk_embedding=[emb], x_vector_only_mode=[not a.icl],
                       icl_mode=[a.icl])
        with torch.inference_mode():
            codes, _ = model.generate(
                input_ids=[ids(f"<|im_start|>assistant\n{TEXT}<|im_end|>\n<|im_start|>assistant\n")],
                instruct_ids=[instruct_ids[0] if instruct_ids else None],
                ref_ids=ref_ids,
                voice_clone_prompt=vcp,
                languages=["english"],
                speakers=[speaker],
                # Each generate_* path's default: whole text for preset and
                # described voices, the streamed layout for a cloned one.
                non_streaming_mode=a.mode != "clone",
                max_new_tokens=a.frames,
                eos_token_id=suppressed,
            )
            c = codes[0]
            if vcp is not None and vcp["ref_code"][0] is not None:
                c = torch.cat([vcp["ref_code"][0], c], dim=0)
            wav = tok.decode(c.unsqueeze(0), return_dict=True).audio_values[0]
        sync()
        dt = time.perf_counter() - t0
        audio_s = codes[0].shape[0] * 1920 / 24000
        if run >= a.warmup:
            results.append(dict(seconds=dt, audio_s=audio_s, frames=int(codes[0].shape[0]),
                                wav_samples=int(wav.numel())))
        print(f"run {run}: {dt * 1000:.0f} ms for {audio_s:.2f} s of audio (RTF {dt / audio_s:.3f})", flush=True)
    secs = sorted(r["seconds"] for r in results)
    summary = dict(
        variant=os.path.basename(a.variant.rstrip("/")), mode=a.mode + ("-icl" if a.icl else ""),
        frames=a.frames, runs=a.runs, gpu=torch.cuda.get_device_name() if device == "cuda" else "cpu",
        ttfp_ms_median=1000 * secs[len(secs) // 2],
        rtf_median=sorted(r["seconds"] / r["audio_s"] for r in results)[len(results) // 2],
        params_talker=sum(p.numel() for p in model.talker.parameters()),
        runs_detail=results,
    )
    print(json.dumps({k: v for k, v in summary.items() if k != "runs_detail"}))
    if a.out:
        with open(a.out, "w") as f:
            json.dump(summary, f, indent=1)


if __name__ == "__main__":
    main()
