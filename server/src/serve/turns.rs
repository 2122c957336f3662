//! Turn-taking for every endpoint that hears: `server_vad` turn detection
//! over the user's audio (Silero VAD), and what an interrupted answer leaves
//! in the conversation (only what was heard).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde::Deserialize;
use serde_json::{json, Value};

use omnistream_codecs::pcm::pcm16_le_to_f32;
use omnistream_codecs::StreamResampler;
use omnistream_stages::engine::TRANSCRIBE_RATE;
use omnistream_stages::vad::{VadConfig, VadEvent, VadSegmenter};

use super::listen::Hearing;
use super::realtime::conn::ClientError;
use super::state::{AppState, VadHub};

/// `turn_detection: {"type": "server_vad", ...}` as clients send it (the
/// OpenAI Realtime knobs).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ServerVad {
    #[serde(rename = "type")]
    pub kind: String,
    pub threshold: Option<f32>,
    pub prefix_padding_ms: Option<u32>,
    pub silence_duration_ms: Option<u32>,
    pub create_response: Option<bool>,
    pub interrupt_response: Option<bool>,
    /// Accepted when null: no idle prompts.
    pub idle_timeout_ms: Option<Value>,
}

/// Validated `server_vad` settings of a session.
#[derive(Debug, Clone)]
pub struct TurnSettings {
    pub vad: VadConfig,
    pub create_response: bool,
    pub interrupt_response: bool,
}

impl TurnSettings {
    /// From a client's `turn_detection` value: `Ok(None)` for null (the
    /// client commits), an error naming the field for anything unsupported.
    pub fn parse(
        v: &Value,
        hub: Option<&VadHub>,
        param: &'static str,
    ) -> Result<Option<Self>, ClientError> {
        if v.is_null() {
            return Ok(None);
        }
        let bad = |code: &'static str, m: String| ClientError {
            param: Some(param),
            ..ClientError::invalid(code, m)
        };
        let td: ServerVad = serde_json::from_value(v.clone())
            .map_err(|e| bad("invalid_value", format!("turn_detection: {e}")))?;
        if td.kind != "server_vad" {
            return Err(bad(
                "unsupported_turn_detection",
                format!(
                    "turn_detection type {:?} is not supported: use \"server_vad\" or null",
                    td.kind
                ),
            ));
        }
        let Some(hub) = hub else {
            return Err(bad(
                "unsupported_turn_detection",
                "this server has no VAD model (profile `server.vad`): set turn_detection to null and commit the input audio buffer yourself".into(),
            ));
        };
        if td.idle_timeout_ms.as_ref().is_some_and(|v| !v.is_null()) {
            return Err(bad(
                "unsupported_turn_detection",
                "idle_timeout_ms is not supported: leave it out or null".into(),
            ));
        }
        let d = VadConfig::default();
        let vad = VadConfig {
            threshold: td.threshold.unwrap_or(d.threshold),
            prefix_padding_ms: td.prefix_padding_ms.unwrap_or(d.prefix_padding_ms),
            silence_duration_ms: td.silence_duration_ms.unwrap_or(d.silence_duration_ms),
            min_speech_ms: hub.min_speech_ms,
            ..d
        };
        vad.validate()
            .map_err(|e| bad("invalid_value", e.to_string()))?;
        Ok(Some(Self {
            vad,
            create_response: td.create_response.unwrap_or(true),
            interrupt_response: td.interrupt_response.unwrap_or(true),
        }))
    }

    /// As the session reports it.
    pub fn to_json(&self) -> Value {
        json!({
            "type": "server_vad",
            "threshold": self.vad.threshold,
            "prefix_padding_ms": self.vad.prefix_padding_ms,
            "silence_duration_ms": self.vad.silence_duration_ms,
            "create_response": self.create_response,
            "interrupt_response": self.interrupt_response,
            "idle_timeout_ms": null,
        })
    }
}

