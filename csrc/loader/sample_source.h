#pragma once
// Where the loader's images come from. A SampleSource is a table of samples
// (an encoded image and a label each) that worker threads read concurrently,
// and the order in which a rank visits them in an epoch:
//
//   FileSource    one file per image (an ImageFolder, a file list): the
//                 paths in one string arena, relative to a root
//   ArrowSource   an image column of Arrow arrays (a Hugging Face data set,
//                 Parquet) read in place from the buffers the caller holds
//   ShardSource   tar shards (shard_source.h)
//
// The tables are compact (no std::string per sample), so that a data set of
// millions of images costs tens of bytes per image. Free of torch headers.
#include <atomic>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "loader/tar_index.h"

namespace dino_opt::loader {

// What decides a rank's order in an epoch.
struct OrderOptions {
  uint64_t seed = 0;
  int rank = 0;
  int world_size = 1;
  bool shuffle = true;
  int64_t per_rank = 0;           // samples this rank takes (padded or cut to equal length)
  int64_t shuffle_buffer = 1024;  // shards: samples shuffled together (a window of the stream)
  int64_t first = -1;  // shards: where this rank's run of the stream starts (-1: rank * per_rank)
};

// The file-system reads a source made.
struct ReadStats {
  int64_t reads = 0;       // read calls (pread, or the reads of a whole file)
  int64_t bytes = 0;       // bytes they returned
  int64_t sequential = 0;  // reads that began where the previous read of that file ended
  int64_t opens = 0;       // files opened
};

class SampleSource {
 public:
  virtual ~SampleSource() = default;
  virtual int64_t size() const = 0;
  virtual int64_t label(int64_t index) const = 0;
  // What names sample `index` in a message: its path, "shard: member", "file: row N".
  virtual std::string describe(int64_t index) const = 0;
  // Sample `index`'s encoded bytes into `out`. `position` is where the sample
  // stands in the order given to begin_epoch (-1: outside it, e.g. a
  // replacement for a bad sample). Thread-safe. Throws ImageError or
  // SourceError with the cause (the caller adds describe()).
  virtual void read(int64_t index, int64_t position, std::vector<uint8_t>& out) const = 0;
  // This rank's sample indices for `epoch`, in order. Default: a permutation
  // of all samples per (seed, epoch) of which rank r takes every
  // world_size-th from r (DistributedSampler), wrapping around to pad.
  virtual std::vector<int64_t> epoch_order(const OrderOptions& options, int64_t epoch) const;
  // The loader is about to read positions [first, end) of `order` (nothing is
  // being read now). Default: nothing to prepare.
  virtual void begin_epoch(const OrderOptions& options,
                           std::shared_ptr<const std::vector<int64_t>> order, int64_t first,
                           int64_t end);
  // Stops background reading and wakes readers waiting for it (they throw);
  // idempotent, and begin_epoch starts again.
  virtual void stop() {}
  // Bytes the sample table takes in memory.
  virtual int64_t table_bytes() const = 0;
  ReadStats read_stats() const;
  // The epoch plan belongs to one reader at a time: `owner` takes it (true),
  // or another reader holds it (false). release() gives it back.
  bool claim(const void* owner);
  void release(const void* owner);

 protected:
  void count_read(int64_t reads, int64_t bytes, int64_t sequential, int64_t opens) const;

 private:
  mutable std::mutex stats_mu_;
  mutable ReadStats stats_;
  std::atomic<const void*> owner_{nullptr};
};

// One file per image.
class FileSource : public SampleSource {
 public:
  // `root`: the folder relative paths start from ("" for none).
  explicit FileSource(std::string root);
  void add(std::string_view path, int32_t label);
  void set_label(int64_t index, int32_t label);
  void reserve(size_t count, size_t path_bytes);

  std::string path(int64_t index) const;
  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  int64_t label(int64_t index) const override { return labels_[index]; }
  std::string describe(int64_t index) const override { return path(index); }
  void read(int64_t index, int64_t position, std::vector<uint8_t>& out) const override;
  int64_t table_bytes() const override;

 private:
  std::string root_;  // "" or ending in '/'
  std::string arena_;
  std::vector<uint64_t> ends_;  // path i is arena_[ends_[i-1], ends_[i])
  std::vector<int32_t> labels_;
};

// A file list: `.csv` (a header row naming a path column `path`, `file`,
// `filename`, `image` or `image_path` and a label column `label`, `class`,
// `target` or `category`; without such a header the first column is the path
// and the second, if any, the label; RFC 4180 quoting), or text (one path per
// line, optionally followed by whitespace and a label; a tab separates the
// label when paths hold spaces; blank lines and lines starting with '#' are
// skipped). Labels are integers, or class names (numbered in sorted order, the
// names returned). Relative paths start from `root`. Throws SourceError naming
// the list and the line.
struct FileList {
  std::shared_ptr<FileSource> source;
  std::vector<std::string> classes;  // empty when the labels are integers
};
FileList read_file_list(const std::string& list_path, const std::string& root);

// An Arrow binary or large-binary array of a chunk: the buffers as Arrow lays
// them out (validity may be null), `offset` the array's offset into them.
struct ArrowBinary {
  const uint8_t* validity = nullptr;
  const void* offsets = nullptr;  // int32 (binary) or int64 (large binary)
  const uint8_t* data = nullptr;
  int64_t offset = 0;
  bool large = false;
};

// One chunk of the image column: its bytes, and optionally the paths of
// images stored by path (read where the bytes are null).
struct ArrowChunk {
  int64_t length = 0;
  ArrowBinary bytes;
  ArrowBinary paths;     // data == nullptr: no path column
  int32_t file = 0;      // index into the source's file names
  int64_t file_row = 0;  // row of the chunk's first element in that file
};

class ArrowSource : public SampleSource {
 public:
  // `keepalive` owns whatever keeps the buffers valid (the caller's arrays).
  ArrowSource(std::vector<std::string> files, std::vector<ArrowChunk> chunks,
              std::vector<int32_t> labels, std::shared_ptr<void> keepalive);
  int64_t size() const override { return static_cast<int64_t>(labels_.size()); }
  int64_t label(int64_t index) const override { return labels_[index]; }
  std::string describe(int64_t index) const override;
  void read(int64_t index, int64_t position, std::vector<uint8_t>& out) const override;
  int64_t table_bytes() const override;

 private:
  size_t chunk_of(int64_t index) const;

  std::vector<std::string> files_;
  std::vector<ArrowChunk> chunks_;
  std::vector<int64_t> starts_;  // first row of each chunk
  std::vector<int32_t> labels_;
  std::shared_ptr<void> keepalive_;
};

// The cores this process may run on (sched_getaffinity), at least 1.
int available_cores();

}  // namespace dino_opt::loader
