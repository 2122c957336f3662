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
import wave
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI
from tokenizers import Tokenizer

from fixtures import float_wav, load_safetensors

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "qwen3_omni"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
RATE = 24_000
FRAME = 1920
LEAD = 555  # the causal decoder's lead-in (stages/src/models/qwen3_omni/code2wav.rs)
REF_TOKENS = 32  # the reference ran its Thinker for 32 tokens and spoke 32 frames
REF_FRAMES = 32
# 16-bit output quantisation (1/32768) plus float rounding.
TOL = 2e-4




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




def assert_same_audio(got: np.ndarray, ref: np.ndarray) -> None:
    # The reference spoke 32 frames; a longer answer has them as its prefix (causal decoder).
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


def ws_url(path: str) -> str:
    return URL.replace("http://", "ws://").rstrip("/") + path


def pcm16(samples: np.ndarray) -> bytes:
    return (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()


def test_spoken_turn_over_the_stream_websocket():
    """/v1/stream: a spoken turn (pcm16 at 16 kHz, ended by audio_end) goes to
    the Thinker's own ears (no transcript) and is answered in audio."""
    import asyncio

    import websockets

    async def run():
        async with websockets.connect(ws_url("/v1/stream"), max_size=None) as ws:
            await ws.send(json.dumps({"type": "start", "sample_rate": 16000, "voice": "aiden"}))
            started = json.loads(await ws.recv())
            assert started["type"] == "started" and started["voice"] == "aiden", started
            pcm = pcm16(IO["c2_pcm"])
            for i in range(0, len(pcm), 6400):
                await ws.send(pcm[i : i + 6400])
            await ws.send(json.dumps({"type": "audio_end"}))
            audio, text, events = b"", "", []
            while True:
                m = await asyncio.wait_for(ws.recv(), 120)
                if isinstance(m, bytes):
                    audio += m
                    continue
                e = json.loads(m)
                events.append(e["type"])
                if e["type"] == "transcript":
                    text += e["text"]
                if e["type"] in ("done", "error"):
                    assert e["type"] == "done" and e["status"] == "completed", e
                    break
            assert "input_transcript" not in events, events
            assert events[0] == "audio_received", events
            assert text and len(audio) >= 16000 * 2, (text, len(audio))

    asyncio.run(run())


def test_spoken_turn_over_realtime():
    """/v1/realtime: committed speech (pcm16 at 24 kHz) is heard by the Thinker
    and answered with audio and its transcript."""
    import asyncio

    import websockets

    pcm24 = np.interp(np.arange(0, len(IO["c2_pcm"]), 16000 / 24000), np.arange(len(IO["c2_pcm"])), IO["c2_pcm"])

    async def run():
        async with websockets.connect(ws_url("/v1/realtime"), max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {"audio": {"output": {"voice": "chelsie"}}}}))
            await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm16(pcm24)).decode()}))
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            await ws.send(json.dumps({"type": "response.create"}))
            audio, transcript, kinds = b"", "", []
            while True:
                e = json.loads(await asyncio.wait_for(ws.recv(), 120))
                kinds.append(e["type"])
                if e["type"] == "error":
                    raise AssertionError(e)
                if e["type"] == "session.updated":
                    assert e["session"]["audio"]["output"]["voice"] == "chelsie"
                if e["type"] == "response.output_audio.delta":
                    audio += base64.b64decode(e["delta"])
                if e["type"] == "response.output_audio_transcript.delta":
                    transcript += e["delta"]
                if e["type"] == "response.done":
                    assert e["response"]["status"] == "completed", e
                    break
            assert "input_audio_buffer.committed" in kinds
            assert not any("transcription" in k for k in kinds), kinds
            assert transcript and len(audio) >= 24000 * 2, (transcript, len(audio))

    asyncio.run(run())
