//! `GET /v1/stream`: a plain WebSocket for PCM clients (see `docs/stream.md`).
//!
//! JSON text frames carry control (`start`, `text`, `cancel`, `audio_end` in;
//! `started`, `transcript`, `audio_start`, `done`, `audio_received`,
//! `input_transcript`, `speech_started`/`speech_stopped`, `output_cleared`,
//! `truncated`, `error` out); binary frames carry audio both ways: PCM16 LE
//! mono at the rate the client chose in `start`, or with `"format":"opus"`
//! Ogg Opus (one stream per input utterance, one per answer). Output frames
//! have no header: their order is the audio's order. With `turn_detection`
//! (`server_vad`) the server finds the user's turns itself and a user who
//! talks over an answer interrupts it, as on `/v1/realtime`.
//!
//! This file is a codec between those frames and the conversation
//! (`serve::conversation`), which decides.

use std::sync::Arc;

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_codecs::ogg_opus::OPUS_RATE;
use omnistream_codecs::pcm::f32_to_pcm16_le;
use omnistream_codecs::{CodecError, OggOpusDecoder};

use crate::serve::audio::OutputFormat;
use crate::serve::auth;
use crate::serve::conn::{self, Outbox, Overflow};
use crate::serve::conversation::{
    deaf, Conversation, End, Input, Output, Respond, Settings, TurnSettings,
    MAX_INPUT_AUDIO_SECONDS,
};
use crate::serve::driver::{self, Action, Incoming, Transport};
use crate::serve::error::ClientError;
use crate::serve::sessions::SessionGuard;
use crate::serve::state::AppState;
use crate::serve::voice_store::owner_of;

/// Sample rates a client may choose for both directions.
pub const SAMPLE_RATES: [u32; 4] = [8_000, 16_000, 24_000, 48_000];
/// Longest user turn, in characters.
const MAX_TEXT_CHARS: usize = 4096;
/// Ogg Opus input is decoded this many bytes at a time, the buffer's cap
/// checked in between: a few bytes of Opus can stand for 120 ms of audio, so a
/// whole message decoded at once could outgrow memory before any check.
const OPUS_DECODE_SLICE: usize = 512;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/stream", get(upgrade))
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
        "stream",
        &["omnistream.stream", "realtime"],
        move |state, socket, session| serve(state, socket, session, owner),
    )
}

fn msg(body: Value) -> Message {
    Message::Text(body.to_string().into())
}

fn error_msg(e: &ClientError) -> Message {
    let mut m = json!({"type": "error", "code": e.code, "message": e.message});
    if let Some(p) = e.param {
        m["param"] = p.into();
    }
    msg(m)
}

/// How audio travels both ways, chosen in `start`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
enum Format {
    /// Headerless PCM16 LE mono at `sample_rate`.
    #[default]
    Pcm16,
    /// Ogg Opus, 48 kHz: the client sends one Ogg stream per utterance and
    /// gets one per answer.
    Opus,
}

impl Format {
    fn name(self) -> &'static str {
        match self {
            Self::Pcm16 => "pcm16",
            Self::Opus => "opus",
        }
    }
}

#[derive(Deserialize)]
struct Start {
    #[serde(default)]
    format: Format,
    sample_rate: Option<u32>,
    voice: Option<String>,
    instructions: Option<String>,
    /// `{"type":"server_vad", ...}` (the Realtime API's knobs) or null.
    #[serde(default)]
    turn_detection: Value,
}

#[derive(Deserialize)]
struct Text {
    text: String,
}

/// The stream protocol's codec.
pub struct PcmStream {
    state: Arc<AppState>,
    session_id: String,
    /// Chosen in `start`; nothing else is accepted before.
    rate: Option<u32>,
    format: Format,
    /// The Ogg Opus input stream being received, until `audio_end`.
    opus_in: Option<OggOpusDecoder>,
    /// Whose cloned voices it may speak in (a hash of its API key).
    owner: String,
}

async fn serve(state: Arc<AppState>, socket: WebSocket, session: SessionGuard, owner: String) {
    let _conn = conn::ConnGauge::new(&state.metrics, "stream");
    let (sink, stream) = socket.split();
    let out = Outbox::start(sink, &state.metrics, error_msg(&ClientError::slow_client()));
    let codec = PcmStream::new(state.clone(), session.id.clone()).with_owner(owner);
    driver::run(
        state,
        codec,
        out,
        driver::websocket_inbound(stream),
        session,
        None,
    )
    .await;
}

