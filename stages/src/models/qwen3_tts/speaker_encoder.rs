//! Qwen3-TTS's speaker encoder (`Qwen3TTSSpeakerEncoder`, weights under
//! `speaker_encoder`, Base checkpoints): ECAPA-TDNN over a 24 kHz clip's log-mel
//! spectrogram to one x-vector as wide as the Talker, which the prompt takes in a
//! preset speaker's place (x-vector voice cloning).
//!
//! The front end is qwen-tts's `mel_spectrogram` (n_fft 1024, hop 256, Hann
//! window 1024, reflect padding of 384 on each side and no centring, magnitude
//! `sqrt(re² + im² + 1e-9)`, librosa's slaney mel filterbank (128 bins, 0 to 12
//! kHz), `ln(max(x, 1e-5))`); the DFT and filterbank run in float64 here.
//! Every conv is `padding="same"` with reflect padding, as the reference's.
//!
//! Several clips can be embedded at once ([`SpeakerEncoder::embed_batch`]),
//! right-padded to the longest, each exactly as alone: every conv reflects
//! each clip at its own ends (one gather a conv), and the squeeze-excitation
//! means and the attentive pooling count only each clip's own frames
//! ([`Rows`]).

use candle_core::{DType, Device, Result, Tensor, D};
use candle_nn::VarBuilder;

use super::config::SpeakerEncoderConfig;
use crate::models::stft;

const N_FFT: usize = 1024;
const HOP: usize = 256;
const RATE: usize = 24_000;

/// qwen-tts's `mel_spectrogram` for the speaker encoder: `(1, frames, n_mels)` f32.
#[derive(Debug, Clone)]
pub struct MelFrontEnd {
    /// The Hann-windowed FFT of N_FFT samples.
    stft: stft::Stft,
    /// `[n_bins, n_mels]`.
    filters: Tensor,
}

impl MelFrontEnd {
    pub fn new(n_mels: usize) -> Result<Self> {
        Ok(Self {
            stft: stft::Stft::new(N_FFT),
            filters: stft::mel_basis(RATE, N_FFT, n_mels)?,
        })
    }

    /// Frames of a clip of `samples` samples (0 when it is too short for one).
    pub fn frames(samples: usize) -> usize {
        let padded = samples + (N_FFT - HOP);
        match padded >= N_FFT {
            true => (padded - N_FFT) / HOP + 1,
            false => 0,
        }
    }

    /// `(1, frames, n_mels)` f32 on `device` of 24 kHz mono PCM in [-1, 1]: at
    /// least 385 samples (the reflect padding needs one more than it pads).
    pub fn extract(&self, pcm: &[f32], device: &Device) -> Result<Tensor> {
        let pad = (N_FFT - HOP) / 2;
        if pcm.len() <= pad {
            candle_core::bail!(
                "a clip of {} samples is too short (at least {} needed)",
                pcm.len(),
                pad + 1
            );
        }
        let (re, im) = self.stft.spectrum(pcm, HOP, pad, Self::frames(pcm.len()))?;
        let mag = ((re.sqr()? + im.sqr()?)? + 1e-9)?.sqrt()?;
        mag.matmul(&self.filters)?
            .clamp(1e-5, f64::INFINITY)?
            .log()?
            .to_dtype(DType::F32)?
            .unsqueeze(0)?
            .to_device(device)
    }
}

/// `x` (b, c, t) reflect-padded by `left` and `right` samples on the time axis.
fn reflect_pad(x: &Tensor, left: usize, right: usize) -> Result<Tensor> {
    if left == 0 && right == 0 {
        return Ok(x.clone());
    }
    let t = x.dim(2)?;
    if left >= t || right >= t {
        candle_core::bail!("reflect padding of {left}/{right} needs more than {t} frames");
    }
    let idx: Vec<u32> = (0..left)
        .map(|i| (left - i) as u32)
        .chain((0..t).map(|i| i as u32))
        .chain((0..right).map(|i| (t - 2 - i) as u32))
        .collect();
    let idx = Tensor::from_vec(idx, left + t + right, x.device())?;
    // A Res2Net part is a view across channels: contiguous only for one clip.
    x.contiguous()?.index_select(&idx, 2)
}

/// The frame counts of a batch of clips right-padded to the longest `t`:
/// how each conv pads and how time is pooled so that each clip is as alone.
#[derive(Debug, Clone)]
struct Rows {
    lens: Vec<usize>,
    t: usize,
    /// `(b, 1, t)`: 1 on a clip's frames, 0 past them; `None` when every
    /// clip fills `t`.
    mask: Option<Tensor>,
    /// `(b, 1, t)`: 0 on a clip's frames, -inf past them.
    beyond: Option<Tensor>,
    /// `(b, 1, 1)`: each clip's frame count.
    counts: Tensor,
}

