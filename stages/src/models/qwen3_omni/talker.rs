//! Qwen3-Omni's Talker (`Qwen3OmniMoeTalkerForConditionalGeneration`, weights under
//! `talker`): a Qwen3-MoE decoder (shared expert in every layer, interleaved MRoPE) over
//! codec embeddings that predicts code 0 of each 12.5 Hz frame with `codec_head`; its
//! code predictor fills in codes 1..N-1.
//!
//! Driving it, as the reference's `generate` does:
//! 1. prompt: [`Talker::user_part`] + [`Talker::assistant_part`] (per row, left-padded
//!    with an attention mask in a batch), then [`Talker::prefill`] -> code-0 logits;
//! 2. pick code 0 per row (a [`Sampler`], e.g. [`SamplingConfig::talker`]);
//! 3. [`Talker::step`] with those code-0s and each row's next trailing-text vector (the
//!    next entry of `trailing_text_hidden`, or `tts_pad` once the text is used up): it runs
//!    the code predictor from the Talker's last hidden state and `embed(code0)`, returns
//!    the finished frame (all N codes), feeds `Σ code embeddings + text` to the Talker and
//!    returns the next code-0 logits; repeat from 2 until code 0 is the codec EOS.
//!
//! Public API:
//! - [`TalkerConfig`] (the `talker_config` JSON), `suppress_tokens()`, `speaker(name)`.
//! - [`Talker::new(cfg, vb)`](Talker::new) (`vb` = `talker`); `text_projection(&x)`,
//!   `hidden_projection(&x)`, `embed_codec(&ids)`, `tts_embeds(&thinker_tts)`,
//!   `user_part(..)`, `assistant_part(..)`, `prefill(&embeds, mask, position_ids)`,
//!   `step(&mut state, &code0, &text, &mut cp_samplers)`, `decode(&mut state, &embeds)`,
//!   `code_predictor()`.
//! - [`TalkerState`] (KV cache, padding mask, per-row next position, last hidden),
//!   [`TalkerOutput`], [`TalkerStep`], [`TtsEmbeds`], [`ResizeMlp`].

use super::code_predictor::{CodePredictor, CodePredictorConfig, PredictorGraphs};
use super::graphs;
use super::kernels;
use super::layers::{
    self, Attention, DecoderConfig, DecoderLayer, FeedForward, KvCache, KvSlots, RmsNorm,
    RotaryEmbedding, SlotBatch, SparseMoe,
};
use super::sampling::{samples_on_device, Sampler, SamplingConfig};
use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Activation, Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

fn default_groups() -> usize {
    16
}
fn default_merge() -> usize {
    2
}
fn default_pps() -> usize {
    25
}

/// `Qwen3OmniMoeTalkerConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct TalkerConfig {
    pub text_config: DecoderConfig,
    pub code_predictor_config: CodePredictorConfig,
    #[serde(default = "default_groups")]
    pub num_code_groups: usize,
    /// The Thinker's hidden size (input of the projections).
    pub thinker_hidden_size: usize,
    /// Which Thinker hidden state (index into its `hidden_states`, 0 = embeddings) feeds
    /// `hidden_projection` for multimodal positions.
    pub accept_hidden_layer: usize,
    pub codec_eos_token_id: u32,
    pub codec_nothink_id: u32,
    pub codec_think_bos_id: u32,
    pub codec_think_eos_id: u32,
    pub codec_pad_id: u32,
    pub codec_bos_id: u32,
    /// Speaker name (lower case) -> codec id.
    #[serde(default)]
    pub speaker_id: HashMap<String, u32>,
    #[serde(default)]
    pub audio_token_id: Option<u32>,
    #[serde(default)]
    pub image_token_id: Option<u32>,
    #[serde(default)]
    pub video_token_id: Option<u32>,
    #[serde(default)]
    pub vision_start_token_id: Option<u32>,
    #[serde(default)]
    pub audio_start_token_id: Option<u32>,
    #[serde(default = "default_pps")]
    pub position_id_per_seconds: usize,
    #[serde(default = "default_merge")]
    pub spatial_merge_size: usize,
    /// Which Talker this is: not in Qwen3-Omni's JSON, set by Qwen3-TTS's loader.
    #[serde(skip)]
    pub variant: TalkerVariant,
}

/// The two Talkers this module runs: the same frame loop, code predictor and
/// codec head, built from different layers.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum TalkerVariant {
    /// `Qwen3OmniMoeTalkerForConditionalGeneration`: MoE layers; `text_projection`
    /// and `hidden_projection` bring the Thinker's embeddings and hidden states in.
    #[default]
    Omni,
    /// qwen-tts's `Qwen3TTSTalkerForConditionalGeneration`: dense layers, no
    /// Thinker (its own text embedding goes through `text_projection`, whose
    /// inner width is the text width), and a code predictor that may be narrower.
    Tts,
}

impl TalkerConfig {
    /// The ids the reference's top-level `generate` never lets code 0 be:
    /// `[vocab - 1024, vocab)` except the codec EOS.
    pub fn suppress_tokens(&self) -> Vec<u32> {
        let v = self.text_config.vocab_size;
        (v.saturating_sub(1024)..v)
            .map(|i| i as u32)
            .filter(|&i| i != self.codec_eos_token_id)
            .collect()
    }

    /// A speaker's codec id (names are matched in lower case, as the reference does).
    pub fn speaker(&self, name: &str) -> Option<u32> {
        self.speaker_id.get(&name.to_lowercase()).copied()
    }
}

/// `Qwen3OmniMoeTalkerResizeMLP`: Thinker width -> Talker width (`linear_fc1`, act, `linear_fc2`).
#[derive(Debug, Clone)]
pub struct ResizeMlp {
    linear_fc1: Linear,
    linear_fc2: Linear,
    act: Activation,
}

impl ResizeMlp {
    pub fn new(cfg: &TalkerConfig, vb: VarBuilder) -> Result<Self> {
        let t = &cfg.text_config;
        let inner = match cfg.variant {
            TalkerVariant::Omni => t.intermediate_size,
            TalkerVariant::Tts => cfg.thinker_hidden_size,
        };
        Ok(Self {
            linear_fc1: candle_nn::linear(cfg.thinker_hidden_size, inner, vb.pp("linear_fc1"))?,
            linear_fc2: candle_nn::linear(inner, t.hidden_size, vb.pp("linear_fc2"))?,
            act: t.hidden_act,
        })
    }
}

