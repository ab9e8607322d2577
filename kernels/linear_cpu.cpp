// Linear layers for CPUs: y[M, N] (+)= x[M, K] @ W[N, K]^T (+ bias) with W packed once into column panels, in
// float32 or as int8 with one float32 scale per output channel (weight-only quantisation: x stays float32).
// The C ABI below is called through ctypes by kernels/linear_cpu.py, which documents the contract; this file holds
// only the arithmetic.
//
// Layout: W is cut into panels of NR = 2 * VEC output channels (VEC floats per SIMD register: 8 with AVX2, 16 with
// AVX-512); a panel stores its K x NR weights row by row ([K][NR], the last panel zero-padded), so the microkernel
// reads it with unit stride. This is the packed-B scheme of BLIS (Van Zee & van de Geijn, "BLIS: A Framework for
// Rapidly Instantiating BLAS Functionality", ACM TOMS 2015) and of Goto & van de Geijn ("Anatomy of
// High-Performance Matrix Multiplication", ACM TOMS 2008), without packing x: the engine's decode steps have at
// most max_num_seqs rows, whose x rows stay in L1/L2 while a panel streams from memory once.
//
// Microkernel: an MR x NR tile of y in 2 * MR registers; per k, two vector loads of the panel, MR broadcasts of x
// and 2 * MR fused multiply-adds (MR = 6 with AVX2's 16 registers, as BLIS's Haswell sgemm kernel; 12 with
// AVX-512's 32). Each output is one fp32 accumulator summed in k order; batches of 1-3 rows run tiles over 2-4
// panels at once to keep 8 chains in flight (see `tile`).
//
// int8: q[n, k] = round(W[n, k] / s[n]) in [-127, 127], s[n] = max_k |W[n, k]| / 127 (symmetric per-channel,
// as in LLM.int8()'s weight side, Dettmers et al. 2022, without its outlier split). y = s[n] * sum_k x[m, k] q[n, k]:
// for a few rows the microkernel widens each int8 row of the panel to fp32 in registers; for more rows the panel is
// widened once into a thread-local fp32 buffer and the float32 microkernel runs over it.
//
// Work is split over panels across the calling thread's OpenMP team (static schedule; the engine's CPU threads,
// torch.set_num_threads); with one thread it runs on the caller.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_simd.h"

namespace {

using omni::load_vec;
using omni::splat;
using omni::store_vec;
using omni::vf;
using omni::VEC;

#if defined(__AVX512F__)
constexpr int MR = 12;
#else
constexpr int MR = 6;
#endif
constexpr int NR = 2 * VEC;

// Write an R x NR tile (columns [0, cols)) of accumulators to y: y = scale * acc + bias (+ y).
template <int R>
inline void write_tile(const vf (&acc)[R][2], float* y, int64_t ldy, int cols, const float* scale,
                       const float* bias, bool accumulate) {
  vf s0 = splat(1.0f), s1 = s0, b0 = vf{}, b1 = vf{};
  float tmp[NR];
  if (scale) {
    std::memcpy(tmp, scale, sizeof tmp);
    s0 = load_vec(tmp);
    s1 = load_vec(tmp + VEC);
  }
  if (bias) {
    std::memset(tmp, 0, sizeof tmp);
    std::memcpy(tmp, bias, cols * sizeof(float));
    b0 = load_vec(tmp);
    b1 = load_vec(tmp + VEC);
  }
  for (int r = 0; r < R; ++r) {
    vf v0 = acc[r][0] * s0 + b0, v1 = acc[r][1] * s1 + b1;
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

// The R x (P * NR) tile of x @ [P consecutive panels] over k in [0, K): one accumulator per output, summed in k
// order, so an output's value does not depend on R, P or where its row falls in the batch (batch-invariant).
// Small R take several panels at once (P > 1) so that at least 8 independent multiply-add chains cover the FMA
// units' latency (4 cycles, 2 units). Weight is float (float32 panels) or int8_t (widened in registers). While it
// runs, the tile prefetches `ahead_lines` cache lines from `ahead` into L2 (see `run`).
template <int R, int P, typename Weight>
void tile(const float* x, int64_t ldx, const Weight* panel, int64_t K, float* y, int64_t ldy, int64_t n_left,
          const float* scale, const float* bias, bool accumulate, const char* ahead, int64_t ahead_lines) {
  vf acc[P][R][2] = {};
  const int64_t lines_per_k = K > 0 ? (ahead_lines + K - 1) / K : 0;
  const char* const ahead_end = ahead + ahead_lines * 64;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < lines_per_k && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
    for (int j = 0; j < P; ++j) {
      const Weight* w = panel + (j * K + k) * NR;
      vf w0, w1;
      if constexpr (sizeof(Weight) == 1) {
        w0 = omni::widen_i8(w);
        w1 = omni::widen_i8(w + VEC);
      } else {
        w0 = load_vec(w);
        w1 = load_vec(w + VEC);
      }
      for (int r = 0; r < R; ++r) {
        const vf a = splat(x[r * ldx + k]);
        acc[j][r][0] += a * w0;
        acc[j][r][1] += a * w1;
      }
    }
  }
  for (int j = 0; j < P; ++j) {
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_left - j * NR));
    float panel_scale[NR] = {};
    if (scale) std::memcpy(panel_scale, scale + j * NR, cols * sizeof(float));
    write_tile<R>(acc[j], y + j * NR, ldy, cols, scale ? panel_scale : nullptr, bias ? bias + j * NR : nullptr,
                  accumulate);
  }
}

