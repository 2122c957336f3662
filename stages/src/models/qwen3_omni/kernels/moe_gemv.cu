// Grouped GEMV for MoE decode steps: each routed expert's weights are read once
// per step, for every (token, choice) pair routed to it, with 16-byte loads.
// Same contract as candle's `moe_gemm` (candle-nn/src/moe.rs): pairs come sorted
// by expert (`sorted[i]` is a pair index, `experts[i]` its expert, ascending);
// output row `sorted[i]` of `out` (P, N) gets W[experts[i]] @ x[row], where row
// is `sorted[i] / topk` without pair weights (the pairs' tokens) or `sorted[i]`
// with them (one input row per pair), scaled by `pair_weights[sorted[i]]`.
// bf16 in and out, f32 accumulation; K must be a multiple of 8. No headers: the
// bf16 conversions are written out.

#define WARPS 4
#define ROWS_PER_WARP 4
#define PAIRS 8

__device__ __forceinline__ float bf_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u); // NaN
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest even
    return (unsigned short)(u >> 16);
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    return bf_lo(a.x) * bf_lo(b.x) + bf_hi(a.x) * bf_hi(b.x)
         + bf_lo(a.y) * bf_lo(b.y) + bf_hi(a.y) * bf_hi(b.y)
         + bf_lo(a.z) * bf_lo(b.z) + bf_hi(a.z) * bf_hi(b.z)
         + bf_lo(a.w) * bf_lo(b.w) + bf_hi(a.w) * bf_hi(b.w);
}

// First index in experts[0..p) not below e.
__device__ __forceinline__ int lower_bound(const unsigned int* experts, int p, unsigned int e) {
    int lo = 0, hi = p;
    while (lo < hi) {
        int mid = (lo + hi) / 2;
        if (experts[mid] < e) lo = mid + 1; else hi = mid;
    }
    return lo;
}

// Grid: (experts, ceil(N / (WARPS * ROWS_PER_WARP))); block: WARPS * 32 threads.
extern "C" __global__ void moe_gemv_bf16(
    const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted,
    const unsigned int* __restrict__ experts,
    const float* __restrict__ pair_weights,
    unsigned short* __restrict__ out,
    int p, int n, int k, int topk)
{
    __shared__ int seg[2];
    const unsigned int e = blockIdx.x;
    if (threadIdx.x == 0) {
        seg[0] = lower_bound(experts, p, e);
        seg[1] = lower_bound(experts, p, e + 1);
    }
    __syncthreads();
    const int lo = seg[0], hi = seg[1];
    if (lo >= hi) return;
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const int k8 = k / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    // This warp's rows, streamed together so their loads are in flight at once.
    const int row0 = (blockIdx.y * WARPS + warp) * ROWS_PER_WARP;
    if (row0 >= n) return;
    const uint4* wrow[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = min(row0 + r, n - 1); // a missing last row repeats one, unstored
        wrow[r] = reinterpret_cast<const uint4*>(w + ((size_t)e * n + row) * (size_t)k);
    }
    for (int p0 = lo; p0 < hi; p0 += PAIRS) {
        const int m = min(PAIRS, hi - p0);
        int in_row[PAIRS];
        float acc[ROWS_PER_WARP][PAIRS];
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            in_row[j] = j < m ? (int)(pair_weights ? sorted[p0 + j] : sorted[p0 + j] / topk) : 0;
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r][j] = 0.f;
        }
#pragma unroll 2
        for (int c = lane; c < k8; c += 32) {
            uint4 wv[ROWS_PER_WARP];
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) wv[r] = __ldg(wrow[r] + c);
#pragma unroll
            for (int j = 0; j < PAIRS; ++j) {
                if (j < m) {
                    const uint4 xv = x4[(size_t)in_row[j] * k8 + c];
#pragma unroll
                    for (int r = 0; r < ROWS_PER_WARP; ++r) acc[r][j] += dot8(wv[r], xv);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            if (j >= m) break; // m is the same across the warp
            const unsigned int pair = sorted[p0 + j];
            const float scale = pair_weights ? pair_weights[pair] : 1.f;
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r) {
                float v = acc[r][j];
                for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
                if (lane == 0 && row0 + r < n) out[(size_t)pair * n + row0 + r] = to_bf16(v * scale);
            }
        }
    }
}
