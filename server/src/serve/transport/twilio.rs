//! `GET /v1/phone/twilio`: phone calls over Twilio Media Streams (see
//! `docs/phone.md`). A bidirectional `<Connect><Stream>` opens this
//! WebSocket; every frame is JSON text with an `event`:
//!
//! - in: `connected`, `start` (stream and call ids, the media format, the
//!   `<Parameter>`s), `media` (base64 8 kHz μ-law, 20 ms a frame), `mark`
//!   (audio we sent has played up to it), `dtmf` (a key the caller
//!   pressed), `stop` (the call or the stream ended);
//! - out: `media` (the answer, 8 kHz μ-law, 200 ms a frame), a `mark` after
//!   each (its name says where in the stream's audio it stands, so its echo
//!   tells how much of the answer the caller heard), `clear` (the caller
//!   spoke over the answer: Twilio drops what it has buffered).
//!
//! The caller's turns are found by server VAD and the caller interrupts an
//! answer by speaking, as on `/v1/realtime`. The protocol has no error
//! event: a refused frame is logged and counted in
//! `omnistream_phone_errors_total{code}`; what ends the stream (no or a
//! wrong API key, a media format other than 8 kHz G.711) closes it with a
//! close frame whose reason says why.
//!
//! Twilio cannot set headers on the WebSocket, so with API keys configured
//! the key comes as the `api_key` `<Parameter>` of the `start` event (an
//! `Authorization: Bearer` header is taken too, for other carriers and
//! proxies). Until `start` is accepted nothing else is: a connection that
//! does not start within [`START_WITHIN`] is closed.
//!
//! This file is a codec between those frames and the conversation
//! (`serve::conversation`), which decides.

use std::collections::HashMap;
use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::extract::ws::rejection::WebSocketUpgradeRejection;
use axum::extract::ws::{close_code, CloseFrame, Message, WebSocket, WebSocketUpgrade};
use axum::extract::State;
use axum::http::HeaderMap;
use axum::response::Response;
use axum::routing::get;
use axum::Router;
use base64::Engine as _;
use futures_util::StreamExt;
use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_codecs::g711::Law;

use crate::serve::audio::OutputFormat;
use crate::serve::auth;
use crate::serve::conn::{self, Outbox, Overflow};
use crate::serve::conversation::{
    self, deaf, Conversation, End, Input, Output, Settings, TurnSettings,
};
use crate::serve::driver::{self, Action, Incoming, Transport};
use crate::serve::error::ClientError;
use crate::serve::sessions::SessionGuard;
use crate::serve::state::AppState;
use crate::serve::voice_store::owner_of;

/// G.711 on the phone network: 8 kHz both ways.
pub const PHONE_RATE: u32 = 8_000;
/// A connection must send an accepted `start` this soon after it opened.
pub const START_WITHIN: Duration = Duration::from_secs(10);
/// Answer audio goes out in frames of this many samples (200 ms), each
/// followed by a mark: the marks' echoes say what the caller heard to
/// within one frame.
const FRAME_SAMPLES: usize = 1_600;
/// The longest playout lead a call may ask for.
const MAX_LEAD_MS: u64 = 5_000;
/// The longest `instructions` `<Parameter>`, in characters.
const MAX_INSTRUCTIONS_CHARS: usize = 16_384;

pub fn routes() -> Router<Arc<AppState>> {
    Router::new().route("/v1/phone/twilio", get(upgrade))
}

async fn upgrade(
    State(state): State<Arc<AppState>>,
    headers: HeaderMap,
    ws: Result<WebSocketUpgrade, WebSocketUpgradeRejection>,
) -> Response {
    // The key may still come in `start`: decided there.
    let key_in_header = auth::authorized(&state, &headers);
    let owner = owner_of(auth::presented_key(&state, &headers));
    conn::accept(state, &headers, ws, "twilio", &[], move |s, w, g| {
        serve(s, w, g, key_in_header, owner)
    })
}

