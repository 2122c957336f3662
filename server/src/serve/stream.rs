//! `GET /v1/stream`: a plain WebSocket for PCM clients (see `docs/stream.md`).
//!
//! JSON text frames carry control (`start`, `text`, `cancel` in; `started`,
//! `transcript`, `audio_start`, `done`, `error` out); binary frames carry
//! PCM16 LE mono both ways, at the rate the client chose in `start`. Output
//! frames have no header: their order is the audio's order.

use std::sync::Arc;
use std::time::Duration;

use axum::extract::ws::{close_code, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};
use tokio::sync::watch;

use omnistream_stages::engine::{Modalities, RequestInput, RequestSpec};
use omnistream_stages::models::gguf_tokenizer::ChatMessage;

use super::metrics::TaskGuard;
use super::realtime::conn::{self, Active, ClientError, End, Generation, Outbox, Step};
use super::sessions::SessionGuard;
use super::state::AppState;

/// Sample rates a client may choose for both directions.
pub const SAMPLE_RATES: [u32; 4] = [8_000, 16_000, 24_000, 48_000];
/// Input audio kept per session until voice input lands.
const MAX_INPUT_AUDIO_SECONDS: usize = 60;
/// Longest user turn, in characters.
const MAX_TEXT_CHARS: usize = 4096;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/stream", get(upgrade))
}

async fn upgrade(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ws: WebSocketUpgrade,
) -> Response {
    conn::accept(
        state,
        &headers,
        ws,
        "stream",
        &["omnistream.stream", "realtime"],
        serve,
    )
}

fn msg(body: Value) -> Message {
    Message::Text(body.to_string().into())
}

fn error_msg(e: &ClientError) -> Message {
    msg(json!({"type": "error", "code": e.code, "message": e.message}))
}

#[derive(Deserialize)]
struct Start {
    sample_rate: u32,
    voice: Option<String>,
    instructions: Option<String>,
}

#[derive(Deserialize)]
struct Text {
    text: String,
}

struct PcmStream {
    state: Arc<AppState>,
    out: Outbox,
    session: SessionGuard,
    /// Chosen in `start`; nothing else is accepted before.
    rate: Option<u32>,
    input_audio: Vec<u8>,
    active: Option<Active>,
}

async fn serve(state: Arc<AppState>, socket: WebSocket, session: SessionGuard) {
    let _task = TaskGuard::new(&state.metrics);
    let _conn = conn::ConnGauge::new(&state.metrics, "stream");
    let (sink, mut stream) = socket.split();
    let out = Outbox::start(sink, &state.metrics, error_msg(&ClientError::slow_client()));
    let mut s = PcmStream {
        state,
        out: out.clone(),
        session,
        rate: None,
        input_audio: Vec::new(),
        active: None,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            _ = out.closed() => break,
            _ = tick.tick() => {
                let busy = s.active.as_ref().is_some_and(Active::running);
                if !conn::keep_alive(&s.state, &s.session.id, busy) {
                    out.close(Some(error_msg(&ClientError::expired())), close_code::POLICY);
                    break;
                }
            }
            m = stream.next() => match m {
                None | Some(Ok(Message::Close(_))) => break,
                Some(Err(e)) => {
                    if let Some(err) = conn::read_error(&e) {
                        out.close(Some(error_msg(&err)), close_code::SIZE);
                    }
                    break;
                }
                Some(Ok(Message::Text(t))) => {
                    if let Err(e) = s.on_text(&t).await {
                        s.send(error_msg(&e)).await;
                    }
                }
                Some(Ok(Message::Binary(b))) => {
                    if let Err(e) = s.on_audio(&b) {
                        s.send(error_msg(&e)).await;
                    }
                }
                Some(Ok(Message::Pong(p))) => out.pong(&p),
                Some(Ok(Message::Ping(_))) => {}
            }
        }
    }
    if let Some(a) = s.active.take() {
        let _ = a.cancel.send(true);
    }
    out.close(None, close_code::NORMAL);
}

