// CPU kernel of slimfit::adam_blockwise_: one Adam/AdamW step of pieces whose moments are held as 8- or 4-bit
// block-wise dynamic codes, decoded, stepped and encoded again in one pass over each block.
//
// Bit-exact with slimfit/kernels/reference_adam.py (the specification; its docstring states the formulas):
// fp32 throughout, every operation rounded on its own (setup.py compiles with -ffp-contract=off), the
// scalars rounded to fp32 once. One parallel task handles whole blocks of a piece: the block's weights,
// gradients and decoded moments sit in stack buffers, the weight is written, and the new moments are coded
// with the block's new absmax (blockwise_codes.h: the steps slimfit::quantize_blockwise takes). With a score
// kind, a scored piece's blocks also get the sums of the scheduler's score of the move (the reference's
// block_score_sums: the terms of the weight as loaded and as stored, summed by halving).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>

#include "../rng.h"
#include "blockwise_codes.h"
#include "convert.h"
#include "round_bits.h"
#include "uniform_span.h"

namespace slimfit {
namespace {

constexpr int64_t kMaxBlock = 4096;
constexpr int64_t kGrainElements = 32768;  // elements per parallel task (as quantize_blockwise.cpp)
constexpr int kMaxLevels = 256;  // 8-bit codes; 4-bit codes have 16 levels, two to a byte (low nibble first)
enum Score : int64_t { kNone = 0, kRelative = 1, kRobust = 2, kAbsolute = 3 };

// The scalars of one call (fp32, as the reference rounds them) and one piece's.
struct Hyper {
  float b1c, b2, b2c, eps, wd;
  bool decoupled, stochastic, round_weights;
  int64_t block_size, score;
};

struct Piece {
  float step_size, decay, bc2_sqrt;
  rng::SeedKeys km, kv, kw;
  int64_t offset;  // the piece's first element in its whole parameter: the random streams' index
  float* sums;     // the piece's (3, blocks) score sums, or nullptr: not scored
};

// t[0, bs) summed by halving (t[len, bs) set to 0 first): the second half added to the first until one value is
// left, the reference's order. Overwrites t.
float halving_sum(float* t, int64_t len, int64_t bs) {
  for (int64_t j = len; j < bs; ++j) t[j] = 0.0f;
  for (int64_t h = bs / 2; h >= 1; h /= 2) {
    for (int64_t k = 0; k < h; ++k) t[k] = t[k] + t[k + h];
  }
  return t[0];
}

// Block b's score sums from its weights as loaded (w0) and as stored (w1, overwritten as scratch), into
// sums[r * nb + b] for the rows r of the kind (reference_adam.block_score_sums).
void score_block(int64_t kind, const float* w0, float* w1, float* t, int64_t len, int64_t bs, float* sums,
                 int64_t nb, int64_t b) {
  float r0 = 0.0f, r1 = 0.0f, r2 = 0.0f;
  for (int64_t j = 0; j < len; ++j) w1[j] = w1[j] - w0[j];  // d
  if (kind == kRelative) {
    for (int64_t j = 0; j < len; ++j) {
      const float k = w0[j] != 0.0f ? 1.0f : 0.0f;
      t[j] = (std::fabs(w1[j]) * k) / (std::fabs(w0[j]) + (1.0f - k));
    }
    r0 = halving_sum(t, len, bs);
    for (int64_t j = 0; j < len; ++j) t[j] = w0[j] != 0.0f ? 1.0f : 0.0f;
    r1 = halving_sum(t, len, bs);
    for (int64_t j = 0; j < len; ++j) t[j] = std::fabs(w1[j]);
    r2 = halving_sum(t, len, bs);
  } else if (kind == kRobust) {
    for (int64_t j = 0; j < len; ++j) t[j] = w1[j] * w1[j];
    r0 = halving_sum(t, len, bs);
    for (int64_t j = 0; j < len; ++j) t[j] = w0[j] * w0[j];
    r1 = halving_sum(t, len, bs);
  } else {
    for (int64_t j = 0; j < len; ++j) t[j] = std::fabs(w1[j]);
    r0 = halving_sum(t, len, bs);
    for (int64_t j = 0; j < len; ++j) t[j] = 1.0f;
    r1 = halving_sum(t, len, bs);
  }
  sums[b] = r0;
  sums[nb + b] = r1;
  sums[2 * nb + b] = r2;
}

// u[j] = the uniform of index idx0 + j (any idx0: spans cut where the high half of the index changes).
void uniforms(int64_t idx0, int64_t len, rng::SeedKeys k, float* u) {
  cpu::for_each_segment(idx0, idx0 + len, k.k1, [&](int64_t i0, int64_t i1, uint32_t lo0, uint32_t hk1) {
    cpu::uniform_span(lo0, k.k0, hk1, i1 - i0, u + (i0 - idx0));
  });
}

void words(int64_t idx0, int64_t len, rng::SeedKeys k, uint32_t* w) {
  cpu::for_each_segment(idx0, idx0 + len, k.k1, [&](int64_t i0, int64_t i1, uint32_t lo0, uint32_t hk1) {
    cpu::word_span(lo0, k.k0, hk1, i1 - i0, w + (i0 - idx0));
  });
}

// The codes and absmax of x[0, len) (the block's new moment), as slimfit::quantize_blockwise codes a block:
// `codes` is the block's first byte; 4-bit codes go through `cbuf` and are packed two to a byte.
template <int BITS>
void encode_block(const cpu::MapTables<(1 << BITS)>& m, const float* x, int64_t len, bool stochastic, int64_t idx0,
                  rng::SeedKeys k, float* noise, uint8_t* cbuf, uint8_t* codes, float* absmax) {
  constexpr int L = 1 << BITS;
  const float a = cpu::block_absmax(x, len);
  const float inv = a >= std::numeric_limits<float>::min() ? 1.0f / a : 0.0f;
  *absmax = a;
  uint8_t* out = BITS == 8 ? codes : cbuf;
  if (stochastic) {
    uniforms(idx0, len, k, noise);
    cpu::stochastic_span<L>(m.lv, m.g, x, noise, inv, len, out);
  } else {
    cpu::code_span<L>(m.mid, x, inv, len, out);
  }
  if (BITS != 8) cpu::pack_block<BITS>(cbuf, len, codes);
}

// The level index of element j of a block whose codes start at byte `codes`.
template <int BITS>
inline int code_at(const uint8_t* codes, int64_t j) {
  if (BITS == 8) return codes[j];
  return (codes[j >> 1] >> ((j & 1) * 4)) & 0xF;
}

template <typename T>
void store_weights(const float* w, int64_t len, const Hyper& h, const Piece& pc, int64_t idx0, float* noise,
                   uint32_t* wbits, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    cpu::store_f32(w, out, len);
  } else {
    if (!h.round_weights) {
      cpu::store_f32(w, out, len);
    } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
      words(idx0, len, pc.kw, wbits);
      for (int64_t j = 0; j < len; ++j) out[j].x = cpu::bf16_of(w[j], wbits[j]);
    } else {
      uniforms(idx0, len, pc.kw, noise);
      for (int64_t j = 0; j < len; ++j) out[j].x = cpu::fp16_of(w[j], noise[j]);
    }
  }
}

