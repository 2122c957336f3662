//! Qwen3-Omni Code2Wav: codec codes (16 quantizers at 12.5 Hz) to 24 kHz audio,
//! mirroring `Qwen3OmniMoeCode2Wav` of transformers 5.24, with an exact causal
//! streaming decoder. The same module runs Qwen3-TTS's speech-tokenizer decoder
//! ([`Code2WavVariant::Tts12Hz`]: another front, no left trim; see
//! `models::qwen3_tts::codec`); what follows describes Qwen3-Omni's.
//!
//! Pipeline: mean of the per-quantizer code embeddings, a sliding-window causal
//! transformer (`pre_transformer`), `upsampling_ratios` stages of (transposed
//! conv k=s, ConvNeXt block), a causal conv, `upsample_rates` decoder blocks
//! (SnakeBeta, transposed conv k=2s, three dilated residual units), SnakeBeta,
//! a causal conv to one channel, clamp to [-1, 1].
//!
//! # Alignment with the reference
//!
//! Every conv is causal with stride 1 (left zero padding, so the reference's
//! "extra padding" is always 0) and the k=s transposed convs of the upsampling
//! stages map each input sample to its own s outputs, so all of that is exact and
//! streamable as is. The k=2s transposed convs of the decoder blocks are the only
//! non-causal part: output block j (s samples) is `x[j] W[..s] + x[j-1] W[s..]`
//! and the reference trims s samples at both ends, keeping blocks 1..L-1 of an
//! input of length L. Dropping the last block removes the only output that would
//! need a future input (the reference is therefore causal: its output for F frames
//! is a prefix of its output for F+1 frames). Dropping the first block shifts the
//! signal; summed over the stages that is `((8*5+5)*4+4)*3+3 = 555` samples, which
//! is why the reference returns `F*1920 - 555` samples.
//!
//! After F frames the reference's first `F*1920 - 555` samples are known and the
//! rest are not, so an exact causal decoder must lag it by 555 samples (23.1 ms at
//! 24 kHz). Ours does exactly that: it reproduces the reference's left trim at the
//! start of a stream and emits 555 zero samples first, so for F frames
//!
//! ```text
//! ours[0..555]            = 0
//! ours[555 + r]           = reference[r]     for r in 0..F*1920-555
//! ```
//!
//! and it returns exactly `F*1920` samples, in one call or in chunks of any size
//! (each chunk of n frames gives n*1920 samples). No flush is needed: after the
//! last frame every sample the reference produces has been emitted; what the
//! transposed convs hold back is the tail the reference discards too.
//! (Trimming only the right side instead, as Qwen3-TTS's decoder does, gives
//! F*1920 samples without the delay but differs from this reference near the
//! start, because the onset block would enter the following causal convs.)
//!
//! The reference's own `chunked_decode` re-decodes each chunk with up to 25 frames
//! of left context from position 0 and drops the 555 samples at the end of every
//! chunk: `F*1920 - 555*ceil(F/chunk)` samples in all, a 23 ms hole at each chunk
//! boundary (shown by the tests below against its recorded output).
//!
//! # Streaming
//!
//! [`Code2WavState`] holds, per request batch, the transformer's sliding-window
//! K/V (the last `sliding_window - 1` frames per layer, rotary already applied at
//! their absolute positions), the left context of every causal conv (kernel-1 times
//! dilation samples), the pending half block of every k=2s transposed conv and the
//! frame count. [`Code2Wav::step`] costs time proportional to the chunk; the full
//! [`Code2Wav::decode`] is one step on a fresh state.

use std::collections::hash_map::Entry;

use candle_core::{DType, Module, Result, Tensor, D};
use candle_nn::{Activation, LayerNorm, Linear, VarBuilder};
use serde::Deserialize;

use super::layers::Mlp;
use super::{graphs, kernels};

/// `rope_parameters` of transformers 5 (only the default RoPE is used by Code2Wav).
#[derive(Debug, Clone, Deserialize)]
pub struct RopeParameters {
    #[serde(default = "default_rope_type")]
    pub rope_type: String,
    #[serde(default = "default_rope_theta")]
    pub rope_theta: f64,
}

fn default_rope_type() -> String {
    "default".to_string()
}

fn default_rope_theta() -> f64 {
    10000.0
}

/// `Qwen3OmniMoeCode2WavConfig` (the `code2wav_config` of the checkpoint's config.json).
/// Missing fields take the transformers class defaults.
#[derive(Debug, Clone, Deserialize)]
#[serde(default)]
pub struct Code2WavConfig {
    pub codebook_size: usize,
    pub hidden_size: usize,
    pub max_position_embeddings: usize,
    /// transformers 5 name; the released checkpoint has `rope_theta` instead.
    pub rope_parameters: Option<RopeParameters>,
    pub rope_theta: Option<f64>,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub head_dim: Option<usize>,
    pub attention_bias: bool,
    pub sliding_window: usize,
    pub intermediate_size: usize,
    pub hidden_act: Activation,
    pub layer_scale_initial_scale: f64,
    pub rms_norm_eps: f64,
    pub num_hidden_layers: usize,
    pub num_quantizers: usize,
    pub upsample_rates: Vec<usize>,
    pub upsampling_ratios: Vec<usize>,
    pub decoder_dim: usize,
    /// Qwen3-TTS's decoder: the width of the convolutional path (the transformer
    /// runs at `hidden_size` between `input_proj` and `output_proj`); Qwen3-Omni's
    /// has none (one width throughout).
    pub latent_dim: Option<usize>,
    /// Qwen3-TTS's decoder: the split RVQ's output width.
    pub codebook_dim: Option<usize>,
    /// Which decoder this is: not in the JSON, set by the loader.
    #[serde(skip)]
    pub variant: Code2WavVariant,
}

/// The two codec decoders this module runs. They share the transformer and the
/// convolutional upsampler and differ at both ends.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Code2WavVariant {
    /// `Qwen3OmniMoeCode2Wav`: the mean of the per-quantizer embeddings in; the
    /// transposed convs trim both ends (555 samples of lag, see the module docs).
    #[default]
    Omni,
    /// `Qwen3TTSTokenizerV2Decoder` (qwen-tts): a split RVQ (semantic quantizer 0
    /// and the acoustic rest, each summed and projected) and a causal conv in,
    /// `input_proj`/`output_proj` around the transformer; the transposed convs
    /// trim only the right side, so a stream of F frames is exactly the
    /// reference's F*1920 samples with no lag.
    Tts12Hz,
}

impl Default for Code2WavConfig {
    fn default() -> Self {
        Self {
            codebook_size: 2048,
            hidden_size: 1024,
            max_position_embeddings: 8000,
            rope_parameters: None,
            rope_theta: None,
            num_attention_heads: 16,
            num_key_value_heads: 16,
            head_dim: None,
            attention_bias: false,
            sliding_window: 72,
            intermediate_size: 3072,
            hidden_act: Activation::Silu,
            layer_scale_initial_scale: 0.01,
            rms_norm_eps: 1e-5,
            num_hidden_layers: 8,
            num_quantizers: 16,
            upsample_rates: vec![8, 5, 4, 3],
            upsampling_ratios: vec![2, 2],
            decoder_dim: 1536,
            latent_dim: None,
            codebook_dim: None,
            variant: Code2WavVariant::Omni,
        }
    }
}

impl Code2WavConfig {
    pub fn head_dim(&self) -> usize {
        self.head_dim
            .unwrap_or(self.hidden_size / self.num_attention_heads)
    }

    pub fn rope_theta(&self) -> f64 {
        match (&self.rope_parameters, self.rope_theta) {
            (Some(p), _) => p.rope_theta,
            (None, Some(theta)) => theta,
            (None, None) => default_rope_theta(),
        }
    }

    /// Output samples per code frame (1920: 24 kHz at 12.5 Hz).
    pub fn samples_per_frame(&self) -> usize {
        self.upsampling_ratios
            .iter()
            .chain(&self.upsample_rates)
            .product()
    }

    /// Samples the reference's transposed convs trim from the start (555 for
    /// Qwen3-Omni, 0 for Qwen3-TTS), which is also how far our causal output lags it.
    pub fn delay_samples(&self) -> usize {
        if self.variant == Code2WavVariant::Tts12Hz {
            return 0;
        }
        // Each k=2s stage shifts by s at its own rate; earlier shifts scale up.
        self.upsample_rates.iter().fold(0, |d, &r| d * r + r)
    }

    /// The width of the convolutional path (the transformer's, where they match).
    pub fn latent_dim(&self) -> usize {
        self.latent_dim.unwrap_or(self.hidden_size)
    }
}

/// Left context of a causal layer: `None` until the first step, which then
/// stands for the reference's zero padding.
type Pending = Option<Tensor>;

/// `Qwen3OmniMoeCausalConvNet` with stride 1 (the only stride Code2Wav uses):
/// left zero padding of `(kernel-1)*dilation`, kept across steps as state.
#[derive(Debug, Clone)]
struct CausalConvNet {
    /// (cout, cin, kernel), or (cout, 1, kernel) depthwise.
    weight: Tensor,
    /// (cout, kernel * cin), tap-major: the conv as one matmul over the stacked taps.
    taps: Option<Tensor>,
    /// Depthwise kernels as (kernel, 1, channels, 1) for the groups == channels case.
    depthwise: Option<Tensor>,
    bias: Tensor,
    kernel: usize,
    dilation: usize,
    context: usize,
}

impl CausalConvNet {
    fn new(
        cin: usize,
        cout: usize,
        kernel: usize,
        dilation: usize,
        depthwise: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let vb = vb.pp("conv");
        let (weight, taps, dw) = if depthwise {
            let w = vb.get((cout, 1, kernel), "weight")?;
            let dw = w.permute((2, 1, 0))?.unsqueeze(3)?.contiguous()?;
            (w, None, Some(dw))
        } else {
            let w = vb.get((cout, cin, kernel), "weight")?;
            let taps = w.permute((0, 2, 1))?.reshape((cout, kernel * cin))?;
            (w, Some(taps), None)
        };
        let bias = vb.get(cout, "bias")?.reshape((1, cout, 1))?;
        Ok(Self {
            weight,
            taps,
            depthwise: dw,
            bias,
            kernel,
            dilation,
            context: (kernel - 1) * dilation,
        })
    }

    /// x: (batch, channels, len) -> (batch, out, len).
    fn step(&self, x: &Tensor, state: &mut Pending) -> Result<Tensor> {
        self.step_plus(x, state, None)
    }

    /// [`Self::step`] plus `residual` (batch, out, len).
    fn step_plus(
        &self,
        x: &Tensor,
        state: &mut Pending,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        if let Some(w) = self.taps.as_ref().filter(|_| kernel_conv(x)) {
            return self.step_kernel(x, w, state, residual);
        }
        let y = self.step_ops(x, state)?.broadcast_add(&self.bias)?;
        match residual {
            Some(r) => y + r,
            None => Ok(y),
        }
    }

    /// On a GPU in bf16: one launch, the engine's implicit-GEMM kernel, which reads
    /// the left context where it is (no concatenated or stacked copy).
    fn step_kernel(
        &self,
        x: &Tensor,
        w: &Tensor,
        state: &mut Pending,
        residual: Option<&Tensor>,
    ) -> Result<Tensor> {
        let (b, c, len) = x.dims3()?;
        let ctx = self.context;
        let prev = match (ctx, state.take()) {
            (0, _) => None,
            (_, Some(prev)) => Some(prev),
            (_, None) => Some(Tensor::zeros((b, c, ctx), x.dtype(), x.device())?),
        };
        let y = kernels::causal_conv(x, prev.as_ref(), w, &self.bias, residual, self.dilation)?;
        if let Some(prev) = prev {
            *state = Some(if len >= ctx {
                x.narrow(2, len - ctx, ctx)?.contiguous()?
            } else {
                Tensor::cat(&[&prev, x], 2)?
                    .narrow(2, len, ctx)?
                    .contiguous()?
            });
        }
        Ok(y)
    }

