//! `GET /v1/audio/speech/stream` (WebSocket): text in as it is written (an
//! LLM's deltas), speech out as soon as the Talker can say it, utterance after
//! utterance on one socket. See `docs/api.md`.
//!
//! Client messages (JSON text frames):
//! - `{"type": "session.update", "session": {"voice", "instructions", "language"}}`:
//!   how the next utterances are spoken (checked as `/v1/audio/speech` checks them);
//! - `{"type": "input.text.delta", "delta": "..."}`: text of the open
//!   utterance, which the first delta opens;
//! - `{"type": "input.done"}`: the open utterance's text is complete (the
//!   socket stays open for the next);
//! - `{"type": "input.cancel"}`: drops every utterance not yet fully spoken.
//!
//! Server messages: `session.created` / `session.updated` (`session`),
//! `speech.started` (`utterance_id`), `speech.audio.delta` (`utterance_id`,
//! `audio`: base64 PCM16 LE mono at 24 kHz), `speech.audio.done`
//! (`utterance_id`, `usage`), `speech.cancelled`, and `error` (`error`: `type`,
//! `code`, `message`, `param`). Utterances are spoken in order: a later one
//! runs in the pipeline while an earlier one plays, and its audio follows.
//!
//! [`Protocol`] decides (fed client messages, it returns what to do); [`serve`]
//! does it over the socket and the pipeline.

use std::collections::VecDeque;
use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_stages::engine::{RequestSpec, TextFeed, MAX_SPEECH_CHARS};

use crate::serve::answer::{Answer, Meter, Step};
use crate::serve::audio::OutputFormat;
use crate::serve::auth;
use crate::serve::conn::{self, Outbox};
use crate::serve::conversation::End;
use crate::serve::driver::{websocket_inbound, Inbound};
use crate::serve::error::{ApiError, ClientError};
use crate::serve::sessions::SessionGuard;
use crate::serve::state::AppState;
use crate::serve::transport::http::{cloned_voice_id, speech_session};
use crate::serve::voice_store::owner_of;

/// Utterances a socket may have in flight (open, queued or playing).
pub const MAX_UTTERANCES: usize = 8;
const EP: &str = "audio_speech_stream";
const RATE: u32 = 24_000;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/audio/speech/stream", get(upgrade))
}

async fn upgrade(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    // Whose cloned voices the session may speak in.
    let owner = owner_of(auth::presented_key(&state, &headers));
    conn::accept(
        state,
        &headers,
        ws,
        "speech_stream",
        &["omnistream.speech"],
        move |state, socket, session| serve(state, socket, session, owner),
    )
}

/// How an utterance is spoken.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct SessionUpdate {
    #[serde(default)]
    voice: Option<Value>,
    #[serde(default)]
    instructions: Option<String>,
    #[serde(default)]
    language: Option<String>,
}

/// What [`Protocol`] asks for.
#[derive(Debug)]
pub enum Do {
    Send(Value),
    /// Opens utterance `id`, spoken with `spec`, its text fed as it comes.
    Open {
        id: String,
        spec: Box<RequestSpec>,
    },
    Push {
        id: String,
        text: String,
    },
    Close {
        id: String,
    },
    /// Drops utterance `id`.
    Cancel {
        id: String,
    },
    /// Drops every utterance not yet fully spoken.
    CancelAll,
}

/// The protocol's decisions, without sockets: fed each client message.
pub struct Protocol {
    state: Arc<AppState>,
    /// The caller's voice-store owner (a hash of its API key).
    owner: String,
    session: SessionUpdate,
    voice: Option<String>,
    style: omnistream_stages::engine::SpeechStyle,
    /// The utterance taking text, with the characters it has.
    open: Option<(String, usize)>,
    /// Utterances opened and not yet done (the caller reports them done).
    live: usize,
    next: u64,
}

fn error(e: &ApiError) -> Value {
    let mut err = json!({"type": e.kind, "code": e.code, "message": e.message});
    if let Some(p) = e.param {
        err["param"] = p.into();
    }
    json!({"type": "error", "error": err})
}

