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
#define CHUNK 64
#define THREADS 128
#define MAX_REP 16
#define HIDDEN (-1.0e38f)
// A key row in shared memory: D / 2 words (bf16 pairs) and one of padding, so
// the score loop's 32 lanes (32 positions, one column) hit 32 banks.
#define KW (D / 2 + 1)
#define SOFTMAX_THREADS 256

#include "bf16.cuh"

static_assert(THREADS == D, "the value loop takes a thread a dimension");
static_assert(CHUNK == 64, "the softmax takes two positions a lane");

// Grid: (b * kvh, splits), splits = ceil(kv_len / CHUNK); block: THREADS (= D).
// Short chunks and small blocks: a decode step has few rows, so the kernel is
// bound by its chain of dependent steps, not by bandwidth; many blocks, each
// one load of its chunk into shared memory and no cross-warp reduction, keep
// that chain short. A block whose positions are all hidden loads nothing.
// With one split the normalised output goes to `out`; else each split leaves
// its unnormalised sum (part_o, (b * H, splits, D) f32) and its max and
// denominator (part_ml, (b * H, splits, 2) f32) for `decode_attention_combine`.
extern "C" __global__ void __launch_bounds__(THREADS) decode_attention_bf16(
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
    __shared__ unsigned int ks[CHUNK][KW];
    __shared__ __align__(16) unsigned short vs[CHUNK][D];
    __shared__ __align__(16) float qs[MAX_REP][D];
    __shared__ __align__(16) float sc[MAX_REP][CHUNK];
    __shared__ float ml[MAX_REP][2];
    __shared__ float mk[CHUNK];
    const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
    const int row = blockIdx.x / kvh, kh = blockIdx.x % kvh;
    const int split = blockIdx.y, splits = gridDim.y;
    const int heads = kvh * rep;
    const int c0 = split * CHUNK;
    const int clen = min(CHUNK, kv_len - c0);
    const size_t head0 = (size_t)row * heads + kh * rep;
    // The chunk's mask and the group's queries (in f32), loaded together.
    float m = HIDDEN;
    if (tid < CHUNK) {
        m = tid < clen ? mask[(size_t)row * kv_len + c0 + tid] : HIDDEN;
        mk[tid] = m;
    }
    const uint4* q4 = reinterpret_cast<const uint4*>(q + head0 * D);
    for (int i = tid; i < rep * D / 8; i += THREADS) {
        const uint4 v = q4[i];
        float* dst = &qs[0][0] + i * 8;
        dst[0] = bf_lo(v.x); dst[1] = bf_hi(v.x); dst[2] = bf_lo(v.y); dst[3] = bf_hi(v.y);
        dst[4] = bf_lo(v.z); dst[5] = bf_hi(v.z); dst[6] = bf_lo(v.w); dst[7] = bf_hi(v.w);
    }
    if (!__syncthreads_or(m > HIDDEN)) {
        // Nothing visible here: no weight for the combine, zeros for a lone split.
        for (int r = 0; r < rep; ++r) {
            const size_t head = head0 + r;
            if (splits == 1) {
                out[head * D + tid] = 0;
            } else if (tid == 0) {
                part_ml[(head * splits + split) * 2] = -INFINITY;
                part_ml[(head * splits + split) * 2 + 1] = 0.f;
            }
        }
        return;
    }
    // The visible keys and values of the chunk, each row once, coalesced; hidden
    // rows (never read from memory) are zeros.
    {
        const int slot = slot_of_row ? (int)slot_of_row[row] : row;
        const size_t base = ((size_t)slot * kvh + kh) * max_len + c0;
        const uint4* k4 = reinterpret_cast<const uint4*>(kc + base * D);
        const uint4* v4 = reinterpret_cast<const uint4*>(vc + base * D);
        constexpr int PER = CHUNK * D / 8 / THREADS;
        uint4 kr[PER], vr[PER];
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int i = tid + u * THREADS, p = i / (D / 8);
            const bool seen = p < clen && mk[p] > HIDDEN;
            kr[u] = seen ? __ldg(k4 + i) : make_uint4(0u, 0u, 0u, 0u);
            vr[u] = seen ? __ldg(v4 + i) : make_uint4(0u, 0u, 0u, 0u);
        }
#pragma unroll
        for (int u = 0; u < PER; ++u) {
            const int i = tid + u * THREADS, p = i / (D / 8), c = i % (D / 8);
            ks[p][c * 4] = kr[u].x; ks[p][c * 4 + 1] = kr[u].y;
            ks[p][c * 4 + 2] = kr[u].z; ks[p][c * 4 + 3] = kr[u].w;
            *reinterpret_cast<uint4*>(&vs[p][c * 8]) = vr[u];
        }
    }
    __syncthreads();
    // Scores: a thread a position and every other head of the group.
    {
        constexpr int GROUPS = THREADS / CHUNK;
        const int p = tid % CHUNK, g = tid / CHUNK;
        float acc[MAX_REP / GROUPS];
#pragma unroll
        for (int i = 0; i < MAX_REP / GROUPS; ++i) acc[i] = 0.f;
#pragma unroll 8
        for (int w = 0; w < D / 2; ++w) {
            const unsigned int kw = ks[p][w];
            const float k0 = bf_lo(kw), k1 = bf_hi(kw);
#pragma unroll
            for (int i = 0; i < MAX_REP / GROUPS; ++i) {
                const int r = g + GROUPS * i;
                if (r < rep) {
                    const float2 qq = *reinterpret_cast<const float2*>(&qs[r][2 * w]);
                    acc[i] += qq.x * k0 + qq.y * k1;
                }
            }
        }
        const float mp = mk[p];
#pragma unroll
        for (int i = 0; i < MAX_REP / GROUPS; ++i) {
            const int r = g + GROUPS * i;
            if (r < rep) sc[r][p] = mp > HIDDEN ? acc[i] * scale + mp : -INFINITY;
        }
    }
    __syncthreads();
    // Softmax numerators per head (a warp a head), with each head's max and sum.
    for (int r = warp; r < rep; r += THREADS / 32) {
        float a = sc[r][lane], b = sc[r][lane + 32];
        float mx = fmaxf(a, b);
        for (int o = 16; o > 0; o /= 2) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
        a = mx == -INFINITY ? 0.f : expf(a - mx);
        b = mx == -INFINITY ? 0.f : expf(b - mx);
        sc[r][lane] = a;
        sc[r][lane + 32] = b;
        float s = a + b;
        for (int o = 16; o > 0; o /= 2) s += __shfl_xor_sync(0xffffffffu, s, o);
        if (lane == 0) { ml[r][0] = mx; ml[r][1] = s; }
    }
    __syncthreads();
    // Weighted values: a thread a dimension, four positions at a time (hidden
    // ones weigh 0 against zero rows).
    float o[MAX_REP];