    /// Candle's ops (and the stacked taps' GEMM), before the bias.
    fn step_ops(&self, x: &Tensor, state: &mut Pending) -> Result<Tensor> {
        let len = x.dim(2)?;
        let xx = if self.context == 0 {
            x.clone()
        } else {
            let prev = match state.take() {
                Some(prev) => prev,
                None => {
                    let (b, c, _) = x.dims3()?;
                    Tensor::zeros((b, c, self.context), x.dtype(), x.device())?
                }
            };
            let xx = Tensor::cat(&[&prev, x], 2)?;
            // Copy, so the state does not keep the whole chunk alive.
            *state = Some(xx.narrow(2, len, self.context)?.contiguous()?);
            xx
        };
        let y = match &self.depthwise {
            Some(w) => {
                let mut acc = xx.narrow(2, 0, len)?.broadcast_mul(&w.get(0)?)?;
                for k in 1..self.kernel {
                    let tap = xx.narrow(2, k * self.dilation, len)?;
                    acc = (acc + tap.broadcast_mul(&w.get(k)?)?)?;
                }
                acc
            }
            // The taps stacked on the channel axis and one matmul, whose output is
            // channels-first already, in place of candle's conv1d (an im2col, a
            // matmul, then a transposing copy back); `OMNISTREAM_DECODE_KERNELS=candle` keeps
            // conv1d, for side-by-side measurement.
            None => match self.taps.as_ref().filter(|_| kernels::enabled()) {
                Some(w) => {
                    let stacked = match self.kernel {
                        1 => xx,
                        k => {
                            let taps = (0..k)
                                .map(|j| xx.narrow(2, j * self.dilation, len))
                                .collect::<Result<Vec<_>>>()?;
                            // cat of strided views along dim 1 gives a transposed
                            // layout, which cuBLAS's batched GEMM cannot take.
                            Tensor::cat(&taps, 1)?.contiguous()?
                        }
                    };
                    // Broadcast with a zero batch stride: `broadcast_matmul` would copy
                    // the weight once per stream.
                    let (b, k, _) = stacked.dims3()?;
                    w.broadcast_as((b, w.dim(0)?, k))?.matmul(&stacked)?
                }
                None => xx.conv1d(&self.weight, 0, 1, self.dilation, 1)?,
            },
        };
        Ok(y)
    }
}

/// Whether a (non-depthwise) conv of `x` runs the engine's kernel: on a GPU, in
/// bf16, input channels a multiple of 32 (its K tiles), kernels on.
fn kernel_conv(x: &Tensor) -> bool {
    x.device().is_cuda()
        && x.dtype() == DType::BF16
        && x.dim(1).is_ok_and(|c| c.is_multiple_of(32))
        && kernels::enabled()
}

/// `Qwen3OmniMoeCausalTransConvNet`: ConvTranspose1d with kernel s (no overlap,
/// stateless) or 2s (each input touches two output blocks of s samples), trimmed
/// by kernel - s on both sides like the reference (see the module docs).
#[derive(Debug, Clone)]
struct CausalTransConvNet {
    /// (cin, cout * kernel): the transposed conv as one matmul per input sample.
    weight: Tensor,
    bias: Tensor,
    cout: usize,
    stride: usize,
    overlap: bool,
    /// Qwen3-Omni's reference drops block 0 (the left trim); Qwen3-TTS's keeps it.
    trim_left: bool,
}

impl CausalTransConvNet {
    fn new(
        cin: usize,
        cout: usize,
        kernel: usize,
        stride: usize,
        trim_left: bool,
        vb: VarBuilder,
    ) -> Result<Self> {
        let overlap = if kernel == stride {
            false
        } else if kernel == 2 * stride {
            true
        } else {
            candle_core::bail!("code2wav: transposed conv kernel {kernel} with stride {stride}")
        };
        let vb = vb.pp("conv");
        let weight = vb
            .get((cin, cout, kernel), "weight")?
            .reshape((cin, cout * kernel))?;
        let bias = vb.get(cout, "bias")?.reshape((1, cout, 1))?;
        Ok(Self {
            weight,
            bias,
            cout,
            stride,
            overlap,
            trim_left,
        })
    }

    /// x: (batch, cin, len) -> (batch, cout, len*s), except on a stream's first
    /// step with overlap and `trim_left`, which gives (len-1)*s like the
    /// reference's left trim.
    /// `tail` is the second half-kernel contribution of the previous input sample.
    fn step(&self, x: &Tensor, tail: &mut Pending) -> Result<Tensor> {
        let (b, cin, len) = x.dims3()?;
        let s = self.stride;
        // One GEMM over every stream's samples: `broadcast_matmul` of the transposed
        // input copied the weight once per stream (37.7 MB each in block 1);
        // `OMNISTREAM_DECODE_KERNELS=candle` keeps it, for side-by-side measurement.
        let z = if kernels::enabled() {
            x.transpose(1, 2)?
                .contiguous()?
                .reshape((b * len, cin))?
                .matmul(&self.weight)?
                .reshape((b, len, ()))?
        } else {
            x.transpose(1, 2)?.broadcast_matmul(&self.weight)?
        };
        let blocks = if !self.overlap {
            z.reshape((b, len, self.cout, s))?
        } else {
            // Block j = x[j] W[..s] + x[j-1] W[s..].
            let z = z.reshape((b, len, self.cout, 2, s))?;
            let head = z.narrow(3, 0, 1)?.squeeze(3)?;
            let next = z.narrow(3, 1, 1)?.squeeze(3)?;
            let blocks = match tail.take() {
                // Qwen3-Omni: block 0 (from the zero before the input) is trimmed.
                None if self.trim_left => {
                    (head.narrow(1, 1, len - 1)? + next.narrow(1, 0, len - 1)?)?
                }
                // Qwen3-TTS: block 0 is x[0] W[..s] alone.
                None => {
                    let zero = next.narrow(1, 0, 1)?.zeros_like()?;
                    let shifted = Tensor::cat(&[&zero, &next.narrow(1, 0, len - 1)?], 1)?;
                    (head + shifted)?
                }
                Some(prev) => {
                    let shifted = Tensor::cat(&[&prev, &next.narrow(1, 0, len - 1)?], 1)?;
                    (head + shifted)?
                }
            };
            *tail = Some(next.narrow(1, len - 1, 1)?.contiguous()?);
            blocks
        };
        let n = blocks.dim(1)?;
        blocks
            .permute((0, 2, 1, 3))?
            .reshape((b, self.cout, n * s))?
            .broadcast_add(&self.bias)
    }
}

/// `Qwen3OmniMoeSnakeBeta`: x + 1/(exp(beta) + 1e-9) * sin(x * exp(alpha))^2.
#[derive(Debug, Clone)]
struct SnakeBeta {
    alpha: Tensor,
    inv_beta: Tensor,
}

impl SnakeBeta {
    fn new(channels: usize, vb: VarBuilder) -> Result<Self> {
        let alpha = vb
            .get(channels, "alpha")?
            .exp()?
            .reshape((1, channels, 1))?;
        let inv_beta = (vb.get(channels, "beta")?.exp()? + 1e-9)?
            .recip()?
            .reshape((1, channels, 1))?;
        Ok(Self { alpha, inv_beta })
    }
}

impl Module for SnakeBeta {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        // One pass on the GPU (kernels::snake_beta) where the shapes allow.
        if x.device().is_cuda()
            && x.dtype() == DType::BF16
            && x.dim(2)?.is_multiple_of(8)
            && kernels::enabled()
        {
            return kernels::snake_beta(x, &self.alpha, &self.inv_beta);
        }
        let sin = x.broadcast_mul(&self.alpha)?.sin()?.sqr()?;
        x + sin.broadcast_mul(&self.inv_beta)?
    }
}

/// `Qwen3OmniMoeConvNeXtBlock` with its causal depthwise conv.
#[derive(Debug, Clone)]
struct ConvNeXtBlock {
    dwconv: CausalConvNet,
    norm: LayerNorm,
    pwconv1: Linear,
    pwconv2: Linear,
    gamma: Tensor,
}

impl ConvNeXtBlock {
    fn new(dim: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            dwconv: CausalConvNet::new(dim, dim, 7, 1, true, vb.pp("dwconv"))?,
            norm: candle_nn::layer_norm(dim, 1e-6, vb.pp("norm"))?,
            pwconv1: candle_nn::linear(dim, 4 * dim, vb.pp("pwconv1"))?,
            pwconv2: candle_nn::linear(4 * dim, dim, vb.pp("pwconv2"))?,
            gamma: vb.get(dim, "gamma")?,
        })
    }

    fn step(&self, x: &Tensor, state: &mut Pending) -> Result<Tensor> {
        let h = self.dwconv.step(x, state)?.transpose(1, 2)?;
        let h = self.norm.forward(&h)?;
        let h = self.pwconv1.forward(&h)?.gelu_erf()?;
        let h = self.pwconv2.forward(&h)?.broadcast_mul(&self.gamma)?;
        x + h.transpose(1, 2)?
    }
}

/// `Qwen3OmniMoeCode2WavRMSNorm` / `Qwen3OmniMoeRMSNorm`: normalises in float32
/// (f64 stays f64, for the exactness tests), casts back, then scales, like the reference.
#[derive(Debug, Clone)]
struct RmsNorm {
    weight: Tensor,
    eps: f64,
}

/// The reference upcasts norms and rotary angles to float32; f64 stays f64.
fn compute_dtype(dtype: DType) -> DType {
    if dtype == DType::F64 {
        DType::F64
    } else {
        DType::F32
    }
}

impl RmsNorm {
    fn new(size: usize, eps: f64, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            weight: vb.get(size, "weight")?,
            eps,
        })
    }
}

impl Module for RmsNorm {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x32 = x.to_dtype(compute_dtype(x.dtype()))?;
        let rms = (x32.sqr()?.mean_keepdim(D::Minus1)? + self.eps)?.sqrt()?;
        x32.broadcast_div(&rms)?
            .to_dtype(x.dtype())?
            .broadcast_mul(&self.weight)
    }
}

/// `Qwen3OmniMoeCode2WavAttention`: causal sliding-window attention with RoPE.
#[derive(Debug, Clone)]
struct Attention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    o_proj: Linear,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    window: usize,
}

/// One layer's cached keys (rotated) and values: (batch, kv_heads, <= window-1, head_dim).
type KvCache = Option<(Tensor, Tensor)>;

impl Attention {
    fn new(cfg: &Code2WavConfig, vb: VarBuilder) -> Result<Self> {
        let (h, hd) = (cfg.hidden_size, cfg.head_dim());
        let (nh, nkv) = (cfg.num_attention_heads, cfg.num_key_value_heads);
        let bias = cfg.attention_bias;
        Ok(Self {
            q_proj: candle_nn::linear_b(h, nh * hd, bias, vb.pp("q_proj"))?,
            k_proj: candle_nn::linear_b(h, nkv * hd, bias, vb.pp("k_proj"))?,
            v_proj: candle_nn::linear_b(h, nkv * hd, bias, vb.pp("v_proj"))?,
            o_proj: candle_nn::linear_b(nh * hd, h, bias, vb.pp("o_proj"))?,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: hd,
            window: cfg.sliding_window,
        })
    }

