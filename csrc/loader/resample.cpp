#include "loader/resample.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace dino_opt::loader {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // as Pillow: 8-bit pixels times weights fit int32
constexpr double kSupport = 2.0;            // bicubic

double bicubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

// Fixed-point filter taps of every output position along one axis: output i
// reads count[i] inputs from start[i] with weights[i * taps ...]. Returns taps.
int axis_coefficients(double in0, double in1, int clamp0, int clamp1, int out_size, std::vector<int32_t>& weights,
                      std::vector<int>& start, std::vector<int>& count) {
  const double scale = (in1 - in0) / out_size;
  const double filter_scale = std::max(scale, 1.0);
  const double support = kSupport * filter_scale;
  const int taps = static_cast<int>(std::ceil(support)) * 2 + 1;
  weights.assign(static_cast<size_t>(out_size) * taps, 0);
  start.resize(out_size);
  count.resize(out_size);
  std::vector<double> w(taps);
  // Coordinates relative to the clamp window, as if it had been cropped out.
  const int window = clamp1 - clamp0;
  const double lo = in0 - clamp0;
  for (int i = 0; i < out_size; ++i) {
    const double center = lo + (i + 0.5) * scale;
    int first = static_cast<int>(center - support + 0.5);  // truncation, as Pillow
    if (first < 0) first = 0;
    int last = static_cast<int>(center + support + 0.5);
    if (last > window) last = window;
    const int n = std::min(std::max(last - first, 1), taps);
    double total = 0.0;
    for (int k = 0; k < n; ++k) {
      w[k] = bicubic((k + first - center + 0.5) / filter_scale);
      total += w[k];
    }
    for (int k = 0; k < n; ++k) {
      const double v = total != 0.0 ? w[k] / total : 0.0;
      weights[static_cast<size_t>(i) * taps + k] =
          static_cast<int32_t>(v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
    }
    start[i] = clamp0 + std::min(first, window - 1);
    count[i] = n;
  }
  return taps;
}

inline uint8_t clip8(int32_t acc) {
  const int32_t v = acc >> kPrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

}  // namespace

CropBox scaled_crop_box(int left, int top, int width, int height, double fx, double fy, int src_width,
                        int src_height) {
  CropBox b;
  b.x0 = left * fx;
  b.y0 = top * fy;
  b.x1 = (left + width) * fx;
  b.y1 = (top + height) * fy;
  b.clamp_x0 = std::clamp(static_cast<int>(std::floor(b.x0)), 0, src_width - 1);
  b.clamp_y0 = std::clamp(static_cast<int>(std::floor(b.y0)), 0, src_height - 1);
  b.clamp_x1 = std::clamp(static_cast<int>(std::ceil(b.x1)), b.clamp_x0 + 1, src_width);
  b.clamp_y1 = std::clamp(static_cast<int>(std::ceil(b.y1)), b.clamp_y0 + 1, src_height);
  return b;
}

void resize_crop_bicubic(const ImageView& src, const CropBox& box, int out_width, int out_height, uint8_t* dst,
                         int64_t dst_stride, ResampleScratch& s) {
  if (out_width < 1 || out_height < 1 || !(box.x1 > box.x0) || !(box.y1 > box.y0) || box.clamp_x0 < 0 ||
      box.clamp_y0 < 0 || box.clamp_x1 > src.width || box.clamp_y1 > src.height || box.clamp_x1 <= box.clamp_x0 ||
      box.clamp_y1 <= box.clamp_y0) {
    throw std::invalid_argument("resize_crop_bicubic: empty crop box or output, or box outside the image");
  }
  const int taps_x =
      axis_coefficients(box.x0, box.x1, box.clamp_x0, box.clamp_x1, out_width, s.weights_x, s.start_x, s.count_x);
  const int taps_y =
      axis_coefficients(box.y0, box.y1, box.clamp_y0, box.clamp_y1, out_height, s.weights_y, s.start_y, s.count_y);

  // Horizontal pass over the source rows the vertical pass will read.
  const int row_first = s.start_y[0];
  const int row_last = s.start_y[out_height - 1] + s.count_y[out_height - 1];
  const int rows = row_last - row_first;
  const int64_t row_bytes = int64_t{3} * out_width;
  s.rows.resize(static_cast<size_t>(rows) * row_bytes);
  constexpr int32_t kHalf = 1 << (kPrecisionBits - 1);
  for (int r = 0; r < rows; ++r) {
    const uint8_t* in = src.row(row_first + r);
    uint8_t* out = s.rows.data() + r * row_bytes;
    for (int x = 0; x < out_width; ++x) {
      const uint8_t* p = in + 3 * s.start_x[x];
      const int32_t* w = s.weights_x.data() + static_cast<size_t>(x) * taps_x;
      int32_t r0 = kHalf, g0 = kHalf, b0 = kHalf;
      for (int k = 0, n = s.count_x[x]; k < n; ++k) {
        r0 += p[3 * k] * w[k];
        g0 += p[3 * k + 1] * w[k];
        b0 += p[3 * k + 2] * w[k];
      }
      out[3 * x] = clip8(r0);
      out[3 * x + 1] = clip8(g0);
      out[3 * x + 2] = clip8(b0);
    }
  }

  // Vertical pass: whole rows at a time, so the inner loop runs along
  // contiguous bytes and vectorises.
  s.accum.resize(row_bytes);
  int32_t* acc = s.accum.data();
  for (int y = 0; y < out_height; ++y) {
    std::fill(acc, acc + row_bytes, kHalf);
    const int32_t* w = s.weights_y.data() + static_cast<size_t>(y) * taps_y;
    for (int k = 0, n = s.count_y[y]; k < n; ++k) {
      const uint8_t* in = s.rows.data() + (s.start_y[y] - row_first + k) * row_bytes;
      const int32_t wk = w[k];
      for (int64_t i = 0; i < row_bytes; ++i) acc[i] += in[i] * wk;
    }
    uint8_t* out = dst + y * dst_stride;
    for (int64_t i = 0; i < row_bytes; ++i) out[i] = clip8(acc[i]);
  }
}

}  // namespace dino_opt::loader
