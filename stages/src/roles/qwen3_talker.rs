//! Talker stage for Qwen3-Omni: the Thinker's states in, one codec frame (16
//! codes, 80 ms) per step out.
//!
//! The Talker starts once the Thinker has fed back its first answer token (the
//! prompt's last position is that token over the codec's BOS), then consumes one
//! text vector per frame: the next answer token's embedding, `tts_eos` once the
//! text has ended, `tts_pad` after that. A frame whose text is not there yet
//! waits for the Thinker; its code 0 is drawn once and kept. This is the
//! reference's `generate` exactly, streamed.

use std::sync::Arc;

use candle_core::{DType, Tensor};

use super::qwen3_thinker::sampling_config;
use super::Requests;
use crate::engine::{
    FrameChunk, Payload, PromptStates, RequestCtx, RequestId, StageModel, StepOutput,
};
use crate::models::qwen3_omni::omni::{Qwen3Omni, ThinkerTrace};
use crate::models::qwen3_omni::sampling::{Sampler, SamplingConfig};
use crate::models::qwen3_omni::talker::TalkerState;
use crate::models::{ModelError, Result};
use crate::profile::SamplingParams;

/// Code-0 tokens a request may draw when the profile sets no `max_tokens` (the
/// reference's `talker_max_new_tokens`; 4096 frames = 5.5 minutes).
const DEFAULT_MAX_FRAMES: usize = 4096;

struct Req {
    speaker: u32,
    prompt: Option<Arc<PromptStates>>,
    /// Embeddings of the answer tokens the Thinker fed back, one row each.
    fed: Vec<Tensor>,
    upstream_done: bool,
    state: Option<TalkerState>,
    /// The next frame's code-0 logits `(vocab,)`.
    logits: Option<Tensor>,
    /// Drawn but not yet spoken (its text vector has not arrived).
    code0: Option<u32>,
    frames: usize,
    sampler: Sampler,
    cp_sampler: Sampler,
    max_frames: usize,
}

pub struct Qwen3OmniTalker {
    model: Arc<Qwen3Omni>,
    defaults: SamplingParams,
    cp_defaults: SamplingConfig,
    default_voice: String,
    max_num_seqs: usize,
    reqs: Requests<Req>,
}

enum Text {
    Ready(Tensor),
    Wait,
}

impl Qwen3OmniTalker {
    pub fn new(
        model: Arc<Qwen3Omni>,
        defaults: SamplingParams,
        code_predictor: Option<SamplingParams>,
        default_voice: String,
        max_num_seqs: usize,
    ) -> Result<Self> {
        if model.config().talker.speaker(&default_voice).is_none() {
            return Err(ModelError::Invalid(format!(
                "unknown voice {default_voice:?}; the model has {:?}",
                Self::voice_names(&model)
            )));
        }
        // The reference: code predictor top_k 50, top_p 0.8 when the Talker samples.
        let cp_defaults = match &code_predictor {
            Some(p) => sampling_config(p, None, 0),
            None => {
                let sample = defaults.temperature.unwrap_or(0.9) > 1e-7;
                SamplingConfig::code_predictor().with_do_sample(sample)
            }
        };
        Ok(Self {
            model,
            defaults,
            cp_defaults,
            default_voice,
            max_num_seqs,
            reqs: Requests::default(),
        })
    }

    /// The checkpoint's voices, sorted.
    pub fn voice_names(model: &Qwen3Omni) -> Vec<String> {
        let mut v: Vec<String> = model.config().talker.speaker_id.keys().cloned().collect();
        v.sort();
        v
    }

    fn is_ready(&self, r: &Req) -> bool {
        if r.state.is_none() {
            return r.prompt.is_some() && (!r.fed.is_empty() || r.upstream_done);
        }
        // Frame f needs answer token f + 1, or the end of the answer.
        r.code0.is_none() || r.frames + 1 < r.fed.len() || r.upstream_done
    }

    /// The text vector frame `f` consumes: the answer token after the first one,
    /// `tts_eos` right after the last, then `tts_pad`.
    fn text_for(&self, r: &Req, f: usize) -> Result<Text> {
        let tts = self.model.tts();
        let n = r.fed.len();
        Ok(if f + 1 < n {
            Text::Ready(self.model.text_vectors(&r.fed[f + 1])?)
        } else if !r.upstream_done {
            Text::Wait
        } else if f + 1 == n {
            Text::Ready(tts.eos.unsqueeze(0)?)
        } else {
            Text::Ready(tts.pad.unsqueeze(0)?)
        })
    }

