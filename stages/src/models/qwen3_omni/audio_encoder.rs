//! The Thinker's audio encoder (`thinker.audio_tower`, transformers'
//! `Qwen3OmniMoeAudioEncoder`) and its log-mel front end (the processor's
//! `WhisperFeatureExtractor`: 128 bins, 16 kHz, n_fft 400, hop 160).
//!
//! Encoder: each utterance's features are cut into chunks of `2 * n_window`
//! frames (the last one shorter), every chunk of the call is zero-padded to the
//! longest chunk, and three stride-2 `Conv2d` + GELU, `conv_out` and sinusoidal
//! positions (restarting at 0 in every chunk) turn a chunk of 100 frames into 13
//! tokens. The valid tokens of all chunks are packed, a stack of pre-norm
//! transformer layers attends inside blocks of `n_window_infer / (2 * n_window)`
//! chunks of one utterance (`cu_seqlens`), then `ln_post`, `proj1`, GELU, `proj2`.
//!
//! Batching caveat (the reference's own behaviour, reproduced by
//! [`AudioEncoder::forward`]): the conv stack sees the zero padding of a chunk
//! shorter than the padded length (its second and third convs read the first
//! conv's activations of padded frames), so an utterance shorter than
//! `2 * n_window` frames encodes slightly differently alone than in a batch with
//! a longer one (9e-4 on the tiny model). [`AudioEncoder::forward_independent`]
//! gives each utterance exactly its alone result.

use candle_core::{DType, Device, Module, Result, Tensor};
use candle_nn::{Activation, Conv2d, Conv2dConfig, LayerNorm, Linear, VarBuilder};

use crate::models::stft;

/// `Qwen3OmniMoeAudioEncoderConfig` (the Thinker config's `audio_config`).
#[derive(Debug, Clone, PartialEq, serde::Deserialize)]
pub struct AudioEncoderConfig {
    #[serde(default = "default_num_mel_bins")]
    pub num_mel_bins: usize,
    #[serde(alias = "num_hidden_layers")]
    pub encoder_layers: usize,
    #[serde(alias = "num_attention_heads")]
    pub encoder_attention_heads: usize,
    #[serde(alias = "intermediate_size")]
    pub encoder_ffn_dim: usize,
    #[serde(alias = "hidden_size")]
    pub d_model: usize,
    #[serde(default)]
    pub activation_function: Activation,
    /// Read for completeness: the reference computes `embed_scale` from it but never
    /// applies it, and neither does this port.
    #[serde(default)]
    pub scale_embedding: bool,
    #[serde(default = "default_max_source_positions")]
    pub max_source_positions: usize,
    #[serde(default = "default_n_window")]
    pub n_window: usize,
    pub output_dim: usize,
    #[serde(default = "default_n_window_infer")]
    pub n_window_infer: usize,
    #[serde(default = "default_conv_chunksize")]
    pub conv_chunksize: usize,
    #[serde(default = "default_downsample_hidden_size")]
    pub downsample_hidden_size: usize,
}

fn default_num_mel_bins() -> usize {
    128
}
fn default_max_source_positions() -> usize {
    1500
}
fn default_n_window() -> usize {
    50
}
fn default_n_window_infer() -> usize {
    800
}
fn default_conv_chunksize() -> usize {
    500
}
fn default_downsample_hidden_size() -> usize {
    480
}

/// Frames after the three stride-2 convs of one chunk: `ceil(x / 2)` three times.
fn conv_out_len(frames: usize) -> usize {
    frames.div_ceil(2).div_ceil(2).div_ceil(2)
}

/// Audio tokens of an utterance of `frames` mel frames (transformers'
/// `_get_feat_extract_output_lengths`): 13 per full chunk of `2 * n_window`
/// frames (for n_window 50) plus the conv output of the remainder.
pub fn feat_extract_output_lengths(frames: usize, n_window: usize) -> usize {
    let chunk = 2 * n_window;
    conv_out_len(frames % chunk) + (frames / chunk) * conv_out_len(chunk)
}

