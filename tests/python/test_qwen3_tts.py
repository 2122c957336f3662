"""`omnistream serve --profile deploy/qwen3-tts-tiny.yaml` through the official
OpenAI Python SDK: Qwen3-TTS's architecture (the tiny random-weight checkpoint
qwen-tts made, tests/fixtures/qwen3_tts/), greedy, so the audio the server
streams is checked against the reference's own `generate` + speech tokenizer
(scripts/qwen3_tts/make_fixtures.py): the same 24 kHz samples (16-bit) for a
preset voice, and for a preset voice with `instructions` and a `language`.
Then the bad requests: each a 400 naming its parameter, the server healthy.

Run by tests/tests/qwen3_tts_server.rs, which starts the server and sets
OMNISTREAM_URL."""

from __future__ import annotations

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

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "qwen3_tts" / "generate"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
RATE = 24_000
FRAME = 1920
# 16-bit output quantisation (1/32768) plus float rounding.
TOL = 1e-4


def load_safetensors(path: Path) -> dict[str, np.ndarray]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8 : 8 + n])
    base = 8 + n
    dtypes = {"F32": np.float32, "I64": np.int64}
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(raw[base + a : base + b], dtype=dtypes[v["dtype"]]).reshape(v["shape"])
    return out


IO = load_safetensors(FIX / "io.safetensors")
CASES = {c["name"]: c for c in json.loads((FIX / "io.json").read_text())["cases"]}


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def assert_reference(samples: np.ndarray, case: str) -> None:
    """The reference stopped at its frame budget (or its end code): the server's
    causal decoder gives exactly those samples first, whatever follows."""
    ref = IO[f"{case}.wav"]
    assert len(samples) % FRAME == 0, len(samples)
    assert len(samples) >= len(ref), (len(samples), len(ref))
    err = float(np.abs(samples[: len(ref)] - ref).max())
    assert err < TOL, f"{case}: {err}"


def test_preset_voice_is_the_reference(client):
    c = CASES["custom"]
    r = client.audio.speech.create(model="qwen3-tts", voice=c["speaker"], input=c["text"], response_format="wav")
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        samples = pcm(w.readframes(w.getnframes()))
    assert_reference(samples, "custom")
    # OpenAI's voice names speak in the default voice (the profile's: vivian).
    again = client.audio.speech.create(model="qwen3-tts", voice="alloy", input=c["text"], response_format="pcm")
    assert np.array_equal(pcm(again.content), samples)


def test_instructions_and_language_streamed(client):
    c = CASES["custom_style"]
    with client.audio.speech.with_streaming_response.create(
        model="qwen3-tts",
        voice=c["speaker"].upper(),
        input=c["text"],
        instructions=c["instruct"],
        response_format="pcm",
        extra_body={"language": "English"},
    ) as r:
        assert r.headers["content-type"].startswith("audio/pcm"), r.headers
        chunks = [b for b in r.iter_bytes() if b]
    assert len(chunks) > 1, "streamed as it was made"
    assert_reference(pcm(b"".join(chunks)), "custom_style")
    # Without the instructions it is another prompt, so other audio.
    plain = client.audio.speech.create(
        model="qwen3-tts", voice=c["speaker"], input=c["text"], response_format="pcm",
        extra_body={"language": "english"},
    )
    other = pcm(plain.content)
    n = min(len(other), len(IO["custom_style.wav"]))
    assert n > 0 and np.abs(other[:n] - IO["custom_style.wav"][:n]).max() > 1e-2


def test_sse_stream(client):
    c = CASES["custom"]
    r = client.audio.speech.create(
        model="qwen3-tts", voice=c["speaker"], input=c["text"], response_format="pcm",
        extra_body={"stream_format": "sse"},
    )
    import base64

    audio = b""
    done = False
    for line in r.content.decode().splitlines():
        if not line.startswith("data: "):
            continue
        ev = json.loads(line[6:])
        if ev["type"] == "speech.audio.delta":
            audio += base64.b64decode(ev["audio"])
        elif ev["type"] == "speech.audio.done":
            done = True
    assert done
    assert_reference(pcm(audio), "custom")


@pytest.mark.parametrize(
    "kw, param",
    [
        (dict(voice="nobody"), "voice"),
        (dict(voice="ryan", extra_body={"language": "klingon"}), "language"),
        # A dialect comes with its speaker; it is never asked for by name.
        (dict(voice="ryan", extra_body={"language": "sichuan_dialect"}), "language"),
        (dict(voice="ryan", instructions="x" * 5000), "instructions"),
        (dict(voice="ryan", input=""), "input"),
        (dict(voice="ryan", input="x" * 10_001), "input"),
        (dict(voice="ryan", response_format="aac"), "response_format"),
        (dict(voice="ryan", speed=1.5), "speed"),
    ],
)
def test_bad_requests_name_their_parameter(client, kw, param):
    kw = {"model": "qwen3-tts", "input": "Hello there!", **kw}
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(**kw)
    assert e.value.body["param"] == param, (kw, e.value.body)
    # The server is fine afterwards.
    ok = client.audio.speech.create(model="qwen3-tts", voice="eric", input="Paris.", response_format="pcm")
    assert len(ok.content) > 0 and len(ok.content) % (2 * FRAME) == 0
