#pragma once
// Plain types shared by the EMA kernels; free of torch headers so that the
// CUDA kernel file includes nothing heavy.
#include <cstdint>

namespace dino_opt::ema_detail {

// One dense pair of equal layout, viewed as a flat span of `numel` elements.
struct FlatPair {
  void* teacher;
  const void* student;
  int64_t numel;
};

// The two scalars every kernel uses, m and 1 - m, computed once on the host so
// that the CPU and CUDA kernels compute bit-identical results.
struct Coefficients {
  double keep;
  double mix_in;
};

}  // namespace dino_opt::ema_detail