impl Module for ResizeMlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.linear_fc2
            .forward(&self.linear_fc1.forward(x)?.apply(&self.act)?)
    }
}

/// `Qwen3OmniMoeTalkerModel`.
#[derive(Debug, Clone)]
struct TalkerModel {
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary_emb: RotaryEmbedding,
    codec_embedding: Embedding,
}

impl TalkerModel {
    fn new(cfg: &DecoderConfig, variant: TalkerVariant, vb: VarBuilder) -> Result<Self> {
        // Every Qwen3-Omni Talker layer has the sparse MoE block with its shared expert
        // (the reference replaces whatever `Qwen3OmniMoeThinkerText*` picked); every
        // Qwen3-TTS one the dense MLP.
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| {
                let vb = vb.pp("layers").pp(i);
                let mlp = match variant {
                    TalkerVariant::Omni => FeedForward::Moe(SparseMoe::new(cfg, vb.pp("mlp"))?),
                    TalkerVariant::Tts => FeedForward::dense(cfg, vb.pp("mlp"))?,
                };
                DecoderLayer::with_feed_forward(cfg, mlp, vb)
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("norm"))?,
            rotary_emb: RotaryEmbedding::from_config(cfg, vb.device())?,
            codec_embedding: candle_nn::embedding(
                cfg.vocab_size,
                cfg.hidden_size,
                vb.pp("codec_embedding"),
            )?,
        })
    }

    /// `x` `(b, s, hidden)`, `position_ids` `(3, b, s)`, `mask` over cached + new positions.
    fn forward(
        &self,
        x: &Tensor,
        position_ids: &Tensor,
        mask: Option<&Tensor>,
        caches: &mut [KvCache],
    ) -> Result<Tensor> {
        let (cos, sin) = self.rotary_emb.forward(position_ids, x.dtype())?;
        let attn = |i: usize, a: &Attention, h: &Tensor| match caches.get_mut(i) {
            Some(c) => a.forward(h, &cos, &sin, mask, Some(c)),
            None => candle_core::bail!("no cache for layer {i}"),
        };
        layers::run_decoder(&self.layers, &self.norm, x, attn, |_, _| {})
    }
}

impl TalkerModel {
    /// One decode step of a running batch over KV slots; `position_ids` `(3, b, 1)`.
    fn forward_slots(
        &self,
        x: &Tensor,
        position_ids: &Tensor,
        slots: &[KvSlots],
        batch: &SlotBatch,
    ) -> Result<Tensor> {
        let (cos, sin) = self.rotary_emb.forward(position_ids, x.dtype())?;
        // The Talker's wide projections read faster through cuBLAS than the
        // fused step's GEMVs (docs/bench/qwen3-tts-gpu.md): fused only on request.
        let fuse = match kernels::FUSED_DECODE_TALKER.get() {
            1 => kernels::FUSED_DECODE_ROWS.get() as usize,
            _ => 0,
        };
        layers::run_decoder_slots(&self.layers, &self.norm, x, &cos, &sin, slots, batch, fuse)
    }
}

/// On a GPU, the code predictor draws on the device when every row samples alike
/// (seeds aside) in a way the device sampler can: its 15 steps then need no host
/// round-trip.
fn device_draw(dev: &candle_core::Device, samplers: &[Sampler]) -> Option<SamplingConfig> {
    let first = samplers.first()?.config();
    let alike = |s: &Sampler| {
        SamplingConfig {
            seed: first.seed,
            ..s.config().clone()
        } == *first
    };
    (dev.is_cuda() && samples_on_device(first) && samplers.iter().all(alike)).then(|| first.clone())
}

/// One captured Talker decode step (layers, norm, codec head) and the persistent
/// tensors it reads (inputs, positions, scatter rows, mask, slots) and writes
/// (final hidden states, code-0 logits).
#[derive(Debug)]
struct DecodeGraph {
    graph: graphs::StepGraph,
    inputs: [Tensor; 5],
    hidden: Tensor,
    logits: Tensor,
}

/// The Talker's captured steps by bucket `(rows, kv_len)` and the code predictor's
/// frames, owned by the stage that steps with them. Padded rows of a bucket write
/// into scratch slots: the KV slots from `scratch` on, which no request holds.
#[derive(Debug)]
pub struct TalkerGraphs {
    steps: HashMap<(usize, usize), DecodeGraph>,
    failed: HashSet<(usize, usize)>,
    scratch: usize,
    pub predictor: PredictorGraphs,
}

impl TalkerGraphs {
    /// Graphs for KV slots whose slots from `scratch` on are left to padded rows.
    pub fn new(scratch: usize) -> Self {
        Self {
            steps: HashMap::new(),
            failed: HashSet::new(),
            scratch,
            predictor: PredictorGraphs::default(),
        }
    }

    /// Scratch slots a running batch of up to `max_batch` rows needs for padding.
    pub fn scratch_slots(max_batch: usize) -> usize {
        (1..=max_batch)
            .filter_map(|b| {
                graphs::BATCH_BUCKETS
                    .iter()
                    .find(|&&n| n >= b)
                    .map(|n| n - b)
            })
            .max()
            .unwrap_or(0)
    }

    /// Decode steps captured so far.
    pub fn captured(&self) -> usize {
        self.steps.len()
    }
}

/// A running batch's rows for [`Talker::step_slots`].
pub struct SlotRows<'a> {
    /// Each row's KV slot.
    pub slots: &'a [usize],
    /// Cached positions per row.
    pub lens: &'a [usize],
    /// Rotary position of each row's next input.
    pub pos: &'a [u32],
    /// Each row's last final-normed hidden state, `(b, 1, hidden)`.
    pub last_hidden: &'a Tensor,
}

/// The Thinker's tts special tokens through `text_projection`, each `(hidden,)`.
#[derive(Debug, Clone)]
pub struct TtsEmbeds {
    pub bos: Tensor,
    pub eos: Tensor,
    pub pad: Tensor,
}

/// One batch's decoding state.
#[derive(Debug, Clone)]
pub struct TalkerState {
    caches: Vec<KvCache>,
    /// `(b, kv_len)` f32, 1 = token, 0 = left padding; `None` while nothing is padded.
    padding: Option<Tensor>,
    /// Each row's rotary position for its next input.
    next_pos: Vec<u32>,
    /// The final-normed hidden state of each row's last input, `(b, 1, hidden)`.
    last_hidden: Tensor,
}

