#include "loader/prepare.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdio>
#include <cstring>

#include "loader/resample.h"

namespace dino_opt::loader {
namespace {

void write_atomically(const std::string& dst, const std::vector<uint8_t>& bytes) {
  const std::string tmp = dst + ".tmp" + std::to_string(::getpid());
  auto fail = [&](const char* what) {
    const std::string cause = std::strerror(errno);
    ::unlink(tmp.c_str());
    throw ImageError(dst + ": cannot " + what + ": " + cause);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw ImageError(dst + ": cannot create " + tmp + ": " + std::strerror(errno));
  size_t written = 0;
  while (written < bytes.size()) {
    const ssize_t n = ::write(fd, bytes.data() + written, bytes.size() - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      fail("write");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync");
  }
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), dst.c_str()) != 0) fail("rename");
}

}  // namespace

PrepareResult reencode_image(const std::string& src, const std::string& dst, int max_side,
                             int quality, const DecodeOptions& options) {
  if (max_side < 1) throw ImageError("max_side must be >= 1, got " + std::to_string(max_side));
  if (quality < 1 || quality > 100)
    throw ImageError("quality must be in [1, 100], got " + std::to_string(quality));
  Image image;
  try {
    const std::vector<uint8_t> bytes = read_file(src);
    const ImageHeader header = probe_image(bytes.data(), bytes.size(), options);
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
    image = decode_image(bytes.data(), bytes.size(), header, denom, options);
  } catch (const ImageError& e) {
    throw ImageError(src + ": " + e.what());
  }
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
  const std::vector<uint8_t> encoded = encode_jpeg(image.view(), quality);
  write_atomically(dst, encoded);
  return {image.width, image.height, static_cast<int64_t>(encoded.size())};
}

}  // namespace dino_opt::loader