fn fields<T: serde::de::DeserializeOwned>(v: Value, kind: &str) -> Result<T, ClientError> {
    serde_json::from_value(v)
        .map_err(|e| ClientError::invalid("invalid_event", format!("{kind}: {e}")))
}

fn audio(input: Vec<u8>) -> Action {
    Action::Input {
        event_id: None,
        input: Input::Audio(input),
    }
}

/// Another answer asked for while one plays.
fn busy(id: &str) -> ClientError {
    ClientError::invalid(
        "response_in_progress",
        format!("response {id} is still playing: wait for done or cancel it"),
    )
}

impl PcmStream {
    /// A stream's codec, waiting for its `start`.
    pub fn new(state: Arc<AppState>, session_id: String) -> Self {
        Self {
            state,
            session_id,
            rate: None,
            format: Format::Pcm16,
            opus_in: None,
            owner: String::new(),
        }
    }

    /// The session may speak `owner`'s cloned voices.
    pub fn with_owner(mut self, owner: String) -> Self {
        self.owner = owner;
        self
    }

    fn not_started() -> ClientError {
        ClientError::invalid(
            "not_started",
            "send {\"type\":\"start\",\"sample_rate\":...} first",
        )
    }

    fn on_text(&mut self, text: &str, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
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
        match kind.as_str() {
            "start" => self.start(fields(v, "start")?, conv),
            "text" => self.text(fields(v, "text")?),
            "cancel" => match conv.answering() {
                Some(_) => Ok(vec![Action::Input {
                    event_id: None,
                    input: Input::Cancel { response_id: None },
                }]),
                None => Err(ClientError::invalid(
                    "no_active_response",
                    "there is no response to cancel",
                )),
            },
            "audio_end" => self.audio_end(),
            other => Err(ClientError::invalid(
                "unknown_event_type",
                format!("unknown message type {other:?}: use start, text, cancel or audio_end"),
            )),
        }
    }

    fn start(&mut self, s: Start, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        if self.rate.is_some() {
            return Err(ClientError::invalid(
                "already_started",
                "the stream is already started; open a new connection for another rate",
            ));
        }
        let rate = match (s.format, s.sample_rate) {
            (Format::Pcm16, Some(r)) if SAMPLE_RATES.contains(&r) => r,
            (Format::Pcm16, Some(r)) => {
                return Err(ClientError::invalid(
                    "unsupported_sample_rate",
                    format!("sample_rate {r} is not supported: use one of {SAMPLE_RATES:?}"),
                ))
            }
            (Format::Pcm16, None) => {
                return Err(ClientError::invalid(
                    "invalid_event",
                    format!("start: pcm16 needs a sample_rate, one of {SAMPLE_RATES:?}"),
                ))
            }
            // Ogg Opus carries its own timing and always decodes at 48 kHz.
            (Format::Opus, None | Some(OPUS_RATE)) => OPUS_RATE,
            (Format::Opus, Some(r)) => {
                return Err(ClientError::invalid(
                    "unsupported_sample_rate",
                    format!("sample_rate {r} does not apply to opus, which is 48000 both ways: leave it out"),
                ))
            }
        };
        let voice = match s.voice.as_deref() {
            Some(v) => Some(
                self.state
                    .check_voice(&self.owner, v)
                    .map_err(|m| ClientError::invalid("unsupported_voice", m))?,
            ),
            None => None,
        };
        let hub = self.state.config.vad.as_ref().map(|h| h.min_speech_ms);
        let turns = TurnSettings::parse(&s.turn_detection, hub, "turn_detection")?;
        if turns.is_some() && !conv.caps().hears() {
            return Err(deaf());
        }
        let mut settings = Settings::new(
            rate,
            match s.format {
                Format::Pcm16 => OutputFormat::Pcm16 { rate },
                Format::Opus => OutputFormat::OggOpus,
            },
        );
        settings.voice = voice.clone();
        settings.instructions = s.instructions.filter(|i| !i.trim().is_empty());
        settings.turns = turns;
        // With turn detection the detector holds the utterance under way.
        settings.buffer_with_vad = false;
        let turn_detection = settings.turns.as_ref().map(TurnSettings::to_json);
        self.rate = Some(rate);
        self.format = s.format;
        let started = msg(json!({
            "type": "started", "session_id": self.session_id,
            "format": s.format.name(), "sample_rate": rate,
            "voice": voice.as_deref().unwrap_or(self.state.default_voice()),
            "turn_detection": turn_detection,
        }));
        Ok(vec![
            Action::Input {
                event_id: None,
                input: Input::Configure(settings),
            },
            Action::Send(started),
        ])
    }

