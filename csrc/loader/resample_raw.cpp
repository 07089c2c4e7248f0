#include "loader/resample_raw.h"

#include <algorithm>
#include <limits>
#include <stdexcept>
#include <type_traits>

namespace dino_opt::loader {
namespace {

constexpr double kInvScale = 1.0 / (1 << kResampleFractionBits);

// One output sample from `count` inputs `step` samples apart.
template <typename T>
inline T filter(const T* in, int64_t step, const int32_t* w, int count) {
  if constexpr (std::is_floating_point_v<T>) {
    double acc = 0.0;
    for (int k = 0; k < count; ++k) acc += static_cast<double>(w[k]) * in[k * step];
    return static_cast<T>(acc * kInvScale);
  } else {
    int64_t acc = int64_t{1} << (kResampleFractionBits - 1);
    for (int k = 0; k < count; ++k) acc += int64_t{w[k]} * in[k * step];
    const int64_t v = acc >> kResampleFractionBits;  // arithmetic: a floor, as Pillow's
    constexpr int64_t kMax = std::numeric_limits<T>::max();
    return static_cast<T>(v < 0 ? 0 : v > kMax ? kMax : v);
  }
}

template <typename T>
void resize_typed(const RawView& src, int out_w, int out_h, uint8_t* dst, int64_t dst_stride,
                  RawResampleScratch& s, int taps_x, int taps_y) {
  const int c = src.layout.channels;
  const int row_first = s.start_y[0];
  const int row_last = s.start_y[out_h - 1] + s.count_y[out_h - 1];
  const int64_t mid_row = int64_t{out_w} * c;  // samples per intermediate row
  s.rows.resize(static_cast<size_t>(row_last - row_first) * mid_row * sizeof(T));
  T* mid = reinterpret_cast<T*>(s.rows.data());
  // Horizontal pass over the source rows the vertical taps read.
  for (int y = row_first; y < row_last; ++y) {
    const T* in = reinterpret_cast<const T*>(src.row(y));
    T* out = mid + (y - row_first) * mid_row;
    for (int x = 0; x < out_w; ++x) {
      const int32_t* w = s.weights_x.data() + static_cast<size_t>(x) * taps_x;
      const T* first = in + int64_t{s.start_x[x]} * c;
      for (int ch = 0; ch < c; ++ch) out[x * c + ch] = filter(first + ch, c, w, s.count_x[x]);
    }
  }
  // Vertical pass, a row at a time.
  for (int y = 0; y < out_h; ++y) {
    const int32_t* w = s.weights_y.data() + static_cast<size_t>(y) * taps_y;
    const T* first = mid + (s.start_y[y] - row_first) * mid_row;
    T* out = reinterpret_cast<T*>(dst + y * dst_stride);
    for (int64_t i = 0; i < mid_row; ++i) out[i] = filter(first + i, mid_row, w, s.count_y[y]);
  }
}

}  // namespace

void resize_crop_raw(const RawView& src, const CropBox& box, int out_width, int out_height,
                     uint8_t* dst, int64_t dst_stride, RawResampleScratch& s) {
  if (out_width < 1 || out_height < 1 || !(box.x1 > box.x0) || !(box.y1 > box.y0) ||
      box.clamp_x0 < 0 || box.clamp_y0 < 0 || box.clamp_x1 > src.width ||
      box.clamp_y1 > src.height || box.clamp_x1 <= box.clamp_x0 || box.clamp_y1 <= box.clamp_y0 ||
      src.layout.channels < 1) {
    throw std::invalid_argument(
        "resize_crop_raw: empty crop box or output, or box outside the image");
  }
  const int taps_x = axis_coefficients(box.x0, box.x1, box.clamp_x0, box.clamp_x1, out_width,
                                       s.weights_x, s.start_x, s.count_x);
  const int taps_y = axis_coefficients(box.y0, box.y1, box.clamp_y0, box.clamp_y1, out_height,
                                       s.weights_y, s.start_y, s.count_y);
  switch (src.layout.type) {
    case SampleType::kU8:
      resize_typed<uint8_t>(src, out_width, out_height, dst, dst_stride, s, taps_x, taps_y);
      break;
    case SampleType::kU16:
      resize_typed<uint16_t>(src, out_width, out_height, dst, dst_stride, s, taps_x, taps_y);
      break;
    case SampleType::kF32:
      resize_typed<float>(src, out_width, out_height, dst, dst_stride, s, taps_x, taps_y);
      break;
  }
}

}  // namespace dino_opt::loader
