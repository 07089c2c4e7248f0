"""``schedule.epochs: auto``: the number of epochs chosen from the number of
images and the global batch, so that a small data set gets enough steps
and a large one is not cut short.

    epochs = max(ceil(MIN_STEPS / steps_per_epoch),
                 ceil(REFERENCE_EPOCHS * min(images, REFERENCE_IMAGES) / images))

``steps_per_epoch`` is optimizer steps (the global batch is
``data.batch_size`` x ranks x ``optim.accumulation_steps``; a rank's last
partial batch is dropped, as the training loader drops it). The first term
gives every run at least :data:`MIN_STEPS` optimizer steps (a few hundred
images would otherwise train for a few dozen steps); the second is DINO's
100 epochs for any set up to ImageNet-1k's size, and beyond it the images
seen of 100 ImageNet epochs (a 14 M set: 10 epochs). The warm-ups
(``schedule.warmup_epochs``, ``schedule.warmup_teacher_temp_epochs``) and
``optim.freeze_last_layer`` are read as given for
:data:`REFERENCE_EPOCHS` epochs and scaled with the choice (a span that was
on stays at least one epoch).
"""

from __future__ import annotations

import math
from dataclasses import replace
from typing import NamedTuple

from ..config import Config
from .build import build_source, data_roots

__all__ = [
    "MIN_STEPS",
    "REFERENCE_EPOCHS",
    "REFERENCE_IMAGES",
    "EpochChoice",
    "auto_epochs",
    "resolve_epochs",
]

#: Optimizer steps every run gets at least.
MIN_STEPS = 5000
#: DINO's epochs on ImageNet-1k, which the recipes' warm-ups are given for.
REFERENCE_EPOCHS = 100
#: ImageNet-1k's training images.
REFERENCE_IMAGES = 1_281_167


class EpochChoice(NamedTuple):
    """What ``schedule.epochs: auto`` chose: ``epochs``, the optimizer
    ``steps`` they make, ``steps_per_epoch`` and the ``reason`` (which term won)."""

    epochs: int
    steps: int
    steps_per_epoch: int
    reason: str


def auto_epochs(
    images: int, global_batch: int, accumulation: int = 1, world_size: int = 1
) -> EpochChoice:
    """The epochs for ``images`` images at ``global_batch`` images a loader
    batch (all ``world_size`` ranks), ``accumulation`` batches an optimizer
    step (the module docstring's rule). An epoch's batches are counted as
    the training loader makes them: each rank's share of the images (padded
    to equal shares), its last partial batch dropped."""
    if images < 1 or global_batch < 1 or accumulation < 1 or world_size < 1:
        raise ValueError(
            f"auto epochs need images, a batch, accumulation and ranks >= 1, got "
            f"{images}, {global_batch}, {accumulation}, {world_size}"
        )
    per_rank = max(1, global_batch // world_size)
    batches = max(1, math.ceil(images / world_size) // per_rank)
    by_steps = math.ceil(MIN_STEPS * accumulation / batches)
    by_images = math.ceil(REFERENCE_EPOCHS * min(images, REFERENCE_IMAGES) / images)
    epochs = max(by_steps, by_images)
    if by_steps > by_images:
        reason = f"at least {MIN_STEPS} optimizer steps"
    elif images > REFERENCE_IMAGES:
        reason = f"the images seen in {REFERENCE_EPOCHS} epochs of ImageNet-1k"
    else:
        reason = f"{REFERENCE_EPOCHS} epochs, DINO's, reach {MIN_STEPS} steps or more"
    return EpochChoice(epochs, epochs * batches // accumulation, batches // accumulation, reason)


def _scaled(value: int, epochs: int) -> int:
    """A span given for :data:`REFERENCE_EPOCHS` epochs, at ``epochs`` (one at least when on)."""
    return 0 if value == 0 else max(1, round(value * epochs / REFERENCE_EPOCHS))


def resolve_epochs(cfg: Config, world_size: int = 1) -> tuple[Config, str | None]:
    """``cfg`` with ``schedule.epochs: auto`` resolved from its training
    data (counted, never decoded) and its global batch on ``world_size``
    ranks, the warm-ups and the frozen last layer scaled with it, and the
    one line that says the choice and why; ``(cfg, None)`` for a number."""
    if cfg.schedule.epochs != "auto":
        return cfg, None
    images = len(build_source(cfg, data_roots(cfg).train))
    batch = cfg.data.batch_size * world_size
    choice = auto_epochs(images, batch, cfg.optim.accumulation_steps, world_size)
    s, o = cfg.schedule, cfg.optim
    schedule = replace(
        s,
        epochs=choice.epochs,
        warmup_epochs=_scaled(s.warmup_epochs, choice.epochs),
        warmup_teacher_temp_epochs=_scaled(s.warmup_teacher_temp_epochs, choice.epochs),
    )
    optim = replace(o, freeze_last_layer=_scaled(o.freeze_last_layer, choice.epochs))
    out = replace(cfg, schedule=schedule, optim=optim)
    line = (
        f"schedule.epochs=auto: {choice.epochs} epochs, {choice.steps} optimizer steps "
        f"({images} images, {choice.steps_per_epoch} steps an epoch at a global batch of "
        f"{batch}): {choice.reason}; warm-up {schedule.warmup_epochs}, teacher "
        f"temperature warm-up {schedule.warmup_teacher_temp_epochs}, last layer frozen "
        f"{optim.freeze_last_layer} epochs"
    )
    return out.validate(), line
