#pragma once
// The DINO loss bookkeeping shared by the CPU and CUDA kernels (host and
// device): view counts, per-view weights and the log-sum-exp of chunk
// partials. Free of torch headers.
#include <cmath>
#include <cstdint>
#include <limits>

#ifdef __CUDACC__
#define DINO_OPT_HD __host__ __device__
#else
#define DINO_OPT_HD
#endif

namespace dino_opt::dino_loss_detail {

// Rows are view-major: row v * batch + b is view v of sample b. Teacher view t
// is paired with every student view except view t. A call may hold only some
// of the student views: views [view_offset, view_offset + student_views) of
// total_views; its loss and gradient are then that part of the whole loss
// (the same normalisation), so the parts of a step add up to its loss.
struct Shape {
  int64_t student_views;  // S: student views in this call (ncrops)
  int64_t teacher_views;  // T
  int64_t batch;          // B
  int64_t dim;            // K
  int64_t view_offset;    // the first student view of this call, among all
  int64_t total_views;    // student views of the whole step (S when the call holds all)

  // Number of (teacher view, student view) pairs of the whole step: T * (total - 1).
  DINO_OPT_HD int64_t loss_terms() const { return teacher_views * (total_views - 1); }
  // Whether teacher view t and this call's student view v make a pair.
  DINO_OPT_HD bool paired(int64_t t, int64_t v) const { return t != v + view_offset; }
  // Teacher views paired with this call's student view v.
  DINO_OPT_HD int64_t teacher_weight(int64_t v) const {
    return teacher_views - (v + view_offset < teacher_views ? 1 : 0);
  }
};

// At most this many teacher views (DINO uses 2): per-thread state is sized by it.
constexpr int64_t kMaxTeacherViews = 8;

// log(sum_i sums[i] * exp(maxes[i])) from partials (max_i, sum_i) of chunks,
// each sum_i = sum over the chunk of exp(x - max_i). A chunk of -inf logits
// (max_i = -inf) holds no mass and adds nothing, as in torch.logsumexp; a row
// of -inf only gives -inf. NaN and +inf propagate.
template <typename A>
DINO_OPT_HD inline A combine_lse(const A* maxes, const A* sums, int64_t count) {
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  A m = maxes[0];
  for (int64_t i = 1; i < count; ++i) m = (maxes[i] > m || maxes[i] != maxes[i]) ? maxes[i] : m;
  if (m == neg_inf) return m;
  A s = 0;
  for (int64_t i = 0; i < count; ++i) {
    if (maxes[i] != neg_inf) s += sums[i] * exp(maxes[i] - m);
  }
  return m + log(s);
}

// The log-probability factor of a cross-entropy term p * log q, with
// 0 * log 0 = 0: where the target probability is exactly 0 (underflowed, or
// a teacher logit of -inf) the factor is 0, so the term adds nothing even
// where the student's log-probability is -inf. `acc += p * log_factor(p, x)`
// still contracts to one fused multiply-add. NaN propagates.
template <typename A>
DINO_OPT_HD inline A log_factor(A p, A log_q) {
  return p == A(0) ? A(0) : log_q;
}

}  // namespace dino_opt::dino_loss_detail
