#pragma once
// EMA teacher update: t <- m*t + (1-m)*s for every (teacher, student) pair.
#include <ATen/core/Tensor.h>

#include <functional>
#include <vector>

#include "ops/kernel_types.h"

namespace dino_opt {

// Public C++ API: calls the registered operator dino_opt::ema_update_ through
// the dispatcher, so the CPU or CUDA kernel is chosen by the tensors' device.
void ema_update_(at::TensorList teacher, at::TensorList student, double momentum);

namespace ema_detail {

Coefficients coefficients(double momentum);

// Checks every argument and throws c10::Error naming the offending tensor.
// `device_type` is the backend whose kernel is running.
void check_args(at::TensorList teacher, at::TensorList student, double momentum,
                c10::DeviceType device_type);

// Groups the pairs by (teacher dtype, student dtype) and calls `run` once per
// group with flat spans. Pairs whose layouts are not dense and identical are
// computed through contiguous temporaries that are copied back afterwards.
using GroupFn = std::function<void(at::ScalarType teacher_dtype, at::ScalarType student_dtype,
                                   const std::vector<FlatPair>& pairs)>;
void for_each_group(at::TensorList teacher, at::TensorList student, const GroupFn& run);

}  // namespace ema_detail
}  // namespace dino_opt
