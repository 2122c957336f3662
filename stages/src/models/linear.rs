//! A dense f32 linear layer (`y = x · wᵀ`, `w` of shape `[n, k]`) with a memory-bound kernel for
//! the few-row products of autoregressive decoding.
//!
//! candle's CPU matmul (gemm) is built for large products; for `x` of 1..=16 rows it streams the
//! weights at only ~5-10 GB/s. Here the output rows `n` are split into blocks over rayon's global
//! pool, and within a block every weight row is read from memory once: tiles of 4 weight rows ×
//! up to 3 input rows keep 12 eight-wide FMA accumulators in registers (AVX2 + FMA, detected at
//! run time; a portable scalar loop otherwise), and the next tile is software-prefetched.
//!
//! Measured on the 2-core dev VM (`tests::bench`): 1 row reaches ~20 GB/s from DRAM (the VM's
//! limit: numpy/OpenBLAS gets ~23 GB/s on a 540 MB matrix) and ~38 GB/s from L3; 8 rows read
//! each weight once at ~15-30 GB/s. With AVX2 the kernel serves every `m`: large `m` (prompt
//! prefill) is blocked for L2 and runs at ~110-150 GFLOP/s, still ~2x candle's gemm at
//! 256..2048 rows. Without AVX2, `m > SCALAR_M_MAX` goes to candle's matmul (which has its own
//! SIMD kernels, e.g. NEON).
//!
//! Every output element is summed in the same order whatever `m` and the tiling, so a row's
//! result never depends on the other rows of the batch.

use candle_core::{CpuStorage, DType, Device, Result, Storage, Tensor};
use rayon::prelude::*;

/// Without the AVX2 kernel, more input rows than this go to candle's matmul.
pub const SCALAR_M_MAX: usize = 16;

/// Weight rows per tile (the kernel's register block over `n`).
const NR: usize = 4;
/// Least weight bytes per rayon task, so scheduling (a few µs) stays small beside the work.
const MIN_TASK_BYTES: usize = 128 * 1024;

/// `y = x · wᵀ` with `w` `[n, k]` f32, row-major and contiguous (held as a candle tensor, so the
/// large-`m` path and embedding lookups share the same storage; clones are cheap and shared).
#[derive(Debug, Clone)]
pub struct Linear {
    weight: Tensor,
    n: usize,
    k: usize,
}

impl Linear {
    /// Wraps a `[n, k]` weight (converted to contiguous f32 if it is not already).
    pub fn new(weight: Tensor) -> Result<Self> {
        let (n, k) = weight.dims2()?;
        let weight = weight.to_dtype(DType::F32)?.contiguous()?;
        Ok(Self { weight, n, k })
    }

    /// The `[n, k]` weight tensor.
    pub fn weight(&self) -> &Tensor {
        &self.weight
    }

    pub fn out_features(&self) -> usize {
        self.n
    }

    pub fn in_features(&self) -> usize {
        self.k
    }

    /// Rows `ids` of the weight (an embedding lookup): `[len(ids), k]`.
    pub fn embedding(&self, ids: &Tensor) -> Result<Tensor> {
        self.weight.index_select(ids, 0)
    }

    /// `x` `[.., k]` (f32) → `[.., n]`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        self.forward_with(x, simd_available())
    }

    fn forward_with(&self, x: &Tensor, simd: bool) -> Result<Tensor> {
        let dims = x.dims();
        let Some((&k, lead)) = dims.split_last() else {
            candle_core::bail!("linear: scalar input")
        };
        if k != self.k {
            candle_core::bail!(
                "linear: input has {k} features, the weight {:?}",
                (self.n, self.k)
            )
        }
        let m: usize = lead.iter().product();
        let mut out_dims = lead.to_vec();
        out_dims.push(self.n);
        // Other devices or dtypes: candle's matmul. With AVX2 the kernel is used at every m:
        // measured on 2 cores with this model's shapes, candle's gemm never catches up (the
        // kernel is ~4-8x faster at m <= 16 and still ~2x at m = 256..2048).
        if m == 0 || x.dtype() != DType::F32 || !x.device().is_cpu() || (!simd && m > SCALAR_M_MAX)
        {
            let x2 = x.reshape((m, k))?;
            return x2.matmul(&self.weight.t()?)?.reshape(out_dims);
        }
        let x = x.contiguous()?;
        let mut out = vec![0f32; m * self.n];
        {
            let (xs, xl) = x.storage_and_layout();
            let (ws, wl) = self.weight.storage_and_layout();
            let (Storage::Cpu(CpuStorage::F32(xv)), Storage::Cpu(CpuStorage::F32(wv))) =
                (&*xs, &*ws)
            else {
                candle_core::bail!("linear: expected f32 cpu tensors")
            };
            let (Some((x0, x1)), Some((w0, w1))) =
                (xl.contiguous_offsets(), wl.contiguous_offsets())
            else {
                candle_core::bail!("linear: expected contiguous tensors")
            };
            matmul_nt_with(&xv[x0..x1], m, &wv[w0..w1], self.n, self.k, &mut out, simd);
        }
        Tensor::from_vec(out, out_dims, &Device::Cpu)
    }
}