fn invalid(code: &'static str, message: impl Into<String>) -> Value {
    error(&ApiError::bad_request(code, message))
}

impl Protocol {
    pub fn new(state: Arc<AppState>, owner: String) -> Self {
        Self {
            state,
            owner,
            session: SessionUpdate::default(),
            voice: None,
            style: Default::default(),
            open: None,
            live: 0,
            next: 0,
        }
    }

    fn session_json(&self) -> Value {
        json!({
            "voice": self.voice.clone().unwrap_or_else(|| self.state.default_voice().to_string()),
            "instructions": self.session.instructions,
            "language": self.style.language.clone().unwrap_or_else(|| "auto".into()),
            "output_audio_format": {"type": "audio/pcm", "rate": RATE},
        })
    }

    pub fn created(&self) -> Value {
        json!({"type": "session.created", "session": self.session_json()})
    }

    /// An utterance finished (spoken, cancelled or failed).
    pub fn utterance_ended(&mut self) {
        self.live = self.live.saturating_sub(1);
    }

    pub fn on_text(&mut self, text: &str) -> Vec<Do> {
        let v: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                return vec![Do::Send(invalid(
                    "invalid_json",
                    format!("the message is not valid JSON: {e}"),
                ))]
            }
        };
        match v.get("type").and_then(Value::as_str) {
            Some("session.update") => self.update(v.get("session").cloned().unwrap_or(Value::Null)),
            Some("input.text.delta") => match v.get("delta").and_then(Value::as_str) {
                Some(d) => self.delta(d),
                None => vec![Do::Send(error(&ApiError {
                    param: Some("delta"),
                    ..ApiError::bad_request("invalid_event", "`input.text.delta` needs a string `delta`")
                }))],
            },
            Some("input.done") => match self.open.take() {
                Some((id, _)) => vec![Do::Close { id }],
                None => vec![Do::Send(invalid(
                    "no_open_utterance",
                    "`input.done` with no text since the last one",
                ))],
            },
            Some("input.cancel") => {
                self.open = None;
                self.live = 0;
                vec![Do::CancelAll]
            }
            Some(other) => vec![Do::Send(invalid(
                "unknown_event",
                format!("unknown event type {other:?}: use session.update, input.text.delta, input.done, input.cancel"),
            ))],
            None => vec![Do::Send(invalid("invalid_event", "the message has no `type`"))],
        }
    }

    fn update(&mut self, session: Value) -> Vec<Do> {
        let next: SessionUpdate = match serde_json::from_value(session) {
            Ok(s) => s,
            Err(e) => {
                return vec![Do::Send(invalid(
                    "invalid_event",
                    format!("session.update: {e}"),
                ))]
            }
        };
        let st = &self.state;
        let cloned = cloned_voice_id(next.voice.as_ref());
        let session = speech_session(
            // A cloned voice stands for the named one.
            next.voice.as_ref().filter(|_| cloned.is_none()),
            next.instructions.clone(),
            next.language.clone(),
            &st.voices,
            st.pipeline.languages(),
        )
        .and_then(|(voice, mut style)| {
            let Some(id) = cloned else {
                return Ok((voice, style));
            };
            let Some(v) = st.cloned_voice(&self.owner, id) else {
                return Err(ApiError {
                    param: Some("voice"),
                    ..ApiError::bad_request("voice_not_found", format!("no cloned voice {id:?}"))
                });
            };
            style.speaker_embedding = Some(v.embedding);
            style.reference = v.reference;
            Ok((Some(id.to_string()), style))
        });
        match session {
            Ok((voice, style)) => {
                self.session = next;
                self.voice = voice;
                self.style = style;
                vec![Do::Send(
                    json!({"type": "session.updated", "session": self.session_json()}),
                )]
            }
            Err(e) => vec![Do::Send(error(&e))],
        }
    }

    fn delta(&mut self, delta: &str) -> Vec<Do> {
        let n = delta.chars().count();
        let too_long = |id: Option<&str>| {
            let what = id.map_or("it".to_string(), |i| format!("{i} is dropped"));
            Do::Send(error(&ApiError {
                param: Some("delta"),
                ..ApiError::bad_request(
                    "input_too_long",
                    format!("an utterance is limited to {MAX_SPEECH_CHARS} characters: {what}"),
                )
            }))
        };
        let mut out = Vec::new();
        match &mut self.open {
            Some((id, chars)) => {
                *chars += n;
                if *chars > MAX_SPEECH_CHARS {
                    let id = id.clone();
                    self.open = None;
                    self.live = self.live.saturating_sub(1);
                    return vec![too_long(Some(&id)), Do::Cancel { id }];
                }
            }
            None => {
                if n > MAX_SPEECH_CHARS {
                    return vec![too_long(None)];
                }
                if self.live >= MAX_UTTERANCES {
                    return vec![Do::Send(invalid(
                        "too_many_utterances",
                        format!("at most {MAX_UTTERANCES} utterances in flight: wait for speech.audio.done"),
                    ))];
                }
                self.next += 1;
                let id = format!("utt_{}", self.next);
                let mut spec = crate::run::speech_spec("", self.voice.clone(), None);
                spec.style = self.style.clone();
                self.open = Some((id.clone(), n));
                self.live += 1;
                out.push(Do::Open {
                    id: id.clone(),
                    spec: Box::new(spec),
                });
                out.push(Do::Send(
                    json!({"type": "speech.started", "utterance_id": id}),
                ));
            }
        }
        if let (Some((id, _)), false) = (&self.open, delta.is_empty()) {
            out.push(Do::Push {
                id: id.clone(),
                text: delta.to_string(),
            });
        }
        out
    }
}