/// Sinusoidal positions `[length, channels]` (`SinusoidsPositionEmbedding`), in f32
/// as the reference computes them.
fn sinusoids(length: usize, channels: usize, device: &Device) -> Result<Tensor> {
    let half = channels / 2;
    if !channels.is_multiple_of(2) || half < 2 {
        candle_core::bail!("sinusoidal positions need an even channel count >= 4, got {channels}");
    }
    let inc = (10000f64.ln() / (half - 1) as f64) as f32;
    let inv: Vec<f32> = (0..half).map(|k| (-inc * k as f32).exp()).collect();
    let mut data = Vec::with_capacity(length * channels);
    for t in 0..length {
        data.extend(inv.iter().map(|&v| (t as f32 * v).sin()));
        data.extend(inv.iter().map(|&v| (t as f32 * v).cos()));
    }
    Tensor::from_vec(data, (length, channels), device)
}

/// `Qwen3OmniMoeAudioAttention`: bidirectional attention inside each block of `cu_seqlens`.
#[derive(Debug, Clone)]
struct AudioAttention {
    q_proj: Linear,
    k_proj: Linear,
    v_proj: Linear,
    out_proj: Linear,
    num_heads: usize,
    scaling: f64,
}

impl AudioAttention {
    fn new(cfg: &AudioEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.d_model;
        if cfg.encoder_attention_heads == 0 || !d.is_multiple_of(cfg.encoder_attention_heads) {
            candle_core::bail!(
                "d_model {d} is not divisible by encoder_attention_heads {}",
                cfg.encoder_attention_heads
            );
        }
        let head_dim = d / cfg.encoder_attention_heads;
        Ok(Self {
            q_proj: candle_nn::linear(d, d, vb.pp("q_proj"))?,
            k_proj: candle_nn::linear(d, d, vb.pp("k_proj"))?,
            v_proj: candle_nn::linear(d, d, vb.pp("v_proj"))?,
            out_proj: candle_nn::linear(d, d, vb.pp("out_proj"))?,
            num_heads: cfg.encoder_attention_heads,
            scaling: (head_dim as f64).powf(-0.5),
        })
    }

    /// `xs`: `[seq, d_model]`; `cu_seqlens`: block boundaries `0 = c0 < c1 < ... = seq`.
    fn forward(&self, xs: &Tensor, cu_seqlens: &[usize]) -> Result<Tensor> {
        let (seq, d) = xs.dims2()?;
        let heads = |t: Tensor| t.reshape((seq, self.num_heads, ()))?.transpose(0, 1);
        let q = heads(self.q_proj.forward(xs)?)?;
        let k = heads(self.k_proj.forward(xs)?)?;
        let v = heads(self.v_proj.forward(xs)?)?;
        let mut outs = Vec::with_capacity(cu_seqlens.len().saturating_sub(1));
        for w in cu_seqlens.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            let q = q.narrow(1, start, len)?.contiguous()?;
            let k = k.narrow(1, start, len)?.contiguous()?;
            let v = v.narrow(1, start, len)?.contiguous()?;
            let att = (q.matmul(&k.t()?)? * self.scaling)?;
            let att = candle_nn::ops::softmax_last_dim(&att)?;
            outs.push(att.matmul(&v)?);
        }
        let out = Tensor::cat(&outs, 1)?.transpose(0, 1)?.reshape((seq, d))?;
        self.out_proj.forward(&out)
    }
}

/// `Qwen3OmniMoeAudioEncoderLayer`: pre-norm attention and GELU MLP, both residual.
#[derive(Debug, Clone)]
struct AudioEncoderLayer {
    self_attn: AudioAttention,
    self_attn_layer_norm: LayerNorm,
    fc1: Linear,
    fc2: Linear,
    final_layer_norm: LayerNorm,
    act: Activation,
}

impl AudioEncoderLayer {
    fn new(cfg: &AudioEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let d = cfg.d_model;
        Ok(Self {
            self_attn: AudioAttention::new(cfg, vb.pp("self_attn"))?,
            self_attn_layer_norm: candle_nn::layer_norm(d, 1e-5, vb.pp("self_attn_layer_norm"))?,
            fc1: candle_nn::linear(d, cfg.encoder_ffn_dim, vb.pp("fc1"))?,
            fc2: candle_nn::linear(cfg.encoder_ffn_dim, d, vb.pp("fc2"))?,
            final_layer_norm: candle_nn::layer_norm(d, 1e-5, vb.pp("final_layer_norm"))?,
            act: cfg.activation_function,
        })
    }

