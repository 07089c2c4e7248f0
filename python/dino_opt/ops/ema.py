"""EMA teacher: the momentum (mean) teacher of DINO, updated by one fused
operator over all parameters (``torch.ops.dino_opt.ema_update_``)."""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn
from torch.distributed.tensor import DTensor

from .library import ema_update_
from .schedules import cosine_scheduler

__all__ = ["EMATeacher", "unwrap", "update_teacher"]

MomentumSchedule = float | Sequence[float] | np.ndarray | Callable[[int], float]


def unwrap(model: nn.Module) -> nn.Module:
    """The module inside a DistributedDataParallel / DataParallel wrapper."""
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        return model.module
    return model


def _local(params: list[torch.Tensor]) -> list[torch.Tensor]:
    """This rank's shards of sharded (``DTensor``) parameters, as views that
    write through; plain tensors unchanged. A teacher and a student sharded
    the same way have matching shards, so the EMA runs on them alone."""
    return [p.to_local() if isinstance(p, DTensor) else p for p in params]


def _paired_parameters(
    student: nn.Module, teacher: nn.Module
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Teacher and student parameters in matching order, checked by name and shape."""
    s_named = list(unwrap(student).named_parameters())
    t_named = list(unwrap(teacher).named_parameters())
    if len(s_named) != len(t_named):
        raise ValueError(
            f"teacher has {len(t_named)} parameters but student has {len(s_named)}; "
            "the teacher must have the student's architecture"
        )
    for (s_name, s), (t_name, t) in zip(s_named, t_named, strict=True):
        if s_name != t_name or s.shape != t.shape:
            raise ValueError(
                f"teacher parameter {t_name!r} {tuple(t.shape)} does not match "
                f"student parameter {s_name!r} {tuple(s.shape)}"
            )
    return [t for _, t in t_named], [s for _, s in s_named]


@torch.no_grad()
def update_teacher(student: nn.Module, teacher: nn.Module, m: float) -> None:
    """``teacher <- m * teacher + (1 - m) * student`` over all parameters, in one
    fused operator. Drop-in for the EMA loop of the original DINO code (the
    lesson's ``model.update_teacher()``); ``student`` may be wrapped in DDP."""
    t_params, s_params = _paired_parameters(student, teacher)
    ema_update_(_local(t_params), _local(s_params), m)


class EMATeacher:
    """The DINO momentum teacher of a student network.

    Args:
        student: the student network (may be wrapped in DDP).
        teacher: an existing teacher of the same architecture; when omitted, a
            deep copy of the student is made. Either way its parameters are set
            to not require grad, and with ``init_from_student`` its weights are
            set to the student's (as DINO does at the start of training).
        momentum_schedule: the teacher momentum per step: a constant, a
            per-step sequence (e.g. from
            :func:`~dino_opt.ops.cosine_scheduler`) or a callable
            ``step -> momentum``. When omitted, ``total_steps`` must be given and
            the schedule is DINO's cosine from ``base_momentum`` to
            ``final_momentum`` over ``total_steps``.
        copy_buffers: after each update also copy the student's buffers (e.g.
            BatchNorm running statistics) into the teacher.

    ``update(step)`` applies one EMA step and returns the momentum used.
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module | None = None,
        momentum_schedule: MomentumSchedule | None = None,
        *,
        total_steps: int | None = None,
        base_momentum: float = 0.996,
        final_momentum: float = 1.0,
        init_from_student: bool = True,
        copy_buffers: bool = False,
    ) -> None:
        self.student = unwrap(student)
        if teacher is None:
            teacher = copy.deepcopy(self.student)
        elif init_from_student:
            _paired_parameters(self.student, teacher)  # clear error before load_state_dict
            unwrap(teacher).load_state_dict(self.student.state_dict())
        self.teacher = unwrap(teacher)
        self.teacher.requires_grad_(False)
        self._teacher_params, self._student_params = _paired_parameters(self.student, self.teacher)
        self.copy_buffers = copy_buffers
        self._schedule = self._resolve_schedule(
            momentum_schedule, total_steps, base_momentum, final_momentum
        )

    @staticmethod
    def _resolve_schedule(schedule, total_steps, base, final) -> Callable[[int], float]:
        if schedule is None:
            if total_steps is None:
                raise ValueError(
                    "EMATeacher: give momentum_schedule (a float, a per-step sequence or a "
                    "callable) or total_steps for DINO's cosine schedule"
                )
            schedule = cosine_scheduler(base, final, 1, int(total_steps))
        if callable(schedule):
            return schedule
        if isinstance(schedule, (float, int)):
            value = float(schedule)
            return lambda step: value
        values = np.asarray(schedule, dtype=np.float64)
        if values.ndim != 1 or values.size == 0:
            raise ValueError(
                f"EMATeacher: momentum_schedule must be a non-empty 1-D sequence, "
                f"got shape {values.shape}"
            )

        def lookup(step: int) -> float:
            if not 0 <= step < values.size:
                raise IndexError(
                    f"EMATeacher: step {step} is outside the momentum schedule "
                    f"of {values.size} steps"
                )
            return float(values[step])

        return lookup

    def momentum(self, step: int) -> float:
        """The momentum the schedule gives for ``step``."""
        m = float(self._schedule(step))
        if not (math.isfinite(m) and 0.0 <= m <= 1.0):
            raise ValueError(f"EMATeacher: momentum at step {step} is {m}; expected in [0, 1]")
        return m

    @torch.no_grad()
    def update(self, step: int) -> float:
        """One EMA step with the momentum of ``step``; returns that momentum."""
        m = self.momentum(step)
        ema_update_(_local(self._teacher_params), _local(self._student_params), m)
        if self.copy_buffers:
            for t, s in zip(self.teacher.buffers(), self.student.buffers(), strict=True):
                t.copy_(s)
        return m
