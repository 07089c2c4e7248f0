# dino_opt: setup / test / bench / gpu-check / lint.
# `make test` is all a fresh machine needs: it runs `make setup` first.
SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := test

PYTHON      ?= python3
VENV        ?= .venv
PY          := $(VENV)/bin/python
TORCH_SPEC  ?= torch==2.14.1 torchvision==0.29.1
APT_PACKAGES := libopencv-core-dev libopencv-imgcodecs-dev libturbojpeg0-dev \
                libgtest-dev ninja-build ccache clang-format cmake clang-14 libfuzzer-14-dev
JOBS        ?= $(shell nproc)
STAMPS      := $(VENV)/.stamps
# One persistent build directory per Python and torch: rebuilds are incremental.
BUILD_TAG    = $(shell $(PY) -c "import sys, torch; print(f'cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__.split(\"+\")[0]}')")
BUILD_DIR    = build/$(BUILD_TAG)
NATIVE_SRCS := CMakeLists.txt pyproject.toml $(shell find csrc tests_cpp cmake build_support -type f -not -name '*.pyc' 2>/dev/null)
CXX_FILES   := $(shell find csrc tests_cpp fuzz examples -name '*.cpp' -o -name '*.h' -o -name '*.cu' -o -name '*.cuh' 2>/dev/null)
PY_DIRS     := python tests_py bench scripts build_support
export CCACHE_DIR ?= $(HOME)/.cache/ccache
# Paths relative to the build folder in ccache's keys: the editable build, the
# wheel's and the C++ package's share their compiled objects.
export CCACHE_BASEDIR := $(CURDIR)
export CMAKE_BUILD_PARALLEL_LEVEL := $(JOBS)

.PHONY: apt-packages setup build test test-cpp test-py test-times fuzz bench bench-check demo demo-dinov2 demo-distill lint format gpu-check \
        gpu-debs gpu-rehearsal wheel wheel-smoke build-no-cuda-toolkit cpp-install cpp-example clean

setup: $(STAMPS)/build

# System packages: a quick dpkg query each time; apt-get only when one is missing.
apt-packages:
	@installed=$$(dpkg-query -W -f='$${Status}\n' $(APT_PACKAGES) 2>/dev/null | grep -c "install ok installed" || true); \
	if [ "$$installed" -ne "$(words $(APT_PACKAGES))" ]; then \
	  SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
	  $$SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -q $(APT_PACKAGES); \
	fi

$(PY): | apt-packages
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

# Byte code: pip does not compile what it installs (--no-compile: 6,400 of
# torch's and the pinned packages' modules, most of which no process here
# imports; about 100 s of one core); the first process that imports a module
# writes its byte code, which the others then read. These machines set
# PYTHONDONTWRITEBYTECODE, under which every import would compile its modules
# again, so this project's commands run without it.
unexport PYTHONDONTWRITEBYTECODE
PIP_INSTALL := $(PY) -m pip install -q --no-compile

# torch from this machine's disk (a CUDA build, so the CUDA sources compile and link).
$(STAMPS)/torch: | $(PY)
	@mkdir -p $(STAMPS)
	$(PIP_INSTALL) $(TORCH_SPEC)
	@touch $@

# The Python dependencies pinned in pyproject.toml (runtime, test, lint, build).
$(STAMPS)/deps: pyproject.toml $(STAMPS)/torch
	$(PIP_INSTALL) $$($(PY) -c "import tomllib; t = tomllib.load(open('pyproject.toml', 'rb')); p = t['project']; print(' '.join(t['tool']['dynamic-metadata'][0]['requires'] + [r for v in p['optional-dependencies'].values() for r in v]))")
	@touch $@

# The package's list of modules: the editable install maps each module to its
# file, so adding, moving or removing one needs a reinstall (editing does not).
PY_MODULES := $(STAMPS)/py-modules
# (A file of this make's own first: makes run side by side by CI read the list at once.)
$(shell mkdir -p $(STAMPS) && new=$(PY_MODULES).$$$$ && find python -name '*.py' | sort >$$new && \
  { cmp -s $$new $(PY_MODULES) && rm $$new || mv $$new $(PY_MODULES); })