impl Rows {
    fn new(lens: &[usize], dtype: DType, device: &Device) -> Result<Self> {
        let t = lens.iter().copied().max().unwrap_or(0);
        let b = lens.len();
        let per_frame = |inside: f32, past: f32| -> Result<Option<Tensor>> {
            if lens.iter().all(|&l| l == t) {
                return Ok(None);
            }
            let m: Vec<f32> = lens
                .iter()
                .flat_map(|&l| (0..t).map(move |j| if j < l { inside } else { past }))
                .collect();
            Ok(Some(
                Tensor::from_vec(m, (b, 1, t), device)?.to_dtype(dtype)?,
            ))
        };
        let counts: Vec<f32> = lens.iter().map(|&l| l as f32).collect();
        Ok(Self {
            lens: lens.to_vec(),
            t,
            mask: per_frame(1.0, 0.0)?,
            beyond: per_frame(0.0, f32::NEG_INFINITY)?,
            counts: Tensor::from_vec(counts, (b, 1, 1), device)?.to_dtype(dtype)?,
        })
    }

    /// `x` `(b, c, t)` reflect-padded by `left` and `right`, each clip at its
    /// own ends (what is past a clip's padded end is its last frame, unread).
    /// With no padding (a k=1 conv) `x` is returned as it is, whatever its length.
    fn pad(&self, x: &Tensor, left: usize, right: usize) -> Result<Tensor> {
        if self.mask.is_none() || left + right == 0 {
            return reflect_pad(x, left, right);
        }
        let (b, c, t) = x.dims3()?;
        if let Some(l) = self.lens.iter().find(|&&l| left >= l || right >= l) {
            candle_core::bail!("reflect padding of {left}/{right} needs more than {l} frames");
        }
        let width = left + t + right;
        let idx: Vec<u32> = self
            .lens
            .iter()
            .flat_map(|&l| {
                (0..width).map(move |p| {
                    let q = p as isize - left as isize;
                    let last = l as isize - 1;
                    let r = match q {
                        q if q < 0 => -q,
                        q if q <= last => q,
                        q if q <= last + right as isize => 2 * last - q,
                        _ => last,
                    };
                    r as u32
                })
            })
            .collect();
        let idx = Tensor::from_vec(idx, (b, 1, width), x.device())?
            .broadcast_as((b, c, width))?
            .contiguous()?;
        x.contiguous()?.gather(&idx, 2)
    }

    /// The mean over each clip's frames, `(b, c, 1)`.
    fn mean(&self, x: &Tensor) -> Result<Tensor> {
        match &self.mask {
            None => x.mean_keepdim(2),
            Some(m) => x
                .broadcast_mul(m)?
                .sum_keepdim(2)?
                .broadcast_div(&self.counts),
        }
    }

    /// Equal weights over each clip's frames, `(b, 1, t)`, summing to 1.
    fn uniform(&self, b: usize, device: &Device, dtype: DType) -> Result<Tensor> {
        match &self.mask {
            None => Tensor::full(1.0 / self.t as f64, (b, 1, self.t), device)?.to_dtype(dtype),
            Some(m) => m.broadcast_div(&self.counts),
        }
    }

    /// Softmax over time of `a` `(b, c, t)`, within each clip's frames.
    fn softmax(&self, a: &Tensor) -> Result<Tensor> {
        let a = match &self.beyond {
            None => a.clone(),
            Some(m) => a.broadcast_add(m)?,
        };
        candle_nn::ops::softmax(&a, D::Minus1)
    }
}

/// `nn.Conv1d(padding="same", padding_mode="reflect")`.
#[derive(Debug, Clone)]
struct SameConv {
    weight: Tensor,
    bias: Tensor,
    dilation: usize,
    left: usize,
    right: usize,
}

impl SameConv {
    fn new(
        cin: usize,
        cout: usize,
        kernel: usize,
        dilation: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        let total = dilation * (kernel - 1);
        Ok(Self {
            weight: vb.get((cout, cin, kernel), "weight")?,
            bias: vb.get(cout, "bias")?.reshape((1, cout, 1))?,
            dilation,
            left: total / 2,
            right: total - total / 2,
        })
    }
}

impl SameConv {
    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        rows.pad(x, self.left, self.right)?
            .conv1d(&self.weight, 0, 1, self.dilation, 1)?
            .broadcast_add(&self.bias)
    }
}

