"""The job's logging steps (:class:`MetricsLogger`, held by the job): the
health monitor that watches the optimizer steps, and at each logging step
the row of metrics (loss over ranks, schedules, throughput, memory, health)
written to the run's log and history."""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractContextManager

import torch

from ..config import Config
from ..observe import (
    HealthThresholds,
    MemoryTracker,
    NonFiniteError,
    RunLog,
    TrainingHealthMonitor,
    teacher_entropy_per_row,
)
from ..runtime import StudentGroups, all_reduce_metrics

__all__ = ["MetricsLogger"]


class MetricsLogger:
    """The metrics and health checks of one run's steps, held by the job.

    Built at each start of the job's logging (at the start, and after a
    rollback: fresh health streaks, the throughput window from ``step``)
    with the run's ``config``, its ``log`` and ``history`` (each row goes
    into both), the ``device`` whose memory it reports, this rank's place
    in ``groups`` (students on their own groups of ranks, else None), and
    the job's ``collective`` (the hang watchdog's name for what the ranks
    wait in). The job calls :meth:`observe` after each optimizer step and
    :meth:`row` at each logging step; then acts on what the ranks saw."""

    def __init__(
        self,
        config: Config,
        log: RunLog,
        history: list[dict],
        *,
        device: torch.device,
        groups: StudentGroups | None,
        step: int,
        collective: Callable[[str], AbstractContextManager],
    ):
        self.config = config
        self.log = log
        self.history = history
        self.groups = groups
        self.collective = collective
        self.tracker = MemoryTracker(device=device)
        self.monitor: TrainingHealthMonitor | None = None  # None: health checks off
        if config.health.enabled:
            self.monitor = TrainingHealthMonitor(HealthThresholds.from_config(config.health))
        self.window = (time.perf_counter(), step)  # (time, step) of the last row

    def observe(self, loss: torch.Tensor, trainer, loss_fn, epoch: int, step: int) -> None:
        """An optimizer step's loss and gradient norm, and the outputs the
        ``trainer`` captured at a logging step (the teacher's entropy per
        image, a histogram, with ``logging.histograms``); health checks on."""
        extra = {}
        if trainer.captured:
            c = trainer.captured
            extra = dict(
                teacher_logits=c["teacher_logits"],
                student_logits=c["student_logits"],
                teacher_temp=c.get("teacher_temp") or loss_fn.teacher_temp(epoch),
                student_temp=loss_fn.student_temp,
                center=loss_fn.center,
                features=c.get("features"),
            )
        self.monitor.observe(loss=loss, grad_norm=trainer.last_grad_norm, step=step, **extra)
        if extra and self.config.logging.histograms and self.log.histograms:
            entropy = teacher_entropy_per_row(
                extra["teacher_logits"], loss_fn.center, extra["teacher_temp"]
            )
            self.log.histogram("health/teacher_entropy_per_image", entropy, step)
        trainer.captured = {}

    @property
    def in_nonfinite_streak(self) -> bool:
        """Whether this rank's last steps were non-finite (then no checkpoint is written)."""
        return self.monitor is not None and self.monitor.current_streak() > 0

    @property
    def last_alerts(self) -> list:
        """This rank's alerts of the last health check."""
        return self.monitor.last_alerts if self.monitor is not None else []

    def row(
        self,
        loss: torch.Tensor,
        metrics: dict,
        *,
        step: int,
        epoch: int,
        rates: dict[str, float],
        crop_sides: tuple[int, int | None],
        stop: bool,
    ) -> tuple[dict, NonFiniteError | None]:
        """The row of a logging step: this rank's health check, then one
        all-reduce (and host sync) for the mean loss (and its ``metrics``)
        over ranks, whether any rank got a signal (``stop``), diverged or
        sees a collapse; the row (``rates``: the schedules' values) is
        written. Returns what the ranks saw together and this rank's
        :class:`~dino_opt.observe.NonFiniteError`, if its streak is too long."""
        cfg = self.config
        now = time.perf_counter()
        ips = (step - self.window[1]) * cfg.data.batch_size / max(now - self.window[0], 1e-9)
        health, alerts, diverged = self._check(loss, ips)
        collapsed = any(a.name.startswith("collapse") for a in alerts)
        if self.groups is not None:  # this rank's student's, placed for the mean over all ranks
            loss, metrics = self.groups.metrics(list(cfg.student_keys), loss, metrics)
        parts = {f"loss_{k}": v for k, v in metrics.items() if k != "loss"}
        with self.collective("metrics"):
            reduced = all_reduce_metrics(
                {
                    "loss": loss,
                    "stop": float(stop),
                    "diverged": float(diverged is not None),
                    "collapsed": float(collapsed),
                    **parts,
                }
            )
        row = {
            "step": step,
            "epoch": epoch,
            "loss": reduced["loss"],
            **rates,
            "images_per_second": ips,
            **{k: reduced[k] for k in parts},
        }
        if len(cfg.augmentation.crop_size_pairs) > 1:
            row["global_crop_size"], row["local_crop_size"] = crop_sides
        row.update(self.tracker.get_memory_stats())
        row.update({k: v for k, v in health.items() if k not in row})
        if alerts:
            row["alerts"] = [a.name for a in alerts]
        self.window = (now, step)
        self.history.append(row)
        self.log.write(row)
        self.log.alerts([a.message for a in alerts], step)
        return reduced, diverged

    def _check(self, loss: torch.Tensor, ips: float):
        """This rank's health diagnostics of the window, the alerts they
        raise, and the NonFiniteError when the non-finite streak is too long
        (returned, not raised: the ranks decide together)."""
        if self.monitor is None:
            return {}, [], None
        health = self.monitor.summary()
        try:
            alerts = self.monitor.check_training_health({**health, "loss": loss, "throughput": ips})
        except NonFiniteError as e:
            return health, self.monitor.last_alerts, e
        return health, alerts, None
