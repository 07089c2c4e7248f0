// The .npy header parser and writer (npy_format.h). The header is a Python
// dict literal; only what np.save writes is accepted, token by token, so
// that nothing in a file is ever evaluated.
#include "loader/npy_format.h"

#include <climits>
#include <cstring>
#include <sstream>
#include <string>

#include "loader/image_decode.h"

namespace dino_opt::loader {
namespace {

constexpr uint8_t kMagic[6] = {0x93, 'N', 'U', 'M', 'P', 'Y'};
constexpr int kMaxChannels = 1024;

[[noreturn]] void corrupt(const std::string& why) {
  throw ImageError("corrupt .npy header: " + why);
}

// A cursor over the header's characters.
class HeaderParser {
 public:
  HeaderParser(const char* text, size_t size) : s_(text), n_(size) {}

  void skip_space() {
    while (pos_ < n_ &&
           (s_[pos_] == ' ' || s_[pos_] == '\t' || s_[pos_] == '\n' || s_[pos_] == '\r')) {
      ++pos_;
    }
  }
  bool at_end() const { return pos_ >= n_; }
  char peek() const { return pos_ < n_ ? s_[pos_] : '\0'; }
  void expect(char c) {
    if (peek() != c) {
      corrupt(std::string("expected '") + c + "' at character " + std::to_string(pos_) +
              (at_end() ? " (the header ends)" : std::string(", found '") + peek() + "'"));
    }
    ++pos_;
  }
  bool accept(char c) {
    if (peek() != c) return false;
    ++pos_;
    return true;
  }
  std::string string_literal() {
    const char quote = peek();
    if (quote != '\'' && quote != '"')
      corrupt("expected a string at character " + std::to_string(pos_));
    ++pos_;
    std::string out;
    while (pos_ < n_ && s_[pos_] != quote) {
      if (s_[pos_] == '\\') corrupt("escape sequences in a header string are not read");
      out += s_[pos_++];
    }
    if (pos_ >= n_) corrupt("a string runs past the end of the header");
    ++pos_;
    return out;
  }
  bool boolean() {
    for (const char* word : {"True", "False"}) {
      const size_t len = std::strlen(word);
      if (n_ - pos_ >= len && std::memcmp(s_ + pos_, word, len) == 0) {
        pos_ += len;
        return word[0] == 'T';
      }
    }
    corrupt("expected True or False at character " + std::to_string(pos_));
  }
  std::vector<int64_t> int_tuple() {
    expect('(');
    std::vector<int64_t> out;
    for (;;) {
      skip_space();
      if (accept(')')) return out;
      int64_t v = 0;
      int digits = 0;
      while (peek() >= '0' && peek() <= '9') {
        if (++digits > 10) corrupt("a shape entry above 2^31 - 1");
        v = v * 10 + (s_[pos_++] - '0');
      }
      if (digits == 0)
        corrupt("expected an integer in the shape at character " + std::to_string(pos_));
      if (v > INT32_MAX) corrupt("a shape entry above 2^31 - 1");
      out.push_back(v);
      skip_space();
      if (accept(')')) return out;
      expect(',');
    }
  }

