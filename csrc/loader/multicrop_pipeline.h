#pragma once
// The per-image work of the multi-crop loader, without threads or tensors:
// decode (DCT-scaled when every crop allows), cut and resize each crop, and
// either augment + normalise it (photometric on the CPU) or keep it as uint8
// with its sampled parameters (photometric in the operator, later). Free of
// torch headers, so the fuzz target runs exactly this on arbitrary bytes.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "loader/crop_sampling.h"
#include "loader/image_decode.h"
#include "loader/photometric.h"
#include "loader/resample.h"

namespace dino_opt::loader {

// Where one crop goes: `out` when the photometric stage runs here, else `raw`
// (HWC uint8, rows raw_stride bytes apart) and `params` (a row of
// kPhotometricParamCount floats).
struct CropTarget {
  PlanarOutput out;
  uint8_t* raw = nullptr;
  int64_t raw_stride = 0;
  float* params = nullptr;
};

struct PipelineOptions {
  AugmentConfig augment;
  DecodeOptions decode;
  Normalization normalization;
  bool photometric = true;  // false: write raw crops and their parameters
  bool dct_scaling = true;
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
};

// Runs the whole pipeline on one encoded image; `targets` has
// augment.num_crops() entries. Throws ImageError for bad data.
void run_multicrop(const uint8_t* data, size_t size, Rng& rng, const PipelineOptions& options,
                   const std::vector<CropTarget>& targets, PipelineScratch& scratch,
                   PipelineTimes* times = nullptr);

}  // namespace dino_opt::loader
