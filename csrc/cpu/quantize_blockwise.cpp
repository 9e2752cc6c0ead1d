// CPU kernels of slimfit::quantize_blockwise and slimfit::dequantize_blockwise: block-wise dynamic
// quantization (the codec of optimizer moments; maps in slimfit/kernels/qmaps.py).
//
// Bit-exact with slimfit/kernels/reference.py (the specification): per block of `block_size`
// consecutive elements of the flattened input, in fp32,
//   absmax = max |x| (NaN-propagating)       inv = absmax >= 2**-126 ? 1 / absmax : 0
//   y = x * inv                              mid[i] = (qmap[i] + qmap[i + 1]) * 0.5
//   code = #{i : mid[i] < y}                 (nearest level, a tie to the lower one, NaN -> 0)
// found by a branch-free binary search over the midpoints (log2(levels) compares per element). Stochastic
// rounding (the reference's formulas): c = #{k >= 1 : qmap[k] <= y} by the same search over qmap + 1,
// t = (y - qmap[c]) * g[c] with g the inverse gaps (g[k] = 1 / (qmap[k + 1] - qmap[k]), the last 0), and
// code = c + (u < t), u the counter-based uniform of the element's flat index (rng.h; as quantize.cpp).
// dequantize: qmap[code] * absmax, cast to the output dtype. setup.py compiles with
// -ffp-contract=off, so no step is fused.
//
// One parallel task handles whole blocks: the block is converted to fp32 into a stack buffer,
// reduced to its absmax, coded and packed (blocks start on a byte boundary: block_size is even).
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
#include "blockwise_codes.h"
#include "convert.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kGrainElements = 32768;  // elements per parallel task (as quantize.cpp)

void check_block_size(int64_t block_size, const char* op) {
  const bool ok = block_size >= 32 && block_size <= kMaxBlock && (block_size & (block_size - 1)) == 0;
  TORCH_CHECK(ok, "slimfit::", op, ": block_size must be one of (32, 64, 128, 256, 512, 1024, 2048, 4096), got ",
              block_size);
}

// The map's code width (4 or 8 bits) after the checks validation._op_qmap makes, with its words.
int check_qmap(const at::Tensor& qmap, const at::Device& device, const char* op) {
  TORCH_CHECK(qmap.scalar_type() == at::kFloat && qmap.dim() == 1 && (qmap.numel() == 16 || qmap.numel() == 256),
              "slimfit::", op, ": qmap must be a 1-D float32 tensor of 16 or 256 levels (4- or 8-bit codes; "
              "slimfit.kernels.qmaps), got ", qmap.scalar_type(), " of shape ", qmap.sizes());
  TORCH_CHECK(qmap.device() == device, "slimfit::", op, ": tensors on different devices (qmap on ", qmap.device(),
              ", the data on ", device, "); move them to one device");
  const at::Tensor q = qmap.contiguous();
  const float* v = q.const_data_ptr<float>();
  bool ok = std::isfinite(v[0]);
  for (int64_t i = 1; i < q.numel(); ++i) ok = ok && std::isfinite(v[i]) && v[i] > v[i - 1];
  TORCH_CHECK(ok, "slimfit::", op, ": qmap must be finite and strictly increasing (a sorted map of levels)");
  return q.numel() == 16 ? 4 : 8;
}

template <typename T, int BITS, bool STOCHASTIC>
void quantize_blockwise_impl(const T* x, int64_t n, const float* levels, int64_t block_size, rng::SeedKeys keys,
                             uint8_t* codes, float* absmax) {
  constexpr int kLevels = 1 << BITS;
  const int64_t nb = (n + block_size - 1) / block_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float buf[kMaxBlock];
    alignas(64) float noise[STOCHASTIC ? kMaxBlock : 1];
    alignas(64) uint8_t cbuf[kMaxBlock];
    cpu::MapTables<kLevels> m;  // local copies: the code stores cannot alias them
    cpu::fill_tables<kLevels>(levels, m);
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block_size;
      const int64_t len = std::min(block_size, n - start);
      cpu::load_f32(x + start, buf, len);
      const float a = cpu::block_absmax(buf, len);
      // A zero, subnormal or non-finite (NaN compares false, 1 / inf is 0) block: every y is 0 (or NaN).
      const float inv = a >= std::numeric_limits<float>::min() ? 1.0f / a : 0.0f;
      absmax[b] = a;
      if (STOCHASTIC) {
        // A block (a power of two <= 4096 elements, aligned) never straddles a multiple of 2**32: the high
        // half of the index is constant over it, folded into the key once.
        const uint64_t ustart = static_cast<uint64_t>(start);
        cpu::uniform_span(static_cast<uint32_t>(ustart), keys.k0, static_cast<uint32_t>(ustart >> 32) ^ keys.k1, len,
                          noise);
        cpu::stochastic_span<kLevels>(m.lv, m.g, buf, noise, inv, len, cbuf);
      } else {
        cpu::code_span<kLevels>(m.mid, buf, inv, len, cbuf);
      }
      cpu::pack_block<BITS>(cbuf, len, codes + start * BITS / 8);
    }
  });
}

