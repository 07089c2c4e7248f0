#pragma once
// DINO's per-crop photometric augmentation with torchvision's semantics, on
// one crop: horizontal flip, colour jitter (brightness, contrast, saturation,
// hue in a sampled order), grayscale, Gaussian blur, solarisation, then
// ImageNet-style normalisation. The CPU loader calls apply_photometric per
// crop; the operator dino_opt::multicrop_photometric (csrc/ops) runs the same
// arithmetic on a batch, on the CPU or the GPU. Free of torch headers.
#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace dino_opt::loader {

// The parameters of one crop, sampled by the loader (crop_sampling.h). They
// travel to the operator as a float row of kPhotometricParamCount values, in
// the order of the members below.
struct PhotometricParams {
  bool flip = false;        // horizontal flip
  bool jitter = false;      // colour jitter applied at all
  float brightness = 1.0f;  // factors as torchvision's adjust_* take them
  float contrast = 1.0f;
  float saturation = 1.0f;
  float hue = 0.0f;                            // in [-0.5, 0.5]
  std::array<int8_t, 4> order = {0, 1, 2, 3};  // 0 brightness, 1 contrast, 2 saturation, 3 hue
  bool grayscale = false;                      // 3-channel grayscale (ITU-R 601-2 luma)
  float blur_sigma = 0.0f;                     // 0: no blur
  bool solarize = false;                       // invert values >= 128/255

  // Booleans travel as 0/1; from_floats reads any nonzero value as true and
  // an order entry that is not an integer in 0..3 as -1 (ignored when applied).
  void to_floats(float* out) const;
  static PhotometricParams from_floats(const float* in);
};
constexpr int kPhotometricParamCount = 13;

// Why a parameter row is invalid (flags not 0/1, order not a permutation of
// 0..3, negative or non-finite factors, hue outside [-0.5, 0.5], negative or
// non-finite sigma), or "" when it is valid. Invalid rows are still safe to
// apply: repeated or out-of-range order entries are skipped.
std::string photometric_params_error(const float* row);

// Blur kernel width for a sigma: 2 * ceil(3 sigma) + 1 (a true Gaussian to
// three sigmas, like PIL's GaussianBlur), 0 for sigma <= 0 (or NaN); saturates
// at the largest odd int. On a crop, the kernel is further clamped per axis to
// 2 * (side - 1) + 1 taps, the largest that torch's reflect padding allows
// (a sigma that large is a nearly flat blur anyway).
int blur_kernel_size(float sigma);

struct Normalization {
  float mean[3] = {0.485f, 0.456f, 0.406f};
  float std[3] = {0.229f, 0.224f, 0.225f};
};

enum class OutputType { kFloat32, kBFloat16, kFloat16 };

// Where the normalised crop goes: element strides of the channel, row and
// column, so one writer serves NCHW (stride_x = 1) and channels_last
// (stride_c = 1, stride_x = 3).
struct PlanarOutput {
  void* data = nullptr;
  OutputType type = OutputType::kFloat32;
  int64_t stride_c = 0;
  int64_t stride_y = 0;
  int64_t stride_x = 0;
};

// Floats of scratch space apply_photometric needs for an h x w crop.
size_t photometric_scratch_floats(int height, int width);

// Augments and normalises one h x w RGB crop (HWC uint8, rows 3 * width bytes
// apart) into `out`. `scratch` holds photometric_scratch_floats(h, w) floats.
//
// Arithmetic: float32 throughout, x = u8 / 255 correctly rounded, no rounding
// to uint8 between ops. That is more exact than PIL's pipeline (the original
// DINO code), which rounds to uint8 after every op; it matches torchvision's
// tensor ops on float images to float rounding (photometric_math.h). Flip is
// applied when writing (it commutes with every op). The blur is separable
// (vertical, then horizontal) with reflect padding, summing taps in order.
void apply_photometric(const uint8_t* src, int height, int width, const PhotometricParams& params,
                       const Normalization& norm, const PlanarOutput& out, float* scratch);

// The instruction-set variant apply_photometric runs: "avx2" or "default"
// (chosen once from the CPU; DINO_OPT_PHOTOMETRIC_ISA=default forces the
// baseline). Every variant computes the same bits.
const char* photometric_isa();

}  // namespace dino_opt::loader
