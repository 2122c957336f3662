"""A small Qwen2-style tokenizer (byte-level BPE with Qwen's split regex, NFC,
ChatML special tokens) saved the way a Hugging Face checkpoint stores it, plus
transformers' own encodings and chat rendering of a few conversations. The real
Qwen3-Omni tokenizer is the same `tokenizers` pipeline with a 151k vocabulary."""

import json
import os

from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
from transformers import AutoTokenizer

import tiny

QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|audio_start|>", "<|audio_end|>", "<|audio_pad|>"]
CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. What is the capital of France? Paris is the capital of France.",
    "Hello there! How are you today? I'm fine, thanks; it's 12:30 and we'll leave at 3 o'clock.",
    "Speech streams in real time: first audio in 150 ms, exact chunk boundaries, 24 kHz PCM.",
    "Zürich, naïve café — déjà vu. 你好，世界。 こんにちは。",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You speak briefly."},
        {"role": "user", "content": "Hello there! How are you today?"},
        {"role": "assistant", "content": "I'm fine, thanks."},
        {"role": "user", "content": "It's 12:30 — déjà vu? 你好"},
    ],
]


def make(model, out):
    del model
    tok = Tokenizer(models.BPE())
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=SPECIALS, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(CORPUS * 4, trainer)
    tok.save(os.path.join(out, "tokenizer.json"))
    with open(os.path.join(out, "tokenizer_config.json"), "w") as f:
        json.dump(
            {
                "tokenizer_class": "Qwen2Tokenizer",
                "bos_token": None,
                "eos_token": "<|im_end|>",
                "pad_token": "<|endoftext|>",
                "chat_template": CHATML,
                "add_bos_token": False,
            },
            f,
            indent=1,
        )
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]}, f)

    hf = AutoTokenizer.from_pretrained(out)
    cases = []
    for conv in CONVERSATIONS:
        text = hf.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
        ids = hf(text, add_special_tokens=False)["input_ids"]
        cases.append({"messages": conv, "text": text, "ids": ids, "decoded": hf.decode(ids)})
    for line in CORPUS:
        ids = hf(line, add_special_tokens=False)["input_ids"]
        cases.append({"text": line, "ids": ids, "decoded": hf.decode(ids)})
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
