//! Decoder building blocks shared by Qwen3-Omni's three Qwen3 decoders (Thinker text
//! model, Talker, code predictor), mirroring `modeling_qwen3_omni_moe.py` (transformers
//! 5.24) so checkpoint names map one to one.
//!
//! Public API (stable; only additions from here on):
//! - [`DecoderConfig`] (serde, HF names; `rope_parameters` or the released checkpoint's
//!   `rope_scaling` + `rope_theta`; `num_experts` or `num_local_experts`) and
//!   [`RopeParameters`]. `head_dim()`, `rope_theta()`, `mrope_section()`,
//!   `is_sparse_layer(idx)`.
//! - [`RmsNorm::new(size, eps, vb)`](RmsNorm::new), `forward(&x)` (f32 inside).
//! - [`linear(in, out, bias, vb)`](linear): a `candle_nn::Linear` with or without bias.
//! - [`RotaryEmbedding::new(head_dim, theta, mrope_section, device)`](RotaryEmbedding::new),
//!   [`RotaryEmbedding::from_config`], `forward(&position_ids, dtype) -> (cos, sin)`:
//!   position ids `(b, s)` (plain) or `(3, b, s)` (interleaved MRoPE), any numeric dtype;
//!   cos/sin come back in *half* form `(b, s, head_dim / 2)`.
//! - [`apply_rotary_pos_emb(&q, &k, &cos, &sin)`](apply_rotary_pos_emb): q, k `(b, heads, s, d)`.
//! - [`KvCache`]: `new()`, `append(&k, &v) -> (k_all, v_all)`, `seq_len()`, `reset()`;
//!   a clone is an independent snapshot.
//! - [`attention_mask(padding, batch, q_len, kv_len, device)`](attention_mask): the additive
//!   causal (+ left-padding) mask `(b, 1, q, kv)`, 0 = visible, [`MASK_MIN`] = hidden;
//!   `None` where nothing needs masking (one query, no padding).
//! - [`Attention::new(cfg, vb)`](Attention::new), `forward(&x, &cos, &sin, mask, cache)`:
//!   GQA, q_norm/k_norm, optional bias, KV cache append.
//! - [`Mlp::new(hidden, intermediate, act, vb)`](Mlp::new): SwiGLU gate/up/down.
//! - [`SparseMoe::new(cfg, vb)`](SparseMoe::new): router `gate`, `experts.{e}.*`, and a
//!   sigmoid-gated `shared_expert` when `cfg.shared_expert_intermediate_size` is set.
//! - [`FeedForward`] (`Dense(Mlp)` / `Moe(SparseMoe)`), [`DecoderLayer::new(cfg, idx, vb)`]
//!   (dense or MoE per `mlp_only_layers` / `decoder_sparse_step`),
//!   [`DecoderLayer::with_feed_forward`] (e.g. the Talker, MoE in every layer),
//!   `forward(&x, &cos, &sin, mask, cache)`.

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::{Activation, Linear, VarBuilder};

use super::kernels;
use serde::Deserialize;

/// The additive value of a hidden position in an attention mask. Finite (not -inf), so a
/// query row with every key hidden (a left-padding row) softmaxes without NaN; such rows
/// are then zeroed, as torch's SDPA returns zeros for them.
pub const MASK_MIN: f32 = f32::MIN;

fn default_eps() -> f64 {
    1e-6
}
fn default_one() -> usize {
    1
}
fn default_act() -> Activation {
    Activation::Silu
}
fn default_max_pos() -> usize {
    32768
}

/// `rope_parameters` (transformers 5) or `rope_scaling` (the released checkpoint).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct RopeParameters {
    #[serde(default)]
    pub rope_type: Option<String>,
    /// The older name of `rope_type` (the released checkpoint writes both).
    #[serde(default, rename = "type")]
    pub legacy_type: Option<String>,
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub mrope_section: Option<Vec<usize>>,
    #[serde(default)]
    pub interleaved: Option<bool>,
    #[serde(default)]
    pub mrope_interleaved: Option<bool>,
}

/// A Qwen3(-MoE) decoder's config: the Thinker's and Talker's `text_config` and the
/// code predictor's config share these Hugging Face field names.
#[derive(Debug, Clone, Deserialize)]
pub struct DecoderConfig {
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "default_act")]
    pub hidden_act: Activation,
    #[serde(default = "default_eps")]
    pub rms_norm_eps: f64,
    #[serde(default, alias = "rope_scaling")]
    pub rope_parameters: Option<RopeParameters>,
    /// The released checkpoint's top-level theta (transformers 5 moved it into `rope_parameters`).
    #[serde(default)]
    pub rope_theta: Option<f64>,
    #[serde(default)]
    pub attention_bias: bool,
    #[serde(default, alias = "num_local_experts")]
    pub num_experts: usize,
    #[serde(default)]
    pub num_experts_per_tok: usize,
    #[serde(default)]
    pub moe_intermediate_size: usize,
    #[serde(default)]
    pub norm_topk_prob: bool,
    #[serde(default = "default_one")]
    pub decoder_sparse_step: usize,
    #[serde(default)]
    pub mlp_only_layers: Option<Vec<usize>>,
    #[serde(default)]
    pub shared_expert_intermediate_size: Option<usize>,
    #[serde(default = "default_max_pos")]
    pub max_position_embeddings: usize,
    #[serde(default)]
    pub tie_word_embeddings: bool,
}

impl DecoderConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    /// `rope_parameters.rope_theta`, else the top-level `rope_theta`, else 1e6 (the Qwen3-Omni
    /// text configs' `default_theta`).
    pub fn rope_theta(&self) -> f64 {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_theta)
            .or(self.rope_theta)
            .unwrap_or(1e6)
    }

    pub fn mrope_section(&self) -> Option<Vec<usize>> {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.mrope_section.clone())
    }

    fn rope_type(&self) -> &str {
        self.rope_parameters
            .as_ref()
            .and_then(|r| r.rope_type.as_deref().or(r.legacy_type.as_deref()))
            .unwrap_or("default")
    }

    /// Whether layer `idx` has the sparse MoE block (the reference's rule).
    pub fn is_sparse_layer(&self, idx: usize) -> bool {
        let mlp_only = self
            .mlp_only_layers
            .as_ref()
            .is_some_and(|l| l.contains(&idx));
        !mlp_only
            && self.num_experts > 0
            && self.decoder_sparse_step > 0
            && (idx + 1).is_multiple_of(self.decoder_sparse_step)
    }
}

/// A `candle_nn::Linear`, with a bias only where the checkpoint has one.
pub fn linear(in_dim: usize, out_dim: usize, bias: bool, vb: VarBuilder) -> Result<Linear> {
    candle_nn::linear_b(in_dim, out_dim, bias, vb)
}

/// The rows of `x` `(.., k)` when a projection of it by `w` `(n, k)` goes
/// through the engine's GEMV ([`kernels::DENSE_GEMV`]: a GPU in bf16, a decode
/// step's few rows); `None`: candle's matmul.
fn gemv_rows(x: &Tensor, w: &Tensor) -> Option<usize> {
    let on = x.device().is_cuda()
        && x.dtype() == DType::BF16
        && w.dtype() == DType::BF16
        && kernels::enabled()
        && kernels::DENSE_GEMV.get() == 1;
    let k = x.dims().last().copied().filter(|&k| on && k > 0)?;
    let m = x.elem_count() / k;
    ((1..=kernels::DENSE_GEMV_MAX_ROWS).contains(&m) && k.is_multiple_of(8)).then_some(m)
}

/// `x`'s rows `(m, k)` through `kernels::dense_gemv`, back in `x`'s leading dims.
fn gemv(x: &Tensor, m: usize, w: &Tensor, swiglu: bool) -> Result<Tensor> {
    let y = kernels::dense_gemv(&x.reshape((m, ()))?, w, swiglu)?;
    let mut dims = x.dims().to_vec();
    if let Some(last) = dims.last_mut() {
        *last = y.dim(1)?;
    }
    y.reshape(dims)
}

/// `l.forward(x)`, a decode step's few rows by the engine's GEMV where it is on.
pub fn project(l: &Linear, x: &Tensor) -> Result<Tensor> {
    let Some(m) = gemv_rows(x, l.weight()) else {
        return l.forward(x);
    };
    let y = gemv(x, m, l.weight(), false)?;
    match l.bias() {
        Some(b) => y.broadcast_add(b),
        None => Ok(y),
    }
}

/// Qwen3 RMSNorm: normalised in f32, scaled by `weight`.
#[derive(Debug, Clone)]
pub struct RmsNorm {
    weight: Tensor,
    /// The weight in the checkpoint's dtype, for the GPU's fused half-precision kernel.
    weight_native: Tensor,
    eps: f32,
}

