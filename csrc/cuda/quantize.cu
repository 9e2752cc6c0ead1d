// CUDA kernels of slimfit::quantize and slimfit::dequantize.
//
// Bit-exact with slimfit/kernels/reference.py (the specification). Per group of
// `group_size` consecutive elements of the flattened input, in fp32:
//   mn, mx = min, max (NaN-propagating)      h = 0.5 for a wide group (finite, but mx - mn
//   scaled = (mx*h - mn*h) / (2**bits - 1)       overflows fp32), else 1 (then nothing changes)
//   scale = wide ? 2 * scaled : scaled
//   inv = 1 / (scaled >= 2**-126 ? scaled : 1) (one IEEE reciprocal per group, __frcp_rn)
//   q = (x*h - mn*h) * inv                   code = clamp(floor(q + u), 0, 2**bits - 1)
// with u = 0.5 (nearest) or the counter-based uniform of the element's flat index
// (stochastic, rng_cuda.cuh; a template parameter, so the nearest kernel holds no hash).
// Every step uses an explicitly rounded intrinsic
// (__fsub_rn, __fdiv_rn, __frcp_rn, __fadd_rn, __fmul_rn) so nothing is contracted into an FMA
// or replaced by an approximate division; setup.py also passes --fmad=false.
// dequantize: x = code * scale + offset in fp32 (two roundings), cast to the dtype; where that
// overflows with a finite scale and offset, the same value a quarter down, saturated at +-FLT_MAX.
//
// Layout of the work (memory-bound, so: wide loads, no shared memory, no atomics):
//   * a thread owns V consecutive elements of one group (32 bytes of input: V = 8 for fp32,
//     16 for 16-bit inputs, two 16-byte loads), and T = group_size / V
//     consecutive lanes of a warp own a group (T <= 32 divides 32, so a group never
//     straddles warps); min/max are reduced with __shfl_xor_sync inside those T lanes.
//   * the thread packs its V codes into V * bits / 8 bytes (2 to 16) and writes them with
//     one aligned store: groups, and each thread's share of a group, start on a byte
//     boundary because V * bits is a multiple of 8.
//   * the tail (numel not a multiple of group_size, or of V) goes through a scalar path:
//     elements past the end are excluded from min/max and their code bits stay zero, and
//     only the bytes of the packed output that exist are written.
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <cuda_runtime.h>

#include <cstdint>
#include <limits>

#include "../dequantize_sizes.h"
#include "quantize_kernels.cuh"
#include "rng_cuda.cuh"

