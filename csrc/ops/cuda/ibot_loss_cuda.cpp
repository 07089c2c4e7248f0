// CUDA registration of dino_opt::ibot_loss / ibot_loss_backward: checks,
// workspaces from the caching allocator, launches on the current stream. No
// host synchronisation: the gradient scale is read on the device.
#include <ATen/ops/empty.h>
#include <ATen/ops/empty_like.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda/ibot_loss_kernel.h"
#include "ops/dino_loss.h"
#include "ops/dtype.h"
#include "ops/ibot_loss.h"

namespace dino_opt {
namespace {

struct Prepared {
  ibot_loss_detail::Inputs in;
  cuda::IbotLossArgs args;
};

Prepared prepare(const char* op, const at::Tensor& student, const at::Tensor& targets,
                 const at::Tensor& weights, double student_temp,
                 const at::Tensor& student_lse = {}) {
  Prepared p{ibot_loss_detail::prepare(op, student, targets, weights, student_temp, student_lse),
             {}};
  p.args = cuda::IbotLossArgs{float_index(student.scalar_type(), op, "student"),
                              p.in.float_targets,
                              p.in.student.const_data_ptr(),
                              p.in.targets.const_data_ptr(),
                              p.in.weights.const_data_ptr(),
                              p.in.shape,
                              1.0 / student_temp};
  return p;
}

std::tuple<at::Tensor, at::Tensor> ibot_loss_cuda(const at::Tensor& student,
                                                  const at::Tensor& targets,
                                                  const at::Tensor& weights, double student_temp) {
  // Checks first: with one argument on the CPU, the error names it (a guard
  // built from a CPU tensor would fail with a message about the guard).
  const Prepared p = prepare("ibot_loss", student, targets, weights, student_temp);
  const c10::cuda::CUDAGuard guard(student.device());
  const auto options = student.options().dtype(dino_loss_detail::acc_dtype(student));
  at::Tensor workspace = at::empty({cuda::ibot_loss_forward_workspace(p.args.shape)}, options);
  at::Tensor student_lse = at::empty({p.args.shape.rows}, options);
  at::Tensor loss = at::empty({}, options);
  C10_CUDA_CHECK(cuda::launch_ibot_loss_forward(p.args, workspace.data_ptr(),
                                                student_lse.data_ptr(), loss.data_ptr(),
                                                c10::cuda::getCurrentCUDAStream().stream()));
  return {loss, student_lse};
}

at::Tensor ibot_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& student,
                                   const at::Tensor& targets, const at::Tensor& weights,
                                   const at::Tensor& student_lse, double student_temp) {
  const Prepared p =
      prepare("ibot_loss_backward", student, targets, weights, student_temp, student_lse);
  TORCH_CHECK(grad.numel() == 1, "ibot_loss_backward: grad must be a scalar, got shape ",
              grad.sizes());
  TORCH_CHECK(grad.device() == student.device(), "ibot_loss_backward: grad is on ", grad.device(),
              " but student is on ", student.device());
  const c10::cuda::CUDAGuard guard(student.device());
  const auto acc = dino_loss_detail::acc_dtype(student);
  const at::Tensor grad_acc = grad.to(acc).contiguous();
  const at::Tensor lse = student_lse.contiguous();
  at::Tensor workspace =
      at::empty({cuda::ibot_loss_backward_workspace(p.args.shape)}, student.options().dtype(acc));
  at::Tensor grad_student = at::empty_like(p.in.student);
  C10_CUDA_CHECK(cuda::launch_ibot_loss_backward(
      p.args, lse.const_data_ptr(), grad_acc.const_data_ptr(), workspace.data_ptr(),
      grad_student.data_ptr(), c10::cuda::getCurrentCUDAStream().stream()));
  return grad_student;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CUDA, m) {
  m.impl("ibot_loss", &ibot_loss_cuda);
  m.impl("ibot_loss_backward", &ibot_loss_backward_cuda);
}

}  // namespace dino_opt
