// MoE kernels: for decode steps (a few tokens, each routed to top-k of E
// experts) every routed expert's weights are read once per step for all the
// (token, choice) pairs routed to it, with 16-byte loads, bf16 in and out, f32
// accumulation (bf16 helpers in bf16.cuh); for prefills, the routing of any
// number of tokens and a tensor-core grouped GEMM (the end of this file).
//
// Two ways to find an expert's pairs:
// - `moe_gemv_bf16`: candle's `moe_gemm` contract (candle-nn/src/moe.rs): pairs
//   sorted by expert (`sorted[i]` a pair index, `experts[i]` its expert,
//   ascending); one block column per expert, which finds its segment by binary
//   search (most blocks find none at small batches).
// - `moe_route_bf16` then `moe_gate_up_*` / `moe_down_*`: the router's top-k,
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
template <int ROWS, int UNROLL = 2, int NP = PAIRS, typename Store>
__device__ __forceinline__ void expert_rows(
    const unsigned short* __restrict__ x, const uint4* const* wrow,
    const unsigned int* __restrict__ sorted, bool per_pair, int topk,
    int lo, int hi, int k, Store store)
{
    const int lane = threadIdx.x % 32;
    const int k8 = k / 8;
    const uint4* x4 = reinterpret_cast<const uint4*>(x);
    for (int p0 = lo; p0 < hi; p0 += NP) {
        const int m = min(NP, hi - p0);
        int in_row[NP];
        float acc[ROWS][NP];
#pragma unroll
        for (int j = 0; j < NP; ++j) {
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
            for (int j = 0; j < NP; ++j) {
                if (j < m) {
                    const uint4 xv = x4[(size_t)in_row[j] * k8 + c];
#pragma unroll
                    for (int r = 0; r < ROWS; ++r) acc[r][j] += dot8(wv[r], xv);
                }
            }
        }
#pragma unroll
        for (int j = 0; j < NP; ++j) {
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
template <int ROWS = ROWS_PER_WARP, int UNROLL = 2, int NP = PAIRS>
__device__ __forceinline__ void gemv_rows(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted, const float* __restrict__ pair_weights,
    unsigned short* __restrict__ out, unsigned int e, int lo, int hi, int n, int k, int topk)
{
    const int warp = threadIdx.x / 32;
    const int row0 = (blockIdx.y * WARPS + warp) * ROWS;
    if (row0 >= n) return;
    const uint4* wrow[ROWS];
#pragma unroll
    for (int r = 0; r < ROWS; ++r) {
        const int row = min(row0 + r, n - 1); // a missing last row repeats one, unstored
        wrow[r] = reinterpret_cast<const uint4*>(w + ((size_t)e * n + row) * (size_t)k);
    }
    expert_rows<ROWS, UNROLL, NP>(x, wrow, sorted, pair_weights != nullptr, topk, lo, hi, k,
        [&](unsigned int pair, const float* v) {
            const float scale = pair_weights ? pair_weights[pair] : 1.f;
#pragma unroll
            for (int r = 0; r < ROWS; ++r)
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

// Token t's router softmax (f32, as the reference) and top-k, by one warp:
// choice j's expert to pair_expert[t * topk + j] (shared or global memory) and
// its weight, renormalised when `norm`, to weights[t * topk + j]. Descending,
// ties to the lower expert.
__device__ __forceinline__ void route_token(
    const unsigned short* __restrict__ logits, int t, int n_experts, int topk, int norm,
    unsigned int* pair_expert, float* __restrict__ weights)
{
    constexpr int PER_LANE = ROUTE_MAX_EXPERTS / 32;
    const int lane = threadIdx.x % 32;
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
    // Lane j keeps choice j's weight; the total is the same on every lane.
    float mine = 0.f, total = 0.f;
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
        // NaN logits pick nothing: a weightless valid expert keeps the indices in range.
        if (bi >= n_experts) { bi = j % n_experts; best = 0.f; }
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i)
            if (lane + 32 * i == bi) v[i] = -2.f;
        if (lane == j) { mine = best; pair_expert[(size_t)t * topk + j] = (unsigned int)bi; }
        total += best;
    }
    if (lane < topk) weights[(size_t)t * topk + lane] = norm ? mine / total : mine;
}

// One warp ranks pairs [lo, hi) within their expert, in pair order, 32 at a
// time: rank[p] = the expert's pairs before p (those already in count[e], then
// this warp's earlier ones); count[e] ends as the expert's total.
template <typename Rank>
__device__ __forceinline__ void rank_pairs(
    const unsigned int* pair_expert, int lo, int hi, int* count, Rank* rank)
{
    const int lane = threadIdx.x % 32;
    const unsigned int below = (1u << lane) - 1u;
    for (int p0 = lo; p0 < hi; p0 += 32) {
        const int p = p0 + lane;
        const bool live = p < hi;
        const unsigned int e = live ? pair_expert[p] : 0xffffffffu;
        const unsigned int same = __match_any_sync(0xffffffffu, e);
        const int before = live ? count[e] : 0;
        __syncwarp();
        if (live) {
            rank[p] = (Rank)(before + __popc(same & below));
            if ((same & below) == 0) count[e] = before + __popc(same);
        }
        __syncwarp();
    }
}

// Inclusive scans of a and b across the warp, in lane order.
__device__ __forceinline__ void warp_scan2(int& a, int& b)
{
    const int lane = threadIdx.x % 32;
    for (int o = 1; o < 32; o *= 2) {
        const int u = __shfl_up_sync(0xffffffffu, a, o);
        const int v = __shfl_up_sync(0xffffffffu, b, o);
        if (lane >= o) { a += u; b += v; }
    }
}

// Routing of n <= ROUTE_MAX_TOKENS tokens, one block of ROUTE_THREADS: per token
// (a warp each) the softmax of its router logits (f32, as the reference), its
// top-k (descending, ties to the lower expert) and their weights, renormalised
// when `norm`; then (warp 0 alone, no atomics) the pairs ranked within their
// expert in pair order, the experts' offsets by a warp scan, the pairs ordered
// by expert (by pair index within one), and the routed experts listed in `meta`.
// Outputs: weights (n * topk) f32, sorted (n * topk) u32, meta (1 + 3 * E) u32.
extern "C" __global__ void moe_route_bf16(
    const unsigned short* __restrict__ logits,
    float* __restrict__ weights,
    unsigned int* __restrict__ sorted,
    unsigned int* __restrict__ meta,
    int n, int n_experts, int topk, int norm)
{
    __shared__ unsigned int pair_expert[ROUTE_MAX_TOKENS * ROUTE_MAX_TOPK];
    __shared__ unsigned short pair_rank[ROUTE_MAX_TOKENS * ROUTE_MAX_TOPK];
    __shared__ int count[ROUTE_MAX_EXPERTS];
    __shared__ int offset[ROUTE_MAX_EXPERTS];
    constexpr int PER_LANE = ROUTE_MAX_EXPERTS / 32;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int pairs = n * topk;
    for (int e = tid; e < ROUTE_MAX_EXPERTS; e += ROUTE_THREADS) count[e] = 0;
    for (int t = warp; t < n; t += ROUTE_THREADS / 32)
        route_token(logits, t, n_experts, topk, norm, pair_expert, weights);
    __syncthreads();
    if (warp != 0) return;
    rank_pairs(pair_expert, 0, pairs, count, pair_rank);
    // Offsets and the routed list: PER_LANE consecutive experts a lane, scanned.
    int local = 0, routed_local = 0;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int c = count[lane * PER_LANE + i];
        local += c;
        routed_local += c > 0;
    }
    int incl = local, rincl = routed_local;
    warp_scan2(incl, rincl);
    int off = incl - local, routed = rincl - routed_local;
#pragma unroll
    for (int i = 0; i < PER_LANE; ++i) {
        const int e = lane * PER_LANE + i;
        const int c = count[e];
        offset[e] = off;
        if (c > 0) {
            meta[1 + 3 * routed] = e;
            meta[2 + 3 * routed] = off;
            meta[3 + 3 * routed] = off + c;
            ++routed;
        }
        off += c;
    }
    if (lane == 31) meta[0] = rincl;
    __syncwarp();
    for (int p = lane; p < pairs; p += 32) sorted[offset[pair_expert[p]] + pair_rank[p]] = p;
}

// Routing of any number of tokens (prefills) in two launches, for the
// tensor-core kernels: `moe_topk_bf16` routes each token (a warp a token, 8 a
// block) into pair_expert (n * topk u32) and weights; `moe_sort_bf16` (one block
// of ROUTE_THREADS) orders the pairs by expert, by pair index within one (each
// warp ranks a contiguous segment of pairs, the segments' counts are summed per
// expert in warp order: no atomics, a fixed order), and lists in `meta` ranges
// of at most `max_rows` pairs of one expert: count, then (expert, lo, hi) each.
// `rank` (pairs u32) is scratch.
extern "C" __global__ void moe_topk_bf16(
    const unsigned short* __restrict__ logits,
    float* __restrict__ weights,
    unsigned int* __restrict__ pair_expert,
    int n, int n_experts, int topk, int norm)
{
    const int t = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    if (t < n) route_token(logits, t, n_experts, topk, norm, pair_expert, weights);
}

extern "C" __global__ void __launch_bounds__(ROUTE_THREADS) moe_sort_bf16(
    const unsigned int* __restrict__ pair_expert,
    unsigned int* __restrict__ rank,
    unsigned int* __restrict__ sorted,
    unsigned int* __restrict__ meta,
    int pairs, int n_experts, int max_rows)
{
    constexpr int NW = ROUTE_THREADS / 32;
    constexpr int PER_LANE = ROUTE_MAX_EXPERTS / 32;
    __shared__ int cnt[NW][ROUTE_MAX_EXPERTS]; // per warp, then its exclusive prefix
    __shared__ int offset[ROUTE_MAX_EXPERTS];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    for (int i = tid; i < NW * ROUTE_MAX_EXPERTS; i += ROUTE_THREADS) (&cnt[0][0])[i] = 0;
    __syncthreads();
    const int seg = (pairs + NW - 1) / NW;
    const int lo = min(pairs, warp * seg), hi = min(pairs, lo + seg);
    rank_pairs(pair_expert, lo, hi, cnt[warp], rank);
    __syncthreads();
    for (int e = tid; e < ROUTE_MAX_EXPERTS; e += ROUTE_THREADS) {
        int run = 0;
        for (int w = 0; w < NW; ++w) {
            const int c = cnt[w][e];
            cnt[w][e] = run;
            run += c;
        }
        offset[e] = run; // the expert's total, until the scan below
    }
    __syncthreads();
    if (warp == 0) {
        int local = 0, ranges_local = 0;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int c = offset[lane * PER_LANE + i];
            local += c;
            ranges_local += (c + max_rows - 1) / max_rows;
        }
        int incl = local, rincl = ranges_local;
        warp_scan2(incl, rincl);
        int off = incl - local, r = rincl - ranges_local;
#pragma unroll
        for (int i = 0; i < PER_LANE; ++i) {
            const int e = lane * PER_LANE + i;
            const int c = offset[e];
            offset[e] = off;
            for (int a = 0; a < c; a += max_rows, ++r) {
                meta[1 + 3 * r] = e;
                meta[2 + 3 * r] = off + a;
                meta[3 + 3 * r] = off + min(c, a + max_rows);
            }
            off += c;
        }
        if (lane == 31) meta[0] = rincl;
    }
    __syncthreads();
    for (int p = lo + lane; p < hi; p += 32) {
        const unsigned int e = pair_expert[p];
        sorted[offset[e] + cnt[warp][e] + rank[p]] = p;
    }
}

// Down projection over the routed experts of `meta`: out (P, n) gets each pair's
// row (one input row per pair) through its expert, times its weight.
// Grid: (the routing's range bound, ceil(n / (WARPS * ROWS))); block: WARPS * 32.
template <int ROWS, int NP>
__device__ __forceinline__ void down_gemv(
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
    // lane's loads of a row group go out at once (all of a 768-wide row's at 8
    // rows).
    gemv_rows<ROWS, ROWS == 4 ? 4 : 3, NP>(x, w, sorted, pair_weights, out, meta[1 + 3 * a],
                                          meta[2 + 3 * a], meta[3 + 3 * a], n, k, 1);
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
// Grid: (the routing's range bound, ceil(inter / (WARPS * ROWS / 2)));
// block: WARPS * 32.
template <int ROWS, int NP>
__device__ __forceinline__ void gate_up_gemv(
    const unsigned short* __restrict__ x,
    const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted,
    const unsigned int* __restrict__ meta,
    unsigned short* __restrict__ h,
    int inter, int k, int topk)
{
    constexpr int HALF = ROWS / 2;
    const unsigned int a = blockIdx.x;
    if (a >= meta[0]) return;
    const unsigned int e = meta[1 + 3 * a];
    const int warp = threadIdx.x / 32;
    const int row0 = (blockIdx.y * WARPS + warp) * HALF;
    if (row0 >= inter) return;
    const uint4* wrow[ROWS];
#pragma unroll
    for (int r = 0; r < HALF; ++r) {
        const int row = min(row0 + r, inter - 1);
        const size_t gate = (size_t)e * 2 * inter + row;
        wrow[r] = reinterpret_cast<const uint4*>(w + gate * (size_t)k);
        wrow[HALF + r] = reinterpret_cast<const uint4*>(w + (gate + inter) * (size_t)k);
    }
    expert_rows<ROWS, 2, NP>(x, wrow, sorted, false, topk, meta[2 + 3 * a], meta[3 + 3 * a], k,
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

// The same products on the tensor cores, for a few pairs an expert (decode
// steps): each warp runs mma.m16n8k16 over 16 weight rows and up to 8 pairs,
// the weights loaded straight from global memory into the A fragments. Lane
// (g = lane / 4, c = lane % 4) loads 16 bytes at k offset 8c of each 32-wide
// chunk from A rows g and g + 8 and from pair g's input row; the first two of
// its four 32-bit words feed one mma and the last two the next, which sums each
// chunk over a permutation of its k that A and B share, so the products are the
// same. No shuffles: the accumulators hold whole dot products. Gate/up: A rows
// g and g + 8 are gate and up row `row0 + g`, so the SwiGLU is in-thread.
// More than 8 pairs take another pass over the weights. Requires k % 32 == 0.
__device__ __forceinline__ void mma_bf16(float* d, const uint4& a_lo, const uint4& a_hi,
                                         const uint4& b, bool second)
{
    const unsigned int a0 = second ? a_lo.z : a_lo.x, a2 = second ? a_lo.w : a_lo.y;
    const unsigned int a1 = second ? a_hi.z : a_hi.x, a3 = second ? a_hi.w : a_hi.y;
    const unsigned int b0 = second ? b.z : b.x, b1 = second ? b.w : b.y;
    asm(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// Grid: (the routing's range bound, ceil(n_out / (WARPS * 8))) for gate/up (h
// (P, inter)), (bound, ceil(n_out / (WARPS * 16))) for down (out (P, n));
// block: WARPS * 32. U chunks of 32 are loaded before they are multiplied.
template <bool GATE_UP, int U>
__device__ __forceinline__ void mma_gemv(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,
    const float* __restrict__ pair_weights, unsigned short* __restrict__ out,
    int n_out, int k, int topk)
{
    const unsigned int a = blockIdx.x;
    if (a >= meta[0]) return;
    const size_t e = meta[1 + 3 * a];
    const int lo = (int)meta[2 + 3 * a], hi = (int)meta[3 + 3 * a];
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
    constexpr int WROWS = GATE_UP ? 8 : 16;
    const int row0 = (blockIdx.y * WARPS + warp) * WROWS;
    if (row0 >= n_out) return;
    size_t ra, rb; // A rows g and g + 8 (a missing last row repeats one, unstored)
    if (GATE_UP) {
        ra = e * 2 * n_out + min(row0 + g, n_out - 1);
        rb = ra + n_out;
    } else {
        ra = e * n_out + min(row0 + g, n_out - 1);
        rb = e * n_out + min(row0 + g + 8, n_out - 1);
    }
    const uint4* wa = reinterpret_cast<const uint4*>(w + ra * (size_t)k + 8 * c);
    const uint4* wb = reinterpret_cast<const uint4*>(w + rb * (size_t)k + 8 * c);
    const int chunks = k / 32;
    for (int p0 = lo; p0 < hi; p0 += 8) {
        const int m = min(8, hi - p0);
        const bool live = g < m;
        const unsigned int pg = live ? sorted[p0 + g] : 0u;
        const uint4* xr = reinterpret_cast<const uint4*>(
            x + (size_t)(GATE_UP ? pg / topk : pg) * (size_t)k + 8 * c);
        float d[4] = {0.f, 0.f, 0.f, 0.f};
        for (int q0 = 0; q0 < chunks; q0 += U) {
            uint4 av[U], bv[U], xv[U];
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (q0 + u < chunks) { // the same across the warp
                    av[u] = __ldg(wa + 4 * (q0 + u));
                    bv[u] = __ldg(wb + 4 * (q0 + u));
                    xv[u] = live ? xr[4 * (q0 + u)] : make_uint4(0u, 0u, 0u, 0u);
                }
            }
#pragma unroll
            for (int u = 0; u < U; ++u) {
                if (q0 + u < chunks) {
                    mma_bf16(d, av[u], bv[u], xv[u], false);
                    mma_bf16(d, av[u], bv[u], xv[u], true);
                }
            }
        }
        // d: rows (g, g + 8) x pairs (2c, 2c + 1) of this pass.
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int pj = 2 * c + j;
            if (pj >= m) continue;
            const unsigned int pair = sorted[p0 + pj];
            if (GATE_UP) {
                if (row0 + g >= n_out) continue;
                const float gv = bf(to_bf16(d[j]));
                const float uv = bf(to_bf16(d[2 + j]));
                const float sv = bf(to_bf16(gv / (1.0f + expf(-gv))));
                out[(size_t)pair * n_out + row0 + g] = to_bf16(sv * uv);
            } else {
                const float scale = pair_weights[pair];
                if (row0 + g < n_out) out[(size_t)pair * n_out + row0 + g] = to_bf16(d[j] * scale);
                if (row0 + g + 8 < n_out)
                    out[(size_t)pair * n_out + row0 + g + 8] = to_bf16(d[2 + j] * scale);
            }
        }
    }
}

#define MOE_MMA_GEMV_KERNELS(MINB, U)                                                           \
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) moe_gate_up_r16_b##MINB##_bf16(  \
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    unsigned short* __restrict__ h, int inter, int k, int topk)                                 \
{                                                                                               \
    mma_gemv<true, U>(x, w, sorted, meta, nullptr, h, inter, k, topk);                          \
}                                                                                               \
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) moe_down_r16_b##MINB##_bf16(     \
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    const float* __restrict__ pair_weights, unsigned short* __restrict__ out, int n, int k)     \
{                                                                                               \
    mma_gemv<false, U>(x, w, sorted, meta, pair_weights, out, n, k, 1);                         \
}
MOE_MMA_GEMV_KERNELS(4, 8)
MOE_MMA_GEMV_KERNELS(6, 4)
MOE_MMA_GEMV_KERNELS(8, 2)

// The GEMV kernels at several shapes and register budgets: ROWS weight rows a
// warp (gate/up: half gate, half up), NP pairs a pass over them, launch bounds
// of at least MINB blocks a multiprocessor. More rows a warp: more loads in
// flight per lane and fewer input loads and reductions per weight byte, with
// fewer pairs a pass to fit the registers; fewer registers, more warps
// resident. The sums are the same whatever the shape. The host picks one
// (kernels.rs, `GEMV_ROWS`, `GEMV_BLOCKS`).
#define MOE_GEMV_KERNELS(ROWS, NP, MINB)                                                        \
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) moe_gate_up_r##ROWS##_b##MINB##_bf16( \
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    unsigned short* __restrict__ h, int inter, int k, int topk)                                 \
{                                                                                               \
    gate_up_gemv<ROWS, NP>(x, w, sorted, meta, h, inter, k, topk);                              \
}                                                                                               \
extern "C" __global__ void __launch_bounds__(WARPS * 32, MINB) moe_down_r##ROWS##_b##MINB##_bf16( \
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    const float* __restrict__ pair_weights, unsigned short* __restrict__ out, int n, int k)     \
{                                                                                               \
    down_gemv<ROWS, NP>(x, w, sorted, meta, pair_weights, out, n, k);                           \
}
MOE_GEMV_KERNELS(4, 8, 1)
MOE_GEMV_KERNELS(4, 8, 4)
MOE_GEMV_KERNELS(4, 8, 6)
MOE_GEMV_KERNELS(4, 8, 8)
MOE_GEMV_KERNELS(8, 4, 1)
MOE_GEMV_KERNELS(8, 4, 2)
MOE_GEMV_KERNELS(8, 4, 3)
MOE_GEMV_KERNELS(8, 4, 4)

