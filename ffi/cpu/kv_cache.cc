// The NVFP4 KV cache's FFI handlers (CPU only): nvfp4_kv_cache_write, nvfp4_kv_cache_read,
// nvfp4_kv_attention. Python twin: nvfp4_jax/_src/core/kernels/_kv_cache.py; reference:
// nvfp4_jax/_src/core/reference/kv_cache.py; tests: tests/core/test_kv_cache*.py.
//
// The numbers and the page layout are nvfp4/kv_cache.h's (docs/NUMERICS.md section 15); the
// attention's vector loops are cpu/kv_attention_isa.cc's, per ISA. Every operand is checked
// here first (shapes, dtypes, the layout's attributes against the page bytes), so a bad
// call is an ffi::Error naming the operand, never an access outside a buffer; positions
// and lengths are data, clamped to the cache.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "cpu/kernel_table.h"
#include "cpu/kv_attention.h"
#include "cpu/parallel.h"
#include "cpu/run.h"
#include "nvfp4/checks.h"
#include "nvfp4/dtypes.h"
#include "nvfp4/kv_cache.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4::cpu {
namespace {

namespace ffi = xla::ffi;

std::string Fail(const char* target, const char* what, const ffi::AnyBuffer& b,
                 const std::string& problem) {
  return std::string(target) + ": " + what + " of shape " + ShapeString(b.dimensions()) +
         " and dtype " + DtypeName(b.element_type()) + ": " + problem;
}

bool HasDims(const ffi::AnyBuffer& b, std::initializer_list<int64_t> want) {
  const auto d = b.dimensions();
  if (d.size() != want.size()) return false;
  size_t i = 0;
  for (int64_t w : want) {
    if (d[i++] != w) return false;
  }
  return true;
}

// The layout of the attributes, checked; `error` is set on failure.
kv::Layout MakeLayout(const char* target, int32_t page_size, int32_t kv_heads, int32_t head_dim,
                      bool hnd, bool swizzle_k, bool swizzle_v, bool four_over_six,
                      std::string& error) {
  kv::Layout l;
  l.page_size = page_size;
  l.heads = kv_heads;
  l.head_dim = head_dim;
  l.hnd = hnd;
  l.swizzle[0] = swizzle_k;
  l.swizzle[1] = swizzle_v;
  l.four_over_six = four_over_six;
  const bool swizzled = swizzle_k || swizzle_v;
  if (page_size < 4 || page_size % 4 || kv_heads < 1 || head_dim < kBlock ||
      head_dim % kBlock || head_dim > kBlock * kKvMaxBlocks ||
      (swizzled && (head_dim / kBlock) % 4)) {
    error = std::string(target) + ": attributes page_size=" + std::to_string(page_size) +
            ", kv_heads=" + std::to_string(kv_heads) + ", head_dim=" +
            std::to_string(head_dim) +
            ": need page_size a positive multiple of 4, head_dim a multiple of 16 up to 512 "
            "(of 64 with swizzled scales)";
  }
  return l;
}

// pages u8 (B, P, 2, W) with W = the layout's page bytes; returns "" or the problem.
std::string CheckPages(const char* target, const ffi::AnyBuffer& pages, const kv::Layout& l) {
  const auto d = pages.dimensions();
  if (pages.element_type() != ffi::DataType::U8 || d.size() != 4 || d[2] != 2 ||
      d[3] != l.page_bytes()) {
    return Fail(target, "pages", pages,
                "expected u8 (B, P, 2, " + std::to_string(l.page_bytes()) + ")");
  }
  return "";
}

std::string CheckScales(const char* target, const ffi::AnyBuffer& scales) {
  if (scales.element_type() != ffi::DataType::F32 || !HasDims(scales, {2})) {
    return Fail(target, "scales", scales, "expected f32 (2,): k_scale, v_scale");
  }
  return "";
}

bool ParseFloat(const ffi::AnyBuffer& b, FloatType& t) {
  switch (b.element_type()) {
    case ffi::DataType::BF16: t = FloatType::kBf16; return true;
    case ffi::DataType::F16: t = FloatType::kF16; return true;
    case ffi::DataType::F32: t = FloatType::kF32; return true;
    default: return false;
  }
}

// Element i of a bf16, f16 or f32 buffer as f32 (exact).
float LoadAt(FloatType t, const void* data, int64_t i) {
  return VisitFloatType(t, [&](auto u) {
    using U = decltype(u);
    return U::Load(static_cast<const typename U::Storage*>(data)[i]);
  });
}

ffi::Error KvCacheWriteImpl(ffi::ThreadPool pool, ffi::AnyBuffer pages, ffi::AnyBuffer k,
                            ffi::AnyBuffer v, ffi::AnyBuffer positions, ffi::AnyBuffer scales,
                            ffi::Result<ffi::AnyBuffer> out, int32_t page_size, bool hnd,
                            bool swizzle_k, bool swizzle_v, bool four_over_six,
                            int32_t kv_heads, int32_t head_dim) {
  constexpr const char* kTarget = "nvfp4_kv_cache_write";
  std::string error;
  const kv::Layout l = MakeLayout(kTarget, page_size, kv_heads, head_dim, hnd, swizzle_k,
                                  swizzle_v, four_over_six, error);
  if (error.empty()) error = CheckPages(kTarget, pages, l);
  const auto pd = pages.dimensions();
  const int64_t batch = error.empty() ? pd[0] : 0, npages = error.empty() ? pd[1] : 0;
  FloatType kt = FloatType::kF32, vt = FloatType::kF32;
  int64_t tokens = 0;
  if (error.empty()) {
    const auto kd = k.dimensions();
    if (!ParseFloat(k, kt) || kd.size() != 4 || kd[0] != batch || kd[2] != l.heads ||
        kd[3] != l.head_dim) {
      error = Fail(kTarget, "k", k, "expected bf16, f16 or f32 (B, T, G, E) of the cache's B, G, E");
    } else {
      tokens = kd[1];
    }
  }
  if (error.empty() && (!ParseFloat(v, vt) || !HasDims(v, {batch, tokens, l.heads, l.head_dim}))) {
    error = Fail(kTarget, "v", v, "expected bf16, f16 or f32 of k's shape");
  }
  if (error.empty() && (positions.element_type() != ffi::DataType::S32 || !HasDims(positions, {batch}))) {
    error = Fail(kTarget, "positions", positions, "expected s32 (B,)");
  }
  if (error.empty()) error = CheckScales(kTarget, scales);
  if (error.empty() && (out->element_type() != ffi::DataType::U8 ||
                        out->size_bytes() != pages.size_bytes())) {
    error = Fail(kTarget, "result", *out, "expected the pages' shape and dtype");
  }
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != pages.untyped_data()) {  // not aliased: start from the pages' bytes
    std::memcpy(dst, pages.untyped_data(), pages.size_bytes());
  }
  const auto* pos = static_cast<const int32_t*>(positions.untyped_data());
  const auto* sc = static_cast<const float*>(scales.untyped_data());
  const int64_t capacity = npages * l.page_size, w = l.page_bytes();
  const void* src[2] = {k.untyped_data(), v.untyped_data()};
  const FloatType types[2] = {kt, vt};
  ParallelFor(pool, batch * tokens, GrainItems(2 * l.heads * l.head_dim * 8),
              [&](int64_t begin, int64_t end) {
                float x[kBlock];
                uint8_t codes[kBlock / 2];
                for (int64_t item = begin; item < end; ++item) {
                  const int64_t b = item / tokens, t = item % tokens;
                  const int64_t slot = static_cast<int64_t>(pos[b]) + t;
                  if (slot < 0 || slot >= capacity) continue;  // vLLM's skipped slot
                  const int64_t page = slot / l.page_size, o = slot % l.page_size;
                  for (int side = 0; side < 2; ++side) {
                    uint8_t* bytes = dst + ((b * npages + page) * 2 + side) * w;
                    for (int64_t h = 0; h < l.heads; ++h) {
                      const int64_t first = (item * l.heads + h) * l.head_dim;
                      uint8_t* data = bytes + l.DataOffset(o, h);
                      for (int64_t c = 0; c < l.scale_dim(); ++c) {
                        for (int i = 0; i < kBlock; ++i) {
                          x[i] = LoadAt(types[side], src[side], first + c * kBlock + i);
                        }
                        const uint32_t scale = kv::QuantizeBlock(x, sc[side], l.four_over_six, codes);
                        std::memcpy(data + c * (kBlock / 2), codes, kBlock / 2);
                        bytes[l.ScaleOffset(side, o, h, c)] = static_cast<uint8_t>(scale);
                      }
                    }
                  }
                }
              });
  return ffi::Error::Success();
}

