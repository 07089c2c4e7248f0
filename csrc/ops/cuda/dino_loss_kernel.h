#pragma once
// Launchers of the CUDA DINO loss kernels; free of torch headers. All buffers
// are device pointers; `A` below is the accumulation type (double for float64
// inputs, float otherwise) and every workspace is of that type.
#include <cuda_runtime_api.h>

#include <cstdint>

#include "ops/dino_loss_math.h"
#include "ops/kernel_types.h"

namespace dino_opt::cuda {

struct DinoLossArgs {
  FloatIndex dtype;     // of student and teacher
  const void* student;  // [S*B, K] contiguous
  const void* teacher;  // [T*B, K] contiguous
  const void* center;   // [K] of A
  dino_loss_detail::Shape shape;
  double inv_student_temp;
  double inv_teacher_temp;
};

// Workspace sizes, in elements of A.
int64_t dino_loss_stats_workspace(const dino_loss_detail::Shape& shape);  // max and sum, each
int64_t dino_loss_dots_workspace(const dino_loss_detail::Shape& shape);

// Forward: fills student_lse [S*B], teacher_lse [T*B] and loss [] (all A).
cudaError_t launch_dino_loss_forward(const DinoLossArgs& args, void* stats_max, void* stats_sum,
                                     void* dots, void* student_lse, void* teacher_lse, void* loss,
                                     cudaStream_t stream);

// Backward: grad_student [S*B, K] (input dtype) from grad_loss [] (A).
cudaError_t launch_dino_loss_backward(const DinoLossArgs& args, const void* student_lse,
                                      const void* teacher_lse, const void* grad_loss,
                                      void* grad_student, cudaStream_t stream);

}  // namespace dino_opt::cuda
