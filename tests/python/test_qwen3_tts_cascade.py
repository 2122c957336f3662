"""`omnistream serve --profile deploy/smollm2-qwen3-tts-tiny.yaml` through the
official OpenAI Python SDK: SmolLM2 answers and Qwen3-TTS (the tiny reference
checkpoint) speaks the answer as it is written, on the chat completions and
Realtime paths. The voice is random weights, so what is checked is the shape of
it: the transcript is the answer's text, audio comes in whole 80 ms frames at
24 kHz, streamed while the text is still being written, in any preset voice.

Run by tests/tests/qwen3_tts_server.rs, which starts the server and sets
OMNISTREAM_URL."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import tempfile
import time
import wave
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect

from fixtures import FIXTURES, load_safetensors, pcm16_wav

URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
WS_URL = "ws" + URL.rstrip("/")[len("http"):]
FRAME_BYTES = 1920 * 2  # one 80 ms codec frame of 16-bit PCM at 24 kHz
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


def realtime_answer(client: OpenAI, voice: str):
    with client.realtime.connect(model="omnistream") as conn:
        conn.session.update(session={"type": "realtime", "audio": {"output": {"voice": voice}}})
        conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is the capital of France?"}],
        })
        conn.response.create()
        audio, done = b"", None
        for ev in conn:
            if ev.type == "response.output_audio.delta":
                audio += base64.b64decode(ev.delta)
            elif ev.type in ("response.done", "error"):
                done = ev
                break
    return audio, done


def test_chat_answer_is_spoken_in_each_voice(client):
    said = {}
    for voice in ["vivian", "ryan", "eric"]:
        r = client.chat.completions.create(
            model="omnistream", messages=QUESTION, modalities=["text", "audio"],
            audio={"voice": voice, "format": "pcm16"},
        )
        a = r.choices[0].message.audio
        assert a.transcript and a.transcript.strip(), r
        pcm = base64.b64decode(a.data)
        assert pcm and len(pcm) % FRAME_BYTES == 0, len(pcm)
        said[voice] = (a.transcript, pcm)
    # One answer (greedy Thinker), three speakers: the same words, other audio.
    assert len({t for t, _ in said.values()}) == 1, said
    assert len({p for _, p in said.values()}) == 3


def test_streamed_chat_speaks_while_it_writes(client):
    stream = client.chat.completions.create(
        model="omnistream", messages=QUESTION, modalities=["text", "audio"],
        audio={"voice": "ryan", "format": "pcm16"}, stream=True,
    )
    transcript, chunks, text_after_audio = "", [], False
    for ev in stream:
        if not ev.choices:
            continue
        a = ev.choices[0].delta.audio
        if a is None:
            continue
        if a.transcript:
            transcript += a.transcript
            text_after_audio |= bool(chunks)
        if a.data:
            chunks.append(base64.b64decode(a.data))
    assert transcript.strip() and len(chunks) > 1, (transcript, len(chunks))
    assert sum(map(len, chunks)) % FRAME_BYTES == 0
    # Text kept coming after the first audio: the voice did not wait for the answer.
    assert text_after_audio


def test_realtime_turn_is_spoken(client):
    audio, done = realtime_answer(client, "eric")
    assert done.type == "response.done" and done.response.status == "completed", done
    assert done.response.output[0].content[0].transcript.strip()
    assert audio and len(audio) % FRAME_BYTES == 0, len(audio)


def clone_voice(client: OpenAI, extra: dict | None = None):
    """A voice cloned from the speaker fixture's clip (`extra`: more form fields)."""
    clip = pcm16_wav(load_safetensors(FIXTURES / "qwen3_tts" / "speaker" / "io.safetensors")["pcm"])
    return client.audio.voices.create(
        name="cloned", consent="cons_test", audio_sample=("clip.wav", clip, "audio/wav"), extra_body=extra,
    )


@pytest.mark.parametrize("in_context", [False, True])
def test_a_cloned_voice_speaks_chat_and_realtime(client, in_context):
    """A voice cloned once (`POST /v1/audio/voices`; with `ref_text`, in
    context) speaks the cascade's answers by its id, on chat completions and
    Realtime: other audio than the preset voices', whole frames; a voice id
    that is not there is refused, naming the field."""
    voice = clone_voice(client, {"ref_text": "This is how I sound."} if in_context else None)
    try:
        def chat(v):
            r = client.chat.completions.create(
                model="omnistream", messages=QUESTION, modalities=["text", "audio"],
                audio={"voice": v, "format": "pcm16"},
            )
            return r.choices[0].message.audio

        cloned, preset = chat(voice.id), chat("vivian")
        assert cloned.transcript == preset.transcript
        pcm = base64.b64decode(cloned.data)
        assert pcm and len(pcm) % FRAME_BYTES == 0 and pcm != base64.b64decode(preset.data)
        audio, done = realtime_answer(client, voice.id)
        assert done.type == "response.done" and done.response.status == "completed", done
        assert audio and len(audio) % FRAME_BYTES == 0
    finally:
        client.audio.voices.delete(voice.id)
    with pytest.raises(openai.BadRequestError) as e:
        chat(voice.id)
    assert e.value.body["param"] == "audio.voice", e.value.body
    _, err = realtime_answer(client, voice.id)
    assert err.type == "error" and err.error.param == "voice", err


