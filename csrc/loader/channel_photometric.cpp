// The per-channel photometric stage (channel_photometric.h), plain loops over
// planar float rows.
#include "loader/channel_photometric.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "loader/float16.h"
#include "loader/photometric_math.h"

namespace dino_opt::loader {

namespace pm = photometric_math;

namespace {

uint32_t lowbias32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

template <typename T>
void load_planar(const uint8_t* src, int c_count, int64_t pixels, float scale, float* planes) {
  const T* s = reinterpret_cast<const T*>(src);
  for (int c = 0; c < c_count; ++c) {
    float* dst = planes + c * pixels;
    for (int64_t i = 0; i < pixels; ++i) dst[i] = static_cast<float>(s[i * c_count + c]) / scale;
  }
}

// Separable blur of one h x w plane in place (tmp: max(h, w) floats).
void blur_plane(float* plane, int h, int w, float sigma, float* tmp, float* taps_y, float* taps_x) {
  const int ry = pm::blur_radius(sigma, h), rx = pm::blur_radius(sigma, w);
  pm::gaussian_weights(sigma, ry, taps_y);
  pm::gaussian_weights(sigma, rx, taps_x);
  // Vertical: column by column through tmp, taps added in ascending order.
  for (int x = 0; x < w; ++x) {
    for (int y = 0; y < h; ++y) {
      float acc = 0.0f;
      for (int k = -ry; k <= ry; ++k) acc += taps_y[k + ry] * plane[pm::reflect(y + k, h) * w + x];
      tmp[y] = acc;
    }
    for (int y = 0; y < h; ++y) plane[y * w + x] = tmp[y];
  }
  // Horizontal: row by row.
  for (int y = 0; y < h; ++y) {
    float* row = plane + static_cast<int64_t>(y) * w;
    for (int x = 0; x < w; ++x) {
      float acc = 0.0f;
      for (int k = -rx; k <= rx; ++k) acc += taps_x[k + rx] * row[pm::reflect(x + k, w)];
      tmp[x] = acc;
    }
    std::memcpy(row, tmp, sizeof(float) * w);
  }
}

void store(const PlanarOutput& out, int64_t offset, float v) {
  switch (out.type) {
    case OutputType::kFloat32:
      static_cast<float*>(out.data)[offset] = v;
      break;
    case OutputType::kBFloat16:
      static_cast<uint16_t*>(out.data)[offset] = float_to_bf16_bits(v);
      break;
    case OutputType::kFloat16:
      static_cast<uint16_t*>(out.data)[offset] = float_to_f16_bits(v);
      break;
  }
}

}  // namespace

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
  const auto i2 = static_cast<uint32_t>(2 * index);
  const uint32_t a = lowbias32(i2 ^ key), b = lowbias32((i2 + 1u) ^ key);
  const double u1 = (static_cast<double>(a) + 0.5) / 4294967296.0;  // (0, 1)
  const double u2 = static_cast<double>(b) / 4294967296.0;
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

size_t channel_scratch_floats(int height, int width, int channels) {
  if (height <= 0 || width <= 0 || channels <= 0) return 0;
  const size_t h = height, w = width;
  return static_cast<size_t>(channels) * h * w + std::max(h, w) + 2 * h + 2 * w;
}

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
  const int64_t pixels = int64_t{h} * w;
  float* planes = scratch;
  float* tmp = planes + cc * pixels;
  float* taps_y = tmp + std::max(h, w);
  float* taps_x = taps_y + 2 * h;
  const auto scale = static_cast<float>(sample_scale(layout.type));
  switch (layout.type) {
    case SampleType::kU8:
      load_planar<uint8_t>(src, cc, pixels, scale, planes);
      break;
    case SampleType::kU16:
      load_planar<uint16_t>(src, cc, pixels, scale, planes);
      break;
    case SampleType::kF32:
      load_planar<float>(src, cc, pixels, scale, planes);
      break;
  }
  const bool clamp = layout.type != SampleType::kF32;
  auto bound = [clamp](float x) { return clamp ? pm::clamp01(x) : x; };
  for (int c = 0; c < cc; ++c) {
    float* p = planes + c * pixels;
    const float b = params.brightness[c], k = params.contrast[c];
    if (b != 1.0f) {
      for (int64_t i = 0; i < pixels; ++i) p[i] = bound(p[i] * b);
    }
    if (k != 1.0f) {
      double sum = 0.0;
      for (int64_t i = 0; i < pixels; ++i) sum += p[i];
      const auto mean = static_cast<float>(sum / static_cast<double>(pixels));
      const float term = mean * pm::one_minus(k);
      for (int64_t i = 0; i < pixels; ++i) p[i] = bound(p[i] * k + term);
    }
    if (params.blur_sigma > 0.0f) blur_plane(p, h, w, params.blur_sigma, tmp, taps_y, taps_x);
  }
  const bool noise = params.noise_std > 0.0f;
  for (int c = 0; c < cc; ++c) {
    const float* p = planes + c * pixels;
    const float m = norm.mean[c], sd = norm.std[c];
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        const int64_t i = int64_t{y} * w + x;
        float v = pm::normalize(p[i], m, sd);
        if (noise) {
          v += params.noise_std *
               static_cast<float>(channel_noise(params.noise_key, c * pixels + i));
        }
        const int ox = params.flip ? w - 1 - x : x;
        store(out, c * out.stride_c + y * out.stride_y + ox * out.stride_x, v);
      }
    }
  }
}

}  // namespace dino_opt::loader
