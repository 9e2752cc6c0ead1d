// CPU kernels of slimfit::topk_prune and slimfit::topk_restore.
//
// topk_prune keeps, per row of the last dimension, the k entries with the largest key
// (x, or |x| when by_magnitude) and lists them in ascending index order. The reference
// is a stable descending sort, so ties at the threshold keep the lowest indices and NaN
// ranks above +Inf (torch's sort order; -0 and +0 tie).
//
// Here: each key becomes a uint32 whose unsigned order is that float order; a selection
// (radix select on 8-bit digits, std::nth_element for the last few candidates) finds the
// k-th largest key t; then one pass in index order keeps every key > t and the first
// (k - #{key > t}) keys == t. No sort, O(row).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <limits>
#include <vector>

#include "convert.h"

namespace slimfit {
namespace {

constexpr int64_t kInt16MaxRow = 32768;  // indices 0..32767 fit int16
constexpr int64_t kGrainElements = 16384;


// Order-preserving map float -> uint32: NaN (either sign) is the largest, -0 == +0.
template <bool BY_MAGNITUDE>
inline uint32_t sort_key(float f) {
  if (BY_MAGNITUDE) f = std::fabs(f);
  f = f + 0.0f;  // -0 -> +0 (round to nearest), every other value unchanged
  uint32_t u;
  std::memcpy(&u, &f, sizeof(u));
  u = (u & 0x80000000u) ? ~u : (u | 0x80000000u);
  return f != f ? 0xFFFFFFFFu : u;
}

// Below this many candidates the radix passes stop and std::nth_element finishes.
constexpr int64_t kSmallSelect = 24;

// The k-th largest of n keys (1 <= k <= n), by MSB-first radix selection on 8-bit
// digits: a histogram of the current digit over the candidates finds the digit of the
// answer, and only the candidates with that digit go on to the next digit. Float keys
// share few top bytes, so the first pass keeps a good fraction of the row; the second
// usually leaves a handful. `buf` holds n keys of scratch; `hist` holds 2 x 256 counters
// that are zero on entry and are left zero (two interleaved histograms halve the chains
// of increments to one bin, which float data concentrates into few top-byte values).
inline uint32_t kth_largest_key(const uint32_t* keys, int64_t n, int64_t k, uint32_t* buf, uint32_t* hist) {
  const uint32_t* cand = keys;
  int64_t m = n;
  int64_t need = k;  // rank (1-based, from the top) of the answer among the candidates
  uint32_t prefix = 0;
  uint32_t* h0 = hist;
  uint32_t* h1 = hist + 256;
  for (int shift = 24; shift >= 0; shift -= 8) {
    if (m <= kSmallSelect) {
      if (cand != buf) std::copy(cand, cand + m, buf);
      std::nth_element(buf, buf + (need - 1), buf + m, std::greater<uint32_t>());
      return buf[need - 1];
    }
    int64_t i = 0;
    for (; i + 1 < m; i += 2) {
      ++h0[(cand[i] >> shift) & 0xFFu];
      ++h1[(cand[i + 1] >> shift) & 0xFFu];
    }
    if (i < m) ++h0[(cand[i] >> shift) & 0xFFu];
    int d = 255;
    int64_t above = 0;
    while (above + h0[d] + h1[d] < need) {  // terminates: the counts sum to m >= need
      above += h0[d] + h1[d];
      --d;
    }
    need -= above;
    prefix |= static_cast<uint32_t>(d) << shift;
    // Keep the candidates with digit d (branchless compaction; in place once cand == buf)
    // and clear the counters this pass touched.
    int64_t o = 0;
    for (int64_t j = 0; j < m; ++j) {
      const uint32_t c = cand[j];
      const uint32_t digit = (c >> shift) & 0xFFu;
      h0[digit] = 0;
      h1[digit] = 0;
      buf[o] = c;
      o += digit == static_cast<uint32_t>(d);
    }
    cand = buf;
    m = o;
  }
  return prefix;  // all 32 bits fixed: every remaining candidate equals it
}

template <typename T, typename I, bool BY_MAGNITUDE>
void topk_prune_impl(const T* x, int64_t rows, int64_t row, int64_t k, T* values, I* indices) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    std::vector<uint32_t> keys(row), scratch(row);
    std::vector<float> xf(row);
    std::vector<int32_t> kept(row + 1);
    std::vector<uint32_t> hist(512, 0);
    for (int64_t r = r0; r < r1; ++r) {
      const T* xr = x + r * row;
      T* vr = values + r * k;
      I* ir = indices + r * k;
      if (k == row) {  // everything is kept
        for (int64_t j = 0; j < row; ++j) {
          vr[j] = xr[j];
          ir[j] = static_cast<I>(j);
        }
        continue;
      }
      uint32_t* kp = keys.data();
      float* fp = xf.data();
      cpu::load_f32(xr, fp, row);
      for (int64_t j = 0; j < row; ++j) kp[j] = sort_key<BY_MAGNITUDE>(fp[j]);
      const uint32_t t = kth_largest_key(kp, row, k, scratch.data(), hist.data());
      int64_t above = 0;
      for (int64_t j = 0; j < row; ++j) above += kp[j] > t;
      int64_t ties_left = k - above;  // how many keys == t to keep, lowest indices first
      // Branchless compaction of the kept indices (ascending); kept has one spare slot.
      int32_t* kd = kept.data();
      int64_t o = 0;
      for (int64_t j = 0; j < row; ++j) {
        const uint32_t key = kp[j];
        const bool tie = key == t && ties_left > 0;
        ties_left -= tie;
        kd[o] = static_cast<int32_t>(j);
        o += (key > t) | tie;
      }
      TORCH_INTERNAL_ASSERT(o == k, "slimfit::topk_prune: selected ", o, " entries instead of ", k);
      for (int64_t j = 0; j < k; ++j) {
        vr[j] = xr[kd[j]];
        ir[j] = static_cast<I>(kd[j]);
      }
    }
  });
}

