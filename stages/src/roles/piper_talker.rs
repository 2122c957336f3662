//! Talker stage for a Piper VITS voice: text spans -> phonemes (espeak-ng, out of
//! process) -> latent frames (text encoder + duration predictor + flow).
//!
//! With `async_chunk` the stage speaks each speakable span (a clause boundary
//! after `min_span_chars`, or `max_span_tokens` deltas) while the Thinker is
//! still writing; without it, it waits for the whole text.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use candle_core::Tensor;
use rand::rngs::StdRng;
use rand::SeedableRng;

use super::take_ready;
use crate::engine::{FrameChunk, Payload, RequestCtx, RequestId, StageModel, StepOutput};
use crate::models::phonemize::{speakable_boundary, Phonemizer};
use crate::models::piper::{PiperVoice, Scales};
use crate::models::{ModelError, Result};

/// Span policy between the Thinker and this Talker.
#[derive(Debug, Clone, Copy)]
pub struct SpanPolicy {
    pub async_chunk: bool,
    pub min_span_chars: usize,
    pub max_span_tokens: usize,
    /// `max_span_tokens` for the first span of a request.
    pub initial_span_tokens: usize,
}

struct TalkReq {
    text: String,
    deltas: usize,
    upstream_done: bool,
    /// Spans spoken so far.
    spans: usize,
    scales: Scales,
    rng: StdRng,
}

pub struct PiperTalker {
    voice: Arc<PiperVoice>,
    voice_name: String,
    phonemizer: Phonemizer,
    scales: Scales,
    seed: Option<u64>,
    policy: SpanPolicy,
    max_num_seqs: usize,
    reqs: HashMap<RequestId, TalkReq>,
    order: VecDeque<RequestId>,
}

impl PiperTalker {
    pub fn new(
        voice: Arc<PiperVoice>,
        voice_name: String,
        scales: Scales,
        seed: Option<u64>,
        policy: SpanPolicy,
        max_num_seqs: usize,
    ) -> Result<Self> {
        let phonemizer = Phonemizer::new(&voice.config().espeak_voice)?;
        Ok(Self {
            voice,
            voice_name,
            phonemizer,
            scales,
            seed,
            policy,
            max_num_seqs,
            reqs: HashMap::new(),
            order: VecDeque::new(),
        })
    }

    fn token_limit(&self, r: &TalkReq) -> usize {
        if r.spans == 0 {
            self.policy.initial_span_tokens
        } else {
            self.policy.max_span_tokens
        }
    }

    /// The next span to speak, if one is ready, removed from the buffer.
    fn take_span(&self, r: &mut TalkReq) -> Option<String> {
        let span = self.cut_span(r)?;
        r.spans += 1;
        Some(span)
    }

    fn cut_span(&self, r: &mut TalkReq) -> Option<String> {
        if r.upstream_done {
            if !self.policy.async_chunk {
                return Some(std::mem::take(&mut r.text));
            }
            // Finish sentence by sentence, so the first audio comes early.
            let cut =
                speakable_boundary(&r.text, self.policy.min_span_chars).unwrap_or(r.text.len());
            return Some(r.text.drain(..cut).collect());
        }
        if !self.policy.async_chunk {
            return None;
        }
        if let Some(cut) = speakable_boundary(&r.text, self.policy.min_span_chars) {
            r.deltas = 0;
            return Some(r.text.drain(..cut).collect());
        }
        if r.deltas >= self.token_limit(r) {
            // No clause boundary for a while: cut at the last word boundary.
            let cut = r.text.rfind(char::is_whitespace)?;
            if cut == 0 {
                return None;
            }
            r.deltas = 0;
            return Some(r.text.drain(..cut).collect());
        }
        None
    }

    fn is_ready(&self, r: &TalkReq) -> bool {
        if r.upstream_done {
            return true;
        }
        self.policy.async_chunk
            && (speakable_boundary(&r.text, self.policy.min_span_chars).is_some()
                || (r.deltas >= self.token_limit(r)
                    && r.text
                        .trim_end()
                        .rfind(char::is_whitespace)
                        .is_some_and(|i| i > 0)))
    }

    fn synthesize(&self, text: &str, scales: &Scales, rng: &mut StdRng) -> Result<Option<Tensor>> {
        let mut parts = Vec::new();
        for phonemes in self.phonemizer.phonemize(text)? {
            let ids = self.voice.phoneme_ids(&phonemes);
            // BOS, pad, EOS only: nothing speakable (punctuation, emoji).
            if ids.len() <= 3 {
                continue;
            }
            parts.push(self.voice.latents(&ids, scales, rng)?);
        }
        if parts.is_empty() {
            return Ok(None);
        }
        Ok(Some(Tensor::cat(&parts, 2)?))
    }
}

impl StageModel for PiperTalker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        if let Some(v) = &ctx.spec.voice {
            if !v.eq_ignore_ascii_case(&self.voice_name) {
                return Err(ModelError::Invalid(format!(
                    "unknown voice {v:?} (available: {})",
                    self.voice_name
                )));
            }
        }
        let mut scales = self.scales.clone();
        if let Some(speed) = ctx.spec.sampling.speed {
            if !(0.25..=4.0).contains(&speed) {
                return Err(ModelError::Invalid(format!(
                    "speed {speed} is out of range [0.25, 4.0]"
                )));
            }
            scales.length_scale /= speed;
        }
        let seed = ctx.spec.sampling.seed.or(self.seed).unwrap_or(ctx.id);
        self.reqs.insert(
            ctx.id,
            TalkReq {
                text: String::new(),
                deltas: 0,
                upstream_done: false,
                spans: 0,
                scales,
                rng: StdRng::seed_from_u64(seed),
            },
        );
        self.order.push_back(ctx.id);
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Text(chunk) = payload else {
            return Err(ModelError::Invalid("the Talker takes text".into()));
        };
        if let Some(r) = self.reqs.get_mut(&id) {
            r.text.push_str(&chunk.text);
            r.deltas += 1;
            r.upstream_done |= chunk.finished;
        }
        Ok(())
    }

    fn step(&mut self, out: &mut StepOutput) {
        let mut order = std::mem::take(&mut self.order);
        let ready = take_ready(&mut order, self.max_num_seqs, |id| {
            self.reqs.get(id).is_some_and(|r| self.is_ready(r))
        });
        self.order = order;
        out.batch = ready.len();
        for id in ready {
            let Some(mut r) = self.reqs.remove(&id) else {
                continue;
            };
            let Some(span) = self.take_span(&mut r) else {
                self.reqs.insert(id, r);
                continue;
            };
            let last = r.upstream_done && r.text.trim().is_empty();
            let frames = match self.synthesize(&span, &r.scales.clone(), &mut r.rng) {
                Ok(f) => f,
                Err(e) => {
                    self.order.retain(|x| *x != id);
                    out.failed.push((id, e));
                    continue;
                }
            };
            if frames.is_some() || last {
                out.downstream.push((
                    id,
                    Payload::Frames(FrameChunk {
                        frames,
                        finished: last,
                    }),
                ));
            }
            if last {
                self.order.retain(|x| *x != id);
                out.finished.push(id);
            } else {
                self.reqs.insert(id, r);
            }
        }
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
        self.order.retain(|x| *x != id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| self.is_ready(r))
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}