    fn text(&mut self, t: Text) -> Result<Vec<Action>, ClientError> {
        self.rate.ok_or_else(Self::not_started)?;
        if t.text.trim().is_empty() {
            return Err(ClientError::invalid("empty_text", "the text is empty"));
        }
        if t.text.chars().count() > MAX_TEXT_CHARS {
            return Err(ClientError::invalid(
                "text_too_long",
                format!("a turn is at most {MAX_TEXT_CHARS} characters"),
            ));
        }
        let mut r = Respond::auto(busy);
        r.user_text = Some(t.text);
        Ok(vec![Action::Input {
            event_id: None,
            input: Input::Respond(r),
        }])
    }

    /// The end of the client's utterance: closes an Ogg Opus stream (an
    /// error if it was cut short); the conversation takes the turn.
    fn audio_end(&mut self) -> Result<Vec<Action>, ClientError> {
        self.rate.ok_or_else(Self::not_started)?;
        let mut actions = Vec::new();
        // A stream that failed earlier was reported then; only a cut is news.
        if let Some(Err(e @ CodecError::Truncated(_))) = self.opus_in.take().map(|mut d| d.finish())
        {
            let e = ClientError::invalid(
                "truncated_audio",
                format!("the Ogg Opus input stream was cut short ({e}); the audio decoded before the cut is kept"),
            );
            actions.push(Action::Send(error_msg(&e)));
        }
        actions.push(Action::EndOfAudio);
        Ok(actions)
    }

    fn on_audio(&mut self, bytes: &[u8], conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        self.rate.ok_or_else(Self::not_started)?;
        let vad = conv.settings().turns.is_some();
        match self.format {
            Format::Pcm16 => {
                if bytes.len() % 2 == 1 {
                    return Err(ClientError::invalid(
                        "invalid_audio",
                        "binary frames are PCM16 LE: an even number of bytes",
                    ));
                }
                if vad && bytes.len() > conv.settings().input_cap() {
                    return Err(message_too_long());
                }
                if !vad && bytes.len() > conv.input_room() {
                    return Err(buffer_full("this frame was dropped"));
                }
                Ok(vec![audio(bytes.to_vec())])
            }
            Format::Opus => self.on_opus(bytes, vad, conv),
        }
    }

    /// Decodes the next bytes of the Ogg Opus input stream (split anywhere).
    /// A malformed stream is reported once; its later bytes are refused
    /// until `audio_end` starts a new stream. Audio decoded before the fault
    /// is kept.
    fn on_opus(
        &mut self,
        bytes: &[u8],
        vad: bool,
        conv: &Conversation,
    ) -> Result<Vec<Action>, ClientError> {
        let cap = conv.settings().input_cap();
        let mut room = conv.input_room();
        let mut decoded = 0;
        let mut actions = Vec::new();
        for slice in bytes.chunks(OPUS_DECODE_SLICE) {
            let pcm = match self.decode_opus(slice) {
                Ok(p) => p,
                Err(e) => {
                    actions.push(Action::Send(error_msg(&e)));
                    return Ok(actions);
                }
            };
            if vad {
                decoded += pcm.len();
                if decoded > cap {
                    actions.push(Action::Send(error_msg(&message_too_long())));
                    return Ok(actions);
                }
                actions.push(audio(pcm));
                continue;
            }
            if pcm.len() > room {
                actions.push(audio(pcm[..room - room % 2].to_vec()));
                actions.push(Action::Send(error_msg(&buffer_full(
                    "the audio past it was dropped",
                ))));
                return Ok(actions);
            }
            room -= pcm.len();
            actions.push(audio(pcm));
        }
        Ok(actions)
    }

    /// PCM16 LE of the next bytes of the Ogg Opus input stream.
    fn decode_opus(&mut self, bytes: &[u8]) -> Result<Vec<u8>, ClientError> {
        let dec = self.opus_in.get_or_insert_with(OggOpusDecoder::new);
        if dec.is_finished() {
            return Err(ClientError::invalid(
                "input_stream_ended",
                "this Ogg Opus stream already ended (end-of-stream page): send {\"type\":\"audio_end\"} before the next stream",
            ));
        }
        let samples = dec.push(bytes).map_err(|e| {
            ClientError::invalid(
                "invalid_audio",
                format!("the Ogg Opus input is not valid ({e}); the audio decoded before it is kept, send {{\"type\":\"audio_end\"}} to start a new stream"),
            )
        })?;
        Ok(f32_to_pcm16_le(&samples))
    }
}

