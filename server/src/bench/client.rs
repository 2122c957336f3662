//! One bench request against a running server, timed as the client sees it:
//! `/v1/chat/completions` (SSE), `/v1/audio/speech` (streamed PCM body) or
//! `/v1/realtime` (WebSocket). Every function returns the request's
//! [`Timeline`] or a message saying why it failed.

use std::time::{Duration, Instant};

use base64::Engine as _;
use futures_util::{SinkExt, StreamExt};
use serde_json::{json, Value};
use tokio_tungstenite::tungstenite::{self, client::IntoClientRequest, Message};

use std::sync::Arc;

use super::dataset::Question;
use super::metrics::Timeline;

/// `pcm16` / `pcm` output of the OpenAI APIs: 24 kHz mono s16le.
const PCM_RATE: f64 = 24_000.0;

#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Endpoint {
    /// `POST /v1/chat/completions`, streamed (SSE).
    Chat,
    /// `POST /v1/audio/speech`, PCM streamed as it is produced.
    Speech,
    /// `GET /v1/realtime`: one WebSocket session per request.
    Realtime,
}

/// What every request of a run asks for.
#[derive(Debug, Clone, serde::Serialize)]
pub struct RequestShape {
    pub endpoint: Endpoint,
    pub model: String,
    pub voice: String,
    /// Ask for audio (chat and realtime); speech always returns audio.
    pub audio: bool,
    /// Output token cap (speech: codec frames); with `ignore_eos` every answer
    /// is exactly this long.
    pub max_tokens: Option<usize>,
    pub ignore_eos: bool,
    /// Speech: a reference clip (base64 WAV) that every request clones.
    #[serde(skip)]
    pub ref_audio: Option<Arc<String>>,
    /// Speech: the clip's words (in-context cloning).
    pub ref_text: Option<String>,
    /// Speech: `instructions` (a voice described in words, or a style).
    pub instructions: Option<String>,
    pub temperature: Option<f64>,
    #[serde(skip)]
    pub timeout: Duration,
    /// Spoken questions instead of typed prompts (chat: `input_audio`;
    /// realtime: a microphone paced at real time, turns found by server VAD).
    /// Times then run from the end of speech.
    #[serde(skip)]
    pub questions: Option<Arc<Vec<Question>>>,
    /// Where the questions came from, for the report.
    pub spoken_input: Option<String>,
    /// Realtime with spoken questions: the server VAD's `silence_duration_ms`.
    pub vad_silence_ms: u32,
}

impl RequestShape {
    /// The spoken question of the request seeded `seed` (cycling).
    fn question(&self, seed: u64) -> Option<&Question> {
        let q = self.questions.as_ref()?;
        q.get((seed % q.len().max(1) as u64) as usize)
    }
}

/// Microphone chunks on Realtime: 20 ms, as a browser sends them.
const MIC_CHUNK_S: f64 = 0.02;

/// A client for one server.
#[derive(Clone)]
pub struct Client {
    base: String,
    api_key: Option<String>,
    http: reqwest::Client,
}

impl Client {
    pub fn new(base: &str, api_key: Option<String>) -> anyhow::Result<Self> {
        let base = base.trim_end_matches('/').to_string();
        if !base.starts_with("http://") {
            anyhow::bail!(
                "--url must be http://HOST:PORT (the bench speaks plain HTTP), got {base:?}"
            );
        }
        let http = reqwest::Client::builder()
            .pool_max_idle_per_host(256)
            .build()?;
        Ok(Self {
            base,
            api_key,
            http,
        })
    }

    pub fn base(&self) -> &str {
        &self.base
    }

    fn post(&self, path: &str) -> reqwest::RequestBuilder {
        let rb = self.http.post(format!("{}{path}", self.base));
        match &self.api_key {
            Some(k) => rb.bearer_auth(k),
            None => rb,
        }
    }

