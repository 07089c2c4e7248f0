#pragma once
// The photometric augmentation of crops that are not 8-bit RGB (16-bit, 1 to
// N channels, float arrays): colour jitter, grayscale and solarisation are
// RGB's and have no meaning here, so the DINO recipe's photometric part
// becomes, per crop: per-channel brightness and contrast (each channel its own
// factors, contrast about the channel's own mean), Gaussian blur, normalisation
// by per-channel mean and std, additive Gaussian noise (in units of the
// normalised values), and the horizontal flip. The geometric part (crop
// rectangles, flip, blur probabilities and sigmas) is the RGB recipe's, drawn
// from the same stream (crop_sampling.h). Free of torch headers.
#include <cstdint>
#include <string>
#include <vector>

#include "loader/crop_sampling.h"
#include "loader/image.h"
#include "loader/photometric.h"

namespace dino_opt::loader {

// One crop's parameters. As a float row (the deferred stage's, for the
// operator on the device) of channel_param_count(C) values:
//   [flip, blur_sigma, noise_std, noise_key_high16, noise_key_low16,
//    brightness_0 .. brightness_{C-1}, contrast_0 .. contrast_{C-1}]
struct ChannelParams {
  bool flip = false;
  float blur_sigma = 0.0f;                  // 0: no blur
  float noise_std = 0.0f;                   // 0: no noise
  uint32_t noise_key = 0;                   // the noise field's key (channel_noise)
  std::vector<float> brightness, contrast;  // one factor per channel, 1: unchanged

  void to_floats(float* out) const;
  static ChannelParams from_floats(const float* in, int channels);
};
constexpr int kChannelParamFixed = 5;
inline int channel_param_count(int channels) { return kChannelParamFixed + 2 * channels; }

// The crop's channel parameters: flip, whether to jitter and the blur sigma
// come from its RGB parameters `rgb` (so the geometric part is the RGB
// recipe's); the per-channel factors (uniform in [max(0, 1 - s), 1 + s], with
// the jitter's probability, brightness then contrast, channel by channel) and
// the noise (config.noise_p, sigma uniform in config.noise_std) from `rng`.
ChannelParams sample_channel_params(Rng& rng, const AugmentConfig& config,
                                    const PhotometricParams& rgb, int channels);

// The standard normal sample `index` of noise field `key`: Box-Muller on two
// uniforms from a 32-bit integer hash (lowbias32) of (2 index) ^ key and
// (2 index + 1) ^ key, indices modulo 2^32. A counter-based field, so the
// device operator draws the same numbers (python/dino_opt/ops/channel_photometric_torch.py).
double channel_noise(uint32_t key, uint64_t index);

// Per-channel normalisation: mean and std in units of the sample scale
// (image.h's sample_scale: value / 255, / 65535, or the float as it is).
struct ChannelNormalization {
  std::vector<float> mean, std;
};

// Floats of scratch space apply_channel_photometric needs.
size_t channel_scratch_floats(int height, int width, int channels);

// Augments and normalises one h x w crop (HWC samples of `layout`, rows
// w * C samples apart) into `out` (its strides per channel, row, column).
// Arithmetic in float32: x = sample / scale (a true division); brightness
// x * b_c, then contrast c_c x + (1 - c_c) m_c with m_c the channel's mean
// (a float64 sum), each clamped to [0, 1] for integer samples (not for float
// ones); the blur as the RGB stage's (2 ceil(3 sigma) + 1 taps clamped per
// axis, reflect padding, vertical then horizontal); (x - mean_c) / std_c;
// plus noise_std * z with z sample c h w + y w + x of the field channel_noise
// defines, evaluated in float32 (channel_noise.h: within a few float ulps of
// channel_noise's value); flipped when writing. Vectorised and run for the
// instruction set the RGB stage runs (photometric_isa).
void apply_channel_photometric(const uint8_t* src, ImageLayout layout, int height, int width,
                               const ChannelParams& params, const ChannelNormalization& norm,
                               const PlanarOutput& out, float* scratch);

}  // namespace dino_opt::loader