/// `TimeDelayNetBlock`: a same conv, ReLU.
#[derive(Debug, Clone)]
struct Tdnn(SameConv);

impl Tdnn {
    fn new(
        cin: usize,
        cout: usize,
        kernel: usize,
        dilation: usize,
        vb: VarBuilder,
    ) -> Result<Self> {
        Ok(Self(SameConv::new(
            cin,
            cout,
            kernel,
            dilation,
            vb.pp("conv"),
        )?))
    }
}

impl Tdnn {
    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        self.0.forward(x, rows)?.relu()
    }
}

/// `SqueezeExcitationRes2NetBlock`: TDNN, Res2Net, TDNN, squeeze-excitation, residual.
#[derive(Debug, Clone)]
struct SeRes2NetBlock {
    tdnn1: Tdnn,
    res2net: Vec<Tdnn>,
    scale: usize,
    tdnn2: Tdnn,
    se_conv1: SameConv,
    se_conv2: SameConv,
}

impl SeRes2NetBlock {
    fn new(cfg: &SpeakerEncoderConfig, i: usize, vb: VarBuilder) -> Result<Self> {
        let (cin, cout) = (cfg.enc_channels[i - 1], cfg.enc_channels[i]);
        let scale = cfg.enc_res2net_scale;
        if scale < 2 || cout % scale != 0 || cin != cout {
            candle_core::bail!(
                "speaker encoder block {i}: channels {cin}->{cout} with scale {scale}"
            );
        }
        let part = cout / scale;
        let (k, d) = (cfg.enc_kernel_sizes[i], cfg.enc_dilations[i]);
        let res2net = (0..scale - 1)
            .map(|j| Tdnn::new(part, part, k, d, vb.pp("res2net_block").pp("blocks").pp(j)))
            .collect::<Result<Vec<_>>>()?;
        let se = vb.pp("se_block");
        Ok(Self {
            tdnn1: Tdnn::new(cin, cout, 1, 1, vb.pp("tdnn1"))?,
            res2net,
            scale,
            tdnn2: Tdnn::new(cout, cout, 1, 1, vb.pp("tdnn2"))?,
            se_conv1: SameConv::new(cout, cfg.enc_se_channels, 1, 1, se.pp("conv1"))?,
            se_conv2: SameConv::new(cfg.enc_se_channels, cout, 1, 1, se.pp("conv2"))?,
        })
    }
}

impl SeRes2NetBlock {
    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        let h = self.tdnn1.forward(x, rows)?;
        let parts = h.chunk(self.scale, 1)?;
        let mut outs: Vec<Tensor> = Vec::with_capacity(self.scale);
        for (i, p) in parts.iter().enumerate() {
            let o = match i {
                0 => p.clone(),
                1 => self.res2net[0].forward(p, rows)?,
                _ => self.res2net[i - 1].forward(&(p + &outs[i - 1])?, rows)?,
            };
            outs.push(o);
        }
        let h = self.tdnn2.forward(&Tensor::cat(&outs, 1)?, rows)?;
        // The squeeze-excitation convs are k=1 over one frame: they pad nothing.
        let s = self.se_conv1.forward(&rows.mean(&h)?, rows)?.relu()?;
        let s = candle_nn::ops::sigmoid(&self.se_conv2.forward(&s, rows)?)?;
        h.broadcast_mul(&s)? + x
    }
}

/// `AttentiveStatisticsPooling` over each clip's frames: the attention-
/// weighted mean and standard deviation per channel, `(b, 2c, 1)`.
#[derive(Debug, Clone)]
struct AttentiveStatsPool {
    tdnn: Tdnn,
    conv: SameConv,
}

const STATS_EPS: f64 = 1e-12;

/// Weighted mean and std over time: `w` (b, c|1, t) sums to 1 over t.
fn stats(x: &Tensor, w: &Tensor) -> Result<(Tensor, Tensor)> {
    let mean = x.broadcast_mul(w)?.sum_keepdim(2)?;
    let var = x
        .broadcast_sub(&mean)?
        .sqr()?
        .broadcast_mul(w)?
        .sum_keepdim(2)?
        .clamp(STATS_EPS, f64::INFINITY)?;
    Ok((mean, var.sqrt()?))
}