    /// x: (batch, n, hidden); cos/sin: (n, head_dim/2) or (batch, n, head_dim/2);
    /// `mask` additive, (n, total) or (batch, 1, n, total) for `total` = the cached
    /// keys and these n (see [`TransformerModel::step`]).
    fn step(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let heads = |t: Tensor, nh: usize| {
            t.reshape((b, n, nh, self.head_dim))?
                .transpose(1, 2)?
                .contiguous()
        };
        let q = heads(self.q_proj.forward(x)?, self.num_heads)?;
        let k = heads(self.k_proj.forward(x)?, self.num_kv_heads)?;
        let v = heads(self.v_proj.forward(x)?, self.num_kv_heads)?;
        let q = candle_nn::rotary_emb::rope(&q, cos, sin)?;
        let k = candle_nn::rotary_emb::rope(&k, cos, sin)?;
        let (k, v) = match cache.take() {
            Some((pk, pv)) => (Tensor::cat(&[&pk, &k], 2)?, Tensor::cat(&[&pv, &v], 2)?),
            None => (k, v),
        };
        let total = k.dim(2)?;
        let keep = total.min(self.window.saturating_sub(1));
        *cache = Some((
            k.narrow(2, total - keep, keep)?.contiguous()?,
            v.narrow(2, total - keep, keep)?.contiguous()?,
        ));

        let rep = self.num_heads / self.num_kv_heads;
        let (k, v) = (repeat_kv(k, rep)?, repeat_kv(v, rep)?);
        let scale = 1.0 / (self.head_dim as f64).sqrt();
        let scores = (q.matmul(&k.t()?)? * scale)?.broadcast_add(mask)?;
        let probs = candle_nn::ops::softmax_last_dim(&scores)?;
        let out =
            probs
                .matmul(&v)?
                .transpose(1, 2)?
                .reshape((b, n, self.num_heads * self.head_dim))?;
        self.o_proj.forward(&out)
    }
}

fn repeat_kv(x: Tensor, rep: usize) -> Result<Tensor> {
    if rep == 1 {
        return Ok(x);
    }
    let (b, h, t, d) = x.dims4()?;
    Tensor::cat(&vec![&x; rep], 2)?.reshape((b, h * rep, t, d))
}

/// `Qwen3OmniMoeCode2WavTransformerLayer` (pre-norm, LayerScale on both residuals).
#[derive(Debug, Clone)]
struct TransformerLayer {
    self_attn: Attention,
    mlp: Mlp,
    input_layernorm: RmsNorm,
    post_attention_layernorm: RmsNorm,
    self_attn_layer_scale: Tensor,
    mlp_layer_scale: Tensor,
}

impl TransformerLayer {
    fn new(cfg: &Code2WavConfig, vb: VarBuilder) -> Result<Self> {
        let h = cfg.hidden_size;
        Ok(Self {
            self_attn: Attention::new(cfg, vb.pp("self_attn"))?,
            mlp: Mlp::new(
                cfg.hidden_size,
                cfg.intermediate_size,
                cfg.hidden_act,
                vb.pp("mlp"),
            )?
            .fuse_gate_up()?,
            input_layernorm: RmsNorm::new(h, cfg.rms_norm_eps, vb.pp("input_layernorm"))?,
            post_attention_layernorm: RmsNorm::new(
                h,
                cfg.rms_norm_eps,
                vb.pp("post_attention_layernorm"),
            )?,
            self_attn_layer_scale: vb.pp("self_attn_layer_scale").get(h, "scale")?,
            mlp_layer_scale: vb.pp("mlp_layer_scale").get(h, "scale")?,
        })
    }

    fn step(
        &self,
        x: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        mask: &Tensor,
        cache: &mut KvCache,
    ) -> Result<Tensor> {
        let h = self.input_layernorm.forward(x)?;
        let h = self.self_attn.step(&h, cos, sin, mask, cache)?;
        let x = (x + h.broadcast_mul(&self.self_attn_layer_scale)?)?;
        let h = self
            .mlp
            .forward(&self.post_attention_layernorm.forward(&x)?)?;
        x + h.broadcast_mul(&self.mlp_layer_scale)?
    }
}

/// `Qwen3OmniMoeCode2WavTransformerModel` (weights under `pre_transformer`).
#[derive(Debug, Clone)]
struct TransformerModel {
    layers: Vec<TransformerLayer>,
    norm: RmsNorm,
    inv_freq: Tensor,
    window: usize,
    /// Qwen3-TTS: latent -> hidden before the layers and back after the norm.
    input_proj: Option<Linear>,
    output_proj: Option<Linear>,
}

impl TransformerModel {
    fn new(cfg: &Code2WavConfig, vb: VarBuilder) -> Result<Self> {
        if let Some(p) = &cfg.rope_parameters {
            if p.rope_type != "default" {
                candle_core::bail!("code2wav: unsupported rope_type {}", p.rope_type)
            }
        }
        let layers = (0..cfg.num_hidden_layers)
            .map(|i| TransformerLayer::new(cfg, vb.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        let hd = cfg.head_dim();
        let theta = cfg.rope_theta();
        let inv_freq: Vec<f64> = (0..hd / 2)
            .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd as f64))
            .collect();
        let (input_proj, output_proj) = match cfg.variant {
            Code2WavVariant::Omni => (None, None),
            Code2WavVariant::Tts12Hz => {
                let (l, h) = (cfg.latent_dim(), cfg.hidden_size);
                (
                    Some(candle_nn::linear(l, h, vb.pp("input_proj"))?),
                    Some(candle_nn::linear(h, l, vb.pp("output_proj"))?),
                )
            }
        };
        Ok(Self {
            layers,
            norm: RmsNorm::new(cfg.hidden_size, cfg.rms_norm_eps, vb.pp("norm"))?,
            inv_freq: Tensor::from_vec(inv_freq, (1, hd / 2), vb.device())?,
            window: cfg.sliding_window,
            input_proj,
            output_proj,
        })
    }

    /// x: (batch, n, hidden); row r's frames are pos[r]..pos[r]+n, all rows with
    /// caches of one length. A row's cache may be longer than its history: the keys
    /// before its position 0 are zero padding (a slot's, see [`Code2WavSlots`]) and
    /// masked out.
    fn step(&self, x: &Tensor, pos: Pos, caches: &mut [KvCache]) -> Result<Tensor> {
        let (b, n, _) = x.dims3()?;
        let cached = match caches.first() {
            Some(Some((k, _))) => k.dim(2)?,
            _ => 0,
        };
        let total = cached + n;
        // Like the reference: float32 position times float32 frequency, then
        // cos/sin (absolute positions, as a full decode of the whole stream has).
        let dtype = compute_dtype(x.dtype());
        let inv_freq = self.inv_freq.to_device(x.device())?.to_dtype(dtype)?;
        let (positions, mask) = match pos {
            Pos::Host(pos) => {
                let rows = if pos.len() == b { b } else { 1 };
                let pos = &pos[..rows];
                let positions: Vec<f64> = pos
                    .iter()
                    .flat_map(|&p| (p..p + n).map(|q| q as f64))
                    .collect();
                let positions = Tensor::from_vec(positions, (rows, n, 1), x.device())?;
                (
                    positions.to_dtype(dtype)?,
                    host_mask(pos, n, total, self.window, x.device())?,
                )
            }
            Pos::Device(first) => {
                let offsets = Tensor::arange(0f32, n as f32, x.device())?.reshape((1, n, 1))?;
                let first = first.to_dtype(DType::F32)?.reshape((b, 1, 1))?;
                let positions = first.broadcast_add(&offsets)?.to_dtype(dtype)?;
                (positions, device_mask(&first, n, total, self.window)?)
            }
        };
        let freqs = positions.broadcast_mul(&inv_freq)?;
        let cos = freqs.cos()?.to_dtype(x.dtype())?;
        let sin = freqs.sin()?.to_dtype(x.dtype())?;
        let (cos, sin) = if cos.dim(0)? == 1 {
            (cos.squeeze(0)?, sin.squeeze(0)?)
        } else {
            (cos, sin)
        };
        let mask = mask.to_dtype(x.dtype())?;
        let mut h = match &self.input_proj {
            Some(p) => p.forward(x)?,
            None => x.clone(),
        };
        for (layer, cache) in self.layers.iter().zip(caches.iter_mut()) {
            h = layer.step(&h, &cos, &sin, &mask, cache)?;
        }
        let h = self.norm.forward(&h)?;
        match &self.output_proj {
            Some(p) => p.forward(&h),
            None => Ok(h),
        }
    }
}

/// A part of a step, for [`Code2Wav::step_slots_marked`]: a decoder block's
/// (counted from 1) or the whole model's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Part {
    pub block: Option<usize>,
    pub name: &'static str,
}

impl Part {
    fn whole(name: &'static str) -> Self {
        Self { block: None, name }
    }
}

impl std::fmt::Display for Part {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.block {
            Some(b) => write!(f, "block {b}: {}", self.name),
            None => f.write_str(self.name),
        }
    }
}

