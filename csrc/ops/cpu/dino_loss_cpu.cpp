// CPU kernels of dino_opt::dino_loss and dino_loss_backward. Work is split
// into (row or sample) x (chunk of K) items for at::parallel_for; partial
// results are combined in a fixed order, so the result does not depend on the
// thread count. Inner loops come from the instruction-set kernel table.
#include <ATen/Parallel.h>
#include <ATen/ops/empty.h>
#include <ATen/ops/from_blob.h>
#include <ATen/ops/scalar_tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "ops/cpu/buffer_pool.h"
#include "ops/cpu/denormals.h"
#include "ops/cpu/kernel_table.h"
#include "ops/dino_loss.h"
#include "ops/dtype.h"
#include "ops/ibot_loss_math.h"

namespace dino_opt {
namespace {

using dino_loss_detail::Shape;

constexpr int64_t kChunk = 4096;

// Inputs laid out for the kernels: contiguous rows, the center as a
// contiguous [K] tensor of the accumulation dtype.
struct Inputs {
  at::Tensor student, teacher, center;
  Shape shape;
  int64_t n_chunks;
  const cpu::DinoLossKernels* kernels;

  const char* student_row(int64_t row, int64_t k0) const {
    return static_cast<const char*>(student.const_data_ptr()) +
           (row * shape.dim + k0) * student.element_size();
  }
  const char* teacher_row(int64_t row, int64_t k0) const {
    return static_cast<const char*>(teacher.const_data_ptr()) +
           (row * shape.dim + k0) * teacher.element_size();
  }
  const char* center_at(int64_t k0) const {
    return static_cast<const char*>(center.const_data_ptr()) + k0 * center.element_size();
  }
  int64_t chunk_size(int64_t c) const { return std::min(kChunk, shape.dim - c * kChunk); }
};

Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& teacher,
               const at::Tensor& center, double student_temp, double teacher_temp,
               dino_loss_detail::Views views, const at::Tensor& student_lse = {},
               const at::Tensor& teacher_lse = {}) {
  dino_loss_detail::Inputs in = dino_loss_detail::prepare(
      op, student, teacher, center, student_temp, teacher_temp, views, student_lse, teacher_lse);
  return Inputs{std::move(in.student),
                std::move(in.teacher),
                std::move(in.center),
                in.shape,
                (in.shape.dim + kChunk - 1) / kChunk,
                &cpu::kernels().dino_loss[float_index(student.scalar_type(), op, "student")]};
}

// Per-sample views of one chunk: pointers to each view's row and its log-sum-exp.
struct SampleChunk {
  const void* teacher[dino_loss_detail::kMaxTeacherViews];
  double lse_t[dino_loss_detail::kMaxTeacherViews];
  std::vector<const void*> student;
  std::vector<double> lse_s;
  int64_t k0, n;

