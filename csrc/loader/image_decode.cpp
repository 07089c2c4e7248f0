// Image reading and decoding: POSIX file reads, format sniffing and header
// parsing done here (so that size limits apply before any pixel buffer
// exists), JPEG through TurboJPEG, the other formats through OpenCV imgcodecs.
#include "loader/image_decode.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <turbojpeg.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstring>
#include <memory>
#include <new>
#include <system_error>

#include "loader/npy_format.h"

#ifndef DINO_OPT_WITH_IMGCODECS
#define DINO_OPT_WITH_IMGCODECS 0
#endif
#if DINO_OPT_WITH_IMGCODECS
#include <mutex>
#include <opencv2/core.hpp>
#include <opencv2/core/utils/logger.hpp>
#include <opencv2/imgcodecs.hpp>
#endif

namespace dino_opt::loader {

namespace {

std::string errno_text(int err) { return std::error_code(err, std::generic_category()).message(); }

// ------------------------------------------------------------------ file reading

class FileDescriptor {
 public:
  explicit FileDescriptor(int fd) : fd_(fd) {}
  ~FileDescriptor() { ::close(fd_); }
  FileDescriptor(const FileDescriptor&) = delete;
  FileDescriptor& operator=(const FileDescriptor&) = delete;

 private:
  int fd_;
};

// ------------------------------------------------------------------ byte readers

uint32_t be16(const uint8_t* p) { return (uint32_t{p[0]} << 8) | p[1]; }
uint32_t be32(const uint8_t* p) {
  return (uint32_t{p[0]} << 24) | (uint32_t{p[1]} << 16) | (uint32_t{p[2]} << 8) | p[3];
}
uint32_t le16(const uint8_t* p) { return uint32_t{p[0]} | (uint32_t{p[1]} << 8); }
uint32_t le24(const uint8_t* p) { return le16(p) | (uint32_t{p[2]} << 16); }
uint32_t le32(const uint8_t* p) { return le24(p) | (uint32_t{p[3]} << 24); }
uint64_t le64(const uint8_t* p) { return le32(p) | (uint64_t{le32(p + 4)} << 32); }

// ------------------------------------------------------------------ sniffing

ImageFormat sniff(const uint8_t* d, size_t n) {
  static const uint8_t kPng[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1A, '\n'};
  if (n >= 3 && d[0] == 0xFF && d[1] == 0xD8 && d[2] == 0xFF) return ImageFormat::kJpeg;
  if (n >= 8 && std::memcmp(d, kPng, 8) == 0) return ImageFormat::kPng;
  if (n >= 12 && std::memcmp(d, "RIFF", 4) == 0 && std::memcmp(d + 8, "WEBP", 4) == 0) {
    return ImageFormat::kWebp;
  }
  if (n >= 2 && d[0] == 'B' && d[1] == 'M') return ImageFormat::kBmp;
  if (is_npy(d, n)) return ImageFormat::kNpy;
  // Classic TIFF (42) and BigTIFF (43), either byte order.
  if (n >= 4 && ((d[0] == 'I' && d[1] == 'I' && (d[2] == 42 || d[2] == 43) && d[3] == 0) ||
                 (d[0] == 'M' && d[1] == 'M' && d[2] == 0 && (d[3] == 42 || d[3] == 43)))) {
    return ImageFormat::kTiff;
  }
  return ImageFormat::kUnknown;
}

std::string first_bytes_hex(const uint8_t* d, size_t n) {
  static const char kHex[] = "0123456789abcdef";
  std::string s;
  for (size_t i = 0; i < n && i < 8; ++i) {
    if (i) s += ' ';
    s += kHex[d[i] >> 4];
    s += kHex[d[i] & 15];
  }
  return s;
}

[[noreturn]] void corrupt_header(ImageFormat f, const std::string& why) {
  throw ImageError(std::string("corrupt ") + format_name(f) + " header: " + why);
}

// ------------------------------------------------------------------ TurboJPEG

// One decompressor and one compressor per thread: a tjhandle is not safe to
// share, and creating one per image costs more than the header parse. After
// any failure the handle is replaced: TurboJPEG 2.x returns from a failed
// tjDecompressHeader3 without aborting the decompressor, which then misreads
// the next, valid, file ("Bogus marker length").
class TjHandle {
 public:
  explicit TjHandle(bool compress) : compress_(compress) {}
  ~TjHandle() { reset(); }
  TjHandle(const TjHandle&) = delete;
  TjHandle& operator=(const TjHandle&) = delete;

  tjhandle get() {
    if (handle_ == nullptr) {
      handle_ = compress_ ? tjInitCompress() : tjInitDecompress();
      if (handle_ == nullptr) {
        throw ImageError(std::string("cannot create a TurboJPEG instance: ") +
                         tjGetErrorStr2(nullptr));
      }
    }
    return handle_;
  }
  // The error text of the last call, then a fresh handle for the next one.
  std::string take_error() {
    std::string text = tjGetErrorStr2(handle_);
    reset();
    return text;
  }
  void reset() {
    if (handle_ != nullptr) tjDestroy(handle_);
    handle_ = nullptr;
  }

