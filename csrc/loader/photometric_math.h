#pragma once
// The per-pixel arithmetic of DINO's photometric augmentation, shared by the
// CPU loader (photometric.cpp) and the CUDA kernel (ops/cuda/photometric_kernel.cu)
// so that both compute bit-identical values: the same float32 operations in
// the same order. Both sides are compiled without floating-point contraction
// (-ffp-contract=off, nvcc -fmad=false), so a*b + c is two roundings
// everywhere. Free of torch headers.
//
// Formulas follow torchvision's tensor kernels on float images in [0, 1]
// (transforms/v2/functional/_color.py, _misc.py):
//   gray       = 0.2989 r + 0.587 g + 0.114 b
//   blend(a,b) = clamp(a * f + b * (1 - f), 0, 1)
//   brightness = clamp(x * f)               contrast   = blend(x, mean(gray(image)))
//   saturation = blend(x, gray(pixel))      hue        = rgb -> hsv, h += f mod 1, hsv -> rgb
//   grayscale  = gray in all three channels solarize   = x >= 128/255 ? 1 - x : x
// Deviations, all at the level of float rounding: rgb -> hsv multiplies by
// 1/(max - min) where torchvision divides three times; factors that are the
// identity (brightness, contrast, saturation 1, hue 0) skip their op, where
// torchvision's hue round trip would perturb the last bit.
#include <cmath>
#include <cstdint>

// static: every translation unit has its own copies, so that the per-ISA
// builds of photometric_kernels.cpp never share an out-of-line copy.
#if defined(__CUDACC__)
#define DINO_OPT_PHOTO_HD static __host__ __device__ __forceinline__
#else
#define DINO_OPT_PHOTO_HD static inline
#endif