impl AttentiveStatsPool {
    fn forward(&self, x: &Tensor, rows: &Rows) -> Result<Tensor> {
        let (b, c, t) = x.dims3()?;
        let (mean, std) = stats(x, &rows.uniform(b, x.device(), x.dtype())?)?;
        let ctx = Tensor::cat(
            &[
                x.clone(),
                mean.broadcast_as((b, c, t))?.contiguous()?,
                std.broadcast_as((b, c, t))?.contiguous()?,
            ],
            1,
        )?;
        let a = self
            .conv
            .forward(&self.tdnn.forward(&ctx, rows)?.tanh()?, rows)?;
        let a = rows.softmax(&a)?;
        let (mean, std) = stats(x, &a)?;
        Tensor::cat(&[mean, std], 1)
    }
}

/// `Qwen3TTSSpeakerEncoder`.
#[derive(Debug, Clone)]
pub struct SpeakerEncoder {
    first: Tdnn,
    blocks: Vec<SeRes2NetBlock>,
    mfa: Tdnn,
    asp: AttentiveStatsPool,
    fc: SameConv,
    mel: MelFrontEnd,
    cfg: SpeakerEncoderConfig,
}

impl SpeakerEncoder {
    /// `vb` at `speaker_encoder`.
    pub fn new(cfg: &SpeakerEncoderConfig, vb: VarBuilder) -> Result<Self> {
        let n = cfg.enc_channels.len();
        if n < 3 || cfg.enc_kernel_sizes.len() != n || cfg.enc_dilations.len() != n {
            candle_core::bail!("speaker encoder: enc_channels, kernel sizes and dilations differ");
        }
        let c = &cfg.enc_channels;
        let mfa_in: usize = c[1..n - 1].iter().sum();
        let blocks = vb.pp("blocks");
        Ok(Self {
            first: Tdnn::new(
                cfg.mel_dim,
                c[0],
                cfg.enc_kernel_sizes[0],
                cfg.enc_dilations[0],
                blocks.pp(0),
            )?,
            blocks: (1..n - 1)
                .map(|i| SeRes2NetBlock::new(cfg, i, blocks.pp(i)))
                .collect::<Result<Vec<_>>>()?,
            mfa: Tdnn::new(
                mfa_in,
                c[n - 1],
                cfg.enc_kernel_sizes[n - 1],
                cfg.enc_dilations[n - 1],
                vb.pp("mfa"),
            )?,
            asp: AttentiveStatsPool {
                tdnn: Tdnn::new(
                    c[n - 1] * 3,
                    cfg.enc_attention_channels,
                    1,
                    1,
                    vb.pp("asp").pp("tdnn"),
                )?,
                conv: SameConv::new(
                    cfg.enc_attention_channels,
                    c[n - 1],
                    1,
                    1,
                    vb.pp("asp").pp("conv"),
                )?,
            },
            fc: SameConv::new(c[n - 1] * 2, cfg.enc_dim, 1, 1, vb.pp("fc"))?,
            mel: MelFrontEnd::new(cfg.mel_dim)?,
            cfg: cfg.clone(),
        })
    }

    /// The shortest clip [`Self::embed_pcm`] takes: enough frames for every
    /// conv's reflect padding.
    pub fn min_samples(&self) -> usize {
        let reach = self
            .cfg
            .enc_kernel_sizes
            .iter()
            .zip(&self.cfg.enc_dilations)
            .map(|(k, d)| d * (k - 1) / 2 + 1)
            .max()
            .unwrap_or(1);
        (reach + 1) * HOP
    }

    /// The x-vector `(enc_dim,)` of log-mels `(1, frames, mel_dim)`.
    pub fn forward(&self, mels: &Tensor) -> Result<Tensor> {
        self.forward_batch(std::slice::from_ref(mels))?.squeeze(0)
    }

    /// The x-vectors `(b, enc_dim)` of clips' log-mels, each `(1, frames,
    /// mel_dim)` with its own frame count, each as [`Self::forward`] alone.
    pub fn forward_batch(&self, mels: &[Tensor]) -> Result<Tensor> {
        let dtype = self.fc.weight.dtype();
        let device = self.fc.weight.device();
        let lens = mels.iter().map(|m| m.dim(1)).collect::<Result<Vec<_>>>()?;
        let rows = Rows::new(&lens, dtype, device)?;
        let padded = mels
            .iter()
            .zip(&lens)
            .map(|(m, &l)| m.to_dtype(dtype)?.pad_with_zeros(1, 0, rows.t - l))
            .collect::<Result<Vec<_>>>()?;
        let x = Tensor::cat(&padded, 0)?.transpose(1, 2)?.contiguous()?;
        let mut h = self.first.forward(&x, &rows)?;
        let mut outs = Vec::with_capacity(self.blocks.len());
        for b in &self.blocks {
            h = b.forward(&h, &rows)?;
            outs.push(h.clone());
        }
        let h = self.mfa.forward(&Tensor::cat(&outs, 1)?, &rows)?;
        let pooled = self.asp.forward(&h, &rows)?;
        // k=1 over the pooled frame: it pads nothing.
        self.fc.forward(&pooled, &rows)?.squeeze(2)
    }

