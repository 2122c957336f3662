"""Agent frameworks nobody here wrote, pointed at omnistream as at OpenAI.

- The OpenAI Agents SDK's voice pipeline (`openai-agents`): speech to text,
  an agent with one function tool, text to speech, all on the server.
- Pipecat's OpenAI Realtime service (`pipecat-ai`): a spoken conversation
  over `/v1/realtime`, with the user barging in on the answer.
- Pipecat's Twilio serializer speaking Twilio Media Streams to
  `/v1/phone/twilio`: the question as μ-law, the answer heard, `clear` on
  barge-in, every `mark` echoed.

Needs a running server: OMNISTREAM_URL=http://127.0.0.1:PORT (the Rust test
`tests/tests/agents.rs` starts one and runs this file). Audio is checked by
ear: Whisper tiny.en must hear what was said.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))

import wer as wer_mod  # noqa: E402  (tests/python/wer.py)

URL = os.environ.get("OMNISTREAM_URL")
if not URL:
    pytest.skip("OMNISTREAM_URL is not set (start `omnistream serve`)", allow_module_level=True)

from openai import AsyncOpenAI, OpenAI  # noqa: E402

RATE = 24_000
MAX_WER = 0.35  # one short clip, Whisper tiny.en (see test_openai.py)
SYSTEM = "You are a helpful assistant. Answer in one short sentence."
WS_URL = URL.replace("http://", "ws://").rstrip("/")


@pytest.fixture(scope="module")
def whisper():
    from faster_whisper import WhisperModel

    return WhisperModel(
        str(ROOT / "models" / "whisper-tiny-en"), device="cpu", compute_type="int8", local_files_only=True
    )


def heard(whisper, pcm16: bytes, rate: int = RATE) -> str:
    """What Whisper hears in 16-bit mono PCM (the settings of wer.py)."""
    audio = np.frombuffer(pcm16, dtype=np.int16).astype(np.float32) / 32768.0
    if rate != 16_000:
        # Whisper takes 16 kHz; linear interpolation is enough for speech.
        t = np.arange(0, len(audio) * 16_000 // rate) * (rate / 16_000)
        audio = np.interp(t, np.arange(len(audio)), audio).astype(np.float32)
    segments, _ = whisper.transcribe(
        audio, language="en", beam_size=5, condition_on_previous_text=False, vad_filter=False
    )
    return " ".join(s.text.strip() for s in segments).strip()


def assert_heard(whisper, pcm16: bytes, reference: str) -> None:
    hyp = heard(whisper, pcm16)
    rate, _, _ = wer_mod.wer(reference, hyp)
    assert rate <= MAX_WER, f"WER {rate:.3f} > {MAX_WER}: said {reference!r}, heard {hyp!r}"


def spoken(text: str) -> bytes:
    """`text` in the server's voice: 24 kHz 16-bit PCM."""
    client = OpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0, timeout=120)
    return client.audio.speech.create(model="tts-1", voice="alloy", input=text, response_format="pcm").content


# ------------------------------------------------------------ OpenAI Agents SDK


