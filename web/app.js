// omnistream demo page: a chat with the OpenAI Realtime events (GA names).
// By default it is a WebRTC call (POST /v1/webrtc): the microphone goes up
// (echo cancellation on), the answer's audio comes down on the peer's track
// and plays in an <audio> element, and the events travel on the `oai-events`
// data channel. Where WebRTC cannot connect it falls back to the Realtime
// WebSocket (/v1/realtime): the answer's audio (pcm16, 24 kHz, base64 in
// response.output_audio.delta) is played with the Web Audio API, each chunk
// scheduled right after the previous one so playback is gapless while the
// network keeps ahead of it. `?transport=websocket` (or the setting) skips
// WebRTC. Hands-free (WebRTC only) turns the server's voice activity
// detection on: the user just talks; each turn shows what the server heard
// and the time from the end of speech to the first answer audio; talking over
// an answer interrupts it. window.omnistreamStats exposes per-turn timings
// for tests.
"use strict";

(() => {
  const RATE = 24000;
  // Head start for the first chunk, so it is never scheduled in the past
  // while the main thread is busy. After an underrun (audio arriving slower
  // than it plays) the head start doubles, up to MAX_LEAD_S: fewer, longer
  // pauses instead of many short ones.
  const LEAD_S = 0.05;
  const MAX_LEAD_S = 0.4;

  const $ = (id) => document.getElementById(id);
  const ui = {
    status: $("status"),
    conversation: $("conversation"),
    log: $("log"),
    error: $("error"),
    form: $("composer"),
    message: $("message"),
    send: $("send"),
    stop: $("stop"),
    voice: $("voice"),
    key: $("api-key"),
    transport: $("transport"),
    handsfree: $("handsfree"),
  };
  const wanted = new URLSearchParams(location.search).get("transport");
  if (wanted === "websocket" || wanted === "webrtc") ui.transport.value = wanted;

  const stats = { turns: [] };
  // The audio clock shows whether playback really runs (a suspended or
  // missing output device leaves it at 0).
  Object.defineProperty(stats, "audio_clock_s", {
    enumerable: true,
    get: () => (rtc ? rtc.audioEl.currentTime : audioCtx ? audioCtx.currentTime : 0),
  });
  Object.defineProperty(stats, "audio_state", {
    enumerable: true,
    get: () => (rtc ? (rtc.audioEl.paused ? "paused" : "running") : audioCtx ? audioCtx.state : "none"),
  });
  // "webrtc" or "websocket": how the page is connected now.
  Object.defineProperty(stats, "transport", {
    enumerable: true,
    get: () => (rtc ? "webrtc" : ws ? "websocket" : "none"),
  });
  window.omnistreamStats = stats;

  let ws = null;
  let wsReady = null;
  let wsKey = null;
  let eventSeq = 0;
  // The WebRTC call: { pc, dc, audioEl, mic, key } once connected.
  let rtc = null;
  let rtcReady = null;
  // Set when WebRTC failed once: the page stays on the WebSocket.
  let rtcFailed = null;

  let audioCtx = null;
  let nextTime = 0;
  const sources = new Set();

  // The turn being answered: { t0, responseId, createEventId, stats, el, active }.
  let turn = null;

  function setStatus(text, live) {
    ui.status.textContent = text;
    ui.status.classList.toggle("live", Boolean(live));
  }

  function showError(message) {
    ui.error.textContent = message;
    ui.error.hidden = !message;
  }

  function updateButtons() {
    const active = Boolean(turn && turn.active);
    ui.send.disabled = active;
    ui.stop.disabled = !active && sources.size === 0;
  }

  // --- audio ---------------------------------------------------------------

  // Created (or resumed) inside the click/keypress that sends, so autoplay
  // policies let it play.
  function audio() {
    if (!audioCtx) {
      const AC = window.AudioContext || window.webkitAudioContext;
      audioCtx = new AC();
    }
    if (audioCtx.state === "suspended") {
      audioCtx.resume().catch(() => {});
    }
    return audioCtx;
  }

  function base64ToBytes(b64) {
    const bin = atob(b64);
    const out = new Uint8Array(bin.length);
    for (let i = 0; i < bin.length; i++) out[i] = bin.charCodeAt(i);
    return out;
  }

  // PCM16 little-endian -> Float32; a trailing odd byte waits for the next chunk.
  function pcm16ToFloat(t, bytes) {
    let data = bytes;
    if (t.carry) {
      data = new Uint8Array(bytes.length + 1);
      data[0] = t.carry[0];
      data.set(bytes, 1);
      t.carry = null;
    }
    const n = data.length >> 1;
    if (data.length & 1) t.carry = data.slice(data.length - 1);
    const view = new DataView(data.buffer, data.byteOffset, n * 2);
    const out = new Float32Array(n);
    for (let i = 0; i < n; i++) out[i] = view.getInt16(2 * i, true) / 32768;
    return out;
  }

  function play(t, samples) {
    if (samples.length === 0) return;
    const ctx = audio();
    const buf = ctx.createBuffer(1, samples.length, RATE);
    buf.getChannelData(0).set(samples);
    const src = ctx.createBufferSource();
    src.buffer = buf;
    src.connect(ctx.destination);
    if (nextTime > 0 && nextTime < ctx.currentTime) {
      t.stats.gaps += 1;
      t.lead = Math.min(MAX_LEAD_S, t.lead * 2);
    }
    const at = Math.max(nextTime, ctx.currentTime + t.lead);
    src.start(at);
    nextTime = at + buf.duration;
    sources.add(src);
    src.onended = () => {
      sources.delete(src);
      if (sources.size === 0) updateButtons();
    };
    t.stats.audio_started = true;
    t.stats.audio_seconds += buf.duration;
    updateButtons();
  }

  // --- the microphone over the WebSocket (hands-free without WebRTC) -------

  // {stream, ctx, node} while hands-free runs over the WebSocket.
  let wsMic = null;

  function bytesToBase64(bytes) {
    let bin = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return btoa(bin);
  }

  // Captures the microphone at 24 kHz (the AudioContext resamples) and
  // appends it to the session's input buffer, ~85 ms at a time; the server's
  // turn detection finds the turns.
  async function startWsMic() {
    if (wsMic) return;
    const stream = await navigator.mediaDevices.getUserMedia({
      audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
    });
    const AC = window.AudioContext || window.webkitAudioContext;
    const ctx = new AC({ sampleRate: RATE });
    const node = ctx.createScriptProcessor(2048, 1, 1);
    node.onaudioprocess = (e) => {
      if (!ws || ws.readyState !== WebSocket.OPEN || !handsFree()) return;
      const x = e.inputBuffer.getChannelData(0);
      const pcm = new Int16Array(x.length);
      for (let i = 0; i < x.length; i++) pcm[i] = Math.max(-1, Math.min(1, x[i])) * 32767;
      ws.send(JSON.stringify({ type: "input_audio_buffer.append", audio: bytesToBase64(new Uint8Array(pcm.buffer)) }));
    };
    ctx.createMediaStreamSource(stream).connect(node);
    // A processor only runs while connected to the output (it writes silence).
    node.connect(ctx.destination);
    wsMic = { stream, ctx, node };
  }

  function stopWsMic() {
    if (!wsMic) return;
    const old = wsMic;
    wsMic = null;
    old.node.disconnect();
    old.stream.getTracks().forEach((tr) => tr.stop());
    old.ctx.close().catch(() => {});
  }

  function transportName() {
    return rtc ? "WebRTC" : "WebSocket";
  }

  function stopPlayback() {
    for (const src of sources) {
      try {
        src.stop();
      } catch (_) {
        // Already stopped.
      }
    }
    sources.clear();
    nextTime = 0;
    updateButtons();
  }

  // --- connection ------------------------------------------------------------

  function nextEventId(kind) {
    eventSeq += 1;
    return `evt_page_${kind}_${eventSeq}`;
  }

  function send(event) {
    if (rtc && rtc.dc.readyState === "open") {
      rtc.dc.send(JSON.stringify(event));
      return;
    }
    if (!ws || ws.readyState !== WebSocket.OPEN) throw new Error("not connected");
    ws.send(JSON.stringify(event));
  }

  function connected() {
    return Boolean((rtc && rtc.dc.readyState === "open") || (ws && ws.readyState === WebSocket.OPEN));
  }

  function hangUp() {
    if (!rtc) return;
    const old = rtc;
    rtc = null;
    rtcReady = null;
    if (old.mic) old.mic.getTracks().forEach((tr) => tr.stop());
    old.pc.close();
    old.audioEl.srcObject = null;
  }

  // The WebRTC call: offer (ICE gathered) -> POST /v1/webrtc -> answer.
  // Resolves once the events channel is open.
  async function callServer(key) {
    const pc = new RTCPeerConnection();
    const call = { pc, dc: null, audioEl: new Audio(), mic: null, key };
    call.audioEl.autoplay = true;
    try {
      call.mic = await navigator.mediaDevices.getUserMedia({
        audio: { echoCancellation: true, noiseSuppression: true, autoGainControl: true },
      });
      call.mic.getTracks().forEach((tr) => pc.addTrack(tr, call.mic));
    } catch (_) {
      // No microphone (or no permission): listen only.
      pc.addTransceiver("audio", { direction: "recvonly" });
    }
    pc.ontrack = (e) => {
      call.audioEl.srcObject = e.streams && e.streams[0] ? e.streams[0] : new MediaStream([e.track]);
      call.audioEl.play().catch(() => {});
    };
    call.dc = pc.createDataChannel("oai-events");
    const opened = new Promise((resolve, reject) => {
      call.dc.onopen = resolve;
      setTimeout(() => reject(new Error("the WebRTC call did not connect within 10 s")), 10000);
    });
    call.dc.onmessage = (m) => {
      if (rtc === call) onEvent(m.data);
    };
    call.dc.onclose = () => {
      if (rtc !== call) return;
      hangUp();
      setStatus("Not connected");
      if (turn && turn.active) {
        showError("the call ended");
        finishTurn("disconnected");
      }
    };
    await pc.setLocalDescription(await pc.createOffer());
    // No trickle ICE: wait for our candidates to be in the offer.
    await new Promise((resolve) => {
      if (pc.iceGatheringState === "complete") return resolve();
      pc.addEventListener("icegatheringstatechange", () => {
        if (pc.iceGatheringState === "complete") resolve();
      });
      setTimeout(resolve, 2000);
    });
    const headers = { "Content-Type": "application/sdp" };
    if (key) headers.Authorization = `Bearer ${key}`;
    const r = await fetch("/v1/webrtc", { method: "POST", headers, body: pc.localDescription.sdp });
    if (!r.ok) {
      let msg = `HTTP ${r.status}`;
      try {
        msg = (await r.json()).error.message;
      } catch (_) {
        // Not JSON: keep the status.
      }
      pc.close();
      throw new Error(msg);
    }
    await pc.setRemoteDescription({ type: "answer", sdp: await r.text() });
    rtc = call;
    try {
      await opened;
    } catch (e) {
      hangUp();
      throw e;
    }
    return call;
  }

  // Connects the chosen way; WebRTC falls back to the WebSocket when it fails.
  async function connect() {
    const key = ui.key.value.trim();
    const useRtc = ui.transport.value === "webrtc" && window.RTCPeerConnection && !rtcFailed;
    if (useRtc) {
      if (rtc && rtc.key === key && rtc.dc.readyState === "open") return rtc;
      if (rtcReady && rtc && rtc.key === key) return rtcReady;
      hangUp();
      setStatus("Calling…");
      rtcReady = callServer(key);
      try {
        await rtcReady;
        setStatus("Connected (WebRTC)", true);
        sessionUpdate();
        return rtc;
      } catch (e) {
        // 401 is the key's fault, not WebRTC's: say so rather than fall back.
        if (/api key/i.test(e.message)) throw e;
        rtcFailed = e.message;
        console.warn(`WebRTC failed (${e.message}); using the WebSocket`);
      }
    }
    hangUp();
    return connectWebSocket();
  }

  function handsFree() {
    return ui.handsfree.getAttribute("aria-pressed") === "true";
  }

  function sessionUpdate() {
    send({
      type: "session.update",
      event_id: nextEventId("session"),
      session: {
        type: "realtime",
        output_modalities: ["audio"],
        audio: {
          input: { turn_detection: handsFree() && (rtc || wsMic) ? { type: "server_vad" } : null },
          output: { voice: ui.voice.value, format: { type: "audio/pcm", rate: RATE } },
        },
      },
    });
  }

  // Opens the socket (again, when the key changed or it closed); resolves when open.
  function connectWebSocket() {
    const key = ui.key.value.trim();
    if (ws && ws.readyState <= WebSocket.OPEN && wsKey === key) return wsReady;
    if (ws) ws.close();
    const url = new URL("/v1/realtime", location.href);
    url.protocol = url.protocol === "https:" ? "wss:" : "ws:";
    // Browsers cannot set headers on a WebSocket: the key rides in a subprotocol.
    const protocols = ["realtime"];
    if (key) protocols.push(`openai-insecure-api-key.${key}`);
    let sock;
    try {
      sock = new WebSocket(url.href, protocols);
    } catch (e) {
      return Promise.reject(new Error(`cannot open the WebSocket (${e.message}); an API key may only use letters, digits and -._~!#$%&'*+^|\``));
    }
    ws = sock;
    wsKey = key;
    setStatus("Connecting…");
    wsReady = new Promise((resolve, reject) => {
      let opened = false;
      sock.onopen = () => {
        opened = true;
        setStatus(rtcFailed ? "Connected (WebSocket; WebRTC failed)" : "Connected (WebSocket)", true);
        sessionUpdate();
        resolve(sock);
      };
      sock.onmessage = (m) => {
        if (sock === ws) onEvent(m.data);
      };
      sock.onclose = (e) => {
        if (sock !== ws) return;
        setStatus("Not connected");
        if (!opened) {
          reject(new Error("could not connect to /v1/realtime (is the server up, and is the API key right?)"));
          return;
        }
        if (turn && turn.active) {
          showError(`connection closed${e.reason ? `: ${e.reason}` : ""}`);
          finishTurn("disconnected");
        }
      };
    });
    return wsReady;
  }

  // --- turns -------------------------------------------------------------------

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined) e.textContent = text;
    return e;
  }

  function stat(dl, label, cls) {
    const div = el("div");
    div.append(el("dt", "", label));
    const dd = el("dd", cls, "…");
    div.append(dd);
    dl.append(div);
    return dd;
  }

  function addMessages(text) {
    const user = el("li", "msg user");
    user.append(el("span", "who", "You"), el("div", "text", text));
    const bot = el("li", "msg assistant");
    const body = el("div", "text");
    const dl = el("dl", "stats");
    dl.setAttribute("aria-label", "timings");
    bot.append(el("span", "who", "omnistream"), body, dl);
    const view = {
      user: user.querySelector(".text"),
      text: body,
      ttft: stat(dl, "TTFT", "ttft"),
      ttfp: stat(dl, "TTFP", "ttfp"),
      audio: stat(dl, "Audio", "audio-len"),
      status: stat(dl, "Status", "turn-status"),
    };
    view.status.textContent = "answering";
    view.item = bot;
    bot.setAttribute("aria-busy", "true");
    ui.log.append(user, bot);
    scrollToEnd(true);
    return view;
  }

  // Follows the answer while the reader is at the bottom; leaves them be
  // when they scrolled up to read.
  function scrollToEnd(force) {
    const c = ui.conversation;
    if (force || c.scrollHeight - c.scrollTop - c.clientHeight < 80) c.scrollTop = c.scrollHeight;
  }

  function ms(t) {
    return Math.round(performance.now() - t.t0);
  }

  function onText(t, delta) {
    if (typeof delta !== "string" || !delta) return;
    if (t.stats.ttft_ms === null) {
      t.stats.ttft_ms = ms(t);
      t.el.ttft.textContent = `${t.stats.ttft_ms} ms`;
    }
    t.stats.text += delta;
    t.el.text.textContent = t.stats.text;
    scrollToEnd(false);
  }

  function onAudio(t, b64) {
    if (typeof b64 !== "string" || !b64) return;
    let bytes;
    try {
      bytes = base64ToBytes(b64);
    } catch (_) {
      showError("the server sent audio that is not base64");
      return;
    }
    if (t.stats.ttfp_ms === null) {
      t.stats.ttfp_ms = ms(t);
      t.el.ttfp.textContent = `${t.stats.ttfp_ms} ms`;
    }
    play(t, pcm16ToFloat(t, bytes));
    t.el.audio.textContent = `${t.stats.audio_seconds.toFixed(1)} s`;
  }

  // WebRTC answers play on the track: their timing comes from the server's
  // output_audio_buffer events.
  function onTrackAudio(t, started) {
    if (started) {
      if (t.stats.ttfp_ms === null) {
        t.stats.ttfp_ms = ms(t);
        t.el.ttfp.textContent = `${t.stats.ttfp_ms} ms`;
      }
      t.stats.audio_started = true;
      t.playStart = performance.now();
      t.playTimer = setInterval(() => {
        t.stats.audio_seconds = (performance.now() - t.playStart) / 1000;
        t.el.audio.textContent = `${t.stats.audio_seconds.toFixed(1)} s`;
      }, 250);
      rtc && rtc.audioEl.play().catch(() => {});
    } else if (t.playTimer) {
      clearInterval(t.playTimer);
      t.playTimer = null;
      t.stats.audio_seconds = (performance.now() - t.playStart) / 1000;
      t.el.audio.textContent = `${t.stats.audio_seconds.toFixed(1)} s`;
    }
  }

  function finishTurn(status) {
    const t = turn;
    if (!t || !t.active) return;
    t.active = false;
    t.stats.status = status;
    t.stats.total_ms = ms(t);
    t.el.status.textContent = status;
    t.el.item.removeAttribute("aria-busy");
    if (t.stats.ttft_ms === null) t.el.ttft.textContent = "–";
    if (t.stats.ttfp_ms === null) t.el.ttfp.textContent = "–";
    if (!t.stats.audio_started) t.el.audio.textContent = "–";
    updateButtons();
  }

  function newTurn(text, voice) {
    const t = {
      t0: performance.now(),
      responseId: null,
      createEventId: nextEventId("response"),
      itemEventId: nextEventId("item"),
      active: true,
      voice,
      carry: null,
      lead: LEAD_S,
      stats: {
        ttft_ms: null,
        ttfp_ms: null,
        audio_started: false,
        text: "",
        heard: null,
        audio_seconds: 0,
        gaps: 0,
        status: "in_progress",
      },
    };
    t.el = addMessages(text);
    turn = t;
    stats.turns.push(t.stats);
    updateButtons();
    return t;
  }

  // Hands-free: the user stopped speaking; the server hears it and answers.
  // The turn's clock starts at the end of speech.
  function onSpeechStopped() {
    if (turn && turn.active) finishTurn("interrupted");
    const t = newTurn("…", true);
    t.el.user.classList.add("pending");
    t.el.status.textContent = "listening";
  }

  function onHeard(ev) {
    const t = turn;
    if (!t || !t.voice || t.stats.heard !== null) return;
    const text = (ev.transcript || "").trim();
    t.stats.heard = text;
    t.el.user.classList.remove("pending");
    if (text) {
      t.el.user.textContent = text;
      t.el.status.textContent = "answering";
    } else {
      // Nothing was heard (noise): no turn.
      t.el.user.textContent = "(nothing heard)";
      finishTurn("nothing heard");
    }
  }

  function onEvent(data) {
    let ev;
    try {
      ev = JSON.parse(data);
    } catch (_) {
      return;
    }
    const t = turn;
    // Events of an earlier (cancelled) response are not this turn's.
    const mine = t && t.active && (!ev.response_id || !t.responseId || ev.response_id === t.responseId);
    switch (ev.type) {
      case "session.created":
      case "session.updated":
        break;
      case "input_audio_buffer.speech_started":
        setStatus("Listening…", true);
        break;
      case "input_audio_buffer.speech_stopped":
        setStatus(`Connected (${transportName()}, hands-free)`, true);
        onSpeechStopped();
        break;
      case "conversation.item.input_audio_transcription.completed":
        onHeard(ev);
        break;
      case "output_audio_buffer.started":
        // WebRTC: the first frame of this answer is on the wire.
        if (mine || (t && ev.response_id === t.responseId)) onTrackAudio(t, true);
        break;
      case "output_audio_buffer.cleared":
        // Barge-in over the WebSocket: drop what is scheduled to play.
        if (!rtc) stopPlayback();
        if (t && (!ev.response_id || ev.response_id === t.responseId)) onTrackAudio(t, false);
        break;
      case "output_audio_buffer.stopped":
        if (t && (!ev.response_id || ev.response_id === t.responseId)) onTrackAudio(t, false);
        break;
      case "response.created":
        if (t && t.active && !t.responseId && ev.response) t.responseId = ev.response.id;
        break;
      case "response.output_text.delta":
      case "response.output_audio_transcript.delta":
        if (mine) onText(t, ev.delta);
        break;
      case "response.output_audio.delta":
        if (mine) onAudio(t, ev.delta);
        break;
      case "response.done": {
        const r = ev.response || {};
        if (t && t.active && (!t.responseId || r.id === t.responseId)) finishTurn(r.status || "completed");
        break;
      }
      case "error": {
        const err = ev.error || {};
        showError(err.message || "server error");
        // An error answering this turn's own events ends the turn.
        if (t && t.active && err.event_id && (err.event_id === t.createEventId || err.event_id === t.itemEventId)) {
          finishTurn("failed");
        }
        break;
      }
      default:
        break;
    }
  }

  async function submit() {
    const text = ui.message.value.trim();
    if (!text || (turn && turn.active)) return;
    showError("");
    // Inside the user's gesture: unlock audio now, before any await.
    audio();
    stopPlayback();
    const t = newTurn(text, false);
    ui.message.value = "";
    try {
      await connect();
      send({
        type: "conversation.item.create",
        event_id: t.itemEventId,
        item: { type: "message", role: "user", content: [{ type: "input_text", text }] },
      });
      send({ type: "response.create", event_id: t.createEventId });
    } catch (e) {
      showError(e.message);
      finishTurn("failed");
    }
  }

  function stop() {
    stopPlayback();
    if (!connected()) return;
    if (turn && turn.active) {
      const ev = { type: "response.cancel", event_id: nextEventId("cancel") };
      if (turn.responseId) ev.response_id = turn.responseId;
      send(ev);
    }
    // WebRTC: what the server queued for the track stops too.
    if (rtc) send({ type: "output_audio_buffer.clear", event_id: nextEventId("clear") });
  }

  ui.form.addEventListener("submit", (e) => {
    e.preventDefault();
    submit();
  });
  ui.message.addEventListener("keydown", (e) => {
    if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
      e.preventDefault();
      submit();
    }
  });
  ui.stop.addEventListener("click", stop);
  ui.handsfree.addEventListener("click", async () => {
    const on = !handsFree();
    ui.handsfree.setAttribute("aria-pressed", String(on));
    showError("");
    if (!on) {
      stopWsMic();
      if (connected()) sessionUpdate();
      setStatus(rtc ? "Connected (WebRTC)" : ws ? "Connected (WebSocket)" : "Not connected", connected());
      return;
    }
    audio();
    try {
      await connect();
      // Without the WebRTC call the microphone rides the WebSocket.
      if (!rtc) await startWsMic();
      sessionUpdate();
      setStatus(`Connected (${transportName()}, hands-free)`, true);
    } catch (e) {
      stopWsMic();
      ui.handsfree.setAttribute("aria-pressed", "false");
      showError(e.message);
    }
  });
  ui.voice.addEventListener("change", () => {
    if (connected()) sessionUpdate();
  });
  ui.transport.addEventListener("change", () => {
    if (turn && turn.active) return;
    rtcFailed = null;
    stopWsMic();
    ui.handsfree.setAttribute("aria-pressed", "false");
    hangUp();
    if (ws) {
      const old = ws;
      ws = null;
      old.close();
    }
    setStatus("Not connected");
  });
  // A different key needs a new connection: drop the old one.
  ui.key.addEventListener("change", () => {
    if (rtc && rtc.key !== ui.key.value.trim() && !(turn && turn.active)) {
      hangUp();
      setStatus("Not connected");
    }
    if (ws && wsKey !== ui.key.value.trim() && !(turn && turn.active)) {
      const old = ws;
      ws = null;
      old.close();
      setStatus("Not connected");
    }
  });
  updateButtons();
})();
