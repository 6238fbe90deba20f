// XLA FFI handlers for the CPU kernels: check the arguments (checks.h), pick the kernel by
// the parsed dtypes, run it in parallel over rows on XLA's intra-op thread pool.
//
// The targets CUDA also runs take their bindings from nvfp4/bindings.h, shared with
// cuda/handlers.cu; the CPU-only ones (GEMM, W4A16, threefry) are bound at the end of this
// file. Scalars that change from step to step (amax, the SR key words) are operands, not
// attributes, so new values do not recompile; the static flags are attributes.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif
#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/bindings.h"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

// The GEMM's argument checks live here, not in checks.h: the GEMM is a CPU-only target.
// The shape of an NVFP4 GEMM: `batch` independent (m, k) x (n, k) -> (m, n) products.
struct GemmShape {
  int64_t batch = 1, m = 0, n = 0, k = 0;
};

// nvfp4_gemm(a_codes, a_scales, b_codes, b_scales, a_decode, b_decode) -> out: a_codes u8
// (..., M, K/2), a_scales f8e4m3fn (..., M, K/16), the same for b with N rows, the decode
// factors f32 of the batch shape (...), out f32 (..., M, N); K a multiple of 16.
inline ffi::ErrorOr<GemmShape> CheckGemmArgs(const ffi::AnyBuffer& a_codes,
                                             const ffi::AnyBuffer& a_scales,
                                             const ffi::AnyBuffer& b_codes,
                                             const ffi::AnyBuffer& b_scales,
                                             const ffi::AnyBuffer& a_decode,
                                             const ffi::AnyBuffer& b_decode,
                                             const ffi::AnyBuffer& out) {
  const std::string target = "nvfp4_gemm: ";
  auto fail = [&](const char* what, const ffi::AnyBuffer& b, const std::string& problem) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        target + what + " of shape " + ShapeString(b.dimensions()) + " and dtype " +
        DtypeName(b.element_type()) + ": " + problem));
  };
  const auto ad = a_codes.dimensions();
  const auto bd = b_codes.dimensions();
  if (a_codes.element_type() != ffi::DataType::U8 || ad.size() < 2) {
    return fail("a_codes", a_codes, "expected u8 codes of shape (..., M, K/2)");
  }
  if (b_codes.element_type() != ffi::DataType::U8 || bd.size() != ad.size()) {
    return fail("b_codes", b_codes, "expected u8 codes of shape (..., N, K/2), a_codes' rank");
  }
  const size_t rank = ad.size();
  GemmShape s;
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (bd[i] != ad[i]) return fail("b_codes", b_codes, "batch dims differ from a_codes'");
    s.batch *= ad[i];
  }
  if (bd[rank - 1] != ad[rank - 1]) {
    return fail("b_codes", b_codes, "the last axis (K/2) differs from a_codes'");
  }
  if (ad[rank - 1] % (kBlock / 2) != 0) {
    return fail("a_codes", a_codes, "the last axis must be a multiple of 8 (K/16 blocks)");
  }
  s.m = ad[rank - 2];
  s.n = bd[rank - 2];
  s.k = ad[rank - 1] * 2;
  auto same_dims = [&](const ffi::AnyBuffer& b, size_t n, auto dim) {
    const auto d = b.dimensions();
    if (d.size() != n) return false;
    for (size_t i = 0; i < n; ++i) {
      if (d[i] != dim(i)) return false;
    }
    return true;
  };
  auto scale_dims = [&](const ffi::AnyBuffer& scales, const ffi::AnyBuffer::Dimensions& codes) {
    return scales.element_type() == ffi::DataType::F8E4M3FN &&
           same_dims(scales, rank, [&](size_t i) {
             return i + 1 < rank ? codes[i] : static_cast<int64_t>(s.k / kBlock);
           });
  };
  if (!scale_dims(a_scales, ad)) {
    return fail("a_scales", a_scales, "expected f8e4m3fn of shape (..., M, K/16)");
  }
  if (!scale_dims(b_scales, bd)) {
    return fail("b_scales", b_scales, "expected f8e4m3fn of shape (..., N, K/16)");
  }
  for (const auto* d : {&a_decode, &b_decode}) {
    if (d->element_type() != ffi::DataType::F32 ||
        !same_dims(*d, rank - 2, [&](size_t i) { return ad[i]; })) {
      return fail(d == &a_decode ? "a_decode" : "b_decode", *d,
                  "expected f32 of the batch shape (the leading dims)");
    }
  }
  if (out.element_type() != ffi::DataType::F32 ||
      !same_dims(out, rank, [&](size_t i) {
        return i + 2 < rank ? ad[i] : (i + 2 == rank ? s.m : s.n);
      })) {
    return fail("result", out, "expected f32 of shape (..., M, N)");
  }
  return s;
}

