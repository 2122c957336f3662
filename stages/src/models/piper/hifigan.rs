//! `dec`: the HiFi-GAN generator, one-shot and streaming.
//!
//! x = conv_pre(z)
//! for each upsampler i:  x = ups_i(leaky(x, 0.1)); x = mean_j resblock_{i,j}(x)
//! out = tanh(conv_post(leaky(x, 0.01)))
//! ResBlock "2": for each conv c: x = x + c(leaky(x));  ResBlock "1": for each pair
//! (c1, c2): x = x + c2(leaky(c1(leaky(x)))).
//!
//! Every ConvTranspose1d (kernel k, stride u, padding p, k - 2p = u) is rewritten as a
//! polyphase Conv1d: output sample q*u + r is phase r of frame q, a plain convolution
//! over a few input frames (3 here), so an upsampler is a conv with u * C_out output
//! channels. Activations are kept time-major ([time][channel]), so ordering those
//! channels (phase, channel) makes the interleave free: row q of the conv output *is*
//! rows q*u .. q*u+u of the upsampled signal.
//!
//! So every layer is "a conv with left/right zero padding", which is what the streaming
//! decoder is built from: each conv keeps the input it still needs (initialised with the
//! zeros of its left padding), emits every output whose receptive field is complete, and
//! appends its right padding at the end of the stream. Residual adds and the resblock
//! mean keep FIFOs so that both operands refer to the same absolute sample. Element-wise
//! ops commute with all of this.
//!
//! The decoder runs on the host on plain `Vec<f32>` buffers: the convolutions use a
//! direct (no im2col) register-blocked kernel, AVX2+FMA when the CPU has it (checked at
//! run time), a portable loop otherwise, split over the available cores for large
//! inputs.

use std::sync::OnceLock;

use candle_core::{DType, Tensor};

use super::onnx_weights::OnnxWeights;
use super::PiperHyper;
use crate::models::{ModelError, Result};

// ---------------------------------------------------------------------------
// The time-major convolution.

/// Output channels per register block.
const NB: usize = 16;
/// Output rows per register block.
const MR: usize = 6;
/// Output rows per cache block (all channel blocks of these rows are done together).
const ROW_CHUNK: usize = 96;
/// Multiply-accumulates below which a conv runs on one thread.
const PAR_MIN_MACS: usize = 1 << 22;

/// Threads for large convolutions: `PIPER_THREADS`, else the available cores (at most 8).
fn threads() -> usize {
    static N: OnceLock<usize> = OnceLock::new();
    *N.get_or_init(|| {
        let env = std::env::var("PIPER_THREADS")
            .ok()
            .and_then(|s| s.parse::<usize>().ok());
        match env {
            Some(n) if n > 0 => n.min(64),
            _ => std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1)
                .clamp(1, 8),
        }
    })
}

