// libFuzzer target: the loader's whole per-image pipeline (probe, decode,
// crop sampling, DCT scaling, resize, photometric augmentation) on arbitrary
// bytes, in the 8-bit RGB mode and in the native mode (images at their depth
// and channel count: the raw resampler and the per-channel stage). Any outcome but success or an
// ImageError is a bug: a crash, a sanitizer report, an uncaught exception of another type, a hang
// (libFuzzer's -timeout) or a leak.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "loader/image_decode.h"
#include "loader/multicrop_pipeline.h"

using namespace dino_opt::loader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // The first byte picks the variant, so the corpus explores every stage:
  // bit 0 photometric here, bit 1 DCT scaling, bit 2 the native mode, bit 3
  // (native) a declared layout other than the image's (to be refused).
  const uint8_t mode = data[0];
  data += 1;
  size -= 1;

  PipelineOptions options;
  options.augment.global_size = 32;
  options.augment.local_size = 16;
  options.augment.n_local = 2;
  options.decode.max_pixels = 1 << 22;  // bounded work per input
  options.photometric = (mode & 1) != 0;
  options.dct_scaling = (mode & 2) != 0;
  const AugmentConfig& config = options.augment;
  ImageLayout layout{3, SampleType::kU8};
  if ((mode & 4) != 0) {
    options.mode = ImageMode::kNative;
    try {  // the data set's layout: the image's own, as the loader finds it
      const ImageHeader header = probe_image(data, size, options.decode);
      layout = decode_raw(data, size, header, 1, options.decode).layout;
    } catch (const ImageError&) {
    }
    if ((mode & 8) != 0) layout = {layout.channels % 4 + 1, SampleType::kU16};
    options.layout = layout;
    options.layout_from = "the fuzzed image";
    options.channel_norm.mean.assign(layout.channels, 0.5f);
    options.channel_norm.std.assign(layout.channels, 0.25f);
  }
  const int channels = layout.channels;
  const bool rgb8 = options.rgb_stage();
  const size_t sample = rgb8 ? 1 : sample_bytes(layout.type);

  std::vector<std::vector<uint8_t>> raw(config.num_crops());
  std::vector<std::vector<float>> params(config.num_crops());
  std::vector<std::vector<uint16_t>> out(config.num_crops());
  std::vector<CropTarget> targets(config.num_crops());
  for (int c = 0; c < config.num_crops(); ++c) {
    const int s = config.crop_size(c);
    raw[c].resize(static_cast<size_t>(s) * s * channels * sample);
    params[c].resize(rgb8 ? kPhotometricParamCount : channel_param_count(channels));
    out[c].resize(static_cast<size_t>(s) * s * channels);
    targets[c].raw = raw[c].data();
    targets[c].raw_stride = static_cast<int64_t>(s) * channels * static_cast<int64_t>(sample);
    targets[c].params = params[c].data();
    // bfloat16 planes (NCHW) exercise the narrowest writer.
    targets[c].out = {out[c].data(), OutputType::kBFloat16, int64_t{s} * s, s, 1};
  }
  PipelineScratch scratch;
  Rng rng(mode, 0, size);
  try {
    run_multicrop(data, size, rng, options, targets, scratch);
  } catch (const ImageError&) {
    // Bad data, reported as such: the expected outcome for most inputs.
  }
  return 0;
}