 private:
  bool compress_;
  tjhandle handle_ = nullptr;
};

TjHandle& decompressor() {
  thread_local TjHandle handle(false);
  return handle;
}

TjHandle& compressor() {
  thread_local TjHandle handle(true);
  return handle;
}

struct JpegInfo {
  int width = 0;
  int height = 0;
  int colorspace = -1;  // TJCS_*
};

JpegInfo read_jpeg_header(const uint8_t* data, size_t size) {
  TjHandle& tj = decompressor();
  JpegInfo info;
  int subsamp = -1;
  // TurboJPEG 2.x returns -1 after a mere warning and also when it cannot
  // name the chroma subsampling (irrelevant to a decode into packed RGB); it
  // fills the outputs only once the header was parsed. A tables-only stream
  // can return 0 and leave them untouched. So the outputs decide, not the code.
  const int rc = tjDecompressHeader3(tj.get(), data, static_cast<unsigned long>(size), &info.width,
                                     &info.height, &subsamp, &info.colorspace);
  const bool complete = info.width >= 1 && info.height >= 1;
  const std::string why = rc == 0 && complete ? "" : tj.take_error();
  if (!complete) {
    throw ImageError("truncated or corrupt JPEG header: " +
                     (rc == 0 ? std::string("no image in the data") : why));
  }
  if (info.colorspace < TJCS_RGB || info.colorspace > TJCS_YCCK) {
    throw ImageError("unsupported JPEG colour space" + (why.empty() ? "" : ": " + why));
  }
  return info;
}

// True when the JPEG's marker structure reaches an EOI marker, that is, the
// file was not cut short. Marker segments are skipped by their length (an
// EXIF thumbnail's EOI inside APP1 does not count); entropy-coded data is
// scanned for the next marker, skipping stuffed bytes and restart markers,
// which is how libjpeg itself resynchronises. Each step advances `pos`.
bool jpeg_has_end_marker(const uint8_t* d, size_t n) {
  size_t pos = 2;  // after SOI
  while (pos + 1 < n) {
    const void* ff = std::memchr(d + pos, 0xFF, n - pos - 1);
    if (ff == nullptr) return false;
    pos = static_cast<size_t>(static_cast<const uint8_t*>(ff) - d);
    const uint8_t m = d[pos + 1];
    if (m == 0xD9) return true;
    if (m == 0xFF) {  // fill byte before a marker
      pos += 1;
    } else if (m == 0x00 || m == 0x01 || m == 0xD8 || (m >= 0xD0 && m <= 0xD7)) {
      pos += 2;  // stuffed 0xFF, TEM, stray SOI, RSTn: no length field
    } else {
      if (pos + 3 >= n) return false;
      const size_t length = be16(d + pos + 2);
      if (length < 2) return false;
      pos += 2 + length;
    }
  }
  return false;
}

const tjscalingfactor& scaling_factor(int denom) {
  if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
    throw ImageError("JPEG scale denominator must be 1, 2, 4 or 8, got " + std::to_string(denom));
  }
  int count = 0;
  const tjscalingfactor* factors = tjGetScalingFactors(&count);
  for (int i = 0; factors != nullptr && i < count; ++i) {
    if (factors[i].num == 1 && factors[i].denom == denom) return factors[i];
  }
  throw ImageError("this TurboJPEG cannot decode at scale 1/" + std::to_string(denom));
}

// The first warning of libjpeg's JWRN_JPEG_EOF: the decoder asked for bytes
// past the end of the buffer (libjpeg's message table is stable since 6b).
constexpr const char* kPrematureEnd = "Premature end of JPEG file";

// Decodes into `dst` (pitch bytes per row) at the given scaled size.
//
// Warning policy. libjpeg reports damaged data as warnings and keeps going,
// filling what it cannot decode. Like PIL (whose default refuses truncated
// files, "image file is truncated"), a file that ends before the image does
// is an error: its lower part would be grey filler. Other warnings ("Corrupt
// JPEG data: N extraneous bytes before marker", bad Huffman codes, an unknown
// JFIF revision) are not: PIL decodes such files without complaint, and real
// data sets (ImageNet among them) hold a few; refusing them would stop a
// training run on files that the reference pipeline reads.
//
// TurboJPEG 2.x makes this take two passes: tjGetErrorCode says "warning"
// whenever any warning happened, even if a fatal error followed, and only the
// first warning's text is kept. Pass 1 stops at the first warning (clean
// files, nearly all of them, finish here). If that warning is not the
// premature end, and the file does reach its EOI marker, pass 2 decodes
// through the warnings; it succeeded if its error text is still that first
// warning (a fatal error would have replaced it).
void tj_decode(const uint8_t* data, size_t size, uint8_t* dst, int width, int pitch, int height,
               int pixel_format) {
  TjHandle& tj = decompressor();
  const auto jpeg_size = static_cast<unsigned long>(size);
  const int flags = TJFLAG_LIMITSCANS;  // refuse progressive files with > 500 scans (CPU DoS)
  if (tjDecompress2(tj.get(), data, jpeg_size, dst, width, pitch, height, pixel_format,
                    flags | TJFLAG_STOPONWARNING) == 0) {
    return;
  }
  const bool warning = tjGetErrorCode(tj.get()) == TJERR_WARNING;
  const std::string first = tj.take_error();
  if (!warning) throw ImageError("truncated or corrupt JPEG: " + first);
  if (first.find(kPrematureEnd) != std::string::npos || !jpeg_has_end_marker(data, size)) {
    throw ImageError("truncated or corrupt JPEG: the data ends before the image (" + first + ")");
  }
  if (tjDecompress2(tj.get(), data, jpeg_size, dst, width, pitch, height, pixel_format, flags) ==
      0) {
    return;
  }
  const bool only_warnings = tjGetErrorCode(tj.get()) == TJERR_WARNING;
  const std::string last = tj.take_error();
  if (!only_warnings || last != first) throw ImageError("truncated or corrupt JPEG: " + last);
}

// PIL's CMYK -> RGB (Convert.c cmyk2rgb): R = (255-K) - round(C (255-K) / 255),
// with MULDIV255's exact rounding. libjpeg hands over the samples as stored,
// and CMYK JPEGs (Photoshop's and libjpeg's own, which PIL writes) store them
// inverted, as PIL assumes on reading ("CMYK;I"): C = 255 - stored.
void cmyk_to_rgb(const uint8_t* cmyk, uint8_t* rgb, size_t pixels) {
  for (size_t i = 0; i < pixels; ++i, cmyk += 4, rgb += 3) {
    const uint32_t nk = cmyk[3];  // 255 - K
    for (int c = 0; c < 3; ++c) {
      const uint32_t t = (255u - cmyk[c]) * nk + 128u;
      const uint32_t mul = ((t >> 8) + t) >> 8;  // round(C * nk / 255), <= nk
      rgb[c] = static_cast<uint8_t>(nk - mul);
    }
  }
}

Image decode_jpeg(const uint8_t* data, size_t size, const JpegInfo& info, int denom) {
  const auto [w, h] = jpeg_scaled_size(info.width, info.height, denom);
  Image out(w, h);
  if (info.colorspace == TJCS_CMYK || info.colorspace == TJCS_YCCK) {
    // libjpeg converts YCCK to CMYK itself; CMYK to RGB is left to us.
    std::vector<uint8_t> cmyk(static_cast<size_t>(w) * h * 4);
    tj_decode(data, size, cmyk.data(), w, w * 4, h, TJPF_CMYK);
    cmyk_to_rgb(cmyk.data(), out.pixels.data(), static_cast<size_t>(w) * h);
  } else {
    // Grayscale and RGB JPEGs convert to RGB inside libjpeg.
    tj_decode(data, size, out.pixels.data(), w, w * 3, h, TJPF_RGB);
  }
  return out;
}

// ------------------------------------------------------------------ other headers

ImageHeader png_header(const uint8_t* d, size_t n) {
  if (n < 24) corrupt_header(ImageFormat::kPng, "shorter than the IHDR chunk");
  if (std::memcmp(d + 12, "IHDR", 4) != 0 || be32(d + 8) != 13) {
    corrupt_header(ImageFormat::kPng, "the first chunk is not a 13-byte IHDR");
  }
  const uint32_t w = be32(d + 16), h = be32(d + 20);
  if (w > INT32_MAX || h > INT32_MAX) corrupt_header(ImageFormat::kPng, "side above 2^31 - 1");
  // The colour type's channels: gray, RGB, (palette: as decoded), gray + alpha, RGBA.
  static const int kChannels[7] = {1, 0, 3, 0, 2, 0, 4};
  const int channels = n >= 26 && d[25] <= 6 ? kChannels[d[25]] : 0;
  return {ImageFormat::kPng, static_cast<int>(w), static_cast<int>(h), channels};
}

// A file cut short is refused here rather than handed to OpenCV, for the same
// reason as a truncated JPEG (PIL refuses both), and because libpng and
// OpenCV 4.6 would print their failure to stderr, which OpenCV's log level
// does not govern. PNG: the chunk chain, walked by the chunks' lengths, must
// reach IEND (data after IEND is ignored, as by libpng).
void check_png_complete(const uint8_t* d, size_t n) {
  size_t pos = 8;
  while (n - pos >= 12) {  // length, type, CRC
    const uint64_t length = be32(d + pos);
    if (std::memcmp(d + pos + 4, "IEND", 4) == 0) return;
    if (length > n - pos - 12) break;
    pos += 12 + static_cast<size_t>(length);
  }
  throw ImageError("truncated or corrupt PNG: the chunks end before the IEND chunk");
}

// WebP: the RIFF container, and every chunk in it, must fit in the file
// (OpenCV 4.6 with libwebp allocates what a chunk size claims: a 322-byte file
// claiming a 3.5 GB VP8 chunk took 3.5 GB before failing).
void check_webp_complete(const uint8_t* d, size_t n) {
  const uint64_t riff_end = uint64_t{le32(d + 4)} + 8;
  if (riff_end > n) {
    throw ImageError("truncated or corrupt WebP: the RIFF container needs " +
                     std::to_string(riff_end) + " bytes, the file has " + std::to_string(n));
  }
  uint64_t pos = 12;
  while (pos + 8 <= riff_end) {
    const uint64_t size = le32(d + pos + 4);
    const uint64_t next = pos + 8 + size + (size & 1);  // chunks are padded to even sizes
    if (pos + 8 + size > riff_end) {
      throw ImageError("truncated or corrupt WebP: a '" +
                       std::string(reinterpret_cast<const char*>(d + pos), 4) + "' chunk of " +
                       std::to_string(size) + " bytes runs past the end of the file");
    }
    pos = next;
  }
}

ImageHeader webp_header(const uint8_t* d, size_t n) {
  const ImageFormat f = ImageFormat::kWebp;
  if (n < 21) corrupt_header(f, "no chunk after the RIFF header");
  const uint8_t* payload = d + 20;
  if (std::memcmp(d + 12, "VP8 ", 4) == 0) {  // lossy: key frame header
    if (n < 30 || payload[3] != 0x9D || payload[4] != 0x01 || payload[5] != 0x2A) {
      corrupt_header(f, "no VP8 key frame start code");
    }
    return {f, static_cast<int>(le16(payload + 6) & 0x3FFF),
            static_cast<int>(le16(payload + 8) & 0x3FFF)};
  }
  if (std::memcmp(d + 12, "VP8L", 4) == 0) {  // lossless: 14-bit sides minus one
    if (n < 25 || payload[0] != 0x2F) corrupt_header(f, "no VP8L signature");
    const uint32_t bits = le32(payload + 1);
    return {f, static_cast<int>((bits & 0x3FFF) + 1),
            static_cast<int>(((bits >> 14) & 0x3FFF) + 1)};
  }
  if (std::memcmp(d + 12, "VP8X", 4) == 0) {  // extended: 24-bit canvas sides minus one
    if (n < 30) corrupt_header(f, "VP8X chunk cut short");
    return {f, static_cast<int>(le24(payload + 4) + 1), static_cast<int>(le24(payload + 7) + 1)};
  }
  corrupt_header(
      f, "unknown first chunk '" + std::string(reinterpret_cast<const char*>(d + 12), 4) + "'");
}

ImageHeader bmp_header(const uint8_t* d, size_t n) {
  const ImageFormat f = ImageFormat::kBmp;
  if (n < 18) corrupt_header(f, "shorter than the file and DIB headers");
  const uint32_t dib = le32(d + 14);
  if (dib == 12) {  // BITMAPCOREHEADER: unsigned 16-bit sides
    if (n < 22) corrupt_header(f, "DIB header cut short");
    return {f, static_cast<int>(le16(d + 18)), static_cast<int>(le16(d + 20))};
  }
  if (dib < 16 || n < 26) corrupt_header(f, "unknown or cut DIB header");
  // Signed 32-bit sides; a negative height means rows stored top-down.
  const auto w = static_cast<int32_t>(le32(d + 18));
  const auto h = static_cast<int32_t>(le32(d + 22));
  if (w < 0 || h == INT32_MIN) corrupt_header(f, "negative width or invalid height");
  return {f, w, h < 0 ? -h : h};
}

// BMP: uncompressed (BI_RGB, BI_BITFIELDS) pixel rows must fit in the file.
void check_bmp_complete(const uint8_t* d, size_t n, const ImageHeader& header) {
  const uint32_t dib = le32(d + 14);
  if (dib < 40 || n < 34) return;  // core headers and RLE: left to the decoder
  const uint32_t compression = le32(d + 30);
  if (compression != 0 && compression != 3) return;
  const uint64_t bits = le16(d + 28);
  const uint64_t row_bytes = (static_cast<uint64_t>(header.width) * bits + 31) / 32 * 4;
  const uint64_t end = le32(d + 10) + row_bytes * static_cast<uint64_t>(header.height);
  if (end > n) {
    throw ImageError("truncated or corrupt BMP: pixel rows need " + std::to_string(end) +
                     " bytes, the file has " + std::to_string(n));
  }
}

// The first IFD's size and SamplesPerPixel, and whether its first extra
// sample is unassociated alpha (ExtraSamples, 338, = 2).
struct TiffInfo {
  ImageHeader header;
  bool unassociated_alpha = false;
};

TiffInfo tiff_info(const uint8_t* d, size_t n) {
  const ImageFormat f = ImageFormat::kTiff;
  const bool little = d[0] == 'I';
  const bool big_tiff = (little ? d[2] : d[3]) == 43;
  auto u16 = [&](size_t at) { return little ? le16(d + at) : be16(d + at); };
  auto u32 = [&](size_t at) { return little ? le32(d + at) : be32(d + at); };
  auto u64 = [&](size_t at) {
    return little ? le64(d + at) : (uint64_t{be32(d + at)} << 32) | be32(d + at + 4);
  };
  // First IFD: entry count, then entries of tag, type, count, value.
  uint64_t ifd = 0, count = 0;
  size_t entry_size = 12, count_size = 2, value_at = 8;
  if (big_tiff) {
    if (n < 16 || u16(4) != 8) corrupt_header(f, "BigTIFF header cut short");
    ifd = u64(8);
    entry_size = 20;
    count_size = 8;
    value_at = 12;
  } else {
    if (n < 8) corrupt_header(f, "header cut short");
    ifd = u32(4);
  }
  if (ifd > n || n - ifd < count_size) corrupt_header(f, "first IFD outside the file");
  count = big_tiff ? u64(ifd) : u16(ifd);
  const uint64_t entries_at = ifd + count_size;
  if (count > (n - entries_at) / entry_size) corrupt_header(f, "IFD runs past the end of the file");
  uint64_t side[2] = {0, 0};  // ImageWidth (256), ImageLength (257)
  bool found[2] = {false, false};
  uint64_t samples = 1;  // SamplesPerPixel (277), 1 when absent (TIFF 6.0)
  bool unassociated_alpha = false;
  for (uint64_t i = 0; i < count; ++i) {
    const size_t e = entries_at + i * entry_size;
    const uint32_t tag = u16(e), type = u16(e + 2);
    if (tag == 277 && type == 3) samples = u16(e + value_at);
    if (tag == 338 && type == 3) {
      // The first SHORT: in the value field when the values fit there, else at its offset.
      const uint64_t n_values = big_tiff ? u64(e + 4) : u32(e + 4);
      uint64_t at = e + value_at;
      if (n_values * 2 > entry_size - value_at) {
        at = big_tiff ? u64(e + value_at) : u32(e + value_at);
      }
      unassociated_alpha = n_values > 0 && at <= n - 2 && u16(at) == 2;
    }
    if (tag != 256 && tag != 257) continue;
    uint64_t v = 0;
    if (type == 3) {
      v = u16(e + value_at);  // SHORT, left-justified in the value field
    } else if (type == 4) {
      v = u32(e + value_at);  // LONG
    } else if (type == 16 && big_tiff) {
      v = u64(e + value_at);  // LONG8
    } else {
      corrupt_header(f, "image size tag of type " + std::to_string(type));
    }
    side[tag - 256] = v;
    found[tag - 256] = true;
  }
  if (!found[0] || !found[1]) {
    corrupt_header(f, "no ImageWidth or ImageLength tag in the first IFD");
  }
  if (side[0] > INT32_MAX || side[1] > INT32_MAX) corrupt_header(f, "side above 2^31 - 1");
  return {{f, static_cast<int>(side[0]), static_cast<int>(side[1]), static_cast<int>(samples)},
          unassociated_alpha};
}

ImageHeader tiff_header(const uint8_t* d, size_t n) { return tiff_info(d, n).header; }

void check_max_pixels(const DecodeOptions& options) {
  if (options.max_pixels <= 0) {
    throw ImageError("DecodeOptions::max_pixels must be positive, got " +
                     std::to_string(options.max_pixels));
  }
}

void check_size(ImageFormat f, int64_t w, int64_t h, const DecodeOptions& options) {
  if (w <= 0 || h <= 0) {
    throw ImageError(std::string(format_name(f)) + " image has a zero side (" + std::to_string(w) +
                     "x" + std::to_string(h) + ")");
  }
  if (w * h > options.max_pixels) {
    throw ImageError(std::string(format_name(f)) + " image is " + std::to_string(w) + "x" +
                     std::to_string(h) + " = " + std::to_string(w * h) +
                     " pixels, above the limit of " + std::to_string(options.max_pixels) +
                     " (DecodeOptions::max_pixels; a decompression bomb?)");
  }
}

// ------------------------------------------------------------------ probing

// probe_image, also handing out the JPEG colour space that decoding needs.
ImageHeader probe(const uint8_t* data, size_t size, const DecodeOptions& options, JpegInfo* jpeg) {
  check_max_pixels(options);
  if (data == nullptr || size == 0) throw ImageError("no image data (0 bytes)");
  const ImageFormat f = sniff(data, size);
  if (f == ImageFormat::kUnknown) {
    throw ImageError("unknown image format (first bytes: " + first_bytes_hex(data, size) + ")");
  }
  if (f != ImageFormat::kJpeg && f != ImageFormat::kNpy && !other_formats_available()) {
    throw ImageError(std::string(format_name(f)) +
                     " image, but this build reads JPEG only (it was configured with "
                     "DINO_OPT_WITH_OPENCV=OFF; rebuild with OpenCV imgcodecs for PNG, WebP, BMP "
                     "and TIFF)");
  }
  ImageHeader header;
  switch (f) {
    case ImageFormat::kJpeg: {
      *jpeg = read_jpeg_header(data, size);
      header = {f, jpeg->width, jpeg->height};
      break;
    }
    case ImageFormat::kPng:
      header = png_header(data, size);
      break;
    case ImageFormat::kWebp:
      header = webp_header(data, size);
      break;
    case ImageFormat::kBmp:
      header = bmp_header(data, size);
      break;
    case ImageFormat::kNpy: {
      const NpyHeader npy = parse_npy_header(data, size);
      header = {f, npy.width, npy.height, npy.layout.channels};
      break;
    }
    default:
      header = tiff_header(data, size);
      break;
  }
  check_size(f, header.width, header.height, options);
  if (f == ImageFormat::kPng) check_png_complete(data, size);
  if (f == ImageFormat::kWebp) check_webp_complete(data, size);
  if (f == ImageFormat::kBmp) check_bmp_complete(data, size, header);
  return header;
}

// ------------------------------------------------------------------ OpenCV

#if DINO_OPT_WITH_IMGCODECS

// OpenCV logs warnings about undecodable input (libtiff's among them) to
// stderr; the caller reports the failure itself, once, with the path.
// Process-wide, set on first use. It does not reach the lines that OpenCV
// 4.6's imdecode writes to std::cerr when a decoder throws, nor libpng's own
// error output; the completeness checks above keep truncated files away from
// them.
void silence_opencv_logging() {
  static std::once_flag once;
  std::call_once(once, [] {
    cv::utils::logging::setLogLevel(cv::utils::logging::LogLevel::LOG_LEVEL_SILENT);
  });
}

// 16-bit samples scale to 8 bits by round(v / 257), which maps 0..65535 onto
// 0..255 evenly. (PIL's convert("RGB") takes the high byte of 16-bit RGB and
// clips 16-bit gray at 255, which whitens it; we keep the picture instead.)
uint8_t to8(uint8_t v) { return v; }
uint8_t to8(uint16_t v) { return static_cast<uint8_t>((v + 128u) / 257u); }

// 1 channel: gray; 2: gray + alpha; 3: BGR; 4: BGRA. Alpha is dropped, as
// PIL's convert("RGB") does (no compositing on a background). One exception
// we cannot undo: OpenCV reads 8-bit RGBA TIFFs through libtiff's RGBA
// interface, which premultiplies unassociated alpha, so their colours under
// partial transparency come out darker than PIL's.
template <typename T>
void mat_to_rgb(const cv::Mat& m, Image& out) {
  const int channels = m.channels();
  for (int y = 0; y < m.rows; ++y) {
    const T* src = m.ptr<T>(y);
    uint8_t* dst = out.row(y);
    for (int x = 0; x < m.cols; ++x, src += channels, dst += 3) {
      if (channels <= 2) {
        dst[0] = dst[1] = dst[2] = to8(src[0]);
      } else {
        dst[0] = to8(src[2]);
        dst[1] = to8(src[1]);
        dst[2] = to8(src[0]);
      }
    }
  }
}

const char* depth_name(int depth) {
  switch (depth) {
    case CV_8S:
      return "8-bit signed";
    case CV_16S:
      return "16-bit signed";
    case CV_32S:
      return "32-bit integer";
    case CV_32F:
      return "32-bit float";
    case CV_64F:
      return "64-bit float";
    default:
      return "non-8/16-bit";
  }
}

// The decoded Mat at its stored depth and channels (BGR(A) order for 3 and 4).
cv::Mat imdecode_checked(const uint8_t* data, size_t size, ImageFormat f,
                         const DecodeOptions& options) {
  silence_opencv_logging();
  const std::string name = format_name(f);
  if (size > static_cast<size_t>(INT_MAX)) throw ImageError(name + " file above 2 GiB");
  // imdecode picks its decoder by signature, not by our sniff. Ours match
  // PNG, BMP and TIFF files by their magic alone, but its WebP decoder also
  // wants a valid VP8 header; a damaged WebP then falls through to the last
  // decoder, GDCM (DICOM, in Debian's OpenCV), which claims any file with
  // "DICM" at offset 128. A damaged WebP is refused instead of parsed as DICOM.
  if (f == ImageFormat::kWebp && size >= 132 && std::memcmp(data + 128, "DICM", 4) == 0) {
    throw ImageError(
        "WebP file with a DICOM marker (\"DICM\" at byte 128): refused, OpenCV could decode it as "
        "DICOM");
  }
  cv::Mat decoded;
  try {
    // imdecode only reads the buffer; IMREAD_UNCHANGED keeps 16-bit samples,
    // every channel and alpha and, like PIL, ignores EXIF orientation.
    const cv::Mat raw(1, static_cast<int>(size), CV_8UC1, const_cast<uint8_t*>(data));
    decoded = cv::imdecode(raw, cv::IMREAD_UNCHANGED);
  } catch (const cv::Exception& e) {
    throw ImageError("truncated or corrupt " + name + " (OpenCV: " + e.err + ")");
  }
  if (decoded.empty()) {
    throw ImageError("truncated or corrupt " + name + " (OpenCV decoded nothing)");
  }
  check_size(f, decoded.cols, decoded.rows, options);
  return decoded;
}

Image decode_with_opencv(const uint8_t* data, size_t size, ImageFormat f,
                         const DecodeOptions& options) {
  const cv::Mat decoded = imdecode_checked(data, size, f, options);
  const std::string name = format_name(f);
  const int channels = decoded.channels();
  if (channels < 1 || channels > 4) {
    throw ImageError(name + " image with " + std::to_string(channels) +
                     " channels (8-bit RGB reads 1 to 4; read it at its stored depth: "
                     "image_mode='native', data.image_mode: native)");
  }
  Image out(decoded.cols, decoded.rows);
  if (decoded.depth() == CV_8U) {
    mat_to_rgb<uint8_t>(decoded, out);
  } else if (decoded.depth() == CV_16U) {
    mat_to_rgb<uint16_t>(decoded, out);
  } else {
    throw ImageError(name + " image with " + depth_name(decoded.depth()) +
                     " samples (only 8- and 16-bit are read)");
  }
  return out;
}

RawImage raw_with_opencv(const uint8_t* data, size_t size, const ImageHeader& header,
                         const DecodeOptions& options) {
  const ImageFormat f = header.format;
  const int samples = header.channels;
  if (f == ImageFormat::kTiff && samples != 1 && samples != 3 && samples != 4) {
    throw ImageError("TIFF with " + std::to_string(samples) +
                     " samples per pixel: OpenCV reads 1, 3 or 4; save it as a .npy array (H, W, "
                     "C) instead");
  }
  const cv::Mat decoded = imdecode_checked(data, size, f, options);
  const std::string name = format_name(f);
  ImageLayout layout;
  layout.channels = decoded.channels();
  switch (decoded.depth()) {
    case CV_8U:
      layout.type = SampleType::kU8;
      break;
    case CV_16U:
      layout.type = SampleType::kU16;
      break;
    case CV_32F:
      layout.type = SampleType::kF32;
      break;
    default:
      throw ImageError(name + " image with " + depth_name(decoded.depth()) +
                       " samples (uint8, uint16 and float32 are read)");
  }
  // OpenCV reads 8-bit RGBA TIFFs through libtiff's RGBA interface, which
  // premultiplies unassociated alpha into the colours: not the stored values.
  if (f == ImageFormat::kTiff && layout.channels == 4 && layout.type == SampleType::kU8 &&
      tiff_info(data, size).unassociated_alpha) {
    throw ImageError(
        "8-bit TIFF with unassociated alpha, whose colours OpenCV returns multiplied by the "
        "alpha: save it as a PNG or a .npy array (H, W, C) instead");
  }
  // OpenCV's PNG decoder turns gray + alpha into BGRA: back to (gray, alpha).
  const bool gray_alpha = f == ImageFormat::kPng && header.channels == 2 && layout.channels == 4;
  if (gray_alpha) layout.channels = 2;
  if ((f == ImageFormat::kTiff || f == ImageFormat::kPng) && header.channels > 0 &&
      header.channels != layout.channels) {
    throw ImageError(name + " with " + std::to_string(header.channels) +
                     " samples per pixel, which OpenCV decodes as " +
                     std::to_string(layout.channels) +
                     " channels: save it as a .npy array (H, W, C) instead");
  }
  RawImage out(decoded.cols, decoded.rows, layout);
  if (gray_alpha) {
    const int sb = sample_bytes(layout.type);
    for (int y = 0; y < decoded.rows; ++y) {
      const uint8_t* src = decoded.ptr<uint8_t>(y);
      uint8_t* dst = out.bytes.data() + static_cast<size_t>(y) * out.row_bytes();
      for (int x = 0; x < decoded.cols; ++x) {
        std::memcpy(dst + 2 * x * sb, src + 4 * x * sb, sb);              // gray (B)
        std::memcpy(dst + (2 * x + 1) * sb, src + (4 * x + 3) * sb, sb);  // alpha
      }
    }
    return out;
  }
  const size_t row = static_cast<size_t>(out.row_bytes());
  const int c = layout.channels;
  const int sb = sample_bytes(layout.type);
  for (int y = 0; y < decoded.rows; ++y) {
    const uint8_t* src = decoded.ptr<uint8_t>(y);
    uint8_t* dst = out.bytes.data() + y * row;
    std::memcpy(dst, src, row);
    if (c == 3 || c == 4) {  // BGR(A) -> RGB(A): swap the first and third samples
      for (int x = 0; x < decoded.cols; ++x) {
        uint8_t* px = dst + static_cast<size_t>(x) * c * sb;
        for (int b = 0; b < sb; ++b) std::swap(px[b], px[2 * sb + b]);
      }
    }
  }
  return out;
}

std::vector<uint8_t> encode_with_opencv(const RawView& view, ImageFormat f) {
  silence_opencv_logging();
  const int c = view.layout.channels;
  const int depth = view.layout.type == SampleType::kU8    ? CV_8U
                    : view.layout.type == SampleType::kU16 ? CV_16U
                                                           : CV_32F;
  if (c == 2 || c > 4 || (f == ImageFormat::kPng && view.layout.type == SampleType::kF32)) {
    throw ImageError(std::string(format_name(f)) +
                     " is written with 1, 3 or 4 channels (OpenCV's encoder; PNG: uint8 or "
                     "uint16), not " +
                     view.layout.describe() + " (write .npy)");
  }
  cv::Mat mat(view.height, view.width, CV_MAKETYPE(depth, c));
  const size_t row = static_cast<size_t>(view.width) * c * sample_bytes(view.layout.type);
  const int sb = sample_bytes(view.layout.type);
  for (int y = 0; y < view.height; ++y) {
    uint8_t* dst = mat.ptr<uint8_t>(y);
    std::memcpy(dst, view.row(y), row);
    if (c == 3 || c == 4) {
      for (int x = 0; x < view.width; ++x) {
        uint8_t* px = dst + static_cast<size_t>(x) * c * sb;
        for (int b = 0; b < sb; ++b) std::swap(px[b], px[2 * sb + b]);
      }
    }
  }
  std::vector<uint8_t> out;
  try {
    if (!cv::imencode(f == ImageFormat::kPng ? ".png" : ".tiff", mat, out)) {
      throw ImageError(std::string("OpenCV could not encode a ") + format_name(f) + " of " +
                       view.layout.describe());
    }
  } catch (const cv::Exception& e) {
    throw ImageError(std::string("OpenCV could not encode a ") + format_name(f) + " of " +
                     view.layout.describe() + ": " + e.err);
  }
  return out;
}

#endif  // DINO_OPT_WITH_IMGCODECS

// ------------------------------------------------------------------ .npy and raw JPEG

RawImage decode_npy(const uint8_t* data, size_t size) {
  const NpyHeader h = parse_npy_header(data, size);
  RawImage out(h.width, h.height, h.layout);
  std::memcpy(out.bytes.data(), data + h.data_offset, out.bytes.size());
  return out;
}

// A .npy array as 8-bit RGB, the way decode_with_opencv converts other files
// (channels in stored order: gray, gray + alpha, RGB, RGBA).
template <typename T>
void samples_to_rgb(const RawImage& raw, Image& out) {
  const int c = raw.layout.channels;
  const auto* src = reinterpret_cast<const T*>(raw.bytes.data());
  auto to8 = [](T v) {
    if constexpr (sizeof(T) == 1) {
      return static_cast<uint8_t>(v);
    } else {
      return static_cast<uint8_t>((v + 128u) / 257u);
    }
  };
  const size_t pixels = static_cast<size_t>(raw.width) * raw.height;
  for (size_t i = 0; i < pixels; ++i, src += c) {
    uint8_t* dst = out.pixels.data() + 3 * i;
    if (c <= 2) {
      dst[0] = dst[1] = dst[2] = to8(src[0]);
    } else {
      for (int k = 0; k < 3; ++k) dst[k] = to8(src[k]);
    }
  }
}

Image npy_to_rgb(const uint8_t* data, size_t size) {
  RawImage raw = decode_npy(data, size);
  const ImageLayout l = raw.layout;
  if (l.channels > 4 || l.type == SampleType::kF32) {
    throw ImageError(".npy array of " + l.describe() +
                     ": 8-bit RGB reads uint8 or uint16 arrays with 1 to 4 channels (read it at "
                     "its stored depth: image_mode='native', data.image_mode: native)");
  }
  Image out(raw.width, raw.height);
  if (l.type == SampleType::kU8) {
    samples_to_rgb<uint8_t>(raw, out);
  } else {
    samples_to_rgb<uint16_t>(raw, out);
  }
  return out;
}

// A JPEG at its stored channels: grayscale as 1 channel, anything else as RGB.
RawImage decode_jpeg_raw(const uint8_t* data, size_t size, const JpegInfo& info, int denom) {
  if (info.colorspace == TJCS_GRAY) {
    const auto [w, h] = jpeg_scaled_size(info.width, info.height, denom);
    RawImage out(w, h, ImageLayout{1, SampleType::kU8});
    tj_decode(data, size, out.bytes.data(), w, w, h, TJPF_GRAY);
    return out;
  }
  Image rgb = decode_jpeg(data, size, info, denom);
  RawImage out;
  out.width = rgb.width;
  out.height = rgb.height;
  out.layout = ImageLayout{3, SampleType::kU8};
  out.bytes = std::move(rgb.pixels);
  return out;
}

}  // namespace