    /// The x-vector of 24 kHz mono PCM in [-1, 1].
    pub fn embed_pcm(&self, pcm: &[f32]) -> Result<Tensor> {
        self.embed_batch(&[pcm])?.squeeze(0)
    }

    /// The x-vectors `(b, enc_dim)` of several clips at once, each as
    /// [`Self::embed_pcm`] alone.
    pub fn embed_batch(&self, clips: &[&[f32]]) -> Result<Tensor> {
        let device = self.fc.weight.device();
        let mels = clips
            .iter()
            .map(|pcm| {
                if pcm.len() < self.min_samples() {
                    candle_core::bail!(
                        "a reference clip of {} samples is too short (at least {})",
                        pcm.len(),
                        self.min_samples()
                    );
                }
                self.mel.extract(pcm, device)
            })
            .collect::<Result<Vec<_>>>()?;
        self.forward_batch(&mels)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::models::qwen3_omni::fixtures::max_abs_diff;
    use crate::models::qwen3_tts::config::Qwen3TtsConfig;
    use crate::models::qwen3_tts::fixtures;

    fn encoder() -> SpeakerEncoder {
        let cfg = Qwen3TtsConfig::load(&fixtures::model_dir()).unwrap();
        let se = cfg.speaker_encoder_config.unwrap();
        SpeakerEncoder::new(&se, fixtures::weights().pp("speaker_encoder")).unwrap()
    }

    #[test]
    fn mel_and_xvector_match_reference() {
        let enc = encoder();
        let io = fixtures::io("speaker");
        let pcm: Vec<f32> = io["pcm"].to_vec1().unwrap();
        let mel = enc.mel.extract(&pcm, &Device::Cpu).unwrap();
        let e = max_abs_diff(&mel, &io["mel"]);
        assert!(e < 1e-4, "log-mel {e}");
        // From the reference's own mels: the network alone.
        let e = max_abs_diff(&enc.forward(&io["mel"]).unwrap(), &io["embedding"]);
        assert!(e < 1e-4, "x-vector from the reference mels {e}");
        let e = max_abs_diff(&enc.embed_pcm(&pcm).unwrap(), &io["embedding"]);
        assert!(e < 1e-4, "x-vector from PCM {e}");
    }

    /// Clips of different lengths embedded together, each as alone.
    #[test]
    fn a_batch_embeds_each_clip_as_alone() {
        let enc = encoder();
        let io = fixtures::io("speaker");
        let pcm: Vec<f32> = io["pcm"].to_vec1().unwrap();
        let n = pcm.len();
        let min = enc.min_samples();
        let clips: Vec<&[f32]> = vec![&pcm, &pcm[..min], &pcm[n / 3..], &pcm[..n / 2 + 77]];
        let batch = enc.embed_batch(&clips).unwrap();
        assert_eq!(batch.dims(), [4, enc.cfg.enc_dim]);
        for (i, clip) in clips.iter().enumerate() {
            let alone = enc.embed_pcm(clip).unwrap();
            let e = max_abs_diff(&batch.get(i).unwrap(), &alone);
            assert!(e < 1e-5, "clip {i} ({} samples): {e}", clip.len());
        }
        let e = max_abs_diff(&batch.get(0).unwrap(), &io["embedding"]);
        assert!(e < 1e-4, "the reference's clip in a batch {e}");
        // Clips of one length (no clip is padded): the same as alone.
        let same = enc.embed_batch(&[&pcm, &pcm[..]]).unwrap();
        for i in 0..2 {
            let e = max_abs_diff(&same.get(i).unwrap(), &io["embedding"]);
            assert!(e < 1e-4, "equal clips, clip {i}: {e}");
        }
    }

    #[test]
    fn short_clips_are_refused() {
        let enc = encoder();
        let n = enc.min_samples();
        assert!(enc.embed_pcm(&vec![0.1; n - 1]).is_err());
        let quiet = enc.embed_pcm(&vec![0.0; n]).unwrap();
        assert!(quiet
            .to_vec1::<f32>()
            .unwrap()
            .iter()
            .all(|v| v.is_finite()));
    }
}
