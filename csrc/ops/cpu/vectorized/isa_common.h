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

// exp for arguments <= 0 (x - max, u - lse): float uses ATen's inline
// polynomial (about 20 ulp, much cheaper than the Sleef call), which clamps its
// input and so would turn NaN into a number; NaN is put back so that it
// propagates. float64 keeps the 1-ulp exp.
template <typename A>
inline Vectorized<A> exp_nonpositive(const Vectorized<A>& x) {
  if constexpr (std::is_same_v<A, float>) {
    return Vectorized<float>::blendv(x.exp_u20(), x, x.isnan());
  } else {
    return x.exp();
  }
}

// acc + p * log_q with 0 * log 0 = 0 (dino_loss_detail::log_factor): where p
// is 0 the term is 0, even against a log_q of -inf. NaN propagates.
template <typename A>
inline Vectorized<A> cross_entropy_fmadd(const Vectorized<A>& p, const Vectorized<A>& log_q,
                                         const Vectorized<A>& acc) {
  const Vectorized<A> zero(A(0));
  return at::vec::fmadd(p, Vectorized<A>::blendv(log_q, zero, p == zero), acc);
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
