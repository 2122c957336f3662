// Drives the demo page in a real headless browser:
//   BROWSER=chromium|firefox node page_test.mjs URL [PROMPT]
// (URL may carry ?transport=websocket to skip the default WebRTC call.)
// Debian's Chromium is driven over CDP and Debian's Firefox ESR over WebDriver
// BiDi, both through puppeteer-core (one driver that speaks both; Playwright's
// Firefox needs its own patched build or a newer Firefox than ESR).
// Loads the page, asks PROMPT, waits for the answer's audio to start playing
// and its TTFP to show, lets the turn finish, then asks again and presses
// Stop. Over WebRTC it also records what the browser received of turn 1
// (answer.wav, with the transcript the page showed and the inbound-rtp
// counters). Writes a screenshot and the WAV to a temp folder and prints one
// JSON object on stdout (exit 1 with {"error": ...} when a step fails).
import puppeteer from "puppeteer-core";
import { launchChromium } from "./chromium.mjs";
import { mkdtempSync, writeFileSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const url = process.argv[2];
const prompt = process.argv[3] ?? "What do bees make?";
const browserName = process.env.BROWSER ?? "chromium";
const timeout = Number(process.env.PAGE_TEST_TIMEOUT_MS ?? 240000);
if (!url || !["chromium", "firefox"].includes(browserName)) {
  console.error("usage: BROWSER=chromium|firefox node page_test.mjs URL [PROMPT]");
  process.exit(2);
}

const dir = mkdtempSync(join(tmpdir(), "omnistream-page-"));
const screenshot = join(dir, "page.png");
const consoleErrors = [];
const result = { url, browser: browserName, screenshot };

const launch = {
  chromium: () =>
    launchChromium(
      dir,
      // MIC_WAV: the fake microphone says this file once (hands-free mode).
      process.env.MIC_WAV ? [`--use-file-for-fake-audio-capture=${process.env.MIC_WAV}%noloop`] : [],
    ),
  firefox: () =>
    puppeteer.launch({
      browser: "firefox",
      executablePath: process.env.FIREFOX ?? "/usr/bin/firefox-esr",
      headless: true,
      userDataDir: join(dir, "profile"),
      extraPrefsFirefox: {
        "media.autoplay.default": 0,
        "media.autoplay.block-webaudio": false,
        // No sound card here: a mock audio backend lets the AudioContext run.
        "media.cubeb.force_mock_context": true,
        "app.update.enabled": false,
        "browser.shell.checkDefaultBrowser": false,
        "network.connectivity-service.enabled": false,
        // The WebRTC call asks for the microphone: a fake device, no prompt.
        "media.navigator.streams.fake": true,
        "media.navigator.permission.disabled": true,
      },
      defaultViewport: { width: 900, height: 760 },
    }),
};

// Installed before the page's own script (page.evaluateOnNewDocument): the
// first remote audio track of the page's RTCPeerConnection is also recorded,
// as the browser decoded it, and the call's output_audio_buffer.* events are
// noted, so the test can transcribe what the browser received and read its
// jitter buffer's counters around the answer. A MediaRecorder (Opus again,
// which Whisper does not mind), decoded by an OfflineAudioContext at the end:
// it needs no audio device and no main-thread time while it records (a
// ScriptProcessorNode needs both; an AudioWorklet would need a blob: module,
// which the page's CSP refuses).
function installRecorder(maxSeconds) {
  const Native = window.RTCPeerConnection;
  if (!Native) return;
  const rec = {
    pc: null,
    recorder: null,
    blobs: [],
    t0: null,
    truncated: false,
    error: null,
    events: [],
    errors: [],
    hiccups: [],
    timer: null,
    atStart: null,
  };
  window.__omnistreamRecorder = rec;
  const since = () => (rec.t0 === null ? null : Number(((performance.now() - rec.t0) / 1000).toFixed(2)));

  const FIELDS = [
    "packetsReceived",
    "packetsLost",
    "jitter",
    "concealedSamples",
    "silentConcealedSamples",
    "concealmentEvents",
    "totalSamplesReceived",
    "totalSamplesDuration",
    "insertedSamplesForDeceleration",
    "removedSamplesForAcceleration",
    "jitterBufferDelay",
    "jitterBufferEmittedCount",
    "jitterBufferTargetDelay",
  ];
  rec.inbound = async () => {
    if (!rec.pc) return null;
    const report = await rec.pc.getStats();
    for (const s of report.values()) {
      if (s.type !== "inbound-rtp" || s.kind !== "audio") continue;
      const out = {};
      for (const f of FIELDS) if (typeof s[f] === "number") out[f] = s[f];
      return out;
    }
    return null;
  };

  function record(e) {
    if (rec.recorder || e.track.kind !== "audio") return;
    try {
      // The track alone; the page plays its stream in an <audio> meanwhile.
      const r = new MediaRecorder(new MediaStream([e.track]));
      r.ondataavailable = (ev) => {
        if (ev.data && ev.data.size) rec.blobs.push(ev.data);
      };
      r.onerror = (ev) => {
        rec.error = String(ev.error || ev);
      };
      r.start(1000);
      rec.recorder = r;
      rec.t0 = performance.now();
      // Bounded: the test only needs turn 1.
      setTimeout(() => {
        if (r.state === "recording") {
          rec.truncated = true;
          r.stop();
        }
      }, maxSeconds * 1000);
      // Hiccups, for a failure's message: the ~250 ms windows in which audio
      // was concealed, or fewer than half the 20 ms packets due arrived (the
      // server or the network held them), or less than half the time was
      // played out (the browser's audio thread fell behind).
      let last = null;
      rec.timer = setInterval(async () => {
        const s = await rec.inbound().catch(() => null);
        const now = performance.now();
        if (!s) return;
        if (last && rec.hiccups.length < 200) {
          const due = (now - last.now) / 20;
          const packets = s.packetsReceived - last.s.packetsReceived;
          const played = (s.totalSamplesDuration - last.s.totalSamplesDuration) * 1000;
          const concealed = s.concealedSamples - last.s.concealedSamples;
          if (concealed > 0 || packets < due / 2 || played < (now - last.now) / 2) {
            rec.hiccups.push({
              at_s: since(),
              window_ms: Math.round(now - last.now),
              packets,
              played_ms: Math.round(played),
              concealed,
              silent: (s.silentConcealedSamples ?? 0) - (last.s.silentConcealedSamples ?? 0),
            });
          }
        }
        last = { s, now };
      }, 250);
    } catch (err) {
      rec.error = String(err);
    }
  }

  function note(m) {
    let ev;
    try {
      ev = JSON.parse(m.data);
    } catch (_) {
      return;
    }
    if (!ev || typeof ev.type !== "string") return;
    if (ev.type === "error" && rec.errors.length < 20) rec.errors.push(ev.error);
    if (!ev.type.startsWith("output_audio_buffer.")) return;
    rec.events.push({ type: ev.type, response_id: ev.response_id, underrun_ms: ev.underrun_ms, at_s: since() });
    // The counters as the answer starts, to tell its share from the rest.
    if (ev.type === "output_audio_buffer.started" && !rec.atStart) {
      rec.inbound()
        .then((s) => {
          rec.atStart = s;
        })
        .catch((err) => {
          rec.error = String(err);
        });
    }
  }

  // Stops the recording; resolves to the audio as a 16-bit mono 48 kHz WAV
  // (base64) and the inbound-rtp counters now and as the answer started.
  rec.stop = async () => {
    clearInterval(rec.timer);
    const inbound = await rec.inbound();
    const r = rec.recorder;
    if (!r) throw new Error(`no remote audio track was recorded: ${rec.error}`);
    if (r.state !== "inactive") {
      const stopped = new Promise((resolve) => r.addEventListener("stop", resolve, { once: true }));
      r.stop();
      await stopped;
    }
    const encoded = await new Blob(rec.blobs, { type: r.mimeType }).arrayBuffer();
    const rate = 48000;
    const audio = await new OfflineAudioContext(1, 1, rate).decodeAudioData(encoded);
    const x = audio.getChannelData(0);
    const pcm = new Int16Array(x.length);
    let peak = 0;
    let sumsq = 0;
    for (let i = 0; i < x.length; i++) {
      const y = Math.max(-1, Math.min(1, x[i]));
      peak = Math.max(peak, Math.abs(y));
      sumsq += y * y;
      pcm[i] = Math.round(y * 32767);
    }
    const bytes = new Uint8Array(44 + pcm.length * 2);
    const v = new DataView(bytes.buffer);
    const ascii = (o, s) => [...s].forEach((ch, i) => v.setUint8(o + i, ch.charCodeAt(0)));
    ascii(0, "RIFF");
    v.setUint32(4, 36 + pcm.length * 2, true);
    ascii(8, "WAVE");
    ascii(12, "fmt ");
    v.setUint32(16, 16, true);
    v.setUint16(20, 1, true); // PCM
    v.setUint16(22, 1, true); // mono
    v.setUint32(24, rate, true);
    v.setUint32(28, rate * 2, true);
    v.setUint16(32, 2, true);
    v.setUint16(34, 16, true);
    ascii(36, "data");
    v.setUint32(40, pcm.length * 2, true);
    new Uint8Array(bytes.buffer, 44).set(new Uint8Array(pcm.buffer));
    let bin = "";
    for (let i = 0; i < bytes.length; i += 0x8000) {
      bin += String.fromCharCode.apply(null, bytes.subarray(i, i + 0x8000));
    }
    return {
      wav_base64: btoa(bin),
      mime: r.mimeType,
      rate,
      seconds: pcm.length / rate,
      recorded_for_s: since(),
      peak,
      rms: pcm.length ? Math.sqrt(sumsq / pcm.length) : 0,
      truncated: rec.truncated,
      error: rec.error,
      events: rec.events,
      hiccups: rec.hiccups,
      server_errors: rec.errors,
      inbound_at_start: rec.atStart,
      inbound,
    };
  };

  class Recorded extends Native {
    constructor(...args) {
      super(...args);
      if (!rec.pc) rec.pc = this;
      this.addEventListener("track", record);
    }
    createDataChannel(...args) {
      const dc = super.createDataChannel(...args);
      dc.addEventListener("message", note);
      return dc;
    }
  }
  window.RTCPeerConnection = Recorded;
}

const browser = await launch[browserName]();
const stats = (page) => page.evaluate(() => JSON.parse(JSON.stringify(window.omnistreamStats)));
const waitFor = (page, fn, ms = timeout) => page.waitForFunction(fn, { timeout: ms, polling: 100 });
const text = (page, sel) => page.$eval(sel, (el) => el.textContent);
const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

async function ask(page, message) {
  await page.$eval("#message", (el) => (el.value = ""));
  await page.type("#message", message);
  await page.click("#send");
}

// WebRTC: the answer plays out on the track after response.done. Once the
// server says it stopped (output_audio_buffer.stopped) and the jitter buffer
// has played the tail, stop the recording and write it out as answer.wav.
async function takeRecording(page) {
  await waitFor(
    page,
    () => window.__omnistreamRecorder?.events.some((e) => e.type === "output_audio_buffer.stopped"),
  );
  await sleep(1000);
  const r = await page.evaluate(() => window.__omnistreamRecorder.stop());
  if (!r.seconds) throw new Error(`nothing recorded from the call's track: ${r.error}`);
  const wav = join(dir, "answer.wav");
  writeFileSync(wav, Buffer.from(r.wav_base64, "base64"));
  result.received_wav = wav;
  // inbound-rtp audio as the recording stopped, and as the answer started.
  result.inbound_audio = r.inbound;
  result.inbound_audio_at_start = r.inbound_at_start;
  for (const k of ["wav_base64", "inbound", "inbound_at_start"]) delete r[k];
  result.received = r;
  // The assistant's text is the answer's audio transcript
  // (response.output_audio_transcript.delta): what the audio says.
  result.transcript = result.after_first.turns[0].text;
}

try {
  const page = (await browser.pages())[0] ?? (await browser.newPage());
  page.on("console", (m) => {
    if (m.type() === "error") consoleErrors.push(m.text());
  });
  page.on("pageerror", (e) => consoleErrors.push(String(e)));

  // At most two minutes of received audio: the test only needs turn 1.
  await page.evaluateOnNewDocument(installRecorder, 120);
  const resp = await page.goto(url, { waitUntil: "load" });
  result.status = resp ? resp.status() : null;
  result.title = await page.title();
  result.user_agent = await page.evaluate(() => navigator.userAgent);
  // The controls carry the accessible names a screen-reader user would hear.
  result.labels = await page.evaluate(() => ({
    message: document.querySelector("#message")?.labels?.[0]?.textContent.trim(),
    send: document.querySelector("#send")?.textContent.trim(),
    stop: document.querySelector("#stop")?.textContent.trim(),
  }));

  if (process.env.MIC_WAV) {
    // Hands-free: press the button; the microphone asks; the page shows what
    // the server heard, then the answer plays.
    await page.click("#handsfree");
    result.handsfree_pressed = await page.$eval("#handsfree", (b) => b.getAttribute("aria-pressed"));
    await waitFor(page, () => {
      const t = window.omnistreamStats?.turns?.find((x) => x.heard);
      return t && t.status !== "in_progress";
    });
    await new Promise((r) => setTimeout(r, 500));
    result.stats = await stats(page);
    result.user_shown = await page.$$eval("#log .user .text", (els) => els.map((e) => e.textContent));
    result.status_text = await text(page, "#status");
    await page.screenshot({ path: screenshot });
    result.console_errors = consoleErrors;
    console.log(JSON.stringify(result));
    await browser.close();
    process.exit(0);
  }

  // Turn 1.
  await ask(page, prompt);
  await waitFor(page, () => {
    const t = window.omnistreamStats?.turns?.[0];
    return t && (t.audio_started || t.status !== "in_progress");
  });
  await waitFor(page, () => {
    const el = document.querySelector("#log .assistant .ttfp");
    return el && /\d+ ms/.test(el.textContent);
  });
  result.ttfp_shown = await text(page, "#log .assistant .ttfp");
  result.ttft_shown = await text(page, "#log .assistant .ttft");
  await waitFor(page, () => window.omnistreamStats.turns[0].status !== "in_progress");
  // Let the scheduled audio play on a little, to see the audio clock run.
  await sleep(1000);
  result.after_first = await stats(page);
  result.status_text = await text(page, "#status");
  if (result.after_first.transport === "webrtc") await takeRecording(page);

  // Turn 2: Stop as soon as the answer starts; the server must cancel it.
  await ask(page, "Tell me a long story about the sea and the ships on it.");
  await waitFor(page, () => {
    const t = window.omnistreamStats?.turns?.[1];
    return t && (t.ttft_ms !== null || t.audio_started || t.status !== "in_progress");
  });
  await page.click("#stop");
  await waitFor(page, () => window.omnistreamStats.turns[1].status !== "in_progress", 30000);

  await page.screenshot({ path: screenshot });
  result.stats = await stats(page);
  result.console_errors = consoleErrors;
  console.log(JSON.stringify(result));
  await browser.close();
} catch (e) {
  result.error = String(e && e.stack ? e.stack : e);
  result.console_errors = consoleErrors;
  try {
    const page = (await browser.pages())[0];
    if (page) {
      await page.screenshot({ path: screenshot });
      result.stats = await stats(page);
      result.error_shown = await text(page, "#error");
      result.server_errors = await page.evaluate(() => window.__omnistreamRecorder?.errors);
    }
  } catch (_) {
    // The page is gone; report what we have.
  }
  console.log(JSON.stringify(result));
  await browser.close().catch(() => {});
  process.exit(1);
}
