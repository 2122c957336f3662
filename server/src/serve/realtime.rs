//! `GET /v1/realtime`: the OpenAI Realtime protocol (GA event names) over a
//! WebSocket, text in, text and/or 24 kHz pcm16 audio out.
//!
//! One connection is one session. The handler task reads client events in
//! order; a writer task owns the socket's send half behind a bounded queue
//! (`conn::Outbox`); each response runs in its own task that forwards the
//! pipeline's events the moment they arrive. The shared connection plumbing
//! (upgrade limits, the writer, slow-client detection, the response driver) is
//! in [`conn`] and is used by `/v1/stream` too.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{close_code, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use omnistream_stages::engine::{Modalities, RequestInput, RequestSpec, TRANSCRIBE_RATE};
use omnistream_stages::models::tokenizer::ChatMessage;

use super::audio::OutputFormat;
use super::listen;
use super::metrics::TaskGuard;
use super::sessions::{Session, SessionGuard};
use super::state::AppState;
use super::turns::{Playback, Turn, TurnDetector, TurnSettings};
use super::webrtc::media::AudioOut;
use conn::{Active, ClientError, Drain, End, Generation, Outbox, Step};

/// The only output (and input) audio format: pcm16, mono, 24 kHz.
const RATE: u32 = 24_000;
/// The input audio buffer's limit (60 s at 24 kHz); commit or clear it.
const MAX_INPUT_AUDIO_BYTES: usize = RATE as usize * 2 * 60;
const MAX_OUTPUT_TOKENS: u64 = 4096;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/realtime", get(upgrade))
}

async fn upgrade(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    conn::accept(state, &headers, ws, "realtime", &["realtime"], serve)
}

/// A server event: `type` and a fresh `event_id` added to `body`.
pub fn event(kind: &str, mut body: Value) -> Message {
    if let Value::Object(m) = &mut body {
        m.insert("type".into(), kind.into());
        m.insert("event_id".into(), conn::new_id("event").into());
    }
    Message::Text(body.to_string().into())
}

fn error_event(e: &ClientError, client_event_id: Option<&str>) -> Message {
    event(
        "error",
        json!({"error": {
            "type": e.kind, "code": e.code, "message": e.message,
            "param": e.param, "event_id": client_event_id,
        }}),
    )
}

/// Per-connection state the reader owns; the conversation lives in the
/// session manager (`Session`).
struct Realtime {
    state: Arc<AppState>,
    out: Outbox,
    session: SessionGuard,
    /// Session default for `output_modalities`: `["audio"]` or `["text"]`.
    audio_out: bool,
    input_audio: Vec<u8>,
    last_item: Option<String>,
    active: Option<Active>,
    /// `server_vad` turn detection, when the session turned it on.
    turns: Option<TurnDetector>,
    /// The item id announced with `speech_started`, used at its commit.
    speech_item: Option<String>,
    /// How the latest answer is playing (for barge-in).
    playback: Option<Arc<Playback>>,
    /// WebRTC: the paced track the answers' audio goes to.
    speaker: Option<AudioOut>,
}

async fn serve(state: Arc<AppState>, socket: WebSocket, session: SessionGuard) {
    let _conn = conn::ConnGauge::new(&state.metrics, "realtime");
    let (sink, stream) = socket.split();
    let slow = error_event(&ClientError::slow_client(), None);
    let out = Outbox::start(sink, &state.metrics, slow);
    run_session(state, out, stream, session, None).await;
}

/// Audio that travels outside the event channel (WebRTC): the answer's audio
/// goes to a paced media track and the microphone comes in as PCM.
pub struct MediaPath {
    pub speaker: AudioOut,
    /// pcm16 LE, 24 kHz mono, as the peer's track is decoded.
    pub mic: tokio::sync::mpsc::Receiver<Vec<u8>>,
}

/// Error event for a client too slow to read (the last thing it is sent).
pub fn slow_client_event() -> Message {
    error_event(&ClientError::slow_client(), None)
}

