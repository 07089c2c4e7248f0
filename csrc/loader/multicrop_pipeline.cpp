#include "loader/multicrop_pipeline.h"

#include <chrono>
#include <stdexcept>
#include <tuple>
#include <utility>

namespace dino_opt::loader {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kChannelStreamKey = 0x4348414eull;  // the per-channel parameters' stream

double seconds_since(Clock::time_point& t) {
  const auto now = Clock::now();
  const double s = std::chrono::duration<double>(now - t).count();
  t = now;
  return s;
}

CropBox crop_box(const CropPlan& plan, double fx, double fy, int width, int height) {
  const CropRect& r = plan.rect;
  return plan.whole_image
             ? scaled_box_in_image(plan.x0, plan.y0, plan.x1, plan.y1, fx, fy, width, height)
             : scaled_crop_box(r.left, r.top, r.width, r.height, fx, fy, width, height);
}

// The crops of an 8-bit RGB image.
void rgb_crops(const ImageView& view, double fx, double fy, const std::vector<CropPlan>& plans,
               const PipelineOptions& options, const std::vector<CropTarget>& targets,
               PipelineScratch& scratch, PipelineTimes& local, Clock::time_point& t) {
  const AugmentConfig& config = options.augment;
  for (int c = 0; c < config.num_crops(); ++c) {
    const int out_size = config.crop_size(c);
    const CropBox box = crop_box(plans[c], fx, fy, view.width, view.height);
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
}

// The crops of an image at its stored depth and channels; the per-channel
// parameters come from `rng` (a stream of their own, after the plans).
void raw_crops(const RawView& view, double fx, double fy, const std::vector<CropPlan>& plans,
               Rng& rng, const PipelineOptions& options, const std::vector<CropTarget>& targets,
               PipelineScratch& scratch, PipelineTimes& local, Clock::time_point& t) {
  const AugmentConfig& config = options.augment;
  const ImageLayout layout = view.layout;
  const int pixel_bytes = layout.channels * sample_bytes(layout.type);
  for (int c = 0; c < config.num_crops(); ++c) {
    const int out_size = config.crop_size(c);
    const CropBox box = crop_box(plans[c], fx, fy, view.width, view.height);
    const CropTarget& target = targets[c];
    ChannelParams params;  // the evaluation transform: no photometric change
    params.brightness.assign(layout.channels, 1.0f);
    params.contrast.assign(layout.channels, 1.0f);
    if (!config.center_crop) {
      params = sample_channel_params(rng, config, plans[c].params, layout.channels);
    }
    if (options.photometric) {
      const int64_t row = int64_t{out_size} * pixel_bytes;
      scratch.crop.resize(static_cast<size_t>(row) * out_size);
      resize_crop_raw(view, box, out_size, out_size, scratch.crop.data(), row,
                      scratch.raw_resample);
      local.crop += seconds_since(t);
      scratch.photometric.resize(channel_scratch_floats(out_size, out_size, layout.channels));
      apply_channel_photometric(scratch.crop.data(), layout, out_size, out_size, params,
                                options.channel_norm, target.out, scratch.photometric.data());
      local.augment += seconds_since(t);
    } else {
      resize_crop_raw(view, box, out_size, out_size, target.raw, target.raw_stride,
                      scratch.raw_resample);
      params.to_floats(target.params);
      local.crop += seconds_since(t);
    }
  }
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
  const bool native = options.mode == ImageMode::kNative;
  PipelineTimes local;
  auto t = Clock::now();
  const ImageHeader header = probe_image(data, size, options.decode);
  Image image;
  RawImage raw;
  int full_width = header.width, full_height = header.height;
  auto decode = [&](int denom) {
    if (native) {
      raw = decode_raw(data, size, header, denom, options.decode);
      if (raw.layout != options.layout) {
        throw ImageError("a " + raw.layout.describe() + " image, but the data set's images are " +
                         options.layout.describe() + " (as its first, " + options.layout_from +
                         "): a source mixing channel counts or depths is not read");
      }
      return std::pair<int, int>{raw.width, raw.height};
    }
    image = decode_image(data, size, header, denom, options.decode);
    return std::pair<int, int>{image.width, image.height};
  };
  bool decoded = false;
  int width = 0, height = 0;
  if (full_width <= 0 || full_height <= 0) {
    // The header did not tell the size: decode first; the crops are drawn
    // from the same stream either way.
    std::tie(width, height) = decode(1);
    full_width = width;
    full_height = height;
    decoded = true;
  }
  local.decode += seconds_since(t);

  const std::vector<CropPlan> plans = plan_crops(rng, full_height, full_width, config);
  local.crop += seconds_since(t);

  if (!decoded) {
    const int denom = options.dct_scaling && header.format == ImageFormat::kJpeg
                          ? choose_dct_denom(plans, full_height, full_width, config)
                          : 1;
    std::tie(width, height) = decode(denom);
    local.decode += seconds_since(t);
  }
  const double fx = static_cast<double>(width) / full_width;
  const double fy = static_cast<double>(height) / full_height;
  if (!native) {
    rgb_crops(image.view(), fx, fy, plans, options, targets, scratch, local, t);
  } else if (options.rgb_stage()) {
    const ImageView view{raw.bytes.data(), raw.width, raw.height, raw.row_bytes()};
    rgb_crops(view, fx, fy, plans, options, targets, scratch, local, t);
  } else {
    Rng channel_rng(rng.next(), kChannelStreamKey, 0);
    raw_crops(raw.view(), fx, fy, plans, channel_rng, options, targets, scratch, local, t);
  }
  if (times) {
    times->decode += local.decode;
    times->crop += local.crop;
    times->augment += local.augment;
  }
}

}  // namespace dino_opt::loader