template <typename Weight>
using Tile = void (*)(const float*, int64_t, const Weight*, int64_t, float*, int64_t, int64_t, const float*,
                      const float*, bool, const char*, int64_t);

template <typename Weight, int... R>
constexpr Tile<Weight> tiles[] = {nullptr, tile<R, 1, Weight>...};

// tiles_for<Weight>[r]: the one-panel tile of r rows, r in [1, MR].
#if defined(__AVX512F__)
template <typename Weight>
constexpr const Tile<Weight>* tiles_for = tiles<Weight, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;
#else
template <typename Weight>
constexpr const Tile<Weight>* tiles_for = tiles<Weight, 1, 2, 3, 4, 5, 6>;
#endif

// Panels per tile for a batch of M rows (M < 4: 4 / M rounded up, so that R * P * 2 >= 8 chains).
constexpr int panels_per_tile(int64_t M) { return M < 4 ? (4 + M - 1) / M : 1; }

// wide_tiles<Weight>[M]: the tile of M rows over panels_per_tile(M) panels, M in [1, 3].
template <typename Weight, int... R>
constexpr Tile<Weight> wide_tiles_of[] = {nullptr, tile<R, panels_per_tile(R), Weight>...};
template <typename Weight>
constexpr const Tile<Weight>* wide_tiles = wide_tiles_of<Weight, 1, 2, 3>;

