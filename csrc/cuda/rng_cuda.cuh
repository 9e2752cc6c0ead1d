// Counter-based random numbers for the CUDA kernels: the hash and seed keys are the ones
// of csrc/rng.h (host and device, bit for bit with slimfit/kernels/rng.py); this header
// adds the 64-bit-index entry points the kernels use and a device fp32 conversion with
// explicit round-to-nearest intrinsics, so no contraction can change the bits.
#pragma once

#include <cstdint>

#include "../rng.h"

namespace slimfit {
namespace cuda_rng {

using Keys = rng::SeedKeys;
using rng::seed_keys;

// The random word of flat element index `i` (i >= 0).
SLIMFIT_HD uint32_t word(uint64_t i, Keys k) {
  return rng::word(static_cast<uint32_t>(i), static_cast<uint32_t>(i >> 32), k);
}

// word -> fp32 uniform in [0, 1): (w >> 8) < 2**24 converts exactly; the product with 2**-24 too.
SLIMFIT_HD float word_to_uniform(uint32_t w) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(__uint2float_rn(w >> 8), rng::kInv2Pow24);
#else
  return rng::word_to_uniform(w);
#endif
}

SLIMFIT_HD float uniform(uint64_t i, Keys k) { return word_to_uniform(word(i, k)); }

}  // namespace cuda_rng
}  // namespace slimfit
