// Linear layers for CPUs: y[M, N] (+)= x[M, K] @ W[N, K]^T (+ bias) with W packed once into column panels, in
// float32, or as bfloat16 where the CPU has AVX512-BF16 (x rounded to bfloat16 too, products summed in float32).
// Weight-only int8 is linear_int8.cpp (its own tiles: 8-bit codes with group scales and minimums).
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
// bfloat16 (built only where the compiler targets AVX512-BF16, i.e. -march=native on such a CPU; elsewhere
// linear_bf16_kernel() is 0): the panels hold pairs of consecutive k, [ceil(N / NR)][ceil(K / 2)][NR] pairs of
// bf16 (the odd K's last pair padded with 0), the layout vdpbf16ps reads: one instruction multiplies VEC columns'
// pairs by a broadcast pair of x and adds both products to the VEC float32 accumulators (Intel SDM, VDPBF16PS;
// the products of two bf16 are exact in float32, each step rounds to nearest even, denormals flush to zero). x is
// rounded to bf16 (nearest even) into a per-thread buffer once per call. K is padded to whole AMX tiles (32 k).
// Where the CPU also has AMX (and Linux grants the process its tile state), every call runs AMX tiles (Intel SDM,
// TDPBF16PS: a 16 x 16 float32 block of y += a 16-row x 32-k block of x times a 32-k x 16-column block of the
// panel, the panel's rows read with stride NR pairs): on this project's 2-core Xeon (AMX, AVX512-BF16) vdpbf16ps
// ran at about 40 % of the float32 FMA peak (register-only loop), AMX many times above it. Otherwise the float32
// tiles with a k-pair per step, in one of two ways, chosen once per process by timing cpu_peaks.h's register
// loops (`measured_bf16_kernel`): vdpbf16ps, or where the FMA loop's FLOP rate is at least 1.5x vdpbf16ps's (the
// Intel Xeon without AMX of docs/benchmarks.md: 2x) the pair widened to two float32 vectors (a shift and an and:
// bf16 is the top half of a float32) and two FMAs, odd k first as vdpbf16ps's definition orders them (Intel SDM,
// VDPBF16PS), x rounded to bf16 but held as float32. The two agree bit for bit but where vdpbf16ps flushes
// denormals. Either way every row goes through the same instructions over the same k blocks whatever the batch
// (AMX tiles always have 16 rows, x zero-padded), so results are batch-invariant in a process; AMX and vdpbf16ps
// machines may differ in the last bits.
//
// Work is split over panels across the calling thread's OpenMP team (static schedule; the engine's CPU threads,
// torch.set_num_threads); with one thread it runs on the caller.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>


#include "cpu_amx.h"
#include "cpu_math.h"
#include "cpu_peaks.h"
#include "cpu_simd.h"
#include "cpu_tiles.h"

