// libFuzzer target: the loader's whole per-image pipeline (probe, decode,
// crop sampling, DCT scaling, resize, photometric augmentation) on arbitrary
// bytes. Any outcome but success or an ImageError is a bug: a crash, a
// sanitizer report, an uncaught exception of another type, a hang (libFuzzer's
// -timeout) or a leak.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "loader/multicrop_pipeline.h"

using namespace dino_opt::loader;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size < 2) return 0;
  // The first byte picks the variant, so the corpus explores both stages.
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

  std::vector<std::vector<uint8_t>> raw(config.num_crops());
  std::vector<std::vector<float>> params(config.num_crops());
  std::vector<std::vector<uint16_t>> out(config.num_crops());
  std::vector<CropTarget> targets(config.num_crops());
  for (int c = 0; c < config.num_crops(); ++c) {
    const int s = config.crop_size(c);
    raw[c].resize(static_cast<size_t>(s) * s * 3);
    params[c].resize(kPhotometricParamCount);
    out[c].resize(static_cast<size_t>(s) * s * 3);
    targets[c].raw = raw[c].data();
    targets[c].raw_stride = int64_t{3} * s;
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
