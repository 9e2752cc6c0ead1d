// CPU kernels of slimfit::dropout_mask and slimfit::seeded_dropout.
//
// Element i (flat row-major index) is kept when rng::uniform(seed, i) >= p, the
// comparison done in fp32 like the reference (p is rounded to fp32 first). A kept
// element is x * float32(1 / (1 - p)) in fp32, cast back to x's dtype; p >= 1 gives zeros.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "../rng.h"
#include "convert.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kGrainElements = 32768;
// Elements go through small fp32 buffers so that every loop stays branch-free and
// vectorizes: the conversions, the multiply, the hash (uniform_span) and the keep select.
constexpr int64_t kChunk = 256;

void check_p(double p, const char* op) {
  TORCH_CHECK(p >= 0.0 && p <= 1.0, "slimfit::", op, ": p must be in [0, 1], got ", p);
}

at::Tensor dropout_mask_cpu(const at::Tensor& like, double p, int64_t seed) {
  TORCH_CHECK(like.device().is_cpu(), "slimfit::dropout_mask (CPU kernel): expected a CPU tensor, got ",
              like.device());
  check_p(p, "dropout_mask");
  at::Tensor out = at::empty(like.sizes(), like.options().dtype(at::kBool));
  const int64_t n = out.numel();
  if (n == 0) return out;
  const rng::SeedKeys keys = rng::seed_keys(seed);
  const float pf = static_cast<float>(p);
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) {
    cpu::for_each_segment(b, e, keys.k1, [&](int64_t i0, int64_t i1, uint32_t lo0, uint32_t hk1) {
      alignas(64) float u[kChunk];
      for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
        const int64_t len = std::min(kChunk, i1 - c0);
        cpu::uniform_span(lo0 + static_cast<uint32_t>(c0 - i0), keys.k0, hk1, len, u);
        uint8_t* d = dst + c0;
        for (int64_t j = 0; j < len; ++j) d[j] = static_cast<uint8_t>(u[j] >= pf);
      }
    });
  });
  return out;
}

template <typename T>
void seeded_dropout_impl(const T* x, int64_t n, float pf, float factor, rng::SeedKeys keys, T* y) {
  at::parallel_for(0, n, kGrainElements, [&](int64_t b, int64_t e) {
    cpu::for_each_segment(b, e, keys.k1, [&](int64_t i0, int64_t i1, uint32_t lo0, uint32_t hk1) {
      alignas(64) float buf[kChunk];
      alignas(64) float u[kChunk];
      alignas(64) uint32_t bits[kChunk];
      for (int64_t c0 = i0; c0 < i1; c0 += kChunk) {
        const int64_t len = std::min(kChunk, i1 - c0);
        const uint32_t lo = lo0 + static_cast<uint32_t>(c0 - i0);
        cpu::load_f32(x + c0, buf, len);
        for (int64_t j = 0; j < len; ++j) buf[j] = buf[j] * factor;
        std::memcpy(bits, buf, len * sizeof(float));
        cpu::uniform_span(lo, keys.k0, hk1, len, u);
        for (int64_t j = 0; j < len; ++j) bits[j] = u[j] >= pf ? bits[j] : 0u;  // dropped: +0.0, whatever x was
        std::memcpy(buf, bits, len * sizeof(float));
        cpu::store_f32(buf, y + c0, len);
      }
    });
  });
}

at::Tensor seeded_dropout_cpu(const at::Tensor& x_in, double p, int64_t seed) {
  TORCH_CHECK(x_in.device().is_cpu(), "slimfit::seeded_dropout (CPU kernel): expected a CPU tensor, got ",
              x_in.device());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "slimfit::seeded_dropout: unsupported dtype ", dtype, "; use float32, float16 or bfloat16");
  check_p(p, "seeded_dropout");
  if (p >= 1.0) return at::zeros(x_in.sizes(), x_in.options());
  const at::Tensor x = x_in.contiguous();
  at::Tensor y = at::empty(x.sizes(), x.options());
  const int64_t n = x.numel();
  if (n == 0) return y;
  const rng::SeedKeys keys = rng::seed_keys(seed);
  const float pf = static_cast<float>(p);
  const float factor = static_cast<float>(1.0 / (1.0 - p));  // as torch.tensor(1 / (1 - p), dtype=float32)
  if (dtype == at::kFloat)
    seeded_dropout_impl(x.const_data_ptr<float>(), n, pf, factor, keys, y.data_ptr<float>());
  else if (dtype == at::kHalf)
    seeded_dropout_impl(x.const_data_ptr<c10::Half>(), n, pf, factor, keys, y.data_ptr<c10::Half>());
  else
    seeded_dropout_impl(x.const_data_ptr<c10::BFloat16>(), n, pf, factor, keys, y.data_ptr<c10::BFloat16>());
  return y;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) {
  m.impl("dropout_mask", &slimfit::dropout_mask_cpu);
  m.impl("seeded_dropout", &slimfit::seeded_dropout_cpu);
}
