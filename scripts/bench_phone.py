#!/usr/bin/env python3
"""Concurrent phone calls over Twilio Media Streams (/v1/phone/twilio) or SIP.

    python3 scripts/bench_phone.py --url ws://127.0.0.1:8097 --wav q.wav \
        --concurrent 1 2 4 [--lead-ms 0 1000] [--max-tokens 40] [--api-key KEY]
    python3 scripts/bench_phone.py --url ws://127.0.0.1:8097 --wav q.wav \
        --sip 127.0.0.1:5070 --hook-port 8098 --concurrent 1 2 4

With --sip, each call is a SIP phone instead (a UDP user agent: INVITE with a
PCMU offer, ACK, RTP both ways at 20 ms, BYE): the server must run with
`--sip` and `server.sip.webhook: http://127.0.0.1:HOOK_PORT/`, where this
script hears each call announced and joins its sideband (`/v1/realtime?call_id=`)
to set the call's answer length and VAD silence as the Twilio calls do. The
server paces RTP itself, so a SIP call's holes are its `underrun_ms` (answer
silence the server had to send because audio came late, from
`output_audio_buffer.stopped`); gap_free: no more than 100 ms of it. First
audio is the first RTP packet that is not digital silence after the end of
speech.

Each call is a carrier that behaves as Twilio's does: it sends the caller's
voice as 20 ms μ-law frames paced in real time (0.3 s of silence, the
question from --wav with its trailing silence cut, then silence), plays the
answer's audio in real time from its first frame, echoes each mark when the
audio before it has played, and hangs up (`stop`) once the answer has
played out. Per call, from the moment the last speech sample was sent (the
end of speech):
  first_audio_ms  the first answer frame received (VAD silence wait included)
  holes           20 ms ticks, between the answer's first and last frame,
                  where the carrier had nothing to play: count, total and
                  worst run in ms; gap_free: no hole over 100 ms
  answer_s        answer audio received, in seconds
Each level runs once per --lead-ms (the call's `playout_lead_ms` parameter:
how long the server holds each answer's first audio). Prints one JSON object
per lead and concurrency level; exits 1 if a call got no answer.
Requirements: tests/python/requirements.txt (websockets, numpy).
"""

import argparse
import asyncio
import base64
import json
import socket
import sys
import time
import uuid

import numpy as np
import websockets

from bench_voice import load  # the same questions, cut the same way

RATE = 8000
FRAME = 160  # 20 ms

# G.711 μ-law (ITU-T G.711), as the carrier encodes and decodes it.
BIAS, CLIP = 0x84, 32635


def ulaw_encode(x):
    s = np.clip(np.round(x * 32767), -32768, 32767).astype(np.int32)
    sign = np.where(s < 0, 0x80, 0)
    s = np.minimum(np.abs(s), CLIP) + BIAS
    exp = np.floor(np.log2(s)).astype(np.int32) - 7
    exp = np.clip(exp, 0, 7)
    mant = (s >> (exp + 3)) & 0x0F
    return (~(sign | (exp << 4) | mant) & 0xFF).astype(np.uint8)


def ulaw_decode(b):
    u = ~np.frombuffer(b, np.uint8).astype(np.int32) & 0xFF
    sign, exp, mant = u & 0x80, (u >> 4) & 0x07, u & 0x0F
    s = (((mant << 3) + BIAS) << exp) - BIAS
    return np.where(sign != 0, -s, s).astype(np.float32) / 32768


