"""A tiny random Qwen3-TTS-12Hz checkpoint, built from the reference's own classes.

The reference is the `qwen-tts` package (0.1.1, which pins transformers 4.57.3): its
`Qwen3TTSForConditionalGeneration` (Talker, code predictor, speaker encoder) and the
12 Hz speech tokenizer `Qwen3TTSTokenizerV2Model` (Mimi encoder, split-RVQ decoder).
Install it in its own virtualenv, only for these scripts:

    python3 -m venv /work/venvs/qwen-tts && /work/venvs/qwen-tts/bin/pip install qwen-tts==0.1.1

The checkpoint is written as a downloaded one is laid out: `config.json`,
`generation_config.json`, `model.safetensors` and `speech_tokenizer/`
(`config.json`, `model.safetensors`) under tests/fixtures/qwen3_tts/model/. The
text vocabulary is the tiny Qwen2-style tokenizer of tests/fixtures/qwen3_omni/tokenizer
(it has `<|tts_pad|>`, `<|tts_bos|>`, `<|tts_eos|>`), so the whole model can be
driven from text as the released one is.
"""

import json
import os

import torch
from safetensors.torch import save_file

from qwen_tts.core.models import Qwen3TTSConfig, Qwen3TTSForConditionalGeneration
from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config
from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..", "tests", "fixtures", "qwen3_tts")
TOKENIZER = os.path.join(HERE, "..", "..", "tests", "fixtures", "qwen3_omni", "tokenizer", "tokenizer.json")

with open(TOKENIZER) as f:
    _ADDED = {t["content"]: t["id"] for t in json.load(f)["added_tokens"]}
TEXT_VOCAB = max(_ADDED.values()) + 1
IDS = dict(
    im_start_token_id=_ADDED["<|im_start|>"],
    im_end_token_id=_ADDED["<|im_end|>"],
    tts_pad_token_id=_ADDED["<|tts_pad|>"],
    tts_bos_token_id=_ADDED["<|tts_bos|>"],
    tts_eos_token_id=_ADDED["<|tts_eos|>"],
)
CODEBOOK = 64
NUM_GROUPS = 4
# As the released 3072 = 1024 + 2048: code 0 is a codebook entry, or EOS, and the
# codec's special ids sit in the suppressed [vocab - 1024, vocab).
TALKER_VOCAB = 1024 + CODEBOOK
CODEC = dict(
    codec_pad_id=CODEBOOK + 100,
    codec_bos_id=CODEBOOK + 101,
    codec_eos_token_id=CODEBOOK + 102,
    codec_think_id=CODEBOOK + 106,
    codec_nothink_id=CODEBOOK + 107,
    codec_think_bos_id=CODEBOOK + 108,
    codec_think_eos_id=CODEBOOK + 109,
)
SPEAKERS = {"vivian": CODEBOOK + 250, "ryan": CODEBOOK + 251, "eric": CODEBOOK + 252}
DIALECT = {"vivian": False, "ryan": False, "eric": "sichuan_dialect"}
LANGUAGES = {"english": CODEBOOK + 200, "chinese": CODEBOOK + 201, "sichuan_dialect": CODEBOOK + 202}
TALKER_HIDDEN = 48
ENCODER_VQ_DIM = 48


