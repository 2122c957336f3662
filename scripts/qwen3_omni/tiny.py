"""Tiny random Qwen3-Omni configs and fixture helpers, shared by the fixture scripts.

The reference is Hugging Face transformers 5.24 (`Qwen3OmniMoeForConditionalGeneration`)
on CPU in float32. Every script here writes safetensors under
tests/fixtures/qwen3_omni/<name>/: `model.safetensors` (+ `config.json`) in the
real checkpoint's layout (per-expert tensors, `thinker.` / `talker.` / `code2wav.`
prefixes), and `io.safetensors` with the inputs and the reference outputs.

Run with an environment that has torch and transformers==5.24.0, from the repo root:
    python scripts/qwen3_omni/make_fixtures.py
"""

import json
import os

import torch
from safetensors.torch import save_file
from transformers import Qwen3OmniMoeConfig, Qwen3OmniMoeForConditionalGeneration

ROOT = os.path.join(os.path.dirname(__file__), "..", "..", "tests", "fixtures", "qwen3_omni")

# The tiny Thinker's vocabulary is a real (small) Qwen2-style tokenizer's: a
# byte-level BPE with Qwen's split regex, the chat words ("system", "user",
# "assistant") as single tokens and Qwen3-Omni's special tokens at the end, so the
# whole model can be driven from text through tokenizer.json and its chat
# template, as the real checkpoint is.
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
CHAT_WORDS = ["system", "user", "assistant"]
SPECIALS = [
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|tts_pad|>", "<|tts_bos|>", "<|tts_eos|>",
]
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital of France.",
    "Hello there! How are you today? I'm fine, thanks; it's 12:30 and we'll leave at 3 o'clock.",
    "Speech streams in real time: first audio in 150 ms, exact chunk boundaries, 24 kHz PCM.",
    "Zürich, naïve café — déjà vu. 你好，世界。 こんにちは。",
]
TOKENIZER_DIR = os.path.join(ROOT, "tokenizer")


