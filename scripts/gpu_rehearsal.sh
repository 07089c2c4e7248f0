#!/usr/bin/env bash
# `make gpu-rehearsal`: runs scripts/gpu_check.sh here, stage by stage, as it
# would run on the GPU machine, against only what would be carried there:
#   - a Python environment of its own in which dino_opt is not installed (as
#     on the GPU machine, where torch comes with the image): by default this
#     checkout's .venv made visible through a .pth file; with REHEARSAL_TORCH
#     (and REHEARSAL_PYTHON, REHEARSAL_TORCHVISION) the GPU machine's own
#     Python and torch, installed from PyPI, with the CUDA 13 libraries of
#     .venv standing in for torch's (same sonames); REHEARSAL_SKBUILD, an
#     older scikit-build-core than the build needs, so that the carried one
#     is used as it would be on a machine with such;
#   - the .deb files of third_party/debs unpacked into a prefix of its own;
#   - CMake told to ignore the system prefixes / and /usr
#     (CMAKE_IGNORE_PREFIX_PATH), so the system's OpenCV, libjpeg-turbo and
#     GoogleTest cannot stand in for missing ones;
#   - a build folder of its own, build/gpu-rehearsal-build: as deep under
#     the checkout as `make setup`'s (build/cp311-torch...), so that the
#     paths ccache keys on (relative to CCACHE_BASEDIR, from the build
#     folder) are the same and the objects compiled with the same flags (the
#     core, the CPU kernels, the bindings: all but the loader's library and
#     the C++ tests, which are built without OpenCV here) come from the
#     cache once `make setup` compiled them (CI of 541db19: its build step
#     219 s, one folder deeper, with those recompiled after a change to the
#     loader's sources); small bench sizes (GPU_CHECK_QUICK=1);
#     with this checkout's torch, the CUDA architectures of this checkout's
#     own build (not the GPU's alone, 90, as there), so that the CUDA
#     compiles, keyed also on the build folder's absolute path, come from
#     this folder's previous build (CI: ~400 s less on 2 cores);
#     the GPU machine's torch (REHEARSAL_TORCH) compiles anew anyway and
#     keeps 90.
# Each stage is a separate run, as each is a separate call there: by default
# build, proof, rest (the build made here, as on a machine that was carried
# none); with REHEARSAL_TORCH carry, proof, rest, where `carry` builds the
# wheel and C++ test program that the GPU machine installs instead of
# building, into .gpu-carry (the folder the GPU call carries), and `proof`
# installs it. The CUDA tests skip here. Then scripts/check_rehearsal.py
# judges the report and the plan: each step's seconds here against its cap
# there, and the caps of `proof` within one call's 480 s.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-.venv/bin/python}
TORCH=${REHEARSAL_TORCH:-}
ROOT=build/gpu-rehearsal${TORCH:+-torch$TORCH}
BUILD=$ROOT-build
REPORT_DIR=$(realpath -m "${REPORT_DIR:-$ROOT/report}")
STAGES=${STAGE:-all}
if [ "$STAGES" = all ]; then
  if [ -n "$TORCH" ]; then STAGES=carry,proof,rest; else STAGES=build,proof,rest; fi
fi
CARRY=${GPU_CHECK_CARRY:-$([ -n "$TORCH" ] && echo .gpu-carry || echo "$ROOT/carry")}
start=$SECONDS
venv=$ROOT/venv
tools=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")

# An interpreter of version $1 (e.g. 3.12): on PATH, or one of pyenv's.
python_of_version() {
  local v=$1 p
  if "python$v" --version >/dev/null 2>&1; then command -v "python$v"; return; fi
  for p in "$(pyenv root 2>/dev/null || echo "$HOME/.pyenv")"/versions/"$v"*/bin/python"$v"; do
    [ -x "$p" ] && echo "$p" && return
  done
  echo "gpu-rehearsal: no python$v here (REHEARSAL_PYTHON)" >&2
  return 1
}

