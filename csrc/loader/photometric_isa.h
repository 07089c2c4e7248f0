#pragma once
// The instruction-set variants of apply_photometric (photometric_kernels.cpp)
// and apply_channel_photometric (channel_photometric_kernels.cpp), compiled
// once per variant by cmake/loader.cmake. Internal to the loader; the tests
// call the variants directly to check that they agree bit for bit.
#include <cstdint>

#include "loader/channel_photometric.h"
#include "loader/photometric.h"

#if defined(__x86_64__) || defined(_M_X64)
#define DINO_OPT_PHOTOMETRIC_HAS_AVX2 1
#else
#define DINO_OPT_PHOTOMETRIC_HAS_AVX2 0
#endif

namespace dino_opt::loader {

using ChannelPhotometricKernelFn = void (*)(const uint8_t* src, ImageLayout layout, int height,
                                            int width, const ChannelParams& params,
                                            const ChannelNormalization& norm,
                                            const PlanarOutput& out, float* scratch);

using PhotometricKernelFn = void (*)(const uint8_t* src, int height, int width,
                                     const PhotometricParams& params, const Normalization& norm,
                                     const PlanarOutput& out, float* scratch);

namespace photometric_default {
void apply_photometric_kernel(const uint8_t* src, int height, int width,
                              const PhotometricParams& params, const Normalization& norm,
                              const PlanarOutput& out, float* scratch);
void apply_channel_photometric_kernel(const uint8_t* src, ImageLayout layout, int height, int width,
                                      const ChannelParams& params, const ChannelNormalization& norm,
                                      const PlanarOutput& out, float* scratch);
}  // namespace photometric_default
#if DINO_OPT_PHOTOMETRIC_HAS_AVX2
namespace photometric_avx2 {
void apply_photometric_kernel(const uint8_t* src, int height, int width,
                              const PhotometricParams& params, const Normalization& norm,
                              const PlanarOutput& out, float* scratch);
void apply_channel_photometric_kernel(const uint8_t* src, ImageLayout layout, int height, int width,
                                      const ChannelParams& params, const ChannelNormalization& norm,
                                      const PlanarOutput& out, float* scratch);
}  // namespace photometric_avx2
#endif

}  // namespace dino_opt::loader
