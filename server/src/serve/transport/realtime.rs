//! `GET /v1/realtime`: the OpenAI Realtime protocol (GA event names) over a
//! WebSocket, text in, text and/or 24 kHz pcm16 audio out; and the same
//! events over a WebRTC data channel, with the audio on media tracks.
//!
//! This file is a codec: client events become the conversation's inputs
//! (validated here, against the protocol), its outputs become server events.
//! What happens in the conversation is decided in `serve::conversation`.

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::http::HeaderMap;
use axum::response::Response;
use base64::Engine as _;
use futures_util::StreamExt;
use omnistream_codecs::g711::Law;
use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_stages::engine::{ChatMessage, Modalities, Role, ToolCall};

use crate::serve::audio::OutputFormat;
use crate::serve::auth;
use crate::serve::conn::{self, AudioSink, Outbox, Overflow};
use crate::serve::conversation::history::Origin;
use crate::serve::conversation::{
    new_id, AnswerInfo, Context, Conversation, End, Input, Item, Output, Respond, Settings,
    ToolItem, TurnSettings,
};
use crate::serve::driver::{self, Action, Incoming, Transport};
use crate::serve::error::ClientError;
use crate::serve::sessions::SessionGuard;
use crate::serve::state::AppState;
use crate::serve::tools::{self, Shape};
use crate::serve::voice_store::owner_of;

/// The only output (and input) audio format: pcm16, mono, 24 kHz.
pub const RATE: u32 = 24_000;
const MAX_OUTPUT_TOKENS: u64 = 4096;

/// A Realtime session on the upgraded connection (`GET /v1/realtime`; the
/// route is `transport::routes`, which sends `?call_id=` to a WebRTC call's
/// sideband instead).
pub fn accept(
    state: Arc<AppState>,
    headers: &HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    let owner = owner_of(auth::presented_key(&state, headers));
    conn::accept(
        state,
        headers,
        ws,
        "realtime",
        &["realtime"],
        move |st, ws, s| serve(st, ws, s, owner),
    )
}

/// Checks a session configuration as `session.update` would on a fresh
/// session: the effective session, or the error naming the field.
pub fn check_session(
    state: &Arc<AppState>,
    owner: &str,
    session: &Value,
) -> Result<Value, ClientError> {
    let mut codec = Realtime::new(state.clone(), new_id("sess"), None).with_owner(owner.into());
    let conv = Conversation::new(driver::caps(state), codec.settings());
    let update = json!({"type": "session.update", "session": session});
    let settings = codec.session_update(update, &conv)?;
    Ok(codec.session_json(&settings, &conv))
}

