// Images that are not 8-bit RGB (csrc/loader: npy_format.h, decode_raw,
// resample_raw.h, channel_photometric.h, the pipeline's native mode): the
// .npy header parser on good and bad headers, lossless round trips at every
// depth and channel count, the resampler at any depth against the 8-bit one,
// the pipeline refusing a source that mixes layouts. Fresh random content per
// run; the NumPy references of the crops are in tests_py/test_raw_images.py.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "loader/channel_noise.h"
#include "loader/channel_photometric.h"
#include "loader/image_decode.h"
#include "loader/multicrop_pipeline.h"
#include "loader/npy_format.h"
#include "loader/photometric_isa.h"
#include "loader/resample.h"
#include "loader/resample_raw.h"

namespace dl = dino_opt::loader;

namespace {

void expect_image_error(const std::function<void()>& call, const std::string& fragment) {
  try {
    call();
    ADD_FAILURE() << "expected an ImageError containing: " << fragment;
  } catch (const dl::ImageError& e) {
    EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
        << "message was: " << e.what() << "\nexpected: " << fragment;
  }
}

dl::RawImage random_image(std::mt19937& rng, int w, int h, dl::ImageLayout layout) {
  dl::RawImage im(w, h, layout);
  if (layout.type == dl::SampleType::kF32) {
    std::uniform_real_distribution<float> u(-2.0f, 3.0f);
    auto* p = reinterpret_cast<float*>(im.bytes.data());
    for (size_t i = 0; i < im.bytes.size() / 4; ++i) p[i] = u(rng);
  } else {
    for (auto& b : im.bytes) b = static_cast<uint8_t>(rng());
  }
  return im;
}

// A v1.0 .npy file with `header` as its dict text and `data_bytes` bytes after it.
std::vector<uint8_t> npy_with_header(const std::string& header, size_t data_bytes) {
  std::vector<uint8_t> out(10 + header.size() + data_bytes, 7);
  const uint8_t start[8] = {0x93, 'N', 'U', 'M', 'P', 'Y', 1, 0};
  std::memcpy(out.data(), start, 8);
  out[8] = static_cast<uint8_t>(header.size() & 0xFF);
  out[9] = static_cast<uint8_t>(header.size() >> 8);
  std::memcpy(out.data() + 10, header.data(), header.size());
  return out;
}

const std::vector<dl::ImageLayout> kLayouts = {
    {1, dl::SampleType::kU8},   {2, dl::SampleType::kU16}, {4, dl::SampleType::kU16},
    {13, dl::SampleType::kU16}, {1, dl::SampleType::kF32}, {6, dl::SampleType::kF32}};

}  // namespace

TEST(RawImages, NpyRoundTripsEveryLayout) {
  std::mt19937 rng(std::random_device{}());
  for (const auto& layout : kLayouts) {
    const dl::RawImage im = random_image(rng, 1 + rng() % 40, 1 + rng() % 30, layout);
    const auto bytes = dl::encode_raw(im.view(), dl::ImageFormat::kNpy);
    const dl::ImageHeader h = dl::probe_image(bytes.data(), bytes.size());
    EXPECT_EQ(h.format, dl::ImageFormat::kNpy);
    EXPECT_EQ(h.width, im.width);
    EXPECT_EQ(h.height, im.height);
    EXPECT_EQ(h.channels, layout.channels);
    const dl::RawImage back = dl::decode_raw(bytes.data(), bytes.size(), h);
    EXPECT_EQ(back.layout, layout) << back.layout.describe();
    EXPECT_EQ(back.bytes, im.bytes) << layout.describe();
    const auto header_end = dl::parse_npy_header(bytes.data(), bytes.size()).data_offset;
    EXPECT_EQ(header_end % 64, 0u);
  }
}

