//! Whisper's network (encoder and decoder), on this crate's f32 kernels.
//!
//! Modules and weight names mirror Hugging Face's `WhisperForConditionalGeneration`
//! (`model.encoder.layers.N.self_attn.q_proj`, ...), which is what [`super`] maps the
//! CTranslate2 variables to. candle's own Whisper does the same arithmetic through candle's CPU
//! matmul, which reaches ~10 GFLOP/s on the encoder's products on 2 cores, and its decoder keeps
//! no self-attention cache (every step reruns the whole prefix). Here every product goes through
//! [`matmul_nt`] (~110-150 GFLOP/s at these shapes), convolutions are im2col + the same kernel,
//! and the decoder carries a [`DecoderState`] (self-attention keys and values, and the
//! cross-attention keys and values of the window, computed once).
//!
//! Numerics follow the reference: LayerNorm eps 1e-5, exact (erf) GELU, queries and keys each
//! scaled by `d_head^-0.25`, the encoder's sinusoidal positions computed as Whisper does.

use rayon::prelude::*;

use crate::models::linear::matmul_nt;
use crate::models::{ModelError, Result};

/// The hyper-parameters the network needs.
#[derive(Debug, Clone, PartialEq)]
pub struct WhisperNetConfig {
    pub n_mels: usize,
    pub d_model: usize,
    pub encoder_heads: usize,
    pub decoder_heads: usize,
    pub encoder_layers: usize,
    pub decoder_layers: usize,
    /// Encoder positions (1500: 30 s at 50 per second).
    pub audio_ctx: usize,
    /// Decoder positions (448).
    pub text_ctx: usize,
    pub vocab: usize,
}

/// Named f32 weights (HF names), as [`super`] builds them.
pub trait WeightSource {
    /// The weight `name`, row-major, and its shape.
    fn get(&self, name: &str) -> Result<(Vec<f32>, Vec<usize>)>;
    fn has(&self, name: &str) -> bool;
}

fn missing(name: &str, shape: &[usize], want: &[usize]) -> ModelError {
    ModelError::Invalid(format!(
        "whisper: {name} has shape {shape:?}, expected {want:?}"
    ))
}

fn tensor(ws: &dyn WeightSource, name: &str, want: &[usize]) -> Result<Vec<f32>> {
    let (v, shape) = ws.get(name)?;
    if shape != want {
        return Err(missing(name, &shape, want));
    }
    Ok(v)
}

/// `y = x · wᵀ + b`, `w` `[n, k]`.
struct Dense {
    w: Vec<f32>,
    b: Option<Vec<f32>>,
    n: usize,
    k: usize,
}

impl Dense {
    fn load(ws: &dyn WeightSource, prefix: &str, n: usize, k: usize) -> Result<Self> {
        let w = tensor(ws, &format!("{prefix}.weight"), &[n, k])?;
        let bias = format!("{prefix}.bias");
        let b = if ws.has(&bias) {
            Some(tensor(ws, &bias, &[n])?)
        } else {
            None
        };
        Ok(Self { w, b, n, k })
    }

    /// `x` `[m, k]` → `[m, n]`.
    fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * self.n];
        matmul_nt(x, m, &self.w, self.n, self.k, &mut out);
        if let Some(b) = &self.b {
            out.par_chunks_mut(self.n).for_each(|row| {
                for (o, b) in row.iter_mut().zip(b) {
                    *o += b;
                }
            });
        }
        out
    }
}

struct LayerNorm {
    g: Vec<f32>,
    b: Vec<f32>,
}

impl LayerNorm {
    fn load(ws: &dyn WeightSource, prefix: &str, d: usize) -> Result<Self> {
        Ok(Self {
            g: tensor(ws, &format!("{prefix}.weight"), &[d])?,
            b: tensor(ws, &format!("{prefix}.bias"), &[d])?,
        })
    }

