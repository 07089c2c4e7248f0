#pragma once
// DINOv2's block masks of the global crops' patch tokens (its iBOT loss), on
// the loader's counter-based streams (crop_sampling.h). A mask is grown by
// random rectangles until it holds the requested number of patches; a batch's
// plan decides which global crops get a mask and how large, stratified over
// the mask ratio range. Every stream is keyed by (seed, epoch, position), so
// the masks do not depend on the thread count, resume exactly from any batch,
// and never draw from the crops' streams. Free of torch headers.
#include <cstdint>
#include <vector>

#include "loader/crop_sampling.h"

namespace dino_opt::loader {

// The mask options of the loader; off by default.
struct MaskConfig {
  bool enabled = false;
  int patch_size = 14;  // the mask grid is global_size / patch_size patches a side
  double ratio_min = 0.1, ratio_max = 0.5;  // fraction of the grid, stratified over the batch
  double probability = 0.5;                 // share of the global crops that get a mask
  double min_num_patches = 4;               // smallest rectangle's area
  double max_num_patches = 0;               // largest rectangle's area; 0: half the grid
  double min_aspect = 0.3;
  double max_aspect = 0;  // 0: 1 / min_aspect

  // Patches a side of the mask grid for global crops of `global_size`.
  int grid(int global_size) const { return global_size / patch_size; }
  // Throws std::invalid_argument naming the option that is out of range
  // (only when enabled).
  void validate(int global_size) const;
};

// The generator of one grid's masks, the options resolved.
struct BlockMasker {
  int height = 0, width = 0;
  double min_patches = 4, max_patches = 0;
  double log_aspect_lo = 0, log_aspect_hi = 0;

  BlockMasker(const MaskConfig& config, int global_size);
  BlockMasker(int height, int width, double min_patches, double max_patches, double min_aspect,
              double max_aspect);
  int num_patches() const { return height * width; }

  // Zeroes `mask` (height * width bytes, row-major) and masks at most `count`
  // patches (fewer when no rectangle fits the remainder); returns how many.
  int generate(Rng& rng, int count, uint8_t* mask) const;

  // One step of generate(): up to 10 tries at a rectangle (area uniform in
  // [min_patches, limit], log aspect uniform, both sides under the grid's)
  // that adds 1..limit new patches; returns the patches it added (0: none).
  int add_rectangle(Rng& rng, double limit, uint8_t* mask) const;
};

// The requested patch count of each of `n_crops` global crops of one batch:
// int(n_crops * probability) of them, in a random order, get
// int(n_tokens * u_i) with u_i uniform in the i-th of as many equal bins of
// [ratio_min, ratio_max]; the others 0.
std::vector<int> plan_mask_counts(Rng& rng, int n_crops, int n_tokens, const MaskConfig& config);

// The edge of bin `i` of `n` over [lo, hi]: lo + (hi - lo) * i / n (the
// Python side computes the same doubles for its upper bound).
double mask_bin_edge(double lo, double hi, int i, int n);

// The stream of a batch's plan, and of one global crop's (`view` 0 or 1) mask
// of the sample at global position `position`; neither is a crop stream.
Rng mask_plan_stream(uint64_t seed, int64_t epoch, int rank, int64_t batch);
Rng mask_stream(uint64_t seed, int64_t epoch, uint64_t position, int view);

}  // namespace dino_opt::loader
