//! The 12 Hz speech tokenizer's encoder (`Qwen3TTSTokenizerV2Encoder`, weights
//! under `encoder.` in `speech_tokenizer/model.safetensors`): 24 kHz mono PCM to
//! the codes the Talker speaks in. A Base checkpoint clones a voice in context
//! from a reference clip's codes (see [`super::talker::Voice::InContext`]).
//!
//! It is transformers' `MimiModel.encode` (transformers 4.57.3, which qwen-tts
//! 0.1.1 pins), then `codes[:, :encoder_valid_num_quantizers]`:
//!
//! ```text
//! encoder               SEANet: causal convs (padded by the config's pad_mode, zeros for the
//!                       released one: k - s on the left, the rest of the last stride on the
//!                       right), ELU, resnet blocks, strides [4, 5, 6, 8]
//! encoder_transformer   pre-LayerNorm layers: RoPE attention (causal), GELU MLP, layer scales
//! downsample            causal conv k=4, s=2, replicate-padded: 25 Hz -> 12.5 Hz
//! quantizer             split RVQ over the same vectors: 1 semantic codebook, then the acoustic
//!                       ones, each set behind its own input_proj; rows embed_sum / max(usage, 1e-5),
//!                       the nearest by Euclidean distance, residuals subtracted
//! ```
//!
//! The SEANet encoder's convs and resnet blocks and the downsample conv are
//! candle-transformers' Mimi modules ([`StreamableConv1d`],
//! [`SeaNetResnetBlock`]): their weight names, padding and activations are the
//! reference's. The SEANet is put together here (as candle's `SeaNetEncoder`
//! does) so that a batch of clips can be encoded at once, each exactly as alone
//! (see *Batches*). The transformer and the
//! quantizer are written here: the reference's eager and sdpa attention is
//! plain causal (transformers applies `sliding_window` only on its
//! flash-attention path, and qwen-tts loads the tokenizer without it), where
//! candle's Mimi transformer always limits attention to the window; candle's
//! quantizer also takes no `encoder_valid_num_quantizers` and needs input
//! projections the reference has only when widths differ.
//!
//! # Frames
//!
//! A clip of `n` samples gives `ceil(n / 1920)` frames ([`CodecEncoder::frames`]):
//! each strided conv pads out its last stride, so the SEANet makes
//! `ceil(n / 960)` steps and the downsample halves that, rounding up; the
//! reference trims to the same count (which only bites for padded batches).
//! The encode is one-shot, for reference clips of seconds (attention is
//! quadratic in the clip's 25 Hz steps: 750 for 30 s).
//!
//! # Batches
//!
//! [`CodecEncoder::encode_batch`] encodes clips of different lengths together,
//! right-padded to the longest. Every layer is causal, so a clip's steps never
//! see the padding after it, with one exception: a conv of stride `s` pads the
//! last stride out on the right (zeros, or the last step repeated for the
//! downsample's replicate padding), and in a batch the shorter clips have the
//! longer ones' steps there instead. So before each strided conv, each clip's
//! steps past its own length are set to what its padding alone would be; then
//! every step it keeps is computed from the same inputs as alone.
//!
//! # Exactness
//!
//! Codes are argmins of distances, computed here as `|e|² - 2 x·e` (the
//! reference: `cdist`, through a matmul as well). Two codebook rows at the same
//! distance up to float rounding may go either way, as they may between the
//! reference's own CPU and GPU runs; on the fixtures every code is equal (the
//! nearest row leads the next by at least 3e-5 of the distance there). The
//! encoder runs in f32 whatever the checkpoint's dtype: qwen-tts loads the
//! tokenizer in the model's dtype (bf16 on a GPU, typically), whose codes stray
//! from its own f32 ones at near ties; these are the f32 reference's.

use std::path::Path;

use candle_core::{DType, Device, Module, Result, Tensor, D};
use candle_nn::Activation;
use candle_nn::{LayerNorm, Linear, VarBuilder};
use candle_transformers::models::mimi::conv::{PadMode, StreamableConv1d};
use candle_transformers::models::mimi::seanet::SeaNetResnetBlock;
use serde::Deserialize;

use super::codec::CodecError;
use super::config::{ConfigError, SpeechTokenizerConfig};
use crate::models::qwen3_omni::layers::{apply_rotary_pos_emb, linear, RotaryEmbedding};

