//! Piper VITS voices (e.g. `en_US-joe-medium`) in candle, read straight from the
//! Piper `.onnx` export and its `.onnx.json`.
//!
//! The graph is VITS inference as in piper's `vits` package:
//! `enc_p` (text encoder) -> `dp` (stochastic duration predictor, reverse) -> length
//! regulation -> `z_p = m_p + randn * exp(logs_p) * noise_scale` -> `flow` (reverse) ->
//! `dec` (HiFi-GAN). [`PiperVoice::latents`] is everything before `dec` (the "Talker"
//! half), [`PiperVoice::decode`] / [`DecoderStream`] is `dec` (the "Code2Wav" half).
//!
//! Every hyper-parameter is derived from the initializer shapes and the node attributes
//! of the graph ([`PiperHyper::from_weights`]). For `en_US-joe-medium` they are:
//!
//! | module | values |
//! |---|---|
//! | enc_p | n_vocab 256, hidden 192, filter 768, 2 heads (k_channels 96), 6 layers, FFN kernel 3 (relu), window 4, LayerNorm eps 1e-5, out (inter) 192 |
//! | dp | filter 192, DDSConv kernel 3 x 3 layers (dilations 1, 3, 9, exact GELU), 4 ConvFlows (3 used in reverse), 10 bins, tail bound 5 |
//! | flow | 4 mean-only coupling layers, WN hidden 192, kernel 5, dilation rate 1, 4 layers |
//! | dec | conv_pre 192->256 k7; upsample rates [8, 8, 4], kernels [16, 16, 8] (channels 256->128->64->32); ResBlock "2", kernels [3, 5, 7], dilations [[1, 2], [2, 6], [3, 12]]; leaky slope 0.1, final 0.01; conv_post 32->1 k7 (no bias); tanh; hop 256 |
//!
//! Execution: the convolution-heavy parts (`dec`, `flow`, the encoder FFNs) run on the
//! host on time-major buffers with a direct convolution kernel (AVX2+FMA when the CPU
//! has it, else portable; `PIPER_THREADS` caps its threads, default: available cores
//! up to 8). Attention, the duration predictor and the glue are candle ops on the
//! load device. The streaming decoder's lookahead for this voice is 2728 samples
//! (11 frames).

mod duration;
mod flow;
mod hifigan;
pub mod onnx_weights;
mod text_encoder;

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use rand_distr::{Distribution, StandardNormal};

pub use hifigan::DecoderStream;
use onnx_weights::OnnxWeights;

use crate::models::{ModelError, Result};

/// Hyper-parameters of a Piper VITS graph, derived from its weights and nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct PiperHyper {
    /// Rows of the phoneme embedding (`num_symbols`).
    pub n_vocab: usize,
    /// Text encoder width.
    pub hidden_channels: usize,
    /// Latent (z) channels: half of `enc_p.proj`'s outputs.
    pub inter_channels: usize,
    /// Text encoder FFN width.
    pub filter_channels: usize,
    pub n_heads: usize,
    pub n_layers: usize,
    pub ffn_kernel_size: usize,
    /// Relative attention window (emb_rel_k has 2w+1 rows).
    pub window_size: usize,
    pub dp_filter_channels: usize,
    pub dp_kernel_size: usize,
    pub dp_n_layers: usize,
    pub dp_n_flows: usize,
    pub dp_num_bins: usize,
    pub dp_tail_bound: f32,
    pub flow_n_flows: usize,
    pub flow_hidden_channels: usize,
    pub flow_kernel_size: usize,
    pub flow_dilation_rate: usize,
    pub flow_wn_layers: usize,
    pub dec_initial_channel: usize,
    pub dec_conv_pre_kernel: usize,
    pub upsample_rates: Vec<usize>,
    pub upsample_kernel_sizes: Vec<usize>,
    /// "1" (convs1/convs2 pairs) or "2" (single convs).
    pub resblock: String,
    pub resblock_kernel_sizes: Vec<usize>,
    pub resblock_dilations: Vec<Vec<usize>>,
    pub dec_leaky_slope: f32,
    pub dec_final_leaky_slope: f32,
    pub dec_conv_post_kernel: usize,
    /// Product of the upsample rates: samples per latent frame.
    pub hop_length: usize,
}

