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


def _loss_acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.library.register_fake("dino_opt::dino_loss")
def _dino_loss_fake(student, teacher, center, student_temp, teacher_temp, ncrops):
    acc = _loss_acc_dtype(student.dtype)
    return (
        student.new_empty((), dtype=acc),
        student.new_empty((student.shape[0],), dtype=acc),
        teacher.new_empty((teacher.shape[0],), dtype=acc),
    )


@torch.library.register_fake("dino_opt::dino_loss_backward")
def _dino_loss_backward_fake(grad, student, *args):
    return student.new_empty(student.shape)


def _dino_loss_setup_context(ctx, inputs, output):
    student, teacher, center, student_temp, teacher_temp, ncrops = inputs
    _, student_lse, teacher_lse = output
    ctx.save_for_backward(student, teacher, center, student_lse, teacher_lse)
    ctx.scalars = (student_temp, teacher_temp, ncrops)
    ctx.mark_non_differentiable(student_lse, teacher_lse)


def _dino_loss_backward(ctx, grad_loss, _grad_student_lse, _grad_teacher_lse):
    # Only the student gets a gradient: the teacher's targets are constants.
    grad_student = None
    if ctx.needs_input_grad[0]:
        grad_student = torch.ops.dino_opt.dino_loss_backward(
            grad_loss, *ctx.saved_tensors, *ctx.scalars
        )
    return grad_student, None, None, None, None, None


torch.library.register_autograd(
    "dino_opt::dino_loss", _dino_loss_backward, setup_context=_dino_loss_setup_context
)


def dino_loss(
    student: torch.Tensor,
    teacher: torch.Tensor,
    center: torch.Tensor,
    student_temp: float,
    teacher_temp: float,
    ncrops: int,
) -> torch.Tensor:
    """The DINO loss of one step, fused: cross-entropy between
    ``softmax((teacher - center) / teacher_temp)`` of every teacher view and
    ``log_softmax(student / student_temp)`` of every other student view,
    averaged over samples and over the ``T * (ncrops - 1)`` view pairs.

    ``student``: [ncrops * B, K], view-major (the original code's layout);
    ``teacher``: [T * B, K] with teacher view t paired with every student view
    but view t; ``center``: [K] or [1, K]. Inputs float64, float32, bfloat16
    or float16 (student and teacher alike); arithmetic in float32 (float64 for
    float64). Differentiable in ``student`` only (the teacher is detached).
    Returns a 0-dim float32 (float64) tensor.
    """
    loss, _, _ = torch.ops.dino_opt.dino_loss(
        student, teacher.detach(), center, float(student_temp), float(teacher_temp), int(ncrops)
    )
    return loss
