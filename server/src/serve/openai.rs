//! OpenAI-compatible HTTP: `POST /v1/chat/completions` (text, or text + audio;
//! one JSON body or SSE) and `POST /v1/audio/speech` (a body streamed as it is
//! produced, or SSE).
//!
//! A request is validated, admitted (`begin_request`: 503 over the cap),
//! submitted, and its first event awaited, so every failure up to that point
//! is an ordinary HTTP error. From then on the response body pulls events
//! straight from the request's bounded queue: audio leaves the moment the
//! pipeline emits it, a slow client never blocks a stage (the engine drops it
//! once its queue fills), and a client that goes away drops the body, and with
//! it the `RequestHandle`: the request is cancelled in every stage.

use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use axum::{Extension, Json, Router};
use base64::Engine as _;
use serde::de::DeserializeOwned;
use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_stages::engine::{
    CancelReason, EngineError, Event, Modalities, RequestHandle, RequestInput, RequestSpec,
    SamplingOverrides, MAX_SPEECH_CHARS,
};
use omnistream_stages::engine::{ChatMessage, Role};

use super::answer::Meter;
use super::audio::{AudioEncoder, OutputFormat};
use super::error::{read_body, ApiError};
use super::metrics::{Metrics, TaskGuard};
use super::sessions::InFlightGuard;
use super::shutdown;
use super::state::AppState;

/// Largest request body; more is a 413.
pub const MAX_BODY_BYTES: usize = 1 << 20;
/// How long an answer's audio id can be referred to in a later turn.
const AUDIO_TTL: Duration = Duration::from_secs(3600);
/// Answers whose transcript is kept for later turns (oldest dropped first).
const AUDIO_STORE_CAP: usize = 1024;
/// Output formats per endpoint (OpenAI's names).
const CHAT_FORMATS: &[&str] = &["pcm16", "wav", "opus"];
const SPEECH_FORMATS: &[&str] = &["wav", "pcm", "opus"];
/// Metric labels.
const EP_CHAT: &str = "chat_completions";
const EP_SPEECH: &str = "audio_speech";

pub fn routes() -> Router<Arc<AppState>> {
    Router::new()
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/audio/speech", post(speech))
        .layer(Extension(Arc::new(AudioStore::default())))
        .layer(DefaultBodyLimit::max(MAX_BODY_BYTES))
}

// ---------------------------------------------------------------- handlers

async fn chat_completions(
    State(state): State<Arc<AppState>>,
    Extension(store): Extension<Arc<AudioStore>>,
    req: Request,
) -> Response {
    let mut t = tracker(&state.metrics, EP_CHAT);
    let reply = chat(&state, &store, req, &mut t).await;
    respond(reply, t)
}

async fn speech(State(state): State<Arc<AppState>>, req: Request) -> Response {
    let t = tracker(&state.metrics, EP_SPEECH);
    let reply = speak(&state, req).await;
    respond(reply, t)
}

/// What a handler made: a whole response, or a streamed one to start with the
/// request's tracker.
enum Reply {
    Whole(Response),
    Stream(Box<dyn FnOnce(Tracker) -> Response + Send>),
}

/// The response; an error's outcome is recorded unless the request already
/// has one.
fn respond(reply: Result<Reply, ApiError>, mut t: Tracker) -> Response {
    match reply {
        Ok(Reply::Whole(r)) => r,
        Ok(Reply::Stream(start)) => {
            t.streaming = true;
            start(t)
        }
        Err(e) => {
            t.finish_if_open(match e.status {
                StatusCode::SERVICE_UNAVAILABLE => "overloaded",
                s if s.is_client_error() => "bad_request",
                _ => "error",
            });
            e.into_response()
        }
    }
}

async fn chat(
    state: &Arc<AppState>,
    store: &Arc<AudioStore>,
    req: Request,
    t: &mut Tracker,
) -> Result<Reply, ApiError> {
    let body: ChatRequest = read_json(req).await?;
    let plan = ChatPlan::from_request(body, store, state.pipeline.voices())?;
    let audio = match plan.audio {
        Some(format) => Some((format, sample_rate(state)?)),
        None => None,
    };
    let max_tokens = plan.spec.sampling.max_tokens;
    let slot = state.sessions.begin_request()?;
    let handle = submit(state, plan.spec).await?;
    let mut phase = state.shutdown.watch();
    let first = first_event(&handle, false, &mut phase).await?;
    let meta = ChunkMeta::new(&state.config.model_name, plan.include_usage);
    if !plan.stream {
        let r = collect_chat(
            &handle, &mut phase, first, audio, t, &meta, max_tokens, store,
        )
        .await?;
        return Ok(Reply::Whole(r));
    }
    let sink = ChatSse {
        meta,
        audio: audio.map(|(f, rate)| AudioOut::new(f, rate)).transpose()?,
        text: String::new(),
        started: false,
        max_tokens,
        store: store.clone(),
    };
    let state = state.clone();
    Ok(Reply::Stream(Box::new(move |t| {
        let run = Running::new(&state, handle, slot, t, phase);
        sse_response(event_body(run, first, sink))
    })))
}

async fn speak(state: &Arc<AppState>, req: Request) -> Result<Reply, ApiError> {
    let body: SpeechRequest = read_json(req).await?;
    let plan = SpeechPlan::from_request(body, state.pipeline.voices())?;
    let enc = AudioEncoder::new(plan.format, sample_rate(state)?).map_err(internal)?;
    let slot = state.sessions.begin_request()?;
    let handle = submit(state, plan.spec).await?;
    // The first audio (or a failure) before the status line is sent.
    let mut phase = state.shutdown.watch();
    let first = first_event(&handle, true, &mut phase).await?;
    let state = state.clone();
    Ok(Reply::Stream(Box::new(move |t| {
        let run = Running::new(&state, handle, slot, t, phase);
        if plan.sse {
            return sse_response(event_body(run, first, SpeechSse { enc }));
        }
        let body = event_body(run, first, SpeechRaw { enc });
        (
            [
                (header::CONTENT_TYPE, plan.format.content_type()),
                (header::CACHE_CONTROL, "no-cache"),
            ],
            body,
        )
            .into_response()
    })))
}

