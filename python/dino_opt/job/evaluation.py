"""The teacher's evaluation while a run trains (``eval.every_epochs``), and
that of a distillation's other students, then and at the end of the run."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ..config import Config
from ..eval import evaluate_run, evaluate_teacher
from ..observe import RunFolder, RunLog
from ..runtime import HangWatchdog
from ..train import StudentBank, recipe_of
from .sharding import full_teacher

__all__ = ["evaluate_between_epochs", "evaluate_other_students"]


def evaluate_other_students(cfg: Config, parts, teacher: torch.nn.Module, device: torch.device,
                            folder: RunFolder, step: int) -> dict:  # fmt: skip
    """The end-of-run evaluation (:func:`~dino_opt.eval.evaluate_run`) of
    each student of a :class:`~dino_opt.train.StudentBank` but the first
    (which the run's own evaluation covers), its EMA (of ``teacher``, the
    whole EMA network) beside its random initialisation, into
    ``students/<name>/``; the report's ``students`` key, by name. ``{}``
    for a run of one student."""
    out = {}
    for name, own, trained in _other_students(cfg, teacher):
        nets = (trained, parts.random_teacher.members[name].backbone)
        out[name] = evaluate_run(own, parts.roots, *nets, device, folder.student(name), None, step)
    return {"students": out} if out else {}


def _other_students(cfg: Config, teacher) -> list[tuple[str, Config, torch.nn.Module]]:
    """(name, config, EMA backbone) of each student of a
    :class:`~dino_opt.train.StudentBank` but the first; none for one student."""
    if not isinstance(teacher, StudentBank):
        return []
    configs = recipe_of(cfg).student_configs(cfg)[1:]
    names = list(teacher.members)[1:]
    return [(n, c, teacher.members[n].backbone) for n, c in zip(names, configs, strict=True)]


def evaluate_between_epochs(cfg: Config, parts, done: int, device: torch.device,
                            log: RunLog, step: int, world: int, lead: bool,
                            watchdog: HangWatchdog | None) -> None:  # fmt: skip
    """``parts``: the run's built objects (``teacher``, ``random_teacher``,
    ``roots``). After ``done`` epochs, every ``eval.every_epochs`` (not after the
    last: the end of the run evaluates), where there is a val split: the
    teacher's k-NN and linear probe on rank 0, as an ``evaluation`` row of
    the metrics (a distillation's other students too, keys named
    ``student_<name>``). Collective: every rank gathers a sharded teacher,
    then waits for rank 0 in a barrier with its hang watchdog disarmed."""
    every = cfg.eval.every_epochs
    if not every or done % every or done >= cfg.schedule.epochs or parts.roots.val is None:
        return
    if watchdog is not None:
        watchdog.disarm()
    teacher = full_teacher(parts.teacher, parts.random_teacher, lead)
    if lead:
        evaluate_teacher(cfg, parts.roots, teacher.backbone, device, log, step, done)
        for name, own, trained in _other_students(cfg, teacher):
            evaluate_teacher(own, parts.roots, trained, device, log, step, done, f"student_{name}")
    if world > 1:
        dist.barrier()
    if watchdog is not None:
        watchdog.arm()
