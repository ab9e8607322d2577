// Paged decode attention for CPUs: one query token per sequence against its K/V read in place from the paged
// cache (no gather). The C ABI below is called through ctypes by kernels/paged_decode_cpu.py, which documents the
// contract; this file holds only the arithmetic.
//
// Work item = one sequence b; for each KV head h, the `group` query heads that share it are scored against
// every cached token of b (fp32 dot products), softmax in fp32 (max-subtracted, over the stored scores), then
// P @ V accumulated in fp32 and written in the cache dtype. Tokens are walked block by block (one block-table
// read per block, no division per token). Items are spread over the OpenMP threads of the process (the .so
// links libgomp by soname, so it joins the runtime torch already loaded).
//
// Two paths: for head_dim 64 or 128 and groups of 1 to 8, a SIMD path (cpu_simd.h's vectors: AVX-512, AVX2 or
// 16-byte, by what -march=native enables) keeps the group's queries and accumulators in registers and converts
// each K/V row to fp32 once for the whole group; everything else runs a portable loop that the compiler
// vectorises. Measured on the engine's decode step (SmolLM2 bf16, batch 32, contexts 150-380, one layer, K/V not
// in cache) with the blocks in allocation order, as in a fresh engine: portable loop 630 us, AVX-512 path 410-500
// us, torch's gather + SDPA 1,000-1,400 us. With the blocks scattered at random (a long-running engine;
// scripts/bench_cpu_decode.py): AVX-512 path 690-720 us against 1,280-1,370 us; prefetching the next block's
// rows (its address is in the block table, where no hardware prefetcher looks) took 4-6 % off there.
//
// exp: exp_nonpositive from cpu_math.h; softmax, the block-table check and the denormal mode from cpu_paged.h.

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_paged.h"
#include "cpu_simd.h"