def tiny_config(model_type: str = "base") -> Qwen3TTSConfig:
    predictor = dict(
        vocab_size=CODEBOOK,
        # Narrower than the Talker, as in the 1.7B (2048 -> 1024): exercises
        # `small_to_mtp_projection`.
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        num_code_groups=NUM_GROUPS,
        max_position_embeddings=64,
    )
    talker = dict(
        code_predictor_config=predictor,
        vocab_size=TALKER_VOCAB,
        hidden_size=TALKER_HIDDEN,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=1e6,
        rope_scaling=dict(rope_type="default", mrope_section=[4, 2, 2], interleaved=True),
        max_position_embeddings=4096,
        num_code_groups=NUM_GROUPS,
        text_hidden_size=40,
        text_vocab_size=TEXT_VOCAB,
        spk_id=SPEAKERS,
        spk_is_dialect=DIALECT,
        codec_language_id=LANGUAGES,
        **CODEC,
    )
    speaker = dict(
        mel_dim=128,
        enc_dim=TALKER_HIDDEN,
        enc_channels=[32, 32, 32, 32, 96],
        enc_kernel_sizes=[5, 3, 3, 3, 1],
        enc_dilations=[1, 2, 3, 4, 1],
        enc_attention_channels=16,
        enc_res2net_scale=4,
        enc_se_channels=16,
        sample_rate=24000,
    )
    return Qwen3TTSConfig(
        talker_config=talker,
        speaker_encoder_config=speaker,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size="tiny",
        tts_model_type=model_type,
        **IDS,
    )


def tokenizer_config() -> Qwen3TTSTokenizerV2Config:
    decoder = dict(
        codebook_size=CODEBOOK,
        codebook_dim=32,
        hidden_size=32,
        latent_dim=48,
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
        rope_theta=10000.0,
    )
    encoder = dict(
        sampling_rate=24000,
        frame_rate=12.5,
        audio_channels=1,
        hidden_size=32,
        num_filters=4,
        num_residual_layers=1,
        upsampling_ratios=[8, 6, 5, 4],
        kernel_size=7,
        last_kernel_size=3,
        residual_kernel_size=3,
        dilation_growth_rate=2,
        use_causal_conv=True,
        pad_mode="constant",
        compress=2,
        trim_right_ratio=1.0,
        codebook_size=CODEBOOK,
        # As the released encoder (hidden 512, codebooks of 256, 32 quantizers of
        # which 16 are used): the quantizers work in their own width behind
        # input_proj, and there are more of them than the Talker takes.
        codebook_dim=ENCODER_VQ_DIM,
        vector_quantization_hidden_dimension=ENCODER_VQ_DIM,
        num_quantizers=2 * NUM_GROUPS,
        num_semantic_quantizers=1,
        upsample_groups=32,
        num_hidden_layers=2,
        intermediate_size=64,
        num_attention_heads=4,
        num_key_value_heads=4,
        head_dim=8,
        # Not applied by the reference (its eager and sdpa attention are plain
        # causal); the fixture clips run past it to show that.
        sliding_window=16,
        max_position_embeddings=8000,
        rope_theta=10000.0,
        layer_scale_initial_scale=0.01,
        use_cache=False,
    )
    return Qwen3TTSTokenizerV2Config(
        encoder_config=encoder,
        decoder_config=decoder,
        encoder_valid_num_quantizers=NUM_GROUPS,
    )


