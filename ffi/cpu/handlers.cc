// XLA FFI handlers for the CPU kernels: check arguments, pick the kernel, run it in
// parallel over rows on XLA's intra-op thread pool.
//
// Scalars that change from step to step (amax, the SR key words) are operands, not
// attributes, so new values do not recompile; the static flags are bool attributes.
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {
namespace {

// About this many elements per parallel chunk: large enough to amortize scheduling.
constexpr int64_t kGrainElements = 1 << 16;

int64_t GrainItems(int64_t elements_per_item) {
  return std::max<int64_t>(1, kGrainElements / std::max<int64_t>(1, elements_per_item));
}

int Index(ffi::DataType t) {
  return t == ffi::DataType::BF16 ? kBf16 : (t == ffi::DataType::F16 ? kF16 : kF32);
}

bool IsFloat(ffi::DataType t) {
  return t == ffi::DataType::BF16 || t == ffi::DataType::F16 || t == ffi::DataType::F32;
}

ffi::Error ExpectFloat(const char* target, const char* what, const ffi::AnyBuffer& b) {
  if (IsFloat(b.element_type())) return ffi::Error::Success();
  return Invalid(target, Describe(what, b) + ": expected dtype bf16, f16 or f32");
}

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

ffi::Error AmaxImpl(ffi::ThreadPool pool, ffi::AnyBuffer x,
                    ffi::Result<ffi::Buffer<ffi::F32>> out, bool rht) {
  constexpr const char* kTarget = "nvfp4_amax";
  auto layout = QuantizedLayout(kTarget, "x", x, /*block_2d=*/false);
  if (layout.has_error()) return layout.error();
  if (auto e = ExpectFloat(kTarget, "x", x); e.failure()) return e;
  if (auto e = ExpectScalarF32(kTarget, "result", *out); e.failure()) return e;
  const AmaxRangeFn fn = BestTable().amax[Index(x.element_type())];
  std::atomic<uint32_t> seen{0};
  ParallelFor(pool, layout->rows, GrainItems(layout->cols), [&](int64_t begin, int64_t end) {
    AtomicMax(seen, fn(x.untyped_data(), layout->cols, rht, begin, end));
  });
  const uint32_t bits = seen.load();
  *out->typed_data() = AsFloat(bits < kInfBits ? bits : kNanBits);
  return ffi::Error::Success();
}

ffi::ErrorOr<QuantizeJob> MakeJob(const char* target, const ffi::AnyBuffer& x,
                                  ffi::Buffer<ffi::F32> amax, ffi::Buffer<ffi::U32> key,
                                  bool block_2d, bool rht, bool sr) {
  auto layout = CheckQuantizeInputs(target, x, amax, key, block_2d);
  if (layout.has_error()) return ffi::Unexpected(layout.error());
  if (auto e = ExpectFloat(target, "x", x); e.failure()) return ffi::Unexpected(e);
  QuantizeJob job;
  job.x = x.untyped_data();
  job.rows = layout->rows;
  job.cols = layout->cols;
  job.block_2d = block_2d;
  job.rht = rht;
  job.sr = sr;
  job.g = MakeGlobalScale(*amax.typed_data());
  job.k0 = key.typed_data()[0];
  job.k1 = key.typed_data()[1];
  job.counter_offset = static_cast<uint64_t>(key.typed_data()[2]) |
                       static_cast<uint64_t>(key.typed_data()[3]) << 32;
  return job;
}

ffi::Error QuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                        ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> codes,
                        ffi::Result<ffi::AnyBuffer> scales,
                        ffi::Result<ffi::Buffer<ffi::F32>> stored_amax, bool block_2d,
                        bool rht, bool stochastic_rounding) {
  constexpr const char* kTarget = "nvfp4_quantize";
  auto job = MakeJob(kTarget, x, amax, key, block_2d, rht, stochastic_rounding);
  if (job.has_error()) return job.error();
  const RowLayout layout{job->rows, job->cols};
  if (auto e = CheckCodesAndScales(kTarget, layout, *codes, *scales); e.failure()) return e;
  if (auto e = ExpectScalarF32(kTarget, "stored_amax", *stored_amax); e.failure()) return e;
  job->codes = static_cast<uint8_t*>(codes->untyped_data());
  job->scales = static_cast<uint8_t*>(scales->untyped_data());
  const bool finite =
      RunQuantize(pool, BestTable().quantize[Index(x.element_type())], *job);
  *stored_amax->typed_data() = StoredAmax(*amax.typed_data(), finite);
  return ffi::Error::Success();
}

template <class U>
void FillNan(void* out, int64_t n) {
  auto* p = static_cast<typename U::Storage*>(out);
  std::fill(p, p + n, U::Store(AsFloat(kNanBits)));
}

void FillNan(ffi::DataType t, void* out, int64_t n) {
  if (t == ffi::DataType::BF16) FillNan<Bf16>(out, n);
  if (t == ffi::DataType::F16) FillNan<F16>(out, n);
  if (t == ffi::DataType::F32) FillNan<F32>(out, n);
}

ffi::Error FakeQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Buffer<ffi::F32> amax,
                            ffi::Buffer<ffi::U32> key, ffi::Result<ffi::AnyBuffer> out,
                            bool block_2d, bool rht, bool stochastic_rounding,
                            bool global_scale) {
  constexpr const char* kTarget = "nvfp4_fake_quantize";
  auto job = MakeJob(kTarget, x, amax, key, block_2d, rht, stochastic_rounding);
  if (job.has_error()) return job.error();
  const RowLayout layout{job->rows, job->cols};
  if (auto e = CheckValues(kTarget, "result", layout, *out); e.failure()) return e;
  const float a = *amax.typed_data();
  job->values = out->untyped_data();
  job->global = DecodeGlobal(a);
  job->use_global = global_scale;
  const auto fn = BestTable().fake_quantize[Index(x.element_type())][Index(out->element_type())];
  const bool finite = RunQuantize(pool, fn, *job);
  // Like dequantize: a NaN stored amax (non-finite input or A) makes every value NaN.
  const float stored = StoredAmax(a, finite);
  if (global_scale && stored != stored) FillNan(out->element_type(), job->values, layout.size());
  return ffi::Error::Success();
}

