"""Code2Wav fixtures: reference waveforms of `model.code2wav` for random codes.

The reference runs in float64 as well (the same modules and weights, `.double()`,
with the two places that force float32 whatever the dtype, the RMSNorms' upcast
and the rotary frequencies, computing in float64), stored as float32: the Rust
tests check f64 against it and f32 against both it and the float32 reference
(kept for one length). tiny.py scales the decoder's convs so the waveform has
speech-like levels; unscaled, the tiny decoder peaks near 90 and amplifies f32
rounding ~1000x, which would make two correct float32 implementations differ by
~1e-3.

Writes tests/fixtures/qwen3_omni/code2wav/io.safetensors:
  codes_{F}    (2, num_quantizers, F) int64, F in LENGTHS, different content per request
  wav_{F}      (2, 1, F*1920 - 555): the float64 reference's waveform BEFORE the final
               clamp(-1, 1), captured by a hook on the last conv of `model.code2wav(codes)`
               (clamping it gives that call's output exactly, asserted)
  wav32_{F32}  the same from the float32 reference, for F = F32 only
  chunked_wav  (1, 1, F*1920 - 555*ceil(F/CHUNK)): the float64 reference's
               `chunked_decode(codes_{F}[:1], CHUNK, LEFT)` (clamped, as it returns) for F = 20
and io.json with these settings. Long streaming checks need no reference (they
compare our stream with our own full decode) and live in Rust only.
"""

import copy
import types

import torch

import tiny

LENGTHS = [1, 5, 20]
F32 = 5
CHUNK = 5
LEFT = 25


def unclamped(c2w, codes):
    captured = []
    hook = c2w.decoder[-1].register_forward_hook(lambda _m, _i, out: captured.append(out))
    out = c2w(codes)
    hook.remove()
    wav = captured[0]
    assert torch.equal(wav.clamp(-1, 1), out)
    return wav


def _rms_norm_f64(self, hidden_states):
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return self.weight * (hidden_states * torch.rsqrt(variance + self.variance_epsilon))


def _rotary_f64(self, x, position_ids):
    freqs = position_ids[..., None].to(torch.float64) * self.inv_freq.to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def float64_copy(c2w):
    """`c2w` in float64 throughout (instance-level patches: other fixtures keep the originals)."""
    c64 = copy.deepcopy(c2w).double()
    for module in c64.modules():
        if type(module).__name__ in ("Qwen3OmniMoeCode2WavRMSNorm", "Qwen3OmniMoeRMSNorm"):
            module.forward = types.MethodType(_rms_norm_f64, module)
    rotary = c64.pre_transformer.rotary_emb
    cfg = c2w.config
    dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    base = cfg.rope_parameters["rope_theta"]
    rotary.inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    rotary.forward = types.MethodType(_rotary_f64, rotary)
    return c64


def make(model, out_dir):
    c32 = model.code2wav
    c64 = float64_copy(c32)
    cfg = c32.config
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for frames in LENGTHS:
        codes = torch.randint(0, cfg.codebook_size, (2, cfg.num_quantizers, frames), generator=g)
        wav = unclamped(c64, codes)
        assert wav.shape == (2, 1, frames * 1920 - 555), wav.shape
        # Neither silent nor identical across the batch, and some samples inside the clamp.
        assert wav.abs().mean() > 1e-3 and (wav[0] - wav[1]).abs().mean() > 1e-3
        assert (wav.abs() < 1).sum() > 100
        tensors[f"codes_{frames}"] = codes
        tensors[f"wav_{frames}"] = wav.float()
        if frames == F32:
            tensors[f"wav32_{frames}"] = unclamped(c32, codes)
    frames = max(LENGTHS)
    chunked = c64.chunked_decode(tensors[f"codes_{frames}"][:1], chunk_size=CHUNK, left_context_size=LEFT)
    tensors["chunked_wav"] = chunked.float()
    meta = dict(lengths=LENGTHS, float32_length=F32, chunk_size=CHUNK, left_context_size=LEFT,
                chunked_frames=frames, chunked_samples=chunked.shape[-1])
    tiny.save_io("code2wav", tensors, meta)