/// A Realtime conversation over any transport: events in from `stream`, out
/// through `out`; with `media`, audio over a media track instead of events.
pub async fn run_session<St>(
    state: Arc<AppState>,
    out: Outbox,
    mut stream: St,
    session: SessionGuard,
    media: Option<MediaPath>,
) where
    St: futures_util::Stream<Item = Result<Message, axum::Error>> + Unpin,
{
    let _task = TaskGuard::new(&state.metrics);
    let (speaker, mut mic) = match media {
        Some(m) => (Some(m.speaker), Some(m.mic)),
        None => (None, None),
    };
    let mut rt = Realtime {
        state,
        out: out.clone(),
        session,
        audio_out: true,
        input_audio: Vec::new(),
        last_item: None,
        active: None,
        turns: None,
        speech_item: None,
        playback: None,
        speaker,
    };
    rt.send_session("session.created").await;
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain = Drain::new(&rt.state);
    loop {
        tokio::select! {
            biased;
            _ = out.closed() => break,
            _ = drain.next() => {
                // WebRTC: the answer is done when the track has played it.
                let playing = rt.speaker.as_ref().is_some_and(|s| s.queued_samples() > 0);
                let closing = drain.closing();
                if drain.due(rt.active.as_ref()) && (!playing || closing) {
                    if rt.speaker.is_some() && !closing {
                        // `output_audio_buffer.stopped` is one frame behind.
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    let bye = error_event(&ClientError::shutting_down(), None);
                    out.finish(bye, close_code::AWAY, conn::GOODBYE).await;
                    break;
                }
            }
            _ = tick.tick() => {
                let busy = rt.active.as_ref().is_some_and(Active::running);
                if !conn::keep_alive(&rt.state, &rt.session.id, busy) {
                    out.close(Some(error_event(&ClientError::expired(), None)), close_code::POLICY);
                    break;
                }
            }
            Some(pcm) = async { match mic.as_mut() { Some(m) => m.recv().await, None => None } } => {
                rt.mic_audio(&pcm).await;
            }
            msg = stream.next() => match msg {
                None | Some(Ok(Message::Close(_))) => break,
                Some(Err(e)) => {
                    if let Some((err, code)) = conn::read_error(&e) {
                        out.close(Some(error_event(&err, None)), code);
                    }
                    break;
                }
                Some(Ok(Message::Text(t))) => rt.on_text(&t).await,
                Some(Ok(Message::Binary(_))) => {
                    let e = ClientError::invalid(
                        "invalid_frame",
                        "binary frames are not part of the Realtime protocol: send JSON text events",
                    );
                    rt.send(error_event(&e, None)).await;
                }
                Some(Ok(Message::Pong(p))) => out.pong(&p),
                Some(Ok(Message::Ping(_))) => {} // answered by the socket
            }
        }
    }
    if let Some(a) = rt.active.take() {
        let _ = a.cancel.send(true);
    }
    out.close(None, close_code::NORMAL);
}

/// `"inf"` or a positive integer.
fn parse_max_tokens(v: &Value, param: &'static str) -> Result<Option<usize>, ClientError> {
    match v {
        Value::String(s) if s == "inf" => Ok(None),
        Value::Number(n) => match n.as_u64() {
            Some(k) if (1..=MAX_OUTPUT_TOKENS).contains(&k) => Ok(Some(k as usize)),
            _ => Err(ClientError::param(
                param,
                format!("{param} must be an integer from 1 to {MAX_OUTPUT_TOKENS}, or \"inf\""),
            )),
        },
        _ => Err(ClientError::param(
            param,
            format!("{param} must be an integer or \"inf\""),
        )),
    }
}

fn check_temperature(t: f64) -> Result<f64, ClientError> {
    if (0.0..=2.0).contains(&t) {
        Ok(t)
    } else {
        Err(ClientError::param(
            "temperature",
            "temperature must be between 0 and 2",
        ))
    }
}

fn check_voice(state: &AppState, v: &str) -> Result<String, ClientError> {
    state.voice(v).map_err(|m| ClientError::param("voice", m))
}

/// Accepts pcm16 at 24 kHz, in the GA (`{"type":"audio/pcm","rate":24000}`)
/// or beta (`"pcm16"`) shape; anything else is `unsupported_audio_format`.
fn check_format(v: &Value, param: &'static str) -> Result<(), ClientError> {
    let unsupported = |what: String| {
        Err(ClientError {
            param: Some(param),
            ..ClientError::invalid(
                "unsupported_audio_format",
                format!(
                    "audio format {what} is not supported: use {{\"type\":\"audio/pcm\",\"rate\":24000}} (pcm16)"
                ),
            )
        })
    };
    match v {
        Value::String(s) if s == "pcm16" || s == "audio/pcm" => Ok(()),
        Value::Object(m) => {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            if kind != "audio/pcm" {
                return unsupported(format!("{kind:?}"));
            }
            match m.get("rate") {
                None | Some(Value::Null) => Ok(()),
                Some(r) if r.as_u64() == Some(u64::from(RATE)) => Ok(()),
                Some(r) => unsupported(format!("audio/pcm at {r} Hz")),
            }
        }
        other => unsupported(other.to_string()),
    }
}

fn modalities(names: &[String], param: &'static str) -> Result<bool, ClientError> {
    let m = Modalities::from_names(names).map_err(|e| ClientError::param(param, e))?;
    Ok(m.audio)
}

/// Deserializes a present field as `Some(value)` (so `null` is `Some(Null)`,
/// and an absent one stays `None`).
fn present<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Option<Value>, D::Error> {
    Value::deserialize(d).map(Some)
}

#[derive(Deserialize, Default)]
struct AudioInPatch {
    format: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    turn_detection: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    transcription: Option<Value>,
}

#[derive(Deserialize, Default)]
struct AudioOutPatch {
    format: Option<Value>,
    voice: Option<String>,
    speed: Option<f32>,
}

#[derive(Deserialize, Default)]
struct AudioPatch {
    input: Option<AudioInPatch>,
    output: Option<AudioOutPatch>,
}

/// `session.update`'s `session` (GA shape, with the beta names accepted too).
#[derive(Deserialize, Default)]
struct SessionPatch {
    #[serde(rename = "type")]
    kind: Option<String>,
    instructions: Option<String>,
    voice: Option<String>,
    output_modalities: Option<Vec<String>>,
    modalities: Option<Vec<String>>,
    audio: Option<AudioPatch>,
    output_audio_format: Option<Value>,
    input_audio_format: Option<Value>,
    #[serde(default, deserialize_with = "present")]
    turn_detection: Option<Value>,
    max_output_tokens: Option<Value>,
    max_response_output_tokens: Option<Value>,
    temperature: Option<f64>,
    tools: Option<Vec<Value>>,
}

#[derive(Deserialize)]
struct SessionUpdate {
    session: SessionPatch,
}

#[derive(Deserialize)]
struct ContentIn {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
    transcript: Option<String>,
    audio: Option<String>,
}

#[derive(Deserialize)]
struct ItemIn {
    id: Option<String>,
    #[serde(rename = "type")]
    kind: String,
    role: Option<String>,
    #[serde(default)]
    content: Vec<ContentIn>,
}

#[derive(Deserialize)]
struct ItemCreate {
    item: ItemIn,
}

#[derive(Deserialize, Default)]
struct ResponseParams {
    output_modalities: Option<Vec<String>>,
    modalities: Option<Vec<String>>,
    instructions: Option<String>,
    voice: Option<String>,
    audio: Option<AudioPatch>,
    output_audio_format: Option<Value>,
    max_output_tokens: Option<Value>,
    max_response_output_tokens: Option<Value>,
    temperature: Option<f64>,
    conversation: Option<String>,
    input: Option<Vec<Value>>,
}

#[derive(Deserialize, Default)]
struct ResponseCreate {
    #[serde(default)]
    response: Option<ResponseParams>,
}

#[derive(Deserialize, Default)]
struct ResponseCancel {
    response_id: Option<String>,
}

#[derive(Deserialize)]
struct AudioAppend {
    audio: String,
}

/// What a validated `session.update` changes.
struct SessionChange {
    /// Checked in `session_update`, which knows whether the server has VAD.
    turn_detection: Option<Value>,
    instructions: Option<String>,
    voice: Option<String>,
    audio_out: Option<bool>,
    max_tokens: Option<Option<usize>>,
    temperature: Option<f64>,
    speed: Option<f32>,
}

impl SessionPatch {
    /// Validates everything before anything is applied.
    fn validate(self) -> Result<SessionChange, ClientError> {
        if let Some(k) = self.kind.as_deref() {
            if k != "realtime" {
                return Err(ClientError::param(
                    "session.type",
                    format!("session type {k:?} is not supported: use \"realtime\""),
                ));
            }
        }
        let audio = self.audio.unwrap_or_default();
        let input = audio.input.unwrap_or_default();
        let output = audio.output.unwrap_or_default();
        let turn_detection = input.turn_detection.or(self.turn_detection);
        // Committed speech is always transcribed where the pipeline hears (the
        // Thinker reads words); a transcription config may only ask for that.
        if let Some(Value::Object(t)) = &input.transcription {
            let lang = t.get("language").and_then(Value::as_str);
            if lang.is_some_and(|l| l != "en") {
                return Err(ClientError::param(
                    "session.audio.input.transcription.language",
                    "the recognizer (Whisper tiny.en) hears English only: use \"en\"",
                ));
            }
        }
        if self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(ClientError::param(
                "session.tools",
                "tools are not supported",
            ));
        }
        for (f, p) in [
            (&output.format, "session.audio.output.format"),
            (&self.output_audio_format, "session.output_audio_format"),
            (&input.format, "session.audio.input.format"),
            (&self.input_audio_format, "session.input_audio_format"),
        ] {
            if let Some(f) = f {
                check_format(f, p)?;
            }
        }
        // Checked against the pipeline's voices where the session applies it.
        let voice = output.voice.or(self.voice);
        let audio_out = match self.output_modalities.or(self.modalities) {
            Some(names) => Some(modalities(&names, "session.output_modalities")?),
            None => None,
        };
        let max_tokens = match self.max_output_tokens.or(self.max_response_output_tokens) {
            Some(v) => Some(parse_max_tokens(&v, "max_output_tokens")?),
            None => None,
        };
        let temperature = self.temperature.map(check_temperature).transpose()?;
        let speed = match output.speed {
            Some(s) if (0.25..=1.5).contains(&s) => Some(s),
            Some(_) => {
                return Err(ClientError::param(
                    "session.audio.output.speed",
                    "speed must be between 0.25 and 1.5",
                ))
            }
            None => None,
        };
        Ok(SessionChange {
            turn_detection,
            instructions: self.instructions,
            voice,
            audio_out,
            max_tokens,
            temperature,
            speed,
        })
    }
}

/// What a validated `response.create` asks for.
struct ResponseOptions {
    audio_out: bool,
    /// Whether the answer joins the conversation (`conversation: "auto"`).
    record: bool,
    instructions: Option<String>,
    voice: Option<String>,
    max_tokens: Option<Option<usize>>,
    temperature: Option<f64>,
}

impl ResponseParams {
    fn validate(self, session_audio: bool) -> Result<ResponseOptions, ClientError> {
        if self.input.as_ref().is_some_and(|i| !i.is_empty()) {
            return Err(ClientError::param(
                "response.input",
                "custom response input is not supported: add conversation items instead",
            ));
        }
        let record = match self.conversation.as_deref() {
            None | Some("auto") => true,
            Some("none") => false,
            Some(o) => {
                return Err(ClientError::param(
                    "response.conversation",
                    format!("conversation {o:?}: use \"auto\" or \"none\""),
                ))
            }
        };
        let audio_out = match self.output_modalities.or(self.modalities) {
            Some(names) => modalities(&names, "response.output_modalities")?,
            None => session_audio,
        };
        let out_audio = self.audio.and_then(|a| a.output).unwrap_or_default();
        if let Some(f) = out_audio
            .format
            .as_ref()
            .or(self.output_audio_format.as_ref())
        {
            check_format(f, "response.audio.output.format")?;
        }
        Ok(ResponseOptions {
            audio_out,
            record,
            instructions: self.instructions,
            voice: out_audio.voice.or(self.voice),
            max_tokens: self
                .max_output_tokens
                .or(self.max_response_output_tokens)
                .map(|v| parse_max_tokens(&v, "max_output_tokens"))
                .transpose()?,
            temperature: self.temperature.map(check_temperature).transpose()?,
        })
    }
}

/// Parses a client event's fields into `T`; a type mismatch is a clear error.
fn fields<T: serde::de::DeserializeOwned>(v: Value, kind: &str) -> Result<T, ClientError> {
    serde_json::from_value(v)
        .map_err(|e| ClientError::invalid("invalid_event", format!("{kind}: {e}")))
}

impl Realtime {
    async fn send(&self, msg: Message) {
        // A failed send means the connection is closing; the loop sees it.
        let _ = self.out.send(msg).await;
    }

    async fn fail(&self, e: ClientError, client_event_id: Option<&str>) {
        self.send(error_event(&e, client_event_id)).await;
    }

    fn session_json(&self, s: &Session) -> Value {
        json!({
            "type": "realtime",
            "object": "realtime.session",
            "id": s.id,
            "model": self.state.config.model_name,
            "output_modalities": if self.audio_out { ["audio"] } else { ["text"] },
            "instructions": s.instructions.clone().unwrap_or_default(),
            "audio": {
                "input": {
                    "format": {"type": "audio/pcm", "rate": RATE},
                    "transcription": if listen::can_hear(&self.state) {
                        json!({"model": "whisper-tiny.en", "language": "en", "prompt": ""})
                    } else {
                        Value::Null
                    },
                    "noise_reduction": null,
                    "turn_detection": self.turns.as_ref().map_or(Value::Null, |t| t.settings.to_json()),
                },
                "output": {
                    "format": {"type": "audio/pcm", "rate": RATE},
                    "voice": s.voice.clone().unwrap_or_else(|| self.state.default_voice().to_string()),
                    "speed": s.sampling.speed.unwrap_or(1.0),
                },
            },
            "max_output_tokens": s.sampling.max_tokens.map_or_else(|| json!("inf"), |n| json!(n)),
            "temperature": s.sampling.temperature,
            "tools": [],
            "tool_choice": "auto",
            "tracing": null,
        })
    }

