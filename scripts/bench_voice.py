#!/usr/bin/env python3
"""End of speech -> first answer audio over /v1/realtime with server_vad.

    python3 scripts/bench_voice.py --url ws://127.0.0.1:8091 --wavs a.wav b.wav ... [--rounds 2]

For each WAV (any rate, mono 16-bit; a spoken question), opens a realtime
session with `server_vad` (silence_duration_ms as given), streams 0.3 s of
silence, the speech and 1.5 s of silence in 20 ms chunks paced in real time,
like a microphone, and times, from the moment the last speech sample was sent
(the end of speech: each file's trailing silence is cut first):
  stopped     input_audio_buffer.speech_stopped (VAD: includes the silence wait)
  heard       conversation.item.input_audio_transcription.completed (+ recognizer)
  first_audio the first response.output_audio.delta (+ Thinker, Talker, Code2Wav)
Answers are capped at --max-tokens. Prints one JSON object with every sample
and p50/p90 of each; exits 1 if a turn was not heard or not answered.
Requirements: tests/python/requirements.txt (websockets, numpy).
"""

import argparse
import asyncio
import base64
import json
import time
import wave

import numpy as np
import websockets

RATE = 24000
CHUNK = RATE // 50  # 20 ms


def load(path, to_rate=RATE):
    """A WAV's samples at `to_rate`, its trailing silence cut."""
    with wave.open(path) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    # The end of speech is the last sample above -40 dBFS: a file's own
    # trailing silence would otherwise count as time the server had.
    loud = np.flatnonzero(np.abs(x) > 0.01)
    x = x[: loud[-1] + 1] if len(loud) else x
    n = int(len(x) * to_rate / rate)
    return np.interp(np.arange(n) * rate / to_rate, np.arange(len(x)), x).astype(np.float32)


def pcm16(x):
    return (np.clip(x, -1, 1) * 32767).astype("<i2").tobytes()


async def one(url, speech, silence_ms, max_tokens):
    async with websockets.connect(f"{url}/v1/realtime", max_size=None) as ws:
        await ws.recv()  # session.created
        await ws.send(json.dumps({"type": "session.update", "session": {
            "max_output_tokens": max_tokens,
            "audio": {"input": {"turn_detection": {
                "type": "server_vad", "silence_duration_ms": silence_ms}}}}}))
        times = {}
        transcript = None

        async def reader():
            nonlocal transcript
            while True:
                m = json.loads(await ws.recv())
                t = m["type"]
                now = time.monotonic()
                if t == "input_audio_buffer.speech_stopped":
                    times.setdefault("stopped", now)
                elif t == "conversation.item.input_audio_transcription.completed":
                    times.setdefault("heard", now)
                    transcript = m.get("transcript")
                elif t == "response.output_audio.delta":
                    times.setdefault("first_audio", now)
                elif t == "response.done":
                    return
                elif t == "error":
                    raise RuntimeError(m)

        task = asyncio.create_task(reader())
        audio = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), speech,
                                np.zeros(RATE * 3 // 2, np.float32)])
        speech_end = RATE * 3 // 10 + len(speech)
        start = time.monotonic()
        end_of_speech = None
        for i in range(0, len(audio), CHUNK):
            due = start + i / RATE
            await asyncio.sleep(max(0.0, due - time.monotonic()))
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(pcm16(audio[i:i + CHUNK])).decode()}))
            if end_of_speech is None and i + CHUNK >= speech_end:
                end_of_speech = time.monotonic()
        await asyncio.wait_for(task, 120)
        out = {k: round((v - end_of_speech) * 1000) for k, v in times.items()}
        out["transcript"] = transcript
        return out


def pct(xs, q):
    return float(np.percentile(np.array(xs, dtype=float), q)) if xs else None


async def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", default="ws://127.0.0.1:8091")
    p.add_argument("--wavs", nargs="+", required=True)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--silence-ms", type=int, default=500)
    p.add_argument("--max-tokens", type=int, default=16)
    a = p.parse_args()
    samples = []
    for _ in range(a.rounds):
        for w in a.wavs:
            r = await one(a.url, load(w), a.silence_ms, a.max_tokens)
            r["wav"] = w
            samples.append(r)
    summary = {}
    for k in ("stopped", "heard", "first_audio"):
        xs = [s[k] for s in samples if k in s]
        summary[k] = {"n": len(xs), "p50_ms": pct(xs, 50), "p90_ms": pct(xs, 90)}
    ok = all("first_audio" in s and s.get("transcript") for s in samples)
    print(json.dumps({"silence_duration_ms": a.silence_ms, "summary": summary, "samples": samples}))
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    asyncio.run(main())