# Editable install into the persistent build directory, with ccache; re-run
# only when a native source or the list of modules changed.
$(STAMPS)/build: $(NATIVE_SRCS) $(PY_MODULES) $(STAMPS)/deps | apt-packages
	$(PY) -m pip install --no-build-isolation --no-deps -e . \
	  -Cbuild-dir=$(BUILD_DIR) -Ccmake.define.DINO_OPT_BUILD_TESTS=ON
	@touch $@

build: setup

# The fuzz run keeps one core busy (libFuzzer is one process): it runs beside
# the pinned packages' install, the build and the tests (it needs torch's
# numpy and Pillow, not those), its output in $(FUZZ_LOG), shown when they
# end (all of it if it failed); then lint.
FUZZ_LOG := build/fuzz.log
test: $(STAMPS)/torch
	@mkdir -p $(dir $(FUZZ_LOG))
	@$(MAKE) --no-print-directory fuzz >$(FUZZ_LOG) 2>&1 & fuzz=$$!; \
	  echo "make fuzz: beside the build and the tests (log: $(FUZZ_LOG))"; \
	  tests=0; $(MAKE) --no-print-directory setup test-cpp test-py || tests=$$?; \
	  fuzzed=0; wait $$fuzz || fuzzed=$$?; \
	  echo "----- make fuzz ($(FUZZ_LOG)): exit status $$fuzzed"; \
	  if [ $$fuzzed -eq 0 ]; then tail -n 20 $(FUZZ_LOG); else cat $(FUZZ_LOG); fi; \
	  [ $$tests -eq 0 ] && [ $$fuzzed -eq 0 ]
	$(MAKE) --no-print-directory lint

# --no-tests=error: a build without the C++ tests is a failure, never a silent pass.
test-cpp:
	ctest --test-dir $(BUILD_DIR) --output-on-failure --no-tests=error

# The tests in one process per core (pytest-xdist; a test module's tests in
# one process, so that its module fixtures are made once; the modules handed
# out in the order tests_py/conftest.py gives, the longest first, rather than
# xdist's by number of tests), each with one intra-op thread; the 25 slowest
# are listed at the end, and every test's seconds go to $(TEST_TIMES) (JUnit
# XML), which `make test-times` reads. TESTS: the files or folder to run.
TEST_WORKERS ?= $(JOBS)
TEST_TIMES   ?= build/pytest-times.xml
TESTS        ?= tests_py
test-py:
	@mkdir -p $(dir $(TEST_TIMES))
	OMP_NUM_THREADS=1 $(PY) -m pytest $(TESTS) -n $(TEST_WORKERS) --dist loadscope --no-loadscope-reorder \
	  --durations=25 --junitxml=$(TEST_TIMES)

# The slowest tests and test files of the last `make test-py` (docs/testing.md).
test-times:
	$(PY) scripts/test_durations.py $(TEST_TIMES) --slowest 5 --files 5

# The loader's image pipeline under libFuzzer + ASan/UBSan for FUZZ_SECONDS,
# from a seed corpus of every format, then the shards' tar reader for
# FUZZ_TAR_SECONDS from tars in every header format; findings are written to
# build/fuzz. close_fd_mask=2 hides the decoders' own stderr chatter, not
# sanitizer reports.
FUZZ_DIR     := build/fuzz
FUZZ_SECONDS ?= 60
FUZZ_TAR_SECONDS ?= 30
fuzz: $(STAMPS)/torch | apt-packages
	CXX=clang++-14 cmake -S fuzz -B $(FUZZ_DIR) -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo >/dev/null
	cmake --build $(FUZZ_DIR)
	$(PY) scripts/fuzz_corpus.py $(FUZZ_DIR)/seeds
	$(PY) scripts/fuzz_corpus.py --tar $(FUZZ_DIR)/tar_seeds
	mkdir -p $(FUZZ_DIR)/corpus $(FUZZ_DIR)/tar_corpus
	cd $(FUZZ_DIR) && ./fuzz_multicrop -max_total_time=$(FUZZ_SECONDS) -timeout=10 \
	  -rss_limit_mb=2048 -close_fd_mask=2 -print_final_stats=1 corpus seeds
	cd $(FUZZ_DIR) && ./fuzz_tar -max_total_time=$(FUZZ_TAR_SECONDS) -timeout=10 \
	  -rss_limit_mb=2048 -print_final_stats=1 tar_corpus tar_seeds

