// CPU kernels of slimfit::quantize and slimfit::dequantize.
//
// Bit-exact with slimfit/kernels/reference.py (the specification): per group of
// `group_size` consecutive elements of the flattened input, in fp32,
//   mn, mx = min, max (NaN-propagating)      h = 0.5 for a wide group (finite, but mx - mn
//   scaled = (mx*h - mn*h) / (2**bits - 1)       overflows fp32), else 1 (then nothing changes)
//   scale = wide ? 2 * scaled : scaled       inv = 1 / (scaled >= 2**-126 ? scaled : 1)
//   q = (x*h - mn*h) * inv                   code = clamp(floor(q + u), 0, 2**bits - 1)
// with u = 0.5 (nearest) or the counter-based uniform of the element's flat index
// (stochastic). setup.py compiles with -ffp-contract=off, so no step is fused.
// dequantize: code * scale + offset; where that overflows with a finite scale and offset, the
// same value a quarter down, saturated at +-FLT_MAX.
//
// One parallel task handles whole groups: the group is converted to fp32 into a
// stack buffer, reduced with explicit SIMD min/max, then coded in a second
// vectorizable pass and packed (groups always start on a byte boundary because
// group_size is a multiple of 8 / bits).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "../dequantize_sizes.h"
#include "../rng.h"
#include "convert.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kMaxGroup = 256;
// Elements per parallel task: small enough to split a few-MB tensor over 2 cores,
// large enough that the OpenMP fork/join cost does not show.
constexpr int64_t kGrainElements = 32768;

void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "slimfit::", op, ": bits must be 2, 4 or 8, got ", bits);
}

void check_group_size(int64_t group_size, const char* op) {
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256, "slimfit::", op,
              ": group_size must be 32, 64, 128 or 256, got ", group_size);
}

// ------------------------------------------------------------------ min / max
// The plain `v < mn ? v : mn` reduction does not vectorize without -ffinite-math-only,
// so reduce eight lanes at a time explicitly (GCC/Clang vector extensions), with the
// exact same comparisons. NaN is tracked separately and forces mn = mx = NaN (amin/amax
// propagate NaN); +-Inf needs nothing special.
#if defined(__GNUC__) || defined(__clang__)
// 16-byte vectors: the native width of the baseline ISA (SSE2 on x86-64, NEON on
// aarch64); wider generic vectors get split badly. Two accumulators per quantity.
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x4 __attribute__((vector_size(16)));

// buf holds `len8` floats, a multiple of 8 (the caller pads with the last element,
// which changes neither min nor max).
inline void group_min_max(const float* buf, int64_t len8, float& out_mn, float& out_mx) {
  f32x4 mn0, mn1;
  std::memcpy(&mn0, buf, sizeof(f32x4));
  std::memcpy(&mn1, buf + 4, sizeof(f32x4));
  f32x4 mx0 = mn0, mx1 = mn1;
  i32x4 nan = (mn0 != mn0) | (mn1 != mn1);
  for (int64_t j = 8; j < len8; j += 8) {
    f32x4 v0, v1;
    std::memcpy(&v0, buf + j, sizeof(f32x4));
    std::memcpy(&v1, buf + j + 4, sizeof(f32x4));
    mn0 = v0 < mn0 ? v0 : mn0;
    mn1 = v1 < mn1 ? v1 : mn1;
    mx0 = v0 > mx0 ? v0 : mx0;
    mx1 = v1 > mx1 ? v1 : mx1;
    nan |= (v0 != v0) | (v1 != v1);
  }
  mn0 = mn1 < mn0 ? mn1 : mn0;
  mx0 = mx1 > mx0 ? mx1 : mx0;
  float m0 = mn0[0], m1 = mx0[0];
  int32_t any_nan = nan[0] | nan[1] | nan[2] | nan[3];
  for (int l = 1; l < 4; ++l) {
    m0 = mn0[l] < m0 ? mn0[l] : m0;
    m1 = mx0[l] > m1 ? mx0[l] : m1;
  }
  if (any_nan) m0 = m1 = std::numeric_limits<float>::quiet_NaN();
  out_mn = m0;
  out_mx = m1;
}
#else
inline void group_min_max(const float* buf, int64_t len8, float& out_mn, float& out_mx) {
  float mn = buf[0], mx = buf[0];
  bool any_nan = false;
  for (int64_t j = 0; j < len8; ++j) {
    const float v = buf[j];
    mn = v < mn ? v : mn;
    mx = v > mx ? v : mx;
    any_nan |= v != v;
  }
  if (any_nan) mn = mx = std::numeric_limits<float>::quiet_NaN();
  out_mn = mn;
  out_mx = mx;
}
#endif

