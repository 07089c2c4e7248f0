#pragma once
// Fused DINO loss: cross-entropy between the centred, sharpened teacher softmax
// and the student log-softmax over all (teacher view, student view != teacher
// view) pairs, in O((S + T) * K) per sample. See DESIGN.md section 4.
#include <ATen/core/Tensor.h>

#include <tuple>

#include "ops/dino_loss_math.h"

namespace dino_opt {

// Public C++ API (dispatcher calls). Returns (loss, student_lse, teacher_lse):
// the scalar loss, the log-sum-exp of student/student_temp per student row and
// of (teacher - center)/teacher_temp per teacher row, both kept for backward.
std::tuple<at::Tensor, at::Tensor, at::Tensor> dino_loss(const at::Tensor& student,
                                                         const at::Tensor& teacher,
                                                         const at::Tensor& center,
                                                         double student_temp, double teacher_temp,
                                                         int64_t ncrops);

// Gradient of the loss w.r.t. the student logits (the teacher gets none).
at::Tensor dino_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& teacher, const at::Tensor& center,
                              const at::Tensor& student_lse, const at::Tensor& teacher_lse,
                              double student_temp, double teacher_temp, int64_t ncrops);

namespace dino_loss_detail {

// Checks the arguments (throwing c10::Error that names the argument, its shape,
// dtype or device) and returns the view layout. `lse` checks are skipped when
// the tensors are undefined (forward).
Shape check_args(const char* op, const at::Tensor& student, const at::Tensor& teacher,
                 const at::Tensor& center, double student_temp, double teacher_temp, int64_t ncrops,
                 const at::Tensor& student_lse = {}, const at::Tensor& teacher_lse = {});

// Accumulation dtype of the kernels: float64 for float64 inputs, else float32.
at::ScalarType acc_dtype(const at::Tensor& student);

// The arguments as every kernel takes them, after check_args: contiguous rows
// and the center as a contiguous [K] tensor of the accumulation dtype.
struct Inputs {
  at::Tensor student, teacher, center;
  Shape shape;
};
Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
               const at::Tensor& center, double student_temp, double teacher_temp, int64_t ncrops,
               const at::Tensor& student_lse = {}, const at::Tensor& teacher_lse = {});

}  // namespace dino_loss_detail
}  // namespace dino_opt
