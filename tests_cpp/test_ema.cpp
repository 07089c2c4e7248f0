// The CPU kernel of dino_opt::ema_update_ against a scalar loop, through the
// public C++ API (the dispatcher), plus its argument checks.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "ops/ema.h"
#include "test_util.h"

namespace {

// Scalar reference in the kernel's arithmetic: accumulate in float (double for
// a double teacher), m*t + w*s with separate roundings, round once to T.
at::Tensor scalar_reference(const at::Tensor& teacher, const at::Tensor& student, double m) {
  at::Tensor t = teacher.contiguous().clone();
  at::Tensor s = student.contiguous();
  const bool wide = t.scalar_type() == at::kDouble;
  at::Tensor t64 = t.to(at::kDouble).flatten();
  at::Tensor s64 = s.to(at::kDouble).flatten();
  auto tp = t64.accessor<double, 1>();
  auto sp = s64.accessor<double, 1>();
  const float mf = static_cast<float>(m), wf = static_cast<float>(1.0 - m);
  for (int64_t i = 0; i < t64.numel(); ++i) {
    if (wide) {
      tp[i] = tp[i] * m + sp[i] * (1.0 - m);
    } else {
      const float a = static_cast<float>(tp[i]) * mf;
      const float b = static_cast<float>(sp[i]) * wf;
      tp[i] = static_cast<double>(a + b);
    }
  }
  return t64.view(t.sizes()).to(t.scalar_type());
}

void expect_equal(const at::Tensor& got, const at::Tensor& want, const std::string& what) {
  ASSERT_EQ(got.sizes(), want.sizes()) << what;
  EXPECT_TRUE(at::equal(got.contiguous(), want.contiguous()))
      << what << ": max |diff| = "
      << (got.to(at::kDouble) - want.to(at::kDouble)).abs().max().item<double>();
}

const std::vector<at::ScalarType> kFloatTypes = {at::kDouble, at::kFloat, at::kBFloat16, at::kHalf};

TEST(EmaCpu, MatchesScalarLoopForEveryDtypePairAndSize) {
  at::manual_seed(0);
  const std::vector<int64_t> sizes = {0,  1,  2,  3,    7,     15,    16,
                                      17, 31, 33, 1000, 32768, 32769, 100003};
  for (auto tt : kFloatTypes) {
    for (auto st : kFloatTypes) {
      std::vector<at::Tensor> teacher, student, want;
      for (int64_t n : sizes) {
        teacher.push_back(at::randn({n}, at::kDouble).to(tt));
        student.push_back(at::randn({n}, at::kDouble).to(st));
        want.push_back(scalar_reference(teacher.back(), student.back(), 0.9964));
      }
      dino_opt::ema_update_(teacher, student, 0.9964);
      for (size_t i = 0; i < sizes.size(); ++i) {
        expect_equal(teacher[i], want[i],
                     std::string(c10::toString(tt)) + "<-" + c10::toString(st) +
                         " n=" + std::to_string(sizes[i]));
      }
    }
  }
}

TEST(EmaCpu, UnalignedStorageOffsets) {
  at::manual_seed(1);
  at::Tensor t_base = at::randn({4099});
  at::Tensor s_base = at::randn({4099}).to(at::kBFloat16);
  for (int64_t offset = 1; offset < 4; ++offset) {
    at::Tensor t = t_base.narrow(0, offset, 4093);
    at::Tensor s = s_base.narrow(0, 3 - offset, 4093);
    at::Tensor want = scalar_reference(t, s, 0.5);
    dino_opt::ema_update_({t}, {s}, 0.5);
    expect_equal(t, want, "offset " + std::to_string(offset));
  }
}

TEST(EmaCpu, NonContiguousAndChannelsLast) {
  at::manual_seed(2);
  // Transposed teacher, contiguous student: computed through temporaries.
  at::Tensor t = at::randn({64, 48}).t();
  at::Tensor s = at::randn({48, 64});
  at::Tensor want = scalar_reference(t, s, 0.99);
  dino_opt::ema_update_({t}, {s}, 0.99);
  expect_equal(t, want, "transposed teacher");
  // Both channels_last: dense with equal strides, updated in place as flat spans.
  at::Tensor tc = at::randn({8, 3, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor sc = at::randn({8, 3, 5, 5}).contiguous(at::MemoryFormat::ChannelsLast);
  at::Tensor want_c = scalar_reference(tc, sc, 0.7);
  const void* before = tc.data_ptr();
  dino_opt::ema_update_({tc}, {sc}, 0.7);
  EXPECT_EQ(tc.data_ptr(), before);
  expect_equal(tc, want_c, "channels_last");
  // Strided student slice.
  at::Tensor ts = at::randn({100});
  at::Tensor ss = at::randn({200}).slice(0, 0, 200, 2);
  at::Tensor want_s = scalar_reference(ts, ss, 0.25);
  dino_opt::ema_update_({ts}, {ss}, 0.25);
  expect_equal(ts, want_s, "strided student");
}

TEST(EmaCpu, MomentumEndpoints) {
  at::Tensor t = at::randn({1000});
  at::Tensor s = at::randn({1000});
  at::Tensor t0 = t.clone();
  dino_opt::ema_update_({t}, {s}, 1.0);
  expect_equal(t, t0, "m=1 keeps the teacher");
  dino_opt::ema_update_({t}, {s}, 0.0);
  expect_equal(t, s, "m=0 copies the student");
}

TEST(EmaCpu, EmptyListsAreFine) { EXPECT_NO_THROW(dino_opt::ema_update_({}, {}, 0.996)); }

using dino_opt::testing::expect_error;

TEST(EmaCpu, ClearErrors) {
  at::Tensor a = at::zeros({4}), b = at::zeros({4});
  expect_error(
      [&] {
        dino_opt::ema_update_({a, a}, {b}, 0.9);
      },
      "teacher has 2 tensors but student has 1");
  expect_error([&] { dino_opt::ema_update_({a}, {b}, 1.5); }, "momentum must be in [0, 1]");
  expect_error([&] { dino_opt::ema_update_({a}, {b}, -0.1); }, "momentum must be in [0, 1]");
  expect_error([&] { dino_opt::ema_update_({a}, {b}, std::nan("")); },
               "momentum must be in [0, 1]");
  expect_error([&] { dino_opt::ema_update_({a}, {at::zeros({5})}, 0.9); },
               "teacher[0] has shape [4] but student[0] has shape [5]");
  expect_error([&] { dino_opt::ema_update_({at::zeros({4}, at::kLong)}, {b}, 0.9); },
               "teacher[0] has dtype Long");
  expect_error([&] { dino_opt::ema_update_({a}, {at::zeros({4}, at::kInt)}, 0.9); },
               "student[0] has dtype Int");
  expect_error([&] { dino_opt::ema_update_({at::zeros({4}).requires_grad_()}, {b}, 0.9); },
               "teacher[0] requires grad");
  expect_error([&] { dino_opt::ema_update_({at::zeros({1}).expand({4})}, {b}, 0.9); },
               "overlapping memory");
}

}  // namespace
