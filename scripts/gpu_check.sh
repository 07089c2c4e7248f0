#!/usr/bin/env bash
# `make gpu-check STAGE=...`: the GPU check, in stages that each fit one
# 10-minute call of an offline GPU machine (docs/gpu_check.md).
#
#   build       unpack third_party/debs into the prefix; build dino_opt against
#               this machine's torch without OpenCV, with the C++ tests; check
#               with ldd that every built object loads from the prefix, torch's
#               own libraries or the C/C++ runtime; import it
#   cuda-tests  dino-opt doctor, ctest (GoogleTest) and the `cuda`-marked Python tests
#   bench       the five piece benchmarks (EMA, loss, profiler, photometric, loader)
#   e2e         `dino-opt presets --measure` and the end-to-end recipe bench
#
# STAGE is one of these, a comma list, or `all`. The stages after `build` build
# first only when the native sources differ from the last build in this build
# folder (or dino_opt does not import). Each stage has a time budget
# (GPU_CHECK_BUDGET_S, default 450 s): every step runs under `timeout` for the
# smaller of its own cap and what is left, so a stage always ends with its
# report written. Every step appends its output to REPORT_DIR/gpu_check.log and
# rewrites REPORT_DIR/gpu_check.json (scripts/gpu_report.py).
#
# Environment: REPORT_DIR, STAGE, PYTHON, GPU_CHECK_BUILD_DIR, GPU_CHECK_PREFIX,
# GPU_CHECK_DEBS (folder of .deb files), GPU_CHECK_CMAKE_DEFINES (extra CMake
# definitions, space-separated NAME=VALUE), GPU_CHECK_QUICK=1 (small bench
# sizes, for the rehearsal on a CPU), DINO_OPT_CUDA_ARCHS (default: this GPU's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAGE=${STAGE:-all}
BUDGET=${GPU_CHECK_BUDGET_S:-450}
QUICK=${GPU_CHECK_QUICK:-0}
DEBS=${GPU_CHECK_DEBS:-third_party/debs}
REPORT_DIR=$(realpath -m "${REPORT_DIR:-build/gpu-report}")
mkdir -p "$REPORT_DIR"
LOG=$REPORT_DIR/gpu_check.log
export PYTHONUNBUFFERED=1

if ! tag=$("$PY" -c "import sys, torch; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split(\"+\")[0]}')"); then
  echo "gpu-check: $PY cannot import torch" | tee -a "$LOG"
  exit 1
fi
BUILD_DIR=$(realpath -m "${GPU_CHECK_BUILD_DIR:-build/gpu-$tag}")
PREFIX=$(realpath -m "${GPU_CHECK_PREFIX:-.gpu-prefix}")
ARCHS=${DINO_OPT_CUDA_ARCHS:-$("$PY" -c "import torch; print(''.join(map(str, torch.cuda.get_device_capability())) if torch.cuda.is_available() else '90')")}
export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
STAMP=$BUILD_DIR/gpu-check.sources
failed=0

report() { "$PY" "$ROOT/scripts/gpu_report.py" "$@"; }

# step NAME CAP [--junit FILE] [--embed KEY=FILE]... -- COMMAND...
# Runs COMMAND under timeout (CAP seconds or what is left of the stage's
# budget), appends its output to the log and records it in the report.
step() {
  local name=$1 cap=$2 opts=()
  shift 2
  while [ "$1" != "--" ]; do opts+=("$1"); shift; done
  shift
  local left=$((BUDGET - (SECONDS - stage_start)))
  local limit=$((cap < left ? cap : left))
  if [ "$limit" -lt 10 ]; then
    echo "== $stage/$name: not run, the stage's ${BUDGET} s budget is spent" | tee -a "$LOG"
    report record "$REPORT_DIR" "$stage" "$name" -1 0
    failed=1
    return 1
  fi
  report start "$REPORT_DIR" "$stage" "$name"
  echo "== $stage/$name (limit $limit s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  timeout --kill-after=15 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  report record "$REPORT_DIR" "$stage" "$name" "$rc" "$((SECONDS - t0))" "${opts[@]}"
  echo "== $stage/$name: rc $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || { failed=1; return 1; }
}