impl RmsNorm {
    pub fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        let weight_native = vb.get(size, "weight")?;
        Ok(Self {
            weight: weight_native.to_dtype(DType::F32)?,
            weight_native,
            eps: eps as f32,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dtype = x.dtype();
        // On the GPU the bf16 kernel sums in f32 itself: one launch instead of three.
        if x.device().is_cuda() && dtype != DType::F32 && dtype == self.weight_native.dtype() {
            return candle_nn::ops::rms_norm(&x.contiguous()?, &self.weight_native, self.eps);
        }
        let x = x.to_dtype(DType::F32)?.contiguous()?;
        candle_nn::ops::rms_norm(&x, &self.weight, self.eps)?.to_dtype(dtype)
    }
}

impl RmsNorm {
    /// `(x + h, self.forward(x + h))`: a residual add and the norm after it, in one
    /// launch on a GPU in bf16 (kernels::add_rms_norm).
    pub fn add_forward(&self, x: &Tensor, h: &Tensor) -> Result<(Tensor, Tensor)> {
        let fused = x.device().is_cuda()
            && x.dtype() == DType::BF16
            && h.dtype() == DType::BF16
            && self.weight_native.dtype() == DType::BF16
            && x.dims() == h.dims()
            && x.dims().last().is_some_and(|n| n.is_multiple_of(8))
            && kernels::enabled();
        if fused {
            return kernels::add_rms_norm(x, h, &self.weight_native, self.eps);
        }
        let s = (x + h)?;
        let n = self.forward(&s)?;
        Ok((s, n))
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        RmsNorm::forward(self, x)
    }
}

/// Rotary embedding: plain 1-D (`Qwen3OmniMoeRotaryEmbedding`) or interleaved MRoPE
/// (`Qwen3OmniMoeThinkerTextRotaryEmbedding`, also the Talker's).
#[derive(Debug, Clone)]
pub struct RotaryEmbedding {
    /// `(head_dim / 2,)` f32.
    inv_freq: Tensor,
    /// For each frequency index, which of the (t, h, w) position rows drives it.
    mrope_rows: Option<Vec<usize>>,
    /// `mrope_rows` as three 0/1 masks `(head_dim / 2,)`.
    mrope_select: Vec<Tensor>,
}

impl RotaryEmbedding {
    /// `mrope_section` e.g. `[24, 20, 20]` (sums to `head_dim / 2`) for MRoPE, `None` for plain.
    pub fn new(
        head_dim: usize,
        theta: f64,
        mrope_section: Option<&[usize]>,
        device: &Device,
    ) -> Result<Self> {
        let half = head_dim / 2;
        // As the reference: 1 / theta^(arange(0, dim, 2) / dim), in f32.
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0f32 / (theta as f32).powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let inv_freq = Tensor::from_vec(inv, half, device)?;
        let mrope_rows = match mrope_section {
            None => None,
            Some(sec) => {
                if sec.len() != 3 || sec.iter().sum::<usize>() != half {
                    candle_core::bail!(
                        "mrope_section {sec:?} must have 3 entries summing to head_dim/2 = {half}"
                    );
                }
                // recomposition_frequencies: start from T everywhere, then H takes
                // indices 1, 4, .. < 3*sec[1] and W takes 2, 5, .. < 3*sec[2].
                let mut rows = vec![0usize; half];
                for (row, &s) in sec.iter().enumerate().skip(1) {
                    let mut i = row;
                    while i < (s * 3).min(half) {
                        rows[i] = row;
                        i += 3;
                    }
                }
                Some(rows)
            }
        };
        // Per MRoPE row, a 0/1 mask of the frequencies it drives (made once, here).
        let mrope_select = match &mrope_rows {
            Some(rows) => (0..3)
                .map(|r| {
                    let m: Vec<f32> = rows.iter().map(|&x| f32::from(u8::from(x == r))).collect();
                    Tensor::from_vec(m, half, device)
                })
                .collect::<Result<_>>()?,
            None => Vec::new(),
        };
        Ok(Self {
            inv_freq,
            mrope_rows,
            mrope_select,
        })
    }

    /// From a decoder config (MRoPE when it has an `mrope_section`).
    pub fn from_config(cfg: &DecoderConfig, device: &Device) -> Result<Self> {
        if cfg.rope_type() != "default" {
            candle_core::bail!("unsupported rope_type {:?}", cfg.rope_type());
        }
        let sec = cfg.mrope_section();
        Self::new(cfg.head_dim(), cfg.rope_theta(), sec.as_deref(), device)
    }

    /// cos/sin in half form `(b, s, head_dim / 2)` for position ids `(b, s)` or `(3, b, s)`.
    pub fn forward(&self, position_ids: &Tensor, dtype: DType) -> Result<(Tensor, Tensor)> {
        let pos = position_ids.to_dtype(DType::F32)?;
        let freqs = match pos.rank() {
            // (b, s, 1) * (half,)
            2 => pos.unsqueeze(D::Minus1)?.broadcast_mul(&self.inv_freq)?,
            3 => {
                let (three, b, s) = pos.dims3()?;
                if three != 3 {
                    candle_core::bail!("3-D position ids must be (3, b, s), got {:?}", pos.dims());
                }
                let all = pos.unsqueeze(D::Minus1)?.broadcast_mul(&self.inv_freq)?; // (3,b,s,half)
                match &self.mrope_rows {
                    // Without sections every row is the same text position (the reference
                    // expands 2-D ids to 3 identical rows).
                    None => all.get(0)?,
                    Some(rows) => {
                        let half = rows.len();
                        // Pick, per frequency index, the row that drives it.
                        let sel = &self.mrope_select;
                        let mut out = all.get(0)?.broadcast_mul(&sel[0])?;
                        for (r, m) in sel.iter().enumerate().skip(1) {
                            out = (out + all.get(r)?.broadcast_mul(m)?)?;
                        }
                        out.reshape((b, s, half))?
                    }
                }
            }
            r => candle_core::bail!("position ids must be (b, s) or (3, b, s), got rank {r}"),
        };
        let cos = freqs.cos()?.to_dtype(dtype)?.contiguous()?;
        let sin = freqs.sin()?.to_dtype(dtype)?.contiguous()?;
        Ok((cos, sin))
    }
}

/// The reference's `apply_rotary_pos_emb` (rotate_half form): q, k `(b, heads, s, d)`,
/// cos/sin `(b, s, d / 2)` from [`RotaryEmbedding::forward`].
pub fn apply_rotary_pos_emb(
    q: &Tensor,
    k: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
) -> Result<(Tensor, Tensor)> {
    // One row of positions serves every batch entry.
    let (cos, sin) = if cos.rank() == 3 && cos.dim(0)? == 1 && q.dim(0)? != 1 {
        (cos.squeeze(0)?, sin.squeeze(0)?)
    } else {
        (cos.clone(), sin.clone())
    };
    let q = candle_nn::rotary_emb::rope(&q.contiguous()?, &cos, &sin)?;
    let k = candle_nn::rotary_emb::rope(&k.contiguous()?, &cos, &sin)?;
    Ok((q, k))
}

/// One layer's key/value cache, `(b, kv_heads, seq, head_dim)`, appended on every call.
/// Appends concatenate into new tensors (never write in place), so a clone is an
/// independent snapshot that can be extended separately.
#[derive(Debug, Clone, Default)]
pub struct KvCache {
    k: Option<Tensor>,
    v: Option<Tensor>,
}

impl KvCache {
    pub fn new() -> Self {
        Self::default()
    }

    /// Appends `(b, kv_heads, s, d)` keys/values; returns all cached ones (contiguous).
    pub fn append(&mut self, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (k, v) = match (&self.k, &self.v) {
            (Some(pk), Some(pv)) => (Tensor::cat(&[pk, k], 2)?, Tensor::cat(&[pv, v], 2)?),
            _ => (k.contiguous()?, v.contiguous()?),
        };
        self.k = Some(k.clone());
        self.v = Some(v.clone());
        Ok((k, v))
    }

    /// Cached positions.
    pub fn seq_len(&self) -> usize {
        self.k.as_ref().and_then(|k| k.dim(2).ok()).unwrap_or(0)
    }

    pub fn reset(&mut self) {
        self.k = None;
        self.v = None;
    }
}

/// One layer's keys/values for a running batch of decoding requests, written in place:
/// `(slots, kv_heads, max_len, head_dim)`. The requests of a batch occupy slots
/// `0..b` in batch order (the caller compacts them when one leaves), so attention
/// reads the slots through a strided view, with no gather and no copy.
#[derive(Debug)]
pub struct KvSlots {
    k: Tensor,
    v: Tensor,
}

/// Where each row of one batched decode step writes and what it sees: built once per
/// step and shared by every layer of one decoder.
#[derive(Debug)]
pub struct SlotBatch {
    /// `(b * kv_heads, head_dim)` u32: the flat row of `(slots * kv_heads * max_len,
    /// head_dim)` that each new key/value goes to.
    scatter: Tensor,
    /// `(b, 1, 1, kv_len)` f32: 0 up to each row's own length, [`MASK_MIN`] after.
    mask: Tensor,
    /// The rows' slots when they are not `0..b` (then attention gathers them).
    gather: Option<Tensor>,
    batch: usize,
    kv_len: usize,
}

impl SlotBatch {
    /// Row `i` in slot `slots[i]` of `kv` (any layer's: all have one shape) with
    /// `lens[i]` positions cached before this step's token.
    pub fn new(kv: &KvSlots, slots: &[usize], lens: &[usize]) -> Result<Self> {
        let kv_len = lens.iter().map(|l| l + 1).max().unwrap_or(0);
        let (scatter, mask) = Self::host(kv, slots, lens, kv_len)?;
        let (_, kv_heads, _, head_dim) = kv.k.dims4()?;
        let b = lens.len();
        let device = kv.k.device();
        Ok(Self {
            scatter: Tensor::from_vec(scatter, (b * kv_heads, head_dim), device)?,
            mask: Tensor::from_vec(mask, (b, 1, 1, kv_len), device)?,
            gather: if slots.iter().enumerate().all(|(i, &s)| i == s) {
                None
            } else {
                let ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
                Some(Tensor::from_vec(ids, b, device)?)
            },
            batch: b,
            kv_len,
        })
    }

