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

use omnistream_codecs::ogg_opus::OPUS_RATE;
use omnistream_codecs::pcm::f32_to_pcm16_le;
use omnistream_codecs::{CodecError, OggOpusDecoder};
use omnistream_stages::engine::{Modalities, RequestInput, RequestSpec, TRANSCRIBE_RATE};
use omnistream_stages::models::tokenizer::ChatMessage;

use super::audio::OutputFormat;
use super::listen;
use super::metrics::TaskGuard;
use super::realtime::conn::{self, Active, ClientError, End, Generation, Outbox, Step};
use super::sessions::SessionGuard;
use super::state::AppState;
use super::turns::{Playback, Turn, TurnDetector, TurnSettings};

/// Sample rates a client may choose for both directions.
pub const SAMPLE_RATES: [u32; 4] = [8_000, 16_000, 24_000, 48_000];
/// Most audio of one utterance (without turn detection) or of one message.
const MAX_INPUT_AUDIO_SECONDS: usize = 60;
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

struct PcmStream {
    state: Arc<AppState>,
    out: Outbox,
    session: SessionGuard,
    /// Chosen in `start`; nothing else is accepted before.
    rate: Option<u32>,
    format: Format,
    /// Input audio as PCM16 LE at `rate` (Ogg Opus input decoded).
    input_audio: Vec<u8>,
    /// The Ogg Opus input stream being received, until `audio_end`. In a
    /// Mutex only to be `Sync` (libopus's handle is not), as `&self` crosses
    /// awaits; only this connection's task touches it.
    opus_in: std::sync::Mutex<Option<OggOpusDecoder>>,
    active: Option<Active>,
    /// `server_vad`, when `start` asked for it: the detector holds the
    /// utterance under way (`input_audio` stays empty).
    turns: Option<TurnDetector>,
    /// How the latest answer is playing (for barge-in).
    playback: Option<Arc<Playback>>,
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
        format: Format::Pcm16,
        input_audio: Vec::new(),
        opus_in: std::sync::Mutex::new(None),
        active: None,
        turns: None,
        playback: None,
    };
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut drain = conn::Drain::new(&s.state);
    loop {
        tokio::select! {
            biased;
            _ = out.closed() => break,
            _ = drain.next() => {
                if drain.due(s.active.as_ref()) {
                    let bye = error_msg(&ClientError::shutting_down());
                    out.finish(bye, close_code::AWAY, conn::GOODBYE).await;
                    break;
                }
            }
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
                    if let Some((err, code)) = conn::read_error(&e) {
                        out.close(Some(error_msg(&err)), code);
                    }
                    break;
                }
                Some(Ok(Message::Text(t))) => {
                    if let Err(e) = s.on_text(&t).await {
                        s.send(error_msg(&e)).await;
                    }
                }
                Some(Ok(Message::Binary(b))) => {
                    if let Err(e) = s.on_audio(&b).await {
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
            "audio_end" => self.audio_end().await,
            other => Err(ClientError::invalid(
                "unknown_event_type",
                format!("unknown message type {other:?}: use start, text, cancel or audio_end"),
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
                    .voice(v)
                    .map_err(|m| ClientError::invalid("unsupported_voice", m))?,
            ),
            None => None,
        };
        let hub = self.state.config.vad.as_ref();
        let turns = match (
            TurnSettings::parse(&s.turn_detection, hub, "turn_detection")?,
            hub,
        ) {
            (Some(settings), Some(hub)) => {
                if !self.hears() {
                    return Err(Self::deaf());
                }
                let listener =
                    listen::can_hear(&self.state).then(|| (self.state.clone(), "stream"));
                Some(TurnDetector::new(settings, hub, rate, listener)?)
            }
            _ => None,
        };
        let turn_detection = turns.as_ref().map(|t| t.settings.to_json());
        self.turns = turns;
        self.state.sessions.with(&self.session.id, |sess| {
            sess.voice = voice.clone();
            sess.instructions = s.instructions.clone().filter(|i| !i.trim().is_empty());
            sess.input_format = format!("{}@{rate}", s.format.name());
            sess.output_format = format!("{}@{rate}", s.format.name());
        });
        self.rate = Some(rate);
        self.format = s.format;
        self.send(msg(json!({
            "type": "started", "session_id": self.session.id,
            "format": s.format.name(), "sample_rate": rate,
            "voice": voice.as_deref().unwrap_or(self.state.default_voice()),
            "turn_detection": turn_detection,
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
        self.idle()?;
        self.answer(UserTurn::Text(t.text), rate)
    }

    /// No answer is playing (one answer at a time).
    fn idle(&self) -> Result<(), ClientError> {
        match self.active.as_ref().filter(|a| a.running()) {
            Some(a) => Err(ClientError::invalid(
                "response_in_progress",
                format!(
                    "response {} is still playing: wait for done or cancel it",
                    a.id
                ),
            )),
            None => Ok(()),
        }
    }

    /// Whether the pipeline takes speech: through a Listener, or a Thinker
    /// that hears it itself.
    fn hears(&self) -> bool {
        listen::can_hear(&self.state) || self.state.pipeline.thinker_hears()
    }

    /// Starts the spoken answer to the user's turn.
    fn answer(&mut self, turn: UserTurn, rate: u32) -> Result<(), ClientError> {
        let (messages, sampling, voice, audio) = self
            .state
            .sessions
            .with(&self.session.id, |s| {
                let mut history = s.history.clone();
                let audio = match &turn {
                    UserTurn::Text(text) => {
                        history.push(ChatMessage::new("user", text.clone()));
                        None
                    }
                    UserTurn::Spoken(audio) => Some(audio.clone()),
                };
                s.spoken = None;
                (
                    conn::prompt(s.instructions.as_deref(), &history),
                    s.sampling.clone(),
                    s.voice.clone(),
                    audio,
                )
            })
            .ok_or_else(ClientError::expired)?;
        let user = match turn {
            UserTurn::Text(text) => Some(ChatMessage::new("user", text)),
            UserTurn::Spoken(_) => None,
        };
        let spec = RequestSpec {
            input: match audio {
                Some(audio) => RequestInput::Heard { messages, audio },
                None => RequestInput::Chat { messages },
            },
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
            Some(match self.format {
                Format::Pcm16 => OutputFormat::Pcm16 { rate },
                Format::Opus => OutputFormat::OggOpus,
            }),
            cancel_rx,
        )?;
        let id = conn::new_id("resp");
        self.state.sessions.with(&self.session.id, |s| {
            // A spoken turn has no words to keep; its answer is kept.
            if let Some(user) = user {
                conn::remember(s, user);
            }
            s.in_flight = Some(id.clone());
        });
        self.active = Some(Active {
            id: id.clone(),
            cancel,
        });
        let playback = Arc::new(Playback::new(id.clone(), String::new()));
        self.playback = Some(playback.clone());
        let job = Job {
            playback,
            state: self.state.clone(),
            out: self.out.clone(),
            session_id: self.session.id.clone(),
            id,
            rate,
            format: self.format,
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

    async fn on_audio(&mut self, bytes: &[u8]) -> Result<(), ClientError> {
        let rate = self.rate.ok_or_else(Self::not_started)?;
        match self.format {
            Format::Pcm16 => {
                if bytes.len() % 2 == 1 {
                    return Err(ClientError::invalid(
                        "invalid_audio",
                        "binary frames are PCM16 LE: an even number of bytes",
                    ));
                }
                if self.turns.is_some() {
                    if bytes.len() > Self::input_cap(rate) {
                        return Err(Self::message_too_long());
                    }
                    return self.detect(bytes).await;
                }
                if self.input_audio.len() + bytes.len() > Self::input_cap(rate) {
                    return Err(Self::buffer_full("this frame was dropped"));
                }
                self.input_audio.extend_from_slice(bytes);
                Ok(())
            }
            Format::Opus => self.on_opus(bytes, rate).await,
        }
    }

    /// Decodes the next bytes of the Ogg Opus input stream (split anywhere)
    /// into the input buffer, or through the turn detector. A malformed
    /// stream is reported once; its later bytes are refused until
    /// `audio_end` starts a new stream. Audio decoded before the fault is
    /// kept.
    async fn on_opus(&mut self, bytes: &[u8], rate: u32) -> Result<(), ClientError> {
        let cap = Self::input_cap(rate);
        let mut decoded = 0;
        for slice in bytes.chunks(OPUS_DECODE_SLICE) {
            let pcm = self.decode_opus(slice)?;
            if self.turns.is_some() {
                decoded += pcm.len();
                if decoded > cap {
                    return Err(Self::message_too_long());
                }
                self.detect(&pcm).await?;
                continue;
            }
            let room = cap.saturating_sub(self.input_audio.len());
            if pcm.len() > room {
                self.input_audio.extend_from_slice(&pcm[..room - room % 2]);
                return Err(Self::buffer_full("the audio past it was dropped"));
            }
            self.input_audio.extend_from_slice(&pcm);
        }
        Ok(())
    }

    /// PCM16 LE of the next bytes of the Ogg Opus input stream.
    fn decode_opus(&mut self, bytes: &[u8]) -> Result<Vec<u8>, ClientError> {
        let opus_in = self.opus_in.get_mut().unwrap_or_else(|e| e.into_inner());
        let dec = opus_in.get_or_insert_with(OggOpusDecoder::new);
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

    /// `server_vad`: runs the turn detector over new input audio; a turn that
    /// starts interrupts the answer, a turn that ends is heard and answered.
    async fn detect(&mut self, pcm: &[u8]) -> Result<(), ClientError> {
        let Some(t) = self.turns.as_mut() else {
            return Ok(());
        };
        let since = self.playback.as_ref().and_then(|p| p.started());
        let interrupt = t.settings.interrupt_response;
        for turn in t.push(pcm, since)? {
            match turn {
                Turn::Started { audio_start_ms } => {
                    self.send(msg(json!({
                        "type": "speech_started", "audio_start_ms": audio_start_ms,
                    })))
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
                    let seconds = audio.len() as f64 / f64::from(TRANSCRIBE_RATE);
                    self.send(msg(json!({
                        "type": "speech_stopped", "audio_end_ms": audio_end_ms,
                        "seconds": seconds,
                    })))
                    .await;
                    self.hear(audio, early).await?;
                }
            }
        }
        Ok(())
    }

    /// The user spoke over the answer: it stops in every stage, the client
    /// is told to drop the audio it has queued (`output_cleared`), and the
    /// conversation keeps only what was heard (`truncated`).
    async fn barge_in(&mut self) {
        let Some(p) = self.playback.clone() else {
            return;
        };
        let running = self.active.as_ref().is_some_and(Active::running);
        if p.interrupted() || (!running && !p.playing()) {
            return; // nothing is playing
        }
        p.interrupt(0.0);
        if let Some(a) = self.active.as_ref().filter(|a| a.running()) {
            // The answer's job reports the cut (`truncated`) as it ends.
            let _ = a.cancel.send(true);
        } else {
            // Generated whole, still playing at the client.
            let kept = p.truncate_history(&self.state, &self.session.id);
            self.send(truncated(&p, &kept)).await;
        }
        self.send(msg(
            json!({"type": "output_cleared", "response_id": p.response_id}),
        ))
        .await;
    }

    /// The end of the client's utterance: closes an Ogg Opus stream (an
    /// error if it was cut short), reports the audio taken, and, where the
    /// pipeline hears, transcribes it and answers it like a text turn. With
    /// turn detection, an utterance under way ends here.
    async fn audio_end(&mut self) -> Result<(), ClientError> {
        let rate = self.rate.ok_or_else(Self::not_started)?;
        let opus_in = self.opus_in.get_mut().unwrap_or_else(|e| e.into_inner());
        // A stream that failed earlier was reported then; only a cut is news.
        let truncated = match opus_in.take().map(|mut d| d.finish()) {
            Some(Err(e @ CodecError::Truncated(_))) => Some(e),
            _ => None,
        };
        let pcm = std::mem::take(&mut self.input_audio);
        let ended = match self.turns.as_mut().map(TurnDetector::finish) {
            Some(Some(Turn::Stopped { audio, early, .. })) => Some((audio, early)),
            _ => None,
        };
        let seconds = match &ended {
            Some((audio, _)) => audio.len() as f64 / f64::from(TRANSCRIBE_RATE),
            None => pcm.len() as f64 / 2.0 / f64::from(rate),
        };
        if let Some(e) = truncated {
            let e = ClientError::invalid(
                "truncated_audio",
                format!("the Ogg Opus input stream was cut short ({e}); the {seconds:.2} s decoded before the cut are kept"),
            );
            self.send(error_msg(&e)).await;
        }
        self.send(msg(json!({"type": "audio_received", "seconds": seconds})))
            .await;
        let audio = match ended {
            Some((audio, early)) => return self.hear(audio, early).await,
            None if pcm.is_empty() => return Ok(()),
            None => {
                if !self.hears() {
                    return Err(Self::deaf());
                }
                // Without turn detection, one answer at a time.
                self.idle()?;
                listen::to_listener_rate(&pcm, rate)?
            }
        };
        self.hear(audio, None).await
    }

    /// Transcribes the user's utterance (16 kHz) and answers it like a text
    /// turn. Nothing heard (noise, a cough): no turn. Not answered (turn
    /// detection's `create_response` off, or an answer still playing): the
    /// words join the conversation for the next answer.
    async fn hear(
        &mut self,
        audio: Vec<f32>,
        early: Option<listen::Hearing>,
    ) -> Result<(), ClientError> {
        let rate = self.rate.ok_or_else(Self::not_started)?;
        if !self.hears() {
            return Err(Self::deaf());
        }
        let create = self
            .turns
            .as_ref()
            .is_none_or(|t| t.settings.create_response);
        if early.is_none() && self.state.pipeline.thinker_hears() {
            // The Thinker hears the turn itself: no transcript.
            let audio: std::sync::Arc<[f32]> = audio.into();
            if create && self.idle().is_ok() {
                return self.answer(UserTurn::Spoken(audio), rate);
            }
            self.state
                .sessions
                .with(&self.session.id, |s| s.spoken = Some(audio));
            return Ok(());
        }
        let text = match early {
            Some(h) => h.result().await?,
            None => listen::transcribe(&self.state, "stream", audio).await?,
        };
        self.send(msg(json!({"type": "input_transcript", "text": text})))
            .await;
        if text.is_empty() {
            return Ok(());
        }
        if create && self.idle().is_ok() {
            return self.answer(UserTurn::Text(text), rate);
        }
        let user = ChatMessage::new("user", text);
        self.state
            .sessions
            .with(&self.session.id, |s| conn::remember(s, user));
        Ok(())
    }

    fn deaf() -> ClientError {
        ClientError::invalid(
            "transcription_unavailable",
            "this server's pipeline has no speech recognition stage: the utterance was dropped",
        )
    }

    fn message_too_long() -> ClientError {
        ClientError::invalid(
            "input_audio_buffer_full",
            format!("a message carries at most {MAX_INPUT_AUDIO_SECONDS} s of audio; the rest of it was dropped"),
        )
    }

    fn input_cap(rate: u32) -> usize {
        rate as usize * 2 * MAX_INPUT_AUDIO_SECONDS
    }

    fn buffer_full(what: &str) -> ClientError {
        ClientError::invalid(
            "input_audio_buffer_full",
            format!("an utterance is at most {MAX_INPUT_AUDIO_SECONDS} s (send {{\"type\":\"audio_end\"}} to end it); {what}"),
        )
    }
}

/// `truncated`: the conversation keeps `kept` of an interrupted answer.
fn truncated(p: &Playback, kept: &str) -> Message {
    msg(json!({
        "type": "truncated", "response_id": p.response_id,
        "audio_end_ms": p.heard_ms(), "text": kept,
    }))
}

/// One spoken answer, in its own task.
struct Job {
    playback: Arc<Playback>,
    state: Arc<AppState>,
    out: Outbox,
    session_id: String,
    id: String,
    rate: u32,
    format: Format,
    gen: Generation,
}

impl Job {
    async fn run(mut self) {
        let _task = TaskGuard::new(&self.state.metrics);
        let end = self.stream().await;
        let mut text = self.gen.text().to_string();
        if matches!(end, Some(End::Completed(_))) {
            let secs = self.gen.audio_seconds();
            self.state.speech_rate.observe(text.chars().count(), secs);
        }
        // Interrupted: the conversation keeps what the user heard.
        if self.playback.interrupted() {
            text = self.playback.heard_text(&self.state, &text).to_string();
            let _ = self.out.send(truncated(&self.playback, &text)).await;
        }
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
        // A cut-short Ogg Opus answer still ends its stream: a valid file.
        if matches!(end, End::Cancelled | End::Failed(_)) {
            let tail = self.gen.seal();
            if !tail.is_empty() && self.out.send(Message::Binary(tail.into())).await.is_err() {
                return;
            }
        }
        let status = match end {
            End::Completed(_) => "completed",
            End::Cancelled => "cancelled",
            End::SlowClient => {
                self.out.close_slow(error_msg(&ClientError::slow_client()));
                return;
            }
            End::Failed(e) => {
                let e = ClientError::failed(e);
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
            "type": "audio_start", "response_id": self.id,
            "format": self.format.name(), "sample_rate": self.rate,
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
                Step::Audio(bytes) => {
                    match self.format {
                        Format::Pcm16 => self.playback.sent_audio(bytes.len() / 2, self.rate),
                        Format::Opus => self.playback.sent_until(self.gen.audio_seconds()),
                    }
                    Message::Binary(bytes.into())
                }
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

/// A user turn to answer: typed words, or speech for a Thinker that hears it.
enum UserTurn {
    Text(String),
    Spoken(std::sync::Arc<[f32]>),
}
