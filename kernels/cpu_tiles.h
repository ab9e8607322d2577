// The register tiles' shape and their write to y, shared by the CPU linear kernels (linear_cpu.cpp: float32 and
// bfloat16 panels; linear_int8.cpp: int8 codes), which the same panel layout and batch rules keep alike: MR rows x NR
// output channels, NR = two SIMD registers (MR = 6 with AVX2's 16 registers, as BLIS's Haswell sgemm kernel; 12
// with AVX-512's 32).

#pragma once

#include <cstdint>
#include <cstring>

#include "cpu_simd.h"

namespace omni {

#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int NR = 2 * VEC;

// Panels per tile for a batch of M rows (M < 4: 4 / M rounded up, so that R * P * 2 >= 8 multiply-add chains cover
// the FMA units' latency).
constexpr int panels_per_tile(int64_t M) { return M < 4 ? (4 + M - 1) / M : 1; }

// Write an R x NR tile (columns [0, cols)) of accumulators to y: y = acc + bias (+ y).
template <int R>
inline void write_tile(const vf (&acc)[R][2], float* y, int64_t ldy, int cols, const float* bias, bool accumulate) {
  vf b0 = vf{}, b1 = vf{};
  float tmp[NR];
  if (bias) {
    std::memset(tmp, 0, sizeof tmp);
    std::memcpy(tmp, bias, cols * sizeof(float));
    b0 = load_vec(tmp);
    b1 = load_vec(tmp + VEC);
  }
  for (int r = 0; r < R; ++r) {
    vf v0 = acc[r][0] + b0, v1 = acc[r][1] + b1;
    float* row = y + r * ldy;
    if (cols == NR) {
      if (accumulate) {
        v0 += load_vec(row);
        v1 += load_vec(row + VEC);
      }
      store_vec(row, v0);
      store_vec(row + VEC, v1);
    } else {
      store_vec(tmp, v0);
      store_vec(tmp + VEC, v1);
      for (int c = 0; c < cols; ++c) row[c] = accumulate ? row[c] + tmp[c] : tmp[c];
    }
  }
}

}  // namespace omni
