// DINO loss inner loops over one chunk of K, once per instruction set (see
// kernel_table.h). Vector main loops with a scalar tail computing the same
// expressions; arithmetic in float (double for float64 inputs).
#include <algorithm>
#include <cmath>
#include <limits>

#include "ops/cpu/vectorized/isa_common.h"
#include "ops/dino_loss_math.h"
#include "ops/ibot_loss_math.h"

namespace dino_opt::cpu::CPU_CAPABILITY {
namespace {

using dino_loss_detail::kMaxTeacherViews;

// x = (row - center) * inv_temp (center may be null) at i, as a vector and as
// a scalar: every pass that needs a logit computes it with these, so a chunk's
// max, its sum of exp and the exp against the log-sum-exp in the backward all
// see the same number (built with -ffp-contract=off: no pass fuses the product).
template <typename T>
struct Logits {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const T* row;
  const A* center;
  A inv;

  V vec(int64_t i) const {
    V x = load_acc(row + i);
    if (center) x = x - V::loadu(center + i);
    return x * V(inv);
  }
  A scalar(int64_t i) const {
    A x = static_cast<A>(row[i]);
    if (center) x -= center[i];
    return x * inv;
  }
  // The max over [0, n), or NaN. Four independent maxima (no chain of
  // dependent instructions), each by max_unordered, which may drop a NaN: every
  // caller then takes exp(x - max) over the chunk, where the NaN comes back
  // (exp_nonpositive propagates it), except where the max is -inf (no mass, no
  // sum): that chunk is searched for a NaN.
  A max(int64_t n) const {
    constexpr A neg_inf = -std::numeric_limits<A>::infinity();
    constexpr int64_t step = 4 * V::size();
    const int64_t n4 = n - n % step, vn = n - n % V::size();
    V m0(neg_inf), m1(neg_inf), m2(neg_inf), m3(neg_inf);
    for (int64_t i = 0; i < n4; i += step) {
      prefetch_ahead(row + i);
      prefetch_ahead(row + i + step / 2);
      m0 = max_unordered(m0, vec(i));
      m1 = max_unordered(m1, vec(i + V::size()));
      m2 = max_unordered(m2, vec(i + 2 * V::size()));
      m3 = max_unordered(m3, vec(i + 3 * V::size()));
    }
    V vmax = max_unordered(max_unordered(m0, m1), max_unordered(m2, m3));
    for (int64_t i = n4; i < vn; i += V::size()) vmax = max_unordered(vmax, vec(i));
    A m = at::vec::vec_reduce_all<A>([](V& a, V& b) { return at::vec::maximum(a, b); }, vmax);
    for (int64_t i = vn; i < n; ++i) {
      const A x = scalar(i);
      m = (x > m || std::isnan(x)) ? x : m;
    }
    if (m == neg_inf) {
      for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(scalar(i))) return std::numeric_limits<A>::quiet_NaN();
      }
    }
    return m;
  }
};

template <typename A>
A reduce_sum(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>([](Vectorized<A>& a, Vectorized<A>& b) { return a + b; }, v);
}

template <typename T>
void row_stats(const void* row_, const void* center_, int64_t n, double inv_temp, double* max_out,
               double* sum_out) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const Logits<T> x{static_cast<const T*>(row_), static_cast<const A*>(center_),
                    static_cast<A>(inv_temp)};
  const int64_t vn = n - n % V::size();
  // Max first (a NaN reaches the max or the sum: Logits::max), then the sum of exponentials.
  const A m = x.max(n);
  if (m == -std::numeric_limits<A>::infinity()) {  // no mass in this chunk (exp(x - m) is NaN)
    *max_out = m;
    *sum_out = 0;
    return;
  }
  V vsum(A(0));
  for (int64_t i = 0; i < vn; i += V::size()) vsum = vsum + exp_nonpositive(x.vec(i) - V(m));
  A s = reduce_sum(vsum);
  for (int64_t i = vn; i < n; ++i) s += std::exp(x.scalar(i) - m);
  *max_out = m;
  *sum_out = s;
}

