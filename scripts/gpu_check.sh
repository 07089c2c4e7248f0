#!/usr/bin/env bash
# `make gpu-check`: on an offline GPU machine that has torch, nvcc, cmake,
# scikit-build-core and pytest but no apt, build dino_opt against that torch,
# run the C++ tests, the `cuda`-marked Python tests, the other Python tests and
# the GPU benchmarks, and write into REPORT_DIR: gpu_check.json (summary),
# gpu_check.log (every step's output) and bench_*.json (eight files in all).
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
scratch=$build_dir/gpu-check
rm -rf "$scratch" && mkdir -p "$scratch"
log=$REPORT_DIR/gpu_check.log
: >"$log"

# step NAME COMMAND...: runs the command, appends its output to the log,
# records its exit status and duration.
step() {
  local name=$1; shift
  local t0=$SECONDS
  echo "== $name: $*" | tee -a "$log"
  "$@" 2>&1 | tee -a "$log"
  local rc=${PIPESTATUS[0]}
  printf '%s\t%s\t%s\n' "$name" "$rc" "$((SECONDS - t0))" >>"$scratch/steps.tsv"
  return "$rc"
}

if step build env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" $PY -m pip install --no-build-isolation \
  --no-deps -e . -Cbuild-dir="$build_dir" -Ccmake.define.DINO_OPT_BUILD_TESTS=ON; then
  step ctest ctest --test-dir "$build_dir" --output-on-failure
  step pytest_cuda $PY -m pytest tests_py -m cuda -ra --junitxml="$scratch/pytest_cuda.xml"
  step pytest_rest $PY -m pytest tests_py -m "not cuda" -ra --junitxml="$scratch/pytest_rest.xml"
  step bench_ema $PY bench/bench_ema.py --json "$REPORT_DIR/bench_ema.json"
  step bench_loss $PY bench/bench_loss.py --json "$REPORT_DIR/bench_loss.json"
  step bench_profiler $PY bench/bench_profiler.py --json "$REPORT_DIR/bench_profiler.json"
  step bench_photometric $PY bench/bench_photometric.py --json "$REPORT_DIR/bench_photometric.json"
  # The synthetic JPEG set is generated under build/ on the first run (16 cores: seconds).
  step bench_loader $PY bench/bench_loader.py --device cuda --json "$REPORT_DIR/bench_loader.json"
  # What hardware.preset=auto picks on this card, and the batch size measured for it.
  step presets timeout 90 bash -c \
    "$PY -m dino_opt.cli presets --measure --steps 2 --json >'$REPORT_DIR/presets.json'"
  # Last and bounded: the end-to-end table (DINO's ViT-S/16 recipe, baseline vs
  # each optimisation) must not cost the steps above their place in a 10-minute call.
  step bench_train timeout 270 $PY bench/bench_train.py --config recipe --repeats 1 \
    --steps 15 --warmup 5 --json "$REPORT_DIR/bench_train.json"
fi

$PY scripts/gpu_report.py "$scratch" "$REPORT_DIR"
