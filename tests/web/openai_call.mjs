// OpenAI's documented WebRTC call flow against omnistream, in headless
// Chromium (puppeteer-core over CDP):
//   node openai_call.mjs URL API_KEY
// The app server's part (this script, with the API key): an ephemeral key
// from POST /v1/realtime/client_secrets, with the session the call starts
// with. The browser's part, as OpenAI's guide writes it: the microphone
// track and the `oai-events` data channel on an RTCPeerConnection, the offer
// POSTed to /v1/realtime/calls with the ephemeral key as Bearer, the SDP
// answer set; then a text turn over the data channel, answered in audio on
// the track. Then the app server's sideband WebSocket on the call
// (/v1/realtime?call_id=…) asks for the answer's item, and the call is hung
// up with POST /v1/realtime/calls/{id}/hangup. Along the way, what must be
// refused is: a reused, a forged or a misapplied ephemeral key, a bad
// session. Prints one JSON object (exit 1 with {"error": ...}).
import { launchChromium } from "./chromium.mjs";
import { mkdtempSync } from "node:fs";
import { tmpdir } from "node:os";
import { join } from "node:path";

const [url, apiKey] = process.argv.slice(2);
if (!url || !apiKey) {
  console.error("usage: node openai_call.mjs URL API_KEY");
  process.exit(2);
}
const result = { url };
const INSTRUCTIONS = "You are a helpful assistant. Answer in one short sentence.";

async function post(path, { body, headers = {}, key = apiKey } = {}) {
  const r = await fetch(url + path, {
    method: "POST",
    headers: { Authorization: `Bearer ${key}`, ...headers },
    body,
  });
  const text = await r.text();
  let json = null;
  try {
    json = JSON.parse(text);
  } catch {}
  return { status: r.status, text, json, location: r.headers.get("location") };
}

async function secret(body) {
  return post("/v1/realtime/client_secrets", {
    body: JSON.stringify(body),
    headers: { "Content-Type": "application/json" },
  });
}

// The browser's part: OpenAI's guide, with this server as the base URL.
async function browserCall({ ek, ek2, apiKey }) {
  const out = { events: [] };
  const pc = new RTCPeerConnection();
  const audio = document.createElement("audio");
  audio.autoplay = true;
  pc.ontrack = (e) => (audio.srcObject = e.streams[0]);
  const ms = await navigator.mediaDevices.getUserMedia({ audio: true });
  pc.addTrack(ms.getTracks()[0]);
  const dc = pc.createDataChannel("oai-events");
  const waiters = [];
  dc.addEventListener("message", (e) => {
    const ev = JSON.parse(e.data);
    out.events.push(ev.type);
    for (const w of [...waiters]) if (w.test(ev)) w.done(ev);
  });
  const next = (test, ms = 120000) =>
    new Promise((resolve, reject) => {
      const w = { test, done: (ev) => { waiters.splice(waiters.indexOf(w), 1); clearTimeout(t); resolve(ev); } };
      const t = setTimeout(() => reject(new Error(`timed out; events: ${out.events.join(",")}`)), ms);
      waiters.push(w);
    });
  const created = next((ev) => ev.type === "session.created");
  const updated = next((ev) => ev.type === "session.updated");

  const offer = await pc.createOffer();
  await pc.setLocalDescription(offer);
  const sdpResponse = await fetch("/v1/realtime/calls", {
    method: "POST",
    body: offer.sdp,
    headers: { Authorization: `Bearer ${ek}`, "Content-Type": "application/sdp" },
  });
  out.status = sdpResponse.status;
  out.location = sdpResponse.headers.get("Location");
  out.contentType = sdpResponse.headers.get("Content-Type");
  const answer = { type: "answer", sdp: await sdpResponse.text() };
  await pc.setRemoteDescription(answer);

  // The key opened this call: used again, it is refused.
  const again = await fetch("/v1/realtime/calls", {
    method: "POST",
    body: offer.sdp,
    headers: { Authorization: `Bearer ${ek}`, "Content-Type": "application/sdp" },
  });
  out.reusedStatus = again.status;

  await created;
  out.instructions = (await updated).session.instructions;
  dc.send(JSON.stringify({
    type: "conversation.item.create",
    item: { type: "message", role: "user", content: [{ type: "input_text", text: "What do bees make?" }] },
  }));
  dc.send(JSON.stringify({ type: "response.create" }));
  const done = await next((ev) => ev.type === "response.done");
  await next((ev) => ev.type === "output_audio_buffer.stopped", 60000).catch(() => null);
  out.status_done = done.response.status;
  const item = done.response.output[0];
  out.itemId = item.id;
  out.transcript = item.content[0].transcript;
  for (const s of (await pc.getStats()).values()) {
    if (s.type === "inbound-rtp" && s.kind === "audio") {
      out.packetsReceived = s.packetsReceived;
      out.bytesReceived = s.bytesReceived;
    }
  }

  // The app server's sideband on the call: it asks for the answer's item;
  // the reply comes to it (and to the browser, whose session it is).
  const callId = out.location.split("/").pop();
  const side = new WebSocket(`ws://${location.host}/v1/realtime?call_id=${callId}`, [
    "realtime",
    `openai-insecure-api-key.${apiKey}`,
  ]);
  const sideEvents = [];
  const retrieved = new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`sideband: ${sideEvents.join(",")}`)), 30000);
    side.onmessage = (e) => {
      const ev = JSON.parse(e.data);
      sideEvents.push(ev.type);
      if (ev.type === "conversation.item.retrieved") {
        clearTimeout(t);
        resolve(ev);
      }
    };
    side.onerror = () => reject(new Error("the sideband failed to open"));
  });
  await new Promise((resolve) => (side.onopen = resolve));
  const seenByPage = next((ev) => ev.type === "conversation.item.retrieved", 30000);
  side.send(JSON.stringify({ type: "conversation.item.retrieve", item_id: out.itemId }));
  const got = await retrieved;
  out.sidebandTranscript = got.item.content[0].transcript;
  out.pageSawSideband = (await seenByPage).item.id === out.itemId;
  window.__call = { pc, dc, side, callId };

  // The multipart form (`sdp` and `session`) with the API key, as an app
  // server that relays the browser's offer sends it.
  const pc2 = new RTCPeerConnection();
  pc2.addTrack(ms.getTracks()[0].clone());
  const dc2 = pc2.createDataChannel("oai-events");
  const formUpdated = new Promise((resolve, reject) => {
    const t = setTimeout(() => reject(new Error("no session.updated on the form's call")), 30000);
    dc2.onmessage = (e) => {
      const ev = JSON.parse(e.data);
      if (ev.type === "session.updated") {
        clearTimeout(t);
        resolve(ev.session);
      }
    };
  });
  await pc2.setLocalDescription(await pc2.createOffer());
  const form = new FormData();
  form.set("sdp", pc2.localDescription.sdp);
  form.set("session", JSON.stringify({ type: "realtime", instructions: "Form session." }));
  const r2 = await fetch("/v1/realtime/calls", { method: "POST", body: form, headers: { Authorization: `Bearer ${apiKey}` } });
  out.formStatus = r2.status;
  // With an ephemeral key the session is the key's: a form carrying one is refused.
  const withKey = await fetch("/v1/realtime/calls", { method: "POST", body: form, headers: { Authorization: `Bearer ${ek2}` } });
  out.formWithEphemeralStatus = withKey.status;
  out.formWithEphemeralParam = (await withKey.json()).error?.param;
  await pc2.setRemoteDescription({ type: "answer", sdp: await r2.text() });
  out.formInstructions = (await formUpdated).instructions;
  pc2.close();
  return out;
}

