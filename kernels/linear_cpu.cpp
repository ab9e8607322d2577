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
// AVX-512's 32). Each output is one fp32 accumulator summed in k order.
//
// int8: q[n, k] = round(W[n, k] / s[n]) in [-127, 127], s[n] = max_k |W[n, k]| / 127 (symmetric per-channel,
// as in LLM.int8()'s weight side, Dettmers et al. 2022, without its outlier split). y = s[n] * sum_k x[m, k] q[n, k]:
// for a few rows the microkernel widens each int8 row of the panel to fp32 in registers; for more rows the panel is
// widened once into a thread-local fp32 buffer and the float32 microkernel runs over it.
//
// Work is split over panels across the OpenMP threads of the process (static schedule); with one thread (the CPU
// engine's default layout) it runs on the caller.

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

// The R x NR tile of x @ panel over k in [0, K): U interleaved partial sums per output (k = u mod U), so that at
// least 8 independent multiply-add chains cover the FMA units' latency (4 cycles, 2 units) when R is small; summed
// in u order at the end. Weight is float (a float32 panel) or int8_t (widened in registers). While it runs, the
// tile prefetches `ahead_lines` cache lines from `ahead` into L2 (its share of the next panel, see `run`).
template <int R, typename Weight>
void tile(const float* x, int64_t ldx, const Weight* panel, int64_t K, float* y, int64_t ldy, int cols,
          const float* scale, const float* bias, bool accumulate, const char* ahead, int64_t ahead_lines) {
  constexpr int U = R >= 4 ? 1 : (4 + R - 1) / R;
  vf acc[U][R][2] = {};
  auto step = [&](int u, int64_t k) {
    vf w0, w1;
    if constexpr (sizeof(Weight) == 1) {
      w0 = omni::widen_i8(panel + k * NR);
      w1 = omni::widen_i8(panel + k * NR + VEC);
    } else {
      w0 = load_vec(panel + k * NR);
      w1 = load_vec(panel + k * NR + VEC);
    }
    for (int r = 0; r < R; ++r) {
      const vf a = splat(x[r * ldx + k]);
      acc[u][r][0] += a * w0;
      acc[u][r][1] += a * w1;
    }
  };
  const int64_t iterations = K / U;
  const int64_t lines_per_iteration = iterations > 0 ? (ahead_lines + iterations - 1) / iterations : 0;
  const char* const ahead_end = ahead + ahead_lines * 64;
  int64_t k = 0;
  for (; k + U <= K; k += U) {
    for (int64_t i = 0; i < lines_per_iteration && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
    for (int u = 0; u < U; ++u) step(u, k + u);
  }
  for (int u = 0; k < K; ++k, ++u) step(u, k);
  for (int u = 1; u < U; ++u)
    for (int r = 0; r < R; ++r) {
      acc[0][r][0] += acc[u][r][0];
      acc[0][r][1] += acc[u][r][1];
    }
  write_tile<R>(acc[0], y, ldy, cols, scale, bias, accumulate);
}

template <typename Weight>
using Tile = void (*)(const float*, int64_t, const Weight*, int64_t, float*, int64_t, int, const float*,
                      const float*, bool, const char*, int64_t);

template <typename Weight, int... R>
constexpr Tile<Weight> tiles[] = {nullptr, tile<R, Weight>...};

// tiles_for<Weight>[r]: the tile of r rows, r in [1, MR].
#if defined(__AVX512F__)
template <typename Weight>
constexpr const Tile<Weight>* tiles_for = tiles<Weight, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;
#else
template <typename Weight>
constexpr const Tile<Weight>* tiles_for = tiles<Weight, 1, 2, 3, 4, 5, 6>;
#endif

// Rows up to which the int8 microkernel widens in registers; above it the panel is widened once into a buffer.
constexpr int64_t I8_DIRECT_ROWS = MR;

// The driver of linear_f32 / linear_i8: panels split statically over the threads; per panel, its rows in tiles of
// MR. The weights stream from memory once per call (a decode step's x rows stay in L1/L2). With several tiles the
// first tile of each panel would wait for memory while the others run from L2, so the tiles prefetch the next
// panel into L2, each its share, and the stream overlaps the arithmetic. With one tile the panels are read in
// address order and the hardware prefetchers keep up with float32; int8 panels of 1-2 rows go through bytes
// about 4x faster than that, and prefetching the next panel too took 13-19 % off their time (measured on this
// project's AMD EPYC, AVX2; at 4 rows it cost 6-13 %, so it is not done there).
template <typename Weight>
void run(const float* x, int64_t M, int64_t K, int64_t ldx, const Weight* packed, const float* scales, int64_t N,
         const float* bias, float* y, int64_t ldy, bool accumulate) {
  const int64_t panels = (N + NR - 1) / NR;
  const int64_t panel_bytes = K * NR * static_cast<int64_t>(sizeof(Weight));
  const bool widen = sizeof(Weight) == 1 && M > I8_DIRECT_ROWS;
  const int64_t num_tiles = widen || sizeof(Weight) == 4 ? (M + MR - 1) / MR : 1;
  const bool prefetch = num_tiles > 1 || (sizeof(Weight) == 1 && M <= 2);
#pragma omp parallel
  {
    std::vector<float> widened(widen ? K * NR : 0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      const Weight* panel = packed + p * K * NR;
      const char* next = p + 1 < panels && prefetch ? reinterpret_cast<const char*>(panel + K * NR) : nullptr;
      const int64_t share = next ? (panel_bytes / 64 + num_tiles - 1) / num_tiles : 0;  // lines per tile
      float scale[NR] = {};
      if (scales) std::memcpy(scale, scales + p * NR, cols * sizeof(float));
      const float* s = scales ? scale : nullptr;
      const float* b = bias ? bias + p * NR : nullptr;
      if (sizeof(Weight) == 1 && !widen) {
        tiles_for<Weight>[M](x, ldx, panel, K, y + p * NR, ldy, cols, s, b, accumulate, next, share);
        continue;
      }
      const float* fp32_panel = reinterpret_cast<const float*>(panel);
      if (widen) {
        for (int64_t i = 0; i < K * NR; i += VEC) store_vec(widened.data() + i, omni::widen_i8(
            reinterpret_cast<const int8_t*>(panel) + i));
        fp32_panel = widened.data();
      }
      for (int64_t m = 0, t = 0; m < M; m += MR, ++t) {
        const int rows = static_cast<int>(std::min<int64_t>(MR, M - m));
        const int64_t from = std::min(t * share, panel_bytes / 64);
        const int64_t lines = std::min(share, panel_bytes / 64 - from);
        tiles_for<float>[rows](x + m * ldx, ldx, fp32_panel, K, y + m * ldy + p * NR, ldy, cols, s, b, accumulate,
                               next ? next + from * 64 : nullptr, next ? lines : 0);
      }
    }
  }
}

}  // namespace

extern "C" {

// Panel width the packed layouts use (columns per panel).
int64_t linear_panel_width() { return NR; }

// w [N, K] float32 (row stride ldw) -> packed [ceil(N / NR)][K][NR] float32.
void linear_pack_f32(const float* w, int64_t N, int64_t K, int64_t ldw, float* packed) {
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    float* dst = packed + p * K * NR;
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        dst[k * NR + c] = n < N ? w[n * ldw + k] : 0.0f;
      }
  }
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
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    int8_t* dst = packed + p * K * NR;
    for (int64_t k = 0; k < K; ++k)
      for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        float q = 0.0f;
        if (n < N && scales[n] > 0.0f) q = std::nearbyint(w[n * ldw + k] / scales[n]);
        dst[k * NR + c] = static_cast<int8_t>(std::min(127.0f, std::max(-127.0f, q)));
      }
  }
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
