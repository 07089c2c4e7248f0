#include "loader/sample_source.h"

#include <sched.h>

#include <algorithm>
#include <cctype>
#include <map>
#include <numeric>
#include <thread>
#include <unordered_map>

#include "loader/crop_sampling.h"
#include "loader/image_decode.h"

namespace dino_opt::loader {
namespace {

constexpr uint64_t kShuffleKey = 0x53485546464c45ull;  // the epoch's permutation of all samples

std::string lower(std::string_view s) {
  std::string out(s);
  std::transform(out.begin(), out.end(), out.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return out;
}

bool ends_with(std::string_view s, std::string_view suffix) {
  return s.size() >= suffix.size() && lower(s.substr(s.size() - suffix.size())) == suffix;
}

std::string_view trim(std::string_view s) {
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.front()))) s.remove_prefix(1);
  while (!s.empty() && std::isspace(static_cast<unsigned char>(s.back()))) s.remove_suffix(1);
  return s;
}

// A non-negative decimal integer below 2^31.
std::optional<int32_t> parse_label(std::string_view s) {
  if (s.empty() || s.size() > 10) return std::nullopt;
  int64_t v = 0;
  for (char c : s) {
    if (c < '0' || c > '9') return std::nullopt;
    v = v * 10 + (c - '0');
  }
  if (v > INT32_MAX) return std::nullopt;
  return static_cast<int32_t>(v);
}

// One record of a CSV text from `pos` (RFC 4180: fields in double quotes may
// hold commas, newlines and "" for a quote). Advances `pos` and `line`.
std::vector<std::string> csv_record(std::string_view text, size_t& pos, int64_t& line,
                                    const std::string& where) {
  std::vector<std::string> fields(1);
  const int64_t first_line = line;
  bool quoted = false;
  while (pos < text.size()) {
    const char c = text[pos++];
    if (quoted) {
      if (c == '"') {
        if (pos < text.size() && text[pos] == '"') {
          fields.back() += '"';
          ++pos;
        } else {
          quoted = false;
        }
      } else {
        if (c == '\n') ++line;
        fields.back() += c;
      }
    } else if (c == '"') {
      quoted = true;
    } else if (c == ',') {
      fields.emplace_back();
    } else if (c == '\n') {
      ++line;
      break;
    } else if (c != '\r') {
      fields.back() += c;
    }
  }
  if (quoted) {
    throw SourceError(where + " line " + std::to_string(first_line) +
                      ": a quoted field is not closed");
  }
  return fields;
}

int find_column(const std::vector<std::string>& header, std::initializer_list<const char*> names) {
  for (size_t i = 0; i < header.size(); ++i) {
    const std::string h = lower(trim(header[i]));
    for (const char* name : names)
      if (h == name) return static_cast<int>(i);
  }
  return -1;
}

// The rows of a list: (path, label text), with their line numbers.
struct ListRows {
  FileSource* source;
  std::unordered_map<std::string, int32_t> label_ids;  // label text -> first-seen id
  std::vector<std::string> label_texts;
  std::vector<int32_t> row_label;  // first-seen id, or -1
  void add(std::string_view path, std::string_view label, int64_t line, const std::string& where) {
    path = trim(path);
    label = trim(label);
    if (path.empty()) throw SourceError(where + " line " + std::to_string(line) + ": empty path");
    source->add(path, 0);
    if (label.empty()) {
      row_label.push_back(-1);
      return;
    }
    auto [it, fresh] =
        label_ids.emplace(std::string(label), static_cast<int32_t>(label_ids.size()));
    if (fresh) label_texts.emplace_back(label);
    row_label.push_back(it->second);
  }
};

}  // namespace

// ------------------------------------------------------------------ SampleSource

int available_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

std::vector<int64_t> SampleSource::epoch_order(const OrderOptions& o, int64_t epoch) const {
  const int64_t n = size(), w = o.world_size;
  std::vector<int64_t> order(n);
  std::iota(order.begin(), order.end(), int64_t{0});
  if (o.shuffle) {
    Rng rng(o.seed, kShuffleKey, static_cast<uint64_t>(epoch));
    for (int64_t i = n - 1; i > 0; --i) std::swap(order[i], order[rng.randint(0, i + 1)]);
  }
  // DistributedSampler: the ranks take every world_size-th index of the
  // permutation, padded by wrapping around (or cut) to equal length; with
  // exact shards per_rank differs by rank and no index wraps.
  std::vector<int64_t> mine(o.per_rank);
  for (int64_t k = 0; k < o.per_rank; ++k) mine[k] = order[(k * w + o.rank) % n];
  return mine;
}

void SampleSource::begin_epoch(const OrderOptions&, std::shared_ptr<const std::vector<int64_t>>,
                               int64_t, int64_t) {}

