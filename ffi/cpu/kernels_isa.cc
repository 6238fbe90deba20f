// CPU kernels over row ranges, compiled once per instruction set (NVFP4_ISA names it).
//
// Inner loops run over one 16-element block with a fixed trip count and no data-dependent
// branches (the numerics are selects), so the compiler vectorizes them; the per-block
// flags (RHT, SR) are uniform branches that predict perfectly.
//
// Everything here is in the per-ISA namespace or always-inline, and nothing from the
// standard library is used: an out-of-line copy of a shared inline function compiled
// with AVX-512 could otherwise be picked by the linker for every caller.
#include <cstdint>

#include "cpu/kernel_table.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/numerics.h"

#ifndef NVFP4_ISA
#error "compile with -DNVFP4_ISA=<namespace>"
#endif

namespace nvfp4::cpu::NVFP4_ISA {
namespace {

inline uint32_t MaxU32(uint32_t a, uint32_t b) { return a > b ? a : b; }

#if defined(__AVX2__)
// Rht16 of numerics.h with GCC vector extensions, the block as two halves of 8 lanes (one
// AVX2 register each). Stage h < 8 computes, for every lane i of a half, v[i] + v[i ^ h]
// where bit h of i is clear and v[i ^ h] - v[i] where it is set; stage 8 is lo + hi and
// lo - hi. Those are the same additions of the same operands as the scalar butterflies, so
// the same bits, without the scalar shuffling.
typedef float V8f __attribute__((vector_size(32)));
typedef int32_t V8i __attribute__((vector_size(32)));
typedef uint32_t V8u __attribute__((vector_size(32)));

template <int H>
inline V8f Butterfly(V8f v) {
  const V8i partner_index = {0 ^ H, 1 ^ H, 2 ^ H, 3 ^ H, 4 ^ H, 5 ^ H, 6 ^ H, 7 ^ H};
  const V8i high = {0 & H, 1 & H, 2 & H, 3 & H, 4 & H, 5 & H, 6 & H, 7 & H};
  const V8f partner = __builtin_shuffle(v, partner_index);
  return high != 0 ? partner - v : v + partner;
}

inline V8f FlipSigns(V8f v, V8u sign) {
  V8u bits;
  __builtin_memcpy(&bits, &v, sizeof(v));
  bits ^= sign << 31;
  __builtin_memcpy(&v, &bits, sizeof(v));
  return v;
}

inline void Rht16Vec(float block[kBlock], bool inverse) {
  // kRhtSignMask as lanes: elements 0..7, then 8..15.
  const V8u sign_lo = {0, 0, 0, 1, 0, 1, 1, 1};
  const V8u sign_hi = {1, 1, 1, 0, 1, 0, 1, 1};
  V8f lo, hi;
  __builtin_memcpy(&lo, block, sizeof(lo));
  __builtin_memcpy(&hi, block + 8, sizeof(hi));
  if (!inverse) lo = FlipSigns(lo, sign_lo), hi = FlipSigns(hi, sign_hi);
  lo = Butterfly<4>(Butterfly<2>(Butterfly<1>(lo)));
  hi = Butterfly<4>(Butterfly<2>(Butterfly<1>(hi)));
  V8f sum = (lo + hi) * 0.25f, diff = (lo - hi) * 0.25f;
  if (inverse) sum = FlipSigns(sum, sign_lo), diff = FlipSigns(diff, sign_hi);
  __builtin_memcpy(block, &sum, sizeof(sum));
  __builtin_memcpy(block + 8, &diff, sizeof(diff));
}
#else
// Without 8-lane shuffles the vector form is scalarized badly: the scalar butterflies win.
inline void Rht16Vec(float block[kBlock], bool inverse) { Rht16(block, inverse); }
#endif

// 16 elements of T -> f32, with the forward RHT (rounded to T, docs/NUMERICS.md section 5) when
// rht is set.
template <class T>
inline void LoadBlockCpu(const typename T::Storage* p, bool rht, float v[kBlock]) {
  NVFP4_SIMD_LOOP
  for (int i = 0; i < kBlock; ++i) v[i] = T::Load(p[i]);
  if (rht) {
    Rht16Vec(v, /*inverse=*/false);
    NVFP4_SIMD_LOOP
    for (int i = 0; i < kBlock; ++i) v[i] = RoundTo<T>(v[i]);
  }
}

// Random words for `blocks` consecutive blocks from flat element n0: 4 per block. One
// loop over counters, no branches: the threefry rounds vectorize across counters.
// `counter_offset` is added to every counter (a shard's global element offset / 8).
void FillRandomWords(uint32_t k0, uint32_t k1, uint64_t counter_offset, int64_t n0, int64_t blocks,
                     uint32_t* words) {
  const uint64_t j0 = counter_offset + (static_cast<uint64_t>(n0) >> 3);
  for (int64_t c = 0; c < 2 * blocks; ++c) {
    const uint64_t j = j0 + static_cast<uint64_t>(c);
    uint32_t x0 = static_cast<uint32_t>(j >> 32), x1 = static_cast<uint32_t>(j);
    Threefry2x32(k0, k1, x0, x1);
    words[2 * c] = x0;
    words[2 * c + 1] = x1;
  }
}

// Max |x| bits of each 16x16 tile of the 16 rows starting at x (post-RHT when asked).
template <class T>
void TileAmaxBits(const typename T::Storage* x, const QuantizeJob& job, uint32_t* tile) {
  for (int64_t b = 0; b < job.blocks(); ++b) tile[b] = 0;
  for (int r = 0; r < kBlock; ++r) {
    const typename T::Storage* row = x + r * job.cols;
    for (int64_t b = 0; b < job.blocks(); ++b) {
      float v[kBlock];
      LoadBlockCpu<T>(row + b * kBlock, job.rht, v);
      tile[b] = MaxU32(tile[b], MaxAbsBits16(v));
    }
  }
}

// Writes packed codes and the E4M3 scale of one block.
struct CodeSink {
  static void Put(const QuantizeJob& job, int64_t block, uint32_t scale,
                  const uint8_t q[kBlock / 2]) {
    uint8_t* codes = job.codes + block * (kBlock / 2);
    for (int i = 0; i < kBlock / 2; ++i) codes[i] = q[i];
    job.scales[block] = static_cast<uint8_t>(scale);
  }
};

// Writes the dequantized values of one block in dtype U (fake quantization).
template <class U>
struct ValueSink {
  static void Put(const QuantizeJob& job, int64_t block, uint32_t scale,
                  const uint8_t q[kBlock / 2]) {
    const float s = E4m3ToF32(scale);
    float v[kBlock];
    DecodeBlock(q, job.use_global ? s * job.global : s, v);
    StoreBlock<U>(v, static_cast<typename U::Storage*>(job.values) + block * kBlock);
  }
};

// Quantizes one row, handing each block to Sink; returns the max |x| bits seen.
template <class T, class Sink>
uint32_t QuantizeRow(const QuantizeJob& job, int64_t row, const uint32_t* tile, uint32_t* words) {
  const auto* x = static_cast<const typename T::Storage*>(job.x) + row * job.cols;
  if (job.sr) {
    FillRandomWords(job.k0, job.k1, job.counter_offset, row * job.cols, job.blocks(), words);
  }
  uint32_t seen = 0;
  for (int64_t b = 0; b < job.blocks(); ++b) {
    float v[kBlock];
    LoadBlockCpu<T>(x + b * kBlock, job.rht, v);
    const uint32_t bits = MaxAbsBits16(v);
    seen = MaxU32(seen, bits);
    const uint32_t scale = BlockScale(AsFloat(tile ? tile[b] : bits), job.g);
    const float enc = BlockEncode(scale, job.g);
    uint8_t q[kBlock / 2];
    if (job.sr) {
      EncodeBlockSr(v, enc, words + 4 * b, q);
    } else {
      EncodeBlockRn(v, enc, q);
    }
    Sink::Put(job, row * job.blocks() + b, scale, q);
  }
  return seen;
}

template <class T, class Sink>
uint32_t QuantizeRange(const QuantizeJob& job, int64_t begin, int64_t end, uint32_t* scratch) {
  uint32_t* words = scratch;
  uint32_t* tile = job.block_2d ? scratch + 4 * job.blocks() : nullptr;
  uint32_t seen = 0;
  for (int64_t item = begin; item < end; ++item) {
    const int64_t row0 = item * job.rows_per_item();
    if (tile) {
      TileAmaxBits<T>(static_cast<const typename T::Storage*>(job.x) + row0 * job.cols, job, tile);
    }
    for (int64_t r = row0; r < row0 + job.rows_per_item(); ++r) {
      seen = MaxU32(seen, QuantizeRow<T, Sink>(job, r, tile, words));
    }
  }
  return seen;
}

template <class T>
uint32_t AmaxRange(const void* xv, int64_t cols, bool rht, int64_t begin, int64_t end) {
  const auto* x = static_cast<const typename T::Storage*>(xv);
  uint32_t seen = 0;
  for (int64_t i = begin * cols; i < end * cols; i += kBlock) {
    float v[kBlock];
    LoadBlockCpu<T>(x + i, rht, v);
    seen = MaxU32(seen, MaxAbsBits16(v));
  }
  return seen;
}

template <class U>
void DequantizeRange(const DequantizeJob& job, int64_t begin, int64_t end) {
  auto* out = static_cast<typename U::Storage*>(job.out);
  for (int64_t b = begin * job.cols / kBlock; b < end * job.cols / kBlock; ++b) {
    float v[kBlock];
    DecodeBlock(job.codes + b * (kBlock / 2), E4m3ToF32(job.scales[b]) * job.global, v);
    if (job.rht) Rht16Vec(v, /*inverse=*/true);
    StoreBlock<U>(v, out + b * kBlock);
  }
}

template <class T>
void RhtRange(const void* xv, void* outv, int64_t cols, bool inverse, int64_t begin, int64_t end) {
  const auto* x = static_cast<const typename T::Storage*>(xv);
  auto* out = static_cast<typename T::Storage*>(outv);
  for (int64_t i = begin * cols; i < end * cols; i += kBlock) {
    float v[kBlock];
    NVFP4_SIMD_LOOP
    for (int k = 0; k < kBlock; ++k) v[k] = T::Load(x[i + k]);
    Rht16Vec(v, inverse);
    StoreBlock<T>(v, out + i);
  }
}

template <class T>
constexpr QuantizeRangeFn kFake[kNumFloatTypes] = {
    QuantizeRange<T, ValueSink<Bf16>>,
    QuantizeRange<T, ValueSink<F16>>,
    QuantizeRange<T, ValueSink<F32>>,
};

}  // namespace

const KernelTable& Table() {
  static constexpr KernelTable kTable = {
      NVFP4_ISA_NAME,
      {AmaxRange<Bf16>, AmaxRange<F16>, AmaxRange<F32>},
      {QuantizeRange<Bf16, CodeSink>, QuantizeRange<F16, CodeSink>, QuantizeRange<F32, CodeSink>},
      {{kFake<Bf16>[0], kFake<Bf16>[1], kFake<Bf16>[2]},
       {kFake<F16>[0], kFake<F16>[1], kFake<F16>[2]},
       {kFake<F32>[0], kFake<F32>[1], kFake<F32>[2]}},
      {DequantizeRange<Bf16>, DequantizeRange<F16>, DequantizeRange<F32>},
      {RhtRange<Bf16>, RhtRange<F16>, RhtRange<F32>},
  };
  return kTable;
}

}  // namespace nvfp4::cpu::NVFP4_ISA