    /// The scatter rows `(b * kv_heads, head_dim)` and mask `(b, 1, 1, kv_len)` of
    /// [`Self::new`] on the host, over `kv_len` positions (at least every row's
    /// length + 1: a graphed step reads a bucketed length).
    pub fn host(
        kv: &KvSlots,
        slots: &[usize],
        lens: &[usize],
        kv_len: usize,
    ) -> Result<(Vec<u32>, Vec<f32>)> {
        let (n_slots, kv_heads, max_len, head_dim) = kv.k.dims4()?;
        let b = lens.len();
        if slots.len() != b {
            candle_core::bail!("{} slots for {b} rows", slots.len());
        }
        if let Some(&s) = slots.iter().find(|&&s| s >= n_slots) {
            candle_core::bail!("slot {s} of {n_slots}");
        }
        let need = lens.iter().map(|l| l + 1).max().unwrap_or(0);
        if need > max_len || kv_len > max_len {
            candle_core::bail!(
                "a request needs {} cached positions, the slots hold {max_len}",
                need.max(kv_len)
            );
        }
        if need > kv_len {
            candle_core::bail!("rows need {need} positions, the step reads {kv_len}");
        }
        let mut scatter = Vec::with_capacity(b * kv_heads * head_dim);
        for (&slot, &len) in slots.iter().zip(lens) {
            for h in 0..kv_heads {
                let dst = ((slot * kv_heads + h) * max_len + len) as u32;
                scatter.extend(std::iter::repeat_n(dst, head_dim));
            }
        }
        let mut mask = Vec::with_capacity(b * kv_len);
        for &len in lens {
            mask.extend((0..kv_len).map(|j| if j <= len { 0.0 } else { MASK_MIN }));
        }
        Ok((scatter, mask))
    }

    /// A batch of rows in slots `0..b` whose scatter rows and mask (as [`Self::host`]
    /// makes them) are already on the device: a graphed step's persistent inputs.
    pub fn from_device(scatter: Tensor, mask: Tensor) -> Result<Self> {
        let (batch, _, _, kv_len) = mask.dims4()?;
        Ok(Self {
            scatter,
            mask,
            gather: None,
            batch,
            kv_len,
        })
    }

    /// [`Self::from_device`] for rows in any slots: `slots` `(b,)` u32 on the device.
    pub fn from_device_in(scatter: Tensor, mask: Tensor, slots: Tensor) -> Result<Self> {
        Ok(Self {
            gather: Some(slots),
            ..Self::from_device(scatter, mask)?
        })
    }
}

impl KvSlots {
    pub fn new(
        slots: usize,
        kv_heads: usize,
        max_len: usize,
        head_dim: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        let shape = (slots, kv_heads, max_len, head_dim);
        Ok(Self {
            k: Tensor::zeros(shape, dtype, device)?,
            v: Tensor::zeros(shape, dtype, device)?,
        })
    }

    pub fn slots(&self) -> usize {
        self.k.dims()[0]
    }

    pub fn max_len(&self) -> usize {
        self.k.dims()[2]
    }

    /// `(slots, kv_heads, max_len, head_dim)`.
    pub fn shape(&self) -> Result<(usize, usize, usize, usize)> {
        self.k.dims4()
    }

    /// Puts row `row` of a prefilled cache, from position `start` (after its left
    /// padding), into `slot` from position 0.
    pub fn load(&self, slot: usize, cache: &KvCache, row: usize, start: usize) -> Result<()> {
        let (Some(k), Some(v)) = (&cache.k, &cache.v) else {
            candle_core::bail!("load: the cache is empty");
        };
        let (b, _, len, _) = k.dims4()?;
        if row >= b || start > len || len - start > self.max_len() || slot >= self.slots() {
            candle_core::bail!(
                "load: row {row} from {start} of cache {:?} does not fit slot {slot} of {:?}",
                k.dims(),
                self.k.dims()
            );
        }
        let part = |t: &Tensor| {
            t.narrow(0, row, 1)?
                .narrow(2, start, len - start)?
                .contiguous()
        };
        self.k.narrow(0, slot, 1)?.slice_set(&part(k)?, 2, 0)?;
        self.v.narrow(0, slot, 1)?.slice_set(&part(v)?, 2, 0)
    }

    /// Moves slot `from`'s contents into slot `to` (compaction when a request leaves).
    pub fn move_slot(&self, from: usize, to: usize) -> Result<()> {
        if from != to {
            for t in [&self.k, &self.v] {
                let src = t.narrow(0, from, 1)?.copy()?;
                t.narrow(0, to, 1)?.slice_set(&src, 0, 0)?;
            }
        }
        Ok(())
    }

    /// Writes the batch's new `(b, kv_heads, 1, d)` keys/values and returns the rows'
    /// keys/values over the batch's positions, `(b, kv_heads, kv_len, d)`: views when
    /// the rows are slots `0..b`, else gathered copies.
    pub fn append(&self, batch: &SlotBatch, k: &Tensor, v: &Tensor) -> Result<(Tensor, Tensor)> {
        let (slots, kvh, max_len, d) = self.k.dims4()?;
        let flat = (slots * kvh * max_len, d);
        let rows = (batch.batch * kvh, d);
        self.k
            .reshape(flat)?
            .scatter_set(&batch.scatter, &k.contiguous()?.reshape(rows)?, 0)?;
        self.v
            .reshape(flat)?
            .scatter_set(&batch.scatter, &v.contiguous()?.reshape(rows)?, 0)?;
        let view = |t: &Tensor| match &batch.gather {
            None => t.narrow(0, 0, batch.batch)?.narrow(2, 0, batch.kv_len),
            Some(ids) => t.index_select(ids, 0)?.narrow(2, 0, batch.kv_len),
        };
        Ok((view(&self.k)?, view(&self.v)?))
    }
}

/// The additive attention mask `(b, 1, q_len, kv_len)` (f32, 0 visible, [`MASK_MIN`] hidden)
/// for `q_len` new queries after `kv_len - q_len` cached positions: causal, plus the
/// 2-D `padding` mask `(b, kv_len)` (1 = token, 0 = padding; any dtype) when given.
/// `None` when nothing is hidden (a single query without padding).
pub fn attention_mask(
    padding: Option<&Tensor>,
    batch: usize,
    q_len: usize,
    kv_len: usize,
    device: &Device,
) -> Result<Option<Tensor>> {
    if q_len > kv_len {
        candle_core::bail!("attention_mask: q_len {q_len} > kv_len {kv_len}");
    }
    let pad: Option<Vec<Vec<f32>>> = match padding {
        Some(p) => {
            let (pb, pl) = p.dims2()?;
            if pb != batch || pl != kv_len {
                candle_core::bail!(
                    "padding mask {:?} does not match batch {batch} x kv_len {kv_len}",
                    p.dims()
                );
            }
            let v = p.to_dtype(DType::F32)?.to_vec2::<f32>()?;
            if v.iter().all(|r| r.iter().all(|&x| x != 0.0)) {
                None
            } else {
                Some(v)
            }
        }
        None => None,
    };
    if q_len == 1 && pad.is_none() {
        return Ok(None);
    }
    let past = kv_len - q_len;
    let mut data = Vec::with_capacity(batch * q_len * kv_len);
    for bi in 0..batch {
        for qi in 0..q_len {
            for kj in 0..kv_len {
                let visible = kj <= past + qi && pad.as_ref().is_none_or(|p| p[bi][kj] != 0.0);
                data.push(if visible { 0.0 } else { MASK_MIN });
            }
        }
    }
    Tensor::from_vec(data, (batch, 1, q_len, kv_len), device).map(Some)
}

fn repeat_kv(x: Tensor, n_rep: usize) -> Result<Tensor> {
    if n_rep == 1 {
        return Ok(x);
    }
    let (b, h, s, d) = x.dims4()?;
    x.unsqueeze(2)?
        .expand((b, h, n_rep, s, d))?
        .reshape((b, h * n_rep, s, d))
}

/// Qwen3 attention (`Qwen3OmniMoeThinkerTextAttention`, same for the Talker and the
/// code predictor): GQA with per-head q/k RMSNorm before the rotary embedding.
#[derive(Debug, Clone)]
pub struct Attention {
    /// On a GPU in bf16 (no bias): q, k and v stacked `(heads + 2 * kv_heads) * d`
    /// rows for the decode step's single projection; the three below are views of it.
    qkv: Option<Linear>,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    q_norm: RmsNorm,
    k_norm: RmsNorm,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    scaling: f64,
}

impl Attention {
    pub fn new(cfg: &DecoderConfig, vb: VarBuilder) -> Result<Self> {
        let hd = cfg.head_dim();
        let (h, kvh, hs) = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.hidden_size,
        );
        let bias = cfg.attention_bias;
        let mut q_proj = linear(hs, h * hd, bias, vb.pp("q_proj"))?;
        let mut k_proj = linear(hs, kvh * hd, bias, vb.pp("k_proj"))?;
        let mut v_proj = linear(hs, kvh * hd, bias, vb.pp("v_proj"))?;
        let qkv = if vb.device().is_cuda() && vb.dtype() == DType::BF16 && !bias {
            let w = Tensor::cat(&[q_proj.weight(), k_proj.weight(), v_proj.weight()], 0)?;
            // One copy of the weights: the separate projections become views.
            q_proj = Linear::new(w.narrow(0, 0, h * hd)?, None);
            k_proj = Linear::new(w.narrow(0, h * hd, kvh * hd)?, None);
            v_proj = Linear::new(w.narrow(0, (h + kvh) * hd, kvh * hd)?, None);
            Some(Linear::new(w, None))
        } else {
            None
        };
        Ok(Self {
            qkv,
            q_proj,
            k_proj,
            v_proj,
            o_proj: linear(h * hd, hs, bias, vb.pp("o_proj"))?,
            q_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("q_norm"))?,
            k_norm: RmsNorm::new(hd, cfg.rms_norm_eps, vb.pp("k_norm"))?,
            num_heads: h,
            num_kv_heads: kvh,
            head_dim: hd,
            scaling: (hd as f64).powf(-0.5),
        })
    }

    /// `x` `(b, s, hidden)`; cos/sin `(b, s, head_dim / 2)`; `mask` from [`attention_mask`]
    /// over the cached + new positions (`None` = full visibility, e.g. one decode step);
    /// with a cache the new keys/values are appended and attention runs over all of them.
    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let hd = self.head_dim;
        if let Some(qkv) = self.fused_qkv() {
            return self.forward_fused(qkv, x, cos, sin, mask, cache);
        }
        let q = self
            .q_proj
            .forward(x)?
            .reshape((b, s, self.num_heads, hd))?;
        let k = self
            .k_proj
            .forward(x)?
            .reshape((b, s, self.num_kv_heads, hd))?;
        let v = self
            .v_proj
            .forward(x)?
            .reshape((b, s, self.num_kv_heads, hd))?;
        let q = self.q_norm.forward(&q)?.transpose(1, 2)?;
        let k = self.k_norm.forward(&k)?.transpose(1, 2)?;
        let v = v.transpose(1, 2)?.contiguous()?;
        let (q, k) = apply_rotary_pos_emb(&q, &k, cos, sin)?;
        let (k, v) = match cache {
            Some(c) => c.append(&k, &v)?,
            None => (k, v),
        };
        let n_rep = self.num_heads / self.num_kv_heads;
        let k = repeat_kv(k, n_rep)?.contiguous()?;
        let v = repeat_kv(v, n_rep)?.contiguous()?;
        let dtype = q.dtype();
        if q.device().is_cuda() && dtype == DType::BF16 && kernels::enabled() {
            // Scale, mask and softmax in one pass (kernels/attention.cu).
            let probs = kernels::masked_softmax(&q.matmul(&k.t()?)?, mask, self.scaling)?;
            let out = probs.matmul(&v)?;
            let out = out.transpose(1, 2)?.reshape((b, s, self.num_heads * hd))?;
            return self.o_proj.forward(&out);
        }
        let scores = (q.matmul(&k.t()?)? * self.scaling)?.to_dtype(DType::F32)?;
        let probs = match mask {
            Some(m) => {
                let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(m)?)?;
                // Rows with every key hidden come out as zeros, as torch's SDPA gives.
                let keep = m
                    .max_keepdim(D::Minus1)?
                    .ge((MASK_MIN / 2.0) as f64)?
                    .to_dtype(DType::F32)?;
                probs.broadcast_mul(&keep)?
            }
            None => candle_nn::ops::softmax_last_dim(&scores)?,
        };
        let out = probs.to_dtype(dtype)?.matmul(&v)?;
        let out = out.transpose(1, 2)?.reshape((b, s, self.num_heads * hd))?;
        self.o_proj.forward(&out)
    }
}

