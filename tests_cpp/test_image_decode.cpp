// Reading and decoding images (csrc/loader/image_decode.h): JPEG through
// TurboJPEG at every DCT scale, grayscale and CMYK JPEGs, the other formats
// through OpenCV imgcodecs, and every kind of bad input the loader meets.
// Images are made in memory from smooth synthetic content with a fresh seed
// per run; a failing test prints its seed (DINO_OPT_TEST_SEED=N repeats it).
#include <errno.h>
#include <gtest/gtest.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "loader/image_decode.h"
#include "test_util.h"

#if DINO_OPT_TEST_IMGCODECS
#include <opencv2/core.hpp>
#include <opencv2/imgcodecs.hpp>
#endif

namespace dl = dino_opt::loader;

namespace {

// Expects `call` to throw a dl::ImageError whose message contains every fragment.
void expect_image_error(const std::function<void()>& call,
                        const std::vector<std::string>& fragments) {
  try {
    call();
    ADD_FAILURE() << "expected an ImageError containing: " << fragments.front();
  } catch (const dl::ImageError& e) {
    for (const auto& fragment : fragments) {
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos)
          << "message was: " << e.what() << "\nexpected: " << fragment;
    }
  }
}

// A fresh seed per test, or DINO_OPT_TEST_SEED; printed when the test fails.
class ImageDecode : public ::testing::Test {
 protected:
  void SetUp() override {
    const char* env = std::getenv("DINO_OPT_TEST_SEED");
    seed_ = env != nullptr ? std::strtoul(env, nullptr, 10) : std::random_device{}();
    rng_.seed(seed_);
  }
  void TearDown() override {
    if (HasFailure()) std::printf("random seed of this test: DINO_OPT_TEST_SEED=%u\n", seed_);
  }
  unsigned seed_ = 0;
  std::mt19937 rng_;
};

// Smooth natural-looking content: per-channel gradients and a slow wave, plus a
// few flat discs and rectangles with sharp edges.
dl::Image make_image(int w, int h, std::mt19937& rng) {
  std::uniform_real_distribution<float> u(0.f, 1.f);
  float base[3], gx[3], gy[3], wave[3];
  for (int c = 0; c < 3; ++c) {
    base[c] = 40 + 120 * u(rng);
    gx[c] = 90 * (u(rng) - 0.5f);
    gy[c] = 90 * (u(rng) - 0.5f);
    wave[c] = 25 * u(rng);
  }
  const float freq = 2 + 4 * u(rng);
  dl::Image img(w, h);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      const float fx = static_cast<float>(x) / w, fy = static_cast<float>(y) / h;
      for (int c = 0; c < 3; ++c) {
        const float v =
            base[c] + gx[c] * fx + gy[c] * fy + wave[c] * std::sin(freq * (fx + fy + c));
        img.row(y)[3 * x + c] = static_cast<uint8_t>(std::clamp(v, 0.f, 255.f));
      }
    }
  }
  for (int s = 0; s < 4; ++s) {
    const float cx = u(rng) * w, cy = u(rng) * h, r = (0.1f + 0.2f * u(rng)) * std::min(w, h);
    float color[3];
    for (auto& c : color) c = 255 * u(rng);
    const bool disc = s % 2 == 0;
    for (int y = 0; y < h; ++y) {
      for (int x = 0; x < w; ++x) {
        // Signed distance to the shape's edge, blended over ~1.5 px as a
        // camera's optics would: photographs have no aliased edges.
        const float dx = x - cx, dy = y - cy;
        const float dist = disc ? std::sqrt(dx * dx + dy * dy) - r
                                : std::max(std::abs(dx) - r, std::abs(dy) - r / 2);
        const float cover = std::clamp(0.5f - dist / 1.5f, 0.f, 1.f);
        if (cover <= 0) continue;
        uint8_t* p = img.row(y) + 3 * x;
        for (int c = 0; c < 3; ++c) {
          p[c] = static_cast<uint8_t>(std::lround(p[c] + cover * (color[c] - p[c])));
        }
      }
    }
  }
  return img;
}

// TurboJPEG compression with the test's own handle (any pixel format).
std::vector<uint8_t> tj_compress(const uint8_t* pixels, int w, int h, int pixel_format, int subsamp,
                                 int quality, int flags = 0) {
  tjhandle handle = tjInitCompress();
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  const int rc =
      tjCompress2(handle, pixels, w, 0, h, pixel_format, &buffer, &size, subsamp, quality, flags);
  std::vector<uint8_t> out(buffer, buffer + (rc == 0 ? size : 0));
  tjFree(buffer);
  tjDestroy(handle);
  EXPECT_EQ(rc, 0) << "tjCompress2 failed";
  return out;
}

std::vector<uint8_t> jpeg_of(const dl::Image& img, int quality = 92, int flags = 0) {
  return tj_compress(img.pixels.data(), img.width, img.height, TJPF_RGB, TJSAMP_420, quality,
                     flags);
}

dl::Image decode(const std::vector<uint8_t>& bytes, int denom = 1,
                 const dl::DecodeOptions& options = {}) {
  const dl::ImageHeader header = dl::probe_image(bytes.data(), bytes.size(), options);
  return dl::decode_image(bytes.data(), bytes.size(), header, denom, options);
}

