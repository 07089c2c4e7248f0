// Schemas of dino_opt::ibot_loss / ibot_loss_backward and their shared checks.
#include "ops/ibot_loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>

#include "ops/dino_loss.h"
#include "ops/dtype.h"

namespace dino_opt {

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def(
      "ibot_loss(Tensor student, Tensor targets, Tensor weights, float student_temp) -> "
      "(Tensor loss, Tensor student_lse)");
  m.def(
      "ibot_loss_backward(Tensor grad, Tensor student, Tensor targets, Tensor weights, "
      "Tensor student_lse, float student_temp) -> Tensor");
}

std::tuple<at::Tensor, at::Tensor> ibot_loss(const at::Tensor& student, const at::Tensor& targets,
                                             const at::Tensor& weights, double student_temp) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::ibot_loss", "")
                       .typed<std::tuple<at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, double)>();
  return op.call(student, targets, weights, student_temp);
}

at::Tensor ibot_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& targets, const at::Tensor& weights,
                              const at::Tensor& student_lse, double student_temp) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::ibot_loss_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, double)>();
  return op.call(grad, student, targets, weights, student_lse, student_temp);
}

namespace ibot_loss_detail {
namespace {

// Shapes: student [N, K], targets [M, K] with M dividing N, weights [N].
Shape check_shapes(const char* op, const at::Tensor& student, const at::Tensor& targets,
                   const at::Tensor& weights) {
  TORCH_CHECK(student.dim() == 2, op, ": student must be 2-D [N, K], got shape ", student.sizes());
  TORCH_CHECK(targets.dim() == 2, op, ": targets must be 2-D [M, K], got shape ", targets.sizes());
  TORCH_CHECK(student.size(1) == targets.size(1), op, ": student has K=", student.size(1),
              " but targets has K=", targets.size(1), " (shapes ", student.sizes(), " and ",
              targets.sizes(), ")");
  TORCH_CHECK(student.size(1) >= 1, op, ": K must be at least 1, got student shape ",
              student.sizes());
  const int64_t rows = student.size(0), target_rows = targets.size(0);
  TORCH_CHECK(target_rows > 0 ? rows % target_rows == 0 : rows == 0, op, ": student has ", rows,
              " rows, which is not a multiple of the ", target_rows,
              " rows of targets (student row n takes target row n % M; shapes ", student.sizes(),
              " and ", targets.sizes(), ")");
  TORCH_CHECK(weights.dim() == 1 && weights.size(0) == rows, op, ": weights must have shape [",
              rows, "] (one per student row), got ", weights.sizes());
  return Shape{rows, target_rows, student.size(1)};
}

void check_dtypes_and_devices(const char* op, const at::Tensor& student, const at::Tensor& targets,
                              const at::Tensor& weights) {
  float_index(student.scalar_type(), op, "student");
  const at::ScalarType acc = dino_loss_detail::acc_dtype(student);
  TORCH_CHECK(targets.scalar_type() == student.scalar_type() || targets.scalar_type() == at::kFloat,
              op, ": targets has dtype ", targets.scalar_type(), "; expected the student's dtype (",
              student.scalar_type(), ") or float32");
  TORCH_CHECK(weights.scalar_type() == at::kFloat || weights.scalar_type() == acc, op,
              ": weights has dtype ", weights.scalar_type(), "; expected float32",
              acc == at::kFloat ? "" : " or float64");
  TORCH_CHECK(targets.device() == student.device() && weights.device() == student.device(), op,
              ": student, targets and weights must be on one device, got ", student.device(), ", ",
              targets.device(), " and ", weights.device());
}

}  // namespace

Shape check_args(const char* op, const at::Tensor& student, const at::Tensor& targets,
                 const at::Tensor& weights, double student_temp, const at::Tensor& student_lse) {
  const Shape shape = check_shapes(op, student, targets, weights);
  TORCH_CHECK(std::isfinite(student_temp) && student_temp > 0, op,
              ": student_temp must be positive and finite, got ", student_temp);
  check_dtypes_and_devices(op, student, targets, weights);
  if (student_lse.defined()) {
    const at::ScalarType acc = dino_loss_detail::acc_dtype(student);
    TORCH_CHECK(student_lse.dim() == 1 && student_lse.size(0) == shape.rows, op,
                ": student_lse must have shape [", shape.rows, "], got ", student_lse.sizes());
    TORCH_CHECK(student_lse.scalar_type() == acc, op, ": student_lse has dtype ",
                student_lse.scalar_type(), "; expected ", acc);
    TORCH_CHECK(student_lse.device() == student.device(), op, ": student_lse is on ",
                student_lse.device(), " but student is on ", student.device());
  }
  return shape;
}

Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& targets,
               const at::Tensor& weights, double student_temp, const at::Tensor& student_lse) {
  const Shape shape = check_args(op, student, targets, weights, student_temp, student_lse);
  const at::ScalarType acc = dino_loss_detail::acc_dtype(student);
  // A float64 student with float32 targets: the kernels take float64 targets.
  const at::ScalarType target_dtype = acc == at::kDouble ? at::kDouble : targets.scalar_type();
  return Inputs{student.contiguous(), targets.to(target_dtype).contiguous(),
                weights.to(acc).contiguous(), shape,
                targets.scalar_type() != student.scalar_type() && acc == at::kFloat};
}

}  // namespace ibot_loss_detail
}  // namespace dino_opt