TEST(RawImages, NpyHeadersThatNumPyWritesAreRead) {
  // 2-D, a trailing comma or none, double quotes, version 2.0, extra spaces.
  const std::vector<std::pair<std::string, int>> good = {
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (3, 5), }", 1},
      {"{'descr': '|u1', 'fortran_order': False, 'shape': (3, 5, 2)}", 2},
      {"{\"shape\": (3, 5, 4), \"fortran_order\": False, \"descr\": \"<f4\"}   \n", 4},
  };
  for (const auto& [header, channels] : good) {
    const int sb = header.find("<u2") != std::string::npos   ? 2
                   : header.find("<f4") != std::string::npos ? 4
                                                             : 1;
    const auto bytes = npy_with_header(header, 15 * channels * sb);
    const dl::NpyHeader h = dl::parse_npy_header(bytes.data(), bytes.size());
    EXPECT_EQ(h.height, 3);
    EXPECT_EQ(h.width, 5);
    EXPECT_EQ(h.layout.channels, channels);
  }
  std::string header = "{'descr': '<u2', 'fortran_order': False, 'shape': (2, 2), }";
  std::vector<uint8_t> v2 = npy_with_header("", 12 + header.size() + 8 - 10);
  v2[6] = 2;  // version 2.0: a 4-byte header length
  v2[8] = static_cast<uint8_t>(header.size());
  v2[9] = v2[10] = v2[11] = 0;
  std::memcpy(v2.data() + 12, header.data(), header.size());
  EXPECT_EQ(dl::parse_npy_header(v2.data(), v2.size()).layout.type, dl::SampleType::kU16);
}

TEST(RawImages, BadNpyHeadersAreRefusedInOneLine) {
  const std::string ok = "'fortran_order': False, 'shape': (4, 4, 2), }";
  const std::vector<std::pair<std::string, std::string>> bad = {
      {"{'descr': '<i8', " + ok, "dtype '<i8'"},
      {"{'descr': '>u2', " + ok, "big-endian"},
      {"{'descr': '<u2', 'fortran_order': True, 'shape': (4, 4, 2), }", "Fortran order"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (16,), }", "1 dimensions"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (2, 2, 2, 2), }", "4 dimensions"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (4, 0, 2), }", "zero side"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (4, 4, 2000), }", "2000 channels"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (99999999999, 4), }", "2^31"},
      {"{'descr': '<u2', 'fortran_order': False, }", "no 'shape' key"},
      {"{'descr': '<u2', 'descr': '<u2', " + ok, "given twice"},
      {"{'descr': '<u2', 'other': 1, " + ok, "unknown key 'other'"},
      {"{'descr': '<u\\x32', " + ok, "escape"},
      {"{'descr': '<u2', " + ok + " __import__('os')", "text after"},
      {"{'descr': '<u2', 'fortran_order': Maybe, 'shape': (4, 4, 2), }", "True or False"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (4, x), }", "integer"},
      {"['descr', '<u2']", "expected '{'"},
      {"{'descr': '<u2', 'fortran_order': False, 'shape': (4, 4, 2)", "the header ends"},
      {"{'descr': '<u2", "past the end"},
  };
  for (const auto& [header, fragment] : bad) {
    const auto bytes = npy_with_header(header, 64);
    expect_image_error([&] { dl::parse_npy_header(bytes.data(), bytes.size()); }, fragment);
    expect_image_error([&] { dl::probe_image(bytes.data(), bytes.size()); }, fragment);
  }
  // The data shorter than the shape needs; a header longer than the file; a version 9.
  auto cut = npy_with_header("{'descr': '<u2', " + ok, 63);
  expect_image_error([&] { dl::parse_npy_header(cut.data(), cut.size()); }, "truncated .npy");
  auto long_header = npy_with_header("{'descr': '<u2', " + ok, 0);
  long_header[9] = 0x7F;
  expect_image_error([&] { dl::parse_npy_header(long_header.data(), long_header.size()); },
                     "the header claims");
  auto version = npy_with_header("{'descr': '<u2', " + ok, 64);
  version[6] = 9;
  expect_image_error([&] { dl::parse_npy_header(version.data(), version.size()); },
                     "format version 9");
  // Every prefix of a valid file is refused, never read past its end.
  const auto whole = npy_with_header("{'descr': '<u2', " + ok, 64);
  for (size_t n = 0; n < whole.size(); ++n) {
    EXPECT_THROW(dl::probe_image(whole.data(), n), dl::ImageError) << n;
  }
}

