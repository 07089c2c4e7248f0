#pragma once
// Crop + resize at the stored depth, for images that are not 8-bit RGB:
// uint8, uint16 or float32 samples with any number of channels. The filter is
// the 8-bit resampler's (resample.h: Pillow's bicubic, widened by the
// downscale factor, the same fixed-point taps, horizontal pass first); the
// arithmetic is exact where it can be, so that a plain reference reproduces
// it bit for bit:
//   integer samples: sum of tap * sample in int64, plus 2^21, shifted right by
//     22 (a floor), clipped to the type's range; the horizontal pass's output
//     is rounded so, to the source type, before the vertical pass (as Pillow's
//     8-bit intermediate);
//   float32 samples: sum of tap * sample in double, taps in order, times
//     2^-22, rounded to float32 after each pass; no clipping.
// For 3-channel uint8 this equals resize_crop_bicubic byte for byte. Free of
// torch headers.
#include <cstdint>
#include <vector>

#include "loader/image.h"
#include "loader/resample.h"

namespace dino_opt::loader {

struct RawResampleScratch {
  std::vector<int32_t> weights_x, weights_y;
  std::vector<int> start_x, count_x, start_y, count_y;
  std::vector<uint8_t> rows;  // the horizontal pass's output, source type
};

// Resizes `box` of `src` to out_width x out_height samples of src's layout
// into `dst` (rows `dst_stride` bytes apart).
void resize_crop_raw(const RawView& src, const CropBox& box, int out_width, int out_height,
                     uint8_t* dst, int64_t dst_stride, RawResampleScratch& scratch);

}  // namespace dino_opt::loader
