// The loader's photometric augmentation (loader/photometric.h), its float16
// conversions, and the CUDA kernel's block algorithm (ops/photometric_tile.h)
// run serially on the host against the CPU path, bit for bit.
#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <random>
#include <vector>

#include "loader/float16.h"
#include "loader/photometric.h"
#include "loader/photometric_isa.h"
#include "loader/photometric_math.h"
#include "ops/photometric.h"
#include "ops/photometric_tile.h"
#include "test_util.h"

namespace {

using dino_opt::loader::Normalization;
using dino_opt::loader::OutputType;
using dino_opt::loader::PhotometricParams;
using dino_opt::loader::PlanarOutput;

std::vector<uint8_t> random_crop(int h, int w, std::mt19937& rng) {
  std::vector<uint8_t> px(static_cast<size_t>(h) * w * 3);
  std::uniform_int_distribution<int> byte(0, 255);
  for (auto& v : px) v = static_cast<uint8_t>(byte(rng));
  return px;
}

PhotometricParams random_params(std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  PhotometricParams p;
  p.flip = u(rng) < 0.5f;
  p.jitter = u(rng) < 0.8f;
  p.brightness = 0.6f + 0.8f * u(rng);
  p.contrast = 0.6f + 0.8f * u(rng);
  p.saturation = 0.8f + 0.4f * u(rng);
  p.hue = -0.1f + 0.2f * u(rng);
  std::shuffle(p.order.begin(), p.order.end(), rng);
  p.grayscale = u(rng) < 0.2f;
  p.blur_sigma = u(rng) < 0.5f ? 0.1f + 1.9f * u(rng) : 0.0f;
  p.solarize = u(rng) < 0.2f;
  return p;
}

// Runs apply_photometric into a float32 [3, h, w] buffer (or channels_last).
std::vector<float> run_cpu(const std::vector<uint8_t>& src, int h, int w,
                           const PhotometricParams& p, bool channels_last = false) {
  std::vector<float> out(static_cast<size_t>(h) * w * 3);
  std::vector<float> scratch(dino_opt::loader::photometric_scratch_floats(h, w));
  PlanarOutput o;
  o.data = out.data();
  o.type = OutputType::kFloat32;
  if (channels_last) {
    o.stride_c = 1;
    o.stride_y = int64_t{3} * w;
    o.stride_x = 3;
  } else {
    o.stride_c = int64_t{h} * w;
    o.stride_y = w;
    o.stride_x = 1;
  }
  dino_opt::loader::apply_photometric(src.data(), h, w, p, Normalization{}, o, scratch.data());
  return out;
}

TEST(Photometric, ParamsRoundTripThroughFloats) {
  PhotometricParams p;
  p.flip = true;
  p.jitter = true;
  p.brightness = 1.25f;
  p.contrast = 0.75f;
  p.saturation = 0.9f;
  p.hue = -0.05f;
  p.order = {3, 1, 0, 2};
  p.grayscale = true;
  p.blur_sigma = 1.5f;
  p.solarize = true;
  float row[dino_opt::loader::kPhotometricParamCount];
  p.to_floats(row);
  const float want[] = {1, 1, 1.25f, 0.75f, 0.9f, -0.05f, 3, 1, 0, 2, 1, 1.5f, 1};
  for (int i = 0; i < dino_opt::loader::kPhotometricParamCount; ++i) EXPECT_EQ(row[i], want[i]);
  const PhotometricParams q = PhotometricParams::from_floats(row);
  EXPECT_EQ(q.flip, p.flip);
  EXPECT_EQ(q.jitter, p.jitter);
  EXPECT_EQ(q.brightness, p.brightness);
  EXPECT_EQ(q.contrast, p.contrast);
  EXPECT_EQ(q.saturation, p.saturation);
  EXPECT_EQ(q.hue, p.hue);
  EXPECT_EQ(q.order, p.order);
  EXPECT_EQ(q.grayscale, p.grayscale);
  EXPECT_EQ(q.blur_sigma, p.blur_sigma);
  EXPECT_EQ(q.solarize, p.solarize);
  EXPECT_EQ(dino_opt::loader::photometric_params_error(row), "");
}

TEST(Photometric, FromFloatsMarksBadOrderEntriesAndErrorNamesThem) {
  float row[dino_opt::loader::kPhotometricParamCount] = {0, 1, 1, 1, 1, 0, 0, 1, 2, 3, 0, 0, 0};
  row[7] = std::numeric_limits<float>::quiet_NaN();
  row[8] = 1.5f;
  row[9] = 7.0f;
  const PhotometricParams q = PhotometricParams::from_floats(row);
  EXPECT_EQ(q.order[0], 0);
  EXPECT_EQ(q.order[1], -1);
  EXPECT_EQ(q.order[2], -1);
  EXPECT_EQ(q.order[3], -1);
  EXPECT_NE(dino_opt::loader::photometric_params_error(row).find("order"), std::string::npos);

  float bad[dino_opt::loader::kPhotometricParamCount] = {0, 1, 1, 1, 1, 0, 0, 1, 2, 3, 0, 0, 0};
  bad[5] = 0.6f;
  EXPECT_NE(dino_opt::loader::photometric_params_error(bad).find("hue"), std::string::npos);
  bad[5] = 0.0f;
  bad[2] = -1.0f;
  EXPECT_NE(dino_opt::loader::photometric_params_error(bad).find("brightness"), std::string::npos);
  bad[2] = 1.0f;
  bad[0] = 0.5f;
  EXPECT_NE(dino_opt::loader::photometric_params_error(bad).find("flip"), std::string::npos);
  bad[0] = 0.0f;
  bad[11] = std::numeric_limits<float>::infinity();
  EXPECT_NE(dino_opt::loader::photometric_params_error(bad).find("blur_sigma"), std::string::npos);
}

TEST(Photometric, BlurKernelSize) {
  using dino_opt::loader::blur_kernel_size;
  EXPECT_EQ(blur_kernel_size(0.0f), 0);
  EXPECT_EQ(blur_kernel_size(-1.0f), 0);
  EXPECT_EQ(blur_kernel_size(std::numeric_limits<float>::quiet_NaN()), 0);
  EXPECT_EQ(blur_kernel_size(0.1f), 3);   // ceil(0.3) = 1
  EXPECT_EQ(blur_kernel_size(1.0f), 7);   // 3
  EXPECT_EQ(blur_kernel_size(1.01f), 9);  // ceil(3.03) = 4
  EXPECT_EQ(blur_kernel_size(2.0f), 13);  // 6
  EXPECT_EQ(blur_kernel_size(1e30f), std::numeric_limits<int>::max());
  // Per crop the radius is clamped to side - 1 (reflect padding).
  namespace pm = dino_opt::loader::photometric_math;
  EXPECT_EQ(pm::blur_radius(2.0f, 224), 6);
  EXPECT_EQ(pm::blur_radius(2.0f, 5), 4);
  EXPECT_EQ(pm::blur_radius(2.0f, 1), 0);
  // The taps of sigma 2: exp(-k^2 / 8) over the 13 taps' sum, symmetric.
  float taps[13];
  pm::gaussian_weights(2.0f, 6, taps);
  double norm = 0.0;
  for (int k = -6; k <= 6; ++k) norm += std::exp(-k * k / 8.0);
  double sum = 0.0;
  for (int k = 0; k < 13; ++k) {
    sum += taps[k];
    EXPECT_EQ(taps[k], taps[12 - k]);
    EXPECT_NEAR(taps[k], std::exp(-(k - 6) * (k - 6) / 8.0) / norm, 1e-8);
  }
  EXPECT_NEAR(sum, 1.0, 1e-6);
}

TEST(Photometric, IdentityParamsGiveNormalisedInputExactly) {
  std::mt19937 rng(1);
  const int h = 7, w = 13;
  const auto src = random_crop(h, w, rng);
  const Normalization norm;
  for (bool channels_last : {false, true}) {
    const auto out = run_cpu(src, h, w, PhotometricParams{}, channels_last);
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        for (int c = 0; c < 3; ++c) {
          const float v = static_cast<float>(src[(y * w + x) * 3 + c]) / 255.0f;
          const float want = (v - norm.mean[c]) / norm.std[c];
          const size_t at = channels_last ? (static_cast<size_t>(y) * w + x) * 3 + c
                                          : (static_cast<size_t>(c) * h + y) * w + x;
          ASSERT_EQ(out[at], want) << "y=" << y << " x=" << x << " c=" << c;
        }
      }
    }
  }
}

