// CUDA kernels of the fused DINO loss. Three streaming passes over the logits:
//   1. row_stats: per (row, chunk of K) the max and sum of exp of
//      x = S/ts (student rows) or u = (T - c)/tt (teacher rows); a tiny kernel
//      combines the chunks into one log-sum-exp per row;
//   2. pair_dots: per (sample, chunk) the teacher probabilities p_t, then for
//      each student view v the sums  sum_k p_t * (x_v - lse_v)  for every t;
//      one block then adds them up in a fixed order into the loss;
//   3. student_grad (backward): grad_v = g/(n_terms*B) * (w_v*softmax(x_v) - sum_{t!=v} p_t)/ts.
// Floor (forward + backward, no [S*B, K] tensor kept): the logits read twice
// and the gradient written once; these passes read them three times.
// Partial results are combined in a fixed order: the result is deterministic.
#include <cuda_runtime.h>

#include <cmath>

#include "ops/cuda/dino_loss_kernel.h"
#include "ops/cuda/float_types.cuh"
#include "ops/cuda/loss_common.cuh"

namespace dino_opt::cuda {
namespace {

using dino_loss_detail::kMaxTeacherViews;
using dino_loss_detail::Shape;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kStatsPerThread = 8;  // elements of one row per thread in pass 1
constexpr int kStatsChunk = kThreads * kStatsPerThread;
constexpr int kPairPerThread = 4;  // elements of each row per thread in passes 2 and 3
constexpr int kPairChunk = kThreads * kPairPerThread;

// p_t = exp((T_t - c) * inv_tt - lse_t) for the run of this thread, t < T.
template <typename T, typename A>
__device__ __forceinline__ void teacher_probs(const DinoLossArgs& a, const A* teacher_lse,
                                              int64_t b, int64_t base,
                                              A (&p)[kMaxTeacherViews][kPairPerThread]) {
  const Shape& s = a.shape;
  const T* teacher = static_cast<const T*>(a.teacher);
  A c[kPairPerThread];
  bool valid[kPairPerThread];
  load_run<kPairPerThread>(static_cast<const A*>(a.center), base, s.dim, c, valid);
  const A inv = static_cast<A>(a.inv_teacher_temp);
#pragma unroll
  for (int t = 0; t < kMaxTeacherViews; ++t) {
    if (t < s.teacher_views) {
      A u[kPairPerThread];
      load_run<kPairPerThread>(teacher + (t * s.batch + b) * s.dim, base, s.dim, u, valid);
      const A lse = teacher_lse[t * s.batch + b];
#pragma unroll
      for (int j = 0; j < kPairPerThread; ++j) {
        p[t][j] = valid[j] ? exp_acc((u[j] - c[j]) * inv - lse) : A(0);
      }
    }
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    row_stats_kernel(const DinoLossArgs a, int64_t n_chunks, A* out_max, A* out_sum) {
  __shared__ A smem[kWarps];
  const Shape& s = a.shape;
  const int64_t item = blockIdx.x;
  const int64_t row = item / n_chunks;
  const int64_t base = (item % n_chunks) * kStatsChunk + threadIdx.x * kStatsPerThread;
  const int64_t student_rows = s.student_views * s.batch;
  const bool is_teacher = row >= student_rows;
  const T* src = is_teacher ? static_cast<const T*>(a.teacher) + (row - student_rows) * s.dim
                            : static_cast<const T*>(a.student) + row * s.dim;
  A x[kStatsPerThread];
  bool valid[kStatsPerThread];
  load_run<kStatsPerThread>(src, base, s.dim, x, valid);
  if (is_teacher) {
    A c[kStatsPerThread];
    load_run<kStatsPerThread>(static_cast<const A*>(a.center), base, s.dim, c, valid);
#pragma unroll
    for (int j = 0; j < kStatsPerThread; ++j) x[j] -= c[j];
  }
  const A inv = static_cast<A>(is_teacher ? a.inv_teacher_temp : a.inv_student_temp);
#pragma unroll
  for (int j = 0; j < kStatsPerThread; ++j) x[j] *= inv;
  A m, z;
  block_max_sumexp<kThreads>(x, valid, smem, m, z);
  if (threadIdx.x == 0) {
    out_max[item] = m;
    out_sum[item] = z;
  }
}

template <typename A>
__global__ void combine_lse_kernel(Shape s, int64_t n_chunks, const A* maxes, const A* sums,
                                   A* student_lse, A* teacher_lse) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t student_rows = s.student_views * s.batch;
  if (row >= student_rows + s.teacher_views * s.batch) return;
  const A lse =
      dino_loss_detail::combine_lse(maxes + row * n_chunks, sums + row * n_chunks, n_chunks);
  if (row < student_rows) {
    student_lse[row] = lse;
  } else {
    teacher_lse[row - student_rows] = lse;
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    pair_dots_kernel(const DinoLossArgs a, int64_t n_chunks, const A* student_lse,
                     const A* teacher_lse, A* dots) {
  __shared__ A smem[kWarps][kMaxTeacherViews];
  const Shape& s = a.shape;
  const int64_t item = blockIdx.x;
  const int64_t b = item / n_chunks;
  const int64_t base = (item % n_chunks) * kPairChunk + threadIdx.x * kPairPerThread;
  A p[kMaxTeacherViews][kPairPerThread];
  teacher_probs<T>(a, teacher_lse, b, base, p);
  const A inv = static_cast<A>(a.inv_student_temp);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  for (int64_t v = 0; v < s.student_views; ++v) {
    A x[kPairPerThread];
    bool valid[kPairPerThread];
    load_run<kPairPerThread>(static_cast<const T*>(a.student) + (v * s.batch + b) * s.dim, base,
                             s.dim, x, valid);
    const A lse = student_lse[v * s.batch + b];
#pragma unroll
    for (int j = 0; j < kPairPerThread; ++j) x[j] = valid[j] ? x[j] * inv - lse : A(0);
    __syncthreads();  // smem is read by the previous view's final step
#pragma unroll
    for (int t = 0; t < kMaxTeacherViews; ++t) {
      if (t < s.teacher_views) {
        A acc = 0;
#pragma unroll
        for (int j = 0; j < kPairPerThread; ++j) {
          acc += p[t][j] * dino_loss_detail::log_factor(p[t][j], x[j]);
        }
        acc = warp_reduce(acc, [](A p0, A q0) { return p0 + q0; });
        if (lane == 0) smem[warp][t] = acc;
      }
    }
    __syncthreads();
    if (threadIdx.x < s.teacher_views) {
      A total = 0;
      for (int w = 0; w < kWarps; ++w) total += smem[w][threadIdx.x];
      dots[(item * s.student_views + v) * s.teacher_views + threadIdx.x] = total;
    }
  }
}

// One block: loss = -sum over (sample, chunk, v, t != v) of dots / (n_terms * B),
// summed in double in a fixed order.
template <typename A>
__global__ void __launch_bounds__(kThreads)
    loss_kernel(Shape s, int64_t n_chunks, const A* dots, A* loss) {
  __shared__ double smem[kWarps];
  const int64_t count = s.batch * n_chunks * s.student_views * s.teacher_views;
  double total = 0;
  for (int64_t i = threadIdx.x; i < count; i += kThreads) {
    const int64_t t = i % s.teacher_views;
    const int64_t v = (i / s.teacher_views) % s.student_views;
    if (s.paired(t, v)) total += static_cast<double>(dots[i]);
  }
  total = block_sum<kThreads>(total, smem);
  if (threadIdx.x == 0) {
    *loss = static_cast<A>(-total / static_cast<double>(s.loss_terms() * s.batch));
  }
}

template <typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    student_grad_kernel(const DinoLossArgs a, int64_t n_chunks, const A* student_lse,
                        const A* teacher_lse, const A* grad_loss, T* grad) {
  const Shape& s = a.shape;
  const int64_t item = blockIdx.x;
  const int64_t b = item / n_chunks;
  const int64_t base = (item % n_chunks) * kPairChunk + threadIdx.x * kPairPerThread;
  A p[kMaxTeacherViews][kPairPerThread];
  teacher_probs<T>(a, teacher_lse, b, base, p);
  const A inv = static_cast<A>(a.inv_student_temp);
  const A scale = *grad_loss * inv / static_cast<A>(s.loss_terms() * s.batch);
  for (int64_t v = 0; v < s.student_views; ++v) {
    const int64_t row = v * s.batch + b;
    A x[kPairPerThread];
    bool valid[kPairPerThread];
    load_run<kPairPerThread>(static_cast<const T*>(a.student) + row * s.dim, base, s.dim, x, valid);
    const A lse = student_lse[row];
    const A weight = static_cast<A>(s.teacher_weight(v));
    A g[kPairPerThread];
#pragma unroll
    for (int j = 0; j < kPairPerThread; ++j) {
      A targets = 0;
#pragma unroll
      for (int t = 0; t < kMaxTeacherViews; ++t) {
        if (t < s.teacher_views && s.paired(t, v)) targets += p[t][j];
      }
      g[j] = scale * (weight * exp_acc(x[j] * inv - lse) - targets);
    }
    store_run<kPairPerThread>(grad + row * s.dim, base, s.dim, g);
  }
}

int64_t stats_chunks(const Shape& s) { return (s.dim + kStatsChunk - 1) / kStatsChunk; }
int64_t pair_chunks(const Shape& s) { return (s.dim + kPairChunk - 1) / kPairChunk; }

template <typename T>
cudaError_t forward_typed(const DinoLossArgs& a, void* stats_max, void* stats_sum, void* dots,
                          void* student_lse, void* teacher_lse, void* loss, cudaStream_t stream) {
  using A = acc_t<T>;
  const Shape& s = a.shape;
  const int64_t rows = (s.student_views + s.teacher_views) * s.batch;
  const int64_t n_stats = stats_chunks(s);
  row_stats_kernel<T, A><<<rows * n_stats, kThreads, 0, stream>>>(
      a, n_stats, static_cast<A*>(stats_max), static_cast<A*>(stats_sum));
  combine_lse_kernel<A><<<(rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
      s, n_stats, static_cast<const A*>(stats_max), static_cast<const A*>(stats_sum),
      static_cast<A*>(student_lse), static_cast<A*>(teacher_lse));
  const int64_t n_pairs = pair_chunks(s);
  pair_dots_kernel<T, A><<<s.batch * n_pairs, kThreads, 0, stream>>>(
      a, n_pairs, static_cast<const A*>(student_lse), static_cast<const A*>(teacher_lse),
      static_cast<A*>(dots));
  loss_kernel<A>
      <<<1, kThreads, 0, stream>>>(s, n_pairs, static_cast<const A*>(dots), static_cast<A*>(loss));
  return cudaGetLastError();
}

template <typename T>
cudaError_t backward_typed(const DinoLossArgs& a, const void* student_lse, const void* teacher_lse,
                           const void* grad_loss, void* grad, cudaStream_t stream) {
  using A = acc_t<T>;
  const int64_t n_pairs = pair_chunks(a.shape);
  student_grad_kernel<T, A><<<a.shape.batch * n_pairs, kThreads, 0, stream>>>(
      a, n_pairs, static_cast<const A*>(student_lse), static_cast<const A*>(teacher_lse),
      static_cast<const A*>(grad_loss), static_cast<T*>(grad));
  return cudaGetLastError();
}

}  // namespace

int64_t dino_loss_stats_workspace(const Shape& s) {
  return (s.student_views + s.teacher_views) * s.batch * stats_chunks(s);
}

int64_t dino_loss_dots_workspace(const Shape& s) {
  return s.batch * pair_chunks(s) * s.student_views * s.teacher_views;
}

cudaError_t launch_dino_loss_forward(const DinoLossArgs& a, void* stats_max, void* stats_sum,
                                     void* dots, void* student_lse, void* teacher_lse, void* loss,
                                     cudaStream_t stream) {
  switch (a.dtype) {
    case kF64:
      return forward_typed<double>(a, stats_max, stats_sum, dots, student_lse, teacher_lse, loss,
                                   stream);
    case kF32:
      return forward_typed<float>(a, stats_max, stats_sum, dots, student_lse, teacher_lse, loss,
                                  stream);
    case kBF16:
      return forward_typed<__nv_bfloat16>(a, stats_max, stats_sum, dots, student_lse, teacher_lse,
                                          loss, stream);
    case kF16:
      return forward_typed<__half>(a, stats_max, stats_sum, dots, student_lse, teacher_lse, loss,
                                   stream);
    default:
      return cudaErrorInvalidValue;
  }
}

cudaError_t launch_dino_loss_backward(const DinoLossArgs& a, const void* student_lse,
                                      const void* teacher_lse, const void* grad_loss,
                                      void* grad_student, cudaStream_t stream) {
  switch (a.dtype) {
    case kF64:
      return backward_typed<double>(a, student_lse, teacher_lse, grad_loss, grad_student, stream);
    case kF32:
      return backward_typed<float>(a, student_lse, teacher_lse, grad_loss, grad_student, stream);
    case kBF16:
      return backward_typed<__nv_bfloat16>(a, student_lse, teacher_lse, grad_loss, grad_student,
                                           stream);
    case kF16:
      return backward_typed<__half>(a, student_lse, teacher_lse, grad_loss, grad_student, stream);
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace dino_opt::cuda
