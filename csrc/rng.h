// Counter-based random numbers shared by every slimfit backend (C++ side).
//
// Mirrors slimfit/kernels/rng.py bit for bit:
//   k0, k1  = seed_keys(seed)
//   word(i) = lowbias32(lowbias32(lo32(i) ^ k0) ^ hi32(i) ^ k1)
//   uniform(i) = float(word(i) >> 8) * 2**-24        (in [0, 1), 24-bit grid)
// The functions are plain inline code on uint32_t so that loops calling them
// vectorize; they are usable from host C++ and (with SLIMFIT_HD) from CUDA.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define SLIMFIT_HD __host__ __device__ __forceinline__
#else
#define SLIMFIT_HD inline
#endif

namespace slimfit {
namespace rng {

constexpr uint32_t kMul1 = 0x7FEB352Du;
constexpr uint32_t kMul2 = 0x846CA68Bu;
constexpr uint32_t kSeedSalt0 = 0x243F6A88u;
constexpr uint32_t kSeedSalt1 = 0x85A308D3u;
constexpr float kInv2Pow24 = 1.0f / 16777216.0f;  // exact power of two

// The `lowbias32` integer hash (products wrap modulo 2**32).
SLIMFIT_HD uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= kMul1;
  x ^= x >> 15;
  x *= kMul2;
  x ^= x >> 16;
  return x;
}

struct SeedKeys {
  uint32_t k0;
  uint32_t k1;
};

// Two 32-bit keys from a 64-bit seed (a negative int64 is read as its two's complement,
// as Python's `seed & 0xFFFFFFFFFFFFFFFF` does).
SLIMFIT_HD SeedKeys seed_keys(int64_t seed) {
  const uint64_t s = static_cast<uint64_t>(seed);
  SeedKeys k;
  k.k0 = lowbias32(static_cast<uint32_t>(s) ^ kSeedSalt0);
  k.k1 = lowbias32(static_cast<uint32_t>(s >> 32) ^ kSeedSalt1 ^ k.k0);
  return k;
}

// Random word of the element whose flat index has low half `lo` and high half `hi`.
SLIMFIT_HD uint32_t word(uint32_t lo, uint32_t hi, SeedKeys k) {
  return lowbias32(lowbias32(lo ^ k.k0) ^ hi ^ k.k1);
}

// As `word`, for a caller that already folded the high half into the key: hk1 = hi ^ k1.
SLIMFIT_HD uint32_t word_hk(uint32_t lo, uint32_t k0, uint32_t hk1) {
  return lowbias32(lowbias32(lo ^ k0) ^ hk1);
}

// A word -> an fp32 uniform in [0, 1). (w >> 8) < 2**24 converts exactly; the int32 cast
// lets the compiler use the signed (vectorizable) int -> float conversion.
SLIMFIT_HD float word_to_uniform(uint32_t w) {
  return static_cast<float>(static_cast<int32_t>(w >> 8)) * kInv2Pow24;
}

SLIMFIT_HD float uniform(int64_t index, SeedKeys k) {
  const uint64_t i = static_cast<uint64_t>(index);
  return word_to_uniform(word(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), k));
}

}  // namespace rng
}  // namespace slimfit