TEST(Photometric, FlipMirrorsEveryRow) {
  std::mt19937 rng(2);
  const int h = 19, w = 23;
  const auto src = random_crop(h, w, rng);
  for (int trial = 0; trial < 20; ++trial) {
    PhotometricParams p = random_params(rng);
    p.flip = false;
    const auto plain = run_cpu(src, h, w, p);
    p.flip = true;
    const auto flipped = run_cpu(src, h, w, p);
    for (int c = 0; c < 3; ++c) {
      for (int y = 0; y < h; ++y) {
        for (int x = 0; x < w; ++x) {
          const size_t row = (static_cast<size_t>(c) * h + y) * w;
          ASSERT_EQ(flipped[row + x], plain[row + (w - 1 - x)]) << "trial " << trial;
        }
      }
    }
  }
}

TEST(Photometric, HalfConversionsMatchC10ForEveryKindOfValue) {
  std::mt19937 rng(3);
  std::vector<float> values = {0.0f,
                               -0.0f,
                               1.0f,
                               -2.5f,
                               65504.0f,
                               65519.99f,
                               65520.0f,
                               1e9f,
                               -1e9f,
                               6.1035156e-05f,
                               6.0e-05f,
                               5.9604645e-08f,
                               2.9802322e-08f,
                               2.9802326e-08f,
                               1e-30f,
                               3.3895314e38f,
                               std::numeric_limits<float>::infinity(),
                               -std::numeric_limits<float>::infinity(),
                               std::numeric_limits<float>::denorm_min()};
  std::uniform_int_distribution<uint32_t> bits;
  for (int i = 0; i < 200000; ++i) {
    const uint32_t u = bits(rng);
    float f;
    std::memcpy(&f, &u, 4);
    if (!std::isnan(f)) values.push_back(f);
  }
  for (int i = 0; i < 200000; ++i) values.push_back(std::ldexp(static_cast<float>(i), -30));
  for (float f : values) {
    const c10::Half h(f);
    const c10::BFloat16 b(f);
    ASSERT_EQ(dino_opt::loader::float_to_f16_bits(f), h.x) << f;
    ASSERT_EQ(dino_opt::loader::float_to_bf16_bits(f), b.x) << f;
    const float back = dino_opt::loader::f16_bits_to_float(h.x);
    ASSERT_TRUE(back == static_cast<float>(h) || (std::isnan(back) && std::isnan(f))) << f;
  }
  const float nan = std::numeric_limits<float>::quiet_NaN();
  EXPECT_TRUE(
      std::isnan(dino_opt::loader::f16_bits_to_float(dino_opt::loader::float_to_f16_bits(nan))));
  EXPECT_TRUE(
      std::isnan(dino_opt::loader::bf16_bits_to_float(dino_opt::loader::float_to_bf16_bits(nan))));
  // A signalling NaN whose payload sits in the bits that bfloat16 drops stays NaN.
  const uint32_t snan_bits = 0x7F800001u;
  float snan;
  std::memcpy(&snan, &snan_bits, 4);
  EXPECT_TRUE(
      std::isnan(dino_opt::loader::bf16_bits_to_float(dino_opt::loader::float_to_bf16_bits(snan))));
  EXPECT_TRUE(
      std::isnan(dino_opt::loader::f16_bits_to_float(dino_opt::loader::float_to_f16_bits(snan))));
}

