// Paged decode attention for CPUs: one query token per sequence against its K/V read in place from the paged
// cache (no gather). The C ABI below is called through ctypes by kernels/paged_decode_cpu.py, which documents the
// contract; this file holds only the arithmetic.
//
// Work item = (sequence b, KV head h): the GROUP query heads that share KV head h are scored against every
// cached token of b (fp32 dot products), softmax in fp32 (max-subtracted, one pass over stored scores), then
// P @ V accumulated in fp32 and written in the cache dtype. Items are spread over the OpenMP threads of the
// process (the .so links libgomp by soname, so it joins the runtime torch already loaded).
//
// exp: Cephes-style expf (S. L. Moshier, Cephes Math Library, expf.c): x = n*ln2 + r with |r| <= ln2/2,
// exp(r) by a degree-6 polynomial (Cephes' coefficients), 2^n by building the float's exponent field; written
// with plain arithmetic so the compiler vectorises it. Relative error about 2e-7 on the range used (x <= 0).

#include <xmmintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float load(float x) { return x; }
inline float load(uint16_t bf16) {  // bfloat16 is the top half of a float32
  uint32_t bits = static_cast<uint32_t>(bf16) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}
inline float load(_Float16 x) { return static_cast<float>(x); }

inline void store(float x, float* out) { *out = x; }
inline void store(float x, uint16_t* out) {  // round to nearest even (inputs are finite)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  bits += 0x7FFFu + ((bits >> 16) & 1u);
  *out = static_cast<uint16_t>(bits >> 16);
}
inline void store(float x, _Float16* out) { *out = static_cast<_Float16>(x); }

inline float exp_nonpositive(float x) {  // exp(x) for x <= 0; 0 below -87 (float underflow)
  const float clamped = x < -87.0f ? -87.0f : x;
  const float n = std::floor(clamped * 1.44269504088896341f + 0.5f);
  const float r = clamped - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return x < -87.0f ? 0.0f : p * scale;
}

template <typename T>
void decode(const T* query, const T* k_cache, const T* v_cache, const int32_t* block_tables,
            const int32_t* context_lens, T* out, int64_t batch, int64_t num_q_heads, int64_t num_kv_heads,
            int64_t head_dim, int64_t block_size, const int64_t* q_stride, const int64_t* k_stride,
            const int64_t* v_stride, int64_t table_stride, const int64_t* out_stride, float scale) {
  const int64_t group = num_q_heads / num_kv_heads;
#pragma omp parallel
  {
    // Flush denormals to zero (FTZ | DAZ) in this thread while it runs the kernel: a softmax over real scores
    // has many probabilities near 0, and their products with V would otherwise be denormal floats, which are
    // up to 100x slower on x86. Results differ from IEEE only below 1.2e-38.
    const unsigned int saved_csr = _mm_getcsr();
    _mm_setcsr(saved_csr | 0x8040u);
    std::vector<float> q(num_q_heads * head_dim), row(head_dim), acc(num_q_heads * head_dim), inv_sum(num_q_heads);
    std::vector<float> scores;
#pragma omp for schedule(dynamic, 1)
    for (int64_t b = 0; b < batch; ++b) {
      const int64_t len = context_lens[b];
      if (len <= 0) {  // nothing to attend to: defined as zeros
        for (int64_t hq = 0; hq < num_q_heads; ++hq)
          for (int64_t d = 0; d < head_dim; ++d) store(0.0f, out + b * out_stride[0] + hq * out_stride[1] + d);
        continue;
      }
      for (int64_t hq = 0; hq < num_q_heads; ++hq) {
        const T* src = query + b * q_stride[0] + hq * q_stride[1];
        for (int64_t d = 0; d < head_dim; ++d) q[hq * head_dim + d] = load(src[d]) * scale;
      }
      scores.resize(num_q_heads * len);
      const int32_t* table = block_tables + b * table_stride;
      // One sequence per work item, all its heads: a token's K (or V) rows for every head are adjacent in the
      // cache, so each block is read front to back once.
      for (int64_t t = 0; t < len; ++t) {  // scores[hq, t] = q_hq . k_t
        const T* k_token = k_cache + table[t / block_size] * k_stride[0] + (t % block_size) * k_stride[1];
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* k = k_token + h * k_stride[2];
          for (int64_t d = 0; d < head_dim; ++d) row[d] = load(k[d]);
          for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
            const float* qh = q.data() + hq * head_dim;
            float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * row[d];
            scores[hq * len + t] = dot;
          }
        }
      }
      for (int64_t hq = 0; hq < num_q_heads; ++hq) {  // softmax numerators in place
        float* s = scores.data() + hq * len;
        float max = s[0];
#pragma omp simd reduction(max : max)
        for (int64_t t = 1; t < len; ++t) max = s[t] > max ? s[t] : max;
        float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
        for (int64_t t = 0; t < len; ++t) {
          s[t] = exp_nonpositive(s[t] - max);
          sum += s[t];
        }
        inv_sum[hq] = 1.0f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.0f);
      for (int64_t t = 0; t < len; ++t) {  // acc[hq] += p[hq, t] * v_t
        const T* v_token = v_cache + table[t / block_size] * v_stride[0] + (t % block_size) * v_stride[1];
        for (int64_t h = 0; h < num_kv_heads; ++h) {
          const T* v = v_token + h * v_stride[2];
          for (int64_t d = 0; d < head_dim; ++d) row[d] = load(v[d]);
          for (int64_t hq = h * group; hq < (h + 1) * group; ++hq) {
            const float p = scores[hq * len + t];
            float* a = acc.data() + hq * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * row[d];
          }
        }
      }
      for (int64_t hq = 0; hq < num_q_heads; ++hq) {
        T* dst = out + b * out_stride[0] + hq * out_stride[1];
        for (int64_t d = 0; d < head_dim; ++d) store(acc[hq * head_dim + d] * inv_sum[hq], dst + d);
      }
    }
    _mm_setcsr(saved_csr);
  }
}

}  // namespace

#define DEFINE_DECODE(NAME, T)                                                                                    \
  extern "C" void NAME(const void* query, const void* k_cache, const void* v_cache, const int32_t* block_tables, \
                       const int32_t* context_lens, void* out, int64_t batch, int64_t num_q_heads,               \
                       int64_t num_kv_heads, int64_t head_dim, int64_t block_size, const int64_t* q_stride,      \
                       const int64_t* k_stride, const int64_t* v_stride, int64_t table_stride,                   \
                       const int64_t* out_stride, float scale) {                                                 \
    decode<T>(static_cast<const T*>(query), static_cast<const T*>(k_cache), static_cast<const T*>(v_cache),      \
              block_tables, context_lens, static_cast<T*>(out), batch, num_q_heads, num_kv_heads, head_dim,      \
              block_size, q_stride, k_stride, v_stride, table_stride, out_stride, scale);                        \
  }

DEFINE_DECODE(paged_decode_f32, float)
DEFINE_DECODE(paged_decode_bf16, uint16_t)
DEFINE_DECODE(paged_decode_f16, _Float16)