impl Attention {
    /// The stacked q/k/v projection when the engine's attention kernels take
    /// this layer (a GPU in bf16, head shapes they are built for).
    fn fused_qkv(&self) -> Option<&Linear> {
        let (heads, kvh) = (self.num_heads, self.num_kv_heads);
        self.qkv.as_ref().filter(|_| {
            kernels::enabled() && kernels::attention_supported(heads, kvh, self.head_dim)
        })
    }

    /// [`Self::forward`] on a GPU in bf16 through the engine's kernels: one q/k/v
    /// projection, the norms and rotary embedding in one launch (q, k and v come
    /// out in the attention's layouts, nothing transposed after), grouped query
    /// heads against their shared key/value head through a reshape of the
    /// queries (no repeated keys or values), the scaled, masked softmax in one
    /// pass.
    fn forward_fused(
        &self,
        qkv: &Linear,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        let (hd, heads, kvh) = (self.head_dim, self.num_heads, self.num_kv_heads);
        let (q, k, v) = kernels::qk_norm_rope_prefill(
            &project(qkv, x)?,
            &self.q_norm.weight_native,
            &self.k_norm.weight_native,
            self.q_norm.eps,
            cos,
            sin,
            heads,
            kvh,
        )?;
        let (k, v) = match cache {
            Some(c) => c.append(&k, &v)?,
            None => (k, v),
        };
        let kv = k.dim(2)?;
        // (b, kvh, rep * s, d): each key/value head's query rows together.
        let q = q.reshape((b, kvh, (heads / kvh) * s, hd))?;
        let scores = q.matmul(&k.t()?)?.reshape((b, heads, s, kv))?;
        let probs = kernels::masked_softmax(&scores, mask, self.scaling)?;
        let out = probs
            .reshape((b, kvh, (heads / kvh) * s, kv))?
            .matmul(&v.contiguous()?)?
            .reshape((b, heads, s, hd))?;
        let out = out.transpose(1, 2)?.reshape((b, s, heads * hd))?;
        project(&self.o_proj, &out)
    }

    /// One decode step of a running batch: `x` `(b, 1, hidden)`, cos/sin `(b, 1, d / 2)` at
    /// each row's own position; keys/values go into `slots` at the rows' lengths.
    /// Grouped heads share their key/value head through a reshape of the queries, so
    /// nothing is repeated.
    pub fn forward_slots(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        slots: &KvSlots,
        batch: &SlotBatch,
    ) -> Result<Tensor> {
        let (b, s, _) = x.dims3()?;
        if s != 1 || b != batch.batch {
            candle_core::bail!(
                "forward_slots: x {:?} for a batch of {}",
                x.dims(),
                batch.batch
            );
        }
        let (hd, kvh) = (self.head_dim, self.num_kv_heads);
        if let Some(qkv) = self.fused_qkv() {
            // Three launches (kernels/attention.cu): the q/k/v projection, norms +
            // rotary + KV writes, attention over each row's own positions.
            let qkv = project(qkv, x)?.reshape((b, ()))?;
            let out = self.slot_core(&qkv, cos, sin, slots, batch)?;
            return project(&self.o_proj, &out.reshape((b, 1, self.num_heads * hd))?);
        }
        let q = self
            .q_proj
            .forward(x)?
            .reshape((b, 1, self.num_heads, hd))?;
        let k = self.k_proj.forward(x)?.reshape((b, 1, kvh, hd))?;
        let v = self.v_proj.forward(x)?.reshape((b, kvh, 1, hd))?;
        let q = self.q_norm.forward(&q)?.transpose(1, 2)?;
        let k = self.k_norm.forward(&k)?.transpose(1, 2)?;
        let (q, k) = apply_rotary_pos_emb(&q, &k, cos, sin)?;
        let (k, v) = slots.append(batch, &k, &v)?;
        self.slot_attention(&q, &k, &v, batch)
    }

    /// The engine's kernels between the q/k/v projection `(b, q + 2 * kv)` and
    /// `o_proj`: the norms, rotary and KV writes, then each row's attention over
    /// its own positions: `(b, heads, d)`.
    fn slot_core(
        &self,
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        slots: &KvSlots,
        batch: &SlotBatch,
    ) -> Result<Tensor> {
        let q = kernels::qk_norm_rope(
            qkv,
            &self.q_norm.weight_native,
            &self.k_norm.weight_native,
            self.q_norm.eps,
            cos,
            sin,
            &batch.scatter,
            &slots.k,
            &slots.v,
            self.num_heads,
            self.num_kv_heads,
        )?;
        let rows = batch.gather.as_ref();
        kernels::decode_attention(&q, &slots.k, &slots.v, &batch.mask, rows, self.scaling)
    }

    /// Attention of one query per row `(b, heads, 1, d)` over the rows' keys/values
    /// `(b, kv_heads, kv_len, d)` through the batch's mask, then `o_proj`.
    fn slot_attention(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        batch: &SlotBatch,
    ) -> Result<Tensor> {
        let (hd, kvh, b) = (self.head_dim, self.num_kv_heads, batch.batch);
        let n_rep = self.num_heads / kvh;
        let q = q.reshape((b, kvh, n_rep, hd))?;
        let dtype = q.dtype();
        let scores = (q.matmul(&k.t()?)? * self.scaling)?.to_dtype(DType::F32)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores.broadcast_add(&batch.mask)?)?;
        let out = probs.to_dtype(dtype)?.matmul(v)?;
        project(&self.o_proj, &out.reshape((b, 1, self.num_heads * hd))?)
    }
}

/// SwiGLU MLP: `down(act(gate(x)) * up(x))`.
#[derive(Debug, Clone)]
pub struct Mlp {
    gate_proj: Linear,
    up_proj: Linear,
    down_proj: Linear,
    act: Activation,
    /// After [`Mlp::fuse_gate_up`] on a GPU in bf16 with SiLU: gate and up stacked
    /// `2 * intermediate` rows, one projection for both (the two above are views).
    gate_up: Option<Linear>,
}

