"""The config files of the six released Qwen3-TTS-12Hz checkpoints, and their check.

The released repositories (Qwen/Qwen3-TTS-12Hz-{1.7B,0.6B}-{CustomVoice,VoiceDesign,Base}
and the speech tokenizer Qwen/Qwen3-TTS-Tokenizer-12Hz, copied into every
checkpoint's `speech_tokenizer/`) cannot be downloaded here, so their
`config.json`, `generation_config.json` and `speech_tokenizer/config.json` are
written from the tables below (every value says where it came from; see
deploy/qwen3_tts_released/README.md) and serialized as the reference writes them
(qwen-tts 0.1.1's config classes under transformers 4.57.3, keys sorted, indent 2).

    # rewrite deploy/qwen3_tts_released/ from the tables
    /work/venvs/qwen-tts/bin/python scripts/qwen3_tts/released_configs.py --write
    # check it (the default): the files equal the tables; the reference loads them
    # (from_pretrained, and Qwen3TTSConfig(**json) as scripts/qwen3_tts/ref_bench.py does);
    # the models built from them on torch's meta device have the released parameter
    # counts; and the Rust loader (stages/src/models/qwen3_tts/config.rs and the
    # structs it flattens) finds every key it requires, with the right JSON type.
    /work/venvs/qwen-tts/bin/python scripts/qwen3_tts/released_configs.py

Exit status 0 only when every check passes. The Rust check reads the serde structs
from the .rs files each run, so it follows edits to them.
"""

import argparse
import copy
import json
import os
import re
import sys
import types

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
OUT = os.path.join(ROOT, "deploy", "qwen3_tts_released")

# ---------------------------------------------------------------------------
# The tables. "S:" = sourced (README lists the sources), "I:" = inferred.
# ---------------------------------------------------------------------------

# S: token ids of the Qwen2 text vocabulary (<|im_start|>, <|im_end|>, "assistant",
# <|tts_pad|>, <|tts_bos|>, <|tts_eos|>); equal to the reference class defaults too.
TOP_IDS = dict(
    assistant_token_id=77091,
    im_start_token_id=151644,
    im_end_token_id=151645,
    tts_pad_token_id=151671,
    tts_bos_token_id=151672,
    tts_eos_token_id=151673,
)

# S: the codec control ids (the class defaults 4196..4205 are NOT the released ones).
CODEC_IDS = dict(
    codec_pad_id=2148,
    codec_bos_id=2149,
    codec_eos_token_id=2150,
    codec_think_id=2154,
    codec_nothink_id=2155,
    codec_think_bos_id=2156,
    codec_think_eos_id=2157,
)

# S: codec_language_id, in the released files' order (CustomVoice adds the two dialects).
LANGUAGES = {
    "chinese": 2055,
    "english": 2050,
    "german": 2053,
    "italian": 2070,
    "portuguese": 2071,
    "spanish": 2054,
    "japanese": 2058,
    "korean": 2064,
    "french": 2061,
    "russian": 2069,
}
DIALECTS = {"beijing_dialect": 2074, "sichuan_dialect": 2062}

# S: the nine preset speakers (CustomVoice), plain ints, in the released order.
SPEAKERS = {
    "serena": 3066,
    "vivian": 3065,
    "uncle_fu": 3010,
    "ryan": 3061,
    "aiden": 2861,
    "ono_anna": 2873,
    "sohee": 2864,
    "eric": 2875,
    "dylan": 2878,
}
# S (and required by the reference: it indexes spk_is_dialect[speaker] for every
# preset speaker when the language is Chinese or auto).
SPEAKER_DIALECT = {
    "serena": False,
    "vivian": False,
    "uncle_fu": False,
    "ryan": False,
    "aiden": False,
    "ono_anna": False,
    "sohee": False,
    "eric": "sichuan_dialect",
    "dylan": "beijing_dialect",
}

