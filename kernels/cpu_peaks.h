// Register-only arithmetic loops shared by the C++ CPU kernels of kernels/ (header-only; cpu_library.py hashes it
// with each source): machine_limits.cpp times them as the machine's peaks, linear_cpu.cpp to choose how it
// multiplies bfloat16 panels on a CPU without AMX.
//
// Each loop keeps CHAINS independent accumulators in flight, enough to cover the instruction's latency (FMA: 4
// cycles x 2 units -> 8 chains, 12 used; vdpbf16ps likewise), with the operands pinned in registers by an empty asm
// so the compiler cannot hoist or fold the arithmetic. Each returns its FLOP (a multiply-add = 2).

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

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
#endif

}  // namespace omni