// The shape of a weight-only GEMM: x (..., M, K) times the NVFP4 weight (..., N, K) along K,
// each batch dim of the result the one of x or of the weight (the other one 1 or equal).
struct W4a16Shape {
  std::vector<int64_t> batch, x_batch, w_batch;
  int64_t m = 0, n = 0, k = 0;
  FloatType x = FloatType::kF32;
};

// nvfp4_w4a16(x, codes, scales, decode) -> out: x bf16, f16 or f32 (..., M, K), codes u8
// (..., N, K/2), scales f8e4m3fn (..., N, K/16), decode f32 (...) (the weight's batch
// shape), out f32 (..., M, N); K a multiple of 16; the batch dims broadcast (equal or 1).
inline ffi::ErrorOr<W4a16Shape> CheckW4a16Args(const ffi::AnyBuffer& x, const ffi::AnyBuffer& codes,
                                               const ffi::AnyBuffer& scales,
                                               const ffi::AnyBuffer& decode,
                                               const ffi::AnyBuffer& out) {
  const std::string target = "nvfp4_w4a16: ";
  auto fail = [&](const char* what, const ffi::AnyBuffer& b, const std::string& problem) {
    return ffi::Unexpected(ffi::Error::InvalidArgument(
        target + what + " of shape " + ShapeString(b.dimensions()) + " and dtype " +
        DtypeName(b.element_type()) + ": " + problem));
  };
  W4a16Shape s;
  switch (x.element_type()) {
    case ffi::DataType::BF16: s.x = FloatType::kBf16; break;
    case ffi::DataType::F16: s.x = FloatType::kF16; break;
    case ffi::DataType::F32: s.x = FloatType::kF32; break;
    default: return fail("x", x, "expected dtype bf16, f16 or f32");
  }
  const auto xd = x.dimensions();
  const auto cd = codes.dimensions();
  if (xd.size() < 2) return fail("x", x, "expected shape (..., M, K)");
  const size_t rank = xd.size();
  if (xd[rank - 1] % kBlock != 0) {
    return fail("x", x, "the last axis (K) must be a multiple of 16");
  }
  if (codes.element_type() != ffi::DataType::U8 || cd.size() != rank ||
      cd[rank - 1] * 2 != xd[rank - 1]) {
    return fail("codes", codes, "expected u8 codes of shape (..., N, K/2), x's rank and K");
  }
  s.m = xd[rank - 2];
  s.n = cd[rank - 2];
  s.k = xd[rank - 1];
  for (size_t i = 0; i + 2 < rank; ++i) {
    if (xd[i] != cd[i] && xd[i] != 1 && cd[i] != 1) {
      return fail("codes", codes, "batch dims must equal x's or be 1 (broadcast)");
    }
    s.x_batch.push_back(xd[i]);
    s.w_batch.push_back(cd[i]);
    s.batch.push_back(xd[i] == 1 ? cd[i] : xd[i]);
  }
  auto dims_are = [](const ffi::AnyBuffer& b, const std::vector<int64_t>& want) {
    const auto d = b.dimensions();
    if (d.size() != want.size()) return false;
    for (size_t i = 0; i < want.size(); ++i) {
      if (d[i] != want[i]) return false;
    }
    return true;
  };
  std::vector<int64_t> want = s.w_batch;
  want.push_back(s.n);
  want.push_back(s.k / kBlock);
  if (scales.element_type() != ffi::DataType::F8E4M3FN || !dims_are(scales, want)) {
    return fail("scales", scales, "expected f8e4m3fn of shape (..., N, K/16), codes' batch");
  }
  if (decode.element_type() != ffi::DataType::F32 || !dims_are(decode, s.w_batch)) {
    return fail("decode", decode, "expected f32 of the weight's batch shape (the leading dims)");
  }
  want = s.batch;
  want.push_back(s.m);
  want.push_back(s.n);
  if (out.element_type() != ffi::DataType::F32 || !dims_are(out, want)) {
    return fail("result", out, "expected f32 of shape (..., M, N)");
  }
  return s;
}

}  // namespace nvfp4