fn fields<T: serde::de::DeserializeOwned>(v: Value, kind: &str) -> Result<T, ClientError> {
    serde_json::from_value(v)
        .map_err(|e| ClientError::invalid("invalid_event", format!("{kind}: {e}")))
}

impl PcmStream {
    async fn send(&self, m: Message) {
        let _ = self.out.send(m).await;
    }

    fn not_started() -> ClientError {
        ClientError::invalid(
            "not_started",
            "send {\"type\":\"start\",\"sample_rate\":...} first",
        )
    }

    async fn on_text(&mut self, text: &str) -> Result<(), ClientError> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            ClientError::invalid(
                "invalid_json",
                format!("the message is not valid JSON: {e}"),
            )
        })?;
        let kind = v
            .get("type")
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or_else(|| {
                ClientError::invalid("missing_type", "the message has no string \"type\"")
            })?;
        if self.state.sessions.with(&self.session.id, |_| ()).is_none() {
            self.out
                .close(Some(error_msg(&ClientError::expired())), close_code::POLICY);
            return Ok(());
        }
        match kind.as_str() {
            "start" => self.start(fields(v, "start")?).await,
            "text" => self.text(fields(v, "text")?).await,
            "cancel" => self.cancel(),
            other => Err(ClientError::invalid(
                "unknown_event_type",
                format!("unknown message type {other:?}: use start, text or cancel"),
            )),
        }
    }

    async fn start(&mut self, s: Start) -> Result<(), ClientError> {
        if self.rate.is_some() {
            return Err(ClientError::invalid(
                "already_started",
                "the stream is already started; open a new connection for another rate",
            ));
        }
        if !SAMPLE_RATES.contains(&s.sample_rate) {
            return Err(ClientError::invalid(
                "unsupported_sample_rate",
                format!(
                    "sample_rate {} is not supported: use one of {SAMPLE_RATES:?}",
                    s.sample_rate
                ),
            ));
        }
        if let Some(v) = s.voice.as_deref().filter(|v| *v != "joe") {
            return Err(ClientError::invalid(
                "unsupported_voice",
                format!("voice {v:?} is not available; the only voice is \"joe\""),
            ));
        }
        self.state.sessions.with(&self.session.id, |sess| {
            sess.voice = s.voice.clone();
            sess.instructions = s.instructions.clone().filter(|i| !i.trim().is_empty());
            sess.input_format = format!("pcm16@{}", s.sample_rate);
            sess.output_format = format!("pcm16@{}", s.sample_rate);
        });
        self.rate = Some(s.sample_rate);
        self.send(msg(json!({
            "type": "started", "session_id": self.session.id,
            "sample_rate": s.sample_rate, "voice": "joe",
        })))
        .await;
        Ok(())
    }

    async fn text(&mut self, t: Text) -> Result<(), ClientError> {
        let rate = self.rate.ok_or_else(Self::not_started)?;
        if t.text.trim().is_empty() {
            return Err(ClientError::invalid("empty_text", "the text is empty"));
        }
        if t.text.chars().count() > MAX_TEXT_CHARS {
            return Err(ClientError::invalid(
                "text_too_long",
                format!("a turn is at most {MAX_TEXT_CHARS} characters"),
            ));
        }
        if let Some(a) = self.active.as_ref().filter(|a| a.running()) {
            return Err(ClientError::invalid(
                "response_in_progress",
                format!(
                    "response {} is still playing: wait for done or cancel it",
                    a.id
                ),
            ));
        }
        let user = ChatMessage::new("user", t.text);
        let (messages, sampling, voice) = self
            .state
            .sessions
            .with(&self.session.id, |s| {
                let mut history = s.history.clone();
                history.push(user.clone());
                (
                    conn::prompt(s.instructions.as_deref(), &history),
                    s.sampling.clone(),
                    s.voice.clone(),
                )
            })
            .ok_or_else(ClientError::expired)?;
        let spec = RequestSpec {
            input: RequestInput::Chat { messages },
            modalities: Modalities::TEXT_AUDIO,
            sampling,
            voice,
        };
        let (cancel, cancel_rx) = watch::channel(false);
        let gen = Generation::start(
            &self.state,
            &self.out,
            "stream",
            spec,
            Some(rate),
            cancel_rx,
        )?;
        let id = conn::new_id("resp");
        self.state.sessions.with(&self.session.id, |s| {
            conn::remember(s, user);
            s.in_flight = Some(id.clone());
        });
        self.active = Some(Active {
            id: id.clone(),
            cancel,
        });
        let job = Job {
            state: self.state.clone(),
            out: self.out.clone(),
            session_id: self.session.id.clone(),
            id,
            rate,
            gen,
        };
        tokio::spawn(job.run());
        Ok(())
    }

    fn cancel(&mut self) -> Result<(), ClientError> {
        match self.active.as_ref().filter(|a| a.running()) {
            Some(a) => {
                let _ = a.cancel.send(true);
                Ok(())
            }
            None => Err(ClientError::invalid(
                "no_active_response",
                "there is no response to cancel",
            )),
        }
    }

    fn on_audio(&mut self, pcm: &[u8]) -> Result<(), ClientError> {
        let rate = self.rate.ok_or_else(Self::not_started)? as usize;
        if pcm.len() % 2 == 1 {
            return Err(ClientError::invalid(
                "invalid_audio",
                "binary frames are PCM16 LE: an even number of bytes",
            ));
        }
        let cap = rate * 2 * MAX_INPUT_AUDIO_SECONDS;
        if self.input_audio.len() + pcm.len() > cap {
            return Err(ClientError::invalid(
                "input_audio_buffer_full",
                format!(
                    "input audio is kept for voice input (a later issue), at most {MAX_INPUT_AUDIO_SECONDS} s; this frame was dropped"
                ),
            ));
        }
        self.input_audio.extend_from_slice(pcm);
        Ok(())
    }
}

