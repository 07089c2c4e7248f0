#pragma once
// float32 -> bfloat16 / float16 bit patterns, rounded to nearest even, NaN
// kept NaN (quiet). Free of torch headers and usable on the GPU, so that the
// loader, the CPU kernel and the CUDA kernel round alike. Branch-free in
// spirit (selects only), so that loops over them vectorise.
#include <cstdint>
#include <cstring>

// static: per translation unit, as in photometric_math.h (per-ISA builds).
#if defined(__CUDACC__)
#define DINO_OPT_F16_HD static __host__ __device__ __forceinline__
#else
#define DINO_OPT_F16_HD static inline
#endif

namespace dino_opt::loader {

DINO_OPT_F16_HD uint32_t float_bits(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  std::memcpy(&u, &f, sizeof u);
  return u;
#endif
}

DINO_OPT_F16_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  std::memcpy(&f, &u, sizeof f);
  return f;
#endif
}

// bfloat16 is the top half of a float32: add half an ulp of the kept part
// (minus one when the kept part is even, so that ties go to even) and
// truncate. The carry of a mantissa overflow moves into the exponent, which
// is exactly rounding up (to infinity past the largest finite value).
DINO_OPT_F16_HD uint16_t float_to_bf16_bits(float f) {
  const uint32_t u = float_bits(f);
  const bool nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  const uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  return static_cast<uint16_t>(nan ? ((u >> 16) | 0x0040u) : rounded);
}

DINO_OPT_F16_HD float bf16_bits_to_float(uint16_t h) {
  return bits_float(static_cast<uint32_t>(h) << 16);
}

// IEEE binary16 (1 sign, 5 exponent bits of bias 15, 10 mantissa bits).
DINO_OPT_F16_HD uint16_t float_to_f16_bits(float f) {
  const uint32_t u = float_bits(f);
  const uint32_t sign = (u >> 16) & 0x8000u;
  const uint32_t a = u & 0x7FFFFFFFu;
  // Normal results (|f| >= 2^-14): rebias the exponent from 127 to 15 by
  // subtracting 112 << 23, then round away the 13 low mantissa bits as for
  // bfloat16. Inputs from 65520 on (the midpoint above 65504) carry into the
  // all-ones exponent, which is infinity.
  const uint32_t rebased = a - 0x38000000u;
  const uint32_t normal = (rebased + 0xFFFu + ((rebased >> 13) & 1u)) >> 13;
  // Subnormal results: |f| * 2^24 counts units of the smallest subnormal
  // (exact, a power-of-two scaling); adding 2^23 makes the float adder round
  // that count to an integer, ties to even, in the low mantissa bits.
  const float scaled = bits_float(a) * 16777216.0f + 8388608.0f;
  const uint32_t subnormal = float_bits(scaled) - 0x4B000000u;
  uint32_t h = a < 0x38800000u ? subnormal : normal;
  h = a >= 0x477FF000u ? 0x7C00u : h;  // overflow, and infinity itself
  h = a > 0x7F800000u ? 0x7E00u : h;   // NaN: a quiet NaN
  return static_cast<uint16_t>(sign | h);
}

// Exact widening, for tests and readers of the output.
DINO_OPT_F16_HD float f16_bits_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0) {  // zero or subnormal: m * 2^-24, exact in float
    const float v = static_cast<float>(m) * 5.9604644775390625e-8f;
    return bits_float(float_bits(v) | sign);
  }
  if (e == 31) return bits_float(sign | 0x7F800000u | (m << 13));
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

}  // namespace dino_opt::loader