  SampleChunk(const Inputs& in, int64_t b, int64_t c, const double* lse_student,
              const double* lse_teacher)
      : student(in.shape.student_views), lse_s(in.shape.student_views) {
    const Shape& s = in.shape;
    k0 = c * kChunk;
    n = in.chunk_size(c);
    for (int64_t t = 0; t < s.teacher_views; ++t) {
      teacher[t] = in.teacher_row(t * s.batch + b, k0);
      lse_t[t] = lse_teacher[t * s.batch + b];
    }
    for (int64_t v = 0; v < s.student_views; ++v) {
      student[v] = in.student_row(v * s.batch + b, k0);
      lse_s[v] = lse_student[v * s.batch + b];
    }
  }
};

std::vector<double> to_doubles(const at::Tensor& t) {
  const at::Tensor d = t.reshape({-1}).to(at::kDouble).contiguous();
  return std::vector<double>(d.const_data_ptr<double>(), d.const_data_ptr<double>() + d.numel());
}

// Forward: one (sample, chunk of K) item reads the chunk of each of the
// sample's teacher and student rows once from memory (the chunk stays in cache
// between the max and the exp) and leaves per row its chunk max and sum of exp,
// and per (student view, teacher view) the dot of the teacher's unnormalised
// weights w = exp(u - m_t) with x - shift (kernel_table.h, chunk_forward). With
// every row's log-sum-exp combined from its chunks, chunk c adds to
// sum_k p_t[k] * log q_v[k] the term
//   exp(m_t - lse_t) * (dot + sum_k w[k] * (shift - lse_v)),
// as the iBOT loss combines its rows (ibot_loss_detail::row_cross_entropy).
std::tuple<at::Tensor, at::Tensor, at::Tensor> dino_loss_cpu(
    const at::Tensor& student_in, const at::Tensor& teacher_in, const at::Tensor& center_in,
    double student_temp, double teacher_temp, int64_t ncrops, int64_t view_offset,
    int64_t total_views) {
  const Inputs in = prepare("dino_loss", student_in, teacher_in, center_in, student_temp,
                            teacher_temp, {ncrops, view_offset, total_views});
  const Shape& s = in.shape;
  const int64_t S = s.student_views, T = s.teacher_views, C = in.n_chunks;
  const int64_t student_rows = S * s.batch;
  const int64_t rows = student_rows + T * s.batch;
  const int64_t pairs = S * T;
  // maxes and sums by row then chunk (row < student_rows: student row), dots by
  // (sample, chunk) item then pair.
  std::vector<double> maxes(rows * C), sums(rows * C), dots(s.batch * C * pairs);
  at::parallel_for(0, s.batch * C, 1, [&](int64_t begin, int64_t end) {
    const cpu::FlushDenormals flush;          // see denormals.h
    std::vector<double> scratch(T * kChunk);  // wide enough for any acc type
    std::vector<const void*> student(S);
    const void* teacher[dino_loss_detail::kMaxTeacherViews];
    double t_max[dino_loss_detail::kMaxTeacherViews], t_sum[dino_loss_detail::kMaxTeacherViews];
    std::vector<double> s_max(S), s_sum(S);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / C, c = item % C, k0 = c * kChunk;
      for (int64_t t = 0; t < T; ++t) teacher[t] = in.teacher_row(t * s.batch + b, k0);
      for (int64_t v = 0; v < S; ++v) student[v] = in.student_row(v * s.batch + b, k0);
      in.kernels->chunk_forward(teacher, T, student.data(), S, in.center_at(k0), in.chunk_size(c),
                                1.0 / student_temp, 1.0 / teacher_temp, t_max, t_sum, s_max.data(),
                                s_sum.data(), &dots[item * pairs], scratch.data());
      for (int64_t v = 0; v < S; ++v) {
        maxes[(v * s.batch + b) * C + c] = s_max[v];
        sums[(v * s.batch + b) * C + c] = s_sum[v];
      }
      for (int64_t t = 0; t < T; ++t) {
        maxes[(student_rows + t * s.batch + b) * C + c] = t_max[t];
        sums[(student_rows + t * s.batch + b) * C + c] = t_sum[t];
      }
    }
  });
  std::vector<double> lse(rows);
  for (int64_t r = 0; r < rows; ++r) {
    lse[r] = dino_loss_detail::combine_lse(&maxes[r * C], &sums[r * C], C);
  }
  double total = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t c = 0; c < C; ++c) {
      const double* d = &dots[(b * C + c) * pairs];
      for (int64_t v = 0; v < S; ++v) {
        const int64_t sr = (v * s.batch + b) * C + c;
        const double shift_minus_lse =
            ibot_loss_detail::chunk_shift(maxes[sr]) - lse[v * s.batch + b];
        for (int64_t t = 0; t < T; ++t) {
          if (!s.paired(t, v)) continue;
          const int64_t tr = student_rows + t * s.batch + b;
          const double w_sum = sums[tr * C + c];
          total += std::exp(maxes[tr * C + c] - lse[tr]) *
                   (d[v * T + t] + w_sum * dino_loss_detail::log_factor(w_sum, shift_minus_lse));
        }
      }
    }
  }
  const auto options = student_in.options().dtype(dino_loss_detail::acc_dtype(student_in));
  // Copies (from_blob over the local vector), and two separate tensors: outputs must not alias.
  auto lse_tensor = [&](int64_t begin, int64_t count) {
    return at::from_blob(lse.data() + begin, {count}, at::kDouble).to(options, false, true);
  };
  return {at::scalar_tensor(-total / static_cast<double>(s.loss_terms() * s.batch), options),
          lse_tensor(0, student_rows), lse_tensor(student_rows, rows - student_rows)};
}

at::Tensor dino_loss_backward_cpu(const at::Tensor& grad, const at::Tensor& student_in,
                                  const at::Tensor& teacher_in, const at::Tensor& center_in,
                                  const at::Tensor& student_lse, const at::Tensor& teacher_lse,
                                  double student_temp, double teacher_temp, int64_t ncrops,
                                  int64_t view_offset, int64_t total_views) {
  const Inputs in =
      prepare("dino_loss_backward", student_in, teacher_in, center_in, student_temp, teacher_temp,
              {ncrops, view_offset, total_views}, student_lse, teacher_lse);
  TORCH_CHECK(grad.numel() == 1, "dino_loss_backward: grad must be a scalar, got shape ",
              grad.sizes());
  const Shape& s = in.shape;
  const std::vector<double> lse_student = to_doubles(student_lse);
  const std::vector<double> lse_teacher = to_doubles(teacher_lse);
  const double scale = grad.item<double>() / static_cast<double>(s.loss_terms() * s.batch);
  at::Tensor grad_student = cpu::pooled_empty_like(in.student);  // see buffer_pool.h
  char* out = static_cast<char*>(grad_student.data_ptr());
  at::parallel_for(0, s.batch * in.n_chunks, 1, [&](int64_t begin, int64_t end) {
    const cpu::FlushDenormals flush;  // see denormals.h
    std::vector<double> scratch((s.teacher_views + 1) * kChunk);
    std::vector<void*> grad_rows(s.student_views);
    for (int64_t item = begin; item < end; ++item) {
      const int64_t b = item / in.n_chunks;
      const SampleChunk sc(in, b, item % in.n_chunks, lse_student.data(), lse_teacher.data());
      for (int64_t v = 0; v < s.student_views; ++v) {
        grad_rows[v] = out + ((v * s.batch + b) * s.dim + sc.k0) * grad_student.element_size();
      }
      in.kernels->student_grad(sc.teacher, s.teacher_views, sc.student.data(), grad_rows.data(),
                               s.student_views, s.view_offset, in.center_at(sc.k0), sc.n,
                               1.0 / student_temp, 1.0 / teacher_temp, sc.lse_t, sc.lse_s.data(),
                               scale, scratch.data());
    }
  });
  return grad_student;
}

}  // namespace

TORCH_LIBRARY_IMPL(dino_opt, CPU, m) {
  m.impl("dino_loss", &dino_loss_cpu);
  m.impl("dino_loss_backward", &dino_loss_backward_cpu);
}

}  // namespace dino_opt
