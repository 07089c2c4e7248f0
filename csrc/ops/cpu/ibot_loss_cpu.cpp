// CPU kernels of dino_opt::ibot_loss and ibot_loss_backward.
//
// Forward: (row x chunk of K) items over at::parallel_for; each reads its
// chunk of the student row and of the target row once from memory (the chunk
// stays in cache between the statistics and the dot) and leaves the chunk's
// max, sum of exp, target dot and target sum. Rows combine their chunks, and
// the loss its rows, in a fixed order: the result does not depend on the
// thread count.
// Backward: one row per item: its target sum is needed before its first
// gradient element, and a row's targets (256 KiB at K = 65536 in float32)
// stay in the L2 cache from the sum to the gradient, so they too are read
// from memory once. The sum is taken over the same chunks in the same order
// whatever the thread count.
#include <ATen/Parallel.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "ops/cpu/buffer_pool.h"
#include "ops/cpu/denormals.h"
#include "ops/cpu/kernel_table.h"
#include "ops/dino_loss.h"
#include "ops/dtype.h"
#include "ops/ibot_loss.h"

namespace dino_opt {
namespace {

using ibot_loss_detail::Shape;

constexpr int64_t kChunk = 4096;

struct Inputs {
  at::Tensor student, targets, weights;
  Shape shape;
  int64_t n_chunks;
  const cpu::DinoLossKernels* stats;  // row_stats: the chunk's max and sum of exp
  const cpu::IbotLossKernels* kernels;

  const char* student_at(int64_t row, int64_t k0) const {
    return static_cast<const char*>(student.const_data_ptr()) +
           (row * shape.dim + k0) * student.element_size();
  }
  const char* targets_at(int64_t row, int64_t k0) const {
    return static_cast<const char*>(targets.const_data_ptr()) +
           (shape.target_row(row) * shape.dim + k0) * targets.element_size();
  }
  int64_t chunk_size(int64_t c) const { return std::min(kChunk, shape.dim - c * kChunk); }
};

Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& targets,
               const at::Tensor& weights, double student_temp, const at::Tensor& student_lse = {}) {
  ibot_loss_detail::Inputs in =
      ibot_loss_detail::prepare(op, student, targets, weights, student_temp, student_lse);
  const FloatIndex dtype = float_index(student.scalar_type(), op, "student");
  const cpu::KernelTable& table = cpu::kernels();
  return Inputs{std::move(in.student),
                std::move(in.targets),
                std::move(in.weights),
                in.shape,
                (in.shape.dim + kChunk - 1) / kChunk,
                &table.dino_loss[dtype],
                &table.ibot_loss[dtype][in.float_targets ? cpu::kFloatTargets : cpu::kSameTargets]};
}

std::vector<double> to_doubles(const at::Tensor& t) {
  const at::Tensor d = t.reshape({-1}).to(at::kDouble).contiguous();
  return std::vector<double>(d.const_data_ptr<double>(), d.const_data_ptr<double>() + d.numel());
}

// Per (row, chunk) partials of the forward, item = row * n_chunks + chunk.
struct Partials {
  std::vector<double> maxes, sums, dots, tsums;
  explicit Partials(int64_t items) : maxes(items), sums(items), dots(items), tsums(items) {}
};

Partials chunk_partials(const Inputs& in, double inv_temp) {
  Partials p(in.shape.rows * in.n_chunks);
  at::parallel_for(0, in.shape.rows * in.n_chunks, 1, [&](int64_t begin, int64_t end) {
    const cpu::FlushDenormals flush;  // see denormals.h
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / in.n_chunks, k0 = (item % in.n_chunks) * kChunk;
      const int64_t n = in.chunk_size(item % in.n_chunks);
      const char* student = in.student_at(row, k0);
      in.stats->row_stats(student, nullptr, n, inv_temp, &p.maxes[item], &p.sums[item]);
      in.kernels->target_dot(in.targets_at(row, k0), student, n, inv_temp,
                             ibot_loss_detail::chunk_shift(p.maxes[item]), &p.dots[item],
                             &p.tsums[item]);
    }
  });
  return p;
}

std::tuple<at::Tensor, at::Tensor> ibot_loss_cpu(const at::Tensor& student,
                                                 const at::Tensor& targets,
                                                 const at::Tensor& weights, double student_temp) {
  const Inputs in = prepare("ibot_loss", student, targets, weights, student_temp);
  const Shape& s = in.shape;
  const Partials p = chunk_partials(in, 1.0 / student_temp);
  const std::vector<double> w = to_doubles(in.weights);
  std::vector<double> lse(s.rows);
  double total = 0;
  for (int64_t row = 0; row < s.rows; ++row) {
    const int64_t at = row * in.n_chunks;
    total += w[row] * ibot_loss_detail::row_cross_entropy(&p.maxes[at], &p.sums[at], &p.dots[at],
                                                          &p.tsums[at], in.n_chunks, &lse[row]);
  }
  const auto options = student.options().dtype(dino_loss_detail::acc_dtype(student));
  // A copy (from_blob over the local vector): the output must not alias it.
  return {at::scalar_tensor(0.0 - total, options),  // +0 for no rows
          at::from_blob(lse.data(), {s.rows}, at::kDouble).to(options, false, true)};
}

at::Tensor ibot_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& student,
                                  const at::Tensor& targets, const at::Tensor& weights,
                                  const at::Tensor& student_lse, double student_temp) {
  const Inputs in =
      prepare("ibot_loss_backward", student, targets, weights, student_temp, student_lse);
  TORCH_CHECK(grad.numel() == 1, "ibot_loss_backward: grad must be a scalar, got shape ",
              grad.sizes());
  const Shape& s = in.shape;
  const std::vector<double> lse = to_doubles(student_lse), w = to_doubles(in.weights);
  const double g = grad.item<double>(), inv = 1.0 / student_temp;
  at::Tensor grad_student = cpu::pooled_empty_like(in.student);  // see buffer_pool.h
  char* out = static_cast<char*>(grad_student.data_ptr());
  at::parallel_for(0, s.rows, 1, [&](int64_t begin, int64_t end) {
    const cpu::FlushDenormals flush;  // see denormals.h
    for (int64_t row = begin; row < end; ++row) {
      double tsum = 0;
      for (int64_t c = 0; c < in.n_chunks; ++c) {
        double part;
        in.kernels->target_sum(in.targets_at(row, c * kChunk), in.chunk_size(c), &part);
        tsum += part;
      }
      for (int64_t c = 0; c < in.n_chunks; ++c) {
        const int64_t k0 = c * kChunk;
        in.kernels->student_grad(in.targets_at(row, k0), in.student_at(row, k0),
                                 out + (row * s.dim + k0) * grad_student.element_size(),
                                 in.chunk_size(c), inv, lse[row], tsum, g * w[row] * inv);
      }
    }
  });
  return grad_student;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) {
  m.impl("ibot_loss", &ibot_loss_cpu);
  m.impl("ibot_loss_backward", &ibot_loss_backward_cpu);
}

}  // namespace dino_opt