/// Non-streaming chat: the whole answer in one `chat.completion`.
#[allow(clippy::too_many_arguments)]
async fn collect_chat(
    handle: &RequestHandle,
    phase: &mut shutdown::Watch,
    first: Event,
    audio: Option<(OutputFormat, u32)>,
    t: &mut Tracker,
    meta: &ChunkMeta,
    max_tokens: Option<usize>,
    store: &AudioStore,
) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut samples = Vec::new();
    let mut next = Some(first);
    let usage = loop {
        let ev = match next.take() {
            Some(ev) => ev,
            None => phase.next_event(handle).await.unwrap_or_else(ended_early),
        };
        match ev {
            Event::TextDelta(s) => text.push_str(&s),
            Event::Audio {
                samples: chunk,
                sample_rate,
                ..
            } => {
                made(t, chunk.len(), sample_rate);
                samples.extend(chunk);
            }
            Event::Done {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => break Usage::new(prompt_tokens, cached_tokens, completion_tokens),
            Event::Error(e) => {
                t.finish(error_outcome(handle));
                return Err(ApiError::failed(e));
            }
        }
    };
    let finish = finish_reason(usage.completion, max_tokens);
    let message = match audio {
        Some((format, rate)) => {
            // A whole file (WAV with its real sizes), encoded off the async workers.
            let data = tokio::task::spawn_blocking(move || {
                AudioEncoder::encode_all(format, &samples, rate)
            })
            .await
            .map_err(internal)?
            .map_err(internal)?;
            t.audio_out(data.len());
            let id = audio_id();
            let expires_at = unix_now() + AUDIO_TTL.as_secs();
            store.put(&id, &text, expires_at);
            json!({
                "role": "assistant",
                "content": null,
                "refusal": null,
                "audio": {
                    "id": id,
                    "data": b64(&data),
                    "expires_at": expires_at,
                    "transcript": text,
                },
            })
        }
        None => json!({"role": "assistant", "content": text, "refusal": null}),
    };
    t.finish("ok");
    Ok(Json(json!({
        "id": meta.id,
        "object": "chat.completion",
        "created": meta.created,
        "model": meta.model,
        "choices": [{
            "index": 0,
            "message": message,
            "logprobs": null,
            "finish_reason": finish,
        }],
        "usage": usage.chat_json(),
        "system_fingerprint": null,
    }))
    .into_response())
}

// ---------------------------------------------------------------- requests

/// `POST /v1/chat/completions`. Fields not listed are ignored, as OpenAI does.
#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<InMessage>,
    #[serde(default)]
    modalities: Option<Vec<String>>,
    #[serde(default)]
    audio: Option<AudioParam>,
    #[serde(default)]
    stream: Option<bool>,
    #[serde(default)]
    stream_options: Option<StreamOptions>,
    #[serde(default)]
    temperature: Option<f64>,
    #[serde(default)]
    top_p: Option<f64>,
    #[serde(default)]
    max_tokens: Option<i64>,
    #[serde(default)]
    max_completion_tokens: Option<i64>,
    #[serde(default)]
    seed: Option<i64>,
    #[serde(default)]
    n: Option<i64>,
    /// vLLM's extension: generate exactly `max_tokens` (benchmarks' equal work).
    #[serde(default)]
    ignore_eos: Option<bool>,
}

#[derive(Debug, Deserialize)]
struct InMessage {
    role: String,
    #[serde(default)]
    content: Option<Value>,
    /// An earlier answer's audio (`{"id": ...}`), for an assistant turn.
    #[serde(default)]
    audio: Option<AudioRef>,
}

#[derive(Debug, Deserialize)]
struct AudioRef {
    id: String,
}

#[derive(Debug, Deserialize)]
struct AudioParam {
    #[serde(default)]
    voice: Option<Value>,
    #[serde(default)]
    format: Option<String>,
}

#[derive(Debug, Default, Deserialize)]
struct StreamOptions {
    #[serde(default)]
    include_usage: Option<bool>,
}

/// `POST /v1/audio/speech`.
#[derive(Debug, Deserialize)]
struct SpeechRequest {
    input: String,
    #[serde(default)]
    voice: Option<Value>,
    #[serde(default)]
    response_format: Option<String>,
    #[serde(default)]
    speed: Option<f64>,
    #[serde(default)]
    stream_format: Option<String>,
}

/// A validated chat request.
#[derive(Debug)]
struct ChatPlan {
    spec: RequestSpec,
    audio: Option<OutputFormat>,
    stream: bool,
    include_usage: bool,
}

