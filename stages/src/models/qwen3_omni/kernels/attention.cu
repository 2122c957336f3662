// Decode attention over KV slots: one query token per row, grouped query heads,
// each row reading only its own visible positions. Replaces the masked matmul /
// softmax / matmul chain (seven kernels over the longest row) with one kernel,
// or two when a row's positions span several chunks (split-KV, combined after).
//
// Layouts: q (b, kvh * rep, D) bf16; the slots' keys and values
// (slots, kvh, max_len, D) bf16; mask (b, kv_len) f32, additive, a position
// hidden where it is below -1e38 (the engine's MASK_MIN); row i reads slot
// slot_of_row[i] (or slot i without it). Out (b, kvh * rep, D) bf16.
// Softmax in f32 throughout.

#define D 128
#define CHUNK 256
#define THREADS 256
#define MAX_REP 16
#define HIDDEN (-1.0e38f)

#include "bf16.cuh"

// Grid: (b * kvh, splits), splits = ceil(kv_len / CHUNK); block: THREADS.
// With one split the normalised output goes to `out`; else each split leaves
// its unnormalised sum (part_o, (b * H, splits, D) f32) and its max and
// denominator (part_ml, (b * H, splits, 2) f32) for `decode_attention_combine`.
extern "C" __global__ void decode_attention_bf16(
    const unsigned short* __restrict__ q,
    const unsigned short* __restrict__ kc,
    const unsigned short* __restrict__ vc,
    const float* __restrict__ mask,
    const unsigned int* __restrict__ slot_of_row,
    unsigned short* __restrict__ out,
    float* __restrict__ part_o,
    float* __restrict__ part_ml,
    int kvh, int rep, int max_len, int kv_len, float scale)
{
    constexpr int NW = THREADS / 32;
    __shared__ __align__(16) float qs[MAX_REP][D];
    __shared__ float sc[MAX_REP][CHUNK];
    __shared__ float ml[MAX_REP][2];
    __shared__ float red[NW][D];
    __shared__ unsigned char vis[CHUNK];
    __shared__ int end;
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int row = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, splits = gridDim.y;
    const int heads = kvh * rep;
    const int slot = slot_of_row ? (int)slot_of_row[row] : row;
    const int c0 = split * CHUNK;
    const int clen = min(CHUNK, kv_len - c0);
    const size_t base = ((size_t)slot * kvh + kh) * max_len + c0;
    if (tid == 0) end = 0;
    for (int i = tid; i < rep * D; i += THREADS)
        qs[i / D][i % D] = bf(q[((size_t)row * heads + kh * rep) * D + i]);
    __syncthreads();
    // Scores: a thread a position (its key row loaded whole), every head of the group.
    {
        const float m = tid < clen ? mask[(size_t)row * kv_len + c0 + tid] : HIDDEN;
        const bool seen = m > HIDDEN;
        vis[tid] = seen;
        if (seen) atomicMax(&end, tid + 1);
        float acc[MAX_REP];
#pragma unroll
        for (int r = 0; r < MAX_REP; ++r) acc[r] = 0.f;
        if (seen) {
            const uint4* kr = reinterpret_cast<const uint4*>(kc + (base + tid) * D);
            uint4 kv[D / 8];
#pragma unroll
            for (int c = 0; c < D / 8; ++c) kv[c] = __ldg(kr + c);
#pragma unroll
            for (int c = 0; c < D / 8; ++c) {
                const float k8[8] = {bf_lo(kv[c].x), bf_hi(kv[c].x), bf_lo(kv[c].y), bf_hi(kv[c].y),
                                     bf_lo(kv[c].z), bf_hi(kv[c].z), bf_lo(kv[c].w), bf_hi(kv[c].w)};
#pragma unroll
                for (int r = 0; r < MAX_REP; ++r) {
                    if (r < rep) {
                        const float4 a = *reinterpret_cast<const float4*>(&qs[r][c * 8]);
                        const float4 b = *reinterpret_cast<const float4*>(&qs[r][c * 8 + 4]);
                        acc[r] += a.x * k8[0] + a.y * k8[1] + a.z * k8[2] + a.w * k8[3]
                                + b.x * k8[4] + b.y * k8[5] + b.z * k8[6] + b.w * k8[7];
                    }
                }
            }
        }
#pragma unroll
        for (int r = 0; r < MAX_REP; ++r)
            if (r < rep) sc[r][tid] = seen ? acc[r] * scale + m : -INFINITY;
    }
    __syncthreads();
    // Softmax numerators per head (a warp a head), with each head's max and sum.
    for (int r = warp; r < rep; r += NW) {
        float mx = -INFINITY;
        for (int j = lane; j < CHUNK; j += 32) mx = fmaxf(mx, sc[r][j]);
        for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        float s = 0.f;
        for (int j = lane; j < CHUNK; j += 32) {
            const float p = mx == -INFINITY ? 0.f : expf(sc[r][j] - mx);
            sc[r][j] = p;
            s += p;
        }
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) { ml[r][0] = mx; ml[r][1] = s; }
    }
    __syncthreads();
    // Weighted values: the warps split the positions, a lane holds four
    // dimensions of every head; each value row is read once, hidden ones never.
    // Loads go out UNROLL_V rows at a time, ahead of their use (latency, not
    // bandwidth, bounds a decode step's few blocks).
    constexpr int UNROLL_V = 16;
    float o[MAX_REP][4];
