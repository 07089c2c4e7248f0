#include "loader/multicrop_loader.h"

#include <algorithm>
#include <chrono>
#include <limits>
#include <numeric>
#include <tuple>

namespace dino_opt::loader {
namespace {

using Clock = std::chrono::steady_clock;

constexpr uint64_t kSkipKey = 0x534b4950ull;  // the stream of replacement picks
constexpr size_t kMaxSkippedListed = 100;

OutputType output_type(at::ScalarType dtype) {
  switch (dtype) {
    case at::kFloat:
      return OutputType::kFloat32;
    case at::kBFloat16:
      return OutputType::kBFloat16;
    case at::kHalf:
      return OutputType::kFloat16;
    default:
      throw std::invalid_argument(std::string("dtype must be float32, bfloat16 or float16, got ") +
                                  c10::toString(dtype));
  }
}

// Where the crops of sample `row` of a batch of `b` samples go.
std::vector<CropTarget> targets_for(const LoaderBatch& batch, int64_t row, int64_t b,
                                    const LoaderOptions& options) {
  const AugmentConfig& config = options.pipeline.augment;
  std::vector<CropTarget> targets(config.num_crops());
  const int n_global = config.num_global();
  for (int c = 0; c < config.num_crops(); ++c) {
    const int group = c < n_global ? 0 : 1;
    const int64_t n = (c < n_global ? c : c - n_global) * b + row;
    const at::Tensor& t = batch.groups[group];
    CropTarget& target = targets[c];
    if (options.pipeline.photometric) {
      target.out.type = output_type(options.dtype);
      target.out.data = static_cast<char*>(t.data_ptr()) + n * t.stride(0) * t.element_size();
      target.out.stride_c = t.stride(1);
      target.out.stride_y = t.stride(2);
      target.out.stride_x = t.stride(3);
    } else {
      target.raw = static_cast<uint8_t*>(t.data_ptr()) + n * t.stride(0) * t.element_size();
      target.raw_stride = t.stride(1) * t.element_size();
      const at::Tensor& p = batch.params[group];
      target.params = p.data_ptr<float>() + n * p.size(1);
    }
  }
  return targets;
}

// Row `row`'s two global crops in a plan of a batch of `b` (zeros without one).
std::array<int, 2> row_mask_counts(const std::vector<int>& plan, int64_t row, int64_t b) {
  if (plan.empty()) return {0, 0};
  return {plan[row], plan[b + row]};
}

at::ScalarType raw_dtype(SampleType type) {
  switch (type) {
    case SampleType::kU8:
      return at::kByte;
    case SampleType::kU16:
      return at::kUInt16;
    case SampleType::kF32:
      return at::kFloat;
  }
  return at::kByte;
}

}  // namespace

std::pair<ImageLayout, std::string> data_set_layout(const SampleSource& source,
                                                    const DecodeOptions& decode, int64_t tries) {
  std::vector<uint8_t> bytes;
  tries = std::max<int64_t>(1, std::min<int64_t>(tries, source.size()));
  for (int64_t i = 0;; ++i) {
    try {
      source.read(i, -1, bytes);
      const RawImage first = decode_raw(bytes.data(), bytes.size(), ImageHeader{}, 1, decode);
      return {first.layout, source.describe(i)};
    } catch (const std::exception& e) {
      if (i + 1 >= tries) {
        throw std::invalid_argument("the data set's first image sets its channels and depth: " +
                                    source.describe(i) + ": " + e.what());
      }
    }
  }
}

namespace {

// kNative: the layout of the data set's first readable image (the next ones
// when on_error="skip" and it is not), and the per-channel normalisation's
// check. kRgb: the options unchanged.
LoaderOptions resolve_layout(const SampleSource* source, LoaderOptions options) {
  PipelineOptions& p = options.pipeline;
  if (p.mode != ImageMode::kNative || source == nullptr || source->size() == 0) return options;
  std::tie(p.layout, p.layout_from) =
      data_set_layout(*source, p.decode, options.skip_errors ? options.max_skip_attempts : 1);
  {
    const auto c = static_cast<size_t>(p.rgb_stage() ? 3 : p.layout.channels);
    if (p.channel_norm.mean.size() != c || p.channel_norm.std.size() != c) {
      throw std::invalid_argument(
          "the images are " + p.layout.describe() + " (" + p.layout_from + ") but mean and std " +
          "have " + std::to_string(p.channel_norm.mean.size()) + " and " +
          std::to_string(p.channel_norm.std.size()) + " values: give one per channel");
    }
    for (float sd : p.channel_norm.std) {
      if (!(sd != 0.0f)) throw std::invalid_argument("std must be nonzero in every channel");
    }
  }
  return options;
}

bool unshared(const at::Tensor& t) { return t.use_count() == 1 && t.storage().use_count() == 1; }

// Whether the consumer dropped every tensor of a pooled batch.
bool unused(const LoaderBatch& pooled) {
  bool free = unshared(pooled.labels) && unshared(pooled.indices);
  for (const auto& t : pooled.groups) free = free && unshared(t);
  for (const auto& t : pooled.params) free = free && unshared(t);
  return free && (!pooled.masks.defined() || unshared(pooled.masks));
}

}  // namespace

void LoaderOptions::validate() const {
  auto fail = [](const std::string& what) { throw std::invalid_argument(what); };
  if (batch_size < 1) fail("batch_size must be >= 1, got " + std::to_string(batch_size));
  if (num_threads < 0 || num_threads > 1024)
    fail("num_threads must be in [0, 1024], got " + std::to_string(num_threads));
  if (prefetch < 1 || prefetch > 64)
    fail("prefetch must be in [1, 64], got " + std::to_string(prefetch));
  if (world_size < 1) fail("world_size must be >= 1, got " + std::to_string(world_size));
  if (rank < 0 || rank >= world_size)
    fail("rank must be in [0, world_size), got rank " + std::to_string(rank) + " of " +
         std::to_string(world_size));
  if (max_skip_attempts < 1) fail("max_skip_attempts must be >= 1");
  if (shuffle_buffer < 1)
    fail("shuffle_buffer must be >= 1, got " + std::to_string(shuffle_buffer));
  if (pipeline.decode.max_pixels < 1) fail("max_pixels must be >= 1");
  if (pipeline.photometric) output_type(dtype);
  for (int c = 0; c < 3; ++c) {
    if (!(pipeline.normalization.std[c] != 0.0f)) fail("std must be nonzero in every channel");
  }
  pipeline.augment.validate();
  if (masks.enabled && pipeline.augment.center_crop)
    fail("masks need the two global crops; center_crop makes one crop per image");
  if (size_pairs.empty()) {
    if (!size_probs.empty()) fail("crop size ratios need crop size pairs");
    masks.validate(pipeline.augment.global_size);
    return;
  }
  if (pipeline.augment.center_crop)
    fail("crop size pairs need the multi-crop transform; center_crop makes one crop per image");
  if (!size_probs.empty() && size_probs.size() != size_pairs.size()) {
    fail(std::to_string(size_probs.size()) + " crop size ratios for " +
         std::to_string(size_pairs.size()) + " crop size pairs");
  }
  for (size_t k = 0; k < size_pairs.size(); ++k) {
    AugmentConfig augment = pipeline.augment;
    augment.global_size = size_pairs[k].global_size;
    augment.local_size = size_pairs[k].local_size;
    try {
      augment.validate();
      masks.validate(augment.global_size);
    } catch (const std::invalid_argument& e) {
      fail("crop size pair " + std::to_string(k) + ": " + e.what());
    }
  }
  if (!size_probs.empty()) size_pair_cumulative(size_probs);
}

struct MultiCropLoader::Slot {
  int64_t batch = -1;
  int pair = 0;
  int64_t size = 0;
  int64_t done = 0;
  LoaderBatch out;
  std::vector<int> mask_counts;  // the batch's plan: requested patches per global crop
  int64_t error_row = std::numeric_limits<int64_t>::max();
  std::string error;
};

namespace {

std::shared_ptr<SampleSource> file_source(const std::vector<Sample>& samples) {
  auto source = std::make_shared<FileSource>("");
  size_t bytes = 0;
  for (const Sample& s : samples) bytes += s.path.size();
  source->reserve(samples.size(), bytes);
  for (const Sample& s : samples) {
    if (s.label < -1 || s.label > INT32_MAX)
      throw std::invalid_argument("label " + std::to_string(s.label) + " of " + s.path +
                                  " is outside [-1, 2^31)");
    source->add(s.path, static_cast<int32_t>(s.label));
  }
  return source;
}

}  // namespace

MultiCropLoader::MultiCropLoader(const std::vector<Sample>& samples, LoaderOptions options)
    : MultiCropLoader(file_source(samples), std::move(options)) {}

MultiCropLoader::MultiCropLoader(std::shared_ptr<SampleSource> source, LoaderOptions options)
    : source_(std::move(source)), options_(resolve_layout(source_.get(), std::move(options))) {
  options_.validate();
  if (!source_) throw std::invalid_argument("no sample source");
  if (source_->size() == 0) throw std::invalid_argument("the data set is empty: no image files");
  const int64_t n = num_samples(), w = options_.world_size;
  if (options_.exact_shards) {
    per_rank_ = n / w + (options_.rank < n % w ? 1 : 0);
  } else {
    per_rank_ = options_.pad_shards ? (n + w - 1) / w : n / w;
  }
  if (per_rank_ == 0 && !options_.exact_shards) {
    throw std::invalid_argument("the data set has " + std::to_string(n) +
                                " samples, fewer than world_size " + std::to_string(w) +
                                ", and shards are not padded");
  }
  for (int i = 0; i < options_.prefetch; ++i) slots_.push_back(std::make_unique<Slot>());
  if (options_.size_pairs.empty()) {
    pipelines_.push_back(options_.pipeline);
    size_cumulative_ = {1.0};
  } else {
    for (const CropSizePair& pair : options_.size_pairs) {
      pipelines_.push_back(options_.pipeline);
      pipelines_.back().augment.global_size = pair.global_size;
      pipelines_.back().augment.local_size = pair.local_size;
    }
    const auto n = options_.size_pairs.size();
    size_cumulative_ = size_pair_cumulative(
        options_.size_probs.empty() ? std::vector<double>(n, 1.0 / static_cast<double>(n))
                                    : options_.size_probs);
  }
}

MultiCropLoader::~MultiCropLoader() { close(); }

int64_t MultiCropLoader::num_batches() const {
  const int64_t b = options_.batch_size;
  return options_.drop_last ? per_rank_ / b : (per_rank_ + b - 1) / b;
}

int64_t MultiCropLoader::batch_size_of(int64_t batch) const {
  return std::min(options_.batch_size, per_rank_ - batch * options_.batch_size);
}

OrderOptions MultiCropLoader::order_options() const {
  OrderOptions o;
  o.seed = options_.seed;
  o.rank = options_.rank;
  o.world_size = options_.world_size;
  o.shuffle = options_.shuffle;
  o.per_rank = per_rank_;
  if (options_.exact_shards) {
    const int64_t n = num_samples(), w = options_.world_size, r = options_.rank;
    o.first = r * (n / w) + std::min(r, n % w);
  }
  o.shuffle_buffer = options_.shuffle_buffer;
  return o;
}

std::vector<int64_t> MultiCropLoader::epoch_indices(int64_t epoch) const {
  return source_->epoch_order(order_options(), epoch);
}

int MultiCropLoader::size_pair_of(int64_t epoch, int64_t batch) const {
  return draw_size_pair(options_.seed, epoch, batch, size_cumulative_);
}

CropSizePair MultiCropLoader::size_pair(int pair) const {
  if (pair < 0 || pair >= num_size_pairs()) {
    throw std::out_of_range("crop size pair " + std::to_string(pair) + " of " +
                            std::to_string(num_size_pairs()));
  }
  const AugmentConfig& a = pipelines_[pair].augment;
  return {a.global_size, a.local_size};
}

LoaderBatch MultiCropLoader::allocate_batch(int64_t b, int pair) {
  if (!options_.pin_memory) {
    for (const LoaderBatch& pooled : pool_) {
      if (pooled.labels.size(0) == b && pooled.size_pair == pair && unused(pooled)) return pooled;
    }
  }
  const AugmentConfig& config = pipeline_of(pair).augment;
  // Pinned batches come from torch's caching host allocator, which also keeps
  // a block from reuse until the non_blocking copies reading it have finished.
  const auto host = at::TensorOptions().pinned_memory(options_.pin_memory);
  LoaderBatch batch;
  batch.size_pair = pair;
  const int64_t counts[2] = {int64_t{config.num_global()} * b, int64_t{config.num_local()} * b};
  const int64_t sizes[2] = {config.global_size, config.local_size};
  const PipelineOptions& p = options_.pipeline;
  const int64_t c = p.mode == ImageMode::kNative ? p.layout.channels : 3;
  const auto raw = p.mode == ImageMode::kNative ? raw_dtype(p.layout.type) : at::kByte;
  const int64_t param_count =
      p.rgb_stage() ? kPhotometricParamCount : channel_param_count(p.layout.channels);
  for (int g = 0; g < (config.num_local() > 0 ? 2 : 1); ++g) {
    if (p.photometric) {
      auto opts = host.dtype(options_.dtype);
      if (options_.channels_last) opts = opts.memory_format(at::MemoryFormat::ChannelsLast);
      batch.groups.push_back(at::empty({counts[g], c, sizes[g], sizes[g]}, opts));
    } else {
      batch.groups.push_back(at::empty({counts[g], sizes[g], sizes[g], c}, host.dtype(raw)));
      batch.params.push_back(at::empty({counts[g], param_count}, host.dtype(at::kFloat)));
    }
  }
  if (options_.masks.enabled) {
    const int64_t g = options_.masks.grid(config.global_size);
    batch.masks = at::empty({2 * b, g, g}, host.dtype(at::kBool));
  }
  batch.labels = at::empty({b}, host.dtype(at::kLong));
  batch.indices = at::empty({b}, host.dtype(at::kLong));
  if (!options_.pin_memory) {
    if (pool_.size() < static_cast<size_t>(options_.prefetch) + 2) {
      pool_.push_back(batch);
    } else if (num_size_pairs() > 1) {
      // A full pool of other pairs' batches: an unused one makes room.
      for (LoaderBatch& pooled : pool_) {
        if (unused(pooled)) {
          pooled = batch;
          break;
        }
      }
    }
  }
  return batch;
}

MultiCropLoader::FillResult MultiCropLoader::fill_row(const LoaderBatch& batch, int64_t row,
                                                      int64_t b, int64_t index, uint64_t key,
                                                      int64_t epoch, int64_t position) const {
  thread_local PipelineScratch scratch;
  thread_local std::vector<uint8_t> bytes;
  FillResult result;
  const std::vector<CropTarget> targets = targets_for(batch, row, b, options_);
  for (int attempt = 0;; ++attempt) {
    try {
      auto t = Clock::now();
      source_->read(index, attempt == 0 ? position : -1, bytes);
      result.times.decode += std::chrono::duration<double>(Clock::now() - t).count();
      Rng rng(options_.seed, static_cast<uint64_t>(epoch), key);
      run_multicrop(bytes.data(), bytes.size(), rng, pipeline_of(batch.size_pair), targets, scratch,
                    &result.times);
      batch.labels.data_ptr<int64_t>()[row] = source_->label(index);
      batch.indices.data_ptr<int64_t>()[row] = index;
      return result;
    } catch (const std::exception& e) {
      std::string message = source_->describe(index) + ": " + e.what();
      if (!options_.skip_errors) {
        result.error = std::move(message);
        return result;
      }
      result.skipped.push_back(std::move(message));
      if (attempt + 1 >= options_.max_skip_attempts) {
        result.error = "on_error='skip' found no readable replacement in " +
                       std::to_string(options_.max_skip_attempts) +
                       " tries; last: " + result.skipped.back();
        return result;
      }
      // A replacement drawn from the seed, epoch and position: the same in
      // every run and with any number of threads.
      index = static_cast<int64_t>(mix_keys(options_.seed ^ kSkipKey, static_cast<uint64_t>(epoch),
                                            key * 64 + static_cast<uint64_t>(attempt)) %
                                   static_cast<uint64_t>(num_samples()));
    }
  }
}

std::vector<int> MultiCropLoader::plan_masks(int64_t batch, int64_t b, int64_t epoch,
                                             int pair) const {
  if (!options_.masks.enabled) return {};
  const int g = options_.masks.grid(pipeline_of(pair).augment.global_size);
  Rng rng = mask_plan_stream(options_.seed, epoch, options_.rank, batch);
  return plan_mask_counts(rng, static_cast<int>(2 * b), g * g, options_.masks);
}

void MultiCropLoader::fill_masks(const LoaderBatch& batch, int64_t row, int64_t b, uint64_t key,
                                 int64_t epoch, const std::array<int, 2>& counts) const {
  if (!batch.masks.defined()) return;
  const BlockMasker masker(options_.masks, pipeline_of(batch.size_pair).augment.global_size);
  auto* masks = static_cast<uint8_t*>(batch.masks.data_ptr());  // bool: one byte, 0 or 1
  for (int view = 0; view < 2; ++view) {
    Rng rng = mask_stream(options_.seed, epoch, key, view);
    masker.generate(rng, counts[view], masks + (view * b + row) * masker.num_patches());
  }
}

void MultiCropLoader::record(FillResult& result, bool count_sample) {
  decode_s_ += result.times.decode;
  crop_s_ += result.times.crop;
  augment_s_ += result.times.augment;
  if (!count_sample)
    return;  // a sample of an abandoned epoch: its time was spent, it was not delivered
  images_ += 1;
  for (auto& s : result.skipped) {
    ++skipped_;
    if (skipped_files_.size() < kMaxSkippedListed) skipped_files_.push_back(std::move(s));
  }
}

void MultiCropLoader::start_epoch(int64_t epoch, int64_t first_batch) {
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError("the loader is closed");
  if (!source_->claim(this)) {
    throw LoaderError(
        "the data source already feeds another loader's epochs; open it again for this one");
  }
  if (first_batch < 0 || first_batch > num_batches()) {
    throw std::invalid_argument("first batch " + std::to_string(first_batch) +
                                " is outside the epoch's " + std::to_string(num_batches()) +
                                " batches");
  }
  if (running_) elapsed_s_ += std::chrono::duration<double>(Clock::now() - started_).count();
  running_ = false;
  ++generation_;    // results of the old epoch still being computed are dropped
  source_->stop();  // wakes workers waiting for the source's reads of the old epoch
  idle_cv_.wait(lk, [&] { return busy_ == 0; });
  epoch_ = epoch;
  order_ = std::make_shared<const std::vector<int64_t>>(epoch_indices(epoch));
  consumed_ = first_batch;
  next_task_ = first_batch * options_.batch_size;
  end_task_ = options_.drop_last ? num_batches() * options_.batch_size : per_rank_;
  source_->begin_epoch(order_options(), order_, next_task_, end_task_);
  for (auto& slot : slots_) *slot = Slot{};
  running_ = next_task_ < end_task_;
  started_ = Clock::now();
  if (threads_.empty()) {
    const int n = options_.num_threads > 0 ? options_.num_threads : available_cores();
    for (int i = 0; i < n; ++i) threads_.emplace_back([this] { worker_loop(); });
  }
  work_cv_.notify_all();
}

void MultiCropLoader::worker_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  const int64_t b = options_.batch_size;
  for (;;) {
    work_cv_.wait(lk, [&] {
      return closed_ ||
             (running_ && next_task_ < end_task_ && next_task_ / b < consumed_ + options_.prefetch);
    });
    if (closed_) return;
    const int64_t task = next_task_++;
    const int64_t batch = task / b;
    const uint64_t generation = generation_;
    Slot& slot = *slots_[batch % options_.prefetch];
    if (slot.batch != batch) {
      slot = Slot{};
      slot.batch = batch;
      slot.size = batch_size_of(batch);
      slot.pair = size_pair_of(epoch_, batch);
      try {
        slot.out = allocate_batch(slot.size, slot.pair);
      } catch (const std::exception& e) {
        slot.error = std::string("cannot allocate the batch: ") + e.what();
        slot.error_row = -1;
      }
      slot.mask_counts = plan_masks(batch, slot.size, epoch_, slot.pair);
    }
    const bool allocated = !slot.out.groups.empty();
    const LoaderBatch out = slot.out;  // handles, so the tensors outlive a reset of the slot
    const int64_t size = slot.size;
    const int64_t row = task - batch * b;
    const std::array<int, 2> mask_counts = row_mask_counts(slot.mask_counts, row, size);
    ++busy_;
    lk.unlock();

    FillResult result;
    if (allocated) {
      const uint64_t position = static_cast<uint64_t>(task) * options_.world_size + options_.rank;
      result = fill_row(out, row, size, (*order_)[task], position, epoch_, task);
      fill_masks(out, row, size, position, epoch_, mask_counts);
    }

    lk.lock();
    --busy_;
    const bool current = generation == generation_;
    record(result, current);
    if (current) {
      if (!result.error.empty() && row < slot.error_row) {
        slot.error_row = row;
        slot.error = std::move(result.error);
      }
      if (++slot.done == slot.size) done_cv_.notify_all();
    }
    if (busy_ == 0) idle_cv_.notify_all();
  }
}

