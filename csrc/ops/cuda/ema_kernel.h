#pragma once
// Launcher of the multi-tensor EMA kernel. Free of torch headers so that nvcc
// compiles ema_kernel.cu quickly; the registration lives in ema_cuda.cpp.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/kernel_types.h"

namespace dino_opt::cuda {

// Tensors whose pointers travel in one launch's kernel arguments. 28 bytes
// each: within the 32 KB kernel-parameter limit of CUDA >= 12.1 on sm_70+.
constexpr int kEmaTensorsPerLaunch = 1024;

// Runs t = m*t + (1-m)*s over all pairs on `stream`: one launch for up to
// kEmaTensorsPerLaunch tensors. Returns cudaSuccess or the launch error.
cudaError_t launch_ema_update(const ema_detail::FlatPair* pairs, int64_t count,
                              FloatIndex teacher_dtype, FloatIndex student_dtype,
                              ema_detail::Coefficients coefficients, cudaStream_t stream);

}  // namespace dino_opt::cuda