/// An utterance in the pipeline.
struct Utterance {
    id: String,
    answer: Answer,
    feed: Option<TextFeed>,
}

/// The session: client messages through [`Protocol`], each utterance's audio
/// in order to the client.
async fn serve(state: Arc<AppState>, socket: WebSocket, _session: SessionGuard, owner: String) {
    let _conn = conn::ConnGauge::new(&state.metrics, "speech_stream");
    let (sink, stream) = socket.split();
    let slow = ClientError::slow_client();
    let out = Outbox::start(
        sink,
        &state.metrics,
        Message::Text(
            json!({"type": "error", "error": {"type": slow.kind, "code": slow.code, "message": slow.message}})
                .to_string()
                .into(),
        ),
    );
    let mut inbound = websocket_inbound(stream);
    let mut proto = Protocol::new(state.clone(), owner);
    let send = |v: Value| out.push(Message::Text(v.to_string().into()));
    if send(proto.created()).is_err() {
        return;
    }
    let mut queue: VecDeque<Utterance> = VecDeque::new();
    loop {
        let front = queue.front_mut();
        tokio::select! {
            msg = inbound.next() => {
                let text = match msg {
                    Some(Inbound::Text(t)) => t,
                    Some(Inbound::Binary(_)) => {
                        let _ = send(invalid("binary_not_accepted", "send text as JSON text frames"));
                        continue;
                    }
                    Some(Inbound::Pong(p)) => {
                        out.pong(&p);
                        continue;
                    }
                    // No keypad on a WebSocket.
                    Some(Inbound::Key(_)) => continue,
                    Some(Inbound::Broken(e, code)) => {
                        let m = json!({"type": "error", "error": {"type": e.kind, "code": e.code, "message": e.message}});
                        out.close(Some(Message::Text(m.to_string().into())), code);
                        break;
                    }
                    Some(Inbound::Closed) | None => {
                        // Answer the client's close, so it need not wait for ours.
                        out.close(None, axum::extract::ws::close_code::NORMAL);
                        break;
                    }
                };
                for d in proto.on_text(&text) {
                    if apply(&state, &mut queue, d, &send).await.is_err() {
                        return;
                    }
                }
            }
            step = next_step(front) => {
                let Some(u) = queue.front_mut() else { continue };
                match step {
                    Step::Audio(bytes) => {
                        let b64 = base64::engine::general_purpose::STANDARD.encode(&bytes);
                        let ev = json!({"type": "speech.audio.delta", "utterance_id": u.id, "audio": b64});
                        if send(ev).is_err() {
                            break;
                        }
                        u.answer.sent_audio(bytes.len());
                    }
                    Step::Text(_) | Step::ToolCall(_) => {}
                    Step::End(end) => {
                        let ev = match &end {
                            End::Completed(usage) => json!({
                                "type": "speech.audio.done", "utterance_id": u.id,
                                "usage": {"input_tokens": usage.prompt_tokens, "output_tokens": usage.completion_tokens},
                            }),
                            End::Cancelled => json!({"type": "speech.cancelled", "utterance_id": u.id}),
                            End::SlowClient | End::Failed(_) => {
                                let e = ClientError::failed(match &end {
                                    End::Failed(m) => m.clone(),
                                    _ => "the client did not read in time".into(),
                                });
                                json!({"type": "error", "utterance_id": u.id,
                                       "error": {"type": e.kind, "code": e.code, "message": e.message}})
                            }
                        };
                        queue.pop_front();
                        proto.utterance_ended();
                        if send(ev).is_err() {
                            break;
                        }
                    }
                }
            }
        }
    }
    for mut u in queue {
        u.answer.abandon();
    }
    let _ = tokio::time::timeout(conn::GOODBYE, out.closed()).await;
}

