// nvfp4_w4a16: the weight-only GEMM (docs/NUMERICS.md section 9), CPU only: the argument
// checks, the activations in f32 and the per-scale tables of the weight, and the kernels of
// cpu/w4a16_isa.cc at the instruction-set level cpu/isa.cc picked, run on XLA's intra-op
// thread pool (at most GemmMaxThreads() threads, as the GEMM).
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

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

float* F32Data(ffi::AnyBuffer b) { return static_cast<float*>(b.untyped_data()); }

// The W4A16 kernel of the variant `table` is (the same choice, by its name).
W4a16RangeFn W4a16KernelOf(const KernelTable& table, FloatType x) {
#if defined(NVFP4_HAVE_X86_VARIANTS)
  const char* isa = table.isa;
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
  const int64_t threads = GemmMaxThreads();
  // One read of the variant for the whole call: the kernel and its tables' form agree even
  // if a test forces another variant meanwhile.
  const KernelTable& table = BestTable();
  const W4a16RangeFn fn = W4a16KernelOf(table, s.x);
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
    table.to_lookup_table(tables);
    job.x = xf.data() + xo * s.m * s.k;
    job.codes = c + wo * s.n * (s.k / 2);
    job.scales = sc + wo * s.n * (s.k / kBlock);
    job.out = o + b * s.m * s.n;
    ParallelFor(pool, s.n, grain, [&](int64_t begin, int64_t end) { fn(job, begin, end); },
                threads);
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4W4a16Cpu, nvfp4::cpu::W4a16Impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
