// The loader's sampling, resize and thread pool (the image decoder has its own
// file; the sampling statistics against torchvision are in tests_py).
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <fstream>
#include <numeric>
#include <random>
#include <thread>
#include <tuple>

#include "loader/crop_sampling.h"
#include "loader/image_decode.h"
#include "loader/masking.h"
#include "loader/multicrop_loader.h"
#include "loader/resample.h"
#include "test_util.h"

namespace {

using namespace dino_opt::loader;

TEST(LoaderRng, StreamsDependOnEveryKey) {
  Rng a(1, 2, 3), b(1, 2, 3), c(1, 2, 4), d(2, 2, 3);
  const uint64_t x = a.next();
  EXPECT_EQ(x, b.next());
  EXPECT_NE(x, c.next());
  EXPECT_NE(x, d.next());
  for (int i = 0; i < 10000; ++i) {
    const double u = a.uniform();
    ASSERT_GE(u, 0.0);
    ASSERT_LT(u, 1.0);
    const int64_t k = a.randint(-3, 4);
    ASSERT_GE(k, -3);
    ASSERT_LT(k, 4);
  }
}

TEST(LoaderSampling, CropsStayInsideTheImage) {
  Rng rng(7, 0, 0);
  for (auto [h, w] :
       {std::pair{300, 500}, std::pair{3, 10000}, std::pair{1, 1}, std::pair{1000, 2}}) {
    for (int i = 0; i < 2000; ++i) {
      const CropRect r = sample_resized_crop(rng, h, w, 0.05, 1.0);
      ASSERT_GE(r.top, 0);
      ASSERT_GE(r.left, 0);
      ASSERT_GE(r.height, 1);
      ASSERT_GE(r.width, 1);
      ASSERT_LE(r.top + r.height, h);
      ASSERT_LE(r.left + r.width, w);
    }
  }
}

TEST(LoaderSampling, DctScaleNeverUpsamplesACrop) {
  AugmentConfig config;
  Rng rng(3, 0, 0);
  for (int i = 0; i < 500; ++i) {
    const auto plans = plan_crops(rng, 1200, 1600, config);
    const int denom = choose_dct_denom(plans, 1200, 1600, config);
    const auto [w, h] = jpeg_scaled_size(1600, 1200, denom);
    for (int c = 0; c < config.num_crops(); ++c) {
      ASSERT_GE(plans[c].rect.width * w / 1600.0, config.crop_size(c));
      ASSERT_GE(plans[c].rect.height * h / 1200.0, config.crop_size(c));
    }
  }
  // A crop barely larger than its output allows no scaling.
  std::vector<CropPlan> plans(config.num_crops());
  for (auto& p : plans) p.rect = {0, 0, 1000, 1000};
  plans[2].rect = {0, 0, 100, 100};
  EXPECT_EQ(choose_dct_denom(plans, 1200, 1600, config), 1);
  plans[2].rect = {0, 0, 400, 400};
  EXPECT_EQ(choose_dct_denom(plans, 1200, 1600, config), 4);
}

TEST(LoaderSampling, ConfigErrorsNameTheField) {
  AugmentConfig c;
  c.local_scale_lo = 0.5;
  c.local_scale_hi = 0.1;
  try {
    c.validate();
    FAIL() << "expected an error";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("local_scale"), std::string::npos) << e.what();
  }
}

Image random_image(int w, int h, uint32_t seed) {
  Image img(w, h);
  std::mt19937 gen(seed);
  for (auto& p : img.pixels) p = static_cast<uint8_t>(gen());
  return img;
}

