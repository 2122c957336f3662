//! `flow`: VITS ResidualCouplingBlock, reverse direction.
//!
//! flows = [ResidualCouplingLayer(mean_only), Flip] x n_flows, run reversed:
//! Flip (reverse the channel order), then for a coupling layer
//!     x0, x1 = split(x); h = WN(pre(x0)); m = post(h); x1 = x1 - m; x = cat(x0, x1)
//! WN = n_layers x [in_layer (k, dilation rate^i) -> tanh(a) * sigmoid(b) -> res_skip
//! (1x1)]; all but the last res_skip split into a residual and a skip half.
//!
//! Runs on the host, time-major, with the decoder's direct convolution kernel.

use candle_core::{Device, Tensor};

use super::hifigan::RawConv;
use super::onnx_weights::OnnxWeights;
use super::PiperHyper;
use crate::models::{ModelError, Result};

struct Coupling {
    pre: RawConv,
    in_layers: Vec<RawConv>,
    res_skip: Vec<RawConv>,
    post: RawConv,
    half: usize,
    hidden: usize,
}

impl Coupling {
    /// WN(pre(x0)) -> post: x0 [T][half] -> m [T][half]
    fn mean(&self, x0: &[f32]) -> Vec<f32> {
        let hc = self.hidden;
        let mut h = self.pre.run_padded(x0, None);
        let n = self.in_layers.len();
        let mut out: Option<Vec<f32>> = None;
        for i in 0..n {
            let a = self.in_layers[i].run_padded(&h, None);
            let rows = a.len() / (2 * hc);
            let mut acts = vec![0f32; rows * hc];
            for (dst, src) in acts.chunks_exact_mut(hc).zip(a.chunks_exact(2 * hc)) {
                let (ta, sa) = src.split_at(hc);
                for ((d, &t), &s) in dst.iter_mut().zip(ta).zip(sa) {
                    *d = t.tanh() * (1.0 / (1.0 + (-s).exp()));
                }
            }
            let rs = self.res_skip[i].run_padded(&acts, None);
            if i + 1 < n {
                let o = out.get_or_insert_with(|| vec![0f32; rows * hc]);
                for ((hr, orow), src) in h
                    .chunks_exact_mut(hc)
                    .zip(o.chunks_exact_mut(hc))
                    .zip(rs.chunks_exact(2 * hc))
                {
                    let (res, skip) = src.split_at(hc);
                    hr.iter_mut().zip(res).for_each(|(a, b)| *a += b);
                    orow.iter_mut().zip(skip).for_each(|(a, b)| *a += b);
                }
            } else {
                match out.as_mut() {
                    Some(o) => o.iter_mut().zip(&rs).for_each(|(a, b)| *a += b),
                    None => out = Some(rs),
                }
            }
        }
        let out = out.unwrap_or(h);
        self.post.run_padded(&out, None)
    }
}

pub struct FlowBlock {
    /// Coupling layers in forward order (flows.0, flows.2, ...).
    layers: Vec<Coupling>,
    channels: usize,
}

impl FlowBlock {
    pub fn load(w: &OnnxWeights, h: &PiperHyper) -> Result<Self> {
        let half = h.inter_channels / 2;
        let hc = h.flow_hidden_channels;
        let mut layers = Vec::new();
        for i in 0..h.flow_n_flows {
            let p = format!("flow.flows.{}", 2 * i);
            let pre = RawConv::load(w, &format!("{p}.pre"))?;
            let post = RawConv::load(w, &format!("{p}.post"))?;
            let same = |c: &RawConv| c.pad_left + c.pad_right == c.span();
            if pre.cin != half
                || pre.cout != hc
                || post.cin != hc
                || post.cout != half
                || !same(&pre)
                || !same(&post)
            {
                return Err(ModelError::Invalid(format!(
                    "{p}: only mean-only coupling layers are supported (pre {}->{}, post {}->{})",
                    pre.cin, pre.cout, post.cin, post.cout
                )));
            }
            let mut in_layers = Vec::new();
            let mut res_skip = Vec::new();
            for j in 0..h.flow_wn_layers {
                let il = RawConv::load(w, &format!("{p}.enc.in_layers.{j}"))?;
                let rs = RawConv::load(w, &format!("{p}.enc.res_skip_layers.{j}"))?;
                let rs_out = if j + 1 < h.flow_wn_layers { 2 * hc } else { hc };
                if il.cin != hc
                    || il.cout != 2 * hc
                    || il.pad_left + il.pad_right != il.span()
                    || rs.cin != hc
                    || rs.cout != rs_out
                    || !same(&rs)
                {
                    return Err(ModelError::Invalid(format!("{p}.enc layer {j}: bad shape")));
                }
                in_layers.push(il);
                res_skip.push(rs);
            }
            if in_layers.is_empty() {
                return Err(ModelError::Invalid(format!("{p}.enc: no layers")));
            }
            layers.push(Coupling {
                pre,
                in_layers,
                res_skip,
                post,
                half,
                hidden: hc,
            });
        }
        Ok(Self {
            layers,
            channels: h.inter_channels,
        })
    }

    /// z_p [1, C, T] -> z [1, C, T]
    pub fn reverse(&self, z: &Tensor) -> Result<Tensor> {
        let dev = z.device().clone();
        let c = self.channels;
        let t = z.dim(2)?;
        let mut x = z
            .to_device(&Device::Cpu)?
            .squeeze(0)?
            .t()?
            .contiguous()?
            .flatten_all()?
            .to_vec1::<f32>()?;
        for layer in self.layers.iter().rev() {
            let half = layer.half;
            // Flip, then split off x0.
            let mut x0 = Vec::with_capacity(t * half);
            for row in x.chunks_exact_mut(c) {
                row.reverse();
                x0.extend_from_slice(&row[..half]);
            }
            let m = layer.mean(&x0);
            for (row, mr) in x.chunks_exact_mut(c).zip(m.chunks_exact(half)) {
                row[half..].iter_mut().zip(mr).for_each(|(a, b)| *a -= b);
            }
        }
        let z = Tensor::from_vec(x, (t, c), &Device::Cpu)?;
        Ok(z.t()?.contiguous()?.unsqueeze(0)?.to_device(&dev)?)
    }
}
