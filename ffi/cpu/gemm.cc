// nvfp4_gemm: the NVFP4 x NVFP4 GEMM (docs/NUMERICS.md section 9), CPU only: the argument
// checks, the packing of the operands and the tiles of cpu/gemm_isa.cc at the instruction-set
// level cpu/isa.cc picked, run on XLA's intra-op thread pool. Also the test hooks of its
// threads and of AMX (python/module.cc: set_gemm_threads, set_gemm_amx).
#include <algorithm>
#include <atomic>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#if defined(__linux__) && defined(__x86_64__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

#include "cpu/kernel_table.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/checks.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

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

// The GEMM's threads for tests: at most this many when positive (results never depend on it).
// Also the weight-only GEMM's (cpu/w4a16.cc).
std::atomic<int64_t> gemm_max_threads{0};

int64_t GemmMaxThreads() { return gemm_max_threads.load(); }

namespace {

float* F32Data(ffi::AnyBuffer b) { return static_cast<float*>(b.untyped_data()); }

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
  const int64_t threads = GemmMaxThreads();
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

}  // namespace

void SetGemmMaxThreads(int64_t n) { gemm_max_threads.store(n); }

bool SetGemmAmx(bool allowed) {
  gemm_amx_allowed.store(allowed);
  return allowed && AmxGranted() && std::strcmp(BestTable().isa, "x86-64-v4") == 0;
}

}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

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