namespace {

// The two 16-bit float formats, as their bits (no compiler float16 type is needed: GCC has _Float16 on x86 only
// from version 12).
struct bf16 {
  uint16_t bits;
};
struct fp16 {
  uint16_t bits;
};

inline float from_bits(uint32_t bits) {
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline uint32_t to_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  return bits;
}

inline float load(float x) { return x; }
inline float load(bf16 x) { return from_bits(static_cast<uint32_t>(x.bits) << 16); }  // the top half of a float32
inline float load(fp16 x) {
#ifdef __F16C__
  return _cvtsh_ss(x.bits);
#else  // IEEE 754 binary16 -> binary32, exact
  const uint32_t sign = static_cast<uint32_t>(x.bits & 0x8000u) << 16;
  const uint32_t exponent = (x.bits >> 10) & 0x1Fu, mantissa = x.bits & 0x3FFu;
  if (exponent == 0x1F) return from_bits(sign | 0x7F800000u | (mantissa << 13));  // inf, nan
  if (exponent != 0) return from_bits(sign | ((exponent + 112) << 23) | (mantissa << 13));  // rebias 15 -> 127
  return from_bits(sign | to_bits(static_cast<float>(mantissa) * 5.9604644775390625e-8f));  // mantissa * 2^-24
#endif
}

inline void store(float x, float* out) { *out = x; }
inline void store(float x, bf16* out) {  // round to nearest even (the kernel's values are finite)
  uint32_t bits = to_bits(x);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  out->bits = static_cast<uint16_t>(bits >> 16);
}
inline void store(float x, fp16* out) {  // round to nearest even
#ifdef __F16C__
  out->bits = _cvtss_sh(x, _MM_FROUND_TO_NEAREST_INT);
#else
  uint32_t bits = to_bits(x);
  const uint16_t sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
  bits &= 0x7FFFFFFFu;
  if (bits >= 0x7F800000u) {  // inf, nan
    out->bits = sign | 0x7C00u | (bits > 0x7F800000u ? 0x200u : 0u);
  } else if (bits >= 0x477FF000u) {  // >= 65520 rounds past the largest half (65504)
    out->bits = sign | 0x7C00u;
  } else if (bits < 0x38800000u) {  // below 2^-14: a subnormal half, mantissa = x * 2^24 rounded to even
    out->bits = sign | static_cast<uint16_t>(std::nearbyint(from_bits(bits) * 16777216.0f));
  } else {  // normal: rebias the exponent, round 23 mantissa bits to 10 (a carry moves into the exponent)
    uint32_t half = (bits - 0x38000000u) >> 13;
    const uint32_t rest = bits & 0x1FFFu;
    if (rest > 0x1000u || (rest == 0x1000u && (half & 1u))) half += 1;
    out->bits = sign | static_cast<uint16_t>(half);
  }
#endif
}

// Prefetches the `head_dim` elements of head h in every row of the block that holds token `start`, if start < len:
// the next block's address comes from the block table, which the hardware prefetchers cannot follow.
template <typename T>
inline void prefetch_block(const T* cache, const int32_t* table, int64_t start, int64_t len, int64_t block_size,
                           const int64_t* stride, int64_t h, int64_t head_dim) {
  if (start >= len) return;
  const T* row = cache + table[start / block_size] * stride[0] + h * stride[2];
  const int64_t rows = start + block_size < len ? block_size : len - start;
  for (int64_t r = 0; r < rows; ++r, row += stride[1])
    for (int64_t e = 0; e < head_dim; e += 64 / static_cast<int64_t>(sizeof(T))) __builtin_prefetch(row + e);
}

// Calls row_fn(t, row) for t = 0..len-1 with `row` pointing at head h of token t's cache row, walking the block
// table block by block (no division per token) and prefetching each next block while the current one is read.
template <typename T, typename RowFn>
inline void for_each_token(const T* cache, const int32_t* table, int64_t len, int64_t block_size,
                           const int64_t* stride, int64_t h, int64_t head_dim, RowFn&& row_fn) {
  for (int64_t start = 0; start < len; start += block_size) {
    prefetch_block(cache, table, start + block_size, len, block_size, stride, h, head_dim);
    const T* row = cache + table[start / block_size] * stride[0] + h * stride[2];
    const int64_t end = start + block_size < len ? start + block_size : len;
    for (int64_t t = start; t < end; ++t, row += stride[1]) row_fn(t, row);
  }
}

// Portable path. One sequence, one KV head h: its `group` query heads (fp32, pre-scaled, [group][head_dim] in
// `q`) against the first `len` tokens; scores [group][len] and acc [group][head_dim] are scratch; writes the
// group's rows of `out` (out_head_stride apart).
template <typename T, typename O>
void attend(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, int64_t group,
            int64_t head_dim, int64_t block_size, const int64_t* k_stride, const int64_t* v_stride, int64_t h,
            float* scores, float* acc, O* out, int64_t out_head_stride) {
  for_each_token(k_cache, table, len, block_size, k_stride, h, head_dim, [&](int64_t t, const T* k) {
    for (int64_t g = 0; g < group; ++g) {  // scores[g, t] = q_g . k_t
      const float* qg = q + g * head_dim;
      float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < head_dim; ++d) dot += qg[d] * load(k[d]);
      scores[g * len + t] = dot;
    }
  });
  for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place; acc = sum_t p[g, t] * v_t
    float* s = scores + g * len;
    const float sum = omni::softmax_numerators(s, len);
    float* a = acc + g * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) a[d] = 0.0f;
    for_each_token(v_cache, table, len, block_size, v_stride, h, head_dim, [&](int64_t t, const T* v) {
      const float p = s[t];
#pragma omp simd
      for (int64_t d = 0; d < head_dim; ++d) a[d] += p * load(v[d]);
    });
    const float inv_sum = 1.0f / sum;
    for (int64_t d = 0; d < head_dim; ++d) store(a[d] * inv_sum, out + g * out_head_stride + d);
  }
}

// SIMD path, same contract as `attend` with head_dim = HEAD_DIM (a multiple of VEC: C vectors) and GROUP query
// heads per KV head: a token's K (then V) row is converted to fp32 once for the whole group, the group's query
// vectors and P @ V accumulators stay in registers (AVX2's 16 spill some to L1), and a score costs C fused
// multiply-adds (in two chains) and one horizontal sum. VEC floats per vector: 16 with AVX-512, 8 with AVX2, else 4 (SSE, NEON).
using omni::hsum;
using omni::load_vec;
using omni::splat;
using omni::vf;
using omni::VEC;

