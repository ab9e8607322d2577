// Register-only arithmetic loops shared by the C++ CPU kernels of kernels/ (header-only; cpu_library.py hashes it
// with each source): machine_limits.cpp times them as the machine's peaks; linear_cpu.cpp (bfloat16 panels on a
// CPU without AMX) and paged_prefill_cpu.cpp (bfloat16 K/V) choose by `fma_outruns_dot_bf16` how they multiply.
//
// Each loop keeps CHAINS independent accumulators in flight, enough to cover the instruction's latency (FMA: 4
// cycles x 2 units -> 8 chains, 12 used; vdpbf16ps likewise), with the operands pinned in registers by an empty asm
// so the compiler cannot hoist or fold the arithmetic. Each returns its FLOP (a multiply-add = 2).

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <algorithm>
#include <chrono>
#include <cstdint>

#include "cpu_simd.h"

namespace omni {

constexpr int CHAINS = 12;

// `iters` rounds of CHAINS float32 fused multiply-adds on VEC-lane vectors.
inline double fma_f32_loop(int64_t iters) {
  vf acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = splat(0.001f * i);
  vf a = splat(1.0000001f), b = splat(0.9999999f);
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < CHAINS; ++i) acc[i] = a * b + acc[i];
    __asm__ volatile("" : "+x"(a), "+x"(b));
  }
  float sink = 0.0f;
  for (int i = 0; i < CHAINS; ++i) sink += hsum(acc[i]);
  __asm__ volatile("" : : "x"(sink));
  return 2.0 * VEC * CHAINS * iters;
}

#if defined(__AVX512BF16__)
// `iters` rounds of CHAINS AVX512-BF16 vdpbf16ps (16 lanes x 2 multiply-adds each).
inline double dot_bf16_loop(int64_t iters) {
  __m512 acc[CHAINS];
  for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_set1_ps(0.001f * i);
  __m512bh a = reinterpret_cast<__m512bh>(_mm512_set1_epi16(0x3f80)), b = a;  // bf16 1.0
  for (int64_t it = 0; it < iters; ++it) {
    for (int i = 0; i < CHAINS; ++i) acc[i] = _mm512_dpbf16_ps(acc[i], a, b);
    __asm__ volatile("" : "+v"(a), "+v"(b));
  }
  float sink = 0.0f;
  for (int i = 0; i < CHAINS; ++i) sink += _mm512_reduce_add_ps(acc[i]);
  __asm__ volatile("" : : "x"(sink));
  return 4.0 * 16 * CHAINS * iters;
}

// Whether the float32 FMA loop's FLOP rate is at least 1.5x vdpbf16ps's here (then bfloat16 operands are better
// widened to float32 and multiplied with FMAs: one vdpbf16ps per 2 cycles on the Intel Xeons measured, one per
// cycle on the AMD EPYC, docs/benchmarks.md). Each loop's best of 5 runs of about 0.1-0.5 ms, interleaved, so that
// a moment of load on a shared machine does not decide; the margin keeps a CPU where they are close on vdpbf16ps.
// Measured once per process: GCC exports the static as a unique symbol (STB_GNU_UNIQUE), so the first library to
// ask measures for all (linear and attention kernels then agree); with clang once per library.
inline bool fma_outruns_dot_bf16() {
  static const bool outruns = [] {
    double dot = 0.0, fma = 0.0;
    for (int i = 0; i < 5; ++i) {
      for (const bool is_dot : {true, false}) {
        const auto start = std::chrono::steady_clock::now();
        const double flop = is_dot ? dot_bf16_loop(1 << 14) : fma_f32_loop(1 << 14);
        const double rate = flop / std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        (is_dot ? dot : fma) = std::max(is_dot ? dot : fma, rate);
      }
    }
    return fma >= 1.5 * dot;
  }();
  return outruns;
}
#endif

}  // namespace omni
