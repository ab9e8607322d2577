// Paged prefill attention for CPUs: each prefill chunk's float32 queries against its sequence's K/V (float32 or
// bfloat16 caches), causal, with the queries aligned to the end of the context. The C ABI below is called through
// ctypes by kernels/paged_prefill_cpu.py, which documents the contract; this file holds only the arithmetic.
//
// Work item = one sequence s and one KV head h. Its context is read once out of the blocks into two float32
// scratch arrays: K transposed ([head_dim][ctx rounded up to VEC], so one vector holds VEC keys' values of one
// dimension) and V ([ctx][head_dim]). The chunk's queries are taken ROWS (query token, query head) pairs at a
// time, the `group` heads that share h for ROWS / group consecutive tokens (a short last block repeats its last
// pair). For a block, like one tile of a GEMM:
//   scores S[ROWS][keys] = Q K^T, VEC keys per vector: per dimension one load of K^T and ROWS fused multiply-adds
//     with the query value broadcast, so no horizontal sums (the decode kernel's one query needs one per score);
//   a row's keys stop at its position (causal); softmax in float32 over the row's scores (max subtracted,
//     exp_nonpositive from cpu_math.h), the keys past the row's end set to 0;
//   out = P V / sum, 6 rows x 4 vectors of head_dim at a time in registers.
// Work and reads: a block reads its keys up to its last position, so the causal triangle is walked at the
// granularity of ROWS / group tokens; scratch: (2 head_dim + ROWS) x ctx floats a thread. Everything is float32
// (as torch's attention in the reference, kernels/paged_prefill.py's paged_prefill_attention_reference, which
// widens a bfloat16 cache the same way) but on the pair path below.
//
// bfloat16 caches where vdpbf16ps is not outrun by FMAs (omni::fma_outruns_dot_bf16, cpu_peaks.h: the AMD EPYC,
// not the Intel Xeons measured) take the pair path: the context is kept in bfloat16, K^T as pairs of consecutive
// dimensions per key and V as pairs of consecutive keys per dimension, the queries and the softmax weights are
// rounded to bfloat16 (as a bfloat16 model's are in vLLM's and FlashAttention's kernels), and each vdpbf16ps does
// two multiply-adds per lane, float32 accumulation; the softmax and its sum stay float32 (unrounded weights).
//
// Why: the reference's torch SDPA ran SmolLM2's prefill attention at 33-55 GFLOP/s of causal work on the AMD EPYC
// (Zen 4), a third of a 1,000-token prefill in the bfloat16 C++ step; the float32 blocks run it at about 84, the
// pair path at about 130 (docs/benchmarks.md).

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "cpu_math.h"
#include "cpu_paged.h"
#include "cpu_peaks.h"
#include "cpu_simd.h"

