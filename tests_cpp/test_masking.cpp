// DINOv2's block masks (loader/masking.h): the generator's guarantees, the
// batch plan, the streams and the options' checks. The loader's masks are in
// test_loader.cpp; the comparison with the Python generator in tests_py.
#include <gtest/gtest.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <stdexcept>
#include <string>
#include <vector>

#include "loader/masking.h"

namespace {

using namespace dino_opt::loader;

int count_of(const std::vector<uint8_t>& mask) {
  return std::accumulate(mask.begin(), mask.end(), 0);
}

// The bounding box of the set cells: {top, left, height, width}.
std::array<int, 4> bounding_box(const std::vector<uint8_t>& mask, int height, int width) {
  int top = height, left = width, bottom = -1, right = -1;
  for (int y = 0; y < height; ++y) {
    for (int x = 0; x < width; ++x) {
      if (!mask[y * width + x]) continue;
      top = std::min(top, y);
      bottom = std::max(bottom, y);
      left = std::min(left, x);
      right = std::max(right, x);
    }
  }
  return {top, left, bottom - top + 1, right - left + 1};
}

TEST(BlockMask, NeverMasksMoreThanRequested) {
  Rng rng(1, 2, 3);
  for (auto [h, w] : {std::pair{14, 14}, std::pair{16, 16}, std::pair{7, 5}, std::pair{2, 2}}) {
    const BlockMasker masker(h, w, 4, 0.5 * h * w, 0.3, 0);
    std::vector<uint8_t> mask(h * w, 7);  // generate() clears what it is given
    for (int request = 0; request <= h * w; ++request) {
      for (int i = 0; i < 20; ++i) {
        const int masked = masker.generate(rng, request, mask.data());
        ASSERT_EQ(masked, count_of(mask)) << h << "x" << w << " request " << request;
        ASSERT_LE(masked, request) << h << "x" << w;
        for (uint8_t v : mask) ASSERT_LE(v, 1);
      }
    }
  }
}

TEST(BlockMask, ReachesTheRequestOnAverage) {
  // 14 x 14 as DINOv2's ViT-*/14 at 224 px, requests over its ratio range.
  const BlockMasker masker(14, 14, 4, 98, 0.3, 0);
  Rng rng(5, 0, 0);
  std::vector<uint8_t> mask(196);
  for (int request : {20, 50, 98}) {
    double sum = 0;
    for (int i = 0; i < 400; ++i) sum += masker.generate(rng, request, mask.data());
    EXPECT_GT(sum / 400, 0.9 * request) << "request " << request;
  }
}

TEST(BlockMask, RectanglesRespectTheAreaAndAspectBounds) {
  for (const double min_aspect : {0.3, 0.5, 1.0}) {
    const double max_aspect = 1.0 / min_aspect;
    const BlockMasker masker(14, 12, 4, 98, min_aspect, 0);
    Rng rng(11, 0, static_cast<uint64_t>(min_aspect * 10));
    std::vector<uint8_t> mask(14 * 12);
    int seen = 0;
    for (int i = 0; i < 2000; ++i) {
      const double limit = rng.uniform(4, 98);
      std::fill(mask.begin(), mask.end(), 0);
      const int added = masker.add_rectangle(rng, limit, mask.data());
      ASSERT_EQ(added, count_of(mask));
      if (added == 0) continue;
      ++seen;
      const auto [top, left, h, w] = bounding_box(mask, 14, 12);
      ASSERT_EQ(h * w, added) << "not one rectangle";
      ASSERT_LT(h, 14);
      ASSERT_LT(w, 12);
      ASSERT_LE(added, limit);
      // h and w are rounded sqrt(area * aspect) and sqrt(area / aspect).
      ASSERT_GE((h + 0.5) * (w + 0.5), 4.0) << h << "x" << w;
      ASSERT_LE((h - 0.5) / (w + 0.5), max_aspect + 1e-12) << h << "x" << w;
      ASSERT_GE((h + 0.5) / (w - 0.5), min_aspect - 1e-12) << h << "x" << w;
    }
    EXPECT_GT(seen, 1900);
  }
}

TEST(BlockMask, AddsToAMaskWithoutRemovingAndRespectsTheLimit) {
  const BlockMasker masker(10, 10, 4, 50, 0.3, 0);
  Rng rng(3, 3, 3);
  std::vector<uint8_t> mask(100);
  for (int i = 0; i < 500; ++i) {
    masker.generate(rng, 30, mask.data());
    const std::vector<uint8_t> before = mask;
    const int added = masker.add_rectangle(rng, 5, mask.data());
    ASSERT_LE(added, 5);
    ASSERT_EQ(count_of(mask) - count_of(before), added);
    for (int k = 0; k < 100; ++k) ASSERT_GE(mask[k], before[k]);
  }
}

TEST(BlockMask, StreamsAreDeterministicAndDistinct) {
  const BlockMasker masker(14, 14, 4, 98, 0.3, 0);
  auto draw = [&](Rng rng) {
    std::vector<uint8_t> mask(196);
    masker.generate(rng, 60, mask.data());
    return mask;
  };
  const auto a = draw(mask_stream(7, 2, 5, 0));
  EXPECT_EQ(a, draw(mask_stream(7, 2, 5, 0)));
  EXPECT_NE(a, draw(mask_stream(7, 2, 5, 1)));
  EXPECT_NE(a, draw(mask_stream(7, 3, 5, 0)));
  EXPECT_NE(a, draw(mask_stream(7, 2, 6, 0)));
  EXPECT_NE(a, draw(mask_stream(8, 2, 5, 0)));
  // Neither a crop stream (seed, epoch, position) nor the plan's.
  EXPECT_NE(mask_stream(7, 2, 5, 0).next(), Rng(7, 2, 5).next());
  EXPECT_NE(mask_plan_stream(7, 2, 0, 5).next(), Rng(7, 2, 5).next());
  EXPECT_NE(mask_plan_stream(7, 2, 0, 5).next(), mask_plan_stream(7, 2, 1, 5).next());
  EXPECT_EQ(mask_plan_stream(7, 2, 1, 5).next(), mask_plan_stream(7, 2, 1, 5).next());
}

TEST(MaskPlan, MasksTheRightShareWithCountsInTheirBins) {
  MaskConfig config;
  config.enabled = true;
  const int n_tokens = 196;
  for (const double p : {0.0, 0.3, 0.5, 1.0}) {
    for (const int n_crops : {2, 8, 128}) {
      for (int batch = 0; batch < 20; ++batch) {
        config.probability = p;
        Rng rng = mask_plan_stream(1, 0, 0, batch);
        std::vector<int> counts = plan_mask_counts(rng, n_crops, n_tokens, config);
        ASSERT_EQ(static_cast<int>(counts.size()), n_crops);
        const int n = static_cast<int>(n_crops * p);
        std::vector<int> masked;
        for (int c : counts)
          if (c > 0) masked.push_back(c);
        ASSERT_EQ(static_cast<int>(masked.size()), n) << "p " << p << " crops " << n_crops;
        std::sort(masked.begin(), masked.end());
        for (int i = 0; i < n; ++i) {
          const double lo = mask_bin_edge(0.1, 0.5, i, n), hi = mask_bin_edge(0.1, 0.5, i + 1, n);
          ASSERT_GE(masked[i], static_cast<int>(n_tokens * lo));
          ASSERT_LE(masked[i], static_cast<int>(n_tokens * hi));
        }
      }
    }
  }
}

TEST(MaskPlan, ShufflesWhichCropsAreMasked) {
  MaskConfig config;
  std::vector<int> times_masked(16, 0);
  for (int batch = 0; batch < 400; ++batch) {
    Rng rng = mask_plan_stream(3, 1, 0, batch);
    const auto counts = plan_mask_counts(rng, 16, 196, config);
    for (int c = 0; c < 16; ++c) times_masked[c] += counts[c] > 0;
  }
  // Each crop is masked in about half of the batches (binomial, sd 10).
  for (int c = 0; c < 16; ++c) EXPECT_NEAR(times_masked[c], 200, 60) << "crop " << c;
}

TEST(MaskConfig, ErrorsNameTheOption) {
  auto expect_error = [](MaskConfig c, int global_size, const std::string& name) {
    c.enabled = true;
    try {
      c.validate(global_size);
      ADD_FAILURE() << "expected an error naming " << name;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(name), std::string::npos) << e.what();
    }
  };
  MaskConfig c;
  c.patch_size = 14;
  expect_error(c, 32, "patch_size");
  c.patch_size = 0;
  expect_error(c, 32, "patch_size");
  c = MaskConfig{};
  c.patch_size = 16;
  c.ratio_min = 0.6;
  expect_error(c, 32, "ratio");
  c = MaskConfig{};
  c.patch_size = 16;
  c.probability = 1.5;
  expect_error(c, 32, "probability");
  c = MaskConfig{};
  c.patch_size = 16;
  c.min_num_patches = 0;
  expect_error(c, 32, "min_num_patches");
  c = MaskConfig{};
  c.patch_size = 16;
  c.max_num_patches = 2;
  expect_error(c, 32, "max_num_patches");
  c = MaskConfig{};
  c.patch_size = 16;
  c.min_aspect = -1;
  expect_error(c, 32, "min_aspect");
  c = MaskConfig{};
  c.patch_size = 16;
  c.max_aspect = 0.1;
  expect_error(c, 32, "max_aspect");
  c = MaskConfig{};
  c.patch_size = 14;
  c.validate(32);  // off: nothing is checked
  c.enabled = true;
  c.validate(224);
}

}  // namespace
