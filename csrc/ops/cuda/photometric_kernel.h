#pragma once
// Launcher of the CUDA kernels of dino_opt::multicrop_photometric. Free of
// torch headers so that nvcc compiles photometric_kernel.cu quickly; the
// registration lives in photometric_cuda.cpp.
#include <cuda_runtime_api.h>

#include "ops/photometric_tile.h"

namespace dino_opt::cuda {

// Runs the prologue and main launches over all (crop, tile) blocks of the
// batch on `stream`. The caller allocates args.tile_sums ([n, tiles] doubles)
// and args.taps ([n, taps_per_crop(h, w)] floats). Returns cudaSuccess or the
// launch error (cudaErrorInvalidValue when the grid exceeds 2^31 - 1 blocks).
cudaError_t launch_multicrop_photometric(const photometric_detail::BatchArgs& args,
                                         cudaStream_t stream);

}  // namespace dino_opt::cuda