#pragma unroll
    for (int r = 0; r < MAX_REP; ++r) o[r] = 0.f;
    const int jend = (clen + 3) & ~3;
    for (int j = 0; j < jend; j += 4) {
        const float v0 = bf(vs[j][tid]), v1 = bf(vs[j + 1][tid]);
        const float v2 = bf(vs[j + 2][tid]), v3 = bf(vs[j + 3][tid]);
#pragma unroll
        for (int r = 0; r < MAX_REP; ++r) {
            if (r < rep) {
                const float4 p = *reinterpret_cast<const float4*>(&sc[r][j]);
                o[r] += p.x * v0 + p.y * v1 + p.z * v2 + p.w * v3;
            }
        }
    }
#pragma unroll
    for (int r = 0; r < MAX_REP; ++r) {
        if (r >= rep) break;
        const size_t head = head0 + r;
        if (splits == 1) {
            const float l = ml[r][1];
            out[head * D + tid] = to_bf16(l > 0.f ? o[r] / l : 0.f);
        } else {
            part_o[(head * splits + split) * D + tid] = o[r];
            if (tid == 0) {
                part_ml[(head * splits + split) * 2] = ml[r][0];
                part_ml[(head * splits + split) * 2 + 1] = ml[r][1];
            }
        }
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

// New queries and keys/values of `rows` tokens (rows = b * seq: a decode step's
// b rows with seq = 1, or a prefill's b prompts of seq tokens), from the fused
// q/k/v projection qkv (rows, (heads + 2 * kvh) * D) bf16: per head RMSNorm
// (q_norm / k_norm weights, in f32, rounded once as candle's kernel), then the
// rotary embedding (rotate-half form, cos/sin (rows, D / 2), rounded per op as
// candle's bf16 rope); queries to q (b, heads, seq, D); keys and the raw values
// to the flat row scatter[(row * kvh + kh) * D] of kc/vc (rows, D) (the KV-slot
// rows SlotBatch made), or without scatter to (b, kvh, seq, D).
// Grid: (rows, heads + kvh); block: D. Block (row, h) does query head h, or for
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
    int heads, int kvh, int seq, float eps)
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
    const size_t bi = row / seq, si = row % seq;
    if (is_q) {
        q[((bi * heads + h) * seq + si) * D + i] = out;
    } else {
        const size_t dst = scatter ? (size_t)scatter[((size_t)row * kvh + kh) * D] * D + i
                                   : ((bi * kvh + kh) * seq + si) * D + i;
        kc[dst] = out;
        vc[dst] = src[(size_t)kvh * D + i];
    }
}