ReadStats SampleSource::read_stats() const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  return stats_;
}

bool SampleSource::claim(const void* owner) {
  const void* expected = nullptr;
  return owner_.compare_exchange_strong(expected, owner) || expected == owner;
}

void SampleSource::release(const void* owner) {
  const void* expected = owner;
  owner_.compare_exchange_strong(expected, nullptr);
}

void SampleSource::count_read(int64_t reads, int64_t bytes, int64_t sequential,
                              int64_t opens) const {
  std::lock_guard<std::mutex> lk(stats_mu_);
  stats_.reads += reads;
  stats_.bytes += bytes;
  stats_.sequential += sequential;
  stats_.opens += opens;
}

// ------------------------------------------------------------------ FileSource

FileSource::FileSource(std::string root) : root_(std::move(root)) {
  if (!root_.empty() && root_.back() != '/') root_ += '/';
}

void FileSource::reserve(size_t count, size_t path_bytes) {
  ends_.reserve(count);
  labels_.reserve(count);
  arena_.reserve(path_bytes);
}

void FileSource::add(std::string_view path, int32_t label) {
  arena_.append(path);
  ends_.push_back(arena_.size());
  labels_.push_back(label);
}

void FileSource::set_label(int64_t index, int32_t label) { labels_[index] = label; }

std::string FileSource::path(int64_t index) const {
  const uint64_t begin = index == 0 ? 0 : ends_[index - 1];
  const std::string_view rel(arena_.data() + begin, ends_[index] - begin);
  if (rel.empty() || rel.front() == '/' || root_.empty()) return std::string(rel);
  return root_ + std::string(rel);
}

void FileSource::read(int64_t index, int64_t, std::vector<uint8_t>& out) const {
  out = read_file(path(index));
  count_read(1, static_cast<int64_t>(out.size()), 0, 1);
}

int64_t FileSource::table_bytes() const {
  return static_cast<int64_t>(arena_.capacity() + ends_.capacity() * sizeof(uint64_t) +
                              labels_.capacity() * sizeof(int32_t) + root_.capacity());
}

FileList read_file_list(const std::string& list_path, const std::string& root) {
  std::vector<uint8_t> bytes;
  try {
    bytes = read_file(list_path);
  } catch (const ImageError& e) {
    throw SourceError(list_path + ": " + e.what());
  }
  const std::string_view text(reinterpret_cast<const char*>(bytes.data()), bytes.size());
  FileList list{std::make_shared<FileSource>(root), {}};
  ListRows rows{list.source.get(), {}, {}, {}};
  const size_t lines = static_cast<size_t>(std::count(text.begin(), text.end(), '\n')) + 1;
  list.source->reserve(lines, text.size());
  rows.row_label.reserve(lines);
  size_t pos = 0;
  int64_t line = 1;
  if (ends_with(list_path, ".csv")) {
    int path_col = 0, label_col = 1;
    const int64_t header_line = line;
    std::vector<std::string> first = csv_record(text, pos, line, list_path);
    const int named = find_column(first, {"path", "file", "filename", "image", "image_path"});
    if (named >= 0) {  // a header row
      path_col = named;
      label_col = find_column(first, {"label", "class", "target", "category"});
      if (label_col < 0 && first.size() > 1) label_col = path_col == 0 ? 1 : 0;
    } else {
      rows.add(first[0], first.size() > 1 ? first[1] : "", header_line, list_path);
    }
    while (pos < text.size()) {
      const int64_t at = line;
      const std::vector<std::string> f = csv_record(text, pos, line, list_path);
      if (f.size() == 1 && trim(f[0]).empty()) continue;  // a blank line
      if (static_cast<int>(f.size()) <= path_col) {
        throw SourceError(list_path + " line " + std::to_string(at) + ": " +
                          std::to_string(f.size()) + " columns, the path is column " +
                          std::to_string(path_col + 1));
      }
      const bool has_label = label_col >= 0 && label_col < static_cast<int>(f.size());
      rows.add(f[path_col], has_label ? std::string_view(f[label_col]) : "", at, list_path);
    }
  } else {
    while (pos < text.size()) {
      size_t end = text.find('\n', pos);
      if (end == std::string_view::npos) end = text.size();
      const std::string_view row = trim(text.substr(pos, end - pos));
      pos = end + 1;
      const int64_t at = line++;
      if (row.empty() || row.front() == '#') continue;
      size_t split = row.rfind('\t');
      if (split == std::string_view::npos) split = row.find_last_of(' ');
      if (split == std::string_view::npos) {
        rows.add(row, "", at, list_path);
      } else {
        rows.add(row.substr(0, split), row.substr(split + 1), at, list_path);
      }
    }
  }
  if (list.source->size() == 0) throw SourceError(list_path + ": the list names no image");
  // Integer labels as they are; otherwise class names, numbered in sorted order.
  std::vector<int32_t> value(rows.label_texts.size());
  bool integers = true;
  for (size_t i = 0; i < rows.label_texts.size() && integers; ++i) {
    const auto v = parse_label(rows.label_texts[i]);
    integers = v.has_value();
    if (integers) value[i] = *v;
  }
  if (!integers) {
    std::vector<size_t> by_name(rows.label_texts.size());
    std::iota(by_name.begin(), by_name.end(), size_t{0});
    std::sort(by_name.begin(), by_name.end(),
              [&](size_t a, size_t b) { return rows.label_texts[a] < rows.label_texts[b]; });
    for (size_t rank = 0; rank < by_name.size(); ++rank) {
      value[by_name[rank]] = static_cast<int32_t>(rank);
      list.classes.push_back(rows.label_texts[by_name[rank]]);
    }
  }
  for (int64_t i = 0; i < list.source->size(); ++i) {
    const int32_t id = rows.row_label[i];
    list.source->set_label(i, id < 0 ? -1 : value[id]);
  }
  return list;
}

