// CPU kernel of dino_opt::multicrop_photometric: the loader's per-crop
// function, parallel over crops.
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <string>
#include <vector>

#include "loader/photometric.h"
#include "ops/photometric.h"

namespace dino_opt {
namespace {

at::Tensor multicrop_photometric_cpu(const at::Tensor& images, const at::Tensor& params,
                                     at::ArrayRef<double> mean, at::ArrayRef<double> std,
                                     std::optional<at::ScalarType> dtype, bool channels_last) {
  photometric_detail::Prepared p = photometric_detail::prepare(images, params, mean, std, dtype,
                                                               channels_last, c10::DeviceType::CPU);
  const int64_t n = p.images.size(0);
  const int h = static_cast<int>(p.images.size(1));
  const int w = static_cast<int>(p.images.size(2));
  const float* rows = p.params.const_data_ptr<float>();
  for (int64_t i = 0; i < n; ++i) {
    const std::string error =
        loader::photometric_params_error(rows + i * loader::kPhotometricParamCount);
    TORCH_CHECK(error.empty(), "multicrop_photometric: params[", i, "]: ", error);
  }
  if (n == 0 || h == 0 || w == 0) return p.out;
  const uint8_t* src = p.images.const_data_ptr<uint8_t>();
  char* out = static_cast<char*>(p.out.data_ptr());
  const int64_t elem = static_cast<int64_t>(p.out.element_size());
  const int64_t crop_pixels = int64_t{h} * w * 3;
  at::parallel_for(0, n, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(loader::photometric_scratch_floats(h, w));
    for (int64_t i = begin; i < end; ++i) {
      loader::PlanarOutput o;
      o.data = out + i * p.out.stride(0) * elem;
      o.type = p.out_type;
      o.stride_c = p.out.stride(1);
      o.stride_y = p.out.stride(2);
      o.stride_x = p.out.stride(3);
      loader::apply_photometric(
          src + i * crop_pixels, h, w,
          loader::PhotometricParams::from_floats(rows + i * loader::kPhotometricParamCount), p.norm,
          o, scratch.data());
    }
  });
  return p.out;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) {
  m.impl("multicrop_photometric", &multicrop_photometric_cpu);
}

}  // namespace dino_opt