/// `encoder_config` of `speech_tokenizer/config.json`: transformers' `MimiConfig`,
/// with its defaults (the released encoder's shapes) for anything left out.
#[derive(Debug, Clone, Deserialize)]
pub struct CodecEncoderConfig {
    #[serde(default = "d_rate")]
    pub sampling_rate: usize,
    /// 12.5 for the released encoder; `sampling_rate / frame_size` when unset.
    #[serde(default, alias = "_frame_rate")]
    pub frame_rate: Option<f64>,
    #[serde(default = "d_one")]
    pub audio_channels: usize,
    #[serde(default = "d_hidden")]
    pub hidden_size: usize,
    #[serde(default = "d_filters")]
    pub num_filters: usize,
    #[serde(default = "d_one")]
    pub num_residual_layers: usize,
    /// The decoder's upsampling; the encoder strides through them reversed.
    #[serde(default = "d_ratios")]
    pub upsampling_ratios: Vec<usize>,
    #[serde(default = "d_kernel")]
    pub kernel_size: usize,
    #[serde(default = "d_three")]
    pub last_kernel_size: usize,
    #[serde(default = "d_three")]
    pub residual_kernel_size: usize,
    #[serde(default = "d_two")]
    pub dilation_growth_rate: usize,
    #[serde(default = "d_true")]
    pub use_causal_conv: bool,
    #[serde(default = "d_pad_mode")]
    pub pad_mode: String,
    #[serde(default = "d_two")]
    pub compress: usize,
    #[serde(default)]
    pub use_conv_shortcut: bool,
    #[serde(default = "d_codebook_size")]
    pub codebook_size: usize,
    #[serde(default = "d_vq_dim")]
    pub codebook_dim: usize,
    /// The width the quantizers work in (behind `input_proj` where it is not
    /// `hidden_size`).
    #[serde(default = "d_vq_dim")]
    pub vector_quantization_hidden_dimension: usize,
    #[serde(default = "d_quantizers")]
    pub num_quantizers: usize,
    #[serde(default = "d_one")]
    pub num_semantic_quantizers: usize,
    #[serde(default = "d_layers")]
    pub num_hidden_layers: usize,
    #[serde(default = "d_intermediate")]
    pub intermediate_size: usize,
    #[serde(default = "d_heads")]
    pub num_attention_heads: usize,
    #[serde(default = "d_heads")]
    pub num_key_value_heads: usize,
    /// `hidden_size / num_attention_heads` when unset.
    #[serde(default)]
    pub head_dim: Option<usize>,
    #[serde(default = "d_act")]
    pub hidden_act: String,
    #[serde(default = "d_eps")]
    pub norm_eps: f64,
    #[serde(default = "d_theta")]
    pub rope_theta: f64,
    #[serde(default)]
    pub attention_bias: bool,
    /// Read for completeness: the reference does not apply it (see the module doc).
    #[serde(default)]
    pub sliding_window: Option<usize>,
}

fn d_rate() -> usize {
    24_000
}
fn d_one() -> usize {
    1
}
fn d_two() -> usize {
    2
}
fn d_three() -> usize {
    3
}
fn d_hidden() -> usize {
    512
}
fn d_filters() -> usize {
    64
}
fn d_ratios() -> Vec<usize> {
    vec![8, 6, 5, 4]
}
fn d_kernel() -> usize {
    7
}
fn d_true() -> bool {
    true
}
fn d_pad_mode() -> String {
    "constant".into()
}
fn d_codebook_size() -> usize {
    2048
}
fn d_vq_dim() -> usize {
    256
}
fn d_quantizers() -> usize {
    32
}
fn d_layers() -> usize {
    8
}
fn d_intermediate() -> usize {
    2048
}
fn d_heads() -> usize {
    8
}
fn d_act() -> String {
    "gelu".into()
}
fn d_eps() -> f64 {
    1e-5
}
fn d_theta() -> f64 {
    10_000.0
}

