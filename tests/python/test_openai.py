"""The OpenAI-compatible HTTP API, through the official `openai` SDK.

Needs a running server: OMNISTREAM_URL=http://127.0.0.1:PORT (the Rust test
`tests/tests/server_http.rs` starts one and runs this file). Audio is checked
by ear: Whisper tiny.en must hear what the server says it said.
"""

from __future__ import annotations

import base64
import io
import json
import os
import sys
import time
import wave
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wer as wer_mod  # noqa: E402  (tests/python/wer.py)

URL = os.environ.get("OMNISTREAM_URL")
if not URL:
    pytest.skip("OMNISTREAM_URL is not set (start `omnistream serve`)", allow_module_level=True)

import openai  # noqa: E402
from openai import OpenAI  # noqa: E402

RATE = 24_000  # pcm16 / pcm / wav out of the API: 24 kHz mono s16le
# Whisper tiny.en on one short answer swings a lot ("France is" -> "Francis"):
# each clip must be recognisably the same words, and the WER over every clip of
# the run must be <= 10% (checked by the last test).
MAX_WER = 0.10
MAX_WER_ONE_CLIP = 0.35
HEARD: list[tuple[int, int, str, str]] = []  # (errors, reference words, said, heard) per clip
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
SENTENCE = "The weather today is sunny and warm, so we will walk to the park."


@pytest.fixture(scope="module")
def client() -> OpenAI:
    return OpenAI(
        base_url=URL.rstrip("/") + "/v1",
        api_key=os.environ.get("OMNISTREAM_API_KEY", "x"),
        max_retries=0,
        timeout=300,
    )


@pytest.fixture(scope="module")
def whisper():
    from faster_whisper import WhisperModel

    return WhisperModel(
        str(ROOT / "models" / "whisper-tiny-en"), device="cpu", compute_type="int8", local_files_only=True
    )


def heard(whisper, audio_path: Path) -> str:
    """What Whisper hears (the settings of wer.py)."""
    segments, _ = whisper.transcribe(
        str(audio_path), language="en", beam_size=5, condition_on_previous_text=False, vad_filter=False
    )
    return " ".join(s.text.strip() for s in segments).strip()


def assert_intelligible(whisper, audio_path: Path, reference: str) -> None:
    hyp = heard(whisper, audio_path)
    rate, errors, words = wer_mod.wer(reference, hyp)
    HEARD.append((errors, words, reference, hyp))
    assert rate <= MAX_WER_ONE_CLIP, f"WER {rate:.3f} > {MAX_WER_ONE_CLIP}: said {reference!r}, heard {hyp!r}"


def pcm16_to_wav(pcm: bytes, path: Path, rate: int = RATE) -> Path:
    assert len(pcm) % 2 == 0, "pcm16 must be whole samples"
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return path


def wav_pcm(data: bytes) -> bytes:
    """The samples of a 16-bit mono 24 kHz WAV (sized or streaming header)."""
    assert data[:4] == b"RIFF" and data[8:12] == b"WAVE", data[:16]
    assert int.from_bytes(data[22:24], "little") == 1, "mono"
    assert int.from_bytes(data[24:28], "little") == RATE
    assert int.from_bytes(data[34:36], "little") == 16
    i = data.index(b"data", 12)
    return data[i + 8 :]


def chat_messages(question: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]


# ---------------------------------------------------------------- chat


def test_streaming_chat_with_audio_is_intelligible(client, whisper, tmp_path):
    start = time.monotonic()
    stream = client.chat.completions.create(
        model="omnistream",
        messages=chat_messages("What is the capital of France?"),
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "pcm16"},
        stream=True,
        stream_options={"include_usage": True},
        max_tokens=40,
        temperature=0,
    )
    transcript, pcm, ids, expires, finish, usage = [], bytearray(), set(), [], None, None
    audio_chunks, first_audio_at = 0, None
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk"
        if chunk.usage is not None:
            usage = chunk.usage
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        assert not delta.content, "with audio, the text is the transcript"
        if delta.audio is not None:
            a = delta.audio
            if a.id:
                ids.add(a.id)
            if a.transcript:
                transcript.append(a.transcript)
            if a.data:
                first_audio_at = first_audio_at or time.monotonic() - start
                audio_chunks += 1
                pcm += base64.b64decode(a.data)
            if a.expires_at:
                expires.append(a.expires_at)
        if choice.finish_reason:
            finish = choice.finish_reason
    total = time.monotonic() - start
    text = "".join(transcript).strip()
    assert "paris" in text.lower(), text
    assert len(ids) == 1 and next(iter(ids)).startswith("audio_"), ids
    assert expires and expires[-1] > time.time(), expires
    assert finish in ("stop", "length")
    assert usage is not None and usage.completion_tokens > 0 and usage.prompt_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens
    assert len(pcm) > RATE * 2 // 2, f"only {len(pcm)} bytes of audio"
    # Streamed: audio arrived in pieces, the first well before the end.
    assert audio_chunks >= 2, audio_chunks
    assert first_audio_at < total, (first_audio_at, total)
    assert_intelligible(whisper, pcm16_to_wav(bytes(pcm), tmp_path / "stream.wav"), text)


