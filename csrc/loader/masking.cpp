#include "loader/masking.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace dino_opt::loader {
namespace {

constexpr uint64_t kMaskPlanKey = 0x4d41534b504c414eull;  // "MASKPLAN": a batch's plan
constexpr uint64_t kMaskKey = 0x4d41534bull;              // "MASK": one crop's mask
constexpr int kRectangleTries = 10;

[[noreturn]] void fail(const std::string& what) { throw std::invalid_argument("masks: " + what); }

std::string pair_text(double lo, double hi) {
  return "(" + std::to_string(lo) + ", " + std::to_string(hi) + ")";
}

}  // namespace

void MaskConfig::validate(int global_size) const {
  if (!enabled) return;
  if (patch_size < 1 || global_size % patch_size != 0) {
    fail("patch_size " + std::to_string(patch_size) + " must divide global_size " +
         std::to_string(global_size) + " (the mask grid is global_size / patch_size a side)");
  }
  if (!(ratio_min >= 0.0 && ratio_min <= ratio_max && ratio_max <= 1.0))
    fail("ratio must satisfy 0 <= min <= max <= 1, got " + pair_text(ratio_min, ratio_max));
  if (!(probability >= 0.0 && probability <= 1.0))
    fail("probability must be in [0, 1], got " + std::to_string(probability));
  if (!(min_num_patches >= 1.0))
    fail("min_num_patches must be >= 1, got " + std::to_string(min_num_patches));
  if (!(max_num_patches == 0.0 || max_num_patches >= min_num_patches)) {
    fail("max_num_patches must be >= min_num_patches (" + std::to_string(min_num_patches) +
         "), got " + std::to_string(max_num_patches));
  }
  if (!(min_aspect > 0.0 && std::isfinite(min_aspect)))
    fail("min_aspect must be > 0, got " + std::to_string(min_aspect));
  if (!(max_aspect == 0.0 || (max_aspect >= min_aspect && std::isfinite(max_aspect)))) {
    fail("max_aspect must be >= min_aspect (" + std::to_string(min_aspect) + "), got " +
         std::to_string(max_aspect));
  }
}

BlockMasker::BlockMasker(int height, int width, double min_patches, double max_patches,
                         double min_aspect, double max_aspect)
    : height(height),
      width(width),
      min_patches(min_patches),
      max_patches(max_patches),
      log_aspect_lo(std::log(min_aspect)),
      log_aspect_hi(std::log(max_aspect > 0.0 ? max_aspect : 1.0 / min_aspect)) {}

BlockMasker::BlockMasker(const MaskConfig& c, int global_size)
    : BlockMasker(c.grid(global_size), c.grid(global_size), c.min_num_patches,
                  c.max_num_patches > 0.0 ? c.max_num_patches
                                          : 0.5 * c.grid(global_size) * c.grid(global_size),
                  c.min_aspect, c.max_aspect) {}

int BlockMasker::add_rectangle(Rng& rng, double limit, uint8_t* mask) const {
  for (int attempt = 0; attempt < kRectangleTries; ++attempt) {
    const double area = rng.uniform(min_patches, limit);
    const double aspect = std::exp(rng.uniform(log_aspect_lo, log_aspect_hi));
    // Python's round() rounds half to even, as std::nearbyint does by default.
    const int h = static_cast<int>(std::nearbyint(std::sqrt(area * aspect)));
    const int w = static_cast<int>(std::nearbyint(std::sqrt(area / aspect)));
    if (w >= width || h >= height) continue;
    const int top = static_cast<int>(rng.randint(0, height - h + 1));
    const int left = static_cast<int>(rng.randint(0, width - w + 1));
    int already = 0;
    for (int y = top; y < top + h; ++y)
      for (int x = left; x < left + w; ++x) already += mask[y * width + x];
    const int added = h * w - already;
    if (added <= 0 || added > limit) continue;  // nothing new, or more than the remainder
    for (int y = top; y < top + h; ++y) std::fill_n(mask + y * width + left, w, uint8_t{1});
    return added;
  }
  return 0;
}

int BlockMasker::generate(Rng& rng, int count, uint8_t* mask) const {
  std::fill_n(mask, num_patches(), uint8_t{0});
  int masked = 0;
  while (masked < count) {
    const double limit = std::min(static_cast<double>(count - masked), max_patches);
    const int added = add_rectangle(rng, limit, mask);
    if (added == 0) break;
    masked += added;
  }
  return masked;
}

double mask_bin_edge(double lo, double hi, int i, int n) { return lo + (hi - lo) * i / n; }

std::vector<int> plan_mask_counts(Rng& rng, int n_crops, int n_tokens, const MaskConfig& config) {
  const int n = static_cast<int>(n_crops * config.probability);
  std::vector<int> counts(n_crops, 0);
  for (int i = 0; i < n; ++i) {
    const double lo = mask_bin_edge(config.ratio_min, config.ratio_max, i, n);
    const double hi = mask_bin_edge(config.ratio_min, config.ratio_max, i + 1, n);
    // The cap keeps the count within the bin's bound should lo + (hi - lo) * u round up to hi.
    const int cap = static_cast<int>(n_tokens * hi);
    counts[i] = std::min(static_cast<int>(n_tokens * rng.uniform(lo, hi)), cap);
  }
  for (int i = n_crops - 1; i > 0; --i) std::swap(counts[i], counts[rng.randint(0, i + 1)]);
  return counts;
}

Rng mask_plan_stream(uint64_t seed, int64_t epoch, int rank, int64_t batch) {
  return Rng(mix_keys(seed, kMaskPlanKey, static_cast<uint64_t>(epoch)),
             static_cast<uint64_t>(rank), static_cast<uint64_t>(batch));
}

Rng mask_stream(uint64_t seed, int64_t epoch, uint64_t position, int view) {
  return Rng(mix_keys(seed, kMaskKey, static_cast<uint64_t>(epoch)), position,
             static_cast<uint64_t>(view));
}

}  // namespace dino_opt::loader
