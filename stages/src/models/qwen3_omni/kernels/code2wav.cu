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

// ---------------------------------------------------------------------------
// A causal convolution as an implicit GEMM on the tensor cores, channels-first,
// with no stacked copy of its taps (the stacked taps were seven times the input,
// copied by a strided kernel: most of a chunk's time at 32 streams):
//
//   out[b, co, t] = bias[co] + sum_{j < taps, ci} w[co, j * cin + ci] * xx[b, ci, t + j * dilation]
//                   (+ res[b, co, t])
//
// where xx = [prev (b, cin, ctx) | x (b, cin, len)] along time (ctx = (taps - 1) *
// dilation, the layer's left context). M = output channels (A = the weights,
// tap-major rows, streamed with cp.async), N = time, K = taps * cin; a K tile of
// 32 never straddles two taps (cin % 32 == 0), so its B tile is a shifted window
// of the input rows, read element by element (the shift is unaligned for 16-byte
// loads) into an aligned shared tile. bf16 mma with f32 accumulation; the bias
// and the residual are added in f32 and the sum rounded once.
#include <mma.h>

#define CV_BM 64
#define CV_BN 128
#define CV_BK 32
#define CV_ALD (CV_BK + 8)   // A tile pitch (bf16): skews the banks, keeps 16-byte rows
#define CV_BLD (CV_BN + 8)   // B tile pitch (bf16), K rows of N
#define CV_CLD (CV_BN + 4)   // epilogue pitch (f32)
#define CV_THREADS 256
#define CV_BREG (CV_BK * CV_BN / CV_THREADS)
#define CV_A_STAGE (CV_BM * CV_ALD)
#define CV_B_STAGE (CV_BK * CV_BLD)
#define CV_SMEM_AB ((2 * CV_A_STAGE + 2 * CV_B_STAGE) * 2)
#define CV_SMEM_C (CV_BM * CV_CLD * 4)
#define CV_SMEM (CV_SMEM_AB > CV_SMEM_C ? CV_SMEM_AB : CV_SMEM_C)

__device__ __forceinline__ void cv_cp_async16(void* smem, const void* gmem, bool valid) {
    const unsigned int s = (unsigned int)__cvta_generic_to_shared(smem);
    const int bytes = valid ? 16 : 0; // 0: the 16 bytes are zero-filled, nothing read
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(s), "l"(gmem), "r"(bytes));
}

