// Weight-only int8 linear layers for CPUs: y[M, N] (+)= x[M, K] @ W[N, K]^T (+ bias) with W as unsigned 8-bit
// codes and, per group of GROUP = 32 consecutive inputs of each output row, a float32 scale and minimum:
// W[n, k] ~ q[n, k] * s[n, g] + m[n, g], g = k / 32, q in [0, 255] (asymmetric, as GGUF's Q4_1 / Q8_1 blocks of
// 32 and AWQ's zero points, here with 256 levels), q = round((W - m) / s) on the closer (largest error over the
// group, min/max on a tie) of two grids: min/max, m = min of the group, s = (max - m) / 255, on which a Q4_1 block
// (w = d * q4 + m, q4 in 0..15, both ends used by its quantizer) is q = 17 * q4; and centred, s = max |W| / 127,
// m = -128 s, on which a Q8_0 block (w = d * q8, q8 in -127..127) is q = q8 + 128. So a checkpoint dequantized from
// these GGUF types keeps its weights: SmolLM2's layers were Q4_1, its embedding table (the tied output head) Q8_0
// (docs/benchmarks.md, "int8 accuracy": greedy completions identical to float32's).
// The C ABI below is called through ctypes by kernels/linear_cpu.py (its "int8" format), which documents the
// contract; this file holds only the arithmetic.
//
// Layout: the codes in column panels of NR = 2 * VEC output channels, [ceil(N / NR)][K'][NR] bytes, and per panel
// its groups' parameters [ceil(K / 32)][2][NR] (scales, then minimums; the last group may be shorter than 32;
// padding columns have s = m = 0). Within a panel the codes are [K][NR] (the float32 panels' layout of
// linear_cpu.cpp, K' = K) for the FMA microkernel, [ceil(K / 4)][NR][4] (K' = K rounded up to 4, zero codes past K)
// for the VNNI one; linear_i8_k_interleave() says which (1 or 4).
//
// Two microkernels, chosen by the build's flags (linear_i8_kernel()): where the CPU has AVX512-VNNI with AVX512-BW,
// or AVX-VNNI, integer dot products with the activations quantized to 15 bits per group (int8_vnni.h; outputs
// differ from the float32 sum by that quantization, relative ~1e-4); elsewhere (AVX2 only, Arm) the FMA tile below,
// float32 throughout. Both are batch-invariant.
//
// FMA microkernel: the float32 tile of linear_cpu.cpp with the weights dequantized in registers: per k, two loads of
// NR codes widened to float32, w = q * s + m (one fused multiply-add, the group's s and m held in registers), then
// R broadcasts of x and 2 R fused multiply-adds; every row of the tile reuses the dequantized vectors. Each output is
// one float32 sum in k order of x * w, w the same float32 value whatever the batch, so a row's result does not
// depend on the rest of the batch (batch-invariant); prefill (many rows) runs the same tiles, MR rows at a time.
// Batches of 1-3 rows run tiles over 2-4 panels at once (8 multiply-add chains in flight); the tiles prefetch the
// next unit's codes into L2 while 1-2 row batches stream the weights (see linear_cpu.cpp's `run`, same measurement).
//
// Work is split over panels across the calling thread's OpenMP team (static schedule); with one thread it runs on
// the caller.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <memory>

#include "cpu_simd.h"
#include "cpu_tiles.h"

#include "int8_vnni.h"  // defines OMNI_INT8_VNNI where the CPU has VNNI