template <typename T, typename I>
void topk_prune_dispatch(const T* x, int64_t rows, int64_t row, int64_t k, bool by_magnitude, T* values,
                         I* indices) {
  if (by_magnitude)
    topk_prune_impl<T, I, true>(x, rows, row, k, values, indices);
  else
    topk_prune_impl<T, I, false>(x, rows, row, k, values, indices);
}

template <typename T>
void topk_prune_typed(const at::Tensor& x, int64_t rows, int64_t row, int64_t k, bool by_magnitude,
                      at::Tensor& values, at::Tensor& indices) {
  const T* xp = x.const_data_ptr<T>();
  T* vp = values.data_ptr<T>();
  if (indices.scalar_type() == at::kShort)
    topk_prune_dispatch(xp, rows, row, k, by_magnitude, vp, indices.data_ptr<int16_t>());
  else
    topk_prune_dispatch(xp, rows, row, k, by_magnitude, vp, indices.data_ptr<int32_t>());
}

std::tuple<at::Tensor, at::Tensor> topk_prune_cpu(const at::Tensor& x_in, int64_t k, bool by_magnitude) {
  TORCH_CHECK(x_in.device().is_cpu(), "slimfit::topk_prune (CPU kernel): expected a CPU tensor, got ",
              x_in.device());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16,
              "slimfit::topk_prune: unsupported dtype ", dtype, "; use float32, float16 or bfloat16");
  TORCH_CHECK(x_in.dim() >= 1, "slimfit::topk_prune: input must have at least one dimension (rows are the last one)");
  const int64_t row = x_in.size(-1);
  TORCH_CHECK(row <= std::numeric_limits<int32_t>::max(), "slimfit::topk_prune: row length ", row,
              " does not fit int32 indices");
  // As the reference (a sort sliced to k), a row of length 0 yields 0 entries whatever k.
  TORCH_CHECK(k >= 0 && (k <= row || row == 0), "slimfit::topk_prune: k must be in [0, row length=", row, "], got ",
              k);
  const int64_t kk = std::min(k, row);
  const at::Tensor x = x_in.contiguous();
  std::vector<int64_t> out_shape(x.sizes().begin(), x.sizes().end());
  out_shape.back() = kk;
  const auto index_dtype = row <= kInt16MaxRow ? at::kShort : at::kInt;
  at::Tensor values = at::empty(out_shape, x.options());
  at::Tensor indices = at::empty(out_shape, x.options().dtype(index_dtype));
  if (values.numel() == 0) return {values, indices};
  const int64_t rows = x.numel() / row;
  if (dtype == at::kFloat)
    topk_prune_typed<float>(x, rows, row, kk, by_magnitude, values, indices);
  else if (dtype == at::kHalf)
    topk_prune_typed<c10::Half>(x, rows, row, kk, by_magnitude, values, indices);
  else
    topk_prune_typed<c10::BFloat16>(x, rows, row, kk, by_magnitude, values, indices);
  return {values, indices};
}

// ------------------------------------------------------------------ restore
// What restore found wrong with the indices (validation._op_restore_indices raises the same).
struct RestoreFlags {
  std::atomic<bool> outside{false};         // an index outside [0, row_length)
  std::atomic<bool> not_ascending{false};   // a row's indices not strictly ascending (a repeat)
};

// Values are copied as raw words of their element size; zero bits are 0 in every dtype.
template <typename W, typename I>
void topk_restore_impl(const W* values, const I* indices, int64_t rows, int64_t k, int64_t row_length, W* out,
                       RestoreFlags& flags) {
  const int64_t grain = std::max<int64_t>(1, kGrainElements / std::max<int64_t>(row_length + k, 1));
  at::parallel_for(0, rows, grain, [&](int64_t r0, int64_t r1) {
    bool outside = false, not_ascending = false;
    for (int64_t r = r0; r < r1; ++r) {
      const W* vr = values + r * k;
      const I* ir = indices + r * k;
      W* orow = out + r * row_length;
      std::memset(orow, 0, row_length * sizeof(W));  // row by row: still in cache for the scatter
      int64_t prev = -1;
      for (int64_t j = 0; j < k; ++j) {
        const int64_t idx = static_cast<int64_t>(ir[j]);
        not_ascending |= idx <= prev;
        prev = idx;
        if (idx >= 0 && idx < row_length)
          orow[idx] = vr[j];
        else
          outside = true;
      }
    }
    if (outside) flags.outside.store(true, std::memory_order_relaxed);
    if (not_ascending) flags.not_ascending.store(true, std::memory_order_relaxed);
  });
}

