#include "loader/multicrop_pipeline.h"

#include <chrono>
#include <stdexcept>

namespace dino_opt::loader {
namespace {

using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point& t) {
  const auto now = Clock::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

}  // namespace

void run_multicrop(const uint8_t* data, size_t size, Rng& rng, const PipelineOptions& options,
                   const std::vector<CropTarget>& targets, PipelineScratch& scratch,
                   PipelineTimes* times) {
  const AugmentConfig& config = options.augment;
  if (static_cast<int>(targets.size()) != config.num_crops()) {
    throw std::invalid_argument("run_multicrop: " + std::to_string(targets.size()) +
                                " targets for " + std::to_string(config.num_crops()) + " crops");
  }
  PipelineTimes local;
  auto t = Clock::now();
  const ImageHeader header = probe_image(data, size, options.decode);
  Image image;
  int full_width = header.width, full_height = header.height;
  if (full_width <= 0 || full_height <= 0) {
    // The header did not tell the size: decode first; the crops are drawn
    // from the same stream either way.
    image = decode_image(data, size, header, 1, options.decode);
    full_width = image.width;
    full_height = image.height;
  }
  local.decode += seconds_since(t);

  const std::vector<CropPlan> plans = plan_crops(rng, full_height, full_width, config);
  local.crop += seconds_since(t);

  if (image.pixels.empty()) {
    const int denom = options.dct_scaling && header.format == ImageFormat::kJpeg
                          ? choose_dct_denom(plans, full_height, full_width, config)
                          : 1;
    image = decode_image(data, size, header, denom, options.decode);
    local.decode += seconds_since(t);
  }
  const double fx = static_cast<double>(image.width) / full_width;
  const double fy = static_cast<double>(image.height) / full_height;
  const ImageView view = image.view();

  for (int c = 0; c < config.num_crops(); ++c) {
    const int out_size = config.crop_size(c);
    const CropRect& r = plans[c].rect;
    const CropPlan& plan = plans[c];
    const CropBox box = plan.whole_image ? scaled_box_in_image(plan.x0, plan.y0, plan.x1, plan.y1,
                                                               fx, fy, image.width, image.height)
                                         : scaled_crop_box(r.left, r.top, r.width, r.height, fx, fy,
                                                           image.width, image.height);
    const CropTarget& target = targets[c];
    if (options.photometric) {
      scratch.crop.resize(static_cast<size_t>(out_size) * out_size * 3);
      resize_crop_bicubic(view, box, out_size, out_size, scratch.crop.data(), int64_t{3} * out_size,
                          scratch.resample);
      local.crop += seconds_since(t);
      scratch.photometric.resize(photometric_scratch_floats(out_size, out_size));
      apply_photometric(scratch.crop.data(), out_size, out_size, plans[c].params,
                        options.normalization, target.out, scratch.photometric.data());
      local.augment += seconds_since(t);
    } else {
      resize_crop_bicubic(view, box, out_size, out_size, target.raw, target.raw_stride,
                          scratch.resample);
      plans[c].params.to_floats(target.params);
      local.crop += seconds_since(t);
    }
  }
  if (times) {
    times->decode += local.decode;
    times->crop += local.crop;
    times->augment += local.augment;
  }
}

}  // namespace dino_opt::loader
