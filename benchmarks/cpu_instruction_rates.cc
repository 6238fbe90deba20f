// Instruction rates of the host, for the AVX2 kernels' floors: how many of each vector
// instruction the CPU retires per cycle (eight independent chains, registers only), which
// pairs share pipes, and the cycles per 16-block of the instruction mixes of the W4A16
// GEMV's and the NVFP4 GEMM's inner loops (cpu/w4a16_isa.cc, cpu/gemm_isa.cc), their loads
// from L1. A kernel cannot run faster than its mix: this is the floor
// `docs/results/performance.md` compares the kernels with.
//
// Build and run (x86-64 with AVX2; GCC or Clang):
//   g++ -O2 -march=x86-64-v3 benchmarks/cpu_instruction_rates.cc -o /tmp/rates && /tmp/rates
//
// Cycles: each test runs right after a chain of dependent one-cycle integer adds whose time
// gives the clock, and prints the median of 7 such pairs (a VM's TSC does not tick with the
// core clock, and the clock moves from one moment to the next).
#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>

namespace {

double Now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// Seconds per cycle: a chain of dependent adds retires one per cycle (eight per iteration,
// so that the loop's own instructions and its alignment do not count).
__attribute__((noinline)) double SecondsPerCycle() {
  constexpr long kIterations = 25000000;
  uint64_t x = 0;
  const double t = Now();
  for (long i = 0; i < kIterations; ++i) {
    asm volatile(
        "add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
        "add $1, %0\n add $1, %0\n add $1, %0\n add $1, %0\n"
        : "+r"(x));
  }
  return (Now() - t) / (8.0 * kIterations);
}

alignas(64) uint32_t g_mem[512] = {1, 2, 3, 4, 5, 6, 7, 8};  // codes, x, table rows

// Eight independent instances of one instruction per iteration (destination registers 0, 3-9;
// sources ymm1, ymm10, ymm11).
#define NVFP4_EIGHT(OP)                                                                        \
  OP(0) OP(3) OP(4) OP(5) OP(6) OP(7) OP(8) OP(9)
#define NVFP4_CLOBBER "xmm0", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9"

alignas(64) float g_stack[64];  // the GEMM loop's spilled sums

// A test: seconds per unit of the loop ASM, which does PER units per iteration (%0 is g_mem,
// %1 g_stack; the variadic arguments are the registers it writes).
#define NVFP4_LOOP_TEST(NAME, PER, ASM, ...)                                             \
  __attribute__((noinline)) double NAME(long n) {                                        \
    const double t = Now();                                                              \
    for (long i = 0; i < n; ++i) {                                                       \
      asm volatile(ASM : : "r"(g_mem), "r"(g_stack) : __VA_ARGS__);                      \
    }                                                                                    \
    return (Now() - t) / ((PER) * static_cast<double>(n));                               \
  }
#define NVFP4_RATE_TEST(NAME, ASM) NVFP4_LOOP_TEST(NAME, 8, ASM, NVFP4_CLOBBER)

#define S(x) #x
#define MULPS(r) "vmulps %%ymm1, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define ADDPS(r) "vaddps %%ymm1, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define FMA(r) "vfmadd231ps %%ymm1, %%ymm10, %%ymm" S(r) "\n"
#define MADDUBS(r) "vpmaddubsw %%ymm" S(r) ", %%ymm11, %%ymm" S(r) "\n"
#define PMADDWD(r) "vpmaddwd %%ymm11, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define PADDW(r) "vpaddw %%ymm11, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define CVT(r) "vcvtdq2ps %%ymm11, %%ymm" S(r) "\n"
#define PERMPS(r) "vpermps %%ymm1, %%ymm10, %%ymm" S(r) "\n"
#define SRLVD(r) "vpsrlvd %%ymm10, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define SLLD(r) "vpslld $1, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define XORPS(r) "vxorps %%ymm1, %%ymm" S(r) ", %%ymm" S(r) "\n"
#define BCASTD(r) "vpbroadcastd 4(%0), %%ymm" S(r) "\n"

// Each rate test once: its function, the name it prints, its loop. Singles run eight
// independent chains of one instruction; pairs alternate four of each (seconds per
// instruction of the pair).
#define NVFP4_PAIR(A, B) A(0) B(3) A(4) B(5) A(6) B(7) A(8) B(9)
#define NVFP4_SINGLES(X)                                                                   \
  X(Mulps, "vmulps", NVFP4_EIGHT(MULPS))                                                   \
  X(Addps, "vaddps", NVFP4_EIGHT(ADDPS))                                                   \
  X(Fma, "vfmadd231ps", NVFP4_EIGHT(FMA))                                                  \
  X(Maddubs, "vpmaddubsw", NVFP4_EIGHT(MADDUBS))                                           \
  X(Pmaddwd, "vpmaddwd", NVFP4_EIGHT(PMADDWD))                                             \
  X(Paddw, "vpaddw", NVFP4_EIGHT(PADDW))                                                   \
  X(Cvt, "vcvtdq2ps", NVFP4_EIGHT(CVT))                                                    \
  X(Permps, "vpermps", NVFP4_EIGHT(PERMPS))                                                \
  X(Srlvd, "vpsrlvd", NVFP4_EIGHT(SRLVD))                                                  \
  X(Slld, "vpslld", NVFP4_EIGHT(SLLD))                                                     \
  X(Xorps, "vxorps", NVFP4_EIGHT(XORPS))                                                   \
  X(Bcastd, "vpbroadcastd m32", NVFP4_EIGHT(BCASTD))
#define NVFP4_PAIRS(X)                                                                     \
  X(PermMul, "vpermps + vmulps", NVFP4_PAIR(PERMPS, MULPS))                                \
  X(PermAdd, "vpermps + vaddps", NVFP4_PAIR(PERMPS, ADDPS))                                \
  X(PermShift, "vpermps + vpslld", NVFP4_PAIR(PERMPS, SLLD))                               \
  X(ShiftMul, "shifts + vmulps",                                                           \
    SLLD(0) MULPS(3) SRLVD(4) MULPS(5) SLLD(6) MULPS(7) SRLVD(8) MULPS(9))                 \
  X(MaddubsMul, "vpmaddubsw + vmulps", NVFP4_PAIR(MADDUBS, MULPS))                         \
  X(MaddubsAdd, "vpmaddubsw + vpaddw", NVFP4_PAIR(MADDUBS, PADDW))
#define NVFP4_DECLARE_RATE(NAME, LABEL, ASM) NVFP4_RATE_TEST(NAME, ASM)
NVFP4_SINGLES(NVFP4_DECLARE_RATE)
NVFP4_PAIRS(NVFP4_DECLARE_RATE)

// The W4A16 GEMV's 16-block for one row of x (cpu/block_lookup.h's AVX2 LookupBlock and
// the multiply-add), as GCC emits it: per 8 lanes a broadcast of 4 code bytes, the shift
// of each lane's code to its low bits, the permute, the sign (shift and xor), x's load and
// multiply, the add. Four blocks per iteration, each on its own accumulators.
#define GEMV_HALF(V, T, ACC, OFF, XOFF)                                                     \
  "vpbroadcastd " OFF "(%0), %%ymm" V "\n"                                                 \
  "vpsrlvd %%ymm10, %%ymm" V ", %%ymm" V "\n"                                              \
  "vpslld $28, %%ymm" V ", %%ymm" T "\n"                                                   \
  "vpermps %%ymm1, %%ymm" V ", %%ymm" V "\n"                                               \
  "vxorps %%ymm" T ", %%ymm" V ", %%ymm" V "\n"                                            \
  "vmulps " XOFF "(%0), %%ymm" V ", %%ymm" T "\n"                                          \
  "vaddps %%ymm" T ", %%ymm" ACC ", %%ymm" ACC "\n"
#define GEMV_BLOCK(ACC0, ACC1, OFF0, OFF1) \
  GEMV_HALF("0", "12", ACC0, OFF0, "64") GEMV_HALF("3", "13", ACC1, OFF1, "96")

// Seconds per block.
NVFP4_LOOP_TEST(GemvBlock, 4,
                GEMV_BLOCK("4", "5", "0", "4") GEMV_BLOCK("6", "7", "8", "12")
                    GEMV_BLOCK("8", "9", "16", "20") GEMV_BLOCK("11", "14", "24", "28"),
                "xmm0", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm11",
                "xmm12", "xmm13", "xmm14")

// The GEMV's 16-block for four rows of x (a pass of the batched form, whose 8 rows take two):
// the block decoded once (its table row loaded), then each row's two multiplies and adds.
#define GEMV_DECODE(CO)                                                                     \
  "vmovups 1024(%0), %%ymm1\n"                                                              \
  "vpbroadcastd " CO "(%0), %%ymm0\n vpsrlvd %%ymm10, %%ymm0, %%ymm0\n"                    \
  "vpslld $28, %%ymm0, %%ymm12\n vpermps %%ymm1, %%ymm0, %%ymm0\n"                         \
  "vxorps %%ymm12, %%ymm0, %%ymm0\n"                                                        \
  "vpbroadcastd " CO "+4(%0), %%ymm12\n vpsrlvd %%ymm10, %%ymm12, %%ymm12\n"               \
  "vpslld $28, %%ymm12, %%ymm13\n vpermps %%ymm1, %%ymm12, %%ymm1\n"                       \
  "vxorps %%ymm13, %%ymm1, %%ymm1\n"
#define GEMV_ROW(XOFF, ACC0, ACC1)                                                          \
  "vmulps " XOFF "(%0), %%ymm0, %%ymm12\n vaddps %%ymm12, %%ymm" ACC0 ", %%ymm" ACC0 "\n"   \
  "vmulps " XOFF "+32(%0), %%ymm1, %%ymm12\n vaddps %%ymm12, %%ymm" ACC1 ", %%ymm" ACC1 "\n"
#define GEMV_PASS4(CO) \
  GEMV_DECODE(CO) GEMV_ROW("64", "2", "3") GEMV_ROW("128", "4", "5") GEMV_ROW("192", "6", "7") \
      GEMV_ROW("256", "8", "9")

// Seconds per block and pass.
NVFP4_LOOP_TEST(GemvPass4, 4,
                GEMV_PASS4("0") GEMV_PASS4("8") GEMV_PASS4("16") GEMV_PASS4("24"),
                "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                "xmm12", "xmm13")

// A restructure of the 8-row form, not the kernel's loop: each half of a block decoded once
// for all 8 rows (slots 0-7 over the whole K, then slots 8-15: each slot still sums in
// ascending k), 8 sums live. One half-block: the table row, the lookup of 8 lanes with its
// sign, then 8 multiplies and 8 adds.
#define GEMV_HALF8_ROW(XOFF, T, ACC) \
  "vmulps " XOFF "(%0), %%ymm0, %%ymm" T "\n vaddps %%ymm" T ", %%ymm" ACC ", %%ymm" ACC "\n"
#define GEMV_HALF8(CO)                                                                       \
  "vmovups 1024(%0), %%ymm1\n vpbroadcastd " CO "(%0), %%ymm0\n"                             \
  "vpsrlvd %%ymm10, %%ymm0, %%ymm0\n vpslld $28, %%ymm0, %%ymm12\n"                          \
  "vpermps %%ymm1, %%ymm0, %%ymm0\n vxorps %%ymm12, %%ymm0, %%ymm0\n"                        \
  GEMV_HALF8_ROW("64", "12", "2") GEMV_HALF8_ROW("128", "13", "3")                           \
  GEMV_HALF8_ROW("192", "12", "4") GEMV_HALF8_ROW("256", "13", "5")                          \
  GEMV_HALF8_ROW("320", "12", "6") GEMV_HALF8_ROW("384", "13", "7")                          \
  GEMV_HALF8_ROW("448", "12", "8") GEMV_HALF8_ROW("512", "13", "9")

// Seconds per half-block.
NVFP4_LOOP_TEST(GemvHalf8, 4,
                GEMV_HALF8("0") GEMV_HALF8("8") GEMV_HALF8("16") GEMV_HALF8("24"),
                "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                "xmm12", "xmm13")

// The NVFP4 GEMM's work for one output row, 8 columns and one 16-block (128 multiply-adds):
// four byte multiply-adds of a broadcast A quad by B, their 16-bit sums, the pair sum
// (vpmaddwd by ones), the offset correction, the conversion, the scale of A, the FMA by the
// scale of B into the accumulator. Four such on independent registers per iteration.
#define GEMM_SET(H, T, ACC)                                                                 \
  "vpmaddubsw 0(%0), %%ymm11, %%ymm" H "\n"                                                \
  "vpmaddubsw 32(%0), %%ymm11, %%ymm" T "\n"                                               \
  "vpaddw %%ymm" T ", %%ymm" H ", %%ymm" H "\n"                                            \
  "vpmaddubsw 64(%0), %%ymm11, %%ymm" T "\n"                                               \
  "vpaddw %%ymm" T ", %%ymm" H ", %%ymm" H "\n"                                            \
  "vpmaddubsw 96(%0), %%ymm11, %%ymm" T "\n"                                               \
  "vpaddw %%ymm" T ", %%ymm" H ", %%ymm" H "\n"                                            \
  "vpmaddwd %%ymm10, %%ymm" H ", %%ymm" H "\n"                                             \
  "vpaddd 128(%0), %%ymm" H ", %%ymm" H "\n"                                               \
  "vcvtdq2ps %%ymm" H ", %%ymm" H "\n"                                                     \
  "vmulps %%ymm1, %%ymm" H ", %%ymm" H "\n"                                                \
  "vfmadd231ps 160(%0), %%ymm" H ", %%ymm" ACC "\n"

// Seconds per set of 128 multiply-adds.
NVFP4_LOOP_TEST(GemmSet, 4,
                GEMM_SET("0", "3", "4") GEMM_SET("5", "6", "7") GEMM_SET("8", "9", "12")
                    GEMM_SET("13", "14", "15"),
                "xmm0", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9", "xmm12",
                "xmm13", "xmm14", "xmm15")

// The GEMM micro-kernel's whole 16-block as GCC 12 compiles it (cpu/gemm_isa.cc's AVX2
// Micro<2>: 2 rows x 32 columns): the 8 broadcasts of A's quads and 2 of A's scales, the
// 8 sets above, and 6 of the 8 accumulators kept on the stack (a load and a store each).
#define GEMM_SET_ACC(A0, A1, A2, A3, OFF, S, ACC)                                            \
  "vpmaddubsw " OFF "(%0), " A0 ", %%ymm12\n vpmaddubsw " OFF "+128(%0), " A1 ", %%ymm13\n"  \
  "vpaddw %%ymm13, %%ymm12, %%ymm12\n"                                                      \
  "vpmaddubsw " OFF "+256(%0), " A2 ", %%ymm13\n vpmaddubsw " OFF "+384(%0), " A3 ", %%ymm14\n" \
  "vpaddw %%ymm14, %%ymm13, %%ymm13\n vpaddw %%ymm13, %%ymm12, %%ymm12\n"                  \
  "vpmaddwd %%ymm15, %%ymm12, %%ymm12\n vpaddd 512(%0), %%ymm12, %%ymm12\n"                \
  "vcvtdq2ps %%ymm12, %%ymm12\n vmulps " S ", %%ymm12, %%ymm12\n"                           \
  "vfmadd231ps 544(%0), %%ymm12, " ACC "\n"
#define GEMM_SET_SPILLED(A0, A1, A2, A3, OFF, S, SLOT)                                       \
  "vmovaps " SLOT "(%1), %%ymm14\n" GEMM_SET_ACC(A0, A1, A2, A3, OFF, S, "%%ymm14")          \
  "vmovaps %%ymm14, " SLOT "(%1)\n"
#define GEMM_ROW(A0, A1, A2, A3, S, ACC, SLOT0, SLOT1, SLOT2)                                \
  GEMM_SET_ACC(A0, A1, A2, A3, "0", S, ACC) GEMM_SET_SPILLED(A0, A1, A2, A3, "32", S, SLOT0) \
  GEMM_SET_SPILLED(A0, A1, A2, A3, "64", S, SLOT1)                                           \
  GEMM_SET_SPILLED(A0, A1, A2, A3, "96", S, SLOT2)

// Seconds per set of 128 multiply-adds (8 per block).
NVFP4_LOOP_TEST(GemmBlock, 8,
                "vpbroadcastd 640(%0), %%ymm8\n vpbroadcastd 644(%0), %%ymm9\n"
                "vpbroadcastd 648(%0), %%ymm10\n vpbroadcastd 652(%0), %%ymm11\n"
                "vpbroadcastd 656(%0), %%ymm2\n vpbroadcastd 660(%0), %%ymm3\n"
                "vpbroadcastd 664(%0), %%ymm4\n vpbroadcastd 668(%0), %%ymm5\n"
                "vbroadcastss 672(%0), %%ymm6\n vbroadcastss 676(%0), %%ymm7\n"
                GEMM_ROW("%%ymm8", "%%ymm9", "%%ymm10", "%%ymm11", "%%ymm6", "%%ymm0", "0",
                         "32", "64")
                GEMM_ROW("%%ymm2", "%%ymm3", "%%ymm4", "%%ymm5", "%%ymm7", "%%ymm1", "96",
                         "128", "160"),
                "xmm0", "xmm1", "xmm2", "xmm3", "xmm4", "xmm5", "xmm6", "xmm7", "xmm8", "xmm9",
                "xmm10", "xmm11", "xmm12", "xmm13", "xmm14", "memory")

// Median over 7 rounds of (test seconds / seconds per cycle), each round's clock measured
// right before its test.
double Cycles(double (*test)(long), long n) {
  double c[7];
  for (double& v : c) {
    const double cycle = SecondsPerCycle();
    v = test(n) / cycle;
  }
  std::sort(c, c + 7);
  return c[3];
}

}  // namespace

int main() {
  if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) {
    std::printf("this benchmark needs AVX2 and FMA\n");
    return 1;
  }
  double clock[7];
  for (double& v : clock) v = 1e-9 / SecondsPerCycle();
  std::sort(clock, clock + 7);
  std::printf("clock (dependent adds): %.2f GHz, median of 7\n\n", clock[3]);
  constexpr long kN = 20000000;
  struct Rate {
    const char* name;
    double (*test)(long);
  };
#define NVFP4_RATE_ENTRY(NAME, LABEL, ASM) {LABEL, NAME},
  const Rate singles[] = {NVFP4_SINGLES(NVFP4_RATE_ENTRY)};
  const Rate pairs[] = {NVFP4_PAIRS(NVFP4_RATE_ENTRY)};
  std::printf("%-28s %s\n", "instruction (ymm)", "per cycle");
  for (const Rate& r : singles) std::printf("%-28s %5.2f\n", r.name, 1.0 / Cycles(r.test, kN));
  std::printf("\n%-28s %s\n", "alternating pair", "per cycle (both counted)");
  for (const Rate& r : pairs) std::printf("%-28s %5.2f\n", r.name, 1.0 / Cycles(r.test, kN));
  const double gemv = Cycles(GemvBlock, kN / 2), pass4 = Cycles(GemvPass4, kN / 4);
  const double half8 = Cycles(GemvHalf8, kN / 4);
  const double gemm = Cycles(GemmSet, kN / 2), gemm_block = Cycles(GemmBlock, kN / 8);
  std::printf("\nW4A16 GEMV, 1 row: %.2f cycles per 16-block (%.2f ns at %.2f GHz)\n", gemv,
              gemv / clock[3], clock[3]);
  std::printf("W4A16 GEMV, a pass of 4 rows: %.2f cycles per 16-block (8 rows, two passes: "
              "%.2fx the 1-row block)\n",
              pass4, 2 * pass4 / gemv);
  std::printf("W4A16 GEMV, 8 rows decoding each half once (a restructure): %.2f cycles per "
              "16-block (%.2fx the 1-row block)\n",
              2 * half8, 2 * half8 / gemv);
  std::printf("NVFP4 GEMM: %.2f cycles per row x 8 columns x 16-block = %.1f multiply-adds "
              "per cycle\n",
              gemm, 128.0 / gemm);
  std::printf("NVFP4 GEMM, GCC's loop (broadcasts of A, 6 accumulators on the stack): %.2f "
              "cycles per set = %.1f multiply-adds per cycle\n",
              gemm_block, 128.0 / gemm_block);
  return 0;
}