impl PiperHyper {
    pub fn from_weights(w: &OnnxWeights) -> Result<Self> {
        let bad = |msg: String| ModelError::Format {
            path: w.path().to_path_buf(),
            msg,
        };
        let emb = w.dims("enc_p.emb.weight")?;
        let [n_vocab, hidden_channels] = emb[..] else {
            return Err(bad(format!("enc_p.emb.weight has shape {emb:?}")));
        };
        // Conv weights are [out, in, k]; anything else is a Format error.
        let conv_dims = |name: &str| -> Result<[usize; 3]> {
            let d = w.dims(name)?;
            match d[..] {
                [a, b, c] => Ok([a, b, c]),
                _ => Err(bad(format!(
                    "{name} has shape {d:?}, expected [out, in, k]"
                ))),
            }
        };
        let proj = conv_dims("enc_p.proj.weight")?;
        let inter_channels = proj[0] / 2;
        let ffn = conv_dims("enc_p.encoder.ffn_layers.0.conv_1.weight")?;
        let rel = w.dims("enc_p.encoder.attn_layers.0.emb_rel_k")?;
        if rel.len() != 3 || rel[2] == 0 || hidden_channels % rel[2] != 0 || rel[1] % 2 == 0 {
            return Err(bad(format!("emb_rel_k has shape {rel:?}")));
        }
        let dp_pre = conv_dims("dp.pre.weight")?;
        let dp_sep = w.conv_attrs("dp.convs.convs_sep.0")?;
        let mut dp_last_flow: usize = 0;
        for i in 0..64 {
            if w.contains(&format!("dp.flows.{i}.pre.weight")) {
                dp_last_flow = i;
            }
        }
        // ConvFlows sit at odd indices (flows = [affine, (ConvFlow, Flip) x n]).
        if dp_last_flow & 1 == 0 {
            return Err(bad("dp.flows: no ConvFlow at an odd index".into()));
        }
        let dp_proj = conv_dims(&format!("dp.flows.{dp_last_flow}.proj.weight"))?;
        let dp_tail_bound = w
            .node_scalar(&format!("/dp/flows.{dp_last_flow}/LessOrEqual"))
            .unwrap_or(5.0);
        let flow_n_flows = {
            let mut n = 0;
            while w.contains(&format!("flow.flows.{}.pre.weight", 2 * n)) {
                n += 1;
            }
            n
        };
        let flow_pre = conv_dims("flow.flows.0.pre.weight")?;
        let flow_in0 = w.conv_attrs("flow.flows.0.enc.in_layers.0")?;
        let flow_dilation_rate = match w.conv_attrs("flow.flows.0.enc.in_layers.1") {
            Ok(a) => a.dilation,
            Err(_) => 1,
        };
        let flow_wn_layers = w.count("flow.flows.0.enc.in_layers.", ".weight");

        let conv_pre = conv_dims("dec.conv_pre.weight")?;
        let n_ups = w.count("dec.ups.", ".weight");
        let mut upsample_rates = Vec::new();
        let mut upsample_kernel_sizes = Vec::new();
        for i in 0..n_ups {
            let a = w.conv_attrs(&format!("dec.ups.{i}"))?;
            if a.op_type != "ConvTranspose" {
                return Err(bad(format!("dec.ups.{i} is a {}", a.op_type)));
            }
            upsample_rates.push(a.stride);
            upsample_kernel_sizes.push(a.kernel);
        }
        let n_res = w.count("dec.resblocks.", ".convs.0.weight")
            + w.count("dec.resblocks.", ".convs1.0.weight");
        let num_kernels = n_res.checked_div(n_ups).unwrap_or(0);
        if num_kernels == 0 || num_kernels * n_ups != n_res {
            return Err(bad(format!("dec: {n_ups} upsamplers, {n_res} resblocks")));
        }
        let resblock = if w.contains("dec.resblocks.0.convs1.0.weight") {
            "1"
        } else {
            "2"
        };
        let mut resblock_kernel_sizes = Vec::new();
        let mut resblock_dilations = Vec::new();
        for j in 0..num_kernels {
            let p = if resblock == "1" {
                format!("dec.resblocks.{j}.convs1.")
            } else {
                format!("dec.resblocks.{j}.convs.")
            };
            let n = w.count(&p, ".weight");
            let mut dil = Vec::new();
            for c in 0..n {
                dil.push(w.conv_attrs(&format!("{p}{c}"))?.dilation);
            }
            resblock_kernel_sizes.push(w.conv_attrs(&format!("{p}0"))?.kernel);
            resblock_dilations.push(dil);
        }
        // Leaky slopes: the first LeakyRelu of dec, and the one feeding conv_post.
        let dec_leaky_slope = w
            .node("/dec/LeakyRelu")
            .and_then(|n| n.floats.get("alpha").copied())
            .unwrap_or(0.1);
        let post_input = w
            .node("/dec/conv_post/Conv")
            .and_then(|n| n.inputs.first().cloned())
            .unwrap_or_default();
        let dec_final_leaky_slope = w
            .nodes()
            .iter()
            .find(|n| n.op_type == "LeakyRelu" && n.outputs.contains(&post_input))
            .and_then(|n| n.floats.get("alpha").copied())
            .unwrap_or(0.01);
        let conv_post = w.conv_attrs("dec.conv_post")?;

        Ok(Self {
            n_vocab,
            hidden_channels,
            inter_channels,
            filter_channels: ffn[0],
            n_heads: hidden_channels / rel[2],
            n_layers: w.count("enc_p.encoder.attn_layers.", ".conv_q.weight"),
            ffn_kernel_size: ffn[2],
            window_size: (rel[1] - 1) / 2,
            dp_filter_channels: dp_pre[0],
            dp_kernel_size: dp_sep.kernel,
            dp_n_layers: w.count("dp.convs.convs_sep.", ".weight"),
            dp_n_flows: dp_last_flow.div_ceil(2),
            dp_num_bins: (dp_proj[0] + 1) / 3,
            dp_tail_bound,
            flow_n_flows,
            flow_hidden_channels: flow_pre[0],
            flow_kernel_size: flow_in0.kernel,
            flow_dilation_rate,
            flow_wn_layers,
            dec_initial_channel: conv_pre[0],
            dec_conv_pre_kernel: conv_pre[2],
            hop_length: upsample_rates.iter().product(),
            upsample_rates,
            upsample_kernel_sizes,
            resblock: resblock.to_string(),
            resblock_kernel_sizes,
            resblock_dilations,
            dec_leaky_slope,
            dec_final_leaky_slope,
            dec_conv_post_kernel: conv_post.kernel,
        })
    }
}

