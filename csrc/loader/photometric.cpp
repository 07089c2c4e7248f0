// DINO's photometric augmentation of one crop on the CPU.
//
// The crop is processed a row at a time in planar float rows (one array per
// channel), each op a separate loop over the row while it sits in L1, so
// that every loop is a plain elementwise loop the compiler vectorises. Full
// passes over the crop are only made where an op needs the whole image:
//   pass 1 (only with contrast): the ops before contrast, and the sum of the
//          gray values contrast needs; the rows are kept in the planar
//          scratch image unless contrast comes first (then only the sum);
//   pass 2: the remaining colour ops; without blur it also normalises and
//          writes the row, with blur it keeps the row in the scratch image;
//   pass 3 (only with blur): vertical taps from the scratch image into a
//          reflect-padded row, horizontal taps, normalise and write.
// The per-pixel arithmetic is photometric_math.h, which the CUDA kernel
// shares; this file is built with -ffp-contract=off so that both round alike.
#include "loader/photometric.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstring>
#include <sstream>

#include "loader/float16.h"
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

namespace {

// Scratch layout, in floats: the planar image (3 h w), one planar row (3 w),
// a staging row (w), three reflect-padded rows (each at most w + 2 (w - 1)),
// and the vertical and horizontal taps (at most 2 h - 1 and 2 w - 1).
struct Scratch {
  float* image;
  float* row;
  float* staging;
  float* padded;
  float* taps_y;
  float* taps_x;
};

Scratch carve(float* s, int h, int w) {
  Scratch out;
  const size_t plane = static_cast<size_t>(h) * w;
  out.image = s;
  out.row = out.image + 3 * plane;
  out.staging = out.row + 3 * static_cast<size_t>(w);
  out.padded = out.staging + w;
  out.taps_y = out.padded + 9 * static_cast<size_t>(w);
  out.taps_x = out.taps_y + 2 * static_cast<size_t>(h);
  return out;
}

// u8 -> float, each entry the correctly rounded quotient (the loop below
// cannot vectorise a division as cheaply as it looks up 256 floats).
struct UnitTable {
  float v[256];
  UnitTable() {
    for (uint32_t i = 0; i < 256; ++i) v[i] = pm::unit_from_u8(i);
  }
};
const UnitTable kUnit;

struct Row {
  float* __restrict r;
  float* __restrict g;
  float* __restrict b;
};

Row image_row(const Scratch& s, int h, int w, int y) {
  const size_t plane = static_cast<size_t>(h) * w;
  float* base = s.image + static_cast<size_t>(y) * w;
  return {base, base + plane, base + 2 * plane};
}

void load_row(const uint8_t* __restrict src, int n, Row row) {
  const float* __restrict t = kUnit.v;
  for (int x = 0; x < n; ++x) {
    row.r[x] = t[src[3 * x]];
    row.g[x] = t[src[3 * x + 1]];
    row.b[x] = t[src[3 * x + 2]];
  }
}

void apply_op_row(const pm::CropOps& ops, int i, float mean, Row row, int n) {
  float* __restrict r = row.r;
  float* __restrict g = row.g;
  float* __restrict b = row.b;
  const float f = ops.factor[i];
  const float omf = ops.one_minus[i];
  switch (ops.op[i]) {
    case pm::kBrightness:
      for (int x = 0; x < n; ++x) pm::brightness(r[x], g[x], b[x], f);
      break;
    case pm::kContrast: {
      const float term = mean * omf;
      for (int x = 0; x < n; ++x) pm::contrast(r[x], g[x], b[x], f, term);
      break;
    }
    case pm::kSaturation:
      for (int x = 0; x < n; ++x) pm::saturation(r[x], g[x], b[x], f, omf);
      break;
    case pm::kHue:
      for (int x = 0; x < n; ++x) pm::hue(r[x], g[x], b[x], f);
      break;
    case pm::kGrayscale:
      for (int x = 0; x < n; ++x) pm::grayscale(r[x], g[x], b[x]);
      break;
    default:
      break;
  }
}

// Sum of the gray values of a row in double, eight interleaved partial sums
// so that the additions vectorise (the sum is exact to ~1e-16, so its order
// does not show in the float mean).
double gray_sum_row(Row row, int n) {
  double acc[8] = {};
  int x = 0;
  for (; x + 8 <= n; x += 8) {
    for (int j = 0; j < 8; ++j) acc[j] += pm::gray(row.r[x + j], row.g[x + j], row.b[x + j]);
  }
  double sum = 0.0;
  for (; x < n; ++x) sum += pm::gray(row.r[x], row.g[x], row.b[x]);
  for (int j = 0; j < 8; ++j) sum += acc[j];
  return sum;
}

struct StoreF32 {
  using type = float;
  static float cvt(float v) { return v; }
};
struct StoreBF16 {
  using type = uint16_t;
  static uint16_t cvt(float v) { return float_to_bf16_bits(v); }
};
struct StoreF16 {
  using type = uint16_t;
  static uint16_t cvt(float v) { return float_to_f16_bits(v); }
};

// Solarises and normalises a finished row and writes it to output row y,
// mirrored when flipping.
template <class Store>
void write_row(Row row, int n, int y, const pm::CropOps& ops, const Normalization& norm,
               const PlanarOutput& out, float* __restrict staging) {
  using T = typename Store::type;
  const float* planes[3] = {row.r, row.g, row.b};
  for (int c = 0; c < 3; ++c) {
    const float* __restrict v = planes[c];
    const float m = norm.mean[c];
    const float sd = norm.std[c];
    if (ops.solarize) {
      for (int x = 0; x < n; ++x) staging[x] = pm::normalize(pm::solarize(v[x]), m, sd);
    } else {
      for (int x = 0; x < n; ++x) staging[x] = pm::normalize(v[x], m, sd);
    }
    T* __restrict dst = static_cast<T*>(out.data) + c * out.stride_c + y * out.stride_y;
    const int64_t sx = out.stride_x;
    if (sx == 1 && !ops.flip) {
      for (int x = 0; x < n; ++x) dst[x] = Store::cvt(staging[x]);
    } else if (sx == 1) {
      T* __restrict last = dst + (n - 1);
      for (int x = 0; x < n; ++x) last[-x] = Store::cvt(staging[x]);
    } else if (!ops.flip) {
      for (int x = 0; x < n; ++x) dst[x * sx] = Store::cvt(staging[x]);
    } else {
      for (int x = 0; x < n; ++x) dst[(n - 1 - x) * sx] = Store::cvt(staging[x]);
    }
  }
}

void write_row(Row row, int n, int y, const pm::CropOps& ops, const Normalization& norm,
               const PlanarOutput& out, float* staging) {
  switch (out.type) {
    case OutputType::kFloat32:
      return write_row<StoreF32>(row, n, y, ops, norm, out, staging);
    case OutputType::kBFloat16:
      return write_row<StoreBF16>(row, n, y, ops, norm, out, staging);
    case OutputType::kFloat16:
      return write_row<StoreF16>(row, n, y, ops, norm, out, staging);
  }
}

// acc[x] += w * src[x]: one tap of a convolution, accumulated tap by tap in
// order so that every output is 0 + w0 v0 + w1 v1 + ... as on the GPU.
void accumulate_tap(float* __restrict acc, const float* __restrict src, float w, int n) {
  for (int x = 0; x < n; ++x) acc[x] += w * src[x];
}

// Pass 3: separable blur of the scratch image, then write each row.
void blur_and_write(const Scratch& s, int h, int w, const pm::CropOps& ops,
                    const Normalization& norm, const PlanarOutput& out) {
  const int ry = pm::blur_radius(ops.blur_sigma, h);
  const int rx = pm::blur_radius(ops.blur_sigma, w);
  pm::gaussian_weights(ops.blur_sigma, ry, s.taps_y);
  pm::gaussian_weights(ops.blur_sigma, rx, s.taps_x);
  const size_t plane = static_cast<size_t>(h) * w;
  const int padded_width = w + 2 * rx;
  Row result{s.row, s.row + w, s.row + 2 * w};
  float* results[3] = {result.r, result.g, result.b};
  for (int y = 0; y < h; ++y) {
    for (int c = 0; c < 3; ++c) {
      const float* channel = s.image + c * plane;
      float* padded = s.padded + c * static_cast<size_t>(padded_width);
      float* centre = padded + rx;
      std::memset(centre, 0, sizeof(float) * w);
      for (int k = 0; k <= 2 * ry; ++k) {
        const int src_y = pm::reflect(y + k - ry, h);
        accumulate_tap(centre, channel + static_cast<size_t>(src_y) * w, s.taps_y[k], w);
      }
      for (int i = 1; i <= rx; ++i) {
        centre[-i] = centre[i];
        centre[w - 1 + i] = centre[w - 1 - i];
      }
      float* dst = results[c];
      std::memset(dst, 0, sizeof(float) * w);
      for (int k = 0; k <= 2 * rx; ++k) accumulate_tap(dst, padded + k, s.taps_x[k], w);
    }
    write_row(result, w, y, ops, norm, out, s.staging);
  }
}

}  // namespace

