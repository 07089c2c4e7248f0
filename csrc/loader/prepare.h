#pragma once
// `dino-opt prepare`: re-encode a data set once at a bounded size, so that
// every later epoch decodes small JPEGs (the trick that makes FFCV fast).
// Free of torch headers.
#include <cstdint>
#include <string>
#include <vector>

#include "loader/image_decode.h"

namespace dino_opt::loader {

struct PrepareResult {
  int width = 0;  // of the written image
  int height = 0;
  int64_t bytes = 0;
};

// Decodes an encoded image (any readable format), shrinks it so that its
// longer side is at most `max_side` (never enlarges; DCT-scaled decoding
// first where it stays above max_side, then PIL's anti-aliased bicubic) and
// encodes it as JPEG at `quality`. Throws ImageError naming the cause.
std::vector<uint8_t> reencode_bytes(const uint8_t* data, size_t size, int max_side, int quality,
                                    const DecodeOptions& options = {},
                                    PrepareResult* result = nullptr);

// reencode_bytes on file `src`, written to `dst` atomically (temporary file,
// fsync, rename). Throws ImageError naming the file.
PrepareResult reencode_image(const std::string& src, const std::string& dst, int max_side,
                             int quality, const DecodeOptions& options = {});

}  // namespace dino_opt::loader