# A wheel built against this environment's torch; its metadata pins that
# torch's series (torch==X.Y.*), the only ABI its compiled core loads with.
# Built as `pip install .` builds, in pip's build isolation, which
# build_support/torch_pin.py sees past to find the installed torch.
WHEEL_DIR ?= dist
wheel: setup
	rm -f $(WHEEL_DIR)/dino_opt-*.whl
	$(PY) -m pip wheel -q --no-deps . -w $(WHEEL_DIR) -Cbuild-dir=build/wheel-$(BUILD_TAG)
	@ls -l $(WHEEL_DIR)/dino_opt-*.whl

# The wheel in a fresh environment: its requirements come from $(VENV)
# through a .pth file and nothing is downloaded (--no-index); torch is linked
# beside it, where a wheel's C++ library looks for LibTorch. Then
# scripts/smoke_test.py and the C++ example against the wheel's package.
SMOKE_VENV := build/wheel-smoke
PURELIB    := import sysconfig; print(sysconfig.get_paths()['purelib'])
wheel-smoke: wheel
	rm -rf $(SMOKE_VENV)
	$(PY) -m venv --without-pip $(SMOKE_VENV)
	site=$$($(SMOKE_VENV)/bin/python -c "$(PURELIB)") deps=$$($(PY) -c "$(PURELIB)"); \
	  echo "$$deps" >"$$site/requirements.pth" && ln -s "$$deps/torch" "$$site/torch"
	$(PY) -m pip --python $(SMOKE_VENV)/bin/python install -q --no-index $(WHEEL_DIR)/dino_opt-*.whl
	cd build && ../$(SMOKE_VENV)/bin/python ../scripts/smoke_test.py --expect-under ../$(SMOKE_VENV)
	bash scripts/cpp_example.sh $(SMOKE_VENV)/bin/python \
	  "$$($(SMOKE_VENV)/bin/python -c 'import dino_opt; print(dino_opt.cmake_prefix_path)')" \
	  build/example-wheel

# What `pip install .` gives on a machine without the CUDA toolkit, with this
# CUDA build of torch. scripts/no_cuda_toolkit.sh hides the toolkit in a mount
# namespace of its own and checks that neither PATH nor CMake finds nvcc;
# there, a wheel is built as `pip install .` builds it (pip's build isolation,
# a fresh build folder of its own each time, the compiled objects from ccache
# when run again) and its output must hold, once, the line saying the CUDA
# kernels were left out. The wheel then goes into a fresh environment as in
# wheel-smoke where, the toolkit still hidden, dino_opt must import with
# cuda_compiled False and run its loss forward and backward on CPU tensors,
# and the C++ example must build against its package and run.
# Worked out once, on first use (BUILD_TAG imports torch).
NOCUDA_DIR    = $(eval NOCUDA_DIR := build/nocuda-$$(BUILD_TAG))$(NOCUDA_DIR)
NOCUDA_VENV   = $(NOCUDA_DIR)/venv
NOCUDA_LINE  := dino_opt: CUDA kernels left out (CPU-only build)
NOCUDA_CHECK := import dino_opt, torch; info = dino_opt.build_info(); \
  assert info["cuda_compiled"] is False, info; \
  s = torch.randn(12, 32, requires_grad=True); \
  loss = dino_opt.dino_loss(s, torch.randn(6, 32), torch.zeros(1, 32), 0.1, 0.04, 4); \
  loss.backward(); \
  assert torch.isfinite(loss) and torch.isfinite(s.grad).all(), "loss"; \
  print(f"build-no-cuda-toolkit: {dino_opt.__file__}: cuda_compiled False, CPU loss {loss.item():.4f}")
