# The loader's image pipeline (decode, crop sampling, resampling, photometric
# augmentation): a static library free of torch, so that the main build links
# it into dino_opt_core and the fuzz build (fuzz/CMakeLists.txt) compiles the
# same sources with clang and sanitizers.
#
# Headers and libraries are found by name rather than through the packages'
# CMake configs, which hard-code /usr and so break when the .deb files are
# unpacked into a prefix (scripts/gpu_check.sh).
find_path(TURBOJPEG_INCLUDE_DIR turbojpeg.h REQUIRED)
find_library(TURBOJPEG_LIBRARY turbojpeg REQUIRED)
find_path(OPENCV_INCLUDE_DIR opencv2/core.hpp PATH_SUFFIXES opencv4 REQUIRED)
find_library(OPENCV_CORE_LIBRARY opencv_core REQUIRED)
find_library(OPENCV_IMGPROC_LIBRARY opencv_imgproc REQUIRED)
find_library(OPENCV_IMGCODECS_LIBRARY opencv_imgcodecs) # optional: PNG, WebP, BMP, TIFF

set(DINO_OPT_LOADER_DIR "${CMAKE_CURRENT_LIST_DIR}/../csrc/loader")
add_library(dino_opt_loader_core STATIC
    ${DINO_OPT_LOADER_DIR}/image_decode.cpp
    ${DINO_OPT_LOADER_DIR}/photometric.cpp
    ${DINO_OPT_LOADER_DIR}/crop_sampling.cpp
    ${DINO_OPT_LOADER_DIR}/resample.cpp
    ${DINO_OPT_LOADER_DIR}/multicrop_pipeline.cpp
    ${DINO_OPT_LOADER_DIR}/prepare.cpp)
set_target_properties(dino_opt_loader_core PROPERTIES POSITION_INDEPENDENT_CODE ON)
target_include_directories(dino_opt_loader_core PUBLIC "${DINO_OPT_LOADER_DIR}/.."
                           PRIVATE "${TURBOJPEG_INCLUDE_DIR}")
# SYSTEM: OpenCV 4.6's headers warn under C++20 (enum arithmetic), which is not ours to fix.
target_include_directories(dino_opt_loader_core SYSTEM PRIVATE "${OPENCV_INCLUDE_DIR}")
target_link_libraries(dino_opt_loader_core PUBLIC "${TURBOJPEG_LIBRARY}" "${OPENCV_IMGPROC_LIBRARY}"
                      "${OPENCV_CORE_LIBRARY}")
target_compile_options(dino_opt_loader_core PRIVATE -Wall -Wextra -O3)
if(OPENCV_IMGCODECS_LIBRARY)
  target_link_libraries(dino_opt_loader_core PUBLIC "${OPENCV_IMGCODECS_LIBRARY}")
  target_compile_definitions(dino_opt_loader_core PRIVATE DINO_OPT_WITH_IMGCODECS=1)
  set(DINO_OPT_IMGCODECS ON)
else()
  target_compile_definitions(dino_opt_loader_core PRIVATE DINO_OPT_WITH_IMGCODECS=0)
  set(DINO_OPT_IMGCODECS OFF)
  message(STATUS "dino_opt: OpenCV imgcodecs not found: the loader reads JPEG only")
endif()
