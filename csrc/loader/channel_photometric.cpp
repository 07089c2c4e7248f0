// The per-channel photometric stage (channel_photometric.h): its parameters,
// the float64 noise field, and the dispatch to the kernel of the instruction
// set the RGB stage runs (channel_photometric_kernels.cpp).
#include "loader/channel_photometric.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "loader/channel_noise.h"
#include "loader/photometric_isa.h"

namespace dino_opt::loader {

namespace nm = channel_noise_math;

void ChannelParams::to_floats(float* out) const {
  out[0] = flip ? 1.0f : 0.0f;
  out[1] = blur_sigma;
  out[2] = noise_std;
  out[3] = static_cast<float>(noise_key >> 16);
  out[4] = static_cast<float>(noise_key & 0xFFFFu);
  const size_t c = brightness.size();
  for (size_t i = 0; i < c; ++i) {
    out[kChannelParamFixed + i] = brightness[i];
    out[kChannelParamFixed + c + i] = contrast[i];
  }
}

ChannelParams ChannelParams::from_floats(const float* in, int channels) {
  ChannelParams p;
  p.flip = in[0] != 0.0f;
  p.blur_sigma = in[1];
  p.noise_std = in[2];
  auto half = [](float v) {
    return v >= 0.0f && v <= 65535.0f ? static_cast<uint32_t>(v) : uint32_t{0};
  };
  p.noise_key = (half(in[3]) << 16) | half(in[4]);
  p.brightness.assign(in + kChannelParamFixed, in + kChannelParamFixed + channels);
  p.contrast.assign(in + kChannelParamFixed + channels, in + kChannelParamFixed + 2 * channels);
  return p;
}

ChannelParams sample_channel_params(Rng& rng, const AugmentConfig& config,
                                    const PhotometricParams& rgb, int channels) {
  ChannelParams p;
  p.flip = rgb.flip;
  p.blur_sigma = rgb.blur_sigma;
  p.brightness.assign(channels, 1.0f);
  p.contrast.assign(channels, 1.0f);
  if (rgb.jitter) {
    auto factor = [&](double s) {
      return static_cast<float>(rng.uniform(std::max(0.0, 1.0 - s), 1.0 + s));
    };
    for (int c = 0; c < channels; ++c) p.brightness[c] = factor(config.brightness);
    for (int c = 0; c < channels; ++c) p.contrast[c] = factor(config.contrast);
  }
  if (rng.bernoulli(config.noise_p)) {
    p.noise_std = static_cast<float>(rng.uniform(config.noise_std_lo, config.noise_std_hi));
    p.noise_key = static_cast<uint32_t>(rng.next() >> 32);
  }
  return p;
}

double channel_noise(uint32_t key, uint64_t index) {
  const uint32_t a = nm::noise_hash_a(key, index), b = nm::noise_hash_b(key, index);
  const double u1 = (static_cast<double>(a) + 0.5) / 4294967296.0;  // (0, 1)
  const double u2 = static_cast<double>(b) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

size_t channel_scratch_floats(int height, int width, int channels) {
  if (height <= 0 || width <= 0 || channels <= 0) return 0;
  const size_t h = height, w = width;
  // See Scratch in channel_photometric_kernels.cpp.
  return static_cast<size_t>(channels) * h * w + 5 * w + 2 * h + 2 * w;
}

namespace {

// The RGB stage's instruction set (photometric_isa), so that one setting
// (DINO_OPT_PHOTOMETRIC_ISA=default) picks both.
ChannelPhotometricKernelFn choose_kernel() {
#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
  if (std::strcmp(photometric_isa(), "avx2") == 0) {
    return photometric_avx2::apply_channel_photometric_kernel;
  }
#endif
  return photometric_default::apply_channel_photometric_kernel;
}

}  // namespace

void apply_channel_photometric(const uint8_t* src, ImageLayout layout, int h, int w,
                               const ChannelParams& params, const ChannelNormalization& norm,
                               const PlanarOutput& out, float* scratch) {
  const int cc = layout.channels;
  if (static_cast<int>(norm.mean.size()) != cc || static_cast<int>(norm.std.size()) != cc ||
      static_cast<int>(params.brightness.size()) != cc ||
      static_cast<int>(params.contrast.size()) != cc) {
    throw std::invalid_argument("apply_channel_photometric: " + std::to_string(cc) +
                                " channels but other counts of means, stds or factors");
  }
  static const ChannelPhotometricKernelFn kernel = choose_kernel();
  kernel(src, layout, h, w, params, norm, out, scratch);
}

}  // namespace dino_opt::loader