TEST(LoaderSizePairs, DrawsFollowTheRatiosAndDependOnlyOnSeedEpochAndBatch) {
  const std::vector<double> probs = {0.3, 0.3, 0.3, 0.05, 0.05, 0.0};
  const auto cumulative = size_pair_cumulative(probs);
  ASSERT_EQ(cumulative.size(), probs.size());
  EXPECT_DOUBLE_EQ(cumulative.back(), 1.0);
  constexpr int kDraws = 200000;
  std::vector<int> counts(probs.size(), 0);
  int changed_by_epoch = 0;
  for (int64_t batch = 0; batch < kDraws; ++batch) {
    const int k = draw_size_pair(11, 3, batch, cumulative);
    ASSERT_GE(k, 0);
    ASSERT_LT(k, static_cast<int>(probs.size()));
    ASSERT_EQ(k, draw_size_pair(11, 3, batch, cumulative));  // a pure function of its keys
    ++counts[k];
    changed_by_epoch += k != draw_size_pair(11, 4, batch, cumulative);
  }
  for (size_t k = 0; k < probs.size(); ++k) {
    // 6 standard deviations of a binomial count (the draws are fixed by the seed).
    const double mean = kDraws * probs[k], sd = std::sqrt(kDraws * probs[k] * (1 - probs[k]));
    EXPECT_NEAR(counts[k], mean, 6 * sd + 1e-9) << "pair " << k;
  }
  EXPECT_EQ(counts.back(), 0);  // probability 0: never
  EXPECT_GT(changed_by_epoch, kDraws / 2);
  EXPECT_EQ(draw_size_pair(11, 3, 5, {1.0}), 0);
  EXPECT_THROW(size_pair_cumulative({0.5, 0.4}), std::invalid_argument);
  EXPECT_THROW(size_pair_cumulative({1.5, -0.5}), std::invalid_argument);
  EXPECT_THROW(size_pair_cumulative({}), std::invalid_argument);
  EXPECT_NO_THROW(size_pair_cumulative({0.1 + 0.2, 0.7}));  // rounding is not an error
}

TEST(LoaderResample, SameSizeIsACopyAndConstantStaysConstant) {
  const Image img = random_image(40, 30, 1);
  ResampleScratch s;
  Image out(20, 10);
  resize_crop_bicubic(img.view(), scaled_crop_box(5, 7, 20, 10, 1, 1, 40, 30), 20, 10,
                      out.pixels.data(), 60, s);
  for (int y = 0; y < 10; ++y) {
    for (int x = 0; x < 60; ++x) ASSERT_EQ(out.row(y)[x], img.view().row(y + 7)[15 + x]);
  }
  Image flat(50, 50);
  std::fill(flat.pixels.begin(), flat.pixels.end(), 173);
  for (int size : {7, 50, 123}) {
    Image o(size, size);
    resize_crop_bicubic(flat.view(), scaled_crop_box(3, 2, 41, 45, 1, 1, 50, 50), size, size,
                        o.pixels.data(), 3 * size, s);
    for (uint8_t v : o.pixels) ASSERT_EQ(v, 173);
  }
  std::vector<uint8_t> sink(75);
  EXPECT_THROW(
      resize_crop_bicubic(flat.view(), CropBox{0, 0, 0, 10, 0, 0, 1, 10}, 5, 5, sink.data(), 15, s),
      std::invalid_argument);
}

TEST(LoaderSampling, CenterCropIsResizeThenCenterCrop) {
  // 500 x 375 at 224: resized to 341 x 256 (int(256 * 500 / 375) = 341),
  // offsets round(58.5) = 58 (half to even) and 16.
  CropPlan p = center_crop_plan(375, 500, 224, 256);
  EXPECT_TRUE(p.whole_image);
  EXPECT_DOUBLE_EQ(p.x0, 58 * 500.0 / 341);
  EXPECT_DOUBLE_EQ(p.x1, 282 * 500.0 / 341);
  EXPECT_DOUBLE_EQ(p.y0, 16 * 375.0 / 256);
  EXPECT_DOUBLE_EQ(p.y1, 240 * 375.0 / 256);
  AugmentConfig config;
  config.center_crop = true;
  EXPECT_EQ(config.eval_resize(), 256);
  EXPECT_EQ(config.num_crops(), 1);
  Rng rng(1, 2, 3);
  const auto plans = plan_crops(rng, 375, 500, config);
  ASSERT_EQ(plans.size(), 1u);
  EXPECT_EQ(plans[0].x0, p.x0);
  EXPECT_FALSE(plans[0].params.flip || plans[0].params.jitter || plans[0].params.grayscale ||
               plans[0].params.solarize || plans[0].params.blur_sigma > 0);
  config.resize_size = 100;
  EXPECT_THROW(config.validate(), std::invalid_argument);

  // Through the resampler: the box of the whole image equals resizing the
  // whole image and cutting out the centre, for portrait, landscape, square.
  ResampleScratch s;
  for (auto [h, w, size] : {std::tuple{61, 47, 20}, std::tuple{33, 90, 16}, std::tuple{40, 40, 9},
                            std::tuple{13, 11, 24}}) {
    const Image img = random_image(w, h, h * w);
    const int resize = static_cast<int>(std::nearbyint(size * 256.0 / 224.0));
    const CropPlan q = center_crop_plan(h, w, size, resize);
    const int rw = w <= h ? resize : static_cast<int>(static_cast<double>(resize) * w / h);
    const int rh = w <= h ? static_cast<int>(static_cast<double>(resize) * h / w) : resize;
    Image full(rw, rh);
    resize_crop_bicubic(img.view(), scaled_crop_box(0, 0, w, h, 1, 1, w, h), rw, rh,
                        full.pixels.data(), 3 * rw, s);
    Image crop(size, size);
    resize_crop_bicubic(img.view(), scaled_box_in_image(q.x0, q.y0, q.x1, q.y1, 1, 1, w, h), size,
                        size, crop.pixels.data(), 3 * size, s);
    const int left = static_cast<int>(std::nearbyint((rw - size) / 2.0));
    const int top = static_cast<int>(std::nearbyint((rh - size) / 2.0));
    for (int y = 0; y < size; ++y) {
      for (int x = 0; x < 3 * size; ++x)
        ASSERT_EQ(crop.row(y)[x], full.row(top + y)[3 * left + x])
            << h << "x" << w << " at " << y << ", " << x / 3;
    }
  }
}

