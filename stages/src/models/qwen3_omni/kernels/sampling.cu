// Greedy choice on the device, so a decode step copies one id per row to the host
// instead of its logits (a Thinker step at 32 rows: 19.5 MB).

#define ARGMAX_THREADS 1024

// (value, index) `b` beats `a`: larger, or equal at a lower index. NaNs never win,
// as the host's `x > best` scan skips them.
__device__ __forceinline__ bool beats(float bv, int bi, float av, int ai) {
    return bv > av || (bv == av && bi < ai);
}

// out[row] = the first index of the largest of logits[row * stride + 0..cols), as
// torch.argmax and the host sampler choose (0 when every value is -inf or NaN).
// Grid: rows; block: ARGMAX_THREADS.
extern "C" __global__ void argmax_f32(
    const float* __restrict__ logits, unsigned int* __restrict__ out, int cols, long long stride)
{
    __shared__ float sv[ARGMAX_THREADS / 32];
    __shared__ int si[ARGMAX_THREADS / 32];
    const float* row = logits + (size_t)blockIdx.x * (size_t)stride;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    for (int c = threadIdx.x; c < cols; c += ARGMAX_THREADS) {
        const float v = row[c];
        if (v > bv) { bv = v; bi = c; } // a thread's columns ascend: first wins ties
    }
    for (int o = 16; o > 0; o /= 2) {
        const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
        const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
        if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
    }
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    if (lane == 0) { sv[warp] = bv; si[warp] = bi; }
    __syncthreads();
    if (warp == 0) {
        bv = sv[lane];
        bi = si[lane];
        for (int o = 16; o > 0; o /= 2) {
            const float ov = __shfl_xor_sync(0xffffffffu, bv, o);
            const int oi = __shfl_xor_sync(0xffffffffu, bi, o);
            if (beats(ov, oi, bv, bi)) { bv = ov; bi = oi; }
        }
        if (lane == 0) out[blockIdx.x] = bi == 0x7fffffff ? 0u : (unsigned int)bi;
    }
}

// ---------------------------------------------------------------------------
// A top-k / top-p draw in one launch (the code predictor draws 15 codes a frame;
// candle's ops took about twenty launches a draw, among them a sort and a
// cumulative sum as a matmul): the same transforms as sampling.rs's
// `sample_on_device_with` on each row of logits:
//   l = logits * inv_temp; the k largest (sorted, descending); p = softmax over
//   them; a candidate stays while the mass above it is below top_p (top_p >= 1:
//   all stay); the choice is argmax(log p + gumbel(u)) over those kept, u the
//   row's k uniforms in (0, 1], gumbel(u) = -log(-log(min(max(u, 1e-20), 1 - 2^-24)))
//   (curand's uniform includes 1).
// One block of TOPK_THREADS a row sorts the row (padded to the power of two
// `n`, at most TOPK_MAX_COLS) in shared memory by a bitonic network, larger
// values first, ties to the lower index; warp 0 then does the rest, each lane a
// contiguous run of the k candidates.

#define TOPK_THREADS 1024
#define TOPK_MAX_COLS 4096

__device__ __forceinline__ bool topk_before(float av, int ai, float bv, int bi) {
    return av > bv || (av == bv && ai < bi);
}

__device__ __forceinline__ float gumbel_of(float u) {
    u = fminf(fmaxf(u, 1e-20f), 1.0f - 1.0f / 16777216.0f);
    return -logf(-logf(u));
}