ffi::Error DequantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer codes, ffi::AnyBuffer scales,
                          ffi::Buffer<ffi::F32> amax, ffi::Result<ffi::AnyBuffer> out,
                          bool rht) {
  constexpr const char* kTarget = "nvfp4_dequantize";
  auto layout = QuantizedLayout(kTarget, "codes", codes, /*block_2d=*/false, 2);
  if (layout.has_error()) return layout.error();
  if (auto e = CheckCodesAndScales(kTarget, *layout, codes, scales); e.failure()) return e;
  if (auto e = ExpectScalarF32(kTarget, "amax", amax); e.failure()) return e;
  if (auto e = CheckValues(kTarget, "result", *layout, *out); e.failure()) return e;
  DequantizeJob job;
  job.codes = static_cast<const uint8_t*>(codes.untyped_data());
  job.scales = static_cast<const uint8_t*>(scales.untyped_data());
  job.global = DecodeGlobal(*amax.typed_data());
  job.cols = layout->cols;
  job.rht = rht;
  job.out = out->untyped_data();
  const DequantizeRangeFn fn = BestTable().dequantize[Index(out->element_type())];
  ParallelFor(pool, layout->rows, GrainItems(layout->cols),
              [&](int64_t begin, int64_t end) { fn(job, begin, end); });
  return ffi::Error::Success();
}

ffi::Error RhtImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::Result<ffi::AnyBuffer> out,
                   bool inverse) {
  constexpr const char* kTarget = "nvfp4_rht";
  auto layout = QuantizedLayout(kTarget, "x", x, /*block_2d=*/false);
  if (layout.has_error()) return layout.error();
  if (auto e = ExpectFloat(kTarget, "x", x); e.failure()) return e;
  if (out->element_type() != x.element_type()) {
    return Invalid(kTarget, Describe("result", *out) + ": expected the dtype of x");
  }
  if (auto e = CheckValues(kTarget, "result", *layout, *out); e.failure()) return e;
  const RhtRangeFn fn = BestTable().rht[Index(x.element_type())];
  ParallelFor(pool, layout->rows, GrainItems(layout->cols), [&](int64_t begin, int64_t end) {
    fn(x.untyped_data(), out->untyped_data(), layout->cols, inverse, begin, end);
  });
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4AmaxCpu, nvfp4::cpu::AmaxImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4QuantizeCpu, nvfp4::cpu::QuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<bool>("block_2d")
                                  .Attr<bool>("rht")
                                  .Attr<bool>("stochastic_rounding"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4FakeQuantizeCpu, nvfp4::cpu::FakeQuantizeImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::U32>>()
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
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("rht"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4RhtCpu, nvfp4::cpu::RhtImpl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<bool>("inverse"));
