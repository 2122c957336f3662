"""Qwen3-TTS fixtures: the tiny checkpoint (tiny.py) and the reference's outputs.

Run from the repo root with the qwen-tts virtualenv (see tiny.py):
    /work/venvs/qwen-tts/bin/python scripts/qwen3_tts/make_fixtures.py

Writes under tests/fixtures/qwen3_tts/:
  model/                 the checkpoint, laid out as a downloaded one
  model_design/          the same weights as a VoiceDesign checkpoint (its
                         config.json: no preset speakers; the weights and the
                         speech tokenizer are links to model/'s)
  generate/io.safetensors + io.json
      per case c (io.json lists each case's text, speaker, language, instruct,
      non_streaming and x-vector flag):
      {c}.input_ids      the tokenized `<|im_start|>assistant\\n{text}<|im_end|>\\n<|im_start|>assistant\\n`
      {c}.instruct_ids   the tokenized `<|im_start|>user\\n{instruct}<|im_end|>\\n` (when given)
      {c}.prompt         (1, s, hidden): the Talker's prefill inputs `generate` builds
      {c}.trailing       (1, t, hidden): its trailing text vectors
      {c}.codes          (frames, groups) int64: greedy codes (repetition penalty 1.05,
                         as `generate`'s default), up to MAX_FRAMES, EOS excluded
      {c}.logits0        (vocab,) the code-0 logits of the prefill
      {c}.wav            the speech tokenizer's `decode` of those codes
  speaker/io.safetensors: pcm (n,) 24 kHz, mel (1, frames, 128), embedding (hidden,)
  codec/io.safetensors:  codes_{F} (1, groups, F) int64 and wav_{F} (1, 1, F*1920),
      the decoder's waveform before the final clamp, for F in LENGTHS; chunked_{F}
      its `chunked_decode(codes, CHUNK, LEFT)`.
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

MAX_FRAMES = 24
LENGTHS = [1, 5, 20]
CHUNK = 5
LEFT = 3

CASES = [
    dict(name="custom", text="Hello there! How are you today?", speaker="vivian", language="auto",
         instruct=None, non_streaming=True),
    dict(name="custom_stream", text="The quick brown fox jumps over the lazy dog.", speaker="ryan",
         language="english", instruct="Speak happily.", non_streaming=False),
    dict(name="dialect", text="Paris is the capital of France.", speaker="eric", language="auto",
         instruct=None, non_streaming=False),
    dict(name="design", text="What is the capital of France?", speaker=None, language="chinese",
         instruct="A deep, calm voice.", non_streaming=True),
    dict(name="xvector", text="Speech streams in real time.", speaker=None, language="english",
         instruct=None, non_streaming=False, xvector=True),
    # What `omnistream serve` does with a whole text: non-streaming; with a
    # style, and with a cloned voice.
    dict(name="xvector_whole", text="Speech streams in real time.", speaker=None, language="english",
         instruct=None, non_streaming=True, xvector=True),
    dict(name="custom_style", text="The quick brown fox jumps over the lazy dog.", speaker="ryan",
         language="english", instruct="Speak happily.", non_streaming=True),
]


def speech_like(seconds: float, seed: int) -> torch.Tensor:
    """A voiced, syllable-paced test signal in [-1, 1] (no real recordings here)."""
    g = torch.Generator().manual_seed(seed)
    t = torch.arange(int(24000 * seconds), dtype=torch.float64) / 24000
    f0 = 140 + 30 * torch.sin(2 * math.pi * 0.7 * t)
    phase = 2 * math.pi * torch.cumsum(f0, 0) / 24000
    voiced = sum(torch.sin(k * phase) / k for k in range(1, 12))
    envelope = 0.5 * (1 - torch.cos(2 * math.pi * 4 * t)).clamp(min=0)
    noise = 0.05 * torch.randn(t.shape, generator=g, dtype=torch.float64)
    x = 0.3 * voiced * envelope + noise
    return (x / x.abs().max() * 0.8).float()


def main():
    model = tiny.tiny_model()
    tok = tiny.tiny_tokenizer()
    tiny.save_checkpoint(model, tok)
    tiny.save_design_checkpoint(model)
    text_tok = Tokenizer.from_file(tiny.TOKENIZER)

    def ids(s: str) -> torch.Tensor:
        return torch.tensor([text_tok.encode(s, add_special_tokens=False).ids], dtype=torch.long)

    # Speaker encoder.
    pcm = speech_like(2.0, seed=3)
    from qwen_tts.core.models.modeling_qwen3_tts import mel_spectrogram

    mel = mel_spectrogram(pcm.unsqueeze(0), n_fft=1024, num_mels=128, sampling_rate=24000, hop_size=256,
                          win_size=1024, fmin=0, fmax=12000).transpose(1, 2)
    emb = model.extract_speaker_embedding(pcm.numpy(), 24000)
    tiny.save_io("speaker", {"pcm": pcm, "mel": mel, "embedding": emb})

    # The whole generate path, greedy, per case.
    captured = {}
    original = model.talker.generate

    def spy(**kw):
        captured["prompt"] = kw["inputs_embeds"].clone()
        captured["trailing"] = kw["trailing_text_hidden"].clone()
        captured.pop("logits0", None)
        return original(**kw)

    def head(_m, _i, out):
        captured.setdefault("logits0", out[0, -1].clone())

    model.talker.generate = spy
    model.talker.codec_head.register_forward_hook(head)
    tensors, meta = {}, {"max_frames": MAX_FRAMES, "cases": []}
    for case in CASES:
        c = case["name"]
        input_ids = ids(f"<|im_start|>assistant\n{case['text']}<|im_end|>\n<|im_start|>assistant\n")
        instruct_ids = ids(f"<|im_start|>user\n{case['instruct']}<|im_end|>\n") if case["instruct"] else None
        voice_clone_prompt = None
        if case.get("xvector"):
            voice_clone_prompt = dict(ref_code=[None], ref_spk_embedding=[emb], x_vector_only_mode=[True],
                                      icl_mode=[False])
        codes, _ = model.generate(
            input_ids=[input_ids],
            instruct_ids=[instruct_ids],
            voice_clone_prompt=voice_clone_prompt,
            languages=[case["language"]],
            speakers=[case["speaker"]],
            non_streaming_mode=case["non_streaming"],
            max_new_tokens=MAX_FRAMES,
            do_sample=False,
            subtalker_dosample=False,
        )
        codes = codes[0]
        wav = tok.decode(codes.unsqueeze(0), return_dict=True).audio_values[0]
        tensors[f"{c}.input_ids"] = input_ids
        if instruct_ids is not None:
            tensors[f"{c}.instruct_ids"] = instruct_ids
        tensors[f"{c}.prompt"] = captured["prompt"]
        tensors[f"{c}.trailing"] = captured["trailing"]
        tensors[f"{c}.codes"] = codes
        tensors[f"{c}.logits0"] = captured["logits0"]
        tensors[f"{c}.wav"] = wav
        meta["cases"].append({**case, "frames": int(codes.shape[0])})
        print(c, "frames", codes.shape[0], "wav", tuple(wav.shape), "peak", float(wav.abs().max()))
    tiny.save_io("generate", tensors, meta)

    # The codec decoder alone.
    dec = tok.decoder
    g = torch.Generator().manual_seed(7)
    tensors = {}
    for frames in LENGTHS:
        codes = torch.randint(0, tiny.CODEBOOK, (1, tiny.NUM_GROUPS, frames), generator=g)
        captured = []
        hook = dec.decoder[-1].register_forward_hook(lambda _m, _i, out: captured.append(out))
        out = dec(codes)
        hook.remove()
        assert torch.equal(captured[0].clamp(-1, 1), out)
        tensors[f"codes_{frames}"] = codes
        tensors[f"wav_{frames}"] = captured[0]
        tensors[f"chunked_{frames}"] = dec.chunked_decode(codes, CHUNK, LEFT)
        print("codec", frames, tuple(out.shape), "peak", float(captured[0].abs().max()))
    tiny.save_io("codec", tensors, {"lengths": LENGTHS, "chunk": CHUNK, "left": LEFT})


if __name__ == "__main__":
    with torch.no_grad():
        main()