namespace {

using omni::load_vec;
using omni::splat;
using omni::vf;
using omni::bf16_bits;
using omni::VEC;

using omni::MR;
using omni::NR;
using omni::panels_per_tile;
using omni::write_tile;

// Two bfloat16 of consecutive k (the lower k in the low half): one element of a bf16 panel or of bf16 x.
struct Bf16Pair {
  uint32_t bits;
};

// The same panels read as float32 pairs: each pair widened to two float32 vectors, multiplied with FMAs.
struct Bf16Wide {
  uint32_t bits;
};

// The x a tile reads for a Weight: bf16 pairs for vdpbf16ps, else float32 (for Bf16Wide the bf16-rounded x, two
// floats per pair).
template <typename Weight>
using Input = std::conditional_t<std::is_same_v<Weight, Bf16Pair>, Bf16Pair, float>;


// The R x (P * NR) tile of x @ [P consecutive panels] over k in [0, K): one accumulator per output, summed in k
// order, so an output's value does not depend on R, P or where its row falls in the batch (batch-invariant).
// Small R take several panels at once (P > 1) so that at least 8 independent multiply-add chains cover the FMA
// units' latency (4 cycles, 2 units). Weight is float (float32 panels), Bf16Pair or Bf16Wide. While it runs, the
// tile prefetches `ahead_lines` cache lines from `ahead` into L2 (see `run`). For bf16 panels K counts pairs:
// Bf16Pair takes bf16 x (vdpbf16ps), Bf16Wide the bf16-rounded x as float32 (see the file comment).
template <int R, int P, typename Weight>
void tile(const Input<Weight>* x, int64_t ldx, const Weight* panel, int64_t K, float* y, int64_t ldy,
          int64_t n_left, const float* bias, bool accumulate, const char* ahead, int64_t ahead_lines) {
  vf acc[P][R][2] = {};
  const int64_t lines_per_k = K > 0 ? (ahead_lines + K - 1) / K : 0;
  const char* const ahead_end = ahead + ahead_lines * 64;
  for (int64_t k = 0; k < K; ++k) {
    for (int64_t i = 0; i < lines_per_k && ahead < ahead_end; ++i, ahead += 64) __builtin_prefetch(ahead, 0, 2);
    for (int j = 0; j < P; ++j) {
      const Weight* w = panel + (j * K + k) * NR;
      if constexpr (std::is_same_v<Weight, Bf16Pair>) {
#if defined(__AVX512BF16__)
        const __m512bh w0 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w));
        const __m512bh w1 = reinterpret_cast<__m512bh>(_mm512_loadu_si512(w + VEC));
        for (int r = 0; r < R; ++r) {
          const __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(x[r * ldx + k].bits)));
          acc[j][r][0] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[j][r][0]), a, w0));
          acc[j][r][1] = reinterpret_cast<vf>(_mm512_dpbf16_ps(reinterpret_cast<__m512>(acc[j][r][1]), a, w1));
        }