#pragma unroll
    for (int r = 0; r < MAX_REP; ++r) o[r][0] = o[r][1] = o[r][2] = o[r][3] = 0.f;
    const uint2* vr = reinterpret_cast<const uint2*>(vc + base * D) + lane;
    const int jend = end;
    for (int j0 = warp; j0 < jend; j0 += NW * UNROLL_V) {
        uint2 v[UNROLL_V];
#pragma unroll
        for (int u = 0; u < UNROLL_V; ++u) {
            const int j = j0 + u * NW;
            v[u] = j < jend && vis[j] ? __ldg(vr + (size_t)j * (D / 4)) : make_uint2(0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL_V; ++u) {
            const int j = j0 + u * NW;
            if (j >= jend || !vis[j]) continue;
            const float v4[4] = {bf_lo(v[u].x), bf_hi(v[u].x), bf_lo(v[u].y), bf_hi(v[u].y)};
#pragma unroll
            for (int r = 0; r < MAX_REP; ++r) {
                if (r < rep) {
                    const float p = sc[r][j];
#pragma unroll
                    for (int i = 0; i < 4; ++i) o[r][i] += p * v4[i];
                }
            }
        }
    }
    // The warps' sums, added in a fixed order (deterministic), a thread a dimension.
#pragma unroll
    for (int r = 0; r < MAX_REP; ++r) {
        if (r >= rep) break;
#pragma unroll
        for (int i = 0; i < 4; ++i) red[warp][lane * 4 + i] = o[r][i];
        __syncthreads();
        if (tid < D) {
            float acc = 0.f;
#pragma unroll
            for (int w = 0; w < NW; ++w) acc += red[w][tid];
            const size_t head = (size_t)row * heads + kh * rep + r;
            if (splits == 1) {
                const float l = ml[r][1];
                out[head * D + tid] = to_bf16(l > 0.f ? acc / l : 0.f);
            } else {
                part_o[(head * splits + split) * D + tid] = acc;
                if (tid == 0) {
                    part_ml[(head * splits + split) * 2] = ml[r][0];
                    part_ml[(head * splits + split) * 2 + 1] = ml[r][1];
                }
            }
        }
        __syncthreads();
    }
}

// Grid: b * H; block: D. Rescales each split's sums to the row's overall max.
extern "C" __global__ void decode_attention_combine(
    const float* __restrict__ part_o,
    const float* __restrict__ part_ml,
    unsigned short* __restrict__ out,
    int splits)
{
    const size_t head = blockIdx.x;
    const int d = threadIdx.x;
    float mx = -INFINITY;
    for (int s = 0; s < splits; ++s) mx = fmaxf(mx, part_ml[(head * splits + s) * 2]);
    float l = 0.f, o = 0.f;
    if (mx != -INFINITY) {
        for (int s = 0; s < splits; ++s) {
            const float m = part_ml[(head * splits + s) * 2];
            if (m == -INFINITY) continue;
            const float f = expf(m - mx);
            l += f * part_ml[(head * splits + s) * 2 + 1];
            o += f * part_o[(head * splits + s) * D + d];
        }
    }
    out[head * D + d] = to_bf16(l > 0.f ? o / l : 0.f);
}

