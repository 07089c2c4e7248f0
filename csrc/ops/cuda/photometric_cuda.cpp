// CUDA registration of dino_opt::multicrop_photometric: checks, workspace for
// the per-tile gray sums and the blur taps, both launches on the current stream.
// Parameter rows are not validated here (that would need a device-to-host
// copy and a synchronisation); invalid rows are applied safely (see
// loader::photometric_params_error), and the CPU kernel rejects them.
#include <ATen/ops/empty.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <torch/library.h>

#include <climits>

#include "ops/cuda/photometric_kernel.h"
#include "ops/photometric.h"

namespace dino_opt {
namespace {

at::Tensor multicrop_photometric_cuda(const at::Tensor& images, const at::Tensor& params,
                                      at::ArrayRef<double> mean, at::ArrayRef<double> std,
                                      std::optional<at::ScalarType> dtype, bool channels_last) {
  // Checks first: with one argument on the CPU, the error names it (a guard
  // built from a CPU tensor would fail with a message about the guard).
  photometric_detail::Prepared p = photometric_detail::prepare(
      images, params, mean, std, dtype, channels_last, c10::DeviceType::CUDA);
  const c10::cuda::CUDAGuard guard(images.device());
  photometric_detail::BatchArgs a;
  a.n = p.images.size(0);
  a.h = static_cast<int>(p.images.size(1));
  a.w = static_cast<int>(p.images.size(2));
  if (a.n == 0 || a.h == 0 || a.w == 0) return p.out;
  const int64_t tiles = photometric_detail::tiles_per_crop(a);
  TORCH_CHECK(a.n * tiles <= INT_MAX, "multicrop_photometric: ", a.n, " crops of ", a.h, " x ", a.w,
              " make more than 2^31 - 1 tiles of 32 x 32; split the batch");
  const at::Tensor tile_sums = at::empty({a.n * tiles}, p.images.options().dtype(at::kDouble));
  const at::Tensor taps = at::empty({a.n * photometric_detail::taps_per_crop(a.h, a.w)},
                                    p.images.options().dtype(at::kFloat));
  a.images = p.images.const_data_ptr<uint8_t>();
  a.params = p.params.const_data_ptr<float>();
  for (int c = 0; c < 3; ++c) {
    a.norm_mean[c] = p.norm.mean[c];
    a.norm_std[c] = p.norm.std[c];
  }
  a.out = p.out.data_ptr();
  a.out_type = p.out_type;
  a.stride_n = p.out.stride(0);
  a.stride_c = p.out.stride(1);
  a.stride_y = p.out.stride(2);
  a.stride_x = p.out.stride(3);
  a.tile_sums = tile_sums.data_ptr<double>();
  a.taps = taps.data_ptr<float>();
  C10_CUDA_CHECK(cuda::launch_multicrop_photometric(a, c10::cuda::getCurrentCUDAStream().stream()));
  return p.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CUDA, m) {
  m.impl("multicrop_photometric", &multicrop_photometric_cuda);
}

}  // namespace dino_opt