/// Inference scales, as in the `.onnx.json` "inference" section.
#[derive(Debug, Clone, PartialEq)]
pub struct Scales {
    /// Scale of the prior noise (z_p).
    pub noise_scale: f32,
    /// Duration multiplier (> 1 is slower).
    pub length_scale: f32,
    /// Scale of the duration predictor's noise.
    pub noise_w: f32,
}

impl Default for Scales {
    /// The VITS/Piper defaults; a voice's own are in [`PiperConfig::default_scales`].
    fn default() -> Self {
        Self {
            noise_scale: 0.667,
            length_scale: 1.0,
            noise_w: 0.8,
        }
    }
}

/// The voice's `.onnx.json`.
#[derive(Debug, Clone)]
pub struct PiperConfig {
    pub sample_rate: u32,
    pub espeak_voice: String,
    pub default_scales: Scales,
    /// One char (a phoneme) -> ids. Keys of more than one char are left out.
    pub phoneme_id_map: HashMap<char, Vec<i64>>,
    pub num_symbols: usize,
    pub num_speakers: usize,
    /// "espeak" for espeak-ng IPA voices.
    pub phoneme_type: String,
    pub language_code: String,
}

impl PiperConfig {
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| ModelError::Io {
            path: path.to_path_buf(),
            source: e,
        })?;
        Self::parse(&text).map_err(|msg| ModelError::Format {
            path: path.to_path_buf(),
            msg,
        })
    }

    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let v: serde_json::Value = serde_json::from_str(text).map_err(|e| e.to_string())?;
        let sample_rate = v
            .pointer("/audio/sample_rate")
            .and_then(|x| x.as_u64())
            .ok_or("audio.sample_rate is missing")?;
        let sample_rate =
            u32::try_from(sample_rate).map_err(|_| "audio.sample_rate is out of range")?;
        let espeak_voice = v
            .pointer("/espeak/voice")
            .and_then(|x| x.as_str())
            .unwrap_or("")
            .to_string();
        let d = Scales::default();
        let scale = |key: &str, default: f32| -> std::result::Result<f32, String> {
            match v.pointer(&format!("/inference/{key}")) {
                None => Ok(default),
                Some(x) => x
                    .as_f64()
                    .map(|f| f as f32)
                    .ok_or_else(|| format!("inference.{key} is not a number")),
            }
        };
        let default_scales = Scales {
            noise_scale: scale("noise_scale", d.noise_scale)?,
            length_scale: scale("length_scale", d.length_scale)?,
            noise_w: scale("noise_w", d.noise_w)?,
        };
        let map = v
            .get("phoneme_id_map")
            .and_then(|m| m.as_object())
            .ok_or("phoneme_id_map is missing")?;
        let mut phoneme_id_map = HashMap::new();
        for (k, ids) in map {
            let mut chars = k.chars();
            let (Some(c), None) = (chars.next(), chars.next()) else {
                continue;
            };
            let ids = ids
                .as_array()
                .ok_or_else(|| format!("phoneme_id_map[{k:?}] is not a list"))?
                .iter()
                .map(|i| i.as_i64())
                .collect::<Option<Vec<i64>>>()
                .ok_or_else(|| format!("phoneme_id_map[{k:?}] has a non-integer id"))?;
            phoneme_id_map.insert(c, ids);
        }
        for special in ['_', '^', '$'] {
            if !phoneme_id_map.contains_key(&special) {
                return Err(format!("phoneme_id_map has no {special:?}"));
            }
        }
        let num_symbols = v
            .get("num_symbols")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(0);
        let num_speakers = v
            .get("num_speakers")
            .and_then(|x| x.as_u64())
            .map(|x| x as usize)
            .unwrap_or(1);
        let phoneme_type = v
            .get("phoneme_type")
            .and_then(|x| x.as_str())
            .unwrap_or("espeak")
            .to_string();
        let language_code = v
            .pointer("/language/code")
            .and_then(|x| x.as_str())
            .unwrap_or("")
            .to_string();
        Ok(Self {
            sample_rate,
            espeak_voice,
            default_scales,
            phoneme_id_map,
            num_symbols,
            num_speakers,
            phoneme_type,
            language_code,
        })
    }
}