    fn forward(&self, x: &[f32]) -> Vec<f32> {
        let d = self.g.len();
        let mut out = vec![0f32; x.len()];
        out.par_chunks_mut(d)
            .zip(x.par_chunks(d))
            .for_each(|(o, x)| {
                let mean = x.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
                let var = x
                    .iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
                    / d as f64;
                let inv = 1.0 / (var + 1e-5).sqrt();
                for i in 0..d {
                    o[i] = ((f64::from(x[i]) - mean) * inv) as f32 * self.g[i] + self.b[i];
                }
            });
        out
    }
}

/// erf to ~1.5e-7 (Abramowitz & Stegun 7.1.26), in f64 for the polynomial.
fn erf(x: f32) -> f32 {
    let x = f64::from(x);
    let t = 1.0 / (1.0 + 0.327_591_1 * x.abs());
    let y = 1.0
        - (((((1.061_405_429 * t - 1.453_152_027) * t) + 1.421_413_741) * t - 0.284_496_736) * t
            + 0.254_829_592)
            * t
            * (-x * x).exp();
    (if x < 0.0 { -y } else { y }) as f32
}

/// Exact GELU, `x Φ(x)` (PyTorch's `nn.GELU()`, as Whisper and CTranslate2 use).
fn gelu_inplace(x: &mut [f32]) {
    x.par_chunks_mut(4096).for_each(|c| {
        for v in c {
            *v = 0.5 * *v * (1.0 + erf(*v * std::f32::consts::FRAC_1_SQRT_2));
        }
    });
}

fn add_inplace(x: &mut [f32], y: &[f32]) {
    x.par_chunks_mut(4096)
        .zip(y.par_chunks(4096))
        .for_each(|(a, b)| {
            for (a, b) in a.iter_mut().zip(b) {
                *a += b;
            }
        });
}

/// Keys and values split per head for [`attend`]: `k` scaled by `dh^-1/4` (Whisper scales q
/// and k each) `[tk, dh]`, and `vᵀ` `[dh, tk]`.
struct HeadKv {
    k: Vec<f32>,
    vt: Vec<f32>,
}

/// `k`, `v` `[tk, d]` → one [`HeadKv`] per head.
fn split_heads(k: &[f32], v: &[f32], tk: usize, heads: usize) -> Vec<HeadKv> {
    let d = k.len() / tk.max(1);
    let dh = d / heads;
    let scale = (dh as f32).powf(-0.25);
    (0..heads)
        .into_par_iter()
        .map(|h| {
            let mut kh = Vec::with_capacity(tk * dh);
            let mut vt = vec![0f32; dh * tk];
            for r in 0..tk {
                let row = r * d + h * dh;
                kh.extend(k[row..row + dh].iter().map(|x| x * scale));
                for c in 0..dh {
                    vt[c * tk + r] = v[row + c];
                }
            }
            HeadKv { k: kh, vt }
        })
        .collect()
}

/// `out[tq, d] = softmax(q kᵀ (+ causal mask)) v` per head, `q` `[tq, d]`, keys and values of
/// `tk` positions split by [`split_heads`]. `causal`: query `i` sits at position `causal + i`
/// and sees keys `0..=causal + i`.
fn attend(q: &[f32], tq: usize, kv: &[HeadKv], tk: usize, causal: Option<usize>) -> Vec<f32> {
    let d = q.len() / tq.max(1);
    let dh = d / kv.len();
    let scale = (dh as f32).powf(-0.25);
    let head_out: Vec<Vec<f32>> = kv
        .par_iter()
        .enumerate()
        .map(|(h, kv)| {
            let mut qh = Vec::with_capacity(tq * dh);
            for r in 0..tq {
                qh.extend(
                    q[r * d + h * dh..r * d + (h + 1) * dh]
                        .iter()
                        .map(|x| x * scale),
                );
            }
            let mut s = vec![0f32; tq * tk];
            matmul_nt(&qh, tq, &kv.k, tk, dh, &mut s);
            for (i, row) in s.chunks_mut(tk).enumerate() {
                let visible = causal.map_or(tk, |p| (p + i + 1).min(tk));
                softmax_inplace(&mut row[..visible]);
                row[visible..].fill(0.0);
            }
            let mut o = vec![0f32; tq * dh];
            matmul_nt(&s, tq, &kv.vt, dh, tk, &mut o);
            o
        })
        .collect();
    let mut out = vec![0f32; tq * d];
    for (h, o) in head_out.iter().enumerate() {
        for r in 0..tq {
            out[r * d + h * dh..r * d + (h + 1) * dh].copy_from_slice(&o[r * dh..(r + 1) * dh]);
        }
    }
    out
}