// ------------------------------------------------------------------ public API

const char* format_name(ImageFormat format) {
  switch (format) {
    case ImageFormat::kJpeg:
      return "JPEG";
    case ImageFormat::kPng:
      return "PNG";
    case ImageFormat::kWebp:
      return "WebP";
    case ImageFormat::kBmp:
      return "BMP";
    case ImageFormat::kTiff:
      return "TIFF";
    case ImageFormat::kNpy:
      return ".npy";
    case ImageFormat::kUnknown:
      break;
  }
  return "unknown";
}

bool other_formats_available() { return DINO_OPT_WITH_IMGCODECS != 0; }

std::vector<uint8_t> read_file(const std::string& path) {
  // O_NONBLOCK: opening a FIFO must not wait for a writer; it is refused below
  // as not a regular file, and regular files ignore the flag.
  int fd = -1;
  do {
    fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  } while (fd < 0 && errno == EINTR);
  if (fd < 0) {
    const int err = errno;
    if (err == ENOENT) throw ImageError("no such file (" + errno_text(err) + ")");
    throw ImageError("cannot open: " + errno_text(err));
  }
  FileDescriptor file(fd);
  struct stat st {};
  if (::fstat(fd, &st) != 0) throw ImageError("cannot stat: " + errno_text(errno));
  if (S_ISDIR(st.st_mode)) throw ImageError("is a directory, not an image file");
  if (!S_ISREG(st.st_mode)) throw ImageError("not a regular file (a device, FIFO or socket)");

  std::vector<uint8_t> bytes;
  try {
    // One byte more than stat says, so that the read which sees EOF needs no
    // resize; files that grow meanwhile (or report size 0, as in /proc) grow
    // the buffer.
    bytes.resize(static_cast<size_t>(st.st_size) + 1);
    size_t got = 0;
    for (;;) {
      if (got == bytes.size()) bytes.resize(bytes.size() * 2);
      const ssize_t r = ::read(fd, bytes.data() + got, bytes.size() - got);
      if (r < 0) {
        if (errno == EINTR) continue;
        throw ImageError("read failed: " + errno_text(errno));
      }
      if (r == 0) break;
      got += static_cast<size_t>(r);
    }
    bytes.resize(got);
  } catch (const std::bad_alloc&) {
    throw ImageError("file too large to read into memory (" + std::to_string(st.st_size) +
                     " bytes)");
  } catch (const std::length_error&) {
    throw ImageError("file too large to read into memory (" + std::to_string(st.st_size) +
                     " bytes)");
  }
  if (bytes.empty()) throw ImageError("empty file (0 bytes)");
  return bytes;
}