template <typename T>
void quantize_blockwise_bits(const T* x, int64_t n, const float* lv, int bits, int64_t bs, bool stochastic,
                             rng::SeedKeys keys, uint8_t* c, float* a) {
  if (bits == 4 && stochastic)
    quantize_blockwise_impl<T, 4, true>(x, n, lv, bs, keys, c, a);
  else if (bits == 4)
    quantize_blockwise_impl<T, 4, false>(x, n, lv, bs, keys, c, a);
  else if (stochastic)
    quantize_blockwise_impl<T, 8, true>(x, n, lv, bs, keys, c, a);
  else
    quantize_blockwise_impl<T, 8, false>(x, n, lv, bs, keys, c, a);
}

std::tuple<at::Tensor, at::Tensor> quantize_blockwise_cpu(const at::Tensor& x_in, const at::Tensor& qmap,
                                                          int64_t block_size, bool stochastic, int64_t seed) {
  const char* op = "quantize_blockwise";
  TORCH_CHECK(x_in.device().is_cpu(), "slimfit::", op, " (CPU kernel): expected a CPU tensor, got ", x_in.device());
  const auto dtype = x_in.scalar_type();
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16, "slimfit::", op,
              ": unsupported dtype ", dtype, " for x; use float32, float16 or bfloat16");
  check_block_size(block_size, op);
  const int bits = check_qmap(qmap, x_in.device(), op);
  const at::Tensor x = x_in.contiguous();
  const int64_t n = x.numel();
  const int64_t per = 8 / bits;
  auto opts = x.options();
  at::Tensor codes = at::empty({(n + per - 1) / per}, opts.dtype(at::kByte));
  at::Tensor absmax = at::empty({(n + block_size - 1) / block_size}, opts.dtype(at::kFloat));
  if (n == 0) return {codes, absmax};

  const at::Tensor q = qmap.contiguous();
  const float* lv = q.const_data_ptr<float>();
  const rng::SeedKeys keys = rng::seed_keys(seed);
  uint8_t* c = codes.data_ptr<uint8_t>();
  float* a = absmax.data_ptr<float>();
  if (dtype == at::kFloat)
    quantize_blockwise_bits(x.const_data_ptr<float>(), n, lv, bits, block_size, stochastic, keys, c, a);
  else if (dtype == at::kHalf)
    quantize_blockwise_bits(x.const_data_ptr<c10::Half>(), n, lv, bits, block_size, stochastic, keys, c, a);
  else
    quantize_blockwise_bits(x.const_data_ptr<c10::BFloat16>(), n, lv, bits, block_size, stochastic, keys, c, a);
  return {codes, absmax};
}

// ------------------------------------------------------------------ dequantize
template <typename T, int BITS>
void dequantize_blockwise_impl(const uint8_t* codes, const float* absmax, const float* lv, int64_t n,
                               int64_t block_size, T* out) {
  const int64_t nb = (n + block_size - 1) / block_size;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / block_size);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float fbuf[kMaxBlock];
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * block_size;
      const int64_t len = std::min(block_size, n - start);
      const uint8_t* packed = codes + start * BITS / 8;
      const float a = absmax[b];
      if (BITS == 8) {
        for (int64_t j = 0; j < len; ++j) fbuf[j] = lv[packed[j]] * a;
      } else {  // a byte at a time: its low nibble, then its high one
        for (int64_t b = 0; b < len / 2; ++b) {
          fbuf[2 * b] = lv[packed[b] & 0xF] * a;
          fbuf[2 * b + 1] = lv[packed[b] >> 4] * a;
        }
        if (len % 2) fbuf[len - 1] = lv[packed[len / 2] & 0xF] * a;
      }
      cpu::store_f32(fbuf, out + start, len);
    }
  });
}

