#pragma once
// NumPy's .npy format (numpy.lib.format, versions 1.0, 2.0 and 3.0): the
// header parsed here, strictly, so that arrays (H, W) or (H, W, C) of uint8,
// uint16 or float32 are read on the loader's threads without Python. Only
// the dict literal np.save writes is accepted: 'descr', 'fortran_order' and
// 'shape' keys, string, bool and tuple-of-int values. Free of torch headers.
#include <cstddef>
#include <cstdint>
#include <vector>

#include "loader/image.h"

namespace dino_opt::loader {

// True when the bytes start with the .npy magic string ("\x93NUMPY").
bool is_npy(const uint8_t* data, size_t size);

struct NpyHeader {
  int height = 0;
  int width = 0;
  ImageLayout layout;      // channels 1 for a 2-D array
  size_t data_offset = 0;  // where the samples start
};

// Parses and checks the header: a little-endian (or byte-order-free) uint8,
// uint16 or float32 array in C order, 2-D or 3-D with every side >= 1 and at
// most 1024 channels, and data of at least the size the shape needs. Throws
// ImageError naming what is wrong ("corrupt .npy header: ...", "... .npy array
// of dtype '<i8' ...").
NpyHeader parse_npy_header(const uint8_t* data, size_t size);

// The .npy bytes of a `view` (a 3-D array, or 2-D when `squeeze` and it has
// one channel), version 1.0, as np.save writes them.
std::vector<uint8_t> encode_npy(const RawView& view, bool squeeze = true);

}  // namespace dino_opt::loader