size_t photometric_scratch_floats(int height, int width) {
  if (height <= 0 || width <= 0) return 0;
  const size_t h = static_cast<size_t>(height);
  const size_t w = static_cast<size_t>(width);
  return 3 * h * w + 3 * w + w + 9 * w + 2 * h + 2 * w;
}

void apply_photometric(const uint8_t* src, int height, int width, const PhotometricParams& params,
                       const Normalization& norm, const PlanarOutput& out, float* scratch) {
  if (height <= 0 || width <= 0) return;
  const int h = height;
  const int w = width;
  float row_params[kPhotometricParamCount];
  params.to_floats(row_params);
  const pm::CropOps ops = pm::decode_crop_ops(row_params);
  const Scratch s = carve(scratch, h, w);
  const bool blur =
      pm::blur_radius(ops.blur_sigma, h) > 0 || pm::blur_radius(ops.blur_sigma, w) > 0;
  const Row row_buffer{s.row, s.row + w, s.row + 2 * w};
  const size_t src_stride = 3 * static_cast<size_t>(w);

  // Pass 1: the mean gray value of the image as it enters contrast.
  float mean = 0.0f;
  int first_op = 0;  // where pass 2 starts in the op sequence
  bool in_image = false;
  if (ops.contrast_at >= 0) {
    double sum = 0.0;
    in_image = ops.contrast_at > 0;
    for (int y = 0; y < h; ++y) {
      const Row row = in_image ? image_row(s, h, w, y) : row_buffer;
      load_row(src + y * src_stride, w, row);
      for (int i = 0; i < ops.contrast_at; ++i) apply_op_row(ops, i, 0.0f, row, w);
      sum += gray_sum_row(row, w);
    }
    mean = static_cast<float>(sum / (static_cast<double>(h) * w));
    first_op = ops.contrast_at;
  }

  // Pass 2: the remaining colour ops, then either write or keep for the blur.
  for (int y = 0; y < h; ++y) {
    const Row row = (in_image || blur) ? image_row(s, h, w, y) : row_buffer;
    if (!in_image) load_row(src + y * src_stride, w, row);
    for (int i = first_op; i < pm::kMaxOps; ++i) apply_op_row(ops, i, mean, row, w);
    if (!blur) write_row(row, w, y, ops, norm, out, s.staging);
  }

  if (blur) blur_and_write(s, h, w, ops, norm, out);
}

}  // namespace dino_opt::loader