fn softmax_inplace(row: &mut [f32]) {
    let max = row.iter().fold(f32::NEG_INFINITY, |m, &x| m.max(x));
    let mut sum = 0f32;
    for x in row.iter_mut() {
        *x = (*x - max).exp();
        sum += *x;
    }
    let inv = 1.0 / sum;
    for x in row.iter_mut() {
        *x *= inv;
    }
}

/// `self_attn` / `encoder_attn` of a layer.
struct Attention {
    q_proj: Dense,
    k_proj: Dense,
    v_proj: Dense,
    out_proj: Dense,
}

impl Attention {
    fn load(ws: &dyn WeightSource, prefix: &str, d: usize) -> Result<Self> {
        let lin = |p: &str| Dense::load(ws, &format!("{prefix}.{p}"), d, d);
        Ok(Self {
            q_proj: lin("q_proj")?,
            k_proj: lin("k_proj")?,
            v_proj: lin("v_proj")?,
            out_proj: lin("out_proj")?,
        })
    }
}

struct Mlp {
    fc1: Dense,
    fc2: Dense,
}

impl Mlp {
    fn load(ws: &dyn WeightSource, prefix: &str, d: usize) -> Result<Self> {
        Ok(Self {
            fc1: Dense::load(ws, &format!("{prefix}.fc1"), 4 * d, d)?,
            fc2: Dense::load(ws, &format!("{prefix}.fc2"), d, 4 * d)?,
        })
    }

    fn forward(&self, x: &[f32], m: usize) -> Vec<f32> {
        let mut h = self.fc1.forward(x, m);
        gelu_inplace(&mut h);
        self.fc2.forward(&h, m)
    }
}

/// `model.encoder.layers.N`.
struct EncoderLayer {
    self_attn_layer_norm: LayerNorm,
    self_attn: Attention,
    final_layer_norm: LayerNorm,
    mlp: Mlp,
}

/// A 1-D convolution, kernel 3, padding 1, as im2col + one product.
struct Conv3 {
    w: Dense,
    stride: usize,
    c_in: usize,
}

impl Conv3 {
    fn load(
        ws: &dyn WeightSource,
        prefix: &str,
        c_out: usize,
        c_in: usize,
        stride: usize,
    ) -> Result<Self> {
        // [c_out, c_in, 3] row-major is [c_out, c_in * 3] with column c * 3 + j.
        let w = tensor(ws, &format!("{prefix}.weight"), &[c_out, c_in, 3])?;
        let b = tensor(ws, &format!("{prefix}.bias"), &[c_out])?;
        Ok(Self {
            w: Dense {
                w,
                b: Some(b),
                n: c_out,
                k: c_in * 3,
            },
            stride,
            c_in,
        })
    }

    /// `at(t, c)`: input channel `c` at time `t` (in range); `len` input steps → `[len / stride,
    /// c_out]` (time-major).
    fn forward(&self, len: usize, at: impl Fn(usize, usize) -> f32 + Sync) -> (Vec<f32>, usize) {
        let t_out = len.div_ceil(self.stride);
        let k = self.c_in * 3;
        let mut cols = vec![0f32; t_out * k];
        cols.par_chunks_mut(k).enumerate().for_each(|(t, row)| {
            for j in 0..3 {
                // Input index t * stride - 1 + j, zero outside.
                let Some(src) = (t * self.stride + j).checked_sub(1).filter(|&s| s < len) else {
                    continue;
                };
                for c in 0..self.c_in {
                    row[c * 3 + j] = at(src, c);
                }
            }
        });
        (self.w.forward(&cols, t_out), t_out)
    }
}

