"""The evaluations of a run (:class:`Evaluator`, held by the job): the
teacher's while it trains (``eval.every_epochs``) and at its end, and those
of a distillation's other students, then and at the end; the weights a run
(or each student of a distillation) started from, evaluated beside the
result."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from ..config import Config
from ..eval import evaluate_run, evaluate_teacher
from ..observe import RunFolder, RunLog
from ..runtime import HangWatchdog, gather_objects
from ..train import StudentBank, recipe_of
from ..weights import load_student_start, student_starts
from .sharding import full_teacher

__all__ = ["Evaluator"]


def start_backbone(cfg: Config, parts, index: int = 0) -> torch.nn.Module | None:
    """Student ``index``'s backbone (the run's own network: 0) at the
    weights it started from, read again so that a resumed run has it too:
    ``model.init_from`` for the first, ``recipe.distill.students_init_from``
    for a distillation's others; None for one from random initialisation.
    ``parts.random_teacher``'s backbone is that student's (a process of a
    group of ranks holds one student) or the bank's, whose member it is."""
    path = student_starts(cfg)[index]
    if path is None:
        return None
    random = parts.random_teacher
    if isinstance(random, StudentBank):
        random = random.members[cfg.student_keys[index]]
    backbone = copy.deepcopy(random.backbone)
    load_student_start(path, backbone)
    return backbone.eval()


def evaluate_other_students(
    cfg: Config, parts, teacher: torch.nn.Module, device: torch.device, folder: RunFolder, step: int
) -> dict:
    """The end-of-run evaluation (:func:`~dino_opt.eval.evaluate_run`) of
    each student of a :class:`~dino_opt.train.StudentBank` but the first
    (which the run's own evaluation covers), its EMA (of ``teacher``, the
    whole EMA network) beside its random initialisation, into
    ``students/<name>/``; the report's ``students`` key, by name. ``{}``
    for a run of one student."""
    out = {}
    for index, (name, own, trained) in enumerate(_other_students(cfg, teacher), start=1):
        nets = (trained, parts.random_teacher.members[name].backbone)
        out[name] = evaluate_run(
            own,
            parts.roots,
            *nets,
            device,
            folder.student(name),
            None,
            step,
            start_backbone(cfg, parts, index),
        )
    return {"students": out} if out else {}


def _other_students(cfg: Config, teacher) -> list[tuple[str, Config, torch.nn.Module]]:
    """(name, config, EMA backbone) of each student of a
    :class:`~dino_opt.train.StudentBank` but the first; none for one student."""
    if not isinstance(teacher, StudentBank):
        return []
    configs = recipe_of(cfg).student_configs(cfg)[1:]
    names = list(teacher.members)[1:]
    return [(n, c, teacher.members[n].backbone) for n, c in zip(names, configs, strict=True)]


def _group_student(cfg: Config, parts) -> tuple[str, Config] | None:
    """(name, config) of this rank's student when it leads the group of a
    student but the first (students on their own groups of ranks), else None."""
    g = parts.groups
    if g is None or not g.lead or g.index == 0:
        return None
    return cfg.student_names[g.index], recipe_of(cfg).student_configs(cfg)[g.index]


def whole_teacher(parts, lead: bool) -> torch.nn.Module | None:
    """Collective when sharded: the EMA network whole where it is evaluated
    (rank 0, ``lead``; with students on their own groups of ranks, each
    group's lead its own student's), None elsewhere."""
    if parts.groups is not None:
        return full_teacher(
            parts.teacher, parts.random_teacher, parts.groups.lead, cpu_offload=False
        )
    return full_teacher(parts.teacher, parts.random_teacher, lead)


def evaluate_group_students(
    cfg: Config,
    parts,
    teacher: torch.nn.Module | None,
    device: torch.device,
    folder: RunFolder,
    step: int,
) -> dict:
    """Collective for students on their own groups of ranks: the lead of
    each group but the first evaluates its student's EMA (``teacher``,
    :func:`whole_teacher`'s) beside its random initialisation
    (:func:`~dino_opt.eval.evaluate_run`, into ``students/<name>/``), at
    once with the others; rank 0 gets the report's ``students`` key.
    ``{}`` elsewhere and for other runs."""
    if parts.groups is None:
        return {}
    found = None
    own = _group_student(cfg, parts)
    if own is not None:
        name, config = own
        nets = (teacher.backbone, parts.random_teacher.backbone)
        start = start_backbone(cfg, parts, parts.groups.index)
        found = (
            name,
            evaluate_run(
                config, parts.roots, *nets, device, folder.student(name), None, step, start
            ),
        )
    found = [f for f in gather_objects(found) if f is not None]
    return {"students": dict(found)} if found else {}


