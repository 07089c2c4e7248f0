// DINO's photometric augmentation of one crop on the CPU: the body of
// loader::apply_photometric, compiled once per instruction set
// (cmake/loader.cmake: DEFAULT, and AVX2 on x86-64) into the namespace named
// by DINO_OPT_PHOTOMETRIC_ISA; photometric.cpp picks one at run time. All
// helpers have internal linkage (here and in the headers), so the linker never
// hands an AVX2 copy of a function to the baseline variant.
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
// shares; this file is built with -ffp-contract=off so that both round alike,
// and with -fno-trapping-math (no value changes) so that selects vectorise.
#include <cstring>
#include <type_traits>

#include "loader/float16.h"
#include "loader/photometric.h"
#include "loader/photometric_isa.h"
#include "loader/photometric_math.h"
#include "loader/photometric_rows.h"

#ifndef DINO_OPT_PHOTOMETRIC_ISA
#error "DINO_OPT_PHOTOMETRIC_ISA names the variant this build of the file is"
#endif

namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA {

namespace pm = photometric_math;

namespace {

// Scratch layout, in floats (photometric_scratch_floats): the planar image
// (3 h w), one planar row (3 w), three reflect-padded rows (each at most
// w + 2 (w - 1)), and the vertical and horizontal taps (at most 2 h - 1 and
// 2 w - 1).
struct Scratch {
  float* image;
  float* row;
  float* padded;
  float* taps_y;
  float* taps_x;
};

Scratch carve(float* s, int h, int w) {
  Scratch out;
  const size_t plane = static_cast<size_t>(h) * w;
  out.image = s;
  out.row = out.image + 3 * plane;
  out.padded = out.row + 3 * static_cast<size_t>(w);
  out.taps_y = out.padded + 9 * static_cast<size_t>(w);
  out.taps_x = out.taps_y + 2 * static_cast<size_t>(h);
  return out;
}

#if !defined(__AVX__)
// u8 -> float, each entry the correctly rounded quotient: without AVX a
// table lookup is cheaper than the vector division.
struct UnitTable {
  float v[256];
  UnitTable() {
    for (uint32_t i = 0; i < 256; ++i) v[i] = pm::unit_from_u8(i);
  }
};
const UnitTable kUnit;
#endif

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
#if defined(__AVX__)
  for (int x = 0; x < n; ++x) {
    row.r[x] = pm::unit_from_u8(src[3 * x]);
    row.g[x] = pm::unit_from_u8(src[3 * x + 1]);
    row.b[x] = pm::unit_from_u8(src[3 * x + 2]);
  }
#else
  const float* __restrict t = kUnit.v;
  for (int x = 0; x < n; ++x) {
    row.r[x] = t[src[3 * x]];
    row.g[x] = t[src[3 * x + 1]];
    row.b[x] = t[src[3 * x + 2]];
  }
#endif
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

// Solarises, normalises and stores a finished row as output row y, mirrored
// when flipping. One fused loop per channel for planar layouts (NCHW), one
// loop over pixels for interleaved ones (channels_last), a strided loop for
// anything else.
template <bool kSolarize>
float finish(float v, float m, float sd) {
  return pm::normalize(kSolarize ? pm::solarize(v) : v, m, sd);
}

template <class Store, bool kSolarize>
void write_planar(const float* __restrict v, int n, float m, float sd,
                  typename Store::type* __restrict dst, bool flip) {
  if (flip) {
    typename Store::type* __restrict last = dst + (n - 1);
    for (int x = 0; x < n; ++x) last[-x] = Store::cvt(finish<kSolarize>(v[x], m, sd));
  } else {
    for (int x = 0; x < n; ++x) dst[x] = Store::cvt(finish<kSolarize>(v[x], m, sd));
  }
}

#if defined(__AVX__)
template <class Store, bool kSolarize>
void write_interleaved(Row row, int n, const Normalization& norm,
                       typename Store::type* __restrict dst, bool flip) {
  const float m0 = norm.mean[0], m1 = norm.mean[1], m2 = norm.mean[2];
  const float s0 = norm.std[0], s1 = norm.std[1], s2 = norm.std[2];
  if (flip) {
    // Reversed loads and forward stores: this form vectorises, the mirror image does not.
    const float* __restrict r = row.r + (n - 1);
    const float* __restrict g = row.g + (n - 1);
    const float* __restrict b = row.b + (n - 1);
    for (int x = 0; x < n; ++x) {
      dst[3 * x] = Store::cvt(finish<kSolarize>(r[-x], m0, s0));
      dst[3 * x + 1] = Store::cvt(finish<kSolarize>(g[-x], m1, s1));
      dst[3 * x + 2] = Store::cvt(finish<kSolarize>(b[-x], m2, s2));
    }
  } else {
    for (int x = 0; x < n; ++x) {
      dst[3 * x] = Store::cvt(finish<kSolarize>(row.r[x], m0, s0));
      dst[3 * x + 1] = Store::cvt(finish<kSolarize>(row.g[x], m1, s1));
      dst[3 * x + 2] = Store::cvt(finish<kSolarize>(row.b[x], m2, s2));
    }
  }
}
#endif

template <class Store, bool kSolarize>
void write_row(Row row, int n, int y, const pm::CropOps& ops, const Normalization& norm,
               const PlanarOutput& out) {
  using T = typename Store::type;
  T* base = static_cast<T*>(out.data) + y * out.stride_y;
#if defined(__AVX__)
  // With AVX the shuffles of an interleaving store pay; with SSE2 the strided
  // loop below is faster (measured per 224^2 crop: 66 vs 89 us with AVX2,
  // 216 vs 110 us with SSE2).
  if (out.stride_c == 1 && out.stride_x == 3) {
    write_interleaved<Store, kSolarize>(row, n, norm, base, ops.flip);
    return;
  }
#endif
  const float* planes[3] = {row.r, row.g, row.b};
  for (int c = 0; c < 3; ++c) {
    T* dst = base + c * out.stride_c;
    const float* __restrict v = planes[c];
    const float m = norm.mean[c], sd = norm.std[c];
    if (out.stride_x == 1) {
      write_planar<Store, kSolarize>(v, n, m, sd, dst, ops.flip);
    } else {
      const int64_t sx = ops.flip ? -out.stride_x : out.stride_x;
      T* first = ops.flip ? dst + (n - 1) * out.stride_x : dst;
      for (int x = 0; x < n; ++x) first[x * sx] = Store::cvt(finish<kSolarize>(v[x], m, sd));
    }
  }
}

void write_row(Row row, int n, int y, const pm::CropOps& ops, const Normalization& norm,
               const PlanarOutput& out) {
  const bool sol = ops.solarize;
  switch (out.type) {
    case OutputType::kFloat32:
      return sol ? write_row<StoreF32, true>(row, n, y, ops, norm, out)
                 : write_row<StoreF32, false>(row, n, y, ops, norm, out);
    case OutputType::kBFloat16:
      return sol ? write_row<StoreBF16, true>(row, n, y, ops, norm, out)
                 : write_row<StoreBF16, false>(row, n, y, ops, norm, out);
    case OutputType::kFloat16:
      return sol ? write_row<StoreF16, true>(row, n, y, ops, norm, out)
                 : write_row<StoreF16, false>(row, n, y, ops, norm, out);
  }
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
  const int taps_y = 2 * ry + 1, taps_x = 2 * rx + 1;
  Row result{s.row, s.row + w, s.row + 2 * w};
  float* results[3] = {result.r, result.g, result.b};
  for (int y = 0; y < h; ++y) {
    for (int c = 0; c < 3; ++c) {
      const float* channel = s.image + c * plane;
      float* padded = s.padded + c * static_cast<size_t>(padded_width);
      float* centre = padded + rx;
      // Vertical taps read image rows, horizontal taps shifted views of the padded row.
      const auto image_row_of = [&](int k) {
        return channel + static_cast<size_t>(pm::reflect(y + k - ry, h)) * w;
      };
      convolve(image_row_of, s.taps_y, taps_y, centre, w);
      for (int i = 1; i <= rx; ++i) {
        centre[-i] = centre[i];
        centre[w - 1 + i] = centre[w - 1 - i];
      }
      convolve([&](int k) -> const float* { return padded + k; }, s.taps_x, taps_x, results[c], w);
    }
    write_row(result, w, y, ops, norm, out);
  }
}

}  // namespace

void apply_photometric_kernel(const uint8_t* src, int height, int width,
                              const PhotometricParams& params, const Normalization& norm,
                              const PlanarOutput& out, float* scratch) {
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
    if (!blur) write_row(row, w, y, ops, norm, out);
  }

  if (blur) blur_and_write(s, h, w, ops, norm, out);
}

}  // namespace dino_opt::loader::DINO_OPT_PHOTOMETRIC_ISA
