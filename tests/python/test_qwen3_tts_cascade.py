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
import os

import openai
import pytest
from openai import OpenAI

from fixtures import FIXTURES, load_safetensors, pcm16_wav

URL = os.environ.get("OMNISTREAM_URL", "http://127.0.0.1:8000")
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


@pytest.mark.parametrize("in_context", [False, True])
def test_a_cloned_voice_speaks_chat_and_realtime(client, in_context):
    """A voice cloned once (`POST /v1/audio/voices`; with `ref_text`, in
    context) speaks the cascade's answers by its id, on chat completions and
    Realtime: other audio than the preset voices', whole frames; a voice id
    that is not there is refused, naming the field."""
    extra = {"ref_text": "This is how I sound."} if in_context else None
    voice = client.audio.voices.create(
        name="cloned", consent="cons_test", audio_sample=("clip.wav", pcm16_wav(load_safetensors(FIXTURES / "qwen3_tts" / "speaker" / "io.safetensors")["pcm"]), "audio/wav"), extra_body=extra,
    )
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


def test_unknown_voice_is_refused(client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="omnistream", messages=QUESTION, modalities=["text", "audio"],
            audio={"voice": "nobody", "format": "pcm16"},
        )
    assert "nobody" in str(e.value)
