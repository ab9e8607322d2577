// The int8 linear microkernel for CPUs with VNNI (AVX512-VNNI with AVX512-BW, or 256-bit AVX-VNNI): integer dot
// products of the uint8 weight codes with 15-bit activations, included by linear_int8.cpp (which holds the
// contract, the codes' grids and the driver).
//
// Activations: each row of x, per group of GROUP = 32 inputs (the weights' groups), is quantized symmetrically to
// c = round(x * 16256 / max|x|) (round half to even), c in [-16256, 16256], with the float32 scale
// s_a = max|x| / 16256, and c is split into two signed bytes c = 128 * hi + lo (hi = floor((c + 64) / 128) in
// [-127, 127], lo in [-64, 63]). Why 15 bits, not 8: 8-bit activations per group of 32 (llama.cpp's Q8_1) left 22
// of SmolLM2's 50 greedy completions as float32's, 12 bits 47, 15 bits all 50 (benchmarks/results/
// int8_vnni_probe.json); two vpdpbusd per weight vector still beat widening the codes to float32.
//
// Weights: the codes of a panel are stored as [ceil(K / 4)][NR][4]: the four consecutive k of one output channel
// in one 32-bit lane, vpdpbusd's operand layout (zero codes for k >= K); groups' scale and minimum as in the FMA
// layout.
//
// Arithmetic per row, output channel and group: dot = 128 * sum(q * hi) + sum(q * lo) = sum(q * c), exact in int32
// (|dot| <= 32 * 255 * 16256 < 2^31); then y += s_a * (s_w * float(dot) + m_w * float(sum c)), which is
// s_a * sum(c * (q * s_w + m_w)) = sum(x' * w), x' = c * s_a the quantized activation. The float32 roundings are
// per group, in group order, and depend only on the row: the result is batch-invariant like the FMA tiles'.

#pragma once

// Defined where the build has the instructions: AVX512-VNNI with AVX512-BW, or AVX-VNNI without AVX-512.
#if (defined(__AVX512VNNI__) && defined(__AVX512BW__)) || (defined(__AVXVNNI__) && !defined(__AVX512F__))
#define OMNI_INT8_VNNI 1

#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_simd.h"
#include "cpu_tiles.h"

namespace omni::vnni {

constexpr int64_t GROUP = 32;
constexpr int64_t QUADS = GROUP / 4;  // 32-bit lanes of four codes per group
constexpr float TOP = 16256.0f;       // 127 * 128: the largest |c| whose hi fits a signed byte with lo = 0
constexpr float SMALLEST = 0x1p-100f;  // groups with max|x| below count as zero (see quantize_row)

// Row-by-panel pairs a tile keeps in registers: each pair holds 4 int32 accumulators (two halves x two vectors)
// and 2 float32 ones, so 4 pairs fill AVX-512's 32 registers with the weights and broadcasts, 2 AVX2's 16.
#if defined(__AVX512F__)
constexpr int PAIRS = 4;
#else
constexpr int PAIRS = 2;
#endif
constexpr int MR = PAIRS;  // rows per tile when the batch has at least MR rows

// Panels per tile for a batch of M rows: M < MR rows spread the pairs over panels.
constexpr int panels_per_tile(int64_t M) { return M < MR ? std::max<int>(1, PAIRS / static_cast<int>(M)) : 1; }

// One row's group of quantized activations (72 bytes): the two byte halves, four to a 32-bit lane, the scale and
// the sum of the codes (exact in float32: |sum| <= 32 * 16256 < 2^24).
struct Group {
  int32_t hi[QUADS];
  int32_t lo[QUADS];
  float scale;
  float sum;
};

typedef int32_t vi32_unaligned __attribute__((vector_size(VEC * 4), aligned(4)));

inline vi32 load_i32(const void* p) { return *reinterpret_cast<const vi32_unaligned*>(p); }
inline vi32 splat_i32(int32_t v) { return vi32{} + v; }

// acc + the sums of four u8 x s8 products per 32-bit lane.
inline vi32 dot_u8s8(vi32 acc, vi32 u8, vi32 s8) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi32>(_mm512_dpbusd_epi32(reinterpret_cast<__m512i>(acc), reinterpret_cast<__m512i>(u8),
                                                    reinterpret_cast<__m512i>(s8)));
#else
  return reinterpret_cast<vi32>(_mm256_dpbusd_avx_epi32(reinterpret_cast<__m256i>(acc),
                                                        reinterpret_cast<__m256i>(u8), reinterpret_cast<__m256i>(s8)));
#endif
}

