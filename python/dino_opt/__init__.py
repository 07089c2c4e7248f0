"""dino_opt: fast, memory-lean and robust DINO self-supervised training.

The hot paths are a C++/CUDA core registered as PyTorch operators
(``torch.ops.dino_opt.*``); this package is the thin Python API over them.
The one-call API: ``dino_opt.train(data, model=...)``, ``dino_opt.embed(weights,
data)`` and ``dino_opt.load(weights)`` (:mod:`dino_opt.api`).
"""

import os

from . import ops  # noqa: F401  (its operators' Python side)
from . import train as _train_package
from ._compat import install_module_aliases, make_callable
from .api import embed, load
from .api import train as _train
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
# dino_opt.train(data, model=...) trains; dino_opt.train.build & co. stay its modules
make_callable(_train_package, _train)

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
    "embed",
    "load",
    "train",
    "ibot_loss",
    "update_teacher",
    "__version__",
]
