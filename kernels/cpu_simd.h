// The SIMD vocabulary of the C++ CPU kernels of kernels/ (header-only; cpu_library.py hashes it with each source):
// a float vector of VEC lanes as a GCC/clang vector extension, so one kernel source compiles to AVX-512 (16
// lanes), AVX2 (8) or 16-byte SSE/NEON vectors (4) by what -march=native enables.
//
// Where the generic form compiles to scalar code (a broadcast is an add of +0 then a shuffle, a byte widening is
// 16 scalar moves), x86 gets the one instruction it needs.

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>

namespace omni {

#if defined(__AVX512F__)
constexpr int VEC = 16;
#elif defined(__AVX2__)
constexpr int VEC = 8;
#else
constexpr int VEC = 4;
#endif

typedef float vf __attribute__((vector_size(VEC * 4)));
typedef float vf_unaligned __attribute__((vector_size(VEC * 4), aligned(4)));
typedef uint8_t vu8_unaligned __attribute__((vector_size(VEC), aligned(1)));
typedef int32_t vi32 __attribute__((vector_size(VEC * 4)));

inline vf load_vec(const float* p) { return *reinterpret_cast<const vf_unaligned*>(p); }
inline void store_vec(float* p, vf v) { *reinterpret_cast<vf_unaligned*>(p) = v; }

// The sum of v's lanes. With AVX-512 a shuffle tree (_mm512_reduce_add_ps): the generic loop compiles to 16
// serial scalar adds, which made the paged decode kernel's scores (one sum per token and query head) about a third
// of its time; the tree took 8 % off a batch-32 bfloat16 decode step on the Intel Xeon (docs/benchmarks.md).
inline float hsum(vf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#else
  float sum = 0.0f;
  for (int i = 0; i < VEC; ++i) sum += v[i];
  return sum;
#endif
}

// x in every lane; VEC uint8 values at p widened to float.
#if defined(__AVX512F__)
inline vf splat(float x) { return reinterpret_cast<vf>(_mm512_set1_ps(x)); }
inline vf widen_u8(const uint8_t* p) {
  return reinterpret_cast<vf>(
      _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)))));
}
#elif defined(__AVX2__)
inline vf splat(float x) { return reinterpret_cast<vf>(_mm256_set1_ps(x)); }
inline vf widen_u8(const uint8_t* p) {
  return reinterpret_cast<vf>(
      _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p)))));
}
#else
inline vf splat(float x) {
  vf v;
  for (int i = 0; i < VEC; ++i) v[i] = x;
  return v;
}
inline vf widen_u8(const uint8_t* p) {
  return __builtin_convertvector(__builtin_convertvector(*reinterpret_cast<const vu8_unaligned*>(p), vi32), vf);
}
#endif

}  // namespace omni