#endif
      } else if constexpr (std::is_same_v<Weight, Bf16Wide>) {
#if defined(__AVX512BF16__)
        const __m512i p0 = _mm512_loadu_si512(w), p1 = _mm512_loadu_si512(w + VEC);
        const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
        const vf odd0 = reinterpret_cast<vf>(_mm512_and_si512(p0, high));
        const vf odd1 = reinterpret_cast<vf>(_mm512_and_si512(p1, high));
        const vf even0 = reinterpret_cast<vf>(_mm512_slli_epi32(p0, 16));
        const vf even1 = reinterpret_cast<vf>(_mm512_slli_epi32(p1, 16));
        for (int r = 0; r < R; ++r) {
          const vf a_odd = splat(x[r * ldx + 2 * k + 1]), a_even = splat(x[r * ldx + 2 * k]);
          acc[j][r][0] = a_even * even0 + (a_odd * odd0 + acc[j][r][0]);  // two FMAs (-ffp-contract=fast)
          acc[j][r][1] = a_even * even1 + (a_odd * odd1 + acc[j][r][1]);
        }
#endif
      } else {
        const vf w0 = load_vec(w), w1 = load_vec(w + VEC);
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

template <typename Weight>
using Tile = void (*)(const Input<Weight>*, int64_t, const Weight*, int64_t, float*, int64_t, int64_t,
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

// Bytes of x one call's tiles read: more rows (a prefill's) go in blocks of this much x, a multiple of MR rows, so
// that the tiles of a panel read x from the L2 cache (1-2 MiB per core on this project's CPUs) rather than
// stream all of a prefill's x from memory once per panel; each block streams the weights again (a few MB per
// projection, from the last-level cache after the first).
constexpr int64_t ROW_BLOCK_BYTES = 1 << 20;

// wide_tiles<Weight>[M]: the tile of M rows over panels_per_tile(M) panels, M in [1, 3].
template <typename Weight, int... R>
constexpr Tile<Weight> wide_tiles_of[] = {nullptr, tile<R, panels_per_tile(R), Weight>...};
template <typename Weight>
constexpr const Tile<Weight>* wide_tiles = wide_tiles_of<Weight, 1, 2, 3>;

// The driver of linear_f32 and of linear_bf16's tiles: a prefill's rows in blocks, then omni::for_each_tile. Work
// units, split statically over the threads: with M < 4 rows, groups of panels_per_tile(M) consecutive panels (the
// leftover panels one at a time), each one tile; otherwise one panel each, its rows in tiles of MR. The weights
// stream from memory once per call (a decode step's x rows stay in L1/L2). With several tiles per panel the first
// tile would wait for memory while the others run from L2, so the tiles prefetch the next panel into L2, each its
// share, and the stream overlaps the arithmetic. With one tile the panels are read in address order and the
// hardware prefetchers keep up with float32 (int8 codes go through bytes faster: linear_int8.cpp prefetches for 1-2
// rows too). For bf16 panels K counts pairs; x is bf16
// pairs for Bf16Pair, float32 (two per pair, ldx in floats) for Bf16Wide.
template <typename Weight>
void run(const Input<Weight>* x, int64_t M, int64_t K, int64_t ldx, const Weight* packed, int64_t N,
         const float* bias, float* y, int64_t ldy, bool accumulate) {
  if (M <= 0) return;
  if (M > MR) {  // a prefill's rows in blocks (see ROW_BLOCK_BYTES), each a call over all the panels
    // ldx may be 0 (K == 0, or rows given with stride 0): a row then takes no bytes, and one block holds them all
    const int64_t row_bytes = std::max<int64_t>(ldx, 1) * static_cast<int64_t>(sizeof(Input<Weight>));
    const int64_t block = std::max<int64_t>(MR, ROW_BLOCK_BYTES / row_bytes / MR * MR);
    if (M > block) {
      for (int64_t m = 0; m < M; m += block)
        run(x + m * ldx, std::min(block, M - m), K, ldx, packed, N, bias, y + m * ldy, ldy, accumulate);
      return;
    }
  }
  const int64_t panels = (N + NR - 1) / NR;
  omni::for_each_tile(M, panels, K * NR * static_cast<int64_t>(sizeof(Weight)), packed, 4, MR, panels_per_tile(M),
                      false, [&](int64_t m, int rows, int64_t p, bool wide, const char* ahead, int64_t lines) {
                        (wide ? wide_tiles<Weight> : tiles_for<Weight>)[rows](
                            x + m * ldx, ldx, packed + p * K * NR, K, y + m * ldy + p * NR, ldy, N - p * NR,
                            bias ? bias + p * NR : nullptr, accumulate, ahead, lines);
                      });
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


constexpr int64_t PAIR_BLOCK = 16;  // bf16 panels hold a multiple of this many k pairs (one AMX tile's depth)

#if defined(OMNI_AMX)
static_assert(NR == 32, "the AMX tiles cover a panel with two 16-column tiles");
constexpr int AMX_ROWS = 32;  // rows of x (and y) per block: two 16-row tiles

// Tiles (omni::configure_tiles): 0-3 y (rows 0-15 / 16-31 x the panel's columns 0-15 / 16-31), 4-5 x (rows 0-15 /
// 16-31, 32 k), 6-7 the panel (16 k pairs x columns 0-15 / 16-31).

// out[AMX_ROWS][NR] = x rows [0, 16 or 32) of a block (pairs, row stride ldx) times one panel over K pairs
// (a multiple of PAIR_BLOCK).
template <bool TWO>
void amx_block(const Bf16Pair* x, int64_t ldx, const Bf16Pair* panel, int64_t K, float* out) {
  _tile_zero(0);
  _tile_zero(1);
  if constexpr (TWO) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += PAIR_BLOCK) {
    _tile_loadd(6, panel + k * NR, NR * 4);
    _tile_loadd(7, panel + k * NR + 16, NR * 4);
    _tile_loadd(4, x + k, ldx * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if constexpr (TWO) {
      _tile_loadd(5, x + 16 * ldx + k, ldx * 4);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  _tile_stored(0, out, NR * 4);
  _tile_stored(1, out + 16, NR * 4);
  if constexpr (TWO) {
    _tile_stored(2, out + 16 * NR, NR * 4);
    _tile_stored(3, out + 16 * NR + 16, NR * 4);
  }
}

// y = x @ W^T (+ bias) (+ y) through AMX tiles: x bf16 pairs [ceil(M / AMX_ROWS) * AMX_ROWS][K] (rows from M on
// zero), K a multiple of PAIR_BLOCK; panels split statically over the threads, each panel's rows in blocks of 32.
void run_amx(const Bf16Pair* x, int64_t M, int64_t K, const Bf16Pair* packed, int64_t N, const float* bias, float* y,
             int64_t ldy, bool accumulate) {
  const int64_t panels = (N + NR - 1) / NR;
#pragma omp parallel
  {
    omni::configure_tiles();
    alignas(64) float block[AMX_ROWS * NR];
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels; ++p) {
      const int cols = static_cast<int>(std::min<int64_t>(NR, N - p * NR));
      for (int64_t m = 0; m < M; m += AMX_ROWS) {
        const int64_t rows = std::min<int64_t>(AMX_ROWS, M - m);
        if (rows > 16)
          amx_block<true>(x + m * K, K, packed + p * K * NR, K, block);
        else
          amx_block<false>(x + m * K, K, packed + p * K * NR, K, block);
        for (int64_t r = 0; r < rows; ++r) {  // (acc + bias) + y, the float32 tiles' order
          float* row = y + (m + r) * ldy + p * NR;
          for (int c = 0; c < cols; ++c) {
            const float v = block[r * NR + c] + (bias ? bias[p * NR + c] : 0.0f);
            row[c] = accumulate ? row[c] + v : v;
          }
        }
      }
    }
    _tile_release();  // leave no tile state live in the thread (oneDNN configures its own)
  }
}
#endif

// Without AMX: 3 (widened pairs and FMAs) where omni::fma_outruns_dot_bf16 (cpu_peaks.h), else 1 (vdpbf16ps).
int measured_bf16_kernel() {
#if defined(__AVX512BF16__)
  return omni::fma_outruns_dot_bf16() ? 3 : 1;
#else
  return 0;
#endif
}

// Which bf16 kernel this build and process run: 2 AMX, 1 vdpbf16ps, 3 widened pairs and FMAs, 0 none. A build with
// -DOMNI_BF16_KERNEL=1 or 3 (the tests') runs that one without AMX instead of measuring.
int bf16_kernel() {
#if defined(OMNI_AMX)
  if (omni::amx_permitted()) return 2;
#endif
#if defined(OMNI_BF16_KERNEL) && defined(__AVX512BF16__)
  return OMNI_BF16_KERNEL;
#else
  static const int measured = measured_bf16_kernel();
  return measured;
#endif
}
}  // namespace

extern "C" {

// Panel width the packed layouts use (columns per panel).
int64_t linear_panel_width() { return NR; }

// The bfloat16 kernel this build and process run: 2 AMX tiles, 1 vdpbf16ps tiles, 3 float32 tiles over widened
// pairs, 0 none (linear_pack_bf16 and linear_bf16 then do nothing).
int64_t linear_bf16_kernel() { return bf16_kernel(); }

// k pairs a bf16 panel holds for K: ceil(K / 2) rounded up to a multiple of PAIR_BLOCK.
int64_t linear_bf16_pairs(int64_t K) { return ((K + 1) / 2 + PAIR_BLOCK - 1) / PAIR_BLOCK * PAIR_BLOCK; }

// w [N, K] float32 (row stride ldw) -> packed [ceil(N / NR)][K][NR] float32.
void linear_pack_f32(const float* w, int64_t N, int64_t K, int64_t ldw, float* packed) {
  pack_panels(N, K, packed, [&](int64_t n, int64_t k) { return w[n * ldw + k]; });
}

// y[M, N] = x[M, K] @ W^T (+ bias) (+ y when accumulate != 0). x rows have stride ldx, y rows stride ldy (floats).
void linear_f32(const float* x, int64_t M, int64_t K, int64_t ldx, const float* packed, int64_t N,
                const float* bias, float* y, int64_t ldy, int64_t accumulate) {
  run<float>(x, M, K, ldx, packed, N, bias, y, ldy, accumulate != 0);
}

// w [N, K] float32 -> packed [ceil(N / NR)][linear_bf16_pairs(K)][NR] pairs of bfloat16 (see the file comment),
// each weight rounded to nearest even, k from K on zero.
void linear_pack_bf16(const float* w, int64_t N, int64_t K, int64_t ldw, uint32_t* packed) {
  if (bf16_kernel() == 0) return;
  pack_panels(N, linear_bf16_pairs(K), reinterpret_cast<Bf16Pair*>(packed), [&](int64_t n, int64_t k2) {
    const float* row = w + n * ldw + 2 * k2;
    return Bf16Pair{(2 * k2 < K ? bf16_bits(row[0]) : 0u) | (2 * k2 + 1 < K ? bf16_bits(row[1]) << 16 : 0u)};
  });
}

// As linear_f32 with the bf16 panels of linear_pack_bf16: x is rounded to bfloat16 (nearest even) first.
void linear_bf16(const float* x, int64_t M, int64_t K, int64_t ldx, const uint32_t* packed, int64_t N,
                 const float* bias, float* y, int64_t ldy, int64_t accumulate) {
  const int kernel = bf16_kernel();
  if (M <= 0 || kernel == 0) return;
#if defined(__AVX512BF16__)
  const int64_t pairs = linear_bf16_pairs(K);
  const Bf16Pair* panels = reinterpret_cast<const Bf16Pair*>(packed);
  if (kernel == 3) {
    thread_local std::vector<float> widened;  // the caller's thread: x rounded to bf16, as float32, [M][2 * pairs]
    if (static_cast<int64_t>(widened.size()) < M * 2 * pairs) widened.resize(M * 2 * pairs);
    for (int64_t m = 0; m < M; ++m) {
      float* dst = widened.data() + m * 2 * pairs;
      std::memset(dst + K, 0, (2 * pairs - K) * sizeof(float));  // k from K on
      for (int64_t k = 0; k < K; k += 16) {
        const __mmask16 lanes = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
        const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + m * ldx + k));
        _mm512_mask_storeu_ps(dst + k, lanes, _mm512_castsi512_ps(_mm512_slli_epi32(
            _mm512_cvtepu16_epi32(reinterpret_cast<__m256i>(b)), 16)));
      }
    }
    return run<Bf16Wide>(widened.data(), M, pairs, 2 * pairs, reinterpret_cast<const Bf16Wide*>(panels), N, bias, y,
                         ldy, accumulate != 0);
  }
  const int64_t padded_rows = kernel == 2 ? (M + 31) / 32 * 32 : M;  // AMX tiles read whole 16-row blocks
  thread_local std::vector<Bf16Pair> rounded;  // the caller's thread: x as bf16 pairs, [padded_rows][pairs]
  if (static_cast<int64_t>(rounded.size()) < padded_rows * pairs) rounded.resize(padded_rows * pairs);
  std::memset(static_cast<void*>(rounded.data() + M * pairs), 0, (padded_rows - M) * pairs * sizeof(Bf16Pair));
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* dst = reinterpret_cast<uint16_t*>(rounded.data() + m * pairs);
    std::memset(dst + K, 0, (2 * pairs - K) * sizeof(uint16_t));  // k from K on
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 lanes = K - k >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (K - k)) - 1);
      const __m256bh b = _mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(lanes, x + m * ldx + k));
      _mm256_mask_storeu_epi16(dst + k, lanes, reinterpret_cast<__m256i>(b));
    }
  }
#if defined(OMNI_AMX)
  if (kernel == 2) return run_amx(rounded.data(), M, pairs, panels, N, bias, y, ldy, accumulate != 0);
#endif
  run<Bf16Pair>(rounded.data(), M, pairs, pairs, panels, N, bias, y, ldy, accumulate != 0);
#else
  (void)x, (void)K, (void)ldx, (void)packed, (void)N, (void)bias, (void)y, (void)ldy, (void)accumulate;
#endif
}

}  // extern "C"
