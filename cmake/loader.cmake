# The loader's image pipeline (decode, crop sampling, resampling, photometric
# augmentation) and its sample sources (files, tar shards, Arrow buffers): a static library free of torch, so that the main build links
# it into dino_opt_core and the fuzz build (fuzz/CMakeLists.txt) compiles the
# same sources with clang and sanitizers.
#
# JPEG is decoded by libjpeg-turbo (TurboJPEG API), always. PNG, WebP, BMP
# and TIFF go through OpenCV imgcodecs when DINO_OPT_WITH_OPENCV is ON (the
# default); with it OFF the build needs no OpenCV at all and the loader refuses
# other formats with an error that names the format and this option.
#
# libjpeg-turbo and OpenCV are found by cmake/system_libs.cmake.
include(${CMAKE_CURRENT_LIST_DIR}/system_libs.cmake)

set(DINO_OPT_LOADER_DIR "${CMAKE_CURRENT_LIST_DIR}/../csrc/loader")
add_library(dino_opt_loader_core STATIC
    ${DINO_OPT_LOADER_DIR}/image.cpp
    ${DINO_OPT_LOADER_DIR}/image_decode.cpp
    ${DINO_OPT_LOADER_DIR}/npy_format.cpp
    ${DINO_OPT_LOADER_DIR}/resample_raw.cpp
    ${DINO_OPT_LOADER_DIR}/channel_photometric.cpp
    ${DINO_OPT_LOADER_DIR}/photometric.cpp
    ${DINO_OPT_LOADER_DIR}/crop_sampling.cpp
    ${DINO_OPT_LOADER_DIR}/masking.cpp
    ${DINO_OPT_LOADER_DIR}/resample.cpp
    ${DINO_OPT_LOADER_DIR}/multicrop_pipeline.cpp
    ${DINO_OPT_LOADER_DIR}/prepare.cpp
    ${DINO_OPT_LOADER_DIR}/tar_index.cpp
    ${DINO_OPT_LOADER_DIR}/sample_source.cpp
    ${DINO_OPT_LOADER_DIR}/shard_source.cpp)

# The photometric kernels (RGB and per-channel), once per instruction set
# (photometric.cpp picks one at run time). -ffp-contract=off: a*b + c rounds
# twice, as in the CUDA kernel (-fmad=false), so that CPU and GPU augmentations are bit-identical; FMA is
# therefore not enabled. -fno-trapping-math changes no value; it lets the
# compiler evaluate both sides of a select (solarise, hue) and so vectorise.
# -fno-math-errno changes no value either: sqrt becomes one instruction, so
# that the noise field's loop (channel_noise.h) vectorises.
set(DINO_OPT_PHOTOMETRIC_ISAS default)
set(DINO_OPT_PHOTOMETRIC_FLAGS_default "")
if(CMAKE_SYSTEM_PROCESSOR MATCHES "x86_64|AMD64")
  list(APPEND DINO_OPT_PHOTOMETRIC_ISAS avx2)
  set(DINO_OPT_PHOTOMETRIC_FLAGS_avx2 -mavx2)
endif()
foreach(isa IN LISTS DINO_OPT_PHOTOMETRIC_ISAS)
  add_library(dino_opt_photometric_${isa} OBJECT ${DINO_OPT_LOADER_DIR}/photometric_kernels.cpp
              ${DINO_OPT_LOADER_DIR}/channel_photometric_kernels.cpp)
  target_include_directories(dino_opt_photometric_${isa} PRIVATE "${DINO_OPT_LOADER_DIR}/..")
  target_compile_options(dino_opt_photometric_${isa} PRIVATE -Wall -Wextra -ffp-contract=off
                         -fno-trapping-math -fno-math-errno ${DINO_OPT_PHOTOMETRIC_FLAGS_${isa}})
  target_compile_definitions(dino_opt_photometric_${isa} PRIVATE
                             DINO_OPT_PHOTOMETRIC_ISA=photometric_${isa})
  set_target_properties(dino_opt_photometric_${isa} PROPERTIES POSITION_INDEPENDENT_CODE ON)
  target_sources(dino_opt_loader_core PRIVATE $<TARGET_OBJECTS:dino_opt_photometric_${isa}>)
endforeach()
set_target_properties(dino_opt_loader_core PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(dino_opt_loader_core PUBLIC "${DINO_OPT_LOADER_DIR}/.."
                           PRIVATE "${TURBOJPEG_INCLUDE_DIR}")
find_package(Threads REQUIRED)  # the shard source's reader thread
target_link_libraries(dino_opt_loader_core PUBLIC "${TURBOJPEG_LIBRARY}" Threads::Threads)
target_compile_options(dino_opt_loader_core PRIVATE -Wall -Wextra -O3)
if(DINO_OPT_IMGCODECS)
  # SYSTEM: OpenCV 4.6's headers warn under C++20 (enum arithmetic), which is not ours to fix.
  target_include_directories(dino_opt_loader_core SYSTEM PRIVATE "${OPENCV_INCLUDE_DIR}")
  target_link_libraries(dino_opt_loader_core PUBLIC "${OPENCV_IMGCODECS_LIBRARY}"
                        "${OPENCV_CORE_LIBRARY}")
  target_compile_definitions(dino_opt_loader_core PRIVATE DINO_OPT_WITH_IMGCODECS=1)
else()
  target_compile_definitions(dino_opt_loader_core PRIVATE DINO_OPT_WITH_IMGCODECS=0)
  message(STATUS "dino_opt: built without OpenCV (DINO_OPT_WITH_OPENCV=OFF): the loader reads JPEG only")
endif()
