"""Python's garbage collector kept out of the training loop.

CPython's cyclic collector runs whenever enough container objects have been
allocated, which a training step does by the thousand (autograd nodes,
tensors' Python objects, metric dicts): a collection of the oldest
generation, walking every object the process holds (the models, the loader,
the run's state), then lands in the middle of a step at a moment nobody
chose. :class:`StepCollector` turns automatic collection off for the
duration of training and collects at chosen points instead: the young
generations every ``every_steps`` steps, everything at each epoch's end.
"""

from __future__ import annotations

import gc

__all__ = ["StepCollector"]


class StepCollector:
    """A context manager: inside, automatic collection is off and the
    objects alive on entry (the models, the optimizer, the loader) are frozen
    out of every collection (``gc.freeze``); :meth:`after_step` collects the
    young generations (0 and 1) every ``every_steps`` steps and
    :meth:`after_epoch` all of them. On exit the frozen objects are released
    and automatic collection is back as it was. ``every_steps`` 0 leaves
    Python's collector alone."""

    def __init__(self, every_steps: int):
        if every_steps < 0:
            raise ValueError(f"every_steps must be >= 0, got {every_steps}")
        self.every_steps = int(every_steps)
        self._was_enabled = gc.isenabled()

    def __enter__(self) -> StepCollector:
        if self.every_steps:
            self._was_enabled = gc.isenabled()
            gc.collect()
            gc.freeze()
            gc.disable()
        return self

    def __exit__(self, *exc) -> None:
        if self.every_steps:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()

    def after_step(self, step: int) -> None:
        """Step ``step`` (counted from 1) is complete."""
        if self.every_steps and step % self.every_steps == 0:
            gc.collect(1)

    def after_epoch(self) -> None:
        """An epoch is complete: a full collection, of what the epoch left."""
        if self.every_steps:
            gc.collect()