impl ChatPlan {
    fn from_request(
        mut r: ChatRequest,
        store: &AudioStore,
        voices: &[String],
    ) -> Result<Self, ApiError> {
        if r.messages.is_empty() {
            return Err(invalid("`messages` must not be empty"));
        }
        // Speech in the last user message goes to a Thinker that hears it.
        let last = r.messages.len() - 1;
        let mut heard = None;
        for (i, m) in r.messages.iter_mut().enumerate() {
            if let Some(audio) = take_input_audio(i, m, i == last)? {
                heard = Some(audio);
            }
        }
        let messages = r
            .messages
            .iter()
            .enumerate()
            .filter(|(i, m)| !(heard.is_some() && *i == last && m.content.is_none()))
            .map(|(i, m)| to_chat_message(i, m, store))
            .collect::<Result<Vec<_>, _>>()?;
        let sampling = chat_sampling(&r)?;
        let names = r.modalities.unwrap_or_else(|| vec!["text".into()]);
        let modalities =
            Modalities::from_names(&names).map_err(|e| invalid(format!("`modalities`: {e}")))?;
        let (audio, voice) = if modalities.audio {
            let a = r.audio.ok_or_else(|| {
                invalid("`audio` ({\"voice\", \"format\"}) is required when `modalities` includes \"audio\"",
                )
            })?;
            let name = a.format.as_deref().unwrap_or("pcm16");
            (
                Some(output_format(name, CHAT_FORMATS, "audio.format")?),
                check_voice(a.voice.as_ref(), voices)?,
            )
        } else {
            (None, None)
        };
        if r.n.is_some_and(|n| n != 1) {
            return Err(invalid("only `n` = 1 is supported"));
        }
        let stream = r.stream.unwrap_or(false);
        Ok(Self {
            spec: RequestSpec {
                input: match heard {
                    Some(audio) => RequestInput::Heard {
                        messages,
                        audio: audio.into(),
                    },
                    None => RequestInput::Chat { messages },
                },
                modalities,
                sampling,
                voice,
            },
            audio,
            stream,
            include_usage: stream
                && r.stream_options
                    .and_then(|o| o.include_usage)
                    .unwrap_or(false),
        })
    }
}

/// `temperature`, `top_p`, `max_(completion_)tokens`, `seed`, checked against
/// OpenAI's ranges.
fn chat_sampling(r: &ChatRequest) -> Result<SamplingOverrides, ApiError> {
    let mut s = SamplingOverrides::default();
    if let Some(t) = r.temperature {
        if !(0.0..=2.0).contains(&t) {
            return Err(invalid(format!(
                "`temperature` must be between 0 and 2, got {t}"
            )));
        }
        s.temperature = Some(t);
    }
    if let Some(p) = r.top_p {
        if !(0.0..=1.0).contains(&p) {
            return Err(invalid(format!("`top_p` must be between 0 and 1, got {p}")));
        }
        if p == 0.0 {
            // The smallest nucleus is the most likely token: greedy.
            s.temperature = Some(0.0);
        } else {
            s.top_p = Some(p);
        }
    }
    let (field, max) = match (r.max_completion_tokens, r.max_tokens) {
        (Some(m), _) => ("max_completion_tokens", Some(m)),
        (None, m) => ("max_tokens", m),
    };
    if let Some(m) = max {
        if m < 1 {
            return Err(invalid(format!("`{field}` must be at least 1, got {m}")));
        }
        s.max_tokens = Some(usize::try_from(m).unwrap_or(usize::MAX));
    }
    // OpenAI's seed is any 64-bit integer; the bits are the seed.
    s.seed = r.seed.map(|v| v as u64);
    if r.ignore_eos == Some(true) {
        if max.is_none() {
            return Err(invalid(
                "`ignore_eos` needs `max_tokens` (or `max_completion_tokens`): the answer would never end",
            ));
        }
        s.ignore_eos = true;
    }
    Ok(s)
}

fn to_chat_message(i: usize, m: &InMessage, store: &AudioStore) -> Result<ChatMessage, ApiError> {
    let role = match m.role.as_str() {
        "system" | "developer" => Role::System,
        "user" => Role::User,
        "assistant" => Role::Assistant,
        "tool" | "function" => {
            return Err(invalid(format!(
                "messages[{i}]: role {:?} is not supported (no tools)",
                m.role
            )))
        }
        other => {
            return Err(invalid(format!(
            "messages[{i}]: invalid role {other:?}; expected system, developer, user or assistant"
        )))
        }
    };
    let content = match (&m.content, &m.audio) {
        (Some(c), _) if !c.is_null() => content_text(i, c)?,
        (_, Some(a)) if role == Role::Assistant => store.get(&a.id).ok_or_else(|| {
            invalid(format!(
                "messages[{i}]: audio {:?} is unknown or expired",
                a.id
            ))
        })?,
        _ => return Err(invalid(format!("messages[{i}]: `content` is required"))),
    };
    Ok(ChatMessage::new(role, content))
}

/// Takes the `{"type": "input_audio", "input_audio": {"data", "format"}}` parts
/// out of a message (WAV or Ogg Opus, base64), as 16 kHz mono; only the last
/// message, a user's, may carry speech. A message left without parts has its
/// `content` removed.
fn take_input_audio(i: usize, m: &mut InMessage, last: bool) -> Result<Option<Vec<f32>>, ApiError> {
    let Some(Value::Array(parts)) = &mut m.content else {
        return Ok(None);
    };
    let is_audio = |p: &Value| p.get("type").and_then(Value::as_str) == Some("input_audio");
    let Some(j) = parts.iter().position(is_audio) else {
        return Ok(None);
    };
    if !last || m.role != "user" {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: only the last message, a user's, may carry audio"
        )));
    }
    if parts.iter().filter(|p| is_audio(p)).count() > 1 {
        return Err(invalid(format!(
            "messages[{i}]: one input_audio part per message"
        )));
    }
    let part = parts.remove(j);
    let a = part.get("input_audio");
    let data = a
        .and_then(|a| a.get("data"))
        .and_then(Value::as_str)
        .ok_or_else(|| {
            invalid(format!(
                "messages[{i}].content[{j}]: input_audio needs `data` (base64)"
            ))
        })?;
    let format = a
        .and_then(|a| a.get("format"))
        .and_then(Value::as_str)
        .unwrap_or("wav");
    if !matches!(format, "wav" | "opus" | "ogg") {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: input_audio format {format:?} is not supported (wav, opus)"
        )));
    }
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data)
        .map_err(|e| {
            invalid(format!(
                "messages[{i}].content[{j}]: input_audio data is not base64: {e}"
            ))
        })?;
    let (samples, rate) = super::listen::decode_upload(&bytes)?;
    if samples.is_empty() {
        return Err(invalid(format!(
            "messages[{i}].content[{j}]: the audio is empty"
        )));
    }
    let audio = super::audio::resample(&samples, rate)
        .map_err(|e| ApiError::bad_request(e.code, e.message))?;
    if parts.is_empty() {
        m.content = None;
    }
    Ok(Some(audio))
}