// Warp 0's part of a draw from the row's k candidates sorted in sv/si (larger
// first): softmax of the tempered candidates, top-p cut, Gumbel-max choice.
__device__ __forceinline__ void topk_draw(const float* sv, const int* si, int k, float inv_temp,
                                          float top_p, const float* __restrict__ uniform,
                                          unsigned int* __restrict__ out) {
    const int lane = threadIdx.x;
    const int per = (k + 31) / 32, j0 = min(k, lane * per), j1 = min(k, j0 + per);
    const float m = sv[0] * inv_temp;
    float local = 0.f;
    for (int j = j0; j < j1; ++j) local += expf(sv[j] * inv_temp - m);
    float total = local, before = local;
    for (int o = 16; o > 0; o /= 2) total += __shfl_xor_sync(0xffffffffu, total, o);
    // Inclusive scan of the lanes' sums, then this lane's exclusive start.
    for (int o = 1; o < 32; o *= 2) {
        const float t = __shfl_up_sync(0xffffffffu, before, o);
        if (lane >= o) before += t;
    }
    float above = (before - local) / total;
    const float* u = uniform + (size_t)blockIdx.x * (size_t)k;
    float best = -INFINITY;
    int bj = 0x7fffffff;
    for (int j = j0; j < j1; ++j) {
        const float p = expf(sv[j] * inv_temp - m) / total;
        // The most likely candidate always stays (nothing is above it).
        if (top_p >= 1.0f || above < top_p) {
            const float s = logf(p) + gumbel_of(u[j]);
            if (s > best) { best = s; bj = j; }
        }
        above += p;
    }
    for (int o = 16; o > 0; o /= 2) {
        const float ob = __shfl_xor_sync(0xffffffffu, best, o);
        const int oj = __shfl_xor_sync(0xffffffffu, bj, o);
        if (ob > best || (ob == best && oj < bj)) { best = ob; bj = oj; }
    }
    if (lane == 0) out[blockIdx.x] = (unsigned int)si[bj == 0x7fffffff ? 0 : bj];
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) sample_top_k_f32(
    const float* __restrict__ logits, long long stride, const float* __restrict__ uniform,
    unsigned int* __restrict__ out, int cols, int n, int k, float inv_temp, float top_p)
{
    __shared__ float sv[TOPK_MAX_COLS];
    __shared__ int si[TOPK_MAX_COLS];
    const float* row = logits + (size_t)blockIdx.x * (size_t)stride;
    for (int c = threadIdx.x; c < n; c += TOPK_THREADS) {
        // NaNs sort last, as the host's scans never choose them.
        const float v = c < cols ? row[c] : -INFINITY;
        sv[c] = v != v ? -INFINITY : v;
        si[c] = c;
    }
    __syncthreads();
    for (int size = 2; size <= n; size <<= 1) {
        for (int st = size >> 1; st > 0; st >>= 1) {
            for (int i = threadIdx.x; i < n / 2; i += TOPK_THREADS) {
                const int lo = 2 * st * (i / st) + (i % st), hi = lo + st;
                const bool first_larger = (lo & size) == 0;
                const float lv = sv[lo], hv = sv[hi];
                const int li = si[lo], hi_ = si[hi];
                const bool ordered = first_larger ? topk_before(lv, li, hv, hi_) : topk_before(hv, hi_, lv, li);
                if (!ordered) { sv[lo] = hv; sv[hi] = lv; si[lo] = hi_; si[hi] = li; }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x >= 32) return;
    topk_draw(sv, si, k, inv_temp, top_p, uniform, out);
}

// The same draw for rows of at most TOPK_FAST_COLS logits and k <= 64 (the code
// predictor's 2048 codes, top 50), without sorting the row: each of the 32 warps
// sorts its 64 values in registers (a bitonic network over shuffles, two values a
// lane: positions lane and lane + 32), then five rounds merge pairs of sorted
// lists into the top 64 of both (max of one list against the other reversed, a
// bitonic sequence, then its half-cleaners): 5 barriers instead of the full
// sort's 66. Same order (larger first, ties to the lower index) and the same
// draw as sample_top_k_f32. Grid: rows; block: TOPK_THREADS (32 warps).
#define TOPK_FAST_COLS 2048
#define TOPK_NONE 0x7fffffff

// One compare-exchange of the bitonic network between this lane's (v, i) and
// lane ^ stride's: the lower lane keeps the earlier of the two when `desc`.
__device__ __forceinline__ void topk_xchg(float& v, int& i, int stride, bool desc) {
    const float ov = __shfl_xor_sync(0xffffffffu, v, stride);
    const int oi = __shfl_xor_sync(0xffffffffu, i, stride);
    const bool lower = (threadIdx.x & stride) == 0;
    // The lower position of a descending pair keeps the earlier value, the upper
    // one the later (ascending: the other way round); equal ones (padding) stay.
    const bool keep = (lower == desc) ? !topk_before(ov, oi, v, i) : !topk_before(v, i, ov, oi);
    if (!keep) { v = ov; i = oi; }
}

// The stride-32 compare-exchange of a warp's 64: positions lane (a, the lower)
// and lane + 32 (b) are one lane's two values, so no shuffle.
__device__ __forceinline__ void topk_pair(float& av, int& ai, float& bv, int& bi, bool desc) {
    // Stride 32: a and b of one lane; a is the lower position.
    const bool a_first = topk_before(av, ai, bv, bi);
    if (a_first != desc) {
        const float tv = av; av = bv; bv = tv;
        const int ti = ai; ai = bi; bi = ti;
    }
}

__device__ __forceinline__ void topk_merge64(float& av, int& ai, float& bv, int& bi) {
    topk_pair(av, ai, bv, bi, true);
    for (int st = 16; st > 0; st >>= 1) {
        topk_xchg(av, ai, st, true);
        topk_xchg(bv, bi, st, true);
    }
}

extern "C" __global__ void __launch_bounds__(TOPK_THREADS) sample_top_k_fast_f32(
    const float* __restrict__ logits, long long stride, const float* __restrict__ uniform,
    unsigned int* __restrict__ out, int cols, int k, float inv_temp, float top_p)
{
    __shared__ float sv[TOPK_FAST_COLS];
    __shared__ int si[TOPK_FAST_COLS];
    const float* row = logits + (size_t)blockIdx.x * (size_t)stride;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int base = warp * 64;
    auto load = [&](int c, float& v, int& i) {
        if (c < cols) {
            const float x = row[c];
            v = x != x ? -INFINITY : x; // NaNs last, as the host's scans never choose them
            i = c;
        } else {
            v = -INFINITY;
            i = TOPK_NONE;
        }
    };
    float av, bv;
    int ai, bi;
    load(base + lane, av, ai);
    load(base + 32 + lane, bv, bi);
    // Full bitonic sort of 64: sizes 2..32 within each half (a's positions are
    // lane, b's lane + 32: the same direction bits below 32), then size 64.
    for (int size = 2; size <= 32; size <<= 1) {
        for (int st = size >> 1; st > 0; st >>= 1) {
            // Position p = lane (+ 32): (p & size) == 0 sorts descending; for b at
            // size 32 the bit is set, so b's half ascends (a bitonic 64 at the end).
            const bool a_desc = (lane & size) == 0;
            const bool b_desc = ((lane + 32) & size) == 0;
            topk_xchg(av, ai, st, a_desc);
            topk_xchg(bv, bi, st, b_desc);
        }
    }
    topk_merge64(av, ai, bv, bi);
    sv[base + lane] = av; si[base + lane] = ai;
    sv[base + 32 + lane] = bv; si[base + 32 + lane] = bi;
    __syncthreads();
    for (int step = 1; step < 32; step <<= 1) {
        if (warp % (2 * step) == 0) {
            const int other = (warp + step) * 64;
            // Mine at p against the other list's 63 - p: the earlier of each pair
            // is the top 64 of both lists, as a bitonic sequence.
            const float oav = sv[other + 63 - lane], obv = sv[other + 31 - lane];
            const int oai = si[other + 63 - lane], obi = si[other + 31 - lane];
            if (!topk_before(av, ai, oav, oai)) { av = oav; ai = oai; }
            if (!topk_before(bv, bi, obv, obi)) { bv = obv; bi = obi; }
            topk_merge64(av, ai, bv, bi);
            sv[base + lane] = av; si[base + lane] = ai;
            sv[base + 32 + lane] = bv; si[base + 32 + lane] = bi;
        }
        __syncthreads();
    }
    if (threadIdx.x >= 32) return;
    topk_draw(sv, si, k, inv_temp, top_p, uniform, out);
}
