"""A small Qwen2-style tokenizer (byte-level BPE with Qwen's split regex, NFC,
ChatML special tokens) saved the way a Hugging Face checkpoint stores it, plus
transformers' own encodings and chat rendering of a few conversations. The real
Qwen3-Omni tokenizer is the same `tokenizers` pipeline with a 151k vocabulary."""

import json
import os

from tokenizers import Tokenizer
from transformers import AutoTokenizer

import tiny

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
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
    """tokenizer.json is written by tiny.py (the model's vocabulary is built from it)."""
    del model
    tok = Tokenizer.from_file(os.path.join(out, "tokenizer.json"))
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
    for line in tiny.CORPUS:
        ids = hf(line, add_special_tokens=False)["input_ids"]
        cases.append({"text": line, "ids": ids, "decoded": hf.decode(ids)})
    with open(os.path.join(out, "cases.json"), "w") as f:
        json.dump(cases, f, ensure_ascii=False, indent=1)
