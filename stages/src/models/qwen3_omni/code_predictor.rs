//! Qwen3-Omni's code predictor (`Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration`,
//! weights under `talker.code_predictor`): a small dense Qwen3 decoder that, for each
//! Talker frame, turns `[talker last hidden, talker.codec_embedding(code0)]` into the
//! residual codes 1..N-1, each from its own head `lm_head.{i}` and fed back through its
//! own table `model.codec_embedding.{i}`.
//!
//! The reference (`code_predictor.generate` inside the Talker's
//! `prepare_inputs_for_generation`) starts every frame from an empty cache: a 2-position
//! prefill, then one cached step per further code. Here a frame runs on KV slots written
//! in place (the same attention, so the same codes): positions 0 and 1 in one step of
//! twice the rows, then one position a step, whose tables are made once per batch size
//! (`SlotFrame`).
//!
//! Public API:
//! - [`CodePredictorConfig`] (the `code_predictor_config` JSON: the decoder fields plus
//!   `num_code_groups`).
//! - [`CodePredictor::new(cfg, vb)`](CodePredictor::new) (`vb` = `talker.code_predictor`),
//!   `generate(&past_hidden, &code0_embed, &mut samplers) -> PredictedCodes`,
//!   `embed(group, &ids)`, `forward_hidden(&inputs_embeds)`, `num_code_groups()`.

use super::graphs;
use super::kernels;
use super::layers::{
    self, attention_mask, new_slots, run_decoder, Attention, DecoderConfig, DecoderLayer, KvCache,
    KvSlots, RmsNorm, RotaryEmbedding, SlotBatch,
};
use super::sampling::{self, sample_on_device_with, samples_on_device, Sampler, SamplingConfig};
use candle_core::{DType, Module, Result, Tensor};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

/// `Qwen3OmniMoeTalkerCodePredictorConfig`.
#[derive(Debug, Clone, Deserialize)]
pub struct CodePredictorConfig {
    #[serde(flatten)]
    pub decoder: DecoderConfig,
    /// Codes per frame (the Talker's code 0 included): 16 in the released model.
    pub num_code_groups: usize,
}

/// `Qwen3OmniMoeTalkerCodePredictorModel`.
#[derive(Debug, Clone)]
struct CodePredictorModel {
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary_emb: RotaryEmbedding,
    /// `codec_embedding.{i}` embeds code `i + 1`.
    codec_embedding: Vec<Embedding>,
}