double mean_abs_diff(const dl::Image& a, const dl::Image& b) {
  EXPECT_EQ(a.width, b.width);
  EXPECT_EQ(a.height, b.height);
  if (a.pixels.size() != b.pixels.size() || a.pixels.empty()) return 1e9;
  double sum = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) sum += std::abs(a.pixels[i] - b.pixels[i]);
  return sum / a.pixels.size();
}

double psnr(const dl::Image& a, const dl::Image& b) {
  double se = 0;
  for (size_t i = 0; i < a.pixels.size(); ++i) {
    const double d = a.pixels[i] - b.pixels[i];
    se += d * d;
  }
  const double mse = se / a.pixels.size();
  return mse == 0 ? 99 : 10 * std::log10(255.0 * 255.0 / mse);
}

// Mean over each denom x denom block (partial blocks at the right and bottom).
dl::Image box_downscale(const dl::Image& src, int denom) {
  dl::Image out((src.width + denom - 1) / denom, (src.height + denom - 1) / denom);
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      for (int c = 0; c < 3; ++c) {
        int sum = 0, n = 0;
        for (int yy = y * denom; yy < std::min(src.height, (y + 1) * denom); ++yy) {
          for (int xx = x * denom; xx < std::min(src.width, (x + 1) * denom); ++xx, ++n) {
            sum += src.pixels[(static_cast<size_t>(yy) * src.width + xx) * 3 + c];
          }
        }
        out.row(y)[3 * x + c] = static_cast<uint8_t>((sum + n / 2) / n);
      }
    }
  }
  return out;
}

// Offset of the first top-level JPEG segment with this marker (the 0xFF byte).
size_t find_segment(const std::vector<uint8_t>& jpeg, uint8_t marker, size_t from = 2) {
  size_t pos = from;
  while (pos + 4 <= jpeg.size() && jpeg[pos] == 0xFF) {
    if (jpeg[pos + 1] == marker) return pos;
    if (jpeg[pos + 1] == 0xDA) break;  // entropy-coded data follows: stop the walk
    pos += 2 + ((jpeg[pos + 2] << 8) | jpeg[pos + 3]);
  }
  ADD_FAILURE() << "no JPEG segment 0xFF" << std::hex << int{marker};
  return 0;
}

// PIL's CMYK -> RGB of the samples a CMYK JPEG stores (inverted: C = 255 - s).
void pil_rgb_from_stored_cmyk(const uint8_t* s, uint8_t* rgb) {
  const int nk = s[3];
  for (int c = 0; c < 3; ++c) {
    const int t = (255 - s[c]) * nk + 128;
    rgb[c] = static_cast<uint8_t>(std::clamp(nk - (((t >> 8) + t) >> 8), 0, 255));
  }
}

using dino_opt::testing::TempDir;
using dino_opt::testing::write_file;

// ------------------------------------------------------------------ JPEG

TEST_F(ImageDecode, FormatNamesAndBuildFlags) {
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kJpeg), "JPEG");
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kPng), "PNG");
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kWebp), "WebP");
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kBmp), "BMP");
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kTiff), "TIFF");
  EXPECT_STREQ(dl::format_name(dl::ImageFormat::kUnknown), "unknown");
  EXPECT_EQ(dl::other_formats_available(), DINO_OPT_TEST_IMGCODECS != 0);
}

TEST_F(ImageDecode, JpegRoundTripKeepsTheContent) {
  for (auto [w, h] : {std::pair{256, 192}, {97, 131}, {640, 16}}) {
    const dl::Image src = make_image(w, h, rng_);
    const auto bytes = dl::encode_jpeg(src.view(), 95);
    const dl::ImageHeader header = dl::probe_image(bytes.data(), bytes.size());
    EXPECT_EQ(header.format, dl::ImageFormat::kJpeg);
    EXPECT_EQ(header.width, w);
    EXPECT_EQ(header.height, h);
    const dl::Image got = dl::decode_image(bytes.data(), bytes.size(), header);
    ASSERT_EQ(got.width, w);
    ASSERT_EQ(got.height, h);
    EXPECT_GT(psnr(got, src), 30.0) << w << "x" << h;
    // A lower quality gives a smaller file that still resembles the source.
    const auto small = dl::encode_jpeg(src.view(), 30);
    EXPECT_LT(small.size(), bytes.size());
    EXPECT_GT(psnr(decode(small), src), 24.0);
  }
}

TEST_F(ImageDecode, JpegScaledSizeRoundsUpLikeTurboJpeg) {
  EXPECT_EQ(dl::jpeg_scaled_size(203, 157, 1), std::make_pair(203, 157));
  EXPECT_EQ(dl::jpeg_scaled_size(203, 157, 2), std::make_pair(102, 79));
  EXPECT_EQ(dl::jpeg_scaled_size(203, 157, 4), std::make_pair(51, 40));
  EXPECT_EQ(dl::jpeg_scaled_size(203, 157, 8), std::make_pair(26, 20));
  EXPECT_EQ(dl::jpeg_scaled_size(1, 1, 8), std::make_pair(1, 1));
  EXPECT_EQ(dl::jpeg_scaled_size(65535, 8, 8), std::make_pair(8192, 1));
  for (int bad : {0, 3, 16, -2}) {
    expect_image_error([&] { dl::jpeg_scaled_size(100, 100, bad); },
                       {"1, 2, 4 or 8", std::to_string(bad)});
  }
  expect_image_error([] { dl::jpeg_scaled_size(-1, 100, 2); }, {"negative"});
}