// A directory of small JPEGs, removed at the end of the test.
class LoaderThreads : public ::testing::Test {
 protected:
  void SetUp() override {
    for (int i = 0; i < 12; ++i) {
      const Image img = random_image(40 + 7 * i, 60 - 2 * i, i);
      const std::string p = dir_ / ("img" + std::to_string(i) + ".jpg");
      dino_opt::testing::write_file(p, encode_jpeg(img.view(), 85));
      samples_.push_back({p, i % 3});
    }
  }

  LoaderOptions small_options() const {
    LoaderOptions o;
    o.batch_size = 4;
    o.pipeline.augment.global_size = 24;
    o.pipeline.augment.local_size = 12;
    o.pipeline.augment.n_local = 2;
    o.num_threads = 3;
    o.prefetch = 2;
    return o;
  }

  dino_opt::testing::TempDir dir_{"dino_opt_loader_test"};
  std::vector<Sample> samples_;
};

TEST_F(LoaderThreads, AnEpochYieldsEverySampleOnce) {
  MultiCropLoader loader(samples_, small_options());
  loader.start_epoch(0);
  std::vector<int64_t> seen;
  while (auto batch = loader.next()) {
    ASSERT_EQ(batch->groups.size(), 2u);
    EXPECT_EQ(batch->groups[0].sizes(), (at::IntArrayRef{8, 3, 24, 24}));
    EXPECT_EQ(batch->groups[1].sizes(), (at::IntArrayRef{8, 3, 12, 12}));
    for (int64_t i = 0; i < 4; ++i) seen.push_back(batch->indices[i].item<int64_t>());
  }
  std::sort(seen.begin(), seen.end());
  std::vector<int64_t> all(12);
  std::iota(all.begin(), all.end(), 0);
  EXPECT_EQ(seen, all);
  EXPECT_EQ(loader.stats().images, 12);
}

TEST_F(LoaderThreads, CenterCropShardsGiveEverySampleOnceInOrder) {
  LoaderOptions o = small_options();
  o.pipeline.augment.center_crop = true;
  o.shuffle = false;
  o.drop_last = false;
  o.exact_shards = true;
  o.batch_size = 2;
  MultiCropLoader whole(samples_, o);
  whole.start_epoch(0);
  std::vector<at::Tensor> reference(12);
  while (auto batch = whole.next()) {
    ASSERT_EQ(batch->groups.size(), 1u);
    ASSERT_EQ(batch->groups[0].size(1), 3);
    ASSERT_EQ(batch->groups[0].size(2), 24);
    for (int64_t i = 0; i < batch->indices.size(0); ++i)
      reference[batch->indices[i].item<int64_t>()] = batch->groups[0][i].clone();
  }
  for (int world : {2, 5, 13}) {
    std::vector<int64_t> seen;
    for (int rank = 0; rank < world; ++rank) {
      o.rank = rank;
      o.world_size = world;
      MultiCropLoader loader(samples_, o);
      EXPECT_EQ(loader.samples_per_rank(), 12 / world + (rank < 12 % world ? 1 : 0));
      loader.start_epoch(0);
      std::vector<int64_t> mine;
      while (auto batch = loader.next()) {
        for (int64_t i = 0; i < batch->indices.size(0); ++i) {
          const int64_t index = batch->indices[i].item<int64_t>();
          mine.push_back(index);
          EXPECT_EQ(batch->labels[i].item<int64_t>(), index % 3);
          EXPECT_TRUE(at::equal(batch->groups[0][i], reference[index])) << "sample " << index;
        }
      }
      EXPECT_EQ(mine, loader.epoch_indices(0));
      for (size_t k = 0; k < mine.size(); ++k) EXPECT_EQ(mine[k], rank + world * int64_t(k));
      seen.insert(seen.end(), mine.begin(), mine.end());
    }
    std::sort(seen.begin(), seen.end());
    std::vector<int64_t> all(12);
    std::iota(all.begin(), all.end(), 0);
    EXPECT_EQ(seen, all) << "world " << world;
  }
  o.masks.enabled = true;
  o.masks.patch_size = 2;
  EXPECT_THROW(MultiCropLoader(samples_, o), std::invalid_argument);
}

