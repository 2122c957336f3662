"""`omnistream serve --profile deploy/qwen3-tts-tiny.yaml` through the official
OpenAI Python SDK: Qwen3-TTS's architecture (the tiny random-weight checkpoint
qwen-tts made, tests/fixtures/qwen3_tts/), greedy, so the audio the server
streams is checked against the reference's own `generate` + speech tokenizer
(scripts/qwen3_tts/make_fixtures.py): the same 24 kHz samples (16-bit) for a
preset voice, and for a preset voice with `instructions` and a `language`.
Voices cloned from a reference clip (the reference's x-vector path): made once
with `client.audio.voices.create`, spoken by id, kept per API key; and the same
clip sent with the request (`ref_audio`). Then the bad requests: each a 400
naming its parameter, the server healthy.

The server runs with API keys `key-alice` and `key-bob` and a voice store of
its own (tests/tests/qwen3_tts_server.rs).

Run by tests/tests/qwen3_tts_server.rs, which starts the server and sets
OMNISTREAM_URL."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import wave
from pathlib import Path

import numpy as np
import openai
import pytest
import websockets
from openai import OpenAI

from fixtures import float_wav, load_safetensors, pcm16_wav

ROOT = Path(__file__).resolve().parents[2]
FIX = ROOT / "tests" / "fixtures" / "qwen3_tts" / "generate"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
RATE = 24_000
FRAME = 1920
# 16-bit output quantisation (1/32768) plus float rounding.
TOL = 1e-4




IO = load_safetensors(FIX / "io.safetensors")
CLIP = load_safetensors(FIX.parent / "speaker" / "io.safetensors")["pcm"]
CASES = {c["name"]: c for c in json.loads((FIX / "io.json").read_text())["cases"]}
# In-context cloning: the reference's `generate` with a clip's codes and words
# (icl/), the clip from the codec encoder's fixtures (16-bit, so a 16-bit WAV
# carries it exactly).
ICL = load_safetensors(FIX.parent / "icl" / "io.safetensors")
ICL_CASES = {c["name"]: c for c in json.loads((FIX.parent / "icl" / "io.json").read_text())["cases"]}
ENCODER = load_safetensors(FIX.parent / "encoder" / "io.safetensors")




def make_client(key: str) -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key=key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return make_client("key-alice")


@pytest.fixture(scope="module")
def bob() -> OpenAI:
    return make_client("key-bob")






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


def same_audio(a: np.ndarray, b: np.ndarray) -> bool:
    """Equal but for 16-bit rounding: the decoder's chunks follow the load, and
    a float sum over other chunk shapes may round one sample the other way."""
    return a.shape == b.shape and float(np.abs(a - b).max(initial=0.0)) < TOL


def test_preset_voice_is_the_reference(client):
    c = CASES["custom"]
    r = client.audio.speech.create(model="qwen3-tts", voice=c["speaker"], input=c["text"], response_format="wav")
    with wave.open(io.BytesIO(r.content)) as w:
        assert (w.getnchannels(), w.getsampwidth(), w.getframerate()) == (1, 2, RATE)
        samples = pcm(w.readframes(w.getnframes()))
    assert_reference(samples, "custom")
    # OpenAI's voice names speak in the default voice (the profile's: vivian).
    again = client.audio.speech.create(model="qwen3-tts", voice="alloy", input=c["text"], response_format="pcm")
    assert same_audio(pcm(again.content), samples)


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


def test_max_tokens_and_ignore_eos_set_the_length(client):
    """Benchmarks' extension: `max_tokens` codec frames, exactly that many with
    `ignore_eos` (past the text's end), and the frames before the cap are the
    reference's."""
    c = CASES["custom"]
    kw = dict(model="qwen3-tts", voice=c["speaker"], input=c["text"], response_format="pcm")
    capped = pcm(client.audio.speech.create(**kw, extra_body={"max_tokens": 3}).content)
    assert len(capped) == 3 * FRAME
    assert np.abs(capped - IO["custom.wav"][: 3 * FRAME]).max() < TOL
    frames = 60  # past the reference's 24-frame budget and the text's end
    exact = pcm(client.audio.speech.create(**kw, extra_body={"max_tokens": frames, "ignore_eos": True}).content)
    assert len(exact) == frames * FRAME
    assert_reference(exact, "custom")


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
        (dict(voice="ryan", extra_body={"ignore_eos": True}), "ignore_eos"),
        (dict(voice="ryan", extra_body={"max_tokens": 0}), "max_tokens"),
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


def test_a_cloned_voice_is_the_reference_xvector_path(client, bob):
    c = CASES["xvector_whole"]
    voice = client.audio.voices.create(
        name="Reference clip", consent="cons_test", audio_sample=("clip.wav", float_wav(CLIP), "audio/wav"),
    )
    assert voice.id.startswith("voice_") and voice.name == "Reference clip" and voice.object == "audio.voice"
    listed = client.get("/audio/voices", cast_to=object)
    assert [v["id"] for v in listed["data"]] == [voice.id]
    # Another key neither sees nor uses nor deletes it.
    assert bob.get("/audio/voices", cast_to=object)["data"] == []
    with pytest.raises(openai.BadRequestError) as e:
        bob.audio.speech.create(model="qwen3-tts", voice={"id": voice.id}, input=c["text"], response_format="pcm")
    assert e.value.body["param"] == "voice", e.value.body
    with pytest.raises(openai.NotFoundError):
        bob.audio.voices.delete(voice.id)
    # Spoken by id: the reference's audio for that clip's x-vector.
    by_id = client.audio.speech.create(
        model="qwen3-tts", voice={"id": voice.id}, input=c["text"], response_format="pcm",
        extra_body={"language": "english"},
    )
    assert_reference(pcm(by_id.content), "xvector_whole")
    # The same clip sent with the request: the same voice.
    inline = client.audio.speech.create(
        model="qwen3-tts", voice="vivian", input=c["text"], response_format="pcm",
        extra_body={"language": "english", "ref_audio": base64.b64encode(float_wav(CLIP)).decode()},
    )
    assert same_audio(pcm(inline.content), pcm(by_id.content))
    deleted = client.audio.voices.delete(voice.id)
    assert deleted.deleted and deleted.id == voice.id
    assert client.get("/audio/voices", cast_to=object)["data"] == []
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="qwen3-tts", voice=voice.id, input=c["text"], response_format="pcm")
    assert e.value.body["param"] == "voice"
    # One left behind, for the server's restart (tests/tests/qwen3_tts_server.rs).
    client.audio.voices.create(name="kept", consent="cons_test", audio_sample=("kept.wav", pcm16_wav(CLIP), "audio/wav"))