    /// Sends `body` to `path`; returns when it was sent and the response,
    /// a non-2xx status turned into the server's message.
    async fn post_json(
        &self,
        path: &str,
        body: &Value,
    ) -> Result<(Instant, reqwest::Response), String> {
        let t0 = Instant::now();
        let resp = self
            .post(path)
            .json(body)
            .send()
            .await
            .map_err(|e| describe(&e))?;
        Ok((t0, ok_or_error_body(resp).await?))
    }

    /// `GET path` → body, for `/health` and `/metrics`.
    pub async fn get_text(&self, path: &str) -> Result<String, String> {
        let mut rb = self
            .http
            .get(format!("{}{path}", self.base))
            .timeout(Duration::from_secs(10));
        if let Some(k) = &self.api_key {
            rb = rb.bearer_auth(k);
        }
        let resp = rb.send().await.map_err(|e| describe(&e))?;
        let status = resp.status();
        let body = resp.text().await.map_err(|e| describe(&e))?;
        if !status.is_success() {
            return Err(format!("HTTP {status}: {}", body.trim()));
        }
        Ok(body)
    }

    /// Sends one request with `prompt`; `seed` makes sampling reproducible.
    pub async fn run(
        &self,
        shape: &RequestShape,
        prompt: &str,
        seed: u64,
    ) -> Result<Timeline, String> {
        let fut = async {
            match shape.endpoint {
                Endpoint::Chat => self.chat(shape, prompt, seed).await,
                Endpoint::Speech => self.speech(shape, prompt).await,
                Endpoint::Realtime => match shape.question(seed) {
                    Some(q) => self.realtime_spoken(shape, q).await,
                    None => self.realtime(shape, prompt).await,
                },
            }
        };
        tokio::time::timeout(shape.timeout, fut)
            .await
            .unwrap_or_else(|_| Err(format!("no complete answer within {:?}", shape.timeout)))
    }