TEST(RawImages, PixelLimitAppliesToNpy) {
  const auto bytes =
      npy_with_header("{'descr': '|u1', 'fortran_order': False, 'shape': (100, 100), }", 10000);
  dl::DecodeOptions small;
  small.max_pixels = 9999;
  expect_image_error([&] { dl::probe_image(bytes.data(), bytes.size(), small); },
                     "above the limit");
}

TEST(RawImages, NpyInRgbModeBecomesRgbOrIsRefused) {
  std::mt19937 rng(std::random_device{}());
  const dl::RawImage gray = random_image(rng, 7, 5, {1, dl::SampleType::kU16});
  const auto bytes = dl::encode_raw(gray.view(), dl::ImageFormat::kNpy);
  const dl::Image rgb = dl::decode_image(bytes.data(), bytes.size(), dl::ImageHeader{});
  const auto* g = reinterpret_cast<const uint16_t*>(gray.bytes.data());
  for (int i = 0; i < 35; ++i) {
    const auto v = static_cast<uint8_t>((g[i] + 128u) / 257u);
    EXPECT_EQ(rgb.pixels[3 * i], v);
    EXPECT_EQ(rgb.pixels[3 * i + 2], v);
  }
  const dl::RawImage many = random_image(rng, 4, 4, {13, dl::SampleType::kU16});
  const auto many_bytes = dl::encode_raw(many.view(), dl::ImageFormat::kNpy);
  expect_image_error(
      [&] { dl::decode_image(many_bytes.data(), many_bytes.size(), dl::ImageHeader{}); },
      "image_mode='native'");
}

TEST(RawImages, RawResizeOfRgb8EqualsTheHotPath) {
  std::mt19937 rng(std::random_device{}());
  for (int trial = 0; trial < 20; ++trial) {
    const int w = 8 + rng() % 120, h = 8 + rng() % 120;
    const dl::RawImage raw = random_image(rng, w, h, {3, dl::SampleType::kU8});
    const dl::ImageView view{raw.bytes.data(), w, h, int64_t{3} * w};
    const int cw = 1 + rng() % w, ch = 1 + rng() % h;
    const int left = rng() % (w - cw + 1), top = rng() % (h - ch + 1);
    const int out = 1 + rng() % 64;
    const dl::CropBox box = dl::scaled_crop_box(left, top, cw, ch, 1.0, 1.0, w, h);
    std::vector<uint8_t> a(out * out * 3), b(out * out * 3);
    dl::ResampleScratch s8;
    dl::RawResampleScratch sr;
    dl::resize_crop_bicubic(view, box, out, out, a.data(), 3 * out, s8);
    dl::resize_crop_raw(raw.view(), box, out, out, b.data(), 3 * out, sr);
    EXPECT_EQ(a, b) << "crop " << left << "," << top << " " << cw << "x" << ch << " -> " << out;
  }
}