void write_file_atomically(const std::string& path, const uint8_t* bytes, size_t size) {
  const std::string tmp = path + ".tmp" + std::to_string(::getpid());
  auto fail = [&](const char* what) {
    const std::string cause = errno_text(errno);
    ::unlink(tmp.c_str());
    throw ImageError(path + ": cannot " + what + ": " + cause);
  };
  const int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd < 0) throw ImageError(path + ": cannot create " + tmp + ": " + errno_text(errno));
  size_t written = 0;
  while (written < size) {
    const ssize_t n = ::write(fd, bytes + written, size - written);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      ::close(fd);
      fail("write");
    }
    written += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    fail("fsync");
  }
  if (::close(fd) != 0) fail("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) fail("rename");
}

ImageHeader probe_image(const uint8_t* data, size_t size, const DecodeOptions& options) {
  JpegInfo unused;
  return probe(data, size, options, &unused);
}

std::pair<int, int> jpeg_scaled_size(int width, int height, int denom) {
  const tjscalingfactor& factor = scaling_factor(denom);
  if (width < 0 || height < 0) {
    throw ImageError("negative image size " + std::to_string(width) + "x" + std::to_string(height));
  }
  const int64_t w = width, h = height;  // TJSCALED in 64 bits: no overflow near INT_MAX
  return {static_cast<int>(TJSCALED(w, factor)), static_cast<int>(TJSCALED(h, factor))};
}