/// One spoken answer, in its own task.
struct Job {
    state: Arc<AppState>,
    out: Outbox,
    session_id: String,
    id: String,
    rate: u32,
    gen: Generation,
}

impl Job {
    async fn run(mut self) {
        let _task = TaskGuard::new(&self.state.metrics);
        let end = self.stream().await;
        let text = self.gen.text().to_string();
        self.state.sessions.with(&self.session_id, |s| {
            if !text.trim().is_empty() {
                conn::remember(s, ChatMessage::new("assistant", text));
            }
            if s.in_flight.as_deref() == Some(self.id.as_str()) {
                s.in_flight = None;
            }
        });
        let Some(end) = end else {
            return;
        };
        let status = match end {
            End::Completed(_) => "completed",
            End::Cancelled => "cancelled",
            End::SlowClient => {
                self.out.close_slow(error_msg(&ClientError::slow_client()));
                return;
            }
            End::Failed(e) => {
                let e = ClientError::server("generation_failed", e);
                if self.out.send(error_msg(&e)).await.is_err() {
                    return;
                }
                "failed"
            }
        };
        let _ = self
            .out
            .send(msg(json!({
                "type": "done", "response_id": self.id, "status": status,
                "audio_seconds": self.gen.audio_seconds(),
            })))
            .await;
    }

    async fn stream(&mut self) -> Option<End> {
        let start = msg(json!({
            "type": "audio_start", "response_id": self.id, "sample_rate": self.rate,
        }));
        if self.out.send(start).await.is_err() {
            self.gen.abandon();
            return None;
        }
        loop {
            let m = match self.gen.next().await {
                Step::Text(t) => {
                    msg(json!({"type": "transcript", "response_id": self.id, "text": t}))
                }
                Step::Audio(pcm) => Message::Binary(pcm.into()),
                Step::End(end) => return Some(end),
            };
            if self.out.send(m).await.is_err() {
                self.gen.abandon();
                return None;
            }
            self.gen.sent_audio();
        }
    }
}
