#pragma once
// DINO's per-crop photometric augmentation on a batch of uint8 crops:
// dino_opt::multicrop_photometric. The per-crop arithmetic is the loader's
// (loader/photometric.h); the CPU kernel runs it per crop, the CUDA kernel
// runs the same arithmetic per tile (ops/photometric_tile.h).
#include <ATen/core/Tensor.h>
#include <c10/util/ArrayRef.h>

#include <optional>

#include "loader/photometric.h"

namespace dino_opt {

// Public C++ API (dispatcher call). images: uint8 [N, H, W, 3]; params:
// float32 [N, 13] (PhotometricParams::to_floats rows) on the same device;
// mean/std: 3 values each. Returns [N, 3, H, W] of `dtype` (float32 when
// unset, or bfloat16/float16), channels_last when asked.
at::Tensor multicrop_photometric(const at::Tensor& images, const at::Tensor& params,
                                 at::ArrayRef<double> mean, at::ArrayRef<double> std,
                                 std::optional<at::ScalarType> dtype, bool channels_last);

namespace photometric_detail {

// The arguments as every kernel takes them, after the checks.
struct Prepared {
  at::Tensor images;  // contiguous
  at::Tensor params;  // contiguous
  at::Tensor out;     // allocated, [N, 3, H, W]
  loader::Normalization norm;
  loader::OutputType out_type = loader::OutputType::kFloat32;
};

// Checks every argument (throwing c10::Error that names it and what was
// expected) for the kernel of `device_type`, and allocates the output.
Prepared prepare(const at::Tensor& images, const at::Tensor& params, at::ArrayRef<double> mean,
                 at::ArrayRef<double> std, std::optional<at::ScalarType> dtype, bool channels_last,
                 c10::DeviceType device_type);

}  // namespace photometric_detail
}  // namespace dino_opt
