"""`omnistream serve --profile deploy/qwen3-tts-base-tiny.yaml`: a Qwen3-TTS
Base checkpoint as the released ones are, with no preset speaker (the tiny
reference weights, tests/fixtures/qwen3_tts/model_base). The server starts
(its warm-up clones a voice), speaks only cloned voices, in context equal to
the reference's `generate_voice_clone`, and refuses a request with none,
naming `voice`.

Run by tests/tests/qwen3_tts_server.rs, which starts the server and sets
OMNISTREAM_URL."""

from __future__ import annotations

import base64
import json
import os

import numpy as np
import openai
import pytest
from openai import OpenAI

from fixtures import FIXTURES, load_safetensors, pcm16_wav

URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
FRAME = 1920
TOL = 1e-4
ICL = load_safetensors(FIXTURES / "qwen3_tts" / "icl" / "io.safetensors")
CASE = next(
    c for c in json.loads((FIXTURES / "qwen3_tts" / "icl" / "io.json").read_text())["cases"]
    if c["name"] == "icl_stream_long_ref"
)
CLIP = pcm16_wav(load_safetensors(FIXTURES / "qwen3_tts" / "encoder" / "io.safetensors")[f"pcm16_{CASE['ref_clip']}"])


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


def pcm(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype="<i2").astype(np.float32) / 32768.0


def metrics() -> str:
    import httpx

    return httpx.get(URL.rstrip("/") + "/metrics", timeout=30).text


def encodes() -> dict[str, int]:
    """`omnistream_voice_encode_seconds_count` by part, from /metrics."""
    text = metrics()
    prefix = "omnistream_voice_encode_seconds_count{part=\""
    return {
        line[len(prefix):].split('"')[0]: int(float(line.split()[-1]))
        for line in text.splitlines() if line.startswith(prefix)
    }


def test_it_speaks_only_cloned_voices(client):
    before = encodes()
    # No preset voice: a named one (OpenAI's too) is refused, as is none.
    for voice in ["alloy", "vivian"]:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.speech.create(model="qwen3-tts", voice=voice, input="Hello there.")
        assert e.value.body["param"] == "voice" and "cloned" in e.value.body["message"], e.value.body
    # A clip and its words: in context, the reference's audio after its cut.
    got = pcm(client.audio.speech.create(
        model="qwen3-tts", voice="alloy", input=CASE["text"], response_format="pcm",
        extra_body={"ref_audio": base64.b64encode(CLIP).decode(), "ref_text": CASE["ref_text"]},
    ).content)
    ref = ICL["icl_stream_long_ref.wav"]
    assert CASE["cut"] == CASE["ref_frames"] * FRAME
    assert len(got) % FRAME == 0 and len(got) >= len(ref), (len(got), len(ref))
    assert float(np.abs(got[: len(ref)] - ref).max()) < TOL
    # Made once, spoken by id.
    voice = client.audio.voices.create(
        name="mine", consent="c", audio_sample=("clip.wav", CLIP, "audio/wav"),
        extra_body={"ref_text": CASE["ref_text"]},
    )
    again = pcm(client.audio.speech.create(
        model="qwen3-tts", voice=voice.id, input=CASE["text"], response_format="pcm").content)
    assert again.shape == got.shape and float(np.abs(again - got).max()) < TOL
    # Two clips encoded, each part timed once a clip; the one spoken by id was not encoded again.
    after = encodes()
    assert {p: after.get(p, 0) - before.get(p, 0) for p in ("wait", "speaker", "codes")} == {
        "wait": 2, "speaker": 2, "codes": 2}, (before, after)


def batches() -> tuple[int, int]:
    """`omnistream_voice_encode_batch_clips`: (batches, clips in them)."""
    got = {}
    for line in metrics().splitlines():
        for key in ("_count", "_sum"):
            if line.startswith("omnistream_voice_encode_batch_clips" + key + " "):
                got[key] = int(float(line.split()[-1]))
    return got.get("_count", 0), got.get("_sum", 0)


def test_clips_encoded_together_are_each_as_alone(client):
    """Uploads at once share the encoders' batches (clips of different lengths,
    in context and not), and each voice speaks as the same clip uploaded alone,
    one at a time and all at once."""
    from concurrent.futures import ThreadPoolExecutor

    samples = load_safetensors(FIXTURES / "qwen3_tts" / "encoder" / "io.safetensors")[f"pcm16_{CASE['ref_clip']}"]
    other = load_safetensors(FIXTURES / "qwen3_tts" / "speaker" / "io.safetensors")["pcm"]  # 2 s
    clips = [  # (samples, in context); two in context of one length, told apart
        (samples, True), (samples[:60_000], True), (samples[4_000:64_000], True),
        (other, False), (samples[:64_321], False)]

    def upload(i: int) -> str:
        wav, in_context = pcm16_wav(clips[i][0]), clips[i][1]
        extra = {"ref_text": CASE["ref_text"]} if in_context else {}
        return client.audio.voices.create(
            name=f"clip{i}", consent="c", audio_sample=("clip.wav", wav, "audio/wav"), extra_body=extra).id

    def speak(voice: str) -> np.ndarray:
        return pcm(client.audio.speech.create(
            model="qwen3-tts", voice=voice, input=CASE["text"], response_format="pcm",
            extra_body={"max_tokens": 12}).content)

    alone = [speak(upload(i)) for i in range(len(clips))]
    # An in-context voice differs from every other, so its clip mixed up in a
    # batch shows. (The tiny checkpoint's x-vector voices speak alike: their
    # embeddings, batched and alone, are compared in the speaker encoder's
    # unit tests.)
    for i in range(len(alone)):
        for j in range(i):
            if clips[i][1] or clips[j][1]:
                assert float(np.abs(alone[i] - alone[j]).max()) > 1e-2, (i, j)
    before = batches()
    order = [i for _ in range(3) for i in range(len(clips))]
    with ThreadPoolExecutor(len(order)) as pool:
        ids = list(pool.map(upload, order))
    after = batches()
    assert after[1] - before[1] == len(order), (before, after)
    assert 1 <= after[0] - before[0] <= len(order), (before, after)
    for i, voice in zip(order, ids):
        got = speak(voice)
        assert got.shape == alone[i].shape and float(np.abs(got - alone[i]).max()) < TOL, i
    # Spoken at once, the in-context streams are seeded with their clips'
    # codes together (those of one length in one pass): each as alone.
    with ThreadPoolExecutor(len(order)) as pool:
        together = list(pool.map(speak, ids))
    for i, got in zip(order, together):
        assert got.shape == alone[i].shape and float(np.abs(got - alone[i]).max()) < TOL, i


def test_no_voice_at_all_is_refused(client):
    import httpx

    r = httpx.post(URL.rstrip("/") + "/v1/audio/speech", json={"input": "Hello there.", "response_format": "pcm"},
                   timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "voice", r.text