def test_chat_with_audio_wav_in_one_response(client, whisper, tmp_path):
    r = client.chat.completions.create(
        model="omnistream",
        messages=chat_messages("What color is the sky on a clear day?"),
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
        max_tokens=30,
    )
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant"
    assert msg.audio is not None
    assert msg.audio.id.startswith("audio_")
    assert msg.audio.expires_at > time.time()
    assert msg.audio.transcript.strip(), "no transcript"
    data = base64.b64decode(msg.audio.data)
    pcm = wav_pcm(data)
    assert len(pcm) > RATE * 2 // 2, f"only {len(pcm)} bytes"
    path = tmp_path / "answer.wav"
    path.write_bytes(data)
    with wave.open(str(path)) as w:  # a whole file: sized header
        assert w.getframerate() == RATE and w.getnchannels() == 1
        assert w.getnframes() * 2 == len(pcm)
    assert_intelligible(whisper, path, msg.audio.transcript)
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.completion_tokens > 0


def test_chat_audio_opus_streams_ogg(client):
    stream = client.chat.completions.create(
        model="omnistream",
        messages=chat_messages("Say hello."),
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "opus"},
        stream=True,
        max_tokens=20,
    )
    data = bytearray()
    for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.audio and chunk.choices[0].delta.audio.data:
            data += base64.b64decode(chunk.choices[0].delta.audio.data)
    assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
    assert seconds_of_audio(bytes(data)) > 0.3


def test_text_only_chat_stops_at_the_thinker(client):
    r = client.chat.completions.create(
        model="omnistream",
        messages=[{"role": "user", "content": [{"type": "text", "text": "What is the capital of France?"}]}],
        modalities=["text"],
        max_completion_tokens=40,
        temperature=0,
        seed=7,
    )
    msg = r.choices[0].message
    assert msg.audio is None
    assert "Paris" in msg.content, msg.content
    assert r.usage.completion_tokens <= 40

    stream = client.chat.completions.create(
        model="omnistream",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        stream=True,
        max_tokens=40,
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert "Paris" in text, text
    assert all(c.choices[0].delta.audio is None for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_multi_turn_history_reaches_the_model(client):
    question = {"role": "user", "content": "What is my name?"}
    history = [
        {"role": "user", "content": "My name is Alice."},
        {"role": "assistant", "content": "Nice to meet you, Alice!"},
        question,
    ]
    with_history = client.chat.completions.create(model="omnistream", messages=history, max_tokens=30, temperature=0)
    alone = client.chat.completions.create(model="omnistream", messages=[question], max_tokens=30, temperature=0)
    assert "alice" in with_history.choices[0].message.content.lower(), with_history.choices[0].message.content
    assert "alice" not in alone.choices[0].message.content.lower(), alone.choices[0].message.content

    # An earlier spoken answer is referred to by its audio id, as in OpenAI's API.
    first = [{"role": "user", "content": "My name is Alice."}]
    r1 = client.chat.completions.create(
        model="omnistream",
        messages=first,
        modalities=["text", "audio"],
        audio={"voice": "joe", "format": "wav"},
        max_tokens=24,
    )
    spoken = r1.choices[0].message.audio
    r2 = client.chat.completions.create(
        model="omnistream",
        messages=first + [{"role": "assistant", "audio": {"id": spoken.id}}, question],
        max_tokens=24,
        temperature=0,
    )
    # The whole conversation was the prompt (the first turn's prompt reused
    # from the prefix cache), the spoken answer's transcript included.
    assert r2.usage.prompt_tokens > alone.usage.prompt_tokens + r1.usage.prompt_tokens, (r1.usage, r2.usage)
    assert r2.usage.prompt_tokens_details.cached_tokens >= r1.usage.prompt_tokens - 8, r2.usage

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model="omnistream",
            messages=[{"role": "assistant", "audio": {"id": "audio_unknown"}}, {"role": "user", "content": "Hi"}],
        )
    assert "audio_unknown" in e.value.body["message"]


# ---------------------------------------------------------------- speech


def seconds_of_audio(ogg: bytes) -> float:
    import av

    with av.open(io.BytesIO(ogg)) as f:
        n = 0
        rate = 0
        for frame in f.decode(audio=0):
            n += frame.samples
            rate = frame.sample_rate
    return n / rate if rate else 0.0


def test_speech_wav_pcm_opus(client, whisper, tmp_path):
    wav = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="wav")
    path = pcm16_to_wav(wav_pcm(wav.content), tmp_path / "speech.wav")
    assert_intelligible(whisper, path, SENTENCE)

    pcm = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="pcm").content
    assert len(pcm) % 2 == 0 and len(pcm) > RATE * 2, len(pcm)
    assert_intelligible(whisper, pcm16_to_wav(pcm, tmp_path / "speech_pcm.wav"), SENTENCE)

    opus = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="opus")
    assert opus.response.headers["content-type"].startswith("audio/ogg") or "opus" in opus.response.headers[
        "content-type"
    ]
    data = opus.content
    assert data[:4] == b"OggS" and b"OpusHead" in data[:64]
    assert seconds_of_audio(data) > 1.0
    path = tmp_path / "speech.opus"
    path.write_bytes(data)
    assert_intelligible(whisper, path, SENTENCE)

    # A missing voice is ours; speed changes the length.
    slow = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format="pcm", speed=0.5)
    assert len(slow.content) > 1.5 * len(pcm), (len(slow.content), len(pcm))


