// nvfp4_grouped_quantize: the grouped quantization of ragged_dot (docs/NUMERICS.md section
// 12), CPU only. Python twin: nvfp4_jax/_src/core/kernels/_grouped.py; reference: the jnp
// block math of nvfp4_jax/_src/training/ragged/operands.py (`quantize_rows`,
// `quantize_tokens`); tests: tests/training/test_ragged_operands.py.
//
// x (R, C) is quantized along C in 1x16 blocks. Group g is its own tensor, with its own
// stored amax A_g and stochastic-rounding key (k0, k1)_g, numbered from its own first
// element (counter offset 0), exactly as nvfp4_quantize quantizes that tensor alone:
//
//   rows mode:    group g is rows [start_g, start_g + size_g) of x, a (size_g, C) tensor;
//   columns mode: group g is columns [start_g, start_g + size_g) of every row (start and
//                 size multiples of 16), a (R, size_g) tensor: the grouped padded layout.
//
// Everything no group covers gets codes 0 and scales +0; a group whose A_g is NaN, infinite
// or negative (a non-finite group) gets codes 0 and E4M3 NaN scales (section 8). The group
// bounds are data: bounds outside x are an error, never an out-of-bounds access.
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

namespace nvfp4::cpu {
namespace {

namespace ffi = xla::ffi;

constexpr const char* kTarget = "nvfp4_grouped_quantize";

struct GroupedArgs {
  RowLayout layout;
  FloatType x = FloatType::kF32;
  int64_t groups = 0;
};

ffi::ErrorOr<GroupedArgs> CheckGroupedArgs(const ffi::AnyBuffer& x, const ffi::AnyBuffer& bounds,
                                           const ffi::AnyBuffer& amax, const ffi::AnyBuffer& keys,
                                           const ffi::AnyBuffer& codes,
                                           const ffi::AnyBuffer& scales) {
  ArgChecker c(kTarget);
  GroupedArgs a;
  a.x = c.Float("x", x);
  a.layout = c.Layout("x", x, /*block_2d=*/false);
  a.groups = static_cast<int64_t>(amax.element_count());
  c.Dtype("amax", amax, ffi::DataType::F32, " (one stored amax per group)");
  c.CountOf("bounds", bounds, ffi::DataType::S32, 2 * a.groups);
  c.CountOf("keys", keys, ffi::DataType::U32, 2 * a.groups);
  c.CodesAndScales(a.layout, codes, scales);
  auto checked = c.Finish(CheckedArgs{a.layout, a.x, a.x});
  if (checked.has_error()) return ffi::Unexpected(checked.error());
  return a;
}

int64_t ElementBytes(FloatType t) { return t == FloatType::kF32 ? 4 : 2; }

// The group's codes and scales, in a (rows, cols) tensor of its own, quantized as
// nvfp4_quantize would; returns false for a non-finite group (then the outputs are the
// non-finite fill).
bool QuantizeGroup(ffi::ThreadPool& pool, QuantizeRangeFn fn, const void* x, int64_t rows,
                   int64_t cols, float amax, const uint32_t* key, bool sr, uint8_t* codes,
                   uint8_t* scales) {
  const int64_t size = rows * cols;
  bool finite = AmaxValid(amax);
  if (finite && size > 0) {
    QuantizeJob job;
    job.x = x;
    job.rows = rows;
    job.cols = cols;
    job.sr = sr;
    job.g = MakeGlobalScale(amax);
    job.amax = amax;
    job.k0 = key[0];
    job.k1 = key[1];
    job.counter_offset = 0;  // the group's own tensor, numbered from its first element
    job.codes = codes;
    job.scales = scales;
    finite = RunQuantize(pool, fn, job);
  }
  if (!finite && size > 0) {
    std::memset(codes, 0, size / 2);
    std::memset(scales, kE4m3Nan, size / kBlock);
  }
  return finite;
}

ffi::Error GroupedQuantizeImpl(ffi::ThreadPool pool, ffi::AnyBuffer x, ffi::AnyBuffer bounds,
                               ffi::AnyBuffer amax, ffi::AnyBuffer keys,
                               ffi::Result<ffi::AnyBuffer> codes,
                               ffi::Result<ffi::AnyBuffer> scales, bool columns,
                               bool stochastic_rounding) {
  auto args = CheckGroupedArgs(x, bounds, amax, keys, *codes, *scales);
  if (args.has_error()) return args.error();
  const RowLayout& l = args->layout;
  const int64_t es = ElementBytes(args->x);
  const auto* bound = static_cast<const int32_t*>(bounds.untyped_data());
  const auto* amaxes = static_cast<const float*>(amax.untyped_data());
  const auto* words = static_cast<const uint32_t*>(keys.untyped_data());
  const auto* xs = static_cast<const uint8_t*>(x.untyped_data());
  auto* out_codes = static_cast<uint8_t*>(codes->untyped_data());
  auto* out_scales = static_cast<uint8_t*>(scales->untyped_data());
  // Every group's bounds are checked before anything is written.
  const int64_t extent = columns ? l.cols : l.rows;
  for (int64_t g = 0; g < args->groups; ++g) {
    const int64_t start = bound[2 * g], size = bound[2 * g + 1];
    const bool aligned = !columns || (start % kBlock == 0 && size % kBlock == 0);
    if (start < 0 || size < 0 || start > extent - size || !aligned) {
      return ffi::Error::InvalidArgument(
          std::string(kTarget) + ": group " + std::to_string(g) + " spans [" +
          std::to_string(start) + ", " + std::to_string(start + size) + ") of the " +
          (columns ? "columns" : "rows") + " of x of " + std::to_string(l.rows) + " x " +
          std::to_string(l.cols) + (columns ? " (bounds must be multiples of 16)" : ""));
    }
  }
  std::memset(out_codes, 0, l.size() / 2);
  std::memset(out_scales, 0, l.rows * l.blocks());
  const QuantizeRangeFn fn = BestTable().quantize[static_cast<int>(args->x)];
  std::vector<uint8_t> slab, slab_codes, slab_scales;
  for (int64_t g = 0; g < args->groups; ++g) {
    const int64_t start = bound[2 * g], size = bound[2 * g + 1];
    if (size == 0) continue;
    const uint32_t* key = words + 2 * g;
    if (!columns) {
      QuantizeGroup(pool, fn, xs + start * l.cols * es, size, l.cols, amaxes[g], key,
                    stochastic_rounding, out_codes + start * l.cols / 2,
                    out_scales + start * l.blocks());
      continue;
    }
    // A column range: copied into a (rows, size) tensor of its own, quantized, copied back.
    slab.resize(l.rows * size * es);
    slab_codes.resize(l.rows * size / 2);
    slab_scales.resize(l.rows * size / kBlock);
    for (int64_t r = 0; r < l.rows; ++r) {
      std::memcpy(slab.data() + r * size * es, xs + (r * l.cols + start) * es, size * es);
    }
    QuantizeGroup(pool, fn, slab.data(), l.rows, size, amaxes[g], key, stochastic_rounding,
                  slab_codes.data(), slab_scales.data());
    for (int64_t r = 0; r < l.rows; ++r) {
      std::memcpy(out_codes + (r * l.cols + start) / 2, slab_codes.data() + r * size / 2,
                  size / 2);
      std::memcpy(out_scales + (r * l.cols + start) / kBlock,
                  slab_scales.data() + r * size / kBlock, size / kBlock);
    }
  }
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4::cpu

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4GroupedQuantizeCpu, nvfp4::cpu::GroupedQuantizeImpl,
                              xla::ffi::Ffi::Bind()
                                  .Ctx<xla::ffi::ThreadPool>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Arg<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Ret<xla::ffi::AnyBuffer>()
                                  .Attr<bool>("columns")
                                  .Attr<bool>("stochastic_rounding"));