/// What the detector saw in the audio just fed.
pub enum Turn {
    /// The user started speaking (`audio_start_ms` from the start of the
    /// session's audio, prefix padding included).
    Started { audio_start_ms: u64 },
    /// The user stopped: their utterance, mono f32 at 16 kHz, with the
    /// prefix padding and at most `PAUSE_MS` of trailing silence; `early`:
    /// its transcription, already under way since the user paused.
    Stopped {
        audio_end_ms: u64,
        audio: Vec<f32>,
        early: Option<Hearing>,
    },
}

/// Silero's window at 16 kHz.
const VAD_WINDOW: usize = 512;

/// One session's turn detector: PCM16 in at the session's rate, turns out.
pub struct TurnDetector {
    pub settings: TurnSettings,
    seg: VadSegmenter,
    resampler: Option<StreamResampler>,
    echo_guard: Duration,
    /// An utterance that began inside the echo guard: dropped when it ends.
    ignoring: bool,
    /// Length of the utterance at its pause, while the pause lasts.
    paused: Option<usize>,
    /// Where the Listener is (and the endpoint to count its work under),
    /// for transcribing a turn from its pause: the user pauses (`PAUSE_MS`
    /// of quiet), the Listener starts on the utterance so far; unless they
    /// speak again, the turn that `silence_duration_ms` confirms is exactly
    /// that audio, and its words are ready or nearly.
    listener: Option<(Arc<AppState>, &'static str)>,
    /// That transcription, while the pause lasts.
    early: Option<Hearing>,
}

impl TurnDetector {
    /// `listener`: the server and endpoint name, where the pipeline hears
    /// (turns are then transcribed from their pause).
    pub fn new(
        settings: TurnSettings,
        hub: &VadHub,
        rate: u32,
        listener: Option<(Arc<AppState>, &'static str)>,
    ) -> Result<Self, ClientError> {
        let fail = |e: String| ClientError::server("vad_unavailable", e);
        let seg = VadSegmenter::new(hub.model.clone(), settings.vad.clone())
            .map_err(|e| fail(e.to_string()))?;
        let resampler = (rate != TRANSCRIBE_RATE)
            .then(|| StreamResampler::new(rate, TRANSCRIBE_RATE))
            .transpose()
            .map_err(|e| fail(e.to_string()))?;
        Ok(Self {
            settings,
            seg,
            resampler,
            echo_guard: Duration::from_millis(u64::from(hub.echo_guard_ms)),
            ignoring: false,
            paused: None,
            listener,
            early: None,
        })
    }

    /// Feeds PCM16 LE; `playing_since`: when the current answer's audio began
    /// to play (speech that starts within the echo guard after it is taken
    /// for the answer's own echo and dropped).
    pub fn push(
        &mut self,
        pcm16: &[u8],
        playing_since: Option<Instant>,
    ) -> Result<Vec<Turn>, ClientError> {
        let bad = |e: String| ClientError::invalid("invalid_audio", e);
        let samples = pcm16_le_to_f32(pcm16).map_err(|e| bad(e.to_string()))?;
        let samples = match self.resampler.as_mut() {
            Some(r) => r.process(&samples).map_err(|e| bad(e.to_string()))?,
            None => samples,
        };
        let mut turns = Vec::new();
        // A window at a time: at most one event per push, so each turn gets
        // its own audio however much arrives at once.
        for chunk in samples.chunks(VAD_WINDOW) {
            for e in self.seg.push(chunk).map_err(|e| bad(e.to_string()))? {
                match e {
                    VadEvent::SpeechStarted { audio_start_ms } => {
                        self.paused = None;
                        let echo = playing_since.is_some_and(|t| t.elapsed() < self.echo_guard);
                        if echo {
                            self.ignoring = true;
                        } else {
                            turns.push(Turn::Started { audio_start_ms });
                        }
                    }
                    VadEvent::SpeechStopped { audio_end_ms } => {
                        if let Some(t) = self.stopped(audio_end_ms) {
                            turns.push(t);
                        }
                    }
                }
            }
            if self.ignoring {
                continue;
            }
            match (self.seg.paused_len(), self.paused) {
                (Some(len), p) if p != Some(len) => {
                    self.paused = Some(len);
                    self.early = self.listener.as_ref().map(|(state, endpoint)| {
                        let audio = self.seg.utterance()[..len].to_vec();
                        Hearing::start(state.clone(), endpoint, audio)
                    });
                }
                (None, Some(_)) if self.seg.is_speaking() => {
                    // Speech went on: the paused audio is not the turn.
                    self.paused = None;
                    self.early = None;
                }
                _ => {}
            }
        }
        Ok(turns)
    }

    /// The turn that just ended: trailing silence past its pause trimmed
    /// (what a transcription started at the pause heard).
    fn stopped(&mut self, audio_end_ms: u64) -> Option<Turn> {
        let mut audio = self.seg.take_utterance();
        if let Some(len) = self.paused.take() {
            audio.truncate(len);
        }
        let early = self.early.take().filter(|h| h.covers(&audio));
        if std::mem::take(&mut self.ignoring) {
            return None;
        }
        Some(Turn::Stopped {
            audio_end_ms,
            audio,
            early,
        })
    }

    /// The client ended its audio (`audio_end`): an utterance under way ends
    /// here, as if silence had followed it.
    pub fn finish(&mut self) -> Option<Turn> {
        let VadEvent::SpeechStopped { audio_end_ms } = self.seg.flush()? else {
            return None;
        };
        self.stopped(audio_end_ms)
    }

    /// Forgets the audio so far (the client cleared its input buffer); the
    /// clock keeps running.
    pub fn clear(&mut self) {
        if self.seg.is_speaking() {
            self.seg.flush();
        }
        self.seg.take_utterance();
        self.ignoring = false;
        self.paused = None;
        self.early = None;
    }
}

/// How an answer is playing: shared by the session (which interrupts it)
/// and the job streaming it (which counts what went out).
pub struct Playback {
    pub response_id: String,
    /// The assistant item (realtime) the answer is.
    pub item_id: String,
    /// When its first audio went out.
    started: OnceLock<Instant>,
    /// Microseconds of audio handed to the client or the track.
    sent_us: AtomicU64,
    interrupted: AtomicBool,
    /// What the user had heard when they interrupted (ms of audio).
    heard: AtomicU64,
}

impl Playback {
    pub fn new(response_id: String, item_id: String) -> Self {
        Self {
            response_id,
            item_id,
            started: OnceLock::new(),
            sent_us: AtomicU64::new(0),
            interrupted: AtomicBool::new(false),
            heard: AtomicU64::new(0),
        }
    }

