// Decode attention over the NVFP4 KV cache, one chunk of slots per call, compiled once per
// instruction set (NVFP4_ISA) like cpu/kernels_isa.cc; the handler is in cpu/kv_cache.cc.
//
// docs/NUMERICS.md section 15. For one (sequence b, key/value head g, chunk u) and each of
// its query rows m, over the chunk's slots j that row sees:
//
//   k_hat = value(code) * (f32(sf) * k_scale)                 (the block decoded in registers)
//   a[l]  = +0;  a[l] = a[l] + q[16 c + l] * k_hat[16 c + l]  for c = 0, 1, ..., E/16 - 1
//   dot   = ((a[l] + a[l+8]) ... ) the fixed tree of the W4A16 GEMV;  s_j = dot * softmax_scale
//   mx    = max_j s_j;  p_j = exp(s_j - mx) (KvExp);  l = sum_j p_j  (ascending j)
//   o[e]  = sum_j p_j * v_hat_j[e]                             (ascending j; v_hat like k_hat)
//
// Every step is one f32 operation, no FMA; a 16-lane vector holds one 16-block, so the
// order is the same on every ISA. A NaN score makes the chunk's l NaN (hence the row's
// output). Nothing from the standard library: everything here is per-ISA or inline.
#include <cstdint>

#include "cpu/block_lookup.h"
#include "cpu/kv_attention.h"
#include "cpu/simd.h"
#include "nvfp4/kv_cache.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

NVFP4_VINLINE int64_t MinI64(int64_t a, int64_t b) { return a < b ? a : b; }
NVFP4_VINLINE int64_t MaxI64(int64_t a, int64_t b) { return a > b ? a : b; }

// Arithmetic shift right by one, lane by lane.
NVFP4_VINLINE VI SraOne(VI a) {
  for (int j = 0; j < kParts; ++j) a.p[j] = a.p[j] >> 1;
  return a;
}

// KvExp (cpu/kv_attention.h) lane by lane, the same operations in the same order.
NVFP4_VINLINE VF VExp(VF x) {
  const VI nan = x != x;
  x = Select(x < kExpLo, SplatF(kExpLo), x);
  x = Select(SplatF(kExpHi) < x, SplatF(kExpHi), x);
  const VF shifted = x * kLog2e + kRound;
  const VI n = AsVI(shifted) - static_cast<int32_t>(AsBits(kRound));
  const VF nf = shifted - kRound;
  VF r = x - nf * kLn2Hi;
  r = r - nf * kLn2Lo;
  VF p = SplatF(kExpP[0]);
  for (int i = 1; i < 6; ++i) p = p * r + kExpP[i];
  p = p * (r * r) + r + 1.0f;
  const VI half = SraOne(n + Srl(n, 31));  // n / 2, truncated toward 0
  const VF a = AsVF((half + 127) << 23);
  const VF b = AsVF((n - half + 127) << 23);
  return Select(nan, SplatF(AsFloat(kNanBits)), (p * a) * b);
}

// Where one slot's head sits on one side: its codes and its scale bytes' offsets.
struct Slot {
  const uint8_t* bytes;     // the side of the page
  const uint8_t* codes;     // E/2 bytes
  const int64_t* scale_at;  // S offsets (add `head`)
  int64_t head;
};

NVFP4_VINLINE Slot SlotAt(const KvAttentionJob& job, int side, int64_t b, int64_t g, int64_t j) {
  const kv::Layout& l = job.layout;
  const int64_t page = j / l.page_size, t = j % l.page_size;
  const uint8_t* bytes = job.cache + ((b * job.pages + page) * 2 + side) * l.page_bytes();
  return Slot{bytes, bytes + job.data_t[t] + job.data_h[g],
              job.scale_ts[side] + t * l.scale_dim(), job.scale_h[g]};
}

// Block c of a slot decoded: value(code) * (f32(sf) * scale), looked up in the side's table
// row of its scale byte (the 16 codes' values, computed once per call).
NVFP4_VINLINE VF DecodeBlock(const Slot& slot, const float* tables, int64_t c) {
  const float* row = tables + kBlock * slot.bytes[slot.scale_at[c] + slot.head];
  return LookupBlock(row, slot.codes + 8 * c);
}

