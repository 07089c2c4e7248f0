// CUDA registration of dino_opt::ema_update_: checks, groups by dtype pair and
// hands flat spans to the multi-tensor launcher on the current stream.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include "ops/cuda/ema_kernel.h"
#include "ops/dtype.h"
#include "ops/ema.h"

namespace dino_opt {
namespace {

void ema_update_cuda(at::TensorList teacher, at::TensorList student, double momentum) {
  ema_detail::check_args(teacher, student, momentum, c10::DeviceType::CUDA);
  if (teacher.empty()) return;
  const c10::cuda::CUDAGuard guard(teacher[0].device());
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream().stream();
  const ema_detail::Coefficients c = ema_detail::coefficients(momentum);
  ema_detail::for_each_group(
      teacher, student,
      [&](at::ScalarType tt, at::ScalarType st, const std::vector<ema_detail::FlatPair>& pairs) {
        C10_CUDA_CHECK(cuda::launch_ema_update(pairs.data(), static_cast<int64_t>(pairs.size()),
                                               float_index(tt, "ema_update_", "teacher"),
                                               float_index(st, "ema_update_", "student"), c,
                                               stream));
      });
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CUDA, m) { m.impl("ema_update_", &ema_update_cuda); }

}  // namespace dino_opt
