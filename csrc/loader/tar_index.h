#pragma once
// Tar shards in the WebDataset layout: `{key}.jpg|png|webp|...` members, an
// optional `{key}.cls` (an integer label) per key. The parser reads only the
// 512-byte headers it needs (ustar with its name prefix, pax `path` and
// `size` records, GNU long names and base-256 sizes) and never trusts a field
// it has not bounded by the file's size; every failure is a SourceError
// naming the member and its byte offset. An index (each image member's offset,
// size and label, and its name) is built once per shard and kept in a small
// binary file beside it or in a cache folder, with the shard's size and mtime
// so that a changed shard is noticed. Free of torch headers (the fuzz target
// links it).
#include <cstddef>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

namespace dino_opt::loader {

// A data source that cannot be used: a corrupt or truncated shard, a missing
// file, a changed shard. The message names the file (and the member).
class SourceError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Random-access bytes: a file read with pread, or a buffer.
class ByteSource {
 public:
  virtual ~ByteSource() = default;
  virtual uint64_t size() const = 0;
  // Exactly `n` bytes at `offset`; throws SourceError when they are not all there.
  virtual void read_at(uint64_t offset, void* out, size_t n) const = 0;
};

class MemoryBytes : public ByteSource {
 public:
  MemoryBytes(const uint8_t* data, size_t size) : data_(data), size_(size) {}
  uint64_t size() const override { return size_; }
  void read_at(uint64_t offset, void* out, size_t n) const override;

 private:
  const uint8_t* data_;
  size_t size_;
};

// An open regular file (closed with the object), its size and mtime when
// opened. Throws SourceError naming `path` when it cannot be opened or is not
// a regular file; read errors leave the path to the caller.
class FileBytes : public ByteSource {
 public:
  explicit FileBytes(const std::string& path);
  ~FileBytes() override;
  FileBytes(const FileBytes&) = delete;
  FileBytes& operator=(const FileBytes&) = delete;
  uint64_t size() const override { return size_; }
  int64_t mtime_ns() const { return mtime_ns_; }
  void read_at(uint64_t offset, void* out, size_t n) const override;

 private:
  std::string path_;
  int fd_ = -1;
  uint64_t size_ = 0;
  int64_t mtime_ns_ = 0;
};

// A regular-file member of a tar: its name and where its data lies.
struct TarMember {
  std::string name;
  uint64_t offset = 0;  // of the data, a multiple of 512
  uint64_t size = 0;
};

// The regular-file members of a tar archive, in order. The archive ends at
// a zero block, or at a block boundary at the end of the bytes (a file cut
// inside a member's data or its last block is truncated). Throws
// SourceError ("truncated tar: ...", "corrupt tar header ...") naming the
// member and the byte offset of its header.
std::vector<TarMember> scan_tar(const ByteSource& tar);

// One image of a shard: the first image member of its key (`.jpg`, `.jpeg`,
// `.png`, `.webp`, `.bmp`, `.tif`, `.tiff`, `.npy`, any case) and the key's `.cls`
// label (-1 without one).
struct IndexEntry {
  uint64_t offset = 0;  // of the image member's data
  uint32_t size = 0;
  int32_t label = -1;
};

struct ShardIndex {
  uint64_t shard_size = 0;
  int64_t shard_mtime_ns = 0;
  std::vector<IndexEntry> entries;
  std::vector<std::string> names;  // the image members' names; empty when read without them
};

// The key of a member name (the name up to the first dot of its last path
// component) and its extension (after that dot, lower case), as WebDataset
// splits them.
std::pair<std::string, std::string> split_member_name(const std::string& name);

// The samples of a scanned shard (entries and names), in the order of their
// image members. Reads each `.cls` member from `tar`; a label that is not an
// integer in [0, 2^31) throws SourceError naming the member.
ShardIndex shard_samples(const std::vector<TarMember>& members, const ByteSource& tar);

// Scans shard `path` (SourceError messages begin with the path).
ShardIndex index_shard(const std::string& path);

// The index file: written atomically (temporary file, fsync, rename). Throws
// SourceError naming `index_path` when it cannot be written.
void write_shard_index(const ShardIndex& index, const std::string& index_path);
// An index file's content, or nullopt when it is missing, truncated, corrupt
// (bad magic, sizes or checksum) or its entries lie outside the shard size it
// records. `with_names` false leaves `names` empty.
std::optional<ShardIndex> read_shard_index(const std::string& index_path, bool with_names);
// The name of sample `ordinal` in an index file (nullopt when unreadable).
std::optional<std::string> index_member_name(const std::string& index_path, uint64_t ordinal);

// Bytes of an index file for `count` samples whose names take `name_bytes`.
uint64_t index_file_size(uint64_t count, uint64_t name_bytes);

}  // namespace dino_opt::loader