def test_speech_streams_as_it_is_made(client, whisper, tmp_path):
    text = " ".join([SENTENCE, "Then we will have lunch by the lake and read a book in the shade."] * 2)
    start = time.monotonic()
    arrivals, pcm = [], bytearray()
    with client.audio.speech.with_streaming_response.create(
        model="tts-1", voice="joe", input=text, response_format="pcm"
    ) as resp:
        assert resp.status_code == 200
        assert resp.headers.get("transfer-encoding") == "chunked"
        for chunk in resp.iter_bytes():
            arrivals.append(time.monotonic() - start)
            pcm += chunk
    assert len(arrivals) >= 3, arrivals
    # The first audio came well before the last: it left as it was made.
    assert arrivals[0] < 0.6 * arrivals[-1], arrivals
    assert_intelligible(whisper, pcm16_to_wav(bytes(pcm), tmp_path / "streamed.wav"), text)


def test_speech_sse_events(client):
    r = client.audio.speech.create(
        model="gpt-4o-mini-tts", voice="joe", input=SENTENCE, response_format="pcm", stream_format="sse"
    )
    assert r.response.headers["content-type"].startswith("text/event-stream")
    events = [json.loads(line[len("data: ") :]) for line in r.text.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert kinds[-1] == "speech.audio.done" and set(kinds[:-1]) == {"speech.audio.delta"}, kinds
    pcm = b"".join(base64.b64decode(e["audio"]) for e in events[:-1])
    assert len(pcm) % 2 == 0 and len(pcm) > RATE * 2
    usage = events[-1]["usage"]
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def short_spoken_answer(client, voice: str, fmt: str) -> bytes:
    """A chat answer of a few tokens, spoken: its audio bytes."""
    completion = client.chat.completions.create(
        model="omnistream",
        messages=chat_messages("Say hi."),
        modalities=["text", "audio"],
        audio={"voice": voice, "format": fmt},
        max_tokens=8,
    )
    return base64.b64decode(completion.choices[0].message.audio.data)


def assert_mp3_frames(data: bytes) -> None:
    """MPEG audio frames from the first byte (the frame sync word)."""
    assert data[0] == 0xFF and data[1] & 0xE0 == 0xE0, data[:4]


def test_speech_mp3_is_the_default_and_heard(client, whisper, tmp_path):
    """OpenAI's default speech format: MP3 (audio/mpeg), streamed, and what
    a decoder (PyAV, under faster-whisper) hears is the sentence."""
    r = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE)
    assert r.response.headers["content-type"] == "audio/mpeg"
    mp3 = r.content
    assert_mp3_frames(mp3)
    assert 4_000 < len(mp3) < 64_000, len(mp3)  # about 64 kbit/s
    path = tmp_path / "speech.mp3"
    path.write_bytes(mp3)
    assert_intelligible(whisper, path, SENTENCE)
    # The chat answer's audio as MP3 too.
    assert_mp3_frames(short_spoken_answer(client, "joe", "mp3"))


def test_speech_flac_streams_and_decodes(client, whisper, tmp_path):
    """`response_format: flac`: audio/flac, the header first, and what a
    decoder (FFmpeg's, through PyAV) makes of it is the sentence, as long
    as the WAV of the same request."""
    import av

    r = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="flac")
    assert r.response.headers["content-type"] == "audio/flac"
    flac = r.content
    assert flac[:4] == b"fLaC", flac[:8]
    path = tmp_path / "speech.flac"
    path.write_bytes(flac)
    with av.open(str(path)) as f:
        samples = sum(frame.samples for frame in f.decode(audio=0))
    wav = client.audio.speech.create(model="tts-1", voice="alloy", input=SENTENCE, response_format="wav").content
    wav_samples = (len(wav) - 44) // 2
    # (The voice draws its timing: the two takes differ a little.)
    assert abs(samples - wav_samples) <= 0.15 * wav_samples, (samples, wav_samples)
    assert_intelligible(whisper, path, SENTENCE)
    # The chat answer's audio as FLAC too.
    assert short_spoken_answer(client, "joe", "flac")[:4] == b"fLaC"