def stream_answer(voice: str, key: str = "x"):
    """A typed turn on `/v1/stream` in `voice`: the answer's PCM and its
    `done`, or (None, the error) when `start` is refused."""
    with connect(WS_URL + "/v1/stream", additional_headers={"Authorization": f"Bearer {key}"}, open_timeout=30) as ws:
        ws.send(json.dumps({"type": "start", "sample_rate": 24000, "voice": voice}))
        started = json.loads(ws.recv(timeout=60))
        if started["type"] != "started":
            return None, started
        assert started["voice"] == voice, started
        ws.send(json.dumps({"type": "text", "text": "What is the capital of France?"}))
        audio = b""
        while True:
            m = ws.recv(timeout=300)
            if isinstance(m, bytes):
                audio += m
                continue
            e = json.loads(m)
            if e["type"] in ("done", "error"):
                return audio, e


def mulaw(pcm: np.ndarray) -> bytes:
    """G.711 μ-law of 16-bit samples (as a phone line carries them)."""
    x = pcm.astype(np.int32)
    sign = (x < 0).astype(np.int32) << 7
    x = np.minimum(np.abs(x), 32635) + 0x84
    exponent = np.floor(np.log2(x)).astype(np.int32) - 7
    mantissa = (x >> (exponent + 3)) & 0x0F
    return (~(sign | (exponent << 4) | mantissa) & 0xFF).astype(np.uint8).tobytes()


def question_8k() -> bytes:
    """"What is the capital of France?" in espeak-ng's voice, 8 kHz μ-law."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "q.wav")
        subprocess.run(["espeak-ng", "-w", path, "What is the capital of France?"], check=True)
        with wave.open(path) as w:
            rate, pcm = w.getframerate(), np.frombuffer(w.readframes(w.getnframes()), dtype="<i2")
    t = np.arange(0, len(pcm) * 8000 // rate) * (rate / 8000)
    return mulaw(np.interp(t, np.arange(len(pcm)), pcm))


def phone_answer(voice: str, key: str = "x"):
    """A Twilio Media Streams call on `/v1/phone/twilio` speaking in `voice`
    (a `<Parameter>`, with the `api_key` one): the question spoken, then
    silence, paced at real time until a second of the answer came back.
    That answer's μ-law bytes, or (None, the close reason) when the call is
    refused."""
    sid = "MZ" + "0" * 31 + "1"
    frame = 160  # 20 ms at 8 kHz
    question = b"\xff" * 8000 + question_8k()
    audio = question + b"\xff" * 8000 * 20
    heard = b""
    try:
        with connect(WS_URL + "/v1/phone/twilio", open_timeout=30) as ws:
            ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            ws.send(json.dumps({
                "event": "start", "sequenceNumber": "1", "streamSid": sid,
                "start": {
                    "accountSid": "AC" + "0" * 32, "streamSid": sid, "callSid": "CA" + "0" * 32,
                    "tracks": ["inbound"], "customParameters": {"voice": voice, "api_key": key},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
            }))
            due = time.monotonic()
            for i in range(0, len(audio), frame):
                if i >= len(question) and len(heard) >= 8000:
                    break
                ws.send(json.dumps({"event": "media", "streamSid": sid,
                                    "media": {"payload": base64.b64encode(audio[i:i + frame]).decode()}}))
                due += 0.02
                # What the server sent meanwhile: its answer, in marked frames.
                while (left := due - time.monotonic()) > 0:
                    try:
                        msg = json.loads(ws.recv(timeout=left))
                    except TimeoutError:
                        break
                    if msg["event"] == "media":
                        heard += base64.b64decode(msg["media"]["payload"])
    except ConnectionClosed as e:
        return None, e.rcvd.reason if e.rcvd else str(e)
    return heard, None


def webrtc_answer(voice: str) -> dict:
    """A WebRTC call (tests/python/webrtc_peer.py, aiortc) in `voice`: its
    report."""
    with tempfile.TemporaryDirectory() as d:
        out = subprocess.run(
            [sys.executable, str(Path(__file__).with_name("webrtc_peer.py")), "--url", URL.rstrip("/"),
             "--api-key", "x", "--voice", voice, "--codec", "opus", "--out", d],
            capture_output=True, text=True, timeout=600,
        )
    assert out.returncode == 0, out.stdout + out.stderr
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_a_cloned_voice_speaks_the_stream_and_calls(client):
    """The other transports take a cloned voice's id too: `/v1/stream`'s
    `start`, a Twilio call's `voice` `<Parameter>` and a WebRTC call's
    session speak the answer in it;
    only its owner's key may name it, and once deleted it is refused."""
    voice = clone_voice(client)
    try:
        audio, done = stream_answer(voice.id)
        assert done["type"] == "done" and done["status"] == "completed", done
        preset, _ = stream_answer("vivian")
        assert audio and len(audio) % FRAME_BYTES == 0 and audio != preset
        heard, refused = phone_answer(voice.id)
        assert refused is None and len(heard) >= 8000, (refused, len(heard or b""))
        call = webrtc_answer(voice.id)
        assert call["voice"] == voice.id and not call["errors"], call
        # (Cut at the peer's --max-tokens: incomplete, spoken all the same.)
        assert call["response_status"] in ("completed", "incomplete"), call
        assert call["answer_seconds"] > 0 and call["rms"] > 0, call
        # Another key's session does not see it.
        _, err = stream_answer(voice.id, key="another")
        assert err["type"] == "error" and err["code"] == "unsupported_voice", err
    finally:
        client.audio.voices.delete(voice.id)
    _, err = stream_answer(voice.id)
    assert err["type"] == "error" and "no cloned voice" in err["message"], err
    _, reason = phone_answer(voice.id)
    assert reason and reason.startswith("unsupported_voice"), reason


def test_unknown_voice_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="omnistream", messages=QUESTION, modalities=["text", "audio"],
            audio={"voice": "nobody", "format": "pcm16"},
        )
    assert "nobody" in str(e.value)
