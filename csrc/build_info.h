#pragma once
#include <map>
#include <string>

namespace dino_opt {
// How this library was built: torch version, CUDA, compilers, OpenMP.
std::map<std::string, std::string> build_info();
}  // namespace dino_opt