def test_openai_voice_names_speak_in_the_pipeline_voice(client):
    """Apps hard-code OpenAI's voice names: each speaks in one of the
    pipeline's voices (server.voice_aliases; by default the default voice),
    here exactly as `joe` does."""
    def speak(voice):
        r = client.audio.speech.create(model="tts-1", voice=voice, input="Hello there.", response_format="pcm")
        return r.content

    joe = speak("joe")
    assert len(joe) > RATE  # over half a second of pcm16
    for voice in ["alloy", "shimmer", "Cedar"]:
        assert speak(voice) == joe, voice
    assert short_spoken_answer(client, "coral", "wav")[:4] == b"RIFF"


# ---------------------------------------------------------------- errors


def test_invalid_requests_are_openai_errors(client):
    bad_chat = [
        dict(messages=chat_messages("Hi"), modalities=["text", "audio"], audio={"voice": "bob", "format": "wav"}),
        dict(messages=chat_messages("Hi"), modalities=["text", "audio"], audio={"voice": "joe", "format": "aac"}),
        dict(messages=chat_messages("Hi"), temperature=3),
        dict(messages=chat_messages("Hi"), max_tokens=-5),
        dict(messages=[]),
        dict(messages=[{"role": "robot", "content": "Hi"}]),
    ]
    for kw in bad_chat:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="omnistream", **kw)
        assert e.value.status_code == 400
        assert e.value.body["type"] == "invalid_request_error", e.value.body
        assert e.value.body["message"], e.value.body
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tts-1", voice="bob", input="Hi")
    assert "joe" in e.value.body["message"] and "alloy" in e.value.body["message"]
    for kw in [dict(response_format="aac"), dict(speed=5.0), dict(stream_format="ws")]:
        with pytest.raises(openai.BadRequestError):
            client.audio.speech.create(model="tts-1", voice="joe", input="Hi", **kw)
    with pytest.raises(openai.BadRequestError):
        client.audio.speech.create(model="tts-1", voice="joe", input="x" * 4097)
    # Piper speaks a sentence at once: no frame budget to set.
    with pytest.raises(openai.BadRequestError) as e:
        client.audio.speech.create(model="tts-1", voice="joe", input="Hi", extra_body={"max_tokens": 5})
    assert e.value.body["param"] == "max_tokens", e.value.body


def test_transcriptions_hear_wav_and_opus(client, tmp_path):
    """The server hears its own voice back through the transcription API."""
    for fmt, name in [("wav", "q.wav"), ("opus", "q.opus")]:
        audio = client.audio.speech.create(model="tts-1", voice="joe", input=SENTENCE, response_format=fmt)
        path = tmp_path / name
        path.write_bytes(audio.content)
        with path.open("rb") as f:
            t = client.audio.transcriptions.create(model="whisper-1", file=f)
        rate, _, _ = wer_mod.wer(SENTENCE, t.text)
        assert rate <= 0.15, (fmt, t.text)
        with path.open("rb") as f:
            text = client.audio.transcriptions.create(model="whisper-1", file=f, response_format="text")
        assert isinstance(text, str) and text.strip() == t.text, (text, t.text)
    bad = tmp_path / "bad.mp3"
    bad.write_bytes(b"ID3\x03not really an mp3")
    for kw in [dict(file=bad.open("rb")), dict(file=path.open("rb"), language="fr"),
               dict(file=path.open("rb"), response_format="srt")]:
        with pytest.raises(openai.BadRequestError) as e:
            client.audio.transcriptions.create(model="whisper-1", **kw)
        assert e.value.body["message"], e.value.body


# ---------------------------------------------------------------- tools

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
FORCE_WEATHER = {"type": "function", "function": {"name": "get_weather"}}
WEATHER_RESULT = '{"city": "Paris", "sky": "sunny", "temperature_c": 21}'


