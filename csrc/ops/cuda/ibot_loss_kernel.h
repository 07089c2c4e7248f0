#pragma once
// Launchers of the CUDA iBOT loss kernels; free of torch headers. All buffers
// are device pointers; `A` below is the accumulation type (double for float64
// students, float otherwise) and every workspace is of that type.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/ibot_loss_math.h"
#include "ops/kernel_types.h"

namespace dino_opt::cuda {

struct IbotLossArgs {
  FloatIndex dtype;     // of the student
  bool float_targets;   // targets are float32 (under a bfloat16/float16 student)
  const void* student;  // [N, K] contiguous
  const void* targets;  // [M, K] contiguous
  const void* weights;  // [N] of A
  ibot_loss_detail::Shape shape;
  double inv_student_temp;
};

// Forward workspace, in elements of A: four partials per (row, chunk) and a
// term per row.
int64_t ibot_loss_forward_workspace(const ibot_loss_detail::Shape& shape);
// Backward workspace, in elements of A: a sum per target row.
int64_t ibot_loss_backward_workspace(const ibot_loss_detail::Shape& shape);

// Forward: fills student_lse [N] and loss [] (both A).
cudaError_t launch_ibot_loss_forward(const IbotLossArgs& args, void* workspace, void* student_lse,
                                     void* loss, cudaStream_t stream);

// Backward: grad_student [N, K] (the student's dtype) from grad_loss [] (A).
cudaError_t launch_ibot_loss_backward(const IbotLossArgs& args, const void* student_lse,
                                      const void* grad_loss, void* workspace, void* grad_student,
                                      cudaStream_t stream);

}  // namespace dino_opt::cuda
