// A dense decoder layer's elementwise work, fused (kernels.rs, layers.rs): each of
// these replaces two or three of candle's launches, which at a decode step's few
// rows cost more than the arithmetic (the code predictor runs 75 layer passes a
// frame).
#include "bf16.cuh"

#define DENSE_THREADS 256
#define GEMV_WARPS 4
#define GEMV_MAX_ROWS 8

// SwiGLU on the fused gate/up projection: gu (rows, 2 * n) bf16, gate in columns
// [0, n), up in [n, 2 * n); y (rows, n) = silu(gate) * up, with gate and up
// as the projection rounded them, the product in f32 rounded once. n a multiple
// of 8 (16-byte loads); n8 = n / 8, total8 = rows * n8.
extern "C" __global__ void silu_mul_bf16(
    const uint4* __restrict__ gu, uint4* __restrict__ y, int n8, long long total8) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total8;
         i += (long long)gridDim.x * blockDim.x) {
        const long long row = i / n8, c = i % n8;
        const uint4 g = gu[row * 2 * n8 + c], u = gu[row * 2 * n8 + n8 + c];
        const unsigned int gw[4] = {g.x, g.y, g.z, g.w}, uw[4] = {u.x, u.y, u.z, u.w};
        unsigned int w[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const float glo = bf_lo(gw[j]), ghi = bf_hi(gw[j]);
            const float lo = glo / (1.f + expf(-glo)) * bf_lo(uw[j]);
            const float hi = ghi / (1.f + expf(-ghi)) * bf_hi(uw[j]);
            w[j] = (unsigned int)to_bf16(lo) | ((unsigned int)to_bf16(hi) << 16);
        }
        y[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}

// 8 packed bf16 values `a` times `scale` times their norm weights `g`, in f32,
// each rounded once: an RMSNorm's output.
__device__ __forceinline__ uint4 scaled8(uint4 a, uint4 g, float scale) {
    const unsigned int aw[4] = {a.x, a.y, a.z, a.w}, gw[4] = {g.x, g.y, g.z, g.w};
    unsigned int o[4];
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const float lo = bf_lo(aw[j]) * scale * bf_lo(gw[j]);
        const float hi = bf_hi(aw[j]) * scale * bf_hi(gw[j]);
        o[j] = (unsigned int)to_bf16(lo) | ((unsigned int)to_bf16(hi) << 16);
    }
    return make_uint4(o[0], o[1], o[2], o[3]);
}

// The residual add and the RMSNorm after it: s = x + h rounded to bf16 (as the
// unfused add), y = s * rsqrt(mean(s^2) + eps) * w in f32, rounded once (as
// candle's bf16 rms_norm). Rows of `hidden` = n8 * 8 values; a block a row.
// Grid: rows; block: DENSE_THREADS.
extern "C" __global__ void __launch_bounds__(DENSE_THREADS) add_rms_norm_bf16(
    const uint4* __restrict__ x, const uint4* __restrict__ h, const uint4* __restrict__ w,
    uint4* __restrict__ s, uint4* __restrict__ y, int n8, float eps) {
    __shared__ float part[DENSE_THREADS / 32];
    const long long base = (long long)blockIdx.x * n8;
    float ss = 0.f;
    for (int c = threadIdx.x; c < n8; c += DENSE_THREADS) {
        const uint4 a = x[base + c], b = h[base + c];
        const unsigned int aw[4] = {a.x, a.y, a.z, a.w}, bw[4] = {b.x, b.y, b.z, b.w};
        unsigned int o[4];
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            const unsigned short lo = to_bf16(bf_lo(aw[j]) + bf_lo(bw[j]));
            const unsigned short hi = to_bf16(bf_hi(aw[j]) + bf_hi(bw[j]));
            const float flo = bf(lo), fhi = bf(hi);
            ss += flo * flo + fhi * fhi;
            o[j] = (unsigned int)lo | ((unsigned int)hi << 16);
        }
        s[base + c] = make_uint4(o[0], o[1], o[2], o[3]);
    }
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
    __syncthreads();
    float total = 0.f;
    #pragma unroll
    for (int i = 0; i < DENSE_THREADS / 32; i++) total += part[i];
    const float scale = rsqrtf(total / (float)(n8 * 8) + eps);
    // Each thread reads back only the sums it wrote itself.
    for (int c = threadIdx.x; c < n8; c += DENSE_THREADS) {
        y[base + c] = scaled8(s[base + c], w[c], scale);
    }
}

