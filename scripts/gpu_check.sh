#!/usr/bin/env bash
# `make gpu-check`: on an offline GPU machine that has torch, nvcc, cmake,
# scikit-build-core and pytest but no apt, build dino_opt against that torch,
# run the C++ tests, the Python tests (the `cuda`-marked ones run there) and
# the GPU benchmarks, and write a JSON report into REPORT_DIR.
# System headers the machine lacks come from .deb files in third_party/debs
# (`make gpu-debs` on a machine with apt), unpacked into .gpu-prefix.
set -uo pipefail
cd "$(dirname "$0")/.."
REPORT_DIR=${REPORT_DIR:-build/gpu-report}
PY=${PYTHON:-python3}
mkdir -p "$REPORT_DIR"
export PYTHONUNBUFFERED=1

if compgen -G "third_party/debs/*.deb" >/dev/null; then
  prefix=$PWD/.gpu-prefix
  for deb in third_party/debs/*.deb; do dpkg -x "$deb" "$prefix"; done
  export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
  export LD_LIBRARY_PATH="$prefix/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
fi

tag=$($PY -c "import sys, torch; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split(\"+\")[0]}')")
build_dir=build/gpu-$tag
steps_file=$REPORT_DIR/steps.tsv
: >"$steps_file"

# step NAME COMMAND...: runs the command, logs to REPORT_DIR/NAME.log, records rc and seconds.
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*"
  "$@" 2>&1 | tee "$REPORT_DIR/$name.log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$steps_file"
  return "$rc"
}

step build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" $PY -m pip install --no-build-isolation \
  --no-deps -e . -Cbuild-dir="$build_dir" -Ccmake.define.DINO_OPT_BUILD_TESTS=ON || built=no
if [ "${built:-yes}" = yes ]; then
  step ctest ctest --test-dir "$build_dir" --output-on-failure
  step pytest $PY -m pytest tests_py -ra --junitxml="$REPORT_DIR/pytest.xml"
  step bench_ema $PY bench/bench_ema.py --json "$REPORT_DIR/bench_ema.json"
fi

$PY scripts/gpu_report.py "$REPORT_DIR"