// ------------------------------------------------------------------ codes
// clamp(floor(t), 0, L) for t = q + u, without UB for NaN (-> 0): for t >= 0 truncation
// is floor, and clamping t before truncating gives the same integer.
inline uint8_t code_of(float t, float levels) {
  float c = t > 0.0f ? t : 0.0f;
  c = c < levels ? c : levels;
  return static_cast<uint8_t>(static_cast<int32_t>(c));
}

// Packs nbytes * (8 / BITS) codes, little-endian within each byte (the caller pads the
// last byte with zero codes).
template <int BITS>
inline void pack_codes(const uint8_t* c, int64_t nbytes, uint8_t* out) {
  if (BITS == 8) {
    std::memcpy(out, c, nbytes);
  } else if (BITS == 4) {
    for (int64_t b = 0; b < nbytes; ++b) out[b] = static_cast<uint8_t>(c[2 * b] | (c[2 * b + 1] << 4));
  } else {
    for (int64_t b = 0; b < nbytes; ++b)
      out[b] = static_cast<uint8_t>(c[4 * b] | (c[4 * b + 1] << 2) | (c[4 * b + 2] << 4) | (c[4 * b + 3] << 6));
  }
}

// The codes of one group: q = (x*h - mn*h) * inv. h = 0.5 only in a wide group (WIDE); the
// other groups take the plain (x - mn) * inv, the same bits since x*1 == x.
template <bool STOCHASTIC, bool WIDE>
inline void code_group(const float* buf, const float* noise, int64_t len, float mnh, float inv, float levels,
                       uint8_t* cbuf) {
  for (int64_t j = 0; j < len; ++j) {
    const float v = WIDE ? buf[j] * 0.5f : buf[j];
    const float q = (v - mnh) * inv;
    cbuf[j] = code_of(q + (STOCHASTIC ? noise[j] : 0.5f), levels);
  }
}

template <typename T, int BITS, bool STOCHASTIC>
void quantize_impl(const T* x, int64_t n, int64_t group_size, rng::SeedKeys keys, uint8_t* codes, float* scale,
                   float* offset) {
  constexpr int kPer = 8 / BITS;
  constexpr int kLevels = (1 << BITS) - 1;
  const float levels = static_cast<float>(kLevels);
  const int64_t ng = (n + group_size - 1) / group_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / group_size);

  at::parallel_for(0, ng, grain, [&](int64_t g0, int64_t g1) {
    alignas(64) float buf[kMaxGroup];
    alignas(64) float noise[kMaxGroup];
    alignas(64) uint8_t cbuf[kMaxGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * group_size;
      const int64_t len = std::min(group_size, n - start);
      cpu::load_f32(x + start, buf, len);
      // Edge padding (as the reference does) keeps min and max unchanged.
      const int64_t len8 = (len + 7) & ~int64_t(7);
      for (int64_t j = len; j < len8; ++j) buf[j] = buf[len - 1];

      float mn, mx;
      group_min_max(buf, len8, mn, mx);
      // A finite group whose range overflows fp32 (+-3e38) is computed at half scale, exactly.
      const bool wide = std::isinf(mx - mn) && std::isfinite(mx) && std::isfinite(mn);
      const float h = wide ? 0.5f : 1.0f;
      const float scaled = (mx * h - mn * h) / levels;
      // Below the smallest normal fp32 the reciprocal would overflow: a constant group.
      const float inv = 1.0f / (scaled >= std::numeric_limits<float>::min() ? scaled : 1.0f);
      scale[g] = wide ? scaled * 2.0f : scaled;
      offset[g] = mn;

      if (STOCHASTIC) {
        // A group never straddles a multiple of 2**32 (group_size is a power of two
        // <= 256), so the high half of the index is constant over it.
        const uint64_t ustart = static_cast<uint64_t>(start);
        const uint32_t lo0 = static_cast<uint32_t>(ustart);
        const uint32_t hk1 = static_cast<uint32_t>(ustart >> 32) ^ keys.k1;
        cpu::uniform_span(lo0, keys.k0, hk1, len, noise);
      }
      if (wide)
        code_group<STOCHASTIC, true>(buf, noise, len, mn * h, inv, levels, cbuf);
      else
        code_group<STOCHASTIC, false>(buf, noise, len, mn, inv, levels, cbuf);
      const int64_t nbytes = (len + kPer - 1) / kPer;
      for (int64_t j = len; j < nbytes * kPer; ++j) cbuf[j] = 0;  // unused high bits are zero
      pack_codes<BITS>(cbuf, nbytes, codes + start / kPer);
    }
  });
}

