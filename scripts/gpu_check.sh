#!/usr/bin/env bash
# `make gpu-check STAGE=...`: the GPU check, in two stages that each fit one
# call of a GPU machine lent for 15 minutes in all (docs/gpu_check.md).
#
#   proof  the evidence that matters most, in this order, each step's result
#          written as it ends: the build (the carried one of `STAGE=carry`
#          when it matches this tree, Python and torch: installed in seconds;
#          else built here), its ldd closure and import; `dino-opt doctor`;
#          the C++ tests; the `cuda` tests (slow ones last); the end-to-end
#          headline (DINO's ViT-S/16 recipe, baseline vs dino_opt); the loss
#          and EMA benches. Its steps' caps add up to at most 480 s.
#   rest   the other benches (profiler, photometric, loader, presets, head), an
#          FSDP job on NCCL, the checkpoint bench: for when time is left.
#   carry  (where the build is prepared, not on the GPU machine) a wheel and
#          the C++ test program built against this Python and torch, into
#          GPU_CHECK_CARRY (default .gpu-carry) with the digest of the tree.
#   tests  the proof's build, doctor and tests, the `cuda` tests with 220 s,
#          and the FSDP job: a second look after a proof with failures.
#   step   the whole training step settled (bench/bench_train.py, recipe):
#          the published step, the strong baseline, dino_opt without and
#          with checkpointing and the model step, 3 interleaved rounds, MFU.
#   build  the build alone (carried or built here), closure and import.
#
# STAGE is one of these or a comma list; `all` is proof,rest. Each stage has a
# time budget (GPU_CHECK_BUDGET_S, default 480 s, one call's; a build on the
# CPU machine that prepares it, `carry` and the rehearsal's `build`, has
# GPU_CHECK_BUILD_BUDGET_S, default 1800 s: its 2 cores are no GPU call's 16):
# every step runs under
# `timeout` for the smaller of its own cap and what is left, so a stage always
# ends with its report written, and a step that no longer fits is recorded as
# not run. Every step appends its output to REPORT_DIR/gpu_check.log and
# rewrites REPORT_DIR/gpu_check.json (scripts/gpu_report.py).
#
# Environment: REPORT_DIR, STAGE, PYTHON, GPU_CHECK_BUILD_DIR, GPU_CHECK_PREFIX,
# GPU_CHECK_DEBS (folder of .deb files), GPU_CHECK_CARRY, GPU_CHECK_CMAKE_DEFINES
# (extra CMake definitions, space-separated NAME=VALUE), GPU_CHECK_QUICK=1
# (small bench sizes, for the rehearsal on a CPU), DINO_OPT_CUDA_ARCHS
# (default: this GPU's).
set -uo pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
PY=${PYTHON:-python3}
STAGE=${STAGE:-all}
CALL_BUDGET=${GPU_CHECK_BUDGET_S:-480}
BUILD_BUDGET=${GPU_CHECK_BUILD_BUDGET_S:-1800}
BUDGET=$CALL_BUDGET
QUICK=${GPU_CHECK_QUICK:-0}
DEBS=${GPU_CHECK_DEBS:-third_party/debs}
REPORT_DIR=$(realpath -m "${REPORT_DIR:-build/gpu-report}")
mkdir -p "$REPORT_DIR"
LOG=$REPORT_DIR/gpu_check.log
export PYTHONUNBUFFERED=1

# A stage name is checked before anything starts (torch's import takes seconds).
STAGES="proof rest tests step carry build"
[ "$STAGE" = all ] && STAGE=proof,rest
IFS=, read -r -a stages <<<"$STAGE"
for s in "${stages[@]}"; do
  if [[ " $STAGES " != *" $s "* ]]; then
    echo "gpu-check: unknown stage '$s' (proof, rest, tests, step, carry, build or all)" | tee -a "$LOG"
    exit 1
  fi
done

# One import of torch gives the build's tag, the device's CUDA architecture
# (90 without a GPU) and the device.
probe='import sys, torch
gpu = torch.cuda.is_available()
version = torch.__version__.split("+")[0]
print(f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{version}",
      "".join(map(str, torch.cuda.get_device_capability())) if gpu else "90", "cuda" if gpu else "cpu")'
