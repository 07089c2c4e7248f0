#pragma once
// Reading and decoding image files into RGB: JPEG through TurboJPEG (with
// DCT-domain downscaling by 1/2, 1/4, 1/8), other formats through OpenCV
// imgcodecs when the build found it, .npy arrays by npy_format.h. Grayscale,
// CMYK and alpha become RGB. decode_raw instead keeps the stored depth and
// channels (16-bit, 1 to N channels, float32 arrays).
// Every failure is an ImageError whose message names the cause; callers add
// the path. Free of torch headers (the fuzz target links it without torch).
#include <cstddef>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "loader/image.h"

namespace dino_opt::loader {

class ImageError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

enum class ImageFormat { kUnknown, kJpeg, kPng, kWebp, kBmp, kTiff, kNpy };
const char* format_name(ImageFormat format);

struct DecodeOptions {
  // Images with more pixels are refused from their header, before any pixel
  // buffer is allocated (Pillow's default decompression-bomb limit). Must be
  // positive.
  int64_t max_pixels = 178956970;
};

// What the header says. width/height are those of the full-size image.
struct ImageHeader {
  ImageFormat format = ImageFormat::kUnknown;
  int width = 0;
  int height = 0;
  int channels = 0;  // PNG's colour type's, TIFF's SamplesPerPixel, a .npy array's; else 0
};

// The whole file. Throws ImageError for a missing, unreadable, non-regular or
// empty file.
std::vector<uint8_t> read_file(const std::string& path);

// Writes `bytes` to `path` atomically: a temporary file beside it, fsync,
// rename. Throws ImageError naming `path` and the failing step.
void write_file_atomically(const std::string& path, const uint8_t* bytes, size_t size);

// Format and size from the first bytes, without decoding pixels. Throws
// ImageError for unknown content, a corrupt header, a zero side, more than
// options.max_pixels pixels, or a non-JPEG format when imgcodecs is missing.
ImageHeader probe_image(const uint8_t* data, size_t size, const DecodeOptions& options = {});

// The DCT scale denominators TurboJPEG can decode at (1, 2, 4, 8), and the
// size a `width` x `height` JPEG decodes to at 1/denom.
std::pair<int, int> jpeg_scaled_size(int width, int height, int denom);

// Decodes to RGB. `scale_denom` (1, 2, 4 or 8) shrinks a JPEG in the DCT
// domain (size as jpeg_scaled_size); other formats ignore it and decode at
// full size. Throws ImageError for corrupt or truncated data. The header is
// read again from `data` and must match `header` (a default ImageHeader{}
// skips that comparison), so buffer sizes never rest on the caller's struct.
Image decode_image(const uint8_t* data, size_t size, const ImageHeader& header, int scale_denom = 1,
                   const DecodeOptions& options = {});

// Decodes at the stored depth and channel count (image.h's RawImage): 8- and
// 16-bit PNG and TIFF with 1 to 4 channels (gray + alpha PNG as 2; a PNG or
// TIFF whose decoded channels differ from its header's is refused),
// grayscale JPEG as 1 channel and colour JPEG as RGB (DCT-scaled by
// `scale_denom` as decode_image), WebP and BMP as OpenCV reads them, .npy
// arrays as stored. OpenCV's BGR(A) becomes RGB(A). Throws ImageError.
RawImage decode_raw(const uint8_t* data, size_t size, const ImageHeader& header,
                    int scale_denom = 1, const DecodeOptions& options = {});

// Encodes `view` losslessly: kPng (uint8/uint16) and kTiff (uint8, uint16,
// float32) of 1, 3 or 4 channels through OpenCV, or kNpy (any). RGB(A) is written as such (OpenCV's
// BGR order handled here). Throws ImageError for a layout the format cannot hold.
std::vector<uint8_t> encode_raw(const RawView& view, ImageFormat format);

// Baseline JPEG, 4:2:0 chroma, `quality` in [1, 100].
std::vector<uint8_t> encode_jpeg(const ImageView& image, int quality);

// True when the build has OpenCV imgcodecs (PNG, WebP, BMP, TIFF).
bool other_formats_available();

}  // namespace dino_opt::loader