    async fn send_session(&self, kind: &str) {
        let Some(session) = self
            .state
            .sessions
            .with(&self.session.id, |s| self.session_json(s))
        else {
            return;
        };
        self.send(event(kind, json!({ "session": session }))).await;
    }

    async fn on_text(&mut self, text: &str) {
        let v: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                let e = ClientError::invalid(
                    "invalid_json",
                    format!("the event is not valid JSON: {e}"),
                );
                return self.fail(e, None).await;
            }
        };
        let event_id = v.get("event_id").and_then(Value::as_str).map(str::to_owned);
        let Some(kind) = v.get("type").and_then(Value::as_str).map(str::to_owned) else {
            let e = ClientError::invalid("missing_type", "the event has no string \"type\"");
            return self.fail(e, event_id.as_deref()).await;
        };
        // Any client event counts as activity; a session that expired ends here.
        if self.state.sessions.with(&self.session.id, |_| ()).is_none() {
            self.out.close(
                Some(error_event(&ClientError::expired(), None)),
                close_code::POLICY,
            );
            return;
        }
        let r = match kind.as_str() {
            "session.update" => self.session_update(v).await,
            "conversation.item.create" => self.item_create(v).await,
            "response.create" => self.response_create(v).await,
            "response.cancel" => self.response_cancel(v).await,
            "input_audio_buffer.append" => self.audio_append(v).await,
            "input_audio_buffer.commit" => self.audio_commit().await,
            "input_audio_buffer.clear" => {
                self.input_audio.clear();
                if let Some(t) = self.turns.as_mut() {
                    t.clear();
                }
                self.send(event("input_audio_buffer.cleared", json!({})))
                    .await;
                Ok(())
            }
            "output_audio_buffer.clear" if self.speaker.is_some() => {
                if let Some(sp) = &self.speaker {
                    sp.clear();
                }
                self.send(event("output_audio_buffer.cleared", json!({})))
                    .await;
                Ok(())
            }
            "conversation.item.delete"
            | "conversation.item.truncate"
            | "conversation.item.retrieve"
            | "output_audio_buffer.clear"
            | "transcription_session.update" => Err(ClientError::invalid(
                "unsupported_event",
                format!("{kind} is not supported by this server"),
            )),
            other => Err(ClientError::invalid(
                "unknown_event_type",
                format!("unknown event type {other:?}"),
            )),
        };
        if let Err(e) = r {
            self.fail(e, event_id.as_deref()).await;
        }
    }

    async fn session_update(&mut self, v: Value) -> Result<(), ClientError> {
        let mut change = fields::<SessionUpdate>(v, "session.update")?
            .session
            .validate()?;
        if let Some(v) = &change.voice {
            change.voice = Some(check_voice(&self.state, v)?);
        }
        if let Some(td) = &change.turn_detection {
            let hub = self.state.config.vad.as_ref();
            let param = "session.audio.input.turn_detection";
            self.turns = match (TurnSettings::parse(td, hub, param)?, hub) {
                (Some(settings), Some(hub)) => {
                    let listener =
                        listen::can_hear(&self.state).then(|| (self.state.clone(), "realtime"));
                    Some(TurnDetector::new(settings, hub, RATE, listener)?)
                }
                _ => None,
            };
        }
        if let Some(a) = change.audio_out {
            self.audio_out = a;
        }
        self.state.sessions.with(&self.session.id, |s| {
            if let Some(i) = change.instructions {
                s.instructions = Some(i).filter(|i| !i.is_empty());
            }
            if let Some(v) = change.voice {
                s.voice = Some(v);
            }
            if let Some(m) = change.max_tokens {
                s.sampling.max_tokens = m;
            }
            if let Some(t) = change.temperature {
                s.sampling.temperature = Some(t);
            }
            if let Some(sp) = change.speed {
                s.sampling.speed = Some(sp);
            }
        });
        self.send_session("session.updated").await;
        Ok(())
    }

    /// Announces a new conversation item (beta `created`, GA `added` + `done`).
    async fn announce_item(&mut self, item: Value, previous: Option<String>) {
        for kind in [
            "conversation.item.created",
            "conversation.item.added",
            "conversation.item.done",
        ] {
            self.send(event(
                kind,
                json!({"previous_item_id": previous, "item": item}),
            ))
            .await;
        }
    }

    async fn item_create(&mut self, v: Value) -> Result<(), ClientError> {
        let ItemCreate { item } = fields(v, "conversation.item.create")?;
        if item.kind != "message" {
            return Err(ClientError::param(
                "item.type",
                format!(
                    "item type {:?} is not supported: only \"message\" items",
                    item.kind
                ),
            ));
        }
        let role = item.role.unwrap_or_default();
        if !matches!(role.as_str(), "user" | "system" | "assistant") {
            return Err(ClientError::param(
                "item.role",
                format!("role {role:?}: use \"user\", \"system\" or \"assistant\""),
            ));
        }
        let mut text = String::new();
        let mut content = Vec::new();
        for c in &item.content {
            match c.kind.as_str() {
                "input_text" | "text" | "output_text" => {
                    let t = c.text.as_deref().ok_or_else(|| {
                        ClientError::param("item.content.text", "text content needs \"text\"")
                    })?;
                    text.push_str(t);
                    content.push(json!({"type": c.kind, "text": t}));
                }
                "input_audio" | "output_audio" | "audio" => {
                    if let Some(a) = &c.audio {
                        conn::decode_pcm16_base64(a)?;
                    }
                    // Audio is not understood yet: only a given transcript reaches the model.
                    if let Some(t) = &c.transcript {
                        text.push_str(t);
                    }
                    content.push(json!({"type": c.kind, "transcript": c.transcript}));
                }
                other => {
                    return Err(ClientError::param(
                        "item.content.type",
                        format!("content type {other:?} is not supported"),
                    ))
                }
            }
        }
        if text.trim().is_empty() {
            return Err(ClientError::param(
                "item.content",
                "the item has no text (audio without a transcript is not understood yet)",
            ));
        }
        let id = item
            .id
            .filter(|i| !i.is_empty() && i.len() <= 64)
            .unwrap_or_else(|| conn::new_id("item"));
        self.state.sessions.with(&self.session.id, |s| {
            conn::remember(s, ChatMessage::new(role.clone(), text));
        });
        let item = json!({
            "id": id, "object": "realtime.item", "type": "message",
            "status": "completed", "role": role, "content": content,
        });
        let previous = self.last_item.replace(id);
        self.announce_item(item, previous).await;
        Ok(())
    }

    async fn audio_append(&mut self, v: Value) -> Result<(), ClientError> {
        let AudioAppend { audio } = fields(v, "input_audio_buffer.append")?;
        let pcm = conn::decode_pcm16_base64(&audio)?;
        if self.turns.is_some() {
            // Turn detection takes the turns out of the stream: like a
            // microphone's, the buffer keeps the newest audio, never full.
            self.keep_newest(&pcm);
            return self.detect(&pcm).await;
        }
        if self.input_audio.len() + pcm.len() > MAX_INPUT_AUDIO_BYTES {
            return Err(ClientError::invalid(
                "input_audio_buffer_full",
                format!(
                    "the input audio buffer holds at most {} s; commit or clear it",
                    MAX_INPUT_AUDIO_BYTES / (RATE as usize * 2)
                ),
            ));
        }
        self.input_audio.extend_from_slice(&pcm);
        self.detect(&pcm).await
    }

    /// Microphone audio from a media track: always accepted, keeping the
    /// newest `MAX_INPUT_AUDIO_BYTES` (a live microphone never stops).
    async fn mic_audio(&mut self, pcm: &[u8]) {
        self.keep_newest(pcm);
        if let Err(e) = self.detect(pcm).await {
            self.fail(e, None).await;
        }
    }

    /// Appends to the input buffer, dropping its oldest audio past
    /// `MAX_INPUT_AUDIO_BYTES`.
    fn keep_newest(&mut self, pcm: &[u8]) {
        self.input_audio.extend_from_slice(pcm);
        if self.input_audio.len() > MAX_INPUT_AUDIO_BYTES {
            let excess = self.input_audio.len() - MAX_INPUT_AUDIO_BYTES;
            self.input_audio.drain(..excess + excess % 2);
        }
    }

    /// `server_vad`: runs the turn detector over new input audio; a turn that
    /// starts interrupts the answer, a turn that ends is committed, heard and
    /// (with `create_response`) answered.
    async fn detect(&mut self, pcm: &[u8]) -> Result<(), ClientError> {
        let Some(t) = self.turns.as_mut() else {
            return Ok(());
        };
        let since = self.playback.as_ref().and_then(|p| p.started());
        let (create, interrupt) = (t.settings.create_response, t.settings.interrupt_response);
        for turn in t.push(pcm, since)? {
            match turn {
                Turn::Started { audio_start_ms } => {
                    let id = conn::new_id("item");
                    self.speech_item = Some(id.clone());
                    self.send(event(
                        "input_audio_buffer.speech_started",
                        json!({"audio_start_ms": audio_start_ms, "item_id": id}),
                    ))
                    .await;
                    if interrupt {
                        self.barge_in().await;
                    }
                }
                Turn::Stopped {
                    audio_end_ms,
                    audio,
                    early,
                } => {
                    let id = self
                        .speech_item
                        .take()
                        .unwrap_or_else(|| conn::new_id("item"));
                    self.send(event(
                        "input_audio_buffer.speech_stopped",
                        json!({"audio_end_ms": audio_end_ms, "item_id": id}),
                    ))
                    .await;
                    // The utterance is the turn; the buffer starts afresh.
                    self.input_audio.clear();
                    let seconds = audio.len() as f64 / f64::from(TRANSCRIBE_RATE);
                    let heard = self.commit_item(id, audio, seconds, early).await;
                    let busy = self.active.as_ref().is_some_and(Active::running);
                    if create && heard && !busy {
                        self.response_create(json!({"type": "response.create"}))
                            .await?;
                    }
                }
            }
        }
        Ok(())
    }

    /// The user spoke over the answer: it stops in every stage, the audio
    /// queued for playback is dropped, and the conversation keeps only what
    /// was heard (`conversation.item.truncated`).
    async fn barge_in(&mut self) {
        let Some(p) = self.playback.clone() else {
            return;
        };
        let queued = self.speaker.as_ref().map_or(0, AudioOut::queued_samples);
        let queued_s = queued as f64 / f64::from(RATE);
        let running = self.active.as_ref().is_some_and(Active::running);
        if p.interrupted() || (!running && queued == 0 && !p.playing()) {
            return; // nothing is playing
        }
        p.interrupt(queued_s);
        if let Some(sp) = &self.speaker {
            sp.clear();
        }
        if let Some(a) = self.active.as_ref().filter(|a| a.running()) {
            let _ = a.cancel.send(true);
        } else {
            // The answer was generated whole but was still playing: cut the
            // conversation's copy of it back to what was heard.
            p.truncate_history(&self.state, &self.session.id);
            self.send(event(
                "conversation.item.truncated",
                json!({"item_id": p.item_id, "content_index": 0, "audio_end_ms": p.heard_ms()}),
            ))
            .await;
        }
        self.send(event(
            "output_audio_buffer.cleared",
            json!({"response_id": p.response_id}),
        ))
        .await;
    }

    async fn audio_commit(&mut self) -> Result<(), ClientError> {
        if self.input_audio.is_empty() {
            return Err(ClientError::invalid(
                "input_audio_buffer_commit_empty",
                "the input audio buffer is empty",
            ));
        }
        let pcm = std::mem::take(&mut self.input_audio);
        if let Some(t) = self.turns.as_mut() {
            t.clear();
        }
        let audio = if listen::can_hear(&self.state) || self.state.pipeline.thinker_hears() {
            listen::to_listener_rate(&pcm, RATE)?
        } else {
            Vec::new()
        };
        let id = self
            .speech_item
            .take()
            .unwrap_or_else(|| conn::new_id("item"));
        let seconds = pcm.len() as f64 / (f64::from(RATE) * 2.0);
        self.commit_item(id, audio, seconds, None).await;
        Ok(())
    }

    /// Adds the user's speech as an item, transcribes it (16 kHz `audio`;
    /// empty where the pipeline cannot hear; `early`: its transcription,
    /// already started) and puts the words in the conversation; returns
    /// whether there is a turn to answer (not when nothing was heard). A
    /// Thinker that hears speech itself gets the audio instead of words.
    async fn commit_item(
        &mut self,
        id: String,
        audio: Vec<f32>,
        seconds: f64,
        early: Option<listen::Hearing>,
    ) -> bool {
        let previous = self.last_item.replace(id.clone());
        self.send(event(
            "input_audio_buffer.committed",
            json!({"previous_item_id": previous, "item_id": id}),
        ))
        .await;
        // As in OpenAI's API the item comes first, its transcript after.
        let item = json!({
            "id": id, "object": "realtime.item", "type": "message",
            "status": "completed", "role": "user",
            "content": [{"type": "input_audio", "transcript": null}],
            "audio_seconds": seconds,
        });
        self.announce_item(item, previous).await;
        if early.is_none() && self.state.pipeline.thinker_hears() && !audio.is_empty() {
            let audio: std::sync::Arc<[f32]> = audio.into();
            return self
                .state
                .sessions
                .with(&self.session.id, |s| s.spoken = Some(audio))
                .is_some();
        }
        let result = if let Some(h) = early {
            h.result().await
        } else if listen::can_hear(&self.state) {
            listen::transcribe(&self.state, "realtime", audio).await
        } else {
            Err(ClientError::invalid(
                "transcription_unavailable",
                "this server's pipeline has no speech recognition stage: the audio is kept without a transcript and the model does not hear it",
            ))
        };
        match result {
            Ok(transcript) => {
                // A blank transcript (noise, a cough) adds no turn to answer.
                if !transcript.is_empty() {
                    let user = ChatMessage::new("user", transcript.clone());
                    self.state
                        .sessions
                        .with(&self.session.id, |s| conn::remember(s, user));
                }
                self.send(event(
                    "conversation.item.input_audio_transcription.completed",
                    json!({"item_id": id, "content_index": 0, "transcript": transcript}),
                ))
                .await;
                !transcript.is_empty()
            }
            Err(e) => {
                self.send(event(
                    "conversation.item.input_audio_transcription.failed",
                    json!({
                        "item_id": id, "content_index": 0,
                        "error": {"type": e.kind, "code": e.code, "message": e.message},
                    }),
                ))
                .await;
                false
            }
        }
    }

    async fn response_cancel(&mut self, v: Value) -> Result<(), ClientError> {
        let ResponseCancel { response_id } = fields(v, "response.cancel")?;
        let running = self
            .state
            .sessions
            .with(&self.session.id, |s| s.in_flight.clone())
            .flatten();
        match (&self.active, running) {
            (Some(a), Some(r))
                if r == a.id && response_id.as_deref().is_none_or(|id| id == a.id) =>
            {
                let _ = a.cancel.send(true);
                Ok(())
            }
            _ => Err(ClientError::invalid(
                "response_cancel_not_active",
                "there is no active response to cancel",
            )),
        }
    }

    async fn response_create(&mut self, v: Value) -> Result<(), ClientError> {
        let running = self
            .state
            .sessions
            .with(&self.session.id, |s| s.in_flight.clone())
            .flatten();
        if let Some(r) = running {
            return Err(ClientError::invalid(
                "conversation_already_has_active_response",
                format!("response {r} is still in progress: wait for response.done or cancel it"),
            ));
        }
        let mut o = fields::<ResponseCreate>(v, "response.create")?
            .response
            .unwrap_or_default()
            .validate(self.audio_out)?;
        if let Some(v) = &o.voice {
            o.voice = Some(check_voice(&self.state, v)?);
        }
        let Some((messages, mut sampling, session_voice, spoken)) =
            self.state.sessions.with(&self.session.id, |s| {
                let instructions = o.instructions.clone().or(s.instructions.clone());
                (
                    conn::prompt(instructions.as_deref(), &s.history),
                    s.sampling.clone(),
                    s.voice.clone(),
                    s.spoken.take(),
                )
            })
        else {
            return Err(ClientError::expired());
        };
        if spoken.is_none() && messages.iter().all(|m| m.role == "system") {
            return Err(ClientError::invalid(
                "conversation_empty",
                "the conversation has no message to answer: add an item first",
            ));
        }
        if let Some(m) = o.max_tokens {
            sampling.max_tokens = m;
        }
        if let Some(t) = o.temperature {
            sampling.temperature = Some(t);
        }
        let (audio_out, record, max_out) = (o.audio_out, o.record, sampling.max_tokens);
        let spec = RequestSpec {
            input: match spoken {
                Some(audio) => RequestInput::Heard { messages, audio },
                None => RequestInput::Chat { messages },
            },
            modalities: if audio_out {
                Modalities::TEXT_AUDIO
            } else {
                Modalities::TEXT
            },
            sampling,
            voice: o.voice.or(session_voice),
        };
        let (cancel, cancel_rx) = watch::channel(false);
        let gen = Generation::start(
            &self.state,
            &self.out,
            "realtime",
            spec,
            audio_out.then_some(OutputFormat::Pcm16 { rate: RATE }),
            cancel_rx,
        )?;
        let id = conn::new_id("resp");
        self.state
            .sessions
            .with(&self.session.id, |s| s.in_flight = Some(id.clone()));
        self.active = Some(Active {
            id: id.clone(),
            cancel,
        });
        let item_id = conn::new_id("item");
        let previous = self.last_item.replace(item_id.clone());
        let playback = Arc::new(Playback::new(id.clone(), item_id.clone()));
        self.playback = Some(playback.clone());
        let job = Job {
            playback,
            state: self.state.clone(),
            out: self.out.clone(),
            session_id: self.session.id.clone(),
            id,
            item_id,
            previous,
            audio: audio_out,
            record,
            max_out,
            gen,
            speaker: self.speaker.clone().filter(|_| audio_out),
        };
        tokio::spawn(job.run());
        Ok(())
    }
}

