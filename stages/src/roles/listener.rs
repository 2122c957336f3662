//! Listener stage: speech -> the user's words, for Thinkers that cannot hear.
//!
//! A transcription is its own request (`RequestInput::Transcribe`, 16 kHz
//! mono): the server learns the transcript first, can refuse a blank one (no
//! phantom turn from noise), puts it in the conversation, and only then asks
//! the Thinker. One utterance per step: a step is a whole recognition (a few
//! hundred milliseconds for a short turn), and a cancelled request leaves the
//! queue at the next step.
//!
//! With a [`SpeechFilter`] (the profile's `server.vad` model), only the speech
//! regions of the audio reach the recognizer, as faster-whisper's `vad_filter`:
//! Whisper makes words up on silence and noise ("you you you"), and audio
//! without speech is answered with no words and no recognition at all.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::engine::{Event, Payload, RequestCtx, RequestId, RequestInput, StageModel, StepOutput};
use crate::models::whisper::WhisperAsr;
use crate::models::{ModelError, Result};
use crate::vad::SpeechFilter;

/// A speech recognizer as the Listener uses it.
pub trait Transcriber: Send + Sync {
    /// The words in `pcm` (mono f32 at 16 kHz), trimmed; empty when none.
    fn transcribe(&self, pcm: &[f32]) -> Result<String>;
}

impl Transcriber for WhisperAsr {
    fn transcribe(&self, pcm: &[f32]) -> Result<String> {
        WhisperAsr::transcribe(self, pcm)
    }
}

pub struct Listener {
    asr: Arc<dyn Transcriber>,
    /// None: the recognizer hears all of the audio (and judges silence itself).
    filter: Option<SpeechFilter>,
    queue: VecDeque<Arc<RequestCtx>>,
}

impl Listener {
    pub fn new(asr: Arc<dyn Transcriber>, filter: Option<SpeechFilter>) -> Self {
        Self {
            asr,
            filter,
            queue: VecDeque::new(),
        }
    }

    /// The words in `audio`: its speech only, when there is a filter.
    fn hear(&self, audio: &[f32]) -> Result<String> {
        let Some(filter) = &self.filter else {
            return self.asr.transcribe(audio);
        };
        let speech = filter.speech(audio)?;
        if speech.is_empty() {
            return Ok(String::new());
        }
        self.asr.transcribe(&speech)
    }
}