std::optional<LoaderBatch> MultiCropLoader::next() {
  std::unique_lock<std::mutex> lk(mu_);
  if (closed_) throw LoaderError("the loader is closed");
  if (!running_ || consumed_ >= num_batches()) {
    if (running_) elapsed_s_ += std::chrono::duration<double>(Clock::now() - started_).count();
    running_ = false;
    return std::nullopt;
  }
  Slot& slot = *slots_[consumed_ % options_.prefetch];
  const auto t0 = Clock::now();
  done_cv_.wait(lk, [&] { return closed_ || (slot.batch == consumed_ && slot.done == slot.size); });
  wait_s_ += std::chrono::duration<double>(Clock::now() - t0).count();
  if (closed_) throw LoaderError("the loader was closed while waiting for a batch");
  LoaderBatch out = std::move(slot.out);
  out.batch_index = consumed_;
  const std::string error = std::move(slot.error);
  slot = Slot{};
  ++consumed_;
  ++batches_;
  work_cv_.notify_all();
  lk.unlock();
  if (!error.empty()) throw LoaderError("batch " + std::to_string(out.batch_index) + ": " + error);
  return out;
}

void MultiCropLoader::close() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (closed_) return;
    if (running_) elapsed_s_ += std::chrono::duration<double>(Clock::now() - started_).count();
    closed_ = true;
    running_ = false;
  }
  if (source_->claim(this)) {
    source_->stop();
    source_->release(this);
  }
  work_cv_.notify_all();
  done_cv_.notify_all();
  for (auto& t : threads_) t.join();
  threads_.clear();
  std::lock_guard<std::mutex> lk(mu_);
  for (auto& slot : slots_) *slot = Slot{};
  pool_.clear();
}

