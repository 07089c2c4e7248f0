"""dino_opt: fast, memory-lean and robust DINO self-supervised training.

The hot paths are a C++/CUDA core registered as PyTorch operators
(``torch.ops.dino_opt.*``); this package is the thin Python API over them.
"""

import os

import torch  # noqa: F401  (loads libtorch before the native core)

from . import _C, ops  # noqa: F401  (_C loads the core library, which registers the ops)
from ._compat import install_module_aliases
from .ops import (
    DINOLoss,
    EMATeacher,
    NonFiniteLossError,
    cosine_scheduler,
    dino_loss,
    update_teacher,
)

__version__ = "0.1.0"

install_module_aliases()

#: Where an installed wheel keeps the C++ package (``find_package(dino_opt)``):
#: put it on ``CMAKE_PREFIX_PATH`` beside ``torch.utils.cmake_prefix_path``.
#: (An editable install has none; ``cmake --install`` makes one anywhere.)
cmake_prefix_path = os.path.join(os.path.dirname(__file__), "share", "cmake")

__all__ = [
    "DINOLoss",
    "EMATeacher",
    "NonFiniteLossError",
    "build_info",
    "cmake_prefix_path",
    "cosine_scheduler",
    "dino_loss",
    "update_teacher",
    "__version__",
]


def build_info() -> dict:
    """How the native core was built, and what this process sees at run time.

    Keys: ``version``, ``torch_version`` (running), ``torch_version_built``,
    ``cuda_compiled`` (bool), ``cuda_archs`` (list of ints), ``cxx_compiler``,
    ``cuda_compiler``, ``openmp`` (the OpenMP spec date, empty if none),
    ``parallel_info`` (ATen's threading report), ``cpu_kernels`` (the
    instruction set of the CPU kernels chosen at run time), ``image_formats``
    (the formats the native loader decodes: all five, or only JPEG in a build
    configured with ``DINO_OPT_WITH_OPENCV=OFF``), ``cuda_available``,
    ``device_name``.
    """
    native = _C.build_info()
    archs = [int(a) for a in native["cuda_archs"].split(";") if a]
    return {
        "version": __version__,
        "torch_version": torch.__version__,
        "torch_version_built": native["torch_version_built"],
        "cuda_compiled": native["cuda_compiled"] == "yes",
        "cuda_archs": archs,
        "cxx_compiler": native["cxx_compiler"],
        "cuda_compiler": native["cuda_compiler"],
        "openmp": native["openmp"],
        "parallel_info": native["parallel_info"],
        "cpu_kernels": native["cpu_kernels"],
        "image_formats": native["image_formats"].split(", "),
        "cuda_available": torch.cuda.is_available(),
        "device_name": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }
