#pragma once
// The noise field of the per-channel photometric stage (channel_photometric.h):
// sample i of field `key` is Box-Muller on the hashes a = lowbias32((2 i) ^ key)
// and b = lowbias32((2 i + 1) ^ key): sqrt(-2 ln u1) cos(2 pi u2) with
// u1 = (a + 1/2) / 2^32 and u2 = b / 2^32. channel_noise (channel_photometric.cpp)
// evaluates it in float64 with libm, as the device operator does; noise_f32
// here in float32 without a call or a branch, so that a loop over a row of
// samples vectorises (the loader's kernels use it). Free of torch headers;
// static inline, as photometric_math.h, for the per-ISA builds.
#include <bit>
#include <cstdint>

namespace dino_opt::loader::channel_noise_math {

static inline uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// ln(1 + f) for f in [1/sqrt(2) - 1, sqrt(2) - 1]: 2 atanh(s), s = f / (2 + f),
// |s| <= 0.172, the series to s^11 (the next term is below 1e-9 of the sum).
static inline float log1p_reduced(float f) {
  const float s = f / (2.0f + f);
  const float s2 = s * s;
  float p = 1.0f / 11.0f;
  p = p * s2 + 1.0f / 9.0f;
  p = p * s2 + 1.0f / 7.0f;
  p = p * s2 + 1.0f / 5.0f;
  p = p * s2 + 1.0f / 3.0f;
  p = p * s2 + 1.0f;
  return 2.0f * s * p;
}

// The sample from its two hashes, to a few float32 ulps of the float64 value.
static inline float noise_f32(uint32_t a, uint32_t b) {
  // -2 ln u1. With u1 < 1/2, u1 itself is exact enough (relative error
  // 2^-24); above, its distance to 1, e = (2^32 - 1 - a + 1/2) / 2^32, is
  // what carries the precision (ln u1 ~ -e near 1), so it is taken instead.
  const bool upper = (a >> 31) != 0u;
  const uint32_t t = upper ? 0xFFFFFFFFu - a : a;  // < 2^31: a signed conversion
  const float w = (static_cast<float>(static_cast<int32_t>(t)) + 0.5f) * 0x1p-32f;
  // ln u1 = k ln 2 + ln(1 + f). Lower half: u1 = w = 2^k m, m in [1/sqrt2, sqrt2).
  const uint32_t bits = std::bit_cast<uint32_t>(w);
  const bool high_m = (bits & 0x7FFFFFu) > 0x3504F3u;  // mantissa above sqrt 2
  const int32_t k_low = static_cast<int32_t>(bits >> 23) - 127 + (high_m ? 1 : 0);
  const float m = std::bit_cast<float>((bits & 0x7FFFFFu) | (high_m ? 0x3F000000u : 0x3F800000u));
  const float f_low = m - 1.0f;
  // Upper half: u1 = 1 - w with w in (0, 1/2]; f = -w exactly where u1 >= 1/sqrt2,
  // else u1 = 2^-1 (2 - 2 w).
  const bool near_one = w <= 0.29289322f;
  const float f_up = near_one ? -w : 1.0f - 2.0f * w;
  const int32_t k_up = near_one ? 0 : -1;
  const float f = upper ? f_up : f_low;
  const auto k = static_cast<float>(upper ? k_up : k_low);
  const float ln_u1 = k * 0.693147182f + log1p_reduced(f);
  const float radius = __builtin_sqrtf(-2.0f * ln_u1);
  // cos(2 pi u2): the nearest quarter turn q and the rest r (|r| <= 1/8 turn)
  // exactly in integers, then cos or sin of theta = 2 pi r by Taylor series.
  const uint32_t q = (b + 0x20000000u) >> 30;  // 4 wraps to 0
  const int32_t r = static_cast<int32_t>(b - (q << 30));
  const float th = static_cast<float>(r) * (6.28318531f * 0x1p-32f);
  const float t2 = th * th;
  float c = 1.0f / 40320.0f;
  c = c * t2 - 1.0f / 720.0f;
  c = c * t2 + 1.0f / 24.0f;
  c = c * t2 - 0.5f;
  c = c * t2 + 1.0f;
  float s = 1.0f / 362880.0f;
  s = s * t2 - 1.0f / 5040.0f;
  s = s * t2 + 1.0f / 120.0f;
  s = s * t2 - 1.0f / 6.0f;
  s = (s * t2) * th + th;
  // cos(q pi / 2 + theta): cos, -sin, -cos, sin.
  float cosine = (q & 1u) != 0u ? s : c;
  cosine = ((q + 1u) & 2u) != 0u ? -cosine : cosine;
  return radius * cosine;
}

// The hashes of sample `index` (taken modulo 2^32 after doubling) of field `key`.
static inline uint32_t noise_hash_a(uint32_t key, uint64_t index) {
  return lowbias32(static_cast<uint32_t>(2 * index) ^ key);
}
static inline uint32_t noise_hash_b(uint32_t key, uint64_t index) {
  return lowbias32((static_cast<uint32_t>(2 * index) + 1u) ^ key);
}

}  // namespace dino_opt::loader::channel_noise_math
