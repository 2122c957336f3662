"""`omnistream serve --profile deploy/qwen3-omni-tiny.yaml` through the official
OpenAI Python SDK: Qwen3-Omni's architecture (the tiny random-weight checkpoint
the reference made, tests/fixtures/qwen3_omni/), greedy, so what the server says
is checked against the reference's own `generate` (scripts/qwen3_omni/generate.py):
the same words, and the same 24 kHz audio (16-bit, after the causal decoder's
555-sample lead-in) for a typed question and for a spoken one heard by the
Thinker's audio encoder.

Run by tests/tests/qwen3_omni_server.rs, which starts the server and sets
OMNISTREAM_URL."""

from __future__ import annotations

import base64
import io
import json
import os
import struct
import wave
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "qwen3_omni"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
RATE = 24_000
FRAME = 1920
LEAD = 555  # the causal decoder's lead-in (stages/src/models/qwen3_omni/code2wav.rs)
REF_TOKENS = 20  # the reference ran its Thinker for 20 tokens and spoke 23 frames
REF_FRAMES = 23
# 16-bit output quantisation (1/32768) plus float rounding.
TOL = 2e-4


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    dtypes = {"F32": np.float32, "I64": np.int64, "F64": np.float64}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[base + a : base + b], dtype=dtypes[v["dtype"]]).reshape(v["shape"])
    return out


IO = load_safetensors(FIX / "generate" / "io.safetensors")
META = json.loads((FIX / "generate" / "io.json").read_text())
TOK = Tokenizer.from_file(str(FIX / "tokenizer" / "tokenizer.json"))


def reference(i: int) -> tuple[str, np.ndarray]:
    prompt = IO[f"c{i}_input_ids"].shape[1]
    tokens = IO[f"c{i}_sequences"][0, prompt:].tolist()
    return TOK.decode(tokens, skip_special_tokens=False), IO[f"c{i}_wav"]


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


def wav_samples(data: bytes) -> np.ndarray:
    with wave.open(io.BytesIO(data)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        pcm = w.readframes(w.getnframes())
    return np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0


def float_wav(samples: np.ndarray, rate: int) -> bytes:
    """A 32-bit float WAV: the spoken turn reaches the server bit for bit."""
    data = samples.astype("<f4").tobytes()
    fmt = struct.pack("<HHIIHH", 3, 1, rate, rate * 4, 4, 32)
    body = b"WAVE" + b"fmt " + struct.pack("<I", len(fmt)) + fmt + b"data" + struct.pack("<I", len(data)) + data
    return b"RIFF" + struct.pack("<I", len(body)) + body


def assert_same_audio(got: np.ndarray, ref: np.ndarray) -> None:
    # The reference spoke 23 frames; a longer answer has them as its prefix (causal decoder).
    assert len(got) >= REF_FRAMES * FRAME and len(got) % FRAME == 0, len(got)
    assert np.all(got[:LEAD] == 0)
    err = np.abs(got[LEAD : REF_FRAMES * FRAME] - ref).max()
    assert np.abs(ref).max() > 0.05
    assert err <= TOL, f"max abs {err}"


def test_typed_question_is_answered_like_the_reference(client):
    case = META["cases"][0]
    text, ref = reference(0)
    r = client.chat.completions.create(
        model="qwen3-omni-tiny",
        messages=case["messages"],
        modalities=["text", "audio"],
        audio={"voice": case["speaker"], "format": "wav"},
        max_completion_tokens=REF_TOKENS,
    )
    audio = r.choices[0].message.audio
    assert audio.transcript == text
    assert_same_audio(wav_samples(base64.b64decode(audio.data)), ref)


def test_spoken_question_is_heard_by_the_thinker(client):
    case = META["cases"][2]
    text, ref = reference(2)
    pcm = IO["c2_pcm"]
    r = client.chat.completions.create(
        model="qwen3-omni-tiny",
        messages=[
            {
                "role": "user",
                "content": [
                    {
                        "type": "input_audio",
                        "input_audio": {"data": base64.b64encode(float_wav(pcm, 16_000)).decode(), "format": "wav"},
                    }
                ],
            }
        ],
        modalities=["text", "audio"],
        audio={"voice": case["speaker"], "format": "wav"},
        max_completion_tokens=REF_TOKENS,
    )
    audio = r.choices[0].message.audio
    assert audio.transcript == text
    assert_same_audio(wav_samples(base64.b64decode(audio.data)), ref)


def test_streamed_answer_is_the_same_audio(client):
    case = META["cases"][1]
    text, ref = reference(1)
    stream = client.chat.completions.create(
        model="qwen3-omni-tiny",
        messages=case["messages"],
        modalities=["text", "audio"],
        audio={"voice": case["speaker"], "format": "pcm16"},
        max_completion_tokens=REF_TOKENS,
        stream=True,
    )
    pcm, words, chunks = b"", "", 0
    for chunk in stream:
        if not chunk.choices:
            continue
        a = getattr(chunk.choices[0].delta, "audio", None)
        if a:
            a = a if isinstance(a, dict) else a.model_dump()
            if a.get("data"):
                pcm += base64.b64decode(a["data"])
                chunks += 1
            words += a.get("transcript") or ""
    assert words == text
    assert chunks > 3, "audio arrives in pieces as it is made"
    got = np.frombuffer(pcm, dtype="<i2").astype(np.float32) / 32768.0
    assert_same_audio(got, ref)


def test_text_only_and_bad_requests(client):
    case = META["cases"][0]
    text, _ = reference(0)
    r = client.chat.completions.create(
        model="qwen3-omni-tiny", messages=case["messages"], max_completion_tokens=REF_TOKENS
    )
    assert r.choices[0].message.content == text
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="qwen3-omni-tiny",
            messages=case["messages"],
            modalities=["text", "audio"],
            audio={"voice": "joe", "format": "wav"},
        )
    assert "chelsie" in str(e.value) and "ethan" in str(e.value)
    # This Talker speaks the Thinker's answers, not given text.
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tts-1", voice="ethan", input="Hello there.")
    assert "chat" in str(e.value)
    # Garbage audio is a clear error; so is audio anywhere but the last user turn.
    bad = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(b"RIFFjunk").decode(), "format": "wav"}}]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="m", messages=[{"role": "user", "content": bad}])
    good = [{"type": "input_audio", "input_audio": {"data": base64.b64encode(float_wav(IO["c2_pcm"], 16_000)).decode()}}]
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": good}, {"role": "user", "content": "and?"}]
        )
    assert "last message" in str(e.value)
    # The server is still fine.
    r = client.chat.completions.create(model="m", messages=case["messages"], max_completion_tokens=3)
    assert r.choices[0].message.content
