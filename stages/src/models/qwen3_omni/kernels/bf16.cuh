// bf16 helpers shared by the engine's kernels (no CUDA headers: the conversions
// are written out). A bf16 is the high half of an f32.
#pragma once

__device__ __forceinline__ float bf(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
// The low and high bf16 of a 32-bit word (two packed values).
__device__ __forceinline__ float bf_lo(unsigned int w) { return __uint_as_float(w << 16); }
__device__ __forceinline__ float bf_hi(unsigned int w) { return __uint_as_float(w & 0xffff0000u); }

__device__ __forceinline__ unsigned short to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((u >> 16) | 0x40u); // NaN
    u += 0x7fffu + ((u >> 16) & 1u); // round to nearest even
    return (unsigned short)(u >> 16);
}
