//! Turn detection over a 16 kHz stream with Silero VAD, with the knobs and event
//! semantics of the OpenAI Realtime API's `server_vad`:
//!
//! * a window (512 samples, 32 ms) is speech when its probability is >= `threshold`;
//! * `speech_started` fires once speech has lasted `min_speech_ms` (an echo / click
//!   guard, not an OpenAI knob; 0 = on the first speech window). Its
//!   `audio_start_ms` is where that speech began minus `prefix_padding_ms`, clamped
//!   at 0 and at the previous utterance's end (so utterances never overlap);
//! * `speech_stopped` fires after `silence_duration_ms` without a speech window; its
//!   `audio_end_ms` is the end of the audio consumed so far, so it includes that
//!   silence (as OpenAI documents it);
//! * an utterance that reaches `max_utterance_ms` (prefix padding included) is closed
//!   there with `speech_stopped`; if speech goes on, a new one starts after
//!   `min_speech_ms` again. This bounds memory and matches Whisper's 30 s window.
//!
//! Durations are rounded up to whole windows (250 ms -> 8 windows, 256 ms).
//! All times are milliseconds from the start of the stream (samples / 16). The
//! samples of the current (or last) utterance, `audio_start_ms..audio_end_ms`, are
//! kept in [`VadSegmenter::utterance`]. Memory per stream is bounded whatever the
//! stream length: [`VadSegmenter::retained_samples`].

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::models::silero_vad::{SileroVad, VadState};
use crate::models::{ModelError, Result};

/// Trailing silence after which an utterance counts as paused ([`VadSegmenter::paused_len`]).
pub const PAUSE_MS: u32 = 160;

/// Upper bounds on the knobs (they may come from clients): they bound memory.
const MAX_PADDING_MS: u32 = 10_000;
const MAX_MIN_SPEECH_MS: u32 = 10_000;
const MAX_UTTERANCE_MS: u32 = 120_000;

/// `server_vad` settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct VadConfig {
    /// Speech probability at or above which a window is speech (0..=1).
    pub threshold: f32,
    /// Audio kept before the detected start of speech.
    pub prefix_padding_ms: u32,
    /// Silence that ends an utterance.
    pub silence_duration_ms: u32,
    /// Speech needed, without a gap, before `speech_started` (echo guard).
    pub min_speech_ms: u32,
    /// Longest utterance, prefix padding included; reaching it ends the utterance.
    pub max_utterance_ms: u32,
}

impl Default for VadConfig {
    fn default() -> Self {
        Self {
            threshold: 0.5,
            prefix_padding_ms: 300,
            silence_duration_ms: 500,
            min_speech_ms: 250,
            max_utterance_ms: 30_000,
        }
    }
}

impl VadConfig {
    pub fn validate(&self) -> Result<()> {
        let bad = |msg: String| Err(ModelError::Invalid(format!("vad config: {msg}")));
        if !(0.0..=1.0).contains(&self.threshold) {
            return bad(format!("threshold {} is not in 0..=1", self.threshold));
        }
        if self.prefix_padding_ms > MAX_PADDING_MS {
            return bad(format!(
                "prefix_padding_ms {} > {MAX_PADDING_MS}",
                self.prefix_padding_ms
            ));
        }
        if self.min_speech_ms > MAX_MIN_SPEECH_MS {
            return bad(format!(
                "min_speech_ms {} > {MAX_MIN_SPEECH_MS}",
                self.min_speech_ms
            ));
        }
        if self.max_utterance_ms > MAX_UTTERANCE_MS {
            return bad(format!(
                "max_utterance_ms {} > {MAX_UTTERANCE_MS}",
                self.max_utterance_ms
            ));
        }
        Ok(())
    }
}

/// A turn boundary; times in ms from the start of the stream.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum VadEvent {
    SpeechStarted { audio_start_ms: u64 },
    SpeechStopped { audio_end_ms: u64 },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    /// Waiting for speech; `run` counts consecutive speech windows from `run_start`.
    Idle { run_start: u64, run: usize },
    /// In an utterance; `silent` counts consecutive non-speech windows.
    Speaking { silent: usize },
}