ffi::Error KvCacheReadImpl(ffi::ThreadPool pool, ffi::AnyBuffer pages, ffi::AnyBuffer scales,
                           ffi::Result<ffi::AnyBuffer> k, ffi::Result<ffi::AnyBuffer> v,
                           int32_t page_size, bool hnd, bool swizzle_k, bool swizzle_v,
                           bool four_over_six, int32_t kv_heads, int32_t head_dim) {
  constexpr const char* kTarget = "nvfp4_kv_cache_read";
  std::string error;
  const kv::Layout l = MakeLayout(kTarget, page_size, kv_heads, head_dim, hnd, swizzle_k,
                                  swizzle_v, four_over_six, error);
  if (error.empty()) error = CheckPages(kTarget, pages, l);
  if (error.empty()) error = CheckScales(kTarget, scales);
  const auto pd = pages.dimensions();
  const int64_t batch = error.empty() ? pd[0] : 0, npages = error.empty() ? pd[1] : 0;
  const int64_t capacity = npages * l.page_size;
  FloatType types[2] = {FloatType::kF32, FloatType::kF32};
  ffi::AnyBuffer* outs[2] = {&*k, &*v};
  for (int side = 0; side < 2 && error.empty(); ++side) {
    if (!ParseFloat(*outs[side], types[side]) ||
        !HasDims(*outs[side], {batch, capacity, l.heads, l.head_dim})) {
      error = Fail(kTarget, side ? "v" : "k", *outs[side],
                   "expected bf16, f16 or f32 (B, P * page_size, G, E)");
    }
  }
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  const auto* src = static_cast<const uint8_t*>(pages.untyped_data());
  const auto* sc = static_cast<const float*>(scales.untyped_data());
  const int64_t w = l.page_bytes();
  ParallelFor(pool, batch * capacity, GrainItems(4 * l.heads * l.head_dim),
              [&](int64_t begin, int64_t end) {
                for (int64_t item = begin; item < end; ++item) {
                  const int64_t b = item / capacity, slot = item % capacity;
                  const int64_t page = slot / l.page_size, o = slot % l.page_size;
                  for (int side = 0; side < 2; ++side) {
                    const uint8_t* bytes = src + ((b * npages + page) * 2 + side) * w;
                    VisitFloatType(types[side], [&](auto u) {
                      using U = decltype(u);
                      auto* dst = static_cast<typename U::Storage*>(outs[side]->untyped_data());
                      for (int64_t h = 0; h < l.heads; ++h) {
                        const uint8_t* data = bytes + l.DataOffset(o, h);
                        auto* row = dst + (item * l.heads + h) * l.head_dim;
                        for (int64_t c = 0; c < l.scale_dim(); ++c) {
                          const float f =
                              kv::DecodeFactor(bytes[l.ScaleOffset(side, o, h, c)], sc[side]);
                          for (int i = 0; i < kBlock; ++i) {
                            const uint32_t code = (data[c * 8 + i / 2] >> (4 * (i & 1))) & 15u;
                            row[c * kBlock + i] = U::Store(E2m1ToF32(code) * f);
                          }
                        }
                      }
                    });
                  }
                }
              });
  return ffi::Error::Success();
}

