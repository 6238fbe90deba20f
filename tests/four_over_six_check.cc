// Four Over Six as the CUDA kernels compute it (ffi/cuda/kernels.cuh), run on the host: the
// scalar functions of ffi/include/nvfp4/numerics.h in the order the kernels call them (a
// thread per 1x16 block; for 16x16 tiles, a lane per tile row and TileError, the tree the
// kernel's shuffles form). Built and run by tests/core/test_four_over_six.py with the host C++
// compiler (-ffp-contract=off, as nvcc's -fmad=false), so the CUDA path's numbers are checked
// against the NumPy oracle without a GPU.
//
// usage: four_over_six_check IN OUT ROWS COLS MODE E4M3_MAX BLOCK_2D RHT SR K0 K1 AMAX_BITS
//   IN: ROWS * COLS f32; OUT: the packed codes (ROWS * COLS / 2 bytes), then the scale bytes
//   (ROWS * COLS / 16). MODE 1 = mae, 2 = mse. Finite input only.
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "nvfp4/numerics.h"

namespace {

using namespace nvfp4;

struct Args {
  int64_t rows, cols;
  int mode;
  float six_m;
  bool block_2d, rht, sr;
  uint32_t k0, k1;
  float amax;
};

// Block `block` (flat index) of x, with the forward RHT (f32: no rounding to a narrower type).
void LoadBlock(const std::vector<float>& x, int64_t block, bool rht, float v[kBlock]) {
  for (int i = 0; i < kBlock; ++i) v[i] = x[block * kBlock + i];
  if (rht) Rht16(v, /*inverse=*/false);
}

void Encode(const Args& a, int64_t block, uint32_t scale, float enc, const float v[kBlock],
            std::vector<uint8_t>& codes, std::vector<uint8_t>& scales) {
  uint8_t q[kBlock / 2];
  if (a.sr) {
    uint32_t words[4];
    RandomWords16(a.k0, a.k1, 0, block * kBlock, words);
    EncodeBlockSr(v, enc, words, q);
  } else {
    EncodeBlockRn(v, enc, q);
  }
  for (int i = 0; i < kBlock / 2; ++i) codes[block * (kBlock / 2) + i] = q[i];
  scales[block] = static_cast<uint8_t>(scale);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 13) {
    std::fprintf(stderr, "usage: %s IN OUT ROWS COLS MODE E4M3_MAX BLOCK_2D RHT SR K0 K1 AMAX\n",
                 argv[0]);
    return 2;
  }
  Args a;
  a.rows = std::atoll(argv[3]);
  a.cols = std::atoll(argv[4]);
  a.mode = std::atoi(argv[5]);
  a.six_m = 6.0f * static_cast<float>(std::atoi(argv[6]));
  a.block_2d = std::atoi(argv[7]) != 0;
  a.rht = std::atoi(argv[8]) != 0;
  a.sr = std::atoi(argv[9]) != 0;
  a.k0 = static_cast<uint32_t>(std::strtoul(argv[10], nullptr, 10));
  a.k1 = static_cast<uint32_t>(std::strtoul(argv[11], nullptr, 10));
  a.amax = AsFloat(static_cast<uint32_t>(std::strtoul(argv[12], nullptr, 10)));
  const int64_t n = a.rows * a.cols, blocks_per_row = a.cols / kBlock;
  std::vector<float> x(static_cast<size_t>(n));
  FILE* in = std::fopen(argv[1], "rb");
  if (in == nullptr || std::fread(x.data(), sizeof(float), x.size(), in) != x.size()) return 3;
  std::fclose(in);
  std::vector<uint8_t> codes(static_cast<size_t>(n / 2)), scales(static_cast<size_t>(n / kBlock));
  const GlobalScale g = MakeGlobalScale(a.amax, a.six_m);
  if (!a.block_2d) {
    for (int64_t b = 0; b < n / kBlock; ++b) {
      float v[kBlock];
      LoadBlock(x, b, a.rht, v);
      const ScalePair c = FourOverSixScales(AsFloat(MaxAbsBits16(v)), g);
      const float err4 = CandidateError(v, c.s4, BlockEncode(c.s4, g), a.amax, a.six_m, a.mode);
      const float err6 = CandidateError(v, c.s6, BlockEncode(c.s6, g), a.amax, a.six_m, a.mode);
      const uint32_t scale = err4 < err6 ? c.s4 : c.s6;
      Encode(a, b, scale, BlockEncode(scale, g), v, codes, scales);
    }
  } else {
    for (int64_t r0 = 0; r0 < a.rows; r0 += kBlock) {
      for (int64_t cb = 0; cb < blocks_per_row; ++cb) {
        float v[kBlock][kBlock];
        uint32_t tile = 0;
        for (int r = 0; r < kBlock; ++r) {
          LoadBlock(x, (r0 + r) * blocks_per_row + cb, a.rht, v[r]);
          const uint32_t m = MaxAbsBits16(v[r]);
          tile = m > tile ? m : tile;
        }
        const ScalePair c = FourOverSixScales(AsFloat(tile), g);
        float err4[kBlock], err6[kBlock];
        for (int r = 0; r < kBlock; ++r) {
          err4[r] = CandidateError(v[r], c.s4, BlockEncode(c.s4, g), a.amax, a.six_m, a.mode);
          err6[r] = CandidateError(v[r], c.s6, BlockEncode(c.s6, g), a.amax, a.six_m, a.mode);
        }
        const uint32_t scale = TileError(err4) < TileError(err6) ? c.s4 : c.s6;
        for (int r = 0; r < kBlock; ++r) {
          Encode(a, (r0 + r) * blocks_per_row + cb, scale, BlockEncode(scale, g), v[r], codes,
                 scales);
        }
      }
    }
  }
  FILE* out = std::fopen(argv[2], "wb");
  if (out == nullptr) return 4;
  std::fwrite(codes.data(), 1, codes.size(), out);
  std::fwrite(scales.data(), 1, scales.size(), out);
  std::fclose(out);
  return 0;
}
