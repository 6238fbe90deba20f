// Decode attention over the NVFP4 KV cache on the CPU (docs/NUMERICS.md section 15): the
// job the handler (cpu/kv_cache.cc) prepares and the per-ISA chunk kernels
// (cpu/kv_attention_isa.cc, compiled once per x86 level like the other kernels) compute.
//
// Work is split into items (sequence b, key/value head g, chunk u of kKvChunk slots); an
// item's rows are its queries m = t * R + r (query token t, query head g * R + r, R = H / G).
// For each row it writes the partial softmax of the chunk's visible slots: the max score,
// the sum of exp(score - max) and the exp-weighted sum of the values; the handler combines
// the chunks in ascending order. Items and chunks are fixed by the shapes, so the result
// does not depend on the thread count or the ISA.
#ifndef NVFP4_CPU_KV_ATTENTION_H_
#define NVFP4_CPU_KV_ATTENTION_H_

#include <cstdint>

#include "nvfp4/kv_cache.h"
#include "nvfp4/numerics.h"

namespace nvfp4::cpu {

// Slots per chunk: the unit of parallel work and of the softmax's partial sums.
constexpr int64_t kKvChunk = 256;
// Rows of one item processed together (scores kept for a chunk: kKvRows x kKvChunk floats).
constexpr int64_t kKvRows = 8;
// The head dimension's 16-blocks an item keeps dequantized in registers: E <= 512.
constexpr int64_t kKvMaxBlocks = 32;

struct KvAttentionJob {
  kv::Layout layout;
  int64_t batch = 0, tokens = 0, q_heads = 0, pages = 0;
  int64_t group = 1;   // R = H / G
  int64_t chunks = 0;  // ceil(L / kKvChunk)
  const float* q = nullptr;          // (B, T, H, E), f32 (exact from bf16, f16)
  const uint8_t* cache = nullptr;    // (B, P, 2, W)
  const int32_t* visible = nullptr;  // (B, T): the slots query t sees, in [0, L]
  float scale[2] = {1.0f, 1.0f};     // k_scale, v_scale
  // Per side, the decoded values of the 16 codes under each of the 256 scale bytes:
  // tables[side][16 * byte + code] = value(code) * kv::DecodeFactor(byte, scale[side]).
  const float* tables[2] = {nullptr, nullptr};
  float softmax_scale = 1.0f;
  // The byte offsets within a side of a page: codes of (t, h) = data_t[t] + data_h[h];
  // scale s of (t, h) on side c = scale_ts[c][t * S + s] + scale_h[h].
  const int64_t* data_t = nullptr;
  const int64_t* data_h = nullptr;
  const int64_t* scale_ts[2] = {nullptr, nullptr};
  const int64_t* scale_h = nullptr;
  // Partials, (B, G, chunks, M) and (B, G, chunks, M, E), M = T * R.
  float* part_max = nullptr;
  float* part_sum = nullptr;
  float* part_out = nullptr;

  int64_t rows() const { return tokens * group; }
  int64_t slots() const { return pages * layout.page_size; }
  int64_t items() const { return batch * layout.heads * chunks; }
};

// Computes the partials of item `item` = (b * G + g) * chunks + u.
using KvAttentionItemFn = void (*)(const KvAttentionJob& job, int64_t item);

namespace baseline {
KvAttentionItemFn KvAttentionKernel();
}
namespace avx2 {
KvAttentionItemFn KvAttentionKernel();
}
namespace avx512 {
KvAttentionItemFn KvAttentionKernel();
}

// exp(x) in f32, the one formula the chunk kernels (lane by lane) and the handler's combine
// use: with n = rne(x * log2(e)), r = (x - n * ln2_hi) - n * ln2_lo and Cephes' degree-5
// polynomial p(r), exp(x) = (p * 2^(n / 2)) * 2^(n - n / 2); x is clamped to [-104, 88]
// first and NaN stays NaN. Every step is one f32 operation (no FMA).
constexpr float kExpLo = -104.0f;
constexpr float kExpHi = 88.0f;
constexpr float kLog2e = 1.44269504088896341f;
constexpr float kLn2Hi = 0.693359375f;
constexpr float kLn2Lo = -2.12194440e-4f;
constexpr float kRound = 12582912.0f;  // 1.5 * 2^23: t + kRound - kRound rounds t to an integer
constexpr float kExpP[6] = {1.9875691500e-4f, 1.3981999507e-3f, 8.3334519073e-3f,
                            4.1665795894e-2f, 1.6666665459e-1f, 5.0000001201e-1f};

inline float KvExp(float x) {
  const bool nan = x != x;
  x = x < kExpLo ? kExpLo : x;
  x = x > kExpHi ? kExpHi : x;
  const float shifted = x * kLog2e + kRound;
  const int32_t n = static_cast<int32_t>(AsBits(shifted) - AsBits(kRound));
  const float nf = shifted - kRound;
  float r = x - nf * kLn2Hi;
  r = r - nf * kLn2Lo;
  float p = kExpP[0];
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * (r * r) + r + 1.0f;
  const int32_t half = n / 2;  // truncates toward 0
  const float a = AsFloat(static_cast<uint32_t>(half + 127) << 23);
  const float b = AsFloat(static_cast<uint32_t>(n - half + 127) << 23);
  const float y = (p * a) * b;
  return nan ? AsFloat(kNanBits) : y;
}

}  // namespace nvfp4::cpu

#endif  // NVFP4_CPU_KV_ATTENTION_H_
