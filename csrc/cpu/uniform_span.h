// The counter-based uniforms (and words) of a run of consecutive elements, for the CPU kernels.
//
// The hash (rng.h) needs 32-bit lane multiplies, which the x86-64 baseline (SSE2) lacks:
// the compiler emulates each with shuffles. uniform_span is compiled twice, for AVX2 and for
// the baseline, and the loader picks the one the CPU runs (GCC/Clang target_clones); both
// give the same bits (integer arithmetic and an exact conversion).
#pragma once

#include <algorithm>
#include <cstdint>

namespace slimfit {
namespace cpu {

// u[j] = rng::word_to_uniform(rng::word_hk(lo + j, k0, hk1)) for 0 <= j < len (lo + j wraps
// modulo 2**32; callers keep the high half of the index constant over the span).
void uniform_span(uint32_t lo, uint32_t k0, uint32_t hk1, int64_t len, float* u);

// w[j] = rng::word_hk(lo + j, k0, hk1): the raw words, for kernels that use their bits.
void word_span(uint32_t lo, uint32_t k0, uint32_t hk1, int64_t len, uint32_t* w);

// Calls body(i0, i1, lo0, hk1) over [begin, end) cut at multiples of 2**32, so that the
// high half of the index is constant inside each call: element i0 + j has low half
// lo0 + j, and hk1 = hi32(i0) ^ k1.
template <typename F>
inline void for_each_segment(int64_t begin, int64_t end, uint32_t k1, const F& body) {
  constexpr int64_t kSpan = int64_t(1) << 32;
  while (begin < end) {
    const int64_t seg_end = std::min(end, (begin / kSpan + 1) * kSpan);
    const uint64_t ub = static_cast<uint64_t>(begin);
    body(begin, seg_end, static_cast<uint32_t>(ub), static_cast<uint32_t>(ub >> 32) ^ k1);
    begin = seg_end;
  }
}

}  // namespace cpu
}  // namespace slimfit