impl CodecEncoderConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads.max(1))
    }

    fn hop(&self) -> usize {
        self.upsampling_ratios.iter().product()
    }

    /// `MimiConfig.frame_rate`: the given one, or the rate with the 2x downsample.
    pub fn frame_rate(&self) -> f64 {
        self.frame_rate
            .unwrap_or(self.sampling_rate as f64 / (2 * self.hop()) as f64)
    }

    /// The kernel of `downsample` (stride 2), or `None` where the SEANet's own
    /// rate (`encodec_frame_rate`) is already the frame rate, as `MimiModel` decides.
    pub fn downsample_kernel(&self) -> Option<usize> {
        let encodec = self.sampling_rate.div_ceil(self.hop().max(1)) as f64;
        let rate = self.frame_rate();
        ((rate - encodec).abs() > 1e-9).then(|| 2 * (encodec / rate) as usize)
    }

    /// Input samples a code frame covers.
    pub fn samples_per_frame(&self) -> usize {
        match self.downsample_kernel() {
            Some(_) => 2 * self.hop(),
            None => self.hop(),
        }
    }

    /// What this encoder cannot be built for, with `valid` quantizers kept and
    /// `downsample_rate` samples a frame (`speech_tokenizer/config.json`'s).
    pub fn check(&self, valid: usize, downsample_rate: usize) -> std::result::Result<(), String> {
        let heads = self.num_attention_heads;
        if self.audio_channels != 1 {
            return Err(format!(
                "encoder: {} audio channels (mono only)",
                self.audio_channels
            ));
        }
        if !self.use_causal_conv {
            return Err("encoder: only causal convs (use_causal_conv) are supported".into());
        }
        if pad_mode(&self.pad_mode).is_none() {
            return Err(format!(
                "encoder: pad_mode {:?} (constant or replicate)",
                self.pad_mode
            ));
        }
        if self.hidden_act != "gelu" {
            return Err(format!(
                "encoder: hidden_act {:?} (gelu only)",
                self.hidden_act
            ));
        }
        let kv = self.num_key_value_heads;
        if heads == 0 || kv == 0 || !heads.is_multiple_of(kv) {
            return Err(format!(
                "encoder: {heads} attention heads over {} key/value heads",
                self.num_key_value_heads
            ));
        }
        if self.head_dim() == 0 || !self.head_dim().is_multiple_of(2) {
            return Err(format!(
                "encoder: head_dim {} (RoPE needs it even)",
                self.head_dim()
            ));
        }
        if self.upsampling_ratios.is_empty() || self.upsampling_ratios.contains(&0) {
            return Err(format!(
                "encoder: upsampling_ratios {:?}",
                self.upsampling_ratios
            ));
        }
        if self.downsample_kernel().is_some_and(|k| k < 2) {
            return Err(format!(
                "encoder: frame_rate {} above the SEANet's own rate",
                self.frame_rate()
            ));
        }
        if self.samples_per_frame() != downsample_rate {
            return Err(format!(
                "the encoder takes {} samples a frame, encode_downsample_rate says {downsample_rate}",
                self.samples_per_frame()
            ));
        }
        if self.codebook_dim != self.vector_quantization_hidden_dimension {
            return Err(format!(
                "encoder: codebook_dim {} differs from vector_quantization_hidden_dimension {}",
                self.codebook_dim, self.vector_quantization_hidden_dimension
            ));
        }
        let sem = self.num_semantic_quantizers;
        if sem == 0 || sem >= self.num_quantizers || valid < sem || valid > self.num_quantizers {
            return Err(format!(
                "encoder: {valid} valid quantizers of {} ({sem} semantic)",
                self.num_quantizers
            ));
        }
        Ok(())
    }
}

fn pad_mode(s: &str) -> Option<PadMode> {
    match s {
        "constant" => Some(PadMode::Constant),
        "replicate" => Some(PadMode::Replicate),
        _ => None,
    }
}

/// A clip the encoder refuses.
#[derive(Debug, thiserror::Error)]
pub enum EncodeError {
    #[error("the clip is empty")]
    Empty,
    #[error("clip {clip} has a non-finite sample at {sample}")]
    NotFinite { clip: usize, sample: usize },
    #[error(transparent)]
    Model(#[from] candle_core::Error),
}

/// `MimiTransformerLayer`: pre-LayerNorm attention and MLP, each scaled
/// (`*_layer_scale`) before the residual add.
#[derive(Debug, Clone)]
struct TransformerLayer {
    input_layernorm: LayerNorm,
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    self_attn_layer_scale: Tensor,
    post_attention_layernorm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    mlp_layer_scale: Tensor,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
}

impl TransformerLayer {
    fn new(cfg: &CodecEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (heads, kv_heads) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let bias = cfg.attention_bias;
        let att = vb.pp("self_attn");
        let norm = |name: &str| candle_nn::layer_norm(h, cfg.norm_eps, vb.pp(name));
        Ok(Self {
            input_layernorm: norm("input_layernorm")?,
            q_proj: linear(h, heads * hd, bias, att.pp("q_proj"))?,
            k_proj: linear(h, kv_heads * hd, bias, att.pp("k_proj"))?,
            v_proj: linear(h, kv_heads * hd, bias, att.pp("v_proj"))?,
            o_proj: linear(heads * hd, h, bias, att.pp("o_proj"))?,
            self_attn_layer_scale: vb.pp("self_attn_layer_scale").get(h, "scale")?,
            post_attention_layernorm: norm("post_attention_layernorm")?,
            fc1: linear(h, cfg.intermediate_size, false, vb.pp("mlp").pp("fc1"))?,
            fc2: linear(cfg.intermediate_size, h, false, vb.pp("mlp").pp("fc2"))?,
            mlp_layer_scale: vb.pp("mlp_layer_scale").get(h, "scale")?,
            heads,
            kv_heads,
            head_dim: hd,
        })
    }