namespace {

#if defined(OMNI_INT8_VNNI)
namespace vnni = omni::vnni;
#endif
using omni::load_vec;
using omni::splat;
using omni::vf;
using omni::VEC;

using omni::MR;
using omni::NR;
using omni::panels_per_tile;
using omni::write_tile;
constexpr int64_t GROUP = 32;
#if defined(OMNI_INT8_VNNI)
constexpr int64_t K_INTERLEAVE = 4;
static_assert(GROUP == vnni::GROUP);
#else
constexpr int64_t K_INTERLEAVE = 1;
#endif

// Codes per panel row block: K rounded up to K_INTERLEAVE; the code of input k, channel c within a panel.
inline int64_t padded_k(int64_t K) { return (K + K_INTERLEAVE - 1) / K_INTERLEAVE * K_INTERLEAVE; }
inline int64_t code_index(int64_t k, int c) {
  return (k / K_INTERLEAVE * NR + c) * K_INTERLEAVE + k % K_INTERLEAVE;
}

// The float32 weights VEC codes stand for: q * s + m, one rounding where the CPU fuses multiply-adds (the same
// expression everywhere, so every tile gets the same w).
inline vf dequantize(const uint8_t* q, vf s, vf m) { return omni::widen_u8(q) * s + m; }

// The R x (P * NR) tile of x @ [P consecutive panels] over k in [0, K) (see the file comment). `params` points at
// the first panel's group parameters; `groups` = ceil(K / GROUP). While it runs, the tile prefetches
// `ahead_lines` cache lines from `ahead` into L2.
template <int R, int P>
void tile(const float* x, int64_t ldx, const uint8_t* panel, const float* params, int64_t K, int64_t groups,
          float* y, int64_t ldy, int64_t n_left, const float* bias, bool accumulate, const char* ahead,
          int64_t ahead_lines) {
  vf acc[P][R][2] = {};
  const int64_t lines_per_k = K > 0 ? (ahead_lines + K - 1) / K : 0;
  const char* const ahead_end = ahead + ahead_lines * 64;
  for (int64_t g = 0; g < groups; ++g) {
    vf s[P][2], m[P][2];
    for (int j = 0; j < P; ++j) {
      const float* group = params + (j * groups + g) * 2 * NR;
      s[j][0] = load_vec(group);
      s[j][1] = load_vec(group + VEC);
      m[j][0] = load_vec(group + NR);
      m[j][1] = load_vec(group + NR + VEC);
    }
    const int64_t k_end = std::min(K, (g + 1) * GROUP);
    for (int64_t k = g * GROUP; k < k_end; ++k) {
      for (int64_t i = 0; i < lines_per_k && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
      for (int j = 0; j < P; ++j) {
        const uint8_t* q = panel + (j * K + k) * NR;
        const vf w0 = dequantize(q, s[j][0], m[j][0]), w1 = dequantize(q + VEC, s[j][1], m[j][1]);
        for (int r = 0; r < R; ++r) {
          const vf a = splat(x[r * ldx + k]);
          acc[j][r][0] += a * w0;
          acc[j][r][1] += a * w1;
        }
      }
    }
  }
  for (int j = 0; j < P; ++j) {
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_left - j * NR));
    write_tile<R>(acc[j], y + j * NR, ldy, cols, bias ? bias + j * NR : nullptr, accumulate);
  }
}

using Tile = void (*)(const float*, int64_t, const uint8_t*, const float*, int64_t, int64_t, float*, int64_t,
                      int64_t, const float*, bool, const char*, int64_t);

template <int... R>
constexpr Tile one_panel[] = {nullptr, tile<R, 1>...};
template <int... R>
constexpr Tile wide[] = {nullptr, tile<R, panels_per_tile(R)>...};

// tiles[r]: the one-panel tile of r rows, r in [1, MR]; wide_tiles[M]: M rows over panels_per_tile(M) panels.
#if defined(__AVX512F__)
constexpr const Tile* tiles = one_panel<1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12>;
#else
constexpr const Tile* tiles = one_panel<1, 2, 3, 4, 5, 6>;
#endif
constexpr const Tile* wide_tiles = wide<1, 2, 3>;

// A group's grid: w = q * scale + low, and the largest |w - (q * scale + low)| over the group.
struct Grid {
  float scale, low, error;
};

// Quantize n weights (one group of a row) onto the grid (s, m): q = round((w - m) / s) in [0, 255] (0 where
// s = 0), written to q[i]; returns the grid with its largest error, dequantized as the kernel does.
Grid quantize_group(const float* w, int64_t n, float s, float m, uint8_t* q) {
  if (!(s > 0.0f)) s = 0.0f;
  float error = 0.0f;
  for (int64_t i = 0; i < n; ++i) {
    const float code = s > 0.0f ? std::min(255.0f, std::max(0.0f, std::nearbyint((w[i] - m) / s))) : 0.0f;
    q[i] = static_cast<uint8_t>(code);
    error = std::max(error, std::fabs(std::fma(code, s, m) - w[i]));
  }
  return {s, m, error};
}

}  // namespace