// ---------------------------------------------------------------------------
// Tensor-core grouped GEMM for MoE steps of many tokens (prefills): the same
// contract as the moe_gate_up_* / moe_down_* GEMVs (pairs `sorted` by expert, the
// routed ranges in `meta`: count, then (expert, lo, hi) per range), but each
// block multiplies a tile of up to TC_BM gathered input rows by TC_BN weight
// rows with bf16 mma (f32 accumulation), the tiles streamed through shared
// memory with cp.async, two or three stages. A range longer than TC_BM is walked
// tile by tile (moe_route_many cuts ranges to TC_BM rows, so each block has one).
// Requires k % TC_BK == 0 and the output width a multiple of the block's columns.

#include <mma.h>

#define TC_BM 64
#define TC_BN 128
#define TC_BK 32
#define TC_LD (TC_BK + 8)        // smem row pitch (bf16): skews the banks, keeps 16-byte rows
#define TC_CLD (TC_BN + 4)       // epilogue pitch (f32)
#define TC_THREADS 256
#define TC_STAGE ((TC_BM + TC_BN) * TC_LD)
#define TC_SMEM_C (TC_BM * TC_CLD * 4)
// Shared memory of a STAGES-deep pipeline (bf16 tiles), reused by the epilogue.
#define TC_SMEM(STAGES) ((STAGES) * TC_STAGE * 2 > TC_SMEM_C ? (STAGES) * TC_STAGE * 2 : TC_SMEM_C)

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0; // 0: the 16 bytes are zero-filled, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// GATE_UP: B rows are the block's TC_BN/2 gate rows then the same up rows of the
// (E, 2 * n_out, k) weights, A rows are the pairs' tokens, and the epilogue writes
// the SwiGLU (rounded as the GEMV) to out (P, n_out). Else (down): B rows
// are TC_BN rows of (E, n_out, k), A rows the pairs' own rows, and out (P, n_out)
// gets the products times the pair weights.
template <bool GATE_UP, int STAGES>
__device__ __forceinline__ void moe_tc(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,
    const float* __restrict__ pair_weights, unsigned short* __restrict__ out,
    int n_out, int k, int topk)
{
    using namespace nvcuda;
    __shared__ __align__(128) unsigned char smem[TC_SMEM(STAGES)];
    unsigned short* ab = reinterpret_cast<unsigned short*>(smem);
    float* cs = reinterpret_cast<float*>(smem);
    const unsigned int a = blockIdx.x;
    if (a >= meta[0]) return;
    const unsigned int e = meta[1 + 3 * a];
    const int lo = (int)meta[2 + 3 * a], hi = (int)meta[3 + 3 * a];
    const int tid = threadIdx.x, warp = tid / 32;
    const int wm = warp / 4, wn = warp % 4; // 2 x 4 warps, 32 x 32 outputs each
    constexpr int OUT_COLS = GATE_UP ? TC_BN / 2 : TC_BN;
    const int n0 = blockIdx.y * OUT_COLS;
    // This thread's two B rows (the same for every tile of the range).
    const unsigned short* brow[2];
#pragma unroll
    for (int i = 0; i < 2; ++i) {
        const int c = tid / 4 + 64 * i;
        size_t row;
        if (GATE_UP) row = (size_t)e * 2 * n_out + (c < TC_BN / 2 ? n0 + c : n_out + n0 + c - TC_BN / 2);
        else row = (size_t)e * n_out + n0 + c;
        brow[i] = w + row * (size_t)k + (tid % 4) * 8;
    }
    const int nk = k / TC_BK;
    for (int m0 = lo; m0 < hi; m0 += TC_BM) {
        const int m = min(TC_BM, hi - m0);
        const int ar = tid / 4;
        const bool avalid = ar < m;
        const unsigned int pair = avalid ? sorted[m0 + ar] : 0u;
        const unsigned short* arow = x + (size_t)(GATE_UP ? pair / topk : pair) * (size_t)k + (tid % 4) * 8;
        auto load = [&](int kt, int s) {
            unsigned short* as = ab + s * TC_STAGE;
            unsigned short* bs = as + TC_BM * TC_LD;
            const int k0 = kt * TC_BK;
            cp_async16(as + ar * TC_LD + (tid % 4) * 8, arow + k0, avalid);
#pragma unroll
            for (int i = 0; i < 2; ++i)
                cp_async16(bs + (tid / 4 + 64 * i) * TC_LD + (tid % 4) * 8, brow[i] + k0, true);
            cp_async_commit();
        };
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
        // STAGES - 1 tiles in flight ahead of the one multiplied; one group
        // committed per step (empty past the end) keeps the wait's count right.
#pragma unroll
        for (int s = 0; s < STAGES - 1; ++s) {
            if (s < nk) load(s, s);
            else cp_async_commit();
        }
        for (int kt = 0; kt < nk; ++kt) {
            cp_async_wait<STAGES - 2>();
            __syncthreads(); // tile kt landed; every warp is done with tile kt - 1
            const int next = kt + STAGES - 1;
            if (next < nk) load(next, next % STAGES);
            else cp_async_commit();
            const __nv_bfloat16* as = reinterpret_cast<const __nv_bfloat16*>(ab + (kt % STAGES) * TC_STAGE);
            const __nv_bfloat16* bs = as + TC_BM * TC_LD;
#pragma unroll
            for (int kk = 0; kk < TC_BK; kk += 16) {
                wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
                wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> fb[2];
#pragma unroll
                for (int i = 0; i < 2; ++i)
                    wmma::load_matrix_sync(fa[i], as + (wm * 32 + i * 16) * TC_LD + kk, TC_LD);
#pragma unroll
                for (int j = 0; j < 2; ++j)
                    wmma::load_matrix_sync(fb[j], bs + (wn * 32 + j * 16) * TC_LD + kk, TC_LD);
#pragma unroll
                for (int i = 0; i < 2; ++i)
#pragma unroll
                    for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
            }
        }
        cp_async_wait<0>();
        __syncthreads(); // the epilogue reuses the tiles' shared memory
#pragma unroll
        for (int i = 0; i < 2; ++i)
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::store_matrix_sync(cs + (wm * 32 + i * 16) * TC_CLD + wn * 32 + j * 16, acc[i][j],
                                        TC_CLD, wmma::mem_row_major);
        __syncthreads();
        for (int idx = tid; idx < m * OUT_COLS; idx += TC_THREADS) {
            const int r = idx / OUT_COLS, c = idx % OUT_COLS;
            const unsigned int p = sorted[m0 + r];
            if (GATE_UP) {
                const float g = bf(to_bf16(cs[r * TC_CLD + c]));
                const float u = bf(to_bf16(cs[r * TC_CLD + TC_BN / 2 + c]));
                const float s = bf(to_bf16(g / (1.0f + expf(-g))));
                out[(size_t)p * n_out + n0 + c] = to_bf16(s * u);
            } else {
                out[(size_t)p * n_out + n0 + c] = to_bf16(cs[r * TC_CLD + c] * pair_weights[p]);
            }
        }
        __syncthreads(); // the next tile's loads reuse the epilogue's smem
    }
}

