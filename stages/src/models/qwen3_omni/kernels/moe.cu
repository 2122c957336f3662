// MoE kernels for decode steps (a few tokens, each routed to top-k of E experts):
// every routed expert's weights are read once per step for all the (token,
// choice) pairs routed to it, with 16-byte loads, bf16 in and out, f32
// accumulation (bf16 helpers in bf16.cuh).
//
// Two ways to find an expert's pairs:
// - `moe_gemv_bf16`: candle's `moe_gemm` contract (candle-nn/src/moe.rs): pairs
//   sorted by expert (`sorted[i]` a pair index, `experts[i]` its expert,
//   ascending); one block column per expert, which finds its segment by binary
//   search (most blocks find none at small batches).
// - `moe_route_bf16` then `moe_gate_up_bf16` / `moe_down_bf16`: the router's top-k,
//   the sort and a compact list of the routed experts in one kernel (`meta`:
//   count, then (expert, lo, hi) per routed expert), so the expert kernels launch
//   one block column per routed expert, and gate/up ends in the SwiGLU itself.
//
// Output row `sorted[i]` gets W[e] @ x[row], row = `sorted[i] / topk` for the
// pairs' tokens (gate/up) or `sorted[i]` with one input row per pair (down),
// scaled by `pair_weights[sorted[i]]` when given. K must be a multiple of 8.

#define WARPS 4
#define ROWS_PER_WARP 4
#define PAIRS 8
#define ROUTE_THREADS 1024
#define ROUTE_MAX_EXPERTS 256
#define ROUTE_MAX_TOPK 16
#define ROUTE_MAX_TOKENS 128

#include "bf16.cuh"

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    return bf_lo(a.x) * bf_lo(b.x) + bf_hi(a.x) * bf_hi(b.x)
         + bf_lo(a.y) * bf_lo(b.y) + bf_hi(a.y) * bf_hi(b.y)
         + bf_lo(a.z) * bf_lo(b.z) + bf_hi(a.z) * bf_hi(b.z)
         + bf_lo(a.w) * bf_lo(b.w) + bf_hi(a.w) * bf_hi(b.w);
}

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o /= 2) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
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

// ROWS rows of expert e's (n, k) matrix per warp, starting at row0, times the
// inputs of pairs sorted[lo..hi); `store(pair, r, value)` takes each dot product.
// The rows are streamed together so their loads are in flight at once.
template <int ROWS, int UNROLL = 2, typename Store>
__device__ __forceinline__ void expert_rows(
    const unsigned short* __restrict__ x, const uint4* const* wrow,
    const unsigned int* __restrict__ sorted, bool per_pair, int topk,
    int lo, int hi, int k, Store store)
{
    const int lane = threadIdx.x % 32;
    const int k8 = k / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int p0 = lo; p0 < hi; p0 += PAIRS) {
        const int m = min(PAIRS, hi - p0);
        int in_row[PAIRS];
        float acc[ROWS][PAIRS];
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            in_row[j] = j < m ? (int)(per_pair ? sorted[p0 + j] : sorted[p0 + j] / topk) : 0;
#pragma unroll
            for (int r = 0; r < ROWS; ++r) acc[r][j] = 0.f;
        }
#pragma unroll UNROLL
        for (int c = lane; c < k8; c += 32) {
            uint4 wv[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) wv[r] = __ldg(wrow[r] + c);
#pragma unroll
            for (int j = 0; j < PAIRS; ++j) {
                if (j < m) {
                    const uint4 xv = x4[(size_t)in_row[j] * k8 + c];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r][j] += dot8(wv[r], xv);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < PAIRS; ++j) {
            if (j >= m) break; // m is the same across the warp
            float v[ROWS];
#pragma unroll
            for (int r = 0; r < ROWS; ++r) v[r] = warp_sum(acc[r][j]);
            if (lane == 0) store(sorted[p0 + j], v);
        }
    }
}