    fn forward(&self, xs: &Tensor, cu_seqlens: &[usize]) -> Result<Tensor> {
        let h = self.self_attn_layer_norm.forward(xs)?;
        let xs = (xs + self.self_attn.forward(&h, cu_seqlens)?)?;
        let h = self.final_layer_norm.forward(&xs)?;
        let h = self
            .fc2
            .forward(&self.act.forward(&self.fc1.forward(&h)?)?)?;
        xs + h
    }
}

/// `Qwen3OmniMoeAudioEncoder`: log-mel features to the Thinker's audio embeddings.
#[derive(Debug, Clone)]
pub struct AudioEncoder {
    conv2d1: Conv2d,
    conv2d2: Conv2d,
    conv2d3: Conv2d,
    conv_out: Linear,
    positional_embedding: Tensor,
    layers: Vec<AudioEncoderLayer>,
    ln_post: LayerNorm,
    proj1: Linear,
    proj2: Linear,
    act: Activation,
    cfg: AudioEncoderConfig,
}

impl AudioEncoder {
    /// `vb` scoped to the encoder (`vb.pp("thinker").pp("audio_tower")`).
    pub fn new(cfg: &AudioEncoderConfig, vb: VarBuilder) -> Result<Self> {
        if cfg.n_window == 0 || cfg.n_window_infer < 2 * cfg.n_window {
            candle_core::bail!(
                "audio encoder needs n_window > 0 and n_window_infer >= 2 * n_window (got {} and {})",
                cfg.n_window,
                cfg.n_window_infer
            );
        }
        let ds = cfg.downsample_hidden_size;
        let conv = Conv2dConfig {
            padding: 1,
            stride: 2,
            ..Default::default()
        };
        let freq = conv_out_len(cfg.num_mel_bins);
        let layers = (0..cfg.encoder_layers)
            .map(|i| AudioEncoderLayer::new(cfg, vb.pp("layers").pp(i)))
            .collect::<Result<Vec<_>>>()?;
        // candle's CPU conv2d has no bf16/f16 kernel: the (small) conv stack runs in
        // f32 there, whatever the model's dtype.
        let cv = if vb.device().is_cpu() {
            vb.to_dtype(DType::F32)
        } else {
            vb.clone()
        };
        Ok(Self {
            conv2d1: candle_nn::conv2d(1, ds, 3, conv, cv.pp("conv2d1"))?,
            conv2d2: candle_nn::conv2d(ds, ds, 3, conv, cv.pp("conv2d2"))?,
            conv2d3: candle_nn::conv2d(ds, ds, 3, conv, cv.pp("conv2d3"))?,
            conv_out: candle_nn::linear_no_bias(ds * freq, cfg.d_model, vb.pp("conv_out"))?,
            // A buffer, not a checkpoint tensor.
            positional_embedding: sinusoids(cfg.max_source_positions, cfg.d_model, vb.device())?
                .to_dtype(vb.dtype())?,
            layers,
            ln_post: candle_nn::layer_norm(cfg.d_model, 1e-5, vb.pp("ln_post"))?,
            proj1: candle_nn::linear(cfg.d_model, cfg.d_model, vb.pp("proj1"))?,
            proj2: candle_nn::linear(cfg.d_model, cfg.output_dim, vb.pp("proj2"))?,
            act: cfg.activation_function,
            cfg: cfg.clone(),
        })
    }

    pub fn config(&self) -> &AudioEncoderConfig {
        &self.cfg
    }

    /// Audio tokens of an utterance of `frames` mel frames.
    pub fn output_len(&self, frames: usize) -> usize {
        feat_extract_output_lengths(frames, self.cfg.n_window)
    }

