// CPU kernel of slimfit::round_stochastic: fp32 values rounded to bfloat16 or float16 without bias,
// element i drawing from the counter-based word of (seed, i) (slimfit/kernels/reference.py states the
// formulas; this follows them bit for bit).
//   bfloat16: one ulp away from zero with probability (low 16 bits of x) / 2**16, from the word's low
//             16 bits; float16: the upper of x's two fp16 neighbours with probability (x - lo) / (hi - lo),
//             from the element's uniform. Where x or its nearest rounding is not finite: the nearest.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "../rng.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kGrainElements = 32768;
constexpr int64_t kChunk = 256;

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

template <bool BF16>
void round_impl(const float* x, int64_t n, rng::SeedKeys keys, uint16_t* y) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) {
    cpu::for_each_segment(b, e, keys.k1, [&](int64_t i0, int64_t i1, uint32_t lo0, uint32_t hk1) {
      alignas(64) uint32_t w[kChunk];
      alignas(64) float u[kChunk];
      for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
        const int64_t len = std::min(kChunk, i1 - c0);
        const uint32_t lo = lo0 + static_cast<uint32_t>(c0 - i0);
        if constexpr (BF16) {
          cpu::word_span(lo, keys.k0, hk1, len, w);
          for (int64_t j = 0; j < len; ++j) y[c0 + j] = bf16_of(x[c0 + j], w[j]);
        } else {
          cpu::uniform_span(lo, keys.k0, hk1, len, u);
          for (int64_t j = 0; j < len; ++j) y[c0 + j] = fp16_of(x[c0 + j], u[j]);
        }
      }
    });
  });
}

at::Tensor round_stochastic_cpu(const at::Tensor& x_in, at::ScalarType dtype, int64_t seed) {
  TORCH_CHECK(x_in.device().is_cpu(), "slimfit::round_stochastic (CPU kernel): expected a CPU tensor, got ",
              x_in.device());
  TORCH_CHECK(x_in.scalar_type() == at::kFloat, "slimfit::round_stochastic: x must be float32 (the values to "
              "round), got ", x_in.scalar_type());
  TORCH_CHECK(dtype == at::kBFloat16 || dtype == at::kHalf, "slimfit::round_stochastic: rounds to bfloat16 or "
              "float16, got ", dtype, "; float32 values need no rounding");
  const at::Tensor x = x_in.contiguous();
  at::Tensor out = at::empty(x.sizes(), x.options().dtype(dtype));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const rng::SeedKeys keys = rng::seed_keys(seed);
  uint16_t* y = reinterpret_cast<uint16_t*>(out.data_ptr());
  if (dtype == at::kBFloat16)
    round_impl<true>(x.const_data_ptr<float>(), n, keys, y);
  else
    round_impl<false>(x.const_data_ptr<float>(), n, keys, y);
  return out;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) { m.impl("round_stochastic", &slimfit::round_stochastic_cpu); }