TEST_F(ImageDecode, JpegScaledDecodeIsABoxDownscaleOfTheFullDecode) {
  const dl::Image src = make_image(203, 157, rng_);
  const auto bytes = jpeg_of(src, 95);
  const dl::Image full = decode(bytes, 1);
  for (int denom : {2, 4, 8}) {
    const dl::Image scaled = decode(bytes, denom);
    const auto [w, h] = dl::jpeg_scaled_size(203, 157, denom);
    ASSERT_EQ(scaled.width, w);
    ASSERT_EQ(scaled.height, h);
    // The DCT-domain scale is not exactly a box filter (sharp edges ring a
    // little, partial border blocks differ), but it is close on the average.
    const double mad = mean_abs_diff(scaled, box_downscale(full, denom));
    EXPECT_LT(mad, 2.0) << "1/" << denom;
  }
  expect_image_error([&] { decode(bytes, 3); }, {"1, 2, 4 or 8"});
}

TEST_F(ImageDecode, GrayscaleJpegBecomesRgb) {
  const int w = 120, h = 90;
  const dl::Image color = make_image(w, h, rng_);
  std::vector<uint8_t> gray(static_cast<size_t>(w) * h);
  for (size_t i = 0; i < gray.size(); ++i) gray[i] = color.pixels[3 * i + 1];
  const auto bytes = tj_compress(gray.data(), w, h, TJPF_GRAY, TJSAMP_GRAY, 95);
  for (int denom : {1, 2}) {
    const dl::Image got = decode(bytes, denom);
    ASSERT_EQ(got.width, (w + denom - 1) / denom);
    double sum = 0;
    for (int y = 0; y < got.height; ++y) {
      for (int x = 0; x < got.width; ++x) {
        const uint8_t* p = got.view().row(y) + 3 * x;
        ASSERT_EQ(p[0], p[1]);
        ASSERT_EQ(p[1], p[2]);
        if (denom == 1) sum += std::abs(p[0] - gray[static_cast<size_t>(y) * w + x]);
      }
    }
    if (denom == 1) EXPECT_LT(sum / (w * h), 2.0);
  }
}

TEST_F(ImageDecode, CmykJpegConvertsToRgbLikePil) {
  // The test's formula against values PIL 13 gives for Image.new("CMYK", (1, 1),
  // c).convert("RGB"); a CMYK JPEG stores 255 - c.
  const struct {
    uint8_t cmyk[4];
    uint8_t rgb[3];
  } kPil[] = {{{0, 0, 0, 0}, {255, 255, 255}},     {{255, 255, 255, 255}, {0, 0, 0}},
              {{112, 9, 29, 32}, {125, 215, 198}}, {{10, 200, 128, 0}, {245, 55, 127}},
              {{0, 0, 0, 255}, {0, 0, 0}},         {{200, 50, 255, 100}, {33, 125, 0}},
              {{1, 254, 127, 128}, {127, 0, 64}},  {{77, 160, 33, 250}, {3, 2, 4}}};
  for (const auto& sample : kPil) {
    uint8_t stored[4], rgb[3];
    for (int c = 0; c < 4; ++c) stored[c] = static_cast<uint8_t>(255 - sample.cmyk[c]);
    pil_rgb_from_stored_cmyk(stored, rgb);
    EXPECT_EQ(std::vector<uint8_t>(rgb, rgb + 3), std::vector<uint8_t>(sample.rgb, sample.rgb + 3));
  }

  // A YCCK JPEG (what TurboJPEG writes from CMYK) of flat 16x16 patches, one per
  // PIL sample, then noisy content to reach every value path.
  const int n = static_cast<int>(std::size(kPil));
  const int w = 16 * n, h = 32;
  std::vector<uint8_t> cmyk(static_cast<size_t>(w) * h * 4);
  std::uniform_int_distribution<int> byte(0, 255);
  for (int y = 0; y < h; ++y) {
    for (int x = 0; x < w; ++x) {
      for (int c = 0; c < 4; ++c) {
        cmyk[(static_cast<size_t>(y) * w + x) * 4 + c] =
            y < 16 ? static_cast<uint8_t>(255 - kPil[x / 16].cmyk[c])
                   : static_cast<uint8_t>(byte(rng_));
      }
    }
  }
  const auto bytes = tj_compress(cmyk.data(), w, h, TJPF_CMYK, TJSAMP_444, 100);
  const dl::Image got = decode(bytes);
  ASSERT_EQ(got.width, w);
  ASSERT_EQ(got.height, h);

  // Exactly PIL's conversion of the samples libjpeg decodes.
  std::vector<uint8_t> stored(cmyk.size());
  tjhandle handle = tjInitDecompress();
  ASSERT_EQ(tjDecompress2(handle, bytes.data(), bytes.size(), stored.data(), w, 0, h, TJPF_CMYK, 0),
            0);
  tjDestroy(handle);
  for (int i = 0; i < w * h; ++i) {
    uint8_t want[3];
    pil_rgb_from_stored_cmyk(&stored[4 * static_cast<size_t>(i)], want);
    ASSERT_EQ(got.pixels[3 * i], want[0]) << "pixel " << i;
    ASSERT_EQ(got.pixels[3 * i + 1], want[1]) << "pixel " << i;
    ASSERT_EQ(got.pixels[3 * i + 2], want[2]) << "pixel " << i;
  }
  // And the flat patches land near PIL's colours (JPEG rounding only).
  for (int k = 0; k < n; ++k) {
    const uint8_t* p = got.view().row(8) + 3 * (16 * k + 8);
    for (int c = 0; c < 3; ++c) EXPECT_NEAR(p[c], kPil[k].rgb[c], 3) << "patch " << k;
  }
  // Scaled decoding works for CMYK too.
  const dl::Image half = decode(bytes, 2);
  EXPECT_EQ(half.width, w / 2);
  EXPECT_NEAR(half.view().row(4)[3 * 20], kPil[2].rgb[0], 4);
}