@pytest.mark.parametrize(
    "sample, code",
    [
        (pcm16_wav(np.zeros(RATE * 3, dtype=np.float32)), "audio_silent"),
        (pcm16_wav(CLIP[: RATE // 2]), "audio_too_short"),
        (pcm16_wav(np.tile(CLIP, 31)), "audio_too_long"),
        (b"this is not audio at all, just text", "unsupported_audio_format"),
        (b"RIFF\x10\x00\x00\x00WAVEjunk", "invalid_audio"),
    ],
)
def test_bad_reference_clips_are_refused(client, sample, code):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.voices.create(name="bad", consent="c", audio_sample=("x.wav", sample, "audio/wav"))
    assert e.value.body["code"] == code and e.value.body["param"] == "audio_sample", e.value.body


def assert_icl(samples: np.ndarray, case: str) -> None:
    """The reference decodes the clip's codes and the new ones together and
    cuts the clip's share; the server's decoder starts from the state after the
    clip's codes: the same samples (its cut is the clip's frames x 1920 here)."""
    c = ICL_CASES[case]
    assert c["cut"] == c["ref_frames"] * FRAME, c
    ref = ICL[f"{case}.wav"]
    assert len(samples) % FRAME == 0 and len(samples) >= len(ref), (len(samples), len(ref))
    err = float(np.abs(samples[: len(ref)] - ref).max())
    assert err < TOL, f"{case}: {err}"


def test_in_context_cloning_is_the_reference(client):
    """`ref_audio` with `ref_text`: the clip's codes and words in the prompt, as
    `generate_voice_clone` (its default, streamed layout); then the same voice
    made once (`ref_text` with the upload) and spoken by id, and over the speech
    stream with its text in pieces."""
    c = ICL_CASES["icl_stream_long_ref"]
    clip = pcm16_wav(ENCODER[f"pcm16_{c['ref_clip']}"])
    kw = dict(model="qwen3-tts", voice="alloy", input=c["text"], response_format="pcm")
    inline = pcm(client.audio.speech.create(
        **kw, extra_body={"ref_audio": base64.b64encode(clip).decode(), "ref_text": c["ref_text"]},
    ).content)
    assert_icl(inline, "icl_stream_long_ref")
    # Without the words it is the x-vector alone: another voice.
    alone = pcm(client.audio.speech.create(**kw, extra_body={"ref_audio": base64.b64encode(clip).decode()}).content)
    n = min(len(alone), len(inline))
    assert np.abs(alone[:n] - inline[:n]).max() > 1e-2
    voice = client.audio.voices.create(
        name="In context", consent="cons_test", audio_sample=("clip.wav", clip, "audio/wav"),
        extra_body={"ref_text": c["ref_text"]},
    )
    by_id = pcm(client.audio.speech.create(**{**kw, "voice": voice.id}).content)
    assert same_audio(by_id, inline)

    async def stream() -> np.ndarray:
        url = URL.replace("http", "ws", 1).rstrip("/") + "/v1/audio/speech/stream"
        auth = {"Authorization": "Bearer key-alice"}
        async with websockets.connect(url, additional_headers=auth, max_size=None) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {"voice": voice.id}}))
            ev = json.loads(await ws.recv())
            assert ev["type"] == "session.updated" and ev["session"]["voice"] == voice.id, ev
            words = c["text"].split(" ")
            for i, w in enumerate(words):
                await ws.send(json.dumps({"type": "input.text.delta", "delta": w + (" " if i + 1 < len(words) else "")}))
            await ws.send(json.dumps({"type": "input.done"}))
            audio = b""
            while True:
                ev = json.loads(await asyncio.wait_for(ws.recv(), 120))
                assert ev["type"] != "error", ev
                if ev["type"] == "speech.audio.delta":
                    audio += base64.b64decode(ev["audio"])
                if ev["type"] == "speech.audio.done":
                    return pcm(audio)

    # Its text in pieces: the prompt waits for the words that fill the clip's
    # codec side (here the whole text), then speaks as the request did.
    assert same_audio(asyncio.run(stream()), inline)
    client.audio.voices.delete(voice.id)