    /// The reference's `audio_tower(input_features, feature_lens)` (what
    /// `get_audio_features` calls): `features` `[num_mel_bins, sum(lens)]` holds the
    /// utterances' frames one after another; returns `[sum(output_len(len)), output_dim]`,
    /// the utterances' embeddings in order. All chunks of the call are padded to the
    /// longest one, as the reference pads them (see the module docs).
    pub fn forward(&self, features: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let (mels, total) = features.dims2()?;
        if mels != self.cfg.num_mel_bins {
            candle_core::bail!("expected {} mel bins, got {mels}", self.cfg.num_mel_bins);
        }
        if lens.iter().sum::<usize>() != total || lens.is_empty() || lens.contains(&0) {
            candle_core::bail!("feature lengths {lens:?} do not split {total} frames");
        }
        let chunk = 2 * self.cfg.n_window;

        // chunk_and_pad_features: chunks of `chunk` frames, the tail one shorter.
        let mut chunk_lens = Vec::new();
        for &len in lens {
            chunk_lens.extend(std::iter::repeat_n(chunk, len / chunk));
            if !len.is_multiple_of(chunk) {
                chunk_lens.push(len % chunk);
            }
        }
        let max_len = chunk_lens.iter().copied().max().unwrap_or(0);
        let mut start = 0;
        let mut padded = Vec::with_capacity(chunk_lens.len());
        for &l in &chunk_lens {
            let c = features.narrow(1, start, l)?;
            padded.push(c.pad_with_zeros(1, 0, max_len - l)?);
            start += l;
        }
        let padded = Tensor::stack(&padded, 0)?
            .unsqueeze(1)?
            .to_dtype(self.conv2d1.weight().dtype())?;

        // The conv stack, `conv_chunksize` chunks at a time (memory only).
        let mut embeds = Vec::new();
        let n_chunks = chunk_lens.len();
        let step = self.cfg.conv_chunksize.max(1);
        for s in (0..n_chunks).step_by(step) {
            let x = padded.narrow(0, s, step.min(n_chunks - s))?;
            let x = self.conv2d1.forward(&x)?.gelu_erf()?;
            let x = self.conv2d2.forward(&x)?.gelu_erf()?;
            embeds.push(self.conv2d3.forward(&x)?.gelu_erf()?);
        }
        let x = Tensor::cat(&embeds, 0)?.to_dtype(self.positional_embedding.dtype())?;
        let (b, c, f, t) = x.dims4()?;
        let x = x.permute((0, 3, 1, 2))?.reshape((b, t, c * f))?;
        let x = self.conv_out.forward(&x)?;
        if t > self.positional_embedding.dim(0)? {
            candle_core::bail!("chunk of {t} tokens exceeds max_source_positions");
        }
        let x = x.broadcast_add(&self.positional_embedding.narrow(0, 0, t)?.unsqueeze(0)?)?;

        // get_valid_indices: the real tokens of every chunk, packed.
        let mut idx = Vec::new();
        for (i, &l) in chunk_lens.iter().enumerate() {
            idx.extend((0..conv_out_len(l)).map(|j| (i * t + j) as u32));
        }
        let idx = Tensor::new(idx.as_slice(), x.device())?;
        let mut xs = x.reshape((b * t, ()))?.index_select(&idx, 0)?;

        // get_audio_cu_seqlens: blocks of `window` tokens inside each utterance.
        let window = conv_out_len(max_len) * (self.cfg.n_window_infer / chunk);
        let mut cu = vec![0usize];
        for &len in lens {
            let n = feat_extract_output_lengths(len, self.cfg.n_window);
            let mut bounds = vec![window; n / window];
            if !n.is_multiple_of(window) {
                bounds.push(n % window);
            }
            for w in bounds {
                cu.push(cu[cu.len() - 1] + w);
            }
        }

        for layer in &self.layers {
            xs = layer.forward(&xs, &cu)?;
        }
        let xs = self.ln_post.forward(&xs)?;
        let xs = self.act.forward(&self.proj1.forward(&xs)?)?;
        self.proj2.forward(&xs)
    }

