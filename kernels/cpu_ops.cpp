// The float32 CPU engine's per-layer elementwise work, one call each where torch takes 5-10 ops: RMSNorm, rotary
// embedding of q and k with the step's new K/V written into their (float32 or bfloat16) cache slots, and
// SiLU(gate) * up. The C ABI
// below is called through ctypes by kernels/cpu_ops.py, which documents the contract; this file holds only the
// arithmetic.
//
// Rounding matches the torch code these replace (omni_backend/engine/models/): built with -ffp-contract=off, so
// a * b + c rounds twice, as torch's separate ops do. RoPE is then bit-identical to apply_rope (x * cos +
// rotate_half(x) * sin); RMSNorm differs from torch only in the order of its sum of squares; SiLU's exp is
// cpu_math.h's (about 2e-7 relative error, where torch's is Sleef's).
//
// Rows are split over the calling thread's OpenMP team (the engine's CPU threads, torch.set_num_threads; with one
// thread it runs on the caller).

#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_math.h"

extern "C" {

// out[m, :] = weight * (x[m, :] / sqrt(mean(x[m, :]^2) + eps)), float32, rows of stride ldx / ldo.
void rms_norm_f32(const float* x, int64_t M, int64_t H, int64_t ldx, const float* weight, float eps, float* out,
                  int64_t ldo) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* row = x + m * ldx;
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t h = 0; h < H; ++h) sum += row[h] * row[h];
    const float inv = 1.0f / std::sqrt(sum / static_cast<float>(H) + eps);
    float* dst = out + m * ldo;
#pragma omp simd
    for (int64_t h = 0; h < H; ++h) dst[h] = weight[h] * (row[h] * inv);
  }
}

}  // extern "C"

namespace {

// Writes n float32 values into a cache row: copied (float) or rounded to nearest even (bf16 bits).
inline void store_row(const float* src, int64_t n, float* dst) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(const float* src, int64_t n, uint16_t* dst) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<uint16_t>(omni::bf16_bits(src[i]));
}

// qkv [T, (Hq + 2 Hkv) * D] (row stride ldq): rotate the Hq + Hkv query and key heads of every row in place by
// cos/sin [positions, D] at positions[t] (half-split pairing: out = x * cos + rotate_half(x) * sin), then write
// the row's key and value heads to k_cache / v_cache [num_blocks, block_size, Hkv, D] at slot_mapping[t] (block
// slot / block_size, offset slot % block_size; a slot < 0 is padding, not stored), as float32 or rounded to
// bfloat16 (Cache = uint16_t). Returns -1, or the first row whose position or slot is out of range (nothing of that
// row is written).
template <typename Cache>
int64_t rope_store_kv(float* qkv, int64_t T, int64_t ldq, int64_t Hq, int64_t Hkv, int64_t D,
                      const int64_t* positions, const float* cos, const float* sin, int64_t max_positions,
                      const int64_t* slot_mapping, Cache* k_cache, Cache* v_cache, int64_t num_blocks,
                      int64_t block_size) {
  const int64_t half = D / 2, slots = num_blocks * block_size, kv_row = Hkv * D;
  int64_t bad = -1;
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T; ++t) {
    const int64_t pos = positions[t], slot = slot_mapping[t];
    if (pos < 0 || pos >= max_positions || slot >= slots) {
#pragma omp critical
      if (bad < 0 || t < bad) bad = t;
      continue;
    }
    float* row = qkv + t * ldq;
    const float* c = cos + pos * D;
    const float* s = sin + pos * D;
    for (int64_t head = 0; head < Hq + Hkv; ++head) {
      float* x = row + head * D;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float x1 = x[i], x2 = x[i + half];
        const float a = x1 * c[i], b = -x2 * s[i];
        const float e = x2 * c[i + half], f = x1 * s[i + half];
        x[i] = a + b;
        x[i + half] = e + f;
      }
    }
    if (slot < 0) continue;
    const int64_t offset = slot * kv_row;  // the cache is contiguous: block * block_size + offset = slot
    store_row(row + Hq * D, kv_row, k_cache + offset);
    store_row(row + (Hq + Hkv) * D, kv_row, v_cache + offset);
  }
  return bad;
}

}  // namespace

extern "C" {

// rope_store_kv into float32 caches (rope_store_kv_f32) or bfloat16 ones (rope_store_kv_f32_bf16: the float32
// K/V rounded to nearest even); the caches are void* so that one function-pointer type takes both.
#define DEFINE_ROPE_STORE_KV(NAME, Cache)                                                                            \
  int64_t NAME(float* qkv, int64_t T, int64_t ldq, int64_t Hq, int64_t Hkv, int64_t D, const int64_t* positions,     \
               const float* cos, const float* sin, int64_t max_positions, const int64_t* slot_mapping,               \
               void* k_cache, void* v_cache, int64_t num_blocks, int64_t block_size) {                               \
    return rope_store_kv(qkv, T, ldq, Hq, Hkv, D, positions, cos, sin, max_positions, slot_mapping,                  \
                         static_cast<Cache*>(k_cache), static_cast<Cache*>(v_cache), num_blocks, block_size);        \
  }

DEFINE_ROPE_STORE_KV(rope_store_kv_f32, float)
DEFINE_ROPE_STORE_KV(rope_store_kv_f32_bf16, uint16_t)

// out[m, i] = silu(gate_up[m, i]) * gate_up[m, I + i] for i < I, silu(g) = g * sigmoid(g), the sigmoid from
// e = exp(-|g|) <= 1 (1 / (1 + e) for g >= 0, e / (1 + e) below), so exp never overflows.
void silu_mul_f32(const float* gate_up, int64_t M, int64_t I, int64_t ldg, float* out, int64_t ldo) {
#pragma omp parallel for schedule(static)
  for (int64_t m = 0; m < M; ++m) {
    const float* g = gate_up + m * ldg;
    const float* u = g + I;
    float* dst = out + m * ldo;
#pragma omp simd
    for (int64_t i = 0; i < I; ++i) {
      const float e = omni::exp_nonpositive(-std::fabs(g[i]));
      const float sigmoid = (g[i] >= 0.0f ? 1.0f : e) / (1.0f + e);
      dst[i] = g[i] * sigmoid * u[i];
    }
  }
}

}  // extern "C"