impl Mlp {
    pub fn new(
        hidden: usize,
        intermediate: usize,
        act: Activation,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            gate_proj: linear(hidden, intermediate, false, vb.pp("gate_proj"))?,
            up_proj: linear(hidden, intermediate, false, vb.pp("up_proj"))?,
            down_proj: linear(intermediate, hidden, false, vb.pp("down_proj"))?,
            act,
            gate_up: None,
        })
    }

    /// Stacks gate and up into one projection where the engine's SwiGLU kernel can
    /// take its output (a GPU in bf16, SiLU, widths of multiples of 8): a decode
    /// step's MLP in three launches instead of five. Elsewhere `self` as it is.
    /// (MoE experts are stacked by [`SparseMoe`] instead.)
    pub fn fuse_gate_up(mut self) -> Result<Self> {
        let g = self.gate_proj.weight();
        let n = g.dim(0)?;
        let fusable = g.device().is_cuda()
            && g.dtype() == DType::BF16
            && self.act == Activation::Silu
            && n.is_multiple_of(8)
            && self.gate_proj.bias().is_none()
            && self.up_proj.bias().is_none();
        if fusable {
            let w = Tensor::cat(&[g, self.up_proj.weight()], 0)?;
            self.gate_proj = Linear::new(w.narrow(0, 0, n)?, None);
            self.up_proj = Linear::new(w.narrow(0, n, n)?, None);
            self.gate_up = Some(Linear::new(w, None));
        }
        Ok(self)
    }
}

impl Module for Mlp {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        if let Some(gu) = self.gate_up.as_ref().filter(|_| kernels::enabled()) {
            let h = match gemv_rows(x, gu.weight()) {
                Some(m) => gemv(x, m, gu.weight(), true)?,
                None => kernels::silu_mul(&gu.forward(x)?)?,
            };
            return project(&self.down_proj, &h);
        }
        let g = self.gate_proj.forward(x)?.apply(&self.act)?;
        let u = self.up_proj.forward(x)?;
        self.down_proj.forward(&(g * u)?)
    }
}

/// Sparse MoE block (`...ThinkerTextSparseMoeBlock`, or `...TalkerTextSparseMoeBlock` with a
/// shared expert): softmax router in f32, top-k, optional renormalisation; each expert
/// runs only on the tokens routed to it.
#[derive(Debug, Clone)]
pub struct SparseMoe {
    gate: Linear,
    /// Per-expert MLPs (CPU), or none when `fused` holds them.
    experts: Vec<Mlp>,
    /// On a GPU in bf16/f16, the experts stacked for the grouped GEMM: gate and up
    /// `(experts, 2 * intermediate, hidden)`, down `(experts, hidden, intermediate)`.
    fused: Option<(Tensor, Tensor)>,
    shared_expert: Option<(Mlp, Linear)>,
    top_k: usize,
    norm_topk_prob: bool,
    act: Activation,
}

impl SparseMoe {
    pub fn new(cfg: &DecoderConfig, vb: VarBuilder) -> Result<Self> {
        let hs = cfg.hidden_size;
        if cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > cfg.num_experts {
            candle_core::bail!(
                "num_experts_per_tok {} must be in 1..={}",
                cfg.num_experts_per_tok,
                cfg.num_experts
            );
        }
        let gate = linear(hs, cfg.num_experts, false, vb.pp("gate"))?;
        let vbe = vb.pp("experts");
        let mut experts = (0..cfg.num_experts)
            .map(|e| Mlp::new(hs, cfg.moe_intermediate_size, cfg.hidden_act, vbe.pp(e)))
            .collect::<Result<Vec<_>>>()?;
        let fused = if use_fused_moe(vb.device(), vb.dtype()) {
            // Stack per layer as loaded, so the per-expert copies are freed right away.
            let gate_up = experts
                .iter()
                .map(|m| Tensor::cat(&[m.gate_proj.weight(), m.up_proj.weight()], 0))
                .collect::<Result<Vec<_>>>()?;
            let down: Vec<Tensor> = experts
                .iter()
                .map(|m| m.down_proj.weight().clone())
                .collect();
            experts.clear();
            Some((Tensor::stack(&gate_up, 0)?, Tensor::stack(&down, 0)?))
        } else {
            None
        };
        let shared_expert = match cfg.shared_expert_intermediate_size {
            Some(n) => Some((
                Mlp::new(hs, n, cfg.hidden_act, vb.pp("shared_expert"))?.fuse_gate_up()?,
                linear(hs, 1, false, vb.pp("shared_expert_gate"))?,
            )),
            None => None,
        };
        Ok(Self {
            gate,
            experts,
            fused,
            shared_expert,
            top_k: cfg.num_experts_per_tok,
            norm_topk_prob: cfg.norm_topk_prob,
            act: cfg.hidden_act,
        })
    }
}

/// Whether MoE layers on `device` in `dtype` run candle's grouped-GEMM MoE kernel, which
/// reads each routed expert once per step for the whole batch, with no host round-trip.
fn use_fused_moe(device: &Device, dtype: DType) -> bool {
    cfg!(feature = "cuda") && device.is_cuda() && matches!(dtype, DType::BF16 | DType::F16)
}

