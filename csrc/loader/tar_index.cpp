#include "loader/tar_index.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstring>
#include <system_error>
#include <unordered_map>

#include "loader/image_decode.h"

namespace dino_opt::loader {
namespace {

constexpr uint64_t kBlock = 512;
constexpr size_t kMaxName = 4096;            // longer member names are refused
constexpr uint64_t kMaxPaxHeader = 1 << 20;  // bytes of one pax extended header
constexpr uint64_t kMaxLabelBytes = 64;      // of a .cls member
constexpr char kIndexMagic[8] = {'d', 'i', 'n', 'o', 'i', 'd', 'x', '1'};
constexpr uint64_t kIndexHeader = 40;  // magic, shard size, mtime, count, name bytes
constexpr uint64_t kIndexEntry = 16;   // offset, size, label

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

std::string quoted(const std::string& s) { return "'" + s + "'"; }

uint64_t round_up(uint64_t n) { return (n + kBlock - 1) / kBlock * kBlock; }

// The text of a NUL- or length-terminated header field.
std::string field_text(const uint8_t* field, size_t n) {
  const auto* end = static_cast<const uint8_t*>(std::memchr(field, 0, n));
  return std::string(reinterpret_cast<const char*>(field), end ? end - field : n);
}

// A numeric header field: octal digits (leading spaces, then NUL or space
// terminated), or GNU base-256 (high bit of the first byte set).
std::optional<uint64_t> parse_number(const uint8_t* field, size_t n) {
  if (field[0] & 0x80) {
    if (field[0] == 0xff) return std::nullopt;  // negative
    uint64_t v = field[0] & 0x7f;
    for (size_t i = 1; i < n; ++i) {
      if (v >> 56) return std::nullopt;  // overflows 64 bits
      v = (v << 8) | field[i];
    }
    return v;
  }
  size_t i = 0;
  while (i < n && field[i] == ' ') ++i;
  uint64_t v = 0;
  bool any = false;
  for (; i < n && field[i] >= '0' && field[i] <= '7'; ++i) {
    if (v >> 61) return std::nullopt;
    v = v * 8 + (field[i] - '0');
    any = true;
  }
  for (; i < n; ++i) {
    if (field[i] != ' ' && field[i] != 0) return std::nullopt;
  }
  if (!any) return uint64_t{0};
  return v;
}

bool checksum_matches(const uint8_t* h) {
  const auto stored = parse_number(h + 148, 8);
  if (!stored) return false;
  uint64_t unsigned_sum = 0;
  int64_t signed_sum = 0;
  for (size_t i = 0; i < kBlock; ++i) {
    const uint8_t b = (i >= 148 && i < 156) ? ' ' : h[i];
    unsigned_sum += b;
    signed_sum += static_cast<int8_t>(b);
  }
  return *stored == unsigned_sum || static_cast<int64_t>(*stored) == signed_sum;
}

bool all_zero(const uint8_t* h) {
  return std::all_of(h, h + kBlock, [](uint8_t b) { return b == 0; });
}

// Applies the `path` and `size` records of a pax extended header.
void parse_pax(const std::string& data, std::optional<std::string>& path,
               std::optional<uint64_t>& size, const std::string& where) {
  size_t pos = 0;
  while (pos < data.size()) {
    if (data[pos] == 0) break;  // some writers pad with NULs
    size_t digits = pos;
    uint64_t length = 0;
    while (digits < data.size() && data[digits] >= '0' && data[digits] <= '9' && length < (1 << 30))
      length = length * 10 + (data[digits++] - '0');
    if (digits == pos || digits >= data.size() || data[digits] != ' ' ||
        length <= digits - pos + 1 || length > data.size() - pos ||
        data[pos + length - 1] != '\n') {
      throw SourceError("corrupt pax header " + where + ": bad record at byte " +
                        std::to_string(pos));
    }
    const std::string record = data.substr(digits + 1, pos + length - digits - 2);
    const size_t eq = record.find('=');
    if (eq == std::string::npos)
      throw SourceError("corrupt pax header " + where + ": a record without '='");
    const std::string key = record.substr(0, eq), value = record.substr(eq + 1);
    if (key == "path") {
      if (value.size() > kMaxName)
        throw SourceError("pax header " + where + ": a path longer than 4096 bytes");
      path = value;
    } else if (key == "size") {
      uint64_t v = 0;
      if (value.empty() || value.size() > 19 ||
          !std::all_of(value.begin(), value.end(), [](char c) { return c >= '0' && c <= '9'; }))
        throw SourceError("corrupt pax header " + where + ": size " + quoted(value));
      for (char c : value) v = v * 10 + (c - '0');
      size = v;
    }
    pos += length;
  }
}

bool is_image_extension(const std::string& ext) {
  static const char* const kImages[] = {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "npy"};
  return std::any_of(std::begin(kImages), std::end(kImages),
                     [&](const char* e) { return ext == e; });
}

// A little-endian-agnostic hash of the index bytes (the file is read back on
// the machine kind that wrote it; a mismatch only means a rebuild).
uint64_t checksum(const uint8_t* p, size_t n) {
  uint64_t h = 0x9e3779b97f4a7c15ull ^ n;
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    uint64_t w;
    std::memcpy(&w, p + i, 8);
    h = (h ^ w) * 0xff51afd7ed558ccdull;
    h ^= h >> 32;
  }
  uint64_t w = 0;
  std::memcpy(&w, p + i, n - i);
  h = (h ^ w ^ (n - i)) * 0xc4ceb9fe1a85ec53ull;
  return h ^ (h >> 29);
}

template <typename T>
void put(std::vector<uint8_t>& out, T value) {
  const auto* p = reinterpret_cast<const uint8_t*>(&value);
  out.insert(out.end(), p, p + sizeof(T));
}

template <typename T>
T get(const uint8_t* p) {
  T v;
  std::memcpy(&v, p, sizeof(T));
  return v;
}

std::optional<std::vector<uint8_t>> read_whole(const std::string& path) {
  try {
    return read_file(path);
  } catch (const ImageError&) {
    return std::nullopt;
  }
}

// The checked bytes of an index file, or nullopt.
std::optional<std::vector<uint8_t>> checked_index_bytes(const std::string& path) {
  auto bytes = read_whole(path);
  if (!bytes || bytes->size() < kIndexHeader + 8) return std::nullopt;
  const uint8_t* p = bytes->data();
  if (std::memcmp(p, kIndexMagic, 8) != 0) return std::nullopt;
  const auto count = get<uint64_t>(p + 24), name_bytes = get<uint64_t>(p + 32);
  if (count > bytes->size() / kIndexEntry || name_bytes > bytes->size() ||
      index_file_size(count, name_bytes) != bytes->size())
    return std::nullopt;
  const size_t body = bytes->size() - 8;
  if (checksum(p, body) != get<uint64_t>(p + body)) return std::nullopt;
  return bytes;
}

}  // namespace

