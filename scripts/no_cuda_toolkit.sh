#!/usr/bin/env bash
# Runs a command as on a machine without the CUDA toolkit (`make
# build-no-cuda-toolkit`, tests_py/test_no_cuda_toolkit.py): in a mount
# namespace of its own (unshare; through a user namespace when not root),
#   - every toolkit root is an empty read-only tmpfs: /usr/local/cuda*,
#     /opt/cuda*, /usr/lib/nvidia-cuda-toolkit, /usr/lib/cuda, those named by
#     CUDA_HOME, CUDA_PATH, CUDAToolkit_ROOT, CUDA_TOOLKIT_ROOT_DIR and CUDACXX,
#     and the root of each nvcc on PATH (never /, /usr, /usr/local or /opt);
#   - every CUDA tool still on PATH (a wrapper script in /usr/local/bin, or
#     /usr/bin/nvcc) is covered by an empty file that is not executable;
#   - CUDACXX, CUDA_HOME, CUDA_PATH, CUDAToolkit_ROOT and CUDA_TOOLKIT_ROOT_DIR
#     are unset.
# Then it checks that nvcc cannot be found, neither on PATH nor by CMake's
# check_language(CUDA), prints one line saying what it hid, and runs the
# command. The rest of the machine (the compilers, ccache, the checkout,
# torch's own CUDA libraries) is untouched.
#
#   scripts/no_cuda_toolkit.sh COMMAND [ARG...]
#   scripts/no_cuda_toolkit.sh true      # only the checks
#
# Exit status 3, with one line on stderr: the toolkit cannot be hidden here
# (no unshare, or no permission for a mount namespace).
set -euo pipefail
me=no_cuda_toolkit.sh

if [ "${_DINO_OPT_NO_CUDA_NS:-}" != 1 ]; then
  if [ $# -eq 0 ]; then
    echo "usage: scripts/no_cuda_toolkit.sh COMMAND [ARG...]" >&2
    exit 2
  fi
  flags=(--mount --propagation private)
  [ "$EUID" = 0 ] || flags+=(--map-root-user)
  if ! command -v unshare >/dev/null || ! unshare "${flags[@]}" true 2>/dev/null; then
    echo "$me: cannot hide the CUDA toolkit here: 'unshare ${flags[*]}' is unavailable or not permitted" >&2
    exit 3
  fi
  exec env _DINO_OPT_NO_CUDA_NS=1 unshare "${flags[@]}" bash "$0" "$@"
fi
unset _DINO_OPT_NO_CUDA_NS

tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# ---------------------------------------------------------------- the roots
roots=()
add_root() {
  local d
  [ -n "$1" ] || return 0
  d=$(realpath -e "$1" 2>/dev/null) || return 0
  [ -d "$d" ] || return 0
  case "$d" in / | /usr | /usr/local | /opt) return 0 ;; esac
  local r
  for r in "${roots[@]+"${roots[@]}"}"; do [ "$r" = "$d" ] && return 0; done
  roots+=("$d")
}
shopt -s nullglob
for d in /usr/local/cuda /usr/local/cuda-* /opt/cuda /opt/cuda-* /usr/lib/nvidia-cuda-toolkit /usr/lib/cuda; do
  add_root "$d"
done
shopt -u nullglob
for v in CUDA_HOME CUDA_PATH CUDAToolkit_ROOT CUDA_TOOLKIT_ROOT_DIR; do add_root "${!v:-}"; done
[ -z "${CUDACXX:-}" ] || add_root "$(dirname "$(dirname "$(realpath -m "$CUDACXX")")")"
while read -r nvcc; do
  [ -n "$nvcc" ] && add_root "$(dirname "$(dirname "$(realpath -m "$nvcc")")")"
done < <(type -ap nvcc || true)
for r in "${roots[@]+"${roots[@]}"}"; do
  mount -t tmpfs -o ro,size=4k,mode=755 no-cuda-toolkit "$r"
done
unset CUDACXX CUDA_HOME CUDA_PATH CUDAToolkit_ROOT CUDA_TOOLKIT_ROOT_DIR

# ---------------------------------------------------------------- the tools left on PATH
tools=(nvcc nvcc.profile ptxas nvlink fatbinary cudafe++ cicc bin2c cuobjdump nvdisasm nvprune
       cu++filt __nvcc_device_query)
empty=$tmp/not-a-cuda-tool
: >"$empty"
chmod 644 "$empty"
masked=()
IFS=: read -r -a path_dirs <<<"$PATH"
for d in "${path_dirs[@]}"; do
  for t in "${tools[@]}"; do
    f=$d/$t
    # -e follows a link: one into a hidden root now dangles and is found by nothing.
    if [ -e "$f" ] && ! mountpoint -q "$f"; then
      mount --bind "$empty" "$f"
      masked+=("$f")
    fi
  done
done

# ---------------------------------------------------------------- the checks
# An executable nvcc in a folder of PATH (bash's `command -v` would also name
# a covered file, which is not executable).
for d in "${path_dirs[@]}"; do
  if [ -f "$d/nvcc" ] && [ -x "$d/nvcc" ]; then
    echo "$me: nvcc is still found on PATH: $d/nvcc" >&2
    exit 1
  fi
done
probe=$tmp/probe
mkdir -p "$probe/src"
cat >"$probe/src/CMakeLists.txt" <<'EOF'
cmake_minimum_required(VERSION 3.25)
project(no_cuda_probe LANGUAGES NONE)
include(CheckLanguage)
check_language(CUDA)
if(CMAKE_CUDA_COMPILER)
  message(FATAL_ERROR "check_language(CUDA) still finds ${CMAKE_CUDA_COMPILER}")
endif()
EOF
if ! cmake -S "$probe/src" -B "$probe/build" >"$probe/log" 2>&1; then
  echo "$me: CMake still finds a CUDA compiler:" >&2
  cat "$probe/log" >&2
  exit 1
fi
hidden="${roots[*]+"${roots[*]}"}"
echo "$me: CUDA toolkit hidden (roots: ${hidden:-none}; tools: ${masked[*]+"${masked[*]}"}); nvcc not on PATH, CMake check_language(CUDA) finds none"

"$@"
