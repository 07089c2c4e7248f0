"""Python side of the native operators: fake (meta) kernels for torch.compile
and thin, documented wrappers. The schemas and real kernels live in csrc/ops/."""

from collections.abc import Sequence

import torch


@torch.library.register_fake("dino_opt::ema_update_")
def _ema_update_fake(teacher, student, momentum):
    # In-place on `teacher`, no outputs: nothing to allocate while tracing.
    return None


def ema_update_(
    teacher: Sequence[torch.Tensor], student: Sequence[torch.Tensor], momentum: float
) -> None:
    """In place, for every pair: ``t <- momentum * t + (1 - momentum) * s``.

    One fused kernel over all tensors (one CUDA launch for up to 1024 tensors
    per dtype pair). Teacher dtypes float64/float32/bfloat16/float16, any
    student dtype of those; arithmetic in float32 (float64 for a float64
    teacher). Tensors must match in shape and device; the teacher must not
    require grad. Raises ``RuntimeError`` naming the offending tensor otherwise.
    """
    torch.ops.dino_opt.ema_update_(list(teacher), list(student), float(momentum))
