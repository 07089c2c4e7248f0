#pragma once
#include <c10/core/ScalarType.h>

#include "ops/kernel_types.h"

namespace dino_opt {

// Index of a floating dtype (float64, float32, bfloat16, float16) for kernel
// tables and launchers; throws naming `op` and `what` for any other dtype.
FloatIndex float_index(at::ScalarType dtype, const char* op, const char* what);

}  // namespace dino_opt