def build_tokenizer():
    """Trains (deterministically) and saves the tiny tokenizer; returns it."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.add_tokens([AddedToken(w, normalized=False) for w in CHAT_WORDS])
    tok.add_special_tokens(SPECIALS)
    os.makedirs(TOKENIZER_DIR, exist_ok=True)
    tok.save(os.path.join(TOKENIZER_DIR, "tokenizer.json"))
    return tok


_TOK = build_tokenizer()
THINKER_VOCAB = _TOK.get_vocab_size(with_added_tokens=True)
NL = _TOK.token_to_id("Ċ")  # "\n" as a byte-level token
IDS = dict(
    im_start_token_id=_TOK.token_to_id("<|im_start|>"),
    im_end_token_id=_TOK.token_to_id("<|im_end|>"),
    system_token_id=_TOK.token_to_id("system"),
    user_token_id=_TOK.token_to_id("user"),
    assistant_token_id=_TOK.token_to_id("assistant"),
    tts_pad_token_id=_TOK.token_to_id("<|tts_pad|>"),
    tts_bos_token_id=_TOK.token_to_id("<|tts_bos|>"),
    tts_eos_token_id=_TOK.token_to_id("<|tts_eos|>"),
    audio_token_id=_TOK.token_to_id("<|audio_pad|>"),
    image_token_id=_TOK.token_to_id("<|image_pad|>"),
    video_token_id=_TOK.token_to_id("<|video_pad|>"),
    vision_start_token_id=_TOK.token_to_id("<|vision_start|>"),
    audio_start_token_id=_TOK.token_to_id("<|audio_start|>"),
    audio_end_token_id=_TOK.token_to_id("<|audio_end|>"),
)
assert all(v is not None for v in IDS.values()) and NL is not None, IDS
# Plain text ids (below every added token), for scripts that draw random words.
FIRST_ADDED = min(IDS.values())
CODEBOOK = 64
NUM_GROUPS = 4
# The reference suppresses [vocab - 1024, vocab) when sampling code 0, so with
# vocab = 1024 + codebook (as the real 3072 = 1024 + 2048) code 0 is a codebook
# entry or EOS; the codec's special ids sit in the suppressed range, offset as in
# the real model (pad 2148 = 2048 + 100, speakers 2301.. = 2048 + 253..).
TALKER_VOCAB = 1024 + CODEBOOK
CODEC = dict(
    codec_pad_id=CODEBOOK + 100,
    codec_bos_id=CODEBOOK + 101,
    codec_eos_token_id=CODEBOOK + 102,
    codec_nothink_id=CODEBOOK + 107,
    codec_think_bos_id=CODEBOOK + 108,
    codec_think_eos_id=CODEBOOK + 109,
)
SPEAKERS = {"chelsie": CODEBOOK + 253, "ethan": CODEBOOK + 254, "aiden": CODEBOOK + 255}


def tiny_config() -> Qwen3OmniMoeConfig:
    text = dict(
        vocab_size=THINKER_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=32,
        num_experts=8,
        num_experts_per_tok=3,
        norm_topk_prob=True,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[4, 2, 2], interleaved=True, mrope_interleaved=True
        ),
        max_position_embeddings=4096,
    )
    audio = dict(
        num_mel_bins=128,
        encoder_layers=2,
        encoder_attention_heads=4,
        encoder_ffn_dim=64,
        d_model=32,
        output_dim=64,
        downsample_hidden_size=16,
        n_window=50,
        n_window_infer=800,
        conv_chunksize=500,
        max_source_positions=1500,
    )
    vision = dict(
        depth=1,
        hidden_size=32,
        intermediate_size=64,
        num_heads=2,
        out_hidden_size=64,
        patch_size=16,
        spatial_merge_size=2,
        temporal_patch_size=2,
        num_position_embeddings=64,
        deepstack_visual_indexes=[0],
    )
    thinker = dict(
        text_config=text,
        audio_config=audio,
        vision_config=vision,
        position_id_per_seconds=25,
        audio_token_id=IDS["audio_token_id"],
        image_token_id=IDS["image_token_id"],
        video_token_id=IDS["video_token_id"],
        vision_start_token_id=IDS["vision_start_token_id"],
        audio_start_token_id=IDS["audio_start_token_id"],
        user_token_id=IDS["user_token_id"],
    )
    talker_text = dict(
        vocab_size=TALKER_VOCAB,
        hidden_size=48,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        moe_intermediate_size=24,
        shared_expert_intermediate_size=40,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=False,
        rms_norm_eps=1e-6,
        rope_parameters=dict(
            rope_type="default", rope_theta=1e6, mrope_section=[4, 2, 2], interleaved=True, mrope_interleaved=True
        ),
        max_position_embeddings=4096,
    )
    predictor = dict(
        vocab_size=CODEBOOK,
        hidden_size=48,
        intermediate_size=80,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_parameters=dict(rope_type="default", rope_theta=1e6),
        num_code_groups=NUM_GROUPS,
        max_position_embeddings=64,
    )
    talker = dict(
        text_config=talker_text,
        code_predictor_config=predictor,
        num_code_groups=NUM_GROUPS,
        thinker_hidden_size=64,
        accept_hidden_layer=2,
        speaker_id=SPEAKERS,
        spatial_merge_size=2,
        audio_token_id=IDS["audio_token_id"],
        image_token_id=IDS["image_token_id"],
        video_token_id=IDS["video_token_id"],
        vision_start_token_id=IDS["vision_start_token_id"],
        audio_start_token_id=IDS["audio_start_token_id"],
        position_id_per_seconds=25,
        **CODEC,
    )
    code2wav = dict(
        codebook_size=CODEBOOK,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        intermediate_size=48,
        sliding_window=8,
        layer_scale_initial_scale=0.01,
        rms_norm_eps=1e-5,
        num_quantizers=NUM_GROUPS,
        upsample_rates=[8, 5, 4, 3],
        upsampling_ratios=[2, 2],
        decoder_dim=48,
        max_position_embeddings=8000,
        rope_parameters=dict(rope_type="default", rope_theta=10000.0),
    )
    top = {k: v for k, v in IDS.items() if k in (
        "im_start_token_id", "im_end_token_id", "tts_pad_token_id", "tts_bos_token_id", "tts_eos_token_id",
        "system_token_id", "user_token_id", "assistant_token_id")}
    return Qwen3OmniMoeConfig(thinker_config=thinker, talker_config=talker, code2wav_config=code2wav, **top)


def tiny_model(seed: int = 0) -> Qwen3OmniMoeForConditionalGeneration:
    """The whole tiny model with random weights, wider than the default init so
    that errors show (std 0.02 on 64-wide layers makes nearly constant outputs)."""
    torch.manual_seed(seed)
    model = Qwen3OmniMoeForConditionalGeneration(tiny_config()).float().eval()
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed + 1)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or ".norm" in name and name.endswith("weight"):
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "embed" in name and p.dim() == 2:
                # Unit-scale token embeddings (as nn.Embedding's init): with 1/sqrt(d) the
                # residual stream forgets its input and greedy decoding repeats one token.
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p.shape[-1] if p.dim() == 2 else p[0].numel() if "experts" in name else p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / max(fan_in, 1) ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
        # At these widths Code2Wav's decoder gains ~5x per conv: the waveform would
        # peak near 90 (95% clamped) and amplify f32 rounding 1000x. Halving its conv
        # weights gives speech-like levels (peak ~0.4, nothing clamped). Scaled after
        # the walk, so no other component's weights change.
        for name, p in model.code2wav.named_parameters():
            if name.startswith("decoder.") and name.endswith("conv.weight"):
                p.mul_(0.5)
    return model


def out_dir(name: str) -> str:
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    return d


def save_model(model, name: str) -> str:
    """Saves the model as the real checkpoint stores it (transformers reverts its
    fused-expert layout on save) and returns the folder."""
    d = out_dir(name)
    model.save_pretrained(d, safe_serialization=True)
    return d


def save_io(name: str, tensors: dict, meta: dict | None = None) -> None:
    d = out_dir(name)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(d, "io.safetensors"))
    if meta is not None:
        with open(os.path.join(d, "io.json"), "w") as f:
            json.dump(meta, f, indent=1)