/// The next step of the utterance playing, or never when none is.
async fn next_step(u: Option<&mut Utterance>) -> Step {
    match u {
        Some(u) => u.answer.next().await,
        None => std::future::pending().await,
    }
}

/// Does what the protocol asked; `Err` when the client is gone.
async fn apply(
    state: &Arc<AppState>,
    queue: &mut VecDeque<Utterance>,
    d: Do,
    send: &impl Fn(Value) -> Result<(), conn::Gone>,
) -> Result<(), conn::Gone> {
    match d {
        Do::Send(v) => send(v),
        Do::Open { id, spec } => {
            let mut meter = Meter::new(&state.metrics, EP);
            meter.streaming = true;
            let format = Some(OutputFormat::Pcm16 { rate: RATE });
            match Answer::start_text_stream(state, meter, *spec, format).await {
                Ok((answer, feed)) => {
                    queue.push_back(Utterance {
                        id,
                        answer,
                        feed: Some(feed),
                    });
                    Ok(())
                }
                Err(e) => {
                    let e = e.to_api();
                    let mut v = error(&e);
                    v["utterance_id"] = id.into();
                    send(v)
                }
            }
        }
        Do::Push { id, text } => {
            let Some(feed) = queue
                .iter()
                .find(|u| u.id == id)
                .and_then(|u| u.feed.clone())
            else {
                return Ok(());
            };
            let r = tokio::task::spawn_blocking(move || feed.push(&text)).await;
            match r {
                Ok(Ok(())) => Ok(()),
                // The utterance already ended (failed, cancelled): its end says why.
                Ok(Err(_)) | Err(_) => Ok(()),
            }
        }
        Do::Close { id } => {
            if let Some(u) = queue.iter_mut().find(|u| u.id == id) {
                if let Some(feed) = u.feed.take() {
                    let _ = tokio::task::spawn_blocking(move || feed.finish()).await;
                }
            }
            Ok(())
        }
        Do::Cancel { id } => {
            if let Some(i) = queue.iter().position(|u| u.id == id) {
                if let Some(mut u) = queue.remove(i) {
                    u.answer.abandon();
                }
                send(json!({"type": "speech.cancelled", "utterance_id": id}))?;
            }
            Ok(())
        }
        Do::CancelAll => {
            for mut u in queue.drain(..) {
                u.answer.abandon();
                send(json!({"type": "speech.cancelled", "utterance_id": u.id}))?;
            }
            Ok(())
        }
    }
}