namespace {

using omni::load_vec;
using omni::splat;
using omni::store_vec;
using omni::vf;
using omni::VEC;

constexpr int ROWS = 12;     // (token, head) pairs per block: 12 score vectors + 1 key vector fit AVX2's 16 registers
// rows whose P V accumulators are held at once: 6 x 4 vectors + 4 of V + a broadcast fit AVX-512's 32 registers;
// AVX2's 16 spill some to L1 (3 or 2 rows there were no faster in a build without AVX-512 on the AMD EPYC)
constexpr int PV_ROWS = 6;
constexpr int PV_VECS = 4;   // vectors of head_dim per P V pass

struct bf16 {
  uint16_t bits;
};

inline float widen(float x) { return x; }
inline float widen(bf16 x) {  // bfloat16 is the top half of a float32
  const uint32_t bits = static_cast<uint32_t>(x.bits) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

// The first `len` tokens of KV head h of one sequence into kt ([head_dim][ld]) and v ([ld][head_dim]), walking
// its block table; the padding (tokens len..ld-1) is zero in both, so a block's last vector of keys reads no
// stale values (a zero weight times a stale NaN would be NaN).
template <typename T>
void gather(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, int64_t block_size,
            const int64_t* k_stride, const int64_t* v_stride, int64_t h, int64_t head_dim, int64_t ld, float* kt,
            float* v) {
  for (int64_t t = 0; t < len; ++t) {
    const int64_t block = table[t / block_size], slot = t % block_size;
    const T* k_row = k_cache + block * k_stride[0] + slot * k_stride[1] + h * k_stride[2];
    const T* v_row = v_cache + block * v_stride[0] + slot * v_stride[1] + h * v_stride[2];
    for (int64_t d = 0; d < head_dim; ++d) kt[d * ld + t] = widen(k_row[d]);
    for (int64_t d = 0; d < head_dim; ++d) v[t * head_dim + d] = widen(v_row[d]);
  }
  for (int64_t d = 0; d < head_dim; ++d)
    for (int64_t t = len; t < ld; ++t) kt[d * ld + t] = 0.0f;
  for (int64_t i = len * head_dim; i < ld * head_dim; ++i) v[i] = 0.0f;
}

// s[r][0..keys) = q_r . k_t for the ROWS pre-scaled queries q ([ROWS][head_dim]); keys a multiple of VEC.
void scores(const float* q, const float* kt, int64_t ld, int64_t keys, int64_t head_dim, float* s) {
  for (int64_t j = 0; j < keys; j += VEC) {
    vf acc[ROWS] = {};
    for (int64_t d = 0; d < head_dim; ++d) {
      const vf k = load_vec(kt + d * ld + j);
      for (int r = 0; r < ROWS; ++r) acc[r] += splat(q[r * head_dim + d]) * k;
    }
    for (int r = 0; r < ROWS; ++r) store_vec(s + r * ld + j, acc[r]);
  }
}

// Row r's scores s[0..len) -> exp(s - max), s[len..keys) -> 0; returns 1 / the sum of the exps.
float softmax_row(float* s, int64_t len, int64_t keys) {
  const float sum = omni::softmax_numerators(s, len);
  for (int64_t t = len; t < keys; ++t) s[t] = 0.0f;
  return 1.0f / sum;
}

// o[r] = inv_sum[r] * sum_t p[r][t] v_t for r in [r0, r0 + PV_ROWS), PV_VECS vectors of head_dim from c0.
void weighted_values(const float* p, int64_t ld, const float* v, int64_t keys, int64_t head_dim, int r0,
                     int64_t c0, const float* inv_sum, float* o) {
  vf acc[PV_ROWS][PV_VECS] = {};
  for (int64_t t = 0; t < keys; ++t) {
    vf vv[PV_VECS];
    for (int c = 0; c < PV_VECS; ++c) vv[c] = load_vec(v + t * head_dim + c0 + c * VEC);
    for (int r = 0; r < PV_ROWS; ++r) {
      const vf w = splat(p[(r0 + r) * ld + t]);
      for (int c = 0; c < PV_VECS; ++c) acc[r][c] += w * vv[c];
    }
  }
  for (int r = 0; r < PV_ROWS; ++r)
    for (int c = 0; c < PV_VECS; ++c)
      store_vec(o + (r0 + r) * head_dim + c0 + c * VEC, acc[r][c] * splat(inv_sum[r0 + r]));
}

#if defined(__AVX512BF16__)
// The pair path (see the top): vdpbf16ps over pairs of bfloat16 values held as 32-bit words.
inline uint32_t bf16_pair(float lo, float hi) {  // lo in the low half, as vdpbf16ps pairs element 2i with 2i + 1
  return omni::bf16_bits(lo) | (omni::bf16_bits(hi) << 16);
}

// The first `len` tokens of KV head h into kt2 ([head_dim / 2][ld] words: dimensions 2p, 2p + 1 of key t) and
// v2 ([ld / 2][head_dim] words: keys 2u, 2u + 1 of dimension d); the padding (tokens len..ld-1) is zero.
void gather_pairs(const bf16* k_cache, const bf16* v_cache, const int32_t* table, int64_t len, int64_t block_size,
                  const int64_t* k_stride, const int64_t* v_stride, int64_t h, int64_t head_dim, int64_t ld,
                  uint32_t* kt2, uint32_t* v2) {
  const int64_t pairs = head_dim / 2;
  const auto row = [&](const bf16* cache, const int64_t* stride, int64_t t) -> const bf16* {  // null: padding
    return t < len ? cache + table[t / block_size] * stride[0] + (t % block_size) * stride[1] + h * stride[2]
                   : nullptr;
  };
  for (int64_t t = 0; t < ld; t += 2) {  // ld is a multiple of VEC, so even
    for (int64_t u = t; u < t + 2; ++u) {
      const bf16* k = row(k_cache, k_stride, u);
      for (int64_t p = 0; p < pairs; ++p)
        kt2[p * ld + u] = k ? k[2 * p].bits | (static_cast<uint32_t>(k[2 * p + 1].bits) << 16) : 0u;
    }
    const bf16 *v_even = row(v_cache, v_stride, t), *v_odd = row(v_cache, v_stride, t + 1);
    uint32_t* out = v2 + (t / 2) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d)
      out[d] = (v_even ? v_even[d].bits : 0u) | (static_cast<uint32_t>(v_odd ? v_odd[d].bits : 0u) << 16);
  }
}

// s[r][0..keys) = q_r . k_t, q2 ([ROWS][head_dim / 2] words) the pre-scaled queries in bfloat16 pairs.
void scores_pairs(const uint32_t* q2, const uint32_t* kt2, int64_t ld, int64_t keys, int64_t head_dim, float* s) {
  const int64_t pairs = head_dim / 2;
  for (int64_t j = 0; j < keys; j += 16) {
    __m512 acc[ROWS];
    for (int r = 0; r < ROWS; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t p = 0; p < pairs; ++p) {
      const __m512bh k = reinterpret_cast<__m512bh>(_mm512_loadu_si512(kt2 + p * ld + j));
      for (int r = 0; r < ROWS; ++r)
        acc[r] = _mm512_dpbf16_ps(acc[r], reinterpret_cast<__m512bh>(_mm512_set1_epi32(q2[r * pairs + p])), k);
    }
    for (int r = 0; r < ROWS; ++r) _mm512_storeu_ps(s + r * ld + j, acc[r]);
  }
}

// o[r] = inv_sum[r] * sum_t p[r][t] v_t for r in [r0, r0 + 6), 4 vectors of head_dim from c0; p2 ([ROWS][ld / 2]
// words) the softmax weights in bfloat16 pairs.
void weighted_values_pairs(const uint32_t* p2, int64_t ld, const uint32_t* v2, int64_t keys, int64_t head_dim,
                           int r0, int64_t c0, const float* inv_sum, float* o) {
  __m512 acc[6][4];
  for (auto& row : acc)
    for (auto& a : row) a = _mm512_setzero_ps();
  for (int64_t u = 0; u < keys / 2; ++u) {
    __m512bh vv[4];
    for (int c = 0; c < 4; ++c)
      vv[c] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(v2 + u * head_dim + c0 + 16 * c));
    for (int r = 0; r < 6; ++r) {
      const __m512bh w = reinterpret_cast<__m512bh>(_mm512_set1_epi32(p2[(r0 + r) * (ld / 2) + u]));
      for (int c = 0; c < 4; ++c) acc[r][c] = _mm512_dpbf16_ps(acc[r][c], w, vv[c]);
    }
  }
  for (int r = 0; r < 6; ++r)
    for (int c = 0; c < 4; ++c)
      _mm512_storeu_ps(o + (r0 + r) * head_dim + c0 + 16 * c,
                       _mm512_mul_ps(acc[r][c], _mm512_set1_ps(inv_sum[r0 + r])));
}
#endif

