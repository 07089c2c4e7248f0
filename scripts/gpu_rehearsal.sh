#!/usr/bin/env bash
# `make gpu-rehearsal`: runs scripts/gpu_check.sh here, stage by stage, as it
# would run on the GPU machine, against only what would be carried there:
#   - a Python environment of its own in which torch and the tools of this
#     checkout's .venv are importable but dino_opt is not installed (as on the
#     GPU machine, where torch comes with the image);
#   - the .deb files of third_party/debs unpacked into a prefix of its own;
#   - CMake told to ignore /usr (CMAKE_IGNORE_PREFIX_PATH), so the system's
#     OpenCV, libjpeg-turbo and GoogleTest cannot stand in for missing ones;
#   - a build folder of its own; small bench sizes (GPU_CHECK_QUICK=1).
# Each stage is a separate run, as each is a separate call there. The CUDA
# tests skip here. Then it checks the report: every stage ran, every step
# passed, the closure check found nothing outside the prefix, torch and the
# C/C++ runtime, and the carried folder fits the device's 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
ROOT=build/gpu-rehearsal
REPORT_DIR=$(realpath -m "${REPORT_DIR:-$ROOT/report}")
STAGES=${STAGE:-all}
[ "$STAGES" = all ] && STAGES=build,cuda-tests,bench,e2e
start=$SECONDS

# The environment: a venv without dino_opt whose path holds .venv's packages.
venv=$ROOT/venv
if [ ! -x "$venv/bin/python" ]; then
  "$PY" -m venv --without-pip "$venv"
  tools=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  site=$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
  echo "$tools" >"$site/gpu_rehearsal_tools.pth"
  if "$venv/bin/python" -c "import dino_opt; dino_opt.build_info()" 2>/dev/null; then
    echo "gpu-rehearsal: dino_opt is importable in the new $venv: it would hide a failed build" >&2
    exit 1
  fi
fi

rm -rf "$REPORT_DIR"
carried=$(du -sb third_party/debs | cut -f1)
echo "carried: third_party/debs, $carried bytes ($(ls third_party/debs | tr '\n' ' '))"
IFS=, read -r -a stages <<<"$STAGES"
for stage in "${stages[@]}"; do
  PYTHON=$venv/bin/python STAGE=$stage REPORT_DIR=$REPORT_DIR GPU_CHECK_QUICK=1 \
    GPU_CHECK_BUILD_DIR=$ROOT/build GPU_CHECK_PREFIX=$ROOT/prefix \
    GPU_CHECK_CMAKE_DEFINES="CMAKE_IGNORE_PREFIX_PATH=/usr" \
    bash scripts/gpu_check.sh || true
done
"$PY" scripts/check_rehearsal.py "$REPORT_DIR" --stages "$STAGES" --build-dir "$ROOT/build" --venv "$venv" \
  --carried-bytes "$carried"
echo "gpu-rehearsal: $((SECONDS - start)) s"