// A decode step's projection of m <= GEMV_MAX_ROWS rows: y (m, n) = x (m, k) .
// w (n, k)^T, bf16 in and out, f32 sums rounded once (as cuBLAS's bf16 GEMM
// with f32 accumulation). One warp a weight row, its lanes over k in 16-byte
// loads, so a whole matrix's loads are in flight at once (cuBLAS's kernels at
// these shapes split k and reduce after, at about 40% of the memory's rate).
// With SWIGLU w is (2n, k), gate rows then up rows, and the warp takes gate row
// r and up row n + r: y = silu(gate) * up, each projection rounded to bf16 and
// the product in f32 rounded once, as silu_mul_bf16 after the projection.
// With `resid` (m, n), y = resid + the projection, the projection rounded to
// bf16 first and the sum rounded again (as the unfused add after it).
// x4 (global or shared memory) and w4 as 16-byte groups, k8 = k / 8.
// `pre_g`/`pre_u`: the lane's first GEMV_PREFETCH weight groups, loaded by the
// caller before it had x (norm_gemv loads them before its norm, so the weights'
// latency runs under it); null: loaded here.
#define GEMV_PREFETCH 4
template <int WARPS, bool SWIGLU>
__device__ __forceinline__ void gemv_rows(
    const uint4* __restrict__ x4, const uint4* __restrict__ w4,
    const unsigned short* __restrict__ resid, unsigned short* __restrict__ y,
    int m, int n, int k8, const uint4* pre_g = nullptr, const uint4* pre_u = nullptr) {
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * WARPS + threadIdx.x / 32;
    if (row >= n) return;
    const uint4* g = w4 + (size_t)row * k8;
    const uint4* u = w4 + ((size_t)n + row) * k8;
    float acc[GEMV_MAX_ROWS], up[GEMV_MAX_ROWS];
#pragma unroll
    for (int j = 0; j < GEMV_MAX_ROWS; ++j) acc[j] = up[j] = 0.f;
    int c = lane;
    if (pre_g != nullptr) {
#pragma unroll
        for (int p = 0; p < GEMV_PREFETCH; ++p, c += 32) {
            if (c >= k8) break;
#pragma unroll
            for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
                if (j < m) {
                    const uint4 xv = x4[(size_t)j * k8 + c];
                    acc[j] += dot8(pre_g[p], xv);
                    if (SWIGLU) up[j] += dot8(pre_u[p], xv);
                }
            }
        }
    }
#pragma unroll 4
    for (; c < k8; c += 32) {
        const uint4 gv = __ldg(g + c);
        const uint4 uv = SWIGLU ? __ldg(u + c) : gv;
#pragma unroll
        for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
            if (j < m) {
                const uint4 xv = x4[(size_t)j * k8 + c];
                acc[j] += dot8(gv, xv);
                if (SWIGLU) up[j] += dot8(uv, xv);
            }
        }
    }
#pragma unroll
    for (int j = 0; j < GEMV_MAX_ROWS; ++j) {
        if (j >= m) break;
        const float a = warp_sum(acc[j]);
        const float b = SWIGLU ? warp_sum(up[j]) : 0.f;
        if (lane != 0) continue;
        const size_t at = (size_t)j * n + row;
        if (SWIGLU) {
            const float gr = bf(to_bf16(a)), ur = bf(to_bf16(b));
            y[at] = to_bf16(gr / (1.f + expf(-gr)) * ur);
        } else if (resid != nullptr) {
            y[at] = to_bf16(bf(resid[at]) + bf(to_bf16(a)));
        } else {
            y[at] = to_bf16(a);
        }
    }
}

// Grid: ceil(n / GEMV_WARPS); block: GEMV_WARPS * 32. `resid` may be null.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) dense_gemv_bf16(
    const uint4* __restrict__ x, const uint4* __restrict__ w,
    const unsigned short* __restrict__ resid, unsigned short* __restrict__ y,
    int m, int n, int k8) {
    gemv_rows<GEMV_WARPS, false>(x, w, resid, y, m, n, k8);
}

