// CUDA tile kernel of the fused Gram loss: one pass over a tile of the
// student's and the teacher's similarities (made by cuBLAS in the shared
// driver), clamping as asked, leaving a float64 sum of squared differences
// per block and, for the backward, the coefficients d * dd/ds in place of the
// student's similarities. Blocks stride over the tile; each block reduces in
// a fixed order, and the partials are added by the caller in a fixed order:
// the result is deterministic.
#include <cuda_runtime.h>

#include <algorithm>

#include "ops/cuda/gram_loss_kernel.h"

namespace dino_opt::cuda {
namespace {

constexpr int kThreads = 256;
constexpr int64_t kMaxBlocks = 1024;

template <typename A>
__global__ void __launch_bounds__(kThreads)
    gram_tile_kernel(A* s, const A* t, int64_t n, int clamp, bool coeff, double* partials) {
  __shared__ double warp_sums[kThreads / 32];
  double total = 0;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * kThreads;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * kThreads + threadIdx.x; i < n; i += stride) {
    A slope;
    const A d = gram_loss_detail::gram_diff(s[i], t[i], clamp, &slope);
    total += static_cast<double>(d) * static_cast<double>(d);
    if (coeff) s[i] = d * slope;
  }
  for (int offset = 16; offset > 0; offset /= 2) {
    total += __shfl_down_sync(0xffffffffu, total, offset);
  }
  if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = total;
  __syncthreads();
  if (threadIdx.x == 0) {
    double block = 0;
    for (int w = 0; w < kThreads / 32; ++w) block += warp_sums[w];
    partials[blockIdx.x] = block;
  }
}

}  // namespace

int64_t gram_tile_blocks(int64_t n) {
  return std::clamp<int64_t>((n + kThreads - 1) / kThreads, 1, kMaxBlocks);
}

cudaError_t launch_gram_tile(void* s, const void* t, int64_t n, bool is_double,
                             gram_loss_detail::Clamp clamp, bool coeff, double* partials,
                             cudaStream_t stream) {
  const auto blocks = static_cast<unsigned>(gram_tile_blocks(n));
  if (is_double) {
    gram_tile_kernel<double><<<blocks, kThreads, 0, stream>>>(
        static_cast<double*>(s), static_cast<const double*>(t), n, clamp, coeff, partials);
  } else {
    gram_tile_kernel<float><<<blocks, kThreads, 0, stream>>>(
        static_cast<float*>(s), static_cast<const float*>(t), n, clamp, coeff, partials);
  }
  return cudaGetLastError();
}

}  // namespace dino_opt::cuda