TEST_F(LoaderThreads, CloseAndDestroyWithAFullQueueJoinPromptly) {
  for (int consume : {0, 1}) {
    auto loader = std::make_unique<MultiCropLoader>(samples_, small_options());
    loader->start_epoch(0);
    if (consume) loader->next();
    const auto t0 = std::chrono::steady_clock::now();
    while (loader->stats().images < 8 &&
           std::chrono::steady_clock::now() - t0 < std::chrono::seconds(30)) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1));
    }
    loader.reset();  // joins the workers, which wait on a full queue
  }
  MultiCropLoader loader(samples_, small_options());
  loader.start_epoch(0);
  loader.close();
  EXPECT_THROW(loader.next(), LoaderError);
  EXPECT_THROW(loader.start_epoch(1), LoaderError);
  loader.close();  // idempotent
}

TEST_F(LoaderThreads, ABadFileFailsItsBatchOnly) {
  const std::string bad = dir_ / "bad.jpg";
  std::ofstream(bad) << "not a jpeg";
  samples_[5].path = bad;
  LoaderOptions o = small_options();
  o.shuffle = false;
  MultiCropLoader loader(samples_, o);
  loader.start_epoch(0);
  EXPECT_TRUE(loader.next().has_value());
  try {
    loader.next();
    FAIL() << "expected the second batch to fail";
  } catch (const LoaderError& e) {
    EXPECT_NE(std::string(e.what()).find(bad), std::string::npos) << e.what();
  }
  EXPECT_TRUE(loader.next().has_value());
  EXPECT_FALSE(loader.next().has_value());
}

// Every batch's masks, copied (the loader reuses its pageable batches).
std::vector<std::pair<at::Tensor, at::Tensor>> masks_and_crops(MultiCropLoader& loader,
                                                               int64_t epoch, int64_t first = 0) {
  loader.start_epoch(epoch, first);
  std::vector<std::pair<at::Tensor, at::Tensor>> out;
  while (auto batch = loader.next()) {
    out.emplace_back(batch->masks.defined() ? batch->masks.clone() : at::Tensor(),
                     batch->groups[0].clone());
  }
  return out;
}

TEST_F(LoaderThreads, MasksFollowThePlanWhateverTheThreadCount) {
  LoaderOptions o = small_options();
  o.seed = 5;
  o.drop_last = false;  // 12 samples: batches of 5, 5 and 2
  o.masks.enabled = true;
  o.masks.patch_size = 2;  // a 12 x 12 grid
  o.batch_size = 5;
  MultiCropLoader three(samples_, o);
  const auto got = masks_and_crops(three, 1);
  o.num_threads = 1;
  MultiCropLoader one(samples_, o);
  const auto single = masks_and_crops(one, 1);
  ASSERT_EQ(got.size(), 3u);
  ASSERT_EQ(single.size(), got.size());
  const BlockMasker masker(o.masks, 24);
  for (size_t k = 0; k < got.size(); ++k) {
    const at::Tensor& m = got[k].first;
    const int64_t b = k < 2 ? 5 : 2;
    ASSERT_EQ(m.sizes(), (at::IntArrayRef{2 * b, 12, 12}));
    ASSERT_EQ(m.scalar_type(), at::kBool);
    EXPECT_TRUE(at::equal(m, single[k].first)) << "batch " << k;
    // Exactly the plan of (seed, epoch, rank, batch), each crop from its own stream.
    Rng plan_rng = mask_plan_stream(5, 1, 0, static_cast<int64_t>(k));
    const auto plan = plan_mask_counts(plan_rng, static_cast<int>(2 * b), 144, o.masks);
    int64_t masked_crops = 0;
    for (int64_t n = 0; n < 2 * b; ++n) {
      const int64_t row = n % b, view = n / b;
      std::vector<uint8_t> expected(144);
      Rng rng = mask_stream(5, 1, static_cast<uint64_t>(k * 5 + row), static_cast<int>(view));
      masker.generate(rng, plan[n], expected.data());
      const at::Tensor mine = m[n].flatten().to(at::kByte).contiguous();
      ASSERT_TRUE(std::equal(expected.begin(), expected.end(), mine.data_ptr<uint8_t>()));
      ASSERT_LE(mine.sum().item<int64_t>(), plan[n]);
      masked_crops += mine.sum().item<int64_t>() > 0;
    }
    EXPECT_LE(masked_crops, static_cast<int64_t>(2 * b * 0.5));
  }
  // The crops do not change when masks are drawn.
  o.masks.enabled = false;
  MultiCropLoader plain(samples_, o);
  const auto without = masks_and_crops(plain, 1);
  for (size_t k = 0; k < got.size(); ++k) {
    EXPECT_FALSE(without[k].first.defined());
    EXPECT_TRUE(at::equal(without[k].second, got[k].second)) << "batch " << k;
  }
  // A resumed epoch gives the same masks.
  const auto resumed = masks_and_crops(one, 1, 1);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_TRUE(at::equal(resumed[0].first, got[1].first));
}