// The same over gate/up rows with the SwiGLU: n is the intermediate width.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * 32) dense_gate_up_bf16(
    const uint4* __restrict__ x, const uint4* __restrict__ w, unsigned short* __restrict__ y,
    int m, int n, int k8) {
    gemv_rows<GEMV_WARPS, true>(x, w, nullptr, y, m, n, k8);
}

// The RMSNorm of a decode step's residual rows and the projection after it in
// one launch: every block normalises the m rows of x (m, k) into shared memory
// (y = x * rsqrt(mean(x^2) + eps) * nw in f32, rounded once, as candle's bf16
// rms_norm and add_rms_norm_bf16), then its warps project them as
// dense_gemv_bf16 (or with the SwiGLU). The rows are re-normed by each block:
// k values read from L2, cheap beside the block's weight rows, and one launch
// fewer (and no normed copy written) for each projection after a norm.
// Dynamic shared memory: m * k bf16. Grid: ceil(n / NORM_GEMV_WARPS).
#define NORM_GEMV_WARPS 8
template <bool SWIGLU>
__device__ __forceinline__ void norm_gemv(
    const uint4* __restrict__ x, const uint4* __restrict__ nw, const uint4* __restrict__ w,
    unsigned short* __restrict__ y, int m, int n, int k8, float eps) {
    extern __shared__ uint4 xs[];
    __shared__ float part[NORM_GEMV_WARPS];
    // The warp's first weight groups, in flight while the block norms x.
    uint4 pre_g[GEMV_PREFETCH], pre_u[GEMV_PREFETCH];
    {
        const int lane = threadIdx.x % 32;
        const int row = blockIdx.x * NORM_GEMV_WARPS + threadIdx.x / 32;
        const uint4* g = w + (size_t)min(row, n - 1) * k8;
        const uint4* u = w + ((size_t)n + min(row, n - 1)) * k8;
#pragma unroll
        for (int p = 0; p < GEMV_PREFETCH; ++p) {
            const int c = lane + 32 * p;
            pre_g[p] = c < k8 ? __ldg(g + c) : make_uint4(0, 0, 0, 0);
            pre_u[p] = SWIGLU && c < k8 ? __ldg(u + c) : pre_g[p];
        }
    }
    for (int j = 0; j < m; ++j) {
        const uint4* xr = x + (size_t)j * k8;
        float ss = 0.f;
        for (int c = threadIdx.x; c < k8; c += NORM_GEMV_WARPS * 32) {
            const uint4 a = xr[c];
            const unsigned int aw[4] = {a.x, a.y, a.z, a.w};
#pragma unroll
            for (int q = 0; q < 4; q++) ss += bf_lo(aw[q]) * bf_lo(aw[q]) + bf_hi(aw[q]) * bf_hi(aw[q]);
        }
        ss = warp_sum(ss);
        if (threadIdx.x % 32 == 0) part[threadIdx.x / 32] = ss;
        __syncthreads();
        float total = 0.f;
#pragma unroll
        for (int i = 0; i < NORM_GEMV_WARPS; i++) total += part[i];
        // Every thread has read `part` before the next row writes it.
        __syncthreads();
        const float scale = rsqrtf(total / (float)(k8 * 8) + eps);
        for (int c = threadIdx.x; c < k8; c += NORM_GEMV_WARPS * 32) {
            xs[(size_t)j * k8 + c] = scaled8(xr[c], nw[c], scale);
        }
    }
    __syncthreads();
    gemv_rows<NORM_GEMV_WARPS, SWIGLU>(xs, w, nullptr, y, m, n, k8, pre_g, pre_u);
}

extern "C" __global__ void __launch_bounds__(NORM_GEMV_WARPS * 32) norm_gemv_bf16(
    const uint4* __restrict__ x, const uint4* __restrict__ nw, const uint4* __restrict__ w,
    unsigned short* __restrict__ y, int m, int n, int k8, float eps) {
    norm_gemv<false>(x, nw, w, y, m, n, k8, eps);
}

extern "C" __global__ void __launch_bounds__(NORM_GEMV_WARPS * 32) norm_gate_up_bf16(
    const uint4* __restrict__ x, const uint4* __restrict__ nw, const uint4* __restrict__ w,
    unsigned short* __restrict__ y, int m, int n, int k8, float eps) {
    norm_gemv<true>(x, nw, w, y, m, n, k8, eps);
}
