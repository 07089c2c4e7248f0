"""The per-iteration schedules of DINO training: learning rate, weight decay
and teacher momentum (cosine, with a linear warm-up for the learning rate),
and the per-epoch teacher temperature (a linear warm-up, then constant), as
the original code (``main_dino.py``, ``utils.cosine_scheduler``) makes them."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["Schedules", "cosine_scheduler", "teacher_temp_schedule", "warmup_cosine_constant"]


def cosine_scheduler(
    base_value: float,
    final_value: float,
    epochs: int,
    niter_per_ep: int,
    warmup_epochs: int = 0,
    start_warmup_value: float = 0.0,
) -> np.ndarray:
    """Per-iteration schedule of the original DINO code (``utils.cosine_scheduler``).

    A linear warm-up from ``start_warmup_value`` to ``base_value`` over
    ``warmup_epochs * niter_per_ep`` iterations, then a half cosine from
    ``base_value`` towards ``final_value`` over the remaining iterations:
    ``final + (base - final) * (1 + cos(pi * i / n)) / 2`` for i in 0..n-1.
    Returns a float64 array of ``epochs * niter_per_ep`` values.
    """
    for name, value in (("epochs", epochs), ("niter_per_ep", niter_per_ep)):
        if not isinstance(value, (int, np.integer)) or value < 1:
            raise ValueError(f"cosine_scheduler: {name} must be a positive integer, got {value!r}")
    if not isinstance(warmup_epochs, (int, np.integer)) or not 0 <= warmup_epochs <= epochs:
        raise ValueError(
            f"cosine_scheduler: warmup_epochs must be an integer in [0, epochs={epochs}], "
            f"got {warmup_epochs!r}"
        )
    warmup_iters = warmup_epochs * niter_per_ep
    warmup = np.linspace(start_warmup_value, base_value, warmup_iters)
    n = epochs * niter_per_ep - warmup_iters
    i = np.arange(n)
    cosine = final_value + 0.5 * (base_value - final_value) * (1 + np.cos(np.pi * i / max(n, 1)))
    return np.concatenate((warmup, cosine))


def teacher_temp_schedule(
    warmup_teacher_temp: float, teacher_temp: float, warmup_epochs: int, epochs: int
) -> np.ndarray:
    """Per-epoch teacher temperature of DINO's loss: linear from
    ``warmup_teacher_temp`` to ``teacher_temp`` over ``warmup_epochs``, then
    ``teacher_temp`` up to ``epochs`` (a float64 array of ``epochs`` values)."""
    if not 0 <= warmup_epochs <= epochs:
        raise ValueError(
            f"teacher_temp_schedule: warmup_epochs={warmup_epochs} must be in [0, epochs={epochs}]"
        )
    return np.concatenate(
        (
            np.linspace(warmup_teacher_temp, teacher_temp, warmup_epochs),
            np.ones(epochs - warmup_epochs) * teacher_temp,
        )
    )


def warmup_cosine_constant(
    start: float,
    peak: float,
    end: float,
    warmup_iters: int,
    total_iters: int,
    cosine_iters: int | None = None,
) -> np.ndarray:
    """Per-iteration schedule of DINOv3's loss weights: ``warmup_iters``
    values linear from ``start`` towards ``peak`` (``peak`` itself not
    reached), then ``cosine_iters`` values (None: all the rest) of a half
    cosine from ``peak`` to exactly ``end``, then ``end`` up to
    ``total_iters``. A float64 array of ``total_iters`` values."""
    if cosine_iters is None:
        cosine_iters = total_iters - warmup_iters
    if min(warmup_iters, cosine_iters) < 0 or warmup_iters + cosine_iters > total_iters:
        raise ValueError(
            f"warmup_cosine_constant: warmup ({warmup_iters}) and cosine ({cosine_iters}) "
            f"iterations must be >= 0 and fit in the {total_iters} iterations"
        )
    warmup = np.linspace(start, peak, warmup_iters, endpoint=False)
    angle = np.linspace(0.0, np.pi, cosine_iters)
    cosine = end + (peak - end) * (1 + np.cos(angle)) / 2
    constant = np.full(total_iters - warmup_iters - cosine_iters, float(end))
    return np.concatenate((warmup, cosine, constant))


@dataclass
class Schedules:
    """The per-iteration schedules of a run (one value per optimizer step).

    ``teacher_temp`` (DINOv2: per iteration) and ``last_layer_lr`` (DINOv2:
    the learning rate of the heads' last layers, 0 while they are frozen)
    are None for DINO, whose teacher temperature is per epoch (in its loss)
    and whose trainer freezes the last layer by dropping its gradients.
    ``gram_weight`` (DINOv3: the Gram anchoring loss's weight) is None for
    the recipes without Gram anchoring.
    """

    lr: np.ndarray
    weight_decay: np.ndarray
    momentum: np.ndarray
    teacher_temp: np.ndarray | None = None
    last_layer_lr: np.ndarray | None = None
    gram_weight: np.ndarray | None = None

    @classmethod
    def dino(
        cls,
        *,
        base_lr: float,
        min_lr: float,
        weight_decay: float,
        weight_decay_end: float,
        momentum_teacher: float,
        epochs: int,
        warmup_epochs: int,
        niter_per_epoch: int,
    ) -> Schedules:
        """DINO's: the learning rate warms up linearly over ``warmup_epochs``
        then follows a cosine to ``min_lr``; weight decay and teacher momentum
        follow cosines to ``weight_decay_end`` and 1. ``base_lr`` is already
        scaled by the global batch (lr * batch / 256)."""
        return cls(
            lr=cosine_scheduler(base_lr, min_lr, epochs, niter_per_epoch, warmup_epochs),
            weight_decay=cosine_scheduler(weight_decay, weight_decay_end, epochs, niter_per_epoch),
            momentum=cosine_scheduler(momentum_teacher, 1.0, epochs, niter_per_epoch),
        )

    @classmethod
    def dinov2(
        cls,
        *,
        base_lr: float,
        min_lr: float,
        weight_decay: float,
        weight_decay_end: float,
        momentum_teacher: float,
        warmup_teacher_temp: float,
        teacher_temp: float,
        warmup_teacher_temp_epochs: int,
        freeze_last_layer_epochs: int,
        epochs: int,
        warmup_epochs: int,
        niter_per_epoch: int,
    ) -> Schedules:
        """DINOv2's (dinov2/train/train.py): DINO's learning rate, weight
        decay and momentum; the teacher temperature per iteration, linear from
        ``warmup_teacher_temp`` over ``warmup_teacher_temp_epochs`` then
        constant; the last layers' learning rate equal to the others' but 0
        in the first ``freeze_last_layer_epochs``."""
        dino = cls.dino(
            base_lr=base_lr,
            min_lr=min_lr,
            weight_decay=weight_decay,
            weight_decay_end=weight_decay_end,
            momentum_teacher=momentum_teacher,
            epochs=epochs,
            warmup_epochs=warmup_epochs,
            niter_per_epoch=niter_per_epoch,
        )
        warm = min(warmup_teacher_temp_epochs, epochs) * niter_per_epoch
        total = epochs * niter_per_epoch
        temp = np.full(total, float(teacher_temp))
        temp[:warm] = np.linspace(warmup_teacher_temp, teacher_temp, warm)
        last_layer_lr = dino.lr.copy()
        last_layer_lr[: freeze_last_layer_epochs * niter_per_epoch] = 0.0
        return cls(dino.lr, dino.weight_decay, dino.momentum, temp, last_layer_lr)
