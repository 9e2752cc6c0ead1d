// The size checks of slimfit::dequantize shared by the CPU and CUDA kernels (host code), run before any
// allocation: the shape's element count without int64 overflow, and the parts' sizes against it, with the
// words of slimfit/kernels/validation.py.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>

namespace slimfit {
namespace dequantize_sizes {

// Elements of a shape: negative dimensions are refused, and so is a product beyond int64 (which
// would wrap around to a small count that passes the size checks).
inline int64_t shape_numel(at::IntArrayRef shape) {
  int64_t n = 1;
  bool too_big = false, zero = false;
  for (const int64_t d : shape) {
    TORCH_CHECK(d >= 0, "slimfit::dequantize: negative dimension in shape ", shape);
    zero |= d == 0;
    too_big |= __builtin_mul_overflow(n, d, &n);
  }
  if (zero) return 0;  // no elements, however large the other dimensions
  TORCH_CHECK(!too_big, "slimfit::dequantize: shape ", shape, " has more elements than int64 holds; pass the shape "
              "the tensor was quantized with (QuantizedTensor.shape)");
  return n;
}

// The parts of a quantized tensor have exactly the sizes shape, bits and group_size give, as
// validation._op_quantized_sizes says (same words).
inline void check_quantized_sizes(int64_t n_codes, int64_t n_scale, int64_t n_offset, int64_t n, int64_t bits,
                           int64_t group_size, at::IntArrayRef shape) {
  const char* fix = "pass the shape, bits and group_size the tensor was quantized with "
                    "(QuantizedTensor.shape, .bits, .group_size)";
  const int64_t per = 8 / bits;
  const int64_t need = n / per + (n % per != 0);  // no overflow near INT64_MAX
  TORCH_CHECK(n_codes == need, "slimfit::dequantize: ", n_codes, " code bytes do not match the ", n,
              " elements of shape ", shape, " at ", bits, " bits (", need, " bytes); ", fix);
  const int64_t ng = n / group_size + (n % group_size != 0);
  TORCH_CHECK(n_scale == ng && n_offset == ng, "slimfit::dequantize: need ", ng, " groups of scale/offset for ", n,
              " elements (group_size ", group_size, "), got ", n_scale, " and ", n_offset, "; ", fix);
}

}  // namespace dequantize_sizes
}  // namespace slimfit
