"""End-to-end reference: the whole tiny model's `generate` (Thinker -> Talker with
code predictor -> Code2Wav), sampling off everywhere, one request at a time
(the reference takes one speaker per call), text-only and spoken prompts.

Per case `c{i}_*`: input_ids, the Thinker's sequences, the Talker's codes
(batch, groups, frames) as handed to Code2Wav, and the waveform. The spoken
case also stores the 16 kHz PCM and the reference's log-mel features."""

import numpy as np
import torch
from transformers import AutoTokenizer, WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

import tiny

I = tiny.IDS
AUDIO = "<|audio_start|><|audio_pad|><|audio_end|>"


def chat_ids(hf, messages, n_audio=0):
    """The chat template's prompt, the audio placeholder expanded to `n_audio`
    tokens as the processor does."""
    text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = hf(text, add_special_tokens=False)["input_ids"]
    out = []
    for t in ids:
        out += [t] * n_audio if t == I["audio_token_id"] else [t]
    return out


def speech(seconds, seed):
    g = np.random.default_rng(seed)
    t = np.arange(int(16000 * seconds)) / 16000
    f = 180 + 120 * np.sin(2 * np.pi * 1.3 * t)
    x = 0.3 * np.sin(2 * np.pi * np.cumsum(f) / 16000) + 0.05 * g.standard_normal(t.size)
    return x.astype(np.float32)


def make(model, out):
    hf = AutoTokenizer.from_pretrained(tiny.TOKENIZER_DIR)
    fe = WhisperFeatureExtractor(feature_size=128, sampling_rate=16000)
    pcm = speech(1.3, 3)
    feats = fe(pcm, sampling_rate=16000, padding=True, truncation=False, return_attention_mask=True, return_tensors="pt")
    n_audio = int(_get_feat_extract_output_lengths(feats["attention_mask"].sum(-1), 50)[0])
    conversations = [
        ("ethan", [{"role": "system", "content": "You speak briefly."},
                   {"role": "user", "content": "What is the capital of France?"}], None),
        ("chelsie", [{"role": "user", "content": "Hello there! How are you today?"}], None),
        ("aiden", [{"role": "user", "content": AUDIO}], feats),
    ]
    cases = [(spk, chat_ids(hf, msgs, n_audio if f is not None else 0), f, msgs) for spk, msgs, f in conversations]
    tensors, meta = {}, {"cases": []}
    for i, (speaker, ids, feats, messages) in enumerate(cases):
        input_ids = torch.tensor([ids])
        captured = {}
        decode = model.code2wav.chunked_decode

        def capture(codes, **kw):
            captured["codes"] = codes.clone()
            return decode(codes, **kw)

        model.code2wav.chunked_decode = capture
        extra = {}
        if feats is not None:
            extra = dict(input_features=feats["input_features"], feature_attention_mask=feats["attention_mask"])
        seqs, wav = model.generate(
            input_ids=input_ids,
            speaker=speaker,
            thinker_max_new_tokens=32,
            thinker_do_sample=False,
            thinker_eos_token_id=I["im_end_token_id"],
            talker_do_sample=False,
            talker_max_new_tokens=33,
            **extra,
        )
        model.code2wav.chunked_decode = decode
        p = f"c{i}_"
        tensors[p + "input_ids"] = input_ids
        tensors[p + "sequences"] = seqs
        tensors[p + "codes"] = captured["codes"]
        tensors[p + "wav"] = wav.reshape(-1).float()
        if feats is not None:
            tensors[p + "pcm"] = torch.from_numpy(pcm)
            tensors[p + "input_features"] = feats["input_features"][0]
        meta["cases"].append({"speaker": speaker, "messages": messages, "audio_tokens": n_audio if feats is not None else 0,
                              "frames": int(captured["codes"].shape[-1]), "new_tokens": int(seqs.shape[1] - len(ids))})
        print(speaker, "new tokens", seqs.shape[1] - len(ids), "frames", captured["codes"].shape[-1], "wav", wav.shape)
    tiny.save_io("generate", tensors, meta)