namespace {

// The header read again from the bytes (cheap next to the decode), so that
// buffer sizes never rest on a caller's struct and a header that belongs to
// other bytes is caught; the scale denominator checked for every format.
ImageHeader probe_again(const uint8_t* data, size_t size, const ImageHeader& header,
                        int scale_denom, const DecodeOptions& options, JpegInfo* jpeg) {
  scaling_factor(scale_denom);
  const ImageHeader actual = probe(data, size, options, jpeg);
  if (header.format != ImageFormat::kUnknown &&
      (header.format != actual.format || header.width != actual.width ||
       header.height != actual.height)) {
    throw ImageError(std::string("the header (") + format_name(header.format) + " " +
                     std::to_string(header.width) + "x" + std::to_string(header.height) +
                     ") does not match the data (" + format_name(actual.format) + " " +
                     std::to_string(actual.width) + "x" + std::to_string(actual.height) + ")");
  }
  return actual;
}

}  // namespace

Image decode_image(const uint8_t* data, size_t size, const ImageHeader& header, int scale_denom,
                   const DecodeOptions& options) {
  JpegInfo jpeg;
  const ImageHeader actual = probe_again(data, size, header, scale_denom, options, &jpeg);
  try {
    if (actual.format == ImageFormat::kJpeg) return decode_jpeg(data, size, jpeg, scale_denom);
    if (actual.format == ImageFormat::kNpy) return npy_to_rgb(data, size);
#if DINO_OPT_WITH_IMGCODECS
    return decode_with_opencv(data, size, actual.format, options);
#else
    throw ImageError("this build reads JPEG only");           // probe_image refused already
#endif
  } catch (const std::bad_alloc&) {
    throw ImageError(std::string("out of memory decoding a ") + format_name(actual.format) + " " +
                     std::to_string(actual.width) + "x" + std::to_string(actual.height) + " image");
  }
}

