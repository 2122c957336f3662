// omnistream demo page: a chat over the OpenAI Realtime WebSocket
// (/v1/realtime, GA event names). The answer's text streams into the page and
// its audio (pcm16, 24 kHz, base64 in response.output_audio.delta) is played
// with the Web Audio API, each chunk scheduled right after the previous one
// so playback is gapless while the network keeps ahead of it.
// window.omnistreamStats exposes per-turn timings for tests.
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
  };

  const stats = { turns: [] };
  // The audio clock shows whether playback really runs (a suspended or
  // missing output device leaves it at 0).
  Object.defineProperty(stats, "audio_clock_s", {
    enumerable: true,
    get: () => (audioCtx ? audioCtx.currentTime : 0),
  });
  Object.defineProperty(stats, "audio_state", {
    enumerable: true,
    get: () => (audioCtx ? audioCtx.state : "none"),
  });
  window.omnistreamStats = stats;

  let ws = null;
  let wsReady = null;
  let wsKey = null;
  let eventSeq = 0;

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
    if (!ws || ws.readyState !== WebSocket.OPEN) throw new Error("not connected");
    ws.send(JSON.stringify(event));
  }

  function sessionUpdate() {
    send({
      type: "session.update",
      event_id: nextEventId("session"),
      session: {
        type: "realtime",
        output_modalities: ["audio"],
        audio: { output: { voice: ui.voice.value, format: { type: "audio/pcm", rate: RATE } } },
      },
    });
  }

  // Opens the socket (again, when the key changed or it closed); resolves when open.
  function connect() {
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
        setStatus("Connected", true);
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
        setStatus("Connected", true);
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
    const t = {
      t0: performance.now(),
      responseId: null,
      createEventId: nextEventId("response"),
      itemEventId: nextEventId("item"),
      active: true,
      carry: null,
      lead: LEAD_S,
      stats: {
        ttft_ms: null,
        ttfp_ms: null,
        audio_started: false,
        text: "",
        audio_seconds: 0,
        gaps: 0,
        status: "in_progress",
      },
    };
    t.el = addMessages(text);
    turn = t;
    stats.turns.push(t.stats);
    ui.message.value = "";
    updateButtons();
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
    if (turn && turn.active && ws && ws.readyState === WebSocket.OPEN) {
      const ev = { type: "response.cancel", event_id: nextEventId("cancel") };
      if (turn.responseId) ev.response_id = turn.responseId;
      ws.send(JSON.stringify(ev));
    }
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
  ui.voice.addEventListener("change", () => {
    if (ws && ws.readyState === WebSocket.OPEN) sessionUpdate();
  });
  // A different key needs a new connection: drop the old one.
  ui.key.addEventListener("change", () => {
    if (ws && wsKey !== ui.key.value.trim() && !(turn && turn.active)) {
      const old = ws;
      ws = null;
      old.close();
      setStatus("Not connected");
    }
  });
  updateButtons();
})();
