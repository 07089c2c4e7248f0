// The one Python extension module, dino_opt._C. Operators register themselves
// when the core library loads; this module binds the plain C++ classes.
#include <torch/extension.h>

#include "build_info.h"

PYBIND11_MODULE(_C, m) {
  m.doc() = "dino_opt native core";
  m.def("build_info", &dino_opt::build_info, "How the native core was built");
}
