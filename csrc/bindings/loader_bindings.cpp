// Python bindings of the multi-crop loader (csrc/loader) over a sample source
// (source_bindings.cpp) and of the image helpers the tests, `dino-opt
// prepare` and MultiCropDataset use.
#include <pybind11/stl.h>
#include <torch/extension.h>

#include <cstring>
#include <tuple>

#include "bindings/bindings.h"
#include "loader/crop_sampling.h"
#include "loader/image_decode.h"
#include "loader/masking.h"
#include "loader/multicrop_loader.h"
#include "loader/prepare.h"
#include "loader/resample.h"
#include "loader/resample_raw.h"

namespace py = pybind11;

namespace dino_opt::bindings {
namespace {

using namespace dino_opt::loader;

at::ScalarType parse_dtype(const std::string& name) {
  if (name == "float32") return at::kFloat;
  if (name == "bfloat16") return at::kBFloat16;
  if (name == "float16") return at::kHalf;
  throw std::invalid_argument("dtype must be float32, bfloat16 or float16, got " + name);
}

// Augmentation fields by name, so that Python can pass any subset.
void apply_augment(AugmentConfig& c, const py::dict& overrides) {
  for (const auto& [key, value] : overrides) {
    const std::string k = py::cast<std::string>(key);
    auto pair = [&](double& lo, double& hi) {
      const auto v = py::cast<std::pair<double, double>>(value);
      lo = v.first;
      hi = v.second;
    };
    if (k == "global_size")
      c.global_size = py::cast<int>(value);
    else if (k == "local_size")
      c.local_size = py::cast<int>(value);
    else if (k == "n_local")
      c.n_local = py::cast<int>(value);
    else if (k == "global_scale")
      pair(c.global_scale_lo, c.global_scale_hi);
    else if (k == "local_scale")
      pair(c.local_scale_lo, c.local_scale_hi);
    else if (k == "flip_p")
      c.flip_p = py::cast<double>(value);
    else if (k == "jitter_p")
      c.jitter_p = py::cast<double>(value);
    else if (k == "brightness")
      c.brightness = py::cast<double>(value);
    else if (k == "contrast")
      c.contrast = py::cast<double>(value);
    else if (k == "saturation")
      c.saturation = py::cast<double>(value);
    else if (k == "hue")
      c.hue = py::cast<double>(value);
    else if (k == "grayscale_p")
      c.grayscale_p = py::cast<double>(value);
    else if (k == "blur_sigma")
      pair(c.blur_sigma_lo, c.blur_sigma_hi);
    else if (k == "blur_p_global1")
      c.blur_p_global1 = py::cast<double>(value);
    else if (k == "blur_p_global2")
      c.blur_p_global2 = py::cast<double>(value);
    else if (k == "blur_p_local")
      c.blur_p_local = py::cast<double>(value);
    else if (k == "solarize_p_global2")
      c.solarize_p_global2 = py::cast<double>(value);
    else if (k == "noise_p")
      c.noise_p = py::cast<double>(value);
    else if (k == "noise_std")
      pair(c.noise_std_lo, c.noise_std_hi);
    else if (k == "center_crop")
      c.center_crop = py::cast<bool>(value);
    else if (k == "resize_size")
      c.resize_size = py::cast<int>(value);
    else
      throw std::invalid_argument("unknown augmentation option '" + k + "'");
  }
}

// Mask fields by name; an empty dict leaves masks off. Python's
// dino_opt.data.masking.mask_options fills in the defaults first.
MaskConfig parse_masks(const py::dict& options) {
  MaskConfig c;
  c.enabled = !options.empty();
  for (const auto& [key, value] : options) {
    const std::string k = py::cast<std::string>(key);
    if (k == "patch_size") {
      c.patch_size = py::cast<int>(value);
    } else if (k == "ratio") {
      std::tie(c.ratio_min, c.ratio_max) = py::cast<std::pair<double, double>>(value);
    } else if (k == "probability") {
      c.probability = py::cast<double>(value);
    } else if (k == "min_num_patches") {
      c.min_num_patches = py::cast<double>(value);
    } else if (k == "max_num_patches") {
      c.max_num_patches = value.is_none() ? 0.0 : py::cast<double>(value);
    } else if (k == "min_aspect") {
      c.min_aspect = py::cast<double>(value);
    } else if (k == "max_aspect") {
      c.max_aspect = value.is_none() ? 0.0 : py::cast<double>(value);
    } else {
      throw std::invalid_argument("unknown mask option '" + k + "'");
    }
  }
  return c;
}

py::object to_python(std::optional<LoaderBatch> batch) {
  if (!batch) return py::none();
  const py::object masks = batch->masks.defined() ? py::cast(batch->masks) : py::none();
  return py::make_tuple(batch->groups, batch->params, batch->labels, batch->indices,
                        batch->batch_index, masks);
}

py::dict to_dict(const LoaderStats& s) {
  py::dict d;
  d["images"] = s.images;
  d["batches"] = s.batches;
  d["decode_seconds"] = s.decode_seconds;
  d["crop_seconds"] = s.crop_seconds;
  d["augment_seconds"] = s.augment_seconds;
  d["wait_seconds"] = s.wait_seconds;
  d["elapsed_seconds"] = s.elapsed_seconds;
  d["skipped"] = s.skipped;
  d["skipped_files"] = s.skipped_files;
  d["num_threads"] = s.num_threads;
  return d;
}

std::vector<uint8_t> bytes_of(const py::bytes& b) {
  const std::string_view v = b;
  return {v.begin(), v.end()};
}

at::Tensor to_tensor(const Image& image) {
  at::Tensor t = at::empty({image.height, image.width, 3}, at::kByte);
  std::memcpy(t.data_ptr(), image.pixels.data(), image.pixels.size());
  return t;
}

ImageView view_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.size(2) == 3 && t.scalar_type() == at::kByte &&
                  t.device().is_cpu() && t.stride(2) == 1 && t.stride(1) == 3,
              "expected a CPU uint8 [H, W, 3] tensor with contiguous rows, got ", t.sizes(), " ",
              t.scalar_type());
  return {t.data_ptr<uint8_t>(), static_cast<int>(t.size(1)), static_cast<int>(t.size(0)),
          t.stride(0)};
}

