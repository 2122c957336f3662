#!/usr/bin/env python3
"""A real WebRTC peer (aiortc) for `omnistream serve`'s POST /v1/webrtc.

    python3 webrtc_peer.py --url http://127.0.0.1:8091 --codec opus|PCMU|PCMA \
        --prompt "What do bees make?" --out DIR [--voice V] [--hangup-after-audio-ms N]

Offers one sendrecv audio track (a 440 Hz tone as the microphone) restricted to
--codec and an `oai-events` data channel; POSTs the offer as application/sdp;
then, over the data channel, commits one second of microphone audio, asks
--prompt and records the answer arriving on the track. Prints one JSON object:
events seen, the transcript, and the received audio's frame timing (largest gap
between frames while the answer plays, whether RTP-derived timestamps only go
up); writes the answer's audio to DIR/answer.wav. With --hangup-after-audio-ms
it closes the peer connection that long after the first audio of the answer;
with --wait-for-hangup it waits after the answer for the server to hang up
(`hung_up_by_server`), printing `asked` when it asks (a test shuts the server
down then).
With --mic-wav FILE the microphone says FILE instead of humming: the session
turns `server_vad` on and the spoken question is found, heard (its transcript
in `mic_transcript`) and answered without a text prompt. With several files
the microphone says them in turn, 1.5 s of silence apart; each is one turn
(`mic_transcripts`, in order, found with `create_response` off), and the last
is answered on `response.create`.
"""
import argparse
import asyncio
import fractions
import json
import math
import sys
import time
import urllib.error
import urllib.request
import wave

import numpy as np
from aiortc import (
    MediaStreamTrack,
    RTCPeerConnection,
    RTCRtpSender,
    RTCSessionDescription,
)
import av


class Tone(MediaStreamTrack):
    """A microphone, 20 ms frames at 48 kHz, paced: it hums a 440 Hz tone,
    or with `speech` (mono float samples at 48 kHz) says that once after
    half a second, then stays silent."""

    kind = "audio"

    def __init__(self, speech=None):
        super().__init__()
        self.rate = 48000
        self.n = 960
        self.pts = 0
        self.start = None
        self.speech = speech
        self.speech_from = self.rate // 2
        self.quiet = False

    def say(self, speech):
        """Says `speech` (48 kHz float) from the next frame on."""
        self.speech = speech
        self.speech_from = self.pts

    async def recv(self):
        if self.start is None:
            self.start = time.monotonic()
        due = self.start + self.pts / self.rate
        delay = due - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        if self.quiet and self.speech is None:
            pcm = np.zeros(self.n, np.int16)
        elif self.speech is None:
            t = (np.arange(self.n) + self.pts) / self.rate
            pcm = (0.2 * 32767 * np.sin(2 * math.pi * 440 * t)).astype(np.int16)
        else:
            i = self.pts - self.speech_from
            x = np.zeros(self.n, np.float32)
            if i + self.n > 0 and i < len(self.speech):
                part = self.speech[max(i, 0):i + self.n]
                x[max(-i, 0):max(-i, 0) + len(part)] = part
            pcm = (np.clip(x, -1, 1) * 32767).astype(np.int16)
        frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.rate
        frame.pts = self.pts
        frame.time_base = fractions.Fraction(1, self.rate)
        self.pts += self.n
        return frame


def read_speech(path):
    """A WAV as mono float at 48 kHz."""
    with wave.open(path) as w:
        rate = w.getframerate()
        x = np.frombuffer(w.readframes(w.getnframes()), "<i2").astype(np.float32) / 32768
    n = int(len(x) * 48000 / rate)
    return np.interp(np.arange(n) * rate / 48000, np.arange(len(x)), x).astype(np.float32)


def post_offer(url, sdp, api_key):
    req = urllib.request.Request(
        url + "/v1/webrtc", data=sdp.encode(), method="POST",
        headers={"Content-Type": "application/sdp"},
    )
    if api_key:
        req.add_header("Authorization", "Bearer " + api_key)
    with urllib.request.urlopen(req, timeout=30) as r:
        return r.status, r.headers.get("Location"), r.read().decode()