namespace nvfp4::cpu {
namespace {

// The amax kernel without the RHT reads about 4x faster than the others process
// (kGrainElements, GrainItems: cpu/run.h).
constexpr int64_t kAmaxGrainElements = 1 << 19;

int Index(FloatType t) { return static_cast<int>(t); }

// A large result buffer is usually fresh memory from the allocator, whose pages the kernel
// faults in and zeroes one 4 KiB page at a time on the first write: for a 32 MiB result
// that is 8192 faults, which cost more than writing the values. Asking for transparent huge
// pages (where the system allows them on request) makes that 16 faults of 2 MiB.
void AdviseHugePages(void* data, int64_t bytes) {
#if defined(__linux__) && defined(MADV_HUGEPAGE)
  constexpr uintptr_t kHuge = uintptr_t{2} << 20;
  if (bytes < static_cast<int64_t>(2 * kHuge)) return;
  const uintptr_t first = reinterpret_cast<uintptr_t>(data);
  const uintptr_t begin = (first + kHuge - 1) & ~(kHuge - 1);
  const uintptr_t end = (first + static_cast<uintptr_t>(bytes)) & ~(kHuge - 1);
  if (end > begin) madvise(reinterpret_cast<void*>(begin), end - begin, MADV_HUGEPAGE);
#else
  (void)data, (void)bytes;
#endif
}

float* F32Data(ffi::AnyBuffer b) { return static_cast<float*>(b.untyped_data()); }


// The job of quantize and fake quantize, without its outputs (`fos`: Four Over Six or not).
QuantizeJob MakeJob(const ffi::AnyBuffer& x, const RowLayout& layout, float amax,
                    const ffi::AnyBuffer& key, bool block_2d, bool rht, bool sr,
                    const FourOverSixArgs& fos) {
  const auto* words = static_cast<const uint32_t*>(key.untyped_data());
  QuantizeJob job;
  job.x = x.untyped_data();
  job.rows = layout.rows;
  job.cols = layout.cols;
  job.block_2d = block_2d;
  job.rht = rht;
  job.sr = sr;
  job.g = MakeGlobalScale(amax, fos.six_m);
  job.four_over_six = fos.mode;
  job.six_m = fos.six_m;
  job.amax = amax;
  job.k0 = words[0];
  job.k1 = words[1];
  job.counter_offset = static_cast<uint64_t>(words[2]) | static_cast<uint64_t>(words[3]) << 32;
  return job;
}

ffi::Error AmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                    bool rht) {
  auto args = CheckAmaxArgs(x, *out);
  if (args.has_error()) return args.error();
  const RowLayout& layout = args->layout;
  const AmaxRangeFn fn = BestTable().amax[Index(args->x)];
  std::atomic<uint32_t> seen{0};
  const int64_t grain = GrainItems(layout.cols, rht ? kGrainElements : kAmaxGrainElements);
  ParallelFor(pool, layout.rows, grain, [&](int64_t begin, int64_t end) {
    AtomicMax(seen, fn(x.untyped_data(), layout.cols, rht, begin, end));
  });
  const uint32_t bits = seen.load();
  *F32Data(*out) = AsFloat(bits < kInfBits ? bits : kNanBits);
  return ffi::Error::Success();
}

ffi::Error QuantizeAny(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                       ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> codes,
                       ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> stored_amax,
                       bool block_2d, bool rht, bool stochastic_rounding,
                       const FourOverSixArgs& fos) {
  auto args = CheckQuantizeArgs(x, amax, key, *codes, *scales, *stored_amax, block_2d,
                                fos.quantize_target);
  if (args.has_error()) return args.error();
  const RowLayout& layout = args->layout;
  const float a = *F32Data(amax);
  QuantizeJob job = MakeJob(x, layout, a, key, block_2d, rht, stochastic_rounding, fos);
  job.codes = static_cast<uint8_t*>(codes->untyped_data());
  job.scales = static_cast<uint8_t*>(scales->untyped_data());
  AdviseHugePages(codes->untyped_data(), codes->size_bytes());
  // A NaN, inf or negative A gives the non-finite result without reading x.
  const bool finite = AmaxValid(a) && RunQuantize(pool, BestTable().quantize[Index(args->x)], job);
  const float stored = StoredAmax(a, finite);
  *F32Data(*stored_amax) = stored;
  if (stored != stored && layout.size() > 0) {
    // docs/NUMERICS.md section 8: every code 0 and every scale E4M3 NaN.
    std::memset(job.codes, 0, layout.size() / 2);
    std::memset(job.scales, kE4m3Nan, layout.rows * layout.blocks());
  }
  return ffi::Error::Success();
}

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                        ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> codes,
                        ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> stored_amax,
                        bool block_2d, bool rht, bool stochastic_rounding) {
  return QuantizeAny(pool, x, amax, key, codes, scales, stored_amax, block_2d, rht,
                     stochastic_rounding, FourOverSixArgs{});
}

