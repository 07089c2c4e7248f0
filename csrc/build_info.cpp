#include "build_info.h"

#include <ATen/Parallel.h>
#include <torch/version.h>

#include "build_config.h"
#include "loader/image_decode.h"
#include "ops/cpu/kernel_table.h"

namespace dino_opt {

std::map<std::string, std::string> build_info() {
  return {
      {"torch_version_built", TORCH_VERSION},
      {"cuda_compiled", DINO_OPT_WITH_CUDA ? "yes" : "no"},
      {"cuda_archs", DINO_OPT_CUDA_ARCHS},
      {"cxx_compiler", DINO_OPT_CXX_COMPILER},
      {"cuda_compiler", DINO_OPT_CUDA_COMPILER},
      {"openmp", DINO_OPT_OPENMP},
      {"parallel_info", at::get_parallel_info()},
      {"cpu_kernels", cpu::kernels().isa},
      {"image_formats", loader::other_formats_available() ? "JPEG, PNG, WebP, BMP, TIFF" : "JPEG"},
  };
}

}  // namespace dino_opt
