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
use std::collections::HashMap;

use crate::engine::{
    FrameChunk, Payload, PromptStates, RequestCtx, RequestId, StageModel, StepOutput,
};
use crate::models::qwen3_omni::graphs;
use crate::models::qwen3_omni::layers::KvSlots;
use crate::models::qwen3_omni::omni::{Qwen3Omni, ThinkerTrace};
use crate::models::qwen3_omni::sampling::{samples_on_device, Sampler, SamplingConfig};
use crate::models::qwen3_omni::talker::{SlotRows, TalkerGraphs};
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
    /// Once prefilled: cached positions, next rotary position, last hidden state.
    decode: Option<(usize, u32, Tensor)>,
    /// The next frame's code-0 logits.
    logits: Option<Vec<f32>>,
    /// Drawn but not yet spoken (its text vector has not arrived).
    code0: Option<u32>,
    frames: usize,
    sampler: Sampler,
    cp_sampler: Sampler,
    max_frames: usize,
    /// The request ignores end tokens and speaks a fixed number of frames: this
    /// many, or (`Some(None)`) one per text vector.
    fixed_frames: Option<Option<usize>>,
}

pub struct Qwen3OmniTalker {
    model: Arc<Qwen3Omni>,
    defaults: SamplingParams,
    cp_defaults: SamplingConfig,
    default_voice: String,
    max_num_seqs: usize,
    /// Frames per request's KV slot (prompt included).
    max_len: usize,
    reqs: HashMap<RequestId, Req>,
    /// Prefilled requests: request `i` lives in KV slot `i`.
    running: Vec<RequestId>,
    /// One per layer, allocated with the stage (like any server's KV pool); with
    /// graphs, scratch slots past `max_num_seqs` for the padded rows of a bucket.
    slots: Vec<KvSlots>,
    /// Requests dropped from the batch by a failed slot copy, to fail next step.
    lost: Vec<RequestId>,
    /// The captured decode steps and code predictor frames (a GPU without
    /// `enforce_eager`).
    graphs: Option<TalkerGraphs>,
}

/// Talker prompts `(1, s_i, hidden)` left-padded into `(b, max s, hidden)`, with their
/// attention mask `(b, max s)` (1 = token, 0 = padding).
pub(super) fn left_padded(inputs: &[Tensor]) -> Result<(Tensor, Tensor)> {
    let lens: Vec<usize> = inputs
        .iter()
        .map(|t| t.dim(1))
        .collect::<candle_core::Result<_>>()?;
    let s = lens.iter().copied().max().unwrap_or(0);
    let mut rows = Vec::with_capacity(inputs.len());
    let mut mask = Vec::with_capacity(inputs.len() * s);
    for (t, &l) in inputs.iter().zip(&lens) {
        let (_, _, h) = t.dims3()?;
        rows.push(if l < s {
            Tensor::cat(
                &[&Tensor::zeros((1, s - l, h), t.dtype(), t.device())?, t],
                1,
            )?
        } else {
            t.clone()
        });
        mask.extend((0..s).map(|j| f32::from(u8::from(j >= s - l))));
    }
    let Some(dev) = inputs.first().map(|t| t.device()) else {
        return Err(ModelError::Invalid("talker: an empty prefill".into()));
    };
    Ok((
        Tensor::cat(&rows, 0)?,
        Tensor::from_vec(mask, (inputs.len(), s), dev)?,
    ))
}

/// Tells Code2Wav that `id`'s speech is over.
pub(super) fn end_of_speech(out: &mut StepOutput, id: RequestId) {
    out.downstream.push((
        id,
        Payload::Frames(FrameChunk {
            frames: None,
            finished: true,
        }),
    ));
}

/// The text vector a frame consumes: an answer token's embedding (projected in a
/// batch with the step's others), `tts_eos`, `tts_pad`, or not there yet.
enum Text {
    Fed(Tensor),
    Eos,
    Pad,
    Wait,
}

impl Qwen3OmniTalker {
    pub fn new(
        model: Arc<Qwen3Omni>,
        defaults: SamplingParams,
        code_predictor: Option<SamplingParams>,
        default_voice: String,
        max_num_seqs: usize,
        max_len: usize,
        cuda_graphs: bool,
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
        let max_len = max_len
            .min(model.config().talker.text_config.max_position_embeddings)
            .max(2);
        // The Talker shares the Thinker's device (one checkpoint, one device).
        let graphs = (cuda_graphs && graphs::available(model.device()))
            .then(|| TalkerGraphs::new(max_num_seqs));
        let scratch = match graphs {
            Some(_) => TalkerGraphs::scratch_slots(max_num_seqs),
            None => 0,
        };
        let slots = model.talker()?.new_slots(max_num_seqs + scratch, max_len)?;
        Ok(Self {
            defaults,
            cp_defaults,
            default_voice,
            max_num_seqs,
            max_len,
            model,
            reqs: HashMap::new(),
            running: Vec::new(),
            slots,
            lost: Vec::new(),
            graphs,
        })
    }