# S: the code predictor (same in 0.6B and 1.7B). rope_scaling null: plain 1-D RoPE.
# I: initializer_range/attention_dropout/max_window_layers/use_sliding_window are the
# class defaults (no effect on shapes or inference).
CODE_PREDICTOR = dict(
    vocab_size=2048,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=5,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    hidden_act="silu",
    max_position_embeddings=65536,
    initializer_range=0.02,
    rms_norm_eps=1e-6,
    use_cache=True,
    tie_word_embeddings=False,
    rope_theta=1000000,
    rope_scaling=None,
    attention_bias=False,
    use_sliding_window=False,
    max_window_layers=28,
    attention_dropout=0,
    num_code_groups=16,
)


def talker(size: str) -> dict:
    """Qwen3TTSTalkerConfig's fields for a model size ("1b7" or "0b6")."""
    # S: hidden 2048/1024, intermediate 6144/3072 (the 1.7B's 6144 is also the
    # released talker.model.layers.*.mlp.gate_proj shape [6144, 2048]).
    hidden, inter = {"1b7": (2048, 6144), "0b6": (1024, 3072)}[size]
    return dict(
        code_predictor_config=copy.deepcopy(CODE_PREDICTOR),
        vocab_size=3072,  # S
        hidden_size=hidden,
        intermediate_size=inter,
        num_hidden_layers=28,  # S
        num_attention_heads=16,  # S
        num_key_value_heads=8,  # S
        head_dim=128,  # S
        hidden_act="silu",  # S
        max_position_embeddings=32768,  # S
        initializer_range=0.02,  # I: class default
        rms_norm_eps=1e-6,  # S
        use_cache=True,  # I: class default
        tie_word_embeddings=False,  # I: class default (codec_head is its own tensor)
        rope_theta=1000000,  # S
        # S: interleaved MRoPE; "rope_type" only (see README on the legacy "type").
        rope_scaling={"interleaved": True, "mrope_section": [24, 20, 20], "rope_type": "default"},
        attention_bias=False,  # S
        use_sliding_window=False,  # I: class default
        attention_dropout=0,  # I: class default
        num_code_groups=16,  # S
        text_hidden_size=2048,  # S
        text_vocab_size=151936,  # S
        position_id_per_seconds=13,  # S (not read by qwen-tts 0.1.1)
        **CODEC_IDS,
    )


# (folder, tts_model_size, tts_model_type)
VARIANTS = [
    ("1.7b-customvoice", "1b7", "custom_voice"),
    ("1.7b-voicedesign", "1b7", "voice_design"),
    ("1.7b-base", "1b7", "base"),
    ("0.6b-customvoice", "0b6", "custom_voice"),
    ("0.6b-base", "0b6", "base"),
]
HF_REPO = {
    "1.7b-customvoice": "Qwen/Qwen3-TTS-12Hz-1.7B-CustomVoice",
    "1.7b-voicedesign": "Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign",
    "1.7b-base": "Qwen/Qwen3-TTS-12Hz-1.7B-Base",
    "0.6b-customvoice": "Qwen/Qwen3-TTS-12Hz-0.6B-CustomVoice",
    "0.6b-base": "Qwen/Qwen3-TTS-12Hz-0.6B-Base",
}

# S: generation_config.json, in the released order, indent 2, no final newline
# (that gives the released file's 245 bytes). qwen-tts reads it (required:
# Qwen3TTSForConditionalGeneration.from_pretrained opens it) as generate() defaults.
GENERATION = {
    "do_sample": True,
    "repetition_penalty": 1.05,
    "temperature": 0.9,
    "top_p": 1.0,
    "top_k": 50,
    "subtalker_dosample": True,
    "subtalker_temperature": 0.9,
    "subtalker_top_p": 1.0,
    "subtalker_top_k": 50,
    "max_new_tokens": 8192,
}