TEST_F(ImageDecode, TruncatedJpegIsAnErrorWhereverItIsCut) {
  const dl::Image src = make_image(160, 120, rng_);
  for (int flags : {0, TJFLAG_PROGRESSIVE}) {
    const auto bytes = jpeg_of(src, 90, flags);
    const size_t n = bytes.size();
    std::vector<size_t> cuts = {1,     2,     3,         4,     20,    100,  300,
                                n / 4, n / 2, 3 * n / 4, n - 3, n - 2, n - 1};
    std::uniform_int_distribution<size_t> anywhere(3, n - 1);
    for (int i = 0; i < 20; ++i) cuts.push_back(anywhere(rng_));
    for (size_t cut : cuts) {
      const std::vector<uint8_t> part(bytes.begin(), bytes.begin() + cut);
      // Under 3 bytes the JPEG signature itself is cut.
      const std::string why = cut < 3 ? "unknown image format" : "truncated or corrupt";
      expect_image_error([&] { decode(part); }, {why});
      expect_image_error([&] { decode(part, 4); }, {why});
    }
    // A cut inside the entropy-coded data says why.
    const std::vector<uint8_t> half(bytes.begin(), bytes.begin() + n / 2);
    expect_image_error([&] { decode(half); }, {"truncated", "ends before the image"});
    EXPECT_NO_THROW(decode(bytes));
  }
}

TEST_F(ImageDecode, RecoverableJpegDamageDecodesAsPilDoes) {
  const dl::Image src = make_image(160, 120, rng_);
  // Junk before EOI: libjpeg warns "Corrupt JPEG data: 3 extraneous bytes
  // before marker 0xd9" and PIL reads the file; so do we, with the same pixels.
  auto bytes = jpeg_of(src, 90);
  const dl::Image clean = decode(bytes);
  auto junk = bytes;
  junk.insert(junk.end() - 2, {0x12, 0x34, 0x56});
  const dl::Image got = decode(junk);
  EXPECT_EQ(got.pixels, clean.pixels);

  // Junk between the scans of a progressive JPEG: decoded; the same file cut
  // short afterwards (a warning first, the premature end second) is refused.
  auto progressive = jpeg_of(src, 90, TJFLAG_PROGRESSIVE);
  const dl::Image clean_progressive = decode(progressive);
  const size_t first_scan = find_segment(progressive, 0xDA);
  size_t second_scan = 0;
  for (size_t i = first_scan + 2; i + 1 < progressive.size(); ++i) {
    if (progressive[i] == 0xFF && progressive[i + 1] == 0xDA) {
      second_scan = i;
      break;
    }
  }
  ASSERT_GT(second_scan, 0u);
  progressive.insert(progressive.begin() + static_cast<std::ptrdiff_t>(second_scan), {0, 0, 0});
  EXPECT_EQ(decode(progressive).pixels, clean_progressive.pixels);
  const std::vector<uint8_t> cut(progressive.begin(), progressive.end() - 200);
  expect_image_error([&] { decode(cut); }, {"truncated"});
}

TEST_F(ImageDecode, AFailedDecodeLeavesTheThreadAbleToDecode) {
  // TurboJPEG 2.x leaves a handle mid-header after a failed header read; the
  // next valid file on the same thread must still decode.
  const auto bytes = jpeg_of(make_image(48, 40, rng_));
  const dl::Image want = decode(bytes);
  for (size_t cut : {size_t{40}, size_t{120}, bytes.size() / 2}) {
    const std::vector<uint8_t> part(bytes.begin(),
                                    bytes.begin() + static_cast<std::ptrdiff_t>(cut));
    EXPECT_THROW(decode(part), dl::ImageError);
    EXPECT_EQ(decode(bytes).pixels, want.pixels) << "after a cut at " << cut;
  }
}

