// Multi-tensor EMA kernel. Floor: every element of the teacher is read and
// written once and every element of the student read once, so the time is
// bounded below by (2*sizeof(T) + sizeof(S)) * numel / DRAM bandwidth.
//
// Layout of a launch: the tensors' pointers and sizes are passed by value in
// the kernel arguments (no metadata copy); each block owns one chunk of one
// tensor and finds it by binary search over the per-tensor chunk offsets.
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/cuda/ema_kernel.h"
#include "ops/cuda/float_types.cuh"

namespace dino_opt::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int kUnroll = 4;

struct EmaLaunchArgs {
  void* teacher[kEmaTensorsPerLaunch];
  const void* student[kEmaTensorsPerLaunch];
  int64_t numel[kEmaTensorsPerLaunch];
  int32_t first_chunk[kEmaTensorsPerLaunch + 1];
  int32_t count;
};
static_assert(sizeof(EmaLaunchArgs) + 64 <= 32764, "kernel arguments exceed 32 KB");

// m*t + w*s with two explicit roundings and no fused multiply-add: the CPU
// kernel evaluates the same expression with contraction disabled.
__device__ __forceinline__ float blend(float t, float s, float keep, float mix) {
  return __fadd_rn(__fmul_rn(t, keep), __fmul_rn(s, mix));
}
__device__ __forceinline__ double blend(double t, double s, double keep, double mix) {
  return __dadd_rn(__dmul_rn(t, keep), __dmul_rn(s, mix));
}

// Vector width in elements: 16-byte accesses for the teacher, which is both
// read and written.
template <typename T>
__host__ __device__ constexpr int vec_width() {
  return 16 / static_cast<int>(sizeof(T));
}
template <typename T>
__host__ __device__ constexpr int chunk_elems() {
  return kThreads * vec_width<T>() * kUnroll;
}

template <typename T, typename S>
__global__ void __launch_bounds__(kThreads)
    ema_multi_tensor_kernel(const EmaLaunchArgs args, acc_t<T> keep, acc_t<T> mix) {
  using A = acc_t<T>;
  constexpr int V = vec_width<T>();
  constexpr int CHUNK = chunk_elems<T>();
  const int32_t block = static_cast<int32_t>(blockIdx.x);
  // Largest i with first_chunk[i] <= block.
  int lo = 0, hi = args.count - 1;
  while (lo < hi) {
    const int mid = (lo + hi + 1) >> 1;
    if (args.first_chunk[mid] <= block)
      lo = mid;
    else
      hi = mid - 1;
  }
  T* __restrict__ t = static_cast<T*>(args.teacher[lo]);
  const S* __restrict__ s = static_cast<const S*>(args.student[lo]);
  const int64_t begin = static_cast<int64_t>(block - args.first_chunk[lo]) * CHUNK;
  const int64_t end = min(begin + CHUNK, args.numel[lo]);

  const bool aligned = (reinterpret_cast<uintptr_t>(t) % sizeof(Vec<T, V>) == 0) &&
                       (reinterpret_cast<uintptr_t>(s) % sizeof(Vec<S, V>) == 0);
  if (aligned) {
    // Whole vectors: loads of all unrolled steps first, then compute, then stores.
    const int64_t vec_end = begin + (end - begin) / V * V;
    Vec<T, V> tv[kUnroll];
    Vec<S, V> sv[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (static_cast<int64_t>(u) * kThreads + threadIdx.x) * V;
      if (i < vec_end) {
        tv[u] = *reinterpret_cast<const Vec<T, V>*>(t + i);
        sv[u] = *reinterpret_cast<const Vec<S, V>*>(s + i);
      }
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = begin + (static_cast<int64_t>(u) * kThreads + threadIdx.x) * V;
      if (i < vec_end) {
#pragma unroll
        for (int k = 0; k < V; ++k) {
          tv[u].v[k] =
              store_from<T>(blend(load_acc<A>(tv[u].v[k]), load_acc<A>(sv[u].v[k]), keep, mix));
        }
        *reinterpret_cast<Vec<T, V>*>(t + i) = tv[u];
      }
    }
    for (int64_t i = vec_end + threadIdx.x; i < end; i += kThreads) {
      t[i] = store_from<T>(blend(load_acc<A>(t[i]), load_acc<A>(s[i]), keep, mix));
    }
  } else {
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      t[i] = store_from<T>(blend(load_acc<A>(t[i]), load_acc<A>(s[i]), keep, mix));
    }
  }
}

template <typename T, typename S>
cudaError_t launch_typed(const ema_detail::FlatPair* pairs, int64_t count,
                         ema_detail::Coefficients c, cudaStream_t stream) {
  using acc_t = acc_t<T>;
  constexpr int64_t CHUNK = chunk_elems<T>();
  EmaLaunchArgs args;
  int64_t next = 0;
  while (next < count) {
    // Fill one launch with as many tensors as fit, keeping the grid in int32.
    args.count = 0;
    int64_t chunks = 0;
    args.first_chunk[0] = 0;
    while (next < count && args.count < kEmaTensorsPerLaunch) {
      const int64_t tensor_chunks = (pairs[next].numel + CHUNK - 1) / CHUNK;
      if (args.count > 0 && chunks + tensor_chunks > INT32_MAX) break;
      const int i = args.count++;
      args.teacher[i] = pairs[next].teacher;
      args.student[i] = pairs[next].student;
      args.numel[i] = pairs[next].numel;
      chunks += tensor_chunks;
      args.first_chunk[i + 1] = static_cast<int32_t>(chunks);
      ++next;
    }
    ema_multi_tensor_kernel<T, S><<<static_cast<unsigned>(chunks), kThreads, 0, stream>>>(
        args, static_cast<acc_t>(c.keep), static_cast<acc_t>(c.mix_in));
    const cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  return cudaSuccess;
}

template <typename T>
cudaError_t dispatch_student(FloatIndex student_dtype, const ema_detail::FlatPair* pairs,
                             int64_t count, ema_detail::Coefficients c, cudaStream_t stream) {
  switch (student_dtype) {
    case kF64:
      return launch_typed<T, double>(pairs, count, c, stream);
    case kF32:
      return launch_typed<T, float>(pairs, count, c, stream);
    case kBF16:
      return launch_typed<T, __nv_bfloat16>(pairs, count, c, stream);
    case kF16:
      return launch_typed<T, __half>(pairs, count, c, stream);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t launch_ema_update(const ema_detail::FlatPair* pairs, int64_t count,
                              FloatIndex teacher_dtype, FloatIndex student_dtype,
                              ema_detail::Coefficients coefficients, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  switch (teacher_dtype) {
    case kF64:
      return dispatch_student<double>(student_dtype, pairs, count, coefficients, stream);
    case kF32:
      return dispatch_student<float>(student_dtype, pairs, count, coefficients, stream);
    case kBF16:
      return dispatch_student<__nv_bfloat16>(student_dtype, pairs, count, coefficients, stream);
    case kF16:
      return dispatch_student<__half>(student_dtype, pairs, count, coefficients, stream);
    default:
      break;
  }
  return cudaErrorInvalidValue;
}

}  // namespace dino_opt::cuda