/// Streaming turn segmenter for one 16 kHz mono stream.
pub struct VadSegmenter {
    model: Arc<SileroVad>,
    state: VadState,
    config: VadConfig,
    window: usize,
    samples_per_ms: u64,
    min_speech_windows: usize,
    silence_windows: usize,
    /// Silent windows after which the utterance is [`Self::paused_len`] (the point a
    /// recognizer may start on it, ahead of `speech_stopped`).
    pause_windows: usize,
    /// Samples of the utterance at its latest pause; None while speech goes on.
    paused_len: Option<usize>,
    prefix_samples: u64,
    /// Fewer than `window` samples not yet run through the model.
    pending: Vec<f32>,
    /// The last `history_cap` samples run, for the prefix padding.
    history: VecDeque<f32>,
    history_cap: usize,
    /// The current or last utterance; never longer than `utterance_cap`.
    utterance: Vec<f32>,
    utterance_cap: usize,
    utterance_start: u64,
    /// Samples run through the model (the stream clock).
    processed: u64,
    last_end: u64,
    last_probability: f32,
    phase: Phase,
}

impl VadSegmenter {
    pub fn new(model: Arc<SileroVad>, config: VadConfig) -> Result<Self> {
        config.validate()?;
        let mc = model.config();
        let window = mc.window;
        let samples_per_ms = u64::from(mc.sample_rate / 1000);
        let ms_to_windows = |ms: u32| -> usize {
            let samples = u64::from(ms) * samples_per_ms;
            samples.div_ceil(window as u64).max(1) as usize
        };
        let min_speech_windows = ms_to_windows(config.min_speech_ms);
        let prefix_samples = u64::from(config.prefix_padding_ms) * samples_per_ms;
        // Enough to reach back from the confirming window to the padded start.
        let history_cap = prefix_samples as usize + min_speech_windows * window;
        // An utterance must at least hold what it starts with plus one window.
        let utterance_cap =
            (config.max_utterance_ms as usize * samples_per_ms as usize).max(history_cap + window);
        Ok(Self {
            state: model.new_state(),
            window,
            samples_per_ms,
            min_speech_windows,
            silence_windows: ms_to_windows(config.silence_duration_ms),
            pause_windows: ms_to_windows(PAUSE_MS),
            paused_len: None,
            prefix_samples,
            pending: Vec::with_capacity(window),
            history: VecDeque::with_capacity(history_cap + window),
            history_cap,
            utterance: Vec::new(),
            utterance_cap,
            utterance_start: 0,
            processed: 0,
            last_end: 0,
            last_probability: 0.0,
            phase: Phase::Idle {
                run_start: 0,
                run: 0,
            },
            model,
            config,
        })
    }

    pub fn config(&self) -> &VadConfig {
        &self.config
    }

    /// While an utterance goes on: its length (samples) when the current silence reached
    /// `PAUSE_MS`, if it has and the silence is still shorter than `silence_duration_ms`.
    /// Unless speech resumes, `speech_stopped` follows and the utterance is this prefix plus
    /// silence, so a recognizer can start on the prefix early.
    pub fn paused_len(&self) -> Option<usize> {
        match self.phase {
            Phase::Speaking { .. } => self.paused_len,
            Phase::Idle { .. } => None,
        }
    }

    /// Feeds samples (16 kHz mono, any count) and returns the events they complete.
    /// Non-finite samples are refused before anything is consumed.
    pub fn push(&mut self, samples: &[f32]) -> Result<Vec<VadEvent>> {
        if let Some(bad) = samples.iter().find(|s| !s.is_finite()) {
            return Err(ModelError::Invalid(format!("vad: non-finite sample {bad}")));
        }
        let mut events = Vec::new();
        let mut rest = samples;
        if !self.pending.is_empty() {
            let take = (self.window - self.pending.len()).min(rest.len());
            self.pending.extend_from_slice(&rest[..take]);
            rest = &rest[take..];
            if self.pending.len() == self.window {
                let window = std::mem::take(&mut self.pending);
                let r = self.run_window(&window, &mut events);
                self.pending = window;
                self.pending.clear();
                r?;
            }
        }
        // Whole windows straight from the input: no copy, no growth on big pushes.
        let mut chunks = rest.chunks_exact(self.window);
        for w in &mut chunks {
            self.run_window(w, &mut events)?;
        }
        self.pending.extend_from_slice(chunks.remainder());
        Ok(events)
    }