# The speech tokenizer (Qwen/Qwen3-TTS-Tokenizer-12Hz). S: every shape-bearing value.
# The encoder is a stock transformers MimiConfig (the kyutai/mimi values).
TOKENIZER_ENCODER = dict(
    frame_rate=12.5,  # S (serialized as "_frame_rate")
    sampling_rate=24000,
    audio_channels=1,
    hidden_size=512,
    num_filters=64,
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
    codebook_size=2048,
    codebook_dim=256,
    num_quantizers=32,
    use_conv_shortcut=False,
    vector_quantization_hidden_dimension=256,
    num_semantic_quantizers=1,
    upsample_groups=512,
    num_hidden_layers=8,
    intermediate_size=2048,
    num_attention_heads=8,
    num_key_value_heads=8,
    head_dim=64,
    hidden_act="gelu",
    max_position_embeddings=8000,
    initializer_range=0.02,
    norm_eps=1e-5,
    use_cache=False,  # I: MimiConfig default
    use_streaming=False,  # I: MimiConfig default
    rope_theta=10000.0,
    sliding_window=250,
    attention_dropout=0.0,
    layer_scale_initial_scale=0.01,
    attention_bias=False,
)
TOKENIZER_DECODER = dict(
    codebook_size=2048,
    codebook_dim=512,  # S: not a class default; the decoder reads it (split RVQ, pre_conv)
    hidden_size=512,
    latent_dim=1024,
    intermediate_size=1024,
    head_dim=64,  # S: not a class field; the attention reads it (16 x 64 = 1024 > hidden 512)
    num_attention_heads=16,
    num_key_value_heads=16,
    num_hidden_layers=8,
    max_position_embeddings=8000,
    rope_theta=10000,
    attention_bias=False,
    attention_dropout=0.0,
    sliding_window=72,
    hidden_act="silu",
    layer_scale_initial_scale=0.01,
    rms_norm_eps=1e-5,
    num_quantizers=16,
    num_semantic_quantizers=1,  # S (not read: the reference fixes n_q_semantic=1)
    semantic_codebook_size=4096,  # S (not read by qwen-tts 0.1.1)
    vector_quantization_hidden_dimension=512,  # S (not read by qwen-tts 0.1.1)
    upsample_rates=[8, 5, 4, 3],
    upsampling_ratios=[2, 2],
    decoder_dim=1536,
)
TOKENIZER_TOP = dict(
    encoder_valid_num_quantizers=16,
    input_sample_rate=24000,
    output_sample_rate=24000,
    decode_upsample_rate=1920,
    encode_downsample_rate=1920,
)

# Parameter counts of the released safetensors (every stored tensor, buffers such as
# the codebooks' embed_sum/cluster_usage/initialized included), from the tensor
# inventories of luka-loehr/qwen3-tts-native (benchmarks/results/
# voice-design-model-inventory.json, speech-tokenizer-model-inventory.json), measured
# on Qwen/Qwen3-TTS-12Hz-1.7B-VoiceDesign snapshot 5ecdb67327fd37bb2e042aab12ff7391903235d3.
RELEASED_COUNTS = {
    "1.7b-voicedesign": {"talker": 1741550592, "code_predictor": 175125760, "total": 1916676352, "tensors": 404},
    # The Base totals and tensor counts: a public model-contract table (Celune's
    # contracts, pinned to Qwen/Qwen3-TTS-12Hz-0.6B-Base 5d83992436eae1d760afd27aff78a71d676296fc,
    # model.safetensors 1,829,344,272 bytes, and Qwen/Qwen3-TTS-12Hz-1.7B-Base
    # fd4b254389122332181a7c3db7f27e918eec64e3, 3,857,413,744 bytes); the 1.7B-Base
    # total is also what the Hugging Face API reports ({"BF16": 1928677440}).
    "1.7b-base": {"total": 1928677440, "tensors": 480},
    "0.6b-base": {"total": 914643008, "tensors": 478},
}
RELEASED_TOKENIZER_COUNTS = {
    "decoder.decoder": 52370113,
    "decoder.pre_conv": 1573888,
    "decoder.pre_transformer": 30427136,
    "decoder.quantizer": 8945664,
    "decoder.upsample": 21006336,
    "encoder.downsample": 1048576,
    "encoder.encoder": 12628256,
    "encoder.encoder_transformer": 25190400,
    "encoder.quantizer": 17367072,
    "total": 170557441,
    "tensors": 496,
}
# Bytes of the released files (same snapshot; from model-contract-validation.json).
RELEASED_BYTES = {
    "1.7b-voicedesign/config.json": 4421,
    "1.7b-voicedesign/generation_config.json": 245,
    "1.7b-voicedesign/speech_tokenizer/config.json": 2336,
}

# ---------------------------------------------------------------------------
# Serialization, as the reference writes it.
# ---------------------------------------------------------------------------