TEST(RawImages, RawResizeKeepsAConstantImageAtEveryDepth) {
  std::mt19937 rng(std::random_device{}());
  for (const auto& layout : kLayouts) {
    dl::RawImage im(37, 23, layout);
    const uint16_t v16 = static_cast<uint16_t>(rng());
    const float vf = 0.37f;
    const int sb = dl::sample_bytes(layout.type);
    for (size_t i = 0; i < im.bytes.size() / sb; ++i) {
      if (layout.type == dl::SampleType::kU16) std::memcpy(&im.bytes[i * 2], &v16, 2);
      if (layout.type == dl::SampleType::kU8) im.bytes[i] = 200;
      if (layout.type == dl::SampleType::kF32) std::memcpy(&im.bytes[i * 4], &vf, 4);
    }
    const dl::CropBox box = dl::scaled_crop_box(3, 2, 30, 20, 1.0, 1.0, 37, 23);
    const int out = 11;
    std::vector<uint8_t> dst(out * out * layout.channels * sb);
    dl::RawResampleScratch s;
    dl::resize_crop_raw(im.view(), box, out, out, dst.data(), out * layout.channels * sb, s);
    for (size_t i = 0; i < dst.size() / sb; ++i) {
      if (layout.type == dl::SampleType::kU16) {
        uint16_t got;
        std::memcpy(&got, &dst[i * 2], 2);
        ASSERT_EQ(got, v16) << layout.describe();
      } else if (layout.type == dl::SampleType::kU8) {
        ASSERT_EQ(dst[i], 200);
      } else {
        float got;
        std::memcpy(&got, &dst[i * 4], 4);
        ASSERT_NEAR(got, vf, 1e-6f);
      }
    }
  }
}

TEST(RawImages, ChannelNoiseIsStandardNormal) {
  double sum = 0, sq = 0, lag = 0, prev = 0;
  const int n = 200000;
  for (int i = 0; i < n; ++i) {
    const double z = dl::channel_noise(12345u, static_cast<uint64_t>(i));
    sum += z;
    sq += z * z;
    lag += z * prev;
    prev = z;
  }
  EXPECT_NEAR(sum / n, 0.0, 0.01);
  EXPECT_NEAR(sq / n, 1.0, 0.015);
  EXPECT_NEAR(lag / n, 0.0, 0.01);
  EXPECT_NE(dl::channel_noise(1u, 0), dl::channel_noise(2u, 0));
}

TEST(RawImages, ChannelParamsTravelAsFloats) {
  dl::ChannelParams p;
  p.flip = true;
  p.blur_sigma = 1.5f;
  p.noise_std = 0.05f;
  p.noise_key = 0xDEADBEEFu;
  p.brightness = {0.9f, 1.1f, 1.2f};
  p.contrast = {0.7f, 1.0f, 1.3f};
  std::vector<float> row(dl::channel_param_count(3));
  p.to_floats(row.data());
  const dl::ChannelParams q = dl::ChannelParams::from_floats(row.data(), 3);
  EXPECT_EQ(q.flip, p.flip);
  EXPECT_EQ(q.blur_sigma, p.blur_sigma);
  EXPECT_EQ(q.noise_std, p.noise_std);
  EXPECT_EQ(q.noise_key, p.noise_key);
  EXPECT_EQ(q.brightness, p.brightness);
  EXPECT_EQ(q.contrast, p.contrast);
}

TEST(RawImages, IdentityChannelStageIsScaleAndNormalise) {
  std::mt19937 rng(std::random_device{}());
  const int h = 9, w = 7, c = 2;
  const dl::RawImage im = random_image(rng, w, h, {c, dl::SampleType::kU16});
  dl::ChannelParams p;
  p.flip = true;
  p.brightness.assign(c, 1.0f);
  p.contrast.assign(c, 1.0f);
  dl::ChannelNormalization norm{{0.25f, 0.5f}, {0.5f, 2.0f}};
  std::vector<float> out(c * h * w);
  dl::PlanarOutput po{out.data(), dl::OutputType::kFloat32, h * w, w, 1};
  std::vector<float> scratch(dl::channel_scratch_floats(h, w, c));
  dl::apply_channel_photometric(im.bytes.data(), im.layout, h, w, p, norm, po, scratch.data());
  const auto* s = reinterpret_cast<const uint16_t*>(im.bytes.data());
  for (int ch = 0; ch < c; ++ch) {
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        const float v = static_cast<float>(s[(y * w + x) * c + ch]) / 65535.0f;
        EXPECT_EQ(out[ch * h * w + y * w + (w - 1 - x)], (v - norm.mean[ch]) / norm.std[ch]);
      }
    }
  }
}

