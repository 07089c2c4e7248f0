// CUDA registration of dino_opt::dino_loss / dino_loss_backward: checks,
// workspaces from the caching allocator, launches on the current stream. No
// host synchronisation: the gradient scale is read on the device.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda/dino_loss_kernel.h"
#include "ops/dino_loss.h"
#include "ops/dtype.h"

namespace dino_opt {
namespace {

struct Prepared {
  dino_loss_detail::Inputs in;
  cuda::DinoLossArgs args;
};

Prepared prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
                 const at::Tensor& center, double student_temp, double teacher_temp,
                 dino_loss_detail::Views views, const at::Tensor& student_lse = {},
                 const at::Tensor& teacher_lse = {}) {
  Prepared p{dino_loss_detail::prepare(op, student, teacher, center, student_temp, teacher_temp,
                                       views, student_lse, teacher_lse),
             {}};
  p.args = cuda::DinoLossArgs{float_index(student.scalar_type(), op, "student"),
                              p.in.student.const_data_ptr(),
                              p.in.teacher.const_data_ptr(),
                              p.in.center.const_data_ptr(),
                              p.in.shape,
                              1.0 / student_temp,
                              1.0 / teacher_temp};
  return p;
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> dino_loss_cuda(
    const at::Tensor& student, const at::Tensor& teacher, const at::Tensor& center,
    double student_temp, double teacher_temp, int64_t ncrops, int64_t view_offset,
    int64_t total_views) {
  // Checks first: with one argument on the CPU, the error names it (a guard
  // built from a CPU tensor would fail with a message about the guard).
  const Prepared p = prepare("dino_loss", student, teacher, center, student_temp, teacher_temp,
                             {ncrops, view_offset, total_views});
  const c10::cuda::CUDAGuard guard(student.device());
  const auto& s = p.args.shape;
  const auto options = student.options().dtype(dino_loss_detail::acc_dtype(student));
  const int64_t stats = cuda::dino_loss_stats_workspace(s);
  at::Tensor workspace =
      at::empty({2 * stats + cuda::dino_loss_dots_workspace(s)}, options);  // max, sum, dots
  at::Tensor student_lse = at::empty({s.student_views * s.batch}, options);
  at::Tensor teacher_lse = at::empty({s.teacher_views * s.batch}, options);
  at::Tensor loss = at::empty({}, options);
  char* ws = static_cast<char*>(workspace.data_ptr());
  const int64_t elem = workspace.element_size();
  C10_CUDA_CHECK(cuda::launch_dino_loss_forward(
      p.args, ws, ws + stats * elem, ws + 2 * stats * elem, student_lse.data_ptr(),
      teacher_lse.data_ptr(), loss.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
  return {loss, student_lse, teacher_lse};
}

at::Tensor dino_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& student,
                                   const at::Tensor& teacher, const at::Tensor& center,
                                   const at::Tensor& student_lse, const at::Tensor& teacher_lse,
                                   double student_temp, double teacher_temp, int64_t ncrops,
                                   int64_t view_offset, int64_t total_views) {
  const Prepared p =
      prepare("dino_loss_backward", student, teacher, center, student_temp, teacher_temp,
              {ncrops, view_offset, total_views}, student_lse, teacher_lse);
  TORCH_CHECK(grad.numel() == 1, "dino_loss_backward: grad must be a scalar, got shape ",
              grad.sizes());
  TORCH_CHECK(grad.device() == student.device(), "dino_loss_backward: grad is on ", grad.device(),
              " but student is on ", student.device());
  const c10::cuda::CUDAGuard guard(student.device());
  const at::Tensor grad_acc = grad.to(dino_loss_detail::acc_dtype(student)).contiguous();
  const at::Tensor slse = student_lse.contiguous(), tlse = teacher_lse.contiguous();
  at::Tensor grad_student = at::empty_like(p.in.student);
  C10_CUDA_CHECK(cuda::launch_dino_loss_backward(
      p.args, slse.const_data_ptr(), tlse.const_data_ptr(), grad_acc.const_data_ptr(),
      grad_student.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
  return grad_student;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CUDA, m) {
  m.impl("dino_loss", &dino_loss_cuda);
  m.impl("dino_loss_backward", &dino_loss_backward_cuda);
}

}  // namespace dino_opt