SampleType sample_type_of(at::ScalarType t) {
  if (t == at::kByte) return SampleType::kU8;
  if (t == at::kUInt16) return SampleType::kU16;
  if (t == at::kFloat) return SampleType::kF32;
  throw std::invalid_argument(std::string("images are uint8, uint16 or float32, got ") +
                              c10::toString(t));
}

at::ScalarType scalar_type_of(SampleType t) {
  return t == SampleType::kU8 ? at::kByte : t == SampleType::kU16 ? at::kUInt16 : at::kFloat;
}

RawView raw_view_of(const at::Tensor& t) {
  TORCH_CHECK(t.dim() == 3 && t.device().is_cpu() && t.size(2) >= 1 && t.stride(2) == 1 &&
                  t.stride(1) == t.size(2),
              "expected a CPU [H, W, C] tensor with contiguous rows, got ", t.sizes());
  const ImageLayout layout{static_cast<int>(t.size(2)), sample_type_of(t.scalar_type())};
  return {static_cast<const uint8_t*>(t.data_ptr()), static_cast<int>(t.size(1)),
          static_cast<int>(t.size(0)), layout, t.stride(0) * t.element_size()};
}

at::Tensor raw_tensor(const RawView& v) {
  at::Tensor t = at::empty({v.height, v.width, v.layout.channels}, scalar_type_of(v.layout.type));
  const int64_t row = int64_t{v.width} * v.layout.channels * sample_bytes(v.layout.type);
  for (int y = 0; y < v.height; ++y) {
    std::memcpy(static_cast<uint8_t*>(t.data_ptr()) + y * row, v.row(y), row);
  }
  return t;
}

// The box of crop (top, left, height, width) of a `w` x `h` image, which it must fit.
CropBox checked_crop(int w, int h, int top, int left, int height, int width) {
  TORCH_CHECK(
      top >= 0 && left >= 0 && height >= 1 && width >= 1 && top + height <= h && left + width <= w,
      "crop (top ", top, ", left ", left, ", height ", height, ", width ", width,
      ") is outside the ", h, " x ", w, " image");
  return scaled_crop_box(left, top, width, height, 1.0, 1.0, w, h);
}

}  // namespace

