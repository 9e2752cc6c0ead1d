// fp32 <-> float16 / bfloat16 over a span of elements, for the CPU kernels.
//
// Loops that call c10::Half's conversions element by element do not vectorize, so:
//   bfloat16 -> fp32   exact (the 16 bits become the high half of the word)
//   fp32 -> bfloat16   round to nearest even, NaN -> 0x7FC0: c10::BFloat16(float), branch-free
//   float16 <-> fp32   the F16C instructions when the CPU has them (checked once at run time),
//                      else c10::Half. Both round to nearest even and agree on every non-NaN
//                      value (torch's own AVX2 kernels use the same instructions).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cstdint>
#include <cstring>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define SLIMFIT_HAVE_F16C_PATH 1
#endif

namespace slimfit {
namespace cpu {

#ifdef SLIMFIT_HAVE_F16C_PATH
inline bool cpu_has_f16c() {
  static const bool ok = __builtin_cpu_supports("avx") && __builtin_cpu_supports("f16c");
  return ok;
}

__attribute__((target("avx,f16c"))) inline void half_to_f32_f16c(const c10::Half* src, float* dst, int64_t len) {
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(src + j));
    _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(h));
  }
  for (; j < len; ++j) dst[j] = _cvtsh_ss(src[j].x);
}

__attribute__((target("avx,f16c"))) inline void f32_to_half_f16c(const float* src, c10::Half* dst, int64_t len) {
  int64_t j = 0;
  for (; j + 8 <= len; j += 8) {
    const __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + j), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + j), h);
  }
  for (; j < len; ++j) dst[j].x = _cvtss_sh(src[j], _MM_FROUND_TO_NEAREST_INT);
}
#endif

// ---------------------------------------------------------------- to fp32
inline void load_f32(const float* src, float* dst, int64_t len) { std::memcpy(dst, src, len * sizeof(float)); }

inline void load_f32(const c10::BFloat16* src, float* dst, int64_t len) {
  for (int64_t j = 0; j < len; ++j) {
    const uint32_t u = static_cast<uint32_t>(src[j].x) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    dst[j] = f;
  }
}

inline void load_f32(const c10::Half* src, float* dst, int64_t len) {
#ifdef SLIMFIT_HAVE_F16C_PATH
  if (cpu_has_f16c()) return half_to_f32_f16c(src, dst, len);
#endif
  for (int64_t j = 0; j < len; ++j) dst[j] = static_cast<float>(src[j]);
}

// ---------------------------------------------------------------- from fp32
inline void store_f32(const float* src, float* dst, int64_t len) { std::memcpy(dst, src, len * sizeof(float)); }

inline void store_f32(const float* src, double* dst, int64_t len) {
  for (int64_t j = 0; j < len; ++j) dst[j] = static_cast<double>(src[j]);
}

inline void store_f32(const float* src, c10::BFloat16* dst, int64_t len) {
  for (int64_t j = 0; j < len; ++j) {
    uint32_t u;
    std::memcpy(&u, src + j, sizeof(u));
    const uint32_t rounded = (u + (((u >> 16) & 1u) + 0x7FFFu)) >> 16;
    const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
    dst[j].x = static_cast<uint16_t>(nan ? 0x7FC0u : rounded);
  }
}

inline void store_f32(const float* src, c10::Half* dst, int64_t len) {
#ifdef SLIMFIT_HAVE_F16C_PATH
  if (cpu_has_f16c()) return f32_to_half_f16c(src, dst, len);
#endif
  for (int64_t j = 0; j < len; ++j) dst[j] = c10::Half(src[j]);
}

}  // namespace cpu
}  // namespace slimfit