    async fn chat(
        &self,
        shape: &RequestShape,
        prompt: &str,
        seed: u64,
    ) -> Result<Timeline, String> {
        let content = match shape.question(seed) {
            Some(q) => json!([{"type": "input_audio",
                               "input_audio": {"data": q.wav_b64, "format": "wav"}}]),
            None => json!(prompt),
        };
        let mut body = json!({
            "model": shape.model,
            "messages": [{"role": "user", "content": content}],
            "stream": true,
            "stream_options": {"include_usage": true},
            "seed": seed,
        });
        if shape.audio {
            body["modalities"] = json!(["text", "audio"]);
            body["audio"] = json!({"voice": shape.voice, "format": "pcm16"});
        } else {
            body["modalities"] = json!(["text"]);
        }
        if let Some(n) = shape.max_tokens {
            body["max_tokens"] = json!(n);
        }
        if shape.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(t) = shape.temperature {
            body["temperature"] = json!(t);
        }
        let (t0, resp) = self.post_json("/v1/chat/completions", &body).await?;
        let mut tl = Timeline::default();
        let mut sse = SseLines::default();
        let mut stream = resp.bytes_stream();
        let mut done = false;
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| describe(&e))?;
            for data in sse.push(&chunk) {
                let now = t0.elapsed().as_secs_f64();
                if data == "[DONE]" {
                    done = true;
                    continue;
                }
                let v: Value = serde_json::from_str(&data)
                    .map_err(|e| format!("unparseable SSE event ({e}): {data:.200}"))?;
                if let Some(err) = v.get("error") {
                    return Err(format!("error event: {err}"));
                }
                let delta = &v["choices"][0]["delta"];
                let text = delta["content"].as_str().unwrap_or("").to_string()
                    + delta["audio"]["transcript"].as_str().unwrap_or("");
                if !text.is_empty() {
                    tl.first_text.get_or_insert(now);
                    tl.last_text = Some(now);
                }
                if let Some(b64) = delta["audio"]["data"].as_str() {
                    audio_chunk(&mut tl, b64, now)?;
                }
                if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                    tl.output_tokens = u["completion_tokens"].as_u64().map(|n| n as usize);
                    tl.input_tokens = u["prompt_tokens"].as_u64().map(|n| n as usize);
                }
            }
        }
        if !done {
            return Err("the stream ended without [DONE]".into());
        }
        tl.end = t0.elapsed().as_secs_f64();
        Ok(tl)
    }

    async fn speech(&self, shape: &RequestShape, prompt: &str) -> Result<Timeline, String> {
        let mut body = json!({
            "model": shape.model,
            "input": prompt,
            "voice": shape.voice,
            "response_format": "pcm",
            "stream_format": "audio",
        });
        if let Some(n) = shape.max_tokens {
            body["max_tokens"] = json!(n);
        }
        if shape.ignore_eos {
            body["ignore_eos"] = json!(true);
        }
        if let Some(clip) = &shape.ref_audio {
            body["ref_audio"] = json!(clip.as_str());
        }
        if let Some(i) = &shape.instructions {
            body["instructions"] = json!(i);
        }
        if let Some(t) = &shape.ref_text {
            body["ref_text"] = json!(t);
        }
        let (t0, resp) = self.post_json("/v1/audio/speech", &body).await?;
        let mut tl = Timeline::default();
        let mut stream = resp.bytes_stream();
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| describe(&e))?;
            let now = t0.elapsed().as_secs_f64();
            tl.audio(now, chunk.len() as f64 / 2.0 / PCM_RATE);
        }
        tl.end = t0.elapsed().as_secs_f64();
        Ok(tl)
    }

    async fn realtime(&self, shape: &RequestShape, prompt: &str) -> Result<Timeline, String> {
        let mut ws = self.connect_realtime().await?;
        let send = |v: Value| Message::Text(v.to_string().into());
        let mut response = json!({
            "output_modalities": if shape.audio { ["audio"] } else { ["text"] },
            "audio": {"output": {"voice": shape.voice}},
        });
        if let Some(n) = shape.max_tokens {
            response["max_output_tokens"] = json!(n);
        }
        if shape.ignore_eos {
            response["ignore_eos"] = json!(true);
        }
        if let Some(t) = shape.temperature {
            response["temperature"] = json!(t);
        }
        ws.send(send(json!({
            "type": "conversation.item.create",
            "item": {"type": "message", "role": "user",
                     "content": [{"type": "input_text", "text": prompt}]},
        })))
        .await
        .map_err(|e| e.to_string())?;
        let t0 = Instant::now();
        ws.send(send(
            json!({"type": "response.create", "response": response}),
        ))
        .await
        .map_err(|e| e.to_string())?;
        let mut tl = Timeline::default();
        while let Some(msg) = ws.next().await {
            let msg = msg.map_err(|e| format!("WebSocket: {e}"))?;
            let Message::Text(text) = msg else {
                continue;
            };
            let now = t0.elapsed().as_secs_f64();
            if realtime_event(&mut tl, &text, now)? {
                let _ = ws.close(None).await;
                return Ok(tl);
            }
        }
        Err("the WebSocket closed before response.done".into())
    }

    /// One spoken turn on Realtime: the question streamed in 20 ms chunks at
    /// real time, then silence until the server's VAD ends the turn and its
    /// answer starts by itself. Times run from the last chunk of speech.
    async fn realtime_spoken(
        &self,
        shape: &RequestShape,
        q: &Question,
    ) -> Result<Timeline, String> {
        let ws = self.connect_realtime().await?;
        let (mut tx, mut rx) = ws.split();
        let send = |v: Value| Message::Text(v.to_string().into());
        let mut session = json!({
            "type": "realtime",
            "output_modalities": if shape.audio { ["audio"] } else { ["text"] },
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": 24000},
                    "turn_detection": {"type": "server_vad",
                                       "silence_duration_ms": shape.vad_silence_ms},
                },
                "output": {"voice": shape.voice},
            },
        });
        if let Some(n) = shape.max_tokens {
            session["max_output_tokens"] = json!(n);
        }
        if shape.ignore_eos {
            session["ignore_eos"] = json!(true);
        }
        if let Some(t) = shape.temperature {
            session["temperature"] = json!(t);
        }
        tx.send(send(json!({"type": "session.update", "session": session})))
            .await
            .map_err(|e| e.to_string())?;
        // The microphone: speech, then silence until the turn is taken.
        let (ended_tx, ended_rx) = tokio::sync::oneshot::channel::<Instant>();
        let (heard_tx, mut heard_rx) = tokio::sync::watch::channel(false);
        let chunk = (24_000.0 * MIC_CHUNK_S) as usize * 2;
        let speech = q.pcm.clone();
        let mic = tokio::spawn(async move {
            let b64 = |b: &[u8]| base64::engine::general_purpose::STANDARD.encode(b);
            let silence = vec![0u8; chunk];
            let start = tokio::time::Instant::now();
            let mut ended = Some(ended_tx);
            for k in 0.. {
                let from = k * chunk;
                let part: &[u8] = if from < speech.len() {
                    &speech[from..(from + chunk).min(speech.len())]
                } else {
                    if let Some(t) = ended.take() {
                        let _ = t.send(Instant::now());
                    }
                    if *heard_rx.borrow_and_update() {
                        break;
                    }
                    &silence
                };
                let m = send(json!({"type": "input_audio_buffer.append", "audio": b64(part)}));
                if tx.send(m).await.is_err() {
                    break;
                }
                let next = start + Duration::from_secs_f64(MIC_CHUNK_S * (k + 1) as f64);
                if from + chunk < speech.len() {
                    // Speech keeps its pace whatever the server says meanwhile.
                    tokio::time::sleep_until(next).await;
                } else {
                    tokio::select! {
                        _ = tokio::time::sleep_until(next) => {}
                        _ = heard_rx.changed() => {}
                    }
                }
            }
            tx
        });
        let mut ended: Option<Instant> = None;
        let mut ended_rx = ended_rx;
        let mut tl = Timeline::default();
        let result = loop {
            let Some(msg) = rx.next().await else {
                break Err("the WebSocket closed before response.done".to_string());
            };
            let msg = match msg {
                Ok(m) => m,
                Err(e) => break Err(format!("WebSocket: {e}")),
            };
            let Message::Text(text) = msg else {
                continue;
            };
            if ended.is_none() {
                ended = ended_rx.try_recv().ok();
            }
            let now = Instant::now();
            let at =
                |t: Instant| ended.map_or(0.0, |e| t.saturating_duration_since(e).as_secs_f64());
            if text.contains("\"input_audio_buffer.committed\"") {
                // A turn the server ended at a pause inside the question is
                // not the end of speech: only one after it is.
                if ended.is_some() && tl.turn_end.is_none() {
                    let _ = heard_tx.send(true);
                    tl.turn_end = Some(at(now));
                }
                continue;
            }
            // An answer to a part of the question, cut when the speaker went
            // on (barge-in), is the conversation working, not a failure:
            // measure the answer to the whole question.
            if tl.turn_end.is_none() && text.contains("\"response.done\"") {
                tl = Timeline::default();
                continue;
            }
            match realtime_event(&mut tl, &text, at(now)) {
                Ok(true) => break Ok(()),
                Ok(false) => {}
                Err(e) => break Err(e),
            }
        };
        let _ = heard_tx.send(true);
        if let Ok(mut tx) = mic.await {
            let _ = tx.close().await;
        }
        result.map(|()| tl)
    }

    async fn connect_realtime(
        &self,
    ) -> Result<
        tokio_tungstenite::WebSocketStream<
            tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>,
        >,
        String,
    > {
        let url = format!("ws{}/v1/realtime", &self.base["http".len()..]);
        let mut req = url.into_client_request().map_err(|e| e.to_string())?;
        if let Some(k) = &self.api_key {
            let v = format!("Bearer {k}")
                .parse()
                .map_err(|_| "the API key is not a valid header value".to_string())?;
            req.headers_mut().insert("authorization", v);
        }
        let (ws, _) = tokio_tungstenite::connect_async(req)
            .await
            .map_err(|e| match e {
                tungstenite::Error::Http(r) => {
                    format!("WebSocket upgrade refused: HTTP {}", r.status())
                }
                e => format!("WebSocket connect: {e}"),
            })?;
        Ok(ws)
    }
}