/// One response: runs in its own task until the pipeline is done with it,
/// the client cancels it, or the connection goes.
struct Job {
    state: Arc<AppState>,
    out: Outbox,
    session_id: String,
    id: String,
    item_id: String,
    previous: Option<String>,
    audio: bool,
    /// Whether the answer joins the conversation (`conversation: "auto"`).
    record: bool,
    max_out: Option<usize>,
    gen: Generation,
    /// WebRTC: audio goes to the track, not into `output_audio.delta` events.
    speaker: Option<AudioOut>,
    playback: Arc<Playback>,
}

impl Job {
    fn response(&self, status: &str, details: Value, output: Value, usage: Value) -> Value {
        json!({
            "id": self.id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.session_id,
            "output_modalities": if self.audio { ["audio"] } else { ["text"] },
            "max_output_tokens": self.max_out.map_or_else(|| json!("inf"), |n| json!(n)),
            "usage": usage,
        })
    }

    fn item(&self, status: &str, part: Value) -> Value {
        json!({
            "id": self.item_id, "object": "realtime.item", "type": "message",
            "status": status, "role": "assistant", "content": part,
        })
    }

    fn part(&self, text: &str) -> Value {
        if self.audio {
            json!({"type": "output_audio", "transcript": text})
        } else {
            json!({"type": "output_text", "text": text})
        }
    }

