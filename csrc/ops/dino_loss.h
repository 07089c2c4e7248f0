#pragma once
// Fused DINO loss: cross-entropy between the centred, sharpened teacher softmax
// and the student log-softmax over all (teacher view, student view != teacher
// view) pairs, in O((S + T) * K) per sample (docs/design.md derives it).
#include <ATen/core/Tensor.h>

#include <tuple>

#include "ops/dino_loss_math.h"

namespace dino_opt {

// Public C++ API (dispatcher calls). Returns (loss, student_lse, teacher_lse):
// the scalar loss, the log-sum-exp of student/student_temp per student row and
// of (teacher - center)/teacher_temp per teacher row, both kept for backward.
// `student` holds `ncrops` student views: all of them (total_views -1), or
// views [view_offset, view_offset + ncrops) of total_views (see Shape).
std::tuple<at::Tensor, at::Tensor, at::Tensor> dino_loss(const at::Tensor& student,
                                                         const at::Tensor& teacher,
                                                         const at::Tensor& center,
                                                         double student_temp, double teacher_temp,
                                                         int64_t ncrops, int64_t view_offset = 0,
                                                         int64_t total_views = -1);

// Gradient of the loss w.r.t. the student logits (the teacher gets none).
at::Tensor dino_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& teacher, const at::Tensor& center,
                              const at::Tensor& student_lse, const at::Tensor& teacher_lse,
                              double student_temp, double teacher_temp, int64_t ncrops,
                              int64_t view_offset = 0, int64_t total_views = -1);

namespace dino_loss_detail {

// Checks the arguments (throwing c10::Error that names the argument, its shape,
// dtype or device) and returns the view layout. `lse` checks are skipped when
// the tensors are undefined (forward).
// The view arguments of a call: ncrops student views, from view_offset of
// total_views (-1: ncrops, the whole step).
struct Views {
  int64_t ncrops, view_offset, total_views;
};
Shape check_args(const char* op, const at::Tensor& student, const at::Tensor& teacher,
                 const at::Tensor& center, double student_temp, double teacher_temp, Views views,
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
               const at::Tensor& center, double student_temp, double teacher_temp, Views views,
               const at::Tensor& student_lse = {}, const at::Tensor& teacher_lse = {});

}  // namespace dino_loss_detail
}  // namespace dino_opt