    /// When its first audio went out (the echo guard counts from here).
    pub fn started(&self) -> Option<Instant> {
        self.started.get().copied()
    }

    /// `samples` more at `rate` went out.
    pub fn sent_audio(&self, samples: usize, rate: u32) {
        self.started.get_or_init(Instant::now);
        let us = samples as u64 * 1_000_000 / u64::from(rate.max(1));
        self.sent_us.fetch_add(us, Ordering::AcqRel);
    }

    /// `seconds` in all went out (for encoded audio, whose bytes do not
    /// count samples).
    pub fn sent_until(&self, seconds: f64) {
        self.started.get_or_init(Instant::now);
        let us = (seconds.max(0.0) * 1e6) as u64;
        self.sent_us.fetch_max(us, Ordering::AcqRel);
    }

    /// Marks it interrupted. Heard: what left (sent minus what a WebRTC
    /// track still had queued, `queued_s`), and never more than real time
    /// since its first audio (a WebSocket client plays as it receives).
    pub fn interrupt(&self, queued_s: f64) {
        let queued_us = (queued_s.max(0.0) * 1e6) as u64;
        let sent_ms = self
            .sent_us
            .load(Ordering::Acquire)
            .saturating_sub(queued_us)
            / 1000;
        let since_ms = self
            .started
            .get()
            .map_or(0, |t| t.elapsed().as_millis() as u64);
        self.heard.store(sent_ms.min(since_ms), Ordering::Release);
        self.interrupted.store(true, Ordering::Release);
    }

