#pragma once
// The block algorithm of the CUDA kernel of dino_opt::multicrop_photometric,
// written once for any "block" of cooperating threads: on the GPU a CUDA
// thread block (ops/cuda/photometric_kernel.cu), on the host a single thread
// that runs every phase alone (SerialBlock), which is how the C++ tests check
// the GPU algorithm bit for bit against loader::apply_photometric on machines
// without a GPU. Work is split only by strided loops over items and
// block-wide barriers, so the serial run computes exactly what the block
// computes. Free of torch and CUDA headers.
//
// A block owns one kTileW x kTileH tile of one crop.
//   No blur: each pixel is loaded, put through the colour ops, normalised and
//   stored; no shared memory.
//   Blur: the reflect-padded neighbourhood of the tile is processed in chunks
//   of at most kChunkRows x kChunkCols pixels (one chunk for radii <= 8,
//   i.e. sigma <= 2.67, which covers DINO's sigma <= 2): phase A stages the
//   colour-augmented pixels of a chunk in shared memory, phase B adds their
//   vertical taps into per-column sums V, phase C adds the horizontal taps of
//   V into the tile's sums O, and phase D normalises and stores O. Taps are
//   added in ascending order, each sum starting at 0, exactly as the CPU does.
//   Larger radii loop over more chunks with the same arithmetic.
// The mean that contrast needs comes from a prologue launch, which sums the
// gray values of each tile (tile_gray_sum) before the main launch.
#include <cstdint>

#include "loader/float16.h"
#include "loader/photometric.h"
#include "loader/photometric_math.h"