 private:
  const char* s_;
  size_t n_;
  size_t pos_ = 0;
};

struct ParsedDict {
  std::string descr;
  bool fortran_order = false;
  std::vector<int64_t> shape;
};

ParsedDict parse_dict(const char* text, size_t size) {
  HeaderParser p(text, size);
  ParsedDict d;
  bool seen[3] = {false, false, false};
  p.skip_space();
  p.expect('{');
  for (;;) {
    p.skip_space();
    if (p.accept('}')) break;
    const std::string key = p.string_literal();
    p.skip_space();
    p.expect(':');
    p.skip_space();
    int which = -1;
    if (key == "descr") {
      which = 0;
      d.descr = p.string_literal();
    } else if (key == "fortran_order") {
      which = 1;
      d.fortran_order = p.boolean();
    } else if (key == "shape") {
      which = 2;
      d.shape = p.int_tuple();
    } else {
      corrupt("unknown key '" + key + "' (np.save writes descr, fortran_order, shape)");
    }
    if (seen[which]) corrupt("key '" + key + "' given twice");
    seen[which] = true;
    p.skip_space();
    if (p.accept(',')) continue;
    p.expect('}');
    break;
  }
  p.skip_space();
  if (!p.at_end()) corrupt("text after the header's dict");
  const char* names[3] = {"descr", "fortran_order", "shape"};
  for (int i = 0; i < 3; ++i) {
    if (!seen[i]) corrupt(std::string("no '") + names[i] + "' key");
  }
  return d;
}

SampleType parse_descr(const std::string& descr) {
  if (descr == "|u1" || descr == "u1" || descr == "<u1" || descr == ">u1" || descr == "=u1") {
    return SampleType::kU8;
  }
  if (descr == "<u2") return SampleType::kU16;
  if (descr == "<f4") return SampleType::kF32;
  if (descr == ">u2" || descr == ">f4") {
    throw ImageError(".npy array of big-endian dtype '" + descr +
                     "': save it little-endian (a.astype(a.dtype.newbyteorder('<')))");
  }
  throw ImageError(".npy array of dtype '" + descr +
                   "': only uint8 ('|u1'), uint16 ('<u2') and float32 ('<f4') arrays are read");
}

}  // namespace

bool is_npy(const uint8_t* data, size_t size) {
  return size >= sizeof(kMagic) && std::memcmp(data, kMagic, sizeof(kMagic)) == 0;
}

NpyHeader parse_npy_header(const uint8_t* data, size_t size) {
  if (!is_npy(data, size)) corrupt("no \\x93NUMPY magic string");
  if (size < 10) corrupt("cut short before the header length");
  const int major = data[6];
  size_t header_at = 0, header_len = 0;
  if (major == 1) {
    header_at = 10;
    header_len = size_t{data[8]} | (size_t{data[9]} << 8);
  } else if (major == 2 || major == 3) {
    if (size < 12) corrupt("cut short before the header length");
    header_at = 12;
    header_len = size_t{data[8]} | (size_t{data[9]} << 8) | (size_t{data[10]} << 16) |
                 (size_t{data[11]} << 24);
  } else {
    corrupt("format version " + std::to_string(major) + "." + std::to_string(data[7]) +
            " (1.0, 2.0 and 3.0 are read)");
  }
  if (header_len > size - header_at) {
    corrupt("the header claims " + std::to_string(header_len) + " bytes, the file has " +
            std::to_string(size - header_at) + " after the length");
  }
  const ParsedDict d = parse_dict(reinterpret_cast<const char*>(data + header_at), header_len);
  NpyHeader h;
  h.layout.type = parse_descr(d.descr);
  if (d.fortran_order) {
    throw ImageError(".npy array in Fortran order: save it in C order (np.ascontiguousarray(a))");
  }
  if (d.shape.size() != 2 && d.shape.size() != 3) {
    throw ImageError(".npy array of " + std::to_string(d.shape.size()) +
                     " dimensions: images are (H, W) or (H, W, C)");
  }
  for (int64_t side : d.shape) {
    if (side < 1) throw ImageError(".npy array with a zero side");
  }
  h.height = static_cast<int>(d.shape[0]);
  h.width = static_cast<int>(d.shape[1]);
  h.layout.channels = d.shape.size() == 3 ? static_cast<int>(d.shape[2]) : 1;
  if (h.layout.channels > kMaxChannels) {
    throw ImageError(".npy array of " + std::to_string(h.layout.channels) + " channels (at most " +
                     std::to_string(kMaxChannels) + "; images are (H, W, C), channels last)");
  }
  h.data_offset = header_at + header_len;
  // Each side < 2^31 and channels <= 1024: the product fits in 64 bits.
  const uint64_t need = static_cast<uint64_t>(h.height) * static_cast<uint64_t>(h.width) *
                        static_cast<uint64_t>(h.layout.channels) *
                        static_cast<uint64_t>(sample_bytes(h.layout.type));
  if (need > size - h.data_offset) {
    throw ImageError("truncated .npy: the array needs " + std::to_string(need) +
                     " bytes of data, the file has " + std::to_string(size - h.data_offset));
  }
  return h;
}

std::vector<uint8_t> encode_npy(const RawView& view, bool squeeze) {
  const char* descr = view.layout.type == SampleType::kU8    ? "|u1"
                      : view.layout.type == SampleType::kU16 ? "<u2"
                                                             : "<f4";
  std::ostringstream text;
  text << "{'descr': '" << descr << "', 'fortran_order': False, 'shape': (" << view.height << ", "
       << view.width;
  if (!(squeeze && view.layout.channels == 1)) text << ", " << view.layout.channels;
  text << "), }";
  std::string header = text.str();
  // Padded with spaces and a newline so that the data starts at a multiple of 64.
  const size_t total = (10 + header.size() + 1 + 63) / 64 * 64;
  header.resize(total - 10 - 1, ' ');
  header.push_back('\n');
  const size_t row =
      static_cast<size_t>(view.width) * view.layout.channels * sample_bytes(view.layout.type);
  std::vector<uint8_t> out(total + row * static_cast<size_t>(view.height));
  std::memcpy(out.data(), kMagic, sizeof(kMagic));
  out[6] = 1;
  out[7] = 0;
  out[8] = static_cast<uint8_t>(header.size() & 0xFF);
  out[9] = static_cast<uint8_t>(header.size() >> 8);
  std::memcpy(out.data() + 10, header.data(), header.size());
  for (int y = 0; y < view.height; ++y) std::memcpy(out.data() + total + y * row, view.row(y), row);
  return out;
}

}  // namespace dino_opt::loader