/// Where a step's rows are in their streams.
#[derive(Clone, Copy)]
enum Pos<'a> {
    /// Each row's first frame (one entry serves every row).
    Host(&'a [usize]),
    /// The same, (batch,) on the device: a graphed step reads it there.
    Device(&'a Tensor),
}

/// Whether query i (at absolute p = first + i) sees key j of `total` (the last
/// `n` are this step's), its absolute position `first + n - total + j`: inside
/// (p - window, p] (transformers' sliding_window_overlay on top of the causal mask)
/// and not before 0.
fn visible(first: i64, i: i64, j: i64, n: i64, total: i64, window: i64) -> bool {
    let (p, kp) = (first + i, first + n - total + j);
    kp >= 0 && kp <= p && kp + window > p
}

/// The additive mask of rows at host positions `pos`: (n, total) for one entry,
/// else (rows, 1, n, total).
fn host_mask(
    pos: &[usize],
    n: usize,
    total: usize,
    window: usize,
    dev: &candle_core::Device,
) -> Result<Tensor> {
    let mask: Vec<f32> = pos
        .iter()
        .flat_map(|&first| {
            (0..n as i64).flat_map(move |i| {
                (0..total as i64).map(move |j| {
                    if visible(first as i64, i, j, n as i64, total as i64, window as i64) {
                        0.0
                    } else {
                        f32::NEG_INFINITY
                    }
                })
            })
        })
        .collect();
    if pos.len() == 1 {
        Tensor::from_vec(mask, (n, total), dev)
    } else {
        Tensor::from_vec(mask, (pos.len(), 1, n, total), dev)
    }
}

/// [`host_mask`] from positions on the device, `first` (rows, 1, 1) f32, with
/// tensor ops only (a graph replays it, and a capture cannot upload more than
/// candle's 4 KiB parameter cache holds, so no table of `n x total` comes from
/// the host): a key's window and causality do not depend on the row (fixed
/// `total` and `n`), only "not before 0" does, `first + n - total + j >= 0`.
fn device_mask(first: &Tensor, n: usize, total: usize, window: usize) -> Result<Tensor> {
    let dev = first.device();
    let rows = first.dim(0)?;
    let shape = (rows, 1, n, total);
    let i = Tensor::arange(0f32, n as f32, dev)?.reshape((1, 1, n, 1))?;
    let j = Tensor::arange(0f32, total as f32, dev)?.reshape((1, 1, 1, total))?;
    // Query i sits at key index total - n + i: it sees keys j with
    // 0 <= (total - n + i) - j < window, i.e. total - n - window < j - i <= total - n.
    let d = j.broadcast_sub(&i)?;
    let back = (total - n) as f64;
    let in_window = (d.le(back)? * d.gt(back - window as f64)?)?.broadcast_as(shape)?;
    let started = first
        .reshape((rows, 1, 1, 1))?
        .broadcast_add(&j)?
        .ge(back)?
        .broadcast_as(shape)?;
    let visible = (in_window * started)?;
    let open = Tensor::zeros(shape, DType::F32, dev)?;
    let hidden = Tensor::full(f32::NEG_INFINITY, shape, dev)?;
    visible.where_cond(&open, &hidden)
}

/// `Qwen3OmniMoeCode2WavDecoderResidualUnit`: x + conv2(act2(conv1(act1(x)))).
#[derive(Debug, Clone)]
struct DecoderResidualUnit {
    act1: SnakeBeta,
    conv1: CausalConvNet,
    act2: SnakeBeta,
    conv2: CausalConvNet,
}

impl DecoderResidualUnit {
    fn new(dim: usize, dilation: usize, vb: VarBuilder) -> Result<Self> {
        Ok(Self {
            act1: SnakeBeta::new(dim, vb.pp("act1"))?,
            conv1: CausalConvNet::new(dim, dim, 7, dilation, false, vb.pp("conv1"))?,
            act2: SnakeBeta::new(dim, vb.pp("act2"))?,
            conv2: CausalConvNet::new(dim, dim, 1, 1, false, vb.pp("conv2"))?,
        })
    }

    fn step(
        &self,
        x: &Tensor,
        state: &mut Pending,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<Tensor> {
        let a = self.act1.forward(x)?;
        mark("snake")?;
        let h = self.conv1.step(&a, state)?;
        mark("conv k7")?;
        let a = self.act2.forward(&h)?;
        mark("snake")?;
        // Kernel 1: no left context.
        let h = self.conv2.step_plus(&a, &mut None, Some(x))?;
        mark("conv k1 + residual")?;
        Ok(h)
    }
}

/// `Qwen3OmniMoeCode2WavDecoderBlock`: `block.0` SnakeBeta, `block.1` transposed
/// conv (k=2s), `block.2..4` residual units with dilations 1, 3, 9.
#[derive(Debug, Clone)]
struct DecoderBlock {
    act: SnakeBeta,
    upsample: CausalTransConvNet,
    units: Vec<DecoderResidualUnit>,
}

/// A decoder block's streaming state.
#[derive(Debug, Clone, Default)]
struct DecoderBlockState {
    upsample: Pending,
    units: [Pending; 3],
}

impl DecoderBlock {
    fn new(cfg: &Code2WavConfig, idx: usize, vb: VarBuilder) -> Result<Self> {
        let in_dim = cfg.decoder_dim >> idx;
        let out_dim = cfg.decoder_dim >> (idx + 1);
        let rate = cfg.upsample_rates[idx];
        let vb = vb.pp("block");
        let units = [1, 3, 9]
            .iter()
            .enumerate()
            .map(|(i, &d)| DecoderResidualUnit::new(out_dim, d, vb.pp(i + 2)))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            act: SnakeBeta::new(in_dim, vb.pp(0))?,
            upsample: CausalTransConvNet::new(
                in_dim,
                out_dim,
                2 * rate,
                rate,
                cfg.variant == Code2WavVariant::Omni,
                vb.pp(1),
            )?,
            units,
        })
    }

    fn step(
        &self,
        x: &Tensor,
        state: &mut DecoderBlockState,
        mark: &mut dyn FnMut(&'static str) -> Result<()>,
    ) -> Result<Tensor> {
        let a = self.act.forward(x)?;
        mark("snake")?;
        let mut h = self.upsample.step(&a, &mut state.upsample)?;
        mark("transposed conv")?;
        for (unit, s) in self.units.iter().zip(state.units.iter_mut()) {
            h = unit.step(&h, s, mark)?;
        }
        Ok(h)
    }
}

/// Streaming state of one batch of requests (create with [`Code2Wav::new_state`]).
/// Requests that advance independently need their own states; one state can hold
/// a batch whose requests always receive the same number of frames.
#[derive(Debug, Clone)]
pub struct Code2WavState {
    frames: usize,
    /// Qwen3-TTS's `pre_conv` context (`None` for Qwen3-Omni, which has no such conv).
    pre_conv: Option<Pending>,
    kv: Vec<KvCache>,
    /// ConvNeXt depthwise conv per upsampling stage.
    upsample: Vec<Pending>,
    decoder_in: Pending,
    blocks: Vec<DecoderBlockState>,
    decoder_out: Pending,
}

impl Code2WavState {
    /// Frames decoded so far.
    pub fn frames(&self) -> usize {
        self.frames
    }

    /// Every convolution state (the K/V aside), in a fixed order.
    fn tensors_mut(&mut self) -> Vec<&mut Pending> {
        let mut all: Vec<&mut Pending> = self.pre_conv.iter_mut().collect();
        all.extend(self.upsample.iter_mut());
        all.push(&mut self.decoder_in);
        for b in self.blocks.iter_mut() {
            all.push(&mut b.upsample);
            all.extend(b.units.iter_mut());
        }
        all.push(&mut self.decoder_out);
        all
    }
}

/// The streaming states of many streams, one slot each, kept on the device as
/// batched tensors: a step of any set of slots gathers their rows with one
/// `index_select` per state tensor and writes them back with one scatter, where
/// concatenating and splitting per-stream states took a copy per stream and
/// tensor (thousands of launches a step at 32 streams). A slot's K/V is always
/// `sliding_window - 1` frames long, zero-padded on the left (and masked) until
/// the stream has that many, so streams at any frame count share a forward. The
/// tensors have one row more than the slots: a scratch row, where a graphed step's
/// padding rows read and write.
/// Create with [`Code2Wav::new_slots`]; step with [`Code2Wav::step_slots`] or
/// [`Code2Wav::step_slots_graphed`].
#[derive(Debug, Clone)]
pub struct Code2WavSlots {
    /// Frames decoded per slot; 0 is a fresh stream.
    frames: Vec<usize>,
    /// A fresh state: the layout the gathered rows fill.
    fresh: Code2WavState,
    /// K/V frames a slot keeps (`sliding_window - 1`).
    kv_len: usize,
    /// Per layer K and V, (slots, kv_heads, window - 1, head_dim); empty until
    /// the first chunk gives the shapes.
    kv: Vec<(Tensor, Tensor)>,
    /// Every convolution state in [`Code2WavState::tensors_mut`]'s order, (slots, ...).
    conv: Vec<Tensor>,
    /// Bumped whenever the tensors above are (re)allocated: graphs captured on the
    /// old ones are stale.
    generation: u64,
}

impl Code2WavSlots {
    pub fn capacity(&self) -> usize {
        self.frames.len()
    }

    /// Frames slot `slot` has decoded.
    pub fn frames(&self, slot: usize) -> usize {
        self.frames.get(slot).copied().unwrap_or(0)
    }

    /// The batch size of a step of `slots` on `codes`, after checking that the
    /// slots are distinct and exist.
    fn check(&self, slots: &[usize], codes: &Tensor) -> Result<usize> {
        let b = codes.dim(0)?;
        if b != slots.len() {
            candle_core::bail!("code2wav: {} slots for {b} streams", slots.len())
        }
        let mut seen = vec![false; self.capacity()];
        for &s in slots {
            match seen.get_mut(s) {
                Some(seen) if !*seen => *seen = true,
                Some(_) => candle_core::bail!("code2wav: slot {s} twice in one step"),
                None => candle_core::bail!("code2wav: slot {s} of {}", self.capacity()),
            }
        }
        Ok(b)
    }

    /// Starts a new stream in `slot` (its old rows are overwritten by its first chunk).
    pub fn reset(&mut self, slot: usize) {
        if let Some(f) = self.frames.get_mut(slot) {
            *f = 0;
        }
    }

    /// Grows to at least `capacity` slots (doubling), the new ones fresh.
    pub fn reserve(&mut self, capacity: usize) -> Result<()> {
        let old = self.capacity();
        if capacity <= old {
            return Ok(());
        }
        let new = capacity.max(2 * old);
        let grow = |t: &Tensor| -> Result<Tensor> {
            let mut dims = t.dims().to_vec();
            dims[0] = new - old;
            Tensor::cat(&[t, &Tensor::zeros(dims, t.dtype(), t.device())?], 0)
        };
        for (k, v) in self.kv.iter_mut() {
            *k = grow(k)?;
            *v = grow(v)?;
        }
        for t in self.conv.iter_mut() {
            *t = grow(t)?;
        }
        self.frames.resize(new, 0);
        self.generation += 1;
        Ok(())
    }

    /// The rows of `ids` (u32 slot numbers) as one batched state.
    fn gather(&self, ids: &Tensor, frames: usize) -> Result<Code2WavState> {
        let take = |t: &Tensor| t.index_select(ids, 0);
        let mut state = self.fresh.clone();
        state.frames = frames;
        for (dst, (k, v)) in state.kv.iter_mut().zip(&self.kv) {
            *dst = Some((take(k)?, take(v)?));
        }
        for (dst, src) in state.tensors_mut().into_iter().zip(&self.conv) {
            *dst = Some(take(src)?);
        }
        Ok(state)
    }

    /// Writes batched `state`'s rows into the slots `ids` (u32 slot numbers),
    /// left-padding K/V shorter than a slot's with zeros; on the first write the
    /// slots take their shapes from `state`.
    fn scatter(&mut self, ids: &Tensor, state: &mut Code2WavState) -> Result<()> {
        // The slots and the scratch row.
        let cap = self.capacity() + 1;
        let kv: Vec<(Tensor, Tensor)> = state
            .kv
            .iter()
            .map(|kv| {
                let (k, v) = kv
                    .as_ref()
                    .ok_or_else(|| candle_core::Error::Msg("code2wav: no K/V to keep".into()))?;
                Ok((pad_left(k, self.kv_len)?, pad_left(v, self.kv_len)?))
            })
            .collect::<Result<_>>()?;
        let conv: Vec<Tensor> = state
            .tensors_mut()
            .into_iter()
            .map(|t| {
                t.clone()
                    .ok_or_else(|| candle_core::Error::Msg("code2wav: no state to keep".into()))
            })
            .collect::<Result<_>>()?;
        let empty = |t: &Tensor| {
            let mut dims = t.dims().to_vec();
            dims[0] = cap;
            Tensor::zeros(dims, t.dtype(), t.device())
        };
        if self.kv.is_empty() {
            self.kv = kv
                .iter()
                .map(|(k, v)| Ok((empty(k)?, empty(v)?)))
                .collect::<Result<_>>()?;
            self.conv = conv.iter().map(empty).collect::<Result<_>>()?;
            self.generation += 1;
        }
        // scatter_set wants an index per element: one per distinct shape.
        let mut index: Vec<(Vec<usize>, Tensor)> = Vec::new();
        let mut set = |dst: &Tensor, src: &Tensor| -> Result<()> {
            let src = src.contiguous()?;
            let dims = src.dims().to_vec();
            let at = match index.iter().position(|(d, _)| *d == dims) {
                Some(at) => at,
                None => {
                    let mut one = vec![1; dims.len()];
                    one[0] = dims[0];
                    let full = ids
                        .reshape(one)?
                        .broadcast_as(dims.as_slice())?
                        .contiguous()?;
                    index.push((dims, full));
                    index.len() - 1
                }
            };
            dst.scatter_set(&index[at].1, &src, 0)
        };
        for ((dk, dv), (k, v)) in self.kv.iter().zip(&kv) {
            set(dk, k)?;
            set(dv, v)?;
        }
        for (dst, src) in self.conv.iter().zip(&conv) {
            set(dst, src)?;
        }
        Ok(())
    }
}

/// Code2Wav's captured steps (see [`Code2Wav::step_slots_graphed`]), for one
/// [`Code2WavSlots`], used on the thread that made them.
#[derive(Debug, Default)]
pub struct Code2WavGraphs {
    /// By (bucket, frames, first chunks).
    chunks: std::collections::HashMap<(usize, usize, bool), ChunkGraph>,
    /// Keys whose capture failed: eager from then on.
    failed: std::collections::HashSet<(usize, usize, bool)>,
    /// The slots' generation the graphs read and write.
    generation: u64,
}

/// One captured step and the tensors it reads (slot ids, codes, each row's first
/// frame) and writes (the audio); the slots' tensors it reads and writes in place.
#[derive(Debug)]
struct ChunkGraph {
    graph: graphs::StepGraph,
    ids: Tensor,
    codes: Tensor,
    first: Tensor,
    wav: Tensor,
}

/// `t` (batch, heads, len, dim) left-padded with zeros to `len` positions.
fn pad_left(t: &Tensor, len: usize) -> Result<Tensor> {
    let (b, h, l, d) = t.dims4()?;
    if l >= len {
        return t.narrow(2, l - len, len);
    }
    let zeros = Tensor::zeros((b, h, len - l, d), t.dtype(), t.device())?;
    Tensor::cat(&[&zeros, t], 2)
}

/// `ResidualVectorQuantizer.decode` of qwen-tts: the sum of each quantizer's
/// codebook row (`embedding_sum / cluster_usage`, computed once at load),
/// projected by `output_proj` (a k=1 conv without bias).
#[derive(Debug, Clone)]
struct Rvq {
    codebooks: Vec<Tensor>,
    /// (dim, out): the conv's weight transposed for a matmul.
    output_proj: Tensor,
}

impl Rvq {
    fn new(n_q: usize, cfg: &Code2WavConfig, vb: VarBuilder) -> Result<Self> {
        let out = cfg.codebook_dim.unwrap_or(cfg.hidden_size);
        let dim = out / 2;
        let codebooks = (0..n_q)
            .map(|i| {
                let vb = vb.pp("vq").pp("layers").pp(i).pp("_codebook");
                let sum = vb
                    .get((cfg.codebook_size, dim), "embedding_sum")?
                    .to_dtype(DType::F32)?;
                let usage = vb
                    .get(cfg.codebook_size, "cluster_usage")?
                    .to_dtype(DType::F32)?
                    .clamp(1e-5f32, f32::MAX)?
                    .unsqueeze(1)?;
                sum.broadcast_div(&usage)?.to_dtype(vb.dtype())
            })
            .collect::<Result<Vec<_>>>()?;
        let output_proj = vb
            .get((out, dim, 1), "output_proj.weight")?
            .squeeze(2)?
            .t()?
            .contiguous()?;
        Ok(Self {
            codebooks,
            output_proj,
        })
    }

    /// codes (batch, n_q, n) u32 -> (batch, n, out).
    fn decode(&self, codes: &Tensor) -> Result<Tensor> {
        let (b, _, n) = codes.dims3()?;
        let mut sum: Option<Tensor> = None;
        for (q, book) in self.codebooks.iter().enumerate() {
            let ids = codes.narrow(1, q, 1)?.flatten_all()?;
            let e = book.index_select(&ids, 0)?;
            sum = Some(match sum {
                Some(s) => (s + e)?,
                None => e,
            });
        }
        let Some(sum) = sum else {
            candle_core::bail!("code2wav: a quantizer group without quantizers")
        };
        sum.matmul(&self.output_proj)?.reshape((b, n, ()))
    }
}

/// What turns a frame's codes into the transformer's input.
#[derive(Debug, Clone)]
enum Front {
    /// Qwen3-Omni's `code_embedding`: one (num_quantizers * codebook, hidden)
    /// table with per-quantizer offsets, averaged over a frame's quantizers.
    Mean(Tensor),
    /// Qwen3-TTS's `quantizer` (quantizer 0, then the rest, summed) and
    /// `pre_conv` (causal, k=3).
    Rvq {
        first: Rvq,
        rest: Rvq,
        pre_conv: CausalConvNet,
    },
}

/// `Qwen3OmniMoeCode2Wav`, and `Qwen3TTSTokenizerV2Decoder` ([`Code2WavVariant`]).
#[derive(Debug, Clone)]
pub struct Code2Wav {
    front: Front,
    pre_transformer: TransformerModel,
    upsample: Vec<(CausalTransConvNet, ConvNeXtBlock)>,
    decoder_in: CausalConvNet,
    blocks: Vec<DecoderBlock>,
    decoder_act: SnakeBeta,
    decoder_out: CausalConvNet,
    num_quantizers: usize,
    codebook_size: usize,
    delay: usize,
    samples_per_frame: usize,
    /// The pre-transformer's sliding window.
    window: usize,
}

impl Code2Wav {
    /// `vb` is scoped to the checkpoint's `code2wav` prefix.
    pub fn new(cfg: &Code2WavConfig, vb: VarBuilder) -> Result<Self> {
        // With fewer than 2 samples per frame before the k=2s stages, a one-frame
        // first step would leave nothing after the reference's left trim.
        if cfg.variant == Code2WavVariant::Omni
            && cfg.upsampling_ratios.iter().product::<usize>() < 2
        {
            candle_core::bail!("code2wav: upsampling_ratios must upsample at least 2x")
        }
        if cfg.sliding_window < 2 {
            candle_core::bail!("code2wav: sliding_window must be at least 2")
        }
        if cfg.decoder_dim >> cfg.upsample_rates.len() == 0 {
            candle_core::bail!("code2wav: decoder_dim too small for the decoder blocks")
        }
        let h = cfg.latent_dim();
        let front = match cfg.variant {
            Code2WavVariant::Omni => Front::Mean(
                vb.pp("code_embedding")
                    .get((cfg.codebook_size * cfg.num_quantizers, h), "weight")?,
            ),
            Code2WavVariant::Tts12Hz => {
                if cfg.num_quantizers < 2 {
                    candle_core::bail!("code2wav: the split RVQ needs at least 2 quantizers")
                }
                let cd = cfg.codebook_dim.unwrap_or(cfg.hidden_size);
                let q = vb.pp("quantizer");
                Front::Rvq {
                    first: Rvq::new(1, cfg, q.pp("rvq_first"))?,
                    rest: Rvq::new(cfg.num_quantizers - 1, cfg, q.pp("rvq_rest"))?,
                    pre_conv: CausalConvNet::new(cd, h, 3, 1, false, vb.pp("pre_conv"))?,
                }
            }
        };
        let trim_left = cfg.variant == Code2WavVariant::Omni;
        let upsample = cfg
            .upsampling_ratios
            .iter()
            .enumerate()
            .map(|(i, &f)| {
                let vb = vb.pp("upsample").pp(i);
                Ok((
                    CausalTransConvNet::new(h, h, f, f, trim_left, vb.pp(0))?,
                    ConvNeXtBlock::new(h, vb.pp(1))?,
                ))
            })
            .collect::<Result<Vec<_>>>()?;
        let vbd = vb.pp("decoder");
        let decoder_in = CausalConvNet::new(h, cfg.decoder_dim, 7, 1, false, vbd.pp(0))?;
        let blocks = (0..cfg.upsample_rates.len())
            .map(|i| DecoderBlock::new(cfg, i, vbd.pp(i + 1)))
            .collect::<Result<Vec<_>>>()?;
        let out_dim = cfg.decoder_dim >> cfg.upsample_rates.len();
        let n = cfg.upsample_rates.len();
        Ok(Self {
            front,
            pre_transformer: TransformerModel::new(cfg, vb.pp("pre_transformer"))?,
            upsample,
            decoder_in,
            blocks,
            decoder_act: SnakeBeta::new(out_dim, vbd.pp(n + 1))?,
            decoder_out: CausalConvNet::new(out_dim, 1, 7, 1, false, vbd.pp(n + 2))?,
            num_quantizers: cfg.num_quantizers,
            codebook_size: cfg.codebook_size,
            delay: cfg.delay_samples(),
            samples_per_frame: cfg.samples_per_frame(),
            window: cfg.sliding_window,
        })
    }

    /// Output samples per frame (1920).
    pub fn samples_per_frame(&self) -> usize {
        self.samples_per_frame
    }

    /// Leading zero samples of every stream: our lag behind the reference (555).
    pub fn delay_samples(&self) -> usize {
        self.delay
    }

    pub fn new_state(&self) -> Code2WavState {
        Code2WavState {
            frames: 0,
            pre_conv: match self.front {
                Front::Mean(_) => None,
                Front::Rvq { .. } => Some(None),
            },
            kv: vec![None; self.pre_transformer.layers.len()],
            upsample: vec![None; self.upsample.len()],
            decoder_in: None,
            blocks: vec![DecoderBlockState::default(); self.blocks.len()],
            decoder_out: None,
        }
    }

    /// Whole-utterance decode: codes (batch, num_quantizers, frames), u32 or i64,
    /// to (batch, 1, frames * 1920) samples in [-1, 1]; sample `555 + r` is the
    /// reference's sample r, the first 555 are zero (see the module docs).
    pub fn decode(&self, codes: &Tensor) -> Result<Tensor> {
        self.step(&mut self.new_state(), codes)
    }

    /// Decodes the next chunk of a stream: codes (batch, num_quantizers, n) to
    /// (batch, 1, n * 1920). The concatenated chunks equal [`Self::decode`] of the
    /// concatenated codes.
    pub fn step(&self, state: &mut Code2WavState, codes: &Tensor) -> Result<Tensor> {
        self.step_unclamped(state, codes, None)?.clamp(-1f32, 1f32)
    }

    /// Slots for `capacity` streams (more with [`Code2WavSlots::reserve`]).
    pub fn new_slots(&self, capacity: usize) -> Code2WavSlots {
        Code2WavSlots {
            frames: vec![0; capacity],
            fresh: self.new_state(),
            kv_len: self.window - 1,
            kv: Vec::new(),
            conv: Vec::new(),
            generation: 0,
        }
    }

    /// Decodes the next chunk of the streams in `slots` (distinct) in one forward,
    /// each with its own exact state: codes (slots.len(), num_quantizers, n) to
    /// (slots.len(), 1, n * 1920). Streams at their first chunk and streams past it
    /// take one forward each (a first chunk is shorter before the left trim).
    pub fn step_slots(
        &self,
        state: &mut Code2WavSlots,
        slots: &[usize],
        codes: &Tensor,
    ) -> Result<Tensor> {
        self.step_slots_marked(state, slots, codes, &mut |_| Ok(()))
    }

    /// [`Self::step_slots`], calling `mark` after each part of the step (the GPU
    /// profile syncs and times there).
    pub(crate) fn step_slots_marked(
        &self,
        state: &mut Code2WavSlots,
        slots: &[usize],
        codes: &Tensor,
        mark: &mut dyn FnMut(Part) -> Result<()>,
    ) -> Result<Tensor> {
        let b = state.check(slots, codes)?;
        let n = codes.dim(2)?;
        if n == 0 || b == 0 {
            return Tensor::zeros((b, 1, 0), self.decoder_out.weight.dtype(), codes.device());
        }
        let fresh: Vec<usize> = (0..b).filter(|&i| state.frames[slots[i]] == 0).collect();
        if !fresh.is_empty() && fresh.len() < b {
            // Two forwards, then the rows back in the callers' order.
            let started: Vec<usize> = (0..b).filter(|&i| state.frames[slots[i]] > 0).collect();
            let mut out = Vec::new();
            for rows in [&fresh, &started] {
                let sub: Vec<usize> = rows.iter().map(|&i| slots[i]).collect();
                let ids = Tensor::from_vec(
                    rows.iter().map(|&i| i as u32).collect::<Vec<_>>(),
                    rows.len(),
                    codes.device(),
                )?;
                let codes = codes.index_select(&ids, 0)?;
                out.push(self.step_slots_marked(state, &sub, &codes, mark)?);
            }
            let order: Vec<u32> = fresh.iter().chain(&started).map(|&i| i as u32).collect();
            let mut back = vec![0u32; b];
            for (at, &i) in order.iter().enumerate() {
                back[i as usize] = at as u32;
            }
            let wav = Tensor::cat(&out, 0)?;
            let back = Tensor::from_vec(back, b, wav.device())?;
            return wav.index_select(&back, 0);
        }
        let device = self.decoder_out.weight.device();
        let ids = Tensor::from_vec(
            slots.iter().map(|&s| s as u32).collect::<Vec<_>>(),
            b,
            device,
        )?;
        let codes = self.device_codes(codes)?;
        let pos: Vec<usize> = slots.iter().map(|&s| state.frames[s]).collect();
        let mut batch = if fresh.is_empty() {
            let first = pos.iter().copied().max().unwrap_or(1);
            state.gather(&ids, first)?
        } else {
            // Fresh states are all alike: the batch starts from one.
            self.new_state()
        };
        mark(Part::whole("gather"))?;
        let wav = self.step_parts(&mut batch, &codes, Pos::Host(&pos), mark)?;
        state.scatter(&ids, &mut batch)?;
        for (&s, p) in slots.iter().zip(&pos) {
            state.frames[s] = p + n;
        }
        mark(Part::whole("scatter"))?;
        wav.clamp(-1f32, 1f32)
    }

    /// [`Self::step_slots`] as a CUDA graph where it can: every stream at its
    /// first chunk, or every stream past it; `b` rows padded up to a batch bucket
    /// with the scratch row; one graph per (bucket, chunk frames, first chunks),
    /// captured at first use (on the scratch row only, so no stream's state moves
    /// twice). A step launches hundreds of small kernels, and eagerly its launches
    /// take longer than its GPU work at any batch (docs/bench/gpu.md, run 15).
    /// Elsewhere (a mixed batch, the very first chunk, which gives the slots their
    /// shapes, a failed capture, the CPU) it runs eagerly.
    pub fn step_slots_graphed(
        &self,
        state: &mut Code2WavSlots,
        graphs: &mut Code2WavGraphs,
        slots: &[usize],
        codes: &Tensor,
    ) -> Result<Tensor> {
        let b = state.check(slots, codes)?;
        let n = codes.dim(2)?;
        let dev = self.decoder_out.weight.device();
        let bucket = graphs::BATCH_BUCKETS.iter().copied().find(|&m| m >= b);
        let fresh = slots.iter().all(|&s| state.frames[s] == 0);
        let started = slots.iter().all(|&s| state.frames[s] > 0);
        let key = bucket.map(|bb| (bb, n, fresh));
        let Some(key @ (bb, ..)) = key.filter(|k| {
            graphs::available(dev)
                && n > 0
                && (fresh || started)
                && !state.kv.is_empty()
                && !graphs.failed.contains(k)
        }) else {
            let _urgent = graphs::UrgentSection::on(dev);
            return self.step_slots(state, slots, codes);
        };
        let checked = self.device_codes(codes)?;
        let scratch = state.capacity() as u32;
        let mut ids: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        ids.resize(bb, scratch);
        let mut first: Vec<f32> = slots.iter().map(|&s| state.frames[s] as f32).collect();
        first.resize(bb, state.kv_len as f32);
        let Some(g) = self.chunk_graph(state, graphs, key)? else {
            let _urgent = graphs::UrgentSection::on(dev);
            return self.step_slots(state, slots, codes);
        };
        g.ids.slice_set(&Tensor::from_vec(ids, bb, dev)?, 0, 0)?;
        g.first
            .slice_set(&Tensor::from_vec(first, bb, dev)?, 0, 0)?;
        // Rows b.. keep the last step's codes: any valid codes do for the scratch row.
        g.codes.slice_set(&checked, 0, 0)?;
        // Audio goes first on a GPU shared with the Thinker.
        g.graph.launch_urgent(dev)?;
        for &s in slots {
            state.frames[s] += n;
        }
        g.wav.narrow(0, 0, b)?.copy()
    }

    /// The graph of `key` (bucket, frames, first chunks), captured now if it is
    /// new (on the scratch row only, so no stream's state moves); `None` if its
    /// capture failed, now or before (logged once: that key runs eagerly).
    fn chunk_graph<'g>(
        &self,
        state: &mut Code2WavSlots,
        graphs: &'g mut Code2WavGraphs,
        key: (usize, usize, bool),
    ) -> Result<Option<&'g mut ChunkGraph>> {
        let (bb, n, fresh) = key;
        let dev = self.decoder_out.weight.device();
        if graphs.generation != state.generation {
            graphs.chunks.clear();
            graphs.generation = state.generation;
        }
        let Code2WavGraphs { chunks, failed, .. } = graphs;
        if failed.contains(&key) {
            return Ok(None);
        }
        let e = match chunks.entry(key) {
            Entry::Occupied(e) => return Ok(Some(e.into_mut())),
            Entry::Vacant(e) => e,
        };
        let ids = Tensor::full(state.capacity() as u32, bb, dev)?;
        let codes = Tensor::zeros((bb, self.num_quantizers, n), DType::U32, dev)?;
        let first = Tensor::full(state.kv_len as f32, bb, dev)?;
        let dtype = self.decoder_out.weight.dtype();
        let wav = Tensor::zeros((bb, 1, n * self.samples_per_frame), dtype, dev)?;
        let captured = graphs::StepGraph::capture(dev, || {
            // First chunks start from a fresh state, as step_slots's do.
            let (mut batch, pos) = if fresh {
                (self.new_state(), Pos::Host(&[0]))
            } else {
                (state.gather(&ids, 1)?, Pos::Device(&first))
            };
            let out = self.step_parts(&mut batch, &codes, pos, &mut |_| Ok(()))?;
            state.scatter(&ids, &mut batch)?;
            wav.slice_set(&out.clamp(-1f32, 1f32)?, 0, 0)
        });
        match captured {
            Ok(graph) => Ok(Some(e.insert(ChunkGraph {
                graph,
                ids,
                codes,
                first,
                wav,
            }))),
            Err(err) => {
                tracing::warn!(
                    "code2wav graph for {bb} rows of {n} frames: {err}; that bucket runs eagerly"
                );
                failed.insert(key);
                Ok(None)
            }
        }
    }

    /// Captures the steps of every batch bucket a batch of up to `max_batch` runs
    /// at, first chunks of `first` frames and later chunks of `chunk`, before any
    /// stream comes (a capture at first use would delay that step's audio by the
    /// capture). The slots take their shapes from a first chunk on the scratch row.
    /// Returns how many graphs there are.
    pub fn warm_up_graphs(
        &self,
        state: &mut Code2WavSlots,
        graphs: &mut Code2WavGraphs,
        max_batch: usize,
        sizes: &[(usize, bool)],
    ) -> Result<usize> {
        let first = sizes.iter().find(|s| s.1).map_or(1, |s| s.0);
        let dev = self.decoder_out.weight.device();
        if !graphs::available(dev) {
            return Ok(0);
        }
        if state.kv.is_empty() {
            let scratch = Tensor::new(&[state.capacity() as u32], dev)?;
            let codes = Tensor::zeros((1, self.num_quantizers, first.max(1)), DType::U32, dev)?;
            let mut batch = self.new_state();
            self.step_parts(&mut batch, &codes, Pos::Host(&[0]), &mut |_| Ok(()))?;
            state.scatter(&scratch, &mut batch)?;
        }
        let last = graphs::BATCH_BUCKETS
            .iter()
            .position(|&b| b >= max_batch)
            .unwrap_or(graphs::BATCH_BUCKETS.len() - 1);
        for &bb in &graphs::BATCH_BUCKETS[..=last] {
            for &(frames, is_first) in sizes {
                if frames > 0 {
                    self.chunk_graph(state, graphs, (bb, frames, is_first))?;
                }
            }
        }
        Ok(graphs.chunks.len())
    }

    /// Frames of the pre-transformer's output that decide the convolutional
    /// path's state at the end of a stream: the sum of every layer's left
    /// context, each in frames at its own rate (for the released decoder
    /// 3 + 1.5 for the ConvNeXt blocks, 1.5 for `decoder_in`, about 3.4 for the
    /// decoder blocks), rounded up. Every layer after the transformer is a
    /// causal conv, a transposed conv or pointwise (SnakeBeta, the LayerNorm over
    /// channels), so nothing older reaches that state.
    pub fn conv_context_frames(&self) -> usize {
        let spf = self.samples_per_frame;
        // In samples at the output rate: a layer at `rate` samples a frame with
        // `c` samples of context adds c * spf / rate.
        let mut rate = 1;
        let mut total = 0;
        for (up, convnext) in &self.upsample {
            rate *= up.stride;
            total += convnext.dwconv.context * spf / rate;
        }
        total += self.decoder_in.context * spf / rate;
        for block in &self.blocks {
            // A k = 2s transposed conv's block j reads input j - 1.
            total += spf / rate;
            rate *= block.upsample.stride;
            total += block.units.iter().map(|u| u.conv1.context).sum::<usize>() * spf / rate;
        }
        total += self.decoder_out.context * spf / rate.max(1);
        total.div_ceil(spf)
    }

    /// Decodes `codes` (slots.len(), num_quantizers, n) into fresh streams whose
    /// audio is not wanted, only their state (a cloned voice's reference clip,
    /// which the new speech continues). The state after n frames is that of
    /// the pre-transformer over all n (its K/V window and `pre_conv` context)
    /// and of the convolutional path over the last [`Self::conv_context_frames`]
    /// only, so for Qwen3-TTS the frames before those go through the front and
    /// the transformer alone, and the last ones through the whole decoder, from
    /// a zero state (the same as a fresh one: its zero padding), in the chunk
    /// lengths of `sizes` (later chunks' lengths, as [`Self::warm_up_graphs`]
    /// took them) so that on a GPU they replay captured steps. A 5 s clip's 63
    /// frames cost 10 frames of the convolutions (8 + 2 with the released
    /// profiles' chunks), not 63. Qwen3-Omni's decoder
    /// (whose first chunk is trimmed) and clips within the context go through
    /// the whole decoder in chunks.
    pub fn seed_slots(
        &self,
        state: &mut Code2WavSlots,
        mut graphs: Option<&mut Code2WavGraphs>,
        slots: &[usize],
        codes: &Tensor,
        sizes: &[(usize, bool)],
    ) -> Result<()> {
        let b = state.check(slots, codes)?;
        let n = codes.dim(2)?;
        if b == 0 || n == 0 {
            return Ok(());
        }
        if slots.iter().any(|&s| state.frames[s] > 0) {
            candle_core::bail!("code2wav: a seed goes into fresh streams only")
        }
        let later: Vec<usize> = sizes
            .iter()
            .filter(|(f, first)| !first && *f > 0)
            .map(|s| s.0)
            .collect();
        let step = later.iter().copied().min().unwrap_or(1);
        // The conv path's part, whole chunks of the shortest later length.
        let tail = self.conv_context_frames().max(1).next_multiple_of(step);
        let mut done = 0;
        if self.delay == 0 && n > tail && !state.kv.is_empty() {
            done = n - tail;
            self.transform_slots(state, slots, &codes.narrow(2, 0, done)?)?;
        }
        while done < n {
            let rest = n - done;
            let take = match (&graphs, done) {
                // A fresh stream's first chunk is the one length captured fresh.
                (Some(_), 0) => sizes.iter().find(|s| s.1).map_or(1, |s| s.0),
                (Some(_), _) => later
                    .iter()
                    .copied()
                    .filter(|&f| f <= rest)
                    .max()
                    .unwrap_or(rest),
                (None, _) => rest,
            }
            .clamp(1, rest);
            let piece = codes.narrow(2, done, take)?;
            match graphs.as_deref_mut() {
                Some(g) => self.step_slots_graphed(state, g, slots, &piece)?,
                None => self.step_slots(state, slots, &piece)?,
            };
            done += take;
        }
        Ok(())
    }

    /// The front and the pre-transformer alone over fresh `slots`: their K/V and
    /// `pre_conv` context advance by `codes`' n frames; the convolutional path's
    /// state stays zero, a fresh stream's.
    fn transform_slots(
        &self,
        state: &mut Code2WavSlots,
        slots: &[usize],
        codes: &Tensor,
    ) -> Result<()> {
        let b = state.check(slots, codes)?;
        let n = codes.dim(2)?;
        let device = self.decoder_out.weight.device();
        let ids = Tensor::from_vec(
            slots.iter().map(|&s| s as u32).collect::<Vec<_>>(),
            b,
            device,
        )?;
        let codes = self.device_codes(codes)?;
        let mut batch = self.new_state();
        self.transform(&mut batch, &codes, Pos::Host(&[0]), &mut |_| Ok(()))?;
        for (dst, like) in batch.tensors_mut().into_iter().zip(&state.conv) {
            if dst.is_none() {
                let mut dims = like.dims().to_vec();
                dims[0] = b;
                *dst = Some(Tensor::zeros(dims, like.dtype(), like.device())?);
            }
        }
        state.scatter(&ids, &mut batch)?;
        for &s in slots {
            state.frames[s] = n;
        }
        Ok(())
    }

    /// [`Self::step`] before the final clamp (tests compare the signal itself).
    fn step_unclamped(
        &self,
        state: &mut Code2WavState,
        codes: &Tensor,
        positions: Option<&[usize]>,
    ) -> Result<Tensor> {
        let frames = [state.frames];
        let pos = Pos::Host(positions.unwrap_or(&frames));
        self.step_parts(state, &self.device_codes(codes)?, pos, &mut |_| Ok(()))
    }

    /// `codes` (batch, num_quantizers, n), u32 or i64, checked where they are (the
    /// host, from the Talker: on the device the check would wait for the stream
    /// every step), as contiguous u32 on the model's device (a graphed step
    /// copies them into its input with `slice_set`, which takes no strided
    /// tensor, and a seed's pieces are narrowed views).
    fn device_codes(&self, codes: &Tensor) -> Result<Tensor> {
        let (_, nq, n) = codes.dims3()?;
        if nq != self.num_quantizers {
            candle_core::bail!(
                "code2wav: expected {} quantizers, got {nq}",
                self.num_quantizers
            )
        }
        let codes = codes.to_dtype(DType::U32)?;
        if n > 0 {
            // Negative i64 codes wrap to large u32 values and fail here too.
            let max = codes.flatten_all()?.max(0)?.to_scalar::<u32>()?;
            if max as usize >= self.codebook_size {
                candle_core::bail!("code2wav: code {max} outside the codebook")
            }
        }
        codes
            .contiguous()?
            .to_device(self.decoder_out.weight.device())
    }

    /// The front (the codes' embedding, and Qwen3-TTS's `pre_conv`) and the
    /// pre-transformer over `codes` (checked, u32, on the device, at least one
    /// frame): (batch, n, hidden).
    fn transform(
        &self,
        state: &mut Code2WavState,
        codes: &Tensor,
        pos: Pos,
        mark: &mut dyn FnMut(Part) -> Result<()>,
    ) -> Result<Tensor> {
        let (b, nq, n) = codes.dims3()?;
        let device = self.decoder_out.weight.device();
        let h = match &self.front {
            Front::Mean(table) => {
                let offsets: Vec<u32> = (0..nq as u32)
                    .map(|q| q * self.codebook_size as u32)
                    .collect();
                let offsets = Tensor::from_vec(offsets, (1, nq, 1), device)?;
                let ids = codes.broadcast_add(&offsets)?.flatten_all()?;
                table
                    .index_select(&ids, 0)?
                    .reshape((b, nq, n, ()))?
                    .mean(1)?
            }
            Front::Rvq {
                first,
                rest,
                pre_conv,
            } => {
                let q = (first.decode(&codes.narrow(1, 0, 1)?)?
                    + rest.decode(&codes.narrow(1, 1, nq - 1)?)?)?;
                let Some(pending) = state.pre_conv.as_mut() else {
                    candle_core::bail!("code2wav: a state without the pre_conv's context")
                };
                let x = q.transpose(1, 2)?.contiguous()?;
                pre_conv.step(&x, pending)?.transpose(1, 2)?.contiguous()?
            }
        };
        mark(Part::whole("embed"))?;
        let h = self.pre_transformer.step(&h, pos, &mut state.kv)?;
        mark(Part::whole("pre_transformer"))?;
        Ok(h)
    }

    /// One forward of `codes` (checked, u32, on the device) on batched `state`.
    fn step_parts(
        &self,
        state: &mut Code2WavState,
        codes: &Tensor,
        pos: Pos,
        mark: &mut dyn FnMut(Part) -> Result<()>,
    ) -> Result<Tensor> {
        let (b, _, n) = codes.dims3()?;
        let dtype = self.decoder_out.weight.dtype();
        let device = self.decoder_out.weight.device();
        if n == 0 {
            return Tensor::zeros((b, 1, 0), dtype, device);
        }
        let h = self.transform(state, codes, pos, mark)?;
        let mut h = h.transpose(1, 2)?.contiguous()?;
        for ((up, convnext), s) in self.upsample.iter().zip(state.upsample.iter_mut()) {
            h = up.step(&h, &mut None)?;
            h = convnext.step(&h, s)?;
        }
        mark(Part::whole("upsample"))?;
        let mut wav = self.decoder_in.step(&h, &mut state.decoder_in)?;
        mark(Part::whole("decoder_in"))?;
        for (i, (block, s)) in self.blocks.iter().zip(state.blocks.iter_mut()).enumerate() {
            wav = block.step(&wav, s, &mut |name| {
                mark(Part {
                    block: Some(i + 1),
                    name,
                })
            })?;
        }
        let wav = self.decoder_act.forward(&wav)?;
        let mut wav = self.decoder_out.step(&wav, &mut state.decoder_out)?;
        mark(Part::whole("decoder_out"))?;
        if state.frames == 0 && self.delay > 0 {
            let lead = Tensor::zeros((b, 1, self.delay), wav.dtype(), wav.device())?;
            wav = Tensor::cat(&[&lead, &wav], 2)?;
        }
        state.frames += n;
        Ok(wav)
    }
}

#[cfg(test)]
mod tests {
    //! The exactness checks run in f64 against the float64 reference (see
    //! scripts/qwen3_omni/code2wav.py: the tiny random decoder amplifies float32
    //! rounding to ~1e-3 at the waveform, in the reference as in ours);
    //! `float32_accuracy` measures the float32 path against the same truth.
    use super::*;
    use crate::models::qwen3_omni::fixtures;
    use candle_core::Device;

    const SPF: usize = 1920;
    const DELAY: usize = 555;

    fn model(dtype: DType) -> (Code2Wav, Code2WavConfig) {
        let cfg: Code2WavConfig =
            serde_json::from_value(fixtures::config()["code2wav_config"].clone()).unwrap();
        let path = fixtures::dir().join("model/model.safetensors");
        // SAFETY: the fixture file is not modified while the test runs.
        let vb =
            unsafe { VarBuilder::from_mmaped_safetensors(&[path], dtype, &Device::Cpu) }.unwrap();
        (Code2Wav::new(&cfg, vb.pp("code2wav")).unwrap(), cfg)
    }

    /// Not a test: the cost per frame of streaming at the released Code2Wav's
    /// shapes (random weights) for several chunk sizes (docs/bench/qwen3_omni.md).
    #[test]
    #[ignore]
    fn bench_chunk_sizes() {
        let path = std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/qwen3_omni_moe/config.json");
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        let cfg: Code2WavConfig = serde_json::from_value(v["code2wav_config"].clone()).unwrap();
        let vb = crate::models::qwen3_omni::weights::random(DType::F32, &Device::Cpu);
        let m = Code2Wav::new(&cfg, vb).unwrap();
        let frames = 16;
        let codes = random_codes(1, cfg.num_quantizers, frames, cfg.codebook_size, 5);
        stream(&m, &codes, 1, 1); // warm-up
        for chunk in [1usize, 2, 4, 8, 16] {
            let mut best = f64::MAX;
            for _ in 0..3 {
                let t0 = std::time::Instant::now();
                stream(&m, &codes, chunk, chunk);
                best = best.min(t0.elapsed().as_secs_f64());
            }
            println!(
                "code2wav (released shapes, f32, CPU): chunk {chunk:>2} frames: {:.1} ms per frame ({:.3} RTF)",
                best * 1e3 / frames as f64,
                best / (frames as f64 * 0.08)
            );
        }
    }

