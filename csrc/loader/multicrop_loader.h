#pragma once
// The multi-crop loader: a pool of C++ threads runs the per-image pipeline
// (multicrop_pipeline.h) and writes finished batches straight into (pinned)
// tensors, a bounded number of batches ahead of the consumer. Output depends
// only on (seed, epoch, sample position), never on the thread count.
#include <ATen/ATen.h>

#include <array>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "loader/masking.h"
#include "loader/multicrop_pipeline.h"
#include "loader/sample_source.h"

namespace dino_opt::loader {

// A failed batch (on_error="raise"), or a loader used after close().
class LoaderError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// An image file and its label (MultiCropLoader's FileSource constructor).
struct Sample {
  std::string path;
  int64_t label = -1;
};

struct LoaderOptions {
  int64_t batch_size = 64;
  PipelineOptions pipeline;
  int num_threads = 0;  // 0: the cores this process may run on
  int prefetch = 4;     // batches in flight ahead of the consumer
  uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
  bool shuffle = true;
  bool drop_last = true;   // drop this rank's last partial batch
  bool pad_shards = true;  // DistributedSampler: pad (true) or drop (false) to equal shards
  // Every sample exactly once over the ranks (evaluation): no padding and no
  // cut, the first n % world_size ranks take one sample more (a rank may take
  // none); a file source's ranks take every world_size-th sample, a shard
  // source's ranks contiguous runs. Overrides pad_shards.
  bool exact_shards = false;
  int64_t shuffle_buffer = 1024;  // tar shards: samples shuffled together (sample_source.h)
  at::ScalarType dtype = at::kFloat;
  bool channels_last = false;
  bool pin_memory = false;
  bool skip_errors = false;  // on_error="skip"
  int max_skip_attempts = 16;
  MaskConfig masks;  // DINOv2's block masks of the global crops (off by default)
  // High-resolution adaptation: with pairs, each batch makes all of its crops
  // at one (global, local) pair, drawn per batch with probability
  // size_probs[k] (empty: uniform) by draw_size_pair, and pipeline.augment's
  // two sizes are unused. Empty: pipeline.augment's sizes for every batch.
  std::vector<CropSizePair> size_pairs;
  std::vector<double> size_probs;

  // Throws std::invalid_argument naming the option that is out of range.
  void validate() const;
};

// One batch. With the photometric stage here: groups[0] is [2B, C, G, G]
// (C = 3, or the layout's channels in ImageMode::kNative)
// (global crop 1 of every sample, then global crop 2), groups[1] is
// [n_local * B, 3, L, L], in `dtype` (with augment.center_crop: groups[0]
// alone, [B, 3, G, G]); G and L are the batch's pair's (size_pair) when the
// loader has several. Deferred: groups are [N, H, W, C] of the layout's
// sample type (uint8 in kRgb mode) and params[g] the float32 parameters of
// each crop, [N, 13] (the RGB stage) or [N, channel_param_count(C)].
// With masks enabled, masks is bool [2B, g, g] (g = global_size /
// patch_size), row n the mask of global crop n of groups[0].
struct LoaderBatch {
  std::vector<at::Tensor> groups;
  std::vector<at::Tensor> params;
  at::Tensor masks;    // undefined when masks are off
  at::Tensor labels;   // int64 [B]
  at::Tensor indices;  // int64 [B], data set indices (after skip replacements)
  int64_t batch_index = 0;
  int size_pair = 0;  // index into LoaderOptions::size_pairs (0 without pairs)
};

struct LoaderStats {
  int64_t images = 0;                      // decoded and augmented since construction
  int64_t batches = 0;                     // handed to the consumer
  double decode_seconds = 0;               // thread-seconds in read + decode
  double crop_seconds = 0;                 // thread-seconds in crop sampling + resize
  double augment_seconds = 0;              // thread-seconds in the photometric stage
  double wait_seconds = 0;                 // consumer time blocked on an unfinished batch
  double elapsed_seconds = 0;              // wall time the pipeline has been producing
  int64_t skipped = 0;                     // files replaced under on_error="skip"
  std::vector<std::string> skipped_files;  // the first 100, "path: cause"
  int num_threads = 0;
};

// The layout of a data set read at its stored depth: that of its first image
// (of the first `tries` ones, the first that decodes), and that image's
// describe(). Throws std::invalid_argument naming the image when none decodes.
std::pair<ImageLayout, std::string> data_set_layout(const SampleSource& source,
                                                    const DecodeOptions& decode, int64_t tries = 1);

class MultiCropLoader {
 public:
  MultiCropLoader(std::shared_ptr<SampleSource> source, LoaderOptions options);
  // Image files (a FileSource of these paths).
  MultiCropLoader(const std::vector<Sample>& samples, LoaderOptions options);
  ~MultiCropLoader();
  MultiCropLoader(const MultiCropLoader&) = delete;
  MultiCropLoader& operator=(const MultiCropLoader&) = delete;