/// Past this many (token, choice) pairs, a GPU MoE layer runs one cuBLAS GEMM per
/// expert on gathered rows ([`SparseMoe::forward_gathered`]) instead of the grouped
/// kernel, whose prefill path suits few tokens per expert (docs/bench/gpu.md
/// measures both). `OMNISTREAM_MOE_GROUPED_MAX_PAIRS`
/// overrides it, for that measurement.
fn grouped_max_pairs() -> usize {
    static MAX: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MAX.get_or_init(|| {
        std::env::var("OMNISTREAM_MOE_GROUPED_MAX_PAIRS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(4096)
    })
}

/// Up to this many tokens, the grouped MoE kernel runs its decode configuration:
/// tiles for few rows per expert, and expert offsets from its own scan kernel. Its
/// prefill configuration scans with thrust, which allocates and synchronizes, so
/// only the decode one can be captured in a CUDA graph: every graphed batch fits.
const GROUPED_DECODE_MAX_TOKENS: usize = 64;
const _: () = assert!(
    super::graphs::BATCH_BUCKETS[super::graphs::BATCH_BUCKETS.len() - 1]
        <= GROUPED_DECODE_MAX_TOKENS
);

/// Above this many tokens an MoE layer's routed experts run on the tensor cores
/// (kernels/moe.cu, `moe_*_tc_bf16`), at or below it through the GEMV, which
/// reads each expert's weights at full width for few rows (docs/bench/gpu.md
/// times both). Both route on the device up to 128 tokens, so either can be
/// captured in a graph. `OMNISTREAM_MOE_TC_MIN_TOKENS` overrides it, for that measurement.
fn tc_min_tokens() -> usize {
    static MIN: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *MIN.get_or_init(|| {
        std::env::var("OMNISTREAM_MOE_TC_MIN_TOKENS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(32)
    })
}

/// The (token, choice) pairs `choices` (flat expert ids) ordered by expert: the
/// sorted expert ids and, for each, its flat pair index. candle's device sort keeps
/// a row in shared memory, which holds 8,192 u32s at most; longer prefills sort on
/// the host (one copy each way, against a prefill's far larger work).
fn sort_by_expert(choices: &Tensor) -> Result<(Tensor, Tensor)> {
    const DEVICE_SORT_MAX: usize = 8192;
    let n = choices.dim(0)?;
    if n <= DEVICE_SORT_MAX {
        return choices.sort_last_dim(true);
    }
    let ids = choices.to_vec1::<u32>()?;
    let mut order: Vec<u32> = (0..n as u32).collect();
    order.sort_by_key(|&i| ids[i as usize]);
    let sorted: Vec<u32> = order.iter().map(|&i| ids[i as usize]).collect();
    let dev = choices.device();
    Ok((
        Tensor::from_vec(sorted, n, dev)?,
        Tensor::from_vec(order, n, dev)?,
    ))
}

impl SparseMoe {
    /// Each token's top-k experts `(n, k)` u32 and their router probabilities `(n, k)`.
    fn route(&self, probs: &Tensor) -> Result<(Tensor, Tensor)> {
        let idx = probs
            .arg_sort_last_dim(false)?
            .narrow(1, 0, self.top_k)?
            .contiguous()?;
        let top = probs.gather(&idx, 1)?;
        Ok((idx, top))
    }

    /// The routed experts through the grouped GEMM (`candle_nn::moe::moe_gemm`): tokens
    /// sorted by expert on the device; gate/up for every (token, choice), then down
    /// weighted by the router and summed over the choices.
    fn forward_fused(
        &self,
        xs: &Tensor,
        probs: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        prefill: bool,
    ) -> Result<Tensor> {
        let (n, hidden) = xs.dims2()?;
        let inter = down.dim(2)?;
        let (idx, mut top) = self.route(probs)?;
        if self.norm_topk_prob {
            top = top.broadcast_div(&top.sum_keepdim(D::Minus1)?)?;
        }
        let (expert_ids, sorted) = sort_by_expert(&idx.flatten_all()?)?;
        let top = top.contiguous()?;
        // Decode steps in bf16: the engine's grouped GEMV (kernels/moe.cu), which
        // streams each routed expert's weights at full width; else candle's
        // grouped GEMM.
        let gemv = !prefill && xs.dtype() == DType::BF16;
        let grouped = |x: &Tensor, w: &Tensor, pair_weights: Option<&Tensor>| {
            if gemv {
                kernels::moe_gemv(x, w, pair_weights, &sorted, &expert_ids, self.top_k)
            } else {
                let pw = pair_weights.cloned();
                candle_nn::moe::moe_gemm(x, w, &pw, &sorted, &expert_ids, self.top_k, prefill)
            }
        };
        let gu = grouped(xs, gate_up, None)?;
        let g = gu.narrow(D::Minus1, 0, inter)?.contiguous()?;
        let u = gu.narrow(D::Minus1, inter, inter)?.contiguous()?;
        let h = (g.apply(&self.act)? * u)?;
        let out = grouped(&h, down, Some(&top))?;
        out.reshape((n, self.top_k, hidden))?.sum(1)
    }

    /// Whether `n` tokens `xs` take [`Self::forward_decode`]: bf16 on a GPU (stacked
    /// experts), sizes one routing block takes, SiLU experts.
    fn decode_kernels(&self, xs: &Tensor, n: usize) -> bool {
        xs.dtype() == DType::BF16
            && kernels::route_supported(n, self.gate.weight().dim(0).unwrap_or(0), self.top_k)
            && self.act == Activation::Silu
            && kernels::enabled()
    }

    /// A decode step's routed experts in four launches of the engine's kernels
    /// (kernels/moe.cu): routing (softmax, top-k, sort, the routed experts' list),
    /// gate/up with the SwiGLU, down weighted by the router, the sum over the
    /// choices. Only the routed experts' blocks launch, and each reads its weights once.
    ///
    /// Past [`tc_min_tokens`] tokens (prefills) gate/up and down run on the tensor
    /// cores instead of the GEMV.
    fn forward_decode(
        &self,
        xs: &Tensor,
        logits: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
    ) -> Result<Tensor> {
        let routing = kernels::moe_route(logits, self.top_k, self.norm_topk_prob)?;
        let mode = match xs.dim(0)? > tc_min_tokens() && self.tc_kernels(gate_up, down) {
            true => kernels::Mode::Tensor,
            false => kernels::Mode::Gemv,
        };
        self.experts_routed(xs, gate_up, down, &routing, mode)
    }

    /// The routed experts of `xs` by `routing` in three launches: gate/up with the
    /// SwiGLU, down weighted by the router, the sum over the choices.
    fn experts_routed(
        &self,
        xs: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
        routing: &kernels::Routing,
        mode: kernels::Mode,
    ) -> Result<Tensor> {
        let h = kernels::moe_gate_up(xs, gate_up, routing, mode)?;
        kernels::moe_sum(&kernels::moe_down(&h, down, routing, mode)?, self.top_k)
    }

    /// Whether the tensor-core kernels take these stacked experts (bf16 on a GPU,
    /// SiLU, widths their tiles divide, a router the device routing takes).
    fn tc_kernels(&self, gate_up: &Tensor, down: &Tensor) -> bool {
        let Ok((experts, hidden, inter)) = down.dims3() else {
            return false;
        };
        gate_up.dtype() == DType::BF16
            && self.act == Activation::Silu
            && kernels::enabled()
            && kernels::tc_supported(hidden, inter)
            && kernels::route_many_supported(experts, self.top_k)
    }

    /// A prefill's routed experts on the tensor cores: routed on the device
    /// ([`kernels::moe_route_many`]: more tokens than [`kernels::moe_route`]'s one
    /// block takes, nothing through the host), then the kernels of
    /// [`Self::experts_routed`].
    fn forward_tc(
        &self,
        xs: &Tensor,
        logits: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
    ) -> Result<Tensor> {
        let routing = kernels::moe_route_many(logits, self.top_k, self.norm_topk_prob)?;
        self.experts_routed(xs, gate_up, down, &routing, kernels::Mode::Tensor)
    }

    /// The routing [`Self::forward_tc`] makes of `x` `(n, hidden)`, and the router's
    /// probabilities `(n, experts)` f32 (GPU tests).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn routing_many_for_test(&self, x: &Tensor) -> Result<(kernels::Routing, Tensor)> {
        let logits = self.gate.forward(&x.contiguous()?)?;
        let routing = kernels::moe_route_many(&logits, self.top_k, self.norm_topk_prob)?;
        let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
        Ok((routing, probs))
    }

    /// The routed experts of `x` `(n, hidden)`, routed on the device as the engine
    /// routes `n` tokens ([`kernels::moe_route`] up to 128, [`kernels::moe_route_many`]
    /// past that), through the GEMV or the tensor-core kernels (GPU tests and
    /// timings).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn routed_in_mode(&self, x: &Tensor, mode: kernels::Mode) -> Result<Tensor> {
        let Some((gate_up, down)) = &self.fused else {
            candle_core::bail!("no stacked experts (a GPU in bf16/f16 has them)");
        };
        let xs = x.contiguous()?;
        let logits = self.gate.forward(&xs)?;
        let n_experts = logits.dim(1)?;
        let routing = match kernels::route_supported(xs.dim(0)?, n_experts, self.top_k) {
            true => kernels::moe_route(&logits, self.top_k, self.norm_topk_prob)?,
            false => kernels::moe_route_many(&logits, self.top_k, self.norm_topk_prob)?,
        };
        self.experts_routed(&xs, gate_up, down, &routing, mode)
    }

    /// The routed experts of `x` `(n, hidden)` through the grouped kernel in its
    /// prefill or decode configuration (tests compare and time the two).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn forward_grouped(&self, x: &Tensor, prefill: bool) -> Result<Tensor> {
        let Some((gate_up, down)) = &self.fused else {
            candle_core::bail!("no stacked experts (a GPU in bf16/f16 has them)");
        };
        let xs = x.contiguous()?;
        let probs =
            candle_nn::ops::softmax_last_dim(&self.gate.forward(&xs)?.to_dtype(DType::F32)?)?;
        self.forward_fused(&xs, &probs, gate_up, down, prefill)
    }

    /// The decode kernels' parts for `x` `(n, hidden)` (GPU tests): the router
    /// logits, the routing, the routed experts' sum, and the stacked weights.
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn decode_parts(
        &self,
        x: &Tensor,
    ) -> Result<(Tensor, kernels::Routing, Tensor, Tensor, Tensor)> {
        let Some((gate_up, down)) = &self.fused else {
            candle_core::bail!("no stacked experts (a GPU in bf16/f16 has them)");
        };
        let xs = x.contiguous()?;
        let logits = self.gate.forward(&xs)?;
        let routing = kernels::moe_route(&logits, self.top_k, self.norm_topk_prob)?;
        let out = self.forward_decode(&xs, &logits, gate_up, down)?;
        Ok((logits, routing, out, gate_up.clone(), down.clone()))
    }

    /// Expert `e`'s SwiGLU on `x`, from the per-expert MLPs or the stacked weights.
    fn expert(&self, e: usize, x: &Tensor) -> Result<Tensor> {
        match &self.fused {
            None => self.experts[e].forward(x),
            Some((gate_up, down)) => {
                let inter = down.dim(2)?;
                let gu = x.matmul(&gate_up.get(e)?.t()?)?;
                let g = gu.narrow(1, 0, inter)?.apply(&self.act)?;
                let h = (g * gu.narrow(1, inter, inter)?)?;
                h.matmul(&down.get(e)?.t()?)
            }
        }
    }

    /// Long prefills on the GPU: the pairs ordered by expert on the host (one copy
    /// of the routing each way), the tokens gathered once in that order, then per
    /// routed expert one cuBLAS GEMM for gate/up and one for down on its contiguous
    /// rows, the SwiGLU over all pairs at once, and the weighted rows gathered back
    /// to their tokens and summed over the choices.
    fn forward_gathered(
        &self,
        xs: &Tensor,
        probs: &Tensor,
        gate_up: &Tensor,
        down: &Tensor,
    ) -> Result<Tensor> {
        let n = xs.dim(0)?;
        let n_experts = probs.dim(1)?;
        let inter = down.dim(2)?;
        let (idx, top) = self.route(probs)?;
        let idx = idx.to_vec2::<u32>()?;
        let top = top.to_vec2::<f32>()?;
        let mut start = vec![0usize; n_experts + 1];
        for &e in idx.iter().flatten() {
            start[e as usize + 1] += 1;
        }
        for e in 0..n_experts {
            start[e + 1] += start[e];
        }
        let pairs = start[n_experts];
        let mut at = start.clone();
        let mut tokens = vec![0u32; pairs];
        let mut weights = vec![0f32; pairs];
        // Where each (token, choice) pair's row lands in expert order.
        let mut rows = vec![0u32; pairs];
        for t in 0..n {
            let sum: f32 = top[t].iter().sum();
            for (j, &e) in idx[t].iter().enumerate() {
                let slot = &mut at[e as usize];
                tokens[*slot] = t as u32;
                weights[*slot] = if self.norm_topk_prob {
                    top[t][j] / sum
                } else {
                    top[t][j]
                };
                rows[t * self.top_k + j] = *slot as u32;
                *slot += 1;
            }
        }
        let dev = xs.device();
        let ids = Tensor::from_vec(tokens, pairs, dev)?;
        let rows = Tensor::from_vec(rows, pairs, dev)?;
        let w = Tensor::from_vec(weights, (pairs, 1), dev)?.to_dtype(xs.dtype())?;
        let xg = xs.index_select(&ids, 0)?;
        let routed: Vec<(usize, usize, usize)> = (0..n_experts)
            .filter(|&e| start[e + 1] > start[e])
            .map(|e| (e, start[e], start[e + 1] - start[e]))
            .collect();
        let per_expert = |x: &Tensor, w: &Tensor| -> Result<Tensor> {
            let parts = routed
                .iter()
                .map(|&(e, lo, len)| x.narrow(0, lo, len)?.matmul(&w.get(e)?.t()?))
                .collect::<Result<Vec<_>>>()?;
            Tensor::cat(&parts, 0)
        };
        let gu = per_expert(&xg, gate_up)?;
        let g = gu.narrow(1, 0, inter)?.apply(&self.act)?;
        let h = (g * gu.narrow(1, inter, inter)?)?;
        let y = per_expert(&h, down)?.broadcast_mul(&w)?;
        // Back in token order (a gather: candle's index_add walks the pairs serially).
        let hidden = xs.dim(1)?;
        y.index_select(&rows, 0)?
            .reshape((n, self.top_k, hidden))?
            .sum(1)
    }

    /// The routed experts of `x` `(n, hidden)` through [`Self::forward_gathered`]
    /// (GPU tests time it against the grouped kernel).
    #[cfg(all(test, feature = "cuda"))]
    pub(crate) fn forward_gathered_for_test(&self, x: &Tensor) -> Result<Tensor> {
        let Some((gate_up, down)) = &self.fused else {
            candle_core::bail!("no stacked experts (a GPU in bf16/f16 has them)");
        };
        let xs = x.contiguous()?;
        let probs =
            candle_nn::ops::softmax_last_dim(&self.gate.forward(&xs)?.to_dtype(DType::F32)?)?;
        self.forward_gathered(&xs, &probs, gate_up, down)
    }

    /// The routed experts one by one on the tokens routed to each: the CPU path.
    fn forward_experts(&self, xs: &Tensor, probs: &Tensor) -> Result<Tensor> {
        let n = xs.dim(0)?;
        let (idx, top) = self.route(probs)?;
        let idx = idx.to_vec2::<u32>()?;
        let top = top.to_vec2::<f32>()?;
        let n_experts = probs.dim(1)?;
        // Per expert: its tokens and their routing weights.
        let mut tokens: Vec<Vec<u32>> = vec![Vec::new(); n_experts];
        let mut weights: Vec<Vec<f32>> = vec![Vec::new(); n_experts];
        for t in 0..n {
            let sum: f32 = top[t].iter().sum();
            for (j, &e) in idx[t].iter().enumerate() {
                let w = if self.norm_topk_prob {
                    top[t][j] / sum
                } else {
                    top[t][j]
                };
                tokens[e as usize].push(t as u32);
                weights[e as usize].push(w);
            }
        }
        let mut rows = Vec::new();
        let mut outs = Vec::new();
        for e in 0..n_experts {
            if tokens[e].is_empty() {
                continue;
            }
            let m = tokens[e].len();
            let ids = Tensor::from_vec(tokens[e].clone(), m, xs.device())?;
            let w =
                Tensor::from_vec(weights[e].clone(), (m, 1), xs.device())?.to_dtype(xs.dtype())?;
            let h = self.expert(e, &xs.index_select(&ids, 0)?)?;
            outs.push(h.broadcast_mul(&w)?);
            rows.push(ids);
        }
        let out = xs.zeros_like()?;
        if outs.is_empty() {
            return Ok(out);
        }
        // One index_add in expert order: each token sums its experts in ascending index
        // order, as the reference's loop does.
        out.index_add(&Tensor::cat(&rows, 0)?, &Tensor::cat(&outs, 0)?, 0)
    }
}