impl CodePredictorModel {
    /// `embedding_dim`: the Talker's width, which the code embeddings have.
    fn new(cfg: &CodePredictorConfig, embedding_dim: usize, vb: VarBuilder) -> Result<Self> {
        let d = &cfg.decoder;
        let layers = (0..d.num_hidden_layers)
            .map(|i| DecoderLayer::new(d, i, vb.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let codec_embedding = (0..cfg.num_code_groups.saturating_sub(1))
            .map(|i| {
                candle_nn::embedding(d.vocab_size, embedding_dim, vb.pp("codec_embedding").pp(i))
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            layers,
            norm: RmsNorm::new(d.hidden_size, d.rms_norm_eps, vb.pp("norm"))?,
            rotary_emb: RotaryEmbedding::new(d.head_dim(), d.rope_theta(), None, vb.device())?,
            codec_embedding,
        })
    }

    /// `(b, s, hidden)` after `past` cached positions -> final-normed hidden `(b, s, hidden)`.
    fn forward(&self, x: &Tensor, caches: &mut [KvCache]) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let past = caches.first().map_or(0, |c| c.seq_len());
        let pos = Tensor::arange(past as u32, (past + s) as u32, x.device())?
            .unsqueeze(0)?
            .broadcast_as((b, s))?
            .contiguous()?;
        let (cos, sin) = self.rotary_emb.forward(&pos, x.dtype())?;
        let mask = attention_mask(None, b, s, past + s, x.device())?;
        let attn = |i: usize, a: &Attention, h: &Tensor| match caches.get_mut(i) {
            Some(c) => a.forward(h, &cos, &sin, mask.as_ref(), Some(c)),
            None => candle_core::bail!("no cache for layer {i}"),
        };
        run_decoder(&self.layers, &self.norm, x, attn, |_, _| {})
    }

    /// Step `i` of a frame through the frame's KV slots ([`SlotFrame::steps`]):
    /// `(rows, 1, hidden)` -> the final-normed hidden `(rows, 1, hidden)`.
    fn forward_step(&self, x: &Tensor, frame: &SlotFrame, i: usize) -> Result<Tensor> {
        let step = frame
            .steps
            .get(i)
            .ok_or_else(|| candle_core::Error::Msg(format!("no frame step {i}")))?;
        let (cos, sin, kv) = (&step.cos, &step.sin, &frame.kv);
        let fuse = kernels::FUSED_DECODE_ROWS.get() as usize;
        layers::run_decoder_slots(&self.layers, &self.norm, x, cos, sin, kv, &step.batch, fuse)
    }
}

/// A frame's positions on KV slots, written in place (no cache grows, no rotary
/// table is computed during the frame): every frame uses positions `0..groups` of
/// slots `0..b`, so all of this is built once per batch size and serves every frame
/// (a captured graph reads it). Position `p` writes its keys and values before any
/// position reads them, so nothing is reset between frames.
///
/// Step 0 takes positions 0 and 1 together, as `2 * b` rows (row `b + i` in the
/// same slot as row `i`, seeing one more position): their keys and values are
/// written before the attention reads them, so one pass of the layers does both,
/// where a weight-bound pass costs about the same for twice the rows. Step `i >= 1`
/// is position `i + 1`.
#[derive(Debug)]
struct SlotFrame {
    /// Per layer `(b, kv_heads, groups, head_dim)`.
    kv: Vec<KvSlots>,
    /// Per step: where its keys go and what it sees, and its rotary tables
    /// `(rows, 1, head_dim / 2)`.
    steps: Vec<SlotStep>,
}

#[derive(Debug)]
struct SlotStep {
    batch: SlotBatch,
    cos: Tensor,
    sin: Tensor,
}

/// One frame's residual codes for each row, and the raw logits they came from.
#[derive(Debug, Clone)]
pub struct PredictedCodes {
    /// `codes[row]` = codes 1..N-1.
    pub codes: Vec<Vec<u32>>,
    /// Per code 1..N-1: raw logits `(b, codebook)` in f32.
    pub logits: Vec<Tensor>,
    /// `Σ_i codec_embedding.{i}(code i+1)`, `(b, 1, hidden)`: the code predictor's share of
    /// the Talker's next input.
    pub embed_sum: Tensor,
}

/// `Qwen3OmniMoeTalkerCodePredictorModelForConditionalGeneration` (and qwen-tts's
/// `Qwen3TTSTalkerCodePredictorModelForConditionalGeneration`, whose inputs go
/// through `small_to_mtp_projection` where it is narrower than the Talker).
#[derive(Debug, Clone)]
pub struct CodePredictor {
    model: CodePredictorModel,
    /// Talker width -> code predictor width, where they differ (Qwen3-TTS 1.7B).
    small_to_mtp_projection: Option<Linear>,
    /// The Talker's width: its hidden states and the code embeddings.
    embedding_dim: usize,
    /// With `small_to_mtp_projection`: each code table through it, once at load
    /// (`(vocab, hidden)`), so a step's input is one lookup instead of a
    /// projection of the looked-up row (the same sums, row by row).
    projected_embedding: Option<Vec<Embedding>>,
    /// `lm_head.{i}` predicts code `i + 1`.
    lm_head: Vec<Linear>,
    cfg: CodePredictorConfig,
}

impl CodePredictor {
    /// A code predictor as wide as its Talker (Qwen3-Omni's).
    pub fn new(cfg: &CodePredictorConfig, vb: VarBuilder) -> Result<Self> {
        Self::for_talker(cfg, cfg.decoder.hidden_size, vb)
    }