async def call(url, speech, params, quiet_s=3.0, limit_s=180.0):
    sid = "MZ" + format(int(time.time() * 1e6) & 0xFFFFFFFF, "032x")
    seq = 0

    def ev(kind, body):
        nonlocal seq
        seq += 1
        return json.dumps({"event": kind, "sequenceNumber": str(seq), "streamSid": sid, kind: body})

    async with websockets.connect(f"{url}/v1/phone/twilio", max_size=None) as ws:
        await ws.send(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
        await ws.send(ev("start", {
            "streamSid": sid, "callSid": "CA" + sid[2:], "accountSid": "AC0",
            "tracks": ["inbound"], "customParameters": params,
            "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": RATE, "channels": 1},
        }))
        lead = RATE * 3 // 10
        mic = np.concatenate([np.zeros(lead, np.float32), speech])
        speech_end_frame = len(mic) // FRAME
        state = {"received": 0, "played": 0, "pending": [], "first": None, "last": None}

        async def reader():
            async for m in ws:
                v = json.loads(m)
                e = v.get("event")
                if e == "media":
                    n = len(base64.b64decode(v["media"]["payload"]))
                    now = time.monotonic()
                    state["first"] = state["first"] or now
                    state["last"] = now
                    state["received"] += n
                elif e == "mark":
                    state["pending"].append((v["mark"]["name"], state["received"]))
                elif e == "clear":
                    state["played"] = state["received"]

        task = asyncio.create_task(reader())
        start = time.monotonic()
        speech_end = None
        dry = []  # (time, nothing to play) per tick once the answer began
        i = 0
        try:
            while True:
                tick_at = start + i * 0.02
                await asyncio.sleep(max(0.0, tick_at - time.monotonic()))
                frame = mic[i * FRAME:(i + 1) * FRAME]
                if len(frame) < FRAME:
                    frame = np.concatenate([frame, np.zeros(FRAME - len(frame), np.float32)])
                payload = base64.b64encode(ulaw_encode(frame).tobytes()).decode()
                await ws.send(ev("media", {"track": "inbound", "payload": payload}))
                if i + 1 == speech_end_frame:
                    speech_end = time.monotonic()
                i += 1
                if state["first"] is not None:
                    dry.append((time.monotonic(), state["played"] >= state["received"]))
                state["played"] = min(state["played"] + FRAME, state["received"])
                while state["pending"] and state["pending"][0][1] <= state["played"]:
                    name, _ = state["pending"].pop(0)
                    await ws.send(ev("mark", {"name": name}))
                now = time.monotonic()
                if (state["last"] is not None and now - state["last"] > quiet_s
                        and state["played"] >= state["received"]):
                    break
                if now - start > limit_s or task.done():
                    break
            await ws.send(ev("stop", {"callSid": "CA" + sid[2:]}))
        finally:
            task.cancel()
    if state["first"] is None:
        return {"error": "no answer"}
    # Holes: dry ticks between the answer's first and last frame.
    runs, run = [], 0
    for t, empty in dry:
        if t > state["last"]:
            break
        if empty:
            run += 1
        elif run:
            runs.append(run)
            run = 0
    if run:
        runs.append(run)
    return {
        "first_audio_ms": round((state["first"] - speech_end) * 1000),
        "holes": len(runs),
        "hole_ms": 20 * sum(runs),
        "worst_hole_ms": 20 * max(runs, default=0),
        "gap_free": all(r * 20 <= 100 for r in runs),
        "answer_s": round(state["received"] / RATE, 2),
    }


class Hooks:
    """The server's `realtime.call.incoming` webhooks, by SIP Call-ID."""

    def __init__(self):
        self.waiting = {}

    def expect(self, sip_call_id):
        fut = asyncio.get_running_loop().create_future()
        self.waiting[sip_call_id] = fut
        return fut

    async def serve(self, reader, writer):
        head = (await reader.readuntil(b"\r\n\r\n")).decode()
        n = next((int(line.split(":", 1)[1]) for line in head.split("\r\n")
                  if line.lower().startswith("content-length:")), 0)
        body = json.loads(await reader.readexactly(n))
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")
        await writer.drain()
        writer.close()
        data = body.get("data", {})
        for h in data.get("sip_headers", []):
            fut = self.waiting.get(h["value"]) if h["name"] == "Call-ID" else None
            if fut and not fut.done():
                fut.set_result(data["call_id"])


