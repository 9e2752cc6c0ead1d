// Counter-based random numbers for the CUDA kernels: a device (and host) copy of
// slimfit/kernels/rng.py, bit for bit.
//
//   k0, k1     = seed_keys(seed)                       (host, once per launch)
//   word(i)    = lowbias32(lowbias32(lo32(i) ^ k0) ^ hi32(i) ^ k1)
//   uniform(i) = float(word(i) >> 8) * 2**-24          (in [0, 1), on a 2**-24 grid)
//
// Kept apart from csrc/rng.h (the CPU side) on purpose: this header only depends on
// <cstdint> and CUDA intrinsics, and its own namespace avoids any clash when both are
// visible in one program.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SLIMFIT_CUDA_HD __host__ __device__ __forceinline__
#else
#define SLIMFIT_CUDA_HD inline
#endif

namespace slimfit {
namespace cuda_rng {

constexpr uint32_t kMul1 = 0x7FEB352Du;
constexpr uint32_t kMul2 = 0x846CA68Bu;
constexpr uint32_t kSeedSalt0 = 0x243F6A88u;
constexpr uint32_t kSeedSalt1 = 0x85A308D3u;

// lowbias32: products wrap modulo 2**32 (unsigned arithmetic), as `& MASK32` does in Python.
SLIMFIT_CUDA_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

struct Keys {
  uint32_t k0;
  uint32_t k1;
};

// Two 32-bit keys of a 64-bit seed; a negative int64 reads as its two's complement,
// like Python's `seed & 0xFFFFFFFFFFFFFFFF`.
SLIMFIT_CUDA_HD Keys seed_keys(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  Keys k;
  k.k0 = lowbias32(static_cast<uint32_t>(s) ^ kSeedSalt0);
  k.k1 = lowbias32(static_cast<uint32_t>(s >> 32) ^ kSeedSalt1 ^ k.k0);
  return k;
}

// The random word of flat element index `i` (i >= 0).
SLIMFIT_CUDA_HD uint32_t word(uint64_t i, Keys k) {
  const uint32_t lo = static_cast<uint32_t>(i);
  const uint32_t hi = static_cast<uint32_t>(i >> 32);
  return lowbias32(lowbias32(lo ^ k.k0) ^ hi ^ k.k1);
}

// word -> fp32 uniform in [0, 1): (w >> 8) < 2**24 converts exactly, and the product with
// 2**-24 is exact too; on the device the explicit _rn intrinsics rule out any contraction.
SLIMFIT_CUDA_HD float word_to_uniform(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__uint2float_rn(w >> 8), 5.9604644775390625e-08f /* 2**-24 */);
#else
  return static_cast<float>(w >> 8) * 5.9604644775390625e-08f;
#endif
}

SLIMFIT_CUDA_HD float uniform(uint64_t i, Keys k) { return word_to_uniform(word(i, k)); }

}  // namespace cuda_rng
}  // namespace slimfit