typedef int8_t vi8 __attribute__((vector_size(VEC)));

// v rounded to the nearest integer (half to even: the default rounding mode, as std::nearbyint).
inline vi32 round_to_i32(vf v) {
#if defined(__AVX512F__)
  return reinterpret_cast<vi32>(_mm512_cvtps_epi32(reinterpret_cast<__m512>(v)));
#else
  return reinterpret_cast<vi32>(_mm256_cvtps_epi32(reinterpret_cast<__m256>(v)));
#endif
}

// The activations of one row x[0, K) as `groups` Groups (see the file comment). A group holding a NaN or an
// infinity gets scale NaN, so its outputs are NaN, as a float32 product's would be (or infinite). A group with
// max|x| < 2^-100 counts as zero (codes and scale 0): 16256 / max|x| would overflow below about 4.8e-35 and the
// scale lose bits as a subnormal below 1.9e-34; such a group adds under 2^-95 times sum |w| to an output (a flush
// to zero, as vdpbf16ps does with subnormal inputs).
inline void quantize_row(const float* x, int64_t K, Group* out, int64_t groups) {
  constexpr int PARTS = GROUP / VEC;
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t k0 = g * GROUP, n = std::min(GROUP, K - k0);
    float padded[GROUP] = {};
    const float* v = x + k0;
    if (n < GROUP) v = static_cast<const float*>(std::memcpy(padded, v, n * sizeof(float)));
    vf part[PARTS], top_lanes = vf{}, nan_lanes = vf{};
    for (int i = 0; i < PARTS; ++i) {
      part[i] = load_vec(v + i * VEC);
      const vf magnitude = part[i] < 0 ? -part[i] : part[i];
      top_lanes = magnitude > top_lanes ? magnitude : top_lanes;  // a NaN is skipped here, caught below
      nan_lanes += part[i] - part[i];                             // NaN where the part held an infinity or NaN
    }
    float top = 0.0f, not_finite = 0.0f;
    for (int i = 0; i < VEC; ++i) top = std::max(top, top_lanes[i]), not_finite += nan_lanes[i];
    const bool finite = not_finite == 0.0f;
    Group& q = out[g];
    const bool zero = finite && top < SMALLEST;
    const vf inv = splat(finite && !zero ? TOP / top : 0.0f);
    vi32 sum = vi32{};
    for (int i = 0; i < PARTS; ++i) {
      vi32 c = round_to_i32(part[i] * inv);
      const vi32 top_code = splat_i32(static_cast<int32_t>(TOP));
      c = c > top_code ? top_code : c;
      c = c < -top_code ? -top_code : c;
      const vi32 h = (c + 64) >> 7;  // floor: lo = c - 128 h in [-64, 63]
      const vi8 hi = __builtin_convertvector(h, vi8), lo = __builtin_convertvector(c - h * 128, vi8);
      std::memcpy(reinterpret_cast<int8_t*>(q.hi) + i * VEC, &hi, VEC);
      std::memcpy(reinterpret_cast<int8_t*>(q.lo) + i * VEC, &lo, VEC);
      sum += c;
    }
    int32_t total = 0;
    for (int i = 0; i < VEC; ++i) total += sum[i];
    q.scale = !finite ? std::numeric_limits<float>::quiet_NaN() : zero ? 0.0f : top / TOP;
    q.sum = static_cast<float>(total);
  }
}

