// Math shared by the C++ CPU kernels of kernels/ (header-only; cpu_library.py hashes it with each source).
//
// exp_nonpositive: Cephes-style expf (S. L. Moshier, Cephes Math Library, expf.c): x = n*ln2 + r with
// |r| <= ln2/2, exp(r) by a degree-6 polynomial (Cephes' coefficients), 2^n by building the float's exponent
// field; written with plain arithmetic so the compiler vectorises it (glibc's expf is a scalar call unless
// -ffast-math). Relative error about 2e-7 on the range it takes (x <= 0).
// Defined for every float, so that a NaN gate (SiLU) or NaN/Inf attention scores (decode softmax: inf - inf) give
// a NaN result rather than undefined behaviour: the exponent is computed from x clamped to [-87, 0] (a NaN clamps
// to -87, so n stays in [-126, 0] and the float-to-int cast and the shift are defined); the result is 0 below -87
// (-inf included), NaN for a NaN, and 1 for x > 0 (outside the contract).
//
// bf16_bits: float32 -> bfloat16 bits rounded to nearest even (as torch's .to(torch.bfloat16)), a NaN kept a
// quiet NaN (its sign and top payload bits).

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

namespace omni {

inline float exp_nonpositive(float x) {  // exp(x) for x <= 0; 0 below -87 (float underflow)
  const float low = x > -87.0f ? x : -87.0f;  // comparisons with a NaN are false: NaN -> -87
  const float clamped = low < 0.0f ? low : 0.0f;
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
  return x >= -87.0f ? p * scale : (x < -87.0f ? 0.0f : x);  // x is a NaN in the last case
}

inline uint32_t bf16_bits(float f) {
  uint32_t bits;
  std::memcpy(&bits, &f, sizeof bits);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return (bits >> 16) | 0x40u;
  return (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
}

}  // namespace omni
