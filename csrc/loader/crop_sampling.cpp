#include "loader/crop_sampling.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

#include "loader/image_decode.h"

namespace dino_opt::loader {
namespace {

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

constexpr uint64_t kSizePairKey = 0x53495a4550414952ull;  // "SIZEPAIR": a batch's crop sizes

}  // namespace

uint64_t mix_keys(uint64_t seed, uint64_t key_a, uint64_t key_b) {
  uint64_t state = seed;
  uint64_t h = splitmix64(state);
  state = h ^ key_a;
  h = splitmix64(state);
  state = h ^ key_b;
  return splitmix64(state);
}

Rng::Rng(uint64_t seed, uint64_t key_a, uint64_t key_b) {
  uint64_t state = mix_keys(seed, key_a, key_b);
  for (auto& s : s_) s = splitmix64(state);
}

uint64_t Rng::next() {
  const uint64_t result = rotl(s_[1] * 5, 7) * 9;
  const uint64_t t = s_[1] << 17;
  s_[2] ^= s_[0];
  s_[3] ^= s_[1];
  s_[1] ^= s_[2];
  s_[0] ^= s_[3];
  s_[2] ^= t;
  s_[3] = rotl(s_[3], 45);
  return result;
}

double Rng::uniform() { return static_cast<double>(next() >> 11) * 0x1.0p-53; }

double Rng::uniform(double lo, double hi) { return lo + (hi - lo) * uniform(); }

int64_t Rng::randint(int64_t lo, int64_t hi_exclusive) {
  const uint64_t span = static_cast<uint64_t>(hi_exclusive - lo);
  if (span <= 1) return lo;
  // Rejection keeps every value equally likely.
  const uint64_t limit = UINT64_MAX - UINT64_MAX % span;
  uint64_t x;
  do x = next();
  while (x >= limit);
  return lo + static_cast<int64_t>(x % span);
}

bool Rng::bernoulli(double p) { return uniform() < p; }

CropRect sample_resized_crop(Rng& rng, int height, int width, double scale_lo, double scale_hi,
                             double ratio_lo, double ratio_hi) {
  const double area = static_cast<double>(height) * width;
  const double log_lo = std::log(ratio_lo), log_hi = std::log(ratio_hi);
  for (int attempt = 0; attempt < 10; ++attempt) {
    const double target_area = area * rng.uniform(scale_lo, scale_hi);
    const double aspect = std::exp(rng.uniform(log_lo, log_hi));
    // Python's round() rounds half to even, as std::nearbyint does by default.
    const int w = static_cast<int>(std::nearbyint(std::sqrt(target_area * aspect)));
    const int h = static_cast<int>(std::nearbyint(std::sqrt(target_area / aspect)));
    if (w > 0 && w <= width && h > 0 && h <= height) {
      const int top = static_cast<int>(rng.randint(0, height - h + 1));
      const int left = static_cast<int>(rng.randint(0, width - w + 1));
      return {top, left, h, w};
    }
  }
  const double in_ratio = static_cast<double>(width) / height;
  int w = width, h = height;
  if (in_ratio < ratio_lo) {
    h = static_cast<int>(std::nearbyint(w / ratio_lo));
  } else if (in_ratio > ratio_hi) {
    w = static_cast<int>(std::nearbyint(h * ratio_hi));
  }
  h = std::clamp(h, 1, height);
  w = std::clamp(w, 1, width);
  return {(height - h) / 2, (width - w) / 2, h, w};
}

int AugmentConfig::eval_resize() const {
  // global_size * 256 / 224 is never a half (16 * size is even, 14 k + 7 odd),
  // so rounding to nearest is Python's round().
  return resize_size > 0 ? resize_size
                         : static_cast<int>(std::nearbyint(global_size * 256.0 / 224.0));
}

void AugmentConfig::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  auto probability = [&](double p, const char* name) {
    if (!(p >= 0.0 && p <= 1.0))
      fail(std::string(name) + " must be in [0, 1], got " + std::to_string(p));
  };
  auto scale = [&](double lo, double hi, const char* name) {
    if (!(lo > 0.0 && lo <= hi && hi <= 1.0))
      fail(std::string(name) + " must satisfy 0 < lo <= hi <= 1, got (" + std::to_string(lo) +
           ", " + std::to_string(hi) + ")");
  };
  if (global_size < 1 || global_size > 4096)
    fail("global_size must be in [1, 4096], got " + std::to_string(global_size));
  if (local_size < 1 || local_size > 4096)
    fail("local_size must be in [1, 4096], got " + std::to_string(local_size));
  if (center_crop &&
      (resize_size < 0 || resize_size > 8192 || (resize_size > 0 && resize_size < global_size)))
    fail("resize_size must be 0 or in [global_size, 8192], got " + std::to_string(resize_size) +
         " with global_size " + std::to_string(global_size));
  if (n_local < 0 || n_local > 64)
    fail("n_local must be in [0, 64], got " + std::to_string(n_local));
  scale(global_scale_lo, global_scale_hi, "global_scale");
  scale(local_scale_lo, local_scale_hi, "local_scale");
  probability(flip_p, "flip_p");
  probability(jitter_p, "jitter_p");
  probability(grayscale_p, "grayscale_p");
  probability(blur_p_global1, "blur_p_global1");
  probability(blur_p_global2, "blur_p_global2");
  probability(blur_p_local, "blur_p_local");
  probability(solarize_p_global2, "solarize_p_global2");
  if (!(brightness >= 0 && contrast >= 0 && saturation >= 0))
    fail("colour jitter strengths must be >= 0");
  if (!(hue >= 0 && hue <= 0.5)) fail("hue must be in [0, 0.5], got " + std::to_string(hue));
  if (!(blur_sigma_lo > 0 && blur_sigma_lo <= blur_sigma_hi && blur_sigma_hi <= 64))
    fail("blur sigma range must satisfy 0 < lo <= hi <= 64");
  probability(noise_p, "noise_p");
  if (!(noise_std_lo >= 0 && noise_std_lo <= noise_std_hi && noise_std_hi <= 10))
    fail("noise_std range must satisfy 0 <= lo <= hi <= 10");
}