impl TalkerState {
    pub fn batch_size(&self) -> usize {
        self.next_pos.len()
    }

    /// Cached positions (padding included).
    pub fn seq_len(&self) -> usize {
        self.caches.first().map_or(0, |c| c.seq_len())
    }

    /// The last final-normed hidden state per row, `(b, 1, hidden)`.
    pub fn last_hidden(&self) -> &Tensor {
        &self.last_hidden
    }
}

/// [`Talker::prefill`]'s result.
#[derive(Debug, Clone)]
pub struct TalkerOutput {
    /// Code-0 logits at the last position, `(b, vocab)` f32.
    pub logits: Tensor,
    /// Final-normed hidden states over the prompt, `(b, s, hidden)` (padding rows are 0-attention garbage).
    pub hidden: Tensor,
}

/// [`Talker::step`]'s result.
#[derive(Debug, Clone)]
pub struct TalkerStep {
    /// The finished frame per row: code 0 (given) and codes 1..N-1.
    pub codes: Vec<Vec<u32>>,
    /// The next frame's code-0 logits, `(b, vocab)` f32.
    pub logits: Tensor,
}

/// `Qwen3OmniMoeTalkerForConditionalGeneration`.
#[derive(Debug, Clone)]
pub struct Talker {
    model: TalkerModel,
    text_projection: ResizeMlp,
    /// Qwen3-Omni's only.
    hidden_projection: Option<ResizeMlp>,
    codec_head: Linear,
    code_predictor: CodePredictor,
    cfg: TalkerConfig,
}

