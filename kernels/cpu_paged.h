// Pieces shared by the paged attention kernels of kernels/ (paged_decode_cpu.cpp, paged_prefill_cpu.cpp;
// header-only; cpu_library.py hashes it with each source).

#pragma once

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include <cstdint>

#include "cpu_math.h"

namespace omni {

// Replaces s[0..len) by exp(s - max(s)) and returns their sum (len >= 1).
inline float softmax_numerators(float* s, int64_t len) {
  float top = s[0];
#pragma omp simd reduction(max : top)
  for (int64_t t = 1; t < len; ++t) top = s[t] > top ? s[t] : top;
  float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
  for (int64_t t = 0; t < len; ++t) {
    s[t] = exp_nonpositive(s[t] - top);
    sum += s[t];
  }
  return sum;
}

// Whether the ceil(len / block_size) blocks a context of `len` tokens reads fit the table's `max_blocks` columns
// and name blocks in [0, num_blocks): checked before a kernel reads anything.
inline bool blocks_in_range(const int32_t* table, int64_t len, int64_t block_size, int64_t max_blocks,
                            int64_t num_blocks) {
  const int64_t blocks = len > 0 ? (len + block_size - 1) / block_size : 0;
  bool valid = blocks <= max_blocks;
  for (int64_t i = 0; valid && i < blocks; ++i) valid = table[i] >= 0 && table[i] < num_blocks;
  return valid;
}

// Flushes denormals to zero (FTZ | DAZ) in this thread while it lives (x86; nothing elsewhere): a softmax over real
// scores has many probabilities near 0, and their products with V would otherwise be denormal floats, which are
// up to 100x slower on x86. Results differ from IEEE only below 1.2e-38. The caller's mode is restored.
class FlushDenormals {
 public:
#if defined(__x86_64__) || defined(__i386__)
  FlushDenormals() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | 0x8040u); }
  ~FlushDenormals() { _mm_setcsr(saved_); }

 private:
  unsigned int saved_;
#endif
};

}  // namespace omni
