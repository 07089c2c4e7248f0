// Sample types and layouts of images read at their stored depth (image.h).
#include "loader/image.h"

namespace dino_opt::loader {

int sample_bytes(SampleType type) {
  switch (type) {
    case SampleType::kU8:
      return 1;
    case SampleType::kU16:
      return 2;
    case SampleType::kF32:
      return 4;
  }
  return 1;
}

const char* sample_type_name(SampleType type) {
  switch (type) {
    case SampleType::kU8:
      return "uint8";
    case SampleType::kU16:
      return "uint16";
    case SampleType::kF32:
      return "float32";
  }
  return "unknown";
}

double sample_scale(SampleType type) {
  switch (type) {
    case SampleType::kU8:
      return 255.0;
    case SampleType::kU16:
      return 65535.0;
    case SampleType::kF32:
      return 1.0;
  }
  return 1.0;
}

std::string ImageLayout::describe() const {
  return std::to_string(channels) + "-channel " + sample_type_name(type);
}

}  // namespace dino_opt::loader