TEST_F(LoaderThreads, SizePairsShapeEachBatchWhateverTheThreadCountAndResume) {
  LoaderOptions o = small_options();
  o.seed = 9;
  o.batch_size = 2;  // 6 batches an epoch
  o.size_pairs = {{24, 12}, {32, 16}};
  o.size_probs = {0.5, 0.5};
  o.masks.enabled = true;
  o.masks.patch_size = 4;
  MultiCropLoader three(samples_, o);
  o.num_threads = 1;
  MultiCropLoader one(samples_, o);
  ASSERT_EQ(three.num_size_pairs(), 2);
  std::vector<int> seen(2, 0);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    three.start_epoch(epoch);
    one.start_epoch(epoch);
    int64_t k = 0;
    while (auto batch = three.next()) {
      const int pair = three.size_pair_of(epoch, k);
      EXPECT_EQ(batch->size_pair, pair);
      ++seen[pair];
      const int64_t g = pair == 0 ? 24 : 32, l = pair == 0 ? 12 : 16;
      EXPECT_EQ(batch->groups[0].sizes(), (at::IntArrayRef{4, 3, g, g}));
      EXPECT_EQ(batch->groups[1].sizes(), (at::IntArrayRef{4, 3, l, l}));
      EXPECT_EQ(batch->masks.sizes(), (at::IntArrayRef{4, g / 4, g / 4}));
      const auto other = one.next();
      ASSERT_TRUE(other.has_value());
      EXPECT_TRUE(at::equal(batch->groups[0], other->groups[0]));
      EXPECT_TRUE(at::equal(batch->groups[1], other->groups[1]));
      EXPECT_TRUE(at::equal(batch->masks, other->masks));
      ++k;
    }
    EXPECT_EQ(k, 6);
  }
  EXPECT_GT(seen[0], 0);
  EXPECT_GT(seen[1], 0);
  // Resumed at batch 3 of epoch 2: the same pairs and crops as the whole epoch.
  const auto whole = masks_and_crops(three, 2);
  const auto resumed = masks_and_crops(one, 2, 3);
  ASSERT_EQ(resumed.size(), 3u);
  for (size_t k = 0; k < resumed.size(); ++k) {
    EXPECT_TRUE(at::equal(resumed[k].second, whole[k + 3].second)) << "batch " << k + 3;
    EXPECT_TRUE(at::equal(resumed[k].first, whole[k + 3].first)) << "batch " << k + 3;
  }
  // Errors name the pair or the ratios.
  o.size_probs = {0.5, 0.4};
  EXPECT_THROW(MultiCropLoader(samples_, o), std::invalid_argument);
  o.size_probs = {1.0};
  EXPECT_THROW(MultiCropLoader(samples_, o), std::invalid_argument);
  o.size_probs = {};
  o.size_pairs = {{24, 12}, {30, 16}};  // 30 is no multiple of the patch size 4
  try {
    MultiCropLoader bad(samples_, o);
    FAIL() << "expected the pair to be refused";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("crop size pair 1"), std::string::npos) << e.what();
  }
}

}  // namespace
