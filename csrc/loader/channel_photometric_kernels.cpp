// The per-channel photometric stage of one crop (channel_photometric.h): the
// body of loader::apply_channel_photometric, compiled once per instruction set
// beside photometric_kernels.cpp (cmake/loader.cmake, the same flags: no
// contraction, no trapping math) into the namespace DINO_OPT_PHOTOMETRIC_ISA;
// channel_photometric.cpp runs the variant the RGB stage chose.
//
// The crop is split into planar float channels once (row by row, so that the
// interleaved source row is read from L1); then each channel on its own, every
// step a plain loop over contiguous floats that the compiler vectorises:
// brightness fused with the sum contrast needs (eight partial sums), contrast,
// and a row at a time the blur (the RGB stage's blocked tap sums,
// photometric_rows.h: vertical taps into a reflect-padded row, horizontal
// taps), the noise field of the row (channel_noise.h's float32 form, no call
// and no branch), normalisation, and the store, mirrored when flipping.
#include <cstdint>

#include "loader/channel_noise.h"
#include "loader/channel_photometric.h"
#include "loader/photometric_isa.h"
#include "loader/photometric_math.h"
#include "loader/photometric_rows.h"

#ifndef DINO_OPT_PHOTOMETRIC_ISA
#error "DINO_OPT_PHOTOMETRIC_ISA names the variant this build of the file is"
#endif

namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA {

namespace pm = photometric_math;
namespace nm = channel_noise_math;

namespace {

// Scratch layout, in floats (channel_scratch_floats): the planar crop (C h w),
// one row (w), one reflect-padded row (at most w + 2 (w - 1)), one row of
// noise (w), and the vertical and horizontal taps (at most 2 h - 1, 2 w - 1).
struct Scratch {
  float* planes;
  float* row;
  float* padded;
  float* noise;
  float* taps_y;
  float* taps_x;
};

Scratch carve(float* s, int channels, int h, int w) {
  Scratch out;
  out.planes = s;
  out.row = out.planes + static_cast<size_t>(channels) * h * w;
  out.padded = out.row + w;
  out.noise = out.padded + 3 * static_cast<size_t>(w);
  out.taps_y = out.noise + w;
  out.taps_x = out.taps_y + 2 * static_cast<size_t>(h);
  return out;
}

// Row y of the interleaved crop into the planes, each sample / scale (a true division).
template <typename T>
void load_row(const uint8_t* src, int channels, int h, int w, int y, float scale, float* planes) {
  const size_t plane = static_cast<size_t>(h) * w;
  const T* __restrict s = reinterpret_cast<const T*>(src) + static_cast<size_t>(y) * w * channels;
  float* first = planes + static_cast<size_t>(y) * w;
  if (channels == 1) {
    float* __restrict dst = first;
    for (int x = 0; x < w; ++x) dst[x] = static_cast<float>(s[x]) / scale;
    return;
  }
  for (int c = 0; c < channels; ++c) {
    float* __restrict dst = first + c * plane;
    const T* __restrict sc = s + c;
    for (int x = 0; x < w; ++x) dst[x] = static_cast<float>(sc[x * channels]) / scale;
  }
}

template <typename T>
void load_planes(const uint8_t* src, int channels, int h, int w, float scale, float* planes) {
  for (int y = 0; y < h; ++y) load_row<T>(src, channels, h, w, y, scale, planes);
}

template <bool kClamp>
float bound(float x) {
  return kClamp ? pm::clamp01(x) : x;
}

// Brightness (when b != 1) in place, and the sum of the result in float64
// (eight interleaved partial sums, so that the additions vectorise).
template <bool kClamp>
double brightness_and_sum(float* __restrict p, size_t n, float b, bool scale) {
  double acc[8] = {};
  size_t i = 0;
  if (scale) {
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) {
        p[i + j] = bound<kClamp>(p[i + j] * b);
        acc[j] += p[i + j];
      }
    }
    for (size_t k = i; k < n; ++k) p[k] = bound<kClamp>(p[k] * b);
  } else {
    for (; i + 8 <= n; i += 8) {
      for (int j = 0; j < 8; ++j) acc[j] += p[i + j];
    }
  }
  double sum = 0.0;
  for (; i < n; ++i) sum += p[i];
  for (int j = 0; j < 8; ++j) sum += acc[j];
  return sum;
}

template <bool kClamp>
void brightness_only(float* __restrict p, size_t n, float b) {
  for (size_t i = 0; i < n; ++i) p[i] = bound<kClamp>(p[i] * b);
}

template <bool kClamp>
void contrast(float* __restrict p, size_t n, float k, float term) {
  for (size_t i = 0; i < n; ++i) p[i] = bound<kClamp>(p[i] * k + term);
}

// Brightness, then contrast about the channel's mean, in place.
template <bool kClamp>
void colour(float* p, size_t n, float b, float k) {
  if (k != 1.0f) {
    const double sum = brightness_and_sum<kClamp>(p, n, b, b != 1.0f);
    const auto mean = static_cast<float>(sum / static_cast<double>(n));
    contrast<kClamp>(p, n, k, mean * pm::one_minus(k));
  } else if (b != 1.0f) {
    brightness_only<kClamp>(p, n, b);
  }
}

