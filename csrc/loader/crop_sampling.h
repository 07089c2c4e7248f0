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

  int num_crops() const { return 2 + n_local; }
  int crop_size(int crop) const { return crop < 2 ? global_size : local_size; }
  // Throws std::invalid_argument naming the field that is out of range.
  void validate() const;
};

// The photometric parameters of crop `crop` (0, 1 global; then local).
PhotometricParams sample_photometric(Rng& rng, const AugmentConfig& config, int crop);

struct CropPlan {
  CropRect rect;  // in full-size image pixels
  PhotometricParams params;
};

// All crops of one `width` x `height` image, in output order.
std::vector<CropPlan> plan_crops(Rng& rng, int height, int width, const AugmentConfig& config);

// The largest TurboJPEG DCT scale denominator (8, 4, 2 or 1) at which every
// planned crop still covers at least its output size in decoded pixels, so
// downscaled decoding never upsamples a crop.
int choose_dct_denom(const std::vector<CropPlan>& plans, int height, int width,
                     const AugmentConfig& config);

}  // namespace dino_opt::loader
