// CUDA kernels of the fused iBOT loss.
//   Forward, one pass over the student and target rows: per (row, chunk of K)
//   block the chunk's max and sum of exp of x = S / ts, the target dot
//   sum_k t_k * (x_k - max) and the target sum; a thread per row combines its
//   chunks into the row's log-sum-exp and weighted cross-entropy, and one
//   block adds the rows in a fixed order into the loss.
//   Backward: the target rows' sums (a block per target row), then per
//   (row, chunk) block grad = g * w_n * (tsum * softmax(x) - t) / ts.
// Floor: the forward must read S and T once, (N + M) * K elements; the
// backward read S and T and write the gradient, (2N + M) * K. The forward
// meets it; the backward reads T a second time for its row sums (the
// schema keeps only the log-sum-exp), (2N + 2M) * K.
// Partial results are combined in a fixed order: the result is deterministic.
#include <cuda_runtime.h>

#include "ops/cuda/float_types.cuh"
#include "ops/cuda/ibot_loss_kernel.h"
#include "ops/cuda/loss_common.cuh"

namespace dino_opt::cuda {
namespace {

using ibot_loss_detail::Shape;

constexpr int kThreads = 256;
constexpr int kPerThread = 8;  // elements of a row per thread
constexpr int kChunk = kThreads * kPerThread;

int64_t n_chunks(const Shape& s) { return (s.dim + kChunk - 1) / kChunk; }

// The forward's per (row, chunk) partials, each [N * n_chunks], and a term per row.
template <typename A>
struct Workspace {
  A *maxes, *sums, *dots, *tsums, *terms;
  Workspace(void* base, const Shape& s) {
    const int64_t items = s.rows * n_chunks(s);
    maxes = static_cast<A*>(base);
    sums = maxes + items;
    dots = sums + items;
    tsums = dots + items;
    terms = tsums + items;
  }
};

template <typename S, typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    chunk_kernel(const IbotLossArgs a, int64_t chunks, Workspace<A> ws) {
  __shared__ A smem[kThreads / 32];
  const Shape& s = a.shape;
  const int64_t item = blockIdx.x;
  const int64_t row = item / chunks;
  const int64_t base = (item % chunks) * kChunk + threadIdx.x * kPerThread;
  A x[kPerThread], p[kPerThread];
  bool valid[kPerThread];
  load_run<kPerThread>(static_cast<const T*>(a.targets) + s.target_row(row) * s.dim, base, s.dim, p,
                       valid);
  load_run<kPerThread>(static_cast<const S*>(a.student) + row * s.dim, base, s.dim, x, valid);
  const A inv = static_cast<A>(a.inv_student_temp);
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) x[j] *= inv;
  A m, z;
  block_max_sumexp<kThreads>(x, valid, smem, m, z);
  const A shift = ibot_loss_detail::chunk_shift(m);
  A dot = 0, tsum = 0;
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) {
    if (valid[j]) {
      dot += p[j] * dino_loss_detail::log_factor(p[j], x[j] - shift);
      tsum += p[j];
    }
  }
  dot = block_sum<kThreads>(dot, smem);
  tsum = block_sum<kThreads>(tsum, smem);
  if (threadIdx.x == 0) {
    ws.maxes[item] = m;
    ws.sums[item] = z;
    ws.dots[item] = dot;
    ws.tsums[item] = tsum;
  }
}

// A thread per row: its log-sum-exp and weighted cross-entropy term.
template <typename A>
__global__ void row_kernel(Shape s, int64_t chunks, Workspace<A> ws, const A* weights, A* lse) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (row >= s.rows) return;
  const int64_t at = row * chunks;
  const A ce = ibot_loss_detail::row_cross_entropy(ws.maxes + at, ws.sums + at, ws.dots + at,
                                                   ws.tsums + at, chunks, lse + row);
  ws.terms[row] = weights[row] * ce;
}

// One block: loss = -sum of the row terms, in double, in a fixed order.
template <typename A>
__global__ void __launch_bounds__(kThreads) loss_kernel(int64_t rows, const A* terms, A* loss) {
  __shared__ double smem[kThreads / 32];
  double total = 0;
  for (int64_t i = threadIdx.x; i < rows; i += kThreads) total += static_cast<double>(terms[i]);
  total = block_sum<kThreads>(total, smem);
  if (threadIdx.x == 0) *loss = static_cast<A>(0.0 - total);  // +0 for no rows
}

// A block per target row: the sum of its targets.
template <typename T, typename A>
__global__ void __launch_bounds__(kThreads) target_sum_kernel(const IbotLossArgs a, A* tsums) {
  __shared__ A smem[kThreads / 32];
  const Shape& s = a.shape;
  const T* row = static_cast<const T*>(a.targets) + blockIdx.x * s.dim;
  A total = 0;
  for (int64_t base = threadIdx.x * kPerThread; base < s.dim; base += kChunk) {
    A p[kPerThread];
    bool valid[kPerThread];
    load_run<kPerThread>(row, base, s.dim, p, valid);
#pragma unroll
    for (int j = 0; j < kPerThread; ++j) total += p[j];  // 0 past the row's end
  }
  total = block_sum<kThreads>(total, smem);
  if (threadIdx.x == 0) tsums[blockIdx.x] = total;
}

