"""The teacher's evaluation while a run trains (``eval.every_epochs``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import Config
from ..eval import evaluate_teacher
from ..observe import RunLog
from ..runtime import HangWatchdog
from .sharding import full_teacher_backbone

__all__ = ["evaluate_between_epochs"]


def evaluate_between_epochs(cfg: Config, parts, done: int, device: torch.device,
                            log: RunLog, step: int, world: int, lead: bool,
                            watchdog: HangWatchdog | None) -> None:  # fmt: skip
    """``parts``: the run's built objects (``teacher``, ``random_teacher``,
    ``roots``). After ``done`` epochs, every ``eval.every_epochs`` (not after the
    last: the end of the run evaluates), where there is a val split: the
    teacher's k-NN and linear probe on rank 0, as an ``evaluation`` row of
    the metrics. Collective: every rank gathers a sharded teacher, then waits
    for rank 0 in a barrier with its hang watchdog disarmed."""
    every = cfg.eval.every_epochs
    if not every or done % every or done >= cfg.schedule.epochs or parts.roots.val is None:
        return
    if watchdog is not None:
        watchdog.disarm()
    teacher = full_teacher_backbone(parts.teacher, parts.random_teacher, lead)
    if lead:
        evaluate_teacher(cfg, parts.roots, teacher, device, log, step, done)
    if world > 1:
        dist.barrier()
    if watchdog is not None:
        watchdog.arm()
