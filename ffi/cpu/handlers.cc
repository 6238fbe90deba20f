// XLA FFI handlers for the CPU kernels: check the arguments (checks.h), pick the kernel by
// the parsed dtypes, run it in parallel over rows on XLA's intra-op thread pool.
//
// Scalars that change from step to step (amax, the SR key words) are operands, not
// attributes, so new values do not recompile; the static flags are bool attributes.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__linux__)
#include <sys/mman.h>
#endif

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
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

}  // namespace nvfp4

namespace nvfp4::cpu {
namespace {

// About this many elements per parallel chunk: large enough to amortize waking a pool
// thread (tens of microseconds), which the vectorized kernels spend on ~100K elements.
// The amax kernel without the RHT reads about 4x faster than the others process.
constexpr int64_t kGrainElements = 1 << 17;
constexpr int64_t kAmaxGrainElements = 1 << 19;

int64_t GrainItems(int64_t elements_per_item, int64_t grain = kGrainElements) {
  return std::max<int64_t>(1, grain / std::max<int64_t>(1, elements_per_item));
}

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

void AtomicMax(std::atomic<uint32_t>& a, uint32_t v) {
  uint32_t cur = a.load(std::memory_order_relaxed);
  while (v > cur && !a.compare_exchange_weak(cur, v)) {
  }
}

// Runs a quantize-like kernel over the whole tensor; returns whether all input was finite.
bool RunQuantize(ffi::ThreadPool& pool, QuantizeRangeFn fn, const QuantizeJob& job) {
  std::atomic<uint32_t> seen{0};
  ParallelFor(pool, job.rows / job.rows_per_item(), GrainItems(job.rows_per_item() * job.cols),
              [&](int64_t begin, int64_t end) {
                std::vector<uint32_t> scratch(job.scratch_words());
                AtomicMax(seen, fn(job, begin, end, scratch.data()));
              });
  return seen.load() < kInfBits;
}

// The job of quantize and fake quantize, without its outputs.
QuantizeJob MakeJob(const ffi::AnyBuffer& x, const RowLayout& layout, float amax,
                    const ffi::AnyBuffer& key, bool block_2d, bool rht, bool sr) {
  const auto* words = static_cast<const uint32_t*>(key.untyped_data());
  QuantizeJob job;
  job.x = x.untyped_data();
  job.rows = layout.rows;
  job.cols = layout.cols;
  job.block_2d = block_2d;
  job.rht = rht;
  job.sr = sr;
  job.g = MakeGlobalScale(amax);
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

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                        ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> codes,
                        ffi::Result<ffi::AnyBuffer> scales, ffi::Result<ffi::AnyBuffer> stored_amax,
                        bool block_2d, bool rht, bool stochastic_rounding) {
  auto args = CheckQuantizeArgs(x, amax, key, *codes, *scales, *stored_amax, block_2d);
  if (args.has_error()) return args.error();
  const RowLayout& layout = args->layout;
  const float a = *F32Data(amax);
  QuantizeJob job = MakeJob(x, layout, a, key, block_2d, rht, stochastic_rounding);
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

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer amax,
                            ffi::AnyBuffer key, ffi::Result<ffi::AnyBuffer> out,
                            ffi::Result<ffi::AnyBuffer> stored_amax, bool block_2d, bool rht,
                            bool stochastic_rounding, bool global_scale) {
  auto args = CheckFakeQuantizeArgs(x, amax, key, *out, *stored_amax, block_2d);
  if (args.has_error()) return args.error();
  const RowLayout& layout = args->layout;
  const float a = *F32Data(amax);
  QuantizeJob job = MakeJob(x, layout, a, key, block_2d, rht, stochastic_rounding);
  job.values = out->untyped_data();
  AdviseHugePages(out->untyped_data(), out->size_bytes());
  job.global = DecodeGlobal(a);
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
  const int64_t groups = job.groups();
  const int64_t panels = job.panels();
  // One batch element's packed operands at a time, 64-byte aligned pieces of one buffer.
  const int64_t bytes = (s.m * s.k + 64) + (s.m * groups * 4 + 64) +
                        (panels * groups * kGemmNr * (kBlock + 8) + 3 * 64) + 64;
  std::vector<uint8_t> scratch(static_cast<size_t>(bytes));
  int64_t offset = (64 - static_cast<int64_t>(reinterpret_cast<uintptr_t>(scratch.data()) % 64)) % 64;
  job.a_pack = Carve<uint8_t>(scratch, offset, s.m * s.k);
  job.a_scale = Carve<float>(scratch, offset, s.m * groups);
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

}  // namespace

void SetGemmMaxThreads(int64_t n) { gemm_max_threads.store(n); }

}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4AmaxCpu, nvfp4::cpu::AmaxImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>(
        "rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeCpu, nvfp4::cpu::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeCpu, nvfp4::cpu::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding")
                                  .Attr<bool>("global_scale"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4DequantizeCpu, nvfp4::cpu::DequantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4RhtCpu, nvfp4::cpu::RhtImpl,
    ffi::Ffi::Bind().Ctx<ffi::ThreadPool>().Arg<ffi::AnyBuffer>().Ret<ffi::AnyBuffer>().Attr<bool>(
        "inverse"));

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
