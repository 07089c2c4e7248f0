#pragma once
// Launcher of the CUDA Gram loss tile kernel; free of torch headers. All
// buffers are device pointers.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/gram_loss_math.h"

namespace dino_opt::cuda {

// Blocks of the tile kernel for a tile of n similarities: the length of the
// `partials` buffer (float64) it fills.
int64_t gram_tile_blocks(int64_t n);

// s, t: n similarities of the student and the teacher, float64 when `is_double`
// else float32. Writes into partials[b] (float64) block b's sum of
// gram_diff(s, t)^2; with `coeff`, overwrites s with gram_diff * slope.
cudaError_t launch_gram_tile(void* s, const void* t, int64_t n, bool is_double,
                             gram_loss_detail::Clamp clamp, bool coeff, double* partials,
                             cudaStream_t stream);

}  // namespace dino_opt::cuda
