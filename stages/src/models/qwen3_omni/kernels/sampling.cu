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