/// A message's text: a string, or an array of `{"type": "text", "text"}` parts.
fn content_text(i: usize, c: &Value) -> Result<String, ApiError> {
    match c {
        Value::String(s) => Ok(s.clone()),
        Value::Array(parts) => {
            let mut texts = Vec::with_capacity(parts.len());
            for (j, p) in parts.iter().enumerate() {
                let kind = p.get("type").and_then(Value::as_str).unwrap_or("");
                match (kind, p.get("text").and_then(Value::as_str)) {
                    ("text" | "input_text", Some(t)) => texts.push(t),
                    ("text" | "input_text", None) => {
                        return Err(invalid(format!("messages[{i}].content[{j}]: a text part needs `text`"),
                        ))
                    }
                    _ => {
                        return Err(invalid(format!(
                                "messages[{i}].content[{j}]: content part type {kind:?} is not supported (only \"text\")"
                            ),
                        ))
                    }
                }
            }
            Ok(texts.join("\n"))
        }
        _ => Err(invalid(format!(
            "messages[{i}].content must be a string or an array of text parts"
        ))),
    }
}

/// A validated speech request.
#[derive(Debug)]
struct SpeechPlan {
    spec: RequestSpec,
    format: OutputFormat,
    sse: bool,
}

impl SpeechPlan {
    fn from_request(r: SpeechRequest, voices: &[String]) -> Result<Self, ApiError> {
        if r.input.trim().is_empty() {
            return Err(invalid("`input` must not be empty"));
        }
        // The rule: speech needs a letter or a digit; punctuation and markup
        // alone would be an empty recording.
        if !r.input.chars().any(char::is_alphanumeric) {
            return Err(ApiError {
                param: Some("input"),
                ..ApiError::bad_request(
                    "nothing_to_say",
                    "`input` has no letters or digits: there is nothing to say",
                )
            });
        }
        let n = r.input.chars().count();
        if n > MAX_SPEECH_CHARS {
            return Err(invalid(format!(
                "`input` is {n} characters; the limit is {MAX_SPEECH_CHARS}"
            )));
        }
        let voice = check_voice(r.voice.as_ref(), voices)?;
        let format = output_format(
            r.response_format.as_deref().unwrap_or("wav"),
            SPEECH_FORMATS,
            "response_format",
        )?;
        let speed = match r.speed {
            Some(s) if !(0.25..=4.0).contains(&s) => {
                return Err(invalid(format!(
                    "`speed` must be between 0.25 and 4.0, got {s}"
                )))
            }
            s => s.map(|s| s as f32),
        };
        let sse = match r.stream_format.as_deref() {
            None | Some("audio") => false,
            Some("sse") => true,
            Some(other) => {
                return Err(invalid(format!(
                    "unsupported `stream_format` {other:?}; expected \"audio\" or \"sse\""
                )))
            }
        };
        Ok(Self {
            spec: RequestSpec {
                input: RequestInput::Speech { text: r.input },
                modalities: Modalities::TEXT_AUDIO,
                sampling: SamplingOverrides {
                    speed,
                    ..Default::default()
                },
                voice,
            },
            format,
            sse,
        })
    }
}

/// One of the pipeline's voices, by name or as `{"id": ...}`; none = the default.
fn check_voice(v: Option<&Value>, voices: &[String]) -> Result<Option<String>, ApiError> {
    let name = match v {
        None | Some(Value::Null) => return Ok(None),
        Some(Value::String(s)) => s.as_str(),
        Some(Value::Object(o)) => o.get("id").and_then(Value::as_str).unwrap_or(""),
        Some(other) => return Err(invalid(format!("`voice` must be a string, got {other}"))),
    };
    match voices.iter().find(|v| v.eq_ignore_ascii_case(name)) {
        Some(v) => Ok(Some(v.clone())),
        None => Err(invalid(format!(
            "unsupported voice {name:?}; available voices: {}",
            voices.join(", ")
        ))),
    }
}

fn output_format(name: &str, allowed: &[&str], field: &str) -> Result<OutputFormat, ApiError> {
    let unsupported = || {
        invalid(format!(
            "unsupported `{field}` {name:?}; supported: {}",
            allowed.join(", ")
        ))
    };
    if !allowed.contains(&name) {
        return Err(unsupported());
    }
    OutputFormat::from_name(name).map_err(invalid)
}

/// Reads the body (413 past the limit) and parses it (400 with serde's reason).
async fn read_json<T: DeserializeOwned>(req: Request) -> Result<T, ApiError> {
    // JSON or nothing said: a text/plain or form body is what a page elsewhere
    // can send without asking first (a CORS "simple request").
    let ctype = req
        .headers()
        .get(header::CONTENT_TYPE)
        .map(|v| v.to_str().unwrap_or("?").to_ascii_lowercase());
    if let Some(t) = ctype {
        let essence = t.split(';').next().unwrap_or("").trim();
        if essence != "application/json" && !essence.ends_with("+json") {
            return Err(ApiError::unsupported_media_type(format!(
                "Content-Type {essence:?}: send application/json"
            )));
        }
    }
    let bytes = read_body(req, MAX_BODY_BYTES).await?;
    serde_json::from_slice(&bytes)
        .map_err(|e| ApiError::bad_request("invalid_json", format!("invalid request body: {e}")))
}