namespace slimfit {
namespace cuda_impl {
namespace {

template <int Kind, int Group, int Bits>
void launch_quantize(const at::Tensor& x, int64_t n, int64_t ngroups, at::Tensor& codes, at::Tensor& scale,
                     at::Tensor& offset, bool stochastic, cuda_rng::Keys keys, cudaStream_t stream) {
  using S = typename Fmt<Kind>::S;
  using Shape = QuantShape<Kind, Group>;
  const S* xp = reinterpret_cast<const S*>(x.data_ptr());
  const bool vec_ok = reinterpret_cast<uintptr_t>(xp) % 16 == 0;
  const int64_t threads = ngroups * Shape::T;
  const int64_t blocks = (threads + kBlock - 1) / kBlock;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "slimfit::quantize: input too large (", n, " elements)");
  uint8_t* cp = codes.data_ptr<uint8_t>();
  float* sp = scale.data_ptr<float>();
  float* op = offset.data_ptr<float>();
  if (stochastic)
    quantize_kernel<Kind, Group, Bits, true><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
        xp, n, ngroups, cp, sp, op, keys, vec_ok);
  else
    quantize_kernel<Kind, Group, Bits, false><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
        xp, n, ngroups, cp, sp, op, keys, vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int Kind, int Group>
void dispatch_bits_q(int64_t bits, const at::Tensor& x, int64_t n, int64_t ngroups, at::Tensor& codes,
                     at::Tensor& scale, at::Tensor& offset, bool stochastic, cuda_rng::Keys keys,
                     cudaStream_t stream) {
  switch (bits) {
    case 2: return launch_quantize<Kind, Group, 2>(x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
    case 4: return launch_quantize<Kind, Group, 4>(x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
    default: return launch_quantize<Kind, Group, 8>(x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
  }
}

template <int Kind>
void dispatch_group_q(int64_t group_size, int64_t bits, const at::Tensor& x, int64_t n, int64_t ngroups,
                      at::Tensor& codes, at::Tensor& scale, at::Tensor& offset, bool stochastic,
                      cuda_rng::Keys keys, cudaStream_t stream) {
  switch (group_size) {
    case 32: return dispatch_bits_q<Kind, 32>(bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
    case 64: return dispatch_bits_q<Kind, 64>(bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
    case 128: return dispatch_bits_q<Kind, 128>(bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
    default: return dispatch_bits_q<Kind, 256>(bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
  }
}

void check_bits(int64_t bits, const char* op) {
  TORCH_CHECK(bits == 2 || bits == 4 || bits == 8, "slimfit::", op, ": bits must be 2, 4 or 8, got ", bits);
}

void check_group_size(int64_t group_size, const char* op) {
  TORCH_CHECK(group_size == 32 || group_size == 64 || group_size == 128 || group_size == 256, "slimfit::", op,
              ": group_size must be 32, 64, 128 or 256, got ", group_size);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> quantize_cuda(const at::Tensor& x_in, int64_t bits,
                                                             int64_t group_size, bool stochastic, int64_t seed) {
  check_bits(bits, "quantize");
  check_group_size(group_size, "quantize");
  TORCH_CHECK(x_in.is_cuda(), "slimfit::quantize (CUDA): expected a CUDA tensor, got ", x_in.device());
  const c10::cuda::CUDAGuard guard(x_in.device());

  // The same dtypes as every other backend (the op's contract): fp32, fp16, bf16.
  const auto st = x_in.scalar_type();
  TORCH_CHECK(st == at::kFloat || st == at::kHalf || st == at::kBFloat16,
              "slimfit::quantize: unsupported dtype ", st, "; use float32, float16 or bfloat16");
  at::Tensor x = x_in.contiguous();

  const int64_t n = x.numel();
  const int64_t ngroups = (n + group_size - 1) / group_size;
  const int64_t per_byte = 8 / bits;
  const auto opts = x.options();
  at::Tensor codes = at::empty({(n + per_byte - 1) / per_byte}, opts.dtype(at::kByte));
  at::Tensor scale = at::empty({ngroups}, opts.dtype(at::kFloat));
  at::Tensor offset = at::empty({ngroups}, opts.dtype(at::kFloat));
  if (n == 0) return {codes, scale, offset};

  const cuda_rng::Keys keys = cuda_rng::seed_keys(seed);
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(x.device().index()).stream();
  switch (x.scalar_type()) {
    case at::kFloat:
      dispatch_group_q<0>(group_size, bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
      break;
    case at::kHalf:
      dispatch_group_q<1>(group_size, bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
      break;
    default:
      dispatch_group_q<2>(group_size, bits, x, n, ngroups, codes, scale, offset, stochastic, keys, stream);
      break;
  }
  return {codes, scale, offset};
}

template <int Kind, int Bits>
void launch_dequantize(const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset, at::Tensor& out,
                       int64_t n, int group_shift, cudaStream_t stream) {
  using S = typename Fmt<Kind>::S;
  constexpr int V = 16 / static_cast<int>(sizeof(S));
  const uint8_t* cp = codes.data_ptr<uint8_t>();
  S* op = reinterpret_cast<S*>(out.data_ptr());
  const bool vec_ok = reinterpret_cast<uintptr_t>(cp) % 8 == 0 && reinterpret_cast<uintptr_t>(op) % 16 == 0;
  const int64_t threads = (n + V - 1) / V;
  const int64_t blocks = (threads + kBlock - 1) / kBlock;
  TORCH_CHECK(blocks <= std::numeric_limits<int32_t>::max(), "slimfit::dequantize: output too large (", n,
              " elements)");
  dequantize_kernel<Kind, Bits><<<static_cast<unsigned>(blocks), kBlock, 0, stream>>>(
      cp, scale.data_ptr<float>(), offset.data_ptr<float>(), op, n, group_shift, vec_ok);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <int Kind>
void dispatch_bits_dq(int64_t bits, const at::Tensor& codes, const at::Tensor& scale, const at::Tensor& offset,
                      at::Tensor& out, int64_t n, int group_shift, cudaStream_t stream) {
  switch (bits) {
    case 2: return launch_dequantize<Kind, 2>(codes, scale, offset, out, n, group_shift, stream);
    case 4: return launch_dequantize<Kind, 4>(codes, scale, offset, out, n, group_shift, stream);
    default: return launch_dequantize<Kind, 8>(codes, scale, offset, out, n, group_shift, stream);
  }
}

using dequantize_sizes::check_quantized_sizes;
using dequantize_sizes::shape_numel;

at::Tensor dequantize_cuda(const at::Tensor& codes_in, const at::Tensor& scale_in, const at::Tensor& offset_in,
                           int64_t bits, int64_t group_size, c10::SymIntArrayRef sym_shape, at::ScalarType dtype) {
  check_bits(bits, "dequantize");
  check_group_size(group_size, "dequantize");
  TORCH_CHECK(codes_in.is_cuda(), "slimfit::dequantize (CUDA): expected CUDA codes, got ", codes_in.device());
  TORCH_CHECK(codes_in.scalar_type() == at::kByte, "slimfit::dequantize: codes must be uint8, got ",
              codes_in.scalar_type());
  TORCH_CHECK(scale_in.device() == codes_in.device() && offset_in.device() == codes_in.device(),
              "slimfit::dequantize: codes, scale and offset must be on one device, got ", codes_in.device(), ", ",
              scale_in.device(), " and ", offset_in.device());
  // fp32 scale/offset, as quantize makes them (the CPU kernel asks the same).
  TORCH_CHECK(scale_in.scalar_type() == at::kFloat && offset_in.scalar_type() == at::kFloat,
              "slimfit::dequantize: scale and offset must be float32, got ", scale_in.scalar_type(), " and ",
              offset_in.scalar_type());
  const c10::cuda::CUDAGuard guard(codes_in.device());

  const at::IntArrayRef shape = C10_AS_INTARRAYREF_SLOW(sym_shape);
  const int64_t n = shape_numel(shape);
  // The sizes before the allocation (validation.op_dequantize): a wrong shape must not first try
  // to allocate its elements.
  check_quantized_sizes(codes_in.numel(), scale_in.numel(), offset_in.numel(), n, bits, group_size, shape);
  // fp32/fp16/bf16 are written directly; any other dtype is computed in fp32 and cast,
  // which is what the reference does (`.to(dtype)` of the fp32 result).
  const bool direct = dtype == at::kFloat || dtype == at::kHalf || dtype == at::kBFloat16;
  at::Tensor out = at::empty(shape, codes_in.options().dtype(direct ? dtype : at::kFloat));
  if (n == 0) return direct ? out : out.to(dtype);

  const at::Tensor codes = codes_in.contiguous();
  const at::Tensor scale = scale_in.contiguous();
  const at::Tensor offset = offset_in.contiguous();
  int group_shift = 0;
  while ((int64_t{1} << group_shift) < group_size) ++group_shift;

  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(codes.device().index()).stream();
  switch (out.scalar_type()) {
    case at::kFloat: dispatch_bits_dq<0>(bits, codes, scale, offset, out, n, group_shift, stream); break;
    case at::kHalf: dispatch_bits_dq<1>(bits, codes, scale, offset, out, n, group_shift, stream); break;
    default: dispatch_bits_dq<2>(bits, codes, scale, offset, out, n, group_shift, stream); break;
  }
  return direct ? out : out.to(dtype);
}

}  // namespace
}  // namespace cuda_impl
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CUDA, m) {
  m.impl("quantize", &slimfit::cuda_impl::quantize_cuda);
  m.impl("dequantize", &slimfit::cuda_impl::dequantize_cuda);
}