namespace dino_opt::photometric_detail {

namespace pm = loader::photometric_math;

constexpr int kTileW = 32;
constexpr int kTileH = 32;
constexpr int kMaxFastRadius = 8;
constexpr int kChunkCols = kTileW + 2 * kMaxFastRadius;
constexpr int kChunkRows = kTileH + 2 * kMaxFastRadius;
constexpr int kStageFloats = 3 * kChunkRows * kChunkCols;  // S: [3][rows][cols]
constexpr int kColumnFloats = 3 * kTileH * kChunkCols;     // V: [3][kTileH][cols]
constexpr int kTileFloats = 3 * kTileH * kTileW;           // O: [3][kTileH][kTileW]
constexpr int kSharedFloats = kStageFloats + kColumnFloats + kTileFloats;

// Shared memory of a main-launch block: the three buffers and the crop mean.
constexpr int kMainSharedFloats = kSharedFloats + 1;

// Taps per crop in the taps buffer: room for the largest clamped kernels,
// 2 (h - 1) + 1 vertical then 2 (w - 1) + 1 horizontal.
DINO_OPT_PHOTO_HD int64_t taps_per_crop(int h, int w) {
  return int64_t{2} * h - 1 + int64_t{2} * w - 1;
}

DINO_OPT_PHOTO_HD int tiles_x(int w) { return (w + kTileW - 1) / kTileW; }
DINO_OPT_PHOTO_HD int tiles_y(int h) { return (h + kTileH - 1) / kTileH; }

#if defined(__CUDACC__)
#define DINO_OPT_TILE_MEMBER __host__ __device__
#else
#define DINO_OPT_TILE_MEMBER
#endif

// One thread doing the whole block's work (host tests).
struct SerialBlock {
  DINO_OPT_TILE_MEMBER int tid() const { return 0; }
  DINO_OPT_TILE_MEMBER int size() const { return 1; }
  DINO_OPT_TILE_MEMBER void sync() const {}
};

// What a block needs to know about its crop and tile.
struct TileJob {
  const uint8_t* src = nullptr;  // the crop, HWC
  int h = 0, w = 0;
  pm::CropOps ops;
  float mean = 0.0f;  // gray mean entering contrast
  int rx = 0, ry = 0;
  const float* taps_y = nullptr;  // 2 ry + 1
  const float* taps_x = nullptr;  // 2 rx + 1
  int x0 = 0, y0 = 0;             // tile origin
  float norm_mean[3] = {};
  float norm_std[3] = {};
  void* out = nullptr;  // the crop's element (c, y, x) = (0, 0, 0)
  loader::OutputType out_type = loader::OutputType::kFloat32;
  int64_t stride_c = 0, stride_y = 0, stride_x = 0;
};

// Tile `tile` of a crop: its origin.
DINO_OPT_PHOTO_HD void tile_origin(int tile, int w, int& x0, int& y0) {
  const int tx = tiles_x(w);
  x0 = (tile % tx) * kTileW;
  y0 = (tile / tx) * kTileH;
}

// The mean of a crop from its per-tile gray sums, summed in tile order.
DINO_OPT_PHOTO_HD float crop_mean(const double* tile_sums, int tiles, int h, int w) {
  double sum = 0.0;
  for (int i = 0; i < tiles; ++i) sum += tile_sums[i];
  return static_cast<float>(sum / (static_cast<double>(h) * w));
}

DINO_OPT_PHOTO_HD void load_pixel(const TileJob& j, int y, int x, float& r, float& g, float& b) {
  const uint8_t* p = j.src + (static_cast<int64_t>(y) * j.w + x) * 3;
  r = pm::unit_from_u8(p[0]);
  g = pm::unit_from_u8(p[1]);
  b = pm::unit_from_u8(p[2]);
}

DINO_OPT_PHOTO_HD void store_pixel(const TileJob& j, int y, int x, float r, float g, float b) {
  const int xo = j.ops.flip ? j.w - 1 - x : x;
  const float v[3] = {r, g, b};
  for (int c = 0; c < 3; ++c) {
    float t = j.ops.solarize ? pm::solarize(v[c]) : v[c];
    t = pm::normalize(t, j.norm_mean[c], j.norm_std[c]);
    const int64_t at = c * j.stride_c + y * j.stride_y + xo * j.stride_x;
    switch (j.out_type) {
      case loader::OutputType::kFloat32:
        static_cast<float*>(j.out)[at] = t;
        break;
      case loader::OutputType::kBFloat16:
        static_cast<uint16_t*>(j.out)[at] = loader::float_to_bf16_bits(t);
        break;
      case loader::OutputType::kFloat16:
        static_cast<uint16_t*>(j.out)[at] = loader::float_to_f16_bits(t);
        break;
    }
  }
}

DINO_OPT_PHOTO_HD int tile_width(const TileJob& j) {
  return j.w - j.x0 < kTileW ? j.w - j.x0 : kTileW;
}
DINO_OPT_PHOTO_HD int tile_height(const TileJob& j) {
  return j.h - j.y0 < kTileH ? j.h - j.y0 : kTileH;
}

// Sum over the tile of the gray values entering contrast, in double; valid
// in thread 0. `reduce` holds blk.size() doubles; blk.size() is a power of 2.
template <class Block>
DINO_OPT_PHOTO_HD double tile_gray_sum(const Block& blk, const TileJob& j, double* reduce) {
  const int tw = tile_width(j), th = tile_height(j);
  double local = 0.0;
  for (int i = blk.tid(); i < tw * th; i += blk.size()) {
    const int y = j.y0 + i / tw, x = j.x0 + i % tw;
    float r, g, b;
    load_pixel(j, y, x, r, g, b);
    pm::apply_ops(j.ops, 0, j.ops.contrast_at, 0.0f, r, g, b);
    local += static_cast<double>(pm::gray(r, g, b));
  }
  reduce[blk.tid()] = local;
  blk.sync();
  for (int s = blk.size() / 2; s > 0; s /= 2) {
    if (blk.tid() < s) reduce[blk.tid()] += reduce[blk.tid() + s];
    blk.sync();
  }
  return reduce[0];
}

template <class Block>
DINO_OPT_PHOTO_HD void tile_pointwise(const Block& blk, const TileJob& j) {
  const int tw = tile_width(j), th = tile_height(j);
  for (int i = blk.tid(); i < tw * th; i += blk.size()) {
    const int y = j.y0 + i / tw, x = j.x0 + i % tw;
    float r, g, b;
    load_pixel(j, y, x, r, g, b);
    pm::apply_ops(j.ops, 0, pm::kMaxOps, j.mean, r, g, b);
    store_pixel(j, y, x, r, g, b);
  }
}

// `shared` holds kSharedFloats floats.
template <class Block>
DINO_OPT_PHOTO_HD void tile_blur(const Block& blk, const TileJob& j, float* shared) {
  const int tw = tile_width(j), th = tile_height(j);
  float* stage = shared;                  // S[c][row][col], row stride kChunkCols
  float* columns = stage + kStageFloats;  // V[c][j][col]
  float* tile = columns + kColumnFloats;  // O[c][j][x]
  constexpr int kStagePlane = kChunkRows * kChunkCols;
  constexpr int kColumnPlane = kTileH * kChunkCols;
  constexpr int kTilePlane = kTileH * kTileW;

  for (int i = blk.tid(); i < kTileFloats; i += blk.size()) tile[i] = 0.0f;
  // Padded coordinates: rows [y0 - ry, y0 + th + ry), columns [x0 - rx, x0 + tw + rx);
  // a padded coordinate reads the image at reflect(coordinate).
  const int col_begin = j.x0 - j.rx, col_end = j.x0 + tw + j.rx;
  const int row_begin = j.y0 - j.ry, row_end = j.y0 + th + j.ry;
  for (int c0 = col_begin; c0 < col_end; c0 += kChunkCols) {
    const int cw = col_end - c0 < kChunkCols ? col_end - c0 : kChunkCols;
    for (int i = blk.tid(); i < kColumnFloats; i += blk.size()) columns[i] = 0.0f;
    for (int r0 = row_begin; r0 < row_end; r0 += kChunkRows) {
      const int rh = row_end - r0 < kChunkRows ? row_end - r0 : kChunkRows;
      blk.sync();  // the previous chunk's readers of S (and the zeroing of V, O) are done
      // A: stage the chunk's pixels after the colour ops.
      for (int i = blk.tid(); i < rh * cw; i += blk.size()) {
        const int pr = i / cw, pc = i % cw;
        float r, g, b;
        load_pixel(j, pm::reflect(r0 + pr, j.h), pm::reflect(c0 + pc, j.w), r, g, b);
        pm::apply_ops(j.ops, 0, pm::kMaxOps, j.mean, r, g, b);
        const int at = pr * kChunkCols + pc;
        stage[at] = r;
        stage[kStagePlane + at] = g;
        stage[2 * kStagePlane + at] = b;
      }
      blk.sync();
      // B: vertical taps of the staged rows into V, in ascending row order.
      for (int i = blk.tid(); i < th * cw; i += blk.size()) {
        const int row = i / cw, pc = i % cw;
        const int y = j.y0 + row;
        const int q_lo = y - j.ry > r0 ? y - j.ry : r0;
        const int q_hi = y + j.ry < r0 + rh - 1 ? y + j.ry : r0 + rh - 1;
        for (int c = 0; c < 3; ++c) {
          float acc = columns[c * kColumnPlane + row * kChunkCols + pc];
          const float* s = stage + c * kStagePlane + pc;
          for (int q = q_lo; q <= q_hi; ++q)
            acc += j.taps_y[q - y + j.ry] * s[(q - r0) * kChunkCols];
          columns[c * kColumnPlane + row * kChunkCols + pc] = acc;
        }
      }
    }
    blk.sync();
    // C: horizontal taps of this chunk's columns into O, in ascending order.
    for (int i = blk.tid(); i < th * tw; i += blk.size()) {
      const int row = i / tw, tx = i % tw;
      const int x = j.x0 + tx;
      const int q_lo = x - j.rx > c0 ? x - j.rx : c0;
      const int q_hi = x + j.rx < c0 + cw - 1 ? x + j.rx : c0 + cw - 1;
      for (int c = 0; c < 3; ++c) {
        float acc = tile[c * kTilePlane + row * kTileW + tx];
        const float* v = columns + c * kColumnPlane + row * kChunkCols;
        for (int q = q_lo; q <= q_hi; ++q) acc += j.taps_x[q - x + j.rx] * v[q - c0];
        tile[c * kTilePlane + row * kTileW + tx] = acc;
      }
    }
    blk.sync();  // V is zeroed next
  }
  // D: solarise, normalise, store.
  for (int i = blk.tid(); i < th * tw; i += blk.size()) {
    const int row = i / tw, tx = i % tw;
    const int at = row * kTileW + tx;
    store_pixel(j, j.y0 + row, j.x0 + tx, tile[at], tile[kTilePlane + at],
                tile[2 * kTilePlane + at]);
  }
}

// The main launch's work for one tile: blur path or pointwise path.
template <class Block>
DINO_OPT_PHOTO_HD void tile_main(const Block& blk, const TileJob& j, float* shared) {
  if (j.rx > 0 || j.ry > 0) {
    tile_blur(blk, j, shared);
  } else {
    tile_pointwise(blk, j);
  }
}

// A batch as both launches see it. Launch 1 (prologue) runs prologue_block
// for every (crop, tile) block: per-tile gray sums of crops with contrast and
// the blur taps of crops with blur (block of tile 0). Launch 2 runs
// main_block for every (crop, tile) block. Block b is tile b % tiles of crop
// b / tiles.
struct BatchArgs {
  const uint8_t* images = nullptr;  // [n, h, w, 3]
  const float* params = nullptr;    // [n, kPhotometricParamCount]
  int64_t n = 0;
  int h = 0, w = 0;
  float norm_mean[3] = {};
  float norm_std[3] = {};
  void* out = nullptr;  // element (0, 0, 0, 0) of [n, 3, h, w]
  loader::OutputType out_type = loader::OutputType::kFloat32;
  int64_t stride_n = 0, stride_c = 0, stride_y = 0, stride_x = 0;  // in elements
  double* tile_sums = nullptr;                                     // [n, tiles]
  float* taps = nullptr;                                           // [n, taps_per_crop(h, w)]
};

DINO_OPT_PHOTO_HD int tiles_per_crop(const BatchArgs& a) { return tiles_x(a.w) * tiles_y(a.h); }

DINO_OPT_PHOTO_HD TileJob make_job(const BatchArgs& a, int64_t crop, int tile,
                                   const pm::CropOps& ops) {
  TileJob j;
  j.src = a.images + crop * a.h * a.w * 3;
  j.h = a.h;
  j.w = a.w;
  j.ops = ops;
  j.ry = pm::blur_radius(ops.blur_sigma, a.h);
  j.rx = pm::blur_radius(ops.blur_sigma, a.w);
  j.taps_y = a.taps + crop * taps_per_crop(a.h, a.w);
  j.taps_x = j.taps_y + 2 * j.ry + 1;
  tile_origin(tile, a.w, j.x0, j.y0);
  for (int c = 0; c < 3; ++c) {
    j.norm_mean[c] = a.norm_mean[c];
    j.norm_std[c] = a.norm_std[c];
  }
  const int64_t elem = a.out_type == loader::OutputType::kFloat32 ? 4 : 2;
  j.out = static_cast<char*>(a.out) + crop * a.stride_n * elem;
  j.out_type = a.out_type;
  j.stride_c = a.stride_c;
  j.stride_y = a.stride_y;
  j.stride_x = a.stride_x;
  return j;
}

// `reduce` holds blk.size() doubles.
template <class Block>
DINO_OPT_PHOTO_HD void prologue_block(const Block& blk, const BatchArgs& a, int64_t block,
                                      double* reduce) {
  const int tiles = tiles_per_crop(a);
  const int64_t crop = block / tiles;
  const int tile = static_cast<int>(block % tiles);
  const pm::CropOps ops = pm::decode_crop_ops(a.params + crop * loader::kPhotometricParamCount);
  const TileJob j = make_job(a, crop, tile, ops);
  if (tile == 0 && blk.tid() == 0 && (j.rx > 0 || j.ry > 0)) {
    // Writes through the job's (const) tap pointers: the main launch reads them.
    float* taps = a.taps + crop * taps_per_crop(a.h, a.w);
    pm::gaussian_weights(ops.blur_sigma, j.ry, taps);
    pm::gaussian_weights(ops.blur_sigma, j.rx, taps + 2 * j.ry + 1);
  }
  if (ops.contrast_at >= 0) {
    const double sum = tile_gray_sum(blk, j, reduce);
    if (blk.tid() == 0) a.tile_sums[crop * tiles + tile] = sum;
  }
}

// `shared` holds kMainSharedFloats floats.
template <class Block>
DINO_OPT_PHOTO_HD void main_block(const Block& blk, const BatchArgs& a, int64_t block,
                                  float* shared) {
  const int tiles = tiles_per_crop(a);
  const int64_t crop = block / tiles;
  const int tile = static_cast<int>(block % tiles);
  const pm::CropOps ops = pm::decode_crop_ops(a.params + crop * loader::kPhotometricParamCount);
  TileJob j = make_job(a, crop, tile, ops);
  if (ops.contrast_at >= 0) {
    // One thread sums the tile sums; the others read the mean it shares.
    if (blk.tid() == 0) {
      shared[kSharedFloats] = crop_mean(a.tile_sums + crop * tiles, tiles, a.h, a.w);
    }
    blk.sync();
    j.mean = shared[kSharedFloats];
  }
  tile_main(blk, j, shared);
}

}  // namespace dino_opt::photometric_detail