def test_chat_tool_call_round_trip(client):
    """A forced call (the default Thinker, SmolLM2-135M, rarely calls on its
    own: docs/api.md), its result back as a `tool` message, then the answer."""
    question = chat_messages("What is the weather in Paris?")
    r = client.chat.completions.create(
        model="omnistream", messages=question, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
        temperature=0, max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1, choice.message
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert call.id.startswith("call_")
    assert isinstance(json.loads(call.function.arguments), dict), call.function.arguments
    assert choice.message.content is None, "a call is not words"
    # Streamed: the same call as `delta.tool_calls`.
    stream = client.chat.completions.create(
        model="omnistream", messages=question, tools=[WEATHER_TOOL], tool_choice=FORCE_WEATHER,
        temperature=0, max_tokens=60, stream=True,
    )
    streamed, finish, words = {}, None, []
    for chunk in stream:
        if not chunk.choices:
            continue
        d = chunk.choices[0].delta
        if d.content:
            words.append(d.content)
        for tc in d.tool_calls or []:
            s = streamed.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            s["id"] = tc.id or s["id"]
            s["name"] += tc.function.name or ""
            s["arguments"] += tc.function.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and not "".join(words).strip(), (finish, words)
    assert list(streamed) == [0] and streamed[0]["name"] == "get_weather", streamed
    assert streamed[0]["arguments"] == call.function.arguments, "greedy: the same call"
    # The result goes back; the model answers in words (tools offered, its choice).
    r2 = client.chat.completions.create(
        model="omnistream",
        messages=question + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT},
        ],
        tools=[WEATHER_TOOL], tool_choice="none", temperature=0, max_tokens=40,
    )
    assert r2.choices[0].finish_reason in ("stop", "length")
    assert r2.choices[0].message.content.strip() and not r2.choices[0].message.tool_calls
    # The result reached the prompt: it is longer by the result's tokens.
    r3 = client.chat.completions.create(
        model="omnistream",
        messages=question + [
            {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
            {"role": "tool", "tool_call_id": call.id, "content": WEATHER_RESULT + " " + "Sunny. " * 20},
        ],
        temperature=0, max_tokens=1,
    )
    assert r3.usage.prompt_tokens > r2.usage.prompt_tokens + 20, (r3.usage, r2.usage)


TIME_TOOL = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current local time in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city"}},
            "required": ["city"],
        },
    },
}
# (question, the tool it needs, the city it names)
TOOL_QUESTIONS = [
    ("What is the weather in Paris?", "get_weather", "Paris"),
    ("How is the weather in Tokyo today?", "get_weather", "Tokyo"),
    ("Is it raining in London?", "get_weather", "London"),
    ("Weather for Berlin please.", "get_weather", "Berlin"),
    ("What's the weather like in Madrid?", "get_weather", "Madrid"),
    ("Tell me the weather in Rome.", "get_weather", "Rome"),
    ("What time is it in New York?", "get_time", "New York"),
    ("What is the time in Sydney?", "get_time", "Sydney"),
    ("Tell me the current time in Chicago.", "get_time", "Chicago"),
    ("What time is it now in Moscow?", "get_time", "Moscow"),
    ("Current time in Cairo?", "get_time", "Cairo"),
    ("What's the local time in Dubai?", "get_time", "Dubai"),
]


def test_forced_calls_are_the_right_tool_with_the_right_arguments(client):
    """How often the default Thinker (SmolLM2-135M) calls right, over 12
    questions and two tools (docs/api.md reports the counts): on its own
    (`auto`) it rarely calls, and then mostly writes a call that does not
    parse (a clear `invalid_tool_call` error); made to (`required`, or the function named),
    the server's grammar keeps the call to the tools' schemas, and the model
    picks the tool and fills in the city. Greedy, so the counts are the
    same each run; the floors leave room for float differences between
    CPUs."""
    counts = {"auto_calls": 0, "auto_invalid": 0, "required_tool": 0, "required_args": 0,
              "named_args": 0, "forced_invalid": 0}

    def call(choice):
        """The call made, or `None` where the model wrote one that does not
        parse (a clear `invalid_tool_call` error: inside a string argument
        the grammar allows anything, and a small model may ramble there
        until `max_tokens`)."""
        try:
            r = client.chat.completions.create(
                model="omnistream", messages=chat_messages(question), tools=[WEATHER_TOOL, TIME_TOOL],
                tool_choice=choice, temperature=0, max_tokens=60,
            )
        except openai.InternalServerError as e:
            assert e.body["code"] == "invalid_tool_call", e.body
            return None
        calls = r.choices[0].message.tool_calls or []
        assert len(calls) <= 1 and (choice == "auto" or r.choices[0].finish_reason == "tool_calls"), r
        return calls[0].function if calls else False

    for question, tool, city in TOOL_QUESTIONS:
        made = call("auto")
        counts["auto_calls"] += bool(made)
        counts["auto_invalid"] += made is None
        made = call("required")
        counts["forced_invalid"] += made is None
        if made:
            counts["required_tool"] += made.name == tool
            args = json.loads(made.arguments)
            assert list(args) == ["city"], f"not the schema's arguments: {args}"
            counts["required_args"] += args == {"city": city}
        made = call({"type": "function", "function": {"name": tool}})
        counts["forced_invalid"] += made is None
        if made:
            assert made.name == tool
            counts["named_args"] += json.loads(made.arguments) == {"city": city}
    print(f"forced tool calls over {len(TOOL_QUESTIONS)} questions: {counts}")
    assert counts["required_tool"] >= 11, counts
    assert counts["required_args"] >= 9 and counts["named_args"] >= 9, counts


