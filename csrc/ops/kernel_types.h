#pragma once
// Plain types shared by the kernels of every backend; free of torch headers so
// that the CUDA kernel files and per-instruction-set CPU files include nothing heavy.
#include <cstdint>

namespace dino_opt {

// Index of a floating dtype in kernel tables and launchers.
enum FloatIndex : int { kF64 = 0, kF32 = 1, kBF16 = 2, kF16 = 3, kNumFloat = 4 };

namespace ema_detail {

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

}  // namespace ema_detail
}  // namespace dino_opt
