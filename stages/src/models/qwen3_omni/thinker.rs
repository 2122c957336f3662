//! The Qwen3-Omni Thinker's text model (`Qwen3OmniMoeThinkerForConditionalGeneration` minus
//! the vision path): token embeddings with audio embeddings scattered in at the audio
//! placeholder tokens, the MoE decoder with interleaved MRoPE, the final norm and `lm_head`.
//!
//! Weights: a `VarBuilder` scoped to `thinker` (`model.embed_tokens`, `model.layers.{i}`,
//! `model.norm`, `lm_head`; the audio tower `audio_tower` is a separate module).
//!
//! Streaming: [`Thinker::prefill`] takes the (left-padded) prompt, [`Thinker::step`] the
//! next tokens; both append to the explicit [`ThinkerCache`]. Each returns the logits and
//! the requested hidden states in the reference's `output_hidden_states` indexing
//! (0 = input embeddings, `i` = output of layer `i - 1`, `num_hidden_layers` = final
//! normed state), which is what the Talker consumes (`[0]` and `[accept_hidden_layer]`).
//!
//! Positions: the reference (transformers 5.24 `get_rope_index`) builds MRoPE positions
//! from vision grids only; for text and audio prompts every row is the running count of
//! real tokens (left padding gets position 1), which is also what its 3-D audio branch
//! yields for audio segments (`arange(audio_len)` after the audio-start token).

use super::audio_encoder::feat_extract_output_lengths;
use super::graphs;
use super::layers::{
    self, attention_mask, Attention, DecoderConfig, DecoderLayer, KvCache, KvSlots, RmsNorm,
    RotaryEmbedding, SlotBatch,
};
use candle_core::{DType, Device, IndexOp, Module, Result, Tensor, D};
use candle_nn::{Embedding, Linear, VarBuilder};
use serde::Deserialize;
use std::collections::hash_map::Entry;
use std::collections::{HashMap, HashSet};

/// The Thinker's `text_config` (same fields as every Qwen3-Omni decoder).
pub type ThinkerTextConfig = DecoderConfig;

fn default_n_window() -> usize {
    50
}

/// The part of the Thinker's `audio_config` the text model needs (the audio encoder
/// parses the whole of it).
#[derive(Debug, Clone, Deserialize)]
pub struct ThinkerAudioConfig {
    #[serde(default = "default_n_window")]
    pub n_window: usize,
}

impl Default for ThinkerAudioConfig {
    fn default() -> Self {
        Self {
            n_window: default_n_window(),
        }
    }
}

fn default_pos_per_sec() -> usize {
    25
}
fn default_audio_token() -> u32 {
    151646
}
fn default_image_token() -> u32 {
    151655
}
fn default_video_token() -> u32 {
    151656
}
fn default_audio_start() -> u32 {
    151647
}
fn default_user_token() -> u32 {
    872
}

/// `thinker_config` (Hugging Face names; `*_token_index` accepted as older aliases).
#[derive(Debug, Clone, Deserialize)]
pub struct ThinkerConfig {
    pub text_config: ThinkerTextConfig,
    #[serde(default)]
    pub audio_config: ThinkerAudioConfig,
    #[serde(default = "default_pos_per_sec")]
    pub position_id_per_seconds: usize,
    #[serde(default = "default_audio_token", alias = "audio_token_index")]
    pub audio_token_id: u32,
    #[serde(default = "default_image_token", alias = "image_token_index")]
    pub image_token_id: u32,
    #[serde(default = "default_video_token", alias = "video_token_index")]
    pub video_token_id: u32,
    #[serde(default = "default_audio_start")]
    pub audio_start_token_id: u32,
    #[serde(default)]
    pub vision_start_token_id: Option<u32>,
    #[serde(default = "default_user_token")]
    pub user_token_id: u32,
}

/// The audio encoder's output for the prompt's audio placeholders.
#[derive(Debug, Clone, Copy)]
pub struct AudioEmbeds<'a> {
    /// `(n_audio_tokens, hidden)`: every audio, in prompt order (row-major over the batch).
    pub embeds: &'a Tensor,
    /// Mel frames of each audio (`feature_attention_mask.sum(-1)`), used to check that the
    /// placeholder count matches the encoder's output length; empty to skip the check.
    pub feature_lengths: &'a [usize],
}

/// Text/audio MRoPE position ids `(3, b, s)` from a 2-D attention mask (1 = token,
/// 0 = padding), as the reference's `get_rope_index` without vision grids: the running
/// count of real tokens minus one, and 1 at padding. Returns the rows and, per batch row,
/// the position the next token takes.
pub fn get_rope_index(attention_mask: &[Vec<u8>]) -> (Vec<Vec<i64>>, Vec<i64>) {
    let mut rows = Vec::with_capacity(attention_mask.len());
    let mut next = Vec::with_capacity(attention_mask.len());
    for m in attention_mask {
        let mut c = 0i64;
        let row: Vec<i64> = m
            .iter()
            .map(|&x| {
                c += i64::from(x != 0);
                if x != 0 {
                    c - 1
                } else {
                    1
                }
            })
            .collect();
        // generate continues from the last prompt position + 1.
        next.push(row.last().map_or(0, |&p| p + 1));
        rows.push(row);
    }
    (rows, next)
}