    /// Ends an ongoing utterance now (end of input, or a manual commit). The samples
    /// still pending (< one window) are not part of it.
    pub fn flush(&mut self) -> Option<VadEvent> {
        match self.phase {
            Phase::Speaking { .. } => Some(self.stop()),
            Phase::Idle { .. } => None,
        }
    }

    /// Forgets everything: a new stream starting at 0 ms.
    pub fn reset(&mut self) {
        self.state.reset();
        self.pending.clear();
        self.history.clear();
        self.utterance.clear();
        self.utterance_start = 0;
        self.processed = 0;
        self.last_end = 0;
        self.last_probability = 0.0;
        self.phase = Phase::Idle {
            run_start: 0,
            run: 0,
        };
    }

    pub fn is_speaking(&self) -> bool {
        matches!(self.phase, Phase::Speaking { .. })
    }

    /// The current utterance (while speaking) or the last one, from its
    /// `audio_start_ms`; empty before the first one (or after [`Self::take_utterance`]).
    pub fn utterance(&self) -> &[f32] {
        &self.utterance
    }

    /// `audio_start_ms` of [`Self::utterance`].
    pub fn utterance_start_ms(&self) -> u64 {
        self.utterance_start / self.samples_per_ms
    }

    /// Moves the utterance out (e.g. to transcribe it after `speech_stopped`).
    pub fn take_utterance(&mut self) -> Vec<f32> {
        std::mem::take(&mut self.utterance)
    }

    /// Stream time consumed by the model so far, in ms.
    pub fn elapsed_ms(&self) -> u64 {
        self.processed / self.samples_per_ms
    }

    /// The speech probability of the last window.
    pub fn last_probability(&self) -> f32 {
        self.last_probability
    }

    /// Samples of memory held by the buffers (capacities, not lengths). Bounded by
    /// one window + history (prefix + min speech) + `max_utterance_ms`.
    pub fn retained_samples(&self) -> usize {
        self.pending.capacity() + self.history.capacity() + self.utterance.capacity()
    }

    fn ms(&self, samples: u64) -> u64 {
        samples / self.samples_per_ms
    }

    fn run_window(&mut self, w: &[f32], events: &mut Vec<VadEvent>) -> Result<()> {
        let p = self.model.step(&mut self.state, w)?;
        self.last_probability = p;
        let start = self.processed;
        self.processed += w.len() as u64;
        self.history.extend(w.iter().copied());
        let excess = self.history.len().saturating_sub(self.history_cap);
        self.history.drain(..excess);

        let speech = p >= self.config.threshold;
        match self.phase {
            Phase::Idle { run_start, run } => {
                let (run_start, run) = if speech {
                    (if run == 0 { start } else { run_start }, run + 1)
                } else {
                    (start, 0)
                };
                self.phase = Phase::Idle { run_start, run };
                if run >= self.min_speech_windows {
                    events.push(self.start(run_start));
                }
            }
            Phase::Speaking { silent } => {
                self.utterance.extend_from_slice(w);
                let silent = if speech { 0 } else { silent + 1 };
                self.phase = Phase::Speaking { silent };
                if silent == 0 {
                    self.paused_len = None;
                } else if silent == self.pause_windows && silent < self.silence_windows {
                    self.paused_len = Some(self.utterance.len());
                }
                // Stop on enough silence, or before the next window would overflow.
                if silent >= self.silence_windows
                    || self.utterance.len() + self.window > self.utterance_cap
                {
                    events.push(self.stop());
                }
            }
        }
        Ok(())
    }

    /// Speech confirmed: the utterance starts `prefix_padding` before `speech_start`.
    fn start(&mut self, speech_start: u64) -> VadEvent {
        let oldest = self.processed - self.history.len() as u64;
        let from = speech_start
            .saturating_sub(self.prefix_samples)
            .max(self.last_end)
            .max(oldest);
        self.utterance.clear();
        if self.utterance.capacity() < self.utterance_cap {
            // Allocated once at full size: no reallocation (or 2x overshoot) later.
            self.utterance = Vec::with_capacity(self.utterance_cap);
        }
        self.utterance
            .extend(self.history.range((from - oldest) as usize..));
        self.utterance_start = from;
        self.paused_len = None;
        self.phase = Phase::Speaking { silent: 0 };
        VadEvent::SpeechStarted {
            audio_start_ms: self.ms(from),
        }
    }