// nvfp4_quantize_4over6: nvfp4_quantize under Four Over Six (docs/NUMERICS.md section 13).
ffi::Error Quantize4over6Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                              ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> codes,
                              ffi::Result<ffi::AnyBuffer> scales,
                              ffi::Result<ffi::AnyBuffer> stored_amax, bool block_2d, bool rht,
                              bool stochastic_rounding, std::string_view error, int32_t e4m3_max) {
  auto fos = CheckFourOverSixAttrs("nvfp4_quantize_4over6", error, e4m3_max);
  if (fos.has_error()) return fos.error();
  return QuantizeAny(pool, x, amax, key, codes, scales, stored_amax, block_2d, rht,
                     stochastic_rounding, *fos);
}

ffi::Error FakeQuantizeAny(ffi::ThreadPool& pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                           ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> out,
                           ffi::Result<ffi::AnyBuffer> stored_amax, bool block_2d, bool rht,
                           bool stochastic_rounding, bool global_scale,
                           const FourOverSixArgs& fos) {
  auto args = CheckFakeQuantizeArgs(x, amax, key, *out, *stored_amax, block_2d,
                                    fos.fake_quantize_target);
  if (args.has_error()) return args.error();
  const RowLayout& layout = args->layout;
  const float a = *F32Data(amax);
  QuantizeJob job = MakeJob(x, layout, a, key, block_2d, rht, stochastic_rounding, fos);
  job.values = out->untyped_data();
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  job.global = DecodeGlobal(a, fos.six_m);
  job.use_global = global_scale;
  const auto fn = BestTable().fake_quantize[Index(args->x)][Index(args->result)];
  const bool finite = AmaxValid(a) && RunQuantize(pool, fn, job);
  const float stored = StoredAmax(a, finite);
  *F32Data(*stored_amax) = stored;
  if (stored != stored && layout.size() > 0) {
    // What dequantizing the non-finite result gives: NaN everywhere, global scale or not.
    VisitFloatType(args->result, [&](auto u) {
      using U = decltype(u);
      auto* p = static_cast<typename U::Storage*>(job.values);
      std::fill(p, p + layout.size(), U::Store(AsFloat(kNanBits)));
    });
  }
  return ffi::Error::Success();
}

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                            ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> stored_amax, bool block_2d, bool rht,
                            bool stochastic_rounding, bool global_scale) {
  return FakeQuantizeAny(pool, x, amax, key, out, stored_amax, block_2d, rht,
                         stochastic_rounding, global_scale, FourOverSixArgs{});
}

