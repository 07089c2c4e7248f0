"""The training job of ``dino-opt train``: :class:`CheckpointedDINOTrainer`.

One run, restartable at any step: set-up (process group, hardware preset,
run folder, the objects of :mod:`dino_opt.train.build`), resume (the complete state
of a checkpoint, :meth:`CheckpointedDINOTrainer.load_state_dict`), epochs of
steps of :class:`~dino_opt.train.MemoryOptimizedDINOTrainer`, logging
(:class:`~dino_opt.observe.RunLog`, health, profile), checkpoints
(:meth:`CheckpointedDINOTrainer.state_dict`, collective), and the finish
(the final checkpoint, profile, curves, evaluation, ``report.json``). The
job holds a component per concern that it calls at its boundaries: its
checkpoints (:mod:`~dino_opt.job.checkpoints`), the logging steps' metrics
and health checks (:mod:`~dino_opt.job.metrics`), the rollbacks
(:mod:`~dino_opt.job.rollback`), the hang report (:mod:`~dino_opt.job.hang`)
and the evaluations (:mod:`~dino_opt.job.evaluation`).
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
from collections.abc import Iterable
from pathlib import Path

import torch

from ..checkpoint import (
    CheckpointManager,
    capture_rng_state,
    restore_rng_state,
    run_metadata,
)
from ..config import apply_overrides, resume_differences, save_config
from ..observe import (
    NonFiniteError,
    Profiler,
    RunFolder,
    RunLog,
    TrainingHealthMonitor,
    plot_training_curves,
    profile_summary,
)
from ..runtime import (
    GracefulStop,
    HangWatchdog,
    StepCollector,
    all_reduce_metrics,
    broadcast_object,
    data_place,
    gather_objects,
    init_distributed,
)
from ..train import resolve_epochs, resolve_input, resolve_recipe
from ..tune import resolve_checkpointing, resolve_hardware
from ..weights import init_from, start_students, weights_reader
from .checkpoints import RunCheckpoints
from .evaluation import Evaluator
from .groups import group_state, load_group_state
from .hang import HangReporter, injected_hang, start_watchdog
from .metrics import MetricsLogger
from .parts import (
    _NEVER_HELD_BACK,
    PROFILE_PHASES,
    ResumeError,
    _config_of,
    _Parts,
    build_parts,
)
from .restarts import (
    ProgressFile,
    claim_restart,
    injected_kill,
    pending_failures,
    read_restarts,
    rows_to_log,
)
from .rollback import Rollback, RollbackSignal
from .sharding import (
    SHARDED_KEYS,
    load_loss_state,
    load_sharded_state,
    load_whole_state,
    resharded_loader_state,
    sharded_state,
)
from .tracking import tracked_weights

__all__ = ["CheckpointedDINOTrainer", "run_training"]


class CheckpointedDINOTrainer:
    """The training job of ``dino-opt train``, restartable at any step.

    ``CheckpointedDINOTrainer(config, output_dir=..., auto_resume=True).train()``
    builds the loader, student and teacher, loss, optimizer and
    :class:`~dino_opt.train.MemoryOptimizedDINOTrainer` from a
    :class:`~dino_opt.config.Config` (or a YAML path, or a dict), trains, and
    returns the report (also written as ``report.json``). Its checkpoints
    (when, what the state holds, resuming bit for bit, what a resume refuses)
    are docs/checkpoints.md; its health policies and rollbacks docs/health.md.

    It holds the components it calls at its boundaries, each built once with
    what it needs: its checkpoints (:class:`~dino_opt.job.checkpoints.RunCheckpoints`,
    at set-up), its rollbacks (:class:`~dino_opt.job.rollback.Rollback`,
    at set-up), the hang report (:class:`~dino_opt.job.hang.HangReporter`)
    and the evaluations (:class:`~dino_opt.job.evaluation.Evaluator`), once
    it trains, and the metrics and health checks of its logging steps
    (:class:`~dino_opt.job.metrics.MetricsLogger`), at each start of logging.
    """

    def __init__(
        self,
        config=None,
        *,
        config_path: str | os.PathLike | None = None,
        overrides: Iterable[str] = (),
        output_dir: str | os.PathLike | None = None,
        auto_resume: bool = True,
        quiet: bool = False,
        enable_live_dashboard: bool | None = None,
    ):
        if config is not None and config_path is not None:
            raise ValueError("give config or config_path, not both")
        cfg = _config_of(config if config is not None else config_path, list(overrides))
        if not auto_resume and cfg.checkpoint.resume == "auto":
            cfg = apply_overrides(cfg, ["checkpoint.resume=null"])
        if enable_live_dashboard is not None:
            cfg = apply_overrides(cfg, [f"logging.tensorboard={bool(enable_live_dashboard)}"])
        self.config = cfg
        self.quiet = quiet
        self.hardware_preset: str | None = None  # how the preset was resolved, if any
        self.epochs_choice: str | None = None  # what schedule.epochs=auto chose, and why
        self.init_notes: list[str] = []  # what model.init_from loaded, if anything
        out = output_dir or cfg.logging.output_dir or f"runs/{time.strftime('%Y%m%d-%H%M%S')}"
        self._set_output_dir(Path(out))
        self.epoch = self.step = 0
        self.history: list[dict] = []
        self.watchdog: HangWatchdog | None = None
        self.collector = StepCollector(0)  # train() sets the configured one
        self.restarts: list[dict] = []  # by the launcher, from the run folder (restarts.json)
        self._pending: list[dict] = []  # failures the launcher recorded: this attempt is a restart
        self.progress_file: ProgressFile | None = None  # several processes: read by the launcher
        self._seconds_before = 0.0  # training time of the runs this one resumes
        self._started = time.perf_counter()
        self.reader = weights_reader()  # opens a distillation's teacher once

    def _set_output_dir(self, out: Path) -> None:
        """The run folder and the manager of its ``checkpoints/``."""
        ck = self.config.checkpoint
        self.output_dir = out
        self.folder = RunFolder(out)
        self.checkpoint_manager = CheckpointManager(
            self.folder.checkpoints, keep_last=ck.keep, milestone_every=ck.milestone_every
        )

    # ------------------------------------------------------------ set-up

    def _setup(self) -> tuple[dict, Path] | None:
        """Joins the process group, resolves the hardware preset (on the first
        process, handed to the others), fixes the run folder and reads the
        checkpoint to resume from (checked against this config)."""
        # a sharded checkpoint; students on their own ranks are joined into one file
        d = self.config.distributed
        self.sharded = d.strategy == "fsdp" and not d.student_groups
        info = init_distributed(
            self.config.hardware.device,
            timeout_s=self.config.distributed.timeout_s,
            group_alone=self.sharded,
        )
        self.device, self.rank, self.world = info.device, info.rank, info.world_size
        self.lead = self.rank == 0  # writes the run folder; every rank trains
        if self.lead:
            self.config, choice = resolve_hardware(self.config)
            self.hardware_preset = choice.reason if choice is not None else None
            self.config, self.epochs_choice = resolve_epochs(self.config, self.world)
            if self.epochs_choice is not None:
                print(self.epochs_choice, file=sys.stderr)
            self.config = resolve_recipe(self.config, self.reader)  # e.g. a teacher's widths
            self.config = resolve_input(self.config)  # the data's channels and normalisation
            self.config, checkpointing = resolve_checkpointing(self.config, self.world)
            if checkpointing is not None:
                print(checkpointing.reason, file=sys.stderr)
        self.config = broadcast_object(self.config)
        if self.world > 1:  # rank 0's run folder (a default name holds the time it was made)
            self._set_output_dir(Path(gather_objects(str(self.output_dir))[0]))
            found = None  # the launcher's restarts so far, and failures since: a restart
            if self.lead:
                found = (read_restarts(self.folder), pending_failures(self.folder))
            self.restarts, self._pending = broadcast_object(found)
        self.checkpoints = RunCheckpoints(
            self.checkpoint_manager,
            lead=self.lead,
            sharded=self.sharded,
            asynchronous=self.config.checkpoint.async_,
        )
        self.rollback = Rollback(
            self.config.health,
            self.config.optim.accumulation_steps,
            self.checkpoints,
            self._collective,
        )
        torch.manual_seed(self.config.hardware.seed)
        if self.lead:
            self.output_dir.mkdir(parents=True, exist_ok=True)
            # what saves killed mid-write left (no other process saves yet)
            self.checkpoint_manager.remove_stale_temp_files()
        resumed = self.checkpoints.to_resume(
            self.config.checkpoint.resume, restarted=bool(self._pending), output_dir=self.output_dir
        )
        if resumed is not None:
            differences = resume_differences(resumed[0].get("config", {}), self.config)
            if differences:
                raise ResumeError(
                    f"checkpoint {str(resumed[1])!r} belongs to a run with another config: "
                    + "; ".join(differences)
                    + " (train in another run folder to start afresh)"
                )
        if self.lead:
            save_config(self.config, self.folder.config)
        return resumed

    def _build(self) -> _Parts:
        """The objects of the run (:func:`~dino_opt.job.parts.build_parts`)."""
        return build_parts(self.config, self.device, self.rank, self.world, self.reader)

    # ------------------------------------------------------------ resume

    def state_dict(self) -> dict:
        """The complete state of the run at the current step. Collective when
        distributed: every process calls it at the same step (each one's
        loader position and RNGs are gathered), and every process gets it
        (students on their own groups of ranks: their networks on rank 0
        only, joined as one run of them all holds them,
        :mod:`dino_opt.job.groups`)."""
        p = self.parts
        loaders = gather_objects(p.loader.state_dict())  # per rank
        if p.groups is not None:  # joined on rank 0; the loaders of one group
            networks = group_state(
                p.groups, list(self.config.student_keys), p.sizes, p.student, p.teacher, p.optimizer
            )
            loaders = loaders[: p.groups.size]
        elif self.sharded:
            networks = sharded_state(p.student, p.teacher, p.optimizer)
        else:
            networks = {
                "student": p.student.state_dict(),
                "teacher": p.teacher.state_dict(),
                "optimizer": p.optimizer.state_dict(),
            }
        return {
            **networks,
            "scaler": p.trainer.scaler.state_dict() if p.trainer.scaler is not None else None,
            "loss": p.loss_fn.state_dict(),
            "teacher_step": p.model.teacher_step,
            "epoch": self.epoch,
            "step": self.step,
            "loader": loaders,
            "rng": gather_objects(capture_rng_state()),  # per rank
            "world_size": self.world,
            "history": self.history,
            **self.rollback.state_dict(),
            "train_seconds": self._seconds_before + time.perf_counter() - self._started,
            "config": self.config.to_dict(),
            "metadata": self.metadata,
        }

    def load_state_dict(self, state: dict) -> None:
        """Restores a state of :meth:`state_dict` (written by as many
        processes as this run has, or as many others: then the loader goes on
        after the images seen, :func:`~dino_opt.job.sharding.resharded_loader_state`)
        into the built run. A sharded run's state holds ``shards``, the folder
        its networks and optimizer are loaded from (collective), and the
        shards of the loss's frozen networks."""
        p = self.parts
        loss = state["loss"]
        if "shards" in state:
            keys = state.get("sharded_keys", list(SHARDED_KEYS))
            loss = {
                **loss,
                **load_sharded_state(
                    state["shards"], keys, p.student, p.teacher, p.optimizer, p.loss_fn
                ),
            }
        elif p.groups is not None:  # this rank's student's part
            load_group_state(
                state,
                list(self.config.student_keys),
                p.groups,
                p.sizes,
                p.student,
                p.teacher,
                p.optimizer,
            )
        else:  # a whole checkpoint (ddp's, or a sharded one read whole)
            load_whole_state(state, p.student, p.teacher, p.optimizer)
        load_loss_state(p.loss_fn, loss)
        if p.trainer.scaler is not None and state.get("scaler") is not None:
            p.trainer.scaler.load_state_dict(state["scaler"])
        p.model.teacher_step = int(state["teacher_step"])
        self.epoch, self.step = int(state["epoch"]), int(state["step"])
        data_rank, data_world = data_place(p.groups, self.rank, self.world)
        rng = state["rng"]
        restore_rng_state(rng[self.rank % len(rng)], strict=False)
        if len(state["loader"]) == data_world:
            p.loader.load_state_dict(state["loader"][data_rank])
        else:  # another world size: the same epoch, after the images seen
            loader = resharded_loader_state(state["loader"], data_rank, data_world)
            p.loader.load_state_dict(loader)
            self.step = self.epoch * len(p.loader) + p.loader.state_dict()["next_batch"]
            p.model.teacher_step = self.step // self.config.optim.accumulation_steps
        self.history = list(state.get("history", []))
        self.history += rows_to_log(self.restarts, self.history, self.step)  # made after it
        self.rollback.load_state_dict(state)
        self._seconds_before = float(state.get("train_seconds", 0.0))

    def _resume(self, resumed: tuple[dict, Path] | None) -> Path | None:
        if resumed is None:
            return None
        state, path = resumed
        try:
            self.load_state_dict(state)
        except (KeyError, RuntimeError, ValueError, TypeError) as e:
            raise ResumeError(f"checkpoint {str(path)!r} cannot be resumed: {e}") from e
        if self.lead:
            print(f"resuming from {path} (epoch {self.epoch}, step {self.step})", file=sys.stderr)
        return path

    def _init_from(self, path: str | None) -> None:
        """A fresh run's start from existing weights: ``model.init_from``
        (student, teacher and the loss's center where the file has one) and
        a distillation's ``recipe.distill.students_init_from``."""
        p = self.parts
        try:
            if path is not None:
                self.init_notes = init_from(path, p.student, p.teacher, p.loss_fn)
        except (OSError, ValueError) as e:
            raise ValueError(f"model.init_from={path!r}: {e}") from e
        index = p.groups.index if p.groups is not None else None
        self.init_notes += start_students(self.config, p.student, p.teacher, index)
        if self.lead and self.init_notes:
            print("starting from " + "; ".join(self.init_notes), file=sys.stderr)

    def _collective(self, name: str):
        """Marks a collective for the hang watchdog (what the ranks wait in)."""
        return self.watchdog.phase(name) if self.watchdog is not None else contextlib.nullcontext()

    def _save(self, reason: str, *, end_of_epoch: bool = False, wait: bool = False):
        """Collective: every rank calls it at the same step. Rank 0 writes
        (in the background with ``checkpoint.async`` unless ``wait``); then
        all learn whether its write, or the previous one, failed, so that a
        full disk stops them all. Returns the checkpoint's path on rank 0
        (None elsewhere, or when held back while the run is unhealthy)."""
        if reason not in _NEVER_HELD_BACK and self._unhealthy():
            if self.lead:
                print(
                    f"step {self.step}: {reason} checkpoint held back: the run is unhealthy "
                    "(a checkpoint must be one to roll back to)",
                    file=sys.stderr,
                )
            return None
        with self._collective("checkpoint state"):
            state = {**self.state_dict(), "reason": reason}
        path, error = None, None
        if self.lead or self.sharded:  # a sharded run's ranks each write their shards
            try:
                path = self.checkpoints.write(
                    state,
                    reason,
                    epoch=self.epoch,
                    step=self.step,
                    end_of_epoch=end_of_epoch,
                    wait=wait,
                )
            except BaseException as e:  # reported to every rank first
                error = e
        del state
        with self._collective("checkpoint result"):
            ok = all_reduce_metrics({"ok": float(error is None)})["ok"]
        if error is not None:
            raise error
        if ok < 1.0:
            raise RuntimeError(f"rank 0 could not write a checkpoint (at step {self.step})")
        return path

    def _unhealthy(self) -> bool:
        """Collective: whether any rank is in a non-finite streak or (with
        ``health.on_collapse=rollback``) a collapse, so saves wait."""
        if self.monitor is None:
            return False
        local = self.metrics.in_nonfinite_streak or self.rollback.collapse_pending
        with self._collective("health"):
            return all_reduce_metrics({"unhealthy": float(local)})["unhealthy"] > 0

    # ------------------------------------------------------------ the job

    def train(self) -> dict:
        """Trains (resuming when configured) and returns the report."""
        resumed = self._setup()
        self.parts = self._build()
        self.trainer = self.parts.trainer
        self.metadata = run_metadata()
        resumed_from = self._resume(resumed)
        if resumed is None:
            self._init_from(self.config.model.init_from)
        del resumed  # the tensors now live in the models and the optimizer
        self._start_logging()
        self._log_restarts(resumed_from)
        self.checkpoints.start_writer()
        # from now on: an older hang.json is another attempt's
        self.hang = HangReporter(
            self.folder.hang, self.checkpoint_manager, self.checkpoints.writer, self.world
        )
        self.watchdog = start_watchdog(
            self.config.distributed.hang_timeout_s, self.rank, self.world, self.hang.report
        )
        self.evaluator = Evaluator(
            self.config,
            self.parts,
            self.device,
            world=self.world,
            lead=self.lead,
            folder=self.folder,
            watchdog=self.watchdog,
        )
        self.collector = StepCollector(self.config.hardware.gc_every_steps)
        try:
            with GracefulStop() as stop, self.collector:
                if self.step == 0 and self.rollback.enabled:
                    self._save("start")  # a checkpoint to go back to
                stopped_by = self._train_epochs(stop)
        except BaseException:
            self._abandon()
            raise
        return self._finish(stopped_by, resumed_from)

    def _abandon(self) -> None:
        """After an error: the write in flight finishes (its own error, if
        any, is printed: the one being raised matters more), sinks close."""
        self._stop_watchdog()
        self.log.close()
        self.parts.loader.close()
        if self.progress_file is not None:
            self.progress_file.close()
        if self.checkpoints.writer is not None:
            try:
                with GracefulStop():  # a launcher's SIGTERM waits for the write (SIGKILL won't)
                    self.checkpoints.wait()
            except Exception as e:
                print(f"the checkpoint write in flight failed too: {e}", file=sys.stderr)

    def _train_epochs(self, stop: GracefulStop) -> str | None:
        """The epochs from the current one on, going back to the last good
        checkpoint when the health checks ask for it. Returns the signal
        that stopped the run, if any."""
        while True:
            try:
                for epoch in range(self.epoch, self.config.schedule.epochs):
                    stopped_by = self._run_epoch(epoch, stop)
                    if stopped_by is not None:
                        return stopped_by
                return None
            except RollbackSignal as r:
                self._roll_back(r)

    def _roll_back(self, r: RollbackSignal) -> None:
        """Back to the last good checkpoint (:meth:`Rollback.roll_back
        <dino_opt.job.rollback.Rollback.roll_back>`), every rank at once: the
        events after it again in the history, the accumulation discarded,
        the metrics and TensorBoard rewound to it, as on resume."""
        record, earlier = self.rollback.roll_back(r, self.step, self.load_state_dict)
        self.history += earlier
        self.trainer.discard_accumulation()
        self.log.close()
        self._start_logging()
        self.history.append(record)
        self.log.event(record)
        if self.lead:
            print(self.rollback.describe(record, self.step), file=sys.stderr)

    def _log_restarts(self, resumed_from: Path | None) -> None:
        """Several processes: a restart by the launcher becomes a row of
        ``restarts.json`` (rank 0); the rows the history lacks go into it and
        ``metrics.jsonl``; each rank writes its progress for the launcher."""
        if self.world == 1:
            return
        if self._pending:
            rows = (
                claim_restart(
                    self.folder,
                    self._pending,
                    step=self.step,
                    epoch=self.epoch,
                    checkpoint=resumed_from,
                )
                if self.lead
                else None
            )
            self.restarts = broadcast_object(rows)
            if self.lead:
                print(
                    f"restart {len(rows)}: {rows[-1]['message']}; resumed at step {self.step}",
                    file=sys.stderr,
                )
        for row in rows_to_log(self.restarts, self.history, self.step):
            self.history.append(row)
            self.log.event(row)
        self.progress_file = ProgressFile(self.folder, self.rank, self.step)

    # ------------------------------------------------------------ steps

    def _start_logging(self) -> None:
        """The run's log and what writes its rows (:class:`~dino_opt.job.metrics.MetricsLogger`:
        fresh health streaks), and the profiler: at the start and after a rollback."""
        cfg = self.config
        self.log = RunLog(
            cfg,
            self.folder,
            lead=self.lead,
            step=self.step,
            total=cfg.schedule.epochs * len(self.parts.loader),
            metadata=self.metadata,
            history=self.history,
            quiet=self.quiet,
        )
        # The phases of each step as ranges of the native profiler: host clock
        # and, on a GPU, CUDA events on the current stream, resolved only when
        # read after training; push/pop never synchronise the device.
        self.profiler = Profiler(self.device) if cfg.logging.profile and self.lead else None
        self._first_step = self.step
        self._started = time.perf_counter()
        self.metrics = MetricsLogger(
            cfg,
            self.log,
            self.history,
            device=self.device,
            groups=self.parts.groups,
            step=self.step,
            collective=self._collective,
        )
        self._pending_stop: str | None = None

    def _phase(self, name: str):
        return self.profiler.range(name) if self.profiler is not None else contextlib.nullcontext()

    def _run_epoch(self, epoch: int, stop: GracefulStop) -> str | None:
        """One epoch (or the rest of one); returns the signal that stopped it, if any."""
        loader = self.parts.loader
        if epoch != loader.epoch:
            loader.set_epoch(epoch)
        self.parts.student.train()
        batches = iter(loader)
        while True:
            with self._phase("data_wait"):
                batch = next(batches, None)
            if batch is None:
                break
            if self.rollback.skipped(self.step):
                self._skip_batch(epoch)
            else:
                self._train_step(batch, epoch, stop)
            if self.watchdog is not None:
                self.watchdog.progress(self.step)
                self.watchdog.arm()  # from the first step on (not during compilation)
            self.collector.after_step(self.step)
            if self.progress_file is not None:
                self.progress_file.update(self.step)
            injected_kill(self.config.debug, self.step, self.rank, len(self.restarts))
            if self.trainer.at_step_boundary:
                stopped_by = self._at_step_boundary(stop)
                if stopped_by is not None:
                    return stopped_by
        self.collector.after_epoch()
        every = self.config.checkpoint.every_epochs
        if every and (epoch + 1) % every == 0 and epoch + 1 < self.config.schedule.epochs:
            loader.set_epoch(epoch + 1)  # the position to resume from
            self.epoch = epoch + 1
            self._save("epoch", end_of_epoch=True)
        self.evaluator.between_epochs(epoch + 1, self.step, self.log)
        return None

    def _skip_batch(self, epoch: int) -> None:
        """A micro-batch a rollback skips: read, not trained on; the step
        count and the teacher's momentum schedule move on as if it had been."""
        self.epoch = epoch
        self.step += 1
        self.log.advance()
        if self.step % self.config.optim.accumulation_steps == 0:
            self.parts.model.teacher_step += 1

    def _train_step(self, batch, epoch: int, stop: GracefulStop) -> None:
        """One micro-batch: schedules, forward and backward, the optimizer
        step when one is due, health observation, and the logging row."""
        cfg, p = self.config, self.parts
        self.epoch = epoch
        it = min(self.step // cfg.optim.accumulation_steps, len(p.schedules.lr) - 1)
        self.trainer.set_schedules(p.schedules, it, self.rollback.lr_scale)
        total = cfg.schedule.epochs * len(p.loader)
        logging_step = (self.step + 1) % cfg.logging.log_every == 0 or self.step + 1 == total
        self.trainer.capture_outputs = logging_step and self.monitor is not None
        crops = batch.crops
        # the batch's (global, local) crop sides: with crop-size pairs, its drawn pair
        self._crop_sides = (crops[0].shape[-1], crops[2].shape[-1] if len(crops) > 2 else None)
        if cfg.debug.inject_nonfinite_at_step == self.step + 1:
            crops = [torch.full_like(crops[0], float("nan")), *crops[1:]]  # a corrupt batch
        masks = {"masks": batch.masks} if getattr(batch, "masks", None) is not None else {}
        with self._phase("forward_backward"):
            loss, self._step_metrics = self.trainer.train_step_optimized(crops, epoch, **masks)
        with self._phase("optimizer_step"):
            stepped = self.trainer.optimize_step()
        self.step += 1
        self.log.advance()
        if stepped and self.monitor is not None:
            self._observe_health(loss, epoch)
        if logging_step:
            self._log_row(loss, epoch, it, stop)
        if self.profiler is not None:
            self.profiler.step(cfg.data.batch_size)

    @property
    def monitor(self) -> TrainingHealthMonitor | None:
        """The health monitor of the steps (None: health checks off)."""
        return self.metrics.monitor

    def _observe_health(self, loss: torch.Tensor, epoch: int) -> None:
        self.metrics.observe(loss, self.trainer, self.parts.loss_fn, epoch, self.step)

    def _log_row(self, loss: torch.Tensor, epoch: int, it: int, stop: GracefulStop) -> None:
        """The metrics row of a logging step (:meth:`MetricsLogger.row
        <dino_opt.job.metrics.MetricsLogger.row>`, one all-reduce over
        ranks); then the stop signal any rank got, and the health policy,
        act on what the ranks saw together."""
        injected_hang(self.config.debug, self.step, self.rank, len(self.restarts))
        s = self.parts.schedules
        rates = {
            "lr": float(s.lr[it]) * self.rollback.lr_scale,
            "weight_decay": float(s.weight_decay[it]),
            "momentum": float(s.momentum[it]),
        }
        reduced, diverged = self.metrics.row(
            loss,
            self._step_metrics,
            step=self.step,
            epoch=epoch,
            rates=rates,
            crop_sides=self._crop_sides,
            stop=stop.requested,
        )
        if reduced["stop"] > 0 and self._pending_stop is None:
            self._pending_stop = stop.signal_name or "SIGTERM"
        self._act_on_health(reduced, diverged)

    def _act_on_health(self, reduced: dict, diverged: NonFiniteError | None) -> None:
        """What the ranks saw together (``reduced``) at a logging step:
        ``health.on_nonfinite`` when any rank diverged (``diverged``: this
        rank's error), ``health.on_collapse`` when the ranks saw a collapse
        (:class:`~dino_opt.job.rollback.Rollback` raises the signal to go back)."""
        if reduced.get("diverged", 0) > 0:
            error = self.rollback.on_nonfinite(diverged, self.step)
            if error is not None:
                self._save("nonfinite", wait=True)
                raise error
        self.rollback.on_collapse(bool(reduced.get("collapsed")), self.metrics.last_alerts)

    def _at_step_boundary(self, stop: GracefulStop) -> str | None:
        """After an optimizer step: act on a stop signal (alone at once; with
        several ranks at the next logging step, when all of them know of it),
        or write the step checkpoint that is due."""
        if self._pending_stop is None and stop.requested and self.world == 1:
            self._pending_stop = stop.signal_name
        if self._pending_stop is not None:
            self._save(f"signal:{self._pending_stop}", wait=True)
            return self._pending_stop
        cfg, loader = self.config, self.parts.loader
        every = cfg.checkpoint.every_steps * cfg.optim.accumulation_steps  # in loader batches
        # not at an epoch's end: the epoch checkpoint covers it
        if every and self.step % every == 0 and 0 < loader.state_dict()["next_batch"] < len(loader):
            self._save("step")
        return None

    # ------------------------------------------------------------ finish

    def _finish(self, stopped_by: str | None, resumed_from: Path | None) -> dict:
        """The report; for a finished run also the final checkpoint, the
        profile, the curves and the evaluation (on rank 0)."""
        cfg = self.config
        self.parts.loader.close()
        if self.progress_file is not None:
            self.progress_file.close()
        losses = [row["loss"] for row in self.history if "loss" in row]
        report = {
            "epochs": cfg.schedule.epochs,
            "steps": self.step,
            "train_seconds": self._seconds_before + time.perf_counter() - self._started,
            "final_loss": losses[-1] if losses else None,
            "device": str(self.device),
            "run_folder": str(self.output_dir),
            "rollbacks": self.rollback.rollbacks,
            "restarts": self.restarts,
        }
        if self.hardware_preset is not None:
            report["hardware_preset"] = self.hardware_preset
        if self.epochs_choice is not None:
            report["epochs_auto"] = self.epochs_choice
        if resumed_from is not None:
            report["resumed_from"] = str(resumed_from)
        elif self.init_notes:
            report["init_from"] = self.init_notes
        if stopped_by is not None:
            self._stop_watchdog()
            report["stopped_by"] = stopped_by
            report["checkpoint"] = str(self.checkpoint_manager.latest_path())
            return self._write_report(report, final=False)
        self.parts.loader.set_epoch(cfg.schedule.epochs)
        self.epoch = cfg.schedule.epochs
        report["checkpoint"] = str(self._save("final", end_of_epoch=True, wait=True))
        self._stop_watchdog()  # not during the evaluation
        if not self.lead:  # rank 0 evaluates and writes the report (group leads their students)
            self.evaluator.at_end(self.step, self.log)
            self.log.close()
            return report
        report.update(self._profile_report())
        if cfg.logging.curves:
            plot_training_curves(self.history, self.folder.training_curves)
        report.update(self.evaluator.at_end(self.step, self.log))
        if self.log.tracks_artifacts and cfg.logging.mlflow_weights:
            self.log.artifacts([tracked_weights(cfg, report["checkpoint"], self.folder)], "weights")
        return self._write_report(report, final=True)

    def _stop_watchdog(self) -> None:
        if self.watchdog is not None:
            self.watchdog.stop()

    def _profile_report(self) -> dict:
        """``profile.json`` and the report's per-phase shares of a step."""
        if self.profiler is None or self.step <= self._first_step:
            return {}
        profile = profile_summary(self.profiler, PROFILE_PHASES)
        self.folder.profile.write_text(json.dumps(profile, indent=2) + "\n")
        shares = {p: v["share_of_step"] for p, v in profile["phases"].items()}
        shares["other"] = profile["other_share_of_step"]
        return {"profile": {p: None if v is None else round(v, 4) for p, v in shares.items()}}

    def _write_report(self, report: dict, *, final: bool) -> dict:
        if self.lead:
            self.folder.report.write_text(json.dumps(report, indent=2) + "\n")
        self.log.close(report if final else None)
        return report


def run_training(cfg, *, output_dir: str | os.PathLike | None = None, quiet: bool = False) -> dict:
    """The whole job of ``dino-opt train``:
    ``CheckpointedDINOTrainer(cfg, output_dir=..., quiet=...).train()``.

    Data (the built-in set when ``cfg.data.root`` is None), student and
    teacher, the native loader, the fused loss and EMA, AMP, the DINO
    schedules; metrics as JSONL (and TensorBoard) with health diagnostics,
    the resolved config, checkpoints under ``checkpoints/`` (resumed per
    ``cfg.checkpoint.resume``) and, at the end, the evaluation of the
    trained teacher beside the same network at random initialisation
    (:func:`~dino_opt.eval.evaluate_run`). Returns the report (also written
    as report.json); the run folder's files are
    :class:`~dino_opt.observe.RunFolder`'s."""
    return CheckpointedDINOTrainer(cfg, output_dir=output_dir, quiet=quiet).train()