// Any parameter row, however wrong (NaN, infinities, out-of-range order
// entries, huge sigmas), is applied without writing outside the crop's output.
TEST(Photometric, GarbageRowsStayInsideTheOutput) {
  std::mt19937 rng(8);
  const float specials[] = {0.f,
                            1.f,
                            -1.f,
                            0.5f,
                            3.f,
                            4.f,
                            7.5f,
                            1e30f,
                            -1e30f,
                            std::numeric_limits<float>::quiet_NaN(),
                            std::numeric_limits<float>::infinity()};
  std::uniform_real_distribution<float> u(-0.5f, 2.5f);
  for (int trial = 0; trial < 300; ++trial) {
    const int h = 1 + static_cast<int>(rng() % 40), w = 1 + static_cast<int>(rng() % 40);
    const auto src = random_crop(h, w, rng);
    float row[dino_opt::loader::kPhotometricParamCount];
    for (float& v : row) v = rng() % 3 == 0 ? specials[rng() % 11] : u(rng);
    const size_t n = static_cast<size_t>(h) * w * 3;
    constexpr float kCanary = 12345.0f;
    std::vector<float> out(n + 64, kCanary);
    std::vector<float> scratch(dino_opt::loader::photometric_scratch_floats(h, w) + 64, kCanary);
    const bool channels_last = trial % 2 == 1;
    PlanarOutput o{out.data(), OutputType::kFloat32, channels_last ? 1 : int64_t{h} * w,
                   channels_last ? int64_t{3} * w : w, channels_last ? 3 : 1};
    dino_opt::loader::apply_photometric(src.data(), h, w, PhotometricParams::from_floats(row),
                                        Normalization{}, o, scratch.data());
    for (size_t k = n; k < out.size(); ++k) ASSERT_EQ(out[k], kCanary) << "trial " << trial;
    for (size_t k = scratch.size() - 64; k < scratch.size(); ++k) {
      ASSERT_EQ(scratch[k], kCanary) << "trial " << trial;
    }
  }
}

