#include "uniform_span.h"

#include "../rng.h"

// ifunc-based multiversioning: ELF targets on x86-64 only; elsewhere one baseline copy.
#if defined(__x86_64__) && defined(__ELF__) && (defined(__GNUC__) || defined(__clang__))
#define SLIMFIT_CPU_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define SLIMFIT_CPU_CLONES
#endif

namespace slimfit {
namespace cpu {

SLIMFIT_CPU_CLONES void uniform_span(uint32_t lo, uint32_t k0, uint32_t hk1, int64_t len, float* u) {
  for (int64_t j = 0; j < len; ++j) u[j] = rng::word_to_uniform(rng::word_hk(lo + static_cast<uint32_t>(j), k0, hk1));
}

SLIMFIT_CPU_CLONES void word_span(uint32_t lo, uint32_t k0, uint32_t hk1, int64_t len, uint32_t* w) {
  for (int64_t j = 0; j < len; ++j) w[j] = rng::word_hk(lo + static_cast<uint32_t>(j), k0, hk1);
}

}  // namespace cpu
}  // namespace slimfit