// Grid: (ranges bound, n_out / (TC_BN / 2)) for gate/up, h (P, inter);
// (ranges bound, n / TC_BN) for down, out (P, n); block: TC_THREADS. Two or
// three pipeline stages (the host picks, kernels.rs `tc_stages`).
#define MOE_TC_KERNELS(SUFFIX, STAGES)                                                          \
extern "C" __global__ void moe_gate_up_tc##SUFFIX(                                              \
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    unsigned short* __restrict__ h, int inter, int k, int topk)                                 \
{                                                                                               \
    moe_tc<true, STAGES>(x, w, sorted, meta, nullptr, h, inter, k, topk);                       \
}                                                                                               \
extern "C" __global__ void moe_down_tc##SUFFIX(                                                 \
    const unsigned short* __restrict__ h, const unsigned short* __restrict__ w,                 \
    const unsigned int* __restrict__ sorted, const unsigned int* __restrict__ meta,             \
    const float* __restrict__ pair_weights, unsigned short* __restrict__ out, int n, int k)     \
{                                                                                               \
    moe_tc<false, STAGES>(h, w, sorted, meta, pair_weights, out, n, k, 1);                      \
}
MOE_TC_KERNELS(_bf16, 2)
MOE_TC_KERNELS(_s3_bf16, 3)
