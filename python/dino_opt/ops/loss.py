"""DINOLoss: a drop-in for the DINOLoss of facebookresearch/dino (main_dino.py)
over the fused operator ``torch.ops.dino_opt.dino_loss``."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from .library import dino_loss
from .schedules import teacher_temp_schedule

__all__ = ["DINOLoss", "NonFiniteLossError", "dino_loss"]


class NonFiniteLossError(FloatingPointError):
    """The DINO loss is NaN or infinite (raised only with ``check_finite=True``)."""


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


class DINOLoss(nn.Module):
    """The DINO loss with its center, as in the original code, fused.

    Same constructor and call as facebookresearch/dino's ``DINOLoss``:
    ``DINOLoss(out_dim, ncrops, warmup_teacher_temp, teacher_temp,
    warmup_teacher_temp_epochs, nepochs, student_temp=0.1, center_momentum=0.9)``
    and ``loss = dino_loss(student_output, teacher_output, epoch)`` with
    ``student_output`` [ncrops * B, out_dim] and ``teacher_output`` [T * B, out_dim]
    (T teacher views, 2 in DINO; T is read from the shapes).

    The teacher temperature follows DINO's schedule (linear warm-up from
    ``warmup_teacher_temp`` over ``warmup_teacher_temp_epochs``, then
    ``teacher_temp``; :func:`~dino_opt.ops.teacher_temp_schedule`, kept
    as ``teacher_temp_schedule``, read with :meth:`teacher_temp`), or is given
    per call (``teacher_temp=``, as lightly's loss takes it; ``epoch`` may
    then be None). ``center`` is a registered buffer [1, out_dim] (in the
    state dict, so in checkpoints) updated after each step with
    ``c <- m * c + (1 - m) * mean of the teacher rows over all ranks``. Under
    torch.distributed the all-reduce of the batch center is asynchronous and
    applied before the next loss (or ``state_dict()``), as in dinov2, which
    gives the same centers as the original synchronous update.

    ``check_finite=True`` raises :class:`NonFiniteLossError` naming the inputs
    that hold NaN or inf when the loss is not finite (one host sync per step).

    Crop batching: ``views=range(a, b)`` says that ``student_output`` holds
    only the student views ``a .. b - 1`` of the ``ncrops``; the result is
    their share of the step's loss (the parts of a step add up to it, and so
    do their gradients). Pass ``update_center=False`` for every part but one,
    so that the step updates the center once.
    """

    def __init__(
        self,
        out_dim: int,
        ncrops: int,
        warmup_teacher_temp: float,
        teacher_temp: float,
        warmup_teacher_temp_epochs: int,
        nepochs: int,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        *,
        check_finite: bool = False,
    ) -> None:
        super().__init__()
        if out_dim < 1 or ncrops < 2:
            raise ValueError(
                f"DINOLoss: need out_dim >= 1 and ncrops >= 2, got {out_dim}, {ncrops}"
            )
        if not 0 <= warmup_teacher_temp_epochs <= nepochs:
            raise ValueError(
                f"DINOLoss: warmup_teacher_temp_epochs={warmup_teacher_temp_epochs} must be in "
                f"[0, nepochs={nepochs}]"
            )
        if not 0.0 <= center_momentum <= 1.0:
            raise ValueError(f"DINOLoss: center_momentum must be in [0, 1], got {center_momentum}")
        self.out_dim = out_dim
        self.ncrops = ncrops
        self.student_temp = student_temp
        self.center_momentum = center_momentum
        self.check_finite = check_finite
        self.register_buffer("center", torch.zeros(1, out_dim))
        self.teacher_temp_schedule = teacher_temp_schedule(
            warmup_teacher_temp, teacher_temp, warmup_teacher_temp_epochs, nepochs
        )
        # Plain floats: torch.compile treats them as constants (a numpy scalar would
        # become a symbolic float that the operator's `float` argument cannot take).
        self._teacher_temps = [float(t) for t in self.teacher_temp_schedule]
        self._pending_center = None  # (batch sum, row count, all-reduce handle or None)

    def teacher_temp(self, epoch: int) -> float:
        """The teacher temperature of ``epoch`` on the schedule."""
        if not 0 <= epoch < len(self._teacher_temps):
            raise IndexError(
                f"DINOLoss: epoch {epoch} is outside the teacher temperature schedule of "
                f"{len(self._teacher_temps)} epochs (nepochs)"
            )
        return self._teacher_temps[epoch]

    def forward(
        self,
        student_output: torch.Tensor,
        teacher_output: torch.Tensor,
        epoch: int | None = None,
        *,
        teacher_temp: float | None = None,
        views: range | None = None,
        update_center: bool = True,
    ) -> torch.Tensor:
        if teacher_temp is None:
            if epoch is None:
                raise ValueError("DINOLoss: give the epoch (for the schedule) or teacher_temp")
            teacher_temp = self.teacher_temp(epoch)
        views = range(self.ncrops) if views is None else views
        if views.step != 1 or not 0 <= views.start < views.stop <= self.ncrops:
            raise ValueError(
                f"DINOLoss: views must be a range of consecutive student views within "
                f"range({self.ncrops}), got {views}"
            )
        self.apply_center_update()
        teacher_output = teacher_output.detach()
        dtype = torch.promote_types(student_output.dtype, teacher_output.dtype)
        loss = dino_loss(
            student_output.to(dtype),
            teacher_output.to(dtype),
            self.center,
            self.student_temp,
            teacher_temp,
            len(views),
            view_offset=views.start,
            total_views=self.ncrops,
        )
        if self.check_finite and not torch.isfinite(loss):
            raise NonFiniteLossError(
                f"DINO loss is {loss.item()}: non-finite values in student_output: "
                f"{int((~torch.isfinite(student_output)).sum())}, teacher_output: "
                f"{int((~torch.isfinite(teacher_output)).sum())}, center: "
                f"{int((~torch.isfinite(self.center)).sum())}"
            )
        if update_center:
            self.update_center(teacher_output)
        return loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        """Start the center update with this step's teacher output: the batch
        sum is all-reduced asynchronously when distributed and applied by
        :meth:`apply_center_update` (at the next forward at the latest)."""
        # In the wider of float32 and the input's dtype: a float64 teacher keeps its precision.
        dtype = torch.promote_types(teacher_output.dtype, torch.float32)
        batch_sum = torch.sum(teacher_output.detach(), dim=0, dtype=dtype)
        rows = teacher_output.shape[0]
        handle = None
        if _distributed():
            rows *= dist.get_world_size()
            handle = dist.all_reduce(batch_sum, async_op=True)
        self._pending_center = (batch_sum, rows, handle)
        if handle is None:
            self.apply_center_update()

    @torch.no_grad()
    def apply_center_update(self) -> None:
        """Wait for a pending all-reduce and apply it to ``center``."""
        if self._pending_center is None:
            return
        batch_sum, rows, handle = self._pending_center
        self._pending_center = None
        if handle is not None:
            handle.wait()
        batch_center = (batch_sum / rows).unsqueeze(0)
        # Out of place: the loss saved the previous center for its backward pass.
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)

    def state_dict(self, *args, **kwargs):
        self.apply_center_update()
        return super().state_dict(*args, **kwargs)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        # A loaded center replaces the current one: an update still pending
        # from the last step must not be applied on top of it.
        if self._pending_center is not None and self._pending_center[2] is not None:
            self._pending_center[2].wait()
        self._pending_center = None
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)