template <typename T, int BITS>
void quantize_dispatch_rounding(const T* x, int64_t n, int64_t gs, bool stochastic, rng::SeedKeys keys,
                                uint8_t* codes, float* scale, float* offset) {
  if (stochastic)
    quantize_impl<T, BITS, true>(x, n, gs, keys, codes, scale, offset);
  else
    quantize_impl<T, BITS, false>(x, n, gs, keys, codes, scale, offset);
}

template <typename T>
void quantize_dispatch_bits(const T* x, int64_t n, int64_t bits, int64_t gs, bool stochastic, rng::SeedKeys keys,
                            uint8_t* codes, float* scale, float* offset) {
  switch (bits) {
    case 2: quantize_dispatch_rounding<T, 2>(x, n, gs, stochastic, keys, codes, scale, offset); break;
    case 4: quantize_dispatch_rounding<T, 4>(x, n, gs, stochastic, keys, codes, scale, offset); break;
    default: quantize_dispatch_rounding<T, 8>(x, n, gs, stochastic, keys, codes, scale, offset); break;
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cpu(const at::Tensor& x_in, int64_t bits, int64_t group_size,
                                                            bool stochastic, int64_t seed) {
  check_bits(bits, "quantize");
  check_group_size(group_size, "quantize");
  TORCH_CHECK(x_in.device().is_cpu(), "slimfit::quantize (CPU kernel): expected a CPU tensor, got ", x_in.device());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "slimfit::quantize: unsupported dtype ", dtype, "; use float32, float16 or bfloat16");
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t per = 8 / bits;
  const int64_t ng = (n + group_size - 1) / group_size;
  auto opts = x.options();
  at::Tensor codes = at::empty({(n + per - 1) / per}, opts.dtype(at::kByte));
  at::Tensor scale = at::empty({ng}, opts.dtype(at::kFloat));
  at::Tensor offset = at::empty({ng}, opts.dtype(at::kFloat));
  if (n == 0) return {codes, scale, offset};

  const rng::SeedKeys keys = rng::seed_keys(seed);
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* s = scale.data_ptr<float>();
  float* o = offset.data_ptr<float>();
  if (dtype == at::kFloat)
    quantize_dispatch_bits(x.const_data_ptr<float>(), n, bits, group_size, stochastic, keys, c, s, o);
  else if (dtype == at::kHalf)
    quantize_dispatch_bits(x.const_data_ptr<c10::Half>(), n, bits, group_size, stochastic, keys, c, s, o);
  else
    quantize_dispatch_bits(x.const_data_ptr<c10::BFloat16>(), n, bits, group_size, stochastic, keys, c, s, o);
  return {codes, scale, offset};
}

// ------------------------------------------------------------------ dequantize
template <int BITS>
inline void unpack_group(const uint8_t* packed, int64_t len, uint8_t* c) {
  constexpr int kPer = 8 / BITS;
  constexpr int kMask = (1 << BITS) - 1;
  if (BITS == 8) {
    std::memcpy(c, packed, len);
    return;
  }
  const int64_t nbytes = (len + kPer - 1) / kPer;
  for (int64_t b = 0; b < nbytes; ++b) {
    const uint8_t v = packed[b];
    for (int k = 0; k < kPer; ++k) c[b * kPer + k] = static_cast<uint8_t>((v >> (k * BITS)) & kMask);
  }
}

// Whether code * s + o can overflow fp32 with a finite s and o (codes are <= 255): a cheap,
// conservative per-group test, so that only such groups pay for fix_overflow's pass.
inline bool may_overflow(float s, float o) {
  return std::isfinite(s) && std::isfinite(o) && std::fabs(s) * 255.0f + std::fabs(o) >= 0x1p127f;
}

// Where code * s + o overflowed (s, o finite): the same value a quarter down (exact scalings),
// saturated at the largest fp32, as reference.dequantize.
inline void fix_overflow(const uint8_t* cbuf, int64_t len, float s, float o, float* fbuf) {
  constexpr float kMax = std::numeric_limits<float>::max();
  const float sq = s * 0.25f;
  const float oq = o * 0.25f;
  for (int64_t j = 0; j < len; ++j) {
    if (!std::isinf(fbuf[j])) continue;
    float y = static_cast<float>(cbuf[j]) * sq;
    y = (y + oq) * 4.0f;
    fbuf[j] = y > kMax ? kMax : (y < -kMax ? -kMax : y);
  }
}

template <typename T, int BITS>
void dequantize_impl(const uint8_t* codes, const float* scale, const float* offset, int64_t n, int64_t group_size,
                     T* out) {
  constexpr int kPer = 8 / BITS;
  const int64_t ng = (n + group_size - 1) / group_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / group_size);
  at::parallel_for(0, ng, grain, [&](int64_t g0, int64_t g1) {
    alignas(64) uint8_t cbuf[kMaxGroup];
    alignas(64) float fbuf[kMaxGroup];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t start = g * group_size;
      const int64_t len = std::min(group_size, n - start);
      unpack_group<BITS>(codes + start / kPer, len, cbuf);
      const float s = scale[g];
      const float o = offset[g];
      for (int64_t j = 0; j < len; ++j) {
        float v = static_cast<float>(cbuf[j]) * s;  // two roundings, as the reference: no FMA
        fbuf[j] = v + o;
      }
      if (may_overflow(s, o)) fix_overflow(cbuf, len, s, o, fbuf);
      cpu::store_f32(fbuf, out + start, len);
    }
  });
}