template <int BITS, typename T, typename G>
void step_piece(T* p, const G* g, uint8_t* mc, float* ma, uint8_t* vc, float* va, int64_t n,
                const cpu::MapTables<(1 << BITS)>& tm, const cpu::MapTables<(1 << BITS)>& tv, const Hyper& h,
                const Piece& pc) {
  const int64_t bs = h.block_size;
  const int64_t nb = (n + bs - 1) / bs;
  const int64_t grain = std::max<int64_t>(1, kGrainElements / bs);
  at::parallel_for(0, nb, grain, [&](int64_t b0, int64_t b1) {
    alignas(64) float w[kMaxBlock];
    alignas(64) float gr[kMaxBlock];
    alignas(64) float m[kMaxBlock];
    alignas(64) float v[kMaxBlock];
    alignas(64) float noise[kMaxBlock];
    alignas(64) uint32_t wbits[kMaxBlock];
    alignas(64) float w0[kMaxBlock];
    alignas(64) uint8_t cbuf[kMaxBlock];
    const bool scored = pc.sums != nullptr;
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t start = b * bs;
      const int64_t len = std::min(bs, n - start);
      cpu::load_f32(p + start, w, len);
      cpu::load_f32(g + start, gr, len);
      if (scored) std::copy(w, w + len, w0);
      const float am = ma[b], av = va[b];
      uint8_t* mcb = mc + start * BITS / 8;  // the block's first code byte (blocks start on a byte)
      uint8_t* vcb = vc + start * BITS / 8;
      for (int64_t j = 0; j < len; ++j) {
        m[j] = tm.lv[code_at<BITS>(mcb, j)] * am;
        const float s = tv.lv[code_at<BITS>(vcb, j)] * av;
        v[j] = s * s;
      }
      if (h.wd != 0.0f) {
        if (h.decoupled) {
          for (int64_t j = 0; j < len; ++j) w[j] = w[j] * pc.decay;
        } else {
          for (int64_t j = 0; j < len; ++j) gr[j] = gr[j] + w[j] * h.wd;
        }
      }
      for (int64_t j = 0; j < len; ++j) {
        const float gj = gr[j];
        m[j] = m[j] + (gj - m[j]) * h.b1c;
        v[j] = v[j] * h.b2 + (gj * gj) * h.b2c;
        const float denom = std::sqrt(v[j]) / pc.bc2_sqrt + h.eps;
        w[j] = w[j] - pc.step_size * (m[j] / denom);
      }
      const int64_t idx0 = pc.offset + start;
      store_weights<T>(w, len, h, pc, idx0, noise, wbits, p + start);
      if (scored) {
        cpu::load_f32(p + start, w, len);  // the weight as stored (its rounding included)
        score_block(h.score, w0, w, noise, len, bs, pc.sums, nb, b);
      }
      encode_block<BITS>(tm, m, len, h.stochastic, idx0, pc.km, noise, cbuf, mcb, ma + b);
      for (int64_t j = 0; j < len; ++j) v[j] = std::sqrt(v[j] < 0.0f ? 0.0f : v[j]);  // NaN stays NaN
      encode_block<BITS>(tv, v, len, h.stochastic, idx0, pc.kv, noise, cbuf, vcb, va + b);
    }
  });
}