def _randomize(module: torch.nn.Module, g: torch.Generator) -> None:
    """Wider than the default init so that errors show (std 0.02 on 48-wide layers
    makes nearly constant outputs)."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name and name.endswith("weight") and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=g))
            elif "cluster_usage" in name:
                p.copy_(1.0 + torch.rand(p.shape, generator=g))
            elif ("embed" in name or "embedding_sum" in name) and p.dim() == 2:
                p.copy_(torch.randn(p.shape, generator=g))
            elif p.dim() >= 2:
                fan_in = p[0].numel()
                p.copy_(torch.randn(p.shape, generator=g) / max(fan_in, 1) ** 0.5)
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))


def tiny_model(seed: int = 0, model_type: str = "base") -> Qwen3TTSForConditionalGeneration:
    torch.manual_seed(seed)
    cfg = tiny_config(model_type)
    cfg._attn_implementation = "eager"
    cfg.talker_config._attn_implementation = "eager"
    cfg.talker_config.code_predictor_config._attn_implementation = "eager"
    model = Qwen3TTSForConditionalGeneration(cfg).float().eval()
    _randomize(model, torch.Generator().manual_seed(seed + 1))
    return model


def tiny_tokenizer(seed: int = 10) -> Qwen3TTSTokenizerV2Model:
    torch.manual_seed(seed)
    cfg = tokenizer_config()
    cfg._attn_implementation = "eager"
    cfg.decoder_config._attn_implementation = "eager"
    cfg.encoder_config._attn_implementation = "eager"
    tok = Qwen3TTSTokenizerV2Model(cfg).float().eval()
    g = torch.Generator().manual_seed(seed + 1)
    _randomize(tok, g)
    # The encoder's codebooks are buffers (`embed_sum`, `cluster_usage`), which
    # `_randomize` leaves at zeros and ones: every code would be 0. Drawn at about
    # the width of what they quantize (input_proj's outputs, std ~0.5 here).
    with torch.no_grad():
        for name, b in tok.encoder.quantizer.named_buffers():
            if name.endswith("embed_sum"):
                b.copy_(0.6 * torch.randn(b.shape, generator=g))
            elif name.endswith("cluster_usage"):
                b.copy_(1.0 + torch.rand(b.shape, generator=g))
    # As for Qwen3-Omni's tiny Code2Wav: at these widths the decoder gains ~1.5x
    # per conv and the waveform would peak near 50 (mostly clamped). Scaling its
    # convs by 0.7 gives speech-like levels (peak ~0.3, nothing clamped).
    with torch.no_grad():
        for name, p in tok.decoder.named_parameters():
            if name.startswith("decoder.") and name.endswith("conv.weight"):
                p.mul_(0.7)
    return tok


def out_dir(name: str) -> str:
    d = os.path.join(ROOT, name)
    os.makedirs(d, exist_ok=True)
    return d


def save_checkpoint(model, tok) -> str:
    """Writes the checkpoint folder as a downloaded one is laid out."""
    d = out_dir("model")
    model.config.save_pretrained(d)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, os.path.join(d, "model.safetensors"))
    gen = dict(
        do_sample=True, top_k=50, top_p=1.0, temperature=0.9, repetition_penalty=1.05,
        subtalker_dosample=True, subtalker_top_k=50, subtalker_top_p=1.0, subtalker_temperature=0.9,
        max_new_tokens=8192,
    )
    with open(os.path.join(d, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    st = os.path.join(d, "speech_tokenizer")
    os.makedirs(st, exist_ok=True)
    tok.config.save_pretrained(st)
    save_file({k: v.contiguous() for k, v in tok.state_dict().items()}, os.path.join(st, "model.safetensors"))
    return d


def _variant_checkpoint(model, name: str, model_type: str | None) -> str:
    """model/ under another config: no preset speakers (and `model_type` if
    given); the weights, generation config and speech tokenizer are links to
    model/'s."""
    d = out_dir(name)
    cfg = model.config.to_dict()
    if model_type is not None:
        cfg["tts_model_type"] = model_type
    cfg["talker_config"]["spk_id"] = {}
    cfg["talker_config"]["spk_is_dialect"] = {}
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2, sort_keys=True)
    for file in ["model.safetensors", "generation_config.json", "speech_tokenizer"]:
        link = os.path.join(d, file)
        if not os.path.lexists(link):
            os.symlink(os.path.join("..", "model", file), link)
    return d


def save_design_checkpoint(model) -> str:
    """model/ as a VoiceDesign checkpoint: its config says so and lists no
    preset speakers; the prompt of a described voice uses no other weights."""
    return _variant_checkpoint(model, "model_design", "voice_design")


def save_base_checkpoint(model) -> str:
    """model/ as the released Base checkpoints are: no preset speakers, so it
    speaks only voices cloned from a clip."""
    return _variant_checkpoint(model, "model_base", None)


def save_io(name: str, tensors: dict, meta: dict | None = None) -> None:
    d = out_dir(name)
    tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
    save_file(tensors, os.path.join(d, "io.safetensors"))
    if meta is not None:
        with open(os.path.join(d, "io.json"), "w") as f:
            json.dump(meta, f, indent=1)