#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
// The instruction-set variants compute the same bits (no contraction, same
// operation order; only the vector width differs).
TEST(Photometric, InstructionSetVariantsAgreeBitForBit) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(6);
  for (auto [h, w] : {std::pair{96, 96}, std::pair{224, 224}, std::pair{37, 61}, std::pair{3, 2}}) {
    const auto src = random_crop(h, w, rng);
    for (int trial = 0; trial < 12; ++trial) {
      PhotometricParams p = random_params(rng);
      if (trial % 3 == 0) p.blur_sigma = 25.0f;  // taps beyond the blocked kernel
      for (OutputType type : {OutputType::kFloat32, OutputType::kBFloat16, OutputType::kFloat16}) {
        std::vector<float> a(static_cast<size_t>(h) * w * 3), b(a.size());
        std::vector<float> scratch(dino_opt::loader::photometric_scratch_floats(h, w));
        PlanarOutput o{a.data(), type, int64_t{h} * w, w, 1};
        dino_opt::loader::photometric_default::apply_photometric_kernel(
            src.data(), h, w, p, Normalization{}, o, scratch.data());
        o.data = b.data();
        dino_opt::loader::photometric_avx2::apply_photometric_kernel(
            src.data(), h, w, p, Normalization{}, o, scratch.data());
        ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
            << h << "x" << w << " trial " << trial;
      }
    }
  }
  EXPECT_STREQ(dino_opt::loader::photometric_isa(), "avx2");
}
#endif

// The CUDA kernel's block algorithm, run serially over every block of a batch.
std::vector<float> run_tile_algorithm(const std::vector<uint8_t>& images, const float* params,
                                      int n, int h, int w, bool channels_last) {
  namespace pd = dino_opt::photometric_detail;
  pd::BatchArgs a;
  a.images = images.data();
  a.params = params;
  a.n = n;
  a.h = h;
  a.w = w;
  const Normalization norm;
  for (int c = 0; c < 3; ++c) {
    a.norm_mean[c] = norm.mean[c];
    a.norm_std[c] = norm.std[c];
  }
  std::vector<float> out(static_cast<size_t>(n) * 3 * h * w, std::nanf(""));
  a.out = out.data();
  a.stride_n = int64_t{3} * h * w;
  if (channels_last) {
    a.stride_c = 1;
    a.stride_y = int64_t{3} * w;
    a.stride_x = 3;
  } else {
    a.stride_c = int64_t{h} * w;
    a.stride_y = w;
    a.stride_x = 1;
  }
  const int tiles = pd::tiles_per_crop(a);
  std::vector<double> tile_sums(static_cast<size_t>(n) * tiles, std::nan(""));
  std::vector<float> taps(static_cast<size_t>(n * pd::taps_per_crop(h, w)), std::nanf(""));
  a.tile_sums = tile_sums.data();
  a.taps = taps.data();
  double reduce[1];
  std::vector<float> shared(pd::kMainSharedFloats, std::nanf(""));
  const pd::SerialBlock blk;
  for (int64_t b = 0; b < int64_t{n} * tiles; ++b) pd::prologue_block(blk, a, b, reduce);
  for (int64_t b = 0; b < int64_t{n} * tiles; ++b) pd::main_block(blk, a, b, shared.data());
  return out;
}