if ! read -r tag device_arch DEVICE < <("$PY" -c "$probe") || [ -z "$DEVICE" ]; then
  echo "gpu-check: $PY cannot import torch" | tee -a "$LOG"
  exit 1
fi
BUILD_DIR=$(realpath -m "${GPU_CHECK_BUILD_DIR:-build/gpu-$tag}")
PREFIX=$(realpath -m "${GPU_CHECK_PREFIX:-.gpu-prefix}")
CARRY=$(realpath -m "${GPU_CHECK_CARRY:-.gpu-carry}")
ARCHS=${DINO_OPT_CUDA_ARCHS:-$device_arch}
export CMAKE_PREFIX_PATH="$PREFIX/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
# libjpeg-turbo from the prefix for a carried build (its RUNPATH names the
# prefix of the machine it was built on) and the carried C++ test program.
export LD_LIBRARY_PATH="$PREFIX/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
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
    report record "$REPORT_DIR" "$stage" "$name" -1 0 --cap "$cap"
    failed=1
    return 1
  fi
  report start "$REPORT_DIR" "$stage" "$name"
  echo "== $stage/$name (limit $limit s): $*" | tee -a "$LOG"
  local t0=$SECONDS
  STEP_LIMIT=$limit timeout --kill-after=10 "$limit" "$@" 2>&1 | tee -a "$LOG"
  local rc=${PIPESTATUS[0]}
  report record "$REPORT_DIR" "$stage" "$name" "$rc" "$((SECONDS - t0))" --cap "$cap" "${opts[@]}"
  echo "== $stage/$name: rc $rc after $((SECONDS - t0)) s" | tee -a "$LOG"
  [ "$rc" -eq 0 ] || { failed=1; return 1; }
}

# A digest of everything the native build reads: equal digests, same build.
sources_digest() {
  find csrc tests_cpp cmake build_support CMakeLists.txt pyproject.toml -type f \
    ! -name '*.pyc' -print0 | LC_ALL=C sort -z |
    xargs -0 sha256sum | sha256sum | cut -d' ' -f1
}

# What a carried build must match: the native sources, the Python package
# (the wheel holds it), this Python and torch, and the GPU architecture.
carry_digest() {
  { sources_digest
    find python -type f -name '*.py' -print0 | LC_ALL=C sort -z | xargs -0 sha256sum
    echo "$tag sm_$ARCHS"; } | sha256sum | cut -d' ' -f1
}