// chunk_forward's part for one student view, with NT teacher views (0: any
// number, n_teacher) so that the accumulators stay in registers.
template <typename T, int NT>
void student_chunk(const Logits<T>& x, const acc_t<T>* weights, int64_t n_teacher, int64_t n,
                   double* max_out, double* sum_out, double* dots) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  const int64_t nt = NT > 0 ? NT : n_teacher;
  const int64_t vn = n - n % V::size();
  const A m = x.max(n);
  const A shift = ibot_loss_detail::chunk_shift(m);
  const A m_exp = m == neg_inf ? A(0) : m;  // a chunk of -inf: its sum is 0, set below
  V vsum(A(0));
  V acc[NT > 0 ? NT : kMaxTeacherViews];
  for (int64_t t = 0; t < nt; ++t) acc[t] = V(A(0));
  for (int64_t i = 0; i < vn; i += V::size()) {
    const V xi = x.vec(i);
    vsum = vsum + exp_nonpositive(xi - V(m_exp));
    const V d = xi - V(shift);
    for (int64_t t = 0; t < nt; ++t) {
      acc[t] = cross_entropy_fmadd(V::loadu(weights + t * n + i), d, acc[t]);
    }
  }
  A s = reduce_sum(vsum);
  for (int64_t i = vn; i < n; ++i) s += std::exp(x.scalar(i) - m_exp);
  for (int64_t t = 0; t < nt; ++t) {
    A total = reduce_sum(acc[t]);
    for (int64_t i = vn; i < n; ++i) {
      const A w = weights[t * n + i];
      total += w * dino_loss_detail::log_factor(w, x.scalar(i) - shift);
    }
    dots[t] = total;
  }
  *max_out = m;
  *sum_out = m == neg_inf ? 0 : s;
}

// One sample's chunk in one read of its logits. Teacher view t: its max m_t,
// w_t[k] = exp(u_t[k] - m_t) into scratch [T][n] (0 where m_t is -inf: no
// mass) and their sum. Student view v: its max m_v and sum of exp, and for
// every teacher view dots[v * T + t] = sum_k w_t[k] * (x_v[k] - shift_v),
// shift_v = chunk_shift(m_v), no term where w_t[k] = 0 (0 log 0 = 0).
template <typename T>
void chunk_forward(const void* const* teacher, int64_t n_teacher, const void* const* student,
                   int64_t n_student, const void* center_, int64_t n, double inv_ts, double inv_tt,
                   double* teacher_max, double* teacher_sum, double* student_max,
                   double* student_sum, double* dots, void* scratch) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  constexpr A neg_inf = -std::numeric_limits<A>::infinity();
  A* weights = static_cast<A*>(scratch);
  const A* center = static_cast<const A*>(center_);
  const int64_t vn = n - n % V::size();
  for (int64_t t = 0; t < n_teacher; ++t) {
    const Logits<T> u{static_cast<const T*>(teacher[t]), center, static_cast<A>(inv_tt)};
    A* w = weights + t * n;
    const A m = u.max(n);
    A s = 0;
    if (m == neg_inf) {
      std::fill(w, w + n, A(0));
    } else {
      V vsum(A(0));
      for (int64_t i = 0; i < vn; i += V::size()) {
        const V e = exp_nonpositive(u.vec(i) - V(m));
        e.store(w + i);
        vsum = vsum + e;
      }
      s = reduce_sum(vsum);
      for (int64_t i = vn; i < n; ++i) {
        w[i] = std::exp(u.scalar(i) - m);
        s += w[i];
      }
    }
    teacher_max[t] = m;
    teacher_sum[t] = s;
  }
  for (int64_t v = 0; v < n_student; ++v) {
    const Logits<T> x{static_cast<const T*>(student[v]), nullptr, static_cast<A>(inv_ts)};
    auto part = n_teacher == 2   ? &student_chunk<T, 2>
                : n_teacher == 1 ? &student_chunk<T, 1>
                                 : &student_chunk<T, 0>;
    part(x, weights, n_teacher, n, &student_max[v], &student_sum[v], dots + v * n_teacher);
  }
}