async fn serve(
    state: Arc<AppState>,
    socket: WebSocket,
    session: SessionGuard,
    keyed: bool,
    owner: String,
) {
    let _conn = conn::ConnGauge::new(&state.metrics, "twilio");
    let (sink, stream) = socket.split();
    let codec = MediaStream::new(state.clone(), keyed, Instant::now()).with_owner(owner);
    let out = Outbox::start(
        sink,
        &state.metrics,
        close_frame(&ClientError::slow_client()),
    );
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

/// The companding law a `start` event's `mediaFormat.encoding` names.
fn law_of(encoding: &str) -> Option<Law> {
    match encoding.to_ascii_lowercase().as_str() {
        "audio/x-mulaw" | "audio/pcmu" | "pcmu" => Some(Law::Ulaw),
        "audio/x-alaw" | "audio/pcma" | "pcma" => Some(Law::Alaw),
        _ => None,
    }
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct StartMeta {
    stream_sid: String,
    #[serde(default)]
    call_sid: String,
    #[serde(default)]
    tracks: Vec<String>,
    /// `<Parameter name=… value=…>`s of the `<Stream>`.
    #[serde(default)]
    custom_parameters: HashMap<String, Value>,
    media_format: MediaFormat,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct MediaFormat {
    encoding: String,
    sample_rate: u32,
    channels: u32,
}

#[derive(Deserialize)]
struct Media {
    /// `inbound` (the caller); absent in some carriers' frames.
    #[serde(default)]
    track: Option<String>,
    payload: String,
}

#[derive(Deserialize)]
struct Mark {
    name: String,
}

#[derive(Deserialize)]
struct Dtmf {
    digit: String,
}

/// The stream after an accepted `start`.
struct Started {
    stream_sid: String,
    call_sid: String,
    law: Law,
}

/// Where the answer audio stands, in samples since the stream began.
#[derive(Debug, Default)]
struct Played {
    /// Handed to the carrier.
    sent: u64,
    /// Played to the caller: the newest mark echoed (never past `sent`).
    heard: u64,
    /// A mark came back at least once: the peer reports its playback.
    echoes: bool,
    /// The answer whose audio was cleared: what it still makes is dropped.
    cleared: Option<String>,
}

impl Played {
    /// `samples` more of `response_id` go out: the name of the mark after them.
    fn send(&mut self, response_id: &str, samples: usize) -> String {
        self.sent += samples as u64;
        format!("{response_id}:{}", self.sent)
    }

    /// A mark came back. Ours are `{response_id}:{samples}`; another name
    /// (a client's own) says nothing.
    fn echo(&mut self, name: &str) {
        let Some(at) = name
            .rsplit_once(':')
            .and_then(|(_, n)| n.parse::<u64>().ok())
        else {
            return;
        };
        self.echoes = true;
        self.heard = self.heard.max(at.min(self.sent));
    }

    /// Audio sent and not yet played, in samples. A peer that never echoed
    /// a mark is taken to play as it receives.
    fn queued(&self) -> u64 {
        if self.echoes {
            self.sent - self.heard
        } else {
            0
        }
    }

    /// The carrier dropped what it had buffered.
    fn clear(&mut self) {
        self.heard = self.sent;
    }
}

/// Each answer's audio is held this long after its first arrived before any
/// goes out: the carrier plays what it gets at once, and the pipeline
/// delivers an answer in bursts (see `PlayoutLead`).
pub const PLAYOUT_LEAD: Duration = Duration::from_millis(1000);

/// A jitter buffer at the start of each answer: its audio is held until
/// `lead` after the first of it arrived (or until it ended), then passes
/// through. Without it a carrier that plays as it receives runs dry between
/// the answer's first span and the next (docs/bench/phone.md). Time is an
/// input.
#[derive(Debug)]
struct PlayoutLead {
    lead: Duration,
    /// The answer being held: until when, and its audio so far.
    held: Option<(String, Instant, Vec<u8>)>,
    /// The answer whose hold ended: its audio passes through.
    open: Option<String>,
}

impl PlayoutLead {
    fn new(lead: Duration) -> Self {
        Self {
            lead,
            held: None,
            open: None,
        }
    }

    /// Audio of `response_id` arrived at `now`: what may go out now.
    fn push(&mut self, response_id: &str, bytes: &[u8], now: Instant) -> Vec<u8> {
        if self.open.as_deref() == Some(response_id) {
            return bytes.to_vec();
        }
        match &mut self.held {
            Some((r, _, buf)) if r == response_id => buf.extend_from_slice(bytes),
            _ if self.lead.is_zero() => {
                self.open = Some(response_id.to_string());
                return bytes.to_vec();
            }
            _ => self.held = Some((response_id.to_string(), now + self.lead, bytes.to_vec())),
        }
        self.release(now).map(|(_, b)| b).unwrap_or_default()
    }

    /// When the held audio is due.
    fn due(&self) -> Option<Instant> {
        self.held.as_ref().map(|(_, t, _)| *t)
    }

    /// The held answer's audio, once due at `now`; it passes through after.
    fn release(&mut self, now: Instant) -> Option<(String, Vec<u8>)> {
        if self.due().is_some_and(|t| t <= now) {
            let (r, _, buf) = self.held.take()?;
            self.open = Some(r.clone());
            return Some((r, buf));
        }
        None
    }

    /// `response_id` ended: whatever of it is held goes out now.
    fn finish(&mut self, response_id: &str) -> Vec<u8> {
        match self.held.take() {
            Some((r, _, buf)) if r == response_id => buf,
            other => {
                self.held = other;
                Vec::new()
            }
        }
    }

    /// The caller interrupted: nothing held is played.
    fn drop_held(&mut self) {
        self.held = None;
    }
}

/// The Media Streams protocol's codec.
pub struct MediaStream {
    state: Arc<AppState>,
    /// The handshake carried an accepted key (or none is needed).
    keyed: bool,
    /// Whose cloned voices the call may speak in: the handshake's key, or
    /// the `api_key` `<Parameter>`'s.
    owner: String,
    opened: Instant,
    started: Option<Started>,
    /// `stop` came: the call is over, later frames are ignored.
    stopped: bool,
    played: Played,
    lead: PlayoutLead,
}

fn param<'a>(p: &'a HashMap<String, Value>, name: &str) -> Option<&'a str> {
    p.get(name).and_then(Value::as_str).map(str::trim)
}

/// A numeric `<Parameter>` (Twilio sends every value as a string).
fn number<T: std::str::FromStr>(
    p: &HashMap<String, Value>,
    name: &'static str,
) -> Result<Option<T>, ClientError> {
    let Some(v) = p.get(name) else {
        return Ok(None);
    };
    let s = match v {
        Value::String(s) => s.trim().to_string(),
        other => other.to_string(),
    };
    s.parse().map(Some).map_err(|_| {
        ClientError::param(
            name,
            format!("the {name} parameter is not a valid number: {s:?}"),
        )
    })
}

/// The fields of a frame's `event`-named object.
fn fields<T: serde::de::DeserializeOwned>(v: &Value, kind: &str) -> Result<T, ClientError> {
    serde_json::from_value(v.get(kind).cloned().unwrap_or(Value::Null))
        .map_err(|e| ClientError::invalid("invalid_event", format!("{kind}: {e}")))
}

impl MediaStream {
    pub fn new(state: Arc<AppState>, keyed: bool, opened: Instant) -> Self {
        Self {
            state,
            keyed,
            owner: String::new(),
            opened,
            started: None,
            stopped: false,
            played: Played::default(),
            lead: PlayoutLead::new(PLAYOUT_LEAD),
        }
    }

    /// The handshake's key owns the call's voices (unless `start` names one).
    pub fn with_owner(mut self, owner: String) -> Self {
        self.owner = owner;
        self
    }

    fn on_text(&mut self, text: &str, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        let v: Value = serde_json::from_str(text).map_err(|e| {
            ClientError::invalid("invalid_json", format!("the frame is not valid JSON: {e}"))
        })?;
        let kind = v
            .get("event")
            .and_then(Value::as_str)
            .ok_or_else(|| ClientError::invalid("missing_event", "the frame has no \"event\""))?
            .to_owned();
        if self.stopped {
            return Ok(Vec::new());
        }
        if self.started.is_none() && !matches!(kind.as_str(), "connected" | "start") {
            return Err(ClientError::invalid(
                "not_started",
                format!("{kind:?} before \"start\": dropped"),
            ));
        }
        match kind.as_str() {
            "connected" => Ok(Vec::new()),
            "start" => self.start(fields(&v, "start")?, conv),
            "media" => self.media(fields(&v, "media")?, conv),
            "mark" => {
                self.played.echo(&fields::<Mark>(&v, "mark")?.name);
                Ok(Vec::new())
            }
            "dtmf" => self.dtmf(&fields::<Dtmf>(&v, "dtmf")?.digit, conv),
            "stop" => {
                self.stopped = true;
                Ok(Vec::new())
            }
            other => Err(ClientError::invalid(
                "unknown_event_type",
                format!("unknown event {other:?}"),
            )),
        }
    }

    /// Checks the key, the format and the parameters; the conversation
    /// starts with server VAD.
    fn start(&mut self, s: StartMeta, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        if self.started.is_some() {
            return Err(ClientError::invalid(
                "already_started",
                "the stream already started: a second start is ignored",
            ));
        }
        let p = &s.custom_parameters;
        let key = param(p, "api_key").filter(|k| auth::key_accepted(&self.state, k));
        if let Some(k) = key {
            self.owner = owner_of(Some(k));
        }
        if !self.keyed && key.is_none() {
            return Ok(fatal(ClientError {
                kind: "authentication_error",
                ..ClientError::invalid(
                    "invalid_api_key",
                    "a valid API key is needed: <Parameter name=\"api_key\" value=\"...\"/> in the <Stream>",
                )
                .at("customParameters.api_key")
            }));
        }
        let law = law_of(&s.media_format.encoding);
        let (Some(law), PHONE_RATE, 1) = (law, s.media_format.sample_rate, s.media_format.channels)
        else {
            return Ok(fatal(ClientError::invalid(
                "unsupported_media_format",
                format!(
                    "unsupported media format {} at {} Hz, {} channels: use audio/x-mulaw (or audio/x-alaw) at 8000 Hz, mono",
                    s.media_format.encoding, s.media_format.sample_rate, s.media_format.channels
                ),
            )
            .at("mediaFormat")));
        };
        if s.stream_sid.trim().is_empty() {
            return Ok(fatal(ClientError::param(
                "streamSid",
                "start has an empty streamSid",
            )));
        }
        if !s.tracks.is_empty() && !s.tracks.iter().any(|t| t.starts_with("inbound")) {
            return Ok(fatal(
                ClientError::invalid(
                    "unsupported_tracks",
                    "the stream carries no inbound track: use a bidirectional <Connect><Stream>",
                )
                .at("tracks"),
            ));
        }
        let lead = match number::<u64>(p, "playout_lead_ms") {
            Ok(None) => PLAYOUT_LEAD,
            Ok(Some(ms)) if ms <= MAX_LEAD_MS => Duration::from_millis(ms),
            Ok(Some(_)) => {
                return Ok(fatal(ClientError::param(
                    "playout_lead_ms",
                    format!("playout_lead_ms is at most {MAX_LEAD_MS}"),
                )))
            }
            Err(e) => return Ok(fatal(e)),
        };
        match self.settings_from(p, conv) {
            Ok(settings) => {
                self.lead = PlayoutLead::new(lead);
                tracing::info!(
                    stream = %s.stream_sid, call = %s.call_sid,
                    "phone call started ({law:?}, 8 kHz)"
                );
                self.started = Some(Started {
                    stream_sid: s.stream_sid,
                    call_sid: s.call_sid,
                    law,
                });
                Ok(vec![Action::Input {
                    event_id: None,
                    input: Input::Configure(settings),
                }])
            }
            Err(e) => Ok(fatal(e)),
        }
    }

    /// The conversation's settings from the `<Parameter>`s: `voice`,
    /// `instructions`, `max_output_tokens`, `temperature`, and the server
    /// VAD's `threshold`, `prefix_padding_ms`, `silence_duration_ms`,
    /// `idle_timeout_ms`.
    fn settings_from(
        &self,
        p: &HashMap<String, Value>,
        conv: &Conversation,
    ) -> Result<Settings, ClientError> {
        if !conv.caps().hears() {
            return Err(deaf());
        }
        let mut vad = json!({"type": "server_vad"});
        if let Some(t) = number::<f32>(p, "threshold")? {
            vad["threshold"] = t.into();
        }
        if let Some(ms) = number::<u32>(p, "prefix_padding_ms")? {
            vad["prefix_padding_ms"] = ms.into();
        }
        if let Some(ms) = number::<u32>(p, "silence_duration_ms")? {
            vad["silence_duration_ms"] = ms.into();
        }
        if let Some(ms) = number::<u64>(p, "idle_timeout_ms")? {
            vad["idle_timeout_ms"] = ms.into();
        }
        let hub = self.state.config.vad.as_ref().map(|h| h.min_speech_ms);
        let turns = TurnSettings::parse(&vad, hub, "customParameters")?;
        let mut settings = self.settings();
        settings.turns = turns;
        settings.buffer_with_vad = false;
        if let Some(v) = param(p, "voice").filter(|v| !v.is_empty()) {
            settings.voice = Some(
                self.state
                    .check_voice(&self.owner, v)
                    .map_err(|m| ClientError::invalid("unsupported_voice", m).at("voice"))?,
            );
        }
        if let Some(n) = number::<usize>(p, "max_output_tokens")? {
            if n == 0 {
                return Err(ClientError::param(
                    "max_output_tokens",
                    "max_output_tokens must be at least 1",
                ));
            }
            settings.sampling.max_tokens = Some(n);
        }
        if let Some(t) = number::<f64>(p, "temperature")? {
            if !(0.0..=2.0).contains(&t) {
                return Err(ClientError::param(
                    "temperature",
                    "temperature must be between 0 and 2",
                ));
            }
            settings.sampling.temperature = Some(t);
        }
        if let Some(i) = param(p, "instructions").filter(|i| !i.is_empty()) {
            if i.chars().count() > MAX_INSTRUCTIONS_CHARS {
                return Err(ClientError::param(
                    "instructions",
                    format!("instructions are at most {MAX_INSTRUCTIONS_CHARS} characters"),
                ));
            }
            settings.instructions = Some(i.to_string());
        }
        Ok(settings)
    }

    fn media(&mut self, m: Media, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        if m.track
            .as_deref()
            .is_some_and(|t| !t.starts_with("inbound"))
        {
            return Ok(Vec::new()); // our own audio, echoed by a "both tracks" stream
        }
        let Some(s) = &self.started else {
            return Err(ClientError::invalid("not_started", "media before start"));
        };
        let codes = base64::engine::general_purpose::STANDARD
            .decode(m.payload.trim())
            .map_err(|e| {
                ClientError::invalid(
                    "invalid_base64",
                    format!("a media payload is not valid base64 ({e}): dropped"),
                )
            })?;
        let pcm = s.law.decode_le(&codes);
        if pcm.len() > conv.settings().input_cap() {
            return Err(ClientError::invalid(
                "input_audio_buffer_full",
                "a media frame carries more than a minute of audio: dropped",
            ));
        }
        Ok(vec![Action::Input {
            event_id: None,
            input: Input::Audio(pcm),
        }])
    }

    /// A key pressed: the caller's turn, answered at once; while an answer
    /// runs, remembered for the next one.
    fn dtmf(&mut self, digit: &str, conv: &Conversation) -> Result<Vec<Action>, ClientError> {
        let ok = digit.len() == 1
            && digit
                .chars()
                .all(|c| c.is_ascii_digit() || "*#ABCDabcd".contains(c));
        if !ok {
            return Err(ClientError::invalid(
                "invalid_digit",
                format!("{digit:?} is not a keypad digit"),
            )
            .at("dtmf.digit"));
        }
        tracing::debug!(digit, answering = ?conv.answering(), "keypad");
        let key = digit.chars().next().unwrap_or('0').to_ascii_uppercase();
        let input = conversation::keypress(key, conv);
        Ok(vec![Action::Input {
            event_id: None,
            input,
        }])
    }

    /// One answer's audio (pcm16 LE, 8 kHz) as media frames, each with its mark.
    fn audio(&mut self, response_id: &str, pcm16: &[u8]) -> Vec<Message> {
        let Some(s) = self.started.as_ref().filter(|_| !pcm16.is_empty()) else {
            return Vec::new();
        };
        if self.played.cleared.as_deref() == Some(response_id) {
            return Vec::new();
        }
        let mut frames = Vec::with_capacity(2 * (pcm16.len() / 2).div_ceil(FRAME_SAMPLES));
        for piece in pcm16.chunks(2 * FRAME_SAMPLES) {
            let codes = s.law.encode_le(piece);
            let mark = self.played.send(response_id, codes.len());
            let payload = base64::engine::general_purpose::STANDARD.encode(codes);
            frames.push(text(json!({
                "event": "media", "streamSid": s.stream_sid,
                "media": {"payload": payload},
            })));
            frames.push(text(json!({
                "event": "mark", "streamSid": s.stream_sid, "mark": {"name": mark},
            })));
        }
        frames
    }

    /// What the protocol cannot say: logged and counted.
    fn report(&self, e: &ClientError) {
        let (stream, call) = self
            .started
            .as_ref()
            .map_or(("", ""), |s| (s.stream_sid.as_str(), s.call_sid.as_str()));
        tracing::warn!(stream, call, code = e.code, "phone stream: {}", e.message);
        self.state
            .metrics
            .phone_errors
            .with_label_values(&[e.code])
            .inc();
    }
}

fn text(v: Value) -> Message {
    Message::Text(v.to_string().into())
}

/// An error that ends the stream (the driver closes with its reason).
fn fatal(e: ClientError) -> Vec<Action> {
    vec![Action::Close(e, close_code::POLICY)]
}

/// The close frame that says why the stream ends (the code is the driver's).
fn close_frame(e: &ClientError) -> Message {
    Message::Close(Some(CloseFrame {
        code: close_code::POLICY,
        reason: close_reason(e).into(),
    }))
}

/// A close frame's reason is at most 123 bytes.
fn close_reason(e: &ClientError) -> String {
    let mut s = format!("{}: {}", e.code, e.message);
    if s.len() > 123 {
        let mut cut = 120;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
        s.push_str("...");
    }
    s
}

impl Transport for MediaStream {
    fn endpoint(&self) -> &'static str {
        "twilio"
    }

    fn voice_owner(&self) -> &str {
        &self.owner
    }

    fn settings(&self) -> Settings {
        Settings::new(PHONE_RATE, OutputFormat::Pcm16 { rate: PHONE_RATE })
    }

    fn opening(&mut self, _conv: &Conversation) -> Vec<Message> {
        Vec::new()
    }

    fn message(&mut self, m: Incoming<'_>, conv: &Conversation) -> Vec<Action> {
        let r = match m {
            Incoming::Text(t) => self.on_text(t, conv),
            Incoming::Binary(_) => Err(ClientError::invalid(
                "invalid_event",
                "Media Streams frames are JSON text: a binary frame was dropped",
            )),
        };
        r.unwrap_or_else(|e| {
            self.report(&e);
            Vec::new()
        })
    }

    fn output(&mut self, o: Output, _conv: &Conversation) -> Result<Vec<Message>, Overflow> {
        Ok(match o {
            Output::Error { error, .. } => {
                self.report(&error);
                Vec::new()
            }
            Output::Transcribed { result: Err(e), .. } => {
                self.report(&e);
                Vec::new()
            }
            Output::AnswerAudio { answer, bytes } => {
                let now = self.lead.push(&answer.response_id, &bytes, Instant::now());
                self.audio(&answer.response_id, &now)
            }
            Output::AnswerDone { answer, end, .. } => {
                if let End::Failed(m) = end {
                    self.report(&ClientError::failed(m));
                }
                let held = self.lead.finish(&answer.response_id);
                self.audio(&answer.response_id, &held)
            }
            Output::PlaybackCleared { response_id } => {
                self.lead.drop_held();
                self.played.cleared = Some(response_id);
                match &self.started {
                    Some(s) => vec![text(json!({"event": "clear", "streamSid": s.stream_sid}))],
                    None => Vec::new(),
                }
            }
            // The carrier hears only audio: the rest is the conversation's.
            _ => Vec::new(),
        })
    }

    /// Ends the stream: a close frame (the protocol has no error event)
    /// whose reason says why; logged and counted too.
    fn error(&self, e: &ClientError) -> Message {
        self.report(e);
        close_frame(e)
    }

    fn notice(&self, e: &ClientError) -> Option<Message> {
        self.report(e);
        None
    }

    fn queued_seconds(&self) -> f64 {
        self.played.queued() as f64 / f64::from(PHONE_RATE)
    }

    fn clear_player(&mut self) {
        self.played.clear();
    }

    fn wake_at(&self) -> Option<Instant> {
        self.lead.due()
    }

    fn wake(&mut self, now: Instant) -> Vec<Message> {
        match self.lead.release(now) {
            Some((response_id, pcm)) => self.audio(&response_id, &pcm),
            None => Vec::new(),
        }
    }

    fn overdue(&self, now: Instant) -> Option<ClientError> {
        (self.started.is_none() && !self.stopped && now.duration_since(self.opened) > START_WITHIN)
            .then(|| {
                ClientError::invalid(
                    "start_timeout",
                    format!(
                        "no accepted start within {} s of connecting",
                        START_WITHIN.as_secs()
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests;