fn has_avx2_fma() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        static F: OnceLock<bool> = OnceLock::new();
        *F.get_or_init(|| is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Eight floats on a 32-byte boundary.
#[derive(Clone, Copy)]
#[repr(C, align(32))]
struct Aligned8([f32; 8]);

/// A Conv1d (stride 1) on time-major buffers: x[t * cin + ci] -> y[t * cout + co].
pub(crate) struct RawConv {
    pub(crate) cin: usize,
    pub(crate) cout: usize,
    pub(crate) k: usize,
    pub(crate) dilation: usize,
    pub(crate) pad_left: usize,
    pub(crate) pad_right: usize,
    /// cout % NB == 0: [cout / NB][k][cin][NB]; otherwise [cout][k][cin]. Stored in
    /// 32-byte aligned groups of 8 (zero tail) so the AVX2 kernel can use aligned loads.
    w: Vec<Aligned8>,
    bias: Vec<f32>,
    blocked: bool,
}

impl RawConv {
    /// `w`: PyTorch layout [cout][cin][k].
    pub(crate) fn new(
        w: &[f32],
        bias: Option<&[f32]>,
        (cout, cin, k): (usize, usize, usize),
        dilation: usize,
        pad_left: usize,
        pad_right: usize,
    ) -> Result<Self> {
        if w.len() != cout * cin * k || cout == 0 || cin == 0 || k == 0 || dilation == 0 {
            return Err(ModelError::Invalid(format!(
                "conv: {} weights for [{cout}, {cin}, {k}]",
                w.len()
            )));
        }
        let bias = match bias {
            Some(b) if b.len() == cout => b.to_vec(),
            Some(b) => {
                return Err(ModelError::Invalid(format!(
                    "conv: {} biases for {cout} outputs",
                    b.len()
                )))
            }
            None => vec![0f32; cout],
        };
        let blocked = cout % NB == 0;
        let mut p = vec![Aligned8([0f32; 8]); w.len().div_ceil(8)];
        for co in 0..cout {
            for ci in 0..cin {
                for j in 0..k {
                    let v = w[(co * cin + ci) * k + j];
                    let idx = if blocked {
                        (((co / NB) * k + j) * cin + ci) * NB + co % NB
                    } else {
                        (co * k + j) * cin + ci
                    };
                    p[idx / 8].0[idx % 8] = v;
                }
            }
        }
        Ok(Self {
            cin,
            cout,
            k,
            dilation,
            pad_left,
            pad_right,
            w: p,
            bias,
            blocked,
        })
    }

    /// From a candle weight [cout, cin, k] and bias [cout].
    pub(crate) fn from_tensors(
        w: &Tensor,
        b: Option<&Tensor>,
        dilation: usize,
        pad_left: usize,
        pad_right: usize,
    ) -> Result<Self> {
        let dims = w.dims3()?;
        let wv = w.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?;
        let bv = match b {
            Some(b) => Some(b.to_dtype(DType::F32)?.flatten_all()?.to_vec1::<f32>()?),
            None => None,
        };
        Self::new(&wv, bv.as_deref(), dims, dilation, pad_left, pad_right)
    }

    /// `{module}.weight` / `.bias` with its Conv node's dilation and pads.
    pub(crate) fn load(w: &OnnxWeights, module: &str) -> Result<Self> {
        let a = w.conv_attrs(module)?;
        if a.op_type != "Conv" || a.stride != 1 || a.group != 1 {
            return Err(ModelError::Format {
                path: w.path().to_path_buf(),
                msg: format!("{module}: unsupported {a:?}"),
            });
        }
        let weight = w.get(&format!("{module}.weight"))?;
        let bias_name = format!("{module}.bias");
        let bias = if w.contains(&bias_name) {
            Some(w.get(&bias_name)?)
        } else {
            None
        };
        let c = Self::from_tensors(&weight, bias.as_ref(), a.dilation, a.pad_left, a.pad_right)?;
        if c.k != a.kernel {
            return Err(ModelError::Format {
                path: w.path().to_path_buf(),
                msg: format!("{module}: kernel {} but weight {}", a.kernel, c.k),
            });
        }
        Ok(c)
    }

    pub(crate) fn span(&self) -> usize {
        self.dilation * (self.k - 1)
    }

    pub(crate) fn with_padding(mut self, left: usize, right: usize) -> Self {
        self.pad_left = left;
        self.pad_right = right;
        self
    }

    /// The packed weights as plain floats.
    fn weights(&self) -> &[f32] {
        // SAFETY: Aligned8 is repr(C) [f32; 8] with no padding (size 32 = align 32).
        unsafe { std::slice::from_raw_parts(self.w.as_ptr().cast::<f32>(), self.w.len() * 8) }
    }

    /// Unpadded convolution of `x` (rows x cin, rows > span) -> (rows - span) x cout,
    /// plus `add` (same shape as the output) when given.
    pub(crate) fn run(&self, x: &[f32], add: Option<&[f32]>) -> Vec<f32> {
        let rows = x.len() / self.cin;
        assert!(rows > self.span(), "conv input shorter than the kernel");
        let mut y = vec![0f32; (rows - self.span()) * self.cout];
        self.fill(x, add, &mut y);
        y
    }

    /// y row i = conv of x rows i ..= i + span (+ add row i); split over threads when
    /// large.
    fn fill(&self, x: &[f32], add: Option<&[f32]>, y: &mut [f32]) {
        let n = y.len() / self.cout;
        assert_eq!(x.len() % self.cin, 0, "conv input is not whole rows");
        assert!(
            x.len() / self.cin >= n + self.span(),
            "conv input too short"
        );
        if let Some(a) = add {
            assert!(a.len() >= y.len(), "residual too short");
        }
        if n == 0 {
            return;
        }
        let macs = n * self.cout * self.cin * self.k;
        let nt = if macs >= PAR_MIN_MACS {
            threads().min(n.div_ceil(MR * 4)).max(1)
        } else {
            1
        };
        if nt == 1 {
            self.rows(x, add, y, 0);
        } else {
            let per = n.div_ceil(nt);
            std::thread::scope(|s| {
                let mut parts = y.chunks_mut(per * self.cout).enumerate();
                let first = parts.next();
                for (i, ys) in parts {
                    s.spawn(move || self.rows(x, add, ys, i * per));
                }
                if let Some((_, ys)) = first {
                    self.rows(x, add, ys, 0);
                }
            });
        }
    }

    /// Rows [from, to) of x with its zero padding (pad_left rows before it).
    fn padded_rows(&self, x: &[f32], from: usize, to: usize) -> Vec<f32> {
        let c = self.cin;
        let l = x.len() / c;
        let mut out = vec![0f32; (to - from) * c];
        for p in from..to {
            if p >= self.pad_left && p - self.pad_left < l {
                let src = p - self.pad_left;
                out[(p - from) * c..(p - from + 1) * c].copy_from_slice(&x[src * c..(src + 1) * c]);
            }
        }
        out
    }

    /// The conv of x with its zero padding (the one-shot path): the interior straight
    /// from x, the edges from small padded copies.
    pub(crate) fn run_padded(&self, x: &[f32], add: Option<&[f32]>) -> Vec<f32> {
        let (pl, pr, span, co) = (self.pad_left, self.pad_right, self.span(), self.cout);
        if pl == 0 && pr == 0 {
            return self.run(x, add);
        }
        let l = x.len() / self.cin;
        assert!(l + pl + pr > span, "conv input shorter than the kernel");
        let n_out = l + pl + pr - span;
        let mut y = vec![0f32; n_out * co];
        if l > span && pl <= n_out {
            let r0 = pl + l - span; // first output row of the right edge
            self.fill(x, add.map(|a| &a[pl * co..]), &mut y[pl * co..r0 * co]);
            let left = self.padded_rows(x, 0, pl + span);
            self.fill(&left, add, &mut y[..pl * co]);
            let right = self.padded_rows(x, r0, n_out + span);
            self.fill(&right, add.map(|a| &a[r0 * co..]), &mut y[r0 * co..]);
        } else {
            let all = self.padded_rows(x, 0, n_out + span);
            self.fill(&all, add, &mut y);
        }
        y
    }

    /// Output rows t0 .. t0 + y.len() / cout into y.
    fn rows(&self, x: &[f32], add: Option<&[f32]>, y: &mut [f32], t0: usize) {
        let n = y.len() / self.cout;
        if self.blocked {
            #[cfg(target_arch = "x86_64")]
            if has_avx2_fma() {
                // SAFETY: the CPU has AVX2 and FMA; bounds are checked in `fill`.
                unsafe { self.rows_avx2(x, add, y, t0, n) };
                return;
            }
            self.rows_blocked(x, add, y, t0, n);
        } else {
            self.rows_plain(x, add, y, t0, n);
        }
    }

    /// Portable version of the blocked kernel.
    fn rows_blocked(&self, x: &[f32], add: Option<&[f32]>, y: &mut [f32], t0: usize, n: usize) {
        let (cin, cout, k, d) = (self.cin, self.cout, self.k, self.dilation);
        for cb in 0..cout / NB {
            let w = &self.weights()[cb * k * cin * NB..(cb + 1) * k * cin * NB];
            let b = &self.bias[cb * NB..(cb + 1) * NB];
            for t in 0..n {
                let mut acc = [0f32; NB];
                acc.copy_from_slice(b);
                if let Some(a) = add {
                    let a = &a[(t0 + t) * cout + cb * NB..][..NB];
                    for l in 0..NB {
                        acc[l] += a[l];
                    }
                }
                for j in 0..k {
                    let xr = &x[(t0 + t + j * d) * cin..][..cin];
                    let wj = &w[j * cin * NB..(j + 1) * cin * NB];
                    for (ci, &xv) in xr.iter().enumerate() {
                        let wv = &wj[ci * NB..(ci + 1) * NB];
                        for l in 0..NB {
                            acc[l] += xv * wv[l];
                        }
                    }
                }
                y[t * cout + cb * NB..][..NB].copy_from_slice(&acc);
            }
        }
    }

    /// Any cout (conv_post has 1): one dot product per output.
    fn rows_plain(&self, x: &[f32], add: Option<&[f32]>, y: &mut [f32], t0: usize, n: usize) {
        let (cin, cout, k, d) = (self.cin, self.cout, self.k, self.dilation);
        for t in 0..n {
            for co in 0..cout {
                let mut acc = self.bias[co];
                if let Some(a) = add {
                    acc += a[(t0 + t) * cout + co];
                }
                for j in 0..k {
                    let xr = &x[(t0 + t + j * d) * cin..][..cin];
                    let wr = &self.weights()[(co * k + j) * cin..][..cin];
                    acc += xr.iter().zip(wr).map(|(a, b)| a * b).sum::<f32>();
                }
                y[t * cout + co] = acc;
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn rows_avx2(&self, x: &[f32], add: Option<&[f32]>, y: &mut [f32], t0: usize, n: usize) {
        let (cin, cout, k) = (self.cin, self.cout, self.k);
        let span = self.span();
        let tap = self.dilation * cin;
        let xp = x.as_ptr();
        let yp = y.as_mut_ptr();
        let full = n - n % MR;
        let mut tc = 0;
        while tc < full {
            let tce = (tc + ROW_CHUNK).min(full);
            for cb in 0..cout / NB {
                let w = self.w.as_ptr().cast::<f32>().add(cb * k * cin * NB);
                let b = self.bias.as_ptr().add(cb * NB);
                let mut t = tc;
                while t < tce {
                    let ar = match add {
                        Some(a) => a.as_ptr().add((t0 + t) * cout + cb * NB),
                        None => std::ptr::null(),
                    };
                    micro6_avx2((
                        xp.add((t0 + t) * cin),
                        cin,
                        tap,
                        k,
                        w,
                        b,
                        ar,
                        yp.add(t * cout + cb * NB),
                        cout,
                    ));
                    t += MR;
                }
            }
            tc = tce;
        }
        let r = n - full;
        if r == 0 {
            return;
        }
        // The last rows: zero-padded copies so the 6-row kernel can run.
        let mut xs = vec![0f32; (MR + span) * cin];
        xs[..(r + span) * cin].copy_from_slice(&x[(t0 + full) * cin..(t0 + n + span) * cin]);
        let mut adds = vec![0f32; MR * cout];
        if let Some(a) = add {
            adds[..r * cout].copy_from_slice(&a[(t0 + full) * cout..(t0 + n) * cout]);
        }
        let mut ys = vec![0f32; MR * cout];
        for cb in 0..cout / NB {
            micro6_avx2((
                xs.as_ptr(),
                cin,
                tap,
                k,
                self.w.as_ptr().cast::<f32>().add(cb * k * cin * NB),
                self.bias.as_ptr().add(cb * NB),
                if add.is_some() {
                    adds.as_ptr().add(cb * NB)
                } else {
                    std::ptr::null()
                },
                ys.as_mut_ptr().add(cb * NB),
                cout,
            ));
        }
        y[full * cout..n * cout].copy_from_slice(&ys[..r * cout]);
    }
}

type MicroArgs = (
    *const f32, // x at the first row
    usize,      // cin (row stride of x)
    usize,      // floats between taps
    usize,      // taps
    *const f32, // packed weights of this channel block
    *const f32, // bias of this block
    *const f32, // residual at the first row (row stride cout) or null
    *mut f32,   // y at the first row (row stride cout)
    usize,      // cout
);

/// 6 rows x 16 channels: acc[r] = bias (+ add) + sum_j sum_ci x[r + j*d][ci] * w[j][ci][..].
/// Written out with named accumulators so that they stay in registers. Pointer
/// arithmetic is wrapping and the hot loads avoid `loadu` (whose precondition checks
/// builds with debug assertions, like the test profile, would run on every access).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn micro6_avx2(args: MicroArgs) {
    use std::arch::x86_64::*;
    let (x, cin, tap, k, w, b, add, y, cout) = args;
    let b0 = _mm256_loadu_ps(b);
    let b1 = _mm256_loadu_ps(b.wrapping_add(8));
    let (mut a00, mut a01, mut a10, mut a11, mut a20, mut a21) = (b0, b1, b0, b1, b0, b1);
    let (mut a30, mut a31, mut a40, mut a41, mut a50, mut a51) = (b0, b1, b0, b1, b0, b1);
    macro_rules! add_row {
        ($r:expr, $a0:ident, $a1:ident) => {
            let p = add.wrapping_add($r * cout);
            $a0 = _mm256_add_ps($a0, _mm256_loadu_ps(p));
            $a1 = _mm256_add_ps($a1, _mm256_loadu_ps(p.wrapping_add(8)));
        };
    }
    if !add.is_null() {
        add_row!(0, a00, a01);
        add_row!(1, a10, a11);
        add_row!(2, a20, a21);
        add_row!(3, a30, a31);
        add_row!(4, a40, a41);
        add_row!(5, a50, a51);
    }
    let mut wp = w;
    let mut xj = x;
    for _ in 0..k {
        let x0 = xj;
        let x1 = x0.wrapping_add(cin);
        let x2 = x1.wrapping_add(cin);
        let x3 = x2.wrapping_add(cin);
        let x4 = x3.wrapping_add(cin);
        let x5 = x4.wrapping_add(cin);
        for ci in 0..cin {
            // The packed weights are 32-byte aligned (Aligned8) and NB = 16.
            let w0 = _mm256_load_ps(wp);
            let w1 = _mm256_load_ps(wp.wrapping_add(8));
            macro_rules! fma_row {
                ($xr:ident, $a0:ident, $a1:ident) => {
                    let v = _mm256_set1_ps(*$xr.wrapping_add(ci));
                    $a0 = _mm256_fmadd_ps(v, w0, $a0);
                    $a1 = _mm256_fmadd_ps(v, w1, $a1);
                };
            }
            fma_row!(x0, a00, a01);
            fma_row!(x1, a10, a11);
            fma_row!(x2, a20, a21);
            fma_row!(x3, a30, a31);
            fma_row!(x4, a40, a41);
            fma_row!(x5, a50, a51);
            wp = wp.wrapping_add(NB);
        }
        xj = xj.wrapping_add(tap);
    }
    macro_rules! store_row {
        ($r:expr, $a0:ident, $a1:ident) => {
            let p = y.wrapping_add($r * cout);
            _mm256_storeu_ps(p, $a0);
            _mm256_storeu_ps(p.wrapping_add(8), $a1);
        };
    }
    store_row!(0, a00, a01);
    store_row!(1, a10, a11);
    store_row!(2, a20, a21);
    store_row!(3, a30, a31);
    store_row!(4, a40, a41);
    store_row!(5, a50, a51);
}

fn leaky(x: &mut [f32], slope: f32) {
    for v in x.iter_mut() {
        let m = *v * slope;
        *v = if *v < 0.0 { m } else { *v };
    }
}

fn leaky_copy(x: &[f32], slope: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    leaky(&mut out, slope);
    out
}

// ---------------------------------------------------------------------------
// The generator.

/// A ConvTranspose1d as a polyphase conv with channels ordered (phase, channel).
struct Upsample {
    conv: RawConv,
    rate: usize,
}

impl Upsample {
    fn load(w: &OnnxWeights, module: &str) -> Result<Self> {
        let bad = |msg: String| ModelError::Format {
            path: w.path().to_path_buf(),
            msg: format!("{module}: {msg}"),
        };
        let a = w.conv_attrs(module)?.clone();
        let weight = w.get(&format!("{module}.weight"))?;
        let (cin, cout, k) = weight.dims3()?;
        let u = a.stride;
        let p = a.pad_left;
        if a.op_type != "ConvTranspose"
            || a.group != 1
            || a.dilation != 1
            || a.pad_right != p
            || k != a.kernel
            || u == 0
            || k < 2 * p
            || k - 2 * p != u
        {
            return Err(bad(format!(
                "unsupported ConvTranspose {a:?} with weight {:?}",
                weight.dims()
            )));
        }
        let bias = w.get_shaped(&format!("{module}.bias"), &[cout])?;
        // Output m = q*u + r takes x[n] through tap j = m + p - n*u, 0 <= j < k.
        // With n = q + lo + t: j = r + p - (lo + t) * u.
        let (ui, pi, ki) = (u as i64, p as i64, k as i64);
        let lo = -((ki - 1 - pi).div_euclid(ui)); // ceil((p - k + 1) / u)
        let hi = (ui - 1 + pi).div_euclid(ui); // floor((u - 1 + p) / u)
        if lo > 0 || hi < 0 {
            return Err(bad(format!("unexpected polyphase range {lo}..={hi}")));
        }
        let taps = (hi - lo + 1) as usize;
        let wv = weight.flatten_all()?.to_vec1::<f32>()?; // [cin, cout, k]
        let mut wp = vec![0f32; u * cout * cin * taps]; // [(r, co), cin, taps]
        for r in 0..u {
            for co in 0..cout {
                for ci in 0..cin {
                    for t in 0..taps {
                        let j = r as i64 + pi - (lo + t as i64) * ui;
                        if (0..ki).contains(&j) {
                            wp[((r * cout + co) * cin + ci) * taps + t] =
                                wv[(ci * cout + co) * k + j as usize];
                        }
                    }
                }
            }
        }
        let bv = bias.to_vec1::<f32>()?;
        let bp: Vec<f32> = (0..u * cout).map(|i| bv[i % cout]).collect();
        let conv = RawConv::new(
            &wp,
            Some(&bp),
            (u * cout, cin, taps),
            1,
            (-lo) as usize,
            hi as usize,
        )?;
        Ok(Self { conv, rate: u })
    }
}

/// x + convs[n-1](leaky(... convs[0](leaky(x))))
struct ResUnit {
    convs: Vec<RawConv>,
}

struct ResBlock {
    units: Vec<ResUnit>,
}

pub struct Generator {
    conv_pre: RawConv,
    ups: Vec<Upsample>,
    /// resblocks[i * num_kernels + j]
    resblocks: Vec<ResBlock>,
    num_kernels: usize,
    slope: f32,
    final_slope: f32,
    conv_post: RawConv,
    hop: usize,
    in_channels: usize,
}

fn check_same(c: &RawConv, module: &str) -> Result<()> {
    if c.pad_left + c.pad_right != c.span() {
        return Err(ModelError::Invalid(format!(
            "{module}: padding {}+{} does not keep the length (span {})",
            c.pad_left,
            c.pad_right,
            c.span()
        )));
    }
    Ok(())
}

impl Generator {
    pub fn load(w: &OnnxWeights, h: &PiperHyper) -> Result<Self> {
        if w.contains("dec.cond.weight") {
            return Err(ModelError::Invalid(
                "dec.cond: speaker conditioning is not supported".into(),
            ));
        }
        let conv_pre = RawConv::load(w, "dec.conv_pre")?;
        check_same(&conv_pre, "dec.conv_pre")?;
        let mut ups = Vec::new();
        let mut channels = conv_pre.cout;
        for i in 0..h.upsample_rates.len() {
            let up = Upsample::load(w, &format!("dec.ups.{i}"))?;
            if up.conv.cin != channels {
                return Err(ModelError::Invalid(format!(
                    "dec.ups.{i}: channel mismatch"
                )));
            }
            channels = up.conv.cout / up.rate;
            ups.push(up);
        }
        let num_kernels = h.resblock_kernel_sizes.len();
        let mut resblocks = Vec::new();
        for i in 0..ups.len() * num_kernels {
            let p = format!("dec.resblocks.{i}");
            let c_stage = ups[i / num_kernels].conv.cout / ups[i / num_kernels].rate;
            let mut units = Vec::new();
            let pairs: Vec<Vec<String>> = if h.resblock == "1" {
                (0..w.count(&format!("{p}.convs1."), ".weight"))
                    .map(|c| vec![format!("{p}.convs1.{c}"), format!("{p}.convs2.{c}")])
                    .collect()
            } else {
                (0..w.count(&format!("{p}.convs."), ".weight"))
                    .map(|c| vec![format!("{p}.convs.{c}")])
                    .collect()
            };
            for names in pairs {
                let mut convs = Vec::new();
                for name in names {
                    let c = RawConv::load(w, &name)?;
                    check_same(&c, &name)?;
                    if c.cin != c_stage || c.cout != c_stage {
                        return Err(ModelError::Invalid(format!("{name}: channel mismatch")));
                    }
                    convs.push(c);
                }
                units.push(ResUnit { convs });
            }
            if units.is_empty() {
                return Err(ModelError::Invalid(format!("{p}: no convs")));
            }
            resblocks.push(ResBlock { units });
        }
        let conv_post = RawConv::load(w, "dec.conv_post")?;
        check_same(&conv_post, "dec.conv_post")?;
        if conv_post.cout != 1 || conv_post.cin != channels {
            return Err(ModelError::Invalid("dec.conv_post: bad shape".into()));
        }
        let hop = ups.iter().map(|u| u.rate).product();
        Ok(Self {
            in_channels: conv_pre.cin,
            conv_pre,
            ups,
            resblocks,
            num_kernels,
            slope: h.dec_leaky_slope,
            final_slope: h.dec_final_leaky_slope,
            conv_post,
            hop,
        })
    }

    fn stage_blocks(&self, i: usize) -> &[ResBlock] {
        &self.resblocks[i * self.num_kernels..(i + 1) * self.num_kernels]
    }

    /// z [1, C, T] (any device) -> time-major host buffer [T][C].
    fn time_major(&self, z: &Tensor) -> Result<Vec<f32>> {
        let z = z.to_device(&candle_core::Device::Cpu)?.squeeze(0)?;
        Ok(z.t()?.contiguous()?.flatten_all()?.to_vec1::<f32>()?)
    }

    /// z [1, C, T] -> T * hop samples.
    pub fn forward(&self, z: &Tensor) -> Result<Vec<f32>> {
        let t = z.dim(2)?;
        let x = self.time_major(z)?;
        let mut x = self.conv_pre.run_padded(&x, None);
        for (i, up) in self.ups.iter().enumerate() {
            leaky(&mut x, self.slope);
            let y = up.conv.run_padded(&x, None);
            let mut sum: Option<Vec<f32>> = None;
            for rb in self.stage_blocks(i) {
                let mut h = y.clone();
                for unit in &rb.units {
                    let mut a = leaky_copy(&h, self.slope);
                    let n = unit.convs.len();
                    for conv in &unit.convs[..n - 1] {
                        a = conv.run_padded(&a, None);
                        leaky(&mut a, self.slope);
                    }
                    h = unit.convs[n - 1].run_padded(&a, Some(&h));
                }
                sum = Some(match sum {
                    Some(mut s) => {
                        s.iter_mut().zip(&h).for_each(|(s, h)| *s += h);
                        s
                    }
                    None => h,
                });
            }
            x = sum.ok_or_else(|| ModelError::Invalid("dec: no resblocks".into()))?;
            let nk = self.num_kernels as f32;
            x.iter_mut().for_each(|v| *v /= nk);
        }
        leaky(&mut x, self.final_slope);
        let mut out = self.conv_post.run_padded(&x, None);
        out.iter_mut().for_each(|v| *v = v.tanh());
        if out.len() != t * self.hop {
            return Err(ModelError::Invalid(format!(
                "dec: {} samples for {t} frames",
                out.len()
            )));
        }
        Ok(out)
    }

    /// Output samples a sample waits for beyond its own frame: the right paddings
    /// along the longest path, in output samples.
    fn lookahead_samples(&self) -> usize {
        let mut lag = self.conv_pre.pad_right;
        for (i, up) in self.ups.iter().enumerate() {
            lag = (lag + up.conv.pad_right) * up.rate;
            lag += self
                .stage_blocks(i)
                .iter()
                .map(|rb| {
                    rb.units
                        .iter()
                        .flat_map(|u| u.convs.iter())
                        .map(|c| c.pad_right)
                        .sum::<usize>()
                })
                .max()
                .unwrap_or(0);
        }
        lag + self.conv_post.pad_right
    }
}

// ---------------------------------------------------------------------------
// Streaming.

/// The input a conv still needs: its last `span` rows (at the start: the zeros of
/// its left padding).
struct ConvState {
    buf: Vec<f32>,
}

impl ConvState {
    fn new(conv: &RawConv) -> Self {
        Self {
            buf: vec![0f32; conv.pad_left * conv.cin],
        }
    }

    /// Feeds `x` (whole rows; `last`: then the right padding) and returns every output
    /// row now computable, plus the front rows of `skip` (drained) when given.
    fn push(
        &mut self,
        conv: &RawConv,
        x: Option<&[f32]>,
        last: bool,
        skip: Option<&mut Vec<f32>>,
    ) -> Option<Vec<f32>> {
        if let Some(x) = x {
            self.buf.extend_from_slice(x);
        }
        if last {
            self.buf
                .resize(self.buf.len() + conv.pad_right * conv.cin, 0.0);
        }
        let rows = self.buf.len() / conv.cin;
        let span = conv.span();
        if rows <= span {
            return None;
        }
        let n_out = rows - span;
        let out = match skip {
            Some(skip) => {
                let y = conv.run(&self.buf, Some(&skip[..n_out * conv.cout]));
                skip.drain(..n_out * conv.cout);
                y
            }
            None => conv.run(&self.buf, None),
        };
        self.buf.drain(..n_out * conv.cin);
        Some(out)
    }
}

struct UnitState {
    skip: Vec<f32>,
    convs: Vec<ConvState>,
}

struct StageState {
    up: ConvState,
    /// [block][unit]
    blocks: Vec<Vec<UnitState>>,
    /// Finished rows of each block not yet summed.
    pending: Vec<Vec<f32>>,
}

/// A streaming HiFi-GAN decoder. Owns its state; the weights stay in the voice.
/// Concatenating every [`DecoderStream::step`] output and [`DecoderStream::finish`]
/// gives [`super::PiperVoice::decode`] of the concatenated z (up to float rounding)
/// and exactly T * hop samples.
pub struct DecoderStream {
    pre: ConvState,
    stages: Vec<StageState>,
    post: ConvState,
    channels: usize,
    hop: usize,
    lookahead_samples: usize,
    frames_in: usize,
    samples_out: usize,
    finished: bool,
}

impl DecoderStream {
    pub(crate) fn new(g: &Generator) -> Self {
        let stages = g
            .ups
            .iter()
            .enumerate()
            .map(|(i, up)| {
                let blocks: Vec<Vec<UnitState>> = g
                    .stage_blocks(i)
                    .iter()
                    .map(|rb| {
                        rb.units
                            .iter()
                            .map(|u| UnitState {
                                skip: Vec::new(),
                                convs: u.convs.iter().map(ConvState::new).collect(),
                            })
                            .collect()
                    })
                    .collect();
                StageState {
                    up: ConvState::new(&up.conv),
                    pending: vec![Vec::new(); blocks.len()],
                    blocks,
                }
            })
            .collect();
        Self {
            pre: ConvState::new(&g.conv_pre),
            stages,
            post: ConvState::new(&g.conv_post),
            channels: g.in_channels,
            hop: g.hop,
            lookahead_samples: g.lookahead_samples(),
            frames_in: 0,
            samples_out: 0,
            finished: false,
        }
    }

    /// Frames of right context a sample waits for (the decoder is non-causal).
    pub fn lookahead_frames(&self) -> usize {
        self.lookahead_samples.div_ceil(self.hop)
    }

    /// The same in output samples: after n frames, n * hop - lookahead_samples()
    /// samples are out.
    pub fn lookahead_samples(&self) -> usize {
        self.lookahead_samples
    }

    /// Frames fed so far.
    pub fn frames_in(&self) -> usize {
        self.frames_in
    }

    /// Samples returned so far.
    pub fn samples_out(&self) -> usize {
        self.samples_out
    }

    /// Feed z_chunk [1, C, t] (t >= 1); returns every sample that can be computed
    /// exactly now (those more than `lookahead_samples` behind the input).
    pub fn step(&mut self, voice: &super::PiperVoice, z_chunk: &Tensor) -> Result<Vec<f32>> {
        if self.finished {
            return Err(ModelError::Invalid(
                "decoder stream: step after finish".into(),
            ));
        }
        let t = voice.check_z(z_chunk)?;
        let g = &voice.dec;
        if z_chunk.dim(1)? != self.channels || self.stages.len() != g.ups.len() {
            return Err(ModelError::Invalid(
                "decoder stream: used with a different voice".into(),
            ));
        }
        let z = g.time_major(z_chunk)?;
        let out = self.run(g, Some(&z), false);
        self.frames_in += t;
        Ok(out)
    }

    /// End of stream: the remaining samples (zero right-padding exactly like the
    /// one-shot decode). Calling it again returns nothing.
    pub fn finish(&mut self, voice: &super::PiperVoice) -> Result<Vec<f32>> {
        if self.finished {
            return Ok(Vec::new());
        }
        self.finished = true;
        if self.frames_in == 0 {
            return Ok(Vec::new());
        }
        if self.stages.len() != voice.dec.ups.len() {
            return Err(ModelError::Invalid(
                "decoder stream: used with a different voice".into(),
            ));
        }
        Ok(self.run(&voice.dec, None, true))
    }

    fn run(&mut self, g: &Generator, z: Option<&[f32]>, last: bool) -> Vec<f32> {
        let mut x = self.pre.push(&g.conv_pre, z, last, None);
        for (i, (stage, up)) in self.stages.iter_mut().zip(&g.ups).enumerate() {
            if let Some(x) = x.as_mut() {
                leaky(x, g.slope);
            }
            let y = stage.up.push(&up.conv, x.as_deref(), last, None);
            for ((bstate, rb), pending) in stage
                .blocks
                .iter_mut()
                .zip(g.stage_blocks(i))
                .zip(stage.pending.iter_mut())
            {
                let mut h = y.clone();
                for (ustate, unit) in bstate.iter_mut().zip(&rb.units) {
                    h = unit_push(ustate, unit, h, g.slope, last);
                }
                if let Some(h) = h {
                    pending.extend_from_slice(&h);
                }
            }
            let n = stage.pending.iter().map(|p| p.len()).min().unwrap_or(0);
            x = if n == 0 {
                None
            } else {
                let mut sum: Vec<f32> = stage.pending[0].drain(..n).collect();
                for p in stage.pending[1..].iter_mut() {
                    sum.iter_mut().zip(p.drain(..n)).for_each(|(s, v)| *s += v);
                }
                let nk = g.num_kernels as f32;
                sum.iter_mut().for_each(|v| *v /= nk);
                Some(sum)
            };
        }
        if let Some(x) = x.as_mut() {
            leaky(x, g.final_slope);
        }
        let mut out = self
            .post
            .push(&g.conv_post, x.as_deref(), last, None)
            .unwrap_or_default();
        out.iter_mut().for_each(|v| *v = v.tanh());
        self.samples_out += out.len();
        out
    }
}

fn unit_push(
    st: &mut UnitState,
    unit: &ResUnit,
    x: Option<Vec<f32>>,
    slope: f32,
    last: bool,
) -> Option<Vec<f32>> {
    let mut a = x.map(|x| {
        st.skip.extend_from_slice(&x);
        let mut x = x;
        leaky(&mut x, slope);
        x
    });
    let n = unit.convs.len();
    for (cs, conv) in st.convs[..n - 1].iter_mut().zip(&unit.convs[..n - 1]) {
        a = cs.push(conv, a.as_deref(), last, None);
        if let Some(a) = a.as_mut() {
            leaky(a, slope);
        }
    }
    st.convs[n - 1].push(&unit.convs[n - 1], a.as_deref(), last, Some(&mut st.skip))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct definition: y[t][co] = b[co] + add + sum_{ci,j} x[t + j*d][ci] * w[co][ci][j].
    fn reference(
        w: &[f32],
        b: &[f32],
        (cout, cin, k): (usize, usize, usize),
        d: usize,
        x: &[f32],
        add: Option<&[f32]>,
    ) -> Vec<f32> {
        let rows = x.len() / cin;
        let n = rows - d * (k - 1);
        let mut y = vec![0f32; n * cout];
        for t in 0..n {
            for co in 0..cout {
                let mut acc = b[co] as f64;
                if let Some(a) = add {
                    acc += a[t * cout + co] as f64;
                }
                for ci in 0..cin {
                    for j in 0..k {
                        acc += (x[(t + j * d) * cin + ci] * w[(co * cin + ci) * k + j]) as f64;
                    }
                }
                y[t * cout + co] = acc as f32;
            }
        }
        y
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        let mut s = seed.wrapping_mul(2654435761).wrapping_add(12345);
        (0..n)
            .map(|_| {
                s = s.wrapping_mul(1664525).wrapping_add(1013904223);
                (s >> 8) as f32 / (1u32 << 24) as f32 - 0.5
            })
            .collect()
    }

    fn max_diff(a: &[f32], b: &[f32]) -> f32 {
        assert_eq!(a.len(), b.len());
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
    }

    #[test]
    fn conv_kernels_match_the_definition() {
        // (cout, cin, k, d, output rows): blocked and plain layouts, row tails,
        // dilation, a size large enough to be split over threads.
        let cases = [
            (16, 8, 3, 1, 7),
            (32, 5, 5, 2, 13),
            (48, 16, 7, 3, 1),
            (1, 32, 7, 1, 10),
            (3, 4, 2, 5, 9),
            (64, 64, 3, 4, 1100),
        ];
        for (i, &(cout, cin, k, d, n)) in cases.iter().enumerate() {
            let w = data(cout * cin * k, 3 * i as u32);
            let b = data(cout, 3 * i as u32 + 1);
            let x = data((n + d * (k - 1)) * cin, 3 * i as u32 + 2);
            let add = data(n * cout, 7 + i as u32);
            let conv = RawConv::new(&w, Some(&b), (cout, cin, k), d, 0, 0).unwrap();
            for a in [None, Some(add.as_slice())] {
                let want = reference(&w, &b, (cout, cin, k), d, &x, a);
                let got = conv.run(&x, a);
                assert!(
                    max_diff(&got, &want) < 1e-4,
                    "case {i}: {}",
                    max_diff(&got, &want)
                );
                // The portable kernels too, whatever the CPU.
                let mut y = vec![0f32; n * cout];
                if conv.blocked {
                    conv.rows_blocked(&x, a, &mut y, 0, n);
                } else {
                    conv.rows_plain(&x, a, &mut y, 0, n);
                }
                assert!(max_diff(&y, &want) < 1e-4, "case {i} portable");
            }
            // Padded: same as padding by hand.
            let (pl, pr) = ((d * (k - 1)) / 2, d * (k - 1) - (d * (k - 1)) / 2);
            let conv = conv.with_padding(pl, pr);
            let xs = data(n * cin, 11 + i as u32);
            let mut xp = vec![0f32; pl * cin];
            xp.extend_from_slice(&xs);
            xp.resize((n + pl + pr) * cin, 0.0);
            let want = reference(&w, &b, (cout, cin, k), d, &xp, Some(&add));
            let got = conv.run_padded(&xs, Some(&add));
            assert!(max_diff(&got, &want) < 1e-4, "case {i} padded");
        }
    }
}
