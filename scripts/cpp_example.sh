#!/usr/bin/env bash
# Builds examples/cpp against an installed C++ package of dino_opt and runs it
# on three JPEG files: scripts/cpp_example.sh PYTHON PACKAGE_PREFIX BUILD_DIR.
# First, that a configure without torch's prefix fails saying what to add.
# PYTHON gives torch's CMake prefix (and writes the images); PACKAGE_PREFIX is
# a `cmake --install` prefix or an installed wheel's dino_opt.cmake_prefix_path.
set -euo pipefail
py=$1 prefix=$2 build=$3
torch_prefix=$("$py" -c "import torch; print(torch.utils.cmake_prefix_path)")
rm -rf "$build"
mkdir -p "$build/images"
"$py" - "$build/images" <<'PY'
import sys
import numpy as np
from PIL import Image
rng = np.random.default_rng(0)
for i in range(3):
    pixels = rng.integers(0, 256, (60 + 10 * i, 80, 3), dtype=np.uint8)
    Image.fromarray(pixels).save(f"{sys.argv[1]}/{i}.jpg", quality=90)
PY
# Without torch's prefix, find_package(dino_opt) must say what to add.
if cmake -S examples/cpp -B "$build/no-torch" "-DCMAKE_PREFIX_PATH=$prefix" >"$build/no-torch.log" 2>&1 ||
  ! grep -q "dino_opt needs Torch" "$build/no-torch.log"; then
  echo "cpp-example: find_package(dino_opt) without torch did not say it needs Torch:" >&2
  cat "$build/no-torch.log" >&2
  exit 1
fi
launcher=() # ccache where there is one, as for the core
if command -v ccache >/dev/null; then launcher=(-DCMAKE_CXX_COMPILER_LAUNCHER=ccache); fi
cmake -S examples/cpp -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${launcher[@]}" \
  "-DCMAKE_PREFIX_PATH=$prefix;$torch_prefix" >"$build/configure.log" 2>&1 ||
  { cat "$build/configure.log"; exit 1; }
cmake --build "$build"
"$build/dino_opt_example" "$build"/images/*.jpg