// The attention kernel of the variant `table` is (the same choice, by its name).
KvAttentionItemFn KvAttentionKernelOf(const KernelTable& table) {
#if defined(NVFP4_HAVE_X86_VARIANTS)
  const char* isa = table.isa;
  if (std::strcmp(isa, "x86-64-v4") == 0) return avx512::KvAttentionKernel();
  if (std::strcmp(isa, "x86-64-v3") == 0) return avx2::KvAttentionKernel();
#endif
  return baseline::KvAttentionKernel();
}

struct AttentionArgs {
  kv::Layout layout;
  FloatType q = FloatType::kF32;
  int64_t batch = 0, tokens = 0, heads = 0, pages = 0;
};

std::string CheckAttention(const ffi::AnyBuffer& q, const ffi::AnyBuffer& pages,
                           const ffi::AnyBuffer& scales, const ffi::AnyBuffer& lengths,
                           const ffi::AnyBuffer& softmax_scale, const ffi::AnyBuffer& out,
                           AttentionArgs& a) {
  constexpr const char* kTarget = "nvfp4_kv_attention";
  std::string error = CheckPages(kTarget, pages, a.layout);
  if (!error.empty()) return error;
  a.batch = pages.dimensions()[0];
  a.pages = pages.dimensions()[1];
  const auto qd = q.dimensions();
  if (!ParseFloat(q, a.q) || qd.size() != 4 || qd[0] != a.batch || qd[3] != a.layout.head_dim ||
      qd[2] % a.layout.heads) {
    return Fail(kTarget, "q", q,
                "expected bf16, f16 or f32 (B, T, H, E), H a multiple of the cache's G");
  }
  a.tokens = qd[1];
  a.heads = qd[2];
  error = CheckScales(kTarget, scales);
  if (!error.empty()) return error;
  if (lengths.element_type() != ffi::DataType::S32 || !HasDims(lengths, {a.batch})) {
    return Fail(kTarget, "lengths", lengths, "expected s32 (B,)");
  }
  if (softmax_scale.element_type() != ffi::DataType::F32 || softmax_scale.dimensions().size()) {
    return Fail(kTarget, "softmax_scale", softmax_scale, "expected an f32 scalar");
  }
  if (out.element_type() != ffi::DataType::F32 ||
      !HasDims(out, {a.batch, a.tokens, a.heads, a.layout.head_dim})) {
    return Fail(kTarget, "result", out, "expected f32 of q's shape");
  }
  return "";
}

