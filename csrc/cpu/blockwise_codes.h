// The per-block coding steps of block-wise dynamic quantization (slimfit/kernels/reference.py states the
// formulas), shared by the CPU kernels of slimfit::quantize_blockwise and slimfit::adam_blockwise_: the
// nearest and the stochastic code of y = x * inv over a span, a block's NaN-propagating absmax, code
// packing, and the tables of one map. Compiled with -ffp-contract=off (setup.py): no step is fused.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

namespace slimfit {
namespace cpu {

// The index of the level nearest y: the count of midpoints below it, by a binary search without
// branches (each step adds h times a 0/1 comparison: the branchy form mispredicts half the time),
// so the searches of consecutive elements overlap in the CPU.
template <int LEVELS>
inline uint8_t nearest_code(const float* mid, float y) {
  int c = 0;
#pragma GCC unroll 8
  for (int h = LEVELS / 2; h >= 1; h >>= 1) c += h * static_cast<int>(mid[c + h - 1] < y);
  return static_cast<uint8_t>(c);
}

// The codes of y = buf[j] * inv for a span: eight searches interleaved step by step, so that their eight
// chains of dependent loads overlap (1.6x the throughput of one search after another); the tail one by one.
template <int LEVELS>
inline void code_span(const float* mid, const float* buf, float inv, int64_t len, uint8_t* out) {
  constexpr int kWays = 8;
  int64_t j = 0;
  for (; j + kWays <= len; j += kWays) {
    float y[kWays];
    int c[kWays];
    for (int k = 0; k < kWays; ++k) {
      y[k] = buf[j + k] * inv;
      c[k] = 0;
    }
#pragma GCC unroll 8
    for (int h = LEVELS / 2; h >= 1; h >>= 1) {
#pragma GCC unroll 8
      for (int k = 0; k < kWays; ++k) c[k] += h & -static_cast<int>(mid[c[k] + h - 1] < y[k]);
    }
    for (int k = 0; k < kWays; ++k) out[j + k] = static_cast<uint8_t>(c[k]);
  }
  for (; j < len; ++j) out[j] = nearest_code<LEVELS>(mid, buf[j] * inv);
}

inline float block_absmax(const float* buf, int64_t len) {
  float m = 0.0f;
  bool nan = false;
  for (int64_t j = 0; j < len; ++j) {
    const float a = std::fabs(buf[j]);
    m = a > m ? a : m;
    nan |= buf[j] != buf[j];
  }
  return nan ? std::numeric_limits<float>::quiet_NaN() : m;
}

template <int BITS>
inline void pack_block(const uint8_t* c, int64_t len, uint8_t* out) {
  if (BITS == 8) {
    std::memcpy(out, c, len);
    return;
  }
  const int64_t pairs = len / 2;
  for (int64_t b = 0; b < pairs; ++b) out[b] = static_cast<uint8_t>(c[2 * b] | (c[2 * b + 1] << 4));
  if (len % 2) out[pairs] = c[len - 1];  // the unused high bits of the last byte are zero
}

// Stochastic rounding of y = buf[j] * inv for a span, eight elements interleaved as code_span does: c, the
// level at or below y, by a branch-free search of the levels above the first (up = lv + 1: c counts those
// <= y), then the upper level when u < t = (y - lv[c]) * g[c]; NaN y searches to 0 and compares false.
template <int LEVELS>
inline void stochastic_span(const float* lv, const float* g, const float* buf, const float* u, float inv, int64_t len,
                            uint8_t* out) {
  constexpr int kWays = 8;
  const float* up = lv + 1;
  for (int64_t j0 = 0; j0 < len; j0 += kWays) {
    const int ways = static_cast<int>(std::min<int64_t>(kWays, len - j0));
    float y[kWays];
    int c[kWays];
    for (int k = 0; k < kWays; ++k) {
      y[k] = k < ways ? buf[j0 + k] * inv : 0.0f;
      c[k] = 0;
    }
#pragma GCC unroll 8
    for (int h = LEVELS / 2; h >= 1; h >>= 1) {
#pragma GCC unroll 8
      for (int k = 0; k < kWays; ++k) c[k] += h & -static_cast<int>(up[c[k] + h - 1] <= y[k]);
    }
    for (int k = 0; k < ways; ++k) {
      const float t = (y[k] - lv[c[k]]) * g[c[k]];
      out[j0 + k] = static_cast<uint8_t>(c[k] + static_cast<int>(u[j0 + k] < t));
    }
  }
}

// The tables of one map: its levels, midpoints (nearest) and inverse gaps (stochastic), as the kernels read them.
template <int LEVELS>
struct MapTables {
  alignas(64) float lv[LEVELS];
  alignas(64) float mid[LEVELS - 1];
  alignas(64) float g[LEVELS];
};

// The tables of a map filled from its levels (midpoints and inverse gaps: the reference's formulas).
template <int LEVELS>
inline void fill_tables(const float* levels, MapTables<LEVELS>& m) {
  std::memcpy(m.lv, levels, sizeof(m.lv));
  for (int i = 0; i + 1 < LEVELS; ++i) {
    m.mid[i] = (m.lv[i] + m.lv[i + 1]) * 0.5f;
    m.g[i] = 1.0f / (m.lv[i + 1] - m.lv[i]);
  }
  m.g[LEVELS - 1] = 0.0f;
}

}  // namespace cpu
}  // namespace slimfit
