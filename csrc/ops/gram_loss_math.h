#pragma once
// The Gram anchoring loss's elementwise rule, shared by the CPU and CUDA tile
// kernels (host and device). Free of torch headers.
#include <cstdint>

#include "ops/dino_loss_math.h"

namespace dino_opt::gram_loss_detail {

// Which similarities are clamped at 0 (dinov3's GramLoss options).
enum Clamp : int {
  kNoClamp = 0,       // d = s - t
  kClampBoth = 1,     // remove_neg: d = max(s, 0) - max(t, 0)
  kClampTeacher = 2,  // remove_only_teacher_neg: t < 0 -> t = 0, s as it is (dinov3 clamps
                      // the teacher first, so its mask of pairs where both are negative is empty)
};

// The difference d of one pair of similarities (student s, teacher t) and its
// slope dd/ds in *slope. A clamped student similarity (s < 0, set to 0) has
// slope 0; at s = 0 it is kept, as dinov3's `sim[sim < 0] = 0` keeps it.
template <typename A>
DINO_OPT_HD inline A gram_diff(A s, A t, int clamp, A* slope) {
  if (clamp == kNoClamp) {
    *slope = A(1);
    return s - t;
  }
  const bool clamp_student = s < A(0) && clamp == kClampBoth;
  const A kept_s = clamp_student ? A(0) : s;
  *slope = clamp_student ? A(0) : A(1);
  return kept_s - (t < A(0) ? A(0) : t);
}

}  // namespace dino_opt::gram_loss_detail
