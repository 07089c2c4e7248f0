#pragma once
// Row helpers of the per-ISA photometric kernels (photometric_kernels.cpp,
// channel_photometric_kernels.cpp): the output element types and the
// blocked tap sums of the separable blur. Included inside each kernel's
// build, so every copy has internal linkage and its build's vector width.
#include <cstdint>
#include <cstring>

#include "loader/float16.h"

#ifndef DINO_OPT_PHOTOMETRIC_ISA
#error "included only by the per-ISA photometric kernels"
#endif

namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA {
namespace {

struct StoreF32 {
  using type = float;
  static float cvt(float v) { return v; }
};
struct StoreBF16 {
  using type = uint16_t;
  static uint16_t cvt(float v) { return float_to_bf16_bits(v); }
};
struct StoreF16 {
  using type = uint16_t;
  static uint16_t cvt(float v) { return float_to_f16_bits(v); }
};

// out[x] = sum over k of w[k] * src[k][x], adding the terms in order of k to
// 0, as the GPU does. Blocks of 4 vectors of columns keep their sums in
// registers across all taps (GCC/Clang vector extensions, as wide as the
// build's registers), so each tap costs one load, one multiply and one add
// per vector.
constexpr int kMaxBlockedTaps = 64;
#if defined(__AVX__)
constexpr int kLanes = 8;
#else
constexpr int kLanes = 4;
#endif
typedef float VecF __attribute__((vector_size(kLanes * sizeof(float))));
inline VecF loadv(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof v);
  return v;
}
inline void storev(float* p, VecF v) { std::memcpy(p, &v, sizeof v); }

void convolve_taps(const float* const* src, const float* w, int taps, float* __restrict out,
                   int n) {
  constexpr int L = kLanes;
  int x0 = 0;
  for (; x0 + 4 * L <= n; x0 += 4 * L) {
    VecF a0 = {}, a1 = {}, a2 = {}, a3 = {};
    for (int k = 0; k < taps; ++k) {
      const float* s = src[k] + x0;
      const float wk = w[k];
      a0 += wk * loadv(s);
      a1 += wk * loadv(s + L);
      a2 += wk * loadv(s + 2 * L);
      a3 += wk * loadv(s + 3 * L);
    }
    storev(out + x0, a0);
    storev(out + x0 + L, a1);
    storev(out + x0 + 2 * L, a2);
    storev(out + x0 + 3 * L, a3);
  }
  for (; x0 + L <= n; x0 += L) {
    VecF a = {};
    for (int k = 0; k < taps; ++k) a += w[k] * loadv(src[k] + x0);
    storev(out + x0, a);
  }
  for (int x = x0; x < n; ++x) {
    float acc = 0.0f;
    for (int k = 0; k < taps; ++k) acc += w[k] * src[k][x];
    out[x] = acc;
  }
}

// The same sums for any number of taps (src_of(k) is tap k's source), one
// pass over the row per tap.
template <class SrcOf>
void convolve_taps_long(SrcOf src_of, const float* w, int taps, float* __restrict out, int n) {
  for (int x = 0; x < n; ++x) out[x] = 0.0f;
  for (int k = 0; k < taps; ++k) {
    const float* __restrict s = src_of(k);
    const float wk = w[k];
    for (int x = 0; x < n; ++x) out[x] += wk * s[x];
  }
}

template <class SrcOf>
void convolve(SrcOf src_of, const float* w, int taps, float* out, int n) {
  if (taps <= kMaxBlockedTaps) {
    const float* src[kMaxBlockedTaps];
    for (int k = 0; k < taps; ++k) src[k] = src_of(k);
    convolve_taps(src, w, taps, out, n);
  } else {
    convolve_taps_long(src_of, w, taps, out, n);
  }
}

}  // namespace
}  // namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA
