"""dino_opt: fast, memory-lean and robust DINO self-supervised training.

The hot paths are a C++/CUDA core registered as PyTorch operators
(``torch.ops.dino_opt.*``); this package is the thin Python API over them.
"""

import os

from . import ops  # noqa: F401  (its operators' Python side)
from ._compat import install_module_aliases
from .ops import (
    DINOLoss,
    EMATeacher,
    NonFiniteLossError,
    build_info,
    cosine_scheduler,
    dino_loss,
    ibot_loss,
    update_teacher,
)
from .ops.native import _C  # noqa: F401  (the core library, which registers the ops)

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
    "ibot_loss",
    "update_teacher",
    "__version__",
]
