#pragma once
// Fused iBOT masked-patch cross-entropy: for every student row n (a masked
// patch token) the weighted cross-entropy between its target probabilities
// T[n % M] and log_softmax(S[n] / student_temp), without a [N, K] tensor of
// log-probabilities (docs/loss.md, "iBOT patch loss").
#include <ATen/core/Tensor.h>

#include <tuple>

#include "ops/ibot_loss_math.h"

namespace dino_opt {

// Public C++ API (dispatcher calls). Returns (loss, student_lse):
//   loss = -sum_n weights[n] * sum_k T[n % M, k] * log_softmax(S[n] / student_temp)_k,
// a scalar of the accumulation dtype (float64 for float64 students, else
// float32), and student_lse[n] = logsumexp(S[n] / student_temp), kept for the
// backward. student [N, K] float64/float32/bfloat16/float16; targets [M, K]
// with M dividing N, of the student's dtype or float32; weights [N] float32
// (or float64 for float64 students).
std::tuple<at::Tensor, at::Tensor> ibot_loss(const at::Tensor& student, const at::Tensor& targets,
                                             const at::Tensor& weights, double student_temp);

// Gradient of the loss w.r.t. the student (targets and weights get none):
//   grad * weights[n] * (rowsum(T[n % M]) * softmax(S[n] / student_temp) - T[n % M]) / student_temp
// in the student's dtype.
at::Tensor ibot_loss_backward(const at::Tensor& grad, const at::Tensor& student,
                              const at::Tensor& targets, const at::Tensor& weights,
                              const at::Tensor& student_lse, double student_temp);

namespace ibot_loss_detail {

// Checks the arguments, throwing c10::Error that names the argument and its
// shape, dtype or device; `student_lse` is checked only when defined (backward).
Shape check_args(const char* op, const at::Tensor& student, const at::Tensor& targets,
                 const at::Tensor& weights, double student_temp,
                 const at::Tensor& student_lse = {});

// The arguments as every kernel takes them, after check_args: contiguous rows,
// targets of the student's dtype or float32 (float64 for a float64 student),
// weights contiguous in the accumulation dtype.
struct Inputs {
  at::Tensor student, targets, weights;
  Shape shape;
  bool float_targets;  // targets are float32 under a bfloat16/float16 student
};
Inputs prepare(const char* op, const at::Tensor& student, const at::Tensor& targets,
               const at::Tensor& weights, double student_temp, const at::Tensor& student_lse = {});

}  // namespace ibot_loss_detail
}  // namespace dino_opt
