// The register tiles' shape, their write to y and the loop that runs them over the panels, shared by the CPU linear
// kernels (linear_cpu.cpp: float32 and bfloat16 panels; linear_int8.cpp: int8 codes), which the same panel layout
// and batch rules keep alike: MR rows x NR output channels, NR = two SIMD registers (MR = 6 with AVX2's 16
// registers, as BLIS's Haswell sgemm kernel; 12 with AVX-512's 32).

#pragma once

#include <algorithm>
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

// Calls run(m, rows, p, wide, ahead, ahead_lines) for every tile of an M-row product over `panels` panels of
// `panel_bytes` bytes from `packed`: the panels in units (of `group` panels each while they last, then single ones)
// split over the calling thread's OpenMP team (static schedule); a batch of fewer than `wide_below` rows runs one
// wide tile per unit (wide = true), a larger one tiles of at most `mr` rows. Each tile is told the next unit's
// weights (its share of their cache lines) to prefetch into L2 while it runs: when the unit has several tiles,
// and with `prefetch_small` also for batches of 1-2 rows, which stream the weights (measured in linear_cpu.cpp's
// `run` and linear_int8.cpp).
template <class Run>
void for_each_tile(int64_t M, int64_t panels, int64_t panel_bytes, const void* packed, int64_t wide_below,
                   int64_t mr, int group, bool prefetch_small, const Run& run) {
  const char* const begin = static_cast<const char*>(packed);
  const char* const end = begin + panels * panel_bytes;
  const int64_t num_tiles = M < wide_below ? 1 : (M + mr - 1) / mr;
  const bool prefetch = num_tiles > 1 || (prefetch_small && M <= 2);
  const int64_t grouped_units = group > 1 ? panels / group : 0;
  const int64_t units = grouped_units + (panels - grouped_units * group);
#pragma omp parallel for schedule(static)
  for (int64_t u = 0; u < units; ++u) {
    const bool grouped = u < grouped_units;
    const int64_t p = grouped ? u * group : grouped_units * group + (u - grouped_units);  // the unit's first panel
    const int64_t unit_panels = grouped ? group : 1;
    const char* next = begin + (p + unit_panels) * panel_bytes;
    const int64_t next_bytes = prefetch ? std::min<int64_t>(unit_panels * panel_bytes, end - next) : 0;
    const int64_t next_lines = next_bytes > 0 ? next_bytes / 64 : 0;
    if (M < wide_below) {
      run(0, static_cast<int>(M), p, grouped, next, next_lines);
      continue;
    }
    const int64_t share = (next_lines + num_tiles - 1) / num_tiles;  // lines per tile
    for (int64_t m = 0, t = 0; m < M; m += mr, ++t) {
      const int rows = static_cast<int>(std::min<int64_t>(mr, M - m));
      const int64_t from = std::min(t * share, next_lines);
      run(m, rows, p, false, next + from * 64, std::min(share, next_lines - from));
    }
  }
}

}  // namespace omni
