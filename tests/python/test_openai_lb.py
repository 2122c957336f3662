"""The `openai` SDK through a load balancer in front of several gateways.

Needs OMNISTREAM_URL (HAProxy's address); `tests/tests/distributed.rs` starts
NATS, the stage processes, two gateways and HAProxy, then runs this file.
Each call may land on either gateway: every one must work the same.
"""

from __future__ import annotations

import os

import pytest

URL = os.environ.get("OMNISTREAM_URL")
if not URL:
    pytest.skip("OMNISTREAM_URL is not set", allow_module_level=True)

from openai import OpenAI  # noqa: E402


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


def test_streamed_chat_with_audio_through_the_balancer(client):
    for _ in range(2):  # round robin: both gateways
        stream = client.chat.completions.create(
            model="x",
            messages=[{"role": "user", "content": "What do bees make?"}],
            max_tokens=30,
            modalities=["text", "audio"],
            audio={"voice": "joe", "format": "pcm16"},
            stream=True,
        )
        transcript, audio_chunks = "", 0
        for chunk in stream:
            if not chunk.choices:
                continue
            audio = chunk.choices[0].delta.audio
            if audio is not None:
                transcript += audio.transcript or ""
                audio_chunks += 1 if audio.data else 0
        assert transcript.strip(), "no transcript"
        assert audio_chunks > 0, "no audio"


def test_speech_through_the_balancer(client):
    for _ in range(2):
        r = client.audio.speech.create(model="tts-1", voice="joe", input="Hello from behind the balancer.", response_format="pcm")
        assert len(r.content) > 24_000, len(r.content)  # more than half a second of 24 kHz pcm16


def test_models_and_text_chat(client):
    assert client.models.list().data
    for _ in range(2):
        r = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Say hi."}], max_tokens=8)
        assert r.choices[0].message.content