// ------------------------------------------------------------------ ArrowSource

ArrowSource::ArrowSource(std::vector<std::string> files, std::vector<ArrowChunk> chunks,
                         std::vector<int32_t> labels, std::shared_ptr<void> keepalive)
    : files_(std::move(files)),
      chunks_(std::move(chunks)),
      labels_(std::move(labels)),
      keepalive_(std::move(keepalive)) {
  int64_t rows = 0;
  for (const ArrowChunk& c : chunks_) {
    if (c.length < 0 || c.bytes.offsets == nullptr || c.bytes.data == nullptr || c.file < 0 ||
        static_cast<size_t>(c.file) >= files_.size())
      throw SourceError("an Arrow chunk without buffers or file name");
    starts_.push_back(rows);
    rows += c.length;
  }
  if (rows != static_cast<int64_t>(labels_.size())) {
    throw SourceError("the image column has " + std::to_string(rows) + " rows but " +
                      std::to_string(labels_.size()) + " labels were given");
  }
}

size_t ArrowSource::chunk_of(int64_t index) const {
  return static_cast<size_t>(std::upper_bound(starts_.begin(), starts_.end(), index) -
                             starts_.begin() - 1);
}

std::string ArrowSource::describe(int64_t index) const {
  const ArrowChunk& c = chunks_[chunk_of(index)];
  return files_[c.file] + ": row " + std::to_string(c.file_row + index - starts_[chunk_of(index)]);
}

namespace {

bool arrow_valid(const ArrowBinary& b, int64_t i) {
  if (b.validity == nullptr) return true;
  const int64_t j = b.offset + i;
  return (b.validity[j >> 3] >> (j & 7)) & 1;
}

std::pair<int64_t, int64_t> arrow_span(const ArrowBinary& b, int64_t i) {
  const int64_t j = b.offset + i;
  if (b.large) {
    const auto* o = static_cast<const int64_t*>(b.offsets);
    return {o[j], o[j + 1]};
  }
  const auto* o = static_cast<const int32_t*>(b.offsets);
  return {o[j], o[j + 1]};
}

}  // namespace

void ArrowSource::read(int64_t index, int64_t, std::vector<uint8_t>& out) const {
  const size_t k = chunk_of(index);
  const ArrowChunk& c = chunks_[k];
  const int64_t i = index - starts_[k];
  if (arrow_valid(c.bytes, i)) {
    const auto [begin, end] = arrow_span(c.bytes, i);
    if (begin < 0 || end < begin) throw SourceError("corrupt Arrow offsets");
    out.assign(c.bytes.data + begin, c.bytes.data + end);
    count_read(0, end - begin, 0, 0);
    return;
  }
  if (c.paths.data != nullptr && arrow_valid(c.paths, i)) {
    const auto [begin, end] = arrow_span(c.paths, i);
    if (begin < 0 || end < begin) throw SourceError("corrupt Arrow offsets");
    const std::string path(reinterpret_cast<const char*>(c.paths.data) + begin, end - begin);
    try {
      out = read_file(path);
    } catch (const ImageError& e) {
      throw ImageError(path + ": " + e.what());
    }
    count_read(1, static_cast<int64_t>(out.size()), 0, 1);
    return;
  }
  throw SourceError("the image is null (neither bytes nor a path)");
}

int64_t ArrowSource::table_bytes() const {
  return static_cast<int64_t>(chunks_.capacity() * sizeof(ArrowChunk) +
                              starts_.capacity() * sizeof(int64_t) +
                              labels_.capacity() * sizeof(int32_t));
}

}  // namespace dino_opt::loader