    /// The checkpoint's voices, sorted.
    pub fn voice_names(model: &Qwen3Omni) -> Vec<String> {
        let mut v: Vec<String> = model.config().talker.speaker_id.keys().cloned().collect();
        v.sort();
        v
    }

    fn is_ready(&self, r: &Req) -> bool {
        if r.decode.is_none() {
            return r.prompt.is_some() && (!r.fed.is_empty() || r.upstream_done);
        }
        // Frame f needs answer token f + 1, or the end of the answer.
        r.code0.is_none() || r.frames + 1 < r.fed.len() || r.upstream_done
    }

    /// The text vector frame `f` consumes: the answer token after the first one,
    /// `tts_eos` right after the last, then `tts_pad`.
    fn text_for(&self, r: &Req, f: usize) -> Text {
        let n = r.fed.len();
        if f + 1 < n {
            Text::Fed(r.fed[f + 1].clone())
        } else if !r.upstream_done {
            Text::Wait
        } else if f + 1 == n {
            Text::Eos
        } else {
            Text::Pad
        }
    }

    /// The step's text vectors `(b, 1, hidden)`: the fed embeddings through the
    /// Talker's text projection in one batch, the tts embeddings in their rows.
    fn text_vectors(&self, texts: Vec<Text>) -> Result<Tensor> {
        let b = texts.len();
        let fed: Vec<&Tensor> = texts
            .iter()
            .filter_map(|t| match t {
                Text::Fed(e) => Some(e),
                _ => None,
            })
            .collect();
        let projected = match fed.len() {
            0 => None,
            _ => Some(self.model.text_vectors(&Tensor::cat(&fed, 0)?)?),
        };
        if let (Some(p), true) = (&projected, fed.len() == b) {
            return Ok(p.unsqueeze(1)?);
        }
        let tts = self.model.tts()?;
        let mut next = 0;
        let mut rows = Vec::with_capacity(b);
        for t in &texts {
            rows.push(match (t, &projected) {
                (Text::Fed(_), Some(p)) => {
                    next += 1;
                    p.get(next - 1)?
                }
                (Text::Eos, _) => tts.eos.clone(),
                _ => tts.pad.clone(),
            });
        }
        Ok(Tensor::stack(&rows, 0)?.unsqueeze(1)?)
    }

    /// Prefills `batch` in one left-padded forward, each request into the next free
    /// KV slot (the caller checked there are enough).
    fn prefill(&mut self, batch: &mut [(RequestId, Req)]) -> Result<()> {
        let talker = self.model.talker()?;
        let mut inputs = Vec::with_capacity(batch.len());
        for (_, r) in batch.iter() {
            let (Some(prompt), Some(first)) = (&r.prompt, r.fed.first()) else {
                return Err(ModelError::Invalid(
                    "talker: prefill before the prompt".into(),
                ));
            };
            let embeds = Tensor::cat(&[&prompt.embeds, first], 0)?;
            inputs.push(self.model.talker_prompt(
                &ThinkerTrace {
                    prompt: &prompt.ids,
                    embeds: &embeds,
                    hidden: &prompt.hidden,
                },
                r.speaker,
            )?);
        }
        // One request's mask has no padding: the prefill then takes it as none.
        let (x, mask) = left_padded(&inputs)?;
        let (state, o) = talker.prefill(&x, Some(&mask), None)?;
        let logits = o.logits.to_vec2::<f32>()?;
        for (row, ((id, r), logits)) in batch.iter_mut().zip(logits).enumerate() {
            let slot = self.running.len();
            let (len, pos, hidden) = talker.load_slot(&self.slots, slot, &state, row)?;
            r.decode = Some((len, pos, hidden));
            r.logits = Some(logits);
            r.max_frames = r.max_frames.min(self.max_len.saturating_sub(len));
            self.running.push(*id);
        }
        Ok(())
    }