/// Whether the AVX2 + FMA kernel runs on this machine.
pub fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[m, n] = x[m, k] · w[n, k]ᵀ` (all row-major), parallel over blocks of `n`.
///
/// # Panics
/// If a slice is shorter than its shape says.
pub fn matmul_nt(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    matmul_nt_with(x, m, w, n, k, out, simd_available())
}

/// [`matmul_nt`] with the portable kernel only (for tests and comparisons).
pub fn matmul_nt_scalar(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32]) {
    matmul_nt_with(x, m, w, n, k, out, false)
}

/// A raw output pointer that rayon tasks share; each task writes a disjoint set of columns.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint elements (their own column range of every row) and the buffer
// outlives the parallel loop (`for_each` returns only when every task has finished).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

fn matmul_nt_with(x: &[f32], m: usize, w: &[f32], n: usize, k: usize, out: &mut [f32], simd: bool) {
    assert!(x.len() >= m * k, "x: {} < {m} x {k}", x.len());
    assert!(w.len() >= n * k, "w: {} < {n} x {k}", w.len());
    assert!(out.len() >= m * n, "out: {} < {m} x {n}", out.len());
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        out[..m * n].fill(0.0);
        return;
    }
    // Block size: enough weight bytes per task to amortise scheduling, and a few tasks per
    // thread for balance; a multiple of NR so only the last block has a ragged tile.
    let threads = rayon::current_num_threads().max(1);
    let min_rows = MIN_TASK_BYTES.div_ceil(k * 4);
    let rows = n.div_ceil(threads * 4).max(min_rows).div_ceil(NR) * NR;
    let blocks = n.div_ceil(rows);
    let ptr = OutPtr(out.as_mut_ptr());
    let run = |b: usize| {
        let n0 = b * rows;
        let n1 = (n0 + rows).min(n);
        // SAFETY: bounds asserted above; this block writes only columns n0..n1.
        unsafe { block(x, m, w, n, k, n0, n1, ptr, simd) }
    };
    if blocks == 1 {
        run(0);
    } else {
        (0..blocks).into_par_iter().for_each(run);
    }
}

/// Columns `n0..n1` of `out` (row stride `n`).
///
/// # Safety
/// `x` holds `m * k`, `w` `n * k` and `out` `m * n` elements; no other thread writes these
/// columns meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn block(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    n0: usize,
    n1: usize,
    out: OutPtr,
    simd: bool,
) {
    #[cfg(target_arch = "x86_64")]
    if simd {
        return avx::block(x.as_ptr(), m, w.as_ptr(), n, k, n0, n1, out.0);
    }
    let _ = simd;
    scalar_block(x, m, w, n, k, n0, n1, out)
}

/// Portable kernel: 8 partial sums per dot product (auto-vectorisable), one weight row at a time
/// against every input row (the row is then in L1 for rows 2..m).
#[allow(clippy::too_many_arguments)]
unsafe fn scalar_block(
    x: &[f32],
    m: usize,
    w: &[f32],
    n: usize,
    k: usize,
    n0: usize,
    n1: usize,
    out: OutPtr,
) {
    for j in n0..n1 {
        let wr = &w[j * k..(j + 1) * k];
        for i in 0..m {
            let xr = &x[i * k..(i + 1) * k];
            let mut acc = [0f32; 8];
            let mut wc = wr.chunks_exact(8);
            let mut xc = xr.chunks_exact(8);
            for (a, b) in (&mut wc).zip(&mut xc) {
                for l in 0..8 {
                    acc[l] += a[l] * b[l];
                }
            }
            let mut s =
                ((acc[0] + acc[4]) + (acc[1] + acc[5])) + ((acc[2] + acc[6]) + (acc[3] + acc[7]));
            for (a, b) in wc.remainder().iter().zip(xc.remainder()) {
                s += a * b;
            }
            *out.0.add(i * n + j) = s;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx {
    //! Raw pointers with `wrapping_add` (no debug-build UB checks in the hot loop) and
    //! hand-unrolled tiles, so the accumulators stay in registers even at the dev profile's
    //! opt-level.
    use super::NR;
    use std::arch::x86_64::*;

    /// How many 4-row tiles ahead the weights are prefetched.
    const PF_TILES: usize = 1;
    /// Input rows per L2 panel (96 rows × k = 1536 floats = 576 KiB).
    const PANEL_M: usize = 96;
    /// Weight bytes per L2 chunk.
    const CHUNK_BYTES: usize = 128 * 1024;

    /// An unaligned 8-float load. `_mm256_loadu_ps` is a `copy_nonoverlapping`, whose debug-build
    /// precondition check spills every load through the stack; `lddqu` is the same load.
    macro_rules! load {
        ($p:expr) => {
            _mm256_castsi256_ps(_mm256_lddqu_si256($p as *const __m256i))
        };
    }

    /// Horizontal sum of `acc` plus the scalar tail `k8..k` of the dot product of `w` and `x`.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn finish(acc: __m256, w: *const f32, x: *const f32, k8: usize, k: usize) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(acc), _mm256_extractf128_ps(acc, 1));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
        let mut s = _mm_cvtss_f32(s);
        for q in k8..k {
            s += *w.wrapping_add(q) * *x.wrapping_add(q);
        }
        s
    }

    /// A tile of 4 weight rows (`w`, stride `k`) × `C` input rows (`x`, stride `k`): per 8-float
    /// chunk, the `C` input chunks are loaded, then each weight row's chunk once, FMA'd into its
    /// `C` accumulators (4 × 3 tile: 12 accumulators + 3 + 1 = all 16 ymm registers).
    /// Results go to `out[c * n + r]`.
    macro_rules! tile4 {
        ($name:ident, $($c:literal => $xp:ident, $xv:ident, [$a0:ident, $a1:ident, $a2:ident, $a3:ident]),+) => {
            #[inline]
            #[target_feature(enable = "avx2,fma")]
            unsafe fn $name<const PF: bool>(
                w: *const f32,
                x: *const f32,
                k: usize,
                out: *mut f32,
                n: usize,
            ) {
                let w0 = w;
                let w1 = w.wrapping_add(k);
                let w2 = w.wrapping_add(2 * k);
                let w3 = w.wrapping_add(3 * k);
                $(
                    let $xp = x.wrapping_add($c * k);
                    let mut $a0 = _mm256_setzero_ps();
                    let mut $a1 = _mm256_setzero_ps();
                    let mut $a2 = _mm256_setzero_ps();
                    let mut $a3 = _mm256_setzero_ps();
                )+
                let k8 = k & !7;
                let mut p = 0;
                // The next tiles' weights (4k floats each, contiguous) are prefetched 128 bytes
                // per step, so the next tile is in flight by the time this one ends.
                let pf = (w.wrapping_add(PF_TILES * 4 * k)) as *const i8;
                while p < k8 {
                    if PF {
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(16 * p));
                        _mm_prefetch::<_MM_HINT_T0>(pf.wrapping_add(16 * p + 64));
                    }
                    $( let $xv = load!($xp.wrapping_add(p)); )+
                    let v = load!(w0.wrapping_add(p));
                    $( $a0 = _mm256_fmadd_ps(v, $xv, $a0); )+
                    let v = load!(w1.wrapping_add(p));
                    $( $a1 = _mm256_fmadd_ps(v, $xv, $a1); )+
                    let v = load!(w2.wrapping_add(p));
                    $( $a2 = _mm256_fmadd_ps(v, $xv, $a2); )+
                    let v = load!(w3.wrapping_add(p));
                    $( $a3 = _mm256_fmadd_ps(v, $xv, $a3); )+
                    p += 8;
                }
                $(
                    let o = out.wrapping_add($c * n);
                    *o = finish($a0, w0, $xp, k8, k);
                    *o.wrapping_add(1) = finish($a1, w1, $xp, k8, k);
                    *o.wrapping_add(2) = finish($a2, w2, $xp, k8, k);
                    *o.wrapping_add(3) = finish($a3, w3, $xp, k8, k);
                )+
            }
        };
    }
    tile4!(tile4x1, 0 => x0, u0, [a00, a01, a02, a03]);
    tile4!(
        tile4x2,
        0 => x0, u0, [a00, a01, a02, a03],
        1 => x1, u1, [a10, a11, a12, a13]
    );
    tile4!(
        tile4x3,
        0 => x0, u0, [a00, a01, a02, a03],
        1 => x1, u1, [a10, a11, a12, a13],
        2 => x2, u2, [a20, a21, a22, a23]
    );

    /// One weight row against one input row (the `n % 4` leftover rows), summed in the same
    /// order as the tiles, so every output element is the same whichever path computes it.
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn dot(w: *const f32, x: *const f32, k: usize) -> f32 {
        let mut a = _mm256_setzero_ps();
        let k8 = k & !7;
        let mut p = 0;
        while p < k8 {
            a = _mm256_fmadd_ps(load!(w.wrapping_add(p)), load!(x.wrapping_add(p)), a);
            p += 8;
        }
        finish(a, w, x, k8, k)
    }

    /// Input rows of `x` in `[i0, i1)` against weight rows `[j0, j1)` (`j1 - j0` a multiple of
    /// 4): for each 4-row weight tile (then in L1), every input row, 3 at a time. The weights
    /// are prefetched only when `prefetch` (the first pass over them).
    #[allow(clippy::too_many_arguments)]
    #[inline]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn tiles(
        x: *const f32,
        (i0, i1): (usize, usize),
        w: *const f32,
        (j0, j1): (usize, usize),
        n: usize,
        k: usize,
        out: *mut f32,
        prefetch: bool,
    ) {
        let mut j = j0;
        while j + NR <= j1 {
            let wj = w.wrapping_add(j * k);
            let mut i = i0;
            while i < i1 {
                let xi = x.wrapping_add(i * k);
                let oi = out.wrapping_add(i * n + j);
                let pf = prefetch && i == i0;
                // Input rows 3 at a time; a remainder of 4 as 2 + 2 rather than 3 + 1.
                match i1 - i {
                    1 => {
                        if pf {
                            tile4x1::<true>(wj, xi, k, oi, n)
                        } else {
                            tile4x1::<false>(wj, xi, k, oi, n)
                        }
                        i += 1;
                    }
                    2 | 4 => {
                        if pf {
                            tile4x2::<true>(wj, xi, k, oi, n)
                        } else {
                            tile4x2::<false>(wj, xi, k, oi, n)
                        }
                        i += 2;
                    }
                    _ => {
                        if pf {
                            tile4x3::<true>(wj, xi, k, oi, n)
                        } else {
                            tile4x3::<false>(wj, xi, k, oi, n)
                        }
                        i += 3;
                    }
                }
            }
            j += NR;
        }
    }

    /// Columns `n0..n1` of `out[m, n]` = `x[m, k]` · `w[n, k]ᵀ`.
    ///
    /// For large `m` (prefill) the work is blocked for L2: chunks of weight rows (~128 KiB)
    /// against panels of input rows (`PANEL_M`), so neither is re-read from memory per tile.
    /// For `m <= PANEL_M` this is one sweep over the weights.
    #[allow(clippy::too_many_arguments)]
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn block(
        x: *const f32,
        m: usize,
        w: *const f32,
        n: usize,
        k: usize,
        n0: usize,
        n1: usize,
        out: *mut f32,
    ) {
        let chunk = (CHUNK_BYTES / (k * 4)).max(1).div_ceil(NR) * NR;
        let mut jc = n0;
        while jc < n1 {
            let je = (jc + chunk).min(n1);
            let jt = jc + (je - jc) / NR * NR; // the tiled part
            let mut ip = 0;
            while ip < m {
                let ie = (ip + PANEL_M).min(m);
                tiles(x, (ip, ie), w, (jc, jt), n, k, out, ip == 0);
                ip = ie;
            }
            for j in jt..je {
                let wj = w.wrapping_add(j * k);
                for i in 0..m {
                    *out.wrapping_add(i * n + j) = dot(wj, x.wrapping_add(i * k), k);
                }
            }
            jc = je;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.gen_range(-1.0f32..1.0)).collect()
    }

    /// Against an f64 reference: |err| <= 1e-5 * Σ|w·x| per element.
    fn check(got: &[f32], x: &[f32], m: usize, w: &[f32], n: usize, k: usize, what: &str) {
        for i in 0..m {
            for j in 0..n {
                let (mut s, mut a) = (0f64, 0f64);
                for q in 0..k {
                    let p = x[i * k + q] as f64 * w[j * k + q] as f64;
                    s += p;
                    a += p.abs();
                }
                let d = (got[i * n + j] as f64 - s).abs();
                assert!(
                    d <= 1e-5 * a.max(1e-30),
                    "{what}: m={m} n={n} k={k} [{i},{j}]: got {} want {s} (|x||w| {a})",
                    got[i * n + j]
                );
            }
        }
    }

    #[test]
    fn kernels_match_f64_and_candle() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        let mut worst = 0f32;
        for &(n, k) in &[
            (1, 1),
            (5, 3),
            (7, 13),
            (37, 64),
            (130, 100),
            (333, 576),
            (601, 1537),
            (1030, 200),
        ] {
            let w = rand_vec(&mut rng, n * k);
            let lin = Linear::new(Tensor::from_vec(w.clone(), (n, k), &Device::Cpu)?)?;
            for &m in &[1, 2, 3, 4, 5, 8, 16, 17, 33, 40, 97, 200] {
                let x = rand_vec(&mut rng, m * k);
                let mut out = vec![f32::NAN; m * n];
                matmul_nt(&x, m, &w, n, k, &mut out);
                check(&out, &x, m, &w, n, k, "simd");
                let mut out_s = vec![f32::NAN; m * n];
                matmul_nt_scalar(&x, m, &w, n, k, &mut out_s);
                check(&out_s, &x, m, &w, n, k, "scalar");

                // Against candle's matmul, through the tensor API (both code paths).
                let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?;
                let want = xt.matmul(&lin.weight().t()?)?;
                let scale = want.abs()?.max_all()?.to_scalar::<f32>()?.max(1e-6);
                for simd in [true, false] {
                    let got = lin.forward_with(&xt, simd && simd_available())?;
                    assert_eq!(got.dims(), [m, n]);
                    let d = (got - &want)?.abs()?.max_all()?.to_scalar::<f32>()?;
                    assert!(d <= 1e-4 * scale, "m={m} n={n} k={k}: {d} vs {scale}");
                    worst = worst.max(d / scale);
                }
            }
        }
        println!("max |ours - candle| / max |candle|: {worst:.2e}");
        Ok(())
    }

    /// Each output row depends only on its own input row (bit for bit), whatever the number of
    /// rows or their grouping into tiles: batching sequences cannot change their results.
    #[test]
    fn rows_do_not_depend_on_the_batch() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(11);
        let (n, k, m) = (203, 100, 13);
        let w = rand_vec(&mut rng, n * k);
        let x = rand_vec(&mut rng, m * k);
        let mut all = vec![0f32; m * n];
        matmul_nt(&x, m, &w, n, k, &mut all);
        for i in 0..m {
            let mut one = vec![0f32; n];
            matmul_nt(&x[i * k..(i + 1) * k], 1, &w, n, k, &mut one);
            assert_eq!(one, all[i * n..(i + 1) * n], "row {i}");
        }
    }

    #[test]
    fn leading_dims_and_non_contiguous_input() -> Result<()> {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let (n, k) = (50, 24);
        let w = Tensor::from_vec(rand_vec(&mut rng, n * k), (n, k), &Device::Cpu)?;
        let lin = Linear::new(w.clone())?;
        let x = Tensor::from_vec(rand_vec(&mut rng, 2 * 3 * k), (2, 3, k), &Device::Cpu)?;
        let got = lin.forward(&x)?;
        assert_eq!(got.dims(), [2, 3, n]);
        let want = x.broadcast_matmul(&w.t()?)?;
        let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-4);
        // A transposed (strided) input.
        let xt = Tensor::from_vec(rand_vec(&mut rng, k * 3), (k, 3), &Device::Cpu)?.t()?;
        let got = lin.forward(&xt)?;
        let want = xt.contiguous()?.matmul(&w.t()?)?;
        let d = (got - want)?.abs()?.max_all()?.to_scalar::<f32>()?;
        assert!(d < 1e-4);
        assert!(lin
            .forward(&Tensor::zeros((2, k + 1), DType::F32, &Device::Cpu)?)
            .is_err());
        Ok(())
    }

    /// Throughput on the SmolLM2-135M shapes, kernel vs candle's matmul (min over interleaved
    /// rounds: the machine may be shared):
    /// `cargo test -p omnistream-stages --lib linear::tests::bench -- --ignored --nocapture`
    /// (`BENCH_N=49152 BENCH_M=1,8` to select).
    #[test]
    #[ignore]
    fn bench() -> Result<()> {
        use std::time::Instant;
        let mut rng = rand::rngs::StdRng::seed_from_u64(1);
        let only_n: Option<usize> = std::env::var("BENCH_N").ok().and_then(|s| s.parse().ok());
        let ms: Vec<usize> = std::env::var("BENCH_M")
            .ok()
            .map(|s| s.split(',').filter_map(|m| m.parse().ok()).collect())
            .unwrap_or_else(|| vec![1, 2, 4, 8, 16, 32, 64, 128, 256]);
        let shapes = [
            (192, 576),
            (576, 576),
            (1536, 576),
            (576, 1536),
            (49152, 576),
        ];
        for &(n, k) in &shapes {
            if only_n.is_some_and(|o| o != n) {
                continue;
            }
            let w = rand_vec(&mut rng, n * k);
            let wt = Tensor::from_vec(w.clone(), (n, k), &Device::Cpu)?.t()?;
            for &m in &ms {
                let x = rand_vec(&mut rng, m * k);
                let xt = Tensor::from_vec(x.clone(), (m, k), &Device::Cpu)?;
                let mut out = vec![0f32; m * n];
                let reps = (20_000_000 / (n * k * 4)).clamp(1, 100);
                let (mut ours, mut candle) = (f64::INFINITY, f64::INFINITY);
                for _ in 0..10 {
                    let t = Instant::now();
                    for _ in 0..reps {
                        matmul_nt(&x, m, &w, n, k, &mut out);
                    }
                    ours = ours.min(t.elapsed().as_secs_f64() / reps as f64);
                    let t = Instant::now();
                    for _ in 0..reps {
                        xt.matmul(&wt)?;
                    }
                    candle = candle.min(t.elapsed().as_secs_f64() / reps as f64);
                }
                let gb = (n * k * 4) as f64 / 1e9;
                println!(
                    "n={n:5} k={k:4} m={m:3}: ours {:8.1} us ({:5.1} GB/s, {:5.1} GFLOP/s)  \
                     candle {:8.1} us ({:5.1} GB/s)",
                    ours * 1e6,
                    gb / ours,
                    gb / 2.0 * m as f64 / ours,
                    candle * 1e6,
                    gb / candle
                );
            }
        }
        Ok(())
    }
}
