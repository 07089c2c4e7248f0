// DINO loss inner loops over one chunk of K, once per instruction set (see
// kernel_table.h). Vector main loops with a scalar tail computing the same
// expressions; arithmetic in float (double for float64 inputs).
#include <cmath>
#include <limits>

#include "ops/cpu/vectorized/isa_common.h"
#include "ops/dino_loss_math.h"

namespace dino_opt::cpu::CPU_CAPABILITY {
namespace {

using dino_loss_detail::kMaxTeacherViews;

template <typename T>
void row_stats(const void* row_, const void* center_, int64_t n, double inv_temp, double* max_out,
               double* sum_out) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  const T* row = static_cast<const T*>(row_);
  const A* center = static_cast<const A*>(center_);
  const A inv = static_cast<A>(inv_temp);
  const int64_t vn = n - n % V::size();
  auto value_v = [&](int64_t i) {
    V x = load_acc(row + i);
    if (center) x = x - V::loadu(center + i);
    return x * V(inv);
  };
  auto value = [&](int64_t i) {
    A x = static_cast<A>(row[i]);
    if (center) x -= center[i];
    return x * inv;
  };
  // Max first (NaN propagates through maximum), then the sum of exponentials.
  V vmax(-std::numeric_limits<A>::infinity());
  for (int64_t i = 0; i < vn; i += V::size()) vmax = at::vec::maximum(vmax, value_v(i));
  A m = at::vec::vec_reduce_all<A>([](V& a, V& b) { return at::vec::maximum(a, b); }, vmax);
  for (int64_t i = vn; i < n; ++i) {
    const A x = value(i);
    m = (x > m || std::isnan(x)) ? x : m;
  }
  if (m == -std::numeric_limits<A>::infinity()) {  // no mass in this chunk (exp(x - m) is NaN)
    *max_out = m;
    *sum_out = 0;
    return;
  }
  V vsum(A(0));
  for (int64_t i = 0; i < vn; i += V::size()) vsum = vsum + exp_nonpositive(value_v(i) - V(m));
  A s = at::vec::vec_reduce_all<A>([](V& a, V& b) { return a + b; }, vsum);
  for (int64_t i = vn; i < n; ++i) s += std::exp(value(i) - m);
  *max_out = m;
  *sum_out = s;
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
void pair_dots(const void* const* teacher, int64_t n_teacher, const void* const* student,
               int64_t n_student, const void* center_, int64_t n, double inv_ts, double inv_tt,
               const double* lse_t, const double* lse_s, double* out, void* scratch) {
  using A = acc_t<T>;
  using V = Vectorized<A>;
  A* probs = static_cast<A*>(scratch);
  teacher_probs<T>(teacher, n_teacher, static_cast<const A*>(center_), n, static_cast<A>(inv_tt),
                   lse_t, probs);
  const int64_t vn = n - n % V::size();
  const A inv = static_cast<A>(inv_ts);
  for (int64_t v = 0; v < n_student; ++v) {
    const T* row = static_cast<const T*>(student[v]);
    const A lse = static_cast<A>(lse_s[v]);
    V acc[kMaxTeacherViews];
    for (int64_t t = 0; t < n_teacher; ++t) acc[t] = V(A(0));
    for (int64_t i = 0; i < vn; i += V::size()) {
      const V log_q = load_acc(row + i) * V(inv) - V(lse);  // student log-softmax
      for (int64_t t = 0; t < n_teacher; ++t) {
        acc[t] = cross_entropy_fmadd(V::loadu(probs + t * n + i), log_q, acc[t]);
      }
    }
    for (int64_t t = 0; t < n_teacher; ++t) {
      A total = at::vec::vec_reduce_all<A>([](V& a, V& b) { return a + b; }, acc[t]);
      for (int64_t i = vn; i < n; ++i) {
        const A p = probs[t * n + i];
        total += p * dino_loss_detail::log_factor(p, static_cast<A>(row[i]) * inv - lse);
      }
      out[v * n_teacher + t] = total;
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
  for (int64_t v = 0; v < n_student; ++v) {
    const T* row = static_cast<const T*>(student[v]);
    T* out = static_cast<T*>(grad[v]);
    const A lse = static_cast<A>(lse_s[v]);
    const int64_t u = v + view_offset;  // this view's place among all student views
    const A weight = static_cast<A>(n_teacher - (u < n_teacher ? 1 : 0));
    for (int64_t i = 0; i < vn; i += V::size()) {
      V targets(A(0));  // sum of the teacher probabilities paired with view v
      for (int64_t t = 0; t < n_teacher; ++t) {
        if (t != u) targets = targets + V::loadu(probs + t * n + i);
      }
      const V q = exp_nonpositive(load_acc(row + i) * V(inv) - V(lse));
      store_acc(out + i, (V(weight) * q - targets) * V(g));
    }
    for (int64_t i = vn; i < n; ++i) {
      A targets = 0;
      for (int64_t t = 0; t < n_teacher; ++t) {
        if (t != u) targets += probs[t * n + i];
      }
      const A q = std::exp(static_cast<A>(row[i]) * inv - lse);
      out[i] = static_cast<T>((weight * q - targets) * g);
    }
  }
}

}  // namespace

void fill_dino_loss_kernels(KernelTable& table) {
  for_each_float_type([&]<typename T>(int index) {
    table.dino_loss[index] = DinoLossKernels{&row_stats<T>, &pair_dots<T>, &student_grad<T>};
  });
}

}  // namespace dino_opt::cpu::CPU_CAPABILITY
