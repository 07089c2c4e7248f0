#pragma once
// Device helpers shared by the streaming loss kernels (the DINO and iBOT
// losses): runs of a row loaded into registers, warp and block reductions,
// and the (max, sum of exp) statistics of a block's chunk of a row.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "ops/cuda/float_types.cuh"

namespace dino_opt::cuda {

__device__ __forceinline__ float exp_acc(float v) { return expf(v); }
__device__ __forceinline__ double exp_acc(double v) { return exp(v); }

// max that propagates NaN (as torch's max does).
template <typename A>
__device__ __forceinline__ A nan_max(A a, A b) {
  return (a != a || a > b) ? a : b;
}

// Elements [base, base + N) of `row` widened to A; positions at or past `dim`
// are reported invalid. One aligned vector load when the whole run is inside
// the row and aligned, element loads otherwise.
template <int N, typename T, typename A>
__device__ __forceinline__ void load_run(const T* row, int64_t base, int64_t dim, A (&out)[N],
                                         bool (&valid)[N]) {
  if (base + N <= dim && reinterpret_cast<uintptr_t>(row + base) % sizeof(Vec<T, N>) == 0) {
    const Vec<T, N> v = *reinterpret_cast<const Vec<T, N>*>(row + base);
#pragma unroll
    for (int j = 0; j < N; ++j) {
      out[j] = load_acc<A>(v.v[j]);
      valid[j] = true;
    }
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      valid[j] = base + j < dim;
      out[j] = valid[j] ? load_acc<A>(row[base + j]) : A(0);
    }
  }
}

// Stores the run [base, base + N) of `row`, rounded to T; positions at or past
// `dim` are left alone.
template <int N, typename T, typename A>
__device__ __forceinline__ void store_run(T* row, int64_t base, int64_t dim, const A (&in)[N]) {
  if (base + N <= dim && reinterpret_cast<uintptr_t>(row + base) % sizeof(Vec<T, N>) == 0) {
    Vec<T, N> v;
#pragma unroll
    for (int j = 0; j < N; ++j) v.v[j] = store_from<T>(in[j]);
    *reinterpret_cast<Vec<T, N>*>(row + base) = v;
  } else {
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (base + j < dim) row[base + j] = store_from<T>(in[j]);
    }
  }
}

template <typename A, typename Op>
__device__ __forceinline__ A warp_reduce(A v, Op op) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1)
    v = op(v, __shfl_xor_sync(0xffffffffu, v, offset));
  return v;
}

// Reduction over a block of `Threads` threads (a multiple of 32, at most
// 1024); every thread gets the result. `smem` holds Threads / 32 values.
template <int Threads, typename A, typename Op>
__device__ __forceinline__ A block_reduce(A v, Op op, A identity, A* smem) {
  constexpr int kWarps = Threads / 32;
  __syncthreads();  // smem may still be read from a previous reduction
  v = warp_reduce(v, op);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) smem[warp] = v;
  __syncthreads();
  v = lane < kWarps ? smem[lane] : identity;
  return warp_reduce(v, op);
}

template <int Threads, typename A>
__device__ __forceinline__ A block_sum(A v, A* smem) {
  return block_reduce<Threads>(
      v, [](A p, A q) { return p + q; }, A(0), smem);
}

// The chunk statistics of a row over a block: the max m of the valid x and
// sum of exp(x - m); every thread gets both. A chunk of -inf (m = -inf) holds
// no mass: sum 0 (exp(x - m) would be NaN). NaN propagates through the max.
template <int Threads, int N, typename A>
__device__ __forceinline__ void block_max_sumexp(const A (&x)[N], const bool (&valid)[N], A* smem,
                                                 A& max_out, A& sum_out) {
  const A neg_inf = -INFINITY;
  A m = neg_inf;
#pragma unroll
  for (int j = 0; j < N; ++j) {
    if (valid[j]) m = nan_max(m, x[j]);
  }
  m = block_reduce<Threads>(
      m, [](A p, A q) { return nan_max(p, q); }, neg_inf, smem);
  A z = 0;
  if (m != neg_inf) {  // m is block-uniform: the whole block takes the same branch
#pragma unroll
    for (int j = 0; j < N; ++j) {
      if (valid[j]) z += exp_acc(x[j] - m);
    }
    z = block_sum<Threads>(z, smem);
  }
  max_out = m;
  sum_out = z;
}

}  // namespace dino_opt::cuda
