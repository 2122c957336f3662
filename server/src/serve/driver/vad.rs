//! The turn detector: Silero VAD over a session's input audio, on a
//! blocking worker of its own (inference never runs on the async workers),
//! reporting [`Speech`] in the order it was heard.

use tokio::sync::mpsc;

use omnistream_codecs::pcm::pcm16_le_to_f32;
use omnistream_codecs::StreamResampler;
use omnistream_stages::engine::TRANSCRIBE_RATE;
use omnistream_stages::vad::{VadEvent, VadSegmenter};

use crate::serve::conversation::{Speech, TurnSettings};
use crate::serve::error::ClientError;
use crate::serve::state::VadHub;

/// Silero's window at 16 kHz.
const VAD_WINDOW: usize = 512;
/// Audio messages queued for the worker before the session's reader waits.
const QUEUE: usize = 64;

enum Cmd {
    Audio(Vec<u8>),
    Clear,
    /// The client's audio ended: the utterance under way ends here.
    Finish,
}

/// What the worker reports.
pub enum Heard {
    Speech(Speech),
    /// After [`Detector::finish`]: the utterance that was under way.
    Finished(Option<Vec<f32>>),
    Error(ClientError),
}

/// A session's handle on its detector; dropping it stops the worker.
pub struct Detector {
    tx: mpsc::Sender<Cmd>,
}

impl Detector {
    /// Starts the worker: pcm16 at `rate` in, [`Heard`] out on `events`.
    pub fn start(
        settings: &TurnSettings,
        hub: &VadHub,
        rate: u32,
        events: mpsc::UnboundedSender<Heard>,
    ) -> Result<Self, ClientError> {
        let fail = |e: String| ClientError::server("vad_unavailable", e);
        let seg = VadSegmenter::new(hub.model.clone(), settings.vad.clone())
            .map_err(|e| fail(e.to_string()))?;
        let resampler = (rate != TRANSCRIBE_RATE)
            .then(|| StreamResampler::new(rate, TRANSCRIBE_RATE))
            .transpose()
            .map_err(|e| fail(e.to_string()))?;
        let (tx, rx) = mpsc::channel(QUEUE);
        let worker = Worker {
            seg,
            resampler,
            paused: None,
        };
        tokio::task::spawn_blocking(move || worker.run(rx, events));
        Ok(Self { tx })
    }

    /// Feeds pcm16 LE (waits while the worker is `QUEUE` messages behind).
    pub async fn push(&self, pcm: Vec<u8>) {
        let _ = self.tx.send(Cmd::Audio(pcm)).await;
    }

    pub async fn clear(&self) {
        let _ = self.tx.send(Cmd::Clear).await;
    }

    /// Ends the utterance under way; [`Heard::Finished`] follows everything
    /// the audio before it produced.
    pub async fn finish(&self) {
        let _ = self.tx.send(Cmd::Finish).await;
    }
}

struct Worker {
    seg: VadSegmenter,
    resampler: Option<StreamResampler>,
    /// Length of the utterance at its pause, while the pause lasts.
    paused: Option<usize>,
}

impl Worker {
    fn run(mut self, mut rx: mpsc::Receiver<Cmd>, events: mpsc::UnboundedSender<Heard>) {
        while let Some(cmd) = rx.blocking_recv() {
            let out = match cmd {
                Cmd::Audio(pcm) => match self.push(&pcm) {
                    Ok(s) => s.into_iter().map(Heard::Speech).collect(),
                    Err(e) => vec![Heard::Error(e)],
                },
                Cmd::Clear => {
                    self.clear();
                    Vec::new()
                }
                Cmd::Finish => vec![Heard::Finished(self.finish())],
            };
            for h in out {
                if events.send(h).is_err() {
                    return;
                }
            }
        }
    }

    fn push(&mut self, pcm16: &[u8]) -> Result<Vec<Speech>, ClientError> {
        let bad = |e: String| ClientError::invalid("invalid_audio", e);
        let samples = pcm16_le_to_f32(pcm16).map_err(|e| bad(e.to_string()))?;
        let samples = match self.resampler.as_mut() {
            Some(r) => r.process(&samples).map_err(|e| bad(e.to_string()))?,
            None => samples,
        };
        let mut heard = Vec::new();
        // A window at a time: at most one event per push, so each turn gets
        // its own audio however much arrives at once.
        for chunk in samples.chunks(VAD_WINDOW) {
            for e in self.seg.push(chunk).map_err(|e| bad(e.to_string()))? {
                match e {
                    VadEvent::SpeechStarted { audio_start_ms } => {
                        self.paused = None;
                        heard.push(Speech::Started { audio_start_ms });
                    }
                    VadEvent::SpeechStopped { audio_end_ms } => {
                        heard.push(self.stopped(audio_end_ms));
                    }
                }
            }
            match (self.seg.paused_len(), self.paused) {
                (Some(len), p) if p != Some(len) => {
                    self.paused = Some(len);
                    let audio = self.seg.utterance()[..len].to_vec();
                    heard.push(Speech::Paused { audio });
                }
                (None, Some(_)) if self.seg.is_speaking() => {
                    // Speech went on: the paused audio is not the turn.
                    self.paused = None;
                    heard.push(Speech::Resumed);
                }
                _ => {}
            }
        }
        Ok(heard)
    }

    /// The turn that just ended: trailing silence past its pause trimmed
    /// (what a transcription started at the pause heard).
    fn stopped(&mut self, audio_end_ms: u64) -> Speech {
        let mut audio = self.seg.take_utterance();
        if let Some(len) = self.paused.take() {
            audio.truncate(len);
        }
        Speech::Stopped {
            audio_end_ms,
            audio,
        }
    }

    fn finish(&mut self) -> Option<Vec<f32>> {
        let VadEvent::SpeechStopped { audio_end_ms } = self.seg.flush()? else {
            return None;
        };
        match self.stopped(audio_end_ms) {
            Speech::Stopped { audio, .. } => Some(audio),
            _ => None,
        }
    }

    /// Forgets the audio so far; the clock keeps running.
    fn clear(&mut self) {
        if self.seg.is_speaking() {
            self.seg.flush();
        }
        self.seg.take_utterance();
        self.paused = None;
    }
}
