#pragma once
// Shared by the binding files of the one Python module dino_opt._C.
#include <pybind11/pybind11.h>

#include <utility>

namespace dino_opt::bindings {

// Calls f() with the GIL released (it may wait for the device or for other
// threads), returning its result.
template <typename F>
auto without_gil(F&& f) {
  pybind11::gil_scoped_release release;
  return std::forward<F>(f)();
}

// The multi-crop loader, its exception and the image helpers (loader_bindings.cpp).
void bind_loader(pybind11::module_& m);
// The loader's sample sources and the tar index helpers (source_bindings.cpp).
void bind_sources(pybind11::module_& m);

}  // namespace dino_opt::bindings