    /// `response_id`, `item_id`, `output_index`, `content_index` plus `extra`.
    fn delta(&self, kind: &str, extra: Value) -> Message {
        let mut body = json!({
            "response_id": self.id, "item_id": self.item_id,
            "output_index": 0, "content_index": 0,
        });
        if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
            b.extend(e);
        }
        event(kind, body)
    }

    async fn run(mut self) {
        let _task = TaskGuard::new(&self.state.metrics);
        let end = self.stream().await;
        let mut text = self.gen.text().to_string();
        if matches!(end, Some(End::Completed(_))) && self.audio {
            let secs = self.gen.audio_seconds();
            self.state.speech_rate.observe(text.chars().count(), secs);
        }
        // Interrupted: the conversation keeps what the user heard.
        if self.playback.interrupted() {
            let heard = self.playback.heard_ms();
            text = self.playback.heard_text(&self.state, &text).to_string();
            let truncated = event(
                "conversation.item.truncated",
                json!({"item_id": self.item_id, "content_index": 0, "audio_end_ms": heard}),
            );
            let _ = self.out.send(truncated).await;
        }
        // The conversation learns the answer (even a cancelled one: it was heard).
        let record = self.record && !text.trim().is_empty();
        self.state.sessions.with(&self.session_id, |s| {
            if record {
                conn::remember(s, ChatMessage::new("assistant", text.clone()));
            }
            if s.in_flight.as_deref() == Some(self.id.as_str()) {
                s.in_flight = None;
            }
        });
        let Some(end) = end else {
            return; // the connection is gone
        };
        self.finish(end, &text).await;
    }

    /// Streams the answer; `None` when the connection went away meanwhile.
    async fn stream(&mut self) -> Option<End> {
        let text_delta = if self.audio {
            "response.output_audio_transcript.delta"
        } else {
            "response.output_text.delta"
        };
        let created = event(
            "response.created",
            json!({"response": self.response("in_progress", Value::Null, json!([]), Value::Null)}),
        );
        let item = self.item("in_progress", json!([]));
        let opening = [
            created,
            event(
                "response.output_item.added",
                json!({"response_id": self.id, "output_index": 0, "item": item}),
            ),
            event(
                "conversation.item.added",
                json!({"previous_item_id": self.previous, "item": item}),
            ),
            event(
                "response.content_part.added",
                json!({
                    "response_id": self.id, "item_id": self.item_id,
                    "output_index": 0, "content_index": 0, "part": self.part(""),
                }),
            ),
        ];
        for m in opening {
            if self.out.send(m).await.is_err() {
                self.gen.abandon();
                return None;
            }
        }
        loop {
            let msg = match self.gen.next().await {
                Step::Text(t) => self.delta(text_delta, json!({ "delta": t })),
                Step::Audio(pcm) if self.speaker.is_some() => {
                    self.playback.sent_audio(pcm.len() / 2, RATE);
                    let queued = self.speaker.as_ref().map(|sp| sp.push(&self.id, &pcm));
                    if queued.is_some_and(|r| r.is_err()) {
                        self.gen.abandon();
                        return Some(End::SlowClient);
                    }
                    self.gen.sent_audio();
                    continue;
                }
                Step::Audio(pcm) => {
                    self.playback.sent_audio(pcm.len() / 2, RATE);
                    self.delta(
                        "response.output_audio.delta",
                        json!({ "delta": base64::engine::general_purpose::STANDARD.encode(&pcm) }),
                    )
                }
                Step::End(end) => return Some(end),
            };
            if self.out.send(msg).await.is_err() {
                self.gen.abandon();
                return None;
            }
            self.gen.sent_audio();
        }
    }

    async fn finish(&mut self, end: End, text: &str) {
        if let Some(sp) = &self.speaker {
            sp.end(&self.id);
        }
        let (status, details, usage) = match &end {
            End::Completed(u) => {
                let incomplete = self.max_out.is_some_and(|m| u.completion_tokens >= m);
                let details = if incomplete {
                    json!({"type": "incomplete", "reason": "max_output_tokens"})
                } else {
                    Value::Null
                };
                let status = if incomplete {
                    "incomplete"
                } else {
                    "completed"
                };
                let usage = json!({
                    "total_tokens": u.prompt_tokens + u.completion_tokens,
                    "input_tokens": u.prompt_tokens,
                    "output_tokens": u.completion_tokens,
                    "input_token_details": {"cached_tokens": u.cached_tokens, "text_tokens": u.prompt_tokens, "audio_tokens": 0},
                    "output_token_details": {"text_tokens": u.completion_tokens, "audio_tokens": 0},
                });
                (status, details, usage)
            }
            End::Cancelled => (
                "cancelled",
                json!({"type": "cancelled", "reason": "client_cancelled"}),
                Value::Null,
            ),
            End::SlowClient => {
                self.out
                    .close_slow(error_event(&ClientError::slow_client(), None));
                return;
            }
            End::Failed(e) => (
                "failed",
                json!({"type": "failed", "error": {"type": super::failure_kind(super::failure_code(e)), "code": super::failure_code(e), "message": e}}),
                Value::Null,
            ),
        };
        let item_status = if status == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        let part = self.part(text);
        let item = self.item(item_status, json!([part]));
        let mut closing = Vec::new();
        if self.audio {
            closing.push(self.delta("response.output_audio.done", json!({})));
            closing.push(self.delta(
                "response.output_audio_transcript.done",
                json!({ "transcript": text }),
            ));
        } else {
            closing.push(self.delta("response.output_text.done", json!({ "text": text })));
        }
        closing.push(self.delta("response.content_part.done", json!({ "part": part })));
        closing.push(event(
            "response.output_item.done",
            json!({"response_id": self.id, "output_index": 0, "item": item}),
        ));
        closing.push(event(
            "conversation.item.done",
            json!({"previous_item_id": self.previous, "item": item}),
        ));
        closing.push(event(
            "response.done",
            json!({"response": self.response(status, details, json!([item]), usage)}),
        ));
        for m in closing {
            if self.out.send(m).await.is_err() {
                return;
            }
        }
    }
}

/// Connection plumbing shared by `/v1/realtime` and `/v1/stream`.
pub(super) mod conn {
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    use axum::body::Bytes;
    use axum::extract::ws::{CloseFrame, Message, WebSocket, WebSocketUpgrade};
    use base64::Engine as _;
    use futures_util::stream::SplitSink;
    use futures_util::{Sink, SinkExt};
    use prometheus::IntGauge;
    use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

    use omnistream_stages::engine::{CancelReason, Event, RequestHandle, RequestSpec};
    use omnistream_stages::models::tokenizer::ChatMessage;

    use super::super::audio::{AudioEncoder, OutputFormat};
    use super::super::auth;
    use super::super::metrics::{Metrics, TaskGuard};
    use super::super::sessions::SessionGuard;
    use super::super::sessions::{InFlightGuard, Session};
    use super::super::shutdown::{self, Phase};
    use super::super::state::AppState;
    use super::super::ApiError;
    use axum::http::HeaderMap;
    use axum::response::{IntoResponse, Response};

    /// Largest WebSocket frame or message a client may send.
    pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
    /// Unsent output one connection may queue (in KiB) before its producers wait.
    const QUEUE_KIB: u32 = 1024;
    /// A client is too slow when a write has been stuck this long, or a ping
    /// has gone unanswered this long while output kept flowing.
    const SLOW_AFTER: Duration = Duration::from_secs(5);
    /// ...at least this much output written after the unanswered ping.
    const SLOW_BYTES: u64 = 256 * 1024;
    /// A ping goes out after this much output (the pong says the client read it).
    const PING_EVERY_BYTES: u64 = 64 * 1024;
    /// How long the final error frame and the close may take to go out.
    const FINAL_WRITE: Duration = Duration::from_secs(5);
    /// ...to a client dropped for not reading.
    const SLOW_GOODBYE: Duration = Duration::from_secs(30);
    /// Time left to a client to read a server-initiated close before the socket goes.
    const LINGER: Duration = Duration::from_millis(500);
    /// Conversation history sent to the Thinker, newest first, in characters.
    const HISTORY_CHARS: usize = 16_000;
    /// Messages a session keeps.
    const MAX_HISTORY: usize = 256;