built_objects() {
  local site carried=()
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
  carried_matches && carried=("$CARRY"/dino_opt_tests)
  ls "$BUILD_DIR"/libdino_opt_core.so "$BUILD_DIR"/_C*.so "$BUILD_DIR"/dino_opt_tests \
    "${carried[@]}" "$site"/dino_opt/*.so 2>/dev/null
}

# pyproject.toml needs scikit-build-core >= 1.1 (its [[tool.dynamic-metadata]]
# pins torch in the metadata). A machine with an older one gets the carried
# wheel (make gpu-debs), on PYTHONPATH for this build only.
ensure_build_backend() {
  local check="import scikit_build_core as s; from packaging.version import Version as V; assert V(s.__version__) >= V('1.1')"
  "$PY" -c "$check" 2>/dev/null && return 0
  local wheels=("$DEBS"/scikit_build_core-*.whl)
  step build-backend 30 -- "$PY" -m pip install -q --no-index --no-deps --upgrade \
    --target "$PREFIX/python" "${wheels[0]}" || return 1
  export PYTHONPATH="$PREFIX/python${PYTHONPATH:+:$PYTHONPATH}"
}

# The carried .deb files into the prefix (libjpeg-turbo, GoogleTest).
unpack_debs() {
  local debs=("$DEBS"/*.deb)
  if [ ! -e "${debs[0]}" ]; then
    echo "== $stage: no .deb files in $DEBS (run 'make gpu-debs' where apt works and carry them)" |
      tee -a "$LOG"
    return 0
  fi
  rm -rf "$PREFIX"
  step unpack 20 -- "$PY" scripts/unpack_debs.py "$PREFIX" "${debs[@]}"
}

CMAKE_DEFINES=()
cmake_defines() {
  CMAKE_DEFINES=(-Ccmake.define.DINO_OPT_BUILD_TESTS=ON -Ccmake.define.DINO_OPT_WITH_OPENCV=OFF
                 "-Ccmake.define.DINO_OPT_CUDA_ARCHS=$ARCHS")
  local d
  for d in ${GPU_CHECK_CMAKE_DEFINES:-}; do CMAKE_DEFINES+=("-Ccmake.define.$d"); done
}

# Builds here: pip's editable install, CMake and ninja in BUILD_DIR; the
# digest of the sources is kept for ensure_built.
build_native() {
  ensure_build_backend || return 1
  cmake_defines
  rm -f "$STAMP"
  local cap=300  # on the GPU machine's 16 cores; a rehearsal's 2 have the build budget
  [ "$QUICK" = 1 ] && cap=$BUILD_BUDGET
  step build "$cap" -- env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip install \
    --no-build-isolation --no-deps -e . "-Cbuild-dir=$BUILD_DIR" "${CMAKE_DEFINES[@]}" || return 1
  sources_digest >"$STAMP"
}

# The carried build, when it was made from this tree for this Python, torch
# and GPU: the wheel into this Python (no build, no download).
carried_matches() {
  [ -f "$CARRY/digest" ] && [ "$(cat "$CARRY/digest")" = "$(carry_digest)" ]
}

install_carried() {
  local wheels=("$CARRY"/dino_opt-*.whl) site
  step install 30 -- "$PY" -m pip install -q --no-index --no-deps --force-reinstall \
    "${wheels[0]}" || return 1
  # the carried C++ test program finds dino_opt's core and LibTorch here
  site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['platlib'])")
  export LD_LIBRARY_PATH="$site/dino_opt:$site/torch/lib:$LD_LIBRARY_PATH"
}

# What every stage reports about the build it runs on: the ldd closure of the
# built objects and dino_opt.build_info() (seconds, so never skipped).
check_build() {
  local objects
  mapfile -t objects < <(built_objects)
  step closure 10 --embed "closure=$BUILD_DIR/closure.json" -- "$PY" scripts/check_closure.py \
    --prefix "$PREFIX" --json "$BUILD_DIR/closure.json" "${objects[@]}"
  step import 15 --embed "build_info=$BUILD_DIR/build_info.json" -- "$PY" -c \
    "import json, dino_opt; info = {**dino_opt.build_info(), 'native_module': dino_opt._C.__file__}; print(info); json.dump(info, open('$BUILD_DIR/build_info.json', 'w'))"
}

# The build to run on: the carried one when it matches; else the build of an
# earlier call on this machine when the sources are the same; else a build.
ensure_built() {
  mkdir -p "$BUILD_DIR"
  if carried_matches; then
    echo "== $stage: the carried build in $CARRY matches this tree, $tag, sm_$ARCHS" | tee -a "$LOG"
    unpack_debs || return 1
    if ! install_carried; then
      echo "== $stage: the carried build did not install: building here" | tee -a "$LOG"
      build_native || return 1
    fi
  elif [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$(sources_digest)" ]; then
    echo "== $stage: the build in $BUILD_DIR is up to date" | tee -a "$LOG"
  else
    [ -f "$CARRY/digest" ] && echo "== $stage: the carried build in $CARRY is for another tree," \
      "Python, torch or GPU: building here" | tee -a "$LOG"
    unpack_debs && build_native || return 1
  fi
  check_build
}

stage_carry() {
  unpack_debs || return 1
  ensure_build_backend || return 1
  cmake_defines
  rm -rf "$CARRY"
  mkdir -p "$CARRY"
  step wheel 900 -- env CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" "$PY" -m pip wheel -q \
    --no-build-isolation --no-deps . -w "$CARRY" "-Cbuild-dir=$BUILD_DIR-carry" \
    "${CMAKE_DEFINES[@]}" || return 1
  cp "$BUILD_DIR-carry/dino_opt_tests" "$CARRY/" && carry_digest >"$CARRY/digest"
  du -sb "$CARRY"/* | tee -a "$LOG"
}

# The C++ tests: ctest in the build folder, or the carried test program.
cpp_tests() {
  local xml=$REPORT_DIR/cpp_tests.xml
  if [ -f "$BUILD_DIR/CTestTestfile.cmake" ] && ! carried_matches; then
    step cpp_tests 30 --junit "$xml" -- env GTEST_OUTPUT="xml:$xml" ctest --test-dir "$BUILD_DIR" \
      --output-on-failure --no-tests=error
  else
    step cpp_tests 30 --junit "$xml" -- env GTEST_OUTPUT="xml:$xml" "$CARRY/dino_opt_tests"
  fi
}

# The `cuda` tests, quick ones first (conftest.py), in 8 processes; a test
# that would start in the last 45 s of the step's cap is skipped as not run,
# so that the JUnit file is written; one that runs over 60 s fails with its
# traceback (pytest-timeout, where installed). A test that crashes its
# process is reported by name (pytest-xdist). cuda_tests CAP
cuda_tests() {
  local xml=$REPORT_DIR/pytest_cuda.xml extra=()
  "$PY" -c "import xdist" 2>/dev/null && [ "$DEVICE" = cuda ] && extra+=(-n 8)
  "$PY" -c "import pytest_timeout" 2>/dev/null && extra+=(--timeout 60)
  step pytest_cuda "$1" --junit "$xml" -- bash -c \
    'export DINO_OPT_TEST_DEADLINE=$(($(date +%s) + STEP_LIMIT - 45)); exec "$@"' _ \
    "$PY" -m pytest tests_py -m cuda "${extra[@]}" -v -ra -p no:cacheprovider "--junitxml=$xml"
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

# The headline: DINO's ViT-S/16 recipe (2x224 + 8x96 crops, out_dim 65536,
# batch 64, data loading included), the published step against dino_opt with
# every switch of `dino-opt train` on (eager, its default), with and without
# gradient checkpointing. The bench keeps 15 s for writing its table; rows
# that do not fit are reported as not run.
headline() {
  local train=(--config recipe --only baseline,all,all_no_ckpt --without compile --steps 40
               --warmup 10)
  [ "$QUICK" = 1 ] && train=(--config cpu --quick --only baseline,all)
  bench_step bench_train 150 bench/bench_train.py "${train[@]}" --time-budget 135
  # the plot stays behind: $OUT brings back 8 files
  mv -f "$REPORT_DIR/bench_train.png" "$BUILD_DIR/" 2>/dev/null || true
}

stage_proof() {
  ensure_built || return 1
  # The first check a user runs: every fused operator on the device against its plain form.
  step doctor 30 -- "$PY" -m dino_opt.cli doctor
  cpp_tests
  cuda_tests 130
  headline
  bench_step bench_loss 40 bench/bench_loss.py --repeats 10 -- --batch 4 --dim 4096 --repeats 1
  bench_step bench_ema 20 bench/bench_ema.py --repeats 10 -- --repeats 2 --models ViT-S/16
}

# An FSDP run of one epoch of the demo on NCCL (one process on a GPU, gloo on a CPU).
fsdp_job() {
  local run=$BUILD_DIR/fsdp-run tiny=()
  rm -rf "$run"
  if [ "$QUICK" = 1 ]; then  # 12 steps of a small built-in data set, not the default's 125
    "$PY" -c "import sys; from dino_opt.data import builtin_dataset; builtin_dataset(sys.argv[1], \
train_per_class=20, val_per_class=5, test_per_class=0, image_size=48)" "$BUILD_DIR/fsdp-data"
    tiny=("${TINY[@]}" model.backbone=vit_tiny data.batch_size=16 "data.root=$BUILD_DIR/fsdp-data/train")
  fi
  step fsdp_job 120 -- "$PY" -m dino_opt.cli train --nproc 1 --output-dir "$run" \
    distributed.strategy=fsdp schedule.epochs=1 schedule.warmup_epochs=0 eval.linear=false \
    eval.dense=false eval.pictures=0 logging.progress=false "${tiny[@]}"
}

# What hardware.preset=auto picks on this card, and the batch size measured for it.
presets() {
  local args=(--measure --steps 2)
  [ "$QUICK" = 1 ] && args=(--measure --steps 1 --max-batch 2 hardware.preset=cpu "${TINY[@]}")
  step presets 60 --embed "presets=$BUILD_DIR/presets.json" -- bash -c \
    "set -o pipefail; \"\$0\" -m dino_opt.cli presets --json \"\${@}\" | tee '$BUILD_DIR/presets.json'" \
    "$PY" "${args[@]}"
}

# The rehearsal's sizes on a CPU.
TINY=(hardware.device=cpu augmentation.global_crop_size=32 augmentation.local_crop_size=16
      model.out_dim=128 model.hidden_dim=64 model.bottleneck_dim=32)

# The proof's tests alone, with more time for the `cuda` tests, and the NCCL job.
stage_tests() {
  ensure_built || return 1
  step doctor 30 -- "$PY" -m dino_opt.cli doctor
  cpp_tests
  cuda_tests 220
  fsdp_job
}

# Most useful first: NCCL, the loader on 16 cores, the presets, the other benches.
stage_rest() {
  ensure_built || return 1
  fsdp_job
  # The synthetic JPEGs are generated under build/ on the first run (16 cores: seconds).
  bench_step bench_loader 90 bench/bench_loader.py --device "$DEVICE" --repeats 2 \
    -- --count 96 --batch-size 16 --repeats 1 --warmup 1
  presets
  bench_step bench_photometric 45 bench/bench_photometric.py -- --images 4 --repeats 1
  bench_step bench_profiler 45 bench/bench_profiler.py -- --steps 5 --batch 4 --out-dim 256
  # The head in a frozen-last-layer epoch: its weight gradient skipped against computed and dropped.
  bench_step bench_head 30 bench/bench_head.py -- --rows 40 --repeats 2 --rounds 1
  # Checkpoints every 1/10/100 steps, sync vs async, ViT-S/16.
  bench_step bench_checkpoint 90 bench/bench_checkpoint.py --models vit_small --batch-size 64 \
    --repeats 1 -- --models demo --batch-size 8 --every 1,10 --saves 1 --min-steps 2
}

# The whole training step, settled: DINO's ViT-S/16 recipe at batch 64, the
# published step, the strong baseline (bf16, compiled blocks, fused AdamW,
# foreach EMA), dino_opt's rows without and with checkpointing (the default
# step with selective checkpointing at auto's first rung, then the default
# step replayed as CUDA graphs, last), and the model step on crops already on
# the GPU (what bounds the step), in 3 interleaved
# rounds, with MFU; the rows that do not fit the budget are reported as not run.
stage_step() {
  ensure_built || return 1
  # the default row last in each round: its first round compiles every block
  # (a graph per crop size and drop-path rate), which must not starve the others
  local train=(--config recipe
               --only baseline,strong,all_no_ckpt,all,model_step,default,default_lean,default_graphs
               --steps 60 --warmup 10 --repeats 3)
  [ "$QUICK" = 1 ] && train=(--config cpu --quick --only baseline,strong,all_no_ckpt,model_step,default,default_lean)
  bench_step bench_step 450 bench/bench_train.py "${train[@]}" --time-budget 430
  mv -f "$REPORT_DIR/bench_step.png" "$BUILD_DIR/" 2>/dev/null || true
}

# A stage's budget: one GPU call's, but for a build made on the CPU machine
# that prepares the call (carry; build in the rehearsal, GPU_CHECK_QUICK=1).
stage_budget() {
  case $1 in
    carry) echo "$BUILD_BUDGET" ;;
    build) if [ "$QUICK" = 1 ]; then echo "$BUILD_BUDGET"; else echo "$CALL_BUDGET"; fi ;;
    *) echo "$CALL_BUDGET" ;;
  esac
}

run_stage() {
  stage=$1
  stage_start=$SECONDS
  BUDGET=$(stage_budget "$stage")
  echo "== stage $stage (budget $BUDGET s) on $(hostname), $(date -Is)" | tee -a "$LOG"
  case $stage in
    proof) stage_proof ;;
    rest) stage_rest ;;
    tests) stage_tests ;;
    step) stage_step ;;
    carry) stage_carry ;;
    build) ensure_built ;;
  esac
  echo "== stage $stage done after $((SECONDS - stage_start)) s" | tee -a "$LOG"
}

for s in "${stages[@]}"; do run_stage "$s"; done
report verdict "$REPORT_DIR" | tee -a "$LOG"
[ "${PIPESTATUS[0]}" -eq 0 ] && [ "$failed" -eq 0 ]