    fn stop(&mut self) -> VadEvent {
        self.last_end = self.processed;
        self.phase = Phase::Idle {
            run_start: self.processed,
            run: 0,
        };
        VadEvent::SpeechStopped {
            audio_end_ms: self.ms(self.processed),
        }
    }
}

// ------------------------------------------------ speech regions (faster-whisper's vad_filter)

/// faster-whisper's `vad_filter` (`VadOptions`, `max_speech_duration_s` infinite): which parts
/// of a recording a recognizer is given. Defaults are faster-whisper 1.0's.
#[derive(Debug, Clone, PartialEq)]
pub struct SpeechFilterConfig {
    /// A window at or above this probability starts speech; speech ends on windows below
    /// `threshold - 0.15` (faster-whisper's `neg_threshold`).
    pub threshold: f32,
    /// Speech regions this short or shorter are dropped (clicks, coughs).
    pub min_speech_ms: u32,
    /// Silence needed to end a region; shorter gaps stay inside it.
    pub min_silence_ms: u32,
    /// Audio kept on each side of a region (half the gap when two are closer than twice this).
    pub speech_pad_ms: u32,
}

impl Default for SpeechFilterConfig {
    fn default() -> Self {
        Self {
            threshold: 0.5,
            min_speech_ms: 250,
            min_silence_ms: 2000,
            speech_pad_ms: 400,
        }
    }
}

/// Keeps only the speech of a recording (Silero VAD over the whole of it, from a fresh
/// state), so a recognizer never sees long silence or noise, where it makes words up.
#[derive(Debug, Clone)]
pub struct SpeechFilter {
    model: Arc<SileroVad>,
    config: SpeechFilterConfig,
}

impl SpeechFilter {
    pub fn new(model: Arc<SileroVad>, config: SpeechFilterConfig) -> Result<Self> {
        if !(0.0..=1.0).contains(&config.threshold) {
            return Err(ModelError::Invalid(format!(
                "speech filter: threshold {} is not in 0..=1",
                config.threshold
            )));
        }
        Ok(Self { model, config })
    }

    pub fn config(&self) -> &SpeechFilterConfig {
        &self.config
    }

    /// The padded speech regions of `audio` (16 kHz mono), as sample ranges in order and
    /// apart: faster-whisper's `get_speech_timestamps`.
    pub fn regions(&self, audio: &[f32]) -> Result<Vec<Range<usize>>> {
        let cfg = &self.config;
        let window = self.model.config().window;
        let per_ms = (self.model.config().sample_rate / 1000) as usize;
        let min_speech = cfg.min_speech_ms as usize * per_ms;
        let min_silence = cfg.min_silence_ms as usize * per_ms;
        let pad = cfg.speech_pad_ms as usize * per_ms;
        let neg_threshold = cfg.threshold - 0.15;

        let mut state = self.model.new_state();
        let mut last = vec![0f32; window];
        let mut speeches: Vec<Range<usize>> = Vec::new();
        // (start of the region in progress, first sample of the silence that may end it)
        let mut current: Option<usize> = None;
        let mut silence_from: Option<usize> = None;
        for (i, chunk) in audio.chunks(window).enumerate() {
            // The last chunk is zero-padded to a whole window, as faster-whisper does.
            let w = if chunk.len() == window {
                chunk
            } else {
                last.fill(0.0);
                last[..chunk.len()].copy_from_slice(chunk);
                &last[..]
            };
            let p = self.model.step(&mut state, w)?;
            let at = i * window;
            if p >= cfg.threshold {
                silence_from = None;
            }
            let Some(start) = current else {
                if p >= cfg.threshold {
                    current = Some(at);
                }
                continue;
            };
            if p < neg_threshold {
                let from = *silence_from.get_or_insert(at);
                if at - from >= min_silence {
                    if from - start > min_speech {
                        speeches.push(start..from);
                    }
                    current = None;
                    silence_from = None;
                }
            }
        }
        if let Some(start) = current {
            if audio.len() - start > min_speech {
                speeches.push(start..audio.len());
            }
        }
        // Padding: pad on each side, or half the gap where two regions are closer than 2 pads.
        let n = speeches.len();
        for i in 0..n {
            if i == 0 {
                speeches[0].start = speeches[0].start.saturating_sub(pad);
            }
            if i + 1 < n {
                let gap = speeches[i + 1].start.saturating_sub(speeches[i].end);
                let grow = if gap < 2 * pad { gap / 2 } else { pad };
                speeches[i].end += grow;
                speeches[i + 1].start = speeches[i + 1].start.saturating_sub(grow);
            } else {
                speeches[i].end = (speeches[i].end + pad).min(audio.len());
            }
        }
        Ok(speeches)
    }