// out[pair, row0 + r] = W[e][row0 + r] . x[pair's row] (* pair weight), for the
// warp's rows of pairs sorted[lo..hi).
template <int UNROLL = 2>
__device__ __forceinline__ void gemv_rows(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted, const float* __restrict__ pair_weights,
    unsigned short* __restrict__ out, unsigned int e, int lo, int hi, int n, int k, int topk)
{
    const int warp = threadIdx.x / 32;
    const int row0 = (blockIdx.y * WARPS + warp) * ROWS_PER_WARP;
    if (row0 >= n) return;
    const uint4* wrow[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < ROWS_PER_WARP; ++r) {
        const int row = min(row0 + r, n - 1); // a missing last row repeats one, unstored
        wrow[r] = reinterpret_cast<const uint4*>(w + ((size_t)e * n + row) * (size_t)k);
    }
    expert_rows<ROWS_PER_WARP, UNROLL>(x, wrow, sorted, pair_weights != nullptr, topk, lo, hi, k,
        [&](unsigned int pair, const float* v) {
            const float scale = pair_weights ? pair_weights[pair] : 1.f;
#pragma unroll
            for (int r = 0; r < ROWS_PER_WARP; ++r)
                if (row0 + r < n) out[(size_t)pair * n + row0 + r] = to_bf16(v[r] * scale);
        });
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
    if (seg[0] >= seg[1]) return;
    gemv_rows(x, w, sorted, pair_weights, out, e, seg[0], seg[1], n, k, topk);
}

// Routing of n <= ROUTE_MAX_TOKENS tokens, one block of ROUTE_THREADS: per token
// (a warp each) the softmax of its router logits (f32, as the reference), its
// top-k (descending, ties to the lower expert) and their weights, renormalised
// when `norm`; then the pairs counted per expert, ordered by expert (by pair
// index within one), and the routed experts listed in `meta`.
// Outputs: weights (n * topk) f32, sorted (n * topk) u32, meta (1 + 3 * E) u32.
extern "C" __global__ void moe_route_bf16(
    const unsigned short* __restrict__ logits,
    float* __restrict__ weights,
    unsigned int* __restrict__ sorted,
    unsigned int* __restrict__ meta,
    int n, int n_experts, int topk, int norm)
{
    __shared__ unsigned int pair_expert[ROUTE_MAX_TOKENS * ROUTE_MAX_TOPK];
    __shared__ int count[ROUTE_MAX_EXPERTS];
    __shared__ int offset[ROUTE_MAX_EXPERTS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int pairs = n * topk;
    for (int e = tid; e < n_experts; e += ROUTE_THREADS) count[e] = 0;
    __syncthreads();
    constexpr int PER_LANE = ROUTE_MAX_EXPERTS / 32;
    for (int t = warp; t < n; t += ROUTE_THREADS / 32) {
        float v[PER_LANE];
        float mx = -INFINITY;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane + 32 * i;
            v[i] = e < n_experts ? bf(logits[(size_t)t * n_experts + e]) : -INFINITY;
            mx = fmaxf(mx, v[i]);
        }
        for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float s = 0.f;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            v[i] = lane + 32 * i < n_experts ? expf(v[i] - mx) : 0.f;
            s += v[i];
        }
        s = warp_sum(s);
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) v[i] = lane + 32 * i < n_experts ? v[i] / s : -1.f;
        float picked[ROUTE_MAX_TOPK];
        float total = 0.f;
        for (int j = 0; j < topk; ++j) {
            float best = -2.f;
            int bi = 0x7fffffff;
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i)
                if (v[i] > best) { best = v[i]; bi = lane + 32 * i; }
            for (int o = 16; o > 0; o /= 2) {
                const float ob = __shfl_xor_sync(0xffffffffu, best, o);
                const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
                if (ob > best || (ob == best && oi < bi)) { best = ob; bi = oi; }
            }
#pragma unroll
            for (int i = 0; i < PER_LANE; ++i)
                if (lane + 32 * i == bi) v[i] = -2.f;
            picked[j] = best;
            total += best;
            if (lane == 0) pair_expert[t * topk + j] = (unsigned int)bi;
        }
        if (lane == 0) {
            for (int j = 0; j < topk; ++j) {
                weights[t * topk + j] = norm ? picked[j] / total : picked[j];
                atomicAdd(&count[pair_expert[t * topk + j]], 1);
            }
        }
    }
    __syncthreads();
    if (tid == 0) {
        int off = 0, routed = 0;
        for (int e = 0; e < n_experts; ++e) {
            offset[e] = off;
            if (count[e] > 0) {
                meta[1 + 3 * routed] = e;
                meta[2 + 3 * routed] = off;
                meta[3 + 3 * routed] = off + count[e];
                ++routed;
            }
            off += count[e];
        }
        meta[0] = routed;
    }
    __syncthreads();
    // One thread an expert walks the pairs in order: a deterministic order.
    for (int e = tid; e < n_experts; e += ROUTE_THREADS) {
        if (count[e] == 0) continue;
        int at = offset[e];
        for (int p = 0; p < pairs; ++p)
            if (pair_expert[p] == (unsigned int)e) sorted[at++] = p;
    }
}