// nvfp4_fake_quantize_4over6: nvfp4_fake_quantize under Four Over Six.
ffi::Error FakeQuantize4over6Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                                  ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> out,
                                  ffi::Result<ffi::AnyBuffer> stored_amax, bool block_2d,
                                  bool rht, bool stochastic_rounding, bool global_scale,
                                  std::string_view error, int32_t e4m3_max) {
  auto fos = CheckFourOverSixAttrs("nvfp4_fake_quantize_4over6", error, e4m3_max);
  if (fos.has_error()) return fos.error();
  return FakeQuantizeAny(pool, x, amax, key, out, stored_amax, block_2d, rht,
                         stochastic_rounding, global_scale, *fos);
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::AnyBuffer decode_scale, ffi::Result<ffi::AnyBuffer> out, bool rht) {
  auto args = CheckDequantizeArgs(codes, scales, decode_scale, *out);
  if (args.has_error()) return args.error();
  DequantizeJob job;
  job.codes = static_cast<const uint8_t*>(codes.untyped_data());
  job.scales = static_cast<const uint8_t*>(scales.untyped_data());
  job.global = *F32Data(decode_scale);  // D: A * RCP2688, or an imported checkpoint's own
  job.cols = args->layout.cols;
  job.rht = rht;
  job.out = out->untyped_data();
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  const DequantizeRangeFn fn = BestTable().dequantize[Index(args->result)];
  ParallelFor(pool, args->layout.rows, GrainItems(job.cols),
              [&](int64_t begin, int64_t end) { fn(job, begin, end); });
  return ffi::Error::Success();
}

ffi::Error RhtImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                   bool inverse) {
  auto args = CheckRhtArgs(x, *out);
  if (args.has_error()) return args.error();
  const int64_t cols = args->layout.cols;
  const RhtRangeFn fn = BestTable().rht[Index(args->x)];
  ParallelFor(pool, args->layout.rows, GrainItems(cols), [&](int64_t begin, int64_t end) {
    fn(x.untyped_data(), out->untyped_data(), cols, inverse, begin, end);
  });
  return ffi::Error::Success();
}

// The GEMM's threads for tests: at most this many when positive (results never depend on it).
std::atomic<int64_t> gemm_max_threads{0};

// About this many multiply-adds per parallel chunk of GEMM tiles, and elements per chunk of
// the packing.
constexpr int64_t kGemmGrainMacs = int64_t{1} << 22;

template <class T>
T* Carve(std::vector<uint8_t>& scratch, int64_t& offset, int64_t count) {
  T* p = reinterpret_cast<T*>(scratch.data() + offset);
  offset += (count * static_cast<int64_t>(sizeof(T)) + 63) / 64 * 64;
  return p;
}

// Whether the GEMM uses AMX-INT8 where it can: off by default. The per-block f32 scaling
// of the exact order leaves AMX 16 x 16 x 16 tile products (K = one block) that each need a
// tile store and 16 vector rows of scaling; on the one AMX host measured (2026-11-24, 2-core
// Xeon) that ran 1.3-1.5x slower than the AVX-512 VNNI kernel, so it is opt-in
// (set_gemm_amx(True)) and tested bit for bit against the other ISAs.
std::atomic<bool> gemm_amx_allowed{false};

// Whether this CPU has AMX-TILE and AMX-INT8 and the kernel granted this process the tile
// data state (Linux asks for it: arch_prctl ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA).
bool AmxGranted() {
#if defined(__linux__) && defined(__x86_64__) && defined(NVFP4_HAVE_X86_VARIANTS)
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return false;
    if (((d >> 24) & 1u) == 0 || ((d >> 25) & 1u) == 0) return false;  // AMX-TILE, AMX-INT8
    constexpr long kReqXcompPerm = 0x1023, kGetXcompPerm = 0x1022, kXtileData = 18;
    if (syscall(SYS_arch_prctl, kReqXcompPerm, kXtileData) != 0) return false;
    unsigned long features = 0;
    return syscall(SYS_arch_prctl, kGetXcompPerm, &features) == 0 &&
           ((features >> kXtileData) & 1u) != 0;
  }();
  return granted;
#else
  return false;
#endif
}