    /// The running response of a connection, as its reader sees it.
    pub struct Active {
        pub id: String,
        pub cancel: watch::Sender<bool>,
    }

    impl Active {
        /// Whether its task still runs (it holds the receiver until it ends).
        pub fn running(&self) -> bool {
            !self.cancel.is_closed()
        }
    }

    /// A client-visible error: an `error` event; the connection stays usable
    /// unless the caller closes it.
    #[derive(Debug, Clone)]
    pub struct ClientError {
        pub kind: &'static str,
        pub code: &'static str,
        pub message: String,
        pub param: Option<&'static str>,
    }

    impl ClientError {
        pub fn invalid(code: &'static str, message: impl Into<String>) -> Self {
            Self {
                kind: "invalid_request_error",
                code,
                message: message.into(),
                param: None,
            }
        }
        pub fn param(param: &'static str, message: impl Into<String>) -> Self {
            Self {
                param: Some(param),
                ..Self::invalid("invalid_value", message)
            }
        }
        pub fn server(code: &'static str, message: impl Into<String>) -> Self {
            Self {
                kind: "server_error",
                ..Self::invalid(code, message)
            }
        }
        /// A request that failed: its code and type from the message.
        pub fn failed(message: String) -> Self {
            let code = super::super::failure_code(&message);
            Self {
                kind: super::super::failure_kind(code),
                ..Self::invalid(code, message)
            }
        }
        pub fn slow_client() -> Self {
            Self::server(
                "slow_client",
                "the client did not read its output in time; the connection is dropped",
            )
        }
        pub fn shutting_down() -> Self {
            ApiError::shutting_down().into()
        }
        pub fn expired() -> Self {
            Self::invalid(
                "session_expired",
                "the session expired after being idle; reconnect",
            )
        }
    }

    impl From<ApiError> for ClientError {
        fn from(e: ApiError) -> Self {
            Self {
                kind: e.kind,
                code: e.code,
                message: e.message,
                param: None,
            }
        }
    }

    pub fn new_id(prefix: &str) -> String {
        let u = uuid::Uuid::new_v4().simple().to_string();
        format!("{prefix}_{}", &u[..20])
    }

    fn forbidden_origin() -> ApiError {
        ApiError::forbidden(
            "origin_not_allowed",
            "this Origin may not open WebSockets here (server.allowed_origins)",
        )
    }

    /// The shared WebSocket upgrade: Origin check, a session (or 503 over the
    /// cap), frame and message limits, the subprotocol to echo (the first of
    /// `protocols` the client offered), then `serve` on the socket.
    pub fn accept<F, Fut>(
        state: Arc<AppState>,
        headers: &HeaderMap,
        ws: WebSocketUpgrade,
        kind: &'static str,
        protocols: &[&'static str],
        serve: F,
    ) -> Response
    where
        F: FnOnce(Arc<AppState>, WebSocket, SessionGuard) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        if !auth::origin_allowed(&state, headers) {
            return forbidden_origin().into_response();
        }
        let session = match state.sessions.open(kind) {
            Ok(s) => s,
            Err(e) => return e.into_response(),
        };
        ws.max_message_size(MAX_MESSAGE_BYTES)
            .max_frame_size(MAX_MESSAGE_BYTES)
            .protocols(protocols.iter().copied())
            .on_upgrade(move |socket| serve(state, socket, session))
    }

    /// A read error worth telling the client about, with the close code
    /// RFC 6455 gives it (1009 too big, 1007 not UTF-8, 1002 a protocol
    /// violation), or `None` when the connection is simply gone.
    pub fn read_error(e: &axum::Error) -> Option<(ClientError, u16)> {
        use axum::extract::ws::close_code;
        let s = e.to_string();
        if s.contains("Space limit exceeded") {
            let m =
                format!("frames and messages are limited to {MAX_MESSAGE_BYTES} bytes; closing");
            Some((
                ClientError::invalid("message_too_large", m),
                close_code::SIZE,
            ))
        } else if s.contains("UTF-8 encoding error") {
            let m = "a text frame is not valid UTF-8; closing";
            Some((ClientError::invalid("invalid_utf8", m), close_code::INVALID))
        } else if s.contains("WebSocket protocol error") {
            let m = format!("{s}; closing");
            Some((
                ClientError::invalid("protocol_error", m),
                close_code::PROTOCOL,
            ))
        } else {
            None
        }
    }

    /// Base64 pcm16 (little-endian) -> bytes, checked.
    pub fn decode_pcm16_base64(b64: &str) -> Result<Vec<u8>, ClientError> {
        let pcm = base64::engine::general_purpose::STANDARD
            .decode(b64)
            .map_err(|e| {
                ClientError::invalid("invalid_base64", format!("audio is not valid base64: {e}"))
            })?;
        if pcm.len() % 2 == 1 {
            return Err(ClientError::invalid(
                "invalid_audio",
                "pcm16 audio needs an even number of bytes",
            ));
        }
        Ok(pcm)
    }

    /// Marks the session active while a response runs; `false` once it expired.
    pub fn keep_alive(state: &AppState, id: &str, busy: bool) -> bool {
        if busy {
            state.sessions.with(id, |_| ()).is_some()
        } else {
            state.sessions.exists(id)
        }
    }

    /// Adds a message to the session's history, forgetting the oldest past
    /// `MAX_HISTORY` (only the newest `HISTORY_CHARS` reach the Thinker anyway).
    pub fn remember(s: &mut Session, m: ChatMessage) {
        s.history.push(m);
        if s.history.len() > MAX_HISTORY {
            let extra = s.history.len() - MAX_HISTORY;
            s.history.drain(..extra);
        }
    }

    /// The Thinker's messages: instructions, then the newest history that fits.
    pub fn prompt(instructions: Option<&str>, history: &[ChatMessage]) -> Vec<ChatMessage> {
        let mut budget = HISTORY_CHARS;
        let mut keep = 0;
        for m in history.iter().rev() {
            let n = m.content.len();
            if n > budget && keep > 0 {
                break;
            }
            budget = budget.saturating_sub(n);
            keep += 1;
        }
        let mut out = Vec::with_capacity(keep + 1);
        if let Some(i) = instructions.filter(|i| !i.trim().is_empty()) {
            out.push(ChatMessage::new("system", i));
        }
        out.extend_from_slice(&history[history.len() - keep..]);
        out
    }

    /// `omnistream_connections_open{protocol}` while alive.
    pub struct ConnGauge(IntGauge);

    impl ConnGauge {
        pub fn new(m: &Metrics, protocol: &str) -> Self {
            let g = m.connections_open.with_label_values(&[protocol]);
            g.inc();
            Self(g)
        }
    }

    impl Drop for ConnGauge {
        fn drop(&mut self) {
            self.0.dec();
        }
    }

    /// A session's view of the server's shutdown: wakes it when the server
    /// starts draining, then every 50 ms to see whether it may end.
    pub struct Drain {
        phase: shutdown::Watch,
        draining: bool,
        tick: tokio::time::Interval,
    }

    impl Drain {
        pub fn new(state: &AppState) -> Self {
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            // Not polled until the drain: no burst of missed ticks then.
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            Self {
                phase: state.shutdown.watch(),
                draining: false,
                tick,
            }
        }

        pub async fn next(&mut self) {
            if self.draining {
                self.tick.tick().await;
            } else {
                self.phase.reached(Phase::Draining).await;
                self.draining = true;
            }
        }

        pub fn closing(&self) -> bool {
            self.phase.now() >= Phase::Closing
        }

        /// Whether the session ends now: no answer is running (a running one
        /// is cut by the server's close on its own, and then ends).
        pub fn due(&self, active: Option<&Active>) -> bool {
            !active.is_some_and(Active::running)
        }
    }

    /// How long a session's last events may take to reach its client.
    pub const GOODBYE: Duration = Duration::from_secs(2);

    /// The connection is closing (or closed).
    #[derive(Debug)]
    pub struct Gone;

    /// How the connection ends: an optional last message and a close code.
    #[derive(Clone)]
    struct Ending {
        last: Option<Message>,
        code: u16,
    }

    struct Shared {
        tx: mpsc::UnboundedSender<(Message, OwnedSemaphorePermit)>,
        budget: Arc<Semaphore>,
        closing: watch::Sender<Option<Ending>>,
        /// Highest ping sequence the client answered.
        acked: AtomicU64,
        /// The client was dropped for not reading.
        slow: AtomicBool,
        /// `omnistream_slow_clients_total`.
        slow_clients: prometheus::IntCounter,
    }