// Whether bfloat16 caches take the pair path here: a build with -DOMNI_BF16_KERNEL=1 (vdpbf16ps) or 3 (FMAs), the
// linear kernels' switch, forces it (the tests); else vdpbf16ps unless FMAs outrun it.
bool use_pairs() {
#if defined(__AVX512BF16__) && defined(OMNI_BF16_KERNEL)
  return OMNI_BF16_KERNEL == 1;
#elif defined(__AVX512BF16__)
  return !omni::fma_outruns_dot_bf16();
#else
  return false;
#endif
}

// The pair path's gather and block (see the top); with no pair path here, never called (`pairs` is false).
template <typename T>
void gather_context(const T* k_cache, const T* v_cache, const int32_t* table, int64_t len, int64_t block_size,
                    const int64_t* k_stride, const int64_t* v_stride, int64_t h, int64_t head_dim, int64_t ld,
                    uint32_t* kt2, uint32_t* v2) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same<T, bf16>::value)
    gather_pairs(k_cache, v_cache, table, len, block_size, k_stride, v_stride, h, head_dim, ld, kt2, v2);
#endif
}

// One block of ROWS rows on the pair path: the float32 pre-scaled queries q rounded into q2, scores into s,
// softmax, its weights rounded into p2, out o; inv_sum gets each row's 1 / sum.
void attend_pairs(const float* q, uint32_t* q2, const uint32_t* kt2, const uint32_t* v2, int64_t ld, int64_t keys,
                  int64_t head_dim, const int64_t* lens, float* s, uint32_t* p2, float* inv_sum, float* o) {
#if defined(__AVX512BF16__)
  const int64_t pairs = head_dim / 2, half = ld / 2;
  for (int64_t i = 0; i < ROWS * pairs; ++i) q2[i] = bf16_pair(q[2 * i], q[2 * i + 1]);
  scores_pairs(q2, kt2, ld, keys, head_dim, s);
  for (int r = 0; r < ROWS; ++r) {
    float* row = s + r * ld;
    inv_sum[r] = softmax_row(row, lens[r], keys);
    for (int64_t u = 0; u < keys / 2; ++u) p2[r * half + u] = bf16_pair(row[2 * u], row[2 * u + 1]);
  }
  for (int r0 = 0; r0 < ROWS; r0 += 6)
    for (int64_t c0 = 0; c0 < head_dim; c0 += 64) weighted_values_pairs(p2, ld, v2, keys, head_dim, r0, c0, inv_sum, o);
#endif
}