template <typename W>
void topk_restore_words(const at::Tensor& values, const at::Tensor& indices, int64_t rows, int64_t k,
                        int64_t row_length, at::Tensor& out, RestoreFlags& bad) {
  const W* vp = static_cast<const W*>(values.const_data_ptr());
  W* op = static_cast<W*>(out.data_ptr());
  switch (indices.scalar_type()) {
    case at::kShort:
      topk_restore_impl(vp, indices.const_data_ptr<int16_t>(), rows, k, row_length, op, bad);
      break;
    case at::kInt:
      topk_restore_impl(vp, indices.const_data_ptr<int32_t>(), rows, k, row_length, op, bad);
      break;
    default:
      topk_restore_impl(vp, indices.const_data_ptr<int64_t>(), rows, k, row_length, op, bad);
      break;
  }
}

at::Tensor topk_restore_cpu(const at::Tensor& values_in, const at::Tensor& indices_in, int64_t row_length) {
  TORCH_CHECK(values_in.device().is_cpu() && indices_in.device().is_cpu(),
              "slimfit::topk_restore (CPU kernel): values and indices must be CPU tensors");
  TORCH_CHECK(values_in.dim() >= 1, "slimfit::topk_restore: values must have at least one dimension");
  TORCH_CHECK(values_in.sizes() == indices_in.sizes(), "slimfit::topk_restore: values ", values_in.sizes(),
              " and indices ", indices_in.sizes(), " must have the same shape");
  const auto itype = indices_in.scalar_type();
  TORCH_CHECK(itype == at::kShort || itype == at::kInt || itype == at::kLong,
              "slimfit::topk_restore: indices must be int16, int32 or int64, got ", itype);
  TORCH_CHECK(row_length >= 0, "slimfit::topk_restore: row_length must be >= 0, got ", row_length);
  const int64_t esize = values_in.element_size();
  TORCH_CHECK(!values_in.is_complex() && (esize == 1 || esize == 2 || esize == 4 || esize == 8),
              "slimfit::topk_restore: unsupported values dtype ", values_in.scalar_type(),
              "; use a real dtype (restore values.real and values.imag separately)");
  std::vector<int64_t> out_shape(values_in.sizes().begin(), values_in.sizes().end());
  const int64_t k = out_shape.back();
  out_shape.back() = row_length;
  // k >= 1 entries per row cannot sit in rows of length 0 (the reference's scatter raises too);
  // checked before the early return below, which would otherwise hand back an empty tensor.
  TORCH_CHECK(row_length > 0 || values_in.numel() == 0, "slimfit::topk_restore: row_length is 0 but each row has ",
              k, " kept entries; pass the pruned tensor's row length (PrunedTensor.row_length)");
  // k distinct positions need rows of at least k (validation.op_topk_restore, same words).
  TORCH_CHECK(k <= row_length || values_in.numel() == 0, "slimfit::topk_restore: row_length=", row_length,
              " cannot hold the ", k, " kept entries of each row; pass the pruned tensor's row length "
              "(PrunedTensor.row_length)");
  at::Tensor out = at::empty(out_shape, values_in.options());
  if (out.numel() == 0) return out;
  if (values_in.numel() == 0) return out.zero_();
  const at::Tensor values = values_in.contiguous();
  const at::Tensor indices = indices_in.contiguous();
  const int64_t rows = values.numel() / k;
  RestoreFlags bad;
  switch (esize) {
    case 1: topk_restore_words<uint8_t>(values, indices, rows, k, row_length, out, bad); break;
    case 2: topk_restore_words<uint16_t>(values, indices, rows, k, row_length, out, bad); break;
    case 4: topk_restore_words<uint32_t>(values, indices, rows, k, row_length, out, bad); break;
    default: topk_restore_words<uint64_t>(values, indices, rows, k, row_length, out, bad); break;
  }
  TORCH_CHECK(!bad.outside.load(), "slimfit::topk_restore: an index is outside [0, row_length=", row_length, ")");
  TORCH_CHECK(!bad.not_ascending.load(), "slimfit::topk_restore: the indices of a row are not strictly ascending (a "
              "repeated index?); pass them as topk_prune returns them (sort each row's indices and values alike)");
  return out;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) {
  m.impl("topk_prune", &slimfit::topk_prune_cpu);
  m.impl("topk_restore", &slimfit::topk_restore_cpu);
}
