// iBOT loss inner loops over one chunk of K, once per instruction set (see
// kernel_table.h). S is the student's element type, T the targets' (S, or
// float under a bfloat16/float16 student); arithmetic in float (double for
// float64). Vector main loops with a scalar tail computing the same expressions.
#include <cmath>

#include "ops/cpu/vectorized/isa_common.h"
#include "ops/dino_loss_math.h"

namespace dino_opt::cpu::CPU_CAPABILITY {
namespace {

template <typename S>
using V = Vectorized<acc_t<S>>;

template <typename A>
A reduce_sum(const Vectorized<A>& v) {
  return at::vec::vec_reduce_all<A>([](Vectorized<A>& a, Vectorized<A>& b) { return a + b; }, v);
}

template <typename S, typename T>
void target_dot(const void* targets_, const void* student_, int64_t n, double inv_temp,
                double shift_, double* dot_out, double* tsum_out) {
  using A = acc_t<S>;
  static_assert(std::is_same_v<A, acc_t<T>>, "targets and student share the accumulation type");
  const T* targets = static_cast<const T*>(targets_);
  const S* student = static_cast<const S*>(student_);
  const A inv = static_cast<A>(inv_temp), shift = static_cast<A>(shift_);
  const int64_t vn = n - n % V<S>::size();
  V<S> dot(A(0)), tsum(A(0));
  for (int64_t i = 0; i < vn; i += V<S>::size()) {
    const V<S> p = load_acc(targets + i);
    dot = cross_entropy_fmadd(p, load_acc(student + i) * V<S>(inv) - V<S>(shift), dot);
    tsum = tsum + p;
  }
  A d = reduce_sum(dot), t = reduce_sum(tsum);
  for (int64_t i = vn; i < n; ++i) {
    const A p = static_cast<A>(targets[i]);
    d += p * dino_loss_detail::log_factor(p, static_cast<A>(student[i]) * inv - shift);
    t += p;
  }
  *dot_out = d;
  *tsum_out = t;
}

template <typename T>
void target_sum(const void* targets_, int64_t n, double* tsum_out) {
  using A = acc_t<T>;
  const T* targets = static_cast<const T*>(targets_);
  const int64_t vn = n - n % V<T>::size();
  V<T> tsum(A(0));
  for (int64_t i = 0; i < vn; i += V<T>::size()) tsum = tsum + load_acc(targets + i);
  A t = reduce_sum(tsum);
  for (int64_t i = vn; i < n; ++i) t += static_cast<A>(targets[i]);
  *tsum_out = t;
}

template <typename S, typename T>
void student_grad(const void* targets_, const void* student_, void* grad_, int64_t n,
                  double inv_temp, double lse_, double tsum_, double scale_) {
  using A = acc_t<S>;
  const T* targets = static_cast<const T*>(targets_);
  const S* student = static_cast<const S*>(student_);
  S* grad = static_cast<S*>(grad_);
  const A inv = static_cast<A>(inv_temp), lse = static_cast<A>(lse_);
  const A tsum = static_cast<A>(tsum_), scale = static_cast<A>(scale_);
  const int64_t vn = n - n % V<S>::size();
  for (int64_t i = 0; i < vn; i += V<S>::size()) {
    const V<S> q = exp_nonpositive(load_acc(student + i) * V<S>(inv) - V<S>(lse));
    store_acc(grad + i, (V<S>(tsum) * q - load_acc(targets + i)) * V<S>(scale));
  }
  for (int64_t i = vn; i < n; ++i) {
    const A q = std::exp(static_cast<A>(student[i]) * inv - lse);
    grad[i] = static_cast<S>((tsum * q - static_cast<A>(targets[i])) * scale);
  }
}

template <typename S, typename T>
IbotLossKernels ibot_kernels() {
  return IbotLossKernels{&target_dot<S, T>, &target_sum<T>, &student_grad<S, T>};
}

}  // namespace

void fill_ibot_loss_kernels(KernelTable& table) {
  for_each_float_type([&]<typename S>(int index) {
    table.ibot_loss[index][kSameTargets] = ibot_kernels<S, S>();
    // float32 targets: under a half student; float64 students take float64 targets.
    using T = std::conditional_t<std::is_same_v<S, double>, double, float>;
    table.ibot_loss[index][kFloatTargets] = ibot_kernels<S, T>();
  });
}

}  // namespace dino_opt::cpu::CPU_CAPABILITY