    /// `x` `(1, t, hidden)`; `mask` `(t, t)` additive (0 or -inf).
    fn forward(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, mask: &Tensor) -> Result<Tensor> {
        let (b, t, _) = x.dims3()?;
        let hd = self.head_dim;
        let h = self.input_layernorm.forward(x)?;
        let split = |p: &Linear, n: usize| -> Result<Tensor> {
            p.forward(&h)?.reshape((b, t, n, hd))?.transpose(1, 2)
        };
        let q = split(&self.q_proj, self.heads)?;
        let k = split(&self.k_proj, self.kv_heads)?;
        let v = split(&self.v_proj, self.kv_heads)?.contiguous()?;
        let (q, k) = apply_rotary_pos_emb(&q, &k, cos, sin)?;
        let rep = self.heads / self.kv_heads;
        let k = candle_transformers::utils::repeat_kv(k, rep)?.contiguous()?;
        let v = candle_transformers::utils::repeat_kv(v, rep)?.contiguous()?;
        let w = (q.matmul(&k.t()?)? * (1.0 / (hd as f64).sqrt()))?.broadcast_add(mask)?;
        let w = candle_nn::ops::softmax_last_dim(&w)?;
        let o = w
            .matmul(&v)?
            .transpose(1, 2)?
            .reshape((b, t, self.heads * hd))?;
        let o = self.o_proj.forward(&o)?;
        let x = (x + o.broadcast_mul(&self.self_attn_layer_scale)?)?;
        let h = self.post_attention_layernorm.forward(&x)?;
        let h = self.fc2.forward(&self.fc1.forward(&h)?.gelu_erf()?)?;
        x + h.broadcast_mul(&self.mlp_layer_scale)?
    }
}

/// `MimiEuclideanCodebook`: rows `embed_sum / max(cluster_usage, 1e-5)`.
#[derive(Debug, Clone)]
struct Codebook {
    embed: Tensor,
    /// `embed` transposed `(dim, size)`, contiguous for the distance matmul.
    embed_t: Tensor,
    /// `|row|²` `(1, size)`.
    sq_norms: Tensor,
}

impl Codebook {
    fn new(size: usize, dim: usize, vb: VarBuilder) -> Result<Self> {
        let usage = vb.get(size, "cluster_usage")?;
        let sum = vb.get((size, dim), "embed_sum")?;
        let embed = sum.broadcast_div(&usage.maximum(1e-5)?.unsqueeze(1)?)?;
        Ok(Self {
            embed_t: embed.t()?.contiguous()?,
            sq_norms: embed.sqr()?.sum(1)?.unsqueeze(0)?,
            embed,
        })
    }

    /// The nearest row to each of `x` `(n, dim)`: its index `(n,)` u32 and the row.
    fn quantize(&self, x: &Tensor) -> Result<(Tensor, Tensor)> {
        // |x - e|² less the per-row constant |x|².
        let dist = self
            .sq_norms
            .broadcast_sub(&(x.matmul(&self.embed_t)? * 2.0)?)?;
        let idx = dist.argmin(D::Minus1)?;
        let rows = self.embed.index_select(&idx, 0)?;
        Ok((idx, rows))
    }
}

/// `MimiResidualVectorQuantizer` (encode only): codebooks over the residual,
/// behind `input_proj` (a k=1 conv) where the widths differ.
#[derive(Debug, Clone)]
struct ResidualVectorQuantizer {
    /// `(vq_dim, hidden)`.
    input_proj: Option<Tensor>,
    layers: Vec<Codebook>,
}

impl ResidualVectorQuantizer {
    fn new(cfg: &CodecEncoderConfig, n: usize, vb: VarBuilder) -> Result<Self> {
        let (h, d) = (cfg.hidden_size, cfg.vector_quantization_hidden_dimension);
        let input_proj = match d == h {
            true => None,
            false => Some(vb.pp("input_proj").get((d, h, 1), "weight")?.squeeze(2)?),
        };
        let layers = (0..n)
            .map(|i| Codebook::new(cfg.codebook_size, d, vb.pp("layers").pp(i).pp("codebook")))
            .collect::<Result<_>>()?;
        Ok(Self { input_proj, layers })
    }

