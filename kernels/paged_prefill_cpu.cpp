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
// granularity of ROWS / group tokens. Everything is float32 (as torch's attention in the reference,
// kernels/paged_prefill.py's paged_prefill_attention_reference, which widens a bfloat16 cache the same way).
//
// Why: the reference's torch SDPA ran SmolLM2's prefill attention at 33-55 GFLOP/s of causal work on the AMD EPYC
// (Zen 4), a third of a 1,000-token prefill in the bfloat16 C++ step (docs/benchmarks.md).

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define OMNI_X86 1
#endif

#include <atomic>
#include <cstdint>
#include <cstring>
#include <vector>

#include "cpu_math.h"
#include "cpu_simd.h"

namespace {

using omni::load_vec;
using omni::splat;
using omni::store_vec;
using omni::vf;
using omni::VEC;

constexpr int ROWS = 12;     // (token, head) pairs per block: 12 score vectors + 1 key vector fit AVX2's 16 registers
constexpr int PV_ROWS = 6;   // rows whose P V accumulators are held at once (6 x 4 vectors + 4 of V)
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
  float top = s[0];
#pragma omp simd reduction(max : top)
  for (int64_t t = 1; t < len; ++t) top = s[t] > top ? s[t] : top;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = omni::exp_nonpositive(s[t] - top);
    sum += s[t];
  }
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
  std::atomic<int64_t> bad_seq{-1};
#pragma omp parallel
  {
#ifdef OMNI_X86
    // Flush denormals to zero while the kernel runs in this thread (as the decode kernel: many probabilities are
    // near 0, and denormal products are up to 100x slower on x86).
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr(saved_csr | 0x8040u);
#endif
    std::vector<float> kt, v, s, q(ROWS * head_dim), o(ROWS * head_dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < num_seqs * num_kv_heads; ++item) {
      const int64_t seq = item / num_kv_heads, h = item % num_kv_heads;
      const int64_t q0 = query_start_loc[seq], q_len = query_start_loc[seq + 1] - q0, ctx = context_lens[seq];
      if (q_len <= 0) continue;
      const int32_t* table = block_tables + seq * table_stride;
      const int64_t blocks = (ctx + block_size - 1) / block_size;
      bool valid = q_len <= ctx && blocks <= max_blocks;
      for (int64_t i = 0; valid && i < blocks; ++i) valid = table[i] >= 0 && table[i] < num_blocks;
      if (!valid) {
        int64_t none = -1;
        bad_seq.compare_exchange_strong(none, seq);
        continue;
      }
      const int64_t ld = (ctx + VEC - 1) / VEC * VEC;
      kt.resize(head_dim * ld);
      v.resize(ld * head_dim);
      s.resize(ROWS * ld);
      gather(k_cache, v_cache, table, ctx, block_size, k_stride, v_stride, h, head_dim, ld, kt.data(), v.data());
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
        scores(q.data(), kt.data(), ld, keys, head_dim, s.data());
        float inv_sum[ROWS];
        for (int r = 0; r < ROWS; ++r) inv_sum[r] = softmax_row(s.data() + r * ld, lens[r], keys);
        for (int r0 = 0; r0 < ROWS; r0 += PV_ROWS)
          for (int64_t c0 = 0; c0 < head_dim; c0 += PV_VECS * VEC)
            weighted_values(s.data(), ld, v.data(), keys, head_dim, r0, c0, inv_sum, o.data());
        for (int64_t pair = 0; pair < tokens * group; ++pair) {
          float* dst = out + (q0 + i0 + pair / group) * out_stride[0] + (h * group + pair % group) * out_stride[1];
          std::memcpy(dst, o.data() + pair * head_dim, head_dim * sizeof(float));
        }
      }
    }
#ifdef OMNI_X86
    _mm_setcsr(saved_csr);
#endif
  }
  return bad_seq.load();
}

}  // namespace

// The head_dim multiple the kernel takes (PV_VECS vectors): the wrapper sends other shapes to the torch reference.
extern "C" int64_t paged_prefill_head_dim_multiple() { return PV_VECS * VEC; }
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