  int64_t num_samples() const { return source_->size(); }
  const std::shared_ptr<SampleSource>& source() const { return source_; }
  int64_t samples_per_rank() const { return per_rank_; }
  int64_t num_batches() const;
  // options().pipeline.layout is the data set's in ImageMode::kNative (its
  // first image's; layout_from names it).
  const LoaderOptions& options() const { return options_; }

  // This rank's data set indices for `epoch`, in order (shuffled, sharded).
  std::vector<int64_t> epoch_indices(int64_t epoch) const;
  // The crop-size pair of batch `batch` of `epoch` (draw_size_pair; 0
  // without pairs): the same on every rank, whatever the thread count.
  int size_pair_of(int64_t epoch, int64_t batch) const;
  // How many pairs the loader draws from (1 without size_pairs).
  int num_size_pairs() const { return static_cast<int>(pipelines_.size()); }
  // The (global, local) sides of pair `pair`.
  CropSizePair size_pair(int pair) const;

  // Starts producing `epoch` at batch `first_batch`; abandons any batches of
  // an unfinished epoch.
  void start_epoch(int64_t epoch, int64_t first_batch = 0);
  // The next batch of the current epoch, blocking; nullopt after the last.
  // Throws LoaderError for a batch holding an unreadable file (raise mode).
  std::optional<LoaderBatch> next();
  // Stops and joins every thread; idempotent. next() then throws.
  void close();
  LoaderStats stats() const;

  // Sample `index` alone, on the calling thread, through the same pipeline
  // (a batch of one: [2, 3, G, G] and [n_local, 3, L, L], or raw + params),
  // its random stream keyed by (seed, epoch, index); for a torch Dataset.
  // With size pairs, its pair is that of batch `index` (a batch of one).
  // With masks on, its two global crops' masks follow a plan of their own
  // (a batch of one, keyed by the index). Throws LoaderError as next() does.
  LoaderBatch load_sample(int64_t index, int64_t epoch);

 private:
  struct Slot;
  struct FillResult {
    PipelineTimes times;
    std::string error;                 // raise mode: "path: cause"
    std::vector<std::string> skipped;  // skip mode: every file replaced
  };
  void worker_loop();
  // Adds a sample's stage times (always) and, when `count_sample`, the sample
  // and its skipped files to the statistics. Called with mu_ held.
  void record(FillResult& result, bool count_sample);
  // Runs sample `index` (random stream `key`; at `position` of the epoch's
  // order, -1 outside it) into row `row` of a batch of `b`.
  FillResult fill_row(const LoaderBatch& batch, int64_t row, int64_t b, int64_t index, uint64_t key,
                      int64_t epoch, int64_t position) const;
  // The pipeline of the crops of pair `pair` (options_.pipeline without pairs).
  const PipelineOptions& pipeline_of(int pair) const { return pipelines_[pair]; }
  OrderOptions order_options() const;
  // The requested mask sizes of the 2b global crops of batch `batch` (empty
  // when masks are off), and the masks of row `row`'s two global crops
  // (`counts` from that plan, `key` the sample's stream key).
  std::vector<int> plan_masks(int64_t batch, int64_t b, int64_t epoch, int pair) const;
  void fill_masks(const LoaderBatch& batch, int64_t row, int64_t b, uint64_t key, int64_t epoch,
                  const std::array<int, 2>& counts) const;
  LoaderBatch allocate_batch(int64_t size, int pair);
  int64_t batch_size_of(int64_t batch) const;

  const std::shared_ptr<SampleSource> source_;
  const LoaderOptions options_;
  int64_t per_rank_ = 0;
  // One pipeline per size pair (options_.pipeline with the pair's sides), or
  // options_.pipeline alone; and the pairs' cumulative probabilities.
  std::vector<PipelineOptions> pipelines_;
  std::vector<double> size_cumulative_;

  mutable std::mutex mu_;
  std::condition_variable work_cv_;  // workers: a task, or closing
  std::condition_variable done_cv_;  // consumer: a batch finished
  std::condition_variable idle_cv_;  // start_epoch: no task of the old epoch still running
  bool closed_ = false;
  bool running_ = false;
  uint64_t generation_ = 0;
  int64_t epoch_ = 0;
  std::shared_ptr<const std::vector<int64_t>> order_;  // this rank's data set indices for the epoch
  int64_t next_task_ = 0;  // next sample position (in order_) to hand out
  int64_t end_task_ = 0;
  int64_t consumed_ = 0;  // next batch to hand to the consumer
  int busy_ = 0;
  std::vector<std::unique_ptr<Slot>> slots_;
  std::vector<LoaderBatch> pool_;  // pageable batches, reused once the consumer dropped them
  std::vector<std::thread> threads_;

  // Statistics.
  std::atomic<int64_t> images_{0};
  int64_t batches_ = 0;
  double decode_s_ = 0, crop_s_ = 0, augment_s_ = 0, wait_s_ = 0, elapsed_s_ = 0;
  std::chrono::steady_clock::time_point started_;
  int64_t skipped_ = 0;
  std::vector<std::string> skipped_files_;
};

}  // namespace dino_opt::loader