// ------------------------------------------------------------------ bytes

void MemoryBytes::read_at(uint64_t offset, void* out, size_t n) const {
  if (offset > size_ || n > size_ - offset) {
    throw SourceError("read of " + std::to_string(n) + " bytes at byte " + std::to_string(offset) +
                      " past the end (" + std::to_string(size_) + " bytes)");
  }
  if (n > 0) std::memcpy(out, data_ + offset, n);
}

FileBytes::FileBytes(const std::string& path) : path_(path) {
  do {
    fd_ = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd_ < 0 && errno == EINTR);
  if (fd_ < 0) {
    const int err = errno;
    throw SourceError(path + ": cannot open: " + errno_text(err));
  }
  struct stat st {};
  if (::fstat(fd_, &st) != 0 || !S_ISREG(st.st_mode)) {
    ::close(fd_);
    throw SourceError(path + ": not a regular file");
  }
  size_ = static_cast<uint64_t>(st.st_size);
  mtime_ns_ = int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec;
}

FileBytes::~FileBytes() {
  if (fd_ >= 0) ::close(fd_);
}

void FileBytes::read_at(uint64_t offset, void* out, size_t n) const {
  auto* dst = static_cast<uint8_t*>(out);
  size_t got = 0;
  while (got < n) {
    const ssize_t r = ::pread(fd_, dst + got, n - got, static_cast<off_t>(offset + got));
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) throw SourceError("read failed: " + errno_text(errno));
    if (r == 0) {
      throw SourceError("the file ends at byte " + std::to_string(offset + got) + ", before the " +
                        std::to_string(n) + " bytes at byte " + std::to_string(offset) +
                        " (truncated or changed since indexed)");
    }
    got += static_cast<size_t>(r);
  }
}

// ------------------------------------------------------------------ tar