// The R x (P * NR) tile of the quantized rows `xq` (row stride `groups` Groups) times P consecutive panels of
// codes ([K4][NR][4] bytes each, K4 = ceil(K / 4)) with their groups' parameters `params` ([groups][2][NR] floats
// per panel); prefetches `ahead_lines` cache lines from `ahead` into L2 while it runs.
template <int R, int P>
void tile(const Group* xq, const uint8_t* panel, const float* params, int64_t K4, int64_t groups, float* y,
          int64_t ldy, int64_t n_left, const float* bias, bool accumulate, const char* ahead, int64_t ahead_lines) {
  vf acc[P][R][2] = {};
  const int64_t lines_per_quad = K4 > 0 ? (ahead_lines + K4 - 1) / K4 : 0;
  const char* const ahead_end = ahead + ahead_lines * 64;
  for (int64_t g = 0; g < groups; ++g) {
    vi32 hi[P][R][2] = {}, lo[P][R][2] = {};
    const int64_t q_end = std::min(K4, (g + 1) * QUADS);
    for (int64_t q = g * QUADS; q < q_end; ++q) {
      for (int64_t i = 0; i < lines_per_quad && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
      for (int j = 0; j < P; ++j) {
        const uint8_t* codes = panel + (j * K4 + q) * NR * 4;
        const vi32 w0 = load_i32(codes), w1 = load_i32(codes + VEC * 4);
        for (int r = 0; r < R; ++r) {
          const Group& a = xq[r * groups + g];
          const vi32 h = splat_i32(a.hi[q - g * QUADS]), l = splat_i32(a.lo[q - g * QUADS]);
          hi[j][r][0] = dot_u8s8(hi[j][r][0], w0, h);
          hi[j][r][1] = dot_u8s8(hi[j][r][1], w1, h);
          lo[j][r][0] = dot_u8s8(lo[j][r][0], w0, l);
          lo[j][r][1] = dot_u8s8(lo[j][r][1], w1, l);
        }
      }
    }
    for (int j = 0; j < P; ++j) {
      const float* group = params + (j * groups + g) * 2 * NR;
      const vf s[2] = {load_vec(group), load_vec(group + VEC)}, m[2] = {load_vec(group + NR),
                                                                        load_vec(group + NR + VEC)};
      for (int r = 0; r < R; ++r) {
        const Group& a = xq[r * groups + g];
        const vf scale = splat(a.scale), sum = splat(a.sum);
        for (int h = 0; h < 2; ++h) {
          const vf dot = __builtin_convertvector(hi[j][r][h] * 128 + lo[j][r][h], vf);
          acc[j][r][h] += scale * (s[h] * dot + m[h] * sum);
        }
      }
    }
  }
  for (int j = 0; j < P; ++j) {
    const int cols = static_cast<int>(std::min<int64_t>(NR, n_left - j * NR));
    write_tile<R>(acc[j], y + j * NR, ldy, cols, bias ? bias + j * NR : nullptr, accumulate);
  }
}

using Tile = void (*)(const Group*, const uint8_t*, const float*, int64_t, int64_t, float*, int64_t, int64_t,
                      const float*, bool, const char*, int64_t);

template <int... R>
constexpr Tile one_panel[] = {nullptr, tile<R, 1>...};
template <int... R>
constexpr Tile wide[] = {nullptr, tile<R, panels_per_tile(R)>...};

// tiles[r]: the one-panel tile of r rows, r in [1, MR]; wide_tiles[M]: M < MR rows over panels_per_tile(M) panels.
#if defined(__AVX512F__)
constexpr const Tile* tiles = one_panel<1, 2, 3, 4>;
constexpr const Tile* wide_tiles = wide<1, 2, 3>;
#else
constexpr const Tile* tiles = one_panel<1, 2>;
constexpr const Tile* wide_tiles = wide<1>;
#endif

}  // namespace omni::vnni

#endif  // OMNI_INT8_VNNI