def _quiet_imports():
    # qwen_tts imports onnxruntime (the 25 Hz tokenizer) and sox at module level.
    try:
        import onnxruntime  # noqa: F401
    except ImportError:
        sys.modules["onnxruntime"] = types.ModuleType("onnxruntime")
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.getLogger("transformers").setLevel(logging.ERROR)


def model_config_text(size: str, tts_type: str) -> str:
    """config.json: Qwen3TTSConfig's own serialization (save_pretrained's diff dict,
    whose talker block carries the code predictor's full PretrainedConfig dump, as the
    released file does), with the speaker encoder block as released: {enc_dim,
    sample_rate} in Base checkpoints, absent from the others."""
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig

    t = talker(size)
    if tts_type == "custom_voice":
        t.update(spk_id=dict(SPEAKERS), spk_is_dialect=dict(SPEAKER_DIALECT),
                 codec_language_id={**LANGUAGES, **DIALECTS})
    else:
        t.update(spk_id={}, spk_is_dialect={}, codec_language_id=dict(LANGUAGES))
    cfg = Qwen3TTSConfig(
        talker_config=t,
        tokenizer_type="qwen3_tts_tokenizer_12hz",
        tts_model_size=size,
        tts_model_type=tts_type,
        architectures=["Qwen3TTSForConditionalGeneration"],
        **TOP_IDS,
    )
    d = cfg.to_diff_dict()
    d.pop("speaker_encoder_config", None)
    if tts_type == "base":
        # S: enc_dim = the talker's width (the x-vector is a codec-embedding row).
        d["speaker_encoder_config"] = {"enc_dim": t["hidden_size"], "sample_rate": 24000}
    return _ordered_dump(d)


def _ordered_dump(d: dict) -> str:
    """Keys sorted (as transformers writes), except the contents of the speaker and
    language maps, which keep the released order."""

    def walk(x, keep=False):
        if isinstance(x, dict):
            keys = list(x) if keep else sorted(x)
            return {k: walk(x[k], k in ("codec_language_id", "spk_id", "spk_is_dialect")) for k in keys}
        if isinstance(x, list):
            return [walk(v) for v in x]
        return x

    return json.dumps(walk(d), indent=2) + "\n"


def tokenizer_config_text() -> str:
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config

    cfg = Qwen3TTSTokenizerV2Config(
        encoder_config=dict(TOKENIZER_ENCODER),
        decoder_config=dict(TOKENIZER_DECODER),
        architectures=["Qwen3TTSTokenizerV2Model"],
        **TOKENIZER_TOP,
    )
    return cfg.to_json_string(use_diff=True)


def generation_config_text() -> str:
    return json.dumps(GENERATION, indent=2)


def expected_files() -> dict:
    tok = tokenizer_config_text()
    files = {}
    for folder, size, tts_type in VARIANTS:
        files[f"{folder}/config.json"] = model_config_text(size, tts_type)
        files[f"{folder}/generation_config.json"] = generation_config_text()
        files[f"{folder}/speech_tokenizer/config.json"] = tok
    return files


# ---------------------------------------------------------------------------
# The Rust loader's expectations, read from its serde structs.
# ---------------------------------------------------------------------------

RUST_FILES = [
    "stages/src/models/qwen3_tts/config.rs",
    "stages/src/models/qwen3_omni/layers.rs",
    "stages/src/models/qwen3_omni/code_predictor.rs",
    "stages/src/models/qwen3_omni/code2wav.rs",
]

_ATTR = re.compile(r"#\[serde\((.*)\)\]")


def _split_top(s: str, sep: str = ","):
    """Split on `sep` outside <...>, (...), and quotes."""
    out, depth, cur, q = [], 0, "", False
    for ch in s:
        if ch == '"':
            q = not q
        if not q:
            if ch in "<([":
                depth += 1
            elif ch in ">)]":
                depth -= 1
        if ch == sep and depth == 0 and not q:
            out.append(cur.strip())
            cur = ""
        else:
            cur += ch
    if cur.strip():
        out.append(cur.strip())
    return out


def _serde_args(attrs):
    args = {}
    for a in attrs:
        for part in _split_top(a):
            if "=" in part:
                k, v = part.split("=", 1)
                args.setdefault(k.strip(), []).append(v.strip().strip('"'))
            else:
                args.setdefault(part.strip(), []).append(True)
    return args


