"""`WS /v1/audio/speech/stream` on `omnistream serve --profile
deploy/qwen3-tts-tiny.yaml`: text in as an LLM writes it, speech out, several
utterances on one socket. The first utterance's text arrives word by word, so
the Talker hears it as the reference's streaming-text `generate` does: its
audio is the reference's (tests/fixtures/qwen3_tts, case `custom_stream`).
Then ordering, cancel, and bad input (the socket stays usable).

Run by tests/tests/qwen3_tts_server.rs (with API key `key-alice`)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
from pathlib import Path

import numpy as np
import websockets

from fixtures import load_safetensors

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "qwen3_tts" / "generate"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000").replace("http", "ws", 1)
KEY = "key-alice"
FRAME = 1920
TOL = 1e-4




IO = load_safetensors(FIX / "io.safetensors")
CASES = {c["name"]: c for c in json.loads((FIX / "io.json").read_text())["cases"]}


def connect():
    return websockets.connect(
        URL.rstrip("/") + "/v1/audio/speech/stream",
        additional_headers={"Authorization": f"Bearer {KEY}"},
        max_size=None,
    )


async def recv(ws, timeout=120):
    return json.loads(await asyncio.wait_for(ws.recv(), timeout))


async def until(ws, kind):
    """Events up to and including the first of `kind` (or an error)."""
    seen = []
    while True:
        ev = await recv(ws)
        seen.append(ev)
        if ev["type"] in (kind, "error"):
            return seen


def audio_of(events, utt):
    return b"".join(
        base64.b64decode(e["audio"]) for e in events if e["type"] == "speech.audio.delta" and e["utterance_id"] == utt
    )


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def test_text_as_it_is_written_is_the_reference_streaming_speech():
    c = CASES["custom_stream"]

    async def go():
        async with connect() as ws:
            created = await recv(ws)
            assert created["type"] == "session.created", created
            await ws.send(json.dumps({"type": "session.update", "session": {
                "voice": c["speaker"], "instructions": c["instruct"], "language": "english"}}))
            updated = await recv(ws)
            assert updated["type"] == "session.updated" and updated["session"]["voice"] == c["speaker"], updated
            for w in c["text"].split(" "):
                await ws.send(json.dumps({"type": "input.text.delta", "delta": w + " " if w != c["text"].split(" ")[-1] else w}))
            await ws.send(json.dumps({"type": "input.done"}))
            events = await until(ws, "speech.audio.done")
            assert events[0]["type"] == "speech.started", events[0]
            utt = events[0]["utterance_id"]
            assert events[-1]["type"] == "speech.audio.done", events[-1]
            got = pcm(audio_of(events, utt))
            ref = IO["custom_stream.wav"]
            assert len(got) % FRAME == 0 and len(got) >= len(ref), (len(got), len(ref))
            assert float(np.abs(got[: len(ref)] - ref).max()) < TOL

    asyncio.run(go())


def test_utterances_are_spoken_in_order_and_cancel_drops_them():
    async def go():
        async with connect() as ws:
            await recv(ws)
            for text in ["First sentence here.", "Second one follows."]:
                await ws.send(json.dumps({"type": "input.text.delta", "delta": text}))
                await ws.send(json.dumps({"type": "input.done"}))
            order, done = [], []
            while len(done) < 2:
                ev = await recv(ws)
                assert ev["type"] != "error", ev
                if ev["type"] == "speech.audio.delta":
                    if not order or order[-1] != ev["utterance_id"]:
                        order.append(ev["utterance_id"])
                elif ev["type"] == "speech.audio.done":
                    done.append(ev["utterance_id"])
            # Audio of the first, then of the second: never interleaved.
            assert order == done == ["utt_1", "utt_2"], (order, done)
            # A long utterance, cancelled while it speaks.
            await ws.send(json.dumps({"type": "input.text.delta", "delta": "This one will not be finished. " * 3}))
            started = await recv(ws)
            assert started["type"] == "speech.started"
            await ws.send(json.dumps({"type": "input.cancel"}))
            ev = await until(ws, "speech.cancelled")
            assert ev[-1]["type"] == "speech.cancelled", ev[-1]
            # The socket goes on.
            await ws.send(json.dumps({"type": "input.text.delta", "delta": "Still here."}))
            await ws.send(json.dumps({"type": "input.done"}))
            ev = await until(ws, "speech.audio.done")
            assert ev[-1]["type"] == "speech.audio.done", ev[-1]

    asyncio.run(go())


def test_bad_input_is_an_error_and_the_socket_stays_usable():
    async def go():
        async with connect() as ws:
            await recv(ws)
            for msg, code in [
                ("{not json", "invalid_json"),
                (json.dumps({"type": "nope"}), "unknown_event"),
                (json.dumps({"delta": "x"}), "invalid_event"),
                (json.dumps({"type": "input.text.delta"}), "invalid_event"),
                (json.dumps({"type": "input.done"}), "no_open_utterance"),
                (json.dumps({"type": "session.update", "session": {"voice": "nobody"}}), "invalid_value"),
                (json.dumps({"type": "session.update", "session": {"language": "klingon"}}), "invalid_value"),
                (json.dumps({"type": "session.update", "session": {"colour": "red"}}), "invalid_event"),
            ]:
                await ws.send(msg)
                ev = await recv(ws)
                assert ev["type"] == "error" and ev["error"]["code"] == code, (msg, ev)
            await ws.send(b"\x00\x01binary")
            ev = await recv(ws)
            assert ev["error"]["code"] == "binary_not_accepted", ev
            await ws.send(json.dumps({"type": "input.text.delta", "delta": "x" * 10_001}))
            ev = await until(ws, "error")
            assert ev[-1]["error"]["code"] == "input_too_long", ev
            await ws.send(json.dumps({"type": "input.text.delta", "delta": "Fine again."}))
            await ws.send(json.dumps({"type": "input.done"}))
            ev = await until(ws, "speech.audio.done")
            assert ev[-1]["type"] == "speech.audio.done", ev[-1]

    asyncio.run(go())


def test_a_key_is_needed():
    async def go():
        try:
            async with websockets.connect(URL.rstrip("/") + "/v1/audio/speech/stream"):
                raise AssertionError("connected without a key")
        except websockets.exceptions.InvalidStatus as e:
            assert e.response.status_code == 401

    asyncio.run(go())