    /// Codes `(n,)` u32 per codebook for `x` `(n, hidden)`.
    fn encode(&self, x: &Tensor) -> Result<Vec<Tensor>> {
        let mut residual = match &self.input_proj {
            Some(w) => x.matmul(&w.t()?)?,
            None => x.clone(),
        };
        let mut codes = Vec::with_capacity(self.layers.len());
        for cb in &self.layers {
            let (idx, rows) = cb.quantize(&residual)?;
            residual = (residual - rows)?;
            codes.push(idx);
        }
        Ok(codes)
    }
}

/// `x` `(b, c, t)` with each row's steps from its length `lens[row]` on as the
/// right padding of a causal conv sees them when the row is alone: zeros, or
/// its last step repeated (`mode`). Unchanged where every row fills `t`.
fn pad_past(x: &Tensor, lens: &[usize], mode: PadMode) -> Result<Tensor> {
    let (b, c, t) = x.dims3()?;
    if lens.len() != b || lens.iter().any(|&l| l == 0 || l > t) {
        candle_core::bail!("pad_past: lengths {lens:?} for {b} rows of {t} steps");
    }
    if lens.iter().all(|&l| l == t) {
        return Ok(x.clone());
    }
    match mode {
        PadMode::Replicate => {
            let idx: Vec<u32> = lens
                .iter()
                .flat_map(|&l| (0..t).map(move |j| j.min(l - 1) as u32))
                .collect();
            let idx = Tensor::from_vec(idx, (b, 1, t), x.device())?
                .broadcast_as((b, c, t))?
                .contiguous()?;
            x.contiguous()?.gather(&idx, 2)
        }
        // Zeros (the only other mode `check` lets through).
        _ => {
            let mask: Vec<f32> = lens
                .iter()
                .flat_map(|&l| (0..t).map(move |j| if j < l { 1.0 } else { 0.0 }))
                .collect();
            let mask = Tensor::from_vec(mask, (b, 1, t), x.device())?.to_dtype(x.dtype())?;
            x.broadcast_mul(&mask)
        }
    }
}

/// One strided level of the SEANet: resnet blocks, then ELU and a causal conv
/// of kernel `2 * stride`.
#[derive(Debug, Clone)]
struct SeaNetLayer {
    residuals: Vec<SeaNetResnetBlock>,
    downsample: StreamableConv1d,
    stride: usize,
}

/// The SEANet encoder (`MimiEncoder`), as candle's `SeaNetEncoder` builds it
/// (weights `layers.{i}`), with the convs unnormed as the reference's are.
#[derive(Debug, Clone)]
struct SeaNet {
    init_conv1d: StreamableConv1d,
    layers: Vec<SeaNetLayer>,
    final_conv1d: StreamableConv1d,
    pad_mode: PadMode,
}

const ELU: Activation = Activation::Elu(1.0);

impl SeaNet {
    fn new(c: &CodecEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let pad_mode = pad_mode(&c.pad_mode).unwrap_or(PadMode::Constant);
        let vb = vb.pp("layers");
        let conv = |cin, cout, k, stride, vb: VarBuilder| {
            StreamableConv1d::new(
                cin, cout, k, stride, /* dilation */ 1, /* groups */ 1,
                /* bias */ true, /* causal */ true, /* norm */ None, pad_mode, vb,
            )
        };
        let init_conv1d = conv(c.audio_channels, c.num_filters, c.kernel_size, 1, vb.pp(0))?;
        let (mut idx, mut mult) = (1, 1);
        let mut layers = Vec::with_capacity(c.upsampling_ratios.len());
        for &ratio in c.upsampling_ratios.iter().rev() {
            let dim = mult * c.num_filters;
            let residuals = (0..c.num_residual_layers)
                .map(|j| {
                    let dilation = c.dilation_growth_rate.pow(j as u32);
                    SeaNetResnetBlock::new(
                        dim,
                        &[(c.residual_kernel_size, dilation), (1, 1)],
                        ELU,
                        None,
                        /* causal */ true,
                        pad_mode,
                        c.compress,
                        /* true_skip */ !c.use_conv_shortcut,
                        vb.pp(idx + j),
                    )
                })
                .collect::<Result<Vec<_>>>()?;
            idx += c.num_residual_layers;
            // `idx` is the ELU before it.
            let downsample = conv(dim, 2 * dim, 2 * ratio, ratio, vb.pp(idx + 1))?;
            idx += 2;
            layers.push(SeaNetLayer {
                residuals,
                downsample,
                stride: ratio,
            });
            mult *= 2;
        }
        let final_conv1d = conv(
            mult * c.num_filters,
            c.hidden_size,
            c.last_kernel_size,
            1,
            vb.pp(idx + 1),
        )?;
        Ok(Self {
            init_conv1d,
            layers,
            final_conv1d,
            pad_mode,
        })
    }

