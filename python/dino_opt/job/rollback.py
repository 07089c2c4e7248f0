"""The job's recovery from failed steps (``health.on_nonfinite``,
``health.on_collapse``): :class:`Rollback` decides when to go back to the
last good checkpoint (it raises :class:`RollbackSignal`, which the job
catches), finds it, and keeps the rollbacks so far, which the checkpoints
carry: the optimizer iterations they skip and the learning-rate scale."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractContextManager

from ..config import HealthConfig
from ..observe import CollapseError, HealthAlert, NonFiniteError
from ..runtime import gather_objects
from .checkpoints import RunCheckpoints

__all__ = ["Rollback", "RollbackSignal"]


class RollbackSignal(Exception):
    """Raised inside the epoch loop (by :meth:`Rollback.on_nonfinite` and
    :meth:`Rollback.on_collapse`) to go back to the last good checkpoint;
    the job catches it and hands it to :meth:`Rollback.roll_back`.
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


class Rollback:
    """The rollbacks of one run, held by the job.

    Built once with what it needs: the ``health`` policy, the run's
    ``accumulation_steps``, its ``checkpoints`` (the targets), and the job's
    ``collective`` (the hang watchdog's name for what the ranks wait in).
    The job calls it after a logging step (:meth:`on_nonfinite`,
    :meth:`on_collapse`: they raise the signal to go back), before each
    micro-batch (:meth:`skipped`), and where it catches the signal
    (:meth:`roll_back`). Its state (:meth:`state_dict`) is a checkpoint's
    ``rollbacks``: one record per rollback, so that a resumed run skips the
    same batches at the same learning rate."""

    def __init__(
        self,
        health: HealthConfig,
        accumulation_steps: int,
        checkpoints: RunCheckpoints,
        collective: Callable[[str], AbstractContextManager],
    ):
        self.health = health
        self.accumulation_steps = accumulation_steps
        self.checkpoints = checkpoints
        self.collective = collective
        self.rollbacks: list[dict] = []
        self.collapse_streak = 0  # logging intervals in a row with a collapse alert
        self.collapse_alerts: list[str] = []  # this rank's alerts at the last collapse

    @property
    def enabled(self) -> bool:
        """Whether a health policy may roll back (the run then starts with a
        checkpoint to go back to)."""
        h = self.health
        return h.enabled and "rollback" in (h.on_nonfinite, h.on_collapse)

    @property
    def lr_scale(self) -> float:
        """The learning-rate factor of the rollbacks so far."""
        return self.health.rollback_lr_scale ** len(self.rollbacks)

    @property
    def collapse_pending(self) -> bool:
        """Whether a collapse that may be rolled back is under way (then no
        checkpoint is written: each must be one to go back to)."""
        return self.health.on_collapse == "rollback" and self.collapse_streak > 0

    def skipped(self, step: int) -> bool:
        """Whether the micro-batch after ``step`` belongs to an optimizer
        iteration a rollback skips."""
        it = step // self.accumulation_steps
        spans = [r["skipped_iterations"] for r in self.rollbacks if r["skipped_iterations"]]
        return any(first <= it <= last for first, last in spans)

    def on_nonfinite(self, diverged: NonFiniteError | None, step: int) -> NonFiniteError | None:
        """``health.on_nonfinite`` at ``step``, when some rank's non-finite
        streak grew too long (``diverged``: this rank's error, if it was one
        of them). ``rollback``: collective, the iterations to skip over every
        rank, then raises the signal to go back; ``stop``: returns the error
        to stop with; ``skip``: None."""
        h = self.health
        if h.on_nonfinite == "skip":
            return None
        error = diverged or NonFiniteError(
            h.max_nonfinite_steps + 1,
            None,
            None,
            h.max_nonfinite_steps,
            note="another process saw it",
        )
        if h.on_nonfinite == "stop":
            return error
        detail = f"{error.consecutive} consecutive non-finite steps"
        if error.last_step is not None:
            detail += f" (steps {error.first_step}-{error.last_step})"
        raise RollbackSignal("nonfinite", self._failed_iterations(diverged, step), detail, error)

    def on_collapse(self, collapsed: bool, alerts: list[HealthAlert]) -> None:
        """``health.on_collapse`` after a logging step where the ranks did
        (``collapsed``) or did not see a collapse (``alerts``: this rank's):
        raises the signal to go back after ``health.collapse_patience`` in a row."""
        self.collapse_streak = self.collapse_streak + 1 if collapsed else 0
        h = self.health
        if h.on_collapse == "rollback" and self.collapse_streak >= h.collapse_patience:
            self.collapse_alerts = [a.name for a in alerts]
            names = sorted(set(self.collapse_alerts))
            detail = (
                f"collapse ({', '.join(names) or 'on another rank'}) for "
                f"{self.collapse_streak} logging intervals"
            )
            raise RollbackSignal("collapse", None, detail)

    def roll_back(
        self, r: RollbackSignal, step: int, restore: Callable[[dict], None]
    ) -> tuple[dict, list[dict]]:
        """Back to the newest checkpoint before the failure ``r`` seen at
        ``step``, every rank at once: ``restore`` (the job's
        ``load_state_dict``) loads its complete state, then the rollbacks so
        far, this one included, are kept, so the batches that failed are
        skipped and a resumed run makes the same choices. Returns this
        rollback's record and the earlier ones after that checkpoint (events
        its history lacks). Raises the failure's error when it cannot roll
        back (``health.max_rollbacks`` reached, no checkpoint loads)."""
        self.checkpoints.wait()  # the write in flight is a good checkpoint too
        if len(self.rollbacks) >= self.health.max_rollbacks:
            self._give_up(r)
        first_bad = r.iterations[0] * self.accumulation_steps if r.iterations else None
        state, name = self._target(step - 1 if first_bad is None else first_bad, r)
        record = {
            "event": "rollback",
            "step": int(state["step"]),
            "epoch": int(state["epoch"]),
            "reason": r.reason,
            "detail": r.detail,
            "at_step": step,
            "skipped_iterations": list(r.iterations) if r.iterations else None,
            "checkpoint": name,
            "rollback": len(self.rollbacks) + 1,
        }
        rollbacks = [*self.rollbacks, record]
        before = len(state.get("rollbacks", []))
        restore(state)
        self.rollbacks = rollbacks
        self.collapse_streak = 0
        record["lr_scale"] = self.lr_scale
        return record, rollbacks[before:-1]

    def describe(self, record: dict, step: int) -> str:
        """The line a rollback prints (``step``: the one the run is back at)."""
        return (
            f"rollback {record['rollback']}/{self.health.max_rollbacks} at step "
            f"{record['at_step']}: {record['detail']}; back to {record['checkpoint']} (step "
            f"{step}), skipping optimizer iterations {record['skipped_iterations']}, "
            f"lr x{self.lr_scale:g}"
        )

    def state_dict(self) -> dict:
        """The rollbacks so far, as a checkpoint holds them."""
        return {"rollbacks": self.rollbacks}

    def load_state_dict(self, state: dict) -> None:
        """The rollbacks of a checkpoint's state (none in one written before any)."""
        self.rollbacks = list(state.get("rollbacks", []))

    def _target(self, limit: int, r: RollbackSignal) -> tuple[dict, str]:
        """The state and file name of the newest checkpoint that loads and
        was written at step ``limit`` or before."""
        for record in reversed(self.checkpoints.manager.checkpoints()):
            if record.step <= limit:
                with contextlib.suppress(ValueError, OSError):
                    return self.checkpoints.read(record.path), record.path.name
        self._give_up(r, f"no checkpoint written before step {limit + 1} loads")

    def _give_up(self, r: RollbackSignal, why: str | None = None):
        why = why or f"health.max_rollbacks={self.health.max_rollbacks} rollbacks done"
        records = self.checkpoints.manager.checkpoints()
        kept = f"; the last good checkpoint is kept: {records[-1].path}" if records else ""
        if r.reason == "collapse":
            raise CollapseError(f"{r.detail}; cannot roll back: {why}{kept}", self.collapse_alerts)
        e = r.error
        raise NonFiniteError(
            e.consecutive, e.first_step, e.last_step, e.limit, note=f"cannot roll back: {why}{kept}"
        )

    def _failed_iterations(self, diverged: NonFiniteError | None, step: int) -> tuple[int, int]:
        """Collective: the optimizer iterations of the non-finite streak, over
        every rank that saw one (iteration i trains micro-batches
        i*accumulation ... (i+1)*accumulation - 1)."""
        local = None
        if diverged is not None:
            last_step = diverged.last_step if diverged.last_step is not None else step
            last = last_step // self.accumulation_steps - 1
            local = (last - diverged.consecutive + 1, last)
        with self.collective("rollback"):
            spans = [x for x in gather_objects(local) if x is not None]
        return min(a for a, _ in spans), max(b for _, b in spans)
