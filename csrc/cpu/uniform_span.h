// The counter-based uniforms of a run of consecutive elements, for the CPU kernels.
//
// The hash (rng.h) needs 32-bit lane multiplies, which the x86-64 baseline (SSE2) lacks:
// the compiler emulates each with shuffles. uniform_span is compiled twice, for AVX2 and for
// the baseline, and the loader picks the one the CPU runs (GCC/Clang target_clones); both
// give the same bits (integer arithmetic and an exact conversion).
#pragma once

#include <cstdint>

namespace slimfit {
namespace cpu {

// u[j] = rng::word_to_uniform(rng::word_hk(lo + j, k0, hk1)) for 0 <= j < len (lo + j wraps
// modulo 2**32; callers keep the high half of the index constant over the span).
void uniform_span(uint32_t lo, uint32_t k0, uint32_t hk1, int64_t len, float* u);

}  // namespace cpu
}  // namespace slimfit