// The loader's float32 evaluation of the noise field against its float64
// definition, on the extreme hashes (u1 next to 0 and to 1, u2 on and next
// to every quarter turn) and on random ones.
TEST(RawImages, ChannelNoiseInFloat32IsTheFloat64Field) {
  namespace nm = dl::channel_noise_math;
  auto reference = [](uint32_t a, uint32_t b) {
    const double u1 = (static_cast<double>(a) + 0.5) / 4294967296.0;
    const double u2 = static_cast<double>(b) / 4294967296.0;
    return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
  };
  std::vector<uint32_t> as = {0u,          1u,          2u,          1000u,       0x7FFFFFFFu,
                              0x80000000u, 0xB504F333u, 0xFFFFF000u, 0xFFFFFFFEu, 0xFFFFFFFFu};
  std::vector<uint32_t> bs;
  for (uint32_t q = 0; q < 8; ++q) {
    const uint32_t at = q << 29;  // multiples of an eighth turn
    for (uint32_t d : {0u, 1u, 0xFFFFFFFFu}) bs.push_back(at + d);
  }
  std::mt19937 rng(std::random_device{}());
  for (int i = 0; i < 200; ++i) {
    as.push_back(static_cast<uint32_t>(rng()));
    bs.push_back(static_cast<uint32_t>(rng()));
  }
  double worst = 0.0;
  for (uint32_t a : as) {
    for (uint32_t b : bs) {
      const double want = reference(a, b);
      const double err = std::abs(static_cast<double>(nm::noise_f32(a, b)) - want);
      worst = std::max(worst, err / (1.0 + std::abs(want)));
    }
  }
  EXPECT_LT(worst, 1e-6);
  // The hashes are the field's.
  for (uint64_t index : {uint64_t{0}, uint64_t{77}, (uint64_t{1} << 33) + 5}) {
    const float z = nm::noise_f32(nm::noise_hash_a(9u, index), nm::noise_hash_b(9u, index));
    EXPECT_NEAR(z, dl::channel_noise(9u, index), 1e-5);
  }
}

#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
// The per-channel stage's instruction-set variants compute the same bits.
TEST(RawImages, ChannelStageVariantsAgreeBitForBit) {
  if (!__builtin_cpu_supports("avx2")) GTEST_SKIP() << "this CPU has no AVX2";
  std::mt19937 rng(std::random_device{}());
  std::uniform_real_distribution<float> u(0.0f, 1.0f);
  for (int c : {1, 3, 13}) {
    for (auto type : {dl::SampleType::kU8, dl::SampleType::kU16, dl::SampleType::kF32}) {
      for (auto [h, w] : {std::pair{96, 96}, std::pair{37, 61}, std::pair{2, 3}}) {
        const dl::RawImage im = random_image(rng, w, h, {c, type});
        dl::ChannelParams p;
        p.flip = rng() & 1;
        p.blur_sigma = rng() % 3 == 0 ? 0.0f : 0.1f + 1.9f * u(rng);
        p.noise_std = rng() % 3 == 0 ? 0.0f : 0.2f * u(rng);
        p.noise_key = static_cast<uint32_t>(rng());
        dl::ChannelNormalization norm;
        for (int i = 0; i < c; ++i) {
          p.brightness.push_back(rng() % 4 == 0 ? 1.0f : 0.6f + 0.8f * u(rng));
          p.contrast.push_back(rng() % 4 == 0 ? 1.0f : 0.6f + 0.8f * u(rng));
          norm.mean.push_back(0.2f + 0.4f * u(rng));
          norm.std.push_back(0.1f + 0.3f * u(rng));
        }
        for (auto out_type : {dl::OutputType::kFloat32, dl::OutputType::kBFloat16}) {
          for (bool channels_last : {false, true}) {
            std::vector<float> a(static_cast<size_t>(c) * h * w), b(a.size());
            std::vector<float> scratch(dl::channel_scratch_floats(h, w, c));
            dl::PlanarOutput o{a.data(), out_type, channels_last ? 1 : int64_t{h} * w,
                               channels_last ? int64_t{w} * c : w, channels_last ? c : 1};
            dl::photometric_default::apply_channel_photometric_kernel(
                im.bytes.data(), im.layout, h, w, p, norm, o, scratch.data());
            o.data = b.data();
            dl::photometric_avx2::apply_channel_photometric_kernel(im.bytes.data(), im.layout, h, w,
                                                                   p, norm, o, scratch.data());
            ASSERT_EQ(std::memcmp(a.data(), b.data(), a.size() * sizeof(float)), 0)
                << c << " " << dl::sample_type_name(type) << " " << h << "x" << w;
          }
        }
      }
    }
  }
}
#endif