template <typename T>
void dequantize_blockwise_bits(const uint8_t* c, const float* a, const float* lv, int bits, int64_t n, int64_t bs,
                               T* out) {
  if (bits == 4)
    dequantize_blockwise_impl<T, 4>(c, a, lv, n, bs, out);
  else
    dequantize_blockwise_impl<T, 8>(c, a, lv, n, bs, out);
}

// The sizes the shape, map and block size give, with validation.op_dequantize_blockwise's words.
void check_blockwise_sizes(int64_t n_codes, int64_t n_absmax, int64_t n, int bits, int64_t block_size,
                           at::IntArrayRef shape) {
  const char* fix = "pass the shape, qmap and block_size the tensor was quantized with";
  const int64_t per = 8 / bits;
  const int64_t need = n / per + (n % per != 0);
  TORCH_CHECK(n_codes == need, "slimfit::dequantize_blockwise: ", n_codes, " code bytes do not match the ", n,
              " elements of shape ", shape, " at ", bits, " bits (", need, " bytes); ", fix);
  const int64_t nb = n / block_size + (n % block_size != 0);
  TORCH_CHECK(n_absmax == nb, "slimfit::dequantize_blockwise: need ", nb, " block maxima for ", n,
              " elements (block_size ", block_size, "), got ", n_absmax, "; ", fix);
}

at::Tensor dequantize_blockwise_cpu(const at::Tensor& codes_in, const at::Tensor& absmax_in, const at::Tensor& qmap,
                                    int64_t block_size, c10::SymIntArrayRef sym_shape, at::ScalarType dtype) {
  const char* op = "dequantize_blockwise";
  TORCH_CHECK(codes_in.device().is_cpu() && absmax_in.device().is_cpu(), "slimfit::", op,
              " (CPU kernel): codes and absmax must be CPU tensors");
  TORCH_CHECK(codes_in.scalar_type() == at::kByte, "slimfit::", op, ": codes must be uint8, got ",
              codes_in.scalar_type());
  TORCH_CHECK(absmax_in.scalar_type() == at::kFloat, "slimfit::", op, ": absmax must be float32, got ",
              absmax_in.scalar_type());
  TORCH_CHECK(dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16 || dtype == at::kDouble,
              "slimfit::", op, ": unsupported output dtype ", dtype, "; use float32, float16, bfloat16 or float64");
  check_block_size(block_size, op);
  const int bits = check_qmap(qmap, codes_in.device(), op);
  const at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(sym_shape);
  const int64_t n = dequantize_sizes::shape_numel(shape);
  check_blockwise_sizes(codes_in.numel(), absmax_in.numel(), n, bits, block_size, shape);
  at::Tensor out = at::empty(shape, codes_in.options().dtype(dtype));
  if (n == 0) return out;
  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor absmax = absmax_in.contiguous();
  const at::Tensor q = qmap.contiguous();
  const uint8_t* c = codes.const_data_ptr<uint8_t>();
  const float* a = absmax.const_data_ptr<float>();
  const float* lv = q.const_data_ptr<float>();
  switch (dtype) {
    case at::kFloat: dequantize_blockwise_bits(c, a, lv, bits, n, block_size, out.data_ptr<float>()); break;
    case at::kHalf: dequantize_blockwise_bits(c, a, lv, bits, n, block_size, out.data_ptr<c10::Half>()); break;
    case at::kBFloat16:
      dequantize_blockwise_bits(c, a, lv, bits, n, block_size, out.data_ptr<c10::BFloat16>());
      break;
    default: dequantize_blockwise_bits(c, a, lv, bits, n, block_size, out.data_ptr<double>()); break;
  }
  return out;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) {
  m.impl("quantize_blockwise", &slimfit::quantize_blockwise_cpu);
  m.impl("dequantize_blockwise", &slimfit::dequantize_blockwise_cpu);
}