    /// Draws `r`'s next code 0 if it has none; returns whether the request is done
    /// (the codec's end, or its frame budget).
    fn draw_code0(&self, id: RequestId, r: &mut Req, out: &mut StepOutput) -> Result<bool> {
        if r.code0.is_some() {
            return Ok(false);
        }
        let mut logits = r
            .logits
            .take()
            .ok_or_else(|| ModelError::Invalid("talker: no logits".into()))?;
        let eos = self.model.config().talker.codec_eos_token_id;
        if let Some(fixed) = r.fixed_frames {
            // Fixed-length answers (benchmarks): the set number of frames, or
            // every text vector, then stop.
            let done = match fixed {
                Some(n) => r.frames >= n,
                None => r.upstream_done && r.frames + 1 > r.fed.len(),
            };
            if done {
                end_of_speech(out, id);
                return Ok(true);
            }
            if let Some(l) = logits.get_mut(eos as usize) {
                *l = f32::NEG_INFINITY;
            }
        }
        let c = r.sampler.sample(&logits)?;
        // As `talker_max_new_tokens`: the budget's last code 0 is not spoken.
        if c == eos || r.frames + 1 >= r.max_frames {
            end_of_speech(out, id);
            return Ok(true);
        }
        r.code0 = Some(c);
        Ok(false)
    }

    /// One frame for every running request whose next text vector is there, in one
    /// batched Talker step (code predictor included).
    fn step_running(
        &self,
        reqs: &mut HashMap<RequestId, Req>,
        graphs: Option<&mut TalkerGraphs>,
        out: &mut StepOutput,
    ) -> Result<Vec<RequestId>> {
        let mut ids = Vec::new();
        let mut finished = Vec::new();
        let (mut slots_of, mut lens, mut pos, mut code0, mut texts, mut hidden) = (
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
            Vec::new(),
        );
        for (slot, &id) in self.running.iter().enumerate() {
            let Some(r) = reqs.get_mut(&id) else {
                continue;
            };
            if self.draw_code0(id, r, out)? {
                finished.push(id);
                continue;
            }
            let text = self.text_for(r, r.frames);
            if matches!(text, Text::Wait) {
                continue;
            }
            let (Some(c), Some((len, p, h))) = (r.code0, &r.decode) else {
                continue;
            };
            ids.push(id);
            slots_of.push(slot);
            lens.push(*len);
            pos.push(*p);
            code0.push(c);
            texts.push(text);
            hidden.push(h.clone());
        }
        out.batch = ids.len();
        if ids.is_empty() {
            return Ok(finished);
        }
        let slots = &self.slots;
        let last_hidden = Tensor::cat(&hidden, 0)?;
        let text = self.text_vectors(texts)?;
        // The code predictor takes one sampler per row: borrow them for the step.
        let mut samplers = Vec::with_capacity(ids.len());
        for id in &ids {
            if let Some(r) = reqs.get_mut(id) {
                let stand_in = Sampler::new(SamplingConfig::greedy());
                samplers.push(std::mem::replace(&mut r.cp_sampler, stand_in));
            }
        }
        let rows = SlotRows {
            slots: &slots_of,
            lens: &lens,
            pos: &pos,
            last_hidden: &last_hidden,
        };
        let result =
            self.model
                .talker()?
                .step_slots(slots, &rows, &code0, &text, &mut samplers, graphs);
        for (id, sampler) in ids.iter().zip(samplers) {
            if let Some(r) = reqs.get_mut(id) {
                r.cp_sampler = sampler;
            }
        }
        let (step, new_hidden) = result?;
        // One copy of the whole batch's logits to the host.
        let logits = step.logits.to_vec2::<f32>()?;
        for (row, ((id, codes), logits)) in ids.iter().zip(step.codes).zip(logits).enumerate() {
            let Some(r) = reqs.get_mut(id) else {
                continue;
            };
            r.code0 = None;
            r.frames += 1;
            r.logits = Some(logits);
            if let Some((len, p, h)) = &mut r.decode {
                *len += 1;
                *p += 1;
                *h = new_hidden.narrow(0, row, 1)?;
            }
            let g = codes.len();
            let frame =
                Tensor::from_vec(codes, (g, 1), &candle_core::Device::Cpu)?.to_dtype(DType::U32)?;
            out.downstream.push((
                *id,
                Payload::Frames(FrameChunk {
                    frames: Some(frame),
                    finished: false,
                }),
            ));
        }
        Ok(finished)
    }