def test_agents_sdk_voice_pipeline_calls_the_tool_and_speaks_the_answer(whisper):
    """The Agents SDK's `VoicePipeline` with a `SingleAgentVoiceWorkflow`:
    the question is transcribed, the agent calls `get_weather` with the city
    it heard (the tool choice forces a call, the server's grammar keeps its
    arguments to the schema; the SDK resets the choice after the call), the
    tool's result is put into words, and the words are spoken."""
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, function_tool, set_tracing_disabled
    from agents.voice import (
        AudioInput,
        OpenAIVoiceModelProvider,
        SingleAgentVoiceWorkflow,
        TTSModelSettings,
        VoicePipeline,
        VoicePipelineConfig,
    )

    set_tracing_disabled(True)  # no traces to api.openai.com
    calls: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city.

        Args:
            city: The city.
        """
        calls.append(city)
        return f"It is sunny and 21 degrees in {city}."

    class Workflow(SingleAgentVoiceWorkflow):
        """The SDK's workflow, keeping what it heard and what it said."""

        heard: list[str] = []
        said: list[str] = []

        async def run(self, transcription: str):
            self.heard.append(transcription)
            async for text in super().run(transcription):
                self.said.append(text)
                yield text

    async def main() -> bytes:
        client = AsyncOpenAI(base_url=URL.rstrip("/") + "/v1", api_key="x", max_retries=0)
        agent = Agent(
            name="Weather",
            instructions=SYSTEM,
            model=OpenAIChatCompletionsModel(model="omnistream", openai_client=client),
            tools=[get_weather],
            model_settings=ModelSettings(tool_choice="get_weather", temperature=0, max_tokens=40),
        )
        workflow = Workflow(agent)
        pipeline = VoicePipeline(
            workflow=workflow,
            config=VoicePipelineConfig(
                model_provider=OpenAIVoiceModelProvider(openai_client=client),
                tracing_disabled=True,
                tts_settings=TTSModelSettings(voice="alloy"),
            ),
        )
        question = np.frombuffer(spoken("What is the weather in Paris?"), dtype=np.int16)
        result = await pipeline.run(AudioInput(buffer=question, frame_rate=RATE))
        audio, lifecycle = [], []
        async for ev in result.stream():
            if ev.type == "voice_stream_event_audio" and ev.data is not None:
                audio.append(ev.data.astype(np.int16).tobytes())
            elif ev.type == "voice_stream_event_lifecycle":
                lifecycle.append(ev.event)
            elif ev.type == "voice_stream_event_error":
                raise AssertionError(ev.error)
        assert lifecycle[0] == "turn_started" and "turn_ended" in lifecycle, lifecycle
        return b"".join(audio), workflow

    audio, workflow = asyncio.run(main())
    assert wer_mod.wer("What is the weather in Paris?", workflow.heard[0])[0] <= MAX_WER, workflow.heard
    assert calls == ["Paris"], f"the tool got {calls}"
    said = "".join(workflow.said).strip()
    assert "sunny" in said.lower(), f"the tool's result is not in the answer: {said!r}"
    assert "<tool" not in said, said
    assert len(audio) > RATE, "under half a second of answer"
    assert_heard(whisper, audio, said)


# ------------------------------------------------------------ Pipecat


class Clock:
    def __init__(self):
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


