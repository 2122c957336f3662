"""Fixtures of the Thinker's audio encoder (`model.thinker.audio_tower`) and its
log-mel front end (the processor's WhisperFeatureExtractor).

Writes tests/fixtures/qwen3_omni/audio_encoder/io.safetensors:
- pcm_{i}: raw 16 kHz f32 PCM of three synthetic utterances (chirps + harmonics +
  seeded noise), lengths deliberately not multiples of the 160-sample hop;
- mel_{i}: the reference log-mel (128, frames) of each utterance processed alone,
  exactly as Qwen3OmniMoeProcessor calls the feature extractor;
- out_{i}: the encoder output of each utterance alone (get_audio_features with
  its feature_attention_mask);
- out_batch: the three utterances in one batch (features right-padded to the
  longest, feature_attention_mask, as get_audio_features is called);
- out_{i}_infer200 / out_batch_infer200: the same with n_window_infer = 200 so
  that attention is split into several cu_seqlens blocks inside an utterance
  (the tiny config's 800 would need > 8 s of audio);
- len_in / len_out: `_get_feat_extract_output_lengths` for 1..1200 frames.
io.json has the lengths and the observations about batching.
"""

import numpy as np
import torch
from transformers import WhisperFeatureExtractor
from transformers.models.qwen3_omni_moe.modeling_qwen3_omni_moe import _get_feat_extract_output_lengths

import tiny

SR = 16000
# 0.70 s, 1.30 s and 2.30 s plus a few samples: one chunk (< n_window * 2 = 100
# frames), two chunks, three chunks.
LENGTHS = [11213, 20857, 36871]

# The released checkpoint's preprocessor_config.json (Qwen3-Omni-30B-A3B-Instruct).
FE_CONFIG = dict(
    feature_size=128,
    sampling_rate=SR,
    hop_length=160,
    chunk_length=300,
    n_fft=400,
    padding_value=0.0,
    dither=0.0,
    return_attention_mask=True,
)
# Qwen3OmniMoeProcessor.audio_kwargs
PROC_KWARGS = dict(sampling_rate=SR, padding=True, truncation=False, return_attention_mask=True)


def synth(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    t = np.arange(n) / SR
    dur = n / SR
    f0, f1 = rng.uniform(100, 400), rng.uniform(2000, 6000)
    phase = 2 * np.pi * (f0 * t + (f1 - f0) * t**2 / (2 * dur))
    x = 0.3 * np.sin(phase) + 0.1 * np.sin(3 * phase + 0.5) + 0.05 * np.sin(2 * np.pi * 7000 * t * (1 - t / (2 * dur)))
    env = 0.6 + 0.4 * np.sin(2 * np.pi * rng.uniform(2, 5) * t)
    x = env * x + 0.02 * rng.standard_normal(n)
    return x.astype(np.float32)


def features(fe, audios):
    inputs = fe(audios, return_tensors="pt", **PROC_KWARGS)
    return inputs["input_features"], inputs["attention_mask"]


def make(model, out_dir):
    thinker = model.thinker
    tower = thinker.model.audio_tower
    fe = WhisperFeatureExtractor(**FE_CONFIG)
    audios = [synth(n, seed=10 + i) for i, n in enumerate(LENGTHS)]
    tensors, meta = {}, {"lengths_samples": LENGTHS}

    def run(feats, mask):
        return thinker.model.get_audio_features(feats, feature_attention_mask=mask).last_hidden_state

    mels, masks = [], []
    for i, a in enumerate(audios):
        feats, mask = features(fe, [a])
        assert mask.all()
        mels.append(feats[0])
        masks.append(mask)
        tensors[f"pcm_{i}"] = torch.from_numpy(a)
        tensors[f"mel_{i}"] = feats[0].float()
        tensors[f"out_{i}"] = run(feats, mask)
    meta["frames"] = [m.shape[1] for m in mels]
    meta["tokens"] = [tensors[f"out_{i}"].shape[0] for i in range(len(audios))]

    # The batch path of get_audio_features: features right-padded to the longest,
    # with the mask selecting the real frames. Built from the single-utterance
    # features so the encoder's own batching is what is tested.
    tmax = max(meta["frames"])
    batch = torch.zeros(len(mels), 128, tmax)
    bmask = torch.zeros(len(mels), tmax, dtype=torch.long)
    for i, m in enumerate(mels):
        batch[i, :, : m.shape[1]] = m
        bmask[i, : m.shape[1]] = 1
    tensors["out_batch"] = run(batch, bmask)

    # Smaller attention windows (the encoder reads n_window_infer at forward time).
    saved = tower.n_window_infer
    tower.n_window_infer = 200
    for i, m in enumerate(mels):
        tensors[f"out_{i}_infer200"] = run(m[None], masks[i])
    tensors["out_batch_infer200"] = run(batch, bmask)
    tower.n_window_infer = saved

    # Observations (reported, not asserted by the Rust tests): how far the batch
    # result of each utterance is from the same utterance alone, in the encoder
    # and in the feature extractor (whose batch padding changes boundary frames
    # and, for lengths not a multiple of the hop, adds a frame).
    offs = np.cumsum([0] + meta["tokens"])
    meta["encoder_batch_vs_alone_max_abs"] = [
        float((tensors["out_batch"][offs[i] : offs[i + 1]] - tensors[f"out_{i}"]).abs().max())
        for i in range(len(audios))
    ]
    bf, bm = features(fe, audios)
    meta["fe_batch_frames"] = bm.sum(-1).tolist()
    meta["fe_batch_vs_alone_max_abs"] = [
        float((bf[i, :, : mels[i].shape[1]] - mels[i]).abs().max()) for i in range(len(audios))
    ]

    lens = torch.arange(1, 1201)
    tensors["len_in"] = lens
    tensors["len_out"] = _get_feat_extract_output_lengths(lens, tower.n_window)
    tiny.save_io("audio_encoder", tensors, meta)
