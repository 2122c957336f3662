"""`omnistream serve --profile deploy/qwen3-tts-design-tiny.yaml`: a VoiceDesign
checkpoint (the tiny reference weights, no preset speakers), whose voice is the
one `instructions` describes. Through the OpenAI SDK (which requires a `voice`:
every OpenAI name means the described voice), the audio is the reference's for
a described voice (tests/fixtures/qwen3_tts, case `design`, which ends with the
codec's end code after three frames: so does the server's).

Run by tests/tests/qwen3_tts_server.rs."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import openai
import pytest
from openai import OpenAI

from fixtures import load_safetensors

FIX = Path(__file__).resolve().parents[2] / "tests" / "fixtures" / "qwen3_tts" / "generate"
URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
TOL = 1e-4




REF = load_safetensors(FIX / "io.safetensors")["design.wav"]
CASE = next(c for c in json.loads((FIX / "io.json").read_text())["cases"] if c["name"] == "design")


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=300)


@pytest.mark.parametrize("voice", ["alloy", "described"])
def test_the_described_voice_is_the_reference(client, voice):
    r = client.audio.speech.create(
        model="qwen3-tts", voice=voice, input=CASE["text"], instructions=CASE["instruct"],
        response_format="pcm", extra_body={"language": CASE["language"]},
    )
    got = np.frombuffer(r.content, dtype="<i2").astype(np.float32) / 32768.0
    assert len(got) == len(REF), (len(got), len(REF))
    assert float(np.abs(got - REF).max()) < TOL


def test_there_are_no_presets(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="qwen3-tts", voice="vivian", input="Hello.")
    assert e.value.body["param"] == "voice" and "described" in e.value.body["message"], e.value.body