std::vector<double> size_pair_cumulative(const std::vector<double>& probs, double tolerance) {
  if (probs.empty()) throw std::invalid_argument("crop size ratios: none given");
  double total = 0;
  for (size_t k = 0; k < probs.size(); ++k) {
    if (!(probs[k] >= 0.0 && std::isfinite(probs[k]))) {
      throw std::invalid_argument("crop size ratio " + std::to_string(k) +
                                  " must be a finite number >= 0, got " + std::to_string(probs[k]));
    }
    total += probs[k];
  }
  if (!(std::abs(total - 1.0) <= tolerance))
    throw std::invalid_argument("crop size ratios must sum to 1, got " + std::to_string(total));
  std::vector<double> cumulative(probs.size());
  double sum = 0;
  for (size_t k = 0; k < probs.size(); ++k) {
    sum += probs[k];
    cumulative[k] = sum / total;
  }
  return cumulative;
}

int draw_size_pair(uint64_t seed, int64_t epoch, int64_t batch,
                   const std::vector<double>& cumulative) {
  const int n = static_cast<int>(cumulative.size());
  if (n <= 1) return 0;
  Rng rng(mix_keys(seed, kSizePairKey, static_cast<uint64_t>(epoch)), static_cast<uint64_t>(batch),
          0);
  const double u = rng.uniform();
  for (int k = 0; k < n; ++k) {
    if (u < cumulative[k]) return k;
  }
  // Rounding left the last sum under 1: the last pair with a probability.
  int k = n - 1;
  while (k > 0 && cumulative[k] == cumulative[k - 1]) --k;
  return k;
}

PhotometricParams sample_photometric(Rng& rng, const AugmentConfig& config, int crop) {
  PhotometricParams p;
  p.flip = rng.bernoulli(config.flip_p);
  p.jitter = rng.bernoulli(config.jitter_p);
  if (p.jitter) {
    // ColorJitter.get_params: the order first (a random permutation), then
    // each factor uniform in [max(0, 1 - s), 1 + s], hue in [-h, h].
    for (int i = 0; i < 4; ++i) p.order[i] = static_cast<int8_t>(i);
    for (int i = 3; i > 0; --i) std::swap(p.order[i], p.order[rng.randint(0, i + 1)]);
    auto factor = [&](double s) {
      return static_cast<float>(rng.uniform(std::max(0.0, 1.0 - s), 1.0 + s));
    };
    p.brightness = factor(config.brightness);
    p.contrast = factor(config.contrast);
    p.saturation = factor(config.saturation);
    p.hue = static_cast<float>(rng.uniform(-config.hue, config.hue));
  }
  p.grayscale = rng.bernoulli(config.grayscale_p);
  const double blur_p = crop == 0   ? config.blur_p_global1
                        : crop == 1 ? config.blur_p_global2
                                    : config.blur_p_local;
  if (rng.bernoulli(blur_p)) {
    p.blur_sigma = static_cast<float>(rng.uniform(config.blur_sigma_lo, config.blur_sigma_hi));
  }
  p.solarize = crop == 1 && rng.bernoulli(config.solarize_p_global2);
  return p;
}

CropPlan center_crop_plan(int height, int width, int size, int resize_size) {
  // The resized image: Python's int() truncates the longer side.
  const int rw = width <= height
                     ? resize_size
                     : static_cast<int>(static_cast<double>(resize_size) * width / height);
  const int rh = width <= height
                     ? static_cast<int>(static_cast<double>(resize_size) * height / width)
                     : resize_size;
  // CenterCrop's offsets, round() half to even (std::nearbyint's default mode).
  const double left = std::nearbyint((rw - size) / 2.0), top = std::nearbyint((rh - size) / 2.0);
  const double sx = static_cast<double>(width) / rw, sy = static_cast<double>(height) / rh;
  CropPlan plan;
  plan.whole_image = true;
  plan.x0 = left * sx;
  plan.x1 = (left + size) * sx;
  plan.y0 = top * sy;
  plan.y1 = (top + size) * sy;
  const int l = static_cast<int>(std::floor(plan.x0)), t = static_cast<int>(std::floor(plan.y0));
  const int r = std::min(width, static_cast<int>(std::ceil(plan.x1)));
  const int b = std::min(height, static_cast<int>(std::ceil(plan.y1)));
  plan.rect = {t, l, std::max(1, b - t), std::max(1, r - l)};
  return plan;
}

std::vector<CropPlan> plan_crops(Rng& rng, int height, int width, const AugmentConfig& config) {
  if (config.center_crop) {
    return {center_crop_plan(height, width, config.global_size, config.eval_resize())};
  }
  std::vector<CropPlan> plans(config.num_crops());
  for (int c = 0; c < config.num_crops(); ++c) {
    const bool global = c < 2;
    plans[c].rect = sample_resized_crop(rng, height, width,
                                        global ? config.global_scale_lo : config.local_scale_lo,
                                        global ? config.global_scale_hi : config.local_scale_hi);
    plans[c].params = sample_photometric(rng, config, c);
  }
  return plans;
}

int choose_dct_denom(const std::vector<CropPlan>& plans, int height, int width,
                     const AugmentConfig& config) {
  for (int denom : {8, 4, 2}) {
    const auto [w, h] = jpeg_scaled_size(width, height, denom);
    const double fx = static_cast<double>(w) / width, fy = static_cast<double>(h) / height;
    bool fits = true;
    for (size_t c = 0; c < plans.size() && fits; ++c) {
      const int size = config.crop_size(static_cast<int>(c));
      const CropPlan& p = plans[c];
      const double cw = p.whole_image ? p.x1 - p.x0 : p.rect.width;
      const double ch = p.whole_image ? p.y1 - p.y0 : p.rect.height;
      fits = cw * fx >= size && ch * fy >= size;
    }
    if (fits) return denom;
  }
  return 1;
}

}  // namespace dino_opt::loader
