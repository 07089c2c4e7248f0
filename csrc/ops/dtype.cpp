#include "ops/dtype.h"

#include <c10/util/Exception.h>

namespace dino_opt {

FloatIndex float_index(at::ScalarType dtype, const char* op, const char* what) {
  switch (dtype) {
    case at::kDouble:
      return kF64;
    case at::kFloat:
      return kF32;
    case at::kBFloat16:
      return kBF16;
    case at::kHalf:
      return kF16;
    default:
      TORCH_CHECK(false, op, ": ", what, " has dtype ", dtype,
                  "; expected float64, float32, bfloat16 or float16");
  }
}

}  // namespace dino_opt