// Standard normal samples first .. first + n - 1 of field `key` (indices mod 2^32).
void noise_row(uint32_t key, uint32_t first, int n, float* __restrict z) {
  for (int x = 0; x < n; ++x) {
    const uint32_t i2 = 2u * (first + static_cast<uint32_t>(x));
    z[x] = nm::noise_f32(nm::lowbias32(i2 ^ key), nm::lowbias32((i2 + 1u) ^ key));
  }
}

// Normalises a finished row (plus noise_std * z), stores it as output row y
// of one channel, mirrored when flipping.
template <class Store, bool kNoise>
void write_row(const float* __restrict v, const float* __restrict z, int n, float m, float sd,
               float noise_std, typename Store::type* dst, int64_t stride_x, bool flip) {
  using T = typename Store::type;
  const auto value = [&](int x) {
    float r = pm::normalize(v[x], m, sd);
    if constexpr (kNoise) r += noise_std * z[x];
    return Store::cvt(r);
  };
  if (stride_x == 1) {
    if (flip) {
      T* __restrict last = dst + (n - 1);
      for (int x = 0; x < n; ++x) last[-x] = value(x);
    } else {
      T* __restrict out = dst;
      for (int x = 0; x < n; ++x) out[x] = value(x);
    }
    return;
  }
  const int64_t sx = flip ? -stride_x : stride_x;
  T* first = flip ? dst + (n - 1) * stride_x : dst;
  for (int x = 0; x < n; ++x) first[x * sx] = value(x);
}

template <class Store>
void write_row(const float* v, const float* z, int n, float m, float sd, float noise_std, void* dst,
               int64_t stride_x, bool flip) {
  auto* d = static_cast<typename Store::type*>(dst);
  if (z != nullptr) {
    write_row<Store, true>(v, z, n, m, sd, noise_std, d, stride_x, flip);
  } else {
    write_row<Store, false>(v, z, n, m, sd, noise_std, d, stride_x, flip);
  }
}

void write_row(const float* v, const float* z, int n, int c, int y, float m, float sd,
               float noise_std, const PlanarOutput& out, bool flip) {
  const int64_t at = c * out.stride_c + y * out.stride_y;
  switch (out.type) {
    case OutputType::kFloat32:
      return write_row<StoreF32>(v, z, n, m, sd, noise_std, static_cast<float*>(out.data) + at,
                                 out.stride_x, flip);
    case OutputType::kBFloat16:
      return write_row<StoreBF16>(v, z, n, m, sd, noise_std, static_cast<uint16_t*>(out.data) + at,
                                  out.stride_x, flip);
    case OutputType::kFloat16:
      return write_row<StoreF16>(v, z, n, m, sd, noise_std, static_cast<uint16_t*>(out.data) + at,
                                 out.stride_x, flip);
  }
}

}  // namespace

void apply_channel_photometric_kernel(const uint8_t* src, ImageLayout layout, int h, int w,
                                      const ChannelParams& params, const ChannelNormalization& norm,
                                      const PlanarOutput& out, float* scratch) {
  if (h <= 0 || w <= 0) return;
  const int cc = layout.channels;
  const size_t pixels = static_cast<size_t>(h) * w;
  const Scratch s = carve(scratch, cc, h, w);
  const auto scale = static_cast<float>(sample_scale(layout.type));
  switch (layout.type) {
    case SampleType::kU8:
      load_planes<uint8_t>(src, cc, h, w, scale, s.planes);
      break;
    case SampleType::kU16:
      load_planes<uint16_t>(src, cc, h, w, scale, s.planes);
      break;
    case SampleType::kF32:
      load_planes<float>(src, cc, h, w, scale, s.planes);
      break;
  }
  const bool clamp = layout.type != SampleType::kF32;
  const int ry = pm::blur_radius(params.blur_sigma, h), rx = pm::blur_radius(params.blur_sigma, w);
  const bool blur = params.blur_sigma > 0.0f && (ry > 0 || rx > 0);
  if (blur) {
    pm::gaussian_weights(params.blur_sigma, ry, s.taps_y);
    pm::gaussian_weights(params.blur_sigma, rx, s.taps_x);
  }
  const int taps_y = 2 * ry + 1, taps_x = 2 * rx + 1;
  const bool noise = params.noise_std > 0.0f;
  for (int c = 0; c < cc; ++c) {
    float* p = s.planes + c * pixels;
    if (clamp) {
      colour<true>(p, pixels, params.brightness[c], params.contrast[c]);
    } else {
      colour<false>(p, pixels, params.brightness[c], params.contrast[c]);
    }
    for (int y = 0; y < h; ++y) {
      const float* row = p + static_cast<size_t>(y) * w;
      if (blur) {
        // Vertical taps read plane rows, horizontal taps shifted views of the padded row.
        float* centre = s.padded + rx;
        convolve([&](int k) { return p + static_cast<size_t>(pm::reflect(y + k - ry, h)) * w; },
                 s.taps_y, taps_y, centre, w);
        for (int i = 1; i <= rx; ++i) {
          centre[-i] = centre[i];
          centre[w - 1 + i] = centre[w - 1 - i];
        }
        convolve([&](int k) -> const float* { return s.padded + k; }, s.taps_x, taps_x, s.row, w);
        row = s.row;
      }
      if (noise) {
        noise_row(params.noise_key, static_cast<uint32_t>(c * pixels + static_cast<size_t>(y) * w),
                  w, s.noise);
      }
      write_row(row, noise ? s.noise : nullptr, w, c, y, norm.mean[c], norm.std[c],
                params.noise_std, out, params.flip);
    }
  }
}

}  // namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA
