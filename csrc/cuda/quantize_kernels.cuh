// Device code of slimfit::quantize / slimfit::dequantize (the host side, checks, launches
// and registration are in quantize.cu). See quantize.cu for the algorithm and the layout.
//
// This header needs only CUDA and rng_cuda.cuh (no torch), so the same kernels can be
// compiled for a CPU-side emulation when checking their logic without a GPU.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#endif

#include "rng_cuda.cuh"

namespace slimfit {
namespace cuda_impl {

constexpr int kBlock = 256;  // threads per block of every kernel here
// Full occupancy on sm_80/sm_90 (2048 threads per SM) asks for <= 32 registers per thread.
constexpr int kMinBlocksPerSM = 2048 / kBlock;

// bench/kernels_static.py compiles the kernels a second time with this defined, to count the
// instructions of the steady state (every vector full and aligned); never defined in a build.
#ifdef SLIMFIT_STATIC_COUNT_FULL_VECTORS
#define SLIMFIT_FULL_VECTORS(cond) true
#else
#define SLIMFIT_FULL_VECTORS(cond) (cond)
#endif
constexpr unsigned kFullMask = 0xffffffffu;
constexpr float kFp32Max = 3.40282346638528859812e+38f;  // the largest finite fp32

// ------------------------------------------------------------------ element formats
// Kind 0 = fp32, 1 = fp16, 2 = bf16. Storage is raw bits for the 16-bit formats so that
// the conversions are explicit (torch builds with __CUDA_NO_HALF_CONVERSIONS__ etc.).
template <int Kind>
struct Fmt;

template <>
struct Fmt<0> {
  using S = float;
  static __device__ __forceinline__ float to_float(S v) { return v; }
  static __device__ __forceinline__ S from_float(float v) { return v; }
};

template <>
struct Fmt<1> {
  using S = uint16_t;
  // fp16 -> fp32 is exact.
  static __device__ __forceinline__ float to_float(S v) { return __half2float(__ushort_as_half(v)); }
  // One half of a little-endian word (element 2i in the low half), as fp32.
  static __device__ __forceinline__ float word_half(uint32_t w, int high) {
    return __half2float(__ushort_as_half(static_cast<uint16_t>(high ? w >> 16 : w)));
  }
  // Round to nearest even, as torch's CPU conversion; NaN -> sign | 0x7E00 like c10::Half.
  static __device__ __forceinline__ S from_float(float v) {
    if (v != v) return static_cast<S>(((__float_as_uint(v) >> 16) & 0x8000u) | 0x7E00u);
    return __half_as_ushort(__float2half_rn(v));
  }
};

template <>
struct Fmt<2> {
  using S = uint16_t;
  // bf16 -> fp32 is exact: the 16 bits become the high half of the fp32 word.
  static __device__ __forceinline__ float to_float(S v) { return __uint_as_float(static_cast<uint32_t>(v) << 16); }
  // One half of a little-endian word (element 2i in the low half), as fp32: a shift or a mask.
  static __device__ __forceinline__ float word_half(uint32_t w, int high) {
    return __uint_as_float(high ? (w & 0xFFFF0000u) : (w << 16));
  }
  // Round to nearest even on the bits, as c10::BFloat16 does (NaN -> 0x7FC0).
  static __device__ __forceinline__ S from_float(float v) {
    if (v != v) return static_cast<S>(0x7FC0u);
    const uint32_t u = __float_as_uint(v);
    return static_cast<S>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
  }
};

// NaN-propagating min / max (torch.amin / amax propagate NaN). sm_80+ has it in one
// instruction; the fallback keeps the same semantics for older archs.
__device__ __forceinline__ float nan_min(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("min.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fminf(a, b);
#endif
}

__device__ __forceinline__ float nan_max(float a, float b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(a), "f"(b));
  return r;
#else
  return (a != a || b != b) ? __int_as_float(0x7fffffff) : fmaxf(a, b);
#endif
}

// Store / load of `Bytes` (1, 2, 4 or 8) little-endian bytes at a `Bytes`-aligned address.
template <int Bytes>
__device__ __forceinline__ void store_bytes(uint8_t* p, uint64_t v) {
  if constexpr (Bytes == 1) {
    *p = static_cast<uint8_t>(v);
  } else if constexpr (Bytes == 2) {
    *reinterpret_cast<uint16_t*>(p) = static_cast<uint16_t>(v);
  } else if constexpr (Bytes == 4) {
    *reinterpret_cast<uint32_t*>(p) = static_cast<uint32_t>(v);
  } else {
    static_assert(Bytes == 8, "1, 2, 4 or 8 bytes");
    *reinterpret_cast<uint64_t*>(p) = v;
  }
}

template <int Bytes>
__device__ __forceinline__ uint64_t load_bytes(const uint8_t* p) {
  if constexpr (Bytes == 1) {
    return *p;
  } else if constexpr (Bytes == 2) {
    return *reinterpret_cast<const uint16_t*>(p);
  } else if constexpr (Bytes == 4) {
    return *reinterpret_cast<const uint32_t*>(p);
  } else {
    static_assert(Bytes == 8, "1, 2, 4 or 8 bytes");
    return *reinterpret_cast<const uint64_t*>(p);
  }
}

// ------------------------------------------------------------------ quantize
template <int Kind, int Group>
struct QuantShape {
  using S = typename Fmt<Kind>::S;
  static constexpr int kVecElems = 16 / static_cast<int>(sizeof(S));  // one 16-byte load
  // 32 bytes of input per thread (two 16-byte loads: 8 fp32 or 16 fp16/bf16 elements): the
  // per-thread work (index math, shuffles, scale and reciprocal) is shared by 8 or 16 elements,
  // the codes fill whole bytes at every bit width, and the registers stay within full occupancy.
  static constexpr int V = 32 / static_cast<int>(sizeof(S));  // elements per thread
  static constexpr int T = Group / V;                                          // threads per group
  static constexpr int kLoads = V / kVecElems;                                 // 16-byte loads per thread
  static_assert(T >= 1 && T <= 32 && (32 % T) == 0, "a group must sit inside one warp");
  static_assert(V % kVecElems == 0, "whole 16-byte loads");
};

template <int Kind, int Group, int Bits, bool Stochastic>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSM)
    quantize_kernel(const typename Fmt<Kind>::S* __restrict__ x, int64_t n, int64_t ngroups,
                    uint8_t* __restrict__ codes, float* __restrict__ scale_out, float* __restrict__ offset_out,
                    cuda_rng::Keys keys, bool vec_ok) {
  using F = Fmt<Kind>;
  using S = typename F::S;
  using Shape = QuantShape<Kind, Group>;
  constexpr int V = Shape::V;
  constexpr int T = Shape::T;
  constexpr int kBytes = V * Bits / 8;
  constexpr int kLevels = (1 << Bits) - 1;
  static_assert((V * Bits) % 8 == 0, "a thread's codes fill whole bytes");

  const int64_t tid = static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x;
  const int64_t g = tid / T;
  const int lane = static_cast<int>(tid % T);
  const int64_t e0 = g * Group + static_cast<int64_t>(lane) * V;  // first element of this thread
  // Threads past the last group stay alive until the shuffles are done (full-warp masks).
  const int64_t left = (g < ngroups) ? n - e0 : 0;
  const int valid = SLIMFIT_FULL_VECTORS(false) ? V : left <= 0 ? 0 : (left >= V ? V : static_cast<int>(left));

  // The input stays in its storage format in registers (32-bit words: one fp32 or two 16-bit
  // values each) and is converted where used: 16 fp16/bf16 elements then fit the 32 registers of
  // full occupancy without spilling (a conversion is one instruction, cheaper than a spill).
  constexpr int kPerWord = static_cast<int>(sizeof(uint32_t) / sizeof(S));
  uint32_t raw[V / kPerWord];
  if (valid == V && SLIMFIT_FULL_VECTORS(vec_ok)) {
    const uint4* src = reinterpret_cast<const uint4*>(x + e0);
#pragma unroll
    for (int w = 0; w < Shape::kLoads; ++w) {
      const uint4 q4 = __ldg(src + w);
      raw[4 * w] = q4.x;
      raw[4 * w + 1] = q4.y;
      raw[4 * w + 2] = q4.z;
      raw[4 * w + 3] = q4.w;
    }
  } else {
#pragma unroll
    for (int w = 0; w < V / kPerWord; ++w) raw[w] = 0u;
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j < valid) {
        S bits = x[e0 + j];
        uint32_t u;
        if constexpr (kPerWord == 1) {
          memcpy(&u, &bits, sizeof(u));
        } else {
          u = static_cast<uint32_t>(bits) << (16 * (j % 2));
        }
        raw[j / kPerWord] |= u;
      }
    }
  }
  // element j as fp32
  auto elem = [&](int j) -> float {
    if constexpr (kPerWord == 1) {
      return __uint_as_float(raw[j]);
    } else {
      return F::word_half(raw[j / 2], j % 2);
    }
  };

  // Identities for elements past the end: they never win (a group always holds at least
  // one real element, which then decides).
  float mn = __int_as_float(0x7f800000);
  float mx = -__int_as_float(0x7f800000);
