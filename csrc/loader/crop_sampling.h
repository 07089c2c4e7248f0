#pragma once
// Everything random about one sample: its crop rectangles (torchvision's
// RandomResizedCrop sampling) and each crop's photometric parameters (DINO's
// per-crop probabilities, docs/design.md). Every sample draws from its own
// counter-based stream keyed by (seed, epoch, position), so the output does
// not depend on how many threads produced it. Free of torch headers.
#include <cstdint>
#include <vector>

#include "loader/photometric.h"

namespace dino_opt::loader {

// xoshiro256** seeded through splitmix64 from three keys.
class Rng {
 public:
  Rng(uint64_t seed, uint64_t key_a, uint64_t key_b);
  uint64_t next();
  double uniform();                      // [0, 1), 53 random bits
  double uniform(double lo, double hi);  // [lo, hi)
  int64_t randint(int64_t lo, int64_t hi_exclusive);
  bool bernoulli(double p);

 private:
  uint64_t s_[4];
};

// Mixes keys into one 64-bit value (splitmix64 finaliser over each key).
uint64_t mix_keys(uint64_t seed, uint64_t key_a, uint64_t key_b);

struct CropRect {
  int top = 0;
  int left = 0;
  int height = 0;
  int width = 0;
};

// torchvision RandomResizedCrop.get_params: area fraction uniform in `scale`,
// log aspect ratio uniform in log(`ratio`), 10 tries, then the centre crop
// clamped to `ratio`.
CropRect sample_resized_crop(Rng& rng, int height, int width, double scale_lo, double scale_hi,
                             double ratio_lo = 3.0 / 4.0, double ratio_hi = 4.0 / 3.0);

// The multi-crop recipe; defaults are DINO's (docs/design.md, "The algorithm").
struct AugmentConfig {
  int global_size = 224;
  int local_size = 96;
  int n_local = 8;
  double global_scale_lo = 0.4, global_scale_hi = 1.0;
  double local_scale_lo = 0.05, local_scale_hi = 0.4;
  double flip_p = 0.5;
  double jitter_p = 0.8;
  double brightness = 0.4, contrast = 0.4, saturation = 0.2, hue = 0.1;
  double grayscale_p = 0.2;
  double blur_sigma_lo = 0.1, blur_sigma_hi = 2.0;
  double blur_p_global1 = 1.0, blur_p_global2 = 0.1, blur_p_local = 0.5;
  double solarize_p_global2 = 0.2;
  // Images that are not 8-bit RGB (channel_photometric.h): additive Gaussian
  // noise after normalisation, with this probability per crop and a sigma
  // uniform in [noise_std_lo, noise_std_hi] (normalised units).
  double noise_p = 0.5;
  double noise_std_lo = 0.0, noise_std_hi = 0.1;
  // Evaluation: one crop per image, the centre crop of DINO's evaluation
  // transform (shorter side resized to `resize_size`, then the central
  // global_size square), with no flip and no photometric change; the local
  // crops and the probabilities above are ignored.
  bool center_crop = false;
  int resize_size = 0;  // 0: round(global_size * 256 / 224)

  int num_global() const { return center_crop ? 1 : 2; }
  int num_local() const { return center_crop ? 0 : n_local; }
  int num_crops() const { return num_global() + num_local(); }
  int crop_size(int crop) const { return crop < num_global() ? global_size : local_size; }
  // The shorter side the evaluation transform resizes to.
  int eval_resize() const;
  // Throws std::invalid_argument naming the field that is out of range.
  void validate() const;
};

// One (global, local) pair of crop sides: a multi-size loader draws one pair
// per batch (high-resolution adaptation, DINOv3's global_local_crop_pairs_ratios).
struct CropSizePair {
  int global_size = 224;
  int local_size = 96;
};

// The running sums of `probs`, divided by their total, for draw_size_pair;
// throws std::invalid_argument unless every probability is finite and >= 0
// and the total is within `tolerance` of 1.
std::vector<double> size_pair_cumulative(const std::vector<double>& probs, double tolerance = 1e-6);

// The pair (an index into the `cumulative` of size_pair_cumulative) of batch
// `batch` of `epoch`: one uniform draw from a stream keyed by (seed, epoch,
// batch) alone, so every rank draws the same pair for the same step and a
// resumed epoch the same pairs; a pair of probability 0 is never drawn. No
// crop or mask stream draws from it.
int draw_size_pair(uint64_t seed, int64_t epoch, int64_t batch,
                   const std::vector<double>& cumulative);

// The photometric parameters of crop `crop` (0, 1 global; then local).
PhotometricParams sample_photometric(Rng& rng, const AugmentConfig& config, int crop);

struct CropPlan {
  CropRect rect;  // in full-size image pixels
  PhotometricParams params;
  // The evaluation centre crop: the crop is the fractional box (x0, y0, x1,
  // y1) of the full-size image and its filter reads the whole image, as
  // resizing the image and then cropping it does; rect is then the smallest
  // integer rectangle holding the box, clipped to the image.
  bool whole_image = false;
  double x0 = 0, y0 = 0, x1 = 0, y1 = 0;
};

// The evaluation transform of a `width` x `height` image as one crop: resize
// (shorter side to `resize_size`, the longer one in proportion, truncated),
// then the central `size` square (offsets rounded half to even), as
// torchvision's Resize(resize_size) + CenterCrop(size) on a PIL image.
CropPlan center_crop_plan(int height, int width, int size, int resize_size);

// All crops of one `width` x `height` image, in output order (one, drawing
// nothing from `rng`, with center_crop).
std::vector<CropPlan> plan_crops(Rng& rng, int height, int width, const AugmentConfig& config);

// The largest TurboJPEG DCT scale denominator (8, 4, 2 or 1) at which every
// planned crop still covers at least its output size in decoded pixels, so
// downscaled decoding never upsamples a crop.
int choose_dct_denom(const std::vector<CropPlan>& plans, int height, int width,
                     const AugmentConfig& config);

}  // namespace dino_opt::loader
