//! `enc_p`: VITS TextEncoder (piper `vits/models.py` TextEncoder + `attentions.py` Encoder).
//!
//! emb(ids) * sqrt(hidden) -> n_layers x [relative-position MHA (window w, heads share
//! the relative embeddings) -> +res -> LayerNorm -> FFN(conv k, relu, conv k) -> +res ->
//! LayerNorm] -> proj (1x1) -> split m_p / logs_p. Batch 1 and no padding, so every
//! mask of the reference is all ones and is left out.

use candle_core::{Device, Tensor};

use super::hifigan::RawConv;
use super::onnx_weights::OnnxWeights;
use super::{ChannelNorm, Conv1d, PiperHyper};
use crate::models::{ModelError, Result};

struct Attention {
    conv_q: Conv1d,
    conv_k: Conv1d,
    conv_v: Conv1d,
    conv_o: Conv1d,
    /// [2w+1, k_channels]
    emb_rel_k: Tensor,
    emb_rel_v: Tensor,
    n_heads: usize,
    k_channels: usize,
    window: usize,
}

impl Attention {
    fn load(w: &OnnxWeights, p: &str, h: &PiperHyper) -> Result<Self> {
        let kc = h.hidden_channels / h.n_heads;
        let rel = [1, 2 * h.window_size + 1, kc];
        Ok(Self {
            conv_q: Conv1d::load(w, &format!("{p}.conv_q"))?,
            conv_k: Conv1d::load(w, &format!("{p}.conv_k"))?,
            conv_v: Conv1d::load(w, &format!("{p}.conv_v"))?,
            conv_o: Conv1d::load(w, &format!("{p}.conv_o"))?,
            emb_rel_k: w.get_shaped(&format!("{p}.emb_rel_k"), &rel)?.squeeze(0)?,
            emb_rel_v: w.get_shaped(&format!("{p}.emb_rel_v"), &rel)?.squeeze(0)?,
            n_heads: h.n_heads,
            k_channels: kc,
            window: h.window_size,
        })
    }

    /// x: [1, H, T] -> [1, H, T]
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let t = x.dim(2)?;
        let (nh, kc, w) = (self.n_heads, self.k_channels, self.window);
        let dev = x.device();
        // [1, H, T] -> [heads, T, kc]
        let heads = |y: Tensor| -> Result<Tensor> {
            Ok(y.reshape((nh, kc, t))?.transpose(1, 2)?.contiguous()?)
        };
        let q = heads(self.conv_q.forward(x)?)?;
        let k = heads(self.conv_k.forward(x)?)?;
        let v = heads(self.conv_v.forward(x)?)?;
        let q = (q / (kc as f64).sqrt())?;
        // [heads, T, T]
        let scores = q.matmul(&k.transpose(1, 2)?.contiguous()?)?;
        // Relative keys: rel[h, i, r] = q_i . E_k[r], r = (j - i) + w.
        let n_rel = 2 * w + 1;
        let rel = q.matmul(
            &self
                .emb_rel_k
                .t()?
                .contiguous()?
                .unsqueeze(0)?
                .broadcast_as((nh, kc, n_rel))?
                .contiguous()?,
        )?;
        let (idx_k, mask_k) = band_index(t, w, dev, true)?;
        let idx_k = idx_k.unsqueeze(0)?.broadcast_as((nh, t, t))?.contiguous()?;
        let local = rel.gather(&idx_k, 2)?.broadcast_mul(&mask_k)?;
        let scores = (scores + local)?;
        let p = candle_nn::ops::softmax_last_dim(&scores)?;
        let out = p.matmul(&v)?;
        // Relative values: rw[h, i, r] = p[h, i, i + r - w].
        let (idx_v, mask_v) = band_index(t, w, dev, false)?;
        let idx_v = idx_v
            .unsqueeze(0)?
            .broadcast_as((nh, t, n_rel))?
            .contiguous()?;
        let rw = p.gather(&idx_v, 2)?.broadcast_mul(&mask_v)?;
        let out = (out
            + rw.matmul(
                &self
                    .emb_rel_v
                    .unsqueeze(0)?
                    .broadcast_as((nh, n_rel, kc))?
                    .contiguous()?,
            )?)?;
        // [heads, T, kc] -> [1, H, T]
        let out = out
            .transpose(1, 2)?
            .contiguous()?
            .reshape((1, nh * kc, t))?;
        self.conv_o.forward(&out)
    }
}