#pragma unroll
  for (int j = 0; j < V; ++j) {
    if (j < valid) {
      mn = nan_min(mn, elem(j));
      mx = nan_max(mx, elem(j));
    }
  }
#pragma unroll
  for (int off = T / 2; off > 0; off >>= 1) {
    mn = nan_min(mn, __shfl_xor_sync(kFullMask, mn, off));
    mx = nan_max(mx, __shfl_xor_sync(kFullMask, mx, off));
  }
  if (valid == 0) return;  // past the end: nothing to write (no shuffle follows)

  // A wide group (finite, but mx - mn overflows fp32: +-3e38) runs at half scale, exactly; for
  // every other group h = 1 and these are (mx - mn) / L and (x - mn) * inv (reference.py).
  const bool wide = __fsub_rn(mx, mn) > kFp32Max && mx <= kFp32Max && mn >= -kFp32Max;
  const float h = wide ? 0.5f : 1.0f;
  const float scaled = __fdiv_rn(__fsub_rn(__fmul_rn(mx, h), __fmul_rn(mn, h)), static_cast<float>(kLevels));
  const float scale = wide ? __fmul_rn(scaled, 2.0f) : scaled;
  const float mnh = __fmul_rn(mn, h);
  // One reciprocal per group (NaN >= x is false, as in torch.where); below the smallest
  // normal fp32 it would overflow: a constant group.
  const float inv = __frcp_rn(scaled >= 1.17549435082228750797e-38f ? scaled : 1.0f);
  // A thread's V elements lie in one group, which never straddles a multiple of 2**32: the
  // high half of the index is folded into the seed key once (the hash then runs on 32 bits).
  const uint32_t lo0 = static_cast<uint32_t>(static_cast<uint64_t>(e0));
  const uint32_t hk1 = static_cast<uint32_t>(static_cast<uint64_t>(e0) >> 32) ^ keys.k1;
  (void)lo0;
  (void)hk1;
  if (lane == 0) {
    scale_out[g] = scale;
    offset_out[g] = mn;
  }

  static_assert(V * Bits <= 128, "a thread's codes fit four 32-bit words");
  uint32_t words[4] = {0u, 0u, 0u, 0u};
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const float q = __fmul_rn(__fsub_rn(__fmul_rn(elem(j), h), mnh), inv);
    float u = 0.5f;
    if constexpr (Stochastic) u = cuda_rng::word_to_uniform(rng::word_hk(lo0 + j, keys.k0, hk1));
    // clamp(floor(t), 0, levels) == trunc(clamp(t, 0, levels)): truncation is floor for t >= 0,
    // and fmaxf turns a NaN (non-finite group only) into 0 instead of undefined.
    const float c = fminf(fmaxf(__fadd_rn(q, u), 0.0f), static_cast<float>(kLevels));
    const uint32_t code = (j < valid) ? static_cast<uint32_t>(c) : 0u;
    words[(j * Bits) / 32] |= code << ((j * Bits) % 32);
  }
  uint8_t* dst = codes + e0 * Bits / 8;
  if (valid == V) {
    if constexpr (kBytes == 16) {
      *reinterpret_cast<uint4*>(dst) = make_uint4(words[0], words[1], words[2], words[3]);
    } else {
      store_bytes<kBytes>(dst, (static_cast<uint64_t>(words[1]) << 32) | words[0]);
    }
  } else {
    const int nbytes = (valid * Bits + 7) / 8;  // the packed tensor ends after these
    for (int b = 0; b < nbytes; ++b) dst[b] = static_cast<uint8_t>(words[b / 4] >> (8 * (b % 4)));
  }
}