// Prefill attention's probabilities for rows of at most 32 * SM_PER keys, a warp
// a row (8 rows a block), the row's scores read once into registers; the same
// contract as masked_softmax_bf16 below, which takes longer rows (a block
// version of this one measured slower than that kernel on the H200 at 2,500
// keys). Grid: ceil(rows / 8); block: SOFTMAX_THREADS.
#define SM_PER 16
extern "C" __global__ void __launch_bounds__(SOFTMAX_THREADS) masked_softmax_warp_bf16(
    const unsigned short* __restrict__ scores, const float* __restrict__ mask,
    unsigned short* __restrict__ probs, unsigned long long rows, int heads, int q_len, int kv,
    float scale)
{
    constexpr int NW = SOFTMAX_THREADS / 32;
    const int lane = threadIdx.x % 32;
    const size_t row = (size_t)blockIdx.x * NW + threadIdx.x / 32;
    if (row >= rows) return; // a whole warp
    const size_t b = row / ((size_t)heads * q_len), qi = row % q_len;
    const unsigned short* s = scores + row * kv;
    const float* m = mask ? mask + (b * q_len + qi) * kv : nullptr;
    auto reduce = [&](float v, bool is_max) {
        for (int o = 16; o > 0; o /= 2) {
            const float u = __shfl_xor_sync(0xffffffffu, v, o);
            v = is_max ? fmaxf(v, u) : v + u;
        }
        return v;
    };
    float v[SM_PER];
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < SM_PER; ++i) {
        const int j = lane + i * 32;
        float x = -INFINITY;
        if (j < kv) {
            const float mj = m ? m[j] : 0.f;
            x = mj > HIDDEN ? bf(s[j]) * scale + mj : -INFINITY;
        }
        v[i] = x;
        mx = fmaxf(mx, x);
    }
    mx = reduce(mx, true);
    float sum = 0.f;
#pragma unroll
    for (int i = 0; i < SM_PER; ++i) {
        v[i] = mx == -INFINITY ? 0.f : expf(v[i] - mx);
        sum += v[i];
    }
    sum = reduce(sum, false);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    unsigned short* p = probs + row * kv;
#pragma unroll
    for (int i = 0; i < SM_PER; ++i) {
        const int j = lane + i * 32;
        if (j < kv) p[j] = to_bf16(v[i] * inv);
    }
}

// Prefill attention's probabilities in one pass over the scores: scores
// (b * heads * q, kv) bf16 (q . k, unscaled), the additive mask (b, 1, q, kv) f32
// shared by the heads (or none), `scale`; softmax in f32 per row to probs bf16.
// A row whose every key is hidden comes out as zeros (as torch's SDPA gives).
// Grid: rows; block: SOFTMAX_THREADS.
extern "C" __global__ void masked_softmax_bf16(
    const unsigned short* __restrict__ scores,
    const float* __restrict__ mask,
    unsigned short* __restrict__ probs,
    int heads, int q_len, int kv, float scale)
{
    constexpr int NW = SOFTMAX_THREADS / 32;
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
    for (int j = tid; j < kv; j += SOFTMAX_THREADS) mx = fmaxf(mx, value(j));
    mx = block_reduce(mx, true);
    float sum = 0.f;
    if (mx != -INFINITY)
        for (int j = tid; j < kv; j += SOFTMAX_THREADS) sum += expf(value(j) - mx);
    sum = block_reduce(sum, false);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;
    for (int j = tid; j < kv; j += SOFTMAX_THREADS)
        p[j] = to_bf16(mx == -INFINITY ? 0.f : expf(value(j) - mx) * inv);
}