    /// `x` `(b, 1, t)`, each row `lens[row]` samples long, to `(b, hidden, t')`
    /// and each row's length in steps.
    fn forward(&self, x: &Tensor, lens: &[usize]) -> Result<(Tensor, Vec<usize>)> {
        let mut lens = lens.to_vec();
        let mut x = x.apply(&self.init_conv1d)?;
        for layer in &self.layers {
            for r in &layer.residuals {
                x = x.apply(r)?;
            }
            let h = pad_past(&x.apply(&ELU)?, &lens, self.pad_mode)?;
            x = h.apply(&layer.downsample)?;
            lens.iter_mut().for_each(|l| *l = l.div_ceil(layer.stride));
        }
        Ok((x.apply(&ELU)?.apply(&self.final_conv1d)?, lens))
    }
}

/// The speech tokenizer's encoder: PCM to `(frames, valid quantizers)` codes.
#[derive(Debug, Clone)]
pub struct CodecEncoder {
    encoder: SeaNet,
    layers: Vec<TransformerLayer>,
    rope: RotaryEmbedding,
    downsample: Option<StreamableConv1d>,
    semantic: ResidualVectorQuantizer,
    acoustic: ResidualVectorQuantizer,
    samples_per_frame: usize,
    device: Device,
}

impl CodecEncoder {
    /// `cfg.encoder_config` with `vb` at `encoder` (f32: the codes are argmins,
    /// and half precision moves near ties).
    pub fn new(cfg: &SpeechTokenizerConfig, vb: VarBuilder) -> Result<Self> {
        let Some(c) = &cfg.encoder_config else {
            candle_core::bail!("the speech tokenizer has no encoder_config");
        };
        if vb.dtype() != DType::F32 {
            candle_core::bail!("the codec encoder runs in f32, not {:?}", vb.dtype());
        }
        let valid = cfg.encoder_valid_num_quantizers;
        if let Err(msg) = c.check(valid, cfg.encode_downsample_rate) {
            candle_core::bail!("{msg}");
        }
        let encoder = SeaNet::new(c, vb.pp("encoder"))?;
        let layers = (0..c.num_hidden_layers)
            .map(|i| TransformerLayer::new(c, vb.pp("encoder_transformer").pp("layers").pp(i)))
            .collect::<Result<_>>()?;
        let rope = RotaryEmbedding::new(c.head_dim(), c.rope_theta, None, vb.device())?;
        let downsample = match c.downsample_kernel() {
            Some(k) => Some(StreamableConv1d::new(
                c.hidden_size,
                c.hidden_size,
                k,
                /* stride */ 2,
                /* dilation */ 1,
                /* groups */ 1,
                /* bias */ false,
                /* causal */ true,
                /* norm */ None,
                PadMode::Replicate,
                vb.pp("downsample"),
            )?),
            None => None,
        };
        let q = vb.pp("quantizer");
        let sem = c.num_semantic_quantizers;
        Ok(Self {
            encoder,
            layers,
            rope,
            downsample,
            semantic: ResidualVectorQuantizer::new(
                c,
                sem,
                q.pp("semantic_residual_vector_quantizer"),
            )?,
            acoustic: ResidualVectorQuantizer::new(
                c,
                valid - sem,
                q.pp("acoustic_residual_vector_quantizer"),
            )?,
            samples_per_frame: c.samples_per_frame(),
            device: vb.device().clone(),
        })
    }

    /// Input samples a code frame covers (1920).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// Codes a frame (`encoder_valid_num_quantizers`).
    pub fn num_quantizers(&self) -> usize {
        self.semantic.layers.len() + self.acoustic.layers.len()
    }

    /// Frames [`Self::encode`] makes of `samples` samples: `ceil(samples / 1920)`.
    pub fn frames(&self, samples: usize) -> usize {
        samples.div_ceil(self.samples_per_frame)
    }

    /// The codes of 24 kHz mono PCM: `(frames, quantizers)` u32 on the model's
    /// device, `frames` = [`Self::frames`]`(pcm.len())`, as the reference's
    /// `Qwen3TTSTokenizerV2Model.encode` (one clip, unpadded).
    pub fn encode(&self, pcm: &[f32]) -> std::result::Result<Tensor, EncodeError> {
        let mut codes = self.encode_batch(&[pcm])?;
        Ok(codes.remove(0))
    }

