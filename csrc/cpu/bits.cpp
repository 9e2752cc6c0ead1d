// CPU kernels of slimfit::pack_bits and slimfit::unpack_bits.
//
// Element i of the flattened bool mask is bit i % 8 of byte i // 8. Eight mask bytes
// are handled as one 64-bit word: a multiply gathers (or a masked multiply spreads)
// the eight bits without a per-bit loop.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdint>
#include <cstring>

namespace slimfit {
namespace {

constexpr int64_t kGrainBytes = 32768;  // packed bytes per parallel task (8x as many mask elements)

constexpr uint64_t kLow7 = 0x7F7F7F7F7F7F7F7FULL;
constexpr uint64_t kHigh = 0x8080808080808080ULL;
constexpr uint64_t kOnes = 0x0101010101010101ULL;

// Eight mask bytes (any nonzero byte is true) -> one byte, byte j -> bit j.
inline uint8_t gather8(uint64_t v) {
  const uint64_t nonzero = (((v & kLow7) + kLow7) | v) & kHigh;  // bit 7 of each nonzero byte
  // Bytes of 0/1 at bit 8j; the multiplier moves bit 8j to bit 56 + j with no carries.
  return static_cast<uint8_t>(((nonzero >> 7) * 0x0102040810204080ULL) >> 56);
}

// One byte -> eight bytes of 0/1, bit j -> byte j.
inline uint64_t spread8(uint8_t b) {
  const uint64_t x = (static_cast<uint64_t>(b) * kOnes) & 0x8040201008040201ULL;  // byte j keeps bit j
  return ((x + kLow7) >> 7) & kOnes;
}

at::Tensor pack_bits_cpu(const at::Tensor& mask_in) {
  TORCH_CHECK(mask_in.device().is_cpu(), "slimfit::pack_bits (CPU kernel): expected a CPU tensor, got ",
              mask_in.device());
  TORCH_CHECK(mask_in.scalar_type() == at::kBool, "slimfit::pack_bits: expected a bool mask, got ",
              mask_in.scalar_type(), " (use mask != 0)");
  const at::Tensor mask = mask_in.contiguous();
  const int64_t n = mask.numel();
  const int64_t nbytes = (n + 7) / 8;
  at::Tensor out = at::empty({nbytes}, mask.options().dtype(at::kByte));
  if (n == 0) return out;
  const uint8_t* src = reinterpret_cast<const uint8_t*>(mask.const_data_ptr<bool>());
  uint8_t* dst = out.data_ptr<uint8_t>();
  const int64_t full = n / 8;
  at::parallel_for(0, full, kGrainBytes, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      uint64_t v;
      std::memcpy(&v, src + 8 * b, sizeof(v));
      dst[b] = gather8(v);
    }
  });
  if (full < nbytes) {  // a short last byte; its unused high bits are zero
    uint8_t byte = 0;
    for (int64_t i = 8 * full; i < n; ++i) byte |= static_cast<uint8_t>((src[i] != 0) << (i - 8 * full));
    dst[full] = byte;
  }
  return out;
}

at::Tensor unpack_bits_cpu(const at::Tensor& packed_in, int64_t numel) {
  TORCH_CHECK(packed_in.device().is_cpu(), "slimfit::unpack_bits (CPU kernel): expected a CPU tensor, got ",
              packed_in.device());
  TORCH_CHECK(packed_in.scalar_type() == at::kByte, "slimfit::unpack_bits: expected uint8 packed bits, got ",
              packed_in.scalar_type());
  TORCH_CHECK(numel >= 0, "slimfit::unpack_bits: numel must be >= 0, got ", numel);
  TORCH_CHECK(packed_in.numel() >= (numel + 7) / 8, "slimfit::unpack_bits: ", packed_in.numel(),
              " bytes cannot hold ", numel, " bits");
  at::Tensor out = at::empty({numel}, packed_in.options().dtype(at::kBool));
  if (numel == 0) return out;
  const at::Tensor packed = packed_in.contiguous();
  const uint8_t* src = packed.const_data_ptr<uint8_t>();
  uint8_t* dst = reinterpret_cast<uint8_t*>(out.data_ptr<bool>());
  const int64_t full = numel / 8;
  at::parallel_for(0, full, kGrainBytes, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const uint64_t v = spread8(src[b]);
      std::memcpy(dst + 8 * b, &v, sizeof(v));
    }
  });
  for (int64_t i = 8 * full; i < numel; ++i) dst[i] = static_cast<uint8_t>((src[full] >> (i - 8 * full)) & 1);
  return out;
}

}  // namespace
}  // namespace slimfit

TORCH_LIBRARY_IMPL(slimfit, CPU, m) {
  m.impl("pack_bits", &slimfit::pack_bits_cpu);
  m.impl("unpack_bits", &slimfit::unpack_bits_cpu);
}