template <int BITS, typename T>
void step_piece_grad(const at::Tensor& p, const at::Tensor& g, uint8_t* mc, float* ma, uint8_t* vc, float* va,
                     const cpu::MapTables<(1 << BITS)>& tm, const cpu::MapTables<(1 << BITS)>& tv, const Hyper& h,
                     const Piece& pc) {
  T* pp = reinterpret_cast<T*>(p.data_ptr());
  const int64_t n = p.numel();
  switch (g.scalar_type()) {
    case at::kFloat:
      step_piece<BITS, T, float>(pp, g.const_data_ptr<float>(), mc, ma, vc, va, n, tm, tv, h, pc);
      break;
    case at::kHalf:
      step_piece<BITS, T, c10::Half>(pp, g.const_data_ptr<c10::Half>(), mc, ma, vc, va, n, tm, tv, h, pc);
      break;
    default:
      step_piece<BITS, T, c10::BFloat16>(pp, g.const_data_ptr<c10::BFloat16>(), mc, ma, vc, va, n, tm, tv, h, pc);
      break;
  }
}

bool is_float(at::ScalarType t) { return t == at::kFloat || t == at::kHalf || t == at::kBFloat16; }

void check_map(const at::Tensor& qmap, const char* name, int64_t levels) {
  TORCH_CHECK(qmap.device().is_cpu() && qmap.scalar_type() == at::kFloat && qmap.dim() == 1 &&
                  qmap.numel() == levels && (levels == 16 || levels == kMaxLevels),
              "slimfit::adam_blockwise_: ", name, " must be a 1-D float32 CPU tensor of 16 or 256 levels (4- or "
              "8-bit codes), the same for both moments; got ", qmap.scalar_type(), " of shape ", qmap.sizes(),
              " on ", qmap.device());
  const at::Tensor q = qmap.contiguous();
  const float* lv = q.const_data_ptr<float>();
  bool ok = std::isfinite(lv[0]);
  for (int64_t i = 1; i < levels; ++i) ok = ok && std::isfinite(lv[i]) && lv[i] > lv[i - 1];
  TORCH_CHECK(ok, "slimfit::adam_blockwise_: ", name, " must be finite and strictly increasing (a sorted map)");
}