    /// [`Self::encode`] of several clips at once, each exactly as alone (see
    /// *Batches* in the module doc): one `(frames, quantizers)` tensor a clip,
    /// in order. A bad clip fails the batch, naming its index.
    pub fn encode_batch(&self, clips: &[&[f32]]) -> std::result::Result<Vec<Tensor>, EncodeError> {
        for (i, pcm) in clips.iter().enumerate() {
            if pcm.is_empty() {
                return Err(EncodeError::Empty);
            }
            if let Some(sample) = pcm.iter().position(|x| !x.is_finite()) {
                return Err(EncodeError::NotFinite { clip: i, sample });
            }
        }
        let Some(longest) = clips.iter().map(|c| c.len()).max() else {
            return Ok(Vec::new());
        };
        let b = clips.len();
        let mut padded = vec![0f32; b * longest];
        for (row, pcm) in padded.chunks_mut(longest).zip(clips) {
            row[..pcm.len()].copy_from_slice(pcm);
        }
        let lens: Vec<usize> = clips.iter().map(|c| c.len()).collect();
        let x = Tensor::from_vec(padded, (b, 1, longest), &self.device)?;
        let (x, lens) = self.encoder.forward(&x, &lens)?;
        let x = self.transformer(&x.transpose(1, 2)?.contiguous()?)?;
        let x = match &self.downsample {
            Some(d) => {
                let x = pad_past(&x.transpose(1, 2)?.contiguous()?, &lens, PadMode::Replicate)?;
                d.forward(&x)?.transpose(1, 2)?
            }
            None => x,
        };
        let (_, t, hidden) = x.dims3()?;
        let flat = x.contiguous()?.reshape((b * t, hidden))?;
        let mut codes = self.semantic.encode(&flat)?;
        codes.extend(self.acoustic.encode(&flat)?);
        let codes = Tensor::stack(&codes, 1)?.reshape((b, t, self.num_quantizers()))?;
        clips
            .iter()
            .enumerate()
            .map(|(i, pcm)| {
                let frames = self.frames(pcm.len()).min(t);
                Ok(codes.get(i)?.narrow(0, 0, frames)?)
            })
            .collect()
    }

    /// `encoder_transformer` over `x` `(1, t, hidden)`, every step seeing all
    /// earlier ones (the reference's mask; see the module doc).
    fn transformer(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(1)?;
        let pos = Tensor::arange(0u32, t as u32, &self.device)?.unsqueeze(0)?;
        let (cos, sin) = self.rope.forward(&pos, DType::F32)?;
        let mask: Vec<f32> = (0..t)
            .flat_map(|i| (0..t).map(move |j| if j > i { f32::NEG_INFINITY } else { 0.0 }))
            .collect();
        let mask = Tensor::from_vec(mask, (t, t), &self.device)?;
        let mut x = x.clone();
        for layer in &self.layers {
            x = layer.forward(&x, &cos, &sin, &mask)?;
        }
        Ok(x)
    }
}

/// A tensor every encoder has (its first codebook): present where the
/// checkpoint's speech tokenizer ships the encoder.
const PROBE: &str = "quantizer.semantic_residual_vector_quantizer.layers.0.codebook.embed_sum";

/// The encoder of `speech_tokenizer/` under a checkpoint folder (`cfg`, its
/// config), in f32; `None` where the tokenizer has no encoder config or weights.
pub fn load_encoder(
    dir: &Path,
    cfg: &SpeechTokenizerConfig,
    device: &Device,
) -> std::result::Result<Option<CodecEncoder>, CodecError> {
    let Some(enc) = &cfg.encoder_config else {
        return Ok(None);
    };
    let st = dir.join("speech_tokenizer");
    let path = st.join("model.safetensors");
    let err = |source| CodecError::Weights {
        path: path.display().to_string(),
        source,
    };
    // SAFETY: checkpoint files are not modified while the server runs.
    let vb = unsafe { VarBuilder::from_mmaped_safetensors(&[&path], DType::F32, device) }
        .map_err(err)?
        .pp("encoder");
    if !vb.contains_tensor(PROBE) {
        return Ok(None);
    }
    enc.check(cfg.encoder_valid_num_quantizers, cfg.encode_downsample_rate)
        .map_err(|msg| ConfigError::Invalid {
            path: st.join("config.json").display().to_string(),
            msg,
        })?;
    CodecEncoder::new(cfg, vb).map(Some).map_err(err)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_tts::fixtures;

    fn encoder() -> CodecEncoder {
        let dir = fixtures::model_dir();
        let cfg = SpeechTokenizerConfig::load(&dir).unwrap();
        load_encoder(&dir, &cfg, &Device::Cpu)
            .unwrap()
            .expect("the tiny speech tokenizer has an encoder")
    }

    /// Every code equal, on clips of 7, 15 and 38 frames: the last two run the
    /// transformer past the tiny config's `sliding_window` of 16 steps, which the
    /// reference does not apply.
    #[test]
    fn codes_match_reference() {
        let enc = encoder();
        assert_eq!((enc.samples_per_frame(), enc.num_quantizers()), (1920, 4));
        let io = fixtures::io("encoder");
        let meta = fixtures::meta("encoder");
        let clips = meta["clips"].as_array().unwrap();
        assert_eq!(clips.len(), 3);
        for n in clips {
            let n = n.as_u64().unwrap() as usize;
            let pcm = fixtures::pcm16(&io, n);
            assert_eq!(pcm.len(), n);
            let ours = enc.encode(&pcm).unwrap();
            assert_eq!(ours.dims(), [n.div_ceil(1920), 4], "{n} samples");
            let want: Vec<Vec<u32>> = io[&format!("codes_{n}")]
                .to_dtype(DType::U32)
                .unwrap()
                .to_vec2()
                .unwrap();
            assert_eq!(ours.to_vec2::<u32>().unwrap(), want, "{n} samples");
        }
    }

    /// Clips of different lengths encoded together, each as alone: the
    /// reference's clips (7, 15 and 38 frames) and ones ending mid-stride at
    /// every level, so each strided conv's right padding is exercised.
    #[test]
    fn a_batch_encodes_each_clip_as_alone() {
        let enc = encoder();
        let io = fixtures::io("encoder");
        let meta = fixtures::meta("encoder");
        let mut clips: Vec<Vec<f32>> = meta["clips"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| fixtures::pcm16(&io, n.as_u64().unwrap() as usize))
            .collect();
        let long = clips.iter().map(Vec::len).max().unwrap();
        for n in [1usize, 959, 1921, 4803, long - 7] {
            clips.push(clips[2][..n].to_vec());
        }
        // The same clip twice among them: rows of one length, unpadded.
        clips.push(clips[2].clone());
        let refs: Vec<&[f32]> = clips.iter().map(Vec::as_slice).collect();
        let batch = enc.encode_batch(&refs).unwrap();
        assert_eq!(batch.len(), clips.len());
        for (pcm, got) in clips.iter().zip(&batch) {
            let alone = enc.encode(pcm).unwrap().to_vec2::<u32>().unwrap();
            assert_eq!(
                got.to_vec2::<u32>().unwrap(),
                alone,
                "{} samples",
                pcm.len()
            );
        }
        // The padding itself, as a conv alone would see it.
        let x = Tensor::arange(1f32, 13., &Device::Cpu)
            .unwrap()
            .reshape((2, 1, 6))
            .unwrap();
        let zeros = pad_past(&x, &[4, 6], PadMode::Constant).unwrap();
        assert_eq!(
            zeros.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1., 2., 3., 4., 0., 0., 7., 8., 9., 10., 11., 12.]
        );
        let same = pad_past(&x, &[2, 6], PadMode::Replicate).unwrap();
        assert_eq!(
            same.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            [1., 2., 2., 2., 2., 2., 7., 8., 9., 10., 11., 12.]
        );
    }