// The offset tables of the job (see KvAttentionJob).
struct Offsets {
  std::vector<int64_t> data_t, data_h, scale_ts[2], scale_h;

  explicit Offsets(const kv::Layout& l) {
    for (int64_t t = 0; t < l.page_size; ++t) data_t.push_back(l.DataOffset(t, 0));
    for (int64_t h = 0; h < l.heads; ++h) {
      data_h.push_back(l.DataOffset(0, h));
      scale_h.push_back(l.ScaleOffset(0, 0, h, 0) - l.ScaleOffset(0, 0, 0, 0));
    }
    for (int side = 0; side < 2; ++side) {
      for (int64_t t = 0; t < l.page_size; ++t) {
        for (int64_t s = 0; s < l.scale_dim(); ++s) scale_ts[side].push_back(l.ScaleOffset(side, t, 0, s));
      }
    }
  }
};

// Combines the chunks of every row in ascending order (docs/NUMERICS.md section 15).
void Combine(const KvAttentionJob& job, float* out) {
  const int64_t e = job.layout.head_dim, m_all = job.rows();
  for (int64_t bg = 0; bg < job.batch * job.layout.heads; ++bg) {
    const int64_t b = bg / job.layout.heads, g = bg % job.layout.heads;
    for (int64_t m = 0; m < m_all; ++m) {
      const int64_t t = m / job.group, h = g * job.group + m % job.group;
      const int64_t seen = job.visible[b * job.tokens + t];
      float* dst = out + ((b * job.tokens + t) * job.q_heads + h) * e;
      const int64_t used = (seen + kKvChunk - 1) / kKvChunk;  // chunks with a visible slot
      float top = -AsFloat(kInfBits);
      for (int64_t u = 0; u < used; ++u) {
        const float mx = job.part_max[(bg * job.chunks + u) * m_all + m];
        top = mx > top ? mx : top;
      }
      float total = 0.0f;
      for (int64_t i = 0; i < e; ++i) dst[i] = 0.0f;
      for (int64_t u = 0; u < used; ++u) {
        const int64_t p = (bg * job.chunks + u) * m_all + m;
        const float w = KvExp(job.part_max[p] - top);
        total = total + w * job.part_sum[p];
        const float* o = job.part_out + p * e;
        for (int64_t i = 0; i < e; ++i) dst[i] = dst[i] + w * o[i];
      }
      if (used == 0) continue;  // no visible slot: zeros
      for (int64_t i = 0; i < e; ++i) dst[i] = dst[i] / total;
    }
  }
}