def test_bad_tools_are_clear_errors(client):
    question = chat_messages("What is the weather in Paris?")
    for kw, param in [
        (dict(tools=[{"type": "function"}]), "tools"),
        (dict(tools=[{"type": "retrieval", "function": {"name": "x"}}]), "tools"),
        (dict(tools=[{"type": "function", "function": {"name": "no spaces allowed"}}]), "tools"),
        (dict(tools=[WEATHER_TOOL], tool_choice={"type": "function", "function": {"name": "nope"}}), "tool_choice"),
        (dict(tools=[WEATHER_TOOL], tool_choice="sometimes"), "tool_choice"),
        (dict(tool_choice="required"), "tool_choice"),
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="omnistream", messages=question, **kw)
        assert e.value.body["param"] == param, (kw, e.value.body)
    for messages in [
        question + [{"role": "tool", "content": "sunny"}],
        question + [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}],
        question + [{"role": "user", "content": "x", "tool_calls": []}],
    ]:
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model="omnistream", messages=messages)
        assert e.value.body["message"], e.value.body
    # "required" makes the model call; what it writes may not be a call of
    # these tools: then a clear server error, never spoken JSON.
    try:
        r = client.chat.completions.create(
            model="omnistream", messages=question, tools=[WEATHER_TOOL], tool_choice="required",
            temperature=0, max_tokens=40,
        )
        assert r.choices[0].message.tool_calls, r
    except openai.InternalServerError as e:
        assert e.body["code"] == "invalid_tool_call", e.body
    # The server is healthy after all of it.
    r = client.chat.completions.create(model="omnistream", messages=question, max_tokens=5)
    assert r.choices[0].message.content


def test_realtime_tool_round_trip_through_the_sdk(client):
    """The `openai` SDK's Realtime client: a forced call (its events, never
    spoken), the result as a `function_call_output` item, then a spoken answer."""
    tool = {k: v for k, v in WEATHER_TOOL["function"].items()} | {"type": "function"}
    with client.realtime.connect(model="omnistream") as conn:
        conn.session.update(session={
            "type": "realtime", "tools": [tool], "tool_choice": "auto",
            "instructions": "You are a helpful assistant. Answer in one short sentence.",
        })
        conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "What is the weather in Paris?"}],
        })
        conn.response.create(response={"tool_choice": {"type": "function", "name": "get_weather"}})
        kinds, audio, done, args_done, session = [], 0, None, None, None
        for ev in conn:
            kinds.append(ev.type)
            if ev.type == "session.updated":
                session = ev.session
            elif ev.type == "response.output_audio.delta":
                audio += len(ev.delta)
            elif ev.type == "response.function_call_arguments.done":
                args_done = ev
            elif ev.type == "error":
                raise AssertionError(ev)
            elif ev.type == "response.done":
                done = ev.response
                break
        assert session.tools[0].name == "get_weather", session
        assert done.status == "completed", done
        calls = [o for o in done.output if o.type == "function_call"]
        assert len(calls) == 1 and calls[0].name == "get_weather", done.output
        call = calls[0]
        assert args_done.call_id == call.call_id and args_done.arguments == call.arguments
        assert isinstance(json.loads(call.arguments), dict)
        assert kinds.index("response.output_item.added") < kinds.index("response.function_call_arguments.done")
        assert audio == 0, "a tool call is never spoken"
        # An output for a call that was never made is refused, naming the field.
        conn.conversation.item.create(item={"type": "function_call_output", "call_id": "call_nope", "output": "x"})
        ev = next(e for e in conn if e.type in ("error", "conversation.item.added"))
        assert ev.type == "error" and ev.error.param == "item.call_id", ev
        conn.conversation.item.create(item={
            "type": "function_call_output", "call_id": call.call_id, "output": WEATHER_RESULT,
        })
        conn.response.create(response={"tool_choice": "none"})
        transcript, audio, done, added = "", 0, None, None
        for ev in conn:
            if ev.type == "conversation.item.added" and ev.item.type == "function_call_output":
                added = ev.item
            elif ev.type == "response.output_audio_transcript.delta":
                transcript += ev.delta
            elif ev.type == "response.output_audio.delta":
                audio += len(base64.b64decode(ev.delta))
            elif ev.type == "error":
                raise AssertionError(ev)
            elif ev.type == "response.done":
                done = ev.response
                break
        assert added is not None and added.call_id == call.call_id
        assert done.status in ("completed", "incomplete"), done
        assert not [o for o in done.output if o.type == "function_call"]
        assert transcript.strip() and audio > RATE // 2, (transcript, audio)


