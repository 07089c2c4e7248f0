#pragma once
// Decoded images as the loader passes them between stages: 8-bit RGB,
// interleaved (HWC), rows `stride` bytes apart. Free of torch headers.
#include <cstddef>
#include <cstdint>
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

}  // namespace dino_opt::loader