std::vector<TarMember> scan_tar(const ByteSource& tar) {
  std::vector<TarMember> members;
  const uint64_t end = tar.size();
  uint64_t offset = 0;
  std::optional<std::string> next_name;  // from a pax header or a GNU long name
  std::optional<uint64_t> next_size;
  uint8_t h[kBlock];
  auto where = [&](const std::string& name) {
    return (name.empty() ? std::string("a header") : "member " + quoted(name)) +
           " (header at byte " + std::to_string(offset) + ")";
  };
  while (offset < end) {
    if (end - offset < kBlock) {
      throw SourceError("truncated tar: a header at byte " + std::to_string(offset) +
                        " is cut off by the end of the file at byte " + std::to_string(end));
    }
    tar.read_at(offset, h, kBlock);
    if (all_zero(h)) return members;  // the end-of-archive marker
    std::string name = field_text(h, 100);
    if (!checksum_matches(h))
      throw SourceError("corrupt tar header: " + where(name) + ": bad checksum (not a tar file?)");
    const bool ustar = std::memcmp(h + 257, "ustar", 5) == 0;
    const bool posix_prefix = ustar && h[262] == 0;  // "ustar\0": POSIX; "ustar " is GNU
    if (posix_prefix && h[345] != 0) name = field_text(h + 345, 155) + "/" + name;
    const auto size_field = parse_number(h + 124, 12);
    if (!size_field) throw SourceError("corrupt tar header: " + where(name) + ": bad size field");
    const char type = static_cast<char>(h[156]);
    uint64_t size = *size_field;
    if (type == '0' || type == 0 || type == '7') {
      if (next_name) name = *next_name;
      if (next_size) size = *next_size;
    }
    const uint64_t data = offset + kBlock;
    if (size > end - data) {
      throw SourceError("truncated tar: " + where(name) + " has " + std::to_string(size) +
                        " bytes of data but the file ends at byte " + std::to_string(end));
    }
    if (type == 'x' || type == 'g' || type == 'L') {
      if (size > (type == 'L' ? kMaxName + 1 : kMaxPaxHeader))
        throw SourceError("corrupt tar header: " + where(name) + ": an extended header of " +
                          std::to_string(size) + " bytes");
      std::string text(size, '\0');
      tar.read_at(data, text.data(), size);
      if (type == 'x') {
        parse_pax(text, next_name, next_size, where(name));
      } else if (type == 'L') {
        next_name = text.substr(0, text.find('\0'));
      }
    } else {
      if (type == '0' || type == 0 || type == '7') {
        if (name.empty()) throw SourceError("corrupt tar header: " + where(name) + ": empty name");
        members.push_back({name, data, size});
      }
      if (type != 'K') {  // a GNU long link name belongs to the next header
        next_name.reset();
        next_size.reset();
      }
      // Links, directories and devices have no data; other types keep `size` bytes.
      if (type >= '1' && type <= '6') size = 0;
    }
    const uint64_t next = data + round_up(size);
    if (next > end) {
      throw SourceError("truncated tar: " + where(name) + ": the file ends at byte " +
                        std::to_string(end) + ", inside the last block of its data");
    }
    offset = next;
  }
  if (next_name || next_size)
    throw SourceError("truncated tar: an extended header at the end has no member");
  return members;
}

std::pair<std::string, std::string> split_member_name(const std::string& name) {
  const size_t slash = name.rfind('/');
  const size_t base = slash == std::string::npos ? 0 : slash + 1;
  const size_t dot = name.find('.', base);
  if (dot == std::string::npos) return {name, ""};
  std::string ext = name.substr(dot + 1);
  std::transform(ext.begin(), ext.end(), ext.begin(),
                 [](unsigned char c) { return static_cast<char>(std::tolower(c)); });
  return {name.substr(0, dot), ext};
}

ShardIndex shard_samples(const std::vector<TarMember>& members, const ByteSource& tar) {
  ShardIndex index;
  std::unordered_map<std::string, size_t> image_of;  // key -> sample
  std::unordered_map<std::string, int32_t> label_of;
  for (const TarMember& m : members) {
    auto [key, ext] = split_member_name(m.name);
    const std::string where =
        "member " + quoted(m.name) + " (data at byte " + std::to_string(m.offset) + ")";
    if (is_image_extension(ext)) {
      if (image_of.count(key)) continue;  // the key's first image is its sample
      if (m.size > UINT32_MAX)
        throw SourceError(where + ": " + std::to_string(m.size) + " bytes, too large for an image");
      image_of.emplace(key, index.entries.size());
      index.entries.push_back({m.offset, static_cast<uint32_t>(m.size), -1});
      index.names.push_back(m.name);
    } else if (ext == "cls") {
      if (m.size > kMaxLabelBytes)
        throw SourceError(where + ": a label of " + std::to_string(m.size) + " bytes");
      std::string text(m.size, '\0');
      tar.read_at(m.offset, text.data(), m.size);
      const size_t a = text.find_first_not_of(" \t\r\n"), b = text.find_last_not_of(" \t\r\n");
      const std::string digits = a == std::string::npos ? "" : text.substr(a, b - a + 1);
      int64_t v = 0;
      bool ok = !digits.empty() && digits.size() <= 10;
      for (char c : digits) {
        ok = ok && c >= '0' && c <= '9';
        if (ok) v = v * 10 + (c - '0');
      }
      if (!ok || v > INT32_MAX)
        throw SourceError(where + ": label " + quoted(digits) + " is not an integer in [0, 2^31)");
      label_of[key] = static_cast<int32_t>(v);
    }
  }
  for (const auto& [key, label] : label_of) {
    const auto it = image_of.find(key);
    if (it != image_of.end()) index.entries[it->second].label = label;
  }
  return index;
}