def test_bad_voice_requests_name_their_parameter(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.voices.create(name="", consent="c", audio_sample=("x.wav", float_wav(CLIP), "audio/wav"))
    assert e.value.body["param"] == "name"
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.voices.create(name="x" * 65, consent="c", audio_sample=("x.wav", float_wav(CLIP), "audio/wav"))
    assert e.value.body["param"] == "name"
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.voices.create(name="described", prompt="A deep voice.", type="prompt")
    assert e.value.body["param"] == "type"
    for extra, param in [
        ({"ref_text": "Hello."}, "ref_text"),
        ({"ref_audio": base64.b64encode(float_wav(CLIP)).decode(), "ref_text": "x" * 1001}, "ref_text"),
        # In context, every frame of the clip is in the prompt: 20 s at most
        # (22 s here, at 8 kHz to stay within the JSON body limit).
        ({"ref_audio": base64.b64encode(pcm16_wav(np.tile(CLIP, 11)[::3], 8000)).decode(), "ref_text": "Hi."},
         "ref_audio"),
        ({"ref_audio": "%%% not base64 %%%"}, "ref_audio"),
        ({"ref_audio": base64.b64encode(pcm16_wav(np.zeros(RATE * 3, dtype=np.float32))).decode()}, "ref_audio"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model="qwen3-tts", voice="ryan", input="Hi there.", extra_body=extra)
        assert e.value.body["param"] == param, (extra, e.value.body)
    # An oversized upload: 413 from its declared length, before it is read.
    with pytest.raises(openai.APIStatusError) as e:
        client.audio.voices.create(name="big", consent="c", audio_sample=("x.wav", b"RIFF" + bytes(11 << 20), "audio/wav"))
    assert e.value.status_code == 413 and e.value.body["param"] == "audio_sample", e.value.body