def parse_rust():
    """{struct or enum name: [(file, item)]} for the items deriving Deserialize."""
    items = {}
    for rel in RUST_FILES:
        path = os.path.join(ROOT, rel)
        src = open(path).read()
        # Drop the test modules.
        src = src.split("#[cfg(test)]")[0]
        for m in re.finditer(r"((?:[ \t]*#\[[^\n]*\]\s*\n)*)[ \t]*pub (struct|enum) (\w+)\s*\{(.*?)\n\}", src, re.S):
            head, kind, name, body = m.groups()
            if "Deserialize" not in head:
                continue
            item_attrs = _serde_args(_ATTR.findall(head))
            if kind == "struct":
                fields, attrs = [], []
                for line in body.split("\n"):
                    s = line.strip()
                    if s.startswith("#[serde("):
                        attrs.append(_ATTR.search(s).group(1))
                    elif s.startswith("pub "):
                        fm = re.match(r"pub (\w+):\s*(.+?),?$", s)
                        fields.append((fm.group(1), fm.group(2), _serde_args(attrs)))
                        attrs = []
                    elif s.startswith("#[") or s.startswith("//") or not s:
                        continue
                items.setdefault(name, []).append((rel, dict(kind="struct", attrs=item_attrs, fields=fields)))
            else:
                variants = []
                for part in _split_top(re.sub(r"//[^\n]*", "", body)):
                    part = re.sub(r"#\[[^\]]*\]", "", part).strip()
                    if part:
                        variants.append(part)
                items.setdefault(name, []).append((rel, dict(kind="enum", attrs=item_attrs, variants=variants)))
    return items


def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).lower()


class RustCheck:
    def __init__(self):
        self.items = parse_rust()
        self.errors = []
        self.notes = set()

    def lookup(self, name, here):
        cands = self.items.get(name, [])
        for rel, it in cands:
            if rel == here:
                return rel, it
        return cands[0] if cands else (None, None)

    def check_struct(self, name, here, obj, path):
        rel, st = self.lookup(name, here)
        if st is None or st["kind"] != "struct":
            self.notes.add(f"{name}: not found in {RUST_FILES}, unchecked")
            return
        if not isinstance(obj, dict):
            self.errors.append(f"{path}: expected an object ({name})")
            return
        struct_default = "default" in st["attrs"]
        for fname, ftype, a in st["fields"]:
            if "skip" in a or "skip_deserializing" in a:
                continue
            if "flatten" in a:
                self.check_struct(ftype, rel, obj, path)
                continue
            key = a.get("rename", [fname])[0]
            keys = [key] + a.get("alias", [])
            present = [k for k in keys if k in obj]
            optional = struct_default or "default" in a or ftype.startswith("Option<")
            if not present:
                if not optional:
                    self.errors.append(f"{path}.{key}: required by {name}.{fname} ({rel}), missing")
                continue
            self.check_type(ftype, rel, obj[present[0]], f"{path}.{present[0]}")

    def check_type(self, t, here, v, path):
        t = t.strip()
        m = re.match(r"(\w+(?:::\w+)*)(?:<(.*)>)?$", t)
        base, inner = m.group(1).split("::")[-1], m.group(2)
        bad = lambda what: self.errors.append(f"{path}: {v!r} is not {what} ({t})")  # noqa: E731
        if base == "Option":
            if v is not None:
                self.check_type(inner, here, v, path)
        elif base in ("usize", "u32", "u64", "u16", "u8"):
            if not (isinstance(v, int) and not isinstance(v, bool) and v >= 0):
                bad("an unsigned integer")
        elif base in ("i32", "i64", "isize"):
            if not (isinstance(v, int) and not isinstance(v, bool)):
                bad("an integer")
        elif base in ("f64", "f32"):
            if not (isinstance(v, (int, float)) and not isinstance(v, bool)):
                bad("a number")
        elif base == "bool":
            if not isinstance(v, bool):
                bad("a bool")
        elif base == "String":
            if not isinstance(v, str):
                bad("a string")
        elif base == "Vec":
            if not isinstance(v, list):
                bad("a list")
            else:
                for i, x in enumerate(v):
                    self.check_type(inner, here, x, f"{path}[{i}]")
        elif base in ("HashMap", "BTreeMap"):
            kt, vt = _split_top(inner)
            if not isinstance(v, dict):
                bad("an object")
            else:
                for k, x in v.items():
                    self.check_type(vt, here, x, f"{path}.{k}")
        elif base == "Value":
            pass
        elif base == "Activation":  # candle_nn's serde enum: snake-case names
            if not isinstance(v, str):
                bad("an activation name")
            elif v not in ("silu", "gelu", "gelu_pytorch_tanh", "relu", "swiglu", "swish", "sigmoid"):
                self.notes.add(f"{path}: activation {v!r} not in the list this script knows")
        else:
            rel, it = self.lookup(base, here)
            if it is None:
                self.notes.add(f"{path}: type {t} not found, unchecked")
            elif it["kind"] == "struct":
                self.check_struct(base, rel, v, path)
            else:
                self.check_enum(base, it, rel, v, path)

    def check_enum(self, name, it, rel, v, path):
        if "untagged" in it["attrs"]:
            for var in it["variants"]:
                m = re.match(r"\w+\((.*)\)$", var)
                if not m:
                    continue
                saved = len(self.errors)
                self.check_type(m.group(1), rel, v, path)
                if len(self.errors) == saved:
                    return
                del self.errors[saved:]
            self.errors.append(f"{path}: {v!r} matches no variant of {name}")
            return
        rename_all = it["attrs"].get("rename_all", [None])[0]
        names = []
        for var in it["variants"]:
            vn = re.match(r"\w+", var).group(0)
            names.append(_snake(vn) if rename_all == "snake_case" else vn.lower() if rename_all == "lowercase" else vn)
        if v not in names:
            self.errors.append(f"{path}: {v!r} is not one of {names} ({name})")