TEST_F(ImageDecode, RandomBytesAreRefused) {
  std::uniform_int_distribution<int> byte(0, 255);
  std::uniform_int_distribution<size_t> length(1, 5000);
  const std::vector<std::vector<uint8_t>> prefixes = {
      {},
      {0xFF, 0xD8, 0xFF},
      {0xFF, 0xD8, 0xFF, 0xDB, 0x00, 0x43},
      {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'},
      {'R', 'I', 'F', 'F', 0, 0, 0, 0, 'W', 'E', 'B', 'P'},
      {'B', 'M'},
      {'I', 'I', 42, 0},
      {'M', 'M', 0, 42}};
  dl::DecodeOptions options;
  options.max_pixels = 1 << 22;  // random headers must not make the test allocate much
  for (const auto& prefix : prefixes) {
    for (int i = 0; i < 60; ++i) {
      std::vector<uint8_t> data(prefix);
      const size_t n = length(rng_);
      while (data.size() < prefix.size() + n) data.push_back(static_cast<uint8_t>(byte(rng_)));
      if (prefix.empty() && (data[0] == 0xFF || data[0] == 0x89 || data[0] == 'R' ||
                             data[0] == 'B' || data[0] == 'I' || data[0] == 'M')) {
        data[0] = 0;  // keep the unprefixed buffers unrecognisable
      }
      try {
        const dl::Image img = decode(data, 1, options);
        // Decoding random bytes is not impossible for lenient formats (a BMP
        // header with random pixels), but the result is then a whole image.
        EXPECT_FALSE(prefix.empty());
        EXPECT_EQ(img.pixels.size(), static_cast<size_t>(img.width) * img.height * 3);
      } catch (const dl::ImageError& e) {
        if (prefix.empty())
          EXPECT_NE(std::string(e.what()).find("unknown image format"), std::string::npos);
      }
    }
  }
}

TEST_F(ImageDecode, EmptyDataIsRefused) {
  const uint8_t byte = 0xFF;
  expect_image_error([] { dl::probe_image(nullptr, 0); }, {"0 bytes"});
  expect_image_error([&] { dl::probe_image(&byte, 0); }, {"0 bytes"});
  expect_image_error([&] { dl::probe_image(&byte, 1); }, {"unknown image format", "ff"});
  expect_image_error([] { dl::decode_image(nullptr, 0, {}); }, {"0 bytes"});
}

TEST_F(ImageDecode, PixelLimitIsAppliedFromTheHeaderBeforeDecoding) {
  const dl::Image src = make_image(100, 100, rng_);
  auto bytes = jpeg_of(src);
  dl::DecodeOptions exact;
  exact.max_pixels = 100 * 100;
  EXPECT_EQ(decode(bytes, 1, exact).width, 100);
  dl::DecodeOptions below;
  below.max_pixels = 100 * 100 - 1;
  expect_image_error([&] { dl::probe_image(bytes.data(), bytes.size(), below); },
                     {"100x100", "9999", "max_pixels"});

  // The SOF header patched to claim 60000x60000 (3.6 gigapixels, a 10.8 GB
  // buffer): refused by the default limit from the header alone; decode_image
  // refuses it the same way instead of allocating and decoding.
  const size_t sof = find_segment(bytes, 0xC0);
  ASSERT_GT(sof, 0u);
  for (size_t at : {sof + 5, sof + 7}) {  // height, then width, big-endian
    bytes[at] = 60000 >> 8;
    bytes[at + 1] = 60000 & 0xFF;
  }
  expect_image_error([&] { dl::probe_image(bytes.data(), bytes.size()); },
                     {"JPEG", "60000x60000", "3600000000", "178956970", "max_pixels"});
  expect_image_error([&] { dl::decode_image(bytes.data(), bytes.size(), dl::ImageHeader{}, 8); },
                     {"60000x60000", "max_pixels"});
  // The patch is where TurboJPEG reads the size: a limit that admits the image
  // sees 60000x60000 (not decoded here: that would allocate the 10.8 GB).
  dl::DecodeOptions huge;
  huge.max_pixels = int64_t{60000} * 60000;
  const dl::ImageHeader header = dl::probe_image(bytes.data(), bytes.size(), huge);
  EXPECT_EQ(header.width, 60000);
  EXPECT_EQ(header.height, 60000);
}

TEST_F(ImageDecode, TinyAndThinJpegs) {
  for (auto [w, h] : {std::pair{1, 1}, {10000, 3}, {3, 10000}, {17, 1}}) {
    const dl::Image src = make_image(w, h, rng_);
    const auto bytes = jpeg_of(src, 95);
    for (int denom : {1, 2, 4, 8}) {
      const dl::Image got = decode(bytes, denom);
      const auto [sw, sh] = dl::jpeg_scaled_size(w, h, denom);
      ASSERT_EQ(got.width, sw) << w << "x" << h << " at 1/" << denom;
      ASSERT_EQ(got.height, sh) << w << "x" << h << " at 1/" << denom;
      if (denom == 1) EXPECT_GT(psnr(got, src), 22.0) << w << "x" << h;
    }
  }
}

TEST_F(ImageDecode, DecodeChecksTheHeaderAgainstTheData) {
  const auto bytes = jpeg_of(make_image(64, 48, rng_));
  dl::ImageHeader header = dl::probe_image(bytes.data(), bytes.size());
  header.width = 65;
  expect_image_error([&] { dl::decode_image(bytes.data(), bytes.size(), header); },
                     {"does not match", "65x48", "64x48"});
  header.width = 64;
  header.format = dl::ImageFormat::kPng;
  expect_image_error([&] { dl::decode_image(bytes.data(), bytes.size(), header); },
                     {"does not match"});
  // A default header lets decode_image probe by itself.
  EXPECT_EQ(dl::decode_image(bytes.data(), bytes.size(), dl::ImageHeader{}).width, 64);
  dl::DecodeOptions none;
  none.max_pixels = 0;
  expect_image_error([&] { dl::probe_image(bytes.data(), bytes.size(), none); },
                     {"max_pixels must be positive"});
}

TEST_F(ImageDecode, EncodeJpegHonoursStrideAndChecksItsArguments) {
  const dl::Image src = make_image(75, 50, rng_);
  // The same pixels with 13 bytes of padding per row encode to the same file.
  const int64_t stride = 3 * 75 + 13;
  std::vector<uint8_t> padded(static_cast<size_t>(stride) * 50, 0xAB);
  for (int y = 0; y < 50; ++y) std::memcpy(&padded[y * stride], src.view().row(y), 3 * 75);
  const dl::ImageView view{padded.data(), 75, 50, stride};
  EXPECT_EQ(dl::encode_jpeg(view, 90), dl::encode_jpeg(src.view(), 90));

  for (int q : {0, 101, -5}) {
    expect_image_error([&] { dl::encode_jpeg(src.view(), q); }, {"quality", std::to_string(q)});
  }
  expect_image_error([&] { dl::encode_jpeg(dl::ImageView{}, 90); }, {"empty image"});
  expect_image_error(
      [&] {
        dl::encode_jpeg({src.pixels.data(), 75, 50, 3 * 75 - 1}, 90);
      },
      {"stride"});
  expect_image_error(
      [&] {
        dl::encode_jpeg({src.pixels.data(), 70000, 1, 3 * 70000}, 90);
      },
      {"65535"});
}

TEST_F(ImageDecode, ConcurrentDecodesMatchSerialOnes) {
  // Per-thread TurboJPEG handles: many threads decoding at once give exactly
  // the serial results.
  std::vector<std::vector<uint8_t>> files;
  for (int i = 0; i < 6; ++i) files.push_back(jpeg_of(make_image(64 + 17 * i, 80, rng_), 90));
  std::vector<uint8_t> gray(90 * 70, 100);
  files.push_back(tj_compress(gray.data(), 90, 70, TJPF_GRAY, TJSAMP_GRAY, 90));
  std::vector<uint8_t> cmyk(40 * 30 * 4, 60);
  files.push_back(tj_compress(cmyk.data(), 40, 30, TJPF_CMYK, TJSAMP_444, 90));
  files.push_back(std::vector<uint8_t>(files[0].begin(), files[0].begin() + 500));  // truncated
  std::vector<std::vector<uint8_t>> want;
  for (const auto& f : files) {
    for (int denom : {1, 2, 4, 8}) {
      try {
        want.push_back(decode(f, denom).pixels);
      } catch (const dl::ImageError&) {
        want.push_back({});
      }
    }
  }
  std::vector<int> mismatches(4, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < 5; ++round) {
        for (size_t i = 0; i < want.size(); ++i) {
          const size_t k = (i + static_cast<size_t>(t) * 7) % want.size();  // different orders
          std::vector<uint8_t> got;
          try {
            got = decode(files[k / 4], 1 << (k % 4)).pixels;
          } catch (const dl::ImageError&) {
          }
          if (got != want[k]) ++mismatches[t];
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < 4; ++t) EXPECT_EQ(mismatches[t], 0) << "thread " << t;
}

// ------------------------------------------------------------------ files

TEST_F(ImageDecode, ReadFileReadsWholeFilesAndNamesEachFailure) {
  const TempDir dir("dino_opt_decode");
  std::vector<uint8_t> content(300001);
  for (auto& b : content) b = static_cast<uint8_t>(rng_());
  write_file(dir / "a.jpg", content);
  EXPECT_EQ(dl::read_file(dir / "a.jpg"), content);

  write_file(dir / "empty.jpg", {});
  expect_image_error([&] { dl::read_file(dir / "empty.jpg"); }, {"empty", "0 bytes"});
  expect_image_error([&] { dl::read_file(dir / "missing.jpg"); },
                     {"no such file", "No such file or directory"});
  expect_image_error([&] { dl::read_file(dir.path()); }, {"directory"});
  expect_image_error([&] { dl::read_file(dir / "a.jpg/x.jpg"); },
                     {"cannot open", "Not a directory"});

  // Unreadable files. Tests run as root here, where chmod 000 stops nothing,
  // so the failures come from the kernel instead: a symlink loop fails in
  // open(), and /proc/self/mem opens as a regular file whose read at offset 0
  // (an unmapped address) fails with EIO.
  ASSERT_EQ(::symlink((dir / "loop.jpg").c_str(), (dir / "loop.jpg").c_str()), 0);
  expect_image_error([&] { dl::read_file(dir / "loop.jpg"); }, {"cannot open", "symbolic links"});
  if (::access("/proc/self/mem", F_OK) == 0) {
    expect_image_error([] { dl::read_file("/proc/self/mem"); }, {"read failed", "error"});
  }
  // A FIFO is refused without waiting for a writer.
  ASSERT_EQ(::mkfifo((dir / "fifo.jpg").c_str(), 0600), 0);
  expect_image_error([&] { dl::read_file(dir / "fifo.jpg"); }, {"not a regular file"});
  // Random bytes named .jpg: read fine, refused by the decoder.
  expect_image_error(
      [&] {
        auto bytes = dl::read_file(dir / "a.jpg");
        bytes[0] = 0;
        decode(bytes);
      },
      {"unknown image format"});
}

// ------------------------------------------------------------------ other formats

TEST_F(ImageDecode, JpegOnlyBuildRefusesOtherFormatsClearly) {
  if (dl::other_formats_available()) GTEST_SKIP() << "this build has OpenCV imgcodecs";
  const std::vector<uint8_t> png = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n', 0, 0, 0, 13,
                                    'I',  'H', 'D', 'R', 0,    0,    0,    8,    0, 0, 0, 8};
  expect_image_error([&] { dl::probe_image(png.data(), png.size()); }, {"PNG", "JPEG only"});
}

#if DINO_OPT_TEST_IMGCODECS

std::vector<uint8_t> cv_encode(const std::string& ext, const cv::Mat& m,
                               const std::vector<int>& params = {}) {
  std::vector<uint8_t> out;
  try {
    if (!cv::imencode(ext, m, out, params)) out.clear();
  } catch (const cv::Exception&) {
    out.clear();
  }
  return out;
}

// Expected RGB of a BGR(A) or gray, 8- or 16-bit Mat, by the documented rule.
std::vector<uint8_t> expected_rgb(const cv::Mat& m) {
  std::vector<uint8_t> out;
  auto to8 = [&](int y, int x, int c) -> uint8_t {
    if (m.depth() == CV_16U)
      return static_cast<uint8_t>((m.ptr<uint16_t>(y)[x * m.channels() + c] + 128) / 257);
    return m.ptr<uint8_t>(y)[x * m.channels() + c];
  };
  for (int y = 0; y < m.rows; ++y) {
    for (int x = 0; x < m.cols; ++x) {
      if (m.channels() == 1) {
        out.insert(out.end(), 3, to8(y, x, 0));
      } else {
        out.insert(out.end(), {to8(y, x, 2), to8(y, x, 1), to8(y, x, 0)});
      }
    }
  }
  return out;
}

TEST_F(ImageDecode, PngWithAlphaSixteenBitAndGrayBecomeRgb) {
  const int w = 37, h = 23;
  cv::Mat bgra(h, w, CV_8UC4), bgr16(h, w, CV_16UC3), gray(h, w, CV_8UC1), gray16(h, w, CV_16UC1);
  cv::randu(bgra, 0, 256);
  cv::randu(bgr16, 0, 65536);
  cv::randu(gray, 0, 256);
  cv::randu(gray16, 0, 65536);
  // 16-bit values at the rounding edges: 128 -> 0, 129 -> 1, 385 -> 1, 386 -> 2.
  const uint16_t edges[] = {0, 128, 129, 385, 386, 65535, 65407, 65406};
  for (int i = 0; i < 8; ++i) gray16.at<uint16_t>(0, i) = edges[i];
  bgra.at<cv::Vec4b>(1, 1) = {10, 20, 30, 0};  // fully transparent: colour still kept
  for (const cv::Mat* m : {&bgra, &bgr16, &gray, &gray16}) {
    const auto png = cv_encode(".png", *m);
    ASSERT_FALSE(png.empty());
    const dl::ImageHeader header = dl::probe_image(png.data(), png.size());
    EXPECT_EQ(header.format, dl::ImageFormat::kPng);
    EXPECT_EQ(header.width, w);
    EXPECT_EQ(header.height, h);
    const dl::Image got = dl::decode_image(png.data(), png.size(), header, 4);  // scale ignored
    ASSERT_EQ(got.width, w);
    ASSERT_EQ(got.height, h);
    EXPECT_EQ(got.pixels, expected_rgb(*m)) << "type " << m->type();
  }
  const auto png16 = cv_encode(".png", gray16);
  const dl::Image edge = decode(png16);
  const uint8_t want[] = {0, 0, 1, 1, 2, 255, 255, 254};
  for (int i = 0; i < 8; ++i) EXPECT_EQ(edge.pixels[3 * i], want[i]) << edges[i];
  dl::Image alpha = decode(cv_encode(".png", bgra));
  EXPECT_EQ(std::vector<uint8_t>(alpha.row(1) + 3, alpha.row(1) + 6),
            (std::vector<uint8_t>{30, 20, 10}));
}

TEST_F(ImageDecode, WebpBmpTiffRoundTrip) {
  const dl::Image src = make_image(45, 31, rng_);
  cv::Mat bgr(src.height, src.width, CV_8UC3);
  for (int y = 0; y < src.height; ++y) {
    for (int x = 0; x < src.width; ++x) {
      const uint8_t* p = src.view().row(y) + 3 * x;
      bgr.at<cv::Vec3b>(y, x) = {p[2], p[1], p[0]};
    }
  }
  const struct {
    const char* ext;
    dl::ImageFormat format;
    std::vector<int> params;
  } cases[] = {{".webp", dl::ImageFormat::kWebp, {cv::IMWRITE_WEBP_QUALITY, 101}},  // lossless
               {".webp", dl::ImageFormat::kWebp, {cv::IMWRITE_WEBP_QUALITY, 90}},
               {".bmp", dl::ImageFormat::kBmp, {}},
               {".tiff", dl::ImageFormat::kTiff, {}},
               {".png", dl::ImageFormat::kPng, {}}};
  for (const auto& c : cases) {
    const auto bytes = cv_encode(c.ext, bgr, c.params);
    if (bytes.empty()) {
      std::printf("OpenCV has no %s encoder here: skipped\n", c.ext);
      continue;
    }
    const dl::ImageHeader header = dl::probe_image(bytes.data(), bytes.size());
    EXPECT_EQ(header.format, c.format) << c.ext;
    EXPECT_EQ(header.width, 45) << c.ext;
    EXPECT_EQ(header.height, 31) << c.ext;
    const dl::Image got = dl::decode_image(bytes.data(), bytes.size(), header);
    const bool lossy = c.params.size() == 2 && c.params[1] <= 100;
    if (lossy) {
      EXPECT_GT(psnr(got, src), 25.0) << c.ext;
    } else {
      EXPECT_EQ(got.pixels, src.pixels) << c.ext;
    }
    // Cut short: refused, never a partial image.
    for (size_t cut : {bytes.size() / 2, bytes.size() - 1}) {
      if (c.format == dl::ImageFormat::kTiff && cut == bytes.size() - 1) continue;  // IFD last
      const std::vector<uint8_t> part(bytes.begin(),
                                      bytes.begin() + static_cast<std::ptrdiff_t>(cut));
      expect_image_error([&] { decode(part); },
                         {c.ext == std::string(".tiff") ? "TIFF" : "truncated or corrupt"});
    }
  }
}

TEST_F(ImageDecode, PixelLimitFromPngBmpAndWebpHeaders) {
  cv::Mat small(8, 8, CV_8UC3, cv::Scalar(1, 2, 3));
  // PNG: IHDR width/height at bytes 16 and 20 (big-endian); the CRC is not
  // checked before the limit refuses the file.
  auto png = cv_encode(".png", small);
  for (size_t at : {16u, 20u}) {
    png[at] = 0;
    png[at + 1] = 0;
    png[at + 2] = 60000 >> 8;
    png[at + 3] = 60000 & 0xFF;
  }
  expect_image_error([&] { dl::probe_image(png.data(), png.size()); },
                     {"PNG", "60000x60000", "max_pixels"});
  // BMP: signed 32-bit little-endian sides at bytes 18 and 22.
  auto bmp = cv_encode(".bmp", small);
  for (size_t at : {18u, 22u}) {
    bmp[at] = 60000 & 0xFF;
    bmp[at + 1] = 60000 >> 8;
    bmp[at + 2] = bmp[at + 3] = 0;
  }
  expect_image_error([&] { dl::probe_image(bmp.data(), bmp.size()); },
                     {"BMP", "60000x60000", "max_pixels"});
  // Zero sides are refused too.
  bmp[18] = bmp[19] = 0;
  expect_image_error([&] { dl::probe_image(bmp.data(), bmp.size()); }, {"zero side"});
  // WebP lossless: 14-bit sides minus one packed after the 0x2f signature.
  auto webp = cv_encode(".webp", small, {cv::IMWRITE_WEBP_QUALITY, 101});
  if (!webp.empty()) {
    ASSERT_EQ(std::string(webp.begin() + 12, webp.begin() + 16), "VP8L");
    const uint32_t bits = 16383u | (16383u << 14);
    for (int i = 0; i < 4; ++i)
      webp[21 + i] = static_cast<uint8_t>((webp[21 + i] & (i == 3 ? 0xF0 : 0)) | (bits >> (8 * i)));
    dl::DecodeOptions options;
    options.max_pixels = 1 << 24;
    expect_image_error([&] { dl::probe_image(webp.data(), webp.size(), options); },
                       {"WebP", "16384x16384", "max_pixels"});
  }
}

TEST_F(ImageDecode, ChunkSizesThatOverrunTheFileAreRefused) {
  // A WebP chunk claiming 3.5 GB in a small file: OpenCV 4.6 would allocate
  // the claimed size before failing; the probe refuses it first.
  cv::Mat small(8, 8, CV_8UC3, cv::Scalar(1, 2, 3));
  auto webp = cv_encode(".webp", small, {cv::IMWRITE_WEBP_QUALITY, 101});
  if (webp.empty()) GTEST_SKIP() << "OpenCV has no WebP encoder here";
  webp[16] = 0x00;
  webp[17] = 0x00;
  webp[18] = 0x01;
  webp[19] = 0xD0;  // first chunk: 0xD0010000 bytes
  expect_image_error([&] { decode(webp); }, {"WebP", "3489726464 bytes", "past the end"});
  // A damaged WebP (VP8L version bits set) with "DICM" at byte 128 would fall
  // through OpenCV's signature checks to its DICOM decoder: refused.
  cv::Mat noise(24, 24, CV_8UC3);
  cv::randu(noise, 0, 256);
  auto dicom = cv_encode(".webp", noise, {cv::IMWRITE_WEBP_QUALITY, 101});
  ASSERT_GT(dicom.size(), 132u);
  dicom[24] |= 0xE0;
  std::memcpy(&dicom[128], "DICM", 4);
  expect_image_error([&] { decode(dicom); }, {"WebP", "DICOM"});
  // A PNG chunk running past the end: no IEND is reachable.
  auto png = cv_encode(".png", small);
  png[33] = 0x7F;  // the chunk after IHDR now claims ~2 GB
  expect_image_error([&] { decode(png); }, {"PNG", "IEND"});
}

#endif  // DINO_OPT_TEST_IMGCODECS

}  // namespace