    /// Frees `id`'s slot (see [`super::leave_slot`]); requests that lost theirs
    /// are failed at the next step.
    fn leave(&mut self, id: RequestId) {
        for lost in super::leave_slot(&mut self.running, &self.slots, id) {
            self.reqs.remove(&lost);
            self.lost.push(lost);
        }
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
                decode: None,
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
                fixed_frames: ctx
                    .spec
                    .sampling
                    .ignore_eos
                    .then_some(ctx.spec.sampling.audio_frames),
            },
        );
        Ok(())
    }

    fn push(&mut self, id: RequestId, payload: Payload) -> Result<()> {
        // A Thinker on another device (a replica on its own GPU) sent its
        // states there: they move to this replica's device once, here.
        let Payload::Text(chunk) = payload.states_to(self.model.device())? else {
            return Err(ModelError::Invalid(
                "the Talker takes the Thinker's output".into(),
            ));
        };
        let Some(r) = self.reqs.get_mut(&id) else {
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
        let dev = self.model.device().clone();
        for id in self.lost.drain(..) {
            out.failed
                .push((id, ModelError::Invalid("its KV slot was lost".into())));
        }
        // Prefill the requests whose prompt is complete, while slots are free.
        let mut waiting: Vec<RequestId> = self
            .reqs
            .iter()
            .filter(|(_, r)| r.decode.is_none() && self.is_ready(r))
            .map(|(id, _)| *id)
            .collect();
        waiting.sort_unstable();
        let free = self.max_num_seqs.saturating_sub(self.running.len());
        let mut batch = Vec::new();
        for id in waiting.into_iter().take(free) {
            let Some(r) = self.reqs.remove(&id) else {
                continue;
            };
            if r.fed.is_empty() {
                // The Thinker ended on its first token: nothing to say.
                end_of_speech(out, id);
                out.finished.push(id);
            } else {
                batch.push((id, r));
            }
        }
        if !batch.is_empty() {
            let running = self.running.len();
            // Eager: ahead of the Thinker's next step on a shared GPU
            // (graphs::yield_to_urgent).
            let urgent = graphs::UrgentSection::on(&dev);
            let result = self.prefill(&mut batch);
            drop(urgent);
            if let Err(e) = result {
                // A batched prefill failed: none of its requests got a slot.
                self.running.truncate(running);
                for (id, _) in batch.drain(..) {
                    out.failed.push((id, ModelError::Invalid(e.to_string())));
                }
            }
            for (id, r) in batch {
                self.reqs.insert(id, r);
            }
        }
        let mut reqs = std::mem::take(&mut self.reqs);
        let mut graphs = self.graphs.take();
        // Ahead of the Thinker's next step too (graphs::UrgentSection::step).
        let _urgent = graphs::UrgentSection::step(&dev, graphs.is_some());
        let result = self.step_running(&mut reqs, graphs.as_mut(), out);
        self.reqs = reqs;
        self.graphs = graphs;
        match result {
            Ok(done) => {
                for id in done {
                    self.reqs.remove(&id);
                    self.leave(id);
                    out.finished.push(id);
                }
            }
            Err(e) => {
                // A batched step failed: every running request had a part in it.
                for id in self.running.clone() {
                    self.reqs.remove(&id);
                    self.leave(id);
                    out.failed.push((id, ModelError::Invalid(e.to_string())));
                }
            }
        }
    }

    fn remove(&mut self, id: RequestId) {
        self.reqs.remove(&id);
        self.leave(id);
    }

    fn has_ready_work(&self) -> bool {
        self.reqs.values().any(|r| self.is_ready(r)) || !self.lost.is_empty()
    }

    fn start(&mut self) {
        let Some(g) = &mut self.graphs else {
            return;
        };
        // The constructor checked the part is there.
        let Ok(talker) = self.model.talker() else {
            return;
        };
        let t = std::time::Instant::now();
        match talker.warm_up_graphs(g, &self.slots, self.max_num_seqs) {
            Ok(n) => tracing::info!("Talker: {n} decode graphs captured in {:?}", t.elapsed()),
            Err(e) => tracing::warn!("Talker: capturing decode graphs: {e}"),
        }
        if !samples_on_device(&self.cp_defaults) {
            return;
        }
        let t = std::time::Instant::now();
        let cp = talker.code_predictor();
        match cp.warm_up_graphs(&mut g.predictor, self.max_num_seqs, &self.cp_defaults) {
            Ok(n) => tracing::info!(
                "Talker: {n} code predictor graphs captured in {:?}",
                t.elapsed()
            ),
            // Buckets not captured are captured at their first frame, or run eagerly.
            Err(e) => tracing::warn!("Talker: capturing code predictor graphs: {e}"),
        }
    }

    fn active(&self) -> usize {
        self.reqs.len()
    }
}
