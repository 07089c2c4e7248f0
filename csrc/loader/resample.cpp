#include "loader/resample.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

namespace dino_opt::loader {
namespace {

constexpr int kPrecisionBits = 32 - 8 - 2;  // as Pillow: 8-bit pixels times weights fit int32
static_assert(kPrecisionBits == kResampleFractionBits);
constexpr double kSupport = 2.0;  // bicubic

double bicubic(double x) {
  constexpr double a = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0;
  if (x < 2.0) return (((x - 5.0) * x + 8.0) * x - 4.0) * a;
  return 0.0;
}

}  // namespace

int axis_coefficients(double in0, double in1, int clamp0, int clamp1, int out_size,
                      std::vector<int32_t>& weights, std::vector<int>& start,
                      std::vector<int>& count) {
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
      weights[static_cast<size_t>(i) * taps + k] = static_cast<int32_t>(
          v < 0 ? -0.5 + v * (1 << kPrecisionBits) : 0.5 + v * (1 << kPrecisionBits));
    }
    start[i] = clamp0 + std::min(first, window - 1);
    count[i] = n;
  }
  return taps;
}

namespace {

inline uint8_t clip8(int32_t acc) {
  const int32_t v = acc >> kPrecisionBits;
  return static_cast<uint8_t>(v < 0 ? 0 : v > 255 ? 255 : v);
}

// out[i] = clip8(sum_k w[k] * lines[k][i]) for i < length, where line k
// starts k * line_stride bytes after `lines`. The one hot loop of both passes;
// compiled for AVX2 too and chosen at load time.
__attribute__((target_clones("avx2", "default"))) void filter_lines(const uint8_t* lines,
                                                                    int64_t line_stride,
                                                                    const int32_t* w, int taps,
                                                                    int64_t length, int32_t* acc,
                                                                    uint8_t* out) {
  constexpr int32_t kHalf = 1 << (kPrecisionBits - 1);
  std::fill(acc, acc + length, kHalf);
  for (int k = 0; k < taps; ++k) {
    const uint8_t* in = lines + k * line_stride;
    const int32_t wk = w[k];
    for (int64_t i = 0; i < length; ++i) acc[i] += in[i] * wk;
  }
  for (int64_t i = 0; i < length; ++i) out[i] = clip8(acc[i]);
}

// dst[c][r] = src[r][c] for 3-byte pixels: `rows` x `cols` in, cols x rows out.
void transpose_rgb(const uint8_t* src, int64_t src_stride, int rows, int cols, uint8_t* dst,
                   int64_t dst_stride) {
  constexpr int kBlock = 32;  // tiles keep both sides in cache
  for (int r0 = 0; r0 < rows; r0 += kBlock) {
    for (int c0 = 0; c0 < cols; c0 += kBlock) {
      const int r1 = std::min(rows, r0 + kBlock), c1 = std::min(cols, c0 + kBlock);
      for (int r = r0; r < r1; ++r) {
        const uint8_t* in = src + r * src_stride;
        for (int c = c0; c < c1; ++c) {
          uint8_t* o = dst + c * dst_stride + 3 * r;
          o[0] = in[3 * c];
          o[1] = in[3 * c + 1];
          o[2] = in[3 * c + 2];
        }
      }
    }
  }
}

}  // namespace

CropBox scaled_crop_box(int left, int top, int width, int height, double fx, double fy,
                        int src_width, int src_height) {
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

CropBox scaled_box_in_image(double x0, double y0, double x1, double y1, double fx, double fy,
                            int src_width, int src_height) {
  return {x0 * fx, y0 * fy, x1 * fx, y1 * fy, 0, 0, src_width, src_height};
}

void resize_crop_bicubic(const ImageView& src, const CropBox& box, int out_width, int out_height,
                         uint8_t* dst, int64_t dst_stride, ResampleScratch& s) {
  if (out_width < 1 || out_height < 1 || !(box.x1 > box.x0) || !(box.y1 > box.y0) ||
      box.clamp_x0 < 0 || box.clamp_y0 < 0 || box.clamp_x1 > src.width ||
      box.clamp_y1 > src.height || box.clamp_x1 <= box.clamp_x0 || box.clamp_y1 <= box.clamp_y0) {
    throw std::invalid_argument(
        "resize_crop_bicubic: empty crop box or output, or box outside the image");
  }
  const int taps_x = axis_coefficients(box.x0, box.x1, box.clamp_x0, box.clamp_x1, out_width,
                                       s.weights_x, s.start_x, s.count_x);
  const int taps_y = axis_coefficients(box.y0, box.y1, box.clamp_y0, box.clamp_y1, out_height,
                                       s.weights_y, s.start_y, s.count_y);

  // Both passes filter along contiguous memory so that they vectorise: the
  // source window is transposed to columns x rows, the horizontal pass runs
  // down the columns, its output is transposed back, the vertical pass runs
  // along rows. The arithmetic (and so every rounding) is Pillow's.
  const int row_first = s.start_y[0];
  const int row_last = s.start_y[out_height - 1] + s.count_y[out_height - 1];
  const int rows = row_last - row_first;
  const int col_first = s.start_x[0];
  const int col_last = s.start_x[out_width - 1] + s.count_x[out_width - 1];
  const int cols = col_last - col_first;
  const int64_t column_bytes = int64_t{3} * rows;
  const int64_t row_bytes = int64_t{3} * out_width;

  s.columns.resize(static_cast<size_t>(cols) * column_bytes);
  transpose_rgb(src.row(row_first) + 3 * col_first, src.stride, rows, cols, s.columns.data(),
                column_bytes);

  s.accum.resize(std::max(column_bytes, row_bytes));
  s.filtered.resize(static_cast<size_t>(out_width) * column_bytes);
  for (int x = 0; x < out_width; ++x) {
    filter_lines(s.columns.data() + (s.start_x[x] - col_first) * column_bytes, column_bytes,
                 s.weights_x.data() + static_cast<size_t>(x) * taps_x, s.count_x[x], column_bytes,
                 s.accum.data(), s.filtered.data() + x * column_bytes);
  }

  s.rows.resize(static_cast<size_t>(rows) * row_bytes);
  transpose_rgb(s.filtered.data(), column_bytes, out_width, rows, s.rows.data(), row_bytes);

  for (int y = 0; y < out_height; ++y) {
    filter_lines(s.rows.data() + (s.start_y[y] - row_first) * row_bytes, row_bytes,
                 s.weights_y.data() + static_cast<size_t>(y) * taps_y, s.count_y[y], row_bytes,
                 s.accum.data(), dst + y * dst_stride);
  }
}

}  // namespace dino_opt::loader
