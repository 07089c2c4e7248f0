# The install: the Python package (the core library and the _C module, side
# by side) and the C++ package, so that another CMake project can write
#
#   find_package(dino_opt REQUIRED)   # with torch's CMake prefix on CMAKE_PREFIX_PATH
#   target_link_libraries(app PRIVATE dino_opt::core)
#
# and call the operators (ops/ema.h, ops/dino_loss.h, ops/ibot_loss.h,
# ops/photometric.h), the
# loader (loader/multicrop_loader.h), the memory tracker and the profiler.
include(CMakePackageConfigHelpers)

set_target_properties(dino_opt_core PROPERTIES EXPORT_NAME core)
install(TARGETS dino_opt_core EXPORT dino_optTargets
        LIBRARY DESTINATION "${DINO_OPT_INSTALL_LIBDIR}")
if(SKBUILD)
  install(TARGETS _C LIBRARY DESTINATION dino_opt)
endif()
# The headers, in the layout the sources include them by ("ops/ema.h"); the
# Python bindings and the CUDA kernels' internals are not part of the API.
install(DIRECTORY csrc/ DESTINATION "${DINO_OPT_INSTALL_INCLUDEDIR}"
        FILES_MATCHING PATTERN "*.h"
        PATTERN "bindings" EXCLUDE PATTERN "cuda" EXCLUDE PATTERN "cpu" EXCLUDE)
install(EXPORT dino_optTargets NAMESPACE dino_opt:: DESTINATION "${DINO_OPT_INSTALL_CMAKEDIR}")

# The config checks that the consumer found the torch this core was built
# against (its ABI is the only one the library loads with), and points a
# CUDA build of torch at the toolkit the kernels were compiled with.
set(DINO_OPT_TORCH_VERSION "${Torch_VERSION}")
set(DINO_OPT_CUDA_ROOT "")
if(DINO_OPT_CUDA)
  set(DINO_OPT_CUDA_ROOT "${CMAKE_CUDA_COMPILER_TOOLKIT_ROOT}")
  set(DINO_OPT_TORCH_ARCH_LIST "$ENV{TORCH_CUDA_ARCH_LIST}")
endif()
configure_package_config_file(cmake/dino_optConfig.cmake.in
                              "${CMAKE_CURRENT_BINARY_DIR}/dino_optConfig.cmake"
                              INSTALL_DESTINATION "${DINO_OPT_INSTALL_CMAKEDIR}")
write_basic_package_version_file("${CMAKE_CURRENT_BINARY_DIR}/dino_optConfigVersion.cmake"
                                 VERSION "${DINO_OPT_VERSION}" COMPATIBILITY SameMinorVersion)
install(FILES "${CMAKE_CURRENT_BINARY_DIR}/dino_optConfig.cmake"
              "${CMAKE_CURRENT_BINARY_DIR}/dino_optConfigVersion.cmake"
        DESTINATION "${DINO_OPT_INSTALL_CMAKEDIR}")