// Returns -1, or the first sequence (in the order the threads met them) that breaks the contract (more new tokens
// than context, a context needing more blocks than its table has columns, or a block outside [0, num_blocks)):
// its rows of `out` are left unwritten.
template <typename T>
int64_t prefill(const float* query, const T* k_cache, const T* v_cache, const int32_t* block_tables,
                const int32_t* query_start_loc, const int32_t* context_lens, float* out, int64_t num_seqs,
                int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,
                int64_t max_blocks, const int64_t* q_stride, const int64_t* k_stride, const int64_t* v_stride,
                int64_t table_stride, const int64_t* out_stride, float scale) {
  const int64_t group = num_q_heads / num_kv_heads;
  const int64_t tokens_per_block = ROWS / group;
  const bool pairs = std::is_same<T, bf16>::value && use_pairs();
  std::atomic<int64_t> bad_seq{-1};
#pragma omp parallel
  {
    const omni::FlushDenormals flush;
    std::vector<float> kt, v, s, q(ROWS * head_dim), o(ROWS * head_dim);
    std::vector<uint32_t> kt2, v2, q2(ROWS * head_dim / 2), p2;
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
      const int64_t seq = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t q0 = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q0, ctx = context_lens[seq];
      if (q_len <= 0) continue;
      const int32_t* table = block_tables + seq * table_stride;
      if (q_len > ctx || !omni::blocks_in_range(table, ctx, block_size, max_blocks, num_blocks)) {
        int64_t none = -1;
        bad_seq.compare_exchange_strong(none, seq);
        continue;
      }
      const int64_t ld = (ctx + VEC - 1) / VEC * VEC;
      s.resize(ROWS * ld);
      if (pairs) {
        kt2.resize(head_dim / 2 * ld);
        v2.resize(ld / 2 * head_dim);
        p2.resize(ROWS * ld / 2);
        gather_context(k_cache, v_cache, table, ctx, block_size, k_stride, v_stride, h, head_dim, ld, kt2.data(),
                       v2.data());
      } else {
        kt.resize(head_dim * ld);
        v.resize(ld * head_dim);
        gather(k_cache, v_cache, table, ctx, block_size, k_stride, v_stride, h, head_dim, ld, kt.data(), v.data());
      }
      for (int64_t i0 = 0; i0 < q_len; i0 += tokens_per_block) {
        const int64_t tokens = q_len - i0 < tokens_per_block ? q_len - i0 : tokens_per_block;
        int64_t lens[ROWS];
        for (int r = 0; r < ROWS; ++r) {  // row r = (token i0 + r / group, head h * group + r % group)
          const int64_t pair = r < tokens * group ? r : tokens * group - 1;
          const int64_t i = i0 + pair / group, hq = h * group + pair % group;
          const float* src = query + (q0 + i) * q_stride[0] + hq * q_stride[1];
          for (int64_t d = 0; d < head_dim; ++d) q[r * head_dim + d] = src[d] * scale;
          lens[r] = ctx - q_len + i + 1;
        }
        const int64_t keys = (lens[ROWS - 1] + VEC - 1) / VEC * VEC;  // the last row's is the longest
        float inv_sum[ROWS];
        if (pairs) {
          attend_pairs(q.data(), q2.data(), kt2.data(), v2.data(), ld, keys, head_dim, lens, s.data(), p2.data(),
                       inv_sum, o.data());
        } else {
          scores(q.data(), kt.data(), ld, keys, head_dim, s.data());
          for (int r = 0; r < ROWS; ++r) inv_sum[r] = softmax_row(s.data() + r * ld, lens[r], keys);
          for (int r0 = 0; r0 < ROWS; r0 += PV_ROWS)
            for (int64_t c0 = 0; c0 < head_dim; c0 += PV_VECS * VEC)
              weighted_values(s.data(), ld, v.data(), keys, head_dim, r0, c0, inv_sum, o.data());
        }
        for (int64_t pair = 0; pair < tokens * group; ++pair) {
          float* dst = out + (q0 + i0 + pair / group) * out_stride[0] + (h * group + pair % group) * out_stride[1];
          std::memcpy(dst, o.data() + pair * head_dim, head_dim * sizeof(float));
        }
      }
    }
  }
  return bad_seq.load();
}

}  // namespace

