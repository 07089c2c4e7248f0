// The CPU kernels of dino_opt::dino_loss / dino_loss_backward against a scalar
// double-precision loop over (teacher view, student view) pairs, and the
// argument checks, through the public C++ API.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/dino_loss.h"
#include "test_util.h"

namespace {

struct Reference {
  double loss;
  std::vector<double> grad;  // d loss / d student, row-major [S*B, K]
};

// Straight from the definition: mean over pairs (t, v != t) and samples of
// -sum_k softmax((T_t - c)/tt)_k * log_softmax(S_v/ts)_k.
Reference scalar_reference(const at::Tensor& student_in, const at::Tensor& teacher_in,
                           const at::Tensor& center_in, double ts, double tt, int64_t S) {
  const at::Tensor student = student_in.to(at::kDouble).contiguous();
  const at::Tensor teacher = teacher_in.to(at::kDouble).contiguous();
  const at::Tensor center = center_in.to(at::kDouble).reshape({-1}).contiguous();
  const int64_t K = student.size(1), B = student.size(0) / S, T = teacher.size(0) / B;
  const double* s = student.const_data_ptr<double>();
  const double* t = teacher.const_data_ptr<double>();
  const double* c = center.const_data_ptr<double>();
  auto softmax = [K](std::vector<double> x) {
    double m = x[0];
    for (double v : x) m = std::max(m, v);
    double z = 0;
    for (double& v : x) z += (v = std::exp(v - m));
    for (double& v : x) v /= z;
    return x;
  };
  Reference ref{0.0, std::vector<double>(S * B * K, 0.0)};
  int64_t terms = 0;
  for (int64_t iq = 0; iq < T; ++iq) {
    for (int64_t v = 0; v < S; ++v) {
      if (v == iq) continue;
      ++terms;
      for (int64_t b = 0; b < B; ++b) {
        std::vector<double> u(K), x(K);
        for (int64_t k = 0; k < K; ++k) {
          u[k] = (t[(iq * B + b) * K + k] - c[k]) / tt;
          x[k] = s[(v * B + b) * K + k] / ts;
        }
        const std::vector<double> p = softmax(u), q = softmax(x);
        for (int64_t k = 0; k < K; ++k) {
          ref.loss -= p[k] * std::log(q[k]) / B;
          ref.grad[(v * B + b) * K + k] += (q[k] - p[k]) / (ts * B);
        }
      }
    }
  }
  ref.loss /= terms;
  for (double& g : ref.grad) g /= terms;
  return ref;
}

void expect_matches(int64_t S, int64_t T, int64_t B, int64_t K, at::ScalarType dtype, double tol) {
  at::manual_seed(S * 1000 + T * 100 + B * 10 + K);
  const at::Tensor student = at::randn({S * B, K}, at::kDouble).to(dtype);
  const at::Tensor teacher = at::randn({T * B, K}, at::kDouble).to(dtype);
  const at::Tensor center = 0.1 * at::randn({1, K});
  const Reference ref = scalar_reference(student, teacher, center, 0.1, 0.04, S);
  const auto [loss, student_lse, teacher_lse] =
      dino_opt::dino_loss(student, teacher, center, 0.1, 0.04, S);
  const std::string what = "S=" + std::to_string(S) + " T=" + std::to_string(T) +
                           " B=" + std::to_string(B) + " K=" + std::to_string(K) + " " +
                           c10::toString(dtype);
  EXPECT_NEAR(loss.item<double>(), ref.loss, tol * std::max(1.0, std::abs(ref.loss))) << what;
  const at::Tensor grad =
      dino_opt::dino_loss_backward(at::scalar_tensor(1.0, loss.options()), student, teacher, center,
                                   student_lse, teacher_lse, 0.1, 0.04, S);
  ASSERT_EQ(grad.scalar_type(), dtype) << what;
  const at::Tensor g = grad.to(at::kDouble).contiguous();
  double scale = 0, err = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    scale = std::max(scale, std::abs(ref.grad[i]));
    err = std::max(err, std::abs(g.const_data_ptr<double>()[i] - ref.grad[i]));
  }
  // Floor: the gradient of one confidently wrong sample, 1 / (ts * n_terms * B).
  const double floor = 1.0 / (0.1 * static_cast<double>(T * (S - 1) * B));
  EXPECT_LE(err, tol * std::max(scale, floor)) << what;
}

TEST(DinoLossCpu, MatchesScalarLoopInFloat64) {
  for (auto [S, T] : {std::pair{2, 1}, {2, 2}, {4, 2}, {6, 1}, {10, 2}}) {
    for (auto [B, K] : {std::pair{1, 1}, {3, 7}, {2, 4097}, {1, 9000}}) {
      expect_matches(S, T, B, K, at::kDouble, 1e-10);
    }
  }
}

TEST(DinoLossCpu, MatchesScalarLoopInFloat32AndBFloat16) {
  expect_matches(10, 2, 3, 4100, at::kFloat, 1e-5);
  expect_matches(4, 2, 2, 33, at::kFloat, 1e-5);
  expect_matches(6, 2, 2, 1000, at::kBFloat16, 1e-2);
  expect_matches(6, 2, 2, 1000, at::kHalf, 1e-2);
}

using dino_opt::testing::expect_error;

TEST(DinoLossCpu, ClearErrors) {
  const at::Tensor s = at::randn({8, 16}), t = at::randn({4, 16}), c = at::zeros({16});
  auto call = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& cc, double ts,
                 double tt, int64_t n) { dino_opt::dino_loss(a, b, cc, ts, tt, n); };
  expect_error(
      [&] {
        call(s, at::randn({4, 15}), c, 0.1, 0.04, 4);
      },
      "student has out_dim 16 but teacher has out_dim 15");
  expect_error(
      [&] {
        call(at::randn({9, 16}), t, c, 0.1, 0.04, 4);
      },
      "not a positive multiple of ncrops=4");
  expect_error(
      [&] {
        call(s, at::randn({10, 16}), c, 0.1, 0.04, 4);
      },
      "teacher has 5 views but the student only 4");
  expect_error([&] { call(s, t, at::zeros({15}), 0.1, 0.04, 4); }, "center must have shape [16]");
  expect_error([&] { call(s, t, c, 0.0, 0.04, 4); }, "student_temp must be positive");
  expect_error([&] { call(s, t, c, 0.1, std::nan(""), 4); }, "teacher_temp must be positive");
  expect_error([&] { call(s, t.to(at::kHalf), c, 0.1, 0.04, 4); },
               "teacher has dtype Half but student has dtype Float");
  expect_error([&] { call(s, t, c, 0.1, 0.04, 1); }, "must be at least 2");
  expect_error(
      [&] {
        call(at::randn({18, 4}), at::randn({18, 4}), at::zeros({4}), 0.1, 0.04, 18);
      },
      "at most 8 teacher views");
}

}  // namespace
