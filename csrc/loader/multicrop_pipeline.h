#pragma once
// The per-image work of the multi-crop loader, without threads or tensors:
// decode (DCT-scaled when every crop allows), cut and resize each crop, and
// either augment + normalise it (photometric on the CPU) or keep it as uint8
// with its sampled parameters (photometric in the operator, later). Free of
// torch headers, so the fuzz target runs exactly this on arbitrary bytes.
//
// Two image modes: kRgb decodes every image to 8-bit RGB (the hot path);
// kNative keeps each image's stored depth and channels, which must be the
// data set's (`layout`): 3-channel uint8 images then take the hot path's
// resize and colour augmentation, any other layout the resampler at its depth
// (resample_raw.h) and the per-channel stage (channel_photometric.h).
#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "loader/channel_photometric.h"
#include "loader/crop_sampling.h"
#include "loader/image_decode.h"
#include "loader/photometric.h"
#include "loader/resample.h"
#include "loader/resample_raw.h"

namespace dino_opt::loader {

// Where one crop goes: `out` when the photometric stage runs here, else `raw`
// (HWC samples of the layout, uint8 in kRgb mode, rows raw_stride bytes apart)
// and `params` (a row of kPhotometricParamCount floats, or of
// channel_param_count(C) for a layout other than 3-channel uint8).
struct CropTarget {
  PlanarOutput out;
  uint8_t* raw = nullptr;
  int64_t raw_stride = 0;
  float* params = nullptr;
};

enum class ImageMode { kRgb, kNative };

struct PipelineOptions {
  AugmentConfig augment;
  DecodeOptions decode;
  Normalization normalization;
  bool photometric = true;  // false: write raw crops and their parameters
  bool dct_scaling = true;
  ImageMode mode = ImageMode::kRgb;
  // kNative: what every image must be, and the file that set it (named when
  // another image differs); the per-channel normalisation of layouts other
  // than 3-channel uint8.
  ImageLayout layout;
  std::string layout_from;
  ChannelNormalization channel_norm;

  // Whether crops take the 8-bit RGB stage (kRgb, or a 3-channel uint8 layout).
  bool rgb_stage() const {
    return mode == ImageMode::kRgb || layout == ImageLayout{3, SampleType::kU8};
  }
};

// Seconds spent per stage, summed by the caller.
struct PipelineTimes {
  double decode = 0;  // read + decode
  double crop = 0;    // crop sampling + resize
  double augment = 0;
};

// Per-thread buffers, reused from image to image.
struct PipelineScratch {
  ResampleScratch resample;
  std::vector<uint8_t> crop;
  std::vector<float> photometric;
  RawResampleScratch raw_resample;
};

// Runs the whole pipeline on one encoded image; `targets` has
// augment.num_crops() entries. Throws ImageError for bad data.
void run_multicrop(const uint8_t* data, size_t size, Rng& rng, const PipelineOptions& options,
                   const std::vector<CropTarget>& targets, PipelineScratch& scratch,
                   PipelineTimes* times = nullptr);

}  // namespace dino_opt::loader
