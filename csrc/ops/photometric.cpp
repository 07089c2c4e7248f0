// Schema of dino_opt::multicrop_photometric and the checks shared by its kernels.
#include "ops/photometric.h"

#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>

#include <climits>
#include <cmath>

namespace dino_opt {

TORCH_LIBRARY_FRAGMENT(dino_opt, m) {
  m.def(
      "multicrop_photometric(Tensor images, Tensor params, float[] mean, float[] std, "
      "ScalarType? dtype=None, bool channels_last=False) -> Tensor");
}

at::Tensor multicrop_photometric(const at::Tensor& images, const at::Tensor& params,
                                 at::ArrayRef<double> mean, at::ArrayRef<double> std,
                                 std::optional<at::ScalarType> dtype, bool channels_last) {
  static auto op =
      c10::Dispatcher::singleton()
          .findSchemaOrThrow("dino_opt::multicrop_photometric", "")
          .typed<at::Tensor(const at::Tensor&, const at::Tensor&, at::ArrayRef<double>,
                            at::ArrayRef<double>, std::optional<at::ScalarType>, bool)>();
  return op.call(images, params, mean, std, dtype, channels_last);
}

namespace photometric_detail {

Prepared prepare(const at::Tensor& images, const at::Tensor& params, at::ArrayRef<double> mean,
                 at::ArrayRef<double> std, std::optional<at::ScalarType> dtype, bool channels_last,
                 c10::DeviceType device_type) {
  constexpr const char* op = "multicrop_photometric";
  TORCH_CHECK(images.defined() && params.defined(), op, ": images and params must be defined");
  TORCH_CHECK(images.scalar_type() == at::kByte, op,
              ": images must be uint8 [N, H, W, 3] (RGB crops, channels last), got dtype ",
              images.scalar_type());
  TORCH_CHECK(images.dim() == 4 && images.size(3) == 3, op,
              ": images must have shape [N, H, W, 3] (RGB crops, channels last), got ",
              images.sizes());
  const int64_t n = images.size(0);
  TORCH_CHECK(images.size(1) <= INT_MAX / 2 && images.size(2) <= INT_MAX / 2, op, ": crops of ",
              images.size(1), " x ", images.size(2), " pixels are too large");
  TORCH_CHECK(params.device() == images.device(), op, ": params is on ", params.device(),
              " but images is on ", images.device(), "; both must be on one device");
  TORCH_CHECK(images.device().type() == device_type, op, ": images is on ", images.device(),
              " but the ", c10::DeviceTypeName(device_type), " kernel is running");
  TORCH_CHECK(params.scalar_type() == at::kFloat, op, ": params must be float32 [N, ",
              loader::kPhotometricParamCount, "], got dtype ", params.scalar_type());
  TORCH_CHECK(params.dim() == 2 && params.size(1) == loader::kPhotometricParamCount, op,
              ": params must have shape [N, ", loader::kPhotometricParamCount,
              "] (one row of flip, jitter, brightness, contrast, saturation, hue, order[4], "
              "grayscale, blur_sigma, solarize per crop), got ",
              params.sizes());
  TORCH_CHECK(params.size(0) == n, op, ": params has ", params.size(0),
              " rows but images has N=", n, " crops; one row per crop");
  TORCH_CHECK(mean.size() == 3, op, ": mean must have 3 values (R, G, B), got ", mean.size());
  TORCH_CHECK(std.size() == 3, op, ": std must have 3 values (R, G, B), got ", std.size());
  Prepared p;
  for (int c = 0; c < 3; ++c) {
    TORCH_CHECK(std::isfinite(mean[c]), op, ": mean[", c, "] must be finite, got ", mean[c]);
    TORCH_CHECK(std::isfinite(std[c]) && std[c] != 0.0, op, ": std[", c,
                "] must be finite and nonzero, got ", std[c]);
    p.norm.mean[c] = static_cast<float>(mean[c]);
    p.norm.std[c] = static_cast<float>(std[c]);
    TORCH_CHECK(p.norm.std[c] != 0.0f, op, ": std[", c, "] = ", std[c], " rounds to 0 in float32");
  }
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  switch (out_dtype) {
    case at::kFloat:
      p.out_type = loader::OutputType::kFloat32;
      break;
    case at::kBFloat16:
      p.out_type = loader::OutputType::kBFloat16;
      break;
    case at::kHalf:
      p.out_type = loader::OutputType::kFloat16;
      break;
    default:
      TORCH_CHECK(false, op, ": dtype must be float32, bfloat16 or float16, got ", out_dtype);
  }
  p.images = images.contiguous();
  p.params = params.contiguous();
  p.out = at::empty({n, 3, images.size(1), images.size(2)}, images.options().dtype(out_dtype),
                    channels_last ? at::MemoryFormat::ChannelsLast : at::MemoryFormat::Contiguous);
  return p;
}

}  // namespace photometric_detail
}  // namespace dino_opt
