// Code2Wav's elementwise work, fused (kernels.rs, models/qwen3_omni/code2wav.rs).
#include "bf16.cuh"

// SnakeBeta on (rows, channels, len) contiguous bf16, len a multiple of 8:
// y = x + inv_beta[c] * sin(x * alpha[c])^2, in f32, rounded once (candle's ops
// round after each of their five passes). Eight samples a thread (16-byte loads).
extern "C" __global__ void snake_beta_bf16(
    const uint4 *__restrict__ x, const unsigned short *__restrict__ alpha,
    const unsigned short *__restrict__ inv_beta, uint4 *__restrict__ y,
    int channels, int len8, long long total8) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < total8;
         i += (long long)gridDim.x * blockDim.x) {
        int c = (int)((i / len8) % channels);
        float a = bf(alpha[c]), b = bf(inv_beta[c]);
        uint4 v = x[i];
        unsigned int w[4] = {v.x, v.y, v.z, v.w};
        #pragma unroll
        for (int j = 0; j < 4; j++) {
            float lo = bf_lo(w[j]), hi = bf_hi(w[j]);
            float sl = sinf(lo * a), sh = sinf(hi * a);
            lo += b * sl * sl;
            hi += b * sh * sh;
            w[j] = (unsigned int)to_bf16(lo) | ((unsigned int)to_bf16(hi) << 16);
        }
        y[i] = make_uint4(w[0], w[1], w[2], w[3]);
    }
}