fn message_too_long() -> ClientError {
    ClientError::invalid(
        "input_audio_buffer_full",
        format!("a message carries at most {MAX_INPUT_AUDIO_SECONDS} s of audio; the rest of it was dropped"),
    )
}

fn buffer_full(what: &str) -> ClientError {
    ClientError::invalid(
        "input_audio_buffer_full",
        format!("an utterance is at most {MAX_INPUT_AUDIO_SECONDS} s (send {{\"type\":\"audio_end\"}} to end it); {what}"),
    )
}

impl Transport for PcmStream {
    fn endpoint(&self) -> &'static str {
        "stream"
    }

    fn voice_owner(&self) -> &str {
        &self.owner
    }

    fn settings(&self) -> Settings {
        Settings::new(24_000, OutputFormat::Pcm16 { rate: 24_000 })
    }

    fn opening(&mut self, _conv: &Conversation) -> Vec<Message> {
        Vec::new()
    }

    fn message(&mut self, m: Incoming<'_>, conv: &Conversation) -> Vec<Action> {
        let r = match m {
            Incoming::Text(t) => self.on_text(t, conv),
            Incoming::Binary(b) => self.on_audio(b, conv),
        };
        r.unwrap_or_else(|e| vec![Action::Send(error_msg(&e))])
    }

    fn output(&mut self, o: Output, _conv: &Conversation) -> Result<Vec<Message>, Overflow> {
        let m = match o {
            Output::Error { error, .. } => error_msg(&error),
            Output::SpeechStarted { audio_start_ms, .. } => msg(json!({
                "type": "speech_started", "audio_start_ms": audio_start_ms,
            })),
            Output::SpeechStopped {
                audio_end_ms,
                seconds,
                ..
            } => msg(json!({
                "type": "speech_stopped", "audio_end_ms": audio_end_ms,
                "seconds": seconds,
            })),
            Output::AudioReceived { seconds } => {
                msg(json!({"type": "audio_received", "seconds": seconds}))
            }
            // The stream offers no tools: no calls, no tool items.
            Output::InputCleared
            | Output::Committed { .. }
            | Output::ItemAdded { .. }
            | Output::ToolItemAdded { .. }
            | Output::AnswerToolCall { .. }
            | Output::ItemRetrieved(_)
            | Output::ItemDeleted { .. } => return Ok(Vec::new()),
            Output::Transcribed { result, .. } => match result {
                Ok(text) => msg(json!({"type": "input_transcript", "text": text})),
                Err(e) => error_msg(&e),
            },
            Output::AnswerStarted(a) => msg(json!({
                "type": "audio_start", "response_id": a.response_id,
                "format": self.format.name(), "sample_rate": self.rate,
            })),
            Output::AnswerText { answer, delta } => msg(json!({
                "type": "transcript", "response_id": answer.response_id, "text": delta,
            })),
            Output::AnswerAudio { bytes, .. } => Message::Binary(bytes.into()),
            Output::AnswerDone {
                answer,
                end,
                audio_seconds,
                ..
            } => {
                let mut frames = Vec::new();
                let status = match end {
                    End::Completed(_) => "completed",
                    End::Cancelled | End::SlowClient => "cancelled",
                    End::Failed(e) => {
                        frames.push(error_msg(&ClientError::failed(e)));
                        "failed"
                    }
                };
                frames.push(msg(json!({
                    "type": "done", "response_id": answer.response_id, "status": status,
                    "audio_seconds": audio_seconds,
                })));
                return Ok(frames);
            }
            Output::Truncated {
                response_id,
                audio_end_ms,
                text,
                ..
            } => msg(json!({
                "type": "truncated", "response_id": response_id,
                "audio_end_ms": audio_end_ms, "text": text,
            })),
            Output::PlaybackCleared { response_id } => msg(json!({
                "type": "output_cleared", "response_id": response_id,
            })),
            Output::TimeoutTriggered { audio_end_ms, .. } => msg(json!({
                "type": "timeout_triggered", "audio_end_ms": audio_end_ms,
            })),
        };
        Ok(vec![m])
    }

    fn error(&self, e: &ClientError) -> Message {
        error_msg(e)
    }
}