let browser;
try {
  // Refusals an app server sees first.
  const badVoice = await secret({ session: { type: "realtime", audio: { output: { voice: "nobody" } } } });
  result.badVoice = { status: badVoice.status, param: badVoice.json?.error?.param };
  const badTtl = await secret({ expires_after: { anchor: "created_at", seconds: 5 } });
  result.badTtl = { status: badTtl.status, param: badTtl.json?.error?.param };
  const noKey = await post("/v1/realtime/client_secrets", { key: "wrong" });
  result.noKeyStatus = noKey.status;

  const made = await secret({
    expires_after: { anchor: "created_at", seconds: 600 },
    session: { type: "realtime", instructions: INSTRUCTIONS, audio: { output: { voice: "alloy" } } },
  });
  if (made.status !== 200) throw new Error(`client_secrets: ${made.status} ${made.text}`);
  const ek = made.json.value;
  const ek2 = (await secret({})).json.value;
  result.secret = { prefix: ek.slice(0, 3), expiresIn: made.json.expires_at - Math.floor(Date.now() / 1000), session: made.json.session.instructions };
  // An ephemeral key opens calls only.
  const models = await fetch(url + "/v1/models", { headers: { Authorization: `Bearer ${ek}` } });
  result.ekOnModels = models.status;
  const forged = await post("/v1/realtime/calls", {
    key: "ek_forged",
    body: "v=0",
    headers: { "Content-Type": "application/sdp" },
  });
  result.forged = { status: forged.status, message: forged.json?.error?.message };

  const dir = mkdtempSync(join(tmpdir(), "omnistream-call-"));
  browser = await launchChromium(dir);
  const page = await browser.newPage();
  // Any page of the server's own origin (the guide's code runs on the app's page).
  await page.goto(url + "/health");
  result.call = await page.evaluate(browserCall, { ek, ek2, apiKey });

  const callId = result.call.location.split("/").pop();
  const hung = await post(`/v1/realtime/calls/${callId}/hangup`);
  result.hangupStatus = hung.status;
  result.afterHangup = await page.evaluate(async () => {
    const { pc, side } = window.__call;
    const until = Date.now() + 15000;
    while (Date.now() < until) {
      if (["closed", "failed", "disconnected"].includes(pc.connectionState) && side.readyState === WebSocket.CLOSED) break;
      await new Promise((r) => setTimeout(r, 100));
    }
    return { pc: pc.connectionState, sideband: side.readyState };
  });
  const again = await post(`/v1/realtime/calls/${callId}/hangup`);
  result.hangupAgainStatus = again.status;
  console.log(JSON.stringify(result));
  await browser.close();
} catch (e) {
  result.error = String(e?.stack ?? e);
  console.log(JSON.stringify(result));
  if (browser) await browser.close();
  process.exit(1);
}