// Every non-empty piece of a checked call stepped with the maps' tables (BITS: the code width).
template <int BITS>
void step_all(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_absmax,
              at::TensorList v_codes, at::TensorList v_absmax, const at::Tensor& qmap_m, const at::Tensor& qmap_v,
              at::ArrayRef<double> step_sizes, at::ArrayRef<double> decays, at::ArrayRef<double> bc2_sqrts,
              at::IntArrayRef seeds, at::IntArrayRef offsets, at::TensorList score_sums, const Hyper& h) {
  constexpr int L = 1 << BITS;
  cpu::MapTables<L> tm, tv;
  cpu::fill_tables<L>(qmap_m.contiguous().const_data_ptr<float>(), tm);
  cpu::fill_tables<L>(qmap_v.contiguous().const_data_ptr<float>(), tv);
  for (size_t j = 0; j < params.size(); ++j) {
    const at::Tensor& p = params[j];
    if (p.numel() == 0) continue;
    Piece pc;
    pc.step_size = static_cast<float>(step_sizes[j]);
    pc.decay = static_cast<float>(decays[j]);
    pc.bc2_sqrt = static_cast<float>(bc2_sqrts[j]);
    pc.km = rng::seed_keys(seeds[3 * j]);
    pc.kv = rng::seed_keys(seeds[3 * j + 1]);
    pc.kw = rng::seed_keys(seeds[3 * j + 2]);
    pc.offset = offsets[j];
    pc.sums = h.score != kNone && score_sums[j].numel() != 0 ? score_sums[j].data_ptr<float>() : nullptr;
    uint8_t* mc = m_codes[j].data_ptr<uint8_t>();
    uint8_t* vc = v_codes[j].data_ptr<uint8_t>();
    float* ma = m_absmax[j].data_ptr<float>();
    float* va = v_absmax[j].data_ptr<float>();
    switch (p.scalar_type()) {
      case at::kFloat: step_piece_grad<BITS, float>(p, grads[j], mc, ma, vc, va, tm, tv, h, pc); break;
      case at::kHalf: step_piece_grad<BITS, c10::Half>(p, grads[j], mc, ma, vc, va, tm, tv, h, pc); break;
      default: step_piece_grad<BITS, c10::BFloat16>(p, grads[j], mc, ma, vc, va, tm, tv, h, pc); break;
    }
  }
}

