#include "loader/shard_source.h"

#include <algorithm>
#include <atomic>
#include <iterator>
#include <new>
#include <numeric>

#include "loader/crop_sampling.h"

namespace dino_opt::loader {
namespace {

constexpr uint64_t kShardOrderKey = 0x5348415244ull;  // the epoch's order of the shards
constexpr uint64_t kInterleaveKey = 0x494e544c56ull;  // which open shard gives the next sample
constexpr uint64_t kWindowKey = 0x57494e444f57ull;    // the shuffle of each window

struct Indexed {
  ShardIndex index;
  std::string index_path;
  bool built = false;
  std::string error;
  std::string unwritten;
};

Indexed index_one(const std::string& path, const std::vector<std::string>& candidates) {
  Indexed out;
  const FileBytes file(path);  // SourceError naming a missing or unreadable shard
  for (const std::string& c : candidates) {
    auto index = read_shard_index(c, false);
    if (index && index->shard_size == file.size() && index->shard_mtime_ns == file.mtime_ns()) {
      out.index = std::move(*index);
      out.index_path = c;
      return out;
    }
  }
  out.index = index_shard(path);
  out.built = true;
  std::string why;
  for (const std::string& c : candidates) {
    try {
      write_shard_index(out.index, c);
      out.index_path = c;
      break;
    } catch (const SourceError& e) {
      why += (why.empty() ? "" : "; ") + std::string(e.what());
    }
  }
  if (out.index_path.empty()) out.unwritten = path + ": " + (why.empty() ? "no index path" : why);
  out.index.names.clear();
  out.index.names.shrink_to_fit();
  return out;
}

// A SourceError's message without a leading "path: ".
std::string cause(const SourceError& e, const std::string& path) {
  std::string what = e.what();
  if (what.rfind(path + ": ", 0) == 0) what.erase(0, path.size() + 2);
  return what;
}

}  // namespace

ShardSource::ShardSource(std::vector<std::string> shards,
                         std::vector<std::vector<std::string>> index_paths,
                         ShardSourceOptions options)
    : options_(options) {
  if (shards.empty()) throw SourceError("no shards given");
  if (index_paths.size() != shards.size())
    throw std::invalid_argument("index_paths needs one list of candidates per shard");
  if (options_.streams < 1 || options_.read_block < 4096 || options_.windows_ahead < 1 ||
      options_.merge_gap < 0)
    throw std::invalid_argument("shard options out of range (streams >= 1, read_block >= 4096)");
  const size_t n = shards.size();
  std::vector<Indexed> results(n);
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next++) < n;) {
      try {
        results[i] = index_one(shards[i], index_paths[i]);
      } catch (const std::exception& e) {  // SourceError, or bad_alloc on a huge shard
        results[i].error = e.what();
      }
    }
  };
  const int cores = options_.threads > 0 ? options_.threads : available_cores();
  std::vector<std::thread> pool;
  for (size_t t = 1; t < std::min<size_t>(n, static_cast<size_t>(cores)); ++t)
    pool.emplace_back(work);
  work();
  for (auto& t : pool) t.join();
  int64_t total = 0;
  for (size_t i = 0; i < n; ++i) {
    if (!results[i].error.empty()) throw SourceError(results[i].error);
    total += static_cast<int64_t>(results[i].index.entries.size());
  }
  if (total == 0) throw SourceError(shards[0] + " (and the other shards): no image members");
  members_.reserve(total);
  labels_.reserve(total);
  shards_.reserve(n);
  read_end_.assign(n, 0);
  for (size_t i = 0; i < n; ++i) {
    Indexed& r = results[i];
    shards_.push_back(
        {std::move(shards[i]), std::move(r.index_path), static_cast<int64_t>(members_.size()),
         static_cast<int64_t>(r.index.entries.size()), r.index.shard_size, r.index.shard_mtime_ns});
    for (const IndexEntry& e : r.index.entries) {
      members_.push_back({e.offset, e.size, static_cast<uint32_t>(i)});
      labels_.push_back(e.label);
    }
    r.index.entries = {};
    report_.loaded += !r.built;
    report_.built += r.built;
    report_.written += r.built && !shards_.back().index_path.empty();
    if (!r.unwritten.empty()) report_.unwritten.push_back(std::move(r.unwritten));
  }
}