/// The streaming state of one (batched) Thinker generation.
#[derive(Debug, Clone)]
pub struct ThinkerCache {
    kv: Vec<KvCache>,
    /// `(b, cached)` 1 = token, 0 = padding, over every cached position.
    padding: Vec<Vec<u8>>,
    /// Per batch row, the rope position of the next token.
    next_pos: Vec<i64>,
}

impl ThinkerCache {
    /// Cached positions (prompt + generated).
    pub fn seq_len(&self) -> usize {
        self.kv.first().map_or(0, |c| c.seq_len())
    }

    pub fn reset(&mut self) {
        self.kv.iter_mut().for_each(|c| c.reset());
        self.padding.clear();
        self.next_pos.clear();
    }
}

/// One captured decode step: its graph and the persistent tensors it reads (ids,
/// positions, scatter rows, mask) and writes (logits, embeddings).
#[derive(Debug)]
struct DecodeGraph {
    graph: graphs::StepGraph,
    inputs: [Tensor; 4],
    logits: Tensor,
    embeds: Tensor,
}

/// The Thinker's captured decode steps by bucket `(rows, kv_len)`, owned by the
/// stage that decodes with them (graphs replay on its thread's stream).
#[derive(Debug, Default)]
pub struct ThinkerGraphs {
    steps: HashMap<(usize, usize), DecodeGraph>,
    /// Buckets whose capture failed: they run eagerly.
    failed: HashSet<(usize, usize)>,
}

impl ThinkerGraphs {
    /// Buckets captured so far.
    pub fn captured(&self) -> usize {
        self.steps.len()
    }
}

/// Logits and the requested hidden states of one forward.
#[derive(Debug, Clone)]
pub struct ThinkerOutput {
    /// `(b, s, vocab)`, f32.
    pub logits: Tensor,
    /// `(b, s, hidden)` each, in the order requested.
    pub hidden_states: Vec<Tensor>,
}

#[derive(Debug, Clone)]
pub struct Thinker {
    embed_tokens: Embedding,
    layers: Vec<DecoderLayer>,
    norm: RmsNorm,
    rotary_emb: RotaryEmbedding,
    lm_head: Linear,
    cfg: ThinkerConfig,
    device: Device,
}

