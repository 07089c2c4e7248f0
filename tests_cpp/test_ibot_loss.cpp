// The CPU kernels of dino_opt::ibot_loss / ibot_loss_backward against a
// scalar double-precision loop, their independence of the thread count, and
// the argument checks, through the public C++ API.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "ops/ibot_loss.h"
#include "test_util.h"

namespace {

struct Reference {
  double loss;
  std::vector<double> grad;  // d loss / d student, row-major [N, K]
};

// Straight from the definition: -sum_n w_n sum_k T[n % M, k] log_softmax(S[n] / ts)_k,
// gradient w_n (rowsum(T[n % M]) softmax(S[n] / ts) - T[n % M]) / ts.
Reference scalar_reference(const at::Tensor& student_in, const at::Tensor& targets_in,
                           const at::Tensor& weights_in, double ts) {
  const at::Tensor s = student_in.to(at::kDouble).contiguous();
  const at::Tensor t = targets_in.to(at::kDouble).contiguous();
  const at::Tensor w = weights_in.to(at::kDouble).contiguous();
  const int64_t N = s.size(0), M = t.size(0), K = s.size(1);
  Reference ref{0.0, std::vector<double>(N * K, 0.0)};
  for (int64_t n = 0; n < N; ++n) {
    const double* x = s.const_data_ptr<double>() + n * K;
    const double* p = t.const_data_ptr<double>() + (n % M) * K;
    const double wn = w.const_data_ptr<double>()[n];
    double m = -INFINITY, z = 0, psum = 0;
    for (int64_t k = 0; k < K; ++k) m = std::max(m, x[k] / ts);
    for (int64_t k = 0; k < K; ++k) z += std::exp(x[k] / ts - m);
    const double lse = m + std::log(z);
    for (int64_t k = 0; k < K; ++k) psum += p[k];
    for (int64_t k = 0; k < K; ++k) {
      if (p[k] != 0) ref.loss -= wn * p[k] * (x[k] / ts - lse);
      ref.grad[n * K + k] = wn * (psum * std::exp(x[k] / ts - lse) - p[k]) / ts;
    }
  }
  return ref;
}

struct Case {
  int64_t N, M, K;
  at::ScalarType student, targets;
  double tol;
};

std::string describe(const Case& c) {
  return "N=" + std::to_string(c.N) + " M=" + std::to_string(c.M) + " K=" + std::to_string(c.K) +
         " " + c10::toString(c.student) + "/" + c10::toString(c.targets);
}

// Random logits and targets: softmax rows with some exact zeros, plus a row
// of unnormalised (sum != 1) targets.
std::vector<at::Tensor> make_inputs(const Case& c) {
  at::manual_seed(c.N * 1000 + c.M * 100 + c.K);
  const at::Tensor student = (3 * at::randn({c.N, c.K}, at::kDouble)).to(c.student);
  at::Tensor targets = at::softmax(at::randn({c.M, c.K}, at::kDouble) / 0.3, 1);
  targets = targets * (at::rand({c.M, c.K}, at::kDouble) > 0.2);
  targets.select(0, 0).mul_(1.7);
  const at::Tensor weights = at::rand({c.N}) + 0.1;
  return {student, targets.to(c.targets), weights};
}

void expect_matches(const Case& c) {
  const auto in = make_inputs(c);
  const Reference ref = scalar_reference(in[0], in[1], in[2], 0.1);
  const auto [loss, lse] = dino_opt::ibot_loss(in[0], in[1], in[2], 0.1);
  EXPECT_NEAR(loss.item<double>(), ref.loss, c.tol * std::max(1.0, std::abs(ref.loss)))
      << describe(c);
  const at::Tensor grad = dino_opt::ibot_loss_backward(at::scalar_tensor(1.0, loss.options()),
                                                       in[0], in[1], in[2], lse, 0.1);
  ASSERT_EQ(grad.scalar_type(), c.student) << describe(c);
  const at::Tensor g = grad.to(at::kDouble).contiguous();
  double scale = 0, err = 0;
  for (int64_t i = 0; i < g.numel(); ++i) {
    scale = std::max(scale, std::abs(ref.grad[i]));
    err = std::max(err, std::abs(g.const_data_ptr<double>()[i] - ref.grad[i]));
  }
  EXPECT_LE(err, c.tol * scale) << describe(c);
}

TEST(IbotLossCpu, MatchesScalarLoopInFloat64) {
  for (auto [N, M] : {std::pair{1, 1}, {6, 6}, {6, 3}, {8, 1}}) {
    for (int64_t K : {1, 7, 4097, 9000}) {
      expect_matches({N, M, K, at::kDouble, at::kDouble, 1e-11});
    }
  }
}

TEST(IbotLossCpu, MatchesScalarLoopInLowerPrecision) {
  expect_matches({12, 4, 4100, at::kFloat, at::kFloat, 1e-5});
  expect_matches({5, 5, 33, at::kFloat, at::kFloat, 1e-5});
  for (at::ScalarType half : {at::kBFloat16, at::kHalf}) {
    expect_matches({6, 3, 1000, half, half, 1e-2});
    expect_matches({6, 3, 4099, half, at::kFloat, 1e-2});
  }
  expect_matches({4, 2, 300, at::kDouble, at::kFloat, 1e-11});  // float32 targets, float64 student
}

TEST(IbotLossCpu, ResultDoesNotDependOnThreadCount) {
  const auto in = make_inputs({6, 3, 3 * 4096 + 11, at::kFloat, at::kFloat, 0});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto [loss1, lse1] = dino_opt::ibot_loss(in[0], in[1], in[2], 0.1);
  const at::Tensor grad1 =
      dino_opt::ibot_loss_backward(at::scalar_tensor(0.7), in[0], in[1], in[2], lse1, 0.1);
  at::set_num_threads(std::max(3, threads));
  const auto [loss3, lse3] = dino_opt::ibot_loss(in[0], in[1], in[2], 0.1);
  const at::Tensor grad3 =
      dino_opt::ibot_loss_backward(at::scalar_tensor(0.7), in[0], in[1], in[2], lse3, 0.1);
  at::set_num_threads(threads);
  EXPECT_TRUE(at::equal(loss1, loss3));
  EXPECT_TRUE(at::equal(lse1, lse3));
  EXPECT_TRUE(at::equal(grad1, grad3));
}

TEST(IbotLossCpu, NoRows) {
  const at::Tensor s = at::zeros({0, 5}), t = at::zeros({0, 5}), w = at::zeros({0});
  const auto [loss, lse] = dino_opt::ibot_loss(s, t, w, 0.1);
  EXPECT_EQ(loss.item<double>(), 0.0);
  EXPECT_EQ(lse.numel(), 0);
  EXPECT_EQ(dino_opt::ibot_loss_backward(at::scalar_tensor(1.0), s, t, w, lse, 0.1).sizes(),
            s.sizes());
}

using dino_opt::testing::expect_error;

TEST(IbotLossCpu, ClearErrors) {
  const at::Tensor s = at::randn({6, 16}), t = at::rand({3, 16}), w = at::ones({6});
  auto call = [](const at::Tensor& a, const at::Tensor& b, const at::Tensor& c, double temp) {
    dino_opt::ibot_loss(a, b, c, temp);
  };
  expect_error([&] { call(at::randn({6}), t, w, 0.1); },
               "student must be 2-D [N, K], got shape [6]");
  expect_error(
      [&] {
        call(s, at::rand({3, 15}), w, 0.1);
      },
      "student has K=16 but targets has K=15");
  expect_error(
      [&] {
        call(s, at::rand({4, 16}), w, 0.1);
      },
      "student has 6 rows, which is not a multiple of the 4 rows of targets");
  expect_error([&] { call(s, t, at::ones({5}), 0.1); }, "weights must have shape [6]");
  expect_error([&] { call(s, t, w, 0.0); }, "student_temp must be positive");
  expect_error([&] { call(s.to(at::kLong), t, w, 0.1); }, "student has dtype Long");
  expect_error([&] { call(s, t.to(at::kHalf), w, 0.1); },
               "targets has dtype Half; expected the student's dtype (Float) or float32");
  expect_error([&] { call(s, t, w.to(at::kDouble), 0.1); },
               "weights has dtype Double; expected float32");
  const auto [loss, lse] = dino_opt::ibot_loss(s, t, w, 0.1);
  expect_error([&] { dino_opt::ibot_loss_backward(loss, s, t, w, lse.narrow(0, 0, 5), 0.1); },
               "student_lse must have shape [6]");
  expect_error([&] { dino_opt::ibot_loss_backward(loss, s, t, w, lse.to(at::kDouble), 0.1); },
               "student_lse has dtype Double; expected Float");
}

}  // namespace