ShardSource::~ShardSource() { stop(); }

std::string ShardSource::describe(int64_t index) const {
  const Member& m = members_[index];
  const Shard& s = shards_[m.shard];
  std::optional<std::string> name;
  if (!s.index_path.empty()) name = index_member_name(s.index_path, index - s.first);
  return s.path + ": " + (name ? *name : "the member at byte " + std::to_string(m.offset));
}

int64_t ShardSource::table_bytes() const {
  int64_t bytes = static_cast<int64_t>(
      members_.capacity() * sizeof(Member) + labels_.capacity() * sizeof(int32_t) +
      shards_.capacity() * sizeof(Shard) + read_end_.capacity() * sizeof(uint64_t));
  for (const Shard& s : shards_) bytes += s.path.capacity() + s.index_path.capacity();
  return bytes;
}

// ------------------------------------------------------------------ order

std::vector<int64_t> ShardSource::epoch_order(const OrderOptions& o, int64_t epoch) const {
  const int64_t n = size();
  std::vector<int64_t> out;
  if (o.per_rank <= 0) return out;
  out.reserve(o.per_rank);
  const size_t ns = shards_.size();
  std::vector<uint32_t> perm(ns);
  std::iota(perm.begin(), perm.end(), 0u);
  if (o.shuffle) {
    Rng rng(o.seed, kShardOrderKey, static_cast<uint64_t>(epoch));
    for (int64_t i = static_cast<int64_t>(ns) - 1; i > 0; --i)
      std::swap(perm[i], perm[rng.randint(0, i + 1)]);
  }
  std::vector<int64_t> starts(ns + 1, 0);  // stream position of each shard in the epoch's order
  for (size_t k = 0; k < ns; ++k) starts[k + 1] = starts[k] + shards_[perm[k]].count;
  // This rank's contiguous run of the stream, wrapping around to pad, as
  // pieces of shards: [next, end) of global sample indices.
  struct Segment {
    int64_t next, end;
  };
  std::vector<Segment> segments;
  int64_t p = (o.first >= 0 ? o.first : static_cast<int64_t>(o.rank) * o.per_rank) % n;
  int64_t left = o.per_rank;
  while (left > 0) {
    const size_t k =
        static_cast<size_t>(std::upper_bound(starts.begin(), starts.end(), p) - starts.begin() - 1);
    const int64_t take = std::min(left, starts[k + 1] - p);
    const int64_t first = shards_[perm[k]].first + (p - starts[k]);
    segments.push_back({first, first + take});
    left -= take;
    p = (p + take) % n;
  }
  if (!o.shuffle || options_.streams == 1) {
    for (const Segment& s : segments)
      for (int64_t i = s.next; i < s.end; ++i) out.push_back(i);
    if (!o.shuffle) return out;
  } else {
    Rng rng(o.seed ^ kInterleaveKey, static_cast<uint64_t>(epoch), static_cast<uint64_t>(o.rank));
    std::vector<Segment> open;
    size_t next = 0;
    while (open.size() < static_cast<size_t>(options_.streams) && next < segments.size())
      open.push_back(segments[next++]);
    while (!open.empty()) {
      const size_t j = static_cast<size_t>(rng.randint(0, static_cast<int64_t>(open.size())));
      out.push_back(open[j].next++);
      if (open[j].next == open[j].end) {
        if (next < segments.size()) {
          open[j] = segments[next++];
        } else {
          open.erase(open.begin() + static_cast<std::ptrdiff_t>(j));
        }
      }
    }
  }
  const int64_t s = std::max<int64_t>(1, o.shuffle_buffer);
  for (int64_t w = 0; w * s < o.per_rank; ++w) {
    Rng rng(mix_keys(o.seed, kWindowKey, static_cast<uint64_t>(o.rank)),
            static_cast<uint64_t>(epoch), static_cast<uint64_t>(w));
    const int64_t begin = w * s, end = std::min(o.per_rank, begin + s);
    for (int64_t i = end - 1; i > begin; --i)
      std::swap(out[i], out[begin + rng.randint(0, i - begin + 1)]);
  }
  return out;
}