// p_t[k] = exp((teacher_t[k] - center[k]) * inv_tt - lse_t[t]) into scratch [T][n].
template <typename T>
void teacher_probs(const void* const* teacher, int64_t n_teacher, const acc_t<T>* center, int64_t n,
                   acc_t<T> inv_tt, const double* lse_t, acc_t<T>* probs) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const int64_t vn = n - n % V::size();
  for (int64_t t = 0; t < n_teacher; ++t) {
    const T* row = static_cast<const T*>(teacher[t]);
    A* p = probs + t * n;
    const A lse = static_cast<A>(lse_t[t]);
    for (int64_t i = 0; i < vn; i += V::size()) {
      exp_nonpositive((load_acc(row + i) - V::loadu(center + i)) * V(inv_tt) - V(lse)).store(p + i);
    }
    for (int64_t i = vn; i < n; ++i) {
      p[i] = std::exp((static_cast<A>(row[i]) - center[i]) * inv_tt - lse);
    }
  }
}

template <typename T>
void student_grad(const void* const* teacher, int64_t n_teacher, const void* const* student,
                  void* const* grad, int64_t n_student, int64_t view_offset, const void* center_,
                  int64_t n, double inv_ts, double inv_tt, const double* lse_t, const double* lse_s,
                  double scale, void* scratch) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  A* probs = static_cast<A*>(scratch);
  teacher_probs<T>(teacher, n_teacher, static_cast<const A*>(center_), n, static_cast<A>(inv_tt),
                   lse_t, probs);
  const int64_t vn = n - n % V::size();
  const A inv = static_cast<A>(inv_ts);
  const A g = static_cast<A>(scale * inv_ts);
  // The scaled targets of a view paired with every teacher view (u >= n_teacher,
  // most views), summed once: all[k] = g * sum_t p_t[k], in the order of the
  // per-view sum below.
  A* all = probs + n_teacher * n;
  for (int64_t i = 0; i < vn; i += V::size()) {
    V sum(A(0));
    for (int64_t t = 0; t < n_teacher; ++t) sum = sum + V::loadu(probs + t * n + i);
    (sum * V(g)).store(all + i);
  }
  for (int64_t v = 0; v < n_student; ++v) {
    const T* row = static_cast<const T*>(student[v]);
    T* out = static_cast<T*>(grad[v]);
    const A lse = static_cast<A>(lse_s[v]);
    const int64_t u = v + view_offset;  // this view's place among all student views
    const A weight = static_cast<A>(n_teacher - (u < n_teacher ? 1 : 0));
    const V wg(weight * g);
    for (int64_t i = 0; i < vn; i += V::size()) {
      V targets(A(0));  // g * the sum of the teacher probabilities paired with view v
      if (u >= n_teacher) {
        targets = V::loadu(all + i);
      } else {
        for (int64_t t = 0; t < n_teacher; ++t) {
          if (t != u) targets = targets + V::loadu(probs + t * n + i);
        }
        targets = targets * V(g);
      }
      prefetch_ahead(row + i);
      const V q = exp_nonpositive(load_acc(row + i) * V(inv) - V(lse));
      store_acc(out + i, at::vec::fmsub(q, wg, targets));
    }
    for (int64_t i = vn; i < n; ++i) {
      A targets = 0;
      for (int64_t t = 0; t < n_teacher; ++t) {
        if (t != u) targets += probs[t * n + i];
      }
      const A q = std::exp(static_cast<A>(row[i]) * inv - lse);
      out[i] = static_cast<T>(std::fma(q, weight * g, -(targets * g)));
    }
  }
}

}  // namespace

void fill_dino_loss_kernels(KernelTable& table) {
  for_each_float_type([&]<typename T>(int index) {
    table.dino_loss[index] = DinoLossKernels{&row_stats<T>, &chunk_forward<T>, &student_grad<T>};
  });
}

}  // namespace dino_opt::cpu::CPU_CAPABILITY
