// The NVFP4 KV cache's numbers and byte layout (docs/NUMERICS.md section 15,
// docs/SERVING_FORMATS.md section 6), shared by the kernels that write and read it.
//
// Each 16-block of one token's head is quantized with the side's decode scale s (vLLM's
// k_scale or v_scale), exactly as the jnp reference (nvfp4_jax/_src/core/reference/
// kv_cache.py) writes it, in f32 with every operation rounded once:
//
//   S_enc = 1 / s;   sf_c = e4m3(min(S_enc * (amax_b * r_c), 448)),  r_6 = RCP6, r_4 = 0.25
//   enc_c = sf_c == 0 ? 0 : 1 / (f32(sf_c) * s);   code = e2m1_rn(x * enc_c)
//
// (vLLM's writer takes the same steps with approximate reciprocals, rcp.approx.ftz.f32, for
// RCP6, for 1 / S_enc inside enc and for enc itself.) Four Over Six keeps c = 4 where
//   err_c = sum_i (d_2i^2 + d_2i+1^2), d = value(code_c) * (f32(sf_c) * s) - x
// is strictly smaller than err_6. A block holding NaN or inf, or an invalid s, stores the
// E4M3 NaN scale and codes 0.
//
// The layout of one page and side (W bytes): the packed codes of every (token, head), then
// their scales; HND puts a head's tokens together, NHD a token's heads; a swizzled side
// stores scale (t, s) of a head's (page_size, S = E/16) tile at
// (4 * (t / 4) + s / (S / 4), (s % (S / 4)) * 4 + t % 4).
#ifndef NVFP4_KV_CACHE_H_
#define NVFP4_KV_CACHE_H_

#include <cstdint>

#include "nvfp4/numerics.h"

namespace nvfp4::kv {

// The static layout of a cache (the FFI attributes).
struct Layout {
  int64_t page_size = 16;
  int64_t heads = 1;     // G, key/value heads
  int64_t head_dim = 16;  // E
  bool hnd = true;
  bool swizzle[2] = {false, true};  // K, V
  bool four_over_six = false;

  int64_t data_dim() const { return head_dim / 2; }
  int64_t scale_dim() const { return head_dim / kBlock; }
  int64_t data_bytes() const { return heads * page_size * data_dim(); }
  int64_t page_bytes() const { return heads * page_size * (data_dim() + scale_dim()); }

  // Byte offset, within one side of a page, of the codes of (token t of the page, head h).
  int64_t DataOffset(int64_t t, int64_t h) const {
    return (hnd ? h * page_size + t : t * heads + h) * data_dim();
  }

  // Byte offset, within one side of a page, of scale s of (token t, head h).
  int64_t ScaleOffset(int side, int64_t t, int64_t h, int64_t s) const {
    const int64_t dim = scale_dim();
    if (swizzle[side]) {
      const int64_t group = dim / 4;
      const int64_t ts = 4 * (t / 4) + s / group;
      s = (s % group) * 4 + t % 4;
      t = ts;
    }
    return data_bytes() + (hnd ? h * page_size + t : t * heads + h) * dim + s;
  }
};

// A valid decode scale: finite and positive.
NVFP4_HD bool ScaleValid(float s) { return s > 0.0f && AsBits(s) < kInfBits; }

// One candidate: the E4M3 scale byte and the encode factor of a block of max |x| `amax`.
struct Candidate {
  uint32_t scale;
  float encode;
};

NVFP4_HD Candidate MakeCandidate(float amax, float s_enc, float s, float rcp) {
  const uint32_t scale = F32ToE4m3(MinNan(s_enc * (amax * rcp), kE4m3Max));
  const float sf = E4m3ToF32(scale);
  return Candidate{scale, sf == 0.0f ? 0.0f : 1.0f / (sf * s)};
}

// The squared error of quantizing x with a candidate, in vLLM's pair order.
NVFP4_HD float SquaredError(const float x[kBlock], const Candidate& c, float s) {
  const float factor = E4m3ToF32(c.scale) * s;
  float err = 0.0f;
  for (int i = 0; i < kBlock; i += 2) {
    float sq[2];
    for (int j = 0; j < 2; ++j) {
      const float value = E2m1ToF32(E2m1Rn(x[i + j] * c.encode));  // signed
      const float d = value * factor - x[i + j];
      sq[j] = d * d;
    }
    err = err + (sq[0] + sq[1]);
  }
  return err;
}

// Quantizes one block: 8 packed bytes (element 2i in the low nibble) and the scale byte.
NVFP4_HD uint32_t QuantizeBlock(const float x[kBlock], float s, bool four_over_six,
                                uint8_t codes[kBlock / 2]) {
  float amax = 0.0f;
  bool finite = ScaleValid(s);
  for (int i = 0; i < kBlock; ++i) {
    const uint32_t a = AsBits(x[i]) & kAbsMask;
    finite = finite && a < kInfBits;
    amax = AsFloat(a) > amax ? AsFloat(a) : amax;
  }
  if (!finite) {
    for (int i = 0; i < kBlock / 2; ++i) codes[i] = 0;
    return kE4m3Nan;
  }
  const float s_enc = 1.0f / s;
  Candidate c = MakeCandidate(amax, s_enc, s, AsFloat(kRcp6Bits));
  if (four_over_six) {
    const Candidate c4 = MakeCandidate(amax, s_enc, s, 0.25f);
    if (SquaredError(x, c4, s) < SquaredError(x, c, s)) c = c4;
  }
  for (int i = 0; i < kBlock / 2; ++i) {
    const uint32_t lo = E2m1Rn(x[2 * i] * c.encode);
    const uint32_t hi = E2m1Rn(x[2 * i + 1] * c.encode);
    codes[i] = static_cast<uint8_t>(lo | (hi << 4));
  }
  return c.scale;
}

// The decode factor of a scale byte: f32(sf) * s (the dequantized element is
// value(code) * factor, rounded once).
NVFP4_HD float DecodeFactor(uint32_t scale, float s) { return E4m3ToF32(scale) * s; }

}  // namespace nvfp4::kv

#endif  // NVFP4_KV_CACHE_H_
