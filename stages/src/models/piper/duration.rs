//! `dp`: VITS StochasticDurationPredictor, reverse (inference) direction only.
//!
//! h = proj(DDSConv(pre(x)))            (x = the text encoder's hidden output)
//! z ~ N(0, 1) * noise_w, shape [1, 2, T]
//! for flow in reversed(flows) minus the unused first ConvFlow:
//!     Flip | ConvFlow(g = h) (rational-quadratic spline, inverse) | ElementwiseAffine
//! logw = z[:, 0]
//!
//! DDSConv = dilated depthwise-separable convs (dilation k^i) with channel LayerNorm and
//! exact (erf) GELU. The spline runs element-wise on the host in f32, mirroring
//! `transforms.py` (`unconstrained_rational_quadratic_spline`, tails = "linear").

use candle_core::Tensor;

use super::onnx_weights::OnnxWeights;
use super::{ChannelNorm, Conv1d, PiperHyper};
use crate::models::{ModelError, Result};

const MIN_BIN_WIDTH: f32 = 1e-3;
const MIN_BIN_HEIGHT: f32 = 1e-3;
const MIN_DERIVATIVE: f32 = 1e-3;
/// searchsorted's eps added to the last bin edge.
const SEARCH_EPS: f32 = 1e-6;

/// DDSConv: x -> x + gelu(LN(1x1(gelu(LN(sepconv(x)))))) per layer.
struct Dds {
    seps: Vec<Conv1d>,
    norms_1: Vec<ChannelNorm>,
    c1x1: Vec<Conv1d>,
    norms_2: Vec<ChannelNorm>,
}

impl Dds {
    fn load(w: &OnnxWeights, p: &str, channels: usize) -> Result<Self> {
        let n = w.count(&format!("{p}.convs_sep."), ".weight");
        if n == 0 {
            return Err(ModelError::Invalid(format!("{p}: no DDSConv layers")));
        }
        let mut d = Dds {
            seps: vec![],
            norms_1: vec![],
            c1x1: vec![],
            norms_2: vec![],
        };
        for i in 0..n {
            d.seps.push(Conv1d::load(w, &format!("{p}.convs_sep.{i}"))?);
            d.norms_1
                .push(ChannelNorm::load(w, &format!("{p}.norms_1.{i}"), channels)?);
            d.c1x1.push(Conv1d::load(w, &format!("{p}.convs_1x1.{i}"))?);
            d.norms_2
                .push(ChannelNorm::load(w, &format!("{p}.norms_2.{i}"), channels)?);
        }
        Ok(d)
    }

    fn forward(&self, x: &Tensor, g: Option<&Tensor>) -> Result<Tensor> {
        let mut x = match g {
            Some(g) => (x + g)?,
            None => x.clone(),
        };
        for i in 0..self.seps.len() {
            let y = self.seps[i].forward(&x)?;
            let y = self.norms_1[i].forward(&y)?.gelu_erf()?;
            let y = self.c1x1[i].forward(&y)?;
            let y = self.norms_2[i].forward(&y)?.gelu_erf()?;
            x = (x + y)?;
        }
        Ok(x)
    }
}

struct ConvFlow {
    pre: Conv1d,
    convs: Dds,
    proj: Conv1d,
    num_bins: usize,
    filter_channels: usize,
    tail_bound: f32,
}

enum Flow {
    Flip,
    Conv(Box<ConvFlow>),
    /// x = (x - m) * exp(-logs), per channel.
    Affine {
        m: [f32; 2],
        inv_scale: [f32; 2],
    },
}

pub struct DurationPredictor {
    pre: Conv1d,
    convs: Dds,
    proj: Conv1d,
    /// In the order they are applied in reverse mode.
    flows: Vec<Flow>,
}

impl DurationPredictor {
    pub fn load(w: &OnnxWeights, h: &PiperHyper) -> Result<Self> {
        let fc = h.dp_filter_channels;
        let pre = Conv1d::load(w, "dp.pre")?;
        let convs = Dds::load(w, "dp.convs", fc)?;
        let proj = Conv1d::load(w, "dp.proj")?;

        // flows = [ElementwiseAffine, (ConvFlow, Flip) x n_flows]; reverse inference runs
        // flows[2n], flows[2n-1], ..., flows[2] and then flows[0] (flows[1] is unused and
        // missing from the export).
        let mut flows = Vec::new();
        for idx in (1..=2 * h.dp_n_flows).rev() {
            if idx % 2 == 0 {
                flows.push(Flow::Flip);
            } else if idx != 1 {
                let p = format!("dp.flows.{idx}");
                let pre = Conv1d::load(w, &format!("{p}.pre"))?;
                let proj = Conv1d::load(w, &format!("{p}.proj"))?;
                if pre.cin != 1 || proj.cout != 3 * h.dp_num_bins - 1 {
                    return Err(ModelError::Invalid(format!(
                        "{p}: unexpected shapes (pre in {}, proj out {})",
                        pre.cin, proj.cout
                    )));
                }
                flows.push(Flow::Conv(Box::new(ConvFlow {
                    pre,
                    convs: Dds::load(w, &format!("{p}.convs"), fc)?,
                    proj,
                    num_bins: h.dp_num_bins,
                    filter_channels: fc,
                    tail_bound: h.dp_tail_bound,
                })));
            }
        }
        let m = w.get_shaped("dp.flows.0.m", &[2, 1])?;
        let m = m.flatten_all()?.to_vec1::<f32>()?;
        let inv_scale: Vec<f32> = if w.contains("dp.flows.0.logs") {
            let logs = w.get_shaped("dp.flows.0.logs", &[2, 1])?;
            logs.flatten_all()?
                .to_vec1::<f32>()?
                .iter()
                .map(|l| (-l).exp())
                .collect()
        } else {
            // The export folded exp(-logs) into a constant consumed by /dp/flows.0/Mul.
            match w.node_initializer("/dp/flows.0/Mul") {
                Some((_, t)) if t.elem_count() == 2 => t.flatten_all()?.to_vec1::<f32>()?,
                _ => {
                    return Err(ModelError::Format {
                        path: w.path().to_path_buf(),
                        msg: "dp.flows.0: neither logs nor the folded exp(-logs) found".into(),
                    })
                }
            }
        };
        flows.push(Flow::Affine {
            m: [m[0], m[1]],
            inv_scale: [inv_scale[0], inv_scale[1]],
        });
        Ok(Self {
            pre,
            convs,
            proj,
            flows,
        })
    }