namespace dino_opt::loader::photometric_math {

constexpr float kGrayR = 0.2989f;
constexpr float kGrayG = 0.587f;
constexpr float kGrayB = 0.114f;
// torchvision's solarize compares the float image with threshold 128/255
// rounded to float32, so 128/255 itself is inverted.
constexpr float kSolarizeThreshold = 128.0f / 255.0f;

// The op codes of PhotometricParams::order, plus grayscale and "no op".
enum Op : int8_t {
  kBrightness = 0,
  kContrast = 1,
  kSaturation = 2,
  kHue = 3,
  kGrayscale = 4,
  kNoOp = 5
};
// Slots of a crop's op sequence: the four jitter ops in their order, then grayscale.
constexpr int kMaxOps = 5;

#if defined(__CUDA_ARCH__)
#define DINO_OPT_PHOTO_UNROLL _Pragma("unroll")
#else
#define DINO_OPT_PHOTO_UNROLL
#endif

// u8 -> [0, 1], correctly rounded (a true division, not a multiplication by
// 1/255, which is off by an ulp for 126 of the 256 values).
DINO_OPT_PHOTO_HD float unit_from_u8(uint32_t v) { return static_cast<float>(v) / 255.0f; }

DINO_OPT_PHOTO_HD float clamp01(float x) {
  // NaN passes through, as with torch.clamp.
  x = x < 0.0f ? 0.0f : x;
  return x > 1.0f ? 1.0f : x;
}

DINO_OPT_PHOTO_HD float gray(float r, float g, float b) {
  return (r * kGrayR + g * kGrayG) + b * kGrayB;
}

// 1 - f as torchvision's _blend computes it: in double, then used as float.
DINO_OPT_PHOTO_HD float one_minus(float f) {
  return static_cast<float>(1.0 - static_cast<double>(f));
}

DINO_OPT_PHOTO_HD float blend(float x, float other_term, float f) {
  return clamp01(x * f + other_term);
}

DINO_OPT_PHOTO_HD void brightness(float& r, float& g, float& b, float f) {
  r = clamp01(r * f);
  g = clamp01(g * f);
  b = clamp01(b * f);
}

// mean_term = mean * (1 - f), the same for every pixel of the crop.
DINO_OPT_PHOTO_HD void contrast(float& r, float& g, float& b, float f, float mean_term) {
  r = blend(r, mean_term, f);
  g = blend(g, mean_term, f);
  b = blend(b, mean_term, f);
}

DINO_OPT_PHOTO_HD void saturation(float& r, float& g, float& b, float f, float one_minus_f) {
  const float l = gray(r, g, b) * one_minus_f;
  r = blend(r, l, f);
  g = blend(g, l, f);
  b = blend(b, l, f);
}

DINO_OPT_PHOTO_HD void grayscale(float& r, float& g, float& b) {
  const float l = gray(r, g, b);
  r = l;
  g = l;
  b = l;
}

// torchvision's _rgb2hsv, hue shift with remainder(h + f, 1), _hsv2rgb.
// Written as chains of two-way selects, which compilers turn into vector
// blends (a three-way select stays a branch in GCC 12, and so does the loop).
DINO_OPT_PHOTO_HD void hue(float& r, float& g, float& b, float f) {
  float maxc = r > g ? r : g;
  maxc = maxc > b ? maxc : b;
  float minc = r < g ? r : g;
  minc = minc < b ? minc : b;
  const bool flat = maxc == minc;  // grey: s = 0 and h = 0, no division by zero
  const float range = maxc - minc;
  const float s = range / (flat ? 1.0f : maxc);
  const float inv_range = 1.0f / (flat ? 1.0f : range);
  const float rc = (maxc - r) * inv_range;
  const float gc = (maxc - g) * inv_range;
  const float bc = (maxc - b) * inv_range;
  // The sector where the maximum lies decides the formula; r wins ties, then g.
  float h6 = (gc + 4.0f) - rc;
  h6 = maxc == g ? (rc + 2.0f) - bc : h6;
  h6 = maxc == r ? bc - gc : h6;
  // (h/6 + 1) fmod 1: the sum lies in [5/6, 11/6], so fmod is one exact subtraction.
  float h = h6 * (1.0f / 6.0f) + 1.0f;
  h = h >= 1.0f ? h - 1.0f : h;
  // remainder(h + f, 1) for h + f in [-0.5, 1.5]: Python-style, result in [0, 1].
  h = h + f;
  h = h >= 1.0f ? h - 1.0f : h;
  h = h < 0.0f ? h + 1.0f : h;

  const float v = maxc;
  const float hh = h * 6.0f;
  // floor(hh) for hh in [0, 6], counted with comparisons rather than a float
  // -> int conversion: a NaN (only from NaN factors, which the operator
  // rejects) gives 0 instead of undefined behaviour, and GCC vectorises this
  // where it keeps a guarded conversion scalar.
  int sector =
      (hh >= 1.0f) + (hh >= 2.0f) + (hh >= 3.0f) + (hh >= 4.0f) + (hh >= 5.0f) + (hh >= 6.0f);
  const float frac = hh - static_cast<float>(sector);
  sector = sector >= 6 ? sector - 6 : sector;  // h may round to 1
  const float sxf = s * frac;
  const float one_minus_s = 1.0f - s;
  const float q = clamp01((1.0f - sxf) * v);
  const float t = clamp01((sxf + one_minus_s) * v);
  const float p = clamp01(one_minus_s * v);
  // torchvision's select table: r = [v q p p t v], g = [t v v q p p], b = [p p t v v q].
  float ro = p, go = p, bo = p;
  ro = sector == 0 ? v : ro;
  ro = sector == 1 ? q : ro;
  ro = sector == 4 ? t : ro;
  ro = sector == 5 ? v : ro;
  go = sector == 0 ? t : go;
  go = sector == 1 ? v : go;
  go = sector == 2 ? v : go;
  go = sector == 3 ? q : go;
  bo = sector == 2 ? t : bo;
  bo = sector == 3 ? v : bo;
  bo = sector == 4 ? v : bo;
  bo = sector == 5 ? q : bo;
  r = ro;
  g = go;
  b = bo;
}

DINO_OPT_PHOTO_HD float solarize(float x) { return x >= kSolarizeThreshold ? 1.0f - x : x; }

DINO_OPT_PHOTO_HD float normalize(float x, float mean, float std) { return (x - mean) / std; }

// The resolved op sequence of one crop, decoded from a parameter row (see
// PhotometricParams for the layout): slot i < 4 holds the jitter op order[i],
// slot 4 grayscale. Slots whose op is off, the identity, out of range or a
// repeat hold kNoOp, so any row is safe to apply (the operator rejects bad
// rows on the CPU before they get here). Fixed slots, indexed by unrolled
// loops, keep the struct in registers on the GPU.
struct CropOps {
  int8_t op[kMaxOps] = {kNoOp, kNoOp, kNoOp, kNoOp, kNoOp};
  float factor[kMaxOps] = {};     // the op's factor
  float one_minus[kMaxOps] = {};  // 1 - factor, as torchvision's blend uses it
  int contrast_at = -1;           // slot of the contrast op, -1 if none
  bool flip = false;
  bool solarize = false;
  float blur_sigma = 0.0f;  // > 0: blur
};

DINO_OPT_PHOTO_HD bool param_flag(float v) { return v != 0.0f; }

DINO_OPT_PHOTO_HD CropOps decode_crop_ops(const float* row) {
  CropOps ops;
  ops.flip = param_flag(row[0]);
  if (param_flag(row[1])) {
    int used = 0;  // bit per op code
    DINO_OPT_PHOTO_UNROLL
    for (int i = 0; i < 4; ++i) {
      const float o = row[6 + i];
      if (!(o == 0.0f || o == 1.0f || o == 2.0f || o == 3.0f)) continue;
      const int code = static_cast<int>(o);
      if (used & (1 << code)) continue;
      used |= 1 << code;
      const float f = row[2 + code];
      if (code == kHue ? f == 0.0f : f == 1.0f) continue;  // identity
      if (code == kContrast) ops.contrast_at = i;
      ops.op[i] = static_cast<int8_t>(code);
      ops.factor[i] = f;
      ops.one_minus[i] = one_minus(f);
    }
  }
  if (param_flag(row[10])) ops.op[4] = kGrayscale;
  const float sigma = row[11];
  ops.blur_sigma = sigma > 0.0f ? sigma : 0.0f;  // NaN: no blur
  ops.solarize = param_flag(row[12]);
  return ops;
}

// Applies one op to one pixel; `mean` is the crop's mean gray value as it
// enters contrast.
DINO_OPT_PHOTO_HD void apply_op(int op, float factor, float one_minus_factor, float mean, float& r,
                                float& g, float& b) {
  switch (op) {
    case kBrightness:
      brightness(r, g, b, factor);
      break;
    case kContrast:
      contrast(r, g, b, factor, mean * one_minus_factor);
      break;
    case kSaturation:
      saturation(r, g, b, factor, one_minus_factor);
      break;
    case kHue:
      hue(r, g, b, factor);
      break;
    case kGrayscale:
      grayscale(r, g, b);
      break;
    default:
      break;
  }
}

// Applies the ops of slots [begin, end) to one pixel.
DINO_OPT_PHOTO_HD void apply_ops(const CropOps& ops, int begin, int end, float mean, float& r,
                                 float& g, float& b) {
  DINO_OPT_PHOTO_UNROLL
  for (int i = 0; i < kMaxOps; ++i) {
    if (i >= begin && i < end) apply_op(ops.op[i], ops.factor[i], ops.one_minus[i], mean, r, g, b);
  }
}

// Blur radius along a side of `extent` pixels: ceil(3 sigma), clamped to
// extent - 1 because reflect padding needs a pad smaller than the side (a
// larger kernel would read past the mirrored image). 0 for no blur.
DINO_OPT_PHOTO_HD int blur_radius(float sigma, int extent) {
  if (!(sigma > 0.0f)) return 0;
  const double r = ceil(3.0 * static_cast<double>(sigma));
  const double cap = static_cast<double>(extent > 1 ? extent - 1 : 0);
  return static_cast<int>(r < cap ? r : cap);
}

// The 2r + 1 taps of a normalised Gaussian: exp(-k^2 / (2 sigma^2)) / sum for
// k = -r..r, computed in double and rounded once, so that the CPU and the
// GPU agree (torchvision computes the same kernel in float32).
DINO_OPT_PHOTO_HD void gaussian_weights(float sigma, int radius, float* out) {
  const double s = static_cast<double>(sigma);
  double sum = 0.0;
  for (int k = -radius; k <= radius; ++k) {
    const double x = static_cast<double>(k) / s;
    sum += exp(-0.5 * x * x);
  }
  for (int k = -radius; k <= radius; ++k) {
    const double x = static_cast<double>(k) / s;
    out[k + radius] = static_cast<float>(exp(-0.5 * x * x) / sum);
  }
}

// Index into a side of `n` pixels with reflect padding (torch's "reflect":
// the edge pixel is not repeated); valid for -n < i < 2n - 1.
DINO_OPT_PHOTO_HD int reflect(int i, int n) {
  i = i < 0 ? -i : i;
  return i >= n ? 2 * (n - 1) - i : i;
}

}  // namespace dino_opt::loader::photometric_math