# This checkout's packages, torch included, through a .pth file.
make_tools_env() {
  "$PY" -m venv --without-pip "$venv"
  echo "$tools" >"$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/gpu_rehearsal_tools.pth"
}

# The GPU machine's Python, torch and torchvision, CMake and ninja from PyPI
# as there, and what dino_opt and its tests import; the CUDA libraries torch
# loads are .venv's.
make_stack_env() {
  "$(python_of_version "${REHEARSAL_PYTHON:-3.12}")" -m venv "$venv"
  local pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
  "${pip[@]}" --no-deps --only-binary=:all: "torch==$TORCH" \
    ${REHEARSAL_TORCHVISION:+"torchvision==$REHEARSAL_TORCHVISION"}
  "${pip[@]}" numpy pillow pyyaml tqdm matplotlib tensorboard pytest safetensors timm \
    "scikit-build-core${REHEARSAL_SKBUILD:+==$REHEARSAL_SKBUILD}" \
    cmake ninja sympy networkx jinja2 fsspec filelock typing-extensions
  ln -s "$tools/nvidia" "$("$venv/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/nvidia"
}

if [ ! -f "$venv/.complete" ]; then  # made here once; a half-made one is made again
  rm -rf "$venv"
  if [ -n "$TORCH" ]; then make_stack_env; else make_tools_env; fi
  if "$venv/bin/python" -c "import dino_opt; dino_opt.build_info()" 2>/dev/null; then
    echo "gpu-rehearsal: dino_opt is importable in the new $venv: it would hide a failed build" >&2
    exit 1
  fi
  touch "$venv/.complete"
fi
"$venv/bin/python" -c "import sys, torch; print('rehearsal environment: Python', sys.version.split()[0], 'torch', torch.__version__)"

if [ -z "$TORCH" ] && [ -z "${DINO_OPT_CUDA_ARCHS:-}" ]; then
  DINO_OPT_CUDA_ARCHS=$("$PY" -c "import dino_opt; print(';'.join(map(str, dino_opt.build_info()['cuda_archs'])))")
  [ -n "$DINO_OPT_CUDA_ARCHS" ] && export DINO_OPT_CUDA_ARCHS
fi

rm -rf "$REPORT_DIR"
IFS=, read -r -a stages <<<"$STAGES"
for stage in "${stages[@]}"; do
  PYTHON=$venv/bin/python STAGE=$stage REPORT_DIR=$REPORT_DIR GPU_CHECK_QUICK=1 \
    GPU_CHECK_BUILD_DIR=$BUILD GPU_CHECK_PREFIX=$ROOT/prefix GPU_CHECK_CARRY=$CARRY \
    GPU_CHECK_CMAKE_DEFINES="CMAKE_IGNORE_PREFIX_PATH=/usr;/" \
    bash scripts/gpu_check.sh || true
done
# What a GPU call carries: the .deb files, and the carried build when there is one.
carry_paths=(third_party/debs)
[ -f "$CARRY/digest" ] && carry_paths+=("$CARRY")
carried=$(du -scb "${carry_paths[@]}" | tail -n 1 | cut -f1)
echo "carried: ${carry_paths[*]}, $carried bytes"
# The CMake cache to judge: the carry stage's build where the carried build was
# installed (this run's carry stage, or an earlier one's), else the stage's own.
build_dir=$BUILD
if [[ ,$STAGES, == *,carry,* ]] || "$PY" -c "import json, sys; steps = json.load(open(sys.argv[1]))['steps']; \
sys.exit(not any(s['name'] == 'install' and s['status'] == 'pass' for s in steps))" "$REPORT_DIR/gpu_check.json"; then
  build_dir=$BUILD-carry
fi
"$PY" scripts/check_rehearsal.py "$REPORT_DIR" --stages "$STAGES" --build-dir "$build_dir" \
  --venv "$venv" --prefix "$ROOT/prefix" --carried-bytes "$carried"
echo "gpu-rehearsal: $((SECONDS - start)) s"