impl Thinker {
    /// `vb` scoped to `thinker`.
    pub fn new(cfg: &ThinkerConfig, vb: VarBuilder) -> Result<Self> {
        let tc = &cfg.text_config;
        let vbm = vb.pp("model");
        let embed_tokens =
            candle_nn::embedding(tc.vocab_size, tc.hidden_size, vbm.pp("embed_tokens"))?;
        let layers = (0..tc.num_hidden_layers)
            .map(|i| DecoderLayer::new(tc, i, vbm.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let norm = RmsNorm::new(tc.hidden_size, tc.rms_norm_eps, vbm.pp("norm"))?;
        let lm_head = if tc.tie_word_embeddings {
            Linear::new(embed_tokens.embeddings().clone(), None)
        } else {
            candle_nn::linear_no_bias(tc.hidden_size, tc.vocab_size, vb.pp("lm_head"))?
        };
        let rotary_emb = RotaryEmbedding::from_config(tc, vb.device())?;
        Ok(Self {
            embed_tokens,
            layers,
            norm,
            rotary_emb,
            lm_head,
            cfg: cfg.clone(),
            device: vb.device().clone(),
        })
    }

    pub fn config(&self) -> &ThinkerConfig {
        &self.cfg
    }

    /// Decoder layers (the index of the final normed hidden state).
    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn new_cache(&self) -> ThinkerCache {
        ThinkerCache {
            kv: vec![KvCache::new(); self.layers.len()],
            padding: Vec::new(),
            next_pos: Vec::new(),
        }
    }

    /// Token embeddings `(b, s, hidden)` of `(b, s)` u32 ids.
    pub fn embed_tokens(&self, input_ids: &Tensor) -> Result<Tensor> {
        self.embed_tokens.forward(input_ids)
    }

    /// The prompt embeddings with the audio embeddings at the `audio_token_id` positions
    /// (the reference's `masked_scatter`, row-major over the batch).
    pub fn embed_prompt(&self, input_ids: &Tensor, audio: Option<AudioEmbeds>) -> Result<Tensor> {
        let embeds = self.embed_tokens(input_ids)?;
        let Some(audio) = audio else {
            return Ok(embeds);
        };
        let (b, s, h) = embeds.dims3()?;
        let ids = input_ids.flatten_all()?.to_vec1::<u32>()?;
        let n_audio = audio.embeds.dim(0)?;
        let n_placeholders = ids
            .iter()
            .filter(|&&t| t == self.cfg.audio_token_id)
            .count();
        if n_placeholders != n_audio {
            candle_core::bail!(
                "{n_placeholders} audio placeholder tokens but {n_audio} audio embeddings"
            );
        }
        if !audio.feature_lengths.is_empty() {
            let expect: usize = audio
                .feature_lengths
                .iter()
                .map(|&n| feat_extract_output_lengths(n, self.cfg.audio_config.n_window))
                .sum();
            if expect != n_audio {
                candle_core::bail!(
                    "audio feature lengths {:?} give {expect} tokens, the prompt has {n_audio}",
                    audio.feature_lengths
                );
            }
        }
        // Gather from [text embeddings; audio embeddings].
        let mut k = 0u32;
        let idx: Vec<u32> = ids
            .iter()
            .enumerate()
            .map(|(p, &t)| {
                if t == self.cfg.audio_token_id {
                    k += 1;
                    (b * s) as u32 + k - 1
                } else {
                    p as u32
                }
            })
            .collect();
        let all = Tensor::cat(
            &[
                embeds.reshape((b * s, h))?,
                audio.embeds.to_dtype(embeds.dtype())?,
            ],
            0,
        )?;
        let idx = Tensor::from_vec(idx, b * s, &self.device)?;
        all.index_select(&idx, 0)?.reshape((b, s, h))
    }

    /// Runs the prompt `(b, s)` (u32 ids, left-padded; `attention_mask` `(b, s)`, 1 = token,
    /// `None` = no padding) into a fresh `cache`. `hidden` lists the hidden-state indices to
    /// return (see the module doc).
    pub fn prefill(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        audio: Option<AudioEmbeds>,
        cache: &mut ThinkerCache,
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        self.prefill_impl(input_ids, attention_mask, audio, cache, hidden, false)
    }

    /// [`Self::prefill`] with logits for the last position only, `(b, 1, vocab)` (and
    /// the final normed state, when asked for, there only): what decoding needs, without
    /// a head over every prompt position.
    pub fn prefill_last(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        audio: Option<AudioEmbeds>,
        cache: &mut ThinkerCache,
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        self.prefill_impl(input_ids, attention_mask, audio, cache, hidden, true)
    }

    fn prefill_impl(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        audio: Option<AudioEmbeds>,
        cache: &mut ThinkerCache,
        hidden: &[usize],
        last_only: bool,
    ) -> Result<ThinkerOutput> {
        let (b, s) = input_ids.dims2()?;
        let padding: Vec<Vec<u8>> = match attention_mask {
            Some(m) => m
                .to_dtype(DType::F32)?
                .to_vec2::<f32>()?
                .into_iter()
                .map(|r| r.into_iter().map(|x| u8::from(x != 0.0)).collect())
                .collect(),
            None => vec![vec![1u8; s]; b],
        };
        if padding.len() != b || padding.iter().any(|r| r.len() != s) {
            candle_core::bail!(
                "attention_mask does not match input_ids {:?}",
                input_ids.dims()
            );
        }
        cache.reset();
        let embeds = self.embed_prompt(input_ids, audio)?;
        let (pos, next) = get_rope_index(&padding);
        cache.padding = padding;
        cache.next_pos = next;
        self.forward_embeds(&embeds, &pos, cache, hidden, last_only)
    }

    /// Appends the next tokens `(b, s)` (usually `s = 1`) after a [`Self::prefill`].
    pub fn step(
        &self,
        input_ids: &Tensor,
        cache: &mut ThinkerCache,
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        self.extend(input_ids, None, cache, hidden, false)
    }

    /// Appends the next part `(b, s)` of a prompt after a [`Self::prefill`] of
    /// its start (chunked prefill): `audio` holds the embeddings of this
    /// part's `<|audio_pad|>` tokens, in order. Logits for the last position only,
    /// as [`Self::prefill_last`].
    pub fn extend_last(
        &self,
        input_ids: &Tensor,
        audio: Option<AudioEmbeds>,
        cache: &mut ThinkerCache,
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        self.extend(input_ids, audio, cache, hidden, true)
    }

    fn extend(
        &self,
        input_ids: &Tensor,
        audio: Option<AudioEmbeds>,
        cache: &mut ThinkerCache,
        hidden: &[usize],
        last_only: bool,
    ) -> Result<ThinkerOutput> {
        let (b, s) = input_ids.dims2()?;
        if cache.next_pos.len() != b {
            candle_core::bail!(
                "step: batch {b} but the cache holds {}",
                cache.next_pos.len()
            );
        }
        let embeds = self.embed_prompt(input_ids, audio)?;
        let pos: Vec<Vec<i64>> = cache
            .next_pos
            .iter()
            .map(|&p| (0..s as i64).map(|i| p + i).collect())
            .collect();
        for (row, n) in cache.padding.iter_mut().zip(cache.next_pos.iter_mut()) {
            row.extend(std::iter::repeat_n(1u8, s));
            *n += s as i64;
        }
        self.forward_embeds(&embeds, &pos, cache, hidden, last_only)
    }

    /// The decoder over `embeds` `(b, s, hidden)` at per-row positions `pos` (the same on
    /// all three MRoPE rows, as for text and audio), after the positions already in `cache`,
    /// whose `padding` already covers the new positions.
    fn forward_embeds(
        &self,
        embeds: &Tensor,
        pos: &[Vec<i64>],
        cache: &mut ThinkerCache,
        hidden: &[usize],
        last_only: bool,
    ) -> Result<ThinkerOutput> {
        let (b, s, _) = embeds.dims3()?;
        let flat: Vec<f32> = pos.iter().flatten().map(|&p| p as f32).collect();
        let pos = Tensor::from_vec(flat, (1, b, s), &self.device)?.repeat((3, 1, 1))?;
        let (cos, sin) = self.rotary_emb.forward(&pos, embeds.dtype())?;
        let kv_len = cache.padding.first().map_or(0, |r| r.len());
        let pad_flat: Vec<u8> = cache.padding.iter().flatten().copied().collect();
        let pad = Tensor::from_vec(pad_flat, (b, kv_len), &Device::Cpu)?;
        let mask = attention_mask(Some(&pad), b, s, kv_len, &self.device)?;

        let kv = &mut cache.kv;
        self.run_layers(embeds, hidden, last_only, |i, attn, x| {
            match kv.get_mut(i) {
                Some(c) => attn.forward(x, &cos, &sin, mask.as_ref(), Some(c)),
                None => candle_core::bail!("no cache for layer {i}"),
            }
        })
    }

    /// The decoder layers (`attn(index, attention, normed)` runs a layer's attention,
    /// [`layers::run_decoder`]), the final norm and the head, recording the requested
    /// hidden states.
    fn run_layers(
        &self,
        embeds: &Tensor,
        hidden: &[usize],
        last_only: bool,
        attn: impl FnMut(usize, &Attention, &Tensor) -> Result<Tensor>,
    ) -> Result<ThinkerOutput> {
        let n_layers = self.layers.len();
        if let Some(&bad) = hidden.iter().find(|&&i| i > n_layers) {
            candle_core::bail!("hidden state index {bad} > num_hidden_layers {n_layers}");
        }
        let mut out_hidden: Vec<Option<Tensor>> = vec![None; hidden.len()];
        let mut record = |i: usize, h: &Tensor| {
            for (slot, &want) in out_hidden.iter_mut().zip(hidden) {
                if want == i {
                    *slot = Some(h.clone());
                }
            }
        };
        record(0, embeds);
        let x = layers::run_decoder(&self.layers, &self.norm, embeds, attn, &mut record)?;
        // The final norm is per position: normed whole, then narrowed.
        let x = if last_only {
            x.narrow(1, x.dim(1)? - 1, 1)?.contiguous()?
        } else {
            x
        };
        record(n_layers, &x);
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        let hidden_states = out_hidden
            .into_iter()
            .map(|h| h.ok_or_else(|| candle_core::Error::Msg("hidden state not recorded".into())))
            .collect::<Result<Vec<_>>>()?;
        Ok(ThinkerOutput {
            logits,
            hidden_states,
        })
    }

    /// KV slots for a running batch of up to `slots` requests of up to `max_len`
    /// positions each, one per layer, in the embeddings' dtype.
    pub fn new_slots(&self, slots: usize, max_len: usize) -> Result<Vec<KvSlots>> {
        let dtype = self.embed_tokens.embeddings().dtype();
        layers::new_slots(&self.layers, slots, max_len, dtype, &self.device)
    }

    /// Moves row `row` of a prefilled `cache` (its tokens, without the left padding)
    /// into `slot`; the request then decodes with [`Self::step_slots`]. Returns the
    /// row's cached length and the rope position of its next token.
    pub fn load_slot(
        &self,
        slots: &[KvSlots],
        slot: usize,
        cache: &ThinkerCache,
        row: usize,
    ) -> Result<(usize, i64)> {
        let (Some(pad), Some(&next)) = (cache.padding.get(row), cache.next_pos.get(row)) else {
            candle_core::bail!("load_slot: the cache has no row {row}");
        };
        let start = pad.iter().take_while(|&&m| m == 0).count();
        for (s, kv) in slots.iter().zip(&cache.kv) {
            s.load(slot, kv, row, start)?;
        }
        Ok((pad.len() - start, next))
    }

    /// One decode step of a running batch: row `i` lives in slot `i` with `lens[i]` cached
    /// positions, feeds `ids[i]` at rope position `pos[i]`. Same outputs as [`Self::step`]
    /// with `s = 1`.
    pub fn step_slots(
        &self,
        ids: &[u32],
        pos: &[i64],
        lens: &[usize],
        slots: &[KvSlots],
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        let b = ids.len();
        let (Some(first), true) = (slots.first(), pos.len() == b && lens.len() == b) else {
            candle_core::bail!(
                "step_slots: {b} ids, {} positions, {} lengths",
                pos.len(),
                lens.len()
            );
        };
        let input = Tensor::from_vec(ids.to_vec(), (b, 1), &self.device)?;
        let flat: Vec<f32> = pos.iter().map(|&p| p as f32).collect();
        let pos = Tensor::from_vec(flat, (1, b, 1), &self.device)?;
        let rows: Vec<usize> = (0..b).collect();
        let batch = SlotBatch::new(first, &rows, lens)?;
        self.forward_slots(&input, &pos, &batch, slots, hidden)
    }

    /// The decoder over one token per row: ids `(b, 1)` u32 at rope positions
    /// `(1, b, 1)` f32, keys/values through `batch` into `slots`.
    fn forward_slots(
        &self,
        ids: &Tensor,
        pos: &Tensor,
        batch: &SlotBatch,
        slots: &[KvSlots],
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        let embeds = self.embed_tokens(ids)?;
        let (cos, sin) = self
            .rotary_emb
            .forward(&pos.repeat((3, 1, 1))?, embeds.dtype())?;
        self.run_layers(&embeds, hidden, false, |i, attn, x| match slots.get(i) {
            Some(s) => attn.forward_slots(x, &cos, &sin, s, batch),
            None => candle_core::bail!("no KV slots for layer {i}"),
        })
    }

    /// [`Self::step_slots`] through a CUDA graph of the step's bucket (captured by
    /// [`Self::warm_up_graphs`], or on first use from this real step), so the step
    /// costs one launch instead of
    /// thousands. Falls back to the eager step where no graph applies: hidden states
    /// other than the embeddings (`[0]`), more rows than slots, or a bucket whose
    /// capture failed (logged once).
    pub fn step_slots_graphed(
        &self,
        graphs: &mut ThinkerGraphs,
        ids: &[u32],
        pos: &[i64],
        lens: &[usize],
        slots: &[KvSlots],
        hidden: &[usize],
    ) -> Result<ThinkerOutput> {
        let b = ids.len();
        let kv_len = lens.iter().map(|l| l + 1).max().unwrap_or(0);
        let key = match slots.first() {
            Some(s) if pos.len() == b && lens.len() == b && hidden.iter().all(|&h| h == 0) => {
                graphs::bucket(b, kv_len, s.slots(), s.max_len())
            }
            _ => None,
        };
        let Some(key) = key.filter(|k| !graphs.failed.contains(k)) else {
            return self.step_slots(ids, pos, lens, slots, hidden);
        };
        let inputs = self.graph_inputs(ids, pos, lens, slots, key)?;
        let g = match graphs.steps.entry(key) {
            Entry::Occupied(e) => {
                let g = e.into_mut();
                for (dst, src) in g.inputs.iter().zip(&inputs) {
                    dst.slice_set(src, 0, 0)?;
                }
                g.graph.launch()?;
                g
            }
            // The capture's warm-up run is this step itself: its outputs land in the
            // persistent tensors, and the graph serves the bucket from the next step on.
            Entry::Vacant(e) => match self.capture_decode(key, inputs, slots) {
                Ok(g) => e.insert(g),
                Err(err) => {
                    tracing::warn!(
                        "Thinker decode graph for {} rows, {} positions: {err}; \
                         that bucket runs eagerly",
                        key.0,
                        key.1
                    );
                    graphs.failed.insert(key);
                    // Rerunning writes the same keys/values again: harmless.
                    return self.step_slots(ids, pos, lens, slots, hidden);
                }
            },
        };
        let hidden_states = match hidden {
            [] => Vec::new(),
            _ => vec![g.embeds.narrow(0, 0, b)?.copy()?; hidden.len()],
        };
        // Copies: the next replay overwrites the persistent outputs.
        Ok(ThinkerOutput {
            logits: g.logits.narrow(0, 0, b)?.copy()?,
            hidden_states,
        })
    }

    /// Captures, before any request runs, the decode steps of every batch bucket at
    /// the first key/value bucket (longer ones are captured when a batch first
    /// reaches them), so no request waits for those captures. Steps of empty rows
    /// write only into free slots. Returns how many were captured.
    pub fn warm_up_graphs(&self, graphs: &mut ThinkerGraphs, slots: &[KvSlots]) -> usize {
        let Some(first) = slots.first() else {
            return 0;
        };
        for &b in graphs::BATCH_BUCKETS.iter() {
            let Some(key) = graphs::bucket(b, 1, first.slots(), first.max_len()) else {
                continue;
            };
            if graphs.steps.contains_key(&key) || graphs.failed.contains(&key) {
                continue;
            }
            let captured = self
                .graph_inputs(&[], &[], &[], slots, key)
                .and_then(|inputs| self.capture_decode(key, inputs, slots));
            match captured {
                Ok(g) => {
                    graphs.steps.insert(key, g);
                }
                Err(err) => {
                    tracing::warn!(
                        "Thinker decode graph for {} rows: {err}; eager there",
                        key.0
                    );
                    graphs.failed.insert(key);
                }
            }
        }
        graphs.steps.len()
    }

    /// A graphed step's inputs for rows `ids` at bucket `(rows, kv_len)`: ids, rope
    /// positions, scatter rows and mask. Padded rows decode token 0 at position 0
    /// into the free slots past the batch.
    fn graph_inputs(
        &self,
        ids: &[u32],
        pos: &[i64],
        lens: &[usize],
        slots: &[KvSlots],
        (bb, ll): (usize, usize),
    ) -> Result<[Tensor; 4]> {
        let Some(first) = slots.first() else {
            candle_core::bail!("no KV slots");
        };
        let pad = bb.saturating_sub(ids.len());
        let ids_p: Vec<u32> = ids
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        let pos_p: Vec<f32> = pos
            .iter()
            .map(|&p| p as f32)
            .chain(std::iter::repeat_n(0.0, pad))
            .collect();
        let lens_p: Vec<usize> = lens
            .iter()
            .copied()
            .chain(std::iter::repeat_n(0, pad))
            .collect();
        let rows: Vec<usize> = (0..bb).collect();
        let (scatter, mask) = SlotBatch::host(first, &rows, &lens_p, ll)?;
        let (_, kvh, _, hd) = first.shape()?;
        let dev = &self.device;
        Ok([
            Tensor::from_vec(ids_p, (bb, 1), dev)?,
            Tensor::from_vec(pos_p, (1, bb, 1), dev)?,
            Tensor::from_vec(scatter, (bb * kvh, hd), dev)?,
            Tensor::from_vec(mask, (bb, 1, 1, ll), dev)?,
        ])
    }

    /// Runs the step of `inputs` (from [`Self::graph_inputs`]) and captures it.
    fn capture_decode(
        &self,
        (bb, _): (usize, usize),
        inputs: [Tensor; 4],
        slots: &[KvSlots],
    ) -> Result<DecodeGraph> {
        let tc = &self.cfg.text_config;
        let dev = &self.device;
        let logits = Tensor::zeros((bb, 1, tc.vocab_size), DType::F32, dev)?;
        let dtype = self.embed_tokens.embeddings().dtype();
        let embeds = Tensor::zeros((bb, 1, tc.hidden_size), dtype, dev)?;
        let [ids, pos, scatter, mask] = &inputs;
        let graph = graphs::StepGraph::capture(dev, || {
            let batch = SlotBatch::from_device(scatter.clone(), mask.clone())?;
            let out = self.forward_slots(ids, pos, &batch, slots, &[0])?;
            logits.slice_set(&out.logits, 0, 0)?;
            embeds.slice_set(&out.hidden_states[0], 0, 0)
        })?;
        Ok(DecodeGraph {
            graph,
            inputs,
            logits,
            embeds,
        })
    }

    /// Greedy decoding as the reference's `generate(do_sample=False)`: `max_new_tokens`
    /// per row; a row that emits one of `eos_ids` continues with `pad_id`, and decoding
    /// stops once every row has. Returns the new tokens per row.
    pub fn generate_greedy(
        &self,
        input_ids: &Tensor,
        attention_mask: Option<&Tensor>,
        audio: Option<AudioEmbeds>,
        max_new_tokens: usize,
        eos_ids: &[u32],
        pad_id: u32,
    ) -> Result<Vec<Vec<u32>>> {
        let b = input_ids.dim(0)?;
        let mut cache = self.new_cache();
        let mut out = vec![Vec::with_capacity(max_new_tokens); b];
        let mut done = vec![false; b];
        if max_new_tokens == 0 {
            return Ok(out);
        }
        let mut logits = self
            .prefill(input_ids, attention_mask, audio, &mut cache, &[])?
            .logits;
        loop {
            let s = logits.dim(1)?;
            let next = logits.i((.., s - 1))?.argmax(D::Minus1)?.to_vec1::<u32>()?;
            let next: Vec<u32> = next
                .into_iter()
                .zip(&done)
                .map(|(t, &d)| if d { pad_id } else { t })
                .collect();
            for (i, &t) in next.iter().enumerate() {
                out[i].push(t);
                if eos_ids.contains(&t) {
                    done[i] = true;
                }
            }
            if out[0].len() >= max_new_tokens || done.iter().all(|&d| d) {
                return Ok(out);
            }
            let ids = Tensor::from_vec(next, (b, 1), &self.device)?;
            logits = self.step(&ids, &mut cache, &[])?.logits;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures;
    use std::collections::HashMap;

    fn load() -> (Thinker, HashMap<String, Tensor>, serde_json::Value) {
        let cfg: ThinkerConfig =
            serde_json::from_value(fixtures::config()["thinker_config"].clone()).unwrap();
        let model = Thinker::new(&cfg, fixtures::weights().pp("thinker")).unwrap();
        let meta: serde_json::Value = serde_json::from_str(
            &std::fs::read_to_string(fixtures::dir().join("thinker/io.json")).unwrap(),
        )
        .unwrap();
        (model, fixtures::io("thinker"), meta)
    }

    fn ids(t: &Tensor) -> Tensor {
        t.to_dtype(DType::U32).unwrap()
    }

    fn check(name: &str, got: &Tensor, want: &Tensor, tol: f32) -> f32 {
        let want_max = fixtures::max_abs_diff(want, &want.zeros_like().unwrap());
        assert!(want_max > 1e-2, "{name}: reference is ~0 ({want_max})");
        let d = fixtures::max_abs_diff(got, want);
        println!("{name}: max abs err {d:.3e} (reference max {want_max:.3})");
        assert!(d <= tol, "{name}: {d} > {tol}");
        d
    }

    fn audio_input(io: &HashMap<String, Tensor>) -> (Tensor, Vec<usize>) {
        let lens = io["audio.feature_lengths"].to_vec1::<i64>().unwrap();
        (
            io["audio.embeds"].clone(),
            lens.into_iter().map(|n| n as usize).collect(),
        )
    }

    #[test]
    fn config_parses_released_names() {
        let cfg: DecoderConfig = serde_json::from_str(
            r#"{"vocab_size": 152064, "hidden_size": 2048, "intermediate_size": 768,
                "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                "head_dim": 128, "rope_theta": 1000000, "num_experts": 128,
                "num_experts_per_tok": 8, "moe_intermediate_size": 768, "norm_topk_prob": true,
                "decoder_sparse_step": 1, "mlp_only_layers": [], "hidden_act": "silu",
                "rope_scaling": {"interleaved": true, "mrope_interleaved": true,
                                 "mrope_section": [24, 20, 20], "rope_type": "default",
                                 "type": "default"}}"#,
        )
        .unwrap();
        assert_eq!(cfg.rope_theta(), 1e6);
        assert_eq!(cfg.mrope_section(), Some(vec![24, 20, 20]));
        assert!(cfg.is_sparse_layer(0));
        assert_eq!(feat_extract_output_lengths(150, 50), 20);
        assert_eq!(feat_extract_output_lengths(200, 50), 26);
    }

    #[test]
    fn rope_index_matches_reference() {
        let (_, io, _) = load();
        let mask = io["b2.attention_mask"].to_vec2::<i64>().unwrap();
        let mask: Vec<Vec<u8>> = mask
            .into_iter()
            .map(|r| r.into_iter().map(|x| x as u8).collect())
            .collect();
        let (rows, _) = get_rope_index(&mask);
        let want = io["b2.position_ids"].to_vec3::<i64>().unwrap();
        for w in want {
            assert_eq!(w, rows);
        }
    }

    fn prefill_case(name: &str, audio: bool) {
        let (model, io, meta) = load();
        let acc = meta["accept_hidden_layer"].as_u64().unwrap() as usize;
        let n = model.config().text_config.num_hidden_layers;
        let (ae, lens) = audio_input(&io);
        let audio = audio.then_some(AudioEmbeds {
            embeds: &ae,
            feature_lengths: &lens,
        });
        let mut cache = model.new_cache();
        let out = model
            .prefill(
                &ids(&io[&format!("{name}.input_ids")]),
                Some(&io[&format!("{name}.attention_mask")]),
                audio,
                &mut cache,
                &[0, acc, n],
            )
            .unwrap();
        let tol = 1e-4;
        check(
            &format!("{name} logits"),
            &out.logits,
            &io[&format!("{name}.logits")],
            tol,
        );
        if let Some(a) = audio {
            // The audio embeddings must matter: without them the logits are far off.
            let zeros = a.embeds.zeros_like().unwrap();
            let mut c = model.new_cache();
            let without = AudioEmbeds {
                embeds: &zeros,
                ..a
            };
            let ids = ids(&io[&format!("{name}.input_ids")]);
            let mask = &io[&format!("{name}.attention_mask")];
            let o = model
                .prefill(&ids, Some(mask), Some(without), &mut c, &[])
                .unwrap();
            let d = fixtures::max_abs_diff(&o.logits, &io[&format!("{name}.logits")]);
            println!("{name}: logits with zeroed audio embeddings off by {d:.3}");
            assert!(d > 0.1, "audio embeddings have no effect ({d})");
        }
        check(
            &format!("{name} hidden[0]"),
            &out.hidden_states[0],
            &io[&format!("{name}.hidden0")],
            tol,
        );
        check(
            &format!("{name} hidden[acc]"),
            &out.hidden_states[1],
            &io[&format!("{name}.hidden_acc")],
            tol,
        );
        check(
            &format!("{name} hidden[-1]"),
            &out.hidden_states[2],
            &io[&format!("{name}.hidden_last")],
            tol,
        );
    }

    #[test]
    fn prefill_batch1() {
        prefill_case("b1", false);
    }

    #[test]
    fn prefill_batch2_left_padded() {
        prefill_case("b2", false);
    }

    #[test]
    fn prefill_with_audio() {
        prefill_case("audio", true);
    }

    /// Greedy decoding step by step: the same ids, per-step logits and decode-step hidden
    /// states as the reference's `generate`.
    fn generate_case(name: &str, audio: bool) {
        let (model, io, meta) = load();
        let acc = meta["accept_hidden_layer"].as_u64().unwrap() as usize;
        let n_steps = meta["n_steps"].as_u64().unwrap() as usize;
        let (ae, lens) = audio_input(&io);
        let audio = audio.then_some(AudioEmbeds {
            embeds: &ae,
            feature_lengths: &lens,
        });
        let input_ids = ids(&io[&format!("{name}.input_ids")]);
        let mask = &io[&format!("{name}.attention_mask")];
        let want_ids = io[&format!("{name}.gen_ids")].to_vec2::<i64>().unwrap();
        let want_logits = &io[&format!("{name}.gen_logits")];
        let b = input_ids.dim(0).unwrap();

        let mut cache = model.new_cache();
        let mut out = model
            .prefill(&input_ids, Some(mask), audio, &mut cache, &[0, acc])
            .unwrap();
        let mut got_ids = vec![Vec::new(); b];
        let (mut step_logits, mut h0, mut hacc) = (Vec::new(), Vec::new(), Vec::new());
        let mut min_margin = f32::MAX;
        for step in 0..n_steps {
            let s = out.logits.dim(1).unwrap();
            let last = out.logits.i((.., s - 1)).unwrap();
            // The top-2 gap of the reference logits: greedy equality is meaningful only
            // when it is well above the tolerance.
            let wl = want_logits.i((.., step)).unwrap().to_vec2::<f32>().unwrap();
            for row in &wl {
                let mut v = row.clone();
                v.sort_by(|a, b| b.partial_cmp(a).unwrap());
                min_margin = min_margin.min(v[0] - v[1]);
            }
            let next = last.argmax(D::Minus1).unwrap().to_vec1::<u32>().unwrap();
            for (r, &t) in next.iter().enumerate() {
                got_ids[r].push(t as i64);
            }
            step_logits.push(last.unsqueeze(1).unwrap());
            if step + 1 == n_steps {
                break;
            }
            let t = Tensor::from_vec(next, (b, 1), &Device::Cpu).unwrap();
            out = model.step(&t, &mut cache, &[0, acc]).unwrap();
            h0.push(out.hidden_states[0].clone());
            hacc.push(out.hidden_states[1].clone());
        }
        assert_eq!(got_ids, want_ids, "{name}: greedy ids differ");
        println!("{name}: {n_steps} greedy ids equal (min top-2 logit gap {min_margin:.3e})");
        let tol = 1e-4;
        check(
            &format!("{name} step logits"),
            &Tensor::cat(&step_logits, 1).unwrap(),
            want_logits,
            tol,
        );
        check(
            &format!("{name} step hidden[0]"),
            &Tensor::cat(&h0, 1).unwrap(),
            &io[&format!("{name}.gen_hidden0")],
            tol,
        );
        check(
            &format!("{name} step hidden[acc]"),
            &Tensor::cat(&hacc, 1).unwrap(),
            &io[&format!("{name}.gen_hidden_acc")],
            tol,
        );

        // The one-call greedy loop gives the same ids.
        let audio2 = audio.map(|a| AudioEmbeds { ..a });
        let greedy = model
            .generate_greedy(&input_ids, Some(mask), audio2, n_steps, &[], 0)
            .unwrap();
        let greedy: Vec<Vec<i64>> = greedy
            .into_iter()
            .map(|r| r.into_iter().map(i64::from).collect())
            .collect();
        assert_eq!(greedy, want_ids, "{name}: generate_greedy ids differ");
    }

    #[test]
    fn generate_batch1() {
        generate_case("b1", false);
    }

    #[test]
    fn generate_batch2_left_padded() {
        generate_case("b2", false);
    }

    #[test]
    fn generate_with_audio() {
        generate_case("audio", true);
    }
}

#[cfg(test)]
mod slot_tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures;

    /// Requests of different lengths decoded together over KV slots, joining and
    /// leaving the batch (with compaction), give each request's own `step` results.
    #[test]
    fn batched_slots_match_single_steps() {
        let cfg: ThinkerConfig =
            serde_json::from_value(fixtures::config()["thinker_config"].clone()).unwrap();
        let model = Thinker::new(&cfg, fixtures::weights().pp("thinker")).unwrap();
        let dev = Device::Cpu;
        let prompts: Vec<Vec<u32>> = vec![(1..9).collect(), (20..23).collect(), (40..57).collect()];
        // Reference: each alone.
        let steps = 6;
        let mut want = Vec::new();
        for p in &prompts {
            let mut cache = model.new_cache();
            let ids = Tensor::from_vec(p.clone(), (1, p.len()), &dev).unwrap();
            let mut logits = model
                .prefill(&ids, None, None, &mut cache, &[0])
                .unwrap()
                .logits;
            let mut rows = Vec::new();
            let mut tok = logits
                .i((0, p.len() - 1))
                .unwrap()
                .argmax(0)
                .unwrap()
                .to_scalar::<u32>()
                .unwrap();
            for _ in 0..steps {
                let ids = Tensor::from_vec(vec![tok], (1, 1), &dev).unwrap();
                let out = model.step(&ids, &mut cache, &[0]).unwrap();
                logits = out.logits.i((0, 0)).unwrap();
                rows.push((tok, logits.clone(), out.hidden_states[0].i((0, 0)).unwrap()));
                tok = logits.argmax(0).unwrap().to_scalar::<u32>().unwrap();
            }
            want.push(rows);
        }
        // Batched: request 1 joins at step 2; request 0 leaves after 4 steps.
        let slots = model.new_slots(3, 64).unwrap();
        struct Live {
            req: usize,
            step: usize,
            len: usize,
            pos: i64,
        }
        let mut live: Vec<Live> = Vec::new();
        let join = |req: usize, slot: usize| -> Live {
            let p = &prompts[req];
            let mut cache = model.new_cache();
            let ids = Tensor::from_vec(p.clone(), (1, p.len()), &dev).unwrap();
            model.prefill(&ids, None, None, &mut cache, &[]).unwrap();
            let (len, pos) = model.load_slot(&slots, slot, &cache, 0).unwrap();
            Live {
                req,
                step: 0,
                len,
                pos,
            }
        };
        live.push(join(0, 0));
        live.push(join(2, 1));
        let mut worst = 0f32;
        for round in 0..20 {
            if round == 2 {
                live.push(join(1, live.len()));
            }
            if live.is_empty() {
                break;
            }
            let ids: Vec<u32> = live.iter().map(|l| want[l.req][l.step].0).collect();
            let pos: Vec<i64> = live.iter().map(|l| l.pos).collect();
            let lens: Vec<usize> = live.iter().map(|l| l.len).collect();
            let out = model.step_slots(&ids, &pos, &lens, &slots, &[0]).unwrap();
            for (row, l) in live.iter_mut().enumerate() {
                let (_, logits, embed) = &want[l.req][l.step];
                worst = worst.max(fixtures::max_abs_diff(
                    &out.logits.i((row, 0)).unwrap(),
                    logits,
                ));
                assert_eq!(
                    fixtures::max_abs_diff(&out.hidden_states[0].i((row, 0)).unwrap(), embed),
                    0.0
                );
                l.step += 1;
                l.len += 1;
                l.pos += 1;
            }
            // Leave: request 0 after 4 steps, others when done; the last slot moves in.
            let mut row = 0;
            while row < live.len() {
                let l = &live[row];
                if (l.req == 0 && l.step == 4) || l.step == steps {
                    let last = live.len() - 1;
                    for s in &slots {
                        s.move_slot(last, row).unwrap();
                    }
                    live.swap_remove(row);
                } else {
                    row += 1;
                }
            }
        }
        assert!(live.is_empty());
        assert!(worst < 1e-4, "batched logits differ by {worst}");
    }
}