    /// Like [`forward`](Self::forward), but every utterance encodes exactly as it would
    /// alone (the reference's single-request result), whatever else is in the batch:
    /// utterances of at least `2 * n_window` frames (whose chunks are padded to the full
    /// chunk either way) go through one call, shorter ones each through their own.
    pub fn forward_independent(&self, features: &Tensor, lens: &[usize]) -> Result<Tensor> {
        let chunk = 2 * self.cfg.n_window;
        let mut starts = Vec::with_capacity(lens.len());
        let mut s = 0;
        for &l in lens {
            starts.push(s);
            s += l;
        }
        let long: Vec<usize> = (0..lens.len()).filter(|&i| lens[i] >= chunk).collect();
        let mut outs: Vec<Option<Tensor>> = vec![None; lens.len()];
        if !long.is_empty() {
            let feats = long
                .iter()
                .map(|&i| features.narrow(1, starts[i], lens[i]))
                .collect::<Result<Vec<_>>>()?;
            let long_lens: Vec<usize> = long.iter().map(|&i| lens[i]).collect();
            let out = self.forward(&Tensor::cat(&feats, 1)?, &long_lens)?;
            let mut o = 0;
            for &i in &long {
                let n = self.output_len(lens[i]);
                outs[i] = Some(out.narrow(0, o, n)?);
                o += n;
            }
        }
        for i in 0..lens.len() {
            if outs[i].is_none() {
                outs[i] =
                    Some(self.forward(&features.narrow(1, starts[i], lens[i])?, &lens[i..=i])?);
            }
        }
        let outs: Vec<Tensor> = outs.into_iter().flatten().collect();
        Tensor::cat(&outs, 0)
    }
}

/// Sample rate of the PCM the front end takes.
pub const SAMPLE_RATE: usize = 16000;
const N_FFT: usize = 400;
const HOP: usize = 160;

/// The processor's log-mel front end (transformers' `WhisperFeatureExtractor` with
/// the released `preprocessor_config.json`: 128 bins, n_fft 400, hop 160, no dither),
/// for one utterance as the processor handles a single audio: centered STFT with
/// reflect padding, periodic Hann window, power spectrum, slaney mel filterbank,
/// log10 clamped at 1e-10, floored at (max - 8), (x + 4) / 4, and the last STFT frame
/// dropped, so `len / 160` frames. The reference runs this in float32 (torch.stft);
/// here the DFT and filterbank run in float64, which differs from it by float32
/// rounding only.
#[derive(Debug, Clone)]
pub struct AudioFeatureExtractor {
    /// The Hann-windowed FFT of N_FFT samples.
    stft: stft::Stft,
    /// `[n_bins, n_mels]`.
    filters: Tensor,
}

impl AudioFeatureExtractor {
    pub fn new(n_mels: usize) -> Result<Self> {
        Ok(Self {
            stft: stft::Stft::new(N_FFT),
            filters: stft::mel_basis(SAMPLE_RATE, N_FFT, n_mels)?,
        })
    }

    /// Frames the front end makes of `samples` samples.
    pub fn frames(samples: usize) -> usize {
        samples / HOP
    }

    /// Log-mel features `[n_mels, pcm.len() / 160]` (f32, on `device`) of 16 kHz mono PCM.
    /// Like the reference (whose reflect padding needs it), at least 201 samples.
    pub fn extract(&self, pcm: &[f32], device: &Device) -> Result<Tensor> {
        let pad = N_FFT / 2;
        if pcm.len() <= pad {
            candle_core::bail!(
                "audio of {} samples is too short (at least {} needed)",
                pcm.len(),
                pad + 1
            );
        }
        let n_frames = pcm.len() / HOP;
        let (re, im) = self.stft.spectrum(pcm, HOP, pad, n_frames)?;
        let power = (re.sqr()? + im.sqr()?)?;
        let mel = power
            .matmul(&self.filters)?
            .clamp(1e-10, f64::INFINITY)?
            .log()?;
        let log10 = (mel / std::f64::consts::LN_10)?;
        let max = log10.max_keepdim(0)?.max_keepdim(1)?;
        let log10 = log10.broadcast_maximum(&(max - 8.0)?)?;
        let out = ((log10 + 4.0)? / 4.0)?;
        out.t()?
            .to_dtype(DType::F32)?
            .contiguous()?
            .to_device(device)
    }
}