/// A Piper voice: text encoder, duration predictor, flow and HiFi-GAN decoder.
pub struct PiperVoice {
    config: PiperConfig,
    hyper: PiperHyper,
    device: Device,
    enc: text_encoder::TextEncoder,
    dp: duration::DurationPredictor,
    flow: flow::FlowBlock,
    dec: hifigan::Generator,
}

/// Upper bound on the frames one call of [`PiperVoice::latents`] may produce (~12 min).
pub const MAX_FRAMES: usize = 1 << 16;

impl PiperVoice {
    pub fn load(onnx_path: &Path, json_path: &Path, device: &Device) -> Result<Self> {
        let config = PiperConfig::load(json_path)?;
        if config.num_speakers > 1 {
            return Err(ModelError::Invalid(format!(
                "{}: multi-speaker Piper voices are not supported",
                json_path.display()
            )));
        }
        let w = OnnxWeights::load(onnx_path, device)?;
        let hyper = PiperHyper::from_weights(&w)?;
        if config.num_symbols != 0 && config.num_symbols != hyper.n_vocab {
            return Err(ModelError::Format {
                path: json_path.to_path_buf(),
                msg: format!(
                    "num_symbols {} but the model embeds {}",
                    config.num_symbols, hyper.n_vocab
                ),
            });
        }
        let enc = text_encoder::TextEncoder::load(&w, &hyper)?;
        let dp = duration::DurationPredictor::load(&w, &hyper)?;
        let flow = flow::FlowBlock::load(&w, &hyper)?;
        let dec = hifigan::Generator::load(&w, &hyper)?;
        Ok(Self {
            config,
            hyper,
            device: device.clone(),
            enc,
            dp,
            flow,
            dec,
        })
    }

    pub fn config(&self) -> &PiperConfig {
        &self.config
    }

