#include "loader/prepare.h"

#include <algorithm>
#include <cmath>

#include "loader/resample.h"

namespace dino_opt::loader {
namespace {

void check_arguments(int max_side, int quality) {
  if (max_side < 1) throw ImageError("max_side must be >= 1, got " + std::to_string(max_side));
  if (quality < 1 || quality > 100)
    throw ImageError("quality must be in [1, 100], got " + std::to_string(quality));
}

}  // namespace

std::vector<uint8_t> reencode_bytes(const uint8_t* data, size_t size, int max_side, int quality,
                                    const DecodeOptions& options, PrepareResult* result) {
  check_arguments(max_side, quality);
  const ImageHeader header = probe_image(data, size, options);
  int denom = 1;
  if (header.format == ImageFormat::kJpeg) {
    for (int d : {8, 4, 2}) {
      const auto [w, h] = jpeg_scaled_size(header.width, header.height, d);
      if (std::max(w, h) >= max_side) {
        denom = d;
        break;
      }
    }
  }
  Image image = decode_image(data, size, header, denom, options);
  const int longer = std::max(image.width, image.height);
  if (longer > max_side) {
    const double s = static_cast<double>(max_side) / longer;
    const int w = std::max(1, static_cast<int>(std::lround(image.width * s)));
    const int h = std::max(1, static_cast<int>(std::lround(image.height * s)));
    Image small(w, h);
    ResampleScratch scratch;
    const CropBox box =
        scaled_crop_box(0, 0, image.width, image.height, 1.0, 1.0, image.width, image.height);
    resize_crop_bicubic(image.view(), box, w, h, small.pixels.data(), int64_t{3} * w, scratch);
    image = std::move(small);
  }
  std::vector<uint8_t> encoded = encode_jpeg(image.view(), quality);
  if (result != nullptr)
    *result = {image.width, image.height, static_cast<int64_t>(encoded.size())};
  return encoded;
}

PrepareResult reencode_image(const std::string& src, const std::string& dst, int max_side,
                             int quality, const DecodeOptions& options) {
  check_arguments(max_side, quality);
  PrepareResult result;
  std::vector<uint8_t> encoded;
  try {
    const std::vector<uint8_t> bytes = read_file(src);
    encoded = reencode_bytes(bytes.data(), bytes.size(), max_side, quality, options, &result);
  } catch (const ImageError& e) {
    throw ImageError(src + ": " + e.what());
  }
  write_file_atomically(dst, encoded.data(), encoded.size());
  return result;
}

}  // namespace dino_opt::loader