def next_of(conn, *kinds):
    """The next event of one of `kinds` (an `error` is one too)."""
    return next(e for e in conn if e.type in kinds + ("error",))


def test_realtime_items_and_out_of_band_answers_through_the_sdk(client):
    """The `openai` SDK's Realtime client: items retrieved, truncated where
    the client stopped playing, deleted; an out-of-band answer with its own
    input that the conversation does not keep; refusals naming the field."""
    with client.realtime.connect(model="omnistream") as conn:
        conn.session.update(session={
            "type": "realtime", "instructions": "Answer in one short sentence.",
        })
        conn.conversation.item.create(item={
            "id": "item_question", "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Tell me about the sea."}],
        })
        conn.response.create()
        done = next_of(conn, "response.done")
        assert done.type == "response.done" and done.response.status == "completed", done
        answer = done.response.output[0]
        said = answer.content[0].transcript
        assert said and said.strip(), answer

        conn.conversation.item.retrieve(item_id=answer.id)
        got = next_of(conn, "conversation.item.retrieved")
        assert got.type == "conversation.item.retrieved", got
        assert got.item.role == "assistant" and got.item.content[0].transcript == said, got
        conn.conversation.item.retrieve(item_id="item_question")
        got = next_of(conn, "conversation.item.retrieved")
        assert got.item.content[0].text == "Tell me about the sea.", got

        # The client played 300 ms of the answer: the words of 300 ms stay.
        conn.conversation.item.truncate(item_id=answer.id, content_index=0, audio_end_ms=300)
        cut = next_of(conn, "conversation.item.truncated")
        assert cut.type == "conversation.item.truncated" and cut.audio_end_ms == 300, cut
        conn.conversation.item.retrieve(item_id=answer.id)
        kept = next_of(conn, "conversation.item.retrieved").item.content[0].transcript
        assert said.startswith(kept) and len(kept) < len(said), (kept, said)
        # Past the answer's audio: refused, naming the field.
        conn.conversation.item.truncate(item_id=answer.id, content_index=0, audio_end_ms=3_600_000)
        ev = next_of(conn, "conversation.item.truncated")
        assert ev.type == "error" and ev.error.param == "audio_end_ms", ev

        conn.conversation.item.delete(item_id="item_question")
        ev = next_of(conn, "conversation.item.deleted")
        assert ev.type == "conversation.item.deleted" and ev.item_id == "item_question", ev
        conn.conversation.item.retrieve(item_id="item_question")
        ev = next_of(conn, "conversation.item.retrieved")
        assert ev.type == "error" and ev.error.code == "item_not_found", ev
        assert ev.error.param == "item_id", ev

        # Out of band: its own input, text only, not kept.
        conn.response.create(response={
            "conversation": "none", "output_modalities": ["text"],
            "instructions": "Answer yes or no.",
            "input": [
                {"type": "item_reference", "id": answer.id},
                {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": "Was that about water?"}]},
            ],
        })
        done = next_of(conn, "response.done")
        assert done.type == "response.done" and done.response.status == "completed", done
        side = done.response.output[0]
        assert side.content[0].text.strip(), side
        conn.conversation.item.retrieve(item_id=side.id)
        ev = next_of(conn, "conversation.item.retrieved")
        assert ev.type == "error" and ev.error.code == "item_not_found", ev
        conn.response.create(response={"input": [{"type": "item_reference", "id": "item_gone"}]})
        ev = next_of(conn, "response.created")
        assert ev.type == "error" and ev.error.param == "response.input", ev

        # Over a WebSocket the client holds the audio: no server buffer to clear.
        conn.output_audio_buffer.clear()
        ev = next_of(conn, "output_audio_buffer.cleared")
        assert ev.type == "error" and "WebRTC" in ev.error.message, ev


def test_realtime_idle_timeout_prompts_a_silent_user(client):
    """`idle_timeout_ms`: after the answer has played, silence that long
    makes the server say `input_audio_buffer.timeout_triggered` and answer
    again on the conversation so far."""
    with client.realtime.connect(model="omnistream") as conn:
        conn.session.update(session={
            "type": "realtime", "max_output_tokens": 8,
            "audio": {"input": {"turn_detection": {"type": "server_vad", "idle_timeout_ms": 5000}}},
        })
        ev = next_of(conn, "session.updated")
        assert ev.type == "session.updated", ev
        assert ev.session.audio.input.turn_detection.idle_timeout_ms == 5000, ev.session
        conn.conversation.item.create(item={
            "type": "message", "role": "user",
            "content": [{"type": "input_text", "text": "Hello!"}],
        })
        conn.response.create()
        first = next_of(conn, "response.done")
        assert first.type == "response.done", first
        answered = time.monotonic()
        ev = next_of(conn, "input_audio_buffer.timeout_triggered")
        waited = time.monotonic() - answered
        assert ev.type == "input_audio_buffer.timeout_triggered", ev
        assert waited >= 4.5, f"triggered after {waited:.1f} s of silence"
        again = next_of(conn, "response.done")
        assert again.type == "response.done" and again.response.id != first.response.id, again
        # Out of bounds: refused, naming the field.
        conn.session.update(session={"type": "realtime", "audio": {"input": {
            "turn_detection": {"type": "server_vad", "idle_timeout_ms": 100}}}})
        ev = next_of(conn, "session.updated")
        assert ev.type == "error" and "turn_detection" in ev.error.param, ev


def test_realtime_speaks_g711_both_ways(client, whisper, tmp_path):
    """`audio/pcmu` in and out (what telephony bridges relay): a spoken
    question as 8 kHz μ-law, committed, heard, and the answer as μ-law deltas
    that decode to intelligible speech; `audio/pcma` and bad formats too."""
    import audioop  # noqa: PLC0415  (3.11's; G.711 for the test's own side)

    pcm24 = client.audio.speech.create(model="tts-1", voice="alloy", input="What do bees make?",
                                       response_format="pcm").content
    pcm8, _ = audioop.ratecv(pcm24, 2, 1, RATE, 8000, None)
    with client.realtime.connect(model="omnistream") as conn:
        conn.session.update(session={
            "type": "realtime", "instructions": SYSTEM,
            "audio": {"input": {"format": {"type": "audio/pcmu"}, "turn_detection": None},
                      "output": {"format": {"type": "audio/pcmu"}}},
        })
        ev = next_of(conn, "session.updated")
        assert ev.type == "session.updated", ev
        fmt = ev.session.model_dump()["audio"]
        assert fmt["input"]["format"]["type"] == "audio/pcmu" and fmt["output"]["format"]["type"] == "audio/pcmu"
        ulaw = audioop.lin2ulaw(pcm8, 2)
        for i in range(0, len(ulaw), 160):  # 20 ms frames
            conn.input_audio_buffer.append(audio=base64.b64encode(ulaw[i:i + 160]).decode())
        conn.input_audio_buffer.commit()
        conn.response.create()
        codes, transcript, heard_q = b"", "", None
        for ev in conn:
            if ev.type == "conversation.item.input_audio_transcription.completed":
                heard_q = ev.transcript
            elif ev.type == "response.output_audio.delta":
                codes += base64.b64decode(ev.delta)
            elif ev.type == "response.output_audio_transcript.delta":
                transcript += ev.delta
            elif ev.type == "error":
                raise AssertionError(ev)
            elif ev.type == "response.done":
                break
        assert heard_q and wer_mod.wer("What do bees make?", heard_q)[0] <= MAX_WER_ONE_CLIP, heard_q
        assert len(codes) > 8000, f"{len(codes)} bytes: under a second of μ-law"
        answer = pcm16_to_wav(audioop.ulaw2lin(codes, 2), tmp_path / "pcmu.wav", rate=8000)
        assert_intelligible(whisper, answer, transcript)
        # A-law for the next answer; a response may not pick its own format.
        conn.session.update(session={"type": "realtime", "audio": {"output": {"format": {"type": "audio/pcma"}}}})
        ev = next_of(conn, "session.updated")
        assert ev.type == "session.updated" and ev.session.model_dump()["audio"]["output"]["format"]["type"] == "audio/pcma"
        conn.response.create(response={"audio": {"output": {"format": {"type": "audio/pcm", "rate": 24000}}}})
        ev = next_of(conn, "response.done")
        assert ev.type == "error" and ev.error.param == "response.audio.output.format", ev
        for bad in [{"type": "audio/pcm", "rate": 16000}, {"type": "audio/pcmu", "rate": 16000}, "opus"]:
            conn.session.update(session={"type": "realtime", "audio": {"input": {"format": bad}}})
            ev = next_of(conn, "session.updated")
            assert ev.type == "error" and ev.error.code == "unsupported_audio_format", (bad, ev)
            assert ev.error.param == "session.audio.input.format", ev


def test_zz_word_error_rate_over_all_clips():
    """Runs last (pytest keeps file order): the aggregate over every clip heard."""
    assert len(HEARD) >= 4, f"only {len(HEARD)} clips were checked"
    errors = sum(h[0] for h in HEARD)
    words = sum(h[1] for h in HEARD)
    worst = sorted(HEARD, key=lambda h: -h[0])[:3]
    assert errors / words <= MAX_WER, (
        f"aggregate WER {errors}/{words} = {errors / words:.3f} > {MAX_WER}; the worst clips "
        + "; ".join(f"{e}/{w}: said {r!r}, heard {h!r}" for e, w, r, h in worst)
    )