    impl Shared {
        /// Marks the client as dropped for not reading (counted once).
        fn mark_slow(&self) {
            if !self.slow.swap(true, Ordering::AcqRel) {
                self.slow_clients.inc();
            }
        }
    }

    /// The sending side of a connection: a queue bounded in bytes in front of
    /// a writer task. Cheap to clone.
    #[derive(Clone)]
    pub struct Outbox(Arc<Shared>);

    impl Outbox {
        /// Spawns the writer; `slow` is the message a too-slow client gets last.
        pub fn start(
            sink: SplitSink<WebSocket, Message>,
            metrics: &Metrics,
            slow: Message,
        ) -> Self {
            Self::start_on(sink, metrics, slow, true)
        }

        /// The same over any sink of messages (a WebRTC data channel's
        /// bridge); `pings` off where the transport acknowledges by itself.
        pub fn start_on<K>(sink: K, metrics: &Metrics, slow: Message, pings: bool) -> Self
        where
            K: Sink<Message> + Unpin + Send + 'static,
        {
            let (tx, rx) = mpsc::unbounded_channel();
            let shared = Arc::new(Shared {
                tx,
                budget: Arc::new(Semaphore::new(QUEUE_KIB as usize)),
                closing: watch::channel(None).0,
                acked: AtomicU64::new(0),
                slow: AtomicBool::new(false),
                slow_clients: metrics.slow_clients.clone(),
            });
            let task = TaskGuard::new(metrics);
            let reading = Reading {
                pings,
                ..Reading::default()
            };
            tokio::spawn(write_loop(sink, rx, shared.clone(), slow, task, reading));
            Self(shared)
        }

        /// Queues `msg`; waits while the queue is full. `Err` once closing.
        pub async fn send(&self, msg: Message) -> Result<(), Gone> {
            let kib = (wire_len(&msg) / 1024 + 1).min(QUEUE_KIB as u64) as u32;
            let permit = self
                .0
                .budget
                .clone()
                .acquire_many_owned(kib)
                .await
                .map_err(|_| Gone)?;
            self.0.tx.send((msg, permit)).map_err(|_| Gone)
        }

        /// Ends the connection: `last` (if any) goes out after what is being
        /// written now, then a close frame with `code`. Queued output is dropped.
        pub fn close(&self, last: Option<Message>, code: u16) {
            self.0.closing.send_if_modified(|c| {
                if c.is_some() {
                    return false;
                }
                *c = Some(Ending { last, code });
                true
            });
            self.0.budget.close();
        }

        /// Ends the connection after everything queued, `last` included, is
        /// written (or `within` passes): the graceful [`Self::close`].
        pub async fn finish(&self, last: Message, code: u16, within: Duration) {
            let _ = tokio::time::timeout(within, async {
                if self.send(last).await.is_ok() {
                    // Every permit back: the writer has written it all.
                    let _ = self.0.budget.acquire_many(QUEUE_KIB).await;
                }
            })
            .await;
            self.close(None, code);
        }

        /// Whether the connection was dropped because the client did not read.
        pub fn dropped_slow(&self) -> bool {
            self.0.slow.load(Ordering::Acquire)
        }

        /// Drops a client that cannot keep up: `last` tells it why.
        pub fn close_slow(&self, last: Message) {
            self.0.mark_slow();
            self.close(Some(last), axum::extract::ws::close_code::POLICY);
        }

        pub async fn closed(&self) {
            let mut rx = self.0.closing.subscribe();
            let _ = rx.wait_for(Option::is_some).await;
        }

        /// A pong from the client (the payload is our ping's sequence number).
        pub fn pong(&self, payload: &[u8]) {
            if let Ok(b) = <[u8; 8]>::try_from(payload) {
                self.0
                    .acked
                    .fetch_max(u64::from_be_bytes(b), Ordering::AcqRel);
            }
        }
    }

    fn wire_len(m: &Message) -> u64 {
        match m {
            Message::Text(t) => t.len() as u64,
            Message::Binary(b) => b.len() as u64,
            _ => 0,
        }
    }

    /// The writer's view of whether the client reads what it is sent.
    #[derive(Default)]
    struct Reading {
        /// Whether to probe the client with pings at all.
        pings: bool,
        written: u64,
        last_ping_at: u64,
        next_seq: u64,
        /// Unanswered ping: (seq, sent at, bytes written then).
        outstanding: Option<(u64, Instant, u64)>,
    }

    impl Reading {
        fn slow(&mut self, acked: u64) -> bool {
            if self.outstanding.is_some_and(|(seq, _, _)| acked >= seq) {
                self.outstanding = None;
            }
            self.slow_at()
                .is_some_and(|t| tokio::time::Instant::now() > t)
        }

        /// When the unanswered ping makes the client slow even if no more
        /// output comes: enough was written after it, so only time is missing.
        fn slow_at(&self) -> Option<tokio::time::Instant> {
            let (_, at, bytes) = self.outstanding?;
            (self.written - bytes >= SLOW_BYTES).then(|| (at + SLOW_AFTER).into())
        }

        /// A ping to send now, if it is time.
        fn ping(&mut self) -> Option<Message> {
            if !self.pings
                || self.outstanding.is_some()
                || self.written - self.last_ping_at < PING_EVERY_BYTES
            {
                return None;
            }
            self.next_seq += 1;
            self.last_ping_at = self.written;
            self.outstanding = Some((self.next_seq, Instant::now(), self.written));
            Some(Message::Ping(Bytes::copy_from_slice(
                &self.next_seq.to_be_bytes(),
            )))
        }
    }

    enum Stop {
        Closing,
        Slow,
        Broken,
    }

    /// Sends one message, giving up when the connection closes or the client
    /// turns out too slow.
    async fn send_watched<K: Sink<Message> + Unpin>(
        sink: &mut K,
        msg: Message,
        closing: &mut watch::Receiver<Option<Ending>>,
        reading: &mut Reading,
        shared: &Shared,
    ) -> Result<(), Stop> {
        let started = Instant::now();
        let send = sink.send(msg);
        tokio::pin!(send);
        let mut tick = tokio::time::interval(Duration::from_millis(250));
        loop {
            tokio::select! {
                biased;
                r = &mut send => return r.map_err(|_| Stop::Broken),
                _ = closing.wait_for(Option::is_some) => return Err(Stop::Closing),
                _ = tick.tick() => {
                    if started.elapsed() > SLOW_AFTER
                        || reading.slow(shared.acked.load(Ordering::Acquire))
                    {
                        return Err(Stop::Slow);
                    }
                }
            }
        }
    }

    async fn write_loop<K: Sink<Message> + Unpin>(
        mut sink: K,
        mut rx: mpsc::UnboundedReceiver<(Message, OwnedSemaphorePermit)>,
        shared: Arc<Shared>,
        slow: Message,
        _task: TaskGuard,
        mut reading: Reading,
    ) {
        let mut closing = shared.closing.subscribe();
        let stop = loop {
            let slow_at = reading.slow_at();
            let next = tokio::select! {
                biased;
                _ = closing.wait_for(Option::is_some) => break Stop::Closing,
                m = rx.recv() => m,
                // A client that stopped reading just before the output ended
                // is found out too, not only while output keeps coming.
                _ = async {
                    match slow_at {
                        Some(t) => tokio::time::sleep_until(t).await,
                        None => std::future::pending().await,
                    }
                } => {
                    if reading.slow(shared.acked.load(Ordering::Acquire)) {
                        break Stop::Slow;
                    }
                    continue;
                }
            };
            let Some((msg, permit)) = next else {
                break Stop::Closing;
            };
            let n = wire_len(&msg);
            if let Err(s) = send_watched(&mut sink, msg, &mut closing, &mut reading, &shared).await
            {
                break s;
            }
            drop(permit);
            reading.written += n;
            if reading.slow(shared.acked.load(Ordering::Acquire)) {
                break Stop::Slow;
            }
            if let Some(ping) = reading.ping() {
                if let Err(s) =
                    send_watched(&mut sink, ping, &mut closing, &mut reading, &shared).await
                {
                    break s;
                }
            }
        };
        if matches!(stop, Stop::Slow) {
            shared.mark_slow();
        }
        let ending = match stop {
            Stop::Slow => Some(Ending {
                last: Some(slow),
                code: axum::extract::ws::close_code::POLICY,
            }),
            Stop::Closing => closing.borrow().clone(),
            Stop::Broken => None,
        };
        // A slow client has a full socket before its `slow_client` error: it
        // gets longer to come back and read it (this task is all it holds).
        let within = if shared.slow.load(Ordering::Acquire) {
            SLOW_GOODBYE
        } else {
            FINAL_WRITE
        };
        // Whatever ended the writer ends the connection for everyone else too.
        let outbox = Outbox(shared);
        outbox.close(None, axum::extract::ws::close_code::NORMAL);
        drop(rx);
        let Some(Ending { last, code }) = ending else {
            return;
        };
        let told = last.is_some();
        let _ = tokio::time::timeout(within, async {
            if let Some(m) = last {
                sink.send(m).await?;
            }
            sink.send(Message::Close(Some(CloseFrame {
                code,
                reason: "".into(),
            })))
            .await
        })
        .await;
        if told {
            tokio::time::sleep(LINGER).await;
        }
    }