#[cfg(test)]
mod tests {
    use super::super::fixtures;
    use super::*;

    fn config() -> AudioEncoderConfig {
        let cfg = fixtures::config();
        serde_json::from_value(cfg["thinker_config"]["audio_config"].clone()).expect("audio config")
    }

    fn encoder(cfg: &AudioEncoderConfig) -> AudioEncoder {
        AudioEncoder::new(cfg, fixtures::weights().pp("thinker").pp("audio_tower"))
            .expect("encoder")
    }

    fn pcm(io: &std::collections::HashMap<String, Tensor>, i: usize) -> Vec<f32> {
        io[&format!("pcm_{i}")].to_vec1::<f32>().expect("pcm")
    }

    /// Largest deviation of any token from the mean token: how much the output depends on
    /// the input (the tiny model's `ln_post` weight is small, so outputs are ~0.1).
    fn spread(t: &Tensor) -> f32 {
        let mean = t.mean_keepdim(0).unwrap();
        let d = t.broadcast_sub(&mean).unwrap().abs().unwrap();
        d.flatten_all()
            .unwrap()
            .max(0)
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
    }

    const N: usize = 3;

    #[test]
    fn config_parses_with_tiny_and_released_names() {
        let cfg = config();
        assert_eq!(
            (cfg.encoder_layers, cfg.d_model, cfg.encoder_attention_heads),
            (2, 32, 4)
        );
        assert_eq!(
            (cfg.n_window, cfg.n_window_infer, cfg.downsample_hidden_size),
            (50, 800, 16)
        );
        assert_eq!(cfg.activation_function, Activation::Gelu);
    }

    #[test]
    fn log_mel_matches_reference() {
        let io = fixtures::io("audio_encoder");
        let fe = AudioFeatureExtractor::new(128).unwrap();
        for i in 0..N {
            let mel = fe.extract(&pcm(&io, i), &Device::Cpu).unwrap();
            let want = &io[&format!("mel_{i}")];
            let err = fixtures::max_abs_diff(&mel, want);
            println!("mel {i} {:?}: max abs err {err:e}", mel.dims());
            assert!(err <= 1e-4, "mel {i}: {err}");
        }
    }

    #[test]
    fn encoder_matches_reference_alone() {
        let io = fixtures::io("audio_encoder");
        let mut cfg = config();
        for (infer, suffix) in [(800, ""), (200, "_infer200")] {
            cfg.n_window_infer = infer;
            let enc = encoder(&cfg);
            for i in 0..N {
                let mel = &io[&format!("mel_{i}")];
                let out = enc.forward(mel, &[mel.dim(1).unwrap()]).unwrap();
                let want = &io[&format!("out_{i}{suffix}")];
                let err = fixtures::max_abs_diff(&out, want);
                let spread = spread(want);
                println!(
                    "encoder {i}{suffix} {:?}: max abs err {err:e} (token spread {spread})",
                    out.dims()
                );
                assert!(
                    spread > 100.0 * 1e-4,
                    "reference output barely depends on the input"
                );
                assert!(err <= 1e-4, "encoder {i}{suffix}: {err}");
            }
        }
    }

    fn batch(io: &std::collections::HashMap<String, Tensor>) -> (Tensor, Vec<usize>) {
        let mels: Vec<Tensor> = (0..N).map(|i| io[&format!("mel_{i}")].clone()).collect();
        let lens = mels.iter().map(|m| m.dim(1).unwrap()).collect();
        (Tensor::cat(&mels, 1).unwrap(), lens)
    }

    #[test]
    fn encoder_matches_reference_batched() {
        let io = fixtures::io("audio_encoder");
        // The longest utterance (30 tokens) spans two attention blocks at n_window_infer 200
        // (26 tokens each), so the block restriction changes the reference's result.
        let blocks = fixtures::max_abs_diff(&io["out_2"], &io["out_2_infer200"]);
        assert!(
            blocks > 1e-2,
            "n_window_infer 200 should change utterance 2: {blocks}"
        );
        let (feats, lens) = batch(&io);
        let mut cfg = config();
        for (infer, suffix) in [(800, ""), (200, "_infer200")] {
            cfg.n_window_infer = infer;
            let out = encoder(&cfg).forward(&feats, &lens).unwrap();
            let want = &io[&format!("out_batch{suffix}")];
            let err = fixtures::max_abs_diff(&out, want);
            println!(
                "encoder batch{suffix} {:?}: max abs err {err:e}",
                out.dims()
            );
            assert!(err <= 1e-4, "batch{suffix}: {err}");
        }
    }

