"""The compiled core, loaded once: torch first (the core links against
libtorch), then ``dino_opt._C``, whose library registers the
``torch.ops.dino_opt`` operators. Every folder takes ``_C`` from here."""

import torch  # noqa: F401  (loads libtorch before the native core)

from .. import _C

__all__ = ["_C"]