// Down projection over the routed experts of `meta`: out (P, n) gets each pair's
// row (one input row per pair) through its expert, times its weight.
// Grid: (min(P, E), ceil(n / (WARPS * ROWS_PER_WARP))); block: WARPS * 32.
extern "C" __global__ void moe_down_bf16(
    const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted,
    const unsigned int* __restrict__ meta,
    const float* __restrict__ pair_weights,
    unsigned short* __restrict__ out,
    int n, int k)
{
    const unsigned int a = blockIdx.x;
    if (a >= meta[0]) return;
    // The down projection's rows are short (k = the experts' width): all of a
    // lane's loads of a row group go out at once.
    gemv_rows<4>(x, w, sorted, pair_weights, out, meta[1 + 3 * a], meta[2 + 3 * a],
                 meta[3 + 3 * a], n, k, 1);
}

// The routed experts' sum per token: out (tokens, n) = sum over the token's topk
// pairs' rows of y (tokens * topk, n), in f32, in choice order.
// Grid: (ceil(n / 256), tokens); block: 256.
extern "C" __global__ void moe_sum_bf16(
    const unsigned short* __restrict__ y,
    unsigned short* __restrict__ out,
    int n, int topk)
{
    const int c = blockIdx.x * 256 + threadIdx.x;
    const size_t t = blockIdx.y;
    if (c >= n) return;
    float acc = 0.f;
    for (int j = 0; j < topk; ++j) acc += bf(y[(t * topk + j) * n + c]);
    out[t * n + c] = to_bf16(acc);
}

// Gate and up projections with the SwiGLU, over the routed experts of `meta`:
// w (E, 2 * inter, k) holds gate rows then up rows; h (P, inter) gets
// silu(gate . x) * (up . x), rounded as candle rounds the separate ops (each
// projection to bf16, the silu to bf16, the product to bf16).
// Grid: (min(P, E), ceil(inter / (WARPS * ROWS_PER_WARP / 2))); block: WARPS * 32.
extern "C" __global__ void moe_gate_up_bf16(
    const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted,
    const unsigned int* __restrict__ meta,
    unsigned short* __restrict__ h,
    int inter, int k, int topk)
{
    constexpr int HALF = ROWS_PER_WARP / 2;
    const unsigned int a = blockIdx.x;
    if (a >= meta[0]) return;
    const unsigned int e = meta[1 + 3 * a];
    const int warp = threadIdx.x / 32;
    const int row0 = (blockIdx.y * WARPS + warp) * HALF;
    if (row0 >= inter) return;
    const uint4* wrow[ROWS_PER_WARP];
#pragma unroll
    for (int r = 0; r < HALF; ++r) {
        const int row = min(row0 + r, inter - 1);
        const size_t gate = (size_t)e * 2 * inter + row;
        wrow[r] = reinterpret_cast<const uint4*>(w + gate * (size_t)k);
        wrow[HALF + r] = reinterpret_cast<const uint4*>(w + (gate + inter) * (size_t)k);
    }
    expert_rows<ROWS_PER_WARP>(x, wrow, sorted, false, topk, meta[2 + 3 * a], meta[3 + 3 * a], k,
        [&](unsigned int pair, const float* v) {
#pragma unroll
            for (int r = 0; r < HALF; ++r) {
                if (row0 + r >= inter) continue;
                const float g = bf(to_bf16(v[r]));
                const float u = bf(to_bf16(v[HALF + r]));
                const float s = bf(to_bf16(g / (1.0f + expf(-g))));
                h[(size_t)pair * inter + row0 + r] = to_bf16(s * u);
            }
        });
}