    /// x: encoder hidden [1, H, T]; noise: [2][T] standard normal already times noise_w.
    /// Returns logw, T values.
    pub fn reverse(&self, x: &Tensor, noise: [Vec<f32>; 2]) -> Result<Vec<f32>> {
        let t = x.dim(2)?;
        let g = self.pre.forward(x)?;
        let g = self.convs.forward(&g, None)?;
        let g = self.proj.forward(&g)?;
        let [mut z0, mut z1] = noise;
        if z0.len() != t || z1.len() != t {
            return Err(ModelError::Invalid(
                "duration noise has the wrong length".into(),
            ));
        }
        for flow in &self.flows {
            match flow {
                Flow::Flip => std::mem::swap(&mut z0, &mut z1),
                Flow::Conv(cf) => {
                    let x0 = Tensor::from_slice(&z0, (1, 1, t), x.device())?;
                    let h = cf.pre.forward(&x0)?;
                    let h = cf.convs.forward(&h, Some(&g))?;
                    let h = cf.proj.forward(&h)?; // [1, 3*nb-1, T]
                    let h = h
                        .squeeze(0)?
                        .t()?
                        .contiguous()?
                        .flatten_all()?
                        .to_vec1::<f32>()?;
                    let np = 3 * cf.num_bins - 1;
                    let scale = (cf.filter_channels as f32).sqrt();
                    for (i, x1) in z1.iter_mut().enumerate() {
                        let p = &h[i * np..(i + 1) * np];
                        *x1 = spline_inverse(*x1, p, cf.num_bins, scale, cf.tail_bound);
                    }
                }
                Flow::Affine { m, inv_scale } => {
                    for v in z0.iter_mut() {
                        *v = (*v - m[0]) * inv_scale[0];
                    }
                    for v in z1.iter_mut() {
                        *v = (*v - m[1]) * inv_scale[1];
                    }
                }
            }
        }
        Ok(z0)
    }
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Softmax, then the min-bin floor, cumsum, scaled to [-b, b] with exact end points.
/// Returns (edges[nb+1], sizes[nb]).
fn bins(u: &[f32], scale: f32, min_size: f32, b: f32) -> (Vec<f32>, Vec<f32>) {
    let nb = u.len();
    let max = u.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v / scale));
    let e: Vec<f32> = u.iter().map(|&v| (v / scale - max).exp()).collect();
    let sum: f32 = e.iter().sum();
    let mut edges = Vec::with_capacity(nb + 1);
    edges.push(0f32);
    let mut acc = 0f32;
    for v in &e {
        let s = min_size + (1.0 - min_size * nb as f32) * (v / sum);
        acc += s;
        edges.push(acc);
    }
    for v in edges.iter_mut() {
        *v = 2.0 * b * *v - b;
    }
    edges[0] = -b;
    edges[nb] = b;
    let sizes = edges.windows(2).map(|w| w[1] - w[0]).collect();
    (edges, sizes)
}

/// The inverse rational-quadratic spline of one value with linear tails.
/// `p` = [widths(nb), heights(nb), derivatives(nb-1)] unnormalised.
fn spline_inverse(x: f32, p: &[f32], nb: usize, scale: f32, b: f32) -> f32 {
    if !(x >= -b && x <= b) {
        return x;
    }
    let (cumw, widths) = bins(&p[..nb], scale, MIN_BIN_WIDTH, b);
    let (cumh, heights) = bins(&p[nb..2 * nb], scale, MIN_BIN_HEIGHT, b);
    let constant = ((1.0f64 - MIN_DERIVATIVE as f64).exp() - 1.0).ln() as f32;
    let ud = &p[2 * nb..];
    let deriv = |i: usize| -> f32 {
        let u = if i == 0 || i == nb {
            constant
        } else {
            ud[i - 1]
        };
        MIN_DERIVATIVE + softplus(u)
    };
    // searchsorted on the heights (inverse), last edge nudged up by eps.
    let mut count = 0usize;
    for (i, &e) in cumh.iter().enumerate() {
        let e = if i == nb { e + SEARCH_EPS } else { e };
        if x >= e {
            count += 1;
        }
    }
    let k = count.saturating_sub(1).min(nb - 1);
    let in_cumw = cumw[k];
    let in_w = widths[k];
    let in_cumh = cumh[k];
    let in_h = heights[k];
    let delta = in_h / in_w;
    let d0 = deriv(k);
    let d1 = deriv(k + 1);
    let dy = x - in_cumh;
    let s = d0 + d1 - 2.0 * delta;
    let a = dy * s + in_h * (delta - d0);
    let bb = in_h * d0 - dy * s;
    let c = -delta * dy;
    let disc = (bb * bb - 4.0 * a * c).max(0.0);
    let root = (2.0 * c) / (-bb - disc.sqrt());
    root * in_w + in_cumw
}