RawImage decode_raw(const uint8_t* data, size_t size, const ImageHeader& header, int scale_denom,
                    const DecodeOptions& options) {
  JpegInfo jpeg;
  const ImageHeader actual = probe_again(data, size, header, scale_denom, options, &jpeg);
  try {
    if (actual.format == ImageFormat::kJpeg) {
      return decode_jpeg_raw(data, size, jpeg, scale_denom);
    }
    if (actual.format == ImageFormat::kNpy) return decode_npy(data, size);
#if DINO_OPT_WITH_IMGCODECS
    return raw_with_opencv(data, size, actual, options);
#else
    throw ImageError("this build reads JPEG and .npy only");  // probe_image refused already
#endif
  } catch (const std::bad_alloc&) {
    throw ImageError(std::string("out of memory decoding a ") + format_name(actual.format) + " " +
                     std::to_string(actual.width) + "x" + std::to_string(actual.height) + " image");
  }
}

std::vector<uint8_t> encode_raw(const RawView& view, ImageFormat format) {
  if (view.data == nullptr || view.width < 1 || view.height < 1 || view.layout.channels < 1) {
    throw ImageError("cannot encode an empty image (" + std::to_string(view.width) + "x" +
                     std::to_string(view.height) + ")");
  }
  if (format == ImageFormat::kNpy) return encode_npy(view);
  if (format != ImageFormat::kPng && format != ImageFormat::kTiff) {
    throw ImageError(std::string("encode_raw writes PNG, TIFF or .npy, not ") +
                     format_name(format));
  }
#if DINO_OPT_WITH_IMGCODECS
  return encode_with_opencv(view, format);
#else
  throw ImageError("this build has no OpenCV imgcodecs: it writes .npy only");
#endif
}