ffi::Error GemmImpl(ffi::ThreadPool pool, ffi::AnyBuffer a_codes, ffi::AnyBuffer a_scales,
                    ffi::AnyBuffer b_codes, ffi::AnyBuffer b_scales, ffi::AnyBuffer a_decode,
                    ffi::AnyBuffer b_decode, ffi::Result<ffi::AnyBuffer> out) {
  auto checked = CheckGemmArgs(a_codes, a_scales, b_codes, b_scales, a_decode, b_decode, *out);
  if (checked.has_error()) return checked.error();
  const GemmShape s = *checked;
  if (s.batch == 0 || s.m == 0 || s.n == 0) return ffi::Error::Success();
  const KernelTable& table = BestTable();
  const int64_t threads = gemm_max_threads.load();
  GemmJob job;
  job.m = s.m;
  job.n = s.n;
  job.k = s.k;
  job.amx = gemm_amx_allowed.load() && std::strcmp(table.isa, "x86-64-v4") == 0 && AmxGranted();
  const int64_t groups = job.groups();
  const int64_t panels = job.panels();
  // AMX reads A in whole 16-row groups: the packed A has zero rows past m.
  const int64_t m_pack = job.amx ? (s.m + 15) / 16 * 16 : s.m;
  // One batch element's packed operands at a time, 64-byte aligned pieces of one buffer,
  // kept by the calling thread from call to call: fresh memory every call cost page faults
  // (and the zeroing of a vector) worth several percent of a 2048^3 GEMM.
  const int64_t bytes = (m_pack * s.k + 64) + (m_pack * groups * 4 + 64) +
                        (panels * groups * kGemmNr * (kBlock + 8) + 3 * 64) + 64;
  thread_local std::vector<uint8_t> scratch;
  if (static_cast<int64_t>(scratch.size()) < bytes) {
    scratch = std::vector<uint8_t>();  // free the old one first
    scratch.resize(static_cast<size_t>(bytes));
    AdviseHugePages(scratch.data(), bytes);
  }
  int64_t offset = (64 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(scratch.data()) % 64)) % 64;
  job.a_pack = Carve<uint8_t>(scratch, offset, m_pack * s.k);
  job.a_scale = Carve<float>(scratch, offset, m_pack * groups);
  if (m_pack > s.m) {
    std::memset(job.a_pack + s.m * s.k, 0, (m_pack - s.m) * s.k);
    std::memset(job.a_scale + s.m * groups, 0, (m_pack - s.m) * groups * sizeof(float));
  }
  job.b_pack = Carve<int8_t>(scratch, offset, panels * groups * kGemmNr * kBlock);
  job.b_corr = Carve<int32_t>(scratch, offset, panels * groups * kGemmNr);
  job.b_scale = Carve<float>(scratch, offset, panels * groups * kGemmNr);
  if (offset > bytes) return ffi::Error::Internal("nvfp4_gemm: scratch too small");
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  const auto* ac = static_cast<const uint8_t*>(a_codes.untyped_data());
  const auto* as = static_cast<const uint8_t*>(a_scales.untyped_data());
  const auto* bc = static_cast<const uint8_t*>(b_codes.untyped_data());
  const auto* bs = static_cast<const uint8_t*>(b_scales.untyped_data());
  const float* da = F32Data(a_decode);
  const float* db = F32Data(b_decode);
  float* o = F32Data(*out);
  const int64_t macs_per_tile = kGemmMc * kGemmNr * std::max<int64_t>(s.k, 1);
  for (int64_t b = 0; b < s.batch; ++b) {
    job.a_codes = ac + b * s.m * (s.k / 2);
    job.a_scales = as + b * s.m * groups;
    job.b_codes = bc + b * s.n * (s.k / 2);
    job.b_scales = bs + b * s.n * groups;
    job.alpha = da[b] * db[b];  // alpha = D_a * D_b, formed here: XLA may reassociate it
    job.out = o + b * s.m * s.n;
    ParallelFor(pool, s.m, GrainItems(std::max<int64_t>(s.k, 1)),
                [&](int64_t begin, int64_t end) { table.gemm_pack_a(job, begin, end); }, threads);
    ParallelFor(pool, panels, GrainItems(kGemmNr * std::max<int64_t>(s.k, 1)),
                [&](int64_t begin, int64_t end) { table.gemm_pack_b(job, begin, end); }, threads);
    ParallelFor(pool, job.tiles(), std::max<int64_t>(1, kGemmGrainMacs / macs_per_tile),
                [&](int64_t begin, int64_t end) { table.gemm_tiles(job, begin, end); }, threads);
  }
  return ffi::Error::Success();
}