    /// The speech of `audio`, its regions joined (faster-whisper's `collect_chunks`); empty
    /// when there is none.
    pub fn speech(&self, audio: &[f32]) -> Result<Vec<f32>> {
        let regions = self.regions(audio)?;
        let mut out = Vec::with_capacity(regions.iter().map(|r| r.len()).sum());
        for r in regions {
            out.extend_from_slice(&audio[r]);
        }
        Ok(out)
    }
}

/// `n` samples of reproducible white noise with an RMS of `dbfs` (xorshift,
/// uniform): the silence-and-noise tests of the VAD, Whisper and the Listener.
#[cfg(test)]
pub(crate) fn white_noise(n: usize, dbfs: f32, mut seed: u64) -> Vec<f32> {
    let peak = 10f32.powf(dbfs / 20.0) * 3f32.sqrt();
    (0..n)
        .map(|_| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            peak * ((seed >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::models::silero_vad::testdata::{load, read_wav};
    use crate::models::silero_vad::{ONNX_FILE, SAFETENSORS_FILE};

    fn model(file: &str) -> Option<Arc<SileroVad>> {
        load(file).map(Arc::new)
    }

    fn silence(ms: usize) -> Vec<f32> {
        vec![0.0; ms * 16]
    }

    /// Pushes `audio` in chunks cycling through `sizes`; all events in order.
    fn run(seg: &mut VadSegmenter, audio: &[f32], sizes: &[usize]) -> Vec<VadEvent> {
        let mut events = Vec::new();
        let mut at = 0;
        for &n in sizes.iter().cycle() {
            if at >= audio.len() {
                break;
            }
            let end = (at + n).min(audio.len());
            events.extend(seg.push(&audio[at..end]).expect("push"));
            at = end;
        }
        events
    }

    fn padded_speech() -> Vec<f32> {
        let mut audio = silence(1000);
        audio.extend(read_wav("speech.wav"));
        audio.extend(silence(1500));
        audio
    }

    #[test]
    fn padded_speech_is_one_turn() {
        for file in [ONNX_FILE, SAFETENSORS_FILE] {
            let Some(vad) = model(file) else { return };
            let audio = padded_speech();
            let mut seg = VadSegmenter::new(vad, VadConfig::default()).expect("segmenter");
            let events = run(&mut seg, &audio, &[320, 333, 1024, 7]);
            eprintln!("{file}: {events:?}");
            let [VadEvent::SpeechStarted { audio_start_ms: a }, VadEvent::SpeechStopped { audio_end_ms: b }] =
                events[..]
            else {
                panic!("{file}: expected one start/stop pair, got {events:?}");
            };
            // The clip (3.44 s) starts at 1000 ms with ~60 ms of lead-in and ends with
            // ~200 ms of fading: speech ~1.06..4.25 s.
            assert!((650..=1000).contains(&a), "{file}: start {a} ms");
            assert!((4500..=5100).contains(&b), "{file}: end {b} ms");
            assert_eq!(seg.utterance_start_ms(), a);
            assert_eq!(seg.utterance().len() as u64, (b - a) * 16, "{file}");
            assert!(!seg.is_speaking());
        }
    }

    #[test]
    fn a_pause_comes_before_the_stop_and_is_a_prefix_of_the_turn() {
        let Some(vad) = model(SAFETENSORS_FILE) else {
            return;
        };
        let audio = padded_speech();
        let mut seg = VadSegmenter::new(vad, VadConfig::default()).expect("segmenter");
        let mut pauses = Vec::new();
        let mut stopped = None;
        for w in audio.chunks(512) {
            for e in seg.push(w).expect("push") {
                if let VadEvent::SpeechStopped { .. } = e {
                    stopped = Some(seg.utterance().to_vec());
                }
            }
            if let Some(len) = seg.paused_len() {
                if pauses.last() != Some(&len) {
                    pauses.push(len);
                }
            }
            if stopped.is_some() {
                break;
            }
        }
        let utterance = stopped.expect("a turn");
        let last = *pauses.last().expect("a pause before the stop");
        // The turn is the paused prefix plus silence: 500 ms of it minus the 160 ms paused.
        let tail = utterance.len() - last;
        assert_eq!(
            tail,
            (16 * 500usize).div_ceil(512) * 512 - 5 * 512,
            "{pauses:?}"
        );
        assert!(seg.paused_len().is_none());
    }

    #[test]
    fn chunking_does_not_change_events() {
        let Some(vad) = model(ONNX_FILE) else { return };
        let audio = padded_speech();
        let mut want = None;
        for sizes in [&[512][..], &[1][..], &[160, 7, 999][..], &[audio.len()][..]] {
            let mut seg = VadSegmenter::new(vad.clone(), VadConfig::default()).expect("seg");
            let events = run(&mut seg, &audio, sizes);
            let got = (events, seg.utterance().to_vec());
            match &want {
                None => want = Some(got),
                Some(w) => assert!(*w == got, "chunks {sizes:?}"),
            }
        }
    }

    #[test]
    fn speech_at_stream_start_clamps_padding_to_zero() {
        let Some(vad) = model(ONNX_FILE) else { return };
        let mut audio = read_wav("speech.wav");
        audio.extend(silence(1000));
        let mut seg = VadSegmenter::new(vad, VadConfig::default()).expect("seg");
        let events = run(&mut seg, &audio, &[512]);
        assert_eq!(events.len(), 2, "{events:?}");
        assert_eq!(events[0], VadEvent::SpeechStarted { audio_start_ms: 0 });

        // reset() starts a new stream: same events again. Cut mid-speech, flush()
        // ends the turn at the audio consumed so far.
        seg.reset();
        assert_eq!((seg.elapsed_ms(), seg.utterance().len()), (0, 0));
        let cut = 2 * 16_000 + 100;
        let events = run(&mut seg, &audio[..cut], &[512]);
        assert_eq!(events, vec![VadEvent::SpeechStarted { audio_start_ms: 0 }]);
        assert!(seg.is_speaking());
        let end = seg.elapsed_ms();
        assert_eq!(end, (cut / 512 * 512 / 16) as u64);
        assert_eq!(
            seg.flush(),
            Some(VadEvent::SpeechStopped { audio_end_ms: end })
        );
        assert_eq!(seg.flush(), None);
        assert_eq!(seg.take_utterance().len() as u64, end * 16);
        assert!(seg.utterance().is_empty());
    }

    #[test]
    fn silence_and_noise_have_no_turns() {
        let Some(vad) = model(ONNX_FILE) else { return };
        for name in ["silence.wav", "noise.wav"] {
            let audio = read_wav(name);
            let mut seg = VadSegmenter::new(vad.clone(), VadConfig::default()).expect("seg");
            assert_eq!(run(&mut seg, &audio, &[480]), vec![], "{name}");
            assert!(seg.utterance().is_empty());
            assert_eq!(seg.flush(), None);
        }
    }

    #[test]
    fn mix_has_two_turns_and_min_speech_guards() {
        let Some(vad) = model(ONNX_FILE) else { return };
        let audio = read_wav("mix.wav");
        let mut seg = VadSegmenter::new(vad.clone(), VadConfig::default()).expect("seg");
        let events = run(&mut seg, &audio, &[320]);
        eprintln!("mix: {events:?}");
        assert_eq!(events.len(), 4, "{events:?}");
        assert!(matches!(events[0], VadEvent::SpeechStarted { .. }));
        assert!(matches!(events[1], VadEvent::SpeechStopped { .. }));
        assert!(matches!(events[2], VadEvent::SpeechStarted { .. }));
        assert!(matches!(events[3], VadEvent::SpeechStopped { .. }));

        // "Good morning." holds ~0.6 s of speech, the second sentence more than 1 s
        // without a gap: a 1 s guard only lets the second through.
        let config = VadConfig {
            min_speech_ms: 1000,
            ..VadConfig::default()
        };
        let mut seg = VadSegmenter::new(vad, config).expect("seg");
        let guarded = run(&mut seg, &audio, &[320]);
        eprintln!("mix, min_speech_ms 1000: {guarded:?}");
        assert_eq!(guarded.len(), 2, "{guarded:?}");
        let (VadEvent::SpeechStarted { audio_start_ms: a }, VadEvent::SpeechStopped { .. }) =
            (guarded[0], guarded[1])
        else {
            panic!("{guarded:?}");
        };
        let VadEvent::SpeechStarted {
            audio_start_ms: second,
        } = events[2]
        else {
            unreachable!()
        };
        // Same speech start (at most a gap-split later), prefix padding included.
        assert!(a >= second && a <= second + 600, "{a} vs {second}");
    }

    #[test]
    fn long_speech_is_split_at_max_utterance() {
        let Some(vad) = model(ONNX_FILE) else { return };
        let clip = read_wav("speech.wav");
        // Speech with no gap long enough to end a turn, 24 s; 5 s utterances.
        let audio: Vec<f32> = clip.iter().copied().cycle().take(24 * 16_000).collect();
        let config = VadConfig {
            max_utterance_ms: 5000,
            silence_duration_ms: 1500,
            ..VadConfig::default()
        };
        let mut seg = VadSegmenter::new(vad, config).expect("seg");
        let mut events = Vec::new();
        let mut longest = 0;
        for chunk in audio.chunks(1600) {
            events.extend(seg.push(chunk).expect("push"));
            longest = longest.max(seg.utterance().len());
        }
        eprintln!("long speech: {events:?}");
        assert!(longest <= 5000 * 16, "{longest}");
        assert!(events.len() >= 8, "{events:?}");
        let mut start = None;
        for e in events {
            match e {
                VadEvent::SpeechStarted { audio_start_ms } => start = Some(audio_start_ms),
                VadEvent::SpeechStopped { audio_end_ms } => {
                    let s = start.take().expect("stop after start");
                    assert!(audio_end_ms - s <= 5000, "{s}..{audio_end_ms}");
                }
            }
        }
    }

    #[test]
    fn ten_minute_stream_stays_bounded() {
        let Some(vad) = model(ONNX_FILE) else { return };
        let noise = read_wav("noise.wav");
        let speech = read_wav("speech.wav");
        let config = VadConfig::default();
        let bound = 512 + (300 + 256) * 16 + 512 + 30_000 * 16;
        let mut seg = VadSegmenter::new(vad, config).expect("seg");
        let t = Instant::now();
        // 10 min: silence and noise, with a sentence every minute.
        let mut turns = 0;
        let mut retained = Vec::new();
        for minute in 0..10 {
            let mut block = silence(20_000);
            block.extend(noise.iter().map(|s| s * 0.3));
            block.extend(silence(17_000 - noise.len() / 16));
            block.extend(&speech);
            block.resize(60 * 16_000, 0.0);
            assert_eq!(block.len(), 60 * 16_000);
            for chunk in block.chunks(320) {
                turns += seg
                    .push(chunk)
                    .expect("push")
                    .iter()
                    .filter(|e| matches!(e, VadEvent::SpeechStarted { .. }))
                    .count();
                assert!(
                    seg.retained_samples() <= bound,
                    "{}",
                    seg.retained_samples()
                );
            }
            retained.push(seg.retained_samples());
            assert_eq!(seg.elapsed_ms(), (minute + 1) * 60_000);
        }
        let dt = t.elapsed();
        eprintln!(
            "10 min stream: {turns} turns, retained {retained:?} samples, {dt:.2?} ({:.1} us/window)",
            dt.as_secs_f64() * 1e6 / 18_750.0
        );
        assert_eq!(turns, 10);
        assert!(retained.windows(2).all(|w| w[0] == w[1]), "{retained:?}");
    }

    #[test]
    fn bad_input_and_config_are_refused() {
        let Some(vad) = model(ONNX_FILE) else { return };
        for config in [
            VadConfig {
                threshold: 1.5,
                ..VadConfig::default()
            },
            VadConfig {
                threshold: f32::NAN,
                ..VadConfig::default()
            },
            VadConfig {
                prefix_padding_ms: 60_000,
                ..VadConfig::default()
            },
            VadConfig {
                max_utterance_ms: 3_600_000,
                ..VadConfig::default()
            },
        ] {
            assert!(matches!(
                VadSegmenter::new(vad.clone(), config),
                Err(ModelError::Invalid(_))
            ));
        }
        let mut seg = VadSegmenter::new(vad, VadConfig::default()).expect("seg");
        seg.push(&[0.0; 100]).expect("push");
        assert!(seg.push(&[0.0, f32::NAN]).is_err());
        assert_eq!(seg.pending.len(), 100);
    }

    /// `ms` of reproducible white noise at `dbfs` RMS, 16 kHz.
    fn white_noise(ms: usize, dbfs: f32, seed: u64) -> Vec<f32> {
        super::white_noise(ms * 16, dbfs, seed)
    }

    fn filter(file: &str) -> Option<SpeechFilter> {
        let vad = model(file)?;
        Some(SpeechFilter::new(vad, SpeechFilterConfig::default()).expect("filter"))
    }

    #[test]
    fn speech_filter_finds_nothing_in_silence_and_noise() {
        for file in [ONNX_FILE, SAFETENSORS_FILE] {
            let Some(f) = filter(file) else { return };
            for (name, audio) in [
                ("digital silence", silence(60_000)),
                ("-60 dBFS noise", white_noise(60_000, -60.0, 7)),
                ("-20 dBFS noise (noise.wav)", read_wav("noise.wav")),
            ] {
                let t = Instant::now();
                let r = f.regions(&audio).expect("regions");
                assert!(r.is_empty(), "{file}: {name}: {r:?}");
                assert!(f.speech(&audio).expect("speech").is_empty());
                eprintln!("{file}: {name}: no speech ({:.2?})", t.elapsed());
            }
        }
    }

    #[test]
    fn speech_filter_keeps_padded_speech() {
        for file in [ONNX_FILE, SAFETENSORS_FILE] {
            let Some(f) = filter(file) else { return };
            // 1 s of silence, the clip (speech ~1.06..4.25 s), 3 s of silence: one region,
            // 400 ms of padding on each side.
            let clip = read_wav("speech.wav");
            let mut audio = silence(1000);
            audio.extend_from_slice(&clip);
            audio.extend(silence(3000));
            let r = f.regions(&audio).expect("regions");
            eprintln!("{file}: padded speech: {r:?} of {}", audio.len());
            assert_eq!(r.len(), 1, "{file}: {r:?}");
            assert!((9_600..=11_200).contains(&r[0].start), "{file}: {r:?}");
            assert!((72_000..=78_400).contains(&r[0].end), "{file}: {r:?}");
            let speech = f.speech(&audio).expect("speech");
            assert_eq!(speech, audio[r[0].clone()]);

            // Silence shorter than min_silence_ms after speech stays in its region, to the end
            // (not a whole number of windows) here.
            let mut audio = clip.clone();
            audio.extend(silence(1500));
            let r = f.regions(&audio).expect("regions");
            assert_eq!(r.len(), 1, "{file}: {r:?}");
            assert_eq!((r[0].start, r[0].end), (0, audio.len()), "{file}");

            // Two clips 5 s apart are two regions; 1 s apart (under min_silence_ms), one.
            for (gap_ms, regions) in [(5_000, 2), (1_000, 1)] {
                let mut two = clip.clone();
                two.extend(silence(gap_ms));
                two.extend_from_slice(&clip);
                let r = f.regions(&two).expect("regions");
                eprintln!("{file}: gap {gap_ms} ms: {r:?}");
                assert_eq!(r.len(), regions, "{file}: gap {gap_ms} ms: {r:?}");
                assert!(r.windows(2).all(|w| w[0].end <= w[1].start), "{r:?}");
                assert_eq!(r.last().map(|r| r.end), Some(two.len()));
            }
        }
    }

    #[test]
    fn speech_filter_refuses_bad_input() {
        let Some(vad) = model(SAFETENSORS_FILE) else {
            return;
        };
        for threshold in [1.5, -0.1, f32::NAN] {
            let config = SpeechFilterConfig {
                threshold,
                ..SpeechFilterConfig::default()
            };
            assert!(matches!(
                SpeechFilter::new(vad.clone(), config),
                Err(ModelError::Invalid(_))
            ));
        }
        let f = SpeechFilter::new(vad, SpeechFilterConfig::default()).expect("filter");
        assert!(matches!(
            f.regions(&[0.0, f32::INFINITY]),
            Err(ModelError::Invalid(_))
        ));
        assert!(f.regions(&[]).expect("empty").is_empty());
    }
}