// ------------------------------------------------------------------ dequantize
// code * s + o in fp32 (two roundings). Where that overflows although s and o are finite (a wide
// group's upper codes), the same value a quarter down (exact scalings), saturated at the largest
// fp32, as reference.dequantize.
__device__ __forceinline__ float dequant_value(float code, float s, float o, bool finite_so) {
  float y = __fadd_rn(__fmul_rn(code, s), o);
  if (finite_so && fabsf(y) > kFp32Max) {
    y = __fmul_rn(__fadd_rn(__fmul_rn(code, __fmul_rn(s, 0.25f)), __fmul_rn(o, 0.25f)), 4.0f);
    y = fminf(fmaxf(y, -kFp32Max), kFp32Max);
  }
  return y;
}

// A thread writes V = 16 / sizeof(out) consecutive elements (one 16-byte store); V
// divides every group size, so they share one group's scale and offset.
template <int Kind, int Bits>
__global__ void __launch_bounds__(kBlock, kMinBlocksPerSM)
    dequantize_kernel(const uint8_t* __restrict__ codes, const float* __restrict__ scale,
                      const float* __restrict__ offset, typename Fmt<Kind>::S* __restrict__ out, int64_t n,
                      int group_shift, bool vec_ok) {
  using F = Fmt<Kind>;
  using S = typename F::S;
  constexpr int V = 16 / static_cast<int>(sizeof(S));
  constexpr int kBytes = V * Bits / 8;
  constexpr uint32_t kMask = (1u << Bits) - 1u;

  const int64_t e0 = (static_cast<int64_t>(blockIdx.x) * kBlock + threadIdx.x) * V;
  if (e0 >= n) return;
  const int64_t left = n - e0;
  const int valid = SLIMFIT_FULL_VECTORS(false) ? V : left >= V ? V : static_cast<int>(left);
  const int64_t g = e0 >> group_shift;
  const float s = __ldg(scale + g);
  const float o = __ldg(offset + g);
  const bool finite_so = fabsf(s) <= kFp32Max && fabsf(o) <= kFp32Max;

  const uint8_t* src = codes + e0 * Bits / 8;
  uint64_t packed = 0;
  if (valid == V && SLIMFIT_FULL_VECTORS(vec_ok)) {
    packed = load_bytes<kBytes>(src);
  } else {
    const int nbytes = (valid * Bits + 7) / 8;
    for (int b = 0; b < nbytes; ++b) packed |= static_cast<uint64_t>(src[b]) << (8 * b);
  }

  alignas(16) S res[V];
#pragma unroll
  for (int j = 0; j < V; ++j) {
    const uint32_t code = static_cast<uint32_t>(packed >> (j * Bits)) & kMask;
    res[j] = F::from_float(dequant_value(static_cast<float>(code), s, o, finite_so));
  }
  S* dst = out + e0;
  if (valid == V && SLIMFIT_FULL_VECTORS(vec_ok)) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(res);
  } else {
#pragma unroll
    for (int j = 0; j < V; ++j) {
      if (j < valid) dst[j] = res[j];
    }
  }
}

}  // namespace cuda_impl
}  // namespace slimfit