fn invalid(message: impl Into<String>) -> ApiError {
    ApiError::bad_request("invalid_value", message)
}

fn internal(e: impl std::fmt::Display) -> ApiError {
    ApiError::internal(e.to_string())
}

// ---------------------------------------------------------------- engine

fn sample_rate(state: &AppState) -> Result<u32, ApiError> {
    state
        .pipeline
        .sample_rate()
        .ok_or_else(|| ApiError::bad_request("invalid_value", "this pipeline cannot speak"))
}

/// `submit` may wait on a full connector: off the async workers.
async fn submit(state: &Arc<AppState>, spec: RequestSpec) -> Result<RequestHandle, ApiError> {
    let st = state.clone();
    tokio::task::spawn_blocking(move || st.pipeline.submit(spec))
        .await
        .map_err(internal)?
        .map_err(|e| match e {
            EngineError::BadRequest(m) => ApiError::bad_request("invalid_value", m),
            EngineError::Closed => ApiError::overloaded("the pipeline is shut down"),
            e @ EngineError::Unavailable(_) => ApiError::stage_unavailable(e.to_string()),
            other => ApiError::internal(other.to_string()),
        })
}

/// The request's first event (for speech: the first past its own text); a
/// failure here is still an HTTP error.
async fn first_event(
    handle: &RequestHandle,
    skip_text: bool,
    phase: &mut shutdown::Watch,
) -> Result<Event, ApiError> {
    loop {
        match phase.next_event(handle).await.unwrap_or_else(ended_early) {
            Event::TextDelta(_) if skip_text => continue,
            Event::Error(e) => return Err(ApiError::failed(e)),
            ev => return Ok(ev),
        }
    }
}

fn ended_early() -> Event {
    Event::Error("the pipeline ended the request without a result".into())
}

fn error_outcome(handle: &RequestHandle) -> &'static str {
    match handle.cancel_reason() {
        CancelReason::Client | CancelReason::SlowClient => "cancelled",
        _ => "error",
    }
}

fn finish_reason(completion_tokens: usize, max_tokens: Option<usize>) -> &'static str {
    match max_tokens {
        Some(m) if completion_tokens >= m => "length",
        _ => "stop",
    }
}

// ---------------------------------------------------------------- metrics

/// An HTTP request's metrics: the same [`Meter`] as every answer's; TTFT
/// and TTFP only once a response streams.
type Tracker = Meter;

fn tracker(metrics: &Metrics, endpoint: &'static str) -> Tracker {
    let mut t = Meter::new(metrics, endpoint);
    t.streaming = false;
    t
}

/// `samples` at `rate` made by the pipeline.
fn made(t: &mut Tracker, samples: usize, rate: u32) {
    if rate > 0 {
        t.audio_made(samples as f64 / f64::from(rate));
    }
}

// ---------------------------------------------------------------- streaming

/// A request generating for a streamed response. Field order is drop order:
/// the handle (cancelling an unfinished request) before the in-flight slot.
struct Running {
    handle: RequestHandle,
    tracker: Tracker,
    /// At the server's close the request is cut with a shutdown error.
    phase: shutdown::Watch,
    _slot: InFlightGuard,
    _task: TaskGuard,
}

impl Running {
    fn new(
        state: &AppState,
        handle: RequestHandle,
        slot: InFlightGuard,
        tracker: Tracker,
        phase: shutdown::Watch,
    ) -> Self {
        Self {
            handle,
            tracker,
            phase,
            _slot: slot,
            _task: TaskGuard::new(&state.metrics),
        }
    }
}

/// What to send after one event.
enum Step {
    /// These bytes (maybe none), then the next event.
    More(Vec<u8>),
    /// These bytes, then the end of the body.
    Last(Vec<u8>),
    /// Break the body off (the status line is gone; the client sees it cut).
    Abort(String),
}

/// Turns a request's events into a response body's bytes.
trait Sink: Send + 'static {
    /// A text, audio or done event.
    fn event(&mut self, ev: Event, t: &mut Tracker) -> Step;
    /// The request failed after the response started.
    fn error(&mut self, message: &str) -> Step;
}

/// A body that pulls events as the client reads: each event's bytes go out as
/// one chunk, flushed while the body waits for the next.
fn event_body<S: Sink>(run: Running, first: Event, sink: S) -> Body {
    struct St<S> {
        run: Running,
        first: Option<Event>,
        sink: S,
        ended: bool,
    }
    let st = St {
        run,
        first: Some(first),
        sink,
        ended: false,
    };
    let stream = futures_util::stream::unfold(st, |mut st| async move {
        while !st.ended {
            let ev = match st.first.take() {
                Some(ev) => ev,
                None => {
                    let run = &mut st.run;
                    run.phase
                        .next_event(&run.handle)
                        .await
                        .unwrap_or_else(ended_early)
                }
            };
            let step = match ev {
                Event::Error(m) => {
                    let outcome = error_outcome(&st.run.handle);
                    st.run.tracker.finish(outcome);
                    st.sink.error(&m)
                }
                ev => st.sink.event(ev, &mut st.run.tracker),
            };
            let bytes = match step {
                Step::More(b) => b,
                Step::Last(b) => {
                    st.ended = true;
                    b
                }
                Step::Abort(m) => {
                    st.ended = true;
                    return Some((Err(std::io::Error::other(m)), st));
                }
            };
            if !bytes.is_empty() {
                return Some((Ok(Bytes::from(bytes)), st));
            }
        }
        None
    });
    Body::from_stream(stream)
}