// The step's new queries and keys/values, from the fused q/k/v projection
// qkv (b, (heads + 2 * kvh) * D) bf16: per head RMSNorm (q_norm / k_norm weights,
// in f32, rounded once as candle's kernel), then the rotary embedding
// (rotate-half form, cos/sin (b, D / 2), rounded per op as candle's bf16 rope);
// queries to q (b, heads, D), keys and the raw values into the KV slots at the
// flat row scatter[(row * kvh + kh) * D] of (rows, D) (the row SlotBatch made).
// Grid: (b, heads + kvh); block: D. Block (row, h) does query head h, or for
// h >= heads key/value head h - heads.
extern "C" __global__ void qk_norm_rope_bf16(
    const unsigned short* __restrict__ qkv,
    const unsigned short* __restrict__ q_w,
    const unsigned short* __restrict__ k_w,
    const unsigned short* __restrict__ cos,
    const unsigned short* __restrict__ sin,
    const unsigned int* __restrict__ scatter,
    unsigned short* __restrict__ q,
    unsigned short* __restrict__ kc,
    unsigned short* __restrict__ vc,
    int heads, int kvh, float eps)
{
    __shared__ float part[D / 32];
    __shared__ float normed[D];
    const int row = blockIdx.x, h = blockIdx.y, i = threadIdx.x;
    const bool is_q = h < heads;
    const int kh = h - heads;
    const size_t width = (size_t)(heads + 2 * kvh) * D;
    const unsigned short* src = qkv + row * width + (size_t)h * D;
    const float x = bf(src[i]);
    float ss = x * x;
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    if (i % 32 == 0) part[i / 32] = ss;
    __syncthreads();
    float total = 0.f;
#pragma unroll
    for (int w = 0; w < D / 32; ++w) total += part[w];
    const float scale = rsqrtf(total / D + eps);
    const float n = bf(to_bf16(scale * x * bf((is_q ? q_w : k_w)[i])));
    normed[i] = n;
    __syncthreads();
    const int half = D / 2, j = i % half;
    const float c = bf(cos[(size_t)row * half + j]), s = bf(sin[(size_t)row * half + j]);
    const float other = normed[i < half ? i + half : i - half];
    // i < half: x1 * c - x2 * s; else: x1 * s + x2 * c (x1 the first half's value).
    const float r = i < half ? bf(to_bf16(n * c)) - bf(to_bf16(other * s))
                             : bf(to_bf16(other * s)) + bf(to_bf16(n * c));
    const unsigned short out = to_bf16(r);
    if (is_q) {
        q[((size_t)row * heads + h) * D + i] = out;
    } else {
        const size_t dst = (size_t)scatter[((size_t)row * kvh + kh) * D] * D + i;
        kc[dst] = out;
        vc[dst] = src[(size_t)kvh * D + i];
    }
}

// Prefill attention's probabilities in one pass over the scores: scores
// (b * heads * q, kv) bf16 (q . k, unscaled), the additive mask (b, 1, q, kv) f32
// shared by the heads (or none), `scale`; softmax in f32 per row to probs bf16.
// A row whose every key is hidden comes out as zeros (as torch's SDPA gives).
// Grid: rows; block: THREADS.
extern "C" __global__ void masked_softmax_bf16(
    const unsigned short* __restrict__ scores,
    const float* __restrict__ mask,
    unsigned short* __restrict__ probs,
    int heads, int q_len, int kv, float scale)
{
    constexpr int NW = THREADS / 32;
    __shared__ float red[NW];
    __shared__ float bcast;
    const size_t row = blockIdx.x;
    const int tid = threadIdx.x;
    const size_t b = row / ((size_t)heads * q_len), qi = row % q_len;
    const unsigned short* s = scores + row * kv;
    const float* m = mask ? mask + (b * q_len + qi) * kv : nullptr;
    unsigned short* p = probs + row * kv;
    auto value = [&](int j) {
        const float mj = m ? m[j] : 0.f;
        return mj > HIDDEN ? bf(s[j]) * scale + mj : -INFINITY;
    };
    auto block_reduce = [&](float v, bool is_max) {
        for (int o = 16; o > 0; o /= 2) {
            const float u = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? fmaxf(v, u) : v + u;
        }
        __syncthreads();
        if (tid % 32 == 0) red[tid / 32] = v;
        __syncthreads();
        if (tid == 0) {
            float r = red[0];
            for (int w = 1; w < NW; ++w) r = is_max ? fmaxf(r, red[w]) : r + red[w];
            bcast = r;
        }
        __syncthreads();
        return bcast;
    };
    float mx = -INFINITY;
    for (int j = tid; j < kv; j += THREADS) mx = fmaxf(mx, value(j));
    mx = block_reduce(mx, true);
    float sum = 0.f;
    if (mx != -INFINITY)
        for (int j = tid; j < kv; j += THREADS) sum += expf(value(j) - mx);
    sum = block_reduce(sum, false);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int j = tid; j < kv; j += THREADS)
        p[j] = to_bf16(mx == -INFINITY ? 0.f : expf(value(j) - mx) * inv);
}