template <typename T>
void dequantize_dispatch_bits(const uint8_t* codes, const float* scale, const float* offset, int64_t n, int64_t bits,
                              int64_t gs, T* out) {
  switch (bits) {
    case 2: dequantize_impl<T, 2>(codes, scale, offset, n, gs, out); break;
    case 4: dequantize_impl<T, 4>(codes, scale, offset, n, gs, out); break;
    default: dequantize_impl<T, 8>(codes, scale, offset, n, gs, out); break;
  }
}

using dequantize_sizes::check_quantized_sizes;
using dequantize_sizes::shape_numel;

at::Tensor dequantize_cpu(const at::Tensor& codes_in, const at::Tensor& scale_in, const at::Tensor& offset_in,
                          int64_t bits, int64_t group_size, c10::SymIntArrayRef sym_shape, at::ScalarType dtype) {
  check_bits(bits, "dequantize");
  check_group_size(group_size, "dequantize");
  TORCH_CHECK(codes_in.device().is_cpu() && scale_in.device().is_cpu() && offset_in.device().is_cpu(),
              "slimfit::dequantize (CPU kernel): codes, scale and offset must be CPU tensors");
  TORCH_CHECK(codes_in.scalar_type() == at::kByte, "slimfit::dequantize: codes must be uint8, got ",
              codes_in.scalar_type());
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat && offset_in.scalar_type() == at::kFloat,
              "slimfit::dequantize: scale and offset must be float32, got ", scale_in.scalar_type(), " and ",
              offset_in.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "slimfit::dequantize: unsupported output dtype ", dtype,
              "; use float32, float16, bfloat16 or float64");
  const at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(sym_shape);
  const int64_t n = shape_numel(shape);
  // The sizes before the allocation (validation.op_dequantize): a wrong shape must not first try
  // to allocate its elements.
  check_quantized_sizes(codes_in.numel(), scale_in.numel(), offset_in.numel(), n, bits, group_size, shape);
  at::Tensor out = at::empty(shape, codes_in.options().dtype(dtype));
  if (n == 0) return out;
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  const at::Tensor offset = offset_in.contiguous();
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* s = scale.const_data_ptr<float>();
  const float* o = offset.const_data_ptr<float>();
  switch (dtype) {
    case at::kFloat: dequantize_dispatch_bits(c, s, o, n, bits, group_size, out.data_ptr<float>()); break;
    case at::kHalf: dequantize_dispatch_bits(c, s, o, n, bits, group_size, out.data_ptr<c10::Half>()); break;
    case at::kBFloat16:
      dequantize_dispatch_bits(c, s, o, n, bits, group_size, out.data_ptr<c10::BFloat16>());
      break;
    default: dequantize_dispatch_bits(c, s, o, n, bits, group_size, out.data_ptr<double>()); break;
  }
  return out;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) {
  m.impl("quantize", &slimfit::quantize_cpu);
  m.impl("dequantize", &slimfit::dequantize_cpu);
}