// ------------------------------------------------------------------ reading

std::unique_ptr<FileBytes> ShardSource::open_shard(uint32_t s) const {
  const Shard& shard = shards_[s];
  std::unique_ptr<FileBytes> file;
  try {
    file = std::make_unique<FileBytes>(shard.path);
  } catch (const SourceError& e) {
    throw SourceError(cause(e, shard.path));
  }
  count_read(0, 0, 0, 1);
  if (file->size() != shard.size || file->mtime_ns() != shard.mtime_ns) {
    throw SourceError("the shard changed since its index was built (then " +
                      std::to_string(shard.size) + " bytes, mtime " +
                      std::to_string(shard.mtime_ns) + " ns; now " + std::to_string(file->size()) +
                      " bytes, mtime " + std::to_string(file->mtime_ns()) +
                      " ns): start again to index it anew");
  }
  return file;
}

void ShardSource::read_direct(int64_t index, std::vector<uint8_t>& out) const {
  const Member& m = members_[index];
  const auto file = open_shard(m.shard);
  out.resize(m.size);
  try {
    file->read_at(m.offset, out.data(), m.size);
  } catch (const SourceError& e) {
    throw SourceError(cause(e, shards_[m.shard].path));
  }
  bool sequential;
  {
    std::lock_guard<std::mutex> lk(mu_);
    sequential = read_end_[m.shard] == m.offset;
    read_end_[m.shard] = m.offset + m.size;
  }
  count_read(1, m.size, sequential, 0);
}

std::vector<ShardSource::Extent> ShardSource::load_window(int64_t window) const {
  const int64_t begin = std::max(first_, window * window_);
  const int64_t end = std::min(end_, (window + 1) * window_);
  std::vector<int64_t> wanted;
  wanted.reserve(static_cast<size_t>(end - begin));
  for (int64_t p = begin; p < end; ++p) wanted.push_back((*plan_)[p]);
  std::sort(wanted.begin(), wanted.end());  // samples are numbered shard by shard, by offset
  wanted.erase(std::unique(wanted.begin(), wanted.end()), wanted.end());
  std::vector<Extent> extents;
  uint64_t extent_end = 0;
  std::vector<uint64_t> ends;
  for (int64_t i : wanted) {
    const Member& m = members_[i];
    if (!extents.empty() && extents.back().shard == m.shard &&
        m.offset <= extent_end + static_cast<uint64_t>(options_.merge_gap)) {
      extent_end = std::max(extent_end, m.offset + m.size);
      ends.back() = extent_end;
    } else {
      extents.push_back({m.shard, m.offset, nullptr, 0, {}});
      extent_end = m.offset + m.size;
      ends.push_back(extent_end);
    }
  }
  std::unique_ptr<FileBytes> file;
  std::string open_error;
  for (size_t k = 0; k < extents.size(); ++k) {
    Extent& e = extents[k];
    const std::string& path = shards_[e.shard].path;
    try {
      if (k == 0 || extents[k - 1].shard != e.shard) {
        file.reset();
        open_error.clear();
        try {
          file = open_shard(e.shard);
        } catch (const SourceError& err) {
          open_error = err.what();
        }
      }
      if (!file) throw SourceError(open_error);
      const uint64_t length = ends[k] - e.begin;
      e.bytes.reset(new uint8_t[length]);
      e.length = length;
      int64_t pieces = 0, sequential = 0;
      for (uint64_t off = 0; off < length; off += static_cast<uint64_t>(options_.read_block)) {
        const uint64_t n = std::min<uint64_t>(options_.read_block, length - off);
        file->read_at(e.begin + off, e.bytes.get() + off, n);
        std::lock_guard<std::mutex> lk(mu_);
        sequential += read_end_[e.shard] == e.begin + off;
        read_end_[e.shard] = e.begin + off + n;
        ++pieces;
      }
      count_read(pieces, static_cast<int64_t>(length), sequential, 0);
    } catch (const SourceError& err) {
      e.error = cause(err, path);
      e.bytes.reset();
      e.length = 0;
    } catch (const std::bad_alloc&) {
      e.error = "out of memory for a read of " + std::to_string(ends[k] - e.begin) + " bytes";
      e.bytes.reset();
      e.length = 0;
    }
  }
  return extents;
}