template <typename S, typename T, typename A>
__global__ void __launch_bounds__(kThreads)
    grad_kernel(const IbotLossArgs a, int64_t chunks, const A* lse, const A* tsums,
                const A* grad_loss, S* grad) {
  const Shape& s = a.shape;
  const int64_t item = blockIdx.x;
  const int64_t row = item / chunks;
  const int64_t base = (item % chunks) * kChunk + threadIdx.x * kPerThread;
  A x[kPerThread], p[kPerThread];
  bool valid[kPerThread];
  load_run<kPerThread>(static_cast<const T*>(a.targets) + s.target_row(row) * s.dim, base, s.dim, p,
                       valid);
  load_run<kPerThread>(static_cast<const S*>(a.student) + row * s.dim, base, s.dim, x, valid);
  const A inv = static_cast<A>(a.inv_student_temp);
  const A scale = *grad_loss * static_cast<const A*>(a.weights)[row] * inv;
  const A tsum = tsums[s.target_row(row)], row_lse = lse[row];
  A g[kPerThread];
#pragma unroll
  for (int j = 0; j < kPerThread; ++j) g[j] = scale * (tsum * exp_acc(x[j] * inv - row_lse) - p[j]);
  store_run<kPerThread>(grad + row * s.dim, base, s.dim, g);
}

template <typename S, typename T>
cudaError_t forward_typed(const IbotLossArgs& a, void* workspace, void* lse, void* loss,
                          cudaStream_t stream) {
  using A = acc_t<S>;
  const Shape& s = a.shape;
  const Workspace<A> ws(workspace, s);
  const int64_t chunks = n_chunks(s);
  if (s.rows > 0) {
    chunk_kernel<S, T, A><<<s.rows * chunks, kThreads, 0, stream>>>(a, chunks, ws);
    row_kernel<A><<<(s.rows + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
        s, chunks, ws, static_cast<const A*>(a.weights), static_cast<A*>(lse));
  }
  loss_kernel<A><<<1, kThreads, 0, stream>>>(s.rows, ws.terms, static_cast<A*>(loss));
  return cudaGetLastError();
}

template <typename S, typename T>
cudaError_t backward_typed(const IbotLossArgs& a, const void* lse, const void* grad_loss,
                           void* workspace, void* grad, cudaStream_t stream) {
  using A = acc_t<S>;
  const Shape& s = a.shape;
  if (s.rows == 0) return cudaSuccess;
  A* tsums = static_cast<A*>(workspace);
  target_sum_kernel<T, A><<<s.target_rows, kThreads, 0, stream>>>(a, tsums);
  const int64_t chunks = n_chunks(s);
  grad_kernel<S, T, A><<<s.rows * chunks, kThreads, 0, stream>>>(
      a, chunks, static_cast<const A*>(lse), tsums, static_cast<const A*>(grad_loss),
      static_cast<S*>(grad));
  return cudaGetLastError();
}

template <typename X>
struct Type {
  using type = X;
};

// Calls f(Type<S>{}, Type<T>{}) with the student's and targets' element types.
template <typename F>
cudaError_t dispatch(const IbotLossArgs& a, F&& f) {
  switch (a.dtype) {
    case kF64:
      return f(Type<double>{}, Type<double>{});
    case kF32:
      return f(Type<float>{}, Type<float>{});
    case kBF16:
      return a.float_targets ? f(Type<__nv_bfloat16>{}, Type<float>{})
                             : f(Type<__nv_bfloat16>{}, Type<__nv_bfloat16>{});
    case kF16:
      return a.float_targets ? f(Type<__half>{}, Type<float>{}) : f(Type<__half>{}, Type<__half>{});
    default:
      return cudaErrorInvalidValue;
  }
}

}  // namespace

int64_t ibot_loss_forward_workspace(const Shape& s) { return 4 * s.rows * n_chunks(s) + s.rows; }

int64_t ibot_loss_backward_workspace(const Shape& s) { return s.target_rows; }

cudaError_t launch_ibot_loss_forward(const IbotLossArgs& a, void* workspace, void* student_lse,
                                     void* loss, cudaStream_t stream) {
  return dispatch(a, [&](auto s, auto t) {
    return forward_typed<typename decltype(s)::type, typename decltype(t)::type>(
        a, workspace, student_lse, loss, stream);
  });
}

cudaError_t launch_ibot_loss_backward(const IbotLossArgs& a, const void* student_lse,
                                      const void* grad_loss, void* workspace, void* grad_student,
                                      cudaStream_t stream) {
  return dispatch(a, [&](auto s, auto t) {
    return backward_typed<typename decltype(s)::type, typename decltype(t)::type>(
        a, student_lse, grad_loss, workspace, grad_student, stream);
  });
}

}  // namespace dino_opt::cuda