// The head_dim multiple the kernel takes (PV_VECS vectors): the wrapper sends other shapes to the torch reference.
extern "C" int64_t paged_prefill_head_dim_multiple() { return PV_VECS * VEC; }
// 1 where bfloat16 caches take the pair path (vdpbf16ps), else 0.
extern "C" int64_t paged_prefill_bf16_pairs() { return use_pairs() ? 1 : 0; }
// The most query heads per KV head the kernel takes (a block holds at least one token's group).
extern "C" int64_t paged_prefill_max_group() { return ROWS; }

#define DEFINE_PREFILL(NAME, T)                                                                                    \
  extern "C" int64_t NAME(const float* query, const void* k_cache, const void* v_cache,                         \
                          const int32_t* block_tables, const int32_t* query_start_loc,                          \
                          const int32_t* context_lens, float* out, int64_t num_seqs, int64_t num_q_heads,       \
                          int64_t num_kv_heads, int64_t head_dim, int64_t block_size, int64_t num_blocks,       \
                          int64_t max_blocks, const int64_t* q_stride, const int64_t* k_stride,                 \
                          const int64_t* v_stride, int64_t table_stride, const int64_t* out_stride, float scale) { \
    return prefill<T>(query, static_cast<const T*>(k_cache), static_cast<const T*>(v_cache), block_tables,          \
                      query_start_loc, context_lens, out, num_seqs, num_q_heads, num_kv_heads, head_dim,            \
                      block_size, num_blocks, max_blocks, q_stride, k_stride, v_stride, table_stride, out_stride,   \
                      scale);                                                                                       \
  }

DEFINE_PREFILL(paged_prefill_f32, float)
DEFINE_PREFILL(paged_prefill_f32_bf16, bf16)  // float32 queries and output over bfloat16 caches