# A digest of everything the native build reads: equal digests, same build.
sources_digest() {
  find csrc tests_cpp cmake build_support CMakeLists.txt pyproject.toml -type f \
    ! -name '*.pyc' -print0 | sort -z |
    xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

built_objects() {
  local site
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
  ls "$BUILD_DIR"/libdino_opt_core.so "$BUILD_DIR"/_C*.so "$BUILD_DIR"/dino_opt_tests \
    "$site"/dino_opt/*.so 2>/dev/null
}

# pyproject.toml needs scikit-build-core >= 1.1 (its [[tool.dynamic-metadata]]
# pins torch in the metadata). A machine with an older one gets the carried
# wheel (make gpu-debs), on PYTHONPATH for this build only.
ensure_build_backend() {
  local check="import scikit_build_core as s; from packaging.version import Version as V; assert V(s.__version__) >= V('1.1')"
  "$PY" -c "$check" 2>/dev/null && return 0
  local wheels=("$DEBS"/scikit_build_core-*.whl)
  step build-backend 60 -- "$PY" -m pip install -q --no-index --no-deps --upgrade \
    --target "$PREFIX/python" "${wheels[0]}" || return 1
  export PYTHONPATH="$PREFIX/python${PYTHONPATH:+:$PYTHONPATH}"
}

# Unpacks the carried .deb files and builds (pip's editable install, CMake and
# ninja in BUILD_DIR); the digest of the sources is kept for ensure_built.
build_native() {
  local debs=("$DEBS"/*.deb)
  if [ -e "${debs[0]}" ]; then
    rm -rf "$PREFIX"
    step unpack 60 -- "$PY" scripts/unpack_debs.py "$PREFIX" "${debs[@]}" || return 1
  else
    echo "== $stage: no .deb files in $DEBS (run 'make gpu-debs' where apt works and carry them)" |
      tee -a "$LOG"
  fi
  ensure_build_backend || return 1
  local defines=(-Ccmake.define.DINO_OPT_BUILD_TESTS=ON -Ccmake.define.DINO_OPT_WITH_OPENCV=OFF
                 "-Ccmake.define.DINO_OPT_CUDA_ARCHS=$ARCHS")
  local d
  for d in ${GPU_CHECK_CMAKE_DEFINES:-}; do defines+=("-Ccmake.define.$d"); done
  rm -f "$STAMP"
  step build 420 -- env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install \
    --no-build-isolation --no-deps -e . "-Cbuild-dir=$BUILD_DIR" "${defines[@]}" || return 1
  sources_digest >"$STAMP"
}

# What every stage reports about the build it runs on: the ldd closure of the
# built objects and dino_opt.build_info() (seconds, so never skipped).
check_build() {
  local objects
  mapfile -t objects < <(built_objects)
  step closure 60 --embed "closure=$REPORT_DIR/closure.json" -- "$PY" scripts/check_closure.py \
    --prefix "$PREFIX" --json "$REPORT_DIR/closure.json" "${objects[@]}"
  step import 60 --embed "build_info=$BUILD_DIR/build_info.json" -- "$PY" -c \
    "import json, dino_opt; info = {**dino_opt.build_info(), 'native_module': dino_opt._C.__file__}; print(info); json.dump(info, open('$BUILD_DIR/build_info.json', 'w'))"
}

stage_build() {
  build_native && check_build
}

# The build of the previous call on this machine, when the sources are the same.
ensure_built() {
  if [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(sources_digest)" ]; then
    echo "== $stage: the build in $BUILD_DIR is up to date" | tee -a "$LOG"
  else
    build_native || return 1
  fi
  check_build
}

stage_cuda_tests() {
  ensure_built || return 1
  # The first check a user runs: every fused operator on the device against its plain form.
  step doctor 90 -- "$PY" -m dino_opt.doctor
  step ctest 120 --junit "$REPORT_DIR/ctest_gtest.xml" -- env \
    GTEST_OUTPUT="xml:$REPORT_DIR/ctest_gtest.xml" ctest --test-dir "$BUILD_DIR" \
    --output-on-failure --no-tests=error
  step pytest_cuda 330 --junit "$REPORT_DIR/pytest_cuda.xml" -- "$PY" -m pytest tests_py -m cuda \
    -ra -p no:cacheprovider "--junitxml=$REPORT_DIR/pytest_cuda.xml"
}

# bench_step NAME CAP SCRIPT ARGS... (QUICK_ARGS after a second --)
bench_step() {
  local name=$1 cap=$2 script=$3 args=() quick=()
  shift 3
  while [ $# -gt 0 ] && [ "$1" != "--" ]; do args+=("$1"); shift; done
  [ $# -gt 0 ] && shift && quick=("$@")
  [ "$QUICK" = 1 ] && args+=("${quick[@]}")
  step "$name" "$cap" --embed "bench.$name=$REPORT_DIR/$name.json" -- "$PY" "$script" \
    --json "$REPORT_DIR/$name.json" "${args[@]}"
}

stage_bench() {
  ensure_built || return 1
  bench_step bench_ema 60 bench/bench_ema.py -- --repeats 2
  bench_step bench_loss 90 bench/bench_loss.py -- --batch 4 --dim 4096 --repeats 1
  bench_step bench_profiler 60 bench/bench_profiler.py -- --steps 5 --batch 4 --out-dim 256
  bench_step bench_photometric 60 bench/bench_photometric.py -- --images 4 --repeats 1
  # The synthetic JPEGs are generated under build/ on the first run (16 cores: seconds).
  bench_step bench_loader 150 bench/bench_loader.py --device "$("$PY" -c "import torch; print('cuda' if torch.cuda.is_available() else 'cpu')")" \
    -- --count 96 --batch-size 16 --repeats 1 --warmup 1
}

stage_e2e() {
  ensure_built || return 1
  # What hardware.preset=auto picks on this card, and the batch size measured for it.
  local presets=(--measure --steps 2) tiny=()
  [ "$QUICK" = 1 ] && presets=(--measure --steps 1 --max-batch 2) &&
    tiny=(hardware.preset=cpu hardware.device=cpu augmentation.global_crop_size=32
          augmentation.local_crop_size=16 model.out_dim=128 model.hidden_dim=64
          model.bottleneck_dim=32)
  step presets 90 --embed "presets=$REPORT_DIR/presets.json" -- bash -c \
    "set -o pipefail; \"\$0\" -m dino_opt.cli presets --json \"\${@}\" | tee '$REPORT_DIR/presets.json'" \
    "$PY" "${presets[@]}" "${tiny[@]}"
  # Last: the end-to-end table (DINO's ViT-S/16 recipe, baseline vs each optimisation).
  local train=(--config recipe --repeats 1 --steps 15 --warmup 5)
  [ "$QUICK" = 1 ] && train=(--config cpu --quick --only baseline,all)
  bench_step bench_train 270 bench/bench_train.py "${train[@]}"
  # After it (it matters more): checkpoints every 1/10/100 steps, sync vs async, ViT-S/16.
  bench_step bench_checkpoint 90 bench/bench_checkpoint.py --models vit_small --batch-size 64 \
    --repeats 1 -- --models demo --batch-size 8 --every 1,10 --saves 1 --min-steps 2
}

run_stage() {
  stage=$1
  stage_start=$SECONDS
  echo "== stage $stage (budget $BUDGET s) on $(hostname), $(date -Is)" | tee -a "$LOG"
  case $stage in
    build) stage_build ;;
    cuda-tests) stage_cuda_tests ;;
    bench) stage_bench ;;
    e2e) stage_e2e ;;
    *) echo "gpu-check: unknown stage '$stage' (build, cuda-tests, bench, e2e or all)" | tee -a "$LOG"
       failed=1 ;;
  esac
  echo "== stage $stage done after $((SECONDS - stage_start)) s" | tee -a "$LOG"
}

[ "$STAGE" = all ] && STAGE=build,cuda-tests,bench,e2e
IFS=, read -r -a stages <<<"$STAGE"
for s in "${stages[@]}"; do run_stage "$s"; done
report verdict "$REPORT_DIR" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] && [ "$failed" -eq 0 ]