// Grid: (ceil(len / CV_BN), ceil(cout / CV_BM), batch); block: CV_THREADS.
// w (cout, taps * cin) row-major; cin % 32 == 0; prev is read only when ctx > 0,
// res only when has_res.
extern "C" __global__ void __launch_bounds__(CV_THREADS) causal_conv_bf16(
    const unsigned short* __restrict__ x, const unsigned short* __restrict__ prev,
    const unsigned short* __restrict__ w, const unsigned short* __restrict__ bias,
    const unsigned short* __restrict__ res, unsigned short* __restrict__ out,
    int cin, int cout, int len, int ctx, int taps, int dilation, int has_res)
{
    using namespace nvcuda;
    __shared__ __align__(128) unsigned char smem[CV_SMEM];
    unsigned short* as = reinterpret_cast<unsigned short*>(smem);
    unsigned short* bs = as + 2 * CV_A_STAGE;
    float* cs = reinterpret_cast<float*>(smem);
    const int b = blockIdx.z, m0 = blockIdx.y * CV_BM, t0 = blockIdx.x * CV_BN;
    const int tid = threadIdx.x, warp = tid / 32;
    const int wm = warp / 4, wn = warp % 4; // 2 x 4 warps, 32 x 32 outputs each
    const int kdim = taps * cin, nk = kdim / CV_BK;
    const unsigned short* xb = x + (size_t)b * cin * len;
    const unsigned short* pb = prev + (size_t)b * cin * ctx;
    // A: this thread's 8 weights of row tid / 4.
    const int ar = tid / 4;
    const bool avalid = m0 + ar < cout;
    const unsigned short* arow = w + (size_t)(avalid ? m0 + ar : 0) * kdim + (tid % 4) * 8;
    // B: this thread's column (one output time) and rows br0 + 2i of each K tile.
    const int bn = tid % CV_BN, br0 = tid / CV_BN;
    const int t = t0 + bn;
    unsigned short breg[CV_BREG];
    auto load_a = [&](int kt, int s) {
        cv_cp_async16(as + s * CV_A_STAGE + ar * CV_ALD + (tid % 4) * 8, arow + kt * CV_BK, avalid);
        asm volatile("cp.async.commit_group;\n" ::);
    };
    auto load_b = [&](int kt) {
        const int k0 = kt * CV_BK, tap = k0 / cin, ci0 = k0 % cin;
        const int p = t + tap * dilation; // the position in xx
#pragma unroll
        for (int i = 0; i < CV_BREG; ++i) {
            const int ci = ci0 + br0 + 2 * i;
            unsigned short v = 0;
            if (t < len) v = p < ctx ? pb[(size_t)ci * ctx + p] : xb[(size_t)ci * len + (p - ctx)];
            breg[i] = v;
        }
    };
    auto store_b = [&](int s) {
#pragma unroll
        for (int i = 0; i < CV_BREG; ++i) bs[s * CV_B_STAGE + (br0 + 2 * i) * CV_BLD + bn] = breg[i];
    };
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::fill_fragment(acc[i][j], 0.f);
    load_a(0, 0);
    load_b(0);
    store_b(0);
    for (int kt = 0; kt < nk; ++kt) {
        asm volatile("cp.async.wait_group 0;\n" ::);
        __syncthreads(); // tile kt is in; every warp is done with tile kt - 1's stage
        const bool more = kt + 1 < nk;
        if (more) {
            load_a(kt + 1, (kt + 1) % 2);
            load_b(kt + 1); // into registers, in flight during the products
        }
        const __nv_bfloat16* a = reinterpret_cast<const __nv_bfloat16*>(as + (kt % 2) * CV_A_STAGE);
        const __nv_bfloat16* bt = reinterpret_cast<const __nv_bfloat16*>(bs + (kt % 2) * CV_B_STAGE);
#pragma unroll
        for (int kk = 0; kk < CV_BK; kk += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> fa[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> fb[2];
#pragma unroll
            for (int i = 0; i < 2; ++i)
                wmma::load_matrix_sync(fa[i], a + (wm * 32 + i * 16) * CV_ALD + kk, CV_ALD);
#pragma unroll
            for (int j = 0; j < 2; ++j)
                wmma::load_matrix_sync(fb[j], bt + kk * CV_BLD + wn * 32 + j * 16, CV_BLD);
#pragma unroll
            for (int i = 0; i < 2; ++i)
#pragma unroll
                for (int j = 0; j < 2; ++j) wmma::mma_sync(acc[i][j], fa[i], fb[j], acc[i][j]);
        }
        if (more) store_b((kt + 1) % 2); // that stage was last read before this step's sync
    }
    __syncthreads(); // the epilogue reuses the tiles' shared memory
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j)
            wmma::store_matrix_sync(cs + (wm * 32 + i * 16) * CV_CLD + wn * 32 + j * 16, acc[i][j],
                                    CV_CLD, wmma::mem_row_major);
    __syncthreads();
    for (int idx = tid; idx < CV_BM * CV_BN; idx += CV_THREADS) {
        const int r = idx / CV_BN, c = idx % CV_BN;
        const int co = m0 + r, tt = t0 + c;
        if (co >= cout || tt >= len) continue;
        const size_t o = ((size_t)b * cout + co) * len + tt;
        float v = cs[r * CV_CLD + c] + bf(bias[co]);
        if (has_res) v += bf(res[o]);
        out[o] = to_bf16(v);
    }
}
