// XLA FFI handlers of MS-EDEN on the CPU (docs/NUMERICS.md section 14): the checks of
// nvfp4/checks.h, the kernels of cpu/ms_eden_isa.cc at the instruction-set level cpu/isa.cc
// picked, run over 128-element groups on XLA's intra-op thread pool. The bindings, the
// decoding and the checks are nvfp4/handlers.h's (MsEdenHandlers), shared with the CUDA
// handlers (cuda/ms_eden.cu).
#include <atomic>
#include <cstdint>
#include <cstring>

#include "cpu/kernel_table.h"
#include "cpu/ms_eden.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/bindings.h"
#include "nvfp4/checks.h"
#include "nvfp4/handlers.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {
namespace {

// The MS-EDEN table of the level BestTable() runs (the same choice, by its name).
const MsEdenTable& BestMsEden() {
#if defined(NVFP4_HAVE_X86_VARIANTS)
  const char* isa = BestTable().isa;
  if (std::strcmp(isa, "x86-64-v4") == 0) return avx512::MsEdenKernels();
  if (std::strcmp(isa, "x86-64-v3") == 0) return avx2::MsEdenKernels();
#endif
  return baseline::MsEdenKernels();
}

int Index(FloatType t) { return static_cast<int>(t); }

float* F32Data(ffi::AnyBuffer b) { return static_cast<float*>(b.untyped_data()); }

// The job of all three targets: the groups of x and the sign bits of the rotation.
MsEdenJob MakeJob(const ffi::AnyBuffer& x, const RowLayout& layout,
                  const ffi::AnyBuffer& rotation) {
  MsEdenJob job;
  job.x = x.untyped_data();
  job.groups = layout.size() / kMsEdenGroup;
  const auto* words = static_cast<const uint32_t*>(rotation.untyped_data());
  for (int i = 0; i < kMsEdenGroup; ++i) job.sign_bits[i] = RotationSignBit(words, i);
  return job;
}

void SetKey(MsEdenJob& job, const ffi::AnyBuffer& key) {
  const auto* words = static_cast<const uint32_t*>(key.untyped_data());
  job.k0 = words[0];
  job.k1 = words[1];
  job.counter_offset = static_cast<uint64_t>(words[2]) | static_cast<uint64_t>(words[3]) << 32;
}

// Runs fn over every group; returns the max |y| bits seen (NaN above inf).
uint32_t RunGroups(ffi::ThreadPool& pool, MsEdenRangeFn fn, const MsEdenJob& job) {
  std::atomic<uint32_t> seen{0};
  ParallelFor(pool, job.groups, GrainItems(kMsEdenGroup), [&](int64_t begin, int64_t end) {
    AtomicMax(seen, fn(job, begin, end));
  });
  return seen.load();
}

// The CPU platform of nvfp4/handlers.h's MsEdenHandlers: the kernels on checked arguments.
struct CpuMsEden {
  using Context = ffi::ThreadPool;
  using Binding = ffi::ThreadPool;

  static ffi::Error Amax(ffi::ThreadPool& pool, const CheckedArgs& args, ffi::AnyBuffer x,
                         ffi::AnyBuffer rotation, ffi::AnyBuffer out) {
    const MsEdenJob job = MakeJob(x, args.layout, rotation);
    const uint32_t bits = RunGroups(pool, BestMsEden().amax[Index(args.x)], job);
    *F32Data(out) = AsFloat(bits < kInfBits ? bits : kNanBits);
    return ffi::Error::Success();
  }

  static ffi::Error Quantize(ffi::ThreadPool& pool, const CheckedArgs& args, ffi::AnyBuffer x,
                             ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                             ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                             ffi::AnyBuffer stored_amax) {
    const RowLayout& layout = args.layout;
    const float a = *F32Data(amax);
    MsEdenJob job = MakeJob(x, layout, rotation);
    SetKey(job, key);
    job.g = MakeMsEdenScale(a);
    job.codes = static_cast<uint8_t*>(codes.untyped_data());
    job.scales = static_cast<uint8_t*>(scales.untyped_data());
    // A NaN, inf or negative A gives the non-finite result without reading x.
    const bool finite =
        AmaxValid(a) && RunGroups(pool, BestMsEden().quantize[Index(args.x)], job) < kInfBits;
    const float stored = StoredAmax(a, finite);
    *F32Data(stored_amax) = stored;
    if (stored != stored && layout.size() > 0) {
      // docs/NUMERICS.md section 8: every code 0 and every scale E4M3 NaN.
      std::memset(job.codes, 0, layout.size() / 2);
      std::memset(job.scales, kE4m3Nan, layout.rows * layout.blocks());
    }
    return ffi::Error::Success();
  }

  static ffi::Error FakeQuantize(ffi::ThreadPool& pool, const CheckedArgs& args, ffi::AnyBuffer x,
                                 ffi::AnyBuffer amax, ffi::AnyBuffer key, ffi::AnyBuffer rotation,
                                 ffi::AnyBuffer out, ffi::AnyBuffer stored_amax,
                                 bool global_scale) {
    const RowLayout& layout = args.layout;
    const float a = *F32Data(amax);
    MsEdenJob job = MakeJob(x, layout, rotation);
    SetKey(job, key);
    job.g = MakeMsEdenScale(a);
    job.values = out.untyped_data();
    job.global = global_scale ? MsEdenDecode(a) : 1.0f;
    const auto fn = BestMsEden().fake_quantize[Index(args.x)][Index(args.result)];
    const bool finite = AmaxValid(a) && RunGroups(pool, fn, job) < kInfBits;
    const float stored = StoredAmax(a, finite);
    *F32Data(stored_amax) = stored;
    if (stored != stored && layout.size() > 0) {
      // What dequantizing the non-finite result gives: NaN everywhere.
      VisitFloatType(args.result, [&](auto u) {
        using U = decltype(u);
        auto* p = static_cast<typename U::Storage*>(job.values);
        const typename U::Storage nan = U::Store(AsFloat(kNanBits));
        for (int64_t i = 0; i < layout.size(); ++i) p[i] = nan;
      });
    }
    return ffi::Error::Success();
  }
};

}  // namespace
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

using NvFp4CpuMsEden = nvfp4::cpu::CpuMsEden;
NVFP4_DEFINE_MS_EDEN_HANDLERS(Cpu, NvFp4CpuMsEden);