def test_pipecat_realtime_conversation_with_a_barge_in(whisper):
    """Pipecat's `OpenAIRealtimeLLMService` in a pipeline: a microphone at
    real time (silence, then a question), the answer's audio, the user
    speaking over it (server VAD cuts the answer; Pipecat truncates the item
    where its playback stopped), and the second question answered, heard."""
    from pipecat.frames.frames import (
        EndFrame,
        ErrorFrame,
        InputAudioRawFrame,
        LLMFullResponseEndFrame,
        LLMFullResponseStartFrame,
        StartFrame,
        TTSAudioRawFrame,
        TTSTextFrame,
    )
    from pipecat.pipeline.pipeline import Pipeline
    from pipecat.pipeline.runner import PipelineRunner
    from pipecat.pipeline.task import PipelineParams, PipelineTask
    from pipecat.processors.frame_processor import FrameProcessor
    from pipecat.services.openai.realtime import events
    from pipecat.services.openai.realtime.llm import OpenAIRealtimeLLMService

    story = spoken("Tell me a long story about a dragon who lived in the mountains.")
    capital = spoken("What is the capital of France?")
    clock = Clock()
    log: list[tuple[float, str, object]] = []

    class Microphone(FrameProcessor):
        """20 ms of PCM every 20 ms: what was queued, else silence."""

        def __init__(self):
            super().__init__()
            self.queue = bytearray()
            self.task = None

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, StartFrame) and self.task is None:
                self.task = self.create_task(self.run())
            await self.push_frame(frame, direction)

        async def run(self):
            n = RATE * 2 // 50
            due = time.monotonic()
            while True:
                chunk = bytes(self.queue[:n]).ljust(n, b"\0")
                del self.queue[:n]
                await self.push_frame(InputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
                due += 0.02
                await asyncio.sleep(max(0.0, due - time.monotonic()))

    class Speaker(FrameProcessor):
        """Collects each answer: its audio and its transcript."""

        def __init__(self):
            super().__init__()
            self.answers: list[dict] = []
            self.errors: list[str] = []

        async def process_frame(self, frame, direction):
            await super().process_frame(frame, direction)
            if isinstance(frame, LLMFullResponseStartFrame):
                self.answers.append({"audio": bytearray(), "text": "", "ended": None})
                log.append((clock(), "answer", len(self.answers)))
            elif isinstance(frame, TTSAudioRawFrame) and self.answers:
                assert frame.sample_rate == RATE
                self.answers[-1]["audio"] += frame.audio
            elif isinstance(frame, TTSTextFrame) and self.answers:
                self.answers[-1]["text"] += frame.text
            elif isinstance(frame, LLMFullResponseEndFrame) and self.answers:
                self.answers[-1]["ended"] = clock()
                log.append((clock(), "answer ended", len(self.answers)))
            elif isinstance(frame, ErrorFrame):
                self.errors.append(frame.error)
            await self.push_frame(frame, direction)

    async def main():
        llm = OpenAIRealtimeLLMService(
            api_key="x",
            base_url=WS_URL + "/v1/realtime",
            settings=OpenAIRealtimeLLMService.Settings(
                session_properties=events.SessionProperties(
                    instructions=SYSTEM,
                    audio=events.AudioConfiguration(
                        input=events.AudioInput(turn_detection=events.TurnDetection(silence_duration_ms=500))
                    ),
                )
            ),
        )
        mic, speaker = Microphone(), Speaker()
        task = PipelineTask(Pipeline([mic, llm, speaker]), params=PipelineParams(allow_interruptions=True))

        async def until(cond, limit: float, what: str):
            end = time.monotonic() + limit
            while not cond():
                assert time.monotonic() < end, f"timed out waiting for {what}: {log}, {speaker.errors}"
                await asyncio.sleep(0.02)

        async def script():
            try:
                await asyncio.sleep(1.0)
                mic.queue += story
                # Barge in a second into the answer's audio.
                await until(
                    lambda: speaker.answers and len(speaker.answers[0]["audio"]) >= RATE * 2, 60, "the first answer"
                )
                log.append((clock(), "barge-in", None))
                mic.queue += capital
                await until(lambda: speaker.answers[0]["ended"] is not None, 10, "the first answer to be cut")
                await until(
                    lambda: len(speaker.answers) >= 2 and speaker.answers[1]["ended"] is not None,
                    60,
                    "the second answer",
                )
                await asyncio.sleep(0.5)  # anything late from either answer
            finally:
                await task.queue_frame(EndFrame())

        asyncio.get_running_loop().create_task(script())
        await PipelineRunner(handle_sigint=False).run(task)
        return speaker

    speaker = asyncio.run(asyncio.wait_for(main(), 180))
    assert not speaker.errors, f"errors from the server: {speaker.errors}"
    first, second = speaker.answers[0], speaker.answers[1]
    barge_in = next(t for t, what, _ in log if what == "barge-in")
    # The story was cut soon after the user spoke: server VAD needs ~250 ms
    # of speech, then the answer stops.
    assert first["ended"] - barge_in < 3.0, log
    assert len(first["audio"]) < RATE * 2 * 10, "the cut answer kept coming"
    assert len(second["audio"]) > RATE, f"second answer too short: {second}"
    assert "paris" in second["text"].lower(), second["text"]
    assert_heard(whisper, bytes(second["audio"]), second["text"])


def test_pipecat_twilio_serializer_phone_call(whisper):
    """A Twilio Media Streams call on `/v1/phone/twilio`, its media made and
    read by Pipecat's `TwilioFrameSerializer` (8 kHz μ-law, base64): the
    caller asks, hears the answer, speaks over the next one (the server sends
    `clear`), and echoes each `mark` when the audio before it has played, as
    Twilio does."""
    import websockets
    from pipecat.frames.frames import InputAudioRawFrame, OutputAudioRawFrame
    from pipecat.serializers.twilio import TwilioFrameSerializer

    sid, call = "MZ" + "0" * 31 + "1", "CA" + "0" * 31 + "1"
    story = spoken("Tell me a long story about a dragon who lived in the mountains.")
    capital = spoken("What is the capital of France?")

    async def main():
        ser = TwilioFrameSerializer(stream_sid=sid, params=TwilioFrameSerializer.InputParams(auto_hang_up=False))
        # What the serializer reads of a pipeline's setup: the PCM rate.
        await ser.setup(SimpleNamespace(audio_in_sample_rate=RATE))
        answers: dict[str, bytearray] = {}  # response id -> its audio (a mark names its response)
        unmarked = bytearray()  # audio since the last mark
        last_media = [0.0]
        marks: list[str] = []
        clears: list[float] = []
        queue = bytearray()
        playing_until = [0.0]  # when what was received has played
        pending: list[tuple[float, str]] = []  # marks to echo, when due
        trace: list[tuple[float, str]] = []  # what happened, for a failure's message
        clock = Clock()
        async with websockets.connect(WS_URL + "/v1/phone/twilio", max_size=2**22) as ws:
            await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await ws.send(json.dumps({
                "event": "start", "sequenceNumber": "1", "streamSid": sid,
                "start": {
                    "accountSid": "AC" + "0" * 32, "streamSid": sid, "callSid": call,
                    "tracks": ["inbound"], "customParameters": {},
                    "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
                },
            }))

            async def microphone():
                n = RATE * 2 // 50
                due = time.monotonic()
                while True:
                    chunk = bytes(queue[:n]).ljust(n, b"\0")
                    del queue[:n]
                    msg = await ser.serialize(OutputAudioRawFrame(audio=chunk, sample_rate=RATE, num_channels=1))
                    if msg:
                        await ws.send(msg)
                    now = time.monotonic()
                    for due_at, name in [p for p in pending if p[0] <= clock()]:
                        pending.remove((due_at, name))
                        trace.append((round(clock(), 2), f"echo {name}"))
                        await ws.send(json.dumps({"event": "mark", "streamSid": sid, "mark": {"name": name}}))
                    due += 0.02
                    await asyncio.sleep(max(0.0, due - now))

            async def listen():
                async for raw in ws:
                    msg = json.loads(raw)
                    kind = msg.get("event")
                    trace.append((round(clock(), 2), kind if kind != "mark" else msg["mark"]["name"]))
                    if kind == "media":
                        frame = await ser.deserialize(raw)
                        if frame is None:
                            continue  # the resampler holds a short chunk back
                        assert isinstance(frame, InputAudioRawFrame) and frame.sample_rate == RATE
                        unmarked.extend(frame.audio)
                        last_media[0] = clock()
                        seconds = len(frame.audio) / 2 / RATE
                        playing_until[0] = max(playing_until[0], clock()) + seconds
                    elif kind == "mark":
                        name = msg["mark"]["name"]
                        marks.append(name)
                        answers.setdefault(name.split(":")[0], bytearray()).extend(unmarked)
                        unmarked.clear()
                        pending.append((max(playing_until[0], clock()), name))
                    elif kind == "clear":
                        clears.append(clock())
                        playing_until[0] = clock()
                        unmarked.clear()
                        # Twilio drops its buffer and echoes the pending marks now.
                        for i, (_, name) in enumerate(pending):
                            pending[i] = (0.0, name)

            async def until(cond, limit, what):
                end = time.monotonic() + limit
                while not cond():
                    for t in tasks:  # a failed microphone or listener fails the test
                        if t.done():
                            t.result()
                    assert time.monotonic() < end, f"timed out waiting for {what}: {trace[-40:]}"
                    await asyncio.sleep(0.02)

            tasks = [asyncio.create_task(microphone()), asyncio.create_task(listen())]
            try:
                await asyncio.sleep(1.0)
                queue += story
                first = lambda: next(iter(answers.values()), b"")  # noqa: E731
                await until(lambda: len(first()) >= RATE * 2 * 2, 60, "the first answer")
                barge_in = clock()
                trace.append((round(barge_in, 2), "barge-in"))
                queue += capital
                await until(lambda: clears, 10, "a clear")
                await until(
                    lambda: len(answers) >= 2 and not pending and clock() - last_media[0] > 1.5,
                    60,
                    "the second answer to play out",
                )
                await asyncio.sleep(0.5)
                await ws.send(json.dumps({"event": "stop", "streamSid": sid, "stop": {"callSid": call}}))
            finally:
                for t in tasks:
                    t.cancel()
            return answers, marks, clears, barge_in

    answers, marks, clears, barge_in = asyncio.run(asyncio.wait_for(main(), 180))
    assert clears[0] - barge_in < 3.0, (clears, barge_in)
    assert len(answers) == 2, f"answers by response: {list(answers)}"
    second = bytes(list(answers.values())[-1])
    assert len(second) > RATE, "second answer too short"
    hyp = heard(whisper, second)
    assert "paris" in hyp.lower(), f"heard {hyp!r}"