impl Module for SparseMoe {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let dims = x.dims().to_vec();
        let hidden = *dims.last().unwrap_or(&0);
        let xs = x.reshape(((), hidden))?.contiguous()?;
        let logits = self.gate.forward(&xs)?;
        let n = xs.dim(0)?;
        let mut out = match &self.fused {
            Some((gate_up, down)) if self.decode_kernels(&xs, n) => {
                self.forward_decode(&xs, &logits, gate_up, down)?
            }
            Some((gate_up, down)) if self.tc_kernels(gate_up, down) => {
                self.forward_tc(&xs, &logits, gate_up, down)?
            }
            _ => {
                let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32)?)?;
                match &self.fused {
                    Some((gate_up, down)) if n * self.top_k <= grouped_max_pairs() => {
                        let prefill = n > GROUPED_DECODE_MAX_TOKENS;
                        self.forward_fused(&xs, &probs, gate_up, down, prefill)?
                    }
                    Some((gate_up, down)) => self.forward_gathered(&xs, &probs, gate_up, down)?,
                    None => self.forward_experts(&xs, &probs)?,
                }
            }
        };
        if let Some((mlp, gate)) = &self.shared_expert {
            let shared = mlp.forward(&xs)?;
            let g = candle_nn::ops::sigmoid(&gate.forward(&xs)?)?;
            out = (out + shared.broadcast_mul(&g)?)?;
        }
        out.reshape(dims)
    }
}

/// A decoder layer's feed-forward part.
#[derive(Debug, Clone)]
pub enum FeedForward {
    Dense(Mlp),
    Moe(SparseMoe),
}

impl FeedForward {
    /// The dense SwiGLU MLP of `cfg`'s widths (`vb` at `mlp`), gate and up fused.
    pub fn dense(cfg: &DecoderConfig, vb: VarBuilder) -> Result<Self> {
        let mlp = Mlp::new(cfg.hidden_size, cfg.intermediate_size, cfg.hidden_act, vb)?;
        Ok(Self::Dense(mlp.fuse_gate_up()?))
    }
}

impl Module for FeedForward {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        match self {
            Self::Dense(m) => m.forward(x),
            Self::Moe(m) => m.forward(x),
        }
    }
}

/// Pre-norm decoder layer: `x + attn(norm(x))`, then `h + mlp(norm(h))`.
#[derive(Debug, Clone)]
pub struct DecoderLayer {
    self_attn: Attention,
    mlp: FeedForward,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
}

impl DecoderLayer {
    /// Dense or MoE by the reference's rule (`mlp_only_layers`, `decoder_sparse_step`).
    pub fn new(cfg: &DecoderConfig, layer_idx: usize, vb: VarBuilder) -> Result<Self> {
        let mlp = if cfg.is_sparse_layer(layer_idx) {
            FeedForward::Moe(SparseMoe::new(cfg, vb.pp("mlp"))?)
        } else {
            FeedForward::dense(cfg, vb.pp("mlp"))?
        };
        Self::with_feed_forward(cfg, mlp, vb)
    }

    /// With a given feed-forward part (loaded from `vb.pp("mlp")` by the caller).
    pub fn with_feed_forward(
        cfg: &DecoderConfig,
        mlp: FeedForward,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self {
            self_attn: Attention::new(cfg, vb.pp("self_attn"))?,
            mlp,
            input_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("input_layernorm"),
            )?,
            post_attention_layernorm: RmsNorm::new(
                cfg.hidden_size,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
        })
    }

    pub fn forward(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: Option<&Tensor>,
        cache: Option<&mut KvCache>,
    ) -> Result<Tensor> {
        self.block(x, |h| self.self_attn.forward(h, cos, sin, mask, cache))
    }

    /// The pre-norm residual block around `attn` (the attention on the normed input).
    fn block(&self, x: &Tensor, attn: impl FnOnce(&Tensor) -> Result<Tensor>) -> Result<Tensor> {
        let (x, h) = self.parts(x, &self.input_layernorm.forward(x)?, attn)?;
        x + h
    }

    /// The block on the residual stream `x` and its input norm `normed`, without
    /// the last residual add: (the stream after the attention's add, the MLP's
    /// output), whose sum is the block's output ([`run_decoder`] fuses that add
    /// with the norm after it).
    fn parts(
        &self,
        x: &Tensor,
        normed: &Tensor,
        attn: impl FnOnce(&Tensor) -> Result<Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let h = attn(normed)?;
        let (x, normed) = self.post_attention_layernorm.add_forward(x, &h)?;
        Ok((x, self.mlp.forward(&normed)?))
    }

    /// [`Self::forward`] for one decode step of a running batch over [`KvSlots`].
    pub fn forward_slots(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        slots: &KvSlots,
        batch: &SlotBatch,
    ) -> Result<Tensor> {
        self.block(x, |h| {
            self.self_attn.forward_slots(h, cos, sin, slots, batch)
        })
    }
}

/// A decoder's `layers` and its final `norm` over `x`, each residual add fused with
/// the norm after it (the next layer's input norm, or the final one; one launch
/// on a GPU in bf16, [`RmsNorm::add_forward`]): the final-normed hidden states.
/// `attn(i, attention, normed)` runs layer `i`'s attention on its normed input
/// (with the caller's cache or slots); `record(i, x)` sees the residual stream
/// after layer `i - 1`, for `i` in `1..layers`.
pub fn run_decoder(
    layers: &[DecoderLayer],
    norm: &RmsNorm,
    x: &Tensor,
    mut attn: impl FnMut(usize, &Attention, &Tensor) -> Result<Tensor>,
    mut record: impl FnMut(usize, &Tensor),
) -> Result<Tensor> {
    let Some(first) = layers.first() else {
        return norm.forward(x);
    };
    let mut normed = first.input_layernorm.forward(x)?;
    let mut x = x.clone();
    for (i, layer) in layers.iter().enumerate() {
        let (mid, h) = layer.parts(&x, &normed, |n| attn(i, &layer.self_attn, n))?;
        let next = layers.get(i + 1).map_or(norm, |l| &l.input_layernorm);
        (x, normed) = next.add_forward(&mid, &h)?;
        if i + 1 < layers.len() {
            record(i + 1, &x);
        }
    }
    Ok(normed)
}

