// XLA FFI handlers of the seven targets both platforms run, on the CPU: nvfp4/handlers.h
// decodes and checks the arguments, these run the kernel picked by the parsed dtypes in
// parallel over rows on XLA's intra-op thread pool. The CPU-only targets have files of their
// own (gemm.cc, w4a16.cc, grouped.cc, threefry.cc, kv_cache.cc), as has MS-EDEN (ms_eden.cc).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/checks.h"
#include "nvfp4/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {
namespace {

// The amax kernel without the RHT reads about 4x faster than the others process
// (kGrainElements, GrainItems: cpu/run.h).
constexpr int64_t kAmaxGrainElements = 1 << 19;

int Index(FloatType t) { return static_cast<int>(t); }

float* F32Data(ffi::AnyBuffer b) { return static_cast<float*>(b.untyped_data()); }

// The job of quantize and fake quantize, without its outputs.
QuantizeJob MakeJob(const QuantizeParams& params, const ffi::AnyBuffer& x, float amax,
                    const ffi::AnyBuffer& key) {
  const auto* words = static_cast<const uint32_t*>(key.untyped_data());
  QuantizeJob job;
  static_cast<QuantizeParams&>(job) = params;
  job.x = x.untyped_data();
  job.g = MakeGlobalScale(amax, params.six_m);
  job.amax = amax;
  job.k0 = words[0];
  job.k1 = words[1];
  job.counter_offset = static_cast<uint64_t>(words[2]) | static_cast<uint64_t>(words[3]) << 32;
  return job;
}

struct Cpu {
  using Context = ffi::ThreadPool;
  using Binding = ffi::ThreadPool;

  static ffi::Error Amax(ffi::ThreadPool& pool, const CheckedArgs& args, ffi::AnyBuffer x,
                         ffi::AnyBuffer out, bool rht) {
    const RowLayout& layout = args.layout;
    const AmaxRangeFn fn = BestTable().amax[Index(args.x)];
    std::atomic<uint32_t> seen{0};
    const int64_t grain = GrainItems(layout.cols, rht ? kGrainElements : kAmaxGrainElements);
    ParallelFor(pool, layout.rows, grain, [&](int64_t begin, int64_t end) {
      AtomicMax(seen, fn(x.untyped_data(), layout.cols, rht, begin, end));
    });
    const uint32_t bits = seen.load();
    *F32Data(out) = AsFloat(bits < kInfBits ? bits : kNanBits);
    return ffi::Error::Success();
  }

  static ffi::Error Quantize(ffi::ThreadPool& pool, const QuantizeCall& call, ffi::AnyBuffer x,
                             ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer codes,
                             ffi::AnyBuffer scales, ffi::AnyBuffer stored_amax) {
    const RowLayout& layout = call.args.layout;
    const float a = *F32Data(amax);
    QuantizeJob job = MakeJob(call.params, x, a, key);
    job.codes = static_cast<uint8_t*>(codes.untyped_data());
    job.scales = static_cast<uint8_t*>(scales.untyped_data());
    AdviseHugePages(codes.untyped_data(), codes.size_bytes());
    // A NaN, inf or negative A gives the non-finite result without reading x.
    const bool finite =
        AmaxValid(a) && RunQuantize(pool, BestTable().quantize[Index(call.args.x)], job);
    const float stored = StoredAmax(a, finite);
    *F32Data(stored_amax) = stored;
    if (stored != stored && layout.size() > 0) {
      // docs/NUMERICS.md section 8: every code 0 and every scale E4M3 NaN.
      std::memset(job.codes, 0, layout.size() / 2);
      std::memset(job.scales, kE4m3Nan, layout.rows * layout.blocks());
    }
    return ffi::Error::Success();
  }

  static ffi::Error FakeQuantize(ffi::ThreadPool& pool, const QuantizeCall& call,
                                 ffi::AnyBuffer x, ffi::AnyBuffer amax, ffi::AnyBuffer key,
                                 ffi::AnyBuffer out, ffi::AnyBuffer stored_amax) {
    const RowLayout& layout = call.args.layout;
    const float a = *F32Data(amax);
    QuantizeJob job = MakeJob(call.params, x, a, key);
    job.values = out.untyped_data();
    AdviseHugePages(out.untyped_data(), out.size_bytes());
    job.global = DecodeGlobal(a, job.six_m);
    const auto fn = BestTable().fake_quantize[Index(call.args.x)][Index(call.args.result)];
    const bool finite = AmaxValid(a) && RunQuantize(pool, fn, job);
    const float stored = StoredAmax(a, finite);
    *F32Data(stored_amax) = stored;
    if (stored != stored && layout.size() > 0) {
      // What dequantizing the non-finite result gives: NaN everywhere, global scale or not.
      VisitFloatType(call.args.result, [&](auto u) {
        using U = decltype(u);
        auto* p = static_cast<typename U::Storage*>(job.values);
        std::fill(p, p + layout.size(), U::Store(AsFloat(kNanBits)));
      });
    }
    return ffi::Error::Success();
  }

  static ffi::Error Dequantize(ffi::ThreadPool& pool, const CheckedArgs& args,
                               ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                               ffi::AnyBuffer decode_scale, ffi::AnyBuffer out, bool rht) {
    DequantizeJob job;
    job.codes = static_cast<const uint8_t*>(codes.untyped_data());
    job.scales = static_cast<const uint8_t*>(scales.untyped_data());
    job.global = *F32Data(decode_scale);  // D: A * RCP2688, or an imported checkpoint's own
    job.cols = args.layout.cols;
    job.rht = rht;
    job.out = out.untyped_data();
    AdviseHugePages(out.untyped_data(), out.size_bytes());
    const DequantizeRangeFn fn = BestTable().dequantize[Index(args.result)];
    ParallelFor(pool, args.layout.rows, GrainItems(job.cols),
                [&](int64_t begin, int64_t end) { fn(job, begin, end); });
    return ffi::Error::Success();
  }

  static ffi::Error Rht(ffi::ThreadPool& pool, const CheckedArgs& args, ffi::AnyBuffer x,
                        ffi::AnyBuffer out, bool inverse) {
    const int64_t cols = args.layout.cols;
    const RhtRangeFn fn = BestTable().rht[Index(args.x)];
    ParallelFor(pool, args.layout.rows, GrainItems(cols), [&](int64_t begin, int64_t end) {
      fn(x.untyped_data(), out.untyped_data(), cols, inverse, begin, end);
    });
    return ffi::Error::Success();
  }
};

}  // namespace
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

using NvFp4Cpu = nvfp4::cpu::Cpu;
NVFP4_DEFINE_HANDLERS(Cpu, NvFp4Cpu);