/// One Realtime server event into `tl`; `true` at the answer's
/// `response.done`.
fn realtime_event(tl: &mut Timeline, text: &str, now: f64) -> Result<bool, String> {
    let v: Value =
        serde_json::from_str(text).map_err(|e| format!("unparseable event ({e}): {text:.200}"))?;
    match v["type"].as_str().unwrap_or("") {
        "response.output_text.delta" | "response.output_audio_transcript.delta"
            if v["delta"].as_str().is_some_and(|d| !d.is_empty()) =>
        {
            tl.first_text.get_or_insert(now);
            tl.last_text = Some(now);
        }
        "response.output_audio.delta" => audio_chunk(tl, v["delta"].as_str().unwrap_or(""), now)?,
        "response.done" => {
            let r = &v["response"];
            // Stopping at max_output_tokens is the cap the bench set.
            let capped =
                r["status"] == "incomplete" && r["status_details"]["reason"] == "max_output_tokens";
            if r["status"] != "completed" && !capped {
                return Err(format!("response {}: {}", r["status"], r["status_details"]));
            }
            tl.output_tokens = r["usage"]["output_tokens"].as_u64().map(|n| n as usize);
            tl.input_tokens = r["usage"]["input_tokens"].as_u64().map(|n| n as usize);
            tl.end = now;
            return Ok(true);
        }
        "error" => return Err(format!("error event: {}", v["error"])),
        _ => {}
    }
    Ok(false)
}