void ShardSource::reader_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    cv_.wait(lk, [&] {
      return stopping_ ||
             (next_load_ < num_windows_ && next_load_ < oldest_ + options_.windows_ahead);
    });
    if (stopping_) return;
    const int64_t w = next_load_++;
    auto window = std::make_shared<Window>();
    windows_[w] = window;
    lk.unlock();
    std::vector<Extent> extents = load_window(w);
    lk.lock();
    window->extents = std::move(extents);
    window->ready = true;
    cv_.notify_all();
  }
}

void ShardSource::copy_from(const Window& window, int64_t index, std::vector<uint8_t>& out) const {
  const Member& m = members_[index];
  auto it = std::upper_bound(
      window.extents.begin(), window.extents.end(), m, [](const Member& x, const Extent& e) {
        return x.shard < e.shard || (x.shard == e.shard && x.offset < e.begin);
      });
  if (it == window.extents.begin()) return read_direct(index, out);
  const Extent& e = *std::prev(it);
  if (!e.error.empty()) throw SourceError(e.error);
  if (e.shard != m.shard || m.offset + m.size > e.begin + e.length) return read_direct(index, out);
  const auto* from = e.bytes.get() + (m.offset - e.begin);
  out.assign(from, from + m.size);
}

void ShardSource::finish_position(int64_t window) const {
  std::lock_guard<std::mutex> lk(mu_);
  if (window >= static_cast<int64_t>(remaining_.size()) || remaining_[window] == 0) return;
  if (--remaining_[window] > 0) return;
  windows_.erase(window);
  while (oldest_ < num_windows_ && remaining_[oldest_] == 0) ++oldest_;
  cv_.notify_all();
}

void ShardSource::read(int64_t index, int64_t position, std::vector<uint8_t>& out) const {
  std::shared_ptr<Window> window;
  int64_t w = 0;
  {
    std::unique_lock<std::mutex> lk(mu_);
    const bool planned =
        plan_ && position >= first_ && position < end_ && (*plan_)[position] == index;
    if (planned) {
      w = position / window_;
      cv_.wait(lk, [&] {
        if (stopping_) return true;
        const auto it = windows_.find(w);
        return it != windows_.end() ? it->second->ready : w < next_load_;
      });
      if (stopping_)
        throw SourceError("reading stopped (the epoch was restarted or the loader closed)");
      const auto it = windows_.find(w);
      if (it != windows_.end()) window = it->second;
    }
  }
  if (!window) return read_direct(index, out);
  try {
    copy_from(*window, index, out);
  } catch (...) {
    finish_position(w);
    throw;
  }
  finish_position(w);
}

void ShardSource::begin_epoch(const OrderOptions& options,
                              std::shared_ptr<const std::vector<int64_t>> order, int64_t first,
                              int64_t end) {
  stop();
  std::lock_guard<std::mutex> lk(mu_);
  plan_ = std::move(order);
  window_ = std::max<int64_t>(1, options.shuffle_buffer);
  end_ = std::min<int64_t>(end, static_cast<int64_t>(plan_->size()));
  first_ = std::clamp<int64_t>(first, 0, end_);
  num_windows_ = (end_ + window_ - 1) / window_;
  remaining_.assign(num_windows_, 0);
  for (int64_t w = first_ / window_; w < num_windows_; ++w)
    remaining_[w] = std::min(end_, (w + 1) * window_) - std::max(first_, w * window_);
  windows_.clear();
  oldest_ = next_load_ = first_ / window_;
  stopping_ = false;
  if (first_ < end_) reader_ = std::thread([this] { reader_loop(); });
}

void ShardSource::stop() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  if (reader_.joinable()) reader_.join();
  std::lock_guard<std::mutex> lk(mu_);
  windows_.clear();
  plan_.reset();
}

}  // namespace dino_opt::loader
