"""The job's recovery from failed steps: rollback to the last good checkpoint
(``health.on_nonfinite``, ``health.on_collapse``), the skipped iterations,
and the learning-rate scale of the rollbacks so far.

:class:`RollbackPolicy` is a part of
:class:`~dino_opt.job.CheckpointedDINOTrainer`: its methods read and set the
job's state (step, rollbacks, history, the checkpoint manager, the health
monitor) and call its collectives (``_save``, ``_collective``).
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ..observe import CollapseError, NonFiniteError
from ..runtime import gather_objects
from .parts import _Rollback

__all__ = ["RollbackPolicy"]


class RollbackPolicy:
    """The rollback half of the training job (a base class of it)."""

    def _may_roll_back(self) -> bool:
        h = self.config.health
        return h.enabled and "rollback" in (h.on_nonfinite, h.on_collapse)

    def _skipped(self, step: int) -> bool:
        """Whether the micro-batch after ``step`` belongs to an optimizer
        iteration a rollback skips."""
        it = step // self.config.optim.accumulation_steps
        return any(r["skipped_iterations"] and r["skipped_iterations"][0] <= it
                   <= r["skipped_iterations"][1] for r in self.rollbacks)  # fmt: skip

    def _skip_batch(self, epoch: int) -> None:
        """A skipped micro-batch: read, not trained on; the step count and
        the teacher's momentum schedule move on as if it had been."""
        self.epoch = epoch
        self.step += 1
        self.log.advance()
        if self.step % self.config.optim.accumulation_steps == 0:
            self.parts.model.teacher_step += 1

    @property
    def lr_scale(self) -> float:
        """The learning-rate factor of the rollbacks so far."""
        return self.config.health.rollback_lr_scale ** len(self.rollbacks)

    def _rollback(self, r: _Rollback) -> None:
        """Back to the newest checkpoint before the failure, every rank at
        once: its complete state, with the rollbacks so far (this one
        included) kept, so the batches that failed are skipped and a resumed
        run makes the same choices."""
        h = self.config.health
        if self.writer is not None:
            self.writer.wait()  # the write in flight is a good checkpoint too
        if len(self.rollbacks) >= h.max_rollbacks:
            self._give_up(r)
        first_bad = r.iterations[0] * self.config.optim.accumulation_steps if r.iterations else None
        state, path = self._rollback_target(first_bad, r)
        record = {"event": "rollback", "step": int(state["step"]), "epoch": int(state["epoch"]),
                  "reason": r.reason, "detail": r.detail, "at_step": self.step,
                  "skipped_iterations": list(r.iterations) if r.iterations else None,
                  "checkpoint": path.name, "rollback": len(self.rollbacks) + 1}  # fmt: skip
        rollbacks = [*self.rollbacks, record]
        before = len(state.get("rollbacks", []))
        self.load_state_dict(state)
        self.rollbacks = rollbacks
        self.history += rollbacks[before:-1]  # earlier events after that checkpoint
        record["lr_scale"] = self.lr_scale
        self.trainer.discard_accumulation()
        self._collapse_streak = 0
        self.log.close()
        self._start_logging()  # metrics and TensorBoard rewound to the checkpoint, as on resume
        self.history.append(record)
        self.log.event(record)
        if self.lead:
            print(f"rollback {record['rollback']}/{h.max_rollbacks} at step {record['at_step']}: "
                  f"{r.detail}; back to {path.name} (step {self.step}), skipping optimizer "
                  f"iterations {record['skipped_iterations']}, lr x{self.lr_scale:g}",
                  file=sys.stderr)  # fmt: skip

    def _rollback_target(self, first_bad: int | None, r: _Rollback) -> tuple[dict, Path]:
        """The newest checkpoint that loads and was written before step
        ``first_bad`` (before this step when None)."""
        limit = self.step - 1 if first_bad is None else first_bad
        for record in reversed(self.checkpoint_manager.checkpoints()):
            if record.step <= limit:
                with contextlib.suppress(ValueError, OSError):
                    state = self.checkpoint_manager.load(record.path, tensors=not self.sharded)
                    return self._for_this_run((state, record.path))
        self._give_up(r, f"no checkpoint written before step {limit + 1} loads")

    def _give_up(self, r: _Rollback, why: str | None = None):
        why = why or f"health.max_rollbacks={self.config.health.max_rollbacks} rollbacks done"
        records = self.checkpoint_manager.checkpoints()
        kept = f"; the last good checkpoint is kept: {records[-1].path}" if records else ""
        if r.reason == "collapse":
            alerts = [a.name for a in self.monitor.last_alerts]
            raise CollapseError(f"{r.detail}; cannot roll back: {why}{kept}", alerts)
        e = r.error
        raise NonFiniteError(e.consecutive, e.first_step, e.last_step, e.limit,
                             note=f"cannot roll back: {why}{kept}")  # fmt: skip

    def _act_on_health(self, reduced: dict, diverged: NonFiniteError | None) -> None:
        """``health.on_nonfinite`` when any rank diverged, ``health.on_collapse``
        when the ranks saw a collapse ``health.collapse_patience`` intervals in a row."""
        h = self.config.health
        if reduced.get("diverged", 0) > 0 and h.on_nonfinite != "skip":
            error = diverged or NonFiniteError(
                h.max_nonfinite_steps + 1, None, None, h.max_nonfinite_steps,
                note="another process saw it",
            )  # fmt: skip
            if h.on_nonfinite == "stop":
                self._save("nonfinite", wait=True)
                raise error
            detail = (f"{error.consecutive} consecutive non-finite steps"
                      + (f" (steps {error.first_step}-{error.last_step})"
                         if error.last_step is not None else ""))  # fmt: skip
            raise _Rollback("nonfinite", self._failed_iterations(diverged), detail, error)
        self._collapse_streak = self._collapse_streak + 1 if reduced.get("collapsed") else 0
        if h.on_collapse == "rollback" and self._collapse_streak >= h.collapse_patience:
            names = sorted({a.name for a in self.monitor.last_alerts})
            detail = (f"collapse ({', '.join(names) or 'on another rank'}) for "
                      f"{self._collapse_streak} logging intervals")  # fmt: skip
            raise _Rollback("collapse", None, detail)

    def _failed_iterations(self, diverged: NonFiniteError | None) -> tuple[int, int]:
        """Collective: the optimizer iterations of the non-finite streak, over
        every rank that saw one (iteration i trains micro-batches
        i*accumulation ... (i+1)*accumulation - 1)."""
        accumulation = self.config.optim.accumulation_steps
        local = None
        if diverged is not None:
            last_step = diverged.last_step if diverged.last_step is not None else self.step
            last = last_step // accumulation - 1
            local = (last - diverged.consecutive + 1, last)
        with self._collective("rollback"):
            spans = [x for x in gather_objects(local) if x is not None]
        return min(a for a, _ in spans), max(b for _, b in spans)