// Rows [m0, m0 + rows) of one item.
void Rows(const KvAttentionJob& job, int64_t b, int64_t g, int64_t u, int64_t m0, int64_t rows) {
  const kv::Layout& l = job.layout;
  const int64_t blocks = l.scale_dim(), e = l.head_dim, m_all = job.rows();
  const int64_t j0 = u * kKvChunk, j1 = MinI64(j0 + kKvChunk, job.slots());
  int64_t end[kKvRows];
  const float* q[kKvRows];
  int64_t jmax = j0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t m = m0 + r, t = m / job.group, h = g * job.group + m % job.group;
    end[r] = MinI64(MaxI64(job.visible[b * job.tokens + t], j0), j1);
    q[r] = job.q + ((b * job.tokens + t) * job.q_heads + h) * e;
    jmax = MaxI64(jmax, end[r]);
  }
  float scores[kKvRows][kKvChunk];
  for (int64_t j = j0; j < jmax; ++j) {
    const Slot slot = SlotAt(job, 0, b, g, j);
    // The rows that see slot j are the last ones: `end` does not decrease with the row.
    int64_t first = 0;
    while (first < rows && j >= end[first]) ++first;
    VF acc[kKvRows];
    for (int64_t r = first; r < rows; ++r) acc[r] = SplatF(0.0f);
    for (int64_t c = 0; c < blocks; ++c) {
      const VF k_hat = DecodeBlock(slot, job.tables[0], c);
      for (int64_t r = first; r < rows; ++r) {
        acc[r] = acc[r] + LoadV<VF>(q[r] + kBlock * c) * k_hat;
      }
    }
    for (int64_t r = first; r < rows; ++r) {
      scores[r][j - j0] = SumTree16(acc[r]) * job.softmax_scale;
    }
  }
  const int64_t base = ((b * l.heads + g) * job.chunks + u) * m_all + m0;
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t count = end[r] - j0;
    float mx = -AsFloat(kInfBits);
    bool bad = false;
    for (int64_t i = 0; i < count; ++i) {
      const float s = scores[r][i];
      bad = bad || s != s;
      mx = s > mx ? s : mx;
    }
    const int64_t padded = (count + kBlock - 1) / kBlock * kBlock;
    for (int64_t i = count; i < padded; ++i) scores[r][i] = 0.0f;
    for (int64_t i = 0; i < padded; i += kBlock) {
      StoreV(&scores[r][i], VExp(LoadV<VF>(&scores[r][i]) - SplatF(mx)));
    }
    float sum = 0.0f;
    for (int64_t i = 0; i < count; ++i) sum = sum + scores[r][i];
    job.part_max[base + r] = mx;
    job.part_sum[base + r] = bad ? AsFloat(kNanBits) : sum;
  }
  // p.v block by block: each block's accumulators stay in registers over the chunk's slots
  // (every element still sums its slots in ascending j).
  Slot slots[kKvChunk];
  int64_t first[kKvChunk];
  for (int64_t j = j0; j < jmax; ++j) {
    slots[j - j0] = SlotAt(job, 1, b, g, j);
    int64_t f = 0;
    while (f < rows && j >= end[f]) ++f;
    first[j - j0] = f;
  }
  for (int64_t c = 0; c < blocks; ++c) {
    VF acc[kKvRows];
    for (int64_t r = 0; r < rows; ++r) acc[r] = SplatF(0.0f);
    for (int64_t j = j0; j < jmax; ++j) {
      const VF v_hat = DecodeBlock(slots[j - j0], job.tables[1], c);
      for (int64_t r = first[j - j0]; r < rows; ++r) {
        acc[r] = acc[r] + SplatF(scores[r][j - j0]) * v_hat;
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      StoreV(job.part_out + (base + r) * e + kBlock * c, acc[r]);
    }
  }
}

void Item(const KvAttentionJob& job, int64_t item) {
  const int64_t u = item % job.chunks;
  const int64_t bg = item / job.chunks;
  const int64_t g = bg % job.layout.heads, b = bg / job.layout.heads;
  for (int64_t m0 = 0; m0 < job.rows(); m0 += kKvRows) {
    Rows(job, b, g, u, m0, MinI64(kKvRows, job.rows() - m0));
  }
}

}  // namespace

KvAttentionItemFn KvAttentionKernel() { return Item; }

}  // namespace nvfp4::cpu::NVFP4_ISA