/// Index/mask tensors for the banded relative-position gathers.
/// keys=true: [T, T], idx[i, j] = j - i + w (clamped), mask = |j - i| <= w.
/// keys=false: [T, 2w+1], idx[i, r] = i + r - w (clamped), mask = 0 <= i + r - w < T.
fn band_index(t: usize, w: usize, dev: &Device, keys: bool) -> Result<(Tensor, Tensor)> {
    let cols = if keys { t } else { 2 * w + 1 };
    let mut idx = Vec::with_capacity(t * cols);
    let mut mask = Vec::with_capacity(t * cols);
    for i in 0..t as i64 {
        for c in 0..cols as i64 {
            let (v, lo, hi) = if keys {
                (c - i + w as i64, 0i64, 2 * w as i64)
            } else {
                (i + c - w as i64, 0i64, t as i64 - 1)
            };
            let ok = v >= lo && v <= hi;
            idx.push(v.clamp(lo, hi) as u32);
            mask.push(if ok { 1f32 } else { 0f32 });
        }
    }
    Ok((
        Tensor::from_vec(idx, (t, cols), dev)?,
        Tensor::from_vec(mask, (t, cols), dev)?,
    ))
}

/// conv_1 (k, "same") -> relu -> conv_2 (k, "same"), on the host, time-major.
struct Ffn {
    conv_1: RawConv,
    conv_2: RawConv,
}

impl Ffn {
    fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let (_, h, t) = x.dims3()?;
        let dev = x.device();
        let xt = x
            .to_device(&Device::Cpu)?
            .squeeze(0)?
            .t()?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        let mut y = self.conv_1.run_padded(&xt, None);
        y.iter_mut().for_each(|v| *v = v.max(0.0));
        let y = self.conv_2.run_padded(&y, None);
        if y.len() != t * h {
            return Err(ModelError::Invalid(
                "enc_p: FFN output of the wrong size".into(),
            ));
        }
        let y = Tensor::from_vec(y, (t, h), &Device::Cpu)?;
        Ok(y.t()?.contiguous()?.unsqueeze(0)?.to_device(dev)?)
    }
}

struct Layer {
    attn: Attention,
    norm_1: ChannelNorm,
    ffn: Ffn,
    norm_2: ChannelNorm,
}

pub struct TextEncoder {
    /// [n_vocab, hidden]
    emb: Tensor,
    layers: Vec<Layer>,
    proj: Conv1d,
    hidden: usize,
    out_channels: usize,
}

/// What the text encoder hands on: hidden x, and the prior's mean / log-std.
pub struct EncoderOutput {
    pub x: Tensor,
    pub m_p: Tensor,
    pub logs_p: Tensor,
}

impl TextEncoder {
    pub fn load(w: &OnnxWeights, h: &PiperHyper) -> Result<Self> {
        let emb = w.get_shaped("enc_p.emb.weight", &[h.n_vocab, h.hidden_channels])?;
        let mut layers = Vec::with_capacity(h.n_layers);
        for i in 0..h.n_layers {
            let p = "enc_p.encoder";
            // The FFN pads by hand ("same" padding: (k-1)/2 left, k/2 right).
            let ffn_conv = |name: &str| -> Result<RawConv> {
                let c = RawConv::load(w, &format!("{p}.ffn_layers.{i}.{name}"))?;
                let k = c.k;
                Ok(c.with_padding((k - 1) / 2, k / 2))
            };
            layers.push(Layer {
                attn: Attention::load(w, &format!("{p}.attn_layers.{i}"), h)?,
                norm_1: ChannelNorm::load(w, &format!("{p}.norm_layers_1.{i}"), h.hidden_channels)?,
                ffn: Ffn {
                    conv_1: ffn_conv("conv_1")?,
                    conv_2: ffn_conv("conv_2")?,
                },
                norm_2: ChannelNorm::load(w, &format!("{p}.norm_layers_2.{i}"), h.hidden_channels)?,
            });
        }
        let proj = Conv1d::load(w, "enc_p.proj")?;
        if proj.cout != 2 * h.inter_channels {
            return Err(ModelError::Invalid(format!(
                "enc_p.proj has {} outputs, expected {}",
                proj.cout,
                2 * h.inter_channels
            )));
        }
        Ok(Self {
            emb,
            layers,
            proj,
            hidden: h.hidden_channels,
            out_channels: h.inter_channels,
        })
    }

    /// ids (validated by the caller): -> x [1, H, T], m_p / logs_p [1, C, T].
    pub fn forward(&self, ids: &[i64]) -> Result<EncoderOutput> {
        let dev = self.emb.device();
        let idx: Vec<u32> = ids.iter().map(|&i| i as u32).collect();
        let t = idx.len();
        let idx = Tensor::from_vec(idx, t, dev)?;
        // [T, H] -> [1, H, T]
        let x = self.emb.index_select(&idx, 0)?;
        let x = (x * (self.hidden as f64).sqrt())?;
        let mut x = x.t()?.contiguous()?.unsqueeze(0)?;
        for l in &self.layers {
            let y = l.attn.forward(&x)?;
            x = l.norm_1.forward(&(x + y)?)?;
            let y = l.ffn.forward(&x)?;
            x = l.norm_2.forward(&(x + y)?)?;
        }
        let stats = self.proj.forward(&x)?;
        let c = self.out_channels;
        let m_p = stats.narrow(1, 0, c)?.contiguous()?;
        let logs_p = stats.narrow(1, c, c)?.contiguous()?;
        Ok(EncoderOutput { x, m_p, logs_p })
    }
}
