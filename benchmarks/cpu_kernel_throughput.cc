// Single-thread throughput of the CPU kernel tables, without XLA: each kernel over a bf16
// (4096, 4096) tensor in preallocated buffers (no page faults), timed interleaved with a
// 32 MiB memcpy, medians printed as ns per element and as a multiple of the memcpy's time.
// On a shared machine this is steadier than timings through XLA: no thread pool, no fresh
// output memory, and every kernel sees the same load as the memcpy next to it.
//
// Build from the repository root, each x86 level's three kernel files as CMake builds them:
//   F="-Iffi/include -Iffi -O3 -ffp-contract=off -fno-trapping-math -Wno-psabi -std=gnu++17"
//   N=--param=sccvn-max-alias-queries-per-access=100   # ffi/CMakeLists.txt's, not for AVX-512
//   for l in "avx512 x86-64-v4" "avx2 x86-64-v3 $N" "baseline x86-64 $N"; do set -- $l
//     for f in kernels gemm w4a16; do g++ $F -DNVFP4_ISA=$1 -DNVFP4_ISA_NAME="\"$2\"" \
//       -march=$2 $3 -c ffi/cpu/${f}_isa.cc -o /tmp/${f}_$1.o; done; done
//   g++ $F benchmarks/cpu_kernel_throughput.cc /tmp/*_avx512.o /tmp/*_avx2.o \
//     /tmp/*_baseline.o -o /tmp/throughput
//   /tmp/throughput avx512 20     # table: avx512, avx2 or baseline; rounds
// The GEMM rows time the NVFP4 GEMM's tiles alone, its operands packed beforehand.
// The Four Over Six rows quantize with M = 256 (6M = 1536), the training recipe's default.
#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <new>
#include <random>
#include <vector>

#include "cpu/kernel_table.h"

namespace nvfp4::cpu {
namespace avx512 { const KernelTable& Table(); }
namespace avx2 { const KernelTable& Table(); }
namespace baseline { const KernelTable& Table(); }
}  // namespace nvfp4::cpu

using namespace nvfp4;
using namespace nvfp4::cpu;

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

const KernelTable& PickTable(const char* isa) {
  if (!strcmp(isa, "avx2")) return avx2::Table();
  if (!strcmp(isa, "baseline")) return baseline::Table();
  return avx512::Table();
}

W4a16RangeFn PickW4a16(const char* isa) {
  if (!strcmp(isa, "avx2")) return avx2::W4a16Kernel(FloatType::kBf16);
  if (!strcmp(isa, "baseline")) return baseline::W4a16Kernel(FloatType::kBf16);
  return avx512::W4a16Kernel(FloatType::kBf16);
}

struct Op {
  const char* name;
  std::function<void()> run;
};

// 64-byte aligned storage, as XLA's buffers and the GEMM handler's packed operands are: a
// std::vector's large blocks start 16 bytes past a page, and half of the 32-byte loads from
// them then straddle two cache lines (the GEMM's tiles ran 15-20% slower on Zen 3).
template <class T>
struct Aligned64 {
  using value_type = T;
  Aligned64() = default;
  template <class U>
  Aligned64(const Aligned64<U>&) {}
  T* allocate(size_t count) {
    return static_cast<T*>(::operator new(count * sizeof(T), std::align_val_t{64}));
  }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{64}); }
  template <class U>
  bool operator==(const Aligned64<U>&) const { return true; }
  template <class U>
  bool operator!=(const Aligned64<U>&) const { return false; }
};
template <class T>
using Buffer = std::vector<T, Aligned64<T>>;

}  // namespace

