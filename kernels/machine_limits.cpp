// The CPU's limits: memory bandwidth (a STREAM triad and a read-only pass, each split statically over the
// calling thread's OpenMP team) and arithmetic peaks, measured with register-only loops (no memory traffic):
// float32 FMA, AVX512-BF16 dot products (vdpbf16ps), AMX bf16 tile products (tdpbf16ps) and VNNI u8 x s8 dot
// products (vpdpbusd). The C ABI below is
// called through ctypes by kernels/machine_limits.py, which documents the contract; scripts/bench_cpu_step.py
// reports each decode step against these (a benchmark's yardstick, not used by the engine).
//
// The FMA and vdpbf16ps loops are cpu_peaks.h's; the AMX loop keeps four 16 x 16 accumulator tiles in flight.
// Every thread of the calling OpenMP team runs `iters` iterations; the result is the team's FLOP per second (a
// multiply-add = 2).

#include <omp.h>

#include <cstdint>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#include "cpu_amx.h"
#include "cpu_peaks.h"
#include "cpu_simd.h"
#include "int8_vnni.h"

namespace {

using omni::vf;
using omni::VEC;

template <typename Body>
double team_rate(double flop_per_thread, Body body) {
  double seconds = 0.0;
  int threads = 1;
#pragma omp parallel
  {
#pragma omp single
    threads = omp_get_num_threads();
#pragma omp barrier
    const double start = omp_get_wtime();
    body();
#pragma omp barrier
#pragma omp single
    seconds = omp_get_wtime() - start;
  }
  return seconds > 0.0 ? flop_per_thread * threads / seconds : 0.0;
}

}  // namespace

extern "C" {

// Best seconds over `repeats` passes of a[i] = b[i] + s * c[i], i < n (STREAM's triad).
double triad_seconds(float* a, const float* b, const float* c, int64_t n, int64_t repeats) {
  double best = 1e30;
  for (int64_t r = 0; r < repeats; ++r) {
    const double start = omp_get_wtime();
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) a[i] = b[i] + 3.0f * c[i];
    const double seconds = omp_get_wtime() - start;
    best = seconds < best ? seconds : best;
  }
  return best;
}

// Best seconds over `repeats` passes reading a[0, n) (a sum in 8 vector chains, n a multiple of 8 * VEC; the sum
// is written to *sink so that the reads stay).
double read_seconds(const float* a, int64_t n, int64_t repeats, float* sink) {
  double best = 1e30;
  for (int64_t r = 0; r < repeats; ++r) {
    const double start = omp_get_wtime();
    float total = 0.0f;
#pragma omp parallel reduction(+ : total)
    {
      vf acc[8] = {};
#pragma omp for schedule(static)
      for (int64_t i = 0; i < n; i += 8 * VEC)
        for (int j = 0; j < 8; ++j) acc[j] += omni::load_vec(a + i + j * VEC);
      for (int j = 0; j < 8; ++j) total += omni::hsum(acc[j]);
    }
    const double seconds = omp_get_wtime() - start;
    *sink = total;
    best = seconds < best ? seconds : best;
  }
  return best;
}

// float32 fused multiply-adds on VEC-lane vectors.
double peak_fma_f32(int64_t iters) {
  return team_rate(2.0 * VEC * omni::CHAINS * iters, [iters] { omni::fma_f32_loop(iters); });
}

// AVX512-BF16 vdpbf16ps (16 lanes x 2 multiply-adds); 0 where the build has no AVX512-BF16.
double peak_dot_bf16(int64_t iters) {
#if defined(__AVX512BF16__)
  return team_rate(4.0 * 16 * omni::CHAINS * iters, [iters] { omni::dot_bf16_loop(iters); });
#else
  (void)iters;
  return 0.0;
#endif
}

// VNNI vpdpbusd (VEC 32-bit lanes x 4 u8 x s8 multiply-adds; a multiply-add counted as 2, like the float ones); 0
// where the build has no VNNI (int8_vnni.h's OMNI_INT8_VNNI).
double peak_dot_int8(int64_t iters) {
#if defined(OMNI_INT8_VNNI)
  return team_rate(8.0 * VEC * omni::CHAINS * iters, [iters] {
    omni::vi32 acc[omni::CHAINS] = {};
    omni::vi32 a = omni::vnni::splat_i32(0x01010101), b = omni::vnni::splat_i32(0x01ff01ff);
    for (int64_t it = 0; it < iters; ++it) {
      for (int i = 0; i < omni::CHAINS; ++i) acc[i] = omni::vnni::dot_u8s8(acc[i], a, b);
      __asm__ volatile("" : "+x"(a), "+x"(b));
    }
    int32_t sink = 0;
    for (int i = 0; i < omni::CHAINS; ++i) sink += acc[i][0];
    __asm__ volatile("" : : "r"(sink));
  });
#else
  (void)iters;
  return 0.0;
#endif
}

// AMX tdpbf16ps (a 16 x 16 float32 tile += 16 x 32 bf16 times 32 x 16 bf16: 8,192 multiply-adds); 0 where the
// build has no AMX-BF16 or Linux refuses the process its tile state.
double peak_amx_bf16(int64_t iters) {
#if defined(OMNI_AMX)
  if (!omni::amx_permitted()) return 0.0;
  return team_rate(2.0 * 16 * 16 * 32 * 4 * iters, [iters] {
    omni::configure_tiles();
    for (int64_t it = 0; it < iters; ++it) {
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 4, 7);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
    _tile_release();
  });
#else
  (void)iters;
  return 0.0;
#endif
}

}  // extern "C"
