// DINO's photometric augmentation of one crop: parameter rows, the blur
// kernel size, and apply_photometric, which runs the variant of
// photometric_kernels.cpp for the best instruction set of this CPU.
#include "loader/photometric.h"

#include <climits>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <sstream>

#include "loader/photometric_isa.h"
#include "loader/photometric_math.h"

namespace dino_opt::loader {

namespace pm = photometric_math;

void PhotometricParams::to_floats(float* out) const {
  out[0] = flip ? 1.0f : 0.0f;
  out[1] = jitter ? 1.0f : 0.0f;
  out[2] = brightness;
  out[3] = contrast;
  out[4] = saturation;
  out[5] = hue;
  for (int i = 0; i < 4; ++i) out[6 + i] = static_cast<float>(order[i]);
  out[10] = grayscale ? 1.0f : 0.0f;
  out[11] = blur_sigma;
  out[12] = solarize ? 1.0f : 0.0f;
}

PhotometricParams PhotometricParams::from_floats(const float* in) {
  PhotometricParams p;
  p.flip = pm::param_flag(in[0]);
  p.jitter = pm::param_flag(in[1]);
  p.brightness = in[2];
  p.contrast = in[3];
  p.saturation = in[4];
  p.hue = in[5];
  for (int i = 0; i < 4; ++i) {
    const float o = in[6 + i];
    // A cast of NaN or of an out-of-range float to an integer is undefined.
    const bool valid = o == 0.0f || o == 1.0f || o == 2.0f || o == 3.0f;
    p.order[i] = valid ? static_cast<int8_t>(o) : int8_t{-1};
  }
  p.grayscale = pm::param_flag(in[10]);
  p.blur_sigma = in[11];
  p.solarize = pm::param_flag(in[12]);
  return p;
}

std::string photometric_params_error(const float* row) {
  std::ostringstream msg;
  const char* flag_names[] = {"flip", "jitter", "grayscale", "solarize"};
  const int flag_index[] = {0, 1, 10, 12};
  for (int i = 0; i < 4; ++i) {
    const float v = row[flag_index[i]];
    if (v != 0.0f && v != 1.0f) {
      msg << flag_names[i] << " (column " << flag_index[i] << ") must be 0 or 1, got " << v;
      return msg.str();
    }
  }
  const char* factor_names[] = {"brightness", "contrast", "saturation"};
  for (int i = 0; i < 3; ++i) {
    const float v = row[2 + i];
    if (!(std::isfinite(v) && v >= 0.0f)) {
      msg << factor_names[i] << " (column " << 2 + i << ") must be finite and >= 0, got " << v;
      return msg.str();
    }
  }
  if (!(row[5] >= -0.5f && row[5] <= 0.5f)) {
    msg << "hue (column 5) must be in [-0.5, 0.5], got " << row[5];
    return msg.str();
  }
  bool seen[4] = {false, false, false, false};
  for (int i = 0; i < 4; ++i) {
    const float o = row[6 + i];
    const bool valid = o == 0.0f || o == 1.0f || o == 2.0f || o == 3.0f;
    if (!valid || seen[static_cast<int>(o)]) {
      msg << "order (columns 6-9) must be a permutation of 0, 1, 2, 3, got " << row[6] << ", "
          << row[7] << ", " << row[8] << ", " << row[9];
      return msg.str();
    }
    seen[static_cast<int>(o)] = true;
  }
  if (!(std::isfinite(row[11]) && row[11] >= 0.0f)) {
    msg << "blur_sigma (column 11) must be finite and >= 0, got " << row[11];
    return msg.str();
  }
  return "";
}

int blur_kernel_size(float sigma) {
  if (!(sigma > 0.0f)) return 0;
  const double radius = std::ceil(3.0 * static_cast<double>(sigma));
  constexpr int kMaxRadius = (INT_MAX - 1) / 2;
  return radius >= kMaxRadius ? 2 * kMaxRadius + 1 : 2 * static_cast<int>(radius) + 1;
}

size_t photometric_scratch_floats(int height, int width) {
  if (height <= 0 || width <= 0) return 0;
  const size_t h = static_cast<size_t>(height);
  const size_t w = static_cast<size_t>(width);
  return 3 * h * w + 3 * w + 9 * w + 2 * h + 2 * w;  // see Scratch in photometric_kernels.cpp
}

namespace {

struct Variant {
  PhotometricKernelFn fn;
  const char* name;
};

// AVX2 where the CPU has it (FMA is not used: -ffp-contract=off), unless
// DINO_OPT_PHOTOMETRIC_ISA=default asks for the baseline (tests, debugging).
Variant choose_variant() {
  const char* forced = std::getenv("DINO_OPT_PHOTOMETRIC_ISA");
  if (forced != nullptr && std::strcmp(forced, "default") == 0) {
    return {photometric_default::apply_photometric_kernel, "default"};
  }
#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2")) return {photometric_avx2::apply_photometric_kernel, "avx2"};
#endif
  return {photometric_default::apply_photometric_kernel, "default"};
}

const Variant& variant() {
  static const Variant v = choose_variant();
  return v;
}

}  // namespace

const char* photometric_isa() { return variant().name; }

void apply_photometric(const uint8_t* src, int height, int width, const PhotometricParams& params,
                       const Normalization& norm, const PlanarOutput& out, float* scratch) {
  variant().fn(src, height, width, params, norm, out, scratch);
}

}  // namespace dino_opt::loader