void expect_tile_algorithm_matches_cpu(int n, int h, int w, bool channels_last, std::mt19937& rng,
                                       float sigma_scale = 1.0f) {
  std::vector<uint8_t> images;
  std::vector<float> rows;
  std::vector<PhotometricParams> params;
  for (int i = 0; i < n; ++i) {
    const auto crop = random_crop(h, w, rng);
    images.insert(images.end(), crop.begin(), crop.end());
    PhotometricParams p = random_params(rng);
    p.blur_sigma *= sigma_scale;
    params.push_back(p);
    float row[dino_opt::loader::kPhotometricParamCount];
    p.to_floats(row);
    rows.insert(rows.end(), row, row + dino_opt::loader::kPhotometricParamCount);
  }
  const auto got = run_tile_algorithm(images, rows.data(), n, h, w, channels_last);
  const size_t crop_px = static_cast<size_t>(h) * w * 3;
  for (int i = 0; i < n; ++i) {
    const std::vector<uint8_t> crop(images.begin() + i * crop_px,
                                    images.begin() + (i + 1) * crop_px);
    const auto want = run_cpu(crop, h, w, params[i], channels_last);
    for (size_t k = 0; k < crop_px; ++k) {
      ASSERT_EQ(std::memcmp(&got[i * crop_px + k], &want[k], 4), 0)
          << "crop " << i << " (" << h << "x" << w << ", sigma " << params[i].blur_sigma
          << ") element " << k << ": tile algorithm " << got[i * crop_px + k] << ", CPU "
          << want[k];
    }
  }
}

TEST(PhotometricTileAlgorithm, MatchesCpuBitForBit) {
  std::mt19937 rng(4);
  expect_tile_algorithm_matches_cpu(12, 96, 96, false, rng);
  expect_tile_algorithm_matches_cpu(6, 70, 33, true, rng);
  expect_tile_algorithm_matches_cpu(6, 1, 5, false, rng);
  expect_tile_algorithm_matches_cpu(4, 1, 1, false, rng);
  expect_tile_algorithm_matches_cpu(4, 224, 224, false, rng);
}

TEST(PhotometricTileAlgorithm, LargeRadiiTakeSeveralChunksAndStillMatch) {
  std::mt19937 rng(5);
  // sigma up to 20: radii up to 60, clamped to the side, many chunks of 48.
  expect_tile_algorithm_matches_cpu(8, 50, 81, false, rng, 10.0f);
  expect_tile_algorithm_matches_cpu(4, 9, 130, true, rng, 10.0f);
}

TEST(PhotometricOp, RejectsBadArgumentsWithClearErrors) {
  using dino_opt::testing::expect_error;
  const at::Tensor images = at::zeros({2, 4, 4, 3}, at::kByte);
  // Valid rows: identity factors, order 0 1 2 3.
  const at::Tensor params =
      at::tensor({0.f, 0.f, 1.f, 1.f, 1.f, 0.f, 0.f, 1.f, 2.f, 3.f, 0.f, 0.f, 0.f}).repeat({2, 1});
  const std::vector<double> mean = {0.5, 0.5, 0.5}, std = {0.2, 0.2, 0.2};
  expect_error(
      [&] {
        dino_opt::multicrop_photometric(images, params.narrow(0, 0, 1), mean, std, {}, false);
      },
      "params has 1 rows but images has N=2");
  expect_error(
      [&] { dino_opt::multicrop_photometric(images.to(at::kFloat), params, mean, std, {}, false); },
      "images must be uint8");
  expect_error(
      [&] {
        dino_opt::multicrop_photometric(images, params, mean, {0.2, 0.0, 0.2}, {}, false);
      },
      "std[1] must be finite and nonzero");
  expect_error(
      [&] { dino_opt::multicrop_photometric(images, params, mean, std, at::kDouble, false); },
      "dtype must be float32, bfloat16 or float16");
  at::Tensor bad = params.clone();
  bad[1][7] = 0.0f;  // order 0 0 2 3
  expect_error([&] { dino_opt::multicrop_photometric(images, bad, mean, std, {}, false); },
               "params[1]: order");
}

}  // namespace