    #[test]
    fn a_clip_of_n_samples_makes_ceil_n_over_1920_frames() {
        let enc = encoder();
        for n in [1usize, 1919, 1920, 1921, 3840, 5000] {
            let pcm: Vec<f32> = (0..n).map(|i| 0.5 * (i as f32 * 0.03).sin()).collect();
            let codes = enc.encode(&pcm).unwrap();
            assert_eq!(codes.dims(), [n.div_ceil(1920), 4], "{n} samples");
            assert_eq!(enc.frames(n), n.div_ceil(1920));
        }
    }

    #[test]
    fn bad_clips_are_refused() {
        let enc = encoder();
        assert!(matches!(enc.encode(&[]), Err(EncodeError::Empty)));
        let mut pcm = vec![0.1f32; 4000];
        pcm[1234] = f32::NAN;
        assert!(matches!(
            enc.encode(&pcm),
            Err(EncodeError::NotFinite {
                clip: 0,
                sample: 1234
            })
        ));
        let ok = vec![0.1f32; 3000];
        assert!(matches!(
            enc.encode_batch(&[&ok, &pcm]),
            Err(EncodeError::NotFinite {
                clip: 1,
                sample: 1234
            })
        ));
    }

    /// The released speech tokenizers' encoders (deploy/qwen3_tts_released/):
    /// 1920 samples a frame through the k=4 downsample, 16 of 32 quantizers.
    #[test]
    fn the_released_encoder_configs_check() {
        let root = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_tts_released");
        for name in ["0.6b-base", "1.7b-base", "1.7b-customvoice"] {
            let cfg = SpeechTokenizerConfig::load(&root.join(name)).unwrap();
            let enc = cfg.encoder_config.as_ref().expect(name);
            assert_eq!(cfg.encoder_valid_num_quantizers, 16, "{name}");
            assert_eq!(enc.downsample_kernel(), Some(4), "{name}");
            assert_eq!(enc.samples_per_frame(), 1920, "{name}");
            assert_eq!((enc.hidden_size, enc.head_dim()), (512, 64), "{name}");
            assert_eq!(enc.vector_quantization_hidden_dimension, 256, "{name}");
            enc.check(16, cfg.encode_downsample_rate).unwrap();
            // What this encoder cannot be built for is named.
            let bad = CodecEncoderConfig {
                pad_mode: "reflect".into(),
                ..enc.clone()
            };
            assert!(bad.check(16, 1920).unwrap_err().contains("pad_mode"));
            assert!(enc.check(33, 1920).unwrap_err().contains("33 valid"));
            assert!(enc.check(16, 960).unwrap_err().contains("960"));
        }
    }
}