#if defined(__AVX512F__)
inline vf load_vec(const bf16* p) {
  return reinterpret_cast<vf>(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
inline vf load_vec(const fp16* p) {
  return reinterpret_cast<vf>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
}
#elif defined(__AVX2__)
inline vf load_vec(const bf16* p) {
  return reinterpret_cast<vf>(
      _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif
#if !defined(__AVX512F__) && !defined(__AVX2__)
inline vf load_vec(const bf16* p) {
  vf v;
  for (int i = 0; i < VEC; ++i) v[i] = load(p[i]);
  return v;
}
#endif
#if !defined(__AVX512F__)
inline vf load_vec(const fp16* p) {
#if defined(__F16C__) && defined(__AVX2__)
  return reinterpret_cast<vf>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vf v;
  for (int i = 0; i < VEC; ++i) v[i] = load(p[i]);
  return v;
#endif
}
#endif
template <typename T, int HEAD_DIM, int GROUP, typename O>
void attend_simd(const float* q, const T* k_cache, const T* v_cache, const int32_t* table, int64_t len,
                 int64_t block_size, const int64_t* k_stride, const int64_t* v_stride, int64_t h, float* scores,
                 O* out, int64_t out_head_stride) {
  constexpr int C = HEAD_DIM / VEC;
  vf qv[GROUP][C];
  for (int g = 0; g < GROUP; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = load_vec(q + g * HEAD_DIM + VEC * c);
  for_each_token(k_cache, table, len, block_size, k_stride, h, HEAD_DIM, [&](int64_t t, const T* k) {
    vf kv[C];
    for (int c = 0; c < C; ++c) kv[c] = load_vec(k + VEC * c);
    for (int g = 0; g < GROUP; ++g) {  // two chains (even and odd c): shorter rounding chains, more ILP
      vf even = qv[g][0] * kv[0], odd = vf{};
      for (int c = 1; c < C; ++c) (c % 2 ? odd : even) += qv[g][c] * kv[c];
      scores[g * len + t] = hsum(even + odd);
    }
  });
  float inv_sum[GROUP];
  for (int g = 0; g < GROUP; ++g) inv_sum[g] = 1.0f / omni::softmax_numerators(scores + g * len, len);
  vf acc[GROUP][C] = {};
  for_each_token(v_cache, table, len, block_size, v_stride, h, HEAD_DIM, [&](int64_t t, const T* v) {
    vf vv[C];
    for (int c = 0; c < C; ++c) vv[c] = load_vec(v + VEC * c);
    for (int g = 0; g < GROUP; ++g) {
      const vf p = splat(scores[g * len + t]);
      for (int c = 0; c < C; ++c) acc[g][c] += p * vv[c];
    }
  });
  for (int g = 0; g < GROUP; ++g) {
    alignas(64) float row[HEAD_DIM];
    for (int c = 0; c < C; ++c) omni::store_vec(row + VEC * c, acc[g][c] * inv_sum[g]);
    for (int d = 0; d < HEAD_DIM; ++d) store(row[d], out + g * out_head_stride + d);
  }
}

// Runs attend_simd<T, HEAD_DIM, group> for group 1..8; false (nothing run) for other groups.
template <typename T, int HEAD_DIM, int GROUP = 1, typename O>
bool dispatch_group(int64_t group, const float* q, const T* k_cache, const T* v_cache, const int32_t* table,
                    int64_t len, int64_t block_size, const int64_t* k_stride, const int64_t* v_stride, int64_t h,
                    float* scores, O* out, int64_t out_head_stride) {
  if constexpr (GROUP > 8) {
    return false;
  } else {
    if (group == GROUP) {
      attend_simd<T, HEAD_DIM, GROUP, O>(q, k_cache, v_cache, table, len, block_size, k_stride, v_stride, h, scores,
                                      out, out_head_stride);
      return true;
    }
    return dispatch_group<T, HEAD_DIM, GROUP + 1, O>(group, q, k_cache, v_cache, table, len, block_size, k_stride,
                                                  v_stride, h, scores, out, out_head_stride);
  }
}

// Returns -1, or the first row (in the order the threads met them) whose context length needs more than
// `max_blocks` blocks or whose block table names a block outside [0, num_blocks): such rows are left as zeros.
// Query and output are Q (the cache's dtype, or float32 over a bf16 cache: the bf16 CPU step's activations).
template <typename Q, typename T>
int64_t decode(const Q* query, const T* k_cache, const T* v_cache, const int32_t* block_tables,
               const int32_t* context_lens, Q* out, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
               int64_t head_dim, int64_t block_size, int64_t num_blocks, int64_t max_blocks,
               const int64_t* q_stride, const int64_t* k_stride, const int64_t* v_stride, int64_t table_stride,
               const int64_t* out_stride, float scale) {
  const int64_t group = num_q_heads / num_kv_heads;
  std::atomic<int64_t> bad_row{-1};
#pragma omp parallel
  {
    const omni::FlushDenormals flush;
    std::vector<float> q(group * head_dim), acc(group * head_dim), scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = context_lens[b];
      Q* out_b = out + b * out_stride[0];
      const int32_t* table = block_tables + b * table_stride;
      const bool valid = omni::blocks_in_range(table, len, block_size, max_blocks, num_blocks);
      if (!valid) {
        int64_t none = -1;
        bad_row.compare_exchange_strong(none, b);
      }
      if (len <= 0 || !valid) {  // nothing to attend to (or nothing safe to read): zeros
        for (int64_t hq = 0; hq < num_q_heads; ++hq)
          for (int64_t d = 0; d < head_dim; ++d) store(0.0f, out_b + hq * out_stride[1] + d);
        continue;
      }
      scores.resize(group * len);
      for (int64_t h = 0; h < num_kv_heads; ++h) {
        for (int64_t g = 0; g < group; ++g) {
          const Q* src = query + b * q_stride[0] + (h * group + g) * q_stride[1];
          for (int64_t d = 0; d < head_dim; ++d) q[g * head_dim + d] = load(src[d]) * scale;
        }
        Q* out_h = out_b + h * group * out_stride[1];
        if (head_dim == 64 && dispatch_group<T, 64>(group, q.data(), k_cache, v_cache, table, len, block_size,
                                                    k_stride, v_stride, h, scores.data(), out_h, out_stride[1]))
          continue;
        if (head_dim == 128 && dispatch_group<T, 128>(group, q.data(), k_cache, v_cache, table, len, block_size,
                                                      k_stride, v_stride, h, scores.data(), out_h, out_stride[1]))
          continue;
        attend(q.data(), k_cache, v_cache, table, len, group, head_dim, block_size, k_stride, v_stride, h,
               scores.data(), acc.data(), out_h, out_stride[1]);
      }
    }
  }
  return bad_row.load();
}

}  // namespace

#define DEFINE_DECODE(NAME, Q, T)                                                                                 \
  extern "C" int64_t NAME(const void* query, const void* k_cache, const void* v_cache,                         \
                          const int32_t* block_tables, const int32_t* context_lens, void* out, int64_t batch,   \
                          int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size,     \
                          int64_t num_blocks, int64_t max_blocks, const int64_t* q_stride,                     \
                          const int64_t* k_stride, const int64_t* v_stride, int64_t table_stride,              \
                          const int64_t* out_stride, float scale) {                                            \
    return decode<Q, T>(static_cast<const Q*>(query), static_cast<const T*>(k_cache),                                \
                        static_cast<const T*>(v_cache), block_tables, context_lens, static_cast<Q*>(out),            \
                        batch, num_q_heads, num_kv_heads, head_dim, block_size, num_blocks, max_blocks,              \
                        q_stride, k_stride, v_stride, table_stride, out_stride, scale);                              \
  }

DEFINE_DECODE(paged_decode_f32, float, float)
DEFINE_DECODE(paged_decode_bf16, bf16, bf16)
DEFINE_DECODE(paged_decode_f16, fp16, fp16)
// float32 query and output over bfloat16 caches (the bfloat16 C++ CPU step, kernels/cpu_decode_step.cpp)
DEFINE_DECODE(paged_decode_f32_bf16, float, bf16)