void bind_loader(py::module_& m) {
  py::register_exception<LoaderError>(m, "LoaderError", PyExc_RuntimeError);
  py::register_exception<ImageError>(m, "ImageError", PyExc_ValueError);

  py::class_<MultiCropLoader>(m, "MultiCropLoader")
      .def(py::init([](std::shared_ptr<SampleSource> source, int64_t batch_size,
                       const py::dict& augment, int num_threads, int prefetch, uint64_t seed,
                       int rank, int world_size, bool shuffle, bool drop_last, bool pad_shards,
                       const std::string& dtype, bool channels_last, bool photometric,
                       bool pin_memory, bool skip_errors, int64_t max_pixels,
                       std::vector<float> mean, std::vector<float> std, bool dct_scaling,
                       const py::dict& masks, int64_t shuffle_buffer, bool exact_shards,
                       const std::vector<std::pair<int, int>>& size_pairs,
                       std::vector<double> size_probs, const std::string& image_mode) {
             LoaderOptions o;
             if (image_mode == "native") {
               o.pipeline.mode = ImageMode::kNative;
             } else if (image_mode != "rgb") {
               throw std::invalid_argument("image_mode must be 'rgb' or 'native', got '" +
                                           image_mode + "'");
             }
             // kNative: one value per channel, checked against the data set's
             // layout by the loader (3 for the 8-bit RGB stage).
             if (o.pipeline.mode == ImageMode::kRgb && (mean.size() != 3 || std.size() != 3))
               throw std::invalid_argument("mean and std need 3 values");
             o.pipeline.channel_norm.mean = mean;
             o.pipeline.channel_norm.std = std;
             mean.resize(3, 0.0f);
             std.resize(3, 1.0f);
             o.batch_size = batch_size;
             apply_augment(o.pipeline.augment, augment);
             o.pipeline.photometric = photometric;
             o.pipeline.dct_scaling = dct_scaling;
             o.pipeline.decode.max_pixels = max_pixels;
             for (int c = 0; c < 3; ++c) {
               o.pipeline.normalization.mean[c] = mean[c];
               o.pipeline.normalization.std[c] = std[c];
             }
             o.num_threads = num_threads;
             o.prefetch = prefetch;
             o.seed = seed;
             o.rank = rank;
             o.world_size = world_size;
             o.shuffle = shuffle;
             o.drop_last = drop_last;
             o.pad_shards = pad_shards;
             o.exact_shards = exact_shards;
             o.dtype = parse_dtype(dtype);
             o.channels_last = channels_last;
             o.pin_memory = pin_memory;
             o.skip_errors = skip_errors;
             o.masks = parse_masks(masks);
             o.shuffle_buffer = shuffle_buffer;
             for (const auto& [global_size, local_size] : size_pairs)
               o.size_pairs.push_back({global_size, local_size});
             o.size_probs = std::move(size_probs);
             return std::make_unique<MultiCropLoader>(std::move(source), std::move(o));
           }),
           py::arg("source"), py::arg("batch_size"), py::arg("augment"), py::arg("num_threads"),
           py::arg("prefetch"), py::arg("seed"), py::arg("rank"), py::arg("world_size"),
           py::arg("shuffle"), py::arg("drop_last"), py::arg("pad_shards"), py::arg("dtype"),
           py::arg("channels_last"), py::arg("photometric"), py::arg("pin_memory"),
           py::arg("skip_errors"), py::arg("max_pixels"), py::arg("mean"), py::arg("std"),
           py::arg("dct_scaling"), py::arg("masks") = py::dict(), py::arg("shuffle_buffer") = 1024,
           py::arg("exact_shards") = false,
           py::arg("size_pairs") = std::vector<std::pair<int, int>>(),
           py::arg("size_probs") = std::vector<double>(), py::arg("image_mode") = "rgb")
      .def_property_readonly("source", &MultiCropLoader::source)
      .def_property_readonly(
          "layout",
          [](const MultiCropLoader& l) -> py::object {
            const PipelineOptions& p = l.options().pipeline;
            if (p.mode != ImageMode::kNative) return py::none();
            return py::make_tuple(p.layout.channels, sample_type_name(p.layout.type),
                                  p.layout_from);
          },
          "image_mode='native': (channels, sample type, the image that set them); else None")
      .def_property_readonly("num_samples", &MultiCropLoader::num_samples)
      .def_property_readonly("samples_per_rank", &MultiCropLoader::samples_per_rank)
      .def_property_readonly("num_batches", &MultiCropLoader::num_batches)
      .def("epoch_indices", &MultiCropLoader::epoch_indices, py::arg("epoch"))
      .def_property_readonly("num_size_pairs", &MultiCropLoader::num_size_pairs)
      .def("size_pair_of", &MultiCropLoader::size_pair_of, py::arg("epoch"), py::arg("batch"),
           "The crop-size pair (an index) of batch `batch` of `epoch`")
      .def(
          "size_pair",
          [](const MultiCropLoader& l, int pair) {
            const CropSizePair p = l.size_pair(pair);
            return std::make_pair(p.global_size, p.local_size);
          },
          py::arg("pair"), "The (global, local) crop sides of pair `pair`")
      .def("start_epoch", &MultiCropLoader::start_epoch, py::arg("epoch"),
           py::arg("first_batch") = 0, py::call_guard<py::gil_scoped_release>())
      .def("next",
           [](MultiCropLoader& l) { return to_python(without_gil([&] { return l.next(); })); })
      .def(
          "load_sample",
          [](MultiCropLoader& l, int64_t index, int64_t epoch) {
            return to_python(without_gil(
                [&] { return std::optional<LoaderBatch>(l.load_sample(index, epoch)); }));
          },
          py::arg("index"), py::arg("epoch"))
      .def("close", &MultiCropLoader::close, py::call_guard<py::gil_scoped_release>())
      .def("stats", [](const MultiCropLoader& l) { return to_dict(l.stats()); });

  m.def("available_cores", &available_cores, "The cores this process may run on");
  m.def("other_formats_available", &other_formats_available,
        "True when PNG, WebP, BMP and TIFF can be read (OpenCV imgcodecs)");
  m.def(
      "probe_image",
      [](const py::bytes& data, int64_t max_pixels) {
        const auto bytes = bytes_of(data);
        const ImageHeader h = probe_image(bytes.data(), bytes.size(), DecodeOptions{max_pixels});
        return py::make_tuple(format_name(h.format), h.width, h.height);
      },
      py::arg("data"), py::arg("max_pixels") = DecodeOptions{}.max_pixels);
  m.def(
      "decode_image",
      [](const py::bytes& data, int scale_denom, int64_t max_pixels) {
        const auto bytes = bytes_of(data);
        py::gil_scoped_release release;
        const DecodeOptions options{max_pixels};
        const ImageHeader h = probe_image(bytes.data(), bytes.size(), options);
        return to_tensor(decode_image(bytes.data(), bytes.size(), h, scale_denom, options));
      },
      py::arg("data"), py::arg("scale_denom") = 1,
      py::arg("max_pixels") = DecodeOptions{}.max_pixels,
      "Decodes image bytes to a uint8 [H, W, 3] RGB tensor");
  m.def(
      "data_set_layout",
      [](const std::shared_ptr<SampleSource>& source, int64_t max_pixels, int64_t tries) {
        const auto [layout, from] =
            without_gil([&] { return data_set_layout(*source, DecodeOptions{max_pixels}, tries); });
        return py::make_tuple(layout.channels, sample_type_name(layout.type), from);
      },
      py::arg("source"), py::arg("max_pixels") = DecodeOptions{}.max_pixels, py::arg("tries") = 1,
      "(channels, sample type, described image) of a source's first image that decodes");
  m.def(
      "decode_raw",
      [](const py::bytes& data, int scale_denom, int64_t max_pixels) {
        const auto bytes = bytes_of(data);
        py::gil_scoped_release release;
        const RawImage raw = decode_raw(bytes.data(), bytes.size(), ImageHeader{}, scale_denom,
                                        DecodeOptions{max_pixels});
        return raw_tensor(raw.view());
      },
      py::arg("data"), py::arg("scale_denom") = 1,
      py::arg("max_pixels") = DecodeOptions{}.max_pixels,
      "Decodes image bytes at their stored depth: a [H, W, C] uint8, uint16 or float32 tensor");
  m.def(
      "encode_raw",
      [](const at::Tensor& image, const std::string& format) {
        const ImageFormat f = format == "png"    ? ImageFormat::kPng
                              : format == "tiff" ? ImageFormat::kTiff
                              : format == "npy"  ? ImageFormat::kNpy
                                                 : ImageFormat::kUnknown;
        if (f == ImageFormat::kUnknown)
          throw std::invalid_argument("format must be png, tiff or npy, got '" + format + "'");
        const auto bytes = encode_raw(raw_view_of(image), f);
        return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      py::arg("image"), py::arg("format"),
      "Encodes a [H, W, C] uint8, uint16 or float32 tensor losslessly as PNG, TIFF or .npy");
  m.def(
      "resize_crop_raw",
      [](const at::Tensor& image, int top, int left, int height, int width, int out_width,
         int out_height) {
        const RawView src = raw_view_of(image);
        const CropBox box = checked_crop(src.width, src.height, top, left, height, width);
        at::Tensor out = at::empty({out_height, out_width, src.layout.channels}, image.options());
        RawResampleScratch scratch;
        resize_crop_raw(src, box, out_width, out_height, static_cast<uint8_t*>(out.data_ptr()),
                        out.stride(0) * out.element_size(), scratch);
        return out;
      },
      py::arg("image"), py::arg("top"), py::arg("left"), py::arg("height"), py::arg("width"),
      py::arg("out_width"), py::arg("out_height"),
      "The loader's crop + bicubic resize at the stored depth of a [H, W, C] image");
  m.def(
      "encode_jpeg",
      [](const at::Tensor& image, int quality) {
        const auto bytes = encode_jpeg(view_of(image), quality);
        return py::bytes(reinterpret_cast<const char*>(bytes.data()), bytes.size());
      },
      py::arg("image"), py::arg("quality") = 90);
  m.def(
      "resize_crop",
      [](const at::Tensor& image, int top, int left, int height, int width, int out_width,
         int out_height) {
        const ImageView src = view_of(image);
        const CropBox box = checked_crop(src.width, src.height, top, left, height, width);
        at::Tensor out = at::empty({out_height, out_width, 3}, at::kByte);
        ResampleScratch scratch;
        resize_crop_bicubic(src, box, out_width, out_height, out.data_ptr<uint8_t>(), out.stride(0),
                            scratch);
        return out;
      },
      py::arg("image"), py::arg("top"), py::arg("left"), py::arg("height"), py::arg("width"),
      py::arg("out_width"), py::arg("out_height"),
      "torchvision's resized_crop on a PIL image (crop, then PIL bicubic resize) of a uint8 [H, W, "
      "3] image");
  m.def(
      "sample_crops",
      [](uint64_t seed, int64_t count, int height, int width, const py::dict& augment) {
        AugmentConfig config;
        apply_augment(config, augment);
        config.validate();
        const int n = config.num_crops();
        at::Tensor rects = at::empty({count, n, 4}, at::kLong);
        at::Tensor params = at::empty({count, n, kPhotometricParamCount}, at::kFloat);
        auto* r = rects.data_ptr<int64_t>();
        auto* p = params.data_ptr<float>();
        for (int64_t i = 0; i < count; ++i) {
          Rng rng(seed, 0, static_cast<uint64_t>(i));
          const auto plans = plan_crops(rng, height, width, config);
          for (int c = 0; c < n; ++c) {
            const CropRect& q = plans[c].rect;
            int64_t* row = r + (i * n + c) * 4;
            row[0] = q.top;
            row[1] = q.left;
            row[2] = q.height;
            row[3] = q.width;
            plans[c].params.to_floats(p + (i * n + c) * kPhotometricParamCount);
          }
        }
        return py::make_tuple(rects, params);
      },
      py::arg("seed"), py::arg("count"), py::arg("height"), py::arg("width"),
      py::arg("augment") = py::dict(),
      "Draws `count` samples' crop plans: rects [count, crops, 4] (top, left, height, width) and "
      "params");
  m.def(
      "sample_masks",
      [](uint64_t seed, const std::vector<int>& counts, int height, int width,
         double max_num_patches, double min_num_patches, double min_aspect, double max_aspect) {
        const BlockMasker masker(height, width, min_num_patches, max_num_patches, min_aspect,
                                 max_aspect);
        const auto n = static_cast<int64_t>(counts.size());
        at::Tensor masks = at::empty({n, height, width}, at::kBool);
        auto* out = static_cast<uint8_t*>(masks.data_ptr());
        for (int64_t i = 0; i < n; ++i) {
          Rng rng(seed, 0, static_cast<uint64_t>(i));
          masker.generate(rng, counts[i], out + i * masker.num_patches());
        }
        return masks;
      },
      py::arg("seed"), py::arg("counts"), py::arg("height"), py::arg("width"),
      py::arg("max_num_patches"), py::arg("min_num_patches") = 4.0, py::arg("min_aspect") = 0.3,
      py::arg("max_aspect") = 0.0,
      "Block masks drawn by the loader's generator: mask i ([height, width] bool) asks for "
      "counts[i] patches (max_aspect 0: 1 / min_aspect)");
  m.def(
      "reencode_image",
      [](const std::string& src, const std::string& dst, int max_side, int quality,
         int64_t max_pixels) {
        const PrepareResult r = without_gil(
            [&] { return reencode_image(src, dst, max_side, quality, DecodeOptions{max_pixels}); });
        return py::make_tuple(r.width, r.height, r.bytes);
      },
      py::arg("src"), py::arg("dst"), py::arg("max_side"), py::arg("quality"),
      py::arg("max_pixels") = DecodeOptions{}.max_pixels);
}

}  // namespace dino_opt::bindings