extern "C" {

// Inputs per group of one scale and minimum, and output channels per panel (linear_cpu.cpp's, by the same flags).
int64_t linear_i8_group() { return GROUP; }
int64_t linear_i8_panel_width() { return NR; }
// Consecutive inputs of one channel stored together in a panel (1: [K][NR], 4: [ceil(K / 4)][NR][4]).
int64_t linear_i8_k_interleave() { return K_INTERLEAVE; }
// The microkernel: 0 float32 FMAs on dequantized weights, 1 AVX512-VNNI, 2 AVX-VNNI (256-bit).
int64_t linear_i8_kernel() {
#if defined(OMNI_INT8_VNNI) && defined(__AVX512F__)
  return 1;
#elif defined(OMNI_INT8_VNNI)
  return 2;
#else
  return 0;
#endif
}

// w [N, K] float32 (row stride ldw) -> codes [ceil(N / NR)][K'][NR] uint8 (K' and the order within a panel as the
// file comment says) and params [ceil(N / NR)][ceil(K / 32)][2][NR] float32. A constant group gets s = 0, q = 0
// (w = m exactly).
void linear_pack_i8(const float* w, int64_t N, int64_t K, int64_t ldw, uint8_t* packed, float* params) {
  const int64_t panels = (N + NR - 1) / NR, groups = (K + GROUP - 1) / GROUP, panel_bytes = padded_k(K) * NR;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) {
    uint8_t* codes = packed + p * panel_bytes;
    std::fill(codes, codes + panel_bytes, uint8_t{0});
    for (int64_t g = 0; g < groups; ++g) {
      float* scale = params + (p * groups + g) * 2 * NR;
      float* low = scale + NR;
      const int64_t k0 = g * GROUP, k1 = std::min(K, k0 + GROUP);
      for (int c = 0; c < NR; ++c) {
        const int64_t n = p * NR + c;
        scale[c] = low[c] = 0.0f;
        if (n >= N) continue;
        const float* row = w + n * ldw;
        float lo = row[k0], hi = row[k0];
        for (int64_t k = k0 + 1; k < k1; ++k) lo = std::min(lo, row[k]), hi = std::max(hi, row[k]);
        // the two grids (see the file comment): min/max, then centred; the centred one only where it is closer
        uint8_t spread_codes[GROUP], centred_codes[GROUP];
        const Grid spread = quantize_group(row + k0, k1 - k0, (hi - lo) / 255.0f, lo, spread_codes);
        const float centred_scale = std::max(hi, -lo) / 127.0f;
        const Grid centre = quantize_group(row + k0, k1 - k0, centred_scale, -128.0f * centred_scale, centred_codes);
        const bool centred = centre.error < spread.error;
        const Grid& best = centred ? centre : spread;
        scale[c] = best.scale;
        low[c] = best.low;
        for (int64_t k = k0; k < k1; ++k) codes[code_index(k, c)] = (centred ? centred_codes : spread_codes)[k - k0];
      }
    }
  }
}

// y[M, N] = x[M, K] @ W^T (+ bias) (+ y when accumulate != 0) with the codes and params of linear_pack_i8. x rows
// have stride ldx, y rows stride ldy (floats).
void linear_i8(const float* x, int64_t M, int64_t K, int64_t ldx, const uint8_t* packed, const float* params,
               int64_t N, const float* bias, float* y, int64_t ldy, int64_t accumulate) {
  if (M <= 0) return;
  const int64_t panels = (N + NR - 1) / NR, groups = (K + GROUP - 1) / GROUP, panel_bytes = padded_k(K) * NR;
  const bool add = accumulate != 0;
#if defined(OMNI_INT8_VNNI)
  // the rows' quantized activations, in a buffer the calling thread keeps between calls, grown (not copied) to the
  // largest M * groups it has seen: 72 bytes per row and group, 0.56 of the largest x's own bytes
  static thread_local std::unique_ptr<vnni::Group[]> quantized;
  static thread_local int64_t capacity = 0;
  if (capacity < M * groups) {
    quantized.reset(new vnni::Group[M * groups]);
    capacity = M * groups;
  }
  vnni::Group* const xq = quantized.get();
  // a decode batch's few rows quantize in less time than a parallel region takes to start; a prefill's are split
#pragma omp parallel for schedule(static) if (M >= 16)
  for (int64_t r = 0; r < M; ++r) vnni::quantize_row(x + r * ldx, K, xq + r * groups, groups);
  const int64_t K4 = padded_k(K) / 4;
  omni::for_each_tile(M, panels, panel_bytes, packed, vnni::MR, vnni::MR, vnni::panels_per_tile(M), true,
                [&](int64_t m, int rows, int64_t p, bool wide, const char* ahead, int64_t lines) {
                  (wide ? vnni::wide_tiles : vnni::tiles)[rows](
                      xq + m * groups, packed + p * panel_bytes, params + p * groups * 2 * NR, K4, groups,
                      y + m * ldy + p * NR, ldy, N - p * NR, bias ? bias + p * NR : nullptr, add, ahead, lines);
                });
#else
  omni::for_each_tile(M, panels, panel_bytes, packed, 4, MR, panels_per_tile(M), true,
                [&](int64_t m, int rows, int64_t p, bool wide, const char* ahead, int64_t lines) {
                  (wide ? wide_tiles : tiles)[rows](x + m * ldx, ldx, packed + p * panel_bytes,
                                                    params + p * groups * 2 * NR, K, groups, y + m * ldy + p * NR,
                                                    ldy, N - p * NR, bias ? bias + p * NR : nullptr, add, ahead,
                                                    lines);
                });
#endif
}

}  // extern "C"