def rust_semantics(cfg: dict, tok: dict, where: str):
    """The checks of Qwen3TtsConfig::load and SpeechTokenizerConfig::load."""
    errs = []
    t = cfg.get("tokenizer_type")
    if t is not None and t != "qwen3_tts_tokenizer_12hz":
        errs.append(f"{where}: tokenizer_type {t}")
    tc = cfg["talker_config"]
    if tc["code_predictor_config"]["num_code_groups"] != tc["num_code_groups"]:
        errs.append(f"{where}: num_code_groups differs from the code predictor's")
    if cfg.get("tts_model_type") == "base" and cfg.get("speaker_encoder_config") is None:
        errs.append(f"{where}: a Base checkpoint needs speaker_encoder_config")
    mt = tok.get("model_type")
    if mt is not None and mt != "qwen3_tts_tokenizer_12hz":
        errs.append(f"{where}/speech_tokenizer: model_type {mt}")
    d = tok["decoder_config"]
    spf = 1
    for r in d.get("upsampling_ratios", [2, 2]) + d.get("upsample_rates", [8, 5, 4, 3]):
        spf *= r
    if spf != tok.get("decode_upsample_rate", 1920):
        errs.append(f"{where}/speech_tokenizer: decoder makes {spf} samples a frame")
    return errs


# ---------------------------------------------------------------------------
# The checks.
# ---------------------------------------------------------------------------


def numel(tensors):
    return sum(t.numel() for t in tensors)


def sd_counts(module, prefixes):
    """Stored-tensor counts (parameters + persistent buffers, as in a safetensors file)."""
    sd = module.state_dict()
    out = {}
    for name, p in prefixes.items():
        out[name] = sum(v.numel() for k, v in sd.items() if p(k))
    out["total"] = sum(v.numel() for v in sd.values())
    out["tensors"] = len(sd)
    return out


def count_model(cfg):
    import torch
    from qwen_tts.core.models.modeling_qwen3_tts import Qwen3TTSForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3TTSForConditionalGeneration(cfg)
    c = sd_counts(model, {
        "talker": lambda k: k.startswith("talker.") and not k.startswith("talker.code_predictor."),
        "text_embedding": lambda k: k == "talker.model.text_embedding.weight",
        "code_predictor": lambda k: k.startswith("talker.code_predictor."),
        "speaker_encoder": lambda k: k.startswith("speaker_encoder."),
    })
    c["parameters"] = numel(model.parameters())
    return c