    #[test]
    fn independent_batch_equals_each_alone() {
        let io = fixtures::io("audio_encoder");
        let (feats, lens) = batch(&io);
        let enc = encoder(&config());
        // Twice, in two orders: no state carries between calls or utterances.
        for order in [[0usize, 1, 2], [2, 0, 1]] {
            let f: Vec<Tensor> = order
                .iter()
                .map(|&i| io[&format!("mel_{i}")].clone())
                .collect();
            let l: Vec<usize> = order.iter().map(|&i| lens[i]).collect();
            let out = enc
                .forward_independent(&Tensor::cat(&f, 1).unwrap(), &l)
                .unwrap();
            let mut o = 0;
            for &i in &order {
                let n = enc.output_len(lens[i]);
                let got = out.narrow(0, o, n).unwrap();
                let alone = enc.forward(&io[&format!("mel_{i}")], &lens[i..=i]).unwrap();
                let err_alone = fixtures::max_abs_diff(&got, &alone);
                let err_ref = fixtures::max_abs_diff(&got, &io[&format!("out_{i}")]);
                println!("independent {i}: vs alone {err_alone:e}, vs reference alone {err_ref:e}");
                assert!(err_alone <= 1e-6 && err_ref <= 1e-4);
                o += n;
            }
            assert_eq!(o, out.dim(0).unwrap());
        }
        // The reference's own batch result differs for the short utterance (padding).
        let plain = enc.forward(&feats, &lens).unwrap();
        let short = fixtures::max_abs_diff(&plain.narrow(0, 0, 9).unwrap(), &io["out_0"]);
        println!("reference-style batch vs alone, short utterance: {short:e}");
        assert!(short > 1e-4);
    }

    #[test]
    fn end_to_end_pcm_to_embeddings() {
        let io = fixtures::io("audio_encoder");
        let fe = AudioFeatureExtractor::new(128).unwrap();
        let enc = encoder(&config());
        let mut feats = Vec::new();
        let mut lens = Vec::new();
        for i in 0..N {
            let mel = fe.extract(&pcm(&io, i), &Device::Cpu).unwrap();
            lens.push(mel.dim(1).unwrap());
            let out = enc.forward(&mel, &lens[i..=i]).unwrap();
            let err = fixtures::max_abs_diff(&out, &io[&format!("out_{i}")]);
            println!("pcm -> embeddings {i}: max abs err {err:e}");
            assert!(err <= 1e-4, "end to end {i}: {err}");
            feats.push(mel);
        }
        let out = enc
            .forward(&Tensor::cat(&feats, 1).unwrap(), &lens)
            .unwrap();
        let err = fixtures::max_abs_diff(&out, &io["out_batch"]);
        println!("pcm -> embeddings, batch: max abs err {err:e}");
        assert!(err <= 1e-4);
    }

    #[test]
    fn output_lengths_match_reference() {
        let io = fixtures::io("audio_encoder");
        let lens_in = io["len_in"].to_vec1::<i64>().unwrap();
        let lens_out = io["len_out"].to_vec1::<i64>().unwrap();
        for (&i, &o) in lens_in.iter().zip(&lens_out) {
            assert_eq!(
                feat_extract_output_lengths(i as usize, 50) as i64,
                o,
                "{i} frames"
            );
        }
        let enc = encoder(&config());
        for i in 0..N {
            let frames = io[&format!("mel_{i}")].dim(1).unwrap();
            assert_eq!(
                enc.output_len(frames),
                io[&format!("out_{i}")].dim(0).unwrap()
            );
            assert_eq!(AudioFeatureExtractor::frames(pcm(&io, i).len()), frames);
        }
    }
}
