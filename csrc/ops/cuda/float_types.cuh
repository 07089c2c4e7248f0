#pragma once
// Element types of the CUDA kernels: the accumulation type of an input type,
// conversions to and from it, and aligned vectors for wide loads and stores.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

namespace dino_opt::cuda {

// float, or double for double inputs.
template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

__device__ __forceinline__ float to_float(float v) { return v; }
__device__ __forceinline__ float to_float(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ double to_float(double v) { return v; }

// Widening (or, for a double into a float accumulator, round-to-nearest)
// conversion to A, as static_cast does on the CPU.
template <typename A, typename X>
__device__ __forceinline__ A load_acc(X v) {
  return static_cast<A>(to_float(v));
}

// Round-to-nearest-even conversion from the accumulator to T, as on the CPU.
template <typename T, typename A>
__device__ __forceinline__ T store_from(A v) {
  if constexpr (std::is_same_v<T, __half>) {
    return __float2half_rn(v);
  } else if constexpr (std::is_same_v<T, __nv_bfloat16>) {
    return __float2bfloat16_rn(v);
  } else {
    return static_cast<T>(v);
  }
}

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  T v[N];
};

}  // namespace dino_opt::cuda
