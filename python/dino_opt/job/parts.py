"""The job's small pieces: the objects of a run, the resume checks against a
checkpoint's config, the rollback signal, and the profiled phases."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..config import Config, apply_overrides, default_config, load_config
from ..data import MultiCropLoader
from ..observe import (
    NonFiniteError,
)
from ..ops import DINOLoss, Schedules
from ..train import (
    DataRoots,
    DINOModel,
    MemoryOptimizedDINOTrainer,
)

__all__ = ["PROFILE_PHASES", "ResumeError"]

# The phases of a training step that the job times (profile.json).
PROFILE_PHASES = ("data_wait", "forward_backward", "optimizer_step")

# Config keys that may differ between a checkpoint and the run resuming it:
# where things go and how they are reported, not what is computed (the loader
# gives the same batches whatever its thread count).
_RESUME_MAY_DIFFER = ("logging.", "checkpoint.", "health.", "eval.", "hardware.device",
                      "hardware.preset", "model.init_from", "distributed.", "debug.",
                      "data.num_workers", "data.prefetch", "data.pin_memory")  # fmt: skip

# Saves made even while the run is unhealthy (a non-finite streak, or a
# collapse that may be rolled back); the others wait, so that every
# checkpoint is one to go back to.
_NEVER_HELD_BACK = ("final", "nonfinite")


class ResumeError(ValueError):
    """A checkpoint cannot continue this run (another config, a bad file)."""


class _Rollback(Exception):
    """Raised inside the epoch loop to go back to the last good checkpoint.
    ``iterations``: the (first, last) optimizer iterations to skip, or None."""

    def __init__(
        self,
        reason: str,
        iterations: tuple[int, int] | None,
        detail: str,
        error: NonFiniteError | None = None,
    ):
        super().__init__(detail)
        self.reason, self.iterations, self.detail, self.error = reason, iterations, detail, error


def _config_differences(saved: dict, current: dict) -> list[str]:
    """The keys whose values differ between a checkpoint's config and this
    run's, beyond those a resume may change. The saved config is read as a
    config first, so that keys added since it was written compare at their
    defaults (and old names at their new ones)."""
    try:
        saved = Config.from_dict(saved).to_dict()
    except ValueError:  # a key since removed: compared as written
        pass
    keys = []
    for section in sorted(set(saved) | set(current)):
        a, b = saved.get(section, {}), current.get(section, {})
        for key in sorted(set(a) | set(b)):
            name = f"{section}.{key}"
            if a.get(key) != b.get(key) and not name.startswith(_RESUME_MAY_DIFFER):
                keys.append(f"{name}: {a.get(key)!r} in the checkpoint, {b.get(key)!r} now")
    return keys


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