build-no-cuda-toolkit: $(STAMPS)/deps | apt-packages
	rm -rf $(NOCUDA_DIR)
	mkdir -p $(NOCUDA_DIR)
	scripts/no_cuda_toolkit.sh $(PY) -m pip wheel -v --no-deps . -w $(NOCUDA_DIR)/dist \
	  -Cbuild-dir=$(NOCUDA_DIR)/build >$(NOCUDA_DIR)/build.log 2>&1 || \
	  { tail -n 40 $(NOCUDA_DIR)/build.log; echo "build-no-cuda-toolkit: the build failed ($(NOCUDA_DIR)/build.log)"; exit 1; }
	@head -n 1 $(NOCUDA_DIR)/build.log
	@n=$$(grep -c -F "$(NOCUDA_LINE)" $(NOCUDA_DIR)/build.log || true); \
	  if [ "$$n" != 1 ]; then \
	    echo "build-no-cuda-toolkit: '$(NOCUDA_LINE)' printed $$n times, not once ($(NOCUDA_DIR)/build.log)"; exit 1; \
	  fi; grep -F "$(NOCUDA_LINE)" $(NOCUDA_DIR)/build.log
	$(PY) -m venv --without-pip $(NOCUDA_VENV)
	site=$$($(NOCUDA_VENV)/bin/python -c "$(PURELIB)") deps=$$($(PY) -c "$(PURELIB)"); \
	  echo "$$deps" >"$$site/requirements.pth" && ln -s "$$deps/torch" "$$site/torch"
	$(PY) -m pip --python $(NOCUDA_VENV)/bin/python install -q --no-index $(NOCUDA_DIR)/dist/dino_opt-*.whl
	cd build && ../scripts/no_cuda_toolkit.sh ../$(NOCUDA_VENV)/bin/python -c '$(NOCUDA_CHECK)'
	scripts/no_cuda_toolkit.sh bash scripts/cpp_example.sh $(NOCUDA_VENV)/bin/python \
	  "$$($(NOCUDA_VENV)/bin/python -c 'import dino_opt; print(dino_opt.cmake_prefix_path)')" \
	  $(NOCUDA_DIR)/example

# The C++ package alone (cmake --install: lib/, include/dino_opt/,
# lib/cmake/dino_opt/), then examples/cpp built against it and run.
CPP_BUILD  = build/cpp-$(BUILD_TAG)
CPP_PREFIX = build/cpp-prefix-$(BUILD_TAG)
cpp-install: setup
	cmake -S . -B $(CPP_BUILD) -G Ninja -DCMAKE_BUILD_TYPE=Release \
	  -DPython_EXECUTABLE=$(abspath $(PY)) -DCMAKE_INSTALL_PREFIX=$(abspath $(CPP_PREFIX)) >/dev/null
	cmake --build $(CPP_BUILD) --target dino_opt_core
	cmake --install $(CPP_BUILD) >/dev/null

cpp-example: cpp-install
	bash scripts/cpp_example.sh $(PY) $(abspath $(CPP_PREFIX)) build/example

# The main job: set up, then train DINO on the built-in data set (the demo
# preset), evaluate by k-NN against random initialisation, write runs/demo.
DEMO_DIR ?= runs/demo
demo: setup
	rm -rf $(DEMO_DIR)
	$(VENV)/bin/dino-opt train --output-dir $(DEMO_DIR) $(DEMO_ARGS)

# The same data and budget with the DINOv2 recipe (DINO + iBOT + KoLeo).
DEMO_DINOV2_DIR ?= runs/demo_dinov2
demo-dinov2: setup
	rm -rf $(DEMO_DINOV2_DIR)
	$(VENV)/bin/dino-opt train --demo dinov2 --output-dir $(DEMO_DINOV2_DIR) $(DEMO_ARGS)

# Distillation on the same data: a ViT-S/16 teacher trained with the demo
# recipe for 60 epochs (7.5 times the students' 8: a teacher that knows more
# than they can learn alone), then distilled (features) into the demo's
# ViT-T/16 and a ResNet-18. The teacher trains under bfloat16 autocast
# (DEMO_TEACHER_ARGS): on a CPU with AMX or AVX-512 BF16 that was 1.45x
# float32's step (about an hour on 2 cores); elsewhere set
# DEMO_TEACHER_ARGS=schedule.epochs=60 (float32).
DEMO_DISTILL_DIR  ?= runs/demo_distill
DEMO_TEACHER_ARGS ?= schedule.epochs=60 hardware.precision=bf16
demo-distill: setup
	rm -rf $(DEMO_DISTILL_DIR)
	$(VENV)/bin/dino-opt train --output-dir $(DEMO_DISTILL_DIR)/teacher_vits \
		model.backbone=vit_small eval.every_epochs=20 $(DEMO_TEACHER_ARGS) $(DEMO_ARGS)
	$(VENV)/bin/dino-opt train --demo distill --output-dir $(DEMO_DISTILL_DIR)/students \
		recipe.distill.teacher=$(DEMO_DISTILL_DIR)/teacher_vits 'recipe.distill.students=[resnet18]' \
		$(DEMO_ARGS)