    /// The hyper-parameters read off the graph.
    pub fn hyper(&self) -> &PiperHyper {
        &self.hyper
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    pub fn sample_rate(&self) -> u32 {
        self.config.sample_rate
    }

    /// Samples per latent frame (product of the upsample rates).
    pub fn hop_length(&self) -> usize {
        self.hyper.hop_length
    }

    /// Channels of z.
    pub fn latent_channels(&self) -> usize {
        self.hyper.inter_channels
    }

    /// IPA phoneme string -> ids the way piper(-phonemize) does: BOS "^", PAD "_", then
    /// every phoneme char followed by PAD, then EOS "$". Unknown chars are skipped.
    /// (The input is taken char by char as given; piper NFD-decomposes espeak's output
    /// before this step, which is the phonemizer's job.)
    pub fn phoneme_ids(&self, phonemes: &str) -> Vec<i64> {
        let map = &self.config.phoneme_id_map;
        let get = |c: char| map.get(&c).map(|v| v.as_slice()).unwrap_or(&[]);
        let pad = get('_');
        let mut ids = Vec::with_capacity(2 * phonemes.len() + 3);
        ids.extend_from_slice(get('^'));
        ids.extend_from_slice(pad);
        for c in phonemes.chars() {
            if let Some(v) = map.get(&c) {
                ids.extend_from_slice(v);
                ids.extend_from_slice(pad);
            }
        }
        ids.extend_from_slice(get('$'));
        ids
    }

    /// ids -> latent frames z [1, C, T] (the reversed flow's output, the decoder's input).
    /// `rng` draws the duration noise ([1, 2, N], first) and the prior noise ([1, C, T]);
    /// with noise_scale = noise_w = 0 nothing is drawn and the result is deterministic.
    pub fn latents(
        &self,
        ids: &[i64],
        scales: &Scales,
        rng: &mut impl rand::Rng,
    ) -> Result<Tensor> {
        Ok(self.latents_with_durations(ids, scales, rng)?.0)
    }

    /// [`Self::latents`] plus the frames each id got (w_ceil).
    pub fn latents_with_durations(
        &self,
        ids: &[i64],
        scales: &Scales,
        rng: &mut impl rand::Rng,
    ) -> Result<(Tensor, Vec<usize>)> {
        if ids.is_empty() {
            return Err(ModelError::Invalid(
                "piper: empty phoneme id sequence".into(),
            ));
        }
        if let Some(bad) = ids
            .iter()
            .find(|&&i| i < 0 || i as u64 >= self.hyper.n_vocab as u64)
        {
            return Err(ModelError::Invalid(format!(
                "piper: phoneme id {bad} is outside 0..{}",
                self.hyper.n_vocab
            )));
        }
        let finite = scales.noise_scale.is_finite()
            && scales.noise_w.is_finite()
            && scales.length_scale.is_finite();
        if !finite || scales.length_scale <= 0.0 {
            return Err(ModelError::Invalid(format!("piper: bad scales {scales:?}")));
        }
        let n = ids.len();
        let enc = self.enc.forward(ids)?;

        let mut noise = [vec![0f32; n], vec![0f32; n]];
        if scales.noise_w != 0.0 {
            for row in noise.iter_mut() {
                for v in row.iter_mut() {
                    let r: f32 = StandardNormal.sample(rng);
                    *v = r * scales.noise_w;
                }
            }
        }
        let logw = self.dp.reverse(&enc.x, noise)?;
        let mut durations = Vec::with_capacity(n);
        let mut total = 0usize;
        for &lw in &logw {
            let w = (lw.exp() * scales.length_scale).ceil();
            if !(w.is_finite() && w >= 0.0) || w > MAX_FRAMES as f32 {
                return Err(ModelError::Invalid(format!(
                    "piper: duration {w} is out of range (logw {lw})"
                )));
            }
            let w = w as usize;
            total += w;
            durations.push(w);
        }
        if total > MAX_FRAMES {
            return Err(ModelError::Invalid(format!(
                "piper: {total} frames is more than {MAX_FRAMES}"
            )));
        }
        let c = self.hyper.inter_channels;
        let (m, logs) = if total == 0 {
            // y_lengths is clamped to 1 and the path is empty: one frame of zeros.
            let z = Tensor::zeros((1, c, 1), candle_core::DType::F32, &self.device)?;
            (z.clone(), z)
        } else {
            let mut idx = Vec::with_capacity(total);
            for (i, &d) in durations.iter().enumerate() {
                idx.extend(std::iter::repeat_n(i as u32, d));
            }
            let idx = Tensor::from_vec(idx, total, &self.device)?;
            (
                enc.m_p.index_select(&idx, 2)?,
                enc.logs_p.index_select(&idx, 2)?,
            )
        };
        let frames = total.max(1);
        let z_p = if scales.noise_scale != 0.0 {
            let eps: Vec<f32> = (0..c * frames)
                .map(|_| StandardNormal.sample(&mut *rng))
                .collect();
            let eps = Tensor::from_vec(eps, (1, c, frames), &self.device)?;
            (m + (eps * logs.exp()?)?.affine(scales.noise_scale as f64, 0.0)?)?
        } else {
            m
        };
        let z = self.flow.reverse(&z_p)?;
        Ok((z, durations))
    }

    fn check_z(&self, z: &Tensor) -> Result<usize> {
        let c = self.hyper.inter_channels;
        match z.dims() {
            &[1, cz, t] if cz == c && t >= 1 => {
                if z.dtype() != candle_core::DType::F32 {
                    return Err(ModelError::Invalid(format!(
                        "piper: z must be f32, got {:?}",
                        z.dtype()
                    )));
                }
                Ok(t)
            }
            d => Err(ModelError::Invalid(format!(
                "piper: z must be [1, {c}, T >= 1], got {d:?}"
            ))),
        }
    }

    /// z [1, C, T] -> mono f32 PCM, exactly T * hop_length samples.
    pub fn decode(&self, z: &Tensor) -> Result<Vec<f32>> {
        self.check_z(z)?;
        self.dec.forward(z)
    }

    /// A streaming decoder; see [`DecoderStream`].
    pub fn decoder_stream(&self) -> DecoderStream {
        DecoderStream::new(&self.dec)
    }
}

// ---------------------------------------------------------------------------
// Shared building blocks.

/// Conv1d on [1, C, L] tensors with explicit left/right zero padding, optional
/// dilation, and groups = 1 or depthwise. Computed as im2col tiles x one GEMM.
pub(crate) struct Conv1d {
    pub(crate) cin: usize,
    pub(crate) cout: usize,
    pub(crate) kernel: usize,
    pub(crate) dilation: usize,
    pub(crate) pad_left: usize,
    pub(crate) pad_right: usize,
    depthwise: bool,
    /// groups = 1: [cout, cin * kernel]; depthwise: [cout, kernel].
    w2: Tensor,
    /// [cout, 1]
    bias: Option<Tensor>,
    /// Output columns per im2col tile.
    tile: usize,
}

/// Bytes of one im2col tile (keeps it within L2).
const IM2COL_TILE_BYTES: usize = 2 << 20;

impl Conv1d {
    /// weight [cout, cin / groups, kernel]; groups must be 1 or cin (= cout).
    pub(crate) fn new(
        weight: Tensor,
        bias: Option<Tensor>,
        dilation: usize,
        groups: usize,
        pad_left: usize,
        pad_right: usize,
    ) -> Result<Self> {
        let (cout, cin_g, kernel) = weight.dims3()?;
        if kernel == 0 || dilation == 0 || groups == 0 {
            return Err(ModelError::Invalid(
                "conv: zero kernel/dilation/groups".into(),
            ));
        }
        let cin = cin_g * groups;
        let depthwise = groups > 1;
        if depthwise && !(cin_g == 1 && groups == cout) {
            return Err(ModelError::Invalid(format!(
                "conv: groups {groups} with weight {:?} is not supported",
                weight.dims()
            )));
        }
        let w2 = weight.reshape((cout, cin_g * kernel))?.contiguous()?;
        let bias = match bias {
            Some(b) => {
                if b.dims() != [cout] {
                    return Err(ModelError::Invalid(format!(
                        "conv: bias {:?} for {cout} outputs",
                        b.dims()
                    )));
                }
                Some(b.reshape((cout, 1))?)
            }
            None => None,
        };
        let tile = (IM2COL_TILE_BYTES / (4 * cin * kernel)).max(256);
        Ok(Self {
            cin,
            cout,
            kernel,
            dilation,
            pad_left,
            pad_right,
            depthwise,
            w2,
            bias,
            tile,
        })
    }

