"""The job's small pieces: the objects of a run, the resume error and the
profiled phases."""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config, apply_overrides, default_config, load_config
from ..data import MultiCropLoader
from ..ops import DINOLoss, Schedules
from ..runtime import StudentGroups, data_place
from ..train import (
    DataRoots,
    DINOModel,
    MemoryOptimizedDINOTrainer,
    WeightsReader,
    attach_frozen_copies,
    attach_teacher,
    build_loader,
    build_loss,
    build_models,
    build_optimizer,
    build_schedules,
    build_student,
    build_trainer,
    data_roots,
    recipe_of,
)
from .groups import layout_of, optimizer_sizes
from .sharding import spread

__all__ = ["PROFILE_PHASES", "ResumeError", "build_parts"]

# The phases of a training step that the job times (profile.json).
PROFILE_PHASES = ("data_wait", "forward_backward", "optimizer_step")

# Saves made even while the run is unhealthy (a non-finite streak, or a
# collapse that may be rolled back); the others wait, so that every
# checkpoint is one to go back to.
_NEVER_HELD_BACK = ("final", "nonfinite")


class ResumeError(ValueError):
    """A checkpoint cannot continue this run (another config, a bad file)."""


def _config_of(source, overrides: list[str]) -> Config:
    """A Config from a Config, a dict, a YAML path or None (the defaults)."""
    if source is None:
        return apply_overrides(default_config(), overrides)
    if isinstance(source, Config):
        return apply_overrides(source, overrides) if overrides else source
    if isinstance(source, dict):
        return apply_overrides(Config.from_dict(source), overrides)
    return load_config(source, overrides)


@dataclass
class _Parts:
    """The objects of a run, built by set-up: the same whether fresh or resumed."""

    roots: DataRoots
    loader: MultiCropLoader
    student: nn.Module
    teacher: nn.Module
    random_teacher: nn.Module  # the random-initialisation baseline of the evaluation
    model: DINOModel
    loss_fn: DINOLoss
    optimizer: torch.optim.Optimizer
    schedules: Schedules
    trainer: MemoryOptimizedDINOTrainer
    # students on their own groups of ranks: this rank's place, and each
    # student's optimizer sizes (:func:`~dino_opt.job.groups.optimizer_sizes`)
    groups: StudentGroups | None = None
    sizes: list[tuple[int, int]] | None = None


def _iterations_per_epoch(cfg: Config, loader: MultiCropLoader) -> int:
    """Optimizer steps per epoch, rounded up: an accumulation that does not
    divide the epoch's batches carries its micro-batches into the next
    epoch, so the run makes up to this many per epoch on average."""
    accumulation = cfg.optim.accumulation_steps
    if len(loader) < accumulation:
        raise ValueError(
            f"the data set gives {len(loader)} batches per epoch, fewer than "
            f"optim.accumulation_steps={accumulation}"
        )
    return -(-len(loader) // accumulation)


def build_parts(
    cfg: Config, device: torch.device, rank: int, world: int, reader: WeightsReader
) -> _Parts:
    """The objects of a run (:mod:`dino_opt.train.build`) on this process's
    ``device``: the loader of this rank, the networks (the loss's frozen
    copies of the teacher made before the teacher is sharded, a
    distillation's frozen teacher opened through ``reader``), optimizer,
    schedules and trainer."""
    roots = data_roots(cfg)
    groups = layout_of(cfg, rank, world)  # students on their own ranks: this rank's one
    data_rank, data_world = data_place(groups, rank, world)
    loader = build_loader(cfg, roots.train, device, rank=data_rank, world_size=data_world)
    student, teacher = build_student(cfg, groups.index) if groups else build_models(cfg)
    random_teacher = copy.deepcopy(teacher).eval()
    student, teacher = student.to(device), teacher.to(device)
    torch.manual_seed(cfg.hardware.seed + rank)  # same init everywhere, own drop paths
    schedules = build_schedules(cfg, _iterations_per_epoch(cfg, loader), world_size=data_world)
    loss_fn = build_loss(cfg).to(device)
    frozen = attach_frozen_copies(cfg, loss_fn, teacher, reader)
    external = attach_teacher(cfg, loss_fn, reader, device)  # a distillation's, on the device
    if groups is not None:
        loss_fn.frozen.split_over(groups)  # each rank its share of a batch's teacher forward
    # DDP (over the student's group), or sharded
    trained, teacher = spread(cfg, student, teacher, device, frozen, external, groups)
    model = DINOModel(
        student, teacher, schedules.momentum, copy_buffers=recipe_of(cfg).ema_copies_buffers
    )
    model.student = trained  # the EMA reads the unwrapped `student`
    optimizer = build_optimizer(cfg, student, device)
    trainer = build_trainer(cfg, model, loss_fn, optimizer, device)
    sizes = optimizer_sizes(groups, optimizer) if groups else None
    return _Parts(
        roots,
        loader,
        student,
        teacher,
        random_teacher,
        model,
        loss_fn,
        optimizer,
        schedules,
        trainer,
        groups,
        sizes,
    )