fn audio_chunk(tl: &mut Timeline, b64: &str, now: f64) -> Result<(), String> {
    let pcm = base64::engine::general_purpose::STANDARD
        .decode(b64)
        .map_err(|e| format!("audio delta is not base64: {e}"))?;
    tl.audio(now, (pcm.len() / 2) as f64 / PCM_RATE);
    Ok(())
}

/// A non-2xx response becomes its status and the server's message.
async fn ok_or_error_body(resp: reqwest::Response) -> Result<reqwest::Response, String> {
    let status = resp.status();
    if status.is_success() {
        return Ok(resp);
    }
    let body = resp.text().await.unwrap_or_default();
    let msg = serde_json::from_str::<Value>(&body)
        .ok()
        .and_then(|v| v["error"]["message"].as_str().map(String::from))
        .unwrap_or(body);
    Err(format!("HTTP {status}: {}", msg.trim()))
}

/// reqwest's Display hides the cause ("error sending request"); add it.
fn describe(e: &reqwest::Error) -> String {
    let mut s = e.to_string();
    let mut src = std::error::Error::source(e);
    while let Some(cause) = src {
        s.push_str(": ");
        s.push_str(&cause.to_string());
        src = cause.source();
    }
    s
}

/// Splits a byte stream into the `data:` payloads of server-sent events.
#[derive(Default)]
pub struct SseLines {
    buf: Vec<u8>,
}

impl SseLines {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(i) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=i).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\r', '\n']);
            if let Some(data) = line.strip_prefix("data:") {
                out.push(data.trim_start().to_string());
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_across_chunks() {
        let mut s = SseLines::default();
        assert!(s.push(b"data: {\"a\"").is_empty());
        assert_eq!(s.push(b":1}\n\ndata: [DONE]\r\n"), ["{\"a\":1}", "[DONE]"]);
        assert!(s.push(b": comment\nevent: x\n\n").is_empty());
    }

    #[test]
    fn audio_deltas_add_up() {
        let mut tl = Timeline::default();
        let b64 = base64::engine::general_purpose::STANDARD.encode(vec![0u8; 4800]);
        audio_chunk(&mut tl, &b64, 0.25).unwrap();
        audio_chunk(&mut tl, &b64, 0.75).unwrap();
        audio_chunk(&mut tl, "", 0.9).unwrap();
        assert_eq!(tl.first_audio, Some(0.25));
        assert_eq!(tl.last_audio, Some(0.75));
        assert!((tl.audio_seconds - 0.2).abs() < 1e-12);
        assert!(audio_chunk(&mut tl, "!!", 1.0).is_err());
    }
}