ShardIndex index_shard(const std::string& path) {
  const FileBytes file(path);
  try {
    ShardIndex index = shard_samples(scan_tar(file), file);
    index.shard_size = file.size();
    index.shard_mtime_ns = file.mtime_ns();
    return index;
  } catch (const SourceError& e) {
    const std::string what = e.what();
    throw SourceError(what.rfind(path, 0) == 0 ? what : path + ": " + what);
  }
}

// ------------------------------------------------------------------ index files

uint64_t index_file_size(uint64_t count, uint64_t name_bytes) {
  return kIndexHeader + count * kIndexEntry + name_bytes + 8;
}

void write_shard_index(const ShardIndex& index, const std::string& index_path) {
  std::vector<uint8_t> out;
  uint64_t name_bytes = 0;
  if (index.names.size() != index.entries.size())
    throw SourceError(index_path + ": cannot write an index without its member names");
  for (const std::string& name : index.names) name_bytes += 2 + name.size();
  out.reserve(index_file_size(index.entries.size(), name_bytes));
  out.insert(out.end(), kIndexMagic, kIndexMagic + 8);
  put<uint64_t>(out, index.shard_size);
  put<int64_t>(out, index.shard_mtime_ns);
  put<uint64_t>(out, index.entries.size());
  put<uint64_t>(out, name_bytes);
  for (const IndexEntry& e : index.entries) {
    put<uint64_t>(out, e.offset);
    put<uint32_t>(out, e.size);
    put<int32_t>(out, e.label);
  }
  for (const std::string& name : index.names) {
    put<uint16_t>(out, static_cast<uint16_t>(name.size()));  // names are at most 4096 bytes
    out.insert(out.end(), name.begin(), name.end());
  }
  put<uint64_t>(out, checksum(out.data(), out.size()));
  try {
    write_file_atomically(index_path, out.data(), out.size());
  } catch (const ImageError& e) {
    throw SourceError(e.what());
  }
}

std::optional<ShardIndex> read_shard_index(const std::string& index_path, bool with_names) {
  const auto bytes = checked_index_bytes(index_path);
  if (!bytes) return std::nullopt;
  const uint8_t* p = bytes->data();
  ShardIndex index;
  index.shard_size = get<uint64_t>(p + 8);
  index.shard_mtime_ns = get<int64_t>(p + 16);
  const auto count = get<uint64_t>(p + 24);
  index.entries.resize(count);
  const uint8_t* e = p + kIndexHeader;
  for (uint64_t i = 0; i < count; ++i, e += kIndexEntry) {
    IndexEntry& s = index.entries[i];
    s.offset = get<uint64_t>(e);
    s.size = get<uint32_t>(e + 8);
    s.label = get<int32_t>(e + 12);
    if (s.offset % kBlock != 0 || s.offset > index.shard_size ||
        s.size > index.shard_size - s.offset || s.label < -1)
      return std::nullopt;
  }
  if (with_names) {
    const uint8_t* n = e;
    const uint8_t* end = p + bytes->size() - 8;
    index.names.resize(count);
    for (std::string& name : index.names) {
      if (end - n < 2) return std::nullopt;
      const auto len = get<uint16_t>(n);
      if (static_cast<size_t>(end - n - 2) < len) return std::nullopt;
      name.assign(reinterpret_cast<const char*>(n + 2), len);
      n += 2 + len;
    }
  }
  return index;
}

std::optional<std::string> index_member_name(const std::string& index_path, uint64_t ordinal) {
  const auto bytes = checked_index_bytes(index_path);
  if (!bytes) return std::nullopt;
  const uint8_t* p = bytes->data();
  const auto count = get<uint64_t>(p + 24);
  if (ordinal >= count) return std::nullopt;
  const uint8_t* n = p + kIndexHeader + count * kIndexEntry;
  const uint8_t* end = p + bytes->size() - 8;
  for (uint64_t i = 0;; ++i) {
    if (end - n < 2) return std::nullopt;
    const auto len = get<uint16_t>(n);
    if (static_cast<size_t>(end - n - 2) < len) return std::nullopt;
    if (i == ordinal) return std::string(reinterpret_cast<const char*>(n + 2), len);
    n += 2 + len;
  }
}

}  // namespace dino_opt::loader