    /// Token counts of a completed request.
    #[derive(Debug, Clone, Copy)]
    pub struct Usage {
        pub prompt_tokens: usize,
        pub cached_tokens: usize,
        pub completion_tokens: usize,
    }

    /// How a response ended.
    #[derive(Debug)]
    pub enum End {
        Completed(Usage),
        Cancelled,
        SlowClient,
        Failed(String),
    }

    /// What to send next.
    pub enum Step {
        Text(String),
        /// pcm16 LE at the requested rate.
        Audio(Vec<u8>),
        End(End),
    }

    /// One request through the pipeline as a client sees it: text deltas,
    /// audio converted to the client's rate, the end; with its metrics.
    pub struct Generation {
        handle: Option<RequestHandle>,
        _in_flight: InFlightGuard,
        /// The connection it answers (was the client dropped as too slow?).
        out: Outbox,
        cancel: watch::Receiver<bool>,
        metrics: Metrics,
        endpoint: &'static str,
        /// The client's audio format, when it wants audio.
        format: Option<OutputFormat>,
        encoder: Option<AudioEncoder>,
        /// Pipeline audio taken in, in seconds (what an Ogg Opus answer lasts).
        pipeline_seconds: f64,
        pending: Option<End>,
        started: Instant,
        first_text: bool,
        first_audio: bool,
        last_audio: Option<Instant>,
        out_bytes: u64,
        text: String,
        finished: bool,
        phase: shutdown::Watch,
    }

    impl Generation {
        /// Admits and submits the request (errors: over capacity, bad request).
        pub fn start(
            state: &AppState,
            out: &Outbox,
            endpoint: &'static str,
            spec: RequestSpec,
            format: Option<OutputFormat>,
            cancel: watch::Receiver<bool>,
        ) -> Result<Self, ClientError> {
            if state.shutdown.draining() {
                return Err(ClientError::shutting_down());
            }
            let in_flight = state.sessions.begin_request().map_err(ClientError::from)?;
            let handle = state.pipeline.submit(spec).map_err(|e| match e {
                omnistream_stages::engine::EngineError::BadRequest(m) => {
                    ClientError::invalid("invalid_request", m)
                }
                e @ omnistream_stages::engine::EngineError::Unavailable(_) => {
                    ClientError::server("stage_unavailable", e.to_string())
                }
                other => ClientError::server("engine_unavailable", other.to_string()),
            })?;
            Ok(Self {
                handle: Some(handle),
                _in_flight: in_flight,
                out: out.clone(),
                cancel,
                phase: state.shutdown.watch(),
                metrics: state.metrics.clone(),
                endpoint,
                format,
                encoder: None,
                pipeline_seconds: 0.0,
                pending: None,
                started: Instant::now(),
                first_text: true,
                first_audio: true,
                last_audio: None,
                out_bytes: 0,
                text: String::new(),
                finished: false,
            })
        }

        /// The text so far (the whole answer once ended).
        pub fn text(&self) -> &str {
            &self.text
        }

        /// Seconds of audio handed out: exact for PCM (bytes at the client's
        /// rate), the pipeline's audio for Ogg Opus.
        pub fn audio_seconds(&self) -> f64 {
            match self.format {
                Some(OutputFormat::Pcm16 { rate } | OutputFormat::Wav { rate }) if rate > 0 => {
                    self.out_bytes as f64 / 2.0 / f64::from(rate)
                }
                Some(OutputFormat::OggOpus) => self.pipeline_seconds,
                _ => 0.0,
            }
        }

        /// After a cancelled answer: the end of an Ogg Opus stream (its last
        /// pages, end-of-stream flag set), so what the client saved is still a
        /// valid file. Nothing for PCM, whose bytes need no closing.
        pub fn seal(&mut self) -> Vec<u8> {
            if self.format != Some(OutputFormat::OggOpus) {
                return Vec::new();
            }
            self.flush().unwrap_or_default()
        }

        /// Stops the request in every stage.
        pub fn cancel(&mut self) {
            self.handle = None;
            self.record("cancelled");
        }

        /// The connection went away mid-answer: stops the request.
        pub fn abandon(&mut self) {
            self.handle = None;
            self.record("cancelled");
        }

        /// Call after an audio step was queued for the client (TTFP).
        pub fn sent_audio(&mut self) {
            if self.first_audio && self.out_bytes > 0 {
                self.first_audio = false;
                self.metrics
                    .ttfp
                    .with_label_values(&[self.endpoint])
                    .observe(self.started.elapsed().as_secs_f64());
            }
        }

        fn encode(&mut self, samples: &[f32], input_rate: u32) -> Result<Vec<u8>, String> {
            let Some(format) = self.format else {
                return Ok(Vec::new());
            };
            if self.encoder.is_none() {
                self.encoder =
                    Some(AudioEncoder::new(format, input_rate).map_err(|e| e.to_string())?);
            }
            if input_rate > 0 {
                self.pipeline_seconds += samples.len() as f64 / f64::from(input_rate);
            }
            match self.encoder.as_mut() {
                Some(e) => e.push(samples).map_err(|e| e.to_string()),
                None => Ok(Vec::new()),
            }
        }

        fn flush(&mut self) -> Result<Vec<u8>, String> {
            match self.encoder.take() {
                Some(mut e) => e.finish().map_err(|e| e.to_string()),
                None => Ok(Vec::new()),
            }
        }

        fn audio(&mut self, pcm: Vec<u8>) -> Step {
            self.out_bytes += pcm.len() as u64;
            self.last_audio = Some(Instant::now());
            self.metrics
                .bytes_out
                .with_label_values(&[self.endpoint])
                .inc_by(pcm.len() as u64);
            Step::Audio(pcm)
        }

        fn end(&mut self, end: End) -> Step {
            let outcome = match &end {
                End::Completed(_) => "completed",
                End::Cancelled => "cancelled",
                End::SlowClient => "slow_client",
                End::Failed(_) => "failed",
            };
            if matches!(end, End::Completed(_)) {
                let secs = self.audio_seconds();
                if let Some(last) = self.last_audio.filter(|_| secs > 0.0) {
                    self.metrics
                        .rtf
                        .with_label_values(&[self.endpoint])
                        .observe((last - self.started).as_secs_f64() / secs);
                }
            }
            self.record(outcome);
            // Dropping the handle releases the request in every stage.
            self.handle = None;
            Step::End(end)
        }

        /// Counts the request once; a cancellation caused by dropping a slow
        /// client counts as `slow_client`.
        fn record(&mut self, outcome: &str) {
            let outcome = if outcome == "cancelled" && self.out.dropped_slow() {
                "slow_client"
            } else {
                outcome
            };
            if !self.finished {
                self.finished = true;
                self.metrics
                    .requests
                    .with_label_values(&[self.endpoint, outcome])
                    .inc();
            }
        }

        pub async fn next(&mut self) -> Step {
            if let Some(end) = self.pending.take() {
                return self.end(end);
            }
            loop {
                let Some(handle) = self.handle.as_ref() else {
                    return Step::End(End::Cancelled);
                };
                let event = tokio::select! {
                    biased;
                    _ = self.cancel.wait_for(|c| *c) => None,
                    // At the server's close: cancelled, and a shutdown failure.
                    e = self.phase.next_event(handle) => Some(e),
                };
                let Some(event) = event else {
                    self.cancel();
                    return Step::End(End::Cancelled);
                };
                match event {
                    Some(Event::TextDelta(t)) => {
                        if t.is_empty() {
                            continue;
                        }
                        if self.first_text {
                            self.first_text = false;
                            self.metrics
                                .ttft
                                .with_label_values(&[self.endpoint])
                                .observe(self.started.elapsed().as_secs_f64());
                        }
                        self.text.push_str(&t);
                        return Step::Text(t);
                    }
                    Some(Event::Audio {
                        samples,
                        sample_rate,
                        ..
                    }) => match self.encode(&samples, sample_rate) {
                        Ok(pcm) if pcm.is_empty() => continue,
                        Ok(pcm) => return self.audio(pcm),
                        Err(e) => return self.end(End::Failed(format!("audio conversion: {e}"))),
                    },
                    Some(Event::Done {
                        prompt_tokens,
                        cached_tokens,
                        completion_tokens,
                    }) => {
                        let end = End::Completed(Usage {
                            prompt_tokens,
                            cached_tokens,
                            completion_tokens,
                        });
                        return match self.flush() {
                            Ok(tail) if !tail.is_empty() => {
                                self.pending = Some(end);
                                self.audio(tail)
                            }
                            Ok(_) => self.end(end),
                            Err(e) => self.end(End::Failed(format!("audio conversion: {e}"))),
                        };
                    }
                    Some(Event::Error(e)) => {
                        let slow = handle.cancel_reason() == CancelReason::SlowClient;
                        return self.end(if slow {
                            End::SlowClient
                        } else {
                            End::Failed(e)
                        });
                    }
                    None => {
                        return self.end(End::Failed(
                            "the pipeline ended the request without a result".into(),
                        ))
                    }
                }
            }
        }
    }
}
