#pragma once
// Tar shards as a sample source, read in large sequential pieces.
//
// The table holds, per image, its shard, offset, size and label (20 bytes),
// from each shard's index (tar_index.h): read from an index file when one
// matches the shard's size and mtime, else built by scanning the shard and
// written for next time.
//
// An epoch's order keeps reads sequential: the shards are shuffled per
// (seed, epoch) and laid end to end; rank r takes the r-th contiguous run of
// per_rank samples of that stream (wrapping around to pad), reads `streams`
// of its shards at a time, drawing the next sample from a random one of them,
// and shuffles each window of `shuffle_buffer` consecutive samples. The order
// is a pure function of (seed, epoch, rank, world size), computed up front,
// so an epoch resumes at any position.
//
// Reading: a reader thread loads each window's members before the workers
// need them, as a few contiguous extents per shard read front to back in
// `read_block` pieces, at most two windows ahead of the oldest window still
// being read; a window's memory goes when its last sample has been read.
// A sample outside the plan (a replacement for a bad one) is read directly.
#include <condition_variable>
#include <map>
#include <thread>

#include "loader/sample_source.h"

namespace dino_opt::loader {

struct ShardSourceOptions {
  int streams = 4;               // shards a rank reads at once when shuffling
  int64_t read_block = 8 << 20;  // bytes per read call
  int threads = 0;               // threads building indexes (0: the cores available)
  int64_t windows_ahead = 2;     // windows loaded ahead of the oldest one in use
  int64_t merge_gap = 1 << 20;   // members less than this apart are read in one extent
};

// How the indexes were found at construction.
struct ShardIndexReport {
  int64_t loaded = 0;                  // read from an index file
  int64_t built = 0;                   // scanned from the shard
  int64_t written = 0;                 // of those, written to an index file
  std::vector<std::string> unwritten;  // "shard: why" for built indexes no candidate took
};

class ShardSource : public SampleSource {
 public:
  // `index_paths[i]`: where shard i's index may be, in order of preference;
  // the first that matches the shard is used, and a built index is written to
  // the first that can be written. Throws SourceError naming the shard that
  // is missing, truncated or corrupt (the first in order, when several are).
  ShardSource(std::vector<std::string> shards, std::vector<std::vector<std::string>> index_paths,
              ShardSourceOptions options = {});
  ~ShardSource() override;

  int64_t size() const override { return static_cast<int64_t>(members_.size()); }
  int64_t label(int64_t index) const override { return labels_[index]; }
  std::string describe(int64_t index) const override;
  void read(int64_t index, int64_t position, std::vector<uint8_t>& out) const override;
  std::vector<int64_t> epoch_order(const OrderOptions& options, int64_t epoch) const override;
  void begin_epoch(const OrderOptions& options, std::shared_ptr<const std::vector<int64_t>> order,
                   int64_t first, int64_t end) override;
  void stop() override;
  int64_t table_bytes() const override;

  int64_t num_shards() const { return static_cast<int64_t>(shards_.size()); }
  const std::string& shard_path(int64_t shard) const { return shards_[shard].path; }
  // The shard of sample `index`, and the index file that describes it ("" when none was written).
  int64_t shard_of(int64_t index) const { return members_[index].shard; }
  const std::string& index_path(int64_t shard) const { return shards_[shard].index_path; }
  const ShardIndexReport& index_report() const { return report_; }

 private:
  struct Shard {
    std::string path;
    std::string index_path;
    int64_t first = 0;  // its first sample
    int64_t count = 0;
    uint64_t size = 0;
    int64_t mtime_ns = 0;
  };
  struct Member {
    uint64_t offset;
    uint32_t size;
    uint32_t shard;
  };
  struct Extent {
    uint32_t shard = 0;
    uint64_t begin = 0;
    std::unique_ptr<uint8_t[]> bytes;  // not zeroed first: the read fills it
    uint64_t length = 0;
    std::string error;  // why the extent could not be read
  };
  struct Window {
    bool ready = false;
    std::vector<Extent> extents;  // sorted by (shard, begin)
  };

  // Opens shard `s`, checking that it is still what its index describes.
  std::unique_ptr<FileBytes> open_shard(uint32_t s) const;
  void read_direct(int64_t index, std::vector<uint8_t>& out) const;
  std::vector<Extent> load_window(int64_t window) const;
  void reader_loop();
  void copy_from(const Window& window, int64_t index, std::vector<uint8_t>& out) const;
  void finish_position(int64_t window) const;

  std::vector<Shard> shards_;
  std::vector<Member> members_;
  std::vector<int32_t> labels_;
  ShardSourceOptions options_;
  ShardIndexReport report_;

  // The epoch's reading plan.
  mutable std::mutex mu_;
  mutable std::condition_variable cv_;
  std::shared_ptr<const std::vector<int64_t>> plan_;
  int64_t window_ = 1, first_ = 0, end_ = 0, num_windows_ = 0;
  mutable std::vector<int64_t> remaining_;  // per window: positions not read yet
  mutable std::map<int64_t, std::shared_ptr<Window>> windows_;
  mutable int64_t oldest_ = 0;  // the oldest window with positions not read yet
  int64_t next_load_ = 0;
  bool stopping_ = true;
  std::thread reader_;
  mutable std::vector<uint64_t> read_end_;  // per shard: where the last read ended (statistics)
};

}  // namespace dino_opt::loader