// The W4A16 kernel of the variant BestTable() runs (the same choice, by its name).
W4a16RangeFn BestW4a16Kernel(FloatType x) {
#if defined(NVFP4_HAVE_X86_VARIANTS)
  const char* isa = BestTable().isa;
  if (std::strcmp(isa, "x86-64-v4") == 0) return avx512::W4a16Kernel(x);
  if (std::strcmp(isa, "x86-64-v3") == 0) return avx2::W4a16Kernel(x);
#endif
  return baseline::W4a16Kernel(x);
}

// Offset (in batch elements) of the batch element at `coords` in a tensor of batch dims
// `dims` broadcast to the result's (a dim of 1 repeats).
int64_t BroadcastOffset(const std::vector<int64_t>& coords, const std::vector<int64_t>& dims) {
  int64_t offset = 0;
  for (size_t i = 0; i < dims.size(); ++i) offset = offset * dims[i] + (dims[i] == 1 ? 0 : coords[i]);
  return offset;
}

ffi::Error W4a16Impl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer codes,
                     ffi::AnyBuffer scales, ffi::AnyBuffer decode,
                     ffi::Result<ffi::AnyBuffer> out) {
  auto checked = CheckW4a16Args(x, codes, scales, decode, *out);
  if (checked.has_error()) return checked.error();
  const W4a16Shape& s = *checked;
  int64_t batch = 1, x_batch = 1;
  for (size_t i = 0; i < s.batch.size(); ++i) {
    batch *= s.batch[i];
    x_batch *= s.x_batch[i];
  }
  if (batch == 0 || s.m == 0 || s.n == 0) return ffi::Error::Success();
  const int64_t threads = gemm_max_threads.load();
  const W4a16RangeFn fn = BestW4a16Kernel(s.x);
  // The activations in f32 (exact), row by row.
  const int64_t rows = x_batch * s.m;
  std::vector<float> xf(static_cast<size_t>(rows * s.k));
  VisitFloatType(s.x, [&](auto t) {
    using T = decltype(t);
    const auto* src = static_cast<const typename T::Storage*>(x.untyped_data());
    ParallelFor(pool, rows, GrainItems(std::max<int64_t>(s.k, 1)), [&](int64_t begin, int64_t end) {
      for (int64_t i = begin * s.k; i < end * s.k; ++i) xf[i] = T::Load(src[i]);
    }, threads);
  });
  const auto* c = static_cast<const uint8_t*>(codes.untyped_data());
  const auto* sc = static_cast<const uint8_t*>(scales.untyped_data());
  const float* d = F32Data(decode);
  float* o = F32Data(*out);
  // Per scale byte, the 16 codes' weights as dequantize gives them in x's dtype (f32 bits).
  constexpr float kE2m1[16] = {0.0f,  0.5f,  1.0f,  1.5f,  2.0f,  3.0f,  4.0f,  6.0f,
                               -0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f};
  alignas(64) float tables[256 * kBlock];
  W4a16Job job;
  job.m = s.m;
  job.n = s.n;
  job.k = s.k;
  job.tables = tables;
  std::vector<int64_t> coords(s.batch.size(), 0);
  const int64_t grain = GrainItems(std::max<int64_t>(s.k, 1) * std::min<int64_t>(s.m, 8));
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t i = static_cast<int64_t>(s.batch.size()) - 1, r = b; i >= 0; --i) {
      coords[i] = r % s.batch[i];
      r /= s.batch[i];
    }
    const int64_t xo = BroadcastOffset(coords, s.x_batch);
    const int64_t wo = BroadcastOffset(coords, s.w_batch);
    const float decode_scale = d[wo];
    VisitFloatType(s.x, [&](auto t) {
      using T = decltype(t);
      for (uint32_t byte = 0; byte < 256; ++byte) {
        const float factor = E4m3ToF32(byte) * decode_scale;  // f32(s_b) * D
        for (int c = 0; c < kBlock; ++c) tables[byte * kBlock + c] = RoundTo<T>(kE2m1[c] * factor);
      }
    });
    job.x = xf.data() + xo * s.m * s.k;
    job.codes = c + wo * s.n * (s.k / 2);
    job.scales = sc + wo * s.n * (s.k / kBlock);
    job.out = o + b * s.m * s.n;
    ParallelFor(pool, s.n, grain, [&](int64_t begin, int64_t end) { fn(job, begin, end); },
                threads);
  }
  return ffi::Error::Success();
}

