// Schemas of dino_opt::dino_loss / dino_loss_backward and their shared checks.
#include "ops/dino_loss.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/library.h>

#include <cmath>
#include <utility>

#include "ops/dtype.h"

namespace dino_opt {

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def(
      "dino_loss(Tensor student, Tensor teacher, Tensor center, float student_temp, "
      "float teacher_temp, int ncrops, int view_offset=0, int total_views=-1) -> "
      "(Tensor loss, Tensor student_lse, Tensor teacher_lse)");
  m.def(
      "dino_loss_backward(Tensor grad, Tensor student, Tensor teacher, Tensor center, "
      "Tensor student_lse, Tensor teacher_lse, float student_temp, float teacher_temp, "
      "int ncrops, int view_offset=0, int total_views=-1) -> Tensor");
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dino_loss(const at::Tensor& student,
                                                         const at::Tensor& teacher,
                                                         const at::Tensor& center,
                                                         double student_temp, double teacher_temp,
                                                         int64_t ncrops, int64_t view_offset,
                                                         int64_t total_views) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::dino_loss", "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(
                           const at::Tensor&, const at::Tensor&, const at::Tensor&, double, double,
                           int64_t, int64_t, int64_t)>();
  return op.call(student, teacher, center, student_temp, teacher_temp, ncrops, view_offset,
                 total_views);
}

at::Tensor dino_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& teacher, const at::Tensor& center,
                              const at::Tensor& student_lse, const at::Tensor& teacher_lse,
                              double student_temp, double teacher_temp, int64_t ncrops,
                              int64_t view_offset, int64_t total_views) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("dino_opt::dino_loss_backward", "")
                       .typed<at::Tensor(const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         const at::Tensor&, const at::Tensor&, const at::Tensor&,
                                         double, double, int64_t, int64_t, int64_t)>();
  return op.call(grad, student, teacher, center, student_lse, teacher_lse, student_temp,
                 teacher_temp, ncrops, view_offset, total_views);
}

namespace dino_loss_detail {

at::ScalarType acc_dtype(const at::Tensor& student) {
  return student.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

namespace {

// Checks the view arguments; returns (view_offset, total_views) with -1 resolved.
std::pair<int64_t, int64_t> check_views(const char* op, const Views& v) {
  if (v.total_views == -1) {
    TORCH_CHECK(v.ncrops >= 2, op, ": ncrops (student views) must be at least 2, got ", v.ncrops);
    TORCH_CHECK(v.view_offset == 0, op, ": view_offset=", v.view_offset,
                " needs total_views (the student views of the whole step)");
    return {0, v.ncrops};
  }
  TORCH_CHECK(v.total_views >= 2, op, ": total_views must be at least 2, got ", v.total_views);
  TORCH_CHECK(v.ncrops >= 1 && v.view_offset >= 0 && v.view_offset + v.ncrops <= v.total_views, op,
              ": student views [", v.view_offset, ", ", v.view_offset + v.ncrops,
              ") (view_offset, ncrops) are not within the ", v.total_views,
              " views of the step (total_views)");
  return {v.view_offset, v.total_views};
}

}  // namespace

Shape check_args(const char* op, const at::Tensor& student, const at::Tensor& teacher,
                 const at::Tensor& center, double student_temp, double teacher_temp, Views views,
                 const at::Tensor& student_lse, const at::Tensor& teacher_lse) {
  const int64_t ncrops = views.ncrops;
  const auto [view_offset, total_views] = check_views(op, views);
  TORCH_CHECK(student.dim() == 2, op, ": student must be 2-D [ncrops * batch, out_dim], got shape ",
              student.sizes());
  TORCH_CHECK(teacher.dim() == 2, op, ": teacher must be 2-D [teacher_views * batch, out_dim], ",
              "got shape ", teacher.sizes());
  TORCH_CHECK(student.size(1) == teacher.size(1), op, ": student has out_dim ", student.size(1),
              " but teacher has out_dim ", teacher.size(1), " (shapes ", student.sizes(), " and ",
              teacher.sizes(), ")");
  const int64_t dim = student.size(1);
  TORCH_CHECK(dim >= 1, op, ": out_dim must be at least 1, got shape ", student.sizes());
  TORCH_CHECK(
      center.numel() == dim && (center.dim() == 1 || (center.dim() == 2 && center.size(0) == 1)),
      op, ": center must have shape [", dim, "] or [1, ", dim, "], got ", center.sizes());
  TORCH_CHECK(student.size(0) > 0 && student.size(0) % ncrops == 0, op, ": student has ",
              student.size(0), " rows, which is not a positive multiple of ncrops=", ncrops);
  const int64_t batch = student.size(0) / ncrops;
  TORCH_CHECK(teacher.size(0) > 0 && teacher.size(0) % batch == 0, op, ": teacher has ",
              teacher.size(0), " rows, which is not a positive multiple of the batch size ", batch,
              " (student rows ", student.size(0), " / ncrops ", ncrops, ")");
  const int64_t teacher_views = teacher.size(0) / batch;
  TORCH_CHECK(teacher_views <= total_views, op, ": teacher has ", teacher_views,
              " views but the student only ", total_views,
              "; every teacher view must have a matching student view");
  TORCH_CHECK(teacher_views <= kMaxTeacherViews, op, ": at most ", kMaxTeacherViews,
              " teacher views are supported, got ", teacher_views);
  TORCH_CHECK(std::isfinite(student_temp) && student_temp > 0, op,
              ": student_temp must be positive and finite, got ", student_temp);
  TORCH_CHECK(std::isfinite(teacher_temp) && teacher_temp > 0, op,
              ": teacher_temp must be positive and finite, got ", teacher_temp);
  float_index(student.scalar_type(), op, "student");
  TORCH_CHECK(teacher.scalar_type() == student.scalar_type(), op, ": teacher has dtype ",
              teacher.scalar_type(), " but student has dtype ", student.scalar_type());
  float_index(center.scalar_type(), op, "center");
  TORCH_CHECK(teacher.device() == student.device() && center.device() == student.device(), op,
              ": student, teacher and center must be on one device, got ", student.device(), ", ",
              teacher.device(), " and ", center.device());
  const Shape shape{ncrops, teacher_views, batch, dim, view_offset, total_views};
  if (student_lse.defined()) {
    TORCH_CHECK(
        student_lse.numel() == ncrops * batch && teacher_lse.numel() == teacher_views * batch, op,
        ": student_lse/teacher_lse must have ", ncrops * batch, "/", teacher_views * batch,
        " elements, got ", student_lse.sizes(), "/", teacher_lse.sizes());
    TORCH_CHECK(student_lse.scalar_type() == acc_dtype(student) &&
                    teacher_lse.scalar_type() == acc_dtype(student),
                op, ": student_lse/teacher_lse must have dtype ", acc_dtype(student));
    TORCH_CHECK(
        student_lse.device() == student.device() && teacher_lse.device() == student.device(), op,
        ": student_lse/teacher_lse must be on ", student.device());
  }
  return shape;
}

Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
               const at::Tensor& center, double student_temp, double teacher_temp, Views views,
               const at::Tensor& student_lse, const at::Tensor& teacher_lse) {
  const Shape shape = check_args(op, student, teacher, center, student_temp, teacher_temp, views,
                                 student_lse, teacher_lse);
  return Inputs{student.contiguous(), teacher.contiguous(),
                center.reshape({-1}).to(acc_dtype(student)).contiguous(), shape};
}

}  // namespace dino_loss_detail
}  // namespace dino_opt
