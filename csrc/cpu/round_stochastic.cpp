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
#include "round_bits.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kGrainElements = 32768;
constexpr int64_t kChunk = 256;

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
          for (int64_t j = 0; j < len; ++j) y[c0 + j] = cpu::bf16_of(x[c0 + j], w[j]);
        } else {
          cpu::uniform_span(lo, keys.k0, hk1, len, u);
          for (int64_t j = 0; j < len; ++j) y[c0 + j] = cpu::fp16_of(x[c0 + j], u[j]);
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