    /// A code predictor under a Talker `talker_hidden` wide: narrower ones take
    /// their inputs through `small_to_mtp_projection`.
    pub fn for_talker(
        cfg: &CodePredictorConfig,
        talker_hidden: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        if cfg.num_code_groups < 2 {
            candle_core::bail!("num_code_groups {} must be >= 2", cfg.num_code_groups);
        }
        let d = &cfg.decoder;
        let lm_head = (0..cfg.num_code_groups - 1)
            .map(|i| candle_nn::linear_no_bias(d.hidden_size, d.vocab_size, vb.pp("lm_head").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let small_to_mtp_projection = (talker_hidden != d.hidden_size)
            .then(|| {
                candle_nn::linear(
                    talker_hidden,
                    d.hidden_size,
                    vb.pp("small_to_mtp_projection"),
                )
            })
            .transpose()?;
        let model = CodePredictorModel::new(cfg, talker_hidden, vb.pp("model"))?;
        let projected_embedding = small_to_mtp_projection
            .as_ref()
            .map(|p| {
                model
                    .codec_embedding
                    .iter()
                    .map(|e| Ok(Embedding::new(p.forward(e.embeddings())?, d.hidden_size)))
                    .collect::<Result<Vec<_>>>()
            })
            .transpose()?;
        Ok(Self {
            model,
            small_to_mtp_projection,
            embedding_dim: talker_hidden,
            projected_embedding,
            lm_head,
            cfg: cfg.clone(),
        })
    }

    /// Talker-wide inputs `(b, s, talker_hidden)` at the code predictor's width.
    fn project(&self, x: &Tensor) -> Result<Tensor> {
        match &self.small_to_mtp_projection {
            Some(p) => layers::project(p, x),
            None => Ok(x.clone()),
        }
    }

    pub fn config(&self) -> &CodePredictorConfig {
        &self.cfg
    }

    pub fn num_code_groups(&self) -> usize {
        self.cfg.num_code_groups
    }

    /// Embeds code `group` (1..N-1) ids `(b, s)` with `codec_embedding.{group - 1}`.
    pub fn embed(&self, group: usize, ids: &Tensor) -> Result<Tensor> {
        match group
            .checked_sub(1)
            .and_then(|i| self.model.codec_embedding.get(i))
        {
            Some(e) => e.forward(ids),
            None => candle_core::bail!("code group {group} has no code predictor embedding"),
        }
    }

    /// The final-normed hidden states of a cache-less forward over `inputs_embeds`
    /// `(b, s, hidden)` (what the reference's prefill computes).
    pub fn forward_hidden(&self, inputs_embeds: &Tensor) -> Result<Tensor> {
        let mut caches = vec![KvCache::new(); self.model.layers.len()];
        self.model
            .forward(&self.project(inputs_embeds)?, &mut caches)
    }

    /// Codes 1..N-1 of one frame for every row: `past_hidden` is the Talker's last
    /// final-normed hidden state `(b, 1, hidden)` (or `(b, hidden)`), `code0_embed` the
    /// Talker's `codec_embedding(code0)` of the same shape. `samplers[row]` chooses that
    /// row's codes (greedy or sampled; see [`super::sampling::SamplingConfig::code_predictor`]).
    pub fn generate(
        &self,
        past_hidden: &Tensor,
        code0_embed: &Tensor,
        samplers: &mut [Sampler],
    ) -> Result<PredictedCodes> {
        self.run(past_hidden, code0_embed, Draw::Host(samplers))
    }

    /// [`Self::generate`] with every code drawn on the device by
    /// [`sampling::sample_on_device`] (for configs [`samples_on_device`] accepts): the 15
    /// steps run without a host round-trip, and the codes come back once at the end.
    pub fn generate_on_device(
        &self,
        past_hidden: &Tensor,
        code0_embed: &Tensor,
        cfg: &SamplingConfig,
    ) -> Result<PredictedCodes> {
        if !samples_on_device(cfg) {
            candle_core::bail!("this sampling config needs the host sampler");
        }
        self.run(past_hidden, code0_embed, Draw::Device(cfg, None))
    }

    /// [`Self::generate_on_device`] through a CUDA graph of the frame at the batch's
    /// bucket (captured by [`Self::warm_up_graphs`], or on first use from this real
    /// frame): one launch for the 15
    /// steps' kernels. The noise is drawn before the replay. Runs eagerly past the
    /// largest bucket or where a capture failed (logged once). No logits come back.
    pub fn generate_graphed(
        &self,
        graphs: &mut PredictorGraphs,
        past_hidden: &Tensor,
        code0_embed: &Tensor,
        cfg: &SamplingConfig,
    ) -> Result<PredictedCodes> {
        if !samples_on_device(cfg) {
            candle_core::bail!("this sampling config needs the host sampler");
        }
        let (past_hidden, code0_embed) = (as_rows(past_hidden)?, as_rows(code0_embed)?);
        let b = past_hidden.dim(0)?;
        let bucket = graphs::BATCH_BUCKETS.iter().copied().find(|&n| n >= b);
        let key = bucket.map(|n| {
            let (t, p) = (cfg.temperature.to_bits(), cfg.top_p.to_bits());
            (n, cfg.do_sample, cfg.top_k, t, p)
        });
        let Some(key @ (bb, ..)) = key.filter(|k| !graphs.failed.contains(k)) else {
            return self.generate_on_device(&past_hidden, &code0_embed, cfg);
        };
        let dev = past_hidden.device();
        let n = self.cfg.num_code_groups - 1;
        let k = sampling::device_candidates(cfg, self.cfg.decoder.vocab_size);
        let noise = cfg
            .do_sample
            .then(|| Tensor::rand(1e-20f32, 1.0, (n, bb, k), dev))
            .transpose()?;
        // Rows `b..bb` keep whatever the last frame left there: finite, and dropped.
        let write = |dst: &Tensor, src: &Tensor| dst.slice_set(&src.contiguous()?, 0, 0);
        let g = match graphs.frames.entry(key) {
            Entry::Occupied(e) => {
                let g = e.into_mut();
                write(&g.past_hidden, &past_hidden)?;
                write(&g.code0_embed, &code0_embed)?;
                if let (Some(dst), Some(src)) = (&g.noise, &noise) {
                    write(dst, src)?;
                }
                // The Talker's frames go first on a GPU shared with the Thinker.
                g.graph.launch_urgent(dev)?;
                g
            }
            Entry::Vacant(e) => {
                let hidden = past_hidden.dim(2)?;
                let padded = |t: &Tensor| -> Result<Tensor> {
                    let p = Tensor::zeros((bb, 1, hidden), t.dtype(), dev)?;
                    write(&p, t)?;
                    Ok(p)
                };
                let (ph, ce) = (padded(&past_hidden)?, padded(&code0_embed)?);
                let frame = self.slot_frame(bb, ph.dtype(), dev)?;
                let codes = Tensor::zeros((bb, n), DType::U32, dev)?;
                let sum_dtype = self.model.codec_embedding[0].embeddings().dtype();
                let embed_sum = Tensor::zeros((bb, 1, hidden), sum_dtype, dev)?;
                // As the Thinker's graphs: the capture's warm-up run is this frame.
                let captured = graphs::StepGraph::capture(dev, || {
                    let draw = Draw::Device(cfg, noise.as_ref());
                    let f = self.run_frame(&ph, &ce, draw, Some(&frame))?;
                    let c = f.device_codes.ok_or_else(|| {
                        candle_core::Error::Msg("device draws gave no codes".into())
                    })?;
                    codes.slice_set(&c, 0, 0)?;
                    embed_sum.slice_set(&f.embed_sum, 0, 0)
                });
                match captured {
                    Ok(graph) => e.insert(FrameGraph {
                        graph,
                        _frame: frame,
                        past_hidden: ph,
                        code0_embed: ce,
                        noise,
                        codes,
                        embed_sum,
                    }),
                    Err(err) => {
                        tracing::warn!(
                            "code predictor graph for {bb} rows: {err}; that bucket runs eagerly"
                        );
                        graphs.failed.insert(key);
                        return self.generate_on_device(&past_hidden, &code0_embed, cfg);
                    }
                }
            }
        };
        Ok(PredictedCodes {
            codes: g.codes.narrow(0, 0, b)?.to_vec2::<u32>()?,
            logits: Vec::new(),
            embed_sum: g.embed_sum.narrow(0, 0, b)?.copy()?,
        })
    }

    /// Captures the frames of every batch bucket up to `max_batch` for `cfg` before
    /// any request runs (on zero inputs: a frame has no state to disturb). Returns
    /// how many graphs there are.
    pub fn warm_up_graphs(
        &self,
        graphs: &mut PredictorGraphs,
        max_batch: usize,
        cfg: &SamplingConfig,
    ) -> Result<usize> {
        let hidden = self.embedding_dim;
        // The Talker's states come in the weights' dtype.
        let emb = self.model.codec_embedding[0].embeddings();
        for &b in graphs::BATCH_BUCKETS.iter().filter(|&&b| b <= max_batch) {
            let x = Tensor::zeros((b, 1, hidden), emb.dtype(), emb.device())?;
            self.generate_graphed(graphs, &x, &x, cfg)?;
        }
        Ok(graphs.frames.len())
    }

    fn run(
        &self,
        past_hidden: &Tensor,
        code0_embed: &Tensor,
        draw: Draw,
    ) -> Result<PredictedCodes> {
        let f = self.run_frame(past_hidden, code0_embed, draw, None)?;
        let codes = match f.device_codes {
            Some(c) => c.to_vec2::<u32>()?,
            None => f.host_codes,
        };
        Ok(PredictedCodes {
            codes,
            logits: f.logits,
            embed_sum: f.embed_sum,
        })
    }

    /// The KV slots and per-position tables of a frame of `b` rows in `dtype`.
    fn slot_frame(
        &self,
        b: usize,
        dtype: DType,
        device: &candle_core::Device,
    ) -> Result<SlotFrame> {
        let positions = self.cfg.num_code_groups;
        let kv = new_slots(&self.model.layers, b, positions, dtype, device)?;
        let step = |slots: Vec<usize>, lens: Vec<usize>| -> Result<SlotStep> {
            let pos: Vec<u32> = lens.iter().map(|&l| l as u32).collect();
            let ids = Tensor::from_vec(pos, (lens.len(), 1), device)?;
            let (cos, sin) = self.model.rotary_emb.forward(&ids, dtype)?;
            let batch = SlotBatch::new(&kv[0], &slots, &lens)?;
            Ok(SlotStep { batch, cos, sin })
        };
        let slots: Vec<usize> = (0..b).collect();
        let both = [slots.clone(), slots.clone()].concat();
        let mut steps = vec![step(both, [vec![0; b], vec![1; b]].concat())?];
        for p in 2..positions {
            steps.push(step(slots.clone(), vec![p; b])?);
        }
        Ok(SlotFrame { kv, steps })
    }

    /// One frame as the reference computes it, on KV slots: position 0 the Talker's
    /// hidden state and 1 the embedding of code 0 (which gives code 1) in one step,
    /// then each code's embedding in turn. `frame` from [`Self::slot_frame`] at the
    /// batch's rows, or built here.
    fn run_frame(
        &self,
        past_hidden: &Tensor,
        code0_embed: &Tensor,
        mut draw: Draw,
        frame: Option<&SlotFrame>,
    ) -> Result<Frame> {
        let past_hidden = as_rows(past_hidden)?;
        let dtype = past_hidden.dtype();
        let code0_embed = as_rows(code0_embed)?.to_dtype(dtype)?;
        let b = past_hidden.dim(0)?;
        if code0_embed.dims() != past_hidden.dims() {
            candle_core::bail!(
                "code predictor: hidden {:?} and code 0 embedding {:?}",
                past_hidden.dims(),
                code0_embed.dims()
            );
        }
        if let Draw::Host(samplers) = &draw {
            if samplers.len() != b {
                candle_core::bail!("{} samplers for a batch of {b}", samplers.len());
            }
        }
        let built;
        let frame = match frame {
            Some(f) => f,
            None => {
                built = self.slot_frame(b, dtype, past_hidden.device())?;
                &built
            }
        };
        let n = self.cfg.num_code_groups - 1;
        let mut codes = vec![Vec::with_capacity(n); b];
        let mut all_logits = Vec::with_capacity(n);
        let mut embed_sum: Option<Tensor> = None;
        let mut on_device = Vec::new();
        // Positions 0 and 1 in one step; position 0 only leaves its keys and values.
        let first = self.project(&Tensor::cat(&[&past_hidden, &code0_embed], 0)?)?;
        let mut h = self.model.forward_step(&first, frame, 0)?.narrow(0, b, b)?;
        // The next step's input at the code predictor's width.
        let mut input = first.narrow(0, b, b)?;
        for (g, head) in self.lm_head.iter().enumerate() {
            if g > 0 {
                h = self.model.forward_step(&input, frame, g)?;
            }
            let logits = layers::project(head, &h.squeeze(1)?)?.to_dtype(DType::F32)?;
            let ids = match &mut draw {
                Draw::Host(samplers) => {
                    let rows = logits.to_vec2::<f32>()?;
                    let mut ids = Vec::with_capacity(b);
                    for ((row, sampler), out) in
                        rows.iter().zip(samplers.iter_mut()).zip(codes.iter_mut())
                    {
                        let id = sampler.sample(row)?;
                        out.push(id);
                        ids.push(id);
                    }
                    Tensor::from_vec(ids, (b, 1), input.device())?
                }
                Draw::Device(cfg, noise) => {
                    let u = noise.map(|n| n.get(g)).transpose()?;
                    let ids = sample_on_device_with(&logits, cfg, u.as_ref())?.reshape((b, 1))?;
                    on_device.push(ids.clone());
                    ids
                }
            };
            all_logits.push(logits);
            // Code g+1 is embedded by table g, both as the next input and for the Talker.
            let e = self.model.codec_embedding[g].forward(&ids)?;
            embed_sum = Some(match embed_sum {
                Some(s) => (s + &e)?,
                None => e.clone(),
            });
            input = match &self.projected_embedding {
                Some(tables) => tables[g].forward(&ids)?.to_dtype(dtype)?,
                None => e.to_dtype(dtype)?,
            };
        }
        let embed_sum = match embed_sum {
            Some(s) => s,
            None => candle_core::bail!("no residual code groups"),
        };
        let device_codes = match on_device.is_empty() {
            true => None,
            false => Some(Tensor::cat(&on_device, 1)?),
        };
        Ok(Frame {
            host_codes: codes,
            device_codes,
            logits: all_logits,
            embed_sum,
        })
    }
}

/// A `(b, hidden)` state as `(b, 1, hidden)`; a `(b, 1, hidden)` one as it is.
fn as_rows(t: &Tensor) -> Result<Tensor> {
    match t.rank() {
        2 => t.unsqueeze(1),
        _ => Ok(t.clone()),
    }
}

/// Where [`CodePredictor`]'s codes are drawn.
enum Draw<'a> {
    /// Per row on the host, with the request's own sampler.
    Host(&'a mut [Sampler]),
    /// On the device, one config for all rows; with the uniform noise of every
    /// draw `(groups - 1, b, candidates)` given, or drawn at each.
    Device(&'a SamplingConfig, Option<&'a Tensor>),
}

/// A frame as [`CodePredictor`] computes it, before the codes come to the host.
struct Frame {
    /// Host draws: the codes per row.
    host_codes: Vec<Vec<u32>>,
    /// Device draws: the codes `(b, groups - 1)` u32.
    device_codes: Option<Tensor>,
    logits: Vec<Tensor>,
    embed_sum: Tensor,
}

/// One captured frame of device-drawn codes: its graph and the persistent tensors
/// it reads (last hidden, code-0 embedding, noise) and writes (codes, embedding sum).
#[derive(Debug)]
struct FrameGraph {
    graph: graphs::StepGraph,
    /// The KV slots and tables the graph reads and writes (kept alive with it).
    _frame: SlotFrame,
    past_hidden: Tensor,
    code0_embed: Tensor,
    noise: Option<Tensor>,
    codes: Tensor,
    embed_sum: Tensor,
}

/// The code predictor's captured frames, by batch bucket and sampling config (whose
/// temperature, top-k and top-p are baked into a graph).
#[derive(Debug, Default)]
pub struct PredictorGraphs {
    frames: HashMap<FrameKey, FrameGraph>,
    /// Keys whose capture failed: they run eagerly.
    failed: HashSet<FrameKey>,
}

/// Rows, then the config: do_sample, top-k, temperature and top-p bits.
type FrameKey = (usize, bool, usize, u32, u32);

impl PredictorGraphs {
    /// How many buckets failed to capture and run eagerly.
    pub fn failed(&self) -> usize {
        self.failed.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures;
    use crate::models::qwen3_omni::sampling::SamplingConfig;

    pub(crate) fn load() -> CodePredictor {
        let cfg: CodePredictorConfig = serde_json::from_value(
            fixtures::config()["talker_config"]["code_predictor_config"].clone(),
        )
        .unwrap();
        CodePredictor::new(&cfg, fixtures::weights().pp("talker").pp("code_predictor")).unwrap()
    }

    #[test]
    fn matches_reference_greedy() {
        let cp = load();
        let io = fixtures::io("code_predictor");
        let x = &io["inputs_embeds"];
        let b = x.dim(0).unwrap();

        let hidden = cp.forward_hidden(x).unwrap();
        let e_hidden = fixtures::max_abs_diff(&hidden, &io["prefill_hidden"]);
        let logits0 = cp.lm_head[0].forward(&hidden).unwrap();
        let e_prefill = fixtures::max_abs_diff(&logits0, &io["prefill_logits"]);

        let code0_embed = x.narrow(1, 1, 1).unwrap();
        let past_hidden = x.narrow(1, 0, 1).unwrap();
        let mut samplers: Vec<Sampler> = (0..b)
            .map(|_| Sampler::new(SamplingConfig::greedy()))
            .collect();
        let out = cp
            .generate(&past_hidden, &code0_embed, &mut samplers)
            .unwrap();
        let want: Vec<Vec<u32>> = io["codes"].to_dtype(DType::U32).unwrap().to_vec2().unwrap();
        assert_eq!(out.codes, want);
        let logits = Tensor::stack(&out.logits, 1).unwrap();
        let e_logits = fixtures::max_abs_diff(&logits, &io["logits"]);
        // The Talker's embedding of code 0 plus ours.
        let sum = (&code0_embed + &out.embed_sum).unwrap();
        let e_sum = fixtures::max_abs_diff(&sum, &io["codec_sum"]);
        println!("code predictor max abs: hidden {e_hidden:.2e} prefill logits {e_prefill:.2e} step logits {e_logits:.2e} embed sum {e_sum:.2e}");
        let std = io["logits"]
            .flatten_all()
            .unwrap()
            .var(0)
            .unwrap()
            .sqrt()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(std > 0.3, "reference logits are not trivial: std {std}");
        for e in [e_hidden, e_prefill, e_logits, e_sum] {
            assert!(e <= 1e-4, "{e}");
        }

        // Each row alone gives the same codes as in the batch.
        for (r, want_row) in want.iter().enumerate() {
            let mut s = vec![Sampler::new(SamplingConfig::greedy())];
            let one = cp
                .generate(
                    &past_hidden.narrow(0, r, 1).unwrap(),
                    &code0_embed.narrow(0, r, 1).unwrap(),
                    &mut s,
                )
                .unwrap();
            assert_eq!(&one.codes[0], want_row);
        }
    }

    #[test]
    fn sampled_codes_are_seeded_and_in_range() {
        let cp = load();
        let io = fixtures::io("code_predictor");
        let x = &io["inputs_embeds"];
        let run = |seed: u64| {
            let mut s: Vec<Sampler> = (0..x.dim(0).unwrap())
                .map(|r| Sampler::new(SamplingConfig::code_predictor().with_seed(seed + r as u64)))
                .collect();
            cp.generate(
                &x.narrow(1, 0, 1).unwrap(),
                &x.narrow(1, 1, 1).unwrap(),
                &mut s,
            )
            .unwrap()
            .codes
        };
        let a = run(1);
        assert_eq!(a, run(1));
        assert!(a.iter().flatten().all(|&c| c < 64));
    }

    /// At the released shapes on the GPU in bf16 (random weights), the slot frame's
    /// logits for every code equal a cache-less causal prefill over the same 16
    /// inputs (the frame's own codes embedded): the KV slots, positions and
    /// rotary tables of the engine's kernels against the prefill path.
    #[cfg(feature = "cuda")]
    #[test]
    fn slot_frame_matches_prefill_on_gpu() {
        use crate::models::qwen3_omni::weights;
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_omni_moe_bench/config.json");
        let all: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cfg: CodePredictorConfig =
            serde_json::from_value(all["talker_config"]["code_predictor_config"].clone()).unwrap();
        let dev = candle_core::Device::new_cuda(0).unwrap();
        let vb = weights::random(DType::BF16, &dev);
        let cp = CodePredictor::new(&cfg, vb.pp("talker").pp("code_predictor")).unwrap();
        let (b, hidden) = (5usize, cfg.decoder.hidden_size);
        let randn = || {
            Tensor::randn(0f32, 1.0, (b, 1, hidden), &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap()
        };
        let (ph, ce) = (randn(), randn());
        let out = cp
            .generate_on_device(&ph, &ce, &SamplingConfig::greedy())
            .unwrap();
        let codes = Tensor::new(out.codes.clone(), &dev).unwrap(); // (b, 15)
        let mut inputs = vec![ph, ce];
        for g in 1..cfg.num_code_groups - 1 {
            let ids = codes.narrow(1, g - 1, 1).unwrap();
            inputs.push(cp.embed(g, &ids).unwrap());
        }
        let hidden = cp
            .forward_hidden(&Tensor::cat(&inputs, 1).unwrap())
            .unwrap();
        let mut worst = 0f32;
        for (g, got) in out.logits.iter().enumerate() {
            let h = hidden
                .narrow(1, g + 1, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
                .contiguous()
                .unwrap();
            let want = cp.lm_head[g]
                .forward(&h)
                .unwrap()
                .to_dtype(DType::F32)
                .unwrap();
            let std = want.flatten_all().unwrap().var(0).unwrap().sqrt().unwrap();
            let std = std.to_scalar::<f32>().unwrap();
            let err = fixtures::max_abs_diff(got, &want) / std;
            worst = worst.max(err);
        }
        eprintln!("slot frame vs prefill: worst max abs logit error {worst:.3} of the logits' std");
        // bf16 through 5 layers by two kernel paths; a wrong position or key
        // would be off by about the std itself.
        assert!(worst < 0.1, "{worst}");
    }
}
