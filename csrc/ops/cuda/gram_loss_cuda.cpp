// CUDA registration of dino_opt::gram_loss / gram_loss_backward: the shared
// driver (ops/gram_loss.cpp: cuBLAS matmuls on chunks and tiles through ATen)
// with the CUDA tile kernel, on the current stream. No host synchronisation:
// the loss and the gradient scale stay on the device.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda/gram_loss_kernel.h"
#include "ops/gram_loss.h"

namespace dino_opt {
namespace {

using gram_loss_detail::Clamp;

at::Tensor tile_cuda(at::Tensor& s, const at::Tensor& t, Clamp clamp, bool coeff) {
  TORCH_CHECK(s.is_contiguous() && t.is_contiguous() && s.sizes() == t.sizes() &&
                  s.scalar_type() == t.scalar_type(),
              "gram_loss: internal error, tiles must be contiguous and of one shape and dtype");
  const int64_t n = s.numel();
  at::Tensor partials = at::empty({cuda::gram_tile_blocks(n)}, s.options().dtype(at::kDouble));
  if (n > 0) {
    C10_CUDA_CHECK(cuda::launch_gram_tile(
        s.data_ptr(), t.const_data_ptr(), n, s.scalar_type() == at::kDouble, clamp, coeff,
        partials.data_ptr<double>(), c10::cuda::getCurrentCUDAStream().stream()));
  } else {
    partials.zero_();
  }
  return partials.sum();
}

at::Tensor gram_loss_cuda(const at::Tensor& student, const at::Tensor& teacher, bool apply_norm,
                          bool remove_neg, bool remove_only_teacher_neg, int64_t form) {
  // Checks first: with one argument on the CPU, the error names it.
  const gram_loss_detail::Inputs in = gram_loss_detail::prepare(
      "gram_loss", student, teacher, apply_norm, remove_neg, remove_only_teacher_neg, form);
  const c10::cuda::CUDAGuard guard(student.device());
  return gram_loss_detail::forward(in, &tile_cuda);
}

at::Tensor gram_loss_backward_cuda(const at::Tensor& grad, const at::Tensor& student,
                                   const at::Tensor& teacher, bool apply_norm, bool remove_neg,
                                   bool remove_only_teacher_neg, int64_t form) {
  const gram_loss_detail::Inputs in =
      gram_loss_detail::prepare("gram_loss_backward", student, teacher, apply_norm, remove_neg,
                                remove_only_teacher_neg, form);
  const c10::cuda::CUDAGuard guard(student.device());
  return gram_loss_detail::backward(grad, in, &tile_cuda).view(student.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CUDA, m) {
  m.impl("gram_loss", &gram_loss_cuda);
  m.impl("gram_loss_backward", &gram_loss_backward_cuda);
}

}  // namespace dino_opt