impl DecoderLayer {
    /// The stacked q/k/v, gate/up and down projections where [`run_decoder_slots`]'s
    /// fused step takes this layer: the engine's attention kernels, a dense SwiGLU
    /// MLP with gate and up stacked, no biases, bf16 norms no wider than
    /// [`kernels::NORM_GEMV_MAX_K`].
    fn fused_decode(&self) -> Option<(&Linear, &Linear, &Linear)> {
        let a = &self.self_attn;
        let qkv = a.fused_qkv()?;
        let FeedForward::Dense(mlp) = &self.mlp else {
            return None;
        };
        let gate_up = mlp.gate_up.as_ref()?;
        let hidden = self.input_layernorm.weight_native.elem_count();
        let bf16 = |t: &Tensor| t.dtype() == DType::BF16;
        let ok = qkv.bias().is_none()
            && a.o_proj.bias().is_none()
            && mlp.down_proj.bias().is_none()
            && (8..=kernels::NORM_GEMV_MAX_K).contains(&hidden)
            && hidden.is_multiple_of(8)
            && bf16(&self.input_layernorm.weight_native)
            && bf16(&self.post_attention_layernorm.weight_native)
            && [qkv, gate_up, &a.o_proj, &mlp.down_proj]
                .iter()
                .all(|l| bf16(l.weight()) && l.weight().dim(1).is_ok_and(|k| k % 8 == 0));
        ok.then_some((qkv, gate_up, &mlp.down_proj))
    }
}

/// One decode step of a running batch `x` `(b, 1, hidden)` through `layers` over
/// their KV `slots` (one per layer) and `norm`: [`run_decoder`] with each layer's
/// [`Attention::forward_slots`]; or, for batches of up to `fuse_rows` rows (see
/// [`kernels::FUSED_DECODE_ROWS`]) where every layer is dense and takes the
/// engine's kernels, fused: each RMSNorm inside the projection after it
/// ([`kernels::norm_gemv`]) and each residual add inside the projection before it
/// ([`kernels::dense_gemv_residual`]), six launches a layer.
#[allow(clippy::too_many_arguments)]
pub fn run_decoder_slots(
    layers: &[DecoderLayer],
    norm: &RmsNorm,
    x: &Tensor,
    cos: &Tensor,
    sin: &Tensor,
    slots: &[KvSlots],
    batch: &SlotBatch,
    fuse_rows: usize,
) -> Result<Tensor> {
    let (b, s, hidden) = x.dims3()?;
    let fused = s == 1
        && b <= fuse_rows
        && b <= kernels::DENSE_GEMV_MAX_ROWS
        && x.device().is_cuda()
        && x.dtype() == DType::BF16
        && kernels::enabled()
        && slots.len() >= layers.len()
        && layers.iter().all(|l| l.fused_decode().is_some());
    if !fused {
        let attn = |i: usize, a: &Attention, h: &Tensor| match slots.get(i) {
            Some(kv) => a.forward_slots(h, cos, sin, kv, batch),
            None => candle_core::bail!("no KV slots for layer {i}"),
        };
        return run_decoder(layers, norm, x, attn, |_, _| {});
    }
    let mut x = x.reshape((b, hidden))?;
    for (layer, kv) in layers.iter().zip(slots) {
        let Some((qkv, gate_up, down)) = layer.fused_decode() else {
            candle_core::bail!("run_decoder_slots: a layer the fused step cannot take");
        };
        let (a, n1, n2) = (
            &layer.self_attn,
            &layer.input_layernorm,
            &layer.post_attention_layernorm,
        );
        let qkv = kernels::norm_gemv(&x, &n1.weight_native, n1.eps, qkv.weight(), false)?;
        let out = a.slot_core(&qkv, cos, sin, kv, batch)?.reshape((b, ()))?;
        x = kernels::dense_gemv_residual(&out, a.o_proj.weight(), &x)?;
        let h = kernels::norm_gemv(&x, &n2.weight_native, n2.eps, gate_up.weight(), true)?;
        x = kernels::dense_gemv_residual(&h, down.weight(), &x)?;
    }
    norm.forward(&x)?.reshape((b, 1, hidden))
}

/// KV slots for `layers`: a running batch of up to `slots` requests of `max_len`
/// positions each.
pub fn new_slots(
    layers: &[DecoderLayer],
    slots: usize,
    max_len: usize,
    dtype: DType,
    device: &Device,
) -> Result<Vec<KvSlots>> {
    layers
        .iter()
        .map(|l| {
            let a = &l.self_attn;
            KvSlots::new(slots, a.num_kv_heads, max_len, a.head_dim, dtype, device)
        })
        .collect()
}

/// The GPU's two MoE paths on the same bf16 input (so the same routing): the
/// per-expert GEMMs that long prefills take equal the grouped kernel.
#[cfg(all(test, feature = "cuda"))]
#[test]
fn per_expert_gemm_matches_grouped_kernel_on_gpu() {
    use crate::models::qwen3_omni::{fixtures, weights};
    let dev = Device::new_cuda(0).expect("a CUDA device");
    let cfg: DecoderConfig =
        serde_json::from_value(fixtures::config()["thinker_config"]["text_config"].clone())
            .unwrap();
    let layer = (0..cfg.num_hidden_layers)
        .find(|&i| cfg.is_sparse_layer(i))
        .unwrap();
    let vb =
        weights::from_checkpoint(&fixtures::dir().join("model"), DType::BF16, &dev, None).unwrap();
    let moe = SparseMoe::new(&cfg, vb.pp(format!("thinker.model.layers.{layer}.mlp"))).unwrap();
    let Some((gate_up, down)) = &moe.fused else {
        panic!("bf16 on a GPU stacks the experts");
    };
    let xs = Tensor::randn(0f32, 1.0, (2500, cfg.hidden_size), &dev)
        .unwrap()
        .to_dtype(DType::BF16)
        .unwrap();
    let logits = moe.gate.forward(&xs).unwrap();
    let probs = candle_nn::ops::softmax_last_dim(&logits.to_dtype(DType::F32).unwrap()).unwrap();
    let grouped = moe.forward_fused(&xs, &probs, gate_up, down, true).unwrap();
    let scale = fixtures::max_abs_diff(&grouped, &grouped.zeros_like().unwrap());
    for (what, got) in [
        ("per-expert GEMM", moe.forward_experts(&xs, &probs).unwrap()),
        (
            "gathered GEMM",
            moe.forward_gathered(&xs, &probs, gate_up, down).unwrap(),
        ),
    ] {
        let err = fixtures::max_abs_diff(&grouped, &got);
        eprintln!("2,500 tokens: {what} vs grouped kernel {err:.2e} (max |value| {scale:.2e})");
        assert!(
            err <= 0.02 * scale,
            "{what} differs from the grouped kernel by {err}"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures;

    /// Long prefills sort their expert choices on the host, as the device would.
    #[test]
    fn expert_sort_on_host_matches_device_order() {
        let ids: Vec<u32> = (0..20_000u32).map(|i| (i * 7919) % 128).collect();
        let t = Tensor::from_vec(ids.clone(), ids.len(), &Device::Cpu).unwrap();
        let (experts, order) = sort_by_expert(&t).unwrap();
        let (experts, order) = (
            experts.to_vec1::<u32>().unwrap(),
            order.to_vec1::<u32>().unwrap(),
        );
        assert!(experts.windows(2).all(|w| w[0] <= w[1]));
        assert!(order
            .iter()
            .zip(&experts)
            .all(|(&o, &e)| ids[o as usize] == e));
        let mut seen = order.clone();
        seen.sort_unstable();
        assert!(seen.iter().enumerate().all(|(i, &o)| o as usize == i));
    }

    /// Interleaved MRoPE with distinct t/h/w rows against the reference's
    /// `Qwen3OmniMoeThinkerTextRotaryEmbedding` (full-width cos/sin = [half, half]).
    #[test]
    fn mrope_matches_reference() {
        let io = fixtures::io("thinker");
        let cfg: DecoderConfig =
            serde_json::from_value(fixtures::config()["thinker_config"]["text_config"].clone())
                .unwrap();
        let rope = RotaryEmbedding::from_config(&cfg, &Device::Cpu).unwrap();
        let (cos, sin) = rope.forward(&io["rope.position_ids"], DType::F32).unwrap();
        for (name, got) in [("cos", cos), ("sin", sin)] {
            let want = &io[&format!("rope.{name}")];
            let half = got.dim(D::Minus1).unwrap();
            let full = Tensor::cat(&[&got, &got], D::Minus1).unwrap();
            let d = fixtures::max_abs_diff(&full, want);
            println!("mrope {name}: max abs err {d:.3e} (half {half})");
            assert!(d <= 1e-4, "{name}: {d}");
        }
        // Plain 1-D positions equal MRoPE with three equal rows.
        let p = Tensor::new(&[[3u32, 7, 11]], &Device::Cpu).unwrap();
        let (c1, _) = rope.forward(&p, DType::F32).unwrap();
        let (c3, _) = rope
            .forward(
                &p.unsqueeze(0).unwrap().repeat((3, 1, 1)).unwrap(),
                DType::F32,
            )
            .unwrap();
        assert_eq!(fixtures::max_abs_diff(&c1, &c3), 0.0);
    }
}
