#pragma once
// Crop + resize with PIL's bicubic filter (a = -0.5), which widens its support
// by the downscale factor and so anti-aliases large downscales. Same
// arithmetic as Pillow's resampler (22-bit fixed-point weights, horizontal
// pass first, 8-bit intermediate), so torchvision's RandomResizedCrop on PIL
// images is matched to within rounding. Free of torch headers.
#include <cstdint>
#include <vector>

#include "loader/image.h"

namespace dino_opt::loader {

// A crop in source pixels. The filter reads only pixels of the clamp window
// [clamp_x0, clamp_x1) x [clamp_y0, clamp_y1), as if the crop had been cut
// out first (torchvision crops, then resizes); the box (x0, y0, x1, y1) may be
// fractional, as it is after DCT-scaled decoding.
struct CropBox {
  double x0, y0, x1, y1;
  int clamp_x0, clamp_y0, clamp_x1, clamp_y1;
};

// The box of an integer crop (left, top, width, height) of an image decoded at
// `fx`, `fy` times its full size, clamped to the `src_width` x `src_height`
// decoded image.
CropBox scaled_crop_box(int left, int top, int width, int height, double fx, double fy,
                        int src_width, int src_height);

// The box (x0, y0, x1, y1) of a full-size image, fractional, in an image
// decoded at `fx`, `fy` times its full size, with the whole decoded image as
// the clamp window: the filter reads past the box edges as resizing the whole
// image before cropping does (the evaluation transform).
CropBox scaled_box_in_image(double x0, double y0, double x1, double y1, double fx, double fy,
                            int src_width, int src_height);

// Pillow's bicubic filter taps along one axis, in fixed point (22 fraction
// bits): output i of `out_size` reads count[i] inputs from start[i] (absolute
// positions, inside [clamp0, clamp1)) with weights[i * taps ...], the box
// running from in0 to in1. Returns taps. The 8-bit resampler below and the
// one at any depth (resample_raw.h) share these.
int axis_coefficients(double in0, double in1, int clamp0, int clamp1, int out_size,
                      std::vector<int32_t>& weights, std::vector<int>& start,
                      std::vector<int>& count);
constexpr int kResampleFractionBits = 22;

// Reusable buffers, one per thread.
struct ResampleScratch {
  std::vector<int32_t> weights_x, weights_y;
  std::vector<int> start_x, count_x, start_y, count_y;
  std::vector<uint8_t> columns;   // the source window, transposed
  std::vector<uint8_t> filtered;  // horizontal pass output, transposed
  std::vector<uint8_t> rows;      // horizontal pass output
  std::vector<int32_t> accum;
};

// Resizes `box` of `src` to out_width x out_height RGB into `dst` (rows
// `dst_stride` bytes apart).
void resize_crop_bicubic(const ImageView& src, const CropBox& box, int out_width, int out_height,
                         uint8_t* dst, int64_t dst_stride, ResampleScratch& scratch);

}  // namespace dino_opt::loader
