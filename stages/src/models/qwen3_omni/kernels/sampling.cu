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