// The driver of linear_f32 / linear_i8. Work units, split statically over the threads: with M < 4 rows, groups
// of panels_per_tile(M) consecutive panels (the leftover panels one at a time), each one tile; otherwise one
// panel each, its rows in tiles of MR. The weights stream from memory once per call (a decode step's x rows stay
// in L1/L2). With several tiles per panel the first tile would wait for memory while the others run from L2, so
// the tiles prefetch the next panel into L2, each its share, and the stream overlaps the arithmetic. With one
// tile the panels are read in address order and the hardware prefetchers keep up with float32; int8 panels of
// 1-2 rows go through bytes about 4x faster than that, and prefetching the next unit's panels too took 13-19 % off
// their time (measured on this project's AMD EPYC, AVX2; at 4 rows it cost 6-13 %, so it is not done there).
// int8 with more than MR rows widens each panel once into a thread-local fp32 buffer and runs the float32 tiles.
template <typename Weight>
void run(const float* x, int64_t M, int64_t K, int64_t ldx, const Weight* packed, const float* scales, int64_t N,
         const float* bias, float* y, int64_t ldy, bool accumulate) {
  if (M <= 0) return;
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t panel_bytes = K * NR * static_cast<int64_t>(sizeof(Weight));
  const char* const packed_end = reinterpret_cast<const char*>(packed) + panels * panel_bytes;
  const bool widen = sizeof(Weight) == 1 && M > MR;
  const int64_t num_tiles = widen || sizeof(Weight) == 4 ? (M + MR - 1) / MR : 1;
  const bool prefetch = num_tiles > 1 || (sizeof(Weight) == 1 && M <= 2);
  const int group = panels_per_tile(M);
  const int64_t groups = group > 1 ? panels / group : 0;
  const int64_t units = groups + (panels - groups * group);
#pragma omp parallel
  {
    std::vector<float> widened(widen ? K * NR : 0);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const bool grouped = u < groups;
      const int64_t p = grouped ? u * group : groups * group + (u - groups);  // the unit's first panel
      const int64_t unit_panels = grouped ? group : 1;
      const Weight* panel = packed + p * K * NR;
      const char* next = reinterpret_cast<const char*>(panel + unit_panels * K * NR);
      const int64_t next_bytes = prefetch ? std::min<int64_t>(unit_panels * panel_bytes, packed_end - next) : 0;
      const int64_t next_lines = next_bytes > 0 ? next_bytes / 64 : 0;
      const float* s = scales ? scales + p * NR : nullptr;
      const float* b = bias ? bias + p * NR : nullptr;
      const int64_t n_left = N - p * NR;
      if (M < 4 || (sizeof(Weight) == 1 && !widen)) {  // one tile for all the rows, the weights as they are
        const Tile<Weight> one = grouped ? wide_tiles<Weight>[M] : tiles_for<Weight>[M];
        one(x, ldx, panel, K, y + p * NR, ldy, n_left, s, b, accumulate, next, next_lines);
        continue;
      }
      const float* fp32_panel = reinterpret_cast<const float*>(panel);
      if (widen) {
        for (int64_t i = 0; i < K * NR; i += VEC) store_vec(widened.data() + i, omni::widen_i8(
            reinterpret_cast<const int8_t*>(panel) + i));
        fp32_panel = widened.data();
      }
      const int64_t share = (next_lines + num_tiles - 1) / num_tiles;  // lines per tile
      for (int64_t m = 0, t = 0; m < M; m += MR, ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
        const int64_t from = std::min(t * share, next_lines);
        const int64_t lines = std::min(share, next_lines - from);
        tiles_for<float>[rows](x + m * ldx, ldx, fp32_panel, K, y + m * ldy + p * NR, ldy, n_left, s, b, accumulate,
                               next + from * 64, lines);
      }
    }
  }
}

// packed [ceil(N / NR)][K][NR] = value(n, k) for n < N, zeros in the last panel's padding.
template <typename Weight, typename Value>
void pack_panels(int64_t N, int64_t K, Weight* packed, Value value) {
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    Weight* dst = packed + p * K * NR;
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        dst[k * NR + c] = n < N ? value(n, k) : Weight{};
      }
  }
}

}  // namespace

extern "C" {

// Panel width the packed layouts use (columns per panel).
int64_t linear_panel_width() { return NR; }

// w [N, K] float32 (row stride ldw) -> packed [ceil(N / NR)][K][NR] float32.
void linear_pack_f32(const float* w, int64_t N, int64_t K, int64_t ldw, float* packed) {
  pack_panels(N, K, packed, [&](int64_t n, int64_t k) { return w[n * ldw + k]; });
}

// w [N, K] float32 -> packed [ceil(N / NR)][K][NR] int8 and scales [N] float32 (see the file comment). A row of
// zeros gets scale 0 (its outputs are the bias alone).
void linear_pack_i8(const float* w, int64_t N, int64_t K, int64_t ldw, int8_t* packed, float* scales) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    float top = 0.0f;
    for (int64_t k = 0; k < K; ++k) top = std::max(top, std::fabs(w[n * ldw + k]));
    scales[n] = top / 127.0f;
  }
  pack_panels(N, K, packed, [&](int64_t n, int64_t k) {
    const float q = scales[n] > 0.0f ? std::nearbyint(w[n * ldw + k] / scales[n]) : 0.0f;
    return static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
  });
}

// y[M, N] = x[M, K] @ W^T (+ bias) (+ y when accumulate != 0). x rows have stride ldx, y rows stride ldy (floats).
void linear_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                const float* bias, float* y, int64_t ldy, int64_t accumulate) {
  run<float>(x, M, K, ldx, packed, nullptr, N, bias, y, ldy, accumulate != 0);
}

// As linear_f32 with the int8 panels and per-channel scales of linear_pack_i8.
void linear_i8(const float* x, int64_t M, int64_t K, int64_t ldx, const int8_t* packed, const float* scales,
               int64_t N, const float* bias, float* y, int64_t ldy, int64_t accumulate) {
  run<int8_t>(x, M, K, ldx, packed, scales, N, bias, y, ldy, accumulate != 0);
}

}  // extern "C"