def count_tokenizer(tcfg):
    import torch
    from qwen_tts.core.tokenizer_12hz.modeling_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Model

    with torch.device("meta"):
        tok = Qwen3TTSTokenizerV2Model(tcfg)
    parts = {k: (lambda p: lambda n: n.startswith(p + "."))(k) for k in RELEASED_TOKENIZER_COUNTS
             if k not in ("total", "tensors")}
    parts["encoder"] = lambda n: n.startswith("encoder.")
    parts["decoder"] = lambda n: n.startswith("decoder.")
    c = sd_counts(tok, parts)
    c["parameters"] = numel(tok.parameters())
    c["encoder_parameters"] = numel(tok.encoder.parameters())
    c["decoder_parameters"] = numel(tok.decoder.parameters())
    return c


def fmt(n):
    if n < 100000:
        return f"{n:>13,d}"
    return f"{n:>13,d} ({n / 1e9:.3f} B)" if n >= 1e8 else f"{n:>13,d} ({n / 1e6:.1f} M)"


def verify(args) -> int:
    _quiet_imports()
    from qwen_tts.core.models.configuration_qwen3_tts import Qwen3TTSConfig
    from qwen_tts.core.tokenizer_12hz.configuration_qwen3_tts_tokenizer_v2 import Qwen3TTSTokenizerV2Config

    failures = []

    def check(ok, msg):
        if not ok:
            failures.append(msg)
        return ok

    # 1. The files are the tables.
    expected = expected_files()
    for rel, text in expected.items():
        path = os.path.join(OUT, rel)
        if not os.path.exists(path):
            check(False, f"{rel}: missing (run with --write)")
            continue
        with open(path) as f:
            check(f.read() == text, f"{rel}: differs from the tables (run with --write)")
    for rel, n in RELEASED_BYTES.items():
        path = os.path.join(OUT, rel)
        if os.path.exists(path):
            print(f"bytes  {rel}: {os.path.getsize(path)} (released file: {n})")

    # 2./3. The reference loads them and builds the models; the counts.
    summary = {}
    tok_counts = None
    rust = RustCheck()
    for folder, size, tts_type in VARIANTS:
        d = os.path.join(OUT, folder)
        cfg = Qwen3TTSConfig.from_pretrained(d)
        tcfg = Qwen3TTSTokenizerV2Config.from_pretrained(os.path.join(d, "speech_tokenizer"))
        with open(os.path.join(d, "config.json")) as f:
            raw = json.load(f)
        with open(os.path.join(d, "speech_tokenizer", "config.json")) as f:
            traw = json.load(f)
        with open(os.path.join(d, "generation_config.json")) as f:
            gen = json.load(f)
        # As scripts/qwen3_tts/ref_bench.py builds it.
        cfg2 = Qwen3TTSConfig(**copy.deepcopy(raw))
        tc = cfg.talker_config
        check(cfg2.talker_config.to_dict() == tc.to_dict(), f"{folder}: Qwen3TTSConfig(**json) != from_pretrained")
        check(cfg.tts_model_type == tts_type and cfg.tts_model_size == size, f"{folder}: model type/size")
        check(tc.code_predictor_config.num_code_groups == tc.num_code_groups == 16, f"{folder}: code groups")
        check(tc.hidden_size == {"1b7": 2048, "0b6": 1024}[size], f"{folder}: talker width")
        # generate() suppresses [vocab-1024, vocab) but eos: the control ids must be there.
        for k, v in CODEC_IDS.items():
            check(tc.vocab_size - 1024 <= v < tc.vocab_size, f"{folder}: {k}={v} outside the suppressed control range")
        if tts_type == "custom_voice":
            check(set(tc.spk_id) == set(tc.spk_is_dialect) == set(SPEAKERS), f"{folder}: speakers")
            for s, dia in tc.spk_is_dialect.items():
                check(dia is False or dia in tc.codec_language_id, f"{folder}: {s}'s dialect {dia} has no language id")
        else:
            check(tc.spk_id == {}, f"{folder}: spk_id should be empty")
        check((tts_type == "base") == ("speaker_encoder_config" in raw), f"{folder}: speaker_encoder_config presence")
        if tts_type == "base":
            check(cfg.speaker_encoder_config.enc_dim == tc.hidden_size, f"{folder}: enc_dim != talker width")
        check(set(gen) == set(GENERATION), f"{folder}: generation_config keys")
        check(tcfg.decoder_config.codebook_dim == 512 and tcfg.encoder_config.frame_rate == 12.5, f"{folder}: tokenizer")

        counts = count_model(cfg)
        summary[folder] = counts
        if tok_counts is None:
            tok_counts = count_tokenizer(tcfg)

        # 4. The Rust loader.
        rust.check_struct("Qwen3TtsConfig", "stages/src/models/qwen3_tts/config.rs", raw, f"{folder}/config.json")
        rust.check_struct("SpeechTokenizerConfig", "stages/src/models/qwen3_tts/config.rs", traw,
                          f"{folder}/speech_tokenizer/config.json")
        for e in rust_semantics(raw, traw, folder):
            rust.errors.append(e)

    print()
    print("Parameter counts (stored tensors: parameters + persistent buffers, as in model.safetensors)")
    for folder, _, _ in VARIANTS:
        c = summary[folder]
        rel = RELEASED_COUNTS.get(folder, {})
        print(f"  {HF_REPO[folder]}")
        for k in ("talker", "text_embedding", "code_predictor", "speaker_encoder", "total", "tensors"):
            tag = ""
            if k in rel:
                ok = check(c[k] == rel[k], f"{folder}: {k} {c[k]} != released {rel[k]}")
                tag = f"  released {rel[k]:,d} {'OK' if ok else 'MISMATCH'}"
            print(f"    {k:<16}{fmt(c[k])}{tag}")
        body = c["total"] - c["text_embedding"]
        print(f"    {'w/o text emb.':<16}{fmt(body)}")
        nominal = 1.7e9 if folder.startswith("1.7b") else 0.6e9
        check(abs(body - nominal) / nominal < 0.1, f"{folder}: {body} is not near the name's {nominal:.1e}")
    print(f"  {'Qwen/Qwen3-TTS-Tokenizer-12Hz'} (speech_tokenizer/)")
    for k, rel in RELEASED_TOKENIZER_COUNTS.items():
        ok = check(tok_counts[k] == rel, f"tokenizer: {k} {tok_counts[k]} != released {rel}")
        print(f"    {k:<28}{fmt(tok_counts[k])}  released {rel:,d} {'OK' if ok else 'MISMATCH'}")
    print(f"    {'encoder (all)':<28}{fmt(tok_counts['encoder'])}   nn.Parameters {tok_counts['encoder_parameters']:,d}")
    print(f"    {'decoder (all)':<28}{fmt(tok_counts['decoder'])}   nn.Parameters {tok_counts['decoder_parameters']:,d}")

    print()
    if rust.notes:
        for n in sorted(rust.notes):
            print(f"rust note: {n}")
    if rust.errors:
        print(f"Rust loader ({', '.join(RUST_FILES[:1])} + the structs it flattens): {len(rust.errors)} problem(s)")
        for e in rust.errors:
            print(f"  {e}")
        failures.append(f"Rust loader: {len(rust.errors)} problem(s)")
    else:
        print("Rust loader: every required key present, every type right")

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"models": summary, "tokenizer": tok_counts, "rust_errors": rust.errors,
                       "failures": failures}, f, indent=1)
    print()
    if failures:
        print(f"FAIL ({len(failures)}):")
        for m in failures:
            print(f"  {m}")
        return 1
    print("OK")
    return 0


def write() -> int:
    _quiet_imports()
    for rel, text in expected_files().items():
        path = os.path.join(OUT, rel)
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
        print(f"wrote {os.path.relpath(path, ROOT)} ({len(text.encode())} bytes)")
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--write", action="store_true", help="rewrite deploy/qwen3_tts_released/ from the tables")
    ap.add_argument("--json", help="also write the measured counts and problems here")
    args = ap.parse_args()
    sys.exit(write() if args.write else verify(args))


if __name__ == "__main__":
    main()