LoaderStats MultiCropLoader::stats() const {
  std::lock_guard<std::mutex> lk(mu_);
  LoaderStats s;
  s.images = images_;
  s.batches = batches_;
  s.decode_seconds = decode_s_;
  s.crop_seconds = crop_s_;
  s.augment_seconds = augment_s_;
  s.wait_seconds = wait_s_;
  s.elapsed_seconds =
      elapsed_s_ +
      (running_ ? std::chrono::duration<double>(Clock::now() - started_).count() : 0.0);
  s.skipped = skipped_;
  s.skipped_files = skipped_files_;
  s.num_threads = static_cast<int>(threads_.size());
  return s;
}

LoaderBatch MultiCropLoader::load_sample(int64_t index, int64_t epoch) {
  if (index < 0 || index >= num_samples()) {
    throw std::out_of_range("index " + std::to_string(index) + " is outside the data set of " +
                            std::to_string(num_samples()) + " samples");
  }
  LoaderBatch batch;
  const int pair = size_pair_of(epoch, index);  // a batch of one: batch `index`
  {
    std::lock_guard<std::mutex> lk(mu_);
    batch = allocate_batch(1, pair);
  }
  const uint64_t key = static_cast<uint64_t>(index);
  FillResult result = fill_row(batch, 0, 1, index, key, epoch, -1);
  fill_masks(batch, 0, 1, key, epoch, row_mask_counts(plan_masks(index, 1, epoch, pair), 0, 1));
  {
    std::lock_guard<std::mutex> lk(mu_);
    record(result, true);
  }
  if (!result.error.empty()) throw LoaderError(result.error);
  return batch;
}

}  // namespace dino_opt::loader