/// A server event: `type` and a fresh `event_id` added to `body`.
pub fn event(kind: &str, mut body: Value) -> Message {
    if let Value::Object(m) = &mut body {
        m.insert("type".into(), kind.into());
        m.insert("event_id".into(), new_id("event").into());
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

/// Error event for a client too slow to read (the last thing it is sent).
pub fn slow_client_event() -> Message {
    error_event(&ClientError::slow_client(), None)
}

async fn serve(state: Arc<AppState>, socket: WebSocket, session: SessionGuard, owner: String) {
    let _conn = conn::ConnGauge::new(&state.metrics, "realtime");
    let (sink, stream) = socket.split();
    let out = Outbox::start(sink, &state.metrics, slow_client_event());
    let rt = Realtime::new(state.clone(), session.id.clone(), None).with_owner(owner);
    driver::run(
        state,
        rt,
        out,
        driver::websocket_inbound(stream),
        session,
        None,
    )
    .await;
}

/// The Realtime protocol's codec; `speaker`: where answers' audio plays
/// instead of `response.output_audio.delta` events (a WebRTC track).
pub struct Realtime {
    state: Arc<AppState>,
    session_id: String,
    speaker: Option<Box<dyn AudioSink>>,
    /// The WebSocket's audio formats, in and out.
    wire_in: Wire,
    wire_out: Wire,
    /// Whose cloned voices the session may speak in (a hash of its API key).
    owner: String,
    /// The endpoint its answers count under: `realtime`, or the call's
    /// transport (`webrtc`, `sip`).
    endpoint: &'static str,
}

impl Realtime {
    pub fn new(
        state: Arc<AppState>,
        session_id: String,
        speaker: Option<Box<dyn AudioSink>>,
    ) -> Self {
        Self {
            state,
            session_id,
            speaker,
            wire_in: Wire::Pcm,
            wire_out: Wire::Pcm,
            owner: String::new(),
            endpoint: "realtime",
        }
    }

    /// The session may speak `owner`'s cloned voices.
    pub fn with_owner(mut self, owner: String) -> Self {
        self.owner = owner;
        self
    }

    /// A call's session: its answers count under `endpoint`.
    pub fn counted_as(mut self, endpoint: &'static str) -> Self {
        self.endpoint = endpoint;
        self
    }
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

/// A voice of the pipeline's, or a cloned voice of `owner`'s.
fn check_voice(state: &AppState, owner: &str, v: &str) -> Result<String, ClientError> {
    state
        .check_voice(owner, v)
        .map_err(|m| ClientError::param("voice", m))
}

/// The audio a Realtime WebSocket carries, both ways: pcm16 at 24 kHz, or
/// G.711 at 8 kHz (what telephony bridges relay from a call as it is).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Wire {
    Pcm,
    G711(Law),
}

impl Wire {
    /// The sample rate of its PCM.
    pub fn rate(self) -> u32 {
        match self {
            Self::Pcm => RATE,
            Self::G711(_) => G711_RATE,
        }
    }

    fn to_json(self) -> Value {
        match self {
            Self::Pcm => json!({"type": "audio/pcm", "rate": RATE}),
            Self::G711(Law::Ulaw) => json!({"type": "audio/pcmu"}),
            Self::G711(Law::Alaw) => json!({"type": "audio/pcma"}),
        }
    }

    /// An `input_audio_buffer.append`'s base64 as pcm16 LE at [`Self::rate`].
    fn decode(self, b64: &str) -> Result<Vec<u8>, ClientError> {
        match self {
            Self::Pcm => conn::decode_pcm16_base64(b64),
            Self::G711(law) => Ok(law.decode_le(&conn::decode_audio_base64(b64)?)),
        }
    }

    /// An answer's pcm16 LE (at [`Self::rate`]) as a delta's base64.
    fn encode(self, pcm: &[u8]) -> String {
        let b64 = &base64::engine::general_purpose::STANDARD;
        match self {
            Self::Pcm => b64.encode(pcm),
            Self::G711(law) => b64.encode(law.encode_le(pcm)),
        }
    }
}

/// G.711's one rate.
const G711_RATE: u32 = 8_000;

/// A format in the GA (`{"type":"audio/pcm","rate":24000}`,
/// `{"type":"audio/pcmu"}`, `{"type":"audio/pcma"}`) or beta (`"pcm16"`,
/// `"g711_ulaw"`, `"g711_alaw"`) shape; anything else is
/// `unsupported_audio_format`.
fn check_format(v: &Value, param: &'static str) -> Result<Wire, ClientError> {
    let unsupported = |what: String| {
        Err(ClientError {
            param: Some(param),
            ..ClientError::invalid(
                "unsupported_audio_format",
                format!(
                    "audio format {what} is not supported: use {{\"type\":\"audio/pcm\",\"rate\":24000}} (pcm16), {{\"type\":\"audio/pcmu\"}} or {{\"type\":\"audio/pcma\"}} (G.711, 8 kHz)"
                ),
            )
        })
    };
    let named = |kind: &str| match kind {
        "pcm16" | "audio/pcm" => Some(Wire::Pcm),
        "g711_ulaw" | "audio/pcmu" => Some(Wire::G711(Law::Ulaw)),
        "g711_alaw" | "audio/pcma" => Some(Wire::G711(Law::Alaw)),
        _ => None,
    };
    match v {
        Value::String(s) => named(s).map_or_else(|| unsupported(format!("{s:?}")), Ok),
        Value::Object(m) => {
            let kind = m.get("type").and_then(Value::as_str).unwrap_or("");
            let Some(wire) = named(kind).filter(|_| kind.starts_with("audio/")) else {
                return unsupported(format!("{kind:?}"));
            };
            match m.get("rate") {
                None | Some(Value::Null) => Ok(wire),
                Some(r) if r.as_u64() == Some(u64::from(wire.rate())) => Ok(wire),
                Some(r) => unsupported(format!("{kind} at {r} Hz")),
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
    /// omnistream's extension, as on chat completions (benchmarks): every
    /// answer exactly its `max_output_tokens`.
    ignore_eos: Option<bool>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
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
    /// `function_call` and `function_call_output` items.
    call_id: Option<String>,
    name: Option<String>,
    arguments: Option<Value>,
    output: Option<String>,
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
    /// As the session's.
    ignore_eos: Option<bool>,
    conversation: Option<String>,
    input: Option<Vec<Value>>,
    tools: Option<Value>,
    tool_choice: Option<Value>,
}

#[derive(Deserialize, Default)]
struct ResponseCreate {
    #[serde(default)]
    response: Option<ResponseParams>,
}

#[derive(Deserialize)]
struct ItemRef {
    item_id: String,
}

#[derive(Deserialize)]
struct ItemTruncate {
    item_id: String,
    content_index: usize,
    audio_end_ms: u64,
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
    ignore_eos: Option<bool>,
    speed: Option<f32>,
    /// Checked in `session_update` against the session's tools.
    tools: Option<Value>,
    tool_choice: Option<Value>,
    input_format: Option<Wire>,
    output_format: Option<Wire>,
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
        let format =
            |ga: &Option<Value>, ga_param, beta: &Option<Value>, beta_param| match (ga, beta) {
                (Some(f), _) => check_format(f, ga_param).map(Some),
                (None, Some(f)) => check_format(f, beta_param).map(Some),
                (None, None) => Ok(None),
            };
        let output_format = format(
            &output.format,
            "session.audio.output.format",
            &self.output_audio_format,
            "session.output_audio_format",
        )?;
        let input_format = format(
            &input.format,
            "session.audio.input.format",
            &self.input_audio_format,
            "session.input_audio_format",
        )?;
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
            ignore_eos: self.ignore_eos,
            speed,
            tools: self.tools,
            tool_choice: self.tool_choice,
            input_format,
            output_format,
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
    ignore_eos: Option<bool>,
    /// Checked in `on_event` against the session's tools.
    tools: Option<Value>,
    tool_choice: Option<Value>,
    /// `input`: this answer's own context instead of the conversation.
    input: Option<Vec<Context>>,
}

/// Most items a response's own `input` may hold.
const MAX_RESPONSE_INPUT: usize = 256;

/// One item of a response's `input`: an item written out, or a reference
/// to one of the conversation's.
fn context_item(v: Value, i: usize) -> Result<Context, ClientError> {
    let at = |e: ClientError| {
        ClientError {
            message: format!("response.input[{i}]: {}", e.message),
            ..e
        }
        .at("response.input")
    };
    if v.get("type").and_then(Value::as_str) == Some("item_reference") {
        let id = v.get("id").and_then(Value::as_str).unwrap_or_default();
        if id.is_empty() {
            return Err(at(ClientError::invalid(
                "invalid_value",
                "an item_reference needs its id",
            )));
        }
        return Ok(Context::Reference(id.to_string()));
    }
    let item: ItemIn = serde_json::from_value(v)
        .map_err(|e| at(ClientError::invalid("invalid_value", e.to_string())))?;
    let message = match item_input(item).map_err(at)? {
        Input::AddMessage { role, text, .. } => ChatMessage::new(role, text),
        Input::AddToolOutput {
            call_id, output, ..
        } => ChatMessage::tool(call_id, output),
        Input::AddToolCall { call, .. } => {
            let mut m = ChatMessage::assistant("");
            m.tool_calls.push(call);
            m
        }
        _ => {
            return Err(at(ClientError::invalid(
                "invalid_value",
                "not a message, function_call or function_call_output item",
            )))
        }
    };
    Ok(Context::Message(message))
}

impl ResponseParams {
    fn validate(
        self,
        session_audio: bool,
        session_wire: Wire,
    ) -> Result<ResponseOptions, ClientError> {
        let input = match self.input {
            Some(items) if items.len() > MAX_RESPONSE_INPUT => {
                return Err(ClientError::param(
                    "response.input",
                    format!("response.input holds at most {MAX_RESPONSE_INPUT} items"),
                ))
            }
            Some(items) => Some(
                items
                    .into_iter()
                    .enumerate()
                    .map(|(i, v)| context_item(v, i))
                    .collect::<Result<Vec<_>, _>>()?,
            ),
            None => None,
        };
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
            let wire = check_format(f, "response.audio.output.format")?;
            if wire != session_wire {
                return Err(ClientError {
                    param: Some("response.audio.output.format"),
                    ..ClientError::invalid(
                        "unsupported_audio_format",
                        format!(
                            "a response speaks in the session's audio format ({}): change it with session.update",
                            session_wire.to_json()
                        ),
                    )
                });
            }
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
            ignore_eos: self.ignore_eos,
            tools: self.tools,
            tool_choice: self.tool_choice,
            input,
        })
    }
}

/// Parses a client event's fields into `T`; a type mismatch is a clear error.
fn fields<T: serde::de::DeserializeOwned>(v: Value, kind: &str) -> Result<T, ClientError> {
    serde_json::from_value(v)
        .map_err(|e| ClientError::invalid("invalid_event", format!("{kind}: {e}")))
}

/// Another answer asked for while one runs.
fn busy(id: &str) -> ClientError {
    ClientError::invalid(
        "conversation_already_has_active_response",
        format!("response {id} is still in progress: wait for response.done or cancel it"),
    )
}

fn input(event_id: Option<String>, input: Input) -> Vec<Action> {
    vec![Action::Input { event_id, input }]
}

impl Realtime {
    fn session_json(&self, s: &Settings, conv: &Conversation) -> Value {
        json!({
            "type": "realtime",
            "object": "realtime.session",
            "id": self.session_id,
            "model": self.state.config.model_name,
            "output_modalities": if s.audio_out { ["audio"] } else { ["text"] },
            "instructions": s.instructions.clone().unwrap_or_default(),
            "audio": {
                "input": {
                    "format": self.wire_in.to_json(),
                    "transcription": if conv.caps().listener {
                        json!({"model": "whisper-tiny.en", "language": "en", "prompt": ""})
                    } else {
                        Value::Null
                    },
                    "noise_reduction": null,
                    "turn_detection": s.turns.as_ref().map_or(Value::Null, TurnSettings::to_json),
                },
                "output": {
                    "format": self.wire_out.to_json(),
                    "voice": s.voice.clone().unwrap_or_else(|| self.state.default_voice().to_string()),
                    "speed": s.sampling.speed.unwrap_or(1.0),
                },
            },
            "max_output_tokens": s.sampling.max_tokens.map_or_else(|| json!("inf"), |n| json!(n)),
            "temperature": s.sampling.temperature,
            "tools": s.tools.functions_json(Shape::Realtime),
            "tool_choice": s.tools.choice_json(Shape::Realtime),
            "tracing": null,
        })
    }

    fn on_event(&mut self, v: Value, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        let event_id = v.get("event_id").and_then(Value::as_str).map(str::to_owned);
        let Some(kind) = v.get("type").and_then(Value::as_str).map(str::to_owned) else {
            return Err(ClientError::invalid(
                "missing_type",
                "the event has no string \"type\"",
            ));
        };
        Ok(match kind.as_str() {
            "session.update" => {
                let settings = self.session_update(v, conv)?;
                let session = self.session_json(&settings, conv);
                vec![
                    Action::Input {
                        event_id,
                        input: Input::Configure(settings),
                    },
                    Action::Send(event("session.updated", json!({ "session": session }))),
                ]
            }
            "conversation.item.create" => input(event_id, item_create(v)?),
            "response.create" => {
                let o = fields::<ResponseCreate>(v, "response.create")?
                    .response
                    .unwrap_or_default()
                    .validate(conv.settings().audio_out, self.wire_out)?;
                let voice = o
                    .voice
                    .map(|v| check_voice(&self.state, &self.owner, &v))
                    .transpose()?;
                let tools = match (&o.tools, &o.tool_choice) {
                    (None, None) => None,
                    (t, c) => Some(Arc::new(tools::parse(
                        t.as_ref(),
                        c.as_ref(),
                        &conv.settings().tools,
                        Shape::Realtime,
                        ("response.tools", "response.tool_choice"),
                    )?)),
                };
                let respond = Respond {
                    audio_out: Some(o.audio_out),
                    instructions: o.instructions,
                    voice,
                    max_tokens: o.max_tokens,
                    temperature: o.temperature,
                    ignore_eos: o.ignore_eos,
                    record: o.record,
                    user_text: None,
                    busy,
                    tools,
                    input: o.input,
                };
                input(event_id, Input::Respond(respond))
            }
            "response.cancel" => {
                let ResponseCancel { response_id } = fields(v, "response.cancel")?;
                input(event_id, Input::Cancel { response_id })
            }
            "input_audio_buffer.append" => {
                let AudioAppend { audio } = fields(v, "input_audio_buffer.append")?;
                input(event_id, Input::Audio(self.wire_in.decode(&audio)?))
            }
            "input_audio_buffer.commit" => input(event_id, Input::Commit { respond: false }),
            "input_audio_buffer.clear" => input(event_id, Input::Clear),
            "output_audio_buffer.clear" if self.speaker.is_some() => {
                self.clear_player();
                vec![Action::Send(event(
                    "output_audio_buffer.cleared",
                    json!({}),
                ))]
            }
            "output_audio_buffer.clear" => {
                return Err(ClientError::invalid(
                    "unsupported_event",
                    "output_audio_buffer.clear applies to WebRTC calls, where the server plays the audio; over a WebSocket the client holds it (stop playing, then conversation.item.truncate)",
                ))
            }
            "conversation.item.retrieve" => {
                let ItemRef { item_id } = fields(v, "conversation.item.retrieve")?;
                input(event_id, Input::RetrieveItem { item_id })
            }
            "conversation.item.delete" => {
                let ItemRef { item_id } = fields(v, "conversation.item.delete")?;
                input(event_id, Input::DeleteItem { item_id })
            }
            "conversation.item.truncate" => {
                let t: ItemTruncate = fields(v, "conversation.item.truncate")?;
                input(
                    event_id,
                    Input::TruncateItem {
                        item_id: t.item_id,
                        content_index: t.content_index,
                        audio_end_ms: t.audio_end_ms,
                    },
                )
            }
            "transcription_session.update" => {
                return Err(ClientError::invalid(
                    "unsupported_event",
                    format!("{kind} is not supported by this server"),
                ))
            }
            other => {
                return Err(ClientError::invalid(
                    "unknown_event_type",
                    format!("unknown event type {other:?}"),
                ))
            }
        })
    }

    /// The session's settings after a `session.update`, all of it validated
    /// before any of it applies.
    fn session_update(&mut self, v: Value, conv: &Conversation) -> Result<Settings, ClientError> {
        let change = fields::<SessionUpdate>(v, "session.update")?
            .session
            .validate()?;
        let media_track = self.speaker.is_some();
        for (wire, param) in [
            (change.input_format, "session.audio.input.format"),
            (change.output_format, "session.audio.output.format"),
        ] {
            if media_track && wire.is_some_and(|w| w != Wire::Pcm) {
                return Err(ClientError {
                    param: Some(param),
                    ..ClientError::invalid(
                        "unsupported_audio_format",
                        "a call's audio is on its media track (its codec is the SDP's): the session's format stays audio/pcm",
                    )
                });
            }
        }
        let voice = change
            .voice
            .map(|v| check_voice(&self.state, &self.owner, &v))
            .transpose()?;
        let mut s = conv.settings().clone();
        if let Some(td) = &change.turn_detection {
            let hub = self.state.config.vad.as_ref().map(|h| h.min_speech_ms);
            s.turns = TurnSettings::parse(td, hub, "session.audio.input.turn_detection")?;
        }
        if let Some(a) = change.audio_out {
            s.audio_out = a;
        }
        if let Some(i) = change.instructions {
            s.instructions = Some(i).filter(|i| !i.is_empty());
        }
        if let Some(v) = voice {
            s.voice = Some(v);
        }
        if let Some(m) = change.max_tokens {
            s.sampling.max_tokens = m;
        }
        if let Some(t) = change.temperature {
            s.sampling.temperature = Some(t);
        }
        if let Some(i) = change.ignore_eos {
            s.sampling.ignore_eos = i;
        }
        if s.sampling.ignore_eos && s.sampling.max_tokens.is_none() {
            return Err(ClientError::param(
                "session.ignore_eos",
                "`ignore_eos` needs `max_output_tokens`: the answers would never end",
            ));
        }
        if let Some(sp) = change.speed {
            s.sampling.speed = Some(sp);
        }
        if change.tools.is_some() || change.tool_choice.is_some() {
            s.tools = Arc::new(tools::parse(
                change.tools.as_ref(),
                change.tool_choice.as_ref(),
                &s.tools,
                Shape::Realtime,
                ("session.tools", "session.tool_choice"),
            )?);
        }
        // Applied last: nothing above failed.
        if let Some(w) = change.input_format {
            self.wire_in = w;
            s.input_rate = w.rate();
        }
        if let Some(w) = change.output_format {
            self.wire_out = w;
            s.output = OutputFormat::Pcm16 { rate: w.rate() };
        }
        Ok(s)
    }

    /// Announces a new conversation item (beta `created`, GA `added` + `done`).
    fn announce_item(item: &Value, previous: &Option<String>, frames: &mut Vec<Message>) {
        for kind in [
            "conversation.item.created",
            "conversation.item.added",
            "conversation.item.done",
        ] {
            frames.push(event(
                kind,
                json!({"previous_item_id": previous, "item": item}),
            ));
        }
    }

    fn answer_opening(&self, a: &AnswerInfo) -> Vec<Message> {
        let created = event(
            "response.created",
            json!({"response": self.response(a, "in_progress", Value::Null, json!([]), Value::Null)}),
        );
        let item = answer_item(a, "in_progress", json!([]));
        vec![
            created,
            event(
                "response.output_item.added",
                json!({"response_id": a.response_id, "output_index": 0, "item": item}),
            ),
            event(
                "conversation.item.added",
                json!({"previous_item_id": a.previous, "item": item}),
            ),
            event(
                "response.content_part.added",
                json!({
                    "response_id": a.response_id, "item_id": a.item_id,
                    "output_index": 0, "content_index": 0, "part": part(a, ""),
                }),
            ),
        ]
    }

    fn response(
        &self,
        a: &AnswerInfo,
        status: &str,
        details: Value,
        output: Value,
        usage: Value,
    ) -> Value {
        json!({
            "id": a.response_id,
            "object": "realtime.response",
            "status": status,
            "status_details": details,
            "output": output,
            "conversation_id": self.session_id,
            "output_modalities": if a.audio { ["audio"] } else { ["text"] },
            "max_output_tokens": a.max_out.map_or_else(|| json!("inf"), |n| json!(n)),
            "usage": usage,
        })
    }

    fn answer_closing(
        &self,
        a: &AnswerInfo,
        end: &End,
        text: &str,
        calls: &[(String, ToolCall)],
    ) -> Vec<Message> {
        let (status, details, usage) = match end {
            End::Completed(u) => {
                let incomplete = a.max_out.is_some_and(|m| u.completion_tokens >= m);
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
            End::Cancelled | End::SlowClient => (
                "cancelled",
                json!({"type": "cancelled", "reason": "client_cancelled"}),
                Value::Null,
            ),
            End::Failed(e) => {
                let e = ClientError::failed(e.clone());
                (
                    "failed",
                    json!({"type": "failed", "error": {"type": e.kind, "code": e.code, "message": e.message, "param": e.param}}),
                    Value::Null,
                )
            }
        };
        let item_status = if status == "completed" {
            "completed"
        } else {
            "incomplete"
        };
        let part = part(a, text);
        let item = answer_item(a, item_status, json!([part]));
        let mut closing = Vec::new();
        if a.audio {
            closing.push(delta(a, "response.output_audio.done", json!({})));
            closing.push(delta(
                a,
                "response.output_audio_transcript.done",
                json!({ "transcript": text }),
            ));
        } else {
            closing.push(delta(
                a,
                "response.output_text.done",
                json!({ "text": text }),
            ));
        }
        closing.push(delta(
            a,
            "response.content_part.done",
            json!({ "part": part }),
        ));
        closing.push(event(
            "response.output_item.done",
            json!({"response_id": a.response_id, "output_index": 0, "item": item}),
        ));
        closing.push(event(
            "conversation.item.done",
            json!({"previous_item_id": a.previous, "item": item}),
        ));
        let mut output = vec![item];
        output.extend(calls.iter().map(|(id, c)| call_item(id, c, "completed")));
        closing.push(event(
            "response.done",
            json!({"response": self.response(a, status, details, Value::Array(output), usage)}),
        ));
        closing
    }
}

fn answer_item(a: &AnswerInfo, status: &str, content: Value) -> Value {
    json!({
        "id": a.item_id, "object": "realtime.item", "type": "message",
        "status": status, "role": "assistant", "content": content,
    })
}

/// A function call the model made, as a Realtime item.
fn call_item(item_id: &str, c: &ToolCall, status: &str) -> Value {
    json!({
        "id": item_id, "object": "realtime.item", "type": "function_call",
        "status": status, "call_id": c.id, "name": c.function.name,
        "arguments": if status == "completed" { c.function.arguments.as_str() } else { "" },
    })
}

/// A remembered item, as the conversation has it now (an answer cut back
/// to what was heard, a user turn with its transcript).
fn history_item(item: &Item) -> Value {
    let m = &item.message;
    let message = |role: &str, content: Value| {
        json!({
            "id": item.id, "object": "realtime.item", "type": "message",
            "status": "completed", "role": role, "content": content,
        })
    };
    match &item.origin {
        Origin::Client(content) => message(m.role.as_str(), content.clone()),
        Origin::Typed => message("user", json!([{"type": "input_text", "text": m.content}])),
        Origin::Spoken => message(
            "user",
            json!([{"type": "input_audio", "transcript": m.content}]),
        ),
        Origin::Answer {
            audio_ms: Some(_), ..
        } => message(
            "assistant",
            json!([{"type": "output_audio", "transcript": m.content}]),
        ),
        Origin::Answer { audio_ms: None, .. } => message(
            "assistant",
            json!([{"type": "output_text", "text": m.content}]),
        ),
        Origin::Call => match m.tool_calls.first() {
            Some(c) => call_item(&item.id, c, "completed"),
            None => message("assistant", json!([])),
        },
        Origin::Output => tool_item(
            &item.id,
            &ToolItem::Output {
                call_id: m.tool_call_id.clone().unwrap_or_default(),
                output: m.content.clone(),
            },
        ),
    }
}

/// A tool item the client added, as a Realtime item.
fn tool_item(item_id: &str, item: &ToolItem) -> Value {
    match item {
        ToolItem::Call(c) => call_item(item_id, c, "completed"),
        ToolItem::Output { call_id, output } => json!({
            "id": item_id, "object": "realtime.item", "type": "function_call_output",
            "call_id": call_id, "output": output,
        }),
    }
}

/// The events of one function call of an answer: its own output item after
/// the message (index 0), its arguments (whole: the parser has them only
/// once the call is complete), done. The call is never spoken.
fn call_events(
    a: &AnswerInfo,
    item_id: &str,
    previous: &Option<String>,
    index: usize,
    c: &ToolCall,
) -> Vec<Message> {
    let output_index = index + 1;
    let head = json!({
        "response_id": a.response_id, "item_id": item_id,
        "output_index": output_index, "call_id": c.id,
    });
    let with = |extra: Value| {
        let mut b = head.clone();
        if let (Value::Object(b), Value::Object(e)) = (&mut b, extra) {
            b.extend(e);
        }
        b
    };
    // The item's `response.output_item.<stage>` and `conversation.item.<stage>`.
    let item_events = |stage: &str, status: &str| {
        let item = call_item(item_id, c, status);
        [
            event(
                &format!("response.output_item.{stage}"),
                json!({"response_id": a.response_id, "output_index": output_index, "item": item}),
            ),
            event(
                &format!("conversation.item.{stage}"),
                json!({"previous_item_id": previous, "item": item}),
            ),
        ]
    };
    let mut events = Vec::from(item_events("added", "in_progress"));
    events.push(event(
        "response.function_call_arguments.delta",
        with(json!({"delta": c.function.arguments})),
    ));
    events.push(event(
        "response.function_call_arguments.done",
        with(json!({"name": c.function.name, "arguments": c.function.arguments})),
    ));
    events.extend(item_events("done", "completed"));
    events
}

fn part(a: &AnswerInfo, text: &str) -> Value {
    if a.audio {
        json!({"type": "output_audio", "transcript": text})
    } else {
        json!({"type": "output_text", "text": text})
    }
}

/// `response_id`, `item_id`, `output_index`, `content_index` plus `extra`.
fn delta(a: &AnswerInfo, kind: &str, extra: Value) -> Message {
    let mut body = json!({
        "response_id": a.response_id, "item_id": a.item_id,
        "output_index": 0, "content_index": 0,
    });
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    event(kind, body)
}

/// `conversation.item.create`, validated: a message with text.
fn item_create(v: Value) -> Result<Input, ClientError> {
    let ItemCreate { item } = fields(v, "conversation.item.create")?;
    item_input(item)
}

/// A message, function call or function call output item, checked.
fn item_input(item: ItemIn) -> Result<Input, ClientError> {
    let item_id = item.id.clone().filter(|i| !i.is_empty() && i.len() <= 64);
    match item.kind.as_str() {
        "message" => {}
        "function_call_output" => {
            let call_id = item.call_id.filter(|c| !c.is_empty()).ok_or_else(|| {
                ClientError::param("item.call_id", "a function_call_output needs its call_id")
            })?;
            let output = item.output.ok_or_else(|| {
                ClientError::param("item.output", "a function_call_output needs its output (a string)")
            })?;
            return Ok(Input::AddToolOutput {
                item_id,
                call_id,
                output,
            });
        }
        "function_call" => {
            let call = tools::client_call(
                item.call_id.as_deref(),
                item.name.as_deref(),
                item.arguments.as_ref(),
                "item",
            )?;
            return Ok(Input::AddToolCall { item_id, call });
        }
        other => {
            return Err(ClientError::param(
                "item.type",
                format!(
                    "item type {other:?} is not supported: \"message\", \"function_call\" or \"function_call_output\""
                ),
            ))
        }
    }
    let name = item.role.unwrap_or_default();
    let Some(role) = Role::parse(&name) else {
        return Err(ClientError::param(
            "item.role",
            format!("role {name:?}: use \"user\", \"system\" or \"assistant\""),
        ));
    };
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
    Ok(Input::AddMessage {
        item_id,
        role,
        text,
        content: Value::Array(content),
    })
}

impl Transport for Realtime {
    fn endpoint(&self) -> &'static str {
        self.endpoint
    }

    fn voice_owner(&self) -> &str {
        &self.owner
    }

    fn settings(&self) -> Settings {
        let mut s = Settings::new(RATE, OutputFormat::Pcm16 { rate: RATE });
        // A live microphone never stops: its buffer keeps the newest audio.
        s.mic = self.speaker.is_some();
        s
    }

    fn opening(&mut self, conv: &Conversation) -> Vec<Message> {
        let session = self.session_json(conv.settings(), conv);
        vec![event("session.created", json!({ "session": session }))]
    }

    fn message(&mut self, m: Incoming<'_>, conv: &Conversation) -> Vec<Action> {
        let text = match m {
            Incoming::Text(t) => t,
            Incoming::Binary(_) => {
                let e = ClientError::invalid(
                    "invalid_frame",
                    "binary frames are not part of the Realtime protocol: send JSON text events",
                );
                return vec![Action::Send(error_event(&e, None))];
            }
        };
        let v: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                let e = ClientError::invalid(
                    "invalid_json",
                    format!("the event is not valid JSON: {e}"),
                );
                return vec![Action::Send(error_event(&e, None))];
            }
        };
        let event_id = v.get("event_id").and_then(Value::as_str).map(str::to_owned);
        match self.on_event(v, conv) {
            Ok(actions) => actions,
            Err(e) => vec![Action::Send(error_event(&e, event_id.as_deref()))],
        }
    }

    fn output(&mut self, o: Output, _conv: &Conversation) -> Result<Vec<Message>, Overflow> {
        let mut frames = Vec::new();
        match o {
            Output::Error { error, event_id } => {
                frames.push(error_event(&error, event_id.as_deref()));
            }
            Output::SpeechStarted {
                item_id,
                audio_start_ms,
            } => frames.push(event(
                "input_audio_buffer.speech_started",
                json!({"audio_start_ms": audio_start_ms, "item_id": item_id}),
            )),
            Output::SpeechStopped {
                item_id,
                audio_end_ms,
                ..
            } => frames.push(event(
                "input_audio_buffer.speech_stopped",
                json!({"audio_end_ms": audio_end_ms, "item_id": item_id}),
            )),
            Output::AudioReceived { .. } => {}
            Output::InputCleared => frames.push(event("input_audio_buffer.cleared", json!({}))),
            Output::Committed {
                item_id,
                previous,
                seconds,
            } => {
                frames.push(event(
                    "input_audio_buffer.committed",
                    json!({"previous_item_id": previous, "item_id": item_id}),
                ));
                // As in OpenAI's API the item comes first, its transcript after.
                let item = json!({
                    "id": item_id, "object": "realtime.item", "type": "message",
                    "status": "completed", "role": "user",
                    "content": [{"type": "input_audio", "transcript": null}],
                    "audio_seconds": seconds,
                });
                Self::announce_item(&item, &previous, &mut frames);
            }
            Output::ItemAdded {
                item_id,
                previous,
                role,
                content,
            } => {
                let item = json!({
                    "id": item_id, "object": "realtime.item", "type": "message",
                    "status": "completed", "role": role, "content": content,
                });
                Self::announce_item(&item, &previous, &mut frames);
            }
            Output::ToolItemAdded {
                item_id,
                previous,
                item,
            } => {
                let item = tool_item(&item_id, &item);
                Self::announce_item(&item, &previous, &mut frames);
            }
            Output::AnswerToolCall {
                answer,
                item_id,
                previous,
                index,
                call,
            } => frames.extend(call_events(&answer, &item_id, &previous, index, &call)),
            Output::Transcribed { item_id, result } => frames.push(match result {
                Ok(transcript) => event(
                    "conversation.item.input_audio_transcription.completed",
                    json!({"item_id": item_id, "content_index": 0, "transcript": transcript}),
                ),
                Err(e) => event(
                    "conversation.item.input_audio_transcription.failed",
                    json!({
                        "item_id": item_id, "content_index": 0,
                        "error": {"type": e.kind, "code": e.code, "message": e.message},
                    }),
                ),
            }),
            Output::AnswerStarted(a) => frames.extend(self.answer_opening(&a)),
            Output::AnswerText { answer, delta: d } => {
                let kind = if answer.audio {
                    "response.output_audio_transcript.delta"
                } else {
                    "response.output_text.delta"
                };
                frames.push(delta(&answer, kind, json!({ "delta": d })));
            }
            Output::AnswerAudio { answer, bytes } => match &self.speaker {
                Some(sp) => sp.push(&answer.response_id, &bytes)?,
                None => frames.push(delta(
                    &answer,
                    "response.output_audio.delta",
                    json!({ "delta": self.wire_out.encode(&bytes) }),
                )),
            },
            Output::AnswerDone {
                answer,
                end,
                text,
                calls,
                ..
            } => {
                if let Some(sp) = &self.speaker {
                    sp.end(&answer.response_id);
                }
                frames.extend(self.answer_closing(&answer, &end, &text, &calls));
            }
            Output::Truncated {
                item_id,
                audio_end_ms,
                ..
            } => frames.push(event(
                "conversation.item.truncated",
                json!({"item_id": item_id, "content_index": 0, "audio_end_ms": audio_end_ms}),
            )),
            Output::PlaybackCleared { response_id } => frames.push(event(
                "output_audio_buffer.cleared",
                json!({"response_id": response_id}),
            )),
            Output::ItemRetrieved(item) => frames.push(event(
                "conversation.item.retrieved",
                json!({"item": history_item(&item)}),
            )),
            Output::ItemDeleted { item_id } => frames.push(event(
                "conversation.item.deleted",
                json!({"item_id": item_id}),
            )),
            Output::TimeoutTriggered {
                item_id,
                audio_start_ms,
                audio_end_ms,
            } => frames.push(event(
                "input_audio_buffer.timeout_triggered",
                json!({"item_id": item_id, "audio_start_ms": audio_start_ms, "audio_end_ms": audio_end_ms}),
            )),
        }
        Ok(frames)
    }

    fn error(&self, e: &ClientError) -> Message {
        error_event(e, None)
    }

    fn queued_seconds(&self) -> f64 {
        self.speaker.as_ref().map_or(0.0, |s| s.queued_seconds())
    }

    fn clear_player(&mut self) {
        if let Some(s) = &self.speaker {
            s.clear();
        }
    }

    fn has_player(&self) -> bool {
        self.speaker.is_some()
    }

    /// A phone call's key: the event OpenAI's SIP calls send, then the
    /// caller's turn.
    fn key(&mut self, key: char, conv: &Conversation) -> Vec<Action> {
        vec![
            Action::Send(event(
                "input_audio_buffer.dtmf_event_received",
                json!({"event": key.to_string(), "received_at": super::unix_now()}),
            )),
            Action::Input {
                event_id: None,
                input: crate::serve::conversation::keypress(key, conv),
            },
        ]
    }
}
