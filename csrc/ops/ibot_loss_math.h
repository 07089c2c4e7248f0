#pragma once
// The iBOT patch loss bookkeeping shared by the CPU and CUDA kernels (host
// and device): the shape of a call and the combination of a row's chunk
// partials into its log-sum-exp and cross-entropy. Free of torch headers.
#include <cstdint>

#include "ops/dino_loss_math.h"

namespace dino_opt::ibot_loss_detail {

// student [rows, dim]; targets [target_rows, dim]; student row n takes target
// row n % target_rows (target_rows == rows for iBOT's masked patches).
struct Shape {
  int64_t rows;         // N
  int64_t target_rows;  // M, dividing N (0 only when N is 0)
  int64_t dim;          // K

  DINO_OPT_HD int64_t target_row(int64_t row) const { return row % target_rows; }
};

// The shift a chunk's cross-entropy partial is taken against: its max logit,
// or 0 where that is not finite (a chunk of -inf holds no mass, and inf or
// NaN must reach the result rather than cancel to NaN at the shift).
template <typename A>
DINO_OPT_HD inline A chunk_shift(A chunk_max) {
  return chunk_max - chunk_max == A(0) ? chunk_max : A(0);
}

// A row's sum_k t_k * log_softmax(x)_k from per-chunk partials, and its
// log-sum-exp in *lse_out. For chunk i: maxes[i] and sums[i] as for
// combine_lse, dots[i] = sum over the chunk of t_k * (x_k - chunk_shift(maxes[i]))
// (0 log 0 = 0: no term where t_k = 0) and tsums[i] = sum over the chunk of t_k.
// Each chunk adds dots[i] + tsums[i] * (shift_i - lse): taken against the
// chunk's max, the terms never cancel at the scale of the logits.
template <typename A>
DINO_OPT_HD inline A row_cross_entropy(const A* maxes, const A* sums, const A* dots, const A* tsums,
                                       int64_t count, A* lse_out) {
  const A lse = dino_loss_detail::combine_lse(maxes, sums, count);
  A total = 0;
  for (int64_t i = 0; i < count; ++i) {
    total +=
        dots[i] + tsums[i] * dino_loss_detail::log_factor(tsums[i], chunk_shift(maxes[i]) - lse);
  }
  *lse_out = lse;
  return total;
}

}  // namespace dino_opt::ibot_loss_detail