int main(int argc, char** argv) {
  const KernelTable& t = PickTable(argc > 1 ? argv[1] : "avx512");
  const int iters = argc > 2 ? atoi(argv[2]) : 20;
  const int64_t rows = 4096, cols = 4096, n = rows * cols;

  // bf16 input: normal values times 3, truncated from f32.
  Buffer<uint16_t> x(n);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal;
  for (auto& v : x) {
    float f = normal(rng) * 3;
    uint32_t bits;
    memcpy(&bits, &f, 4);
    v = static_cast<uint16_t>(bits >> 16);
  }
  Buffer<uint8_t> codes(n / 2), scales(n / 16);
  Buffer<uint16_t> values(n), copy(n);
  Buffer<float> values_f32(n);

  QuantizeJob job;
  job.x = x.data();
  job.rows = rows;
  job.cols = cols;
  job.g = MakeGlobalScale(20.0f);
  job.global = DecodeGlobal(20.0f);
  job.codes = codes.data();
  job.scales = scales.data();
  job.values = values.data();
  job.block_2d = job.rht = true;
  job.four_over_six = kMae;  // the most scratch any op below needs: 4/6 on 16x16 tiles
  // The per-chunk scratch is a std::vector, as RunQuantize (cpu/run.h) makes it.
  std::vector<uint32_t> scratch(job.scratch_words());
  job.four_over_six = kPlain;

  DequantizeJob dj;
  dj.codes = codes.data();
  dj.scales = scales.data();
  dj.global = 0.01f;
  dj.cols = cols;

  auto quantize = [&](bool sr, bool rht, bool block_2d, int four_over_six = kPlain) {
    job.sr = sr;
    job.rht = rht;
    job.block_2d = block_2d;
    job.four_over_six = four_over_six;  // M = 256, as the training recipe's default
    job.six_m = four_over_six == kPlain ? k2688 : 1536.0f;
    job.amax = 20.0f;
    job.g = MakeGlobalScale(20.0f, job.six_m);
    t.quantize[0](job, 0, block_2d ? rows / 16 : rows, scratch.data());
    job.four_over_six = kPlain;
  };
  // The weight-only GEMV of a decode step: x (m, 4096) f32 times a frozen (4096, 14336)
  // weight (33 MB of codes and scales: past the caches) and a (4096, 1024) one (2.3 MB: in
  // L2/L3, the kernel's own speed), one thread. Tables as the handler makes them (any
  // values: the speed does not depend on them).
  const int64_t wk = 4096, wn = 14336, wn_small = 1024;
  Buffer<uint8_t> w_codes(wn * wk / 2), w_scales(wn * wk / 16);
  for (auto& b : w_codes) b = static_cast<uint8_t>(rng());
  for (auto& b : w_scales) b = static_cast<uint8_t>(rng() % 0x7e);
  Buffer<float> w_x(8 * wk), w_out(8 * wn), w_tables(256 * 16);
  for (auto& v : w_x) v = normal(rng);
  for (auto& v : w_tables) v = normal(rng);
  t.to_lookup_table(w_tables.data());
  const W4a16RangeFn w4a16 = PickW4a16(argc > 1 ? argv[1] : "avx512");
  auto gemv = [&](int64_t m, int64_t cols) {
    W4a16Job wj;
    wj.m = m;
    wj.n = cols;
    wj.k = wk;
    wj.x = w_x.data();
    wj.codes = w_codes.data();
    wj.scales = w_scales.data();
    wj.tables = w_tables.data();
    wj.out = w_out.data();
    w4a16(wj, 0, cols);
  };
  // The NVFP4 GEMM's tiles (packed operands, as the handler packs them first) at 1024^3 and at
  // a shape of the example's layers (1024 tokens, K = 128, N = 352), one thread.
  struct GemmCase {
    GemmJob job;
    Buffer<uint8_t> codes_a, codes_b, scales_a, scales_b, a_pack;
    Buffer<int8_t> b_pack;
    Buffer<int32_t> b_corr;
    Buffer<float> a_scale, b_scale, out;
  };
  auto make_gemm = [&](int64_t m, int64_t n, int64_t k) {
    GemmCase c;
    c.codes_a.resize(m * k / 2);
    c.codes_b.resize(n * k / 2);
    c.scales_a.resize(m * k / 16);
    c.scales_b.resize(n * k / 16);
    for (auto& b : c.codes_a) b = static_cast<uint8_t>(rng());
    for (auto& b : c.codes_b) b = static_cast<uint8_t>(rng());
    for (auto& b : c.scales_a) b = static_cast<uint8_t>(0x30 + rng() % 16);
    for (auto& b : c.scales_b) b = static_cast<uint8_t>(0x30 + rng() % 16);
    GemmJob& j = c.job;
    j.m = m;
    j.n = n;
    j.k = k;
    c.a_pack.resize(m * k);
    c.a_scale.resize(m * j.groups());
    c.b_pack.resize(j.panels() * j.groups() * kGemmNr * kBlock);
    c.b_corr.resize(j.panels() * j.groups() * kGemmNr);
    c.b_scale.resize(j.panels() * j.groups() * kGemmNr);
    c.out.resize(m * n);
    j.a_codes = c.codes_a.data();
    j.b_codes = c.codes_b.data();
    j.a_scales = c.scales_a.data();
    j.b_scales = c.scales_b.data();
    j.a_pack = c.a_pack.data();
    j.a_scale = c.a_scale.data();
    j.b_pack = c.b_pack.data();
    j.b_corr = c.b_corr.data();
    j.b_scale = c.b_scale.data();
    j.out = c.out.data();
    t.gemm_pack_a(j, 0, m);
    t.gemm_pack_b(j, 0, j.panels());
    return c;
  };
  GemmCase gemm_cube = make_gemm(1024, 1024, 1024), gemm_layer = make_gemm(1024, 352, 128);
  std::vector<Op> ops = {
      {"memcpy 2B", [&] { memcpy(copy.data(), x.data(), n * 2); }},
      {"amax", [&] { t.amax[0](x.data(), cols, false, 0, rows); }},
      {"amax rht", [&] { t.amax[0](x.data(), cols, true, 0, rows); }},
      {"quant rn", [&] { quantize(false, false, false); }},
      {"quant sr", [&] { quantize(true, false, false); }},
      {"quant rht", [&] { quantize(false, true, false); }},
      {"quant 2d", [&] { quantize(false, false, true); }},
      {"quant rht 2d", [&] { quantize(false, true, true); }},
      {"4/6 mae", [&] { quantize(false, false, false, kMae); }},
      {"4/6 mse", [&] { quantize(false, false, false, kMse); }},
      {"4/6 mae sr", [&] { quantize(true, false, false, kMae); }},
      {"4/6 mae 2d", [&] { quantize(false, false, true, kMae); }},
      {"fake bf16",
       [&] {
         job.sr = job.rht = job.block_2d = false;
         t.fake_quantize[0][0](job, 0, rows, scratch.data());
       }},
      {"deq bf16",
       [&] {
         dj.out = values.data();
         t.dequantize[0](dj, 0, rows);
       }},
      {"deq f32",
       [&] {
         dj.out = values_f32.data();
         t.dequantize[2](dj, 0, rows);
       }},
      {"gemv m1 33MB", [&] { gemv(1, wn); }},
      {"gemv m8 33MB", [&] { gemv(8, wn); }},
      {"gemv m1 2MB", [&] { gemv(1, wn_small); }},
      {"gemv m8 2MB", [&] { gemv(8, wn_small); }},
      {"gemm 1024^3", [&] { t.gemm_tiles(gemm_cube.job, 0, gemm_cube.job.tiles()); }},
      {"gemm layer", [&] { t.gemm_tiles(gemm_layer.job, 0, gemm_layer.job.tiles()); }},
  };

  // Interleaved rounds; the first two warm up.
  std::vector<std::vector<double>> seconds(ops.size());
  for (int it = 0; it < iters + 2; ++it) {
    for (size_t i = 0; i < ops.size(); ++i) {
      const double start = Now();
      ops[i].run();
      if (it >= 2) seconds[i].push_back(Now() - start);
    }
  }
  double memcpy_median = 0;
  for (size_t i = 0; i < ops.size(); ++i) {
    std::vector<double> v = seconds[i];
    std::sort(v.begin(), v.end());
    const double median = v[v.size() / 2];
    if (i == 0) memcpy_median = median;
    printf("%-12s %7.3f ms  %5.2f ns/elem  x%.2f memcpy\n", ops[i].name, median * 1e3,
           median * 1e9 / n, median / memcpy_median);
    if (!strncmp(ops[i].name, "gemm", 4)) {  // multiply-adds per second
      const GemmJob& j = strstr(ops[i].name, "1024^3") ? gemm_cube.job : gemm_layer.job;
      printf("%-12s %7.2f GMAC/s (%ld x %ld x %ld, the tiles of packed operands)\n", "",
             double(j.m) * j.n * j.k / median / 1e9, long(j.m), long(j.k), long(j.n));
    }
    if (!strncmp(ops[i].name, "gemv", 4)) {  // the weight's bytes per second, and per block
      const int64_t cols = strstr(ops[i].name, "33MB") ? wn : wn_small;
      const double bytes = cols * wk * (0.5 + 1.0 / 16), blocks = cols * wk / 16.0;
      printf("%-12s %7.2f GB/s of weight, %5.2f ns per 16-block (memcpy: %.2f GB/s read)\n", "",
             bytes / median / 1e9, median * 1e9 / blocks, 2.0 * n / memcpy_median / 1e9);
    }
  }
  return 0;
}
