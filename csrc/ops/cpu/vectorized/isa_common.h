#pragma once
// Shared by the per-instruction-set kernel files: scalar types, the
// accumulation type and vector load/store in it. Compiled with ATen's
// CPU_CAPABILITY macros, so Vectorized<> is the variant of this build.
#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <type_traits>

#include "ops/cpu/kernel_table.h"

namespace dino_opt::cpu::CPU_CAPABILITY {

using at::vec::Vectorized;

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// Vectorized<acc_t<T>>::size() consecutive elements of p, widened.
template <typename T>
inline Vectorized<acc_t<T>> load_acc(const T* p) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    return Vectorized<T>::loadu(p);
  } else {
    Vectorized<float> out;
    at::vec::load_to_float<T>(p, out);
    return out;
  }
}

// Stores Vectorized<acc_t<T>>::size() elements, rounded to T.
template <typename T>
inline void store_acc(T* p, const Vectorized<acc_t<T>>& v) {
  if constexpr (std::is_same_v<T, float> || std::is_same_v<T, double>) {
    v.store(p);
  } else {
    at::vec::convert_from_float<T>(v, v).store(p, Vectorized<float>::size());
  }
}

// Prefetches the cache line 1 KiB of input ahead of p (the pass that first
// reads a row chunk calls it every 64 or 128 bytes): a chunk of K spans
// pages, and the hardware prefetcher starts again at each page.
template <typename T>
inline void prefetch_ahead(const T* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + 1024, 0, 3);
}

#if defined(CPU_CAPABILITY_AVX512)
// exp(x) for float x <= 0 or NaN, AVX-512: exp(x) = 2^n * exp(r) with
// n = round(x * log2(e)) and r = x - n * ln2 (ln2 in two parts, so r is exact
// to a few ulp), exp(r) by its degree-6 Taylor polynomial (|r| <= ln2 / 2: a
// truncation of r^7 / 7! of about 2^-23) and 2^n applied by scalef, which rounds into
// the subnormals and to 0 as the true result does. x is first raised to -110
// (exp(-110) rounds to 0 in float); max returns its second operand where one
// is NaN, so NaN stays NaN through every step. About 2 ulp, 12 instructions.
inline Vectorized<float> exp_nonpositive_avx512(const Vectorized<float>& x_) {
  const __m512 x = _mm512_max_ps(_mm512_set1_ps(-110.0f), x_);
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);  // ln2, high part
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);  // ln2, low part
  __m512 p = _mm512_fmadd_ps(_mm512_set1_ps(1.0f / 720), r, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}
#endif

// exp for arguments <= 0 (x - max, u - lse); NaN propagates. float: the
// polynomial above under AVX-512, elsewhere ATen's inline polynomial (about
// 20 ulp, much cheaper than the Sleef call), which clamps its input and so
// would turn NaN into a number: NaN is put back. float64 keeps the 1-ulp exp.
template <typename A>
inline Vectorized<A> exp_nonpositive(const Vectorized<A>& x) {
  if constexpr (std::is_same_v<A, float>) {
#if defined(CPU_CAPABILITY_AVX512)
    return exp_nonpositive_avx512(x);
#else
    return Vectorized<float>::blendv(x.exp_u20(), x, x.isnan());
#endif
  } else {
    return x.exp();
  }
}

// acc + p * log_q with 0 * log 0 = 0 (dino_loss_detail::log_factor): where p
// is 0 the term is 0, even against a log_q of -inf. NaN propagates.
template <typename A>
inline Vectorized<A> cross_entropy_fmadd(const Vectorized<A>& p, const Vectorized<A>& log_q,
                                         const Vectorized<A>& acc) {
#if defined(CPU_CAPABILITY_AVX512)
  // A masked fused multiply-add: lanes where p == 0 keep acc (p NaN: unordered,
  // so not equal to 0, and the NaN goes in).
  if constexpr (std::is_same_v<A, float>) {
    return _mm512_mask3_fmadd_ps(p, log_q, acc,
                                 _mm512_cmp_ps_mask(p, _mm512_setzero_ps(), _CMP_NEQ_UQ));
  } else {
    return _mm512_mask3_fmadd_pd(p, log_q, acc,
                                 _mm512_cmp_pd_mask(p, _mm512_setzero_pd(), _CMP_NEQ_UQ));
  }
#else
  const Vectorized<A> zero(A(0));
  return at::vec::fmadd(p, Vectorized<A>::blendv(log_q, zero, p == zero), acc);
#endif
}

// max(a, b), which may drop a NaN operand (AVX-512: one instruction, where
// at::vec::maximum spends four on NaN); elsewhere at::vec::maximum.
template <typename A>
inline Vectorized<A> max_unordered(const Vectorized<A>& a, const Vectorized<A>& b) {
#if defined(CPU_CAPABILITY_AVX512)
  if constexpr (std::is_same_v<A, float>) {
    return _mm512_max_ps(a, b);
  } else {
    return _mm512_max_pd(a, b);
  }
#else
  return at::vec::maximum(a, b);
#endif
}

// Calls f.template operator()<T>() with T the type of a FloatIndex.
template <typename F>
inline void for_each_float_type(F&& f) {
  f.template operator()<double>(kF64);
  f.template operator()<float>(kF32);
  f.template operator()<c10::BFloat16>(kBF16);
  f.template operator()<c10::Half>(kF16);
}

}  // namespace dino_opt::cpu::CPU_CAPABILITY