    /// Deterministic pseudo-random codes (batch, quantizers, frames).
    fn random_codes(batch: usize, nq: usize, frames: usize, codebook: usize, seed: u64) -> Tensor {
        let mut x = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        let v: Vec<u32> = (0..batch * nq * frames)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 33) % codebook as u64) as u32
            })
            .collect();
        Tensor::from_vec(v, (batch, nq, frames), &Device::Cpu).unwrap()
    }

    /// Streams `codes` in chunks (the first of `first` frames, then `chunk`),
    /// checking each chunk's length; returns the unclamped concatenation.
    fn stream(m: &Code2Wav, codes: &Tensor, first: usize, chunk: usize) -> Tensor {
        let frames = codes.dim(2).unwrap();
        let mut state = m.new_state();
        let (mut start, mut parts) = (0, vec![]);
        while start < frames {
            let n = (if start == 0 { first } else { chunk }).min(frames - start);
            let codes = codes.narrow(2, start, n).unwrap();
            let wav = m.step_unclamped(&mut state, &codes, None).unwrap();
            assert_eq!(wav.dim(2).unwrap(), n * SPF, "chunk at frame {start}");
            parts.push(wav);
            start += n;
        }
        assert_eq!(state.frames(), frames);
        Tensor::cat(&parts, 2).unwrap()
    }

    fn full(m: &Code2Wav, codes: &Tensor) -> Tensor {
        m.step_unclamped(&mut m.new_state(), codes, None).unwrap()
    }

    fn clamp(t: &Tensor) -> Tensor {
        t.clamp(-1f32, 1f32).unwrap()
    }

    fn max_abs(t: &Tensor) -> f64 {
        let t = t.to_dtype(DType::F64).unwrap().abs().unwrap();
        t.flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar()
            .unwrap()
    }

    /// Largest absolute difference, computed in f64 (the f32-stored reference
    /// then shows its storage rounding instead of a misleading exact 0).
    fn diff(a: &Tensor, b: &Tensor) -> f64 {
        assert_eq!(a.dims(), b.dims());
        let a = a.to_dtype(DType::F64).unwrap();
        max_abs(&(a - b.to_dtype(DType::F64).unwrap()).unwrap())
    }

    /// Our samples that line up with the reference's: [555, frames*1920).
    fn aligned(ours: &Tensor, frames: usize) -> Tensor {
        ours.narrow(2, DELAY, frames * SPF - DELAY).unwrap()
    }

    #[test]
    fn config_names() {
        let (m, cfg) = model(DType::F32);
        assert_eq!((cfg.samples_per_frame(), cfg.delay_samples()), (SPF, DELAY));
        assert_eq!((m.samples_per_frame(), m.delay_samples()), (SPF, DELAY));
        // The released checkpoint's older spelling and the class defaults.
        let old: Code2WavConfig = serde_json::from_str(r#"{"rope_theta": 1234.0}"#).unwrap();
        assert_eq!(old.rope_theta(), 1234.0);
        assert_eq!((old.head_dim(), old.sliding_window), (64, 72));
        assert_eq!((old.samples_per_frame(), old.delay_samples()), (SPF, DELAY));
    }

    /// Full decode against `model.code2wav(codes)`: ours[555 + r] == reference[r],
    /// ours[..555] == 0, exactly frames*1920 samples.
    #[test]
    fn decode_matches_reference() {
        let (m, _) = model(DType::F64);
        let io = fixtures::io("code2wav");
        for frames in [1usize, 5, 20] {
            let codes = &io[&format!("codes_{frames}")];
            let want = &io[&format!("wav_{frames}")]; // before the clamp
            let got = full(&m, codes);
            assert_eq!(got.dims(), &[2, 1, frames * SPF]);
            assert_eq!(max_abs(&got.narrow(2, 0, DELAY).unwrap()), 0.0);
            let err = diff(&aligned(&got, frames), want);
            // `decode` clamps like the reference's forward.
            let decoded = m.decode(codes).unwrap();
            let err_out = diff(&aligned(&decoded, frames), &clamp(want));
            let inside = want.abs().unwrap().lt(1f32).unwrap();
            let inside = inside.to_dtype(DType::F32).unwrap().sum_all().unwrap();
            println!(
                "frames {frames}: before clamp max err {err:.2e} (|signal| <= {:.1}), \
                 output max err {err_out:.2e} ({} samples inside the clamp)",
                max_abs(want),
                inside.to_scalar::<f32>().unwrap()
            );
            assert!(err < 1e-4 && err_out < 1e-4, "{err} {err_out}");
            // Speech-like levels (|signal| ~0.4), different across the batch.
            assert!(max_abs(want) > 0.05);
            let b0 = want.get(0).unwrap();
            let rows = diff(&b0, &want.get(1).unwrap());
            assert!(rows > 1e-3, "batch rows differ by {rows}");
        }
    }

    /// The float32 path against the float64 truth, next to the float32 reference's error.
    #[test]
    fn float32_accuracy() {
        let (m, _) = model(DType::F32);
        let io = fixtures::io("code2wav");
        let (truth, torch32) = (&io["wav_5"], &io["wav32_5"]);
        let ours = aligned(&full(&m, &io["codes_5"]), 5);
        let ours_err = diff(&ours, truth);
        let torch_err = diff(torch32, truth);
        let ours_out = diff(&clamp(&ours), &clamp(truth));
        let torch_out = diff(&clamp(torch32), &clamp(truth));
        let vs_torch = diff(&ours, torch32);
        println!(
            "float32 vs float64 truth, 5 frames: ours {ours_err:.2e} (output {ours_out:.2e}), \
             reference {torch_err:.2e} (output {torch_out:.2e}); ours vs reference float32 {vs_torch:.2e}"
        );
        // Both float32 runs are within rounding of the truth and of each other.
        assert!(ours_err < 1e-4 && vs_torch < 1e-4, "{ours_err} {vs_torch}");
        assert!(
            ours_err < 4.0 * torch_err.max(1e-6),
            "{ours_err} vs {torch_err}"
        );
    }

    /// Streaming in chunks equals the full decode, with n*1920 samples per chunk.
    #[test]
    fn stream_equals_decode() {
        for dtype in [DType::F64, DType::F32] {
            let (m, cfg) = model(dtype);
            let frames = 64; // 8 sliding windows
            let codes = random_codes(2, cfg.num_quantizers, frames, cfg.codebook_size, 1);
            let whole = full(&m, &codes);
            assert_eq!(whole.dims(), &[2, 1, frames * SPF]);
            assert!(max_abs(&whole) > 0.05);
            for first in [1, 2, 4] {
                for chunk in [1, 7, 25] {
                    let got = stream(&m, &codes, first, chunk);
                    let err = diff(&got, &whole);
                    let err_out = diff(&clamp(&got), &clamp(&whole));
                    println!(
                        "{dtype:?} first {first} chunk {chunk}: max err {err:.2e} (output {err_out:.2e})"
                    );
                    assert!(err < 1e-4 && err_out < 1e-4, "{err} {err_out}");
                }
            }
        }
    }

    /// Separate states are independent, and a batch equals its requests alone.
    #[test]
    fn independent_requests() {
        let (m, cfg) = model(DType::F64);
        let frames = 30;
        let a = random_codes(1, cfg.num_quantizers, frames, cfg.codebook_size, 2);
        let b = random_codes(1, cfg.num_quantizers, frames, cfg.codebook_size, 3);
        let (want_a, want_b) = (full(&m, &a), full(&m, &b));
        assert!(diff(&want_a, &want_b) > 1e-3);

        // Two streams stepped alternately with different chunkings.
        let (mut sa, mut sb) = (m.new_state(), m.new_state());
        let (mut pa, mut pb) = (vec![], vec![]);
        let (mut ia, mut ib) = (0, 0);
        while ia < frames || ib < frames {
            if ia < frames {
                let n = 3.min(frames - ia);
                pa.push(
                    m.step_unclamped(&mut sa, &a.narrow(2, ia, n).unwrap(), None)
                        .unwrap(),
                );
                ia += n;
            }
            if ib < frames {
                let n = 7.min(frames - ib);
                pb.push(
                    m.step_unclamped(&mut sb, &b.narrow(2, ib, n).unwrap(), None)
                        .unwrap(),
                );
                ib += n;
            }
        }
        let ea = diff(&Tensor::cat(&pa, 2).unwrap(), &want_a);
        let eb = diff(&Tensor::cat(&pb, 2).unwrap(), &want_b);

        // One batched stream of both requests.
        let both = Tensor::cat(&[&a, &b], 0).unwrap();
        let batched = stream(&m, &both, 2, 5);
        let want = Tensor::cat(&[&want_a, &want_b], 0).unwrap();
        let eab = diff(&batched, &want);
        println!("interleaved a {ea:.2e} b {eb:.2e}, batched {eab:.2e}");
        assert!(ea < 1e-4 && eb < 1e-4 && eab < 1e-4);
    }

    /// Streams decoded together by `step_slots` (at different frame counts
    /// inside the attention window, fresh beside started ones, in any slot order,
    /// a finished stream's slot taken by a new one, the slots grown midway) give
    /// what each gives alone, exactly the same length.
    #[test]
    fn step_slots_match_single_streams() {
        let (m, cfg) = model(DType::F64);
        let lens = [12usize, 24, 24, 20];
        let codes: Vec<Tensor> = (0..4)
            .map(|i| {
                random_codes(
                    1,
                    cfg.num_quantizers,
                    lens[i],
                    cfg.codebook_size,
                    10 + i as u64,
                )
            })
            .collect();
        let want: Vec<Tensor> = codes.iter().map(|c| clamp(&full(&m, c))).collect();
        let mut slots = m.new_slots(2);
        // Stream 2 joins a chunk late (in a third slot), stream 3 once stream 0
        // is done (in its slot).
        let mut slot_of = [Some(0), Some(1), None, None];
        let mut done = [0usize; 4];
        let mut got: Vec<Vec<Tensor>> = vec![vec![]; 4];
        for round in 0.. {
            if round == 1 {
                slots.reserve(3).unwrap();
                assert_eq!(slots.capacity(), 4);
                slot_of[2] = Some(2);
            }
            if done[0] == lens[0] && slot_of[3].is_none() {
                slot_of[0] = None;
                slots.reset(0);
                slot_of[3] = Some(0);
            }
            let active: Vec<usize> = (0..4)
                .rev()
                .filter(|&i| slot_of[i].is_some() && done[i] < lens[i])
                .collect();
            if active.is_empty() {
                break;
            }
            let n = active
                .iter()
                .map(|&i| lens[i] - done[i])
                .min()
                .unwrap()
                .min(if round == 0 { 1 } else { 3 });
            let batch: Vec<Tensor> = active
                .iter()
                .map(|&i| codes[i].narrow(2, done[i], n).unwrap().squeeze(0).unwrap())
                .collect();
            let batch = Tensor::stack(&batch, 0).unwrap();
            let ids: Vec<usize> = active.iter().map(|&i| slot_of[i].unwrap()).collect();
            let out = m.step_slots(&mut slots, &ids, &batch).unwrap();
            assert_eq!(out.dims(), &[active.len(), 1, n * SPF]);
            for (k, &i) in active.iter().enumerate() {
                got[i].push(out.narrow(0, k, 1).unwrap());
                done[i] += n;
                assert_eq!(slots.frames(slot_of[i].unwrap()), done[i]);
            }
        }
        for i in 0..4 {
            let all = Tensor::cat(&got[i], 2).unwrap();
            let e = diff(&all, &want[i]);
            assert!(e < 1e-9, "stream {i} differs by {e}");
        }
        // Bad slot lists are errors, and leave the slots as they were.
        let one = codes[1].narrow(2, 0, 1).unwrap();
        let two = Tensor::cat(&[&one, &one], 0).unwrap();
        let err = m.step_slots(&mut slots, &[1, 1], &two).unwrap_err();
        assert!(err.to_string().contains("twice"), "{err}");
        let err = m.step_slots(&mut slots, &[9], &one).unwrap_err();
        assert!(err.to_string().contains("slot 9"), "{err}");
        let err = m.step_slots(&mut slots, &[0, 1], &one).unwrap_err();
        assert!(err.to_string().contains("2 slots for 1"), "{err}");
        assert_eq!(slots.frames(1), lens[1]);
    }

    /// The mask a graphed step builds on the device from each row's first frame
    /// equals the host's, for rows before, at and past a full window.
    #[test]
    fn device_mask_equals_host_mask() {
        let dev = Device::Cpu;
        for (window, n) in [
            (8usize, 4usize),
            (72, 4),
            (72, 1),
            (8, 9),
            (72, 22),
            (72, 100),
        ] {
            let total = window - 1 + n;
            let firsts = [1usize, 2, 5, window - 2, window - 1, window, 3 * window];
            let host = host_mask(&firsts, n, total, window, &dev).unwrap();
            let first = Tensor::from_vec(
                firsts.iter().map(|&f| f as f32).collect::<Vec<_>>(),
                (firsts.len(), 1, 1),
                &dev,
            )
            .unwrap();
            let device = device_mask(&first, n, total, window).unwrap();
            let (h, d) = (
                host.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
                device.flatten_all().unwrap().to_vec1::<f32>().unwrap(),
            );
            assert_eq!(h, d, "window {window}, n {n}");
            // Each row sees min(first, window - 1) cached keys at its first query.
            assert!(h.iter().any(|x| x.is_infinite()) && h.contains(&0.0));
        }
    }

    /// The reference's `chunked_decode(codes, 5, 25)` on 20 frames drops the 555
    /// samples (23 ms) before every chunk end: 4 x 555 below 20*1920, i.e. 3 x 555
    /// = 1665 fewer than its own full decode, a hole at each of the 3 boundaries.
    /// Our stream in the same chunks loses nothing.
    #[test]
    fn reference_chunked_decode_drops_samples() {
        let (m, _) = model(DType::F64);
        let io = fixtures::io("code2wav");
        let (frames, chunk) = (20usize, 5usize);
        let codes = io["codes_20"].narrow(0, 0, 1).unwrap();
        let reference = clamp(&io["wav_20"].narrow(0, 0, 1).unwrap());
        let chunked = &io["chunked_wav"];
        let chunks = frames.div_ceil(chunk);
        assert_eq!(reference.dim(2).unwrap(), frames * SPF - DELAY);
        assert_eq!(chunked.dim(2).unwrap(), frames * SPF - chunks * DELAY);

        // The 25-frame left context covers all 20 frames, so chunk k of the
        // reference's chunked output is exactly its full decode's samples
        // [k*5*1920, (k+1)*5*1920 - 555): the 555 before each chunk end are gone.
        let (n, kept) = (chunk * SPF, chunk * SPF - DELAY);
        for k in 0..chunks {
            let piece = chunked.narrow(2, k * kept, kept).unwrap();
            let same = reference.narrow(2, k * n, kept).unwrap();
            assert!(diff(&piece, &same) < 1e-5);
        }
        // So from the first boundary on it no longer lines up with the full decode.
        let after = chunked.narrow(2, kept, n).unwrap();
        let jump = diff(&after, &reference.narrow(2, kept, n).unwrap());
        assert!(jump > 1e-3, "{jump}");

        // Ours in the same chunks: 5*1920 samples each, equal to the reference's
        // full decode (555 later) throughout.
        let ours = clamp(&stream(&m, &codes, chunk, chunk));
        assert_eq!(ours.dim(2).unwrap(), frames * SPF);
        let err = diff(&aligned(&ours, frames), &reference);
        println!(
            "reference chunked_decode(5, 25) on 20 frames: {} samples vs {} from its full \
             decode ({} lost, {DELAY} at each boundary); ours streamed in 5s: {} samples, \
             max err vs the reference's full decode {err:.2e}",
            chunked.dim(2).unwrap(),
            reference.dim(2).unwrap(),
            reference.dim(2).unwrap() - chunked.dim(2).unwrap(),
            ours.dim(2).unwrap()
        );
        assert!(err < 1e-4);
    }
}