bench: setup
	$(PY) bench/bench_ema.py
	$(PY) bench/bench_loss.py
	$(PY) bench/bench_profiler.py
	$(PY) bench/bench_photometric.py
	$(PY) bench/bench_loader.py
	$(PY) bench/bench_head.py

# Each piece's bench in its quick mode, ours beside its baseline in one process,
# in the default environment; fails naming the piece whose ratio is under its
# floor in bench/floors.json (twice: a second run guards against a busy machine).
# About a minute on a 2-core machine.
bench-check: setup
	$(PY) bench/bench_check.py

lint: setup
	clang-format --dry-run -Werror $(CXX_FILES)
	$(VENV)/bin/ruff check $(PY_DIRS)
	$(VENV)/bin/ruff format --check $(PY_DIRS)
	$(PY) scripts/size_guide.py

format: setup
	clang-format -i $(CXX_FILES)
	$(VENV)/bin/ruff check --fix $(PY_DIRS)
	$(VENV)/bin/ruff format $(PY_DIRS)

# The GPU check, in stages that each fit one 10-minute call of an offline GPU
# machine (docs/gpu_check.md): STAGE=build|cuda-tests|bench|e2e, a comma list,
# or all. It builds without OpenCV against the machine's own torch, with
# libjpeg-turbo and GoogleTest unpacked from the .deb files of `make gpu-debs`
# (carry third_party/debs), and appends its report to REPORT_DIR.
STAGE      ?= all
REPORT_DIR ?= build/gpu-report
gpu-check:
	STAGE="$(STAGE)" REPORT_DIR="$(REPORT_DIR)" bash scripts/gpu_check.sh

# The .deb files the GPU build unpacks, and the build backend's wheel for a
# machine whose scikit-build-core is older than pyproject.toml needs: nothing
# else is carried.
GPU_DEBS := libturbojpeg0 libturbojpeg0-dev libgtest-dev
GPU_SKBUILD := scikit-build-core==1.1.2
gpu-debs: | $(PY)
	@mkdir -p third_party/debs
	@cd third_party/debs && missing=$$(for p in $(GPU_DEBS); do ls $${p}_*.deb >/dev/null 2>&1 || echo $$p; done); \
	if [ -n "$$missing" ]; then \
	  apt-get download $$missing 2>/dev/null || { \
	    SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); $$SUDO apt-get update -q && apt-get download $$missing; }; \
	fi
	@ls third_party/debs/scikit_build_core-*.whl >/dev/null 2>&1 || \
	  $(PY) -m pip download -q --no-deps --only-binary=:all: $(GPU_SKBUILD) -d third_party/debs

# The same script, stage by stage, here: system OpenCV, libjpeg-turbo and
# GoogleTest hidden from CMake, a separate build folder and Python environment,
# ldd of every built object checked against the carried prefix; the CUDA tests
# skip. With this machine's torch by default; GPU_STACK=1 uses the GPU
# machine's Python and torch instead (from PyPI). The report goes to
# build/gpu-rehearsal*/report.
GPU_STACK ?=
GPU_STACK_VARS := REHEARSAL_PYTHON=3.12 REHEARSAL_TORCH=2.11.0 REHEARSAL_TORCHVISION=0.26.0 \
                  REHEARSAL_SKBUILD=0.11.6
gpu-rehearsal: setup gpu-debs
	$(if $(GPU_STACK),$(GPU_STACK_VARS)) PYTHON=$(PY) STAGE="$(STAGE)" bash scripts/gpu_rehearsal.sh

clean:
	rm -rf build $(STAMPS)/build