    /// `{module}.weight` / `{module}.bias` with the attributes of its Conv node.
    pub(crate) fn load(w: &OnnxWeights, module: &str) -> Result<Self> {
        let weight = w.get(&format!("{module}.weight"))?;
        let bias_name = format!("{module}.bias");
        let bias = if w.contains(&bias_name) {
            Some(w.get(&bias_name)?)
        } else {
            None
        };
        let a = w.conv_attrs(module)?;
        if a.op_type != "Conv" || a.stride != 1 {
            return Err(ModelError::Format {
                path: w.path().to_path_buf(),
                msg: format!(
                    "{module}: {} with stride {} is not supported",
                    a.op_type, a.stride
                ),
            });
        }
        let c = Self::new(weight, bias, a.dilation, a.group, a.pad_left, a.pad_right)?;
        if c.kernel != a.kernel {
            return Err(ModelError::Format {
                path: w.path().to_path_buf(),
                msg: format!("{module}: kernel {} but weight {}", a.kernel, c.kernel),
            });
        }
        Ok(c)
    }

    /// Receptive field minus one: inputs consumed beyond the outputs produced.
    pub(crate) fn span(&self) -> usize {
        self.dilation * (self.kernel - 1)
    }

    /// [1, cin, L] -> [1, cout, L + pad_left + pad_right - span]
    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.pad_left > 0 || self.pad_right > 0 {
            x.pad_with_zeros(2, self.pad_left, self.pad_right)?
        } else {
            x.clone()
        };
        self.forward_valid(&x)
    }

