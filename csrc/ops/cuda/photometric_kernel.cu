// CUDA kernels of dino_opt::multicrop_photometric: thin wrappers that run the
// block algorithm of ops/photometric_tile.h (shared with the host tests) with
// one CUDA thread block per (crop, 32 x 32 tile).
//
// Floor: every input byte is read once and every output element written
// once, so the time is bounded below by
//   (N*H*W*3 * 1 byte + N*3*H*W * sizeof(out)) / DRAM bandwidth,
// e.g. the DINO batch of 2x64 crops of 224^2 and 8x64 of 96^2 moves 33.4 MB in
// and 134 MB out as float32 (67 MB as bfloat16): 56 us (33 us) at 3 TB/s on an
// H100. Launch 1 rereads the input of crops with contrast (from L2 when the
// batch's uint8 crops fit in its 50 MB), and blurred tiles recompute the
// colour ops on their halo (44^2 / 32^2 = 1.9x for sigma = 2), so blurred
// crops are bound by arithmetic rather than by memory: the compiler may not
// fuse a*b + c (this file is built with -fmad=false) so that the results
// equal the CPU kernel's bit for bit.
#include <cuda_runtime.h>

#include <climits>

#include "ops/cuda/photometric_kernel.h"

namespace dino_opt::cuda {
namespace {

using photometric_detail::BatchArgs;

constexpr int kThreads = 256;  // a power of 2: tile_gray_sum's tree reduction

struct CudaBlock {
  __host__ __device__ int tid() const {
#if defined(__CUDA_ARCH__)
    return static_cast<int>(threadIdx.x);
#else
    return 0;
#endif
  }
  __host__ __device__ int size() const { return kThreads; }
  __host__ __device__ void sync() const {
#if defined(__CUDA_ARCH__)
    __syncthreads();
#endif
  }
};

__global__ void __launch_bounds__(kThreads) photometric_prologue(const BatchArgs args) {
  __shared__ double reduce[kThreads];
  photometric_detail::prologue_block(CudaBlock{}, args, static_cast<int64_t>(blockIdx.x), reduce);
}

__global__ void __launch_bounds__(kThreads) photometric_main(const BatchArgs args) {
  extern __shared__ float shared[];
  photometric_detail::main_block(CudaBlock{}, args, static_cast<int64_t>(blockIdx.x), shared);
}

}  // namespace

cudaError_t launch_multicrop_photometric(const BatchArgs& args, cudaStream_t stream) {
  if (args.n == 0 || args.h == 0 || args.w == 0) return cudaSuccess;
  const int64_t blocks = args.n * photometric_detail::tiles_per_crop(args);
  if (blocks > INT_MAX) return cudaErrorInvalidValue;
  // 57 KB: above the 48 KB a launch gets without opting in.
  constexpr size_t kShared = photometric_detail::kMainSharedFloats * sizeof(float);
  cudaError_t err = cudaFuncSetAttribute(
      photometric_main, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kShared));
  if (err != cudaSuccess) return err;
  const unsigned grid = static_cast<unsigned>(blocks);
  photometric_prologue<<<grid, kThreads, 0, stream>>>(args);
  err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  photometric_main<<<grid, kThreads, kShared, stream>>>(args);
  return cudaGetLastError();
}

}  // namespace dino_opt::cuda
