"""Qwen3-TTS fixtures: the tiny checkpoint (tiny.py) and the reference's outputs.

Run from the repo root with the qwen-tts virtualenv (see tiny.py):
    /work/venvs/qwen-tts/bin/python scripts/qwen3_tts/make_fixtures.py

Writes under tests/fixtures/qwen3_tts/:
  model/                 the checkpoint, laid out as a downloaded one
  model_design/          the same weights as a VoiceDesign checkpoint (its
                         config.json: no preset speakers; the weights and the
                         speech tokenizer are links to model/'s)
  model_base/            the same as a Base checkpoint without preset speakers,
                         as the released ones are (links likewise)
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
  encoder/io.safetensors: per clip of n samples in CLIPS (io.json lists them):
      pcm16_{n}          (n,) int16: the clip as 16-bit PCM (the encoder sees pcm16 / 32768)
      codes_{n}          (ceil(n / 1920), groups) int64: the speech tokenizer's `encode`
  icl/io.safetensors + io.json: in-context voice cloning (`generate` with
      `voice_clone_prompt`'s icl_mode, as `generate_voice_clone` calls it), per case c
      (io.json: text, ref_text, ref_clip (an encoder clip), language, non_streaming;
      ref_frames, frames and the waveform's cut):
      {c}.input_ids, {c}.prompt, {c}.trailing, {c}.codes, {c}.logits0  as for generate/
      {c}.ref_ids        the tokenized `<|im_start|>assistant\n{ref_text}<|im_end|>\n`
      {c}.xvector        (hidden,) the speaker encoder's x-vector of the ref clip
      {c}.wav            `generate_voice_clone`'s waveform: the decode of the ref codes
                         followed by the generated ones, the ref's share cut off
"""

import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import tiny  # noqa: E402

from tokenizers import Tokenizer  # noqa: E402

MAX_FRAMES = 24
# In-context cases stop sooner: their waveforms are the bulk of the fixture.
ICL_MAX_FRAMES = 12
# Encoder clips, in samples: 0.5 s, 1.17 s (not a whole number of 1920-sample
# frames) and 3 s (75 encoder steps: past the tiny transformer's sliding_window
# of 16, which the reference's eager/sdpa attention does not apply).
CLIPS = [12000, 28000, 72000]
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

# In-context cloning (Base): a reference clip's codes and transcript before the text.
ICL_CASES = [
    # The ref's 7 frames are fewer than the ref and target text tokens: the rest of
    # the text trails, one token a frame.
    dict(name="icl_stream", text="The quick brown fox jumps over the lazy dog.", ref_text="Hi there.",
         ref_clip=12000, language="english", non_streaming=False),
    # 38 frames outnumber the text: the text side is padded, nothing trails.
    dict(name="icl_stream_long_ref", text="Speech streams in real time.",
         ref_text="This is how I sound on a good day.", ref_clip=72000, language="auto",
         non_streaming=False),
    # Whole text. 15 ref frames of 26: the reference's float cut, int(15 / 26 * 26 * 1920),
    # is 28799, one sample short of the ref's 28800.
    dict(name="icl_whole", text="Paris is the capital of France.", ref_text="A short reference clip.",
         ref_clip=28000, language="english", non_streaming=True),
]


def speech_like(seconds: float, seed: int, samples: int | None = None) -> torch.Tensor:
    """A voiced, syllable-paced test signal in [-1, 1] (no real recordings here)."""
    g = torch.Generator().manual_seed(seed)
    n = samples if samples is not None else int(24000 * seconds)
    t = torch.arange(n, dtype=torch.float64) / 24000
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
    tiny.save_base_checkpoint(model)
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
        last = []
        hook = dec.decoder[-1].register_forward_hook(lambda _m, _i, out: last.append(out))
        out = dec(codes)
        hook.remove()
        assert torch.equal(last[0].clamp(-1, 1), out)
        tensors[f"codes_{frames}"] = codes
        tensors[f"wav_{frames}"] = last[0]
        tensors[f"chunked_{frames}"] = dec.chunked_decode(codes, CHUNK, LEFT)
        print("codec", frames, tuple(out.shape), "peak", float(last[0].abs().max()))
    tiny.save_io("codec", tensors, {"lengths": LENGTHS, "chunk": CHUNK, "left": LEFT})

    # The codec encoder: 16-bit clips (stored at half the size; exact in f32) to codes.
    tensors, clips = {}, {}
    for i, n in enumerate(CLIPS):
        pcm16 = (speech_like(0, seed=20 + i, samples=n) * 32767).round().to(torch.int16)
        pcm = pcm16.float() / 32768
        codes = tok.encode(pcm.unsqueeze(0), padding_mask=torch.ones(1, n, dtype=torch.long)).audio_codes[0]
        assert codes.shape == (math.ceil(n / 1920), tiny.NUM_GROUPS), codes.shape
        tensors[f"pcm16_{n}"] = pcm16
        tensors[f"codes_{n}"] = codes
        clips[n] = (pcm, codes)
        print("encoder", n, tuple(codes.shape), "distinct codes per quantizer",
              [len(set(c.tolist())) for c in codes.T])
    tiny.save_io("encoder", tensors, {"clips": CLIPS})

    # In-context cloning: ref codes from the encoder, the x-vector from the same clip.
    tensors, meta = {}, {"max_frames": ICL_MAX_FRAMES, "cases": []}
    for case in ICL_CASES:
        c = case["name"]
        pcm, ref_code = clips[case["ref_clip"]]
        xvector = model.extract_speaker_embedding(pcm.numpy(), 24000)
        input_ids = ids(f"<|im_start|>assistant\n{case['text']}<|im_end|>\n<|im_start|>assistant\n")
        ref_ids = ids(f"<|im_start|>assistant\n{case['ref_text']}<|im_end|>\n")
        codes, _ = model.generate(
            input_ids=[input_ids],
            ref_ids=[ref_ids],
            voice_clone_prompt=dict(ref_code=[ref_code], ref_spk_embedding=[xvector],
                                    x_vector_only_mode=[False], icl_mode=[True]),
            languages=[case["language"]],
            non_streaming_mode=case["non_streaming"],
            max_new_tokens=ICL_MAX_FRAMES,
            do_sample=False,
            subtalker_dosample=False,
        )
        codes = codes[0]
        # As generate_voice_clone: decode ref + new codes, cut the ref's share.
        total = torch.cat([ref_code, codes], dim=0)
        wav = tok.decode(total.unsqueeze(0), return_dict=True).audio_values[0]
        ref_len, total_len = ref_code.shape[0], total.shape[0]
        cut = int(ref_len / max(total_len, 1) * wav.shape[0])
        tensors[f"{c}.input_ids"] = input_ids
        tensors[f"{c}.ref_ids"] = ref_ids
        tensors[f"{c}.xvector"] = xvector
        tensors[f"{c}.prompt"] = captured["prompt"]
        tensors[f"{c}.trailing"] = captured["trailing"]
        tensors[f"{c}.codes"] = codes
        tensors[f"{c}.logits0"] = captured["logits0"]
        tensors[f"{c}.wav"] = wav[cut:]
        meta["cases"].append({**case, "ref_frames": ref_len, "frames": int(codes.shape[0]),
                              "samples": int(wav.shape[0]), "cut": cut})
        print(c, "ref", ref_len, "frames", codes.shape[0], "prompt", tuple(captured["prompt"].shape),
              "trailing", tuple(captured["trailing"].shape), "cut", cut, "of the ref's", ref_len * 1920)
    tiny.save_io("icl", tensors, meta)


if __name__ == "__main__":
    with torch.no_grad():
        main()