    /// Unpadded ("valid") convolution: [1, cin, L] -> [1, cout, L - span].
    pub(crate) fn forward_valid(&self, x: &Tensor) -> Result<Tensor> {
        let (b, c, l) = x.dims3()?;
        let span = self.span();
        if b != 1 || c != self.cin || l <= span {
            return Err(ModelError::Invalid(format!(
                "conv: input {:?} for cin {} and span {span}",
                x.dims(),
                self.cin
            )));
        }
        let lout = l - span;
        let x2 = x.squeeze(0)?;
        let d = self.dilation;
        let y = if self.depthwise {
            let mut acc: Option<Tensor> = None;
            for j in 0..self.kernel {
                let term = x2
                    .narrow(1, j * d, lout)?
                    .broadcast_mul(&self.w2.narrow(1, j, 1)?)?;
                acc = Some(match acc {
                    Some(a) => (a + term)?,
                    None => term,
                });
            }
            acc.ok_or_else(|| ModelError::Invalid("conv: empty kernel".into()))?
        } else {
            let mut outs = Vec::with_capacity(lout.div_ceil(self.tile));
            let mut s = 0;
            while s < lout {
                let n = self.tile.min(lout - s);
                let col = if self.kernel == 1 {
                    x2.narrow(1, s, n)?
                } else {
                    let taps = (0..self.kernel)
                        .map(|j| x2.narrow(1, s + j * d, n)?.unsqueeze(1))
                        .collect::<candle_core::Result<Vec<_>>>()?;
                    Tensor::cat(&taps, 1)?.reshape((self.cin * self.kernel, n))?
                };
                outs.push(self.w2.matmul(&col)?);
                s += n;
            }
            Tensor::cat(&outs, 1)?
        };
        let y = match &self.bias {
            Some(bias) => y.broadcast_add(bias)?,
            None => y,
        };
        Ok(y.unsqueeze(0)?)
    }
}

/// LayerNorm over the channel dim of [1, C, T] (VITS `modules.LayerNorm`).
pub(crate) struct ChannelNorm {
    gamma: Tensor,
    beta: Tensor,
    eps: f64,
}

impl ChannelNorm {
    pub(crate) fn load(w: &OnnxWeights, p: &str, channels: usize) -> Result<Self> {
        Ok(Self {
            gamma: w
                .get_shaped(&format!("{p}.gamma"), &[channels])?
                .reshape((channels, 1))?,
            beta: w
                .get_shaped(&format!("{p}.beta"), &[channels])?
                .reshape((channels, 1))?,
            eps: 1e-5,
        })
    }

    pub(crate) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let mean = x.mean_keepdim(1)?;
        let xc = x.broadcast_sub(&mean)?;
        let var = xc.sqr()?.mean_keepdim(1)?;
        let y = xc.broadcast_div(&(var + self.eps)?.sqrt()?)?;
        Ok(y.broadcast_mul(&self.gamma)?.broadcast_add(&self.beta)?)
    }
}