def _evaluate_group_students_between(
    cfg: Config,
    parts,
    teacher: torch.nn.Module | None,
    device: torch.device,
    log: RunLog,
    step: int,
    done: int,
) -> None:
    """Collective for students on their own groups of ranks: the lead of
    each group but the first evaluates its student's EMA (k-NN, linear
    probe); rank 0 logs each one's row (keys named ``student_<name>``)."""
    row = None
    own = _group_student(cfg, parts)
    if own is not None:
        name, config = own
        row = evaluate_teacher(
            config, parts.roots, teacher.backbone, device, log, step, done, f"student_{name}"
        )
        row = (f"student_{name}", row)
    for name, found in (r for r in gather_objects(row) if r is not None):
        log.event(found)
        scalars = {k: v for k, v in found.items() if k not in ("step", "epoch", "event")}
        log.scalars(f"eval_{name}", scalars, step)


class Evaluator:
    """The evaluations of one run, held by the job. Built once the run is
    set up, with its config, its objects (``parts``: ``teacher``,
    ``random_teacher``, ``roots``, ``groups``), this process's ``device``,
    the ``world`` size, whether this process leads (rank 0), the run
    ``folder`` and the hang ``watchdog`` (disarmed while rank 0 evaluates).
    The job calls :meth:`between_epochs` after each epoch and
    :meth:`at_end` when the run has finished; both are collective."""

    def __init__(
        self,
        cfg: Config,
        parts,
        device: torch.device,
        *,
        world: int,
        lead: bool,
        folder: RunFolder,
        watchdog: HangWatchdog | None,
    ):
        self.cfg, self.parts, self.device = cfg, parts, device
        self.world, self.lead, self.folder, self.watchdog = world, lead, folder, watchdog

    def between_epochs(self, done: int, step: int, log: RunLog) -> None:
        """After ``done`` epochs, every ``eval.every_epochs`` (not after the
        last: the end of the run evaluates), where there is a val split: the
        teacher's k-NN and linear probe on rank 0, as an ``evaluation`` row
        of the metrics (a distillation's other students too, keys named
        ``student_<name>``). Collective: every rank gathers a sharded
        teacher, then waits for rank 0 in a barrier with its hang watchdog
        disarmed."""
        cfg, parts = self.cfg, self.parts
        every = cfg.eval.every_epochs
        if not every or done % every or done >= cfg.schedule.epochs or parts.roots.val is None:
            return
        if self.watchdog is not None:
            self.watchdog.disarm()
        teacher = whole_teacher(parts, self.lead)
        if self.lead:
            evaluate_teacher(cfg, parts.roots, teacher.backbone, self.device, log, step, done)
            for name, own, trained in _other_students(cfg, teacher):
                evaluate_teacher(
                    own, parts.roots, trained, self.device, log, step, done, f"student_{name}"
                )
        if parts.groups is not None:
            _evaluate_group_students_between(cfg, parts, teacher, self.device, log, step, done)
        if self.world > 1:
            dist.barrier()
        if self.watchdog is not None:
            self.watchdog.arm()

    def at_end(self, step: int, log: RunLog) -> dict:
        """Collective where there is a val split (a sharded teacher is
        gathered whole): the trained teacher beside the same network at
        random initialisation and at the weights it started from
        (:func:`~dino_opt.eval.evaluate_run`, on rank 0), and a
        distillation's other students (into ``students/<name>/``; students on
        their own groups of ranks, each by its group's lead). The report's
        keys on rank 0; ``{}`` elsewhere and without a val split."""
        cfg, p = self.cfg, self.parts
        if p.roots.val is None:
            return {}
        teacher = whole_teacher(p, self.lead)
        if not self.lead:  # the leads of students on their own groups of ranks evaluate theirs
            evaluate_group_students(cfg, p, teacher, self.device, self.folder, step)
            return {}
        nets = (teacher.backbone, p.random_teacher.backbone)
        report = evaluate_run(
            cfg, p.roots, *nets, self.device, self.folder, log, step, start_backbone(cfg, p)
        )
        report.update(evaluate_other_students(cfg, p, teacher, self.device, self.folder, step))
        report.update(evaluate_group_students(cfg, p, teacher, self.device, self.folder, step))
        return report