void adam_blockwise_cpu(at::TensorList params, at::TensorList grads, at::TensorList m_codes, at::TensorList m_absmax,
                        at::TensorList v_codes, at::TensorList v_absmax, const at::Tensor& qmap_m,
                        const at::Tensor& qmap_v, at::ArrayRef<double> step_sizes, at::ArrayRef<double> decays,
                        at::ArrayRef<double> bc2_sqrts, double beta1, double beta2, double eps, double weight_decay,
                        bool decoupled, int64_t block_size, bool stochastic, at::IntArrayRef seeds,
                        at::IntArrayRef offsets, bool round_weights, at::TensorList score_sums, int64_t score) {
  const char* op = "slimfit::adam_blockwise_";
  const size_t n = params.size();
  TORCH_CHECK(grads.size() == n && m_codes.size() == n && m_absmax.size() == n && v_codes.size() == n &&
                  v_absmax.size() == n && step_sizes.size() == n && decays.size() == n && bc2_sqrts.size() == n &&
                  offsets.size() == n && seeds.size() == 3 * n,
              op, ": every list needs one entry per piece (seeds three); got ", n, " params");
  TORCH_CHECK(block_size >= 32 && block_size <= kMaxBlock && (block_size & (block_size - 1)) == 0, op,
              ": block_size must be one of (32, 64, 128, 256, 512, 1024, 2048, 4096), got ", block_size);
  TORCH_CHECK(score >= kNone && score <= kAbsolute, op, ": score must be 0 (none), 1 (relative), 2 (robust) or 3 "
              "(absolute), got ", score);
  TORCH_CHECK(score == kNone ? score_sums.empty() : score_sums.size() == n, op,
              ": score_sums needs one entry per piece with a score kind (an empty tensor: not scored), none "
              "without; got ", score_sums.size(), " for ", n, " params and score ", score);
  check_map(qmap_m, "qmap_m", qmap_m.numel());
  check_map(qmap_v, "qmap_v", qmap_m.numel());
  const int bits = qmap_m.numel() == 16 ? 4 : 8;
  for (size_t j = 0; j < n; ++j) {
    const at::Tensor& p = params[j];
    const int64_t k = p.numel();
    TORCH_CHECK(p.device().is_cpu() && grads[j].device().is_cpu() && m_codes[j].device().is_cpu() &&
                    m_absmax[j].device().is_cpu() && v_codes[j].device().is_cpu() && v_absmax[j].device().is_cpu(),
                op, " (CPU kernel): piece ", j, " has tensors off the CPU");
    TORCH_CHECK(is_float(p.scalar_type()) && is_float(grads[j].scalar_type()), op, ": params[", j, "] and grads[", j,
                "] must be float32, float16 or bfloat16, got ", p.scalar_type(), " and ", grads[j].scalar_type());
    TORCH_CHECK(p.is_contiguous() && grads[j].is_contiguous() && m_codes[j].is_contiguous() &&
                    m_absmax[j].is_contiguous() && v_codes[j].is_contiguous() && v_absmax[j].is_contiguous(),
                op, ": piece ", j, " has a non-contiguous tensor; pass contiguous pieces (view(-1) slices)");
    TORCH_CHECK(grads[j].numel() == k, op, ": grads[", j, "] has ", grads[j].numel(), " elements, its param ", k);
    const int64_t nb = (k + block_size - 1) / block_size;
    if (score != kNone && score_sums[j].numel() != 0) {
      const at::Tensor& sj = score_sums[j];
      TORCH_CHECK(sj.device().is_cpu() && sj.scalar_type() == at::kFloat && sj.is_contiguous() && sj.dim() == 2 &&
                      sj.size(0) == 3 && sj.size(1) == nb,
                  op, ": score_sums[", j, "] must be empty or a contiguous float32 (3, ", nb, ") on the CPU, got ",
                  sj.scalar_type(), " of shape ", sj.sizes());
    }
    const int64_t bytes = bits == 8 ? k : (k + 1) / 2;
    TORCH_CHECK(m_codes[j].scalar_type() == at::kByte && m_codes[j].numel() == bytes &&
                    v_codes[j].scalar_type() == at::kByte && v_codes[j].numel() == bytes,
                op, ": the codes of piece ", j, " must be uint8, its ", k, " elements' ", bits, "-bit codes (", bytes,
                " bytes)");
    TORCH_CHECK(m_absmax[j].scalar_type() == at::kFloat && m_absmax[j].numel() == nb &&
                    v_absmax[j].scalar_type() == at::kFloat && v_absmax[j].numel() == nb,
                op, ": the block maxima of piece ", j, " must be float32, one per block (", nb, ")");
  }
  Hyper h;
  h.b1c = static_cast<float>(1.0 - beta1);
  h.b2 = static_cast<float>(beta2);
  h.b2c = static_cast<float>(1.0 - beta2);
  h.eps = static_cast<float>(eps);
  h.wd = static_cast<float>(weight_decay);
  h.decoupled = decoupled;
  h.stochastic = stochastic;
  h.round_weights = round_weights;
  h.block_size = block_size;
  h.score = score;
  if (bits == 4) {
    step_all<4>(params, grads, m_codes, m_absmax, v_codes, v_absmax, qmap_m, qmap_v, step_sizes, decays, bc2_sqrts,
                seeds, offsets, score_sums, h);
  } else {
    step_all<8>(params, grads, m_codes, m_absmax, v_codes, v_absmax, qmap_m, qmap_v, step_sizes, decays, bc2_sqrts,
                seeds, offsets, score_sums, h);
  }
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) { m.impl("adam_blockwise_", &slimfit::adam_blockwise_cpu); }