impl Talker {
    pub fn new(cfg: &TalkerConfig, vb: VarBuilder) -> Result<Self> {
        if cfg.code_predictor_config.num_code_groups != cfg.num_code_groups {
            candle_core::bail!(
                "talker num_code_groups {} != code predictor's {}",
                cfg.num_code_groups,
                cfg.code_predictor_config.num_code_groups
            );
        }
        let t = &cfg.text_config;
        let hidden_projection = match cfg.variant {
            TalkerVariant::Omni => Some(ResizeMlp::new(cfg, vb.pp("hidden_projection"))?),
            TalkerVariant::Tts => None,
        };
        Ok(Self {
            model: TalkerModel::new(t, cfg.variant, vb.pp("model"))?,
            text_projection: ResizeMlp::new(cfg, vb.pp("text_projection"))?,
            hidden_projection,
            codec_head: candle_nn::linear_no_bias(
                t.hidden_size,
                t.vocab_size,
                vb.pp("codec_head"),
            )?,
            code_predictor: CodePredictor::for_talker(
                &cfg.code_predictor_config,
                t.hidden_size,
                vb.pp("code_predictor"),
            )?,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &TalkerConfig {
        &self.cfg
    }

    pub fn code_predictor(&self) -> &CodePredictor {
        &self.code_predictor
    }

    /// Thinker token embeddings -> Talker width.
    pub fn text_projection(&self, x: &Tensor) -> Result<Tensor> {
        self.text_projection.forward(x)
    }

    /// Thinker hidden states (layer `accept_hidden_layer`) -> Talker width.
    pub fn hidden_projection(&self, x: &Tensor) -> Result<Tensor> {
        match &self.hidden_projection {
            Some(p) => p.forward(x),
            None => candle_core::bail!("this Talker has no hidden_projection"),
        }
    }

    /// `model.codec_embedding` of codec ids (any shape).
    pub fn embed_codec(&self, ids: &Tensor) -> Result<Tensor> {
        self.model.codec_embedding.forward(ids)
    }

    /// `text_projection` of the Thinker's embeddings of `[tts_bos, tts_eos, tts_pad]`, `(3, thinker_hidden)`.
    pub fn tts_embeds(&self, thinker_tts: &Tensor) -> Result<TtsEmbeds> {
        let p = self.text_projection(thinker_tts)?;
        Ok(TtsEmbeds {
            bos: p.get(0)?,
            eos: p.get(1)?,
            pad: p.get(2)?,
        })
    }

    /// The reference's `_get_talker_user_parts`: `hidden_projection(thinker_hidden)` at
    /// multimodal positions (`multimodal` `(b, s)`, nonzero = audio/image/video token),
    /// `text_projection(thinker_embed)` elsewhere; `(b, s, thinker_hidden)` -> `(b, s, hidden)`.
    pub fn user_part(
        &self,
        thinker_embed: &Tensor,
        thinker_hidden: &Tensor,
        multimodal: &Tensor,
    ) -> Result<Tensor> {
        let text = self.text_projection(thinker_embed)?;
        let mm = self.hidden_projection(thinker_hidden)?;
        let m = multimodal
            .ne(0u32)?
            .unsqueeze(D::Minus1)?
            .broadcast_as(text.shape())?;
        m.where_cond(&mm, &text)
    }

    /// The reference's `_get_talker_assistant_parts`: `thinker_embed` `(b, n >= 4, thinker_hidden)`
    /// are the assistant turn's Thinker embeddings (`<|im_start|>`, `assistant`, `\n`, then
    /// the text tokens); `speakers[row]` a codec speaker id. Returns the 9 prompt inputs
    /// `(b, 9, hidden)` (3 text, 4 tts_pad, tts_bos, first text token, over zeros, nothink,
    /// think_bos, think_eos, speaker, codec pad, codec bos) and the trailing text
    /// `(b, n - 3, hidden)` (the further text tokens, then tts_eos) for the steps.
    pub fn assistant_part(
        &self,
        thinker_embed: &Tensor,
        speakers: &[u32],
        tts: &TtsEmbeds,
    ) -> Result<(Tensor, Tensor)> {
        let (b, n, _) = thinker_embed.dims3()?;
        if n < 4 || speakers.len() != b {
            candle_core::bail!(
                "assistant part needs >= 4 positions and one speaker per row, got {n} and {} for {b}",
                speakers.len()
            );
        }
        let h = self.text_projection(thinker_embed)?;
        let hs = h.dim(2)?;
        let row = |t: &Tensor, k: usize| -> Result<Tensor> {
            t.reshape((1, 1, hs))?
                .broadcast_as((b, k, hs))?
                .to_dtype(h.dtype())
        };
        let text = Tensor::cat(
            &[
                h.narrow(1, 0, 3)?,
                row(&tts.pad, 4)?,
                row(&tts.bos, 1)?,
                h.narrow(1, 3, 1)?,
            ],
            1,
        )?;
        let c = &self.cfg;
        let mut ids = Vec::with_capacity(b * 6);
        for &spk in speakers {
            ids.extend([
                c.codec_nothink_id,
                c.codec_think_bos_id,
                c.codec_think_eos_id,
                spk,
                c.codec_pad_id,
                c.codec_bos_id,
            ]);
        }
        let ids = Tensor::from_vec(ids, (b, 6), h.device())?;
        let codec = Tensor::cat(
            &[
                Tensor::zeros((b, 3, hs), h.dtype(), h.device())?,
                self.embed_codec(&ids)?.to_dtype(h.dtype())?,
            ],
            1,
        )?;
        let trailing = Tensor::cat(&[h.narrow(1, 4, n - 4)?, row(&tts.eos, 1)?], 1)?;
        Ok(((text + codec)?, trailing))
    }

    /// Runs the prompt `inputs_embeds` `(b, s, hidden)`. `attention_mask` `(b, s)` (1 =
    /// token, 0 = left padding) as the reference's; `position_ids` `(3, b, s)` where the
    /// prompt has multimodal MRoPE positions (the Thinker's `get_rope_index` over the Talker's
    /// ids), else (`None`) each row counts its tokens from 0.
    pub fn prefill(
        &self,
        inputs_embeds: &Tensor,
        attention_mask: Option<&Tensor>,
        position_ids: Option<&Tensor>,
    ) -> Result<(TalkerState, TalkerOutput)> {
        let (b, s, _) = inputs_embeds.dims3()?;
        let dev = inputs_embeds.device();
        let pad: Vec<Vec<f32>> = match attention_mask {
            Some(m) => m.to_dtype(DType::F32)?.to_vec2::<f32>()?,
            None => vec![vec![1.0; s]; b],
        };
        if pad.len() != b || pad.iter().any(|r| r.len() != s) {
            candle_core::bail!("attention mask does not match inputs ({b}, {s})");
        }
        let (pos, next_pos) = match position_ids {
            Some(p) => {
                let v = p.to_dtype(DType::F32)?.to_vec3::<f32>()?;
                // The next position continues after the largest one (the reference's
                // `rope_deltas` = max + 1 - length), over the row's tokens only.
                let next = (0..b)
                    .map(|r| {
                        let m = (0..s)
                            .filter(|&j| pad[r][j] != 0.0)
                            .flat_map(|j| v.iter().map(move |rows| rows[r][j]))
                            .fold(-1.0f32, f32::max);
                        (m + 1.0) as u32
                    })
                    .collect();
                (p.to_dtype(DType::U32)?, next)
            }
            None => {
                // cumsum(mask) - 1, padding at 0.
                let mut data = Vec::with_capacity(b * s);
                let mut next = Vec::with_capacity(b);
                for row in &pad {
                    let mut n = 0u32;
                    for &m in row {
                        if m != 0.0 {
                            data.push(n);
                            n += 1;
                        } else {
                            data.push(0);
                        }
                    }
                    next.push(n);
                }
                let p = Tensor::from_vec(data, (1, b, s), dev)?.broadcast_as((3, b, s))?;
                (p.contiguous()?, next)
            }
        };
        let padding = if pad.iter().flatten().all(|&m| m != 0.0) {
            None
        } else {
            Some(Tensor::from_vec(
                pad.into_iter().flatten().collect::<Vec<f32>>(),
                (b, s),
                dev,
            )?)
        };
        let mask = layers::attention_mask(padding.as_ref(), b, s, s, dev)?;
        let mut caches = vec![KvCache::new(); self.model.layers.len()];
        let hidden = self
            .model
            .forward(inputs_embeds, &pos, mask.as_ref(), &mut caches)?;
        let last_hidden = hidden.narrow(1, s - 1, 1)?;
        let logits = self.codec_logits(&last_hidden)?;
        let state = TalkerState {
            caches,
            padding,
            next_pos,
            last_hidden,
        };
        Ok((state, TalkerOutput { logits, hidden }))
    }

    /// One Talker position per row from given inputs `(b, 1, hidden)`; returns code-0 logits `(b, vocab)`.
    pub fn decode(&self, state: &mut TalkerState, inputs_embeds: &Tensor) -> Result<Tensor> {
        let (b, s, _) = inputs_embeds.dims3()?;
        if s != 1 || b != state.batch_size() {
            candle_core::bail!(
                "decode takes (batch {}, 1, hidden), got {:?}",
                state.batch_size(),
                inputs_embeds.dims()
            );
        }
        let dev = inputs_embeds.device();
        let kv_len = state.seq_len() + 1;
        if let Some(p) = &state.padding {
            state.padding = Some(Tensor::cat(
                &[p, &Tensor::ones((b, 1), DType::F32, dev)?],
                1,
            )?);
        }
        let mask = layers::attention_mask(state.padding.as_ref(), b, 1, kv_len, dev)?;
        let pos = Tensor::from_vec(state.next_pos.clone(), (1, b, 1), dev)?
            .broadcast_as((3, b, 1))?
            .contiguous()?;
        let hidden = self
            .model
            .forward(inputs_embeds, &pos, mask.as_ref(), &mut state.caches)?;
        for p in state.next_pos.iter_mut() {
            *p += 1;
        }
        state.last_hidden = hidden;
        self.codec_logits(&state.last_hidden)
    }

    /// Finishes the frame whose code 0 per row is `code0` (chosen from the last logits) and
    /// advances one frame: the code predictor (one `cp_samplers[row]` per row) gives codes
    /// 1..N-1 from the last hidden state and `embed(code0)`; the next Talker input is the
    /// sum of the N code embeddings plus `text` `(b, 1, hidden)` (each row's next
    /// trailing-text vector, or tts_pad).
    pub fn step(
        &self,
        state: &mut TalkerState,
        code0: &[u32],
        text: &Tensor,
        cp_samplers: &mut [Sampler],
    ) -> Result<TalkerStep> {
        let b = state.batch_size();
        if code0.len() != b {
            candle_core::bail!("{} code-0s for a batch of {b}", code0.len());
        }
        let (input, codes) =
            self.frame(&state.last_hidden, code0, text, cp_samplers, false, None)?;
        let logits = self.decode(state, &input)?;
        Ok(TalkerStep { codes, logits })
    }

    /// Finishes each row's frame: the code predictor gives codes 1..N-1 from the last
    /// hidden state and `embed(code0)` (drawn on the device when `device_draws` and
    /// [`device_draw`] allow); the next Talker input is the N code embeddings summed
    /// plus `text`. Returns that input `(b, 1, hidden)` and the frames.
    fn frame(
        &self,
        last_hidden: &Tensor,
        code0: &[u32],
        text: &Tensor,
        cp_samplers: &mut [Sampler],
        device_draws: bool,
        graphs: Option<&mut PredictorGraphs>,
    ) -> Result<(Tensor, Vec<Vec<u32>>)> {
        let b = code0.len();
        let dev = last_hidden.device().clone();
        let ids = Tensor::from_vec(code0.to_vec(), (b, 1), &dev)?;
        let e0 = self.embed_codec(&ids)?;
        let cp = match (
            device_draw(&dev, cp_samplers).filter(|_| device_draws),
            graphs,
        ) {
            (Some(cfg), Some(g)) => {
                self.code_predictor
                    .generate_graphed(g, last_hidden, &e0, &cfg)?
            }
            (Some(cfg), None) => self
                .code_predictor
                .generate_on_device(last_hidden, &e0, &cfg)?,
            (None, _) => self
                .code_predictor
                .generate(last_hidden, &e0, cp_samplers)?,
        };
        let dtype = last_hidden.dtype();
        let text = text.reshape((b, 1, ()))?.to_dtype(dtype)?;
        let input = ((e0.to_dtype(dtype)? + cp.embed_sum.to_dtype(dtype)?)? + text)?;
        let codes = code0
            .iter()
            .zip(cp.codes)
            .map(|(&c0, rest)| std::iter::once(c0).chain(rest).collect())
            .collect();
        Ok((input, codes))
    }

    /// KV slots for a running batch of up to `slots` requests of `max_len` positions.
    pub fn new_slots(&self, slots: usize, max_len: usize) -> Result<Vec<KvSlots>> {
        let emb = self.model.codec_embedding.embeddings();
        layers::new_slots(
            &self.model.layers,
            slots,
            max_len,
            emb.dtype(),
            emb.device(),
        )
    }

    /// Moves row `row` of a prefilled (left-padded) `state` into `slot`, without its
    /// padding; returns its cached length, its next rotary position and its last
    /// hidden state `(1, 1, hidden)`.
    pub fn load_slot(
        &self,
        slots: &[KvSlots],
        slot: usize,
        state: &TalkerState,
        row: usize,
    ) -> Result<(usize, u32, Tensor)> {
        let Some(&next) = state.next_pos.get(row) else {
            candle_core::bail!("load_slot: the state has no row {row}");
        };
        let start = match &state.padding {
            Some(p) => p
                .get(row)?
                .to_vec1::<f32>()?
                .iter()
                .take_while(|&&m| m == 0.0)
                .count(),
            None => 0,
        };
        for (s, kv) in slots.iter().zip(&state.caches) {
            s.load(slot, kv, row, start)?;
        }
        Ok((
            state.seq_len() - start,
            next,
            state.last_hidden.narrow(0, row, 1)?,
        ))
    }

    /// [`Self::step`] for a running batch over KV slots: finishes each row's frame from
    /// `code0` and feeds it with `text` `(b, 1, hidden)`. Returns the step and the rows'
    /// new last hidden states `(b, 1, hidden)`.
    pub fn step_slots(
        &self,
        slots: &[KvSlots],
        rows: &SlotRows,
        code0: &[u32],
        text: &Tensor,
        cp_samplers: &mut [Sampler],
        mut graphs: Option<&mut TalkerGraphs>,
    ) -> Result<(TalkerStep, Tensor)> {
        let b = code0.len();
        if slots.is_empty() {
            candle_core::bail!("step_slots: no slots");
        }
        if rows.slots.len() != b || rows.lens.len() != b || rows.pos.len() != b {
            candle_core::bail!("step_slots: rows do not match {b} code-0s");
        }
        let predictor = graphs.as_deref_mut().map(|g| &mut g.predictor);
        let (input, codes) =
            self.frame(rows.last_hidden, code0, text, cp_samplers, true, predictor)?;
        let (hidden, logits) = self.decode_slots(slots, rows, &input, graphs)?;
        Ok((TalkerStep { codes, logits }, hidden))
    }

    /// The decode step of `rows` fed `input` `(b, 1, hidden)`: graphed where a graph
    /// applies, else eagerly. Returns the final hidden states and code-0 logits.
    pub(crate) fn decode_slots(
        &self,
        slots: &[KvSlots],
        rows: &SlotRows,
        input: &Tensor,
        graphs: Option<&mut TalkerGraphs>,
    ) -> Result<(Tensor, Tensor)> {
        if let Some(g) = graphs {
            if let Some(out) = self.decode_graphed(g, slots, rows, input)? {
                return Ok(out);
            }
        }
        let Some(first) = slots.first() else {
            candle_core::bail!("step_slots: no slots");
        };
        let b = rows.slots.len();
        let dev = rows.last_hidden.device();
        // Eager: ahead of the Thinker's next step (graphs::yield_to_urgent).
        let _urgent = graphs::UrgentSection::on(dev);
        let pos = Tensor::from_vec(rows.pos.to_vec(), (1, b, 1), dev)?
            .broadcast_as((3, b, 1))?
            .contiguous()?;
        let batch = SlotBatch::new(first, rows.slots, rows.lens)?;
        let hidden = self.model.forward_slots(input, &pos, slots, &batch)?;
        let logits = self.codec_logits(&hidden)?;
        Ok((hidden, logits))
    }

    /// The decode step of `rows` fed `input` `(b, 1, hidden)` through a CUDA graph of
    /// its bucket, replayed on the urgent stream (captured on first use from this
    /// real step, or by [`Self::warm_up_graphs`]). Returns the final hidden states
    /// and code-0 logits, or `None` where no graph applies (past the largest bucket,
    /// too few scratch slots, a capture that failed): the caller steps eagerly.
    fn decode_graphed(
        &self,
        g: &mut TalkerGraphs,
        slots: &[KvSlots],
        rows: &SlotRows,
        input: &Tensor,
    ) -> Result<Option<(Tensor, Tensor)>> {
        let Some(first) = slots.first() else {
            return Ok(None);
        };
        let b = rows.slots.len();
        let kv_len = rows.lens.iter().map(|l| l + 1).max().unwrap_or(0);
        let Some(key) = graphs::bucket(b, kv_len, first.slots(), first.max_len()) else {
            return Ok(None);
        };
        if g.failed.contains(&key) || g.scratch + (key.0 - b) > first.slots() {
            return Ok(None);
        }
        let host = self.graph_inputs(rows, key, g.scratch, first)?;
        let step = match g.steps.entry(key) {
            Entry::Occupied(e) => {
                let step = e.into_mut();
                step.inputs[0].slice_set(&input.contiguous()?, 0, 0)?;
                for (dst, src) in step.inputs[1..].iter().zip(&host) {
                    dst.slice_set(src, 0, 0)?;
                }
                step.graph.launch_urgent(input.device())?;
                step
            }
            Entry::Vacant(e) => match self.capture_decode(key, input, host, slots) {
                Ok(step) => e.insert(step),
                Err(err) => {
                    tracing::warn!(
                        "Talker decode graph for {} rows, {} positions: {err}; \
                         that bucket runs eagerly",
                        key.0,
                        key.1
                    );
                    g.failed.insert(key);
                    return Ok(None);
                }
            },
        };
        // Copies: the next replay overwrites the persistent outputs.
        Ok(Some((
            step.hidden.narrow(0, 0, b)?.copy()?,
            step.logits.narrow(0, 0, b)?.copy()?,
        )))
    }

    /// A graphed step's positions `(3, bb, 1)`, scatter rows, mask and slots at bucket
    /// `(bb, ll)`: rows past the batch decode at position 0 of the scratch slots.
    fn graph_inputs(
        &self,
        rows: &SlotRows,
        (bb, ll): (usize, usize),
        scratch: usize,
        first: &KvSlots,
    ) -> Result<[Tensor; 4]> {
        let pad = bb - rows.slots.len();
        let slots_p: Vec<usize> = rows
            .slots
            .iter()
            .copied()
            .chain(scratch..scratch + pad)
            .collect();
        let lens_p: Vec<usize> = rows
            .lens
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        let pos_p: Vec<u32> = rows
            .pos
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        let (scatter, mask) = SlotBatch::host(first, &slots_p, &lens_p, ll)?;
        let (_, kvh, _, hd) = first.shape()?;
        let dev = rows.last_hidden.device();
        let ids: Vec<u32> = slots_p.iter().map(|&s| s as u32).collect();
        Ok([
            Tensor::from_vec(pos_p, (1, bb, 1), dev)?
                .broadcast_as((3, bb, 1))?
                .contiguous()?,
            Tensor::from_vec(scatter, (bb * kvh, hd), dev)?,
            Tensor::from_vec(mask, (bb, 1, 1, ll), dev)?,
            Tensor::from_vec(ids, bb, dev)?,
        ])
    }

    /// Runs the step of `input` and the host inputs of [`Self::graph_inputs`] and
    /// captures it.
    fn capture_decode(
        &self,
        (bb, _): (usize, usize),
        input: &Tensor,
        host: [Tensor; 4],
        slots: &[KvSlots],
    ) -> Result<DecodeGraph> {
        let dev = input.device();
        let (_, _, hidden) = input.dims3()?;
        let x = Tensor::zeros((bb, 1, hidden), input.dtype(), dev)?;
        x.slice_set(&input.contiguous()?, 0, 0)?;
        let [pos, scatter, mask, ids] = host;
        let out_hidden = Tensor::zeros((bb, 1, hidden), input.dtype(), dev)?;
        let vocab = self.cfg.text_config.vocab_size;
        let logits = Tensor::zeros((bb, vocab), DType::F32, dev)?;
        let graph = graphs::StepGraph::capture(dev, || {
            let batch = SlotBatch::from_device_in(scatter.clone(), mask.clone(), ids.clone())?;
            let h = self.model.forward_slots(&x, &pos, slots, &batch)?;
            logits.slice_set(&self.codec_logits(&h)?, 0, 0)?;
            out_hidden.slice_set(&h, 0, 0)
        })?;
        Ok(DecodeGraph {
            graph,
            inputs: [x, pos, scatter, mask, ids],
            hidden: out_hidden,
            logits,
        })
    }

    /// Captures, before any request runs, the decode steps of every batch bucket up
    /// to `max_batch` at the first key/value bucket, on zero inputs in slots
    /// `0..bucket` (free then: their positions are rewritten when requests load).
    /// Returns how many there are.
    pub fn warm_up_graphs(
        &self,
        g: &mut TalkerGraphs,
        slots: &[KvSlots],
        max_batch: usize,
    ) -> Result<usize> {
        let emb = self.model.codec_embedding.embeddings();
        for &bb in graphs::BATCH_BUCKETS.iter().filter(|&&n| n <= max_batch) {
            let ids: Vec<usize> = (0..bb).collect();
            let (lens, pos) = (vec![0usize; bb], vec![0u32; bb]);
            let hidden = Tensor::zeros((bb, 1, emb.dim(1)?), emb.dtype(), emb.device())?;
            let rows = SlotRows {
                slots: &ids,
                lens: &lens,
                pos: &pos,
                last_hidden: &hidden,
            };
            self.decode_graphed(g, slots, &rows, &hidden)?;
        }
        Ok(g.captured())
    }

    fn codec_logits(&self, last_hidden: &Tensor) -> Result<Tensor> {
        layers::project(&self.codec_head, &last_hidden.squeeze(1)?.contiguous()?)?
            .to_dtype(DType::F32)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures::{self, max_abs_diff};
    use crate::models::qwen3_omni::sampling::SamplingConfig;

    const FRAMES: usize = 32;

    fn load() -> Talker {
        let cfg: TalkerConfig =
            serde_json::from_value(fixtures::config()["talker_config"].clone()).unwrap();
        Talker::new(&cfg, fixtures::weights().pp("talker")).unwrap()
    }

    fn ids(t: &Tensor) -> Vec<u32> {
        t.to_dtype(DType::U32).unwrap().to_vec1().unwrap()
    }

    /// Greedy generation as the reference's `talker.generate(do_sample=False, ...)`:
    /// `FRAMES` full frames per row and the raw code-0 logits of all `FRAMES + 1` steps.
    fn generate(
        talker: &Talker,
        x: &Tensor,
        mask: Option<&Tensor>,
        trailing: &Tensor,
        tts_pad: &Tensor,
        repetition_penalty: f32,
    ) -> (Vec<Vec<Vec<u32>>>, Tensor) {
        let b = x.dim(0).unwrap();
        let cfg = talker.config();
        let code0_cfg = SamplingConfig {
            repetition_penalty,
            suppress_tokens: cfg.suppress_tokens(),
            ..SamplingConfig::greedy()
        };
        let mut samplers: Vec<Sampler> = (0..b).map(|_| Sampler::new(code0_cfg.clone())).collect();
        let mut cp: Vec<Sampler> = (0..b)
            .map(|_| Sampler::new(SamplingConfig::greedy()))
            .collect();
        let (mut state, out) = talker.prefill(x, mask, None).unwrap();
        let mut logits = vec![out.logits];
        let mut frames = vec![Vec::new(); b];
        let t_len = trailing.dim(1).unwrap();
        let hs = trailing.dim(2).unwrap();
        for f in 0..FRAMES {
            let last = logits.last().unwrap().to_vec2::<f32>().unwrap();
            let code0: Vec<u32> = samplers
                .iter_mut()
                .zip(&last)
                .map(|(s, l)| s.sample(l).unwrap())
                .collect();
            assert!(!code0.contains(&cfg.codec_eos_token_id));
            let text = if f < t_len {
                trailing.narrow(1, f, 1).unwrap()
            } else {
                tts_pad
                    .reshape((1, 1, hs))
                    .unwrap()
                    .repeat((b, 1, 1))
                    .unwrap()
            };
            let step = talker.step(&mut state, &code0, &text, &mut cp).unwrap();
            for (r, c) in step.codes.into_iter().enumerate() {
                frames[r].push(c);
            }
            logits.push(step.logits);
        }
        (frames, Tensor::stack(&logits, 1).unwrap())
    }

    fn want_codes(t: &Tensor) -> Vec<Vec<Vec<u32>>> {
        t.to_dtype(DType::U32).unwrap().to_vec3().unwrap()
    }

    #[test]
    fn prompt_parts_match_reference() {
        let talker = load();
        let io = fixtures::io("talker");
        let tts = talker.tts_embeds(&io["tts_thinker_embeds"]).unwrap();
        let mut e: f32 = 0.0;
        for (ours, k) in [
            (&tts.bos, "tts_bos"),
            (&tts.eos, "tts_eos"),
            (&tts.pad, "tts_pad"),
        ] {
            e = e.max(max_abs_diff(ours, &io[k]));
        }
        let speakers = ids(&io["speakers"]);
        assert_eq!(talker.config().speaker("Chelsie"), Some(speakers[0]));
        for (r, &spk) in speakers.iter().enumerate() {
            let g = |k: &str| io[&format!("row{r}.{k}")].unsqueeze(0).unwrap();
            let user = talker
                .user_part(&g("user_embed"), &g("user_hidden"), &g("mm_mask"))
                .unwrap();
            let (asst, trailing) = talker
                .assistant_part(&g("asst_embed"), &[spk], &tts)
                .unwrap();
            let all = Tensor::cat(&[&user, &asst], 1).unwrap();
            for (ours, k) in [
                (&user, "user"),
                (&asst, "asst"),
                (&trailing, "trailing"),
                (&all, "inputs_embeds"),
            ] {
                e = e.max(max_abs_diff(ours, &g(k)));
            }
        }
        println!("talker prompt parts max abs {e:.2e}");
        assert!(e <= 1e-5, "{e}");
    }

    #[test]
    fn prefill_matches_reference() {
        let talker = load();
        let io = fixtures::io("talker");
        let x = io["row0.inputs_embeds"].unsqueeze(0).unwrap();
        let (_, out) = talker.prefill(&x, None, None).unwrap();
        let e1h = max_abs_diff(&out.hidden, &io["b1.prefill_hidden"]);
        let e1l = max_abs_diff(&out.logits, &io["b1.prefill_logits"]);

        let mask = &io["b2.mask"];
        let (_, out) = talker
            .prefill(&io["b2.inputs_embeds"], Some(mask), None)
            .unwrap();
        let e2l = max_abs_diff(&out.logits, &io["b2.prefill_logits"]);
        // Padding positions are not compared (their outputs are never used).
        let mut e2h: f32 = 0.0;
        let m = mask.to_dtype(DType::U32).unwrap().to_vec2::<u32>().unwrap();
        for (r, row) in m.iter().enumerate() {
            let start = row.iter().position(|&v| v != 0).unwrap();
            let n = row.len() - start;
            let ours = out.hidden.get(r).unwrap().narrow(0, start, n).unwrap();
            let want = io["b2.prefill_hidden"]
                .get(r)
                .unwrap()
                .narrow(0, start, n)
                .unwrap();
            e2h = e2h.max(max_abs_diff(&ours, &want));
        }
        println!("talker prefill max abs: b1 hidden {e1h:.2e} logits {e1l:.2e}; b2 hidden {e2h:.2e} logits {e2l:.2e}");
        for e in [e1h, e1l, e2h, e2l] {
            assert!(e <= 1e-4, "{e}");
        }
    }

    /// Batch 1, greedy with the top-level defaults that apply when greedy (repetition
    /// penalty 1.05, suppressed control ids): every code of 32 frames and all logits.
    #[test]
    fn greedy_generation_matches_reference() {
        let talker = load();
        let io = fixtures::io("talker");
        let x = io["row0.inputs_embeds"].unsqueeze(0).unwrap();
        let trailing = io["row0.trailing"].unsqueeze(0).unwrap();
        let (codes, logits) = generate(&talker, &x, None, &trailing, &io["tts_pad"], 1.05);
        let e = max_abs_diff(&logits, &io["b1.logits"]);
        println!("talker b1 greedy: {FRAMES} frames, code-0 logits max abs {e:.2e}");
        let want = want_codes(&io["b1.codes"]);
        assert_eq!(codes, want);
        // Not trivially matched: spread logits and more than one code in every group.
        let std = io["b1.logits"]
            .flatten_all()
            .and_then(|t| t.var(0))
            .and_then(|t| t.sqrt())
            .and_then(|t| t.to_scalar::<f32>())
            .unwrap();
        assert!(std > 0.3, "{std}");
        for g in 0..4 {
            let mut distinct: Vec<u32> = want[0].iter().map(|f| f[g]).collect();
            distinct.sort_unstable();
            distinct.dedup();
            assert!(distinct.len() > 2, "group {g}: {distinct:?}");
        }
        assert!(e <= 1e-4, "{e}");
    }

    /// Batch 2 (different prompt lengths, left padding, different speakers): equal to the
    /// reference's batch, and each row run alone equals its batch row.
    #[test]
    fn batch_matches_reference_and_rows_alone() {
        let talker = load();
        let io = fixtures::io("talker");
        let tts_pad = &io["tts_pad"];
        let (codes, logits) = generate(
            &talker,
            &io["b2.inputs_embeds"],
            Some(&io["b2.mask"]),
            &io["b2.trailing"],
            tts_pad,
            1.0,
        );
        let want = want_codes(&io["b2.codes"]);
        let e = max_abs_diff(&logits, &io["b2.logits"]);
        assert_eq!(codes, want);
        let mut e_alone: f32 = 0.0;
        for (r, want_row) in want.iter().enumerate() {
            let x = io[&format!("row{r}.inputs_embeds")].unsqueeze(0).unwrap();
            let t = io[&format!("row{r}.trailing")].unsqueeze(0).unwrap();
            let (c, l) = generate(&talker, &x, None, &t, tts_pad, 1.0);
            assert_eq!(&c[0], want_row, "row {r} alone");
            e_alone = e_alone.max(max_abs_diff(
                &l.get(0).unwrap(),
                &io["b2.logits"].get(r).unwrap(),
            ));
        }
        println!("talker b2 greedy: codes identical; logits max abs batch {e:.2e}, rows alone {e_alone:.2e}");
        assert!(e <= 1e-4 && e_alone <= 1e-4, "{e} {e_alone}");
    }

    /// Sampling with the top-level defaults: seeded per row, reproducible, never a
    /// suppressed control id.
    #[test]
    fn sampled_generation_is_seeded() {
        let talker = load();
        let io = fixtures::io("talker");
        let cfg = talker.config().clone();
        let x = &io["b2.inputs_embeds"];
        let trailing = &io["b2.trailing"];
        let run = |seed: u64| {
            let code0_cfg =
                SamplingConfig::talker(cfg.text_config.vocab_size, cfg.codec_eos_token_id);
            let mut s: Vec<Sampler> = (0..2)
                .map(|r| Sampler::new(code0_cfg.clone().with_seed(seed + r)))
                .collect();
            let mut cp: Vec<Sampler> = (0..2)
                .map(|r| Sampler::new(SamplingConfig::code_predictor().with_seed(seed + 10 + r)))
                .collect();
            let (mut state, out) = talker.prefill(x, Some(&io["b2.mask"]), None).unwrap();
            let mut logits = out.logits;
            let mut frames = Vec::new();
            for f in 0..8 {
                let rows = logits.to_vec2::<f32>().unwrap();
                let code0: Vec<u32> = s
                    .iter_mut()
                    .zip(&rows)
                    .map(|(s, l)| s.sample(l).unwrap())
                    .collect();
                let step = talker
                    .step(
                        &mut state,
                        &code0,
                        &trailing.narrow(1, f, 1).unwrap(),
                        &mut cp,
                    )
                    .unwrap();
                frames.push(step.codes);
                logits = step.logits;
            }
            frames
        };
        let a = run(5);
        assert_eq!(a, run(5));
        let suppressed = cfg.suppress_tokens();
        assert!(a
            .iter()
            .flatten()
            .all(|f| !suppressed.contains(&f[0]) && f[1..].iter().all(|&c| c < 64)));
    }

    /// The released checkpoint's older field names (`rope_scaling` + `rope_theta`, extra keys).
    #[test]
    fn parses_released_style_config() {
        let json = serde_json::json!({
            "accept_hidden_layer": 24, "audio_end_token_id": 151670,
            "audio_start_token_id": 151669, "audio_token_id": 151675,
            "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
            "codec_bos_id": 2149, "codec_eos_token_id": 2150, "codec_pad_id": 2148,
            "codec_nothink_id": 2155, "codec_think_bos_id": 2156, "codec_think_eos_id": 2157,
            "num_code_groups": 16, "thinker_hidden_size": 2048, "spatial_merge_size": 2,
            "position_id_per_seconds": 13, "seconds_per_chunk": 2,
            "speaker_id": {"chelsie": 2301, "ethan": 2302, "aiden": 2303},
            "text_config": {
                "num_hidden_layers": 20, "hidden_size": 1024, "intermediate_size": 2048,
                "num_attention_heads": 16, "num_key_value_heads": 2, "head_dim": 128,
                "moe_intermediate_size": 384, "shared_expert_intermediate_size": 768,
                "num_experts": 128, "num_experts_per_tok": 6, "norm_topk_prob": true,
                "vocab_size": 3072, "rope_theta": 1000000, "hidden_act": "silu",
                "rope_scaling": {"mrope_section": [24, 20, 20], "interleaved": true},
                "max_position_embeddings": 65536
            },
            "code_predictor_config": {
                "num_hidden_layers": 5, "hidden_size": 1024, "head_dim": 128,
                "num_attention_heads": 16, "num_key_value_heads": 8, "intermediate_size": 3072,
                "vocab_size": 2048, "num_code_groups": 16, "rope_theta": 1000000,
                "rope_scaling": null, "hidden_act": "silu", "rms_norm_eps": 1e-06
            }
        });
        let cfg: TalkerConfig = serde_json::from_value(json).unwrap();
        assert_eq!(cfg.speaker("Ethan"), Some(2302));
        assert_eq!(cfg.text_config.mrope_section(), Some(vec![24, 20, 20]));
        assert_eq!(cfg.text_config.rope_theta(), 1e6);
        assert_eq!(cfg.code_predictor_config.num_code_groups, 16);
        assert_eq!(cfg.code_predictor_config.decoder.vocab_size, 2048);
        assert_eq!(cfg.code_predictor_config.decoder.mrope_section(), None);
        let s = cfg.suppress_tokens();
        assert_eq!((s.len(), s[0], *s.last().unwrap()), (1023, 2048, 3071));
        assert!(!s.contains(&2150));
    }
}
