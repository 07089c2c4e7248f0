# The loader's system libraries: libjpeg-turbo (TurboJPEG API), always, and
# OpenCV core/imgcodecs with DINO_OPT_WITH_OPENCV (cmake/loader.cmake). The
# main build includes this before it looks for Python, torch and CUDA, so
# that a missing library stops the configure step at once, naming it.
#
# Headers and libraries are found by name rather than through the packages'
# CMake configs, which hard-code /usr and so break when .deb files are
# unpacked into a prefix (scripts/gpu_check.sh).
include_guard(GLOBAL)
option(DINO_OPT_WITH_OPENCV "Decode PNG, WebP, BMP and TIFF through OpenCV imgcodecs" ON)
find_path(TURBOJPEG_INCLUDE_DIR turbojpeg.h)
find_library(TURBOJPEG_LIBRARY turbojpeg)
if(NOT TURBOJPEG_INCLUDE_DIR OR NOT TURBOJPEG_LIBRARY)
  message(FATAL_ERROR "dino_opt: libjpeg-turbo's TurboJPEG API (turbojpeg.h, libturbojpeg) was not "
                      "found; install libturbojpeg0-dev or point CMAKE_PREFIX_PATH at it")
endif()
set(DINO_OPT_IMGCODECS OFF)
if(DINO_OPT_WITH_OPENCV)
  find_path(OPENCV_INCLUDE_DIR opencv2/imgcodecs.hpp PATH_SUFFIXES opencv4)
  find_library(OPENCV_CORE_LIBRARY opencv_core)
  find_library(OPENCV_IMGCODECS_LIBRARY opencv_imgcodecs)
  if(NOT OPENCV_INCLUDE_DIR OR NOT OPENCV_CORE_LIBRARY OR NOT OPENCV_IMGCODECS_LIBRARY)
    message(FATAL_ERROR "dino_opt: OpenCV core/imgcodecs were not found (headers: "
                        "${OPENCV_INCLUDE_DIR}, libraries: ${OPENCV_CORE_LIBRARY} "
                        "${OPENCV_IMGCODECS_LIBRARY}); install libopencv-imgcodecs-dev, or "
                        "configure with -DDINO_OPT_WITH_OPENCV=OFF for a JPEG-only loader")
  endif()
  set(DINO_OPT_IMGCODECS ON)
endif()