std::vector<uint8_t> encode_jpeg(const ImageView& image, int quality) {
  if (quality < 1 || quality > 100) {
    throw ImageError("JPEG quality must be in [1, 100], got " + std::to_string(quality));
  }
  if (image.data == nullptr || image.width < 1 || image.height < 1) {
    throw ImageError("cannot encode an empty image (" + std::to_string(image.width) + "x" +
                     std::to_string(image.height) + ")");
  }
  if (image.width > 65535 || image.height > 65535) {
    throw ImageError("JPEG sides are at most 65535, got " + std::to_string(image.width) + "x" +
                     std::to_string(image.height));
  }
  if (image.stride < int64_t{3} * image.width || image.stride > INT_MAX) {
    throw ImageError("row stride " + std::to_string(image.stride) + " for width " +
                     std::to_string(image.width) + " (need 3 * width <= stride <= 2^31 - 1)");
  }
  TjHandle& tj = compressor();
  unsigned char* buffer = nullptr;
  unsigned long size = 0;
  // ACCURATEDCT: libjpeg's (and so PIL's) default; TurboJPEG would use the
  // fast integer DCT below quality 96.
  const int rc =
      tjCompress2(tj.get(), image.data, image.width, static_cast<int>(image.stride), image.height,
                  TJPF_RGB, &buffer, &size, TJSAMP_420, quality, TJFLAG_ACCURATEDCT);
  const std::unique_ptr<unsigned char, void (*)(unsigned char*)> owned(buffer, tjFree);
  if (rc != 0) throw ImageError("JPEG encoding failed: " + tj.take_error());
  return {buffer, buffer + size};
}

}  // namespace dino_opt::loader