async def run(args, out_dir):
    pc = RTCPeerConnection()
    result = {"codec": args.codec, "events": [], "errors": []}
    speech = None
    turns = len(args.mic_wav or [])
    if args.mic_wav:
        parts = []
        for path in args.mic_wav:
            parts.append(read_speech(path))
            parts.append(np.zeros(48000 * 3 // 2, np.float32))
        speech = np.concatenate(parts)
    mic = Tone(speech)
    mic.quiet = args.barge_in_wav is not None
    transceiver = pc.addTransceiver(mic, direction="sendrecv")
    caps = RTCRtpSender.getCapabilities("audio").codecs
    transceiver.setCodecPreferences([c for c in caps if c.mimeType.lower() == "audio/" + args.codec.lower()])
    dc = pc.createDataChannel("oai-events")
    events = asyncio.Queue()
    dc_open = asyncio.Event()
    dc.on("open", dc_open.set)

    @dc.on("message")
    def on_message(m):
        events.put_nowait(json.loads(m))

    frames = []  # (arrival s, pts, rate, mono int16 samples)
    audio_task = []

    @pc.on("track")
    def on_track(track):
        async def read():
            while True:
                try:
                    f = await track.recv()
                except Exception:
                    return
                a = f.to_ndarray()
                # Packed layouts interleave channels in one row.
                ch = len(f.layout.channels)
                a = a.reshape(-1, ch).mean(axis=1) if a.shape[0] == 1 else a.mean(axis=0)
                frames.append((time.monotonic(), f.pts, f.sample_rate, a.astype(np.int16), f.samples))
        audio_task.append(asyncio.ensure_future(read()))

    await pc.setLocalDescription(await pc.createOffer())
    status, location, answer = post_offer(args.url, pc.localDescription.sdp, args.api_key)
    result["status"] = status
    result["location"] = location
    await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
    try:
        await asyncio.wait_for(dc_open.wait(), 20)
    except asyncio.TimeoutError:
        raise RuntimeError(f"the events channel did not open (connection {pc.connectionState})") from None

    async def next_event(kind, timeout=120):
        while True:
            try:
                e = await asyncio.wait_for(events.get(), timeout)
            except asyncio.TimeoutError:
                raise RuntimeError(f"no {kind} within {timeout} s; events so far: {result['events']}; errors: {result['errors']}") from None
            result["events"].append(e["type"])
            if e["type"] == "error":
                result["errors"].append(e["error"])
            item = e.get("item") or {}
            if item.get("audio_seconds") is not None:
                result["mic_seconds"] = item["audio_seconds"]
            if e["type"] == kind or (isinstance(kind, tuple) and e["type"] in kind):
                return e

    created = await next_event("session.created")
    result["session_id"] = created["session"]["id"]
    if args.voice:
        dc.send(json.dumps({"type": "session.update", "session": {
            "audio": {"output": {"voice": args.voice}}}}))
        updated = await next_event("session.updated", 20)
        result["voice"] = updated["session"]["audio"]["output"]["voice"]
    if args.barge_in_wav:
        return await barge_in(args, pc, dc, mic, next_event, frames, audio_task, result)
    heard = ("conversation.item.input_audio_transcription.completed",
             "conversation.item.input_audio_transcription.failed")
    if speech is not None:
        # Hands-free: the server finds the turn, hears it and answers it.
        dc.send(json.dumps({"type": "session.update", "session": {
            "max_output_tokens": args.max_tokens,
            "audio": {"input": {"turn_detection": {
                "type": "server_vad", "create_response": turns == 1}}}}}))
        await next_event("session.updated", 20)
        result["mic_transcripts"] = []
        for _ in range(turns):
            stopped = await next_event("input_audio_buffer.speech_stopped", 60)
            stopped_at = time.monotonic()
            committed = await next_event("input_audio_buffer.committed", 20)
            result["committed_item"] = committed.get("item_id")
            t = await next_event(heard, 120)
            result["mic_transcripts"].append(t.get("transcript"))
        result["mic_transcript"] = t.get("transcript")
        result["speech_end_ms"] = stopped.get("audio_end_ms")
        asked = stopped_at
        if turns > 1:
            dc.send(json.dumps({"type": "response.create"}))
    else:
        # One second of microphone, then commit it: proves the track's audio arrived.
        await asyncio.sleep(1.2)
        dc.send(json.dumps({"type": "input_audio_buffer.commit"}))
        committed = await next_event("input_audio_buffer.committed", 20)
        result["committed_item"] = committed.get("item_id")
        t = await next_event(heard, 120)
        result["mic_transcript"] = t.get("transcript")

        dc.send(json.dumps({
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": args.prompt}]},
        }))
        asked = time.monotonic()
        dc.send(json.dumps({"type": "response.create",
                            "response": {"max_output_tokens": args.max_tokens}}))
        print("asked", flush=True)  # a test may act on it (a shutdown mid-answer)
    transcript = ""
    started_at = None
    while True:
        try:
            e = await asyncio.wait_for(events.get(), 300)
        except asyncio.TimeoutError:
            raise RuntimeError(f"the answer stalled; events so far: {result['events']}") from None
        result["events"].append(e["type"])
        t = e["type"]
        if t == "error":
            result["errors"].append(e["error"])
            if e["error"].get("code") == "server_shutting_down":
                break  # the server cut the answer and is hanging up
        elif t == "response.output_audio_transcript.delta":
            transcript += e["delta"]
        elif t == "output_audio_buffer.started":
            started_at = time.monotonic()
            result["started_after_ms"] = round((started_at - asked) * 1000)
            if args.hangup_after_audio_ms is not None:
                await asyncio.sleep(args.hangup_after_audio_ms / 1000)
                result["hung_up"] = True
                await pc.close()
                return result
        elif t == "response.done":
            result["response_status"] = e["response"]["status"]
        elif t == "output_audio_buffer.stopped":
            result["underrun_ms"] = e.get("underrun_ms")
            break
        if t == "response.done":
            result["generated_after_ms"] = round((time.monotonic() - asked) * 1000)
    stopped_at = time.monotonic()
    await asyncio.sleep(0.3)
    result["transcript"] = transcript

    # The answer: frames that arrived while it played.
    played = [f for f in frames
              if started_at is not None and started_at - 0.1 <= f[0] <= stopped_at + 0.3]
    result["frames_total"] = len(frames)
    result["frames_answer"] = len(played)
    rate = played[0][2] if played else 0
    result["sample_rate"] = rate
    # Steady state: past the first 10 frames (jitter buffer filling).
    steady = played[10:]
    gaps = [b[0] - a[0] for a, b in zip(steady, steady[1:])]
    result["max_gap_ms"] = round(max(gaps) * 1000, 1) if gaps else None
    # Frames missing from the stream: a step in the RTP-derived pts of more than
    # the frame before it (arrival times also move with the receiver's scheduling).
    steps = [(b[1] - a[1], a[4]) for a, b in zip(played, played[1:])
             if a[1] is not None and b[1] is not None]
    result["frames_lost"] = sum(max(0, round(d / n) - 1) for d, n in steps if n)
    pts = [f[1] for f in frames if f[1] is not None]
    result["pts_monotonic"] = all(b > a for a, b in zip(pts, pts[1:]))
    pcm = np.concatenate([f[3] for f in played]) if played else np.zeros(0, np.int16)
    result["answer_seconds"] = round(len(pcm) / rate, 3) if rate else 0
    result["rms"] = float(np.sqrt(np.mean(pcm.astype(np.float64) ** 2))) if len(pcm) else 0.0
    wav_path = f"{out_dir}/answer.wav"
    with wave.open(wav_path, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate or 8000)
        w.writeframes(pcm.astype("<i2").tobytes())
    result["wav"] = wav_path
    if args.wait_for_hangup:
        await wait_for_hangup(pc, dc, events, result)
    await pc.close()
    for task in audio_task:
        task.cancel()
    return result


async def wait_for_hangup(pc, dc, events, result, timeout=60):
    """The server shuts down: records its last events until it hangs up
    (the events channel or the connection closes)."""
    closed = asyncio.Event()

    @pc.on("connectionstatechange")
    def on_state():
        if pc.connectionState in ("closed", "failed", "disconnected"):
            closed.set()

    dc.on("close", closed.set)
    if dc.readyState == "closed":
        closed.set()
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            e = await asyncio.wait_for(events.get(), 0.2)
        except asyncio.TimeoutError:
            if closed.is_set():
                break
            continue
        result["events"].append(e["type"])
        if e["type"] == "error":
            result["errors"].append(e["error"])
    result["hung_up_by_server"] = closed.is_set()


async def barge_in(args, pc, dc, mic, next_event, frames, audio_task, result):
    """Asks --prompt with server_vad on, and a second into the answer the
    microphone says --barge-in-wav. Reports when the server saw the speech,
    when the last loud frame of the answer arrived after that (`late_ms`), the
    answer's whole transcript and what the conversation kept of it."""
    dc.send(json.dumps({"type": "session.update", "session": {
        "audio": {"input": {"turn_detection": {"type": "server_vad"}}}}}))
    await next_event("session.updated", 20)
    dc.send(json.dumps({
        "type": "conversation.item.create",
        "item": {"type": "message", "role": "user",
                 "content": [{"type": "input_text", "text": args.prompt}]},
    }))
    dc.send(json.dumps({"type": "response.create",
                        "response": {"max_output_tokens": args.max_tokens}}))
    created = await next_event("response.created", 60)
    rid = created["response"]["id"]
    transcript = ""
    while True:
        e = await next_event(("output_audio_buffer.started",
                              "response.output_audio_transcript.delta"), 120)
        if e["type"] == "output_audio_buffer.started":
            break
        transcript += e["delta"]
    started_at = time.monotonic()
    await asyncio.sleep(1.0)
    mic.say(read_speech(args.barge_in_wav))
    detected_at = None
    while True:
        e = await next_event(("input_audio_buffer.speech_started", "response.done",
                              "response.output_audio_transcript.delta",
                              "output_audio_buffer.cleared", "conversation.item.truncated"), 60)
        t = e["type"]
        if t == "input_audio_buffer.speech_started" and detected_at is None:
            detected_at = time.monotonic()
        elif t == "response.output_audio_transcript.delta" and e.get("response_id") == rid:
            transcript += e["delta"]
        elif t == "output_audio_buffer.cleared":
            result["cleared"] = True
        elif t == "conversation.item.truncated":
            result["truncated_audio_end_ms"] = e.get("audio_end_ms")
        elif t == "response.done" and e["response"]["id"] == rid:
            result["response_status"] = e["response"]["status"]
            out = e["response"].get("output") or [{}]
            result["kept"] = (out[0].get("content") or [{}])[0].get("transcript")
            break
    heard = await next_event("conversation.item.input_audio_transcription.completed", 60)
    heard_at = time.monotonic()
    result["mic_transcript"] = heard.get("transcript")
    result["transcript"] = transcript
    # Frames of the first answer: from its start until the interruption was
    # heard (the next answer cannot start before that).
    loud = [f[0] for f in frames
            if started_at - 0.1 <= f[0] <= heard_at
            and np.sqrt(np.mean(f[3].astype(np.float64) ** 2)) > 300]
    result["loud_frames"] = len(loud)
    if detected_at is not None:
        result["late_ms"] = round((max(loud) - detected_at) * 1000, 1) if loud else None
    await pc.close()
    for task in audio_task:
        task.cancel()
    return result


async def concurrent(args):
    """--concurrent N calls at once, each asking --prompt; one JSON line."""
    import os

    dirs = []
    for i in range(args.concurrent):
        d = os.path.join(args.out, f"call{i}")
        os.makedirs(d, exist_ok=True)
        dirs.append(d)
    results = await asyncio.gather(*(run(args, d) for d in dirs), return_exceptions=True)
    calls = [r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"} for r in results]
    return {"concurrent": args.concurrent, "calls": calls}


def hang_up(url, location, api_key):
    """DELETE the call's resource (the offer's Location): the HTTP status."""
    req = urllib.request.Request(url + location, method="DELETE")
    if api_key:
        req.add_header("Authorization", "Bearer " + api_key)
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


async def cycles(args):
    """Connect (offer, answer, events channel open, session.created), then
    close at once, --cycles times; with --delete, hang up over HTTP first
    (the statuses are reported)."""
    done, hangups = 0, []
    for _ in range(args.cycles):
        pc = RTCPeerConnection()
        pc.addTransceiver(Tone(), direction="sendrecv")
        dc = pc.createDataChannel("oai-events")
        got = asyncio.Event()
        dc.on("message", lambda m: got.set())
        await pc.setLocalDescription(await pc.createOffer())
        _, location, answer = post_offer(args.url, pc.localDescription.sdp, args.api_key)
        await pc.setRemoteDescription(RTCSessionDescription(sdp=answer, type="answer"))
        await asyncio.wait_for(got.wait(), 20)
        if args.delete:
            hangups.append(hang_up(args.url, location, args.api_key))
        await pc.close()
        done += 1
    return {"cycles": done, "hangups": hangups}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--codec", default="opus", choices=["opus", "PCMU", "PCMA"])
    p.add_argument("--prompt", default="What do bees make?")
    p.add_argument("--out", default=".")
    p.add_argument("--api-key")
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--voice", help="the session's voice (a cloned voice's id too)")
    p.add_argument("--hangup-after-audio-ms", type=int)
    p.add_argument("--mic-wav", nargs="+",
                   help="say these WAVs into the microphone in turn; turns by server_vad")
    p.add_argument("--barge-in-wav",
                   help="a second into the answer to --prompt, say this WAV over it (server_vad on)")
    p.add_argument("--wait-for-hangup", action="store_true",
                   help="after the answer, record events until the server hangs up")
    p.add_argument("--cycles", type=int, help="only connect and hang up, this many times")
    p.add_argument("--delete", action="store_true",
                   help="with --cycles: hang up with DELETE on the offer's Location")
    p.add_argument("--concurrent", type=int, help="this many calls at once (a load test)")
    args = p.parse_args()
    if args.cycles:
        job = cycles(args)
    elif args.concurrent:
        job = concurrent(args)
    else:
        job = run(args, args.out)
    try:
        result = asyncio.run(asyncio.wait_for(job, 600))
        if result is not None:
            print(json.dumps(result))
    except urllib.error.HTTPError as e:
        print(json.dumps({"error": f"HTTP {e.code}: {e.read().decode()}"}))
        sys.exit(1)
    except Exception as e:  # noqa: BLE001 - report whatever went wrong as JSON
        print(json.dumps({"error": f"{type(e).__name__}: {e}"}))
        sys.exit(1)


if __name__ == "__main__":
    main()