#if DINO_OPT_TEST_IMGCODECS
TEST(RawImages, PngAndTiffRoundTripAtTheirDepth) {
  std::mt19937 rng(std::random_device{}());
  for (int channels : {1, 2, 3, 4}) {
    for (auto type : {dl::SampleType::kU8, dl::SampleType::kU16}) {
      for (auto format : {dl::ImageFormat::kPng, dl::ImageFormat::kTiff}) {
        if (channels == 2) continue;  // OpenCV writes 1, 3 or 4 channels
        const dl::RawImage im = random_image(rng, 1 + rng() % 30, 1 + rng() % 30, {channels, type});
        const auto bytes = dl::encode_raw(im.view(), format);
        const dl::RawImage back = dl::decode_raw(bytes.data(), bytes.size(), dl::ImageHeader{});
        EXPECT_EQ(back.layout, im.layout)
            << dl::format_name(format) << " " << back.layout.describe();
        EXPECT_EQ(back.bytes, im.bytes) << dl::format_name(format) << " " << im.layout.describe();
      }
    }
  }
  // PNG holds no float and no more than 4 channels.
  const dl::RawImage f = random_image(rng, 4, 4, {1, dl::SampleType::kF32});
  expect_image_error([&] { dl::encode_raw(f.view(), dl::ImageFormat::kPng); }, "PNG is written");
  const dl::RawImage two = random_image(rng, 4, 4, {2, dl::SampleType::kU16});
  expect_image_error([&] { dl::encode_raw(two.view(), dl::ImageFormat::kTiff); },
                     "TIFF is written with 1, 3 or 4 channels");
}