def rtp_packet(seq, payload, ssrc):
    head = bytes([0x80, 0, (seq >> 8) & 0xFF, seq & 0xFF])
    return head + (seq * FRAME & 0xFFFFFFFF).to_bytes(4, "big") + ssrc.to_bytes(4, "big") + payload


async def sip_call(args, speech, hooks, quiet_s=3.0, limit_s=180.0):
    loop = asyncio.get_running_loop()
    host, port = args.sip.rsplit(":", 1)
    server = (host, int(port))
    sig = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    rtp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    for s_ in (sig, rtp):
        s_.bind(("127.0.0.1", 0))
        s_.setblocking(False)
    me, media_port = sig.getsockname(), rtp.getsockname()[1]
    call_id, tag = uuid.uuid4().hex, uuid.uuid4().hex[:8]
    announced = hooks.expect(call_id)

    def request(method, cseq, to_tag="", body=""):
        ctype = "Content-Type: application/sdp\r\n" if body else ""
        return (f"{method} sip:agent@{args.sip} SIP/2.0\r\n"
                f"Via: SIP/2.0/UDP {me[0]}:{me[1]};branch=z9hG4bK{uuid.uuid4().hex[:12]}\r\n"
                f"Max-Forwards: 70\r\nFrom: <sip:bench@{me[0]}>;tag={tag}\r\n"
                f"To: <sip:agent@{args.sip}>{to_tag}\r\nCall-ID: {call_id}\r\n"
                f"CSeq: {cseq} {method}\r\nContact: <sip:bench@{me[0]}:{me[1]}>\r\n"
                f"{ctype}Content-Length: {len(body)}\r\n\r\n{body}").encode()

    async def final(msg):
        await loop.sock_sendto(sig, msg, server)
        while True:
            data = (await asyncio.wait_for(loop.sock_recv(sig, 65536), 10)).decode()
            code = int(data.split()[1])
            if code >= 200:
                return code, data

    offer = (f"v=0\r\no=- 1 1 IN IP4 127.0.0.1\r\ns=-\r\nc=IN IP4 127.0.0.1\r\nt=0 0\r\n"
             f"m=audio {media_port} RTP/AVP 0 101\r\na=rtpmap:101 telephone-event/8000\r\n"
             f"a=sendrecv\r\n")
    code, ok = await final(request("INVITE", 1, body=offer))
    if code != 200:
        return {"error": f"INVITE answered {code}"}
    to_tag = ";tag=" + next(line for line in ok.split("\r\n")
                            if line.lower().startswith("to:")).split(";tag=")[1].strip()
    answer_port = int(next(line for line in ok.split("\r\n")
                           if line.startswith("m=audio ")).split()[1])
    await loop.sock_sendto(sig, request("ACK", 1, to_tag), server)
    media = (host, answer_port)

    sess = await asyncio.wait_for(announced, 10)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    state = {"first": None, "last": None, "underrun_ms": 0, "stopped": 0, "speech_end": None}
    async with websockets.connect(f"{args.url}/v1/realtime?call_id={sess}",
                                  additional_headers=headers) as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {
            "max_output_tokens": args.max_tokens,
            "turn_detection": {"type": "server_vad",
                               "silence_duration_ms": args.silence_ms}}}))

        async def events():
            async for m in ws:
                v = json.loads(m)
                if v.get("type") == "output_audio_buffer.stopped":
                    state["underrun_ms"] += v.get("underrun_ms", 0)
                    state["stopped"] += 1

        async def hear():
            while True:
                data = await loop.sock_recv(rtp, 2048)
                payload = data[12:]
                if any(b != 0xFF for b in payload) and state["speech_end"] is not None:
                    now = time.monotonic()
                    state["first"] = state["first"] or now
                    state["last"] = now

        tasks = [asyncio.create_task(events()), asyncio.create_task(hear())]
        mic = np.concatenate([np.zeros(RATE * 3 // 10, np.float32), speech])
        speech_end_frame = len(mic) // FRAME
        ssrc = int(uuid.uuid4().int & 0xFFFFFFFF)
        start = time.monotonic()
        i = 0
        try:
            while True:
                await asyncio.sleep(max(0.0, start + i * 0.02 - time.monotonic()))
                frame = mic[i * FRAME:(i + 1) * FRAME]
                if len(frame) < FRAME:
                    frame = np.concatenate([frame, np.zeros(FRAME - len(frame), np.float32)])
                await loop.sock_sendto(rtp, rtp_packet(i & 0xFFFF, ulaw_encode(frame).tobytes(),
                                                       ssrc), media)
                if i + 1 == speech_end_frame:
                    state["speech_end"] = time.monotonic()
                i += 1
                now = time.monotonic()
                if state["stopped"] and state["last"] and now - state["last"] > quiet_s:
                    break
                if now - start > limit_s:
                    break
        finally:
            for t in tasks:
                t.cancel()
    code, _ = await final(request("BYE", 2, to_tag))
    sig.close()
    rtp.close()
    if state["first"] is None:
        return {"error": "no answer"}
    return {
        "first_audio_ms": round((state["first"] - state["speech_end"]) * 1000),
        "underrun_ms": state["underrun_ms"],
        "gap_free": state["underrun_ms"] <= 100,
        "answer_s": round(state["last"] - state["first"], 2),
        "bye": code,
    }


def pct(xs, q):
    return float(np.percentile(xs, q)) if xs else None


async def level(args, speech, n, lead_ms):
    params = {"max_output_tokens": str(args.max_tokens),
              "silence_duration_ms": str(args.silence_ms)}
    if lead_ms is not None:
        params["playout_lead_ms"] = str(lead_ms)
    if args.api_key:
        params["api_key"] = args.api_key
    if args.sip:
        hooks = Hooks()
        srv = await asyncio.start_server(hooks.serve, "127.0.0.1", args.hook_port)
        async with srv:
            calls = await asyncio.gather(*(sip_call(args, speech, hooks) for _ in range(n)),
                                         return_exceptions=True)
    else:
        calls = await asyncio.gather(*(call(args.url, speech, params) for _ in range(n)),
                                     return_exceptions=True)
    calls = [c if isinstance(c, dict) else {"error": f"{type(c).__name__}: {c}"} for c in calls]
    ok = [c for c in calls if "error" not in c]
    fa = [c["first_audio_ms"] for c in ok]
    return {
        "transport": "sip" if args.sip else "twilio",
        "lead_ms": lead_ms, "concurrent": n, "answered": len(ok),
        "first_audio_ms": {"p50": pct(fa, 50), "max": max(fa, default=None)},
        "gap_free_share": round(sum(c["gap_free"] for c in ok) / len(ok), 2) if ok else 0,
        "hole_ms_per_call": [c.get("hole_ms", c.get("underrun_ms")) for c in ok],
        "calls": calls,
    }


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True, help="ws://host:port")
    p.add_argument("--wav", required=True)
    p.add_argument("--concurrent", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--max-tokens", type=int, default=40)
    p.add_argument("--silence-ms", type=int, default=500)
    p.add_argument("--lead-ms", type=int, nargs="+", default=[None],
                   help="playout_lead_ms per call (default: the server's)")
    p.add_argument("--api-key")
    p.add_argument("--sip", help="host:port: call over SIP instead (see above)")
    p.add_argument("--hook-port", type=int, default=8098,
                   help="with --sip: where the server's webhook comes")
    args = p.parse_args()
    if args.sip and args.lead_ms != [None]:
        p.error("--lead-ms is the Twilio calls' parameter; SIP's is server.sip.playout_lead_ms")
    speech = load(args.wav, RATE)
    failed = False
    for lead in args.lead_ms:
        for n in args.concurrent:
            r = asyncio.run(level(args, speech, n, lead))
            print(json.dumps(r), flush=True)
            failed |= r["answered"] < n
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
