// nvfp4_threefry2x32: the threefry hash of the SR keys (nvfp4/numerics.h, Threefry2x32),
// CPU only.
#include <algorithm>
#include <cstdint>
#include <string>

#include "nvfp4/checks.h"
#include "nvfp4/numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {
namespace {

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
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4Threefry2x32Cpu, nvfp4::cpu::Threefry2x32Impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Ret<ffi::AnyBuffer>());