// An uncompressed little-endian TIFF of `im` (chunky, one strip), written here
// because OpenCV writes no TIFF of 2 or more than 4 channels.
std::vector<uint8_t> plain_tiff(const dl::RawImage& im) {
  const int c = im.layout.channels, sb = dl::sample_bytes(im.layout.type);
  constexpr int kTags = 10;
  const uint32_t ifd = 8, bits_at = ifd + 2 + 12 * kTags + 4, data_at = bits_at + 2 * c;
  std::vector<uint8_t> out(data_at + im.bytes.size());
  auto u16 = [&](size_t at, uint32_t v) {
    out[at] = v & 0xFF;
    out[at + 1] = (v >> 8) & 0xFF;
  };
  auto u32 = [&](size_t at, uint32_t v) {
    u16(at, v & 0xFFFF);
    u16(at + 2, v >> 16);
  };
  out[0] = out[1] = 'I';
  u16(2, 42);
  u32(4, ifd);
  u16(ifd, kTags);
  const auto w = static_cast<uint32_t>(im.width), h = static_cast<uint32_t>(im.height);
  const auto cc = static_cast<uint32_t>(c), bits = static_cast<uint32_t>(8 * sb);
  const uint32_t tags[kTags][4] = {// tag, type (3 SHORT, 4 LONG), count, value
                                   {256, 4, 1, w},
                                   {257, 4, 1, h},
                                   {258, 3, cc, c == 1 ? bits : bits_at},
                                   {259, 3, 1, 1},  // no compression
                                   {262, 3, 1, 1},  // BlackIsZero
                                   {273, 4, 1, data_at},
                                   {277, 3, 1, cc},
                                   {278, 4, 1, h},
                                   {279, 4, 1, static_cast<uint32_t>(im.bytes.size())},
                                   {284, 3, 1, 1}};  // chunky
  for (int i = 0; i < kTags; ++i) {
    const size_t e = ifd + 2 + 12 * i;
    u16(e, tags[i][0]);
    u16(e + 2, tags[i][1]);
    u32(e + 4, tags[i][2]);
    if (tags[i][1] == 3 && tags[i][2] == 1) {
      u16(e + 8, tags[i][3]);
    } else {
      u32(e + 8, tags[i][3]);
    }
  }
  for (int k = 0; k < c; ++k) u16(bits_at + 2 * k, bits);
  std::memcpy(out.data() + data_at, im.bytes.data(), im.bytes.size());
  return out;
}

TEST(RawImages, TiffsOfOtherChannelCountsAreReadOrRefusedNeverMisread) {
  std::mt19937 rng(std::random_device{}());
  for (int channels : {1, 2, 4, 6}) {
    const dl::RawImage im = random_image(rng, 9, 7, {channels, dl::SampleType::kU16});
    const auto bytes = plain_tiff(im);
    EXPECT_EQ(dl::probe_image(bytes.data(), bytes.size()).channels, channels);
    try {
      const dl::RawImage back = dl::decode_raw(bytes.data(), bytes.size(), dl::ImageHeader{});
      EXPECT_EQ(back.layout, im.layout) << channels;
      EXPECT_EQ(back.bytes, im.bytes) << channels;
      std::printf("a %d-channel uint16 TIFF: read as stored\n", channels);
    } catch (const dl::ImageError& e) {
      // What OpenCV cannot read as stored is refused, naming the way out.
      EXPECT_NE(std::string(e.what()).find(".npy"), std::string::npos) << e.what();
      EXPECT_NE(channels, 1) << e.what();
      std::printf("a %d-channel uint16 TIFF: refused (%s)\n", channels, e.what());
    }
  }
}

TEST(RawImages, PipelineRefusesASourceMixingLayouts) {
  std::mt19937 rng(std::random_device{}());
  const dl::RawImage gray16 = random_image(rng, 40, 30, {1, dl::SampleType::kU16});
  const auto bytes = dl::encode_raw(gray16.view(), dl::ImageFormat::kPng);
  dl::PipelineOptions options;
  options.mode = dl::ImageMode::kNative;
  options.photometric = false;
  options.augment.n_local = 0;
  options.layout = {3, dl::SampleType::kU8};
  options.layout_from = "first.png";
  std::vector<uint8_t> raw(2 * 224 * 224 * 3 * 2);
  std::vector<float> params(2 * 13);
  std::vector<dl::CropTarget> targets(2);
  for (int c = 0; c < 2; ++c) {
    targets[c].raw = raw.data() + c * 224 * 224 * 3 * 2;
    targets[c].raw_stride = 224 * 3 * 2;
    targets[c].params = params.data() + c * 13;
  }
  dl::PipelineScratch scratch;
  dl::Rng r(0, 0, 0);
  expect_image_error(
      [&] { dl::run_multicrop(bytes.data(), bytes.size(), r, options, targets, scratch); },
      "a 1-channel uint16 image, but the data set's images are 3-channel uint8 (as its first, "
      "first.png)");
}
#endif  // DINO_OPT_TEST_IMGCODECS
