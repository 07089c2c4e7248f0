#pragma once
// Decoded images as the loader passes them between stages: 8-bit RGB,
// interleaved (HWC), rows `stride` bytes apart (the hot path); and images at
// their stored depth with any number of channels (RawImage), for data that is
// not 8-bit RGB. Free of torch headers.
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace dino_opt::loader {

// A read-only window on RGB pixels owned elsewhere.
struct ImageView {
  const uint8_t* data = nullptr;
  int width = 0;
  int height = 0;
  int64_t stride = 0;  // bytes between rows, >= 3 * width

  const uint8_t* row(int y) const { return data + y * stride; }
};

// An owned, tightly packed RGB image (stride = 3 * width).
struct Image {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> pixels;

  Image() = default;
  Image(int w, int h) : width(w), height(h), pixels(static_cast<size_t>(w) * h * 3) {}
  ImageView view() const { return {pixels.data(), width, height, int64_t{3} * width}; }
  uint8_t* row(int y) { return pixels.data() + static_cast<size_t>(y) * width * 3; }
};

// The sample types images are read at: 8- and 16-bit unsigned, 32-bit float.
enum class SampleType { kU8, kU16, kF32 };
int sample_bytes(SampleType type);
const char* sample_type_name(SampleType type);  // "uint8", "uint16", "float32"
// The value that maps to 1.0 before normalisation: 255, 65535, or 1 (floats
// are taken as they are).
double sample_scale(SampleType type);

// What every image of a data set read at its stored depth must share.
struct ImageLayout {
  int channels = 3;
  SampleType type = SampleType::kU8;
  bool operator==(const ImageLayout& o) const { return channels == o.channels && type == o.type; }
  bool operator!=(const ImageLayout& o) const { return !(*this == o); }
  // "3-channel uint8", "13-channel uint16", "1-channel float32".
  std::string describe() const;
};

// A read-only window on interleaved samples of any layout, rows `stride` bytes apart.
struct RawView {
  const uint8_t* data = nullptr;
  int width = 0;
  int height = 0;
  ImageLayout layout;
  int64_t stride = 0;

  const uint8_t* row(int y) const { return data + y * stride; }
};

// An owned image at its stored depth: HWC, tightly packed. Channel order as
// stored, except that OpenCV's BGR(A) is turned into RGB(A).
struct RawImage {
  int width = 0;
  int height = 0;
  ImageLayout layout;
  std::vector<uint8_t> bytes;

  RawImage() = default;
  RawImage(int w, int h, ImageLayout l)
      : width(w),
        height(h),
        layout(l),
        bytes(static_cast<size_t>(w) * h * l.channels * sample_bytes(l.type)) {}
  int64_t row_bytes() const { return int64_t{width} * layout.channels * sample_bytes(layout.type); }
  RawView view() const { return {bytes.data(), width, height, layout, row_bytes()}; }
};

}  // namespace dino_opt::loader