    /// Whether a client that plays as it receives is still playing it
    /// (more audio went out than real time since the first).
    pub fn playing(&self) -> bool {
        self.started().is_some_and(|t| {
            let sent = Duration::from_micros(self.sent_us.load(Ordering::Acquire));
            sent > t.elapsed()
        })
    }

    pub fn interrupted(&self) -> bool {
        self.interrupted.load(Ordering::Acquire)
    }

    pub fn heard_ms(&self) -> u64 {
        self.heard.load(Ordering::Acquire)
    }

    /// What of `text` (the answer) the user heard before interrupting.
    pub fn heard_text<'a>(&self, state: &AppState, text: &'a str) -> &'a str {
        let rate = state.speech_rate.chars_per_second();
        spoken_prefix(text, self.heard_ms() as f64 / 1000.0, rate)
    }

    /// The answer had been generated whole but was still playing when the
    /// user interrupted: cuts the conversation's copy of it (the last
    /// assistant turn of `session_id`) back to what was heard, and returns
    /// what is kept.
    pub fn truncate_history(&self, state: &AppState, session_id: &str) -> String {
        state
            .sessions
            .with(session_id, |s| {
                let m = s.history.last_mut().filter(|m| m.role == "assistant")?;
                m.content = self.heard_text(state, &m.content).to_string();
                Some(m.content.clone())
            })
            .flatten()
            .unwrap_or_default()
    }
}

/// How many characters of text the voice speaks per second, learnt from the
/// answers it finished (an interrupted answer keeps only what was heard).
pub struct SpeechRate(Mutex<(f64, f64)>);

/// Before any answer finished: Piper's "joe" at length_scale 1.0 speaks about
/// 14 characters a second (measured on the sweep's answers).
const DEFAULT_CHARS_PER_SECOND: f64 = 14.0;

impl Default for SpeechRate {
    fn default() -> Self {
        Self(Mutex::new((0.0, 0.0)))
    }
}

impl SpeechRate {
    pub fn observe(&self, chars: usize, seconds: f64) {
        if chars == 0 || seconds <= 0.0 {
            return;
        }
        let mut g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        g.0 += chars as f64;
        g.1 += seconds;
    }

    pub fn chars_per_second(&self) -> f64 {
        let g = self.0.lock().unwrap_or_else(|e| e.into_inner());
        if g.1 > 1.0 {
            g.0 / g.1
        } else {
            DEFAULT_CHARS_PER_SECOND
        }
    }
}

/// The part of `text` spoken in `seconds` of audio at `chars_per_second`,
/// cut back to a word boundary (a word cut mid-way was not heard whole).
pub fn spoken_prefix(text: &str, seconds: f64, chars_per_second: f64) -> &str {
    let n = (seconds.max(0.0) * chars_per_second).floor() as usize;
    let Some((cut, _)) = text.char_indices().nth(n) else {
        return text;
    };
    let head = &text[..cut];
    match head.rfind(char::is_whitespace) {
        Some(i) => head[..i].trim_end(),
        None => "",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spoken_prefix_cuts_at_a_word() {
        let t = "Bees make honey from nectar.";
        assert_eq!(spoken_prefix(t, 0.0, 14.0), "");
        // 10 chars: "Bees make " -> whole words only.
        assert_eq!(spoken_prefix(t, 10.0 / 14.0, 14.0), "Bees make");
        assert_eq!(spoken_prefix(t, 8.0 / 14.0, 14.0), "Bees");
        assert_eq!(spoken_prefix(t, 100.0, 14.0), t);
        assert_eq!(spoken_prefix("héllo wörld", 7.0 / 14.0, 14.0), "héllo");
    }

    #[test]
    fn speech_rate_learns() {
        let r = SpeechRate::default();
        assert_eq!(r.chars_per_second(), DEFAULT_CHARS_PER_SECOND);
        r.observe(300, 20.0);
        assert!((r.chars_per_second() - 15.0).abs() < 1e-9);
        r.observe(0, 5.0);
        assert!((r.chars_per_second() - 15.0).abs() < 1e-9);
    }
}