fn sse_response(body: Body) -> Response {
    (
        [
            (header::CONTENT_TYPE, "text/event-stream"),
            (header::CACHE_CONTROL, "no-cache"),
            (header::HeaderName::from_static("x-accel-buffering"), "no"),
        ],
        body,
    )
        .into_response()
}

fn sse(v: &Value) -> Vec<u8> {
    format!("data: {v}\n\n").into_bytes()
}

/// A failure after the response started: the error, by its code (as before
/// the status line), and `[DONE]`, so that a client's stream ends as usual.
fn sse_error(message: &str) -> Vec<u8> {
    let mut out = sse(&ApiError::failed(message.to_string()).body());
    out.extend_from_slice(b"data: [DONE]\n\n");
    out
}

fn b64(bytes: &[u8]) -> String {
    base64::engine::general_purpose::STANDARD.encode(bytes)
}

fn audio_id() -> String {
    format!("audio_{}", uuid::Uuid::new_v4().simple())
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

/// The fields every chunk of one completion shares.
#[derive(Debug)]
struct ChunkMeta {
    id: String,
    created: u64,
    model: String,
    include_usage: bool,
}

impl ChunkMeta {
    fn new(model: &str, include_usage: bool) -> Self {
        Self {
            id: format!("chatcmpl-{}", uuid::Uuid::new_v4().simple()),
            created: unix_now(),
            model: model.to_string(),
            include_usage,
        }
    }

    fn chunk(&self, choices: Value, usage: Value) -> Vec<u8> {
        let mut v = json!({
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "system_fingerprint": null,
            "choices": choices,
        });
        if self.include_usage {
            v["usage"] = usage;
        }
        sse(&v)
    }

    fn delta(&self, delta: Value, finish_reason: Option<&str>) -> Vec<u8> {
        self.chunk(
            json!([{"index": 0, "delta": delta, "logprobs": null, "finish_reason": finish_reason}]),
            Value::Null,
        )
    }
}

struct Usage {
    prompt: usize,
    cached: usize,
    completion: usize,
}

impl Usage {
    fn new(prompt: usize, cached: usize, completion: usize) -> Self {
        Self {
            prompt,
            cached,
            completion,
        }
    }

    fn chat_json(&self) -> Value {
        json!({
            "prompt_tokens": self.prompt,
            "completion_tokens": self.completion,
            "total_tokens": self.prompt + self.completion,
            "prompt_tokens_details": {"cached_tokens": self.cached, "audio_tokens": 0},
            "completion_tokens_details": {
                "reasoning_tokens": 0,
                "audio_tokens": 0,
                "accepted_prediction_tokens": 0,
                "rejected_prediction_tokens": 0,
            },
        })
    }
}

/// A chat answer's audio: its id and the encoder into the client's format.
struct AudioOut {
    id: String,
    expires_at: u64,
    enc: AudioEncoder,
}

impl AudioOut {
    fn new(format: OutputFormat, rate: u32) -> Result<Self, ApiError> {
        Ok(Self {
            id: audio_id(),
            expires_at: unix_now() + AUDIO_TTL.as_secs(),
            enc: AudioEncoder::new(format, rate).map_err(internal)?,
        })
    }
}

/// Chat Completions streaming, as OpenAI streams it: text in `delta.content`,
/// or with audio the transcript in `delta.audio.transcript` and the audio in
/// `delta.audio.data`; then `delta.audio.expires_at`, the finish reason, the
/// usage chunk when asked for, and `[DONE]`.
struct ChatSse {
    meta: ChunkMeta,
    audio: Option<AudioOut>,
    text: String,
    started: bool,
    max_tokens: Option<usize>,
    store: Arc<AudioStore>,
}

impl ChatSse {
    fn audio_delta(&self, fields: Value) -> Value {
        let mut a = fields;
        if let Some(out) = &self.audio {
            a["id"] = json!(out.id);
        }
        json!({ "audio": a })
    }

    fn audio_bytes(&mut self, bytes: Vec<u8>, t: &mut Tracker) -> Vec<u8> {
        if bytes.is_empty() {
            return bytes;
        }
        t.audio_out(bytes.len());
        self.meta
            .delta(self.audio_delta(json!({"data": b64(&bytes)})), None)
    }

    fn done(&mut self, usage: Usage, t: &mut Tracker) -> Step {
        let mut out = Vec::new();
        let tail = match self.audio.as_mut().map(|a| a.enc.finish()) {
            Some(Ok(b)) => b,
            Some(Err(e)) => {
                t.finish("error");
                return Step::Last(sse_error(&format!("encoding audio: {e}")));
            }
            None => Vec::new(),
        };
        out.extend(self.audio_bytes(tail, t));
        if let Some(a) = &self.audio {
            self.store.put(&a.id, &self.text, a.expires_at);
            out.extend(self.meta.delta(
                json!({"audio": {"id": a.id, "expires_at": a.expires_at}}),
                None,
            ));
        }
        let finish = finish_reason(usage.completion, self.max_tokens);
        out.extend(self.meta.delta(json!({}), Some(finish)));
        if self.meta.include_usage {
            out.extend(self.meta.chunk(json!([]), usage.chat_json()));
        }
        out.extend_from_slice(b"data: [DONE]\n\n");
        t.finish("ok");
        Step::Last(out)
    }
}

impl Sink for ChatSse {
    fn event(&mut self, ev: Event, t: &mut Tracker) -> Step {
        let mut out = Vec::new();
        if !self.started {
            self.started = true;
            let mut d = json!({"role": "assistant", "content": "", "refusal": null});
            if self.audio.is_some() {
                d["content"] = Value::Null;
            }
            out.extend(self.meta.delta(d, None));
        }
        match ev {
            Event::TextDelta(s) => {
                t.text_out();
                self.text.push_str(&s);
                let d = if self.audio.is_some() {
                    self.audio_delta(json!({ "transcript": s }))
                } else {
                    json!({ "content": s })
                };
                out.extend(self.meta.delta(d, None));
            }
            Event::Audio {
                samples,
                sample_rate,
                ..
            } => {
                made(t, samples.len(), sample_rate);
                let pushed = match self.audio.as_mut() {
                    Some(a) => a.enc.push(&samples),
                    None => Ok(Vec::new()),
                };
                match pushed {
                    Ok(bytes) => out.extend(self.audio_bytes(bytes, t)),
                    Err(e) => {
                        t.finish("error");
                        out.extend(sse_error(&format!("encoding audio: {e}")));
                        return Step::Last(out);
                    }
                }
            }
            Event::Done {
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                let usage = Usage::new(prompt_tokens, cached_tokens, completion_tokens);
                match self.done(usage, t) {
                    Step::Last(rest) => out.extend(rest),
                    other => return other,
                }
                return Step::Last(out);
            }
            Event::Error(m) => return self.error(&m),
        }
        Step::More(out)
    }

    fn error(&mut self, message: &str) -> Step {
        Step::Last(sse_error(message))
    }
}

/// `/v1/audio/speech` with `stream_format: "audio"`: the file's bytes as the
/// encoder makes them.
struct SpeechRaw {
    enc: AudioEncoder,
}

impl Sink for SpeechRaw {
    fn event(&mut self, ev: Event, t: &mut Tracker) -> Step {
        let r = match ev {
            Event::Audio {
                samples,
                sample_rate,
                ..
            } => {
                made(t, samples.len(), sample_rate);
                self.enc.push(&samples).map(Step::More)
            }
            Event::Done { .. } => self.enc.finish().map(|b| {
                t.finish("ok");
                Step::Last(b)
            }),
            Event::TextDelta(_) => Ok(Step::More(Vec::new())),
            Event::Error(m) => return self.error(&m),
        };
        match r {
            Ok(step) => {
                if let Step::More(b) | Step::Last(b) = &step {
                    t.audio_out(b.len());
                }
                step
            }
            Err(e) => {
                t.finish("error");
                Step::Abort(format!("encoding audio: {e}"))
            }
        }
    }

    fn error(&mut self, message: &str) -> Step {
        Step::Abort(message.to_string())
    }
}

/// `/v1/audio/speech` with `stream_format: "sse"`: `speech.audio.delta`
/// events, then `speech.audio.done` with the usage.
struct SpeechSse {
    enc: AudioEncoder,
}

impl SpeechSse {
    fn delta(bytes: &[u8], t: &mut Tracker) -> Vec<u8> {
        if bytes.is_empty() {
            return Vec::new();
        }
        t.audio_out(bytes.len());
        sse(&json!({"type": "speech.audio.delta", "audio": b64(bytes)}))
    }
}

impl Sink for SpeechSse {
    fn event(&mut self, ev: Event, t: &mut Tracker) -> Step {
        match ev {
            Event::Audio {
                samples,
                sample_rate,
                ..
            } => {
                made(t, samples.len(), sample_rate);
                match self.enc.push(&samples) {
                    Ok(b) => Step::More(Self::delta(&b, t)),
                    Err(e) => {
                        t.finish("error");
                        Step::Last(sse_error(&format!("encoding audio: {e}")))
                    }
                }
            }
            Event::Done {
                prompt_tokens,
                completion_tokens,
                ..
            } => {
                let mut out = match self.enc.finish() {
                    Ok(b) => Self::delta(&b, t),
                    Err(e) => {
                        t.finish("error");
                        return Step::Last(sse_error(&format!("encoding audio: {e}")));
                    }
                };
                out.extend(sse(&json!({
                    "type": "speech.audio.done",
                    "usage": {
                        "input_tokens": prompt_tokens,
                        "output_tokens": completion_tokens,
                        "total_tokens": prompt_tokens + completion_tokens,
                    },
                })));
                t.finish("ok");
                Step::Last(out)
            }
            Event::TextDelta(_) => Step::More(Vec::new()),
            Event::Error(m) => self.error(&m),
        }
    }

    fn error(&mut self, message: &str) -> Step {
        Step::Last(sse_error(message))
    }
}

// ---------------------------------------------------------------- audio ids

/// Transcripts of recent spoken answers by audio id, so that a later turn can
/// send `{"role": "assistant", "audio": {"id": ...}}` as OpenAI allows.
#[derive(Default)]
struct AudioStore {
    inner: Mutex<StoreInner>,
}

#[derive(Default)]
struct StoreInner {
    by_id: HashMap<String, (String, u64)>,
    order: VecDeque<String>,
}

impl AudioStore {
    fn put(&self, id: &str, transcript: &str, expires_at: u64) {
        let mut s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        while s.order.len() >= AUDIO_STORE_CAP {
            if let Some(old) = s.order.pop_front() {
                s.by_id.remove(&old);
            }
        }
        s.order.push_back(id.to_string());
        s.by_id
            .insert(id.to_string(), (transcript.to_string(), expires_at));
    }

    fn get(&self, id: &str) -> Option<String> {
        let s = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        s.by_id
            .get(id)
            .filter(|(_, exp)| *exp > unix_now())
            .map(|(t, _)| t.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use omnistream_stages::roles::PIPER_VOICE_NAME;

    fn chat_req(v: Value) -> Result<ChatPlan, ApiError> {
        let r: ChatRequest = serde_json::from_value(v).map_err(|e| invalid(e.to_string()))?;
        ChatPlan::from_request(r, &AudioStore::default(), &[PIPER_VOICE_NAME.to_string()])
    }

    fn msgs() -> Value {
        json!([{"role": "user", "content": "hi"}])
    }

    #[test]
    fn chat_requests_are_validated() {
        let ok = chat_req(json!({"model": "x", "messages": msgs(), "unknown_field": 1})).unwrap();
        assert!(!ok.spec.modalities.audio && !ok.stream);
        for bad in [
            json!({"messages": []}),
            json!({"messages": [{"role": "wizard", "content": "x"}]}),
            json!({"messages": [{"role": "tool", "content": "x"}]}),
            json!({"messages": [{"role": "user"}]}),
            json!({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}),
            json!({"messages": msgs(), "temperature": 2.5}),
            json!({"messages": msgs(), "top_p": 1.5}),
            json!({"messages": msgs(), "max_tokens": -1}),
            json!({"messages": msgs(), "max_completion_tokens": 0}),
            json!({"messages": msgs(), "n": 2}),
            json!({"messages": msgs(), "modalities": ["text", "video"]}),
            json!({"messages": msgs(), "modalities": ["text", "audio"]}),
            json!({"messages": msgs(), "modalities": ["text", "audio"], "audio": {"voice": "joe", "format": "mp3"}}),
            json!({"messages": msgs(), "modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}),
        ] {
            let e = chat_req(bad.clone()).expect_err(&bad.to_string());
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{bad}");
        }
        let e = chat_req(json!({"messages": msgs(), "modalities": ["audio"], "audio": {"voice": "alloy", "format": "wav"}}))
            .unwrap_err();
        assert!(e.message.contains("joe"), "{}", e.message);
    }

    #[test]
    fn chat_fields_reach_the_spec() {
        let p = chat_req(json!({
            "messages": [
                {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": "c"},
                {"role": "user", "content": "d"},
            ],
            "modalities": ["text", "audio"],
            "audio": {"voice": {"id": "joe"}, "format": "opus"},
            "stream": true,
            "stream_options": {"include_usage": true},
            "temperature": 0.5, "top_p": 0.9, "max_tokens": 99, "max_completion_tokens": 7, "seed": -1,
        }))
        .unwrap();
        let RequestInput::Chat { messages } = &p.spec.input else {
            panic!("not a chat")
        };
        let got: Vec<_> = messages
            .iter()
            .map(|m| (m.role.as_str(), m.content.as_str()))
            .collect();
        assert_eq!(
            got,
            [
                ("system", "Be brief."),
                ("user", "a\nb"),
                ("assistant", "c"),
                ("user", "d")
            ]
        );
        assert!(p.spec.modalities.audio && p.stream && p.include_usage);
        assert_eq!(p.spec.voice.as_deref(), Some("joe"));
        assert_eq!(p.spec.sampling.max_tokens, Some(7));
        assert_eq!(p.spec.sampling.temperature, Some(0.5));
        assert_eq!(p.spec.sampling.top_p, Some(0.9));
        assert_eq!(p.spec.sampling.seed, Some(u64::MAX));
    }

    #[test]
    fn earlier_audio_answers_stand_in_for_their_transcript() {
        let store = AudioStore::default();
        store.put("audio_1", "Paris.", unix_now() + 60);
        store.put("audio_old", "gone", unix_now().saturating_sub(1));
        let m = |id: &str| InMessage {
            role: "assistant".into(),
            content: None,
            audio: Some(AudioRef { id: id.into() }),
        };
        assert_eq!(
            to_chat_message(0, &m("audio_1"), &store).unwrap().content,
            "Paris."
        );
        assert!(to_chat_message(0, &m("audio_old"), &store).is_err());
        assert!(to_chat_message(0, &m("audio_nope"), &store).is_err());
    }

    #[test]
    fn speech_requests_are_validated() {
        let plan = |v: Value| {
            let r: SpeechRequest = serde_json::from_value(v).map_err(|e| invalid(e.to_string()))?;
            SpeechPlan::from_request(r, &[PIPER_VOICE_NAME.to_string()])
        };
        let p = plan(json!({"model": "tts-1", "input": "Hello.", "voice": "joe", "speed": 1.5, "stream_format": "sse"})).unwrap();
        assert!(p.sse);
        assert_eq!(p.spec.sampling.speed, Some(1.5));
        assert!(plan(json!({"input": "Hello."})).is_ok());
        for bad in [
            json!({"input": ""}),
            json!({"input": "x".repeat(MAX_SPEECH_CHARS + 1)}),
            json!({"input": "Hi", "voice": "alloy"}),
            json!({"input": "Hi", "response_format": "mp3"}),
            json!({"input": "Hi", "response_format": "pcm16"}),
            json!({"input": "Hi", "speed": 4.5}),
            json!({"input": "Hi", "speed": 0.1}),
            json!({"input": "Hi", "stream_format": "ws"}),
            json!({"voice": "joe"}),
        ] {
            assert!(plan(bad.clone()).is_err(), "{bad}");
        }
    }

    #[test]
    fn finish_reason_reports_the_token_limit() {
        assert_eq!(finish_reason(10, Some(10)), "length");
        assert_eq!(finish_reason(3, Some(10)), "stop");
        assert_eq!(finish_reason(3, None), "stop");
    }
}
