// Stochastic rounding of one fp32 value to bfloat16 or float16 (slimfit/kernels/reference.py states the
// formulas), shared by the CPU kernels of slimfit::round_stochastic and slimfit::adam_blockwise_.
//   bfloat16: one ulp away from zero with probability (low 16 bits of x) / 2**16, from the word's low 16 bits;
//   float16: the upper of x's two fp16 neighbours with probability (x - lo) / (hi - lo), from the uniform.
// Where x or its nearest rounding is not finite: the nearest.
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace slimfit {
namespace cpu {

inline uint32_t bits_of(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof(b));
  return b;
}

inline bool finite_bits(uint32_t b) { return (b & 0x7F800000u) != 0x7F800000u; }

inline uint16_t bf16_of(float x, uint32_t word) {
  const uint32_t b = bits_of(x);
  const c10::BFloat16 near(x);  // round to nearest even, NaN -> 0x7FC0 (as torch's cast)
  if (!finite_bits(b) || (near.x & 0x7F80u) == 0x7F80u) return near.x;
  const uint32_t trunc = b & 0xFFFF0000u;
  const uint32_t up = (word & 0xFFFFu) < (b & 0xFFFFu) ? trunc + 0x10000u : trunc;
  return static_cast<uint16_t>(up >> 16);
}

// torch.nextafter(h, +inf) (up) or (h, -inf) for a finite fp16 h, on its bits.
inline uint16_t half_next(uint16_t h, bool up) {
  if ((h & 0x7FFFu) == 0) return up ? 0x0001u : 0x8001u;
  const bool negative = (h & 0x8000u) != 0;
  return static_cast<uint16_t>(up != negative ? h + 1 : h - 1);
}

inline float half_value(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

inline uint16_t fp16_of(float x, float u) {
  const c10::Half near(x);  // round to nearest even
  if (!finite_bits(bits_of(x)) || (near.x & 0x7C00u) == 0x7C00u) return near.x;
  const float nf = static_cast<float>(near);
  const float other = half_value(half_next(near.x, nf < x));
  const float lo = std::min(nf, other), hi = std::max(nf, other);
  const float p = (x - lo) / (hi - lo);
  return c10::Half(u < p ? hi : lo).x;  // an fp16 value: the cast is exact
}

}  // namespace cpu
}  // namespace slimfit