    /// Advances `r` by what is possible now; returns whether it finished.
    fn advance(&self, id: RequestId, r: &mut Req, out: &mut StepOutput) -> Result<bool> {
        let talker = self.model.talker();
        if r.state.is_none() {
            let Some(prompt) = r.prompt.clone() else {
                return Ok(false);
            };
            if r.fed.is_empty() {
                // The Thinker ended on its first token: nothing to say.
                out.downstream.push((
                    id,
                    Payload::Frames(FrameChunk {
                        frames: None,
                        finished: true,
                    }),
                ));
                return Ok(true);
            }
            let embeds = Tensor::cat(&[&prompt.embeds, &r.fed[0]], 0)?;
            let inputs = self.model.talker_prompt(
                &ThinkerTrace {
                    prompt: &prompt.ids,
                    embeds: &embeds,
                    hidden: &prompt.hidden,
                },
                r.speaker,
            )?;
            let (state, o) = talker.prefill(&inputs, None, None)?;
            r.logits = Some(o.logits.get(0)?);
            r.state = Some(state);
            return Ok(false);
        }
        let eos = self.model.config().talker.codec_eos_token_id;
        let code0 = match r.code0 {
            Some(c) => c,
            None => {
                let logits = r
                    .logits
                    .take()
                    .ok_or_else(|| ModelError::Invalid("talker: no logits".into()))?;
                let c = r.sampler.sample_tensor(&logits)?;
                // As `talker_max_new_tokens`: the budget's last code 0 is not spoken.
                if c == eos || r.frames + 1 >= r.max_frames {
                    out.downstream.push((
                        id,
                        Payload::Frames(FrameChunk {
                            frames: None,
                            finished: true,
                        }),
                    ));
                    return Ok(true);
                }
                r.code0 = Some(c);
                c
            }
        };
        let Text::Ready(text) = self.text_for(r, r.frames)? else {
            return Ok(false);
        };
        let state = r
            .state
            .as_mut()
            .ok_or_else(|| ModelError::Invalid("talker: no state".into()))?;
        let step = talker.step(
            state,
            &[code0],
            &text.unsqueeze(0)?,
            std::slice::from_mut(&mut r.cp_sampler),
        )?;
        r.code0 = None;
        r.frames += 1;
        r.logits = Some(step.logits.get(0)?);
        let codes = step.codes.into_iter().next().unwrap_or_default();
        let g = codes.len();
        let frame =
            Tensor::from_vec(codes, (g, 1), &candle_core::Device::Cpu)?.to_dtype(DType::U32)?;
        out.downstream.push((
            id,
            Payload::Frames(FrameChunk {
                frames: Some(frame),
                finished: false,
            }),
        ));
        Ok(false)
    }
}

impl StageModel for Qwen3OmniTalker {
    fn admit(&mut self, ctx: Arc<RequestCtx>) -> Result<()> {
        let cfg = &self.model.config().talker;
        let voice = ctx.spec.voice.as_deref().unwrap_or(&self.default_voice);
        let speaker = cfg.speaker(voice).ok_or_else(|| {
            ModelError::Invalid(format!(
                "unknown voice {voice:?}; available voices: {}",
                Self::voice_names(&self.model).join(", ")
            ))
        })?;
        let mut code0 = sampling_config(&self.defaults, None, ctx.id);
        code0.suppress_tokens = cfg.suppress_tokens();
        let cp = self.cp_defaults.clone().with_seed(ctx.id.wrapping_add(1));
        self.reqs.insert(
            ctx.id,
            Req {
                speaker,
                prompt: None,
                fed: Vec::new(),
                upstream_done: false,
                state: None,
                logits: None,
                code0: None,
                frames: 0,
                sampler: Sampler::new(code0),
                cp_sampler: Sampler::new(cp),
                max_frames: self
                    .defaults
                    .max_tokens
                    .unwrap_or(DEFAULT_MAX_FRAMES)
                    .max(1),
            },
        );
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        let Payload::Text(chunk) = payload else {
            return Err(ModelError::Invalid(
                "the Talker takes the Thinker's output".into(),
            ));
        };
        let Some(r) = self.reqs.get_mut(id) else {
            return Ok(());
        };
        if let Some(states) = chunk.states {
            if let Some(p) = states.prompt {
                r.prompt = Some(p);
            }
            if let Some(e) = states.embeds {
                for i in 0..e.dim(0)? {
                    r.fed.push(e.narrow(0, i, 1)?);
                }
            }
        } else if !chunk.finished || r.prompt.is_none() {
            return Err(ModelError::Invalid(
                "the Qwen3-Omni Talker speaks from a Qwen3-Omni Thinker's states".into(),
            ));
        }
        r.upstream_done |= chunk.finished;
        Ok(())
    }

    fn step(&mut self, out: &mut StepOutput) {
        let mut reqs = std::mem::take(&mut self.reqs);
        reqs.step(
            self.max_num_seqs,
            out,
            |r| self.is_ready(r),
            |id, r, out| self.advance(id, r, out),
        );
        self.reqs = reqs;
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.any(|r| self.is_ready(r))
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}