ffi::Error KvAttentionImpl(ffi::ThreadPool pool, ffi::AnyBuffer q, ffi::AnyBuffer pages,
                           ffi::AnyBuffer scales, ffi::AnyBuffer lengths,
                           ffi::AnyBuffer softmax_scale, ffi::Result<ffi::AnyBuffer> out,
                           int32_t page_size, bool hnd, bool swizzle_k, bool swizzle_v,
                           bool four_over_six, int32_t kv_heads, int32_t head_dim) {
  std::string error;
  AttentionArgs a;
  a.layout = MakeLayout("nvfp4_kv_attention", page_size, kv_heads, head_dim, hnd, swizzle_k,
                        swizzle_v, four_over_six, error);
  if (error.empty()) error = CheckAttention(q, pages, scales, lengths, softmax_scale, *out, a);
  if (!error.empty()) return ffi::Error::InvalidArgument(error);
  KvAttentionJob job;
  job.layout = a.layout;
  job.batch = a.batch;
  job.tokens = a.tokens;
  job.q_heads = a.heads;
  job.pages = a.pages;
  job.group = a.heads / a.layout.heads;
  job.chunks = (job.slots() + kKvChunk - 1) / kKvChunk;
  if (job.batch == 0 || job.tokens == 0 || job.q_heads == 0) return ffi::Error::Success();
  // The queries in f32 (exact), and what each query sees, clamped to the cache.
  std::vector<float> qf(q.element_count());
  for (size_t i = 0; i < qf.size(); ++i) qf[i] = LoadAt(a.q, q.untyped_data(), i);
  std::vector<int32_t> visible(job.batch * job.tokens);
  const auto* len = static_cast<const int32_t*>(lengths.untyped_data());
  for (int64_t b = 0; b < job.batch; ++b) {
    for (int64_t t = 0; t < job.tokens; ++t) {
      const int64_t seen = static_cast<int64_t>(len[b]) - (job.tokens - 1 - t);
      visible[b * job.tokens + t] = static_cast<int32_t>(std::clamp<int64_t>(seen, 0, job.slots()));
    }
  }
  const Offsets offsets(a.layout);
  const int64_t partials = job.items() * job.rows();
  std::vector<float> part_max(partials), part_sum(partials), part_out(partials * a.layout.head_dim);
  const auto* sc = static_cast<const float*>(scales.untyped_data());
  job.q = qf.data();
  job.cache = static_cast<const uint8_t*>(pages.untyped_data());
  job.visible = visible.data();
  job.scale[0] = sc[0];
  job.scale[1] = sc[1];
  job.softmax_scale = *static_cast<const float*>(softmax_scale.untyped_data());
  // One read of the variant for the whole call: the kernel and its tables' form agree even
  // if a test forces another variant meanwhile.
  const KernelTable& variant = BestTable();
  std::vector<float> tables(2 * 256 * kBlock);
  for (int side = 0; side < 2; ++side) {
    float* table = tables.data() + side * 256 * kBlock;
    for (uint32_t byte = 0; byte < 256; ++byte) {
      const float factor = kv::DecodeFactor(byte, sc[side]);
      for (uint32_t code = 0; code < kBlock; ++code) {
        table[byte * kBlock + code] = E2m1ToF32(code) * factor;
      }
    }
    variant.to_lookup_table(table);
    job.tables[side] = table;
  }
  job.data_t = offsets.data_t.data();
  job.data_h = offsets.data_h.data();
  job.scale_ts[0] = offsets.scale_ts[0].data();
  job.scale_ts[1] = offsets.scale_ts[1].data();
  job.scale_h = offsets.scale_h.data();
  job.part_max = part_max.data();
  job.part_sum = part_sum.data();
  job.part_out = part_out.data();
  const KvAttentionItemFn fn = KvAttentionKernelOf(variant);
  ParallelFor(pool, job.items(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) fn(job, item);
  });
  Combine(job, static_cast<float*>(out->untyped_data()));
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4::cpu

namespace ffi = xla::ffi;

// The layout attributes every KV cache target takes after its operands and results.
template <class Binding>
auto WithKvLayout(Binding&& binding) {
  return std::forward<Binding>(binding)
      .template Attr<int32_t>("page_size")
      .template Attr<bool>("hnd")
      .template Attr<bool>("swizzle_k")
      .template Attr<bool>("swizzle_v")
      .template Attr<bool>("four_over_six")
      .template Attr<int32_t>("kv_heads")
      .template Attr<int32_t>("head_dim");
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4KvCacheWriteCpu, nvfp4::cpu::KvCacheWriteImpl,
                              WithKvLayout(ffi::Ffi::Bind()
                                               .Ctx<ffi::ThreadPool>()
                                               .Arg<ffi::AnyBuffer>()    // pages
                                               .Arg<ffi::AnyBuffer>()    // k
                                               .Arg<ffi::AnyBuffer>()    // v
                                               .Arg<ffi::AnyBuffer>()    // positions
                                               .Arg<ffi::AnyBuffer>()    // scales
                                               .Ret<ffi::AnyBuffer>()));  // pages (aliased)

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4KvCacheReadCpu, nvfp4::cpu::KvCacheReadImpl,
                              WithKvLayout(ffi::Ffi::Bind()
                                               .Ctx<ffi::ThreadPool>()
                                               .Arg<ffi::AnyBuffer>()    // pages
                                               .Arg<ffi::AnyBuffer>()    // scales
                                               .Ret<ffi::AnyBuffer>()    // k
                                               .Ret<ffi::AnyBuffer>()));  // v

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4KvAttentionCpu, nvfp4::cpu::KvAttentionImpl,
                              WithKvLayout(ffi::Ffi::Bind()
                                               .Ctx<ffi::ThreadPool>()
                                               .Arg<ffi::AnyBuffer>()    // q
                                               .Arg<ffi::AnyBuffer>()    // pages
                                               .Arg<ffi::AnyBuffer>()    // scales
                                               .Arg<ffi::AnyBuffer>()    // lengths
                                               .Arg<ffi::AnyBuffer>()    // softmax_scale
                                               .Ret<ffi::AnyBuffer>()));  // out