// nvfp4_threefry2x32(k0, k1, x0, x1) -> (y0, y1): threefry2x32 of every element, as
// jax.extend.random.threefry2x32_p; all u32 of one shape. One custom call in place of the
// rolled 20-round loop XLA's CPU lowering compiles for every hash (the SR keys of each layer
// and step, nvfp4_jax/_src/core/kernels/_threefry.py): the same bits, a fraction of the
// compile time.
ffi::Error Threefry2x32Impl(ffi::AnyBuffer k0, ffi::AnyBuffer k1, ffi::AnyBuffer x0,
                            ffi::AnyBuffer x1, ffi::Result<ffi::AnyBuffer> y0,
                            ffi::Result<ffi::AnyBuffer> y1) {
  const ffi::AnyBuffer* buffers[] = {&k0, &k1, &x0, &x1, &*y0, &*y1};
  const char* names[] = {"k0", "k1", "x0", "x1", "y0", "y1"};
  const auto dims = k0.dimensions();
  for (int i = 0; i < 6; ++i) {
    const ffi::AnyBuffer& b = *buffers[i];
    const auto d = b.dimensions();
    if (b.element_type() != ffi::DataType::U32 ||
        !std::equal(d.begin(), d.end(), dims.begin(), dims.end())) {
      return ffi::Error::InvalidArgument(
          std::string("nvfp4_threefry2x32: ") + names[i] + " of shape " + ShapeString(d) +
          " and dtype " + DtypeName(b.element_type()) + ": expected u32 of k0's shape " +
          ShapeString(dims));
    }
  }
  const auto* a = static_cast<const uint32_t*>(k0.untyped_data());
  const auto* b = static_cast<const uint32_t*>(k1.untyped_data());
  const auto* c = static_cast<const uint32_t*>(x0.untyped_data());
  const auto* d = static_cast<const uint32_t*>(x1.untyped_data());
  auto* e = static_cast<uint32_t*>(y0->untyped_data());
  auto* f = static_cast<uint32_t*>(y1->untyped_data());
  const size_t n = k0.element_count();
  for (size_t i = 0; i < n; ++i) {
    uint32_t u = c[i], v = d[i];
    Threefry2x32(a[i], b[i], u, v);
    e[i] = u, f[i] = v;
  }
  return ffi::Error::Success();
}

}  // namespace

void SetGemmMaxThreads(int64_t n) { gemm_max_threads.store(n); }

bool SetGemmAmx(bool allowed) {
  gemm_amx_allowed.store(allowed);
  return allowed && AmxGranted() && std::strcmp(BestTable().isa, "x86-64-v4") == 0;
}

}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4AmaxCpu, nvfp4::cpu::AmaxImpl,
                              nvfp4::bindings::Amax<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeCpu, nvfp4::cpu::QuantizeImpl,
                              nvfp4::bindings::Quantize<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeCpu, nvfp4::cpu::FakeQuantizeImpl,
                              nvfp4::bindings::FakeQuantize<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Quantize4over6Cpu, nvfp4::cpu::Quantize4over6Impl,
                              nvfp4::bindings::Quantize4over6<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantize4over6Cpu, nvfp4::cpu::FakeQuantize4over6Impl,
                              nvfp4::bindings::FakeQuantize4over6<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4DequantizeCpu, nvfp4::cpu::DequantizeImpl,
                              nvfp4::bindings::Dequantize<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4RhtCpu, nvfp4::cpu::RhtImpl,
                              nvfp4::bindings::Rht<ffi::ThreadPool>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4W4a16Cpu, nvfp4::cpu::W4a16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4GemmCpu, nvfp4::cpu::GemmImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Threefry2x32Cpu, nvfp4::cpu::Threefry2x32Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
