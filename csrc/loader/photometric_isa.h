#pragma once
// The instruction-set variants of apply_photometric (photometric_kernels.cpp,
// compiled once per variant by cmake/loader.cmake). Internal to the loader;
// the tests call the variants directly to check that they agree bit for bit.
#include <cstdint>

#include "loader/photometric.h"

#if defined(__x86_64__) || defined(_M_X64)
#define DINO_OPT_PHOTOMETRIC_HAS_AVX2 1
#else
#define DINO_OPT_PHOTOMETRIC_HAS_AVX2 0
#endif

namespace dino_opt::loader {

using PhotometricKernelFn = void (*)(const uint8_t* src, int height, int width,
                                     const PhotometricParams& params, const Normalization& norm,
                                     const PlanarOutput& out, float* scratch);

namespace photometric_default {
void apply_photometric_kernel(const uint8_t* src, int height, int width,
                              const PhotometricParams& params, const Normalization& norm,
                              const PlanarOutput& out, float* scratch);
}
#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
namespace photometric_avx2 {
void apply_photometric_kernel(const uint8_t* src, int height, int width,
                              const PhotometricParams& params, const Normalization& norm,
                              const PlanarOutput& out, float* scratch);
}
#endif

}  // namespace dino_opt::loader
