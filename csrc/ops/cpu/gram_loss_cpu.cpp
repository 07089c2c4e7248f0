// CPU kernels of dino_opt::gram_loss and gram_loss_backward: the shared driver
// (ops/gram_loss.cpp: ATen matmuls on chunks and tiles) with this tile kernel.
//
// Tile kernel: spans of kSpan similarities over at::parallel_for, each
// leaving its sum of squared differences in float64; the spans add up in a
// fixed order, so the result does not depend on the thread count.
#include <ATen/Dispatch.h>
#include <ATen/Parallel.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops/gram_loss.h"

namespace dino_opt {
namespace {

using gram_loss_detail::Clamp;

constexpr int64_t kSpan = 16384;

template <typename A>
double span_sum(A* s, const A* t, int64_t n, Clamp clamp, bool coeff) {
  double total = 0;
  for (int64_t i = 0; i < n; ++i) {
    A slope;
    const A d = gram_loss_detail::gram_diff(s[i], t[i], clamp, &slope);
    total += static_cast<double>(d) * static_cast<double>(d);
    if (coeff) s[i] = d * slope;
  }
  return total;
}

at::Tensor tile_cpu(at::Tensor& s, const at::Tensor& t, Clamp clamp, bool coeff) {
  TORCH_CHECK(s.is_contiguous() && t.is_contiguous() && s.sizes() == t.sizes(),
              "gram_loss: internal error, tiles must be contiguous and of one shape");
  const int64_t n = s.numel(), spans = (n + kSpan - 1) / kSpan;
  std::vector<double> parts(spans, 0.0);
  AT_DISPATCH_FLOATING_TYPES(s.scalar_type(), "gram_loss_tile", [&] {
    scalar_t* sp = s.data_ptr<scalar_t>();
    const scalar_t* tp = t.const_data_ptr<scalar_t>();
    at::parallel_for(0, spans, 1, [&](int64_t begin, int64_t end) {
      for (int64_t i = begin; i < end; ++i) {
        const int64_t at = i * kSpan;
        parts[i] = span_sum(sp + at, tp + at, std::min(kSpan, n - at), clamp, coeff);
      }
    });
  });
  double total = 0;
  for (const double p : parts) total += p;
  return at::scalar_tensor(total, at::kDouble);
}

at::Tensor gram_loss_cpu(const at::Tensor& student, const at::Tensor& teacher, bool apply_norm,
                         bool remove_neg, bool remove_only_teacher_neg, int64_t form) {
  const gram_loss_detail::Inputs in = gram_loss_detail::prepare(
      "gram_loss", student, teacher, apply_norm, remove_neg, remove_only_teacher_neg, form);
  return gram_loss_detail::forward(in, &tile_cpu);
}

at::Tensor gram_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& student,
                                  const at::Tensor& teacher, bool apply_norm, bool remove_neg,
                                  bool remove_only_teacher_neg, int64_t form) {
  const gram_loss_detail::Inputs in =
      gram_loss_detail::prepare("gram_loss_backward", student, teacher, apply_norm, remove_neg,
                                remove_only_teacher_neg, form);
  return gram_loss_detail::backward(grad, in, &tile_cpu).view(student.sizes());
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) {
  m.impl("gram_loss", &gram_loss_cpu);
  m.impl("gram_loss_backward", &gram_loss_backward_cpu);
}

}  // namespace dino_opt
