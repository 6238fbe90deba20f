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

}  // namespace
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