impl StageModel for Listener {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        if !matches!(ctx.spec.input, RequestInput::Transcribe { .. }) {
            return Err(ModelError::Invalid(
                "the Listener takes speech to transcribe".into(),
            ));
        }
        self.queue.push_back(ctx);
        Ok(())
    }

    fn push(&mut self, _id: RequestId, _payload: Payload) -> Result<()> {
        Err(ModelError::Invalid(
            "the Listener takes its audio with the request".into(),
        ))
    }

    fn step(&mut self, out: &mut StepOutput) {
        let Some(ctx) = self.queue.pop_front() else {
            return;
        };
        out.batch = 1;
        if ctx.is_cancelled() {
            return;
        }
        let RequestInput::Transcribe { audio } = &ctx.spec.input else {
            return;
        };
        match self.hear(audio) {
            Ok(text) => {
                let text = text.trim();
                if !text.is_empty() {
                    ctx.emit(Event::TextDelta(text.to_string()));
                }
                out.finished.push(ctx.id);
            }
            Err(e) => out.failed.push((ctx.id, e)),
        }
    }

    fn remove(&mut self, id: RequestId) {
        self.queue.retain(|c| c.id != id);
    }

    fn has_ready_work(&self) -> bool {
        !self.queue.is_empty()
    }

    fn active(&self) -> usize {
        self.queue.len()
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;

    use candle_core::Device;

    use super::*;
    use crate::models::silero_vad::{SileroVad, SAFETENSORS_FILE};
    use crate::models::whisper::{read_wav_16k, SAMPLE_RATE};
    use crate::vad::SpeechFilterConfig;

    /// The real recognizer, counting its calls and the audio it was given.
    struct Counting {
        asr: WhisperAsr,
        calls: AtomicUsize,
        heard: Mutex<Vec<usize>>,
    }

    impl Transcriber for Counting {
        fn transcribe(&self, pcm: &[f32]) -> Result<String> {
            self.calls.fetch_add(1, Ordering::SeqCst);
            self.heard.lock().expect("lock").push(pcm.len());
            self.asr.transcribe(pcm)
        }
    }

    /// Whisper tiny.en and the profile's VAD (deploy/tiny-cpu.yaml), or None (after a
    /// message) when `omnistream fetch-models` has not put them in models/.
    fn models() -> Option<(WhisperAsr, SileroVad)> {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../models");
        let (whisper, vad) = (
            root.join("whisper-tiny-en"),
            root.join("silero-vad").join(SAFETENSORS_FILE),
        );
        if !whisper.join("model.bin").exists() || !vad.exists() {
            eprintln!("SKIP: models not found under {}", root.display());
            return None;
        }
        Some((
            WhisperAsr::load(&whisper, &Device::Cpu).expect("whisper"),
            SileroVad::load(&vad, &Device::Cpu).expect("silero vad"),
        ))
    }

    /// `seconds` of reproducible white noise at `dbfs` RMS, 16 kHz.
    fn white_noise(seconds: usize, dbfs: f32, seed: u64) -> Vec<f32> {
        crate::vad::white_noise(seconds * SAMPLE_RATE, dbfs, seed)
    }

    /// Lower-case words, punctuation dropped.
    fn words(text: &str) -> Vec<String> {
        text.split_whitespace()
            .map(|w| {
                w.chars()
                    .filter(|c| c.is_alphanumeric())
                    .collect::<String>()
                    .to_lowercase()
            })
            .filter(|w| !w.is_empty())
            .collect()
    }

    #[test]
    fn the_vad_gate_keeps_silence_and_noise_from_whisper() {
        let Some((asr, vad)) = models() else { return };
        let speech =
            read_wav_16k(&Path::new(env!("CARGO_MANIFEST_DIR")).join("testdata/whisper/s04.wav"))
                .expect("s04");
        let alone = asr.transcribe(&speech).expect("s04");
        assert_eq!(alone, "Turn left at the next traffic light.");
        let counting = Arc::new(Counting {
            asr,
            calls: AtomicUsize::new(0),
            heard: Mutex::new(Vec::new()),
        });
        let filter = SpeechFilter::new(Arc::new(vad), SpeechFilterConfig::default()).expect("f");
        let listener = Listener::new(counting.clone(), Some(filter));

        // No speech: no words, and Whisper is not run at all.
        for (name, audio) in [
            ("digital silence", vec![0.0; 60 * SAMPLE_RATE]),
            ("-60 dBFS noise", white_noise(60, -60.0, 7)),
        ] {
            assert_eq!(listener.hear(&audio).expect(name), "", "{name}");
            assert_eq!(counting.calls.load(Ordering::SeqCst), 0, "{name}");
        }

        // Speech between 20 s of silence and 20 s of noise: the same words as on its own
        // (casing and punctuation may differ: Whisper hears it with other edges), from the
        // speech region alone.
        let mut audio = vec![0.0; 20 * SAMPLE_RATE];
        audio.extend_from_slice(&speech);
        audio.extend(white_noise(20, -60.0, 9));
        let got = listener.hear(&audio).expect("speech");
        eprintln!("heard {got:?}");
        assert_eq!(words(&got), words(&alone), "{got:?}");
        let heard = counting.heard.lock().expect("lock").clone();
        eprintln!("whisper heard {heard:?} samples of {}", audio.len());
        assert_eq!(heard.len(), 1);
        assert!(heard[0] <= speech.len() + SAMPLE_RATE, "{heard:?}");

        // Without a filter the recognizer hears everything (and judges silence itself).
        let plain = Listener::new(counting.clone(), None);
        assert_eq!(plain.hear(&[0.0; 16_000]).expect("silence"), "");
        assert_eq!(counting.calls.load(Ordering::SeqCst), 2);
    }
}