pub struct Encoder {
    conv1: Conv3,
    conv2: Conv3,
    /// Whisper's sinusoids, `[audio_ctx, d]`.
    embed_positions: Vec<f32>,
    layers: Vec<EncoderLayer>,
    layer_norm: LayerNorm,
    cfg: WhisperNetConfig,
}

impl Encoder {
    fn load(ws: &dyn WeightSource, cfg: &WhisperNetConfig) -> Result<Self> {
        let d = cfg.d_model;
        let layers = (0..cfg.encoder_layers)
            .map(|l| {
                let p = format!("model.encoder.layers.{l}");
                Ok(EncoderLayer {
                    self_attn_layer_norm: LayerNorm::load(
                        ws,
                        &format!("{p}.self_attn_layer_norm"),
                        d,
                    )?,
                    self_attn: Attention::load(ws, &format!("{p}.self_attn"), d)?,
                    final_layer_norm: LayerNorm::load(ws, &format!("{p}.final_layer_norm"), d)?,
                    mlp: Mlp::load(ws, &p, d)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            conv1: Conv3::load(ws, "model.encoder.conv1", d, cfg.n_mels, 1)?,
            conv2: Conv3::load(ws, "model.encoder.conv2", d, d, 2)?,
            embed_positions: sinusoids(cfg.audio_ctx, d),
            layers,
            layer_norm: LayerNorm::load(ws, "model.encoder.layer_norm", d)?,
            cfg: cfg.clone(),
        })
    }

    /// `mel` `[n_mels, frames]` (row-major) → `[frames / 2, d]`.
    pub fn forward(&self, mel: &[f32], frames: usize) -> Result<Vec<f32>> {
        let (d, n_mels) = (self.cfg.d_model, self.cfg.n_mels);
        if mel.len() != n_mels * frames || frames.div_ceil(2) > self.cfg.audio_ctx {
            return Err(ModelError::Invalid(format!(
                "whisper encoder: {} values for {frames} frames of {n_mels} mels (at most {})",
                mel.len(),
                2 * self.cfg.audio_ctx
            )));
        }
        let (mut h, _) = self.conv1.forward(frames, |t, c| mel[c * frames + t]);
        gelu_inplace(&mut h);
        let (mut x, t) = self.conv2.forward(frames, |s, c| h[s * d + c]);
        gelu_inplace(&mut x);
        add_inplace(&mut x, &self.embed_positions[..t * d]);
        for l in &self.layers {
            let a = l.self_attn_layer_norm.forward(&x);
            let q = l.self_attn.q_proj.forward(&a, t);
            let k = l.self_attn.k_proj.forward(&a, t);
            let v = l.self_attn.v_proj.forward(&a, t);
            let kv = split_heads(&k, &v, t, self.cfg.encoder_heads);
            let o = attend(&q, t, &kv, t, None);
            add_inplace(&mut x, &l.self_attn.out_proj.forward(&o, t));
            let a = l.final_layer_norm.forward(&x);
            add_inplace(&mut x, &l.mlp.forward(&a, t));
        }
        Ok(self.layer_norm.forward(&x))
    }
}

/// Whisper's `sinusoids(length, channels)`: `[sin(t·inc_i) | cos(t·inc_i)]`.
fn sinusoids(length: usize, channels: usize) -> Vec<f32> {
    let half = channels / 2;
    let inc = 10000f32.ln() / (half as f32 - 1.0);
    let inv: Vec<f32> = (0..half).map(|i| (i as f32 * -inc).exp()).collect();
    let mut out = vec![0f32; length * channels];
    for t in 0..length {
        for i in 0..half {
            let a = t as f32 * inv[i];
            out[t * channels + i] = a.sin();
            out[t * channels + half + i] = a.cos();
        }
    }
    out
}

/// `model.decoder.layers.N`.
struct DecoderLayer {
    self_attn_layer_norm: LayerNorm,
    self_attn: Attention,
    encoder_attn_layer_norm: LayerNorm,
    encoder_attn: Attention,
    final_layer_norm: LayerNorm,
    mlp: Mlp,
}

pub struct Decoder {
    /// `[vocab, d]`; also the output projection (tied).
    pub embed_tokens: Vec<f32>,
    embed_positions: Vec<f32>,
    layers: Vec<DecoderLayer>,
    layer_norm: LayerNorm,
    cfg: WhisperNetConfig,
}

/// One window's decoding state: the self-attention keys and values of the tokens so far, the
/// cross-attention keys and values of the window's encoder output.
pub struct DecoderState {
    self_kv: Vec<(Vec<f32>, Vec<f32>)>,
    cross_kv: Vec<Vec<HeadKv>>,
    audio_len: usize,
    pos: usize,
}

impl DecoderState {
    /// Tokens decoded so far.
    pub fn len(&self) -> usize {
        self.pos
    }

    pub fn is_empty(&self) -> bool {
        self.pos == 0
    }
}

impl Decoder {
    fn load(ws: &dyn WeightSource, cfg: &WhisperNetConfig) -> Result<Self> {
        let d = cfg.d_model;
        let layers = (0..cfg.decoder_layers)
            .map(|l| {
                let p = format!("model.decoder.layers.{l}");
                Ok(DecoderLayer {
                    self_attn_layer_norm: LayerNorm::load(
                        ws,
                        &format!("{p}.self_attn_layer_norm"),
                        d,
                    )?,
                    self_attn: Attention::load(ws, &format!("{p}.self_attn"), d)?,
                    encoder_attn_layer_norm: LayerNorm::load(
                        ws,
                        &format!("{p}.encoder_attn_layer_norm"),
                        d,
                    )?,
                    encoder_attn: Attention::load(ws, &format!("{p}.encoder_attn"), d)?,
                    final_layer_norm: LayerNorm::load(ws, &format!("{p}.final_layer_norm"), d)?,
                    mlp: Mlp::load(ws, &p, d)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            embed_tokens: tensor(ws, "model.decoder.embed_tokens.weight", &[cfg.vocab, d])?,
            embed_positions: tensor(
                ws,
                "model.decoder.embed_positions.weight",
                &[cfg.text_ctx, d],
            )?,
            layers,
            layer_norm: LayerNorm::load(ws, "model.decoder.layer_norm", d)?,
            cfg: cfg.clone(),
        })
    }

    /// Logits of hidden states `h` `[m, d]`: `[m, vocab]` (the output projection is the token
    /// embedding).
    pub fn logits(&self, h: &[f32], m: usize) -> Vec<f32> {
        let mut out = vec![0f32; m * self.cfg.vocab];
        matmul_nt(
            h,
            m,
            &self.embed_tokens,
            self.cfg.vocab,
            self.cfg.d_model,
            &mut out,
        );
        out
    }

    /// A fresh state for the window whose encoder output is `audio` `[len, d]`.
    pub fn start(&self, audio: &[f32]) -> DecoderState {
        let len = audio.len() / self.cfg.d_model;
        let cross_kv = self
            .layers
            .iter()
            .map(|l| {
                let k = l.encoder_attn.k_proj.forward(audio, len);
                let v = l.encoder_attn.v_proj.forward(audio, len);
                split_heads(&k, &v, len, self.cfg.decoder_heads)
            })
            .collect();
        DecoderState {
            self_kv: vec![(Vec::new(), Vec::new()); self.layers.len()],
            cross_kv,
            audio_len: len,
            pos: 0,
        }
    }

    /// Feeds `tokens` after those already in `state`; the final hidden states of the new
    /// positions, `[tokens.len(), d]` (before the output projection).
    pub fn step(&self, state: &mut DecoderState, tokens: &[u32]) -> Result<Vec<f32>> {
        let d = self.cfg.d_model;
        let m = tokens.len();
        if state.pos + m > self.cfg.text_ctx {
            return Err(ModelError::Invalid(format!(
                "whisper decoder: more than {} tokens",
                self.cfg.text_ctx
            )));
        }
        let mut x = vec![0f32; m * d];
        for (i, &tok) in tokens.iter().enumerate() {
            let tok = tok as usize;
            if tok >= self.cfg.vocab {
                return Err(ModelError::Invalid(format!("whisper decoder: token {tok}")));
            }
            let p = state.pos + i;
            for c in 0..d {
                x[i * d + c] = self.embed_tokens[tok * d + c] + self.embed_positions[p * d + c];
            }
        }
        for (l, (kv, ckv)) in self
            .layers
            .iter()
            .zip(state.self_kv.iter_mut().zip(&state.cross_kv))
        {
            let a = l.self_attn_layer_norm.forward(&x);
            let q = l.self_attn.q_proj.forward(&a, m);
            kv.0.extend(l.self_attn.k_proj.forward(&a, m));
            kv.1.extend(l.self_attn.v_proj.forward(&a, m));
            let tk = state.pos + m;
            let heads = split_heads(&kv.0, &kv.1, tk, self.cfg.decoder_heads);
            let o = attend(&q, m, &heads, tk, Some(state.pos));
            add_inplace(&mut x, &l.self_attn.out_proj.forward(&o, m));

            let a = l.encoder_attn_layer_norm.forward(&x);
            let q = l.encoder_attn.q_proj.forward(&a, m);
            let o = attend(&q, m, ckv, state.audio_len, None);
            add_inplace(&mut x, &l.encoder_attn.out_proj.forward(&o, m));

            let a = l.final_layer_norm.forward(&x);
            add_inplace(&mut x, &l.mlp.forward(&a, m));
        }
        state.pos += m;
        Ok(self.layer_norm.forward(&x))
    }
}

/// Encoder and decoder.
pub struct WhisperNet {
    pub encoder: Encoder,
    pub decoder: Decoder,
    pub cfg: WhisperNetConfig,
}

impl WhisperNet {
    pub fn load(ws: &dyn WeightSource, cfg: &WhisperNetConfig) -> Result<Self> {
        for heads in [cfg.encoder_heads, cfg.decoder_heads] {
            if heads == 0 || !cfg.d_model.is_multiple_of(heads) || !cfg.d_model.is_multiple_of(2) {
                return Err(ModelError::Invalid(format!(
                    "whisper: d_model {} and {heads} heads do not fit",
                    cfg.d_model
                )));
            }
        }
        Ok(Self {
            encoder: Encoder::load(ws, cfg)?,
            decoder: Decoder::load(ws, cfg)?,
            cfg: cfg.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_is_accurate() {
        for i in -400..=400 {
            let x = i as f32 / 100.0;
            let want = candle_core::cpu::erf::erf_f64(f64::from(x));
            assert!((f64::from(erf(x)) - want).abs() < 3e-7, "erf({x})");
        }
    }

    #[test]
    fn causal_attention_sees_only_the_past() {
        // One head of width 2; the query at position 1 must ignore key 2.
        let q = [1.0, 0.0, 0.0, 1.0];
        let k = [1.0, 0.0, 0.0, 1.0, 5.0, 5.0];
        let v = [1.0, 0.0, 0.0, 1.0, 100.0, 100.0];
        let kv = split_heads(&k, &v, 3, 1);
        let o = attend(&q[2..], 1, &kv, 3, Some(1));
        assert!(o.iter().all(|x| *x < 1.0), "{o:?}");
        let full = attend(&q[2..], 1, &kv, 3, None);
        assert!(full.iter().all(|x| *x > 1.0), "{full:?}");
    }
}
