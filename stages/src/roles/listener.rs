//! Listener stage: speech -> the user's words, for Thinkers that cannot hear.
//!
//! A transcription is its own request (`RequestInput::Transcribe`, 16 kHz
//! mono): the server learns the transcript first, can refuse a blank one (no
//! phantom turn from noise), puts it in the conversation, and only then asks
//! the Thinker. One utterance per step: a step is a whole recognition (a few
//! hundred milliseconds for a short turn), and a cancelled request leaves the
//! queue at the next step.

use std::collections::VecDeque;
use std::sync::Arc;

use crate::engine::{Event, Payload, RequestCtx, RequestId, RequestInput, StageModel, StepOutput};
use crate::models::whisper::WhisperAsr;
use crate::models::{ModelError, Result};

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
    queue: VecDeque<Arc<RequestCtx>>,
}

impl Listener {
    pub fn new(asr: Arc<dyn Transcriber>) -> Self {
        Self {
            asr,
            queue: VecDeque::new(),
        }
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
        match self.asr.transcribe(audio) {
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
