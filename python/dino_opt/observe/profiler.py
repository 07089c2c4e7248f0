"""Profiling over the native core: named ranges timed on the host (steady
clock) and on the GPU (CUDA events on the current stream, resolved later, so a
range adds no synchronisation), NVTX ranges for Nsight Systems, per-step
aggregation, throughput, the GPU's idle time between steps, a Chrome trace and
the lesson's plots.

The lesson's ``DINOProfiler`` timed GPU work with ``time.time()`` and no
synchronisation, which measures how long the launches took, not the work;
here a range's ``device`` time is the GPU time between its two events."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import torch
from matplotlib.figure import Figure  # no pyplot: leaves the user's backend alone

from ..ops.native import _C
from .memory import device_index

__all__ = [
    "DINOProfiler",
    "PerformanceMonitor",
    "PerformanceProfiler",
    "Profiler",
    "TrainingProfiler",
    "profile_summary",
]

log = logging.getLogger(__name__)


class Profiler:
    """Named ranges and steps (the native profiler).

    ``with profiler.range("forward"): ...`` or ``@profiler.profile("loss")``;
    ``profiler.step(batch_size)`` at each step's end. Reading results
    (``ranges()``, ``stats()``, ``steps()``, ``chrome_trace()``) waits for the
    GPU work recorded so far: do it at logging intervals, not every step.
    """

    def __init__(self, device=None) -> None:
        self._native = _C.Profiler(device_index(device))

    @property
    def device(self) -> torch.device:
        index = self._native.device
        return torch.device("cpu") if index < 0 else torch.device("cuda", index)

    @contextlib.contextmanager
    def range(self, name: str) -> Iterator[None]:
        self._native.push(name)
        try:
            yield
        finally:
            self._native.pop()

    def profile(self, name: str | None = None) -> Callable:
        """Decorator: every call of the function is a range (its name by default)."""

        def wrap(fn):
            label = name or fn.__qualname__

            @functools.wraps(fn)
            def inner(*args, **kwargs):
                with self.range(label):
                    return fn(*args, **kwargs)

            return inner

        return wrap

    def step(self, samples: int = 0) -> None:
        self._native.step(samples)

    def ranges(self, first: int = 0) -> list[dict]:
        """Finished ranges, from the ``first``-th on, in the order they finished."""
        return self._native.ranges(first)

    def steps(self) -> list[dict]:
        return self._native.steps()

    def stats(self) -> dict:
        """Per name: ``host`` and ``device`` (None without GPU timing) statistics
        in ms (count, total, mean, median, p95, min, max) and ``share_of_step``."""
        return self._native.stats()

    def throughput(self) -> float:
        """Samples per second over the finished steps."""
        return self._native.throughput()

    def current_step(self) -> int:
        """The index of the step in progress (steps marked so far)."""
        return self._native.current_step()

    def range_count(self) -> int:
        """Finished ranges held (``clear()`` empties them)."""
        return self._native.range_count()

    def synchronizations(self) -> int:
        """Device synchronisations the profiler has made (only when results are read)."""
        return self._native.synchronizations()

    def export_chrome_trace(self, path) -> Path:
        """Writes a Chrome trace (open it in https://ui.perfetto.dev or chrome://tracing)."""
        path = Path(path)
        path.write_text(self._native.chrome_trace())
        return path

    def clear(self) -> None:
        self._native.clear()


def _seconds(r: dict) -> float:
    """A range's time: GPU time when it was timed on a GPU, else host time."""
    return (r["device_ms"] if r["device_ms"] is not None else r["host_ms"]) / 1e3


def profile_summary(profiler: Profiler, phases: Sequence[str]) -> dict:
    """Per-phase statistics of the finished steps of ``profiler`` (a
    :class:`Profiler` whose ranges are named after ``phases``), in seconds.

    A phase's time in a step is the sum of its ranges that began in that step
    (at an epoch's end the loader's exhausted fetch joins the next step's data
    wait). On a GPU it is the GPU time between the range's two CUDA events
    (device clock: how long the GPU spent in that phase, ~0 for a data wait
    the GPU did not notice because it was still busy), elsewhere the host
    time; ``host_seconds`` is always the host time. ``share_of_step`` is the
    phase's total over the steps' total wall time; ``other`` is what the
    phases' host times leave of the step (logging, the schedules, the
    progress bar). Reading the ranges waits for the GPU (once, here)."""
    steps = profiler.steps()
    ranges = profiler.ranges()
    n = len(steps)
    gpu = profiler.device.type == "cuda"
    step_s = np.array([s["host_ms"] for s in steps], dtype=np.float64) / 1e3
    total = float(step_s.sum())
    per_step = {p: np.zeros(n) for p in phases}
    per_step_host = {p: np.zeros(n) for p in phases}
    for r in ranges:
        name, i = r["name"], r["step"]
        if name not in per_step or i >= n:  # the fetch that found the loader exhausted
            continue
        ms = r["device_ms"] if r["device_ms"] is not None else r["host_ms"]
        per_step[name][i] += ms / 1e3
        per_step_host[name][i] += r["host_ms"] / 1e3

    def stats(x: np.ndarray) -> dict:
        if not len(x):
            return {"mean": None, "median": None, "p90": None, "total": 0.0}
        return {
            "mean": float(x.mean()),
            "median": float(np.median(x)),
            "p90": float(np.percentile(x, 90)),
            "total": float(x.sum()),
        }

    out_phases = {}
    for p in phases:
        entry = stats(per_step[p])
        entry["share_of_step"] = entry["total"] / total if total > 0 else None
        if gpu:
            entry["host_seconds"] = stats(per_step_host[p])
        out_phases[p] = entry
    phase_host = sum(float(per_step_host[p].sum()) for p in phases)
    summary = {
        "clock": "device (CUDA events)" if gpu else "host",
        "steps": n,
        "step_seconds": stats(step_s),
        "images_per_second": profiler.throughput(),
        "phases": out_phases,
        "other_share_of_step": max(0.0, 1.0 - phase_host / total) if total > 0 else None,
    }
    idle = [s["device_idle_ms"] for s in steps if s["device_idle_ms"] is not None]
    if idle:  # the GPU's idle gap before each step's first work
        summary["gpu_idle_before_step_seconds"] = stats(np.asarray(idle) / 1e3)
    return summary


class DINOProfiler:
    """The lesson's profiler, correct on GPUs.

    ``profile_block(name)`` times a block (device time on a GPU, host time
    otherwise) and records the change of allocated memory (MB) across it;
    ``profile_training_step(model, crops, loss_fn, optimizer)`` runs and times
    the lesson's seven blocks of a DINO step; ``get_summary_stats()``,
    ``plot_performance_analysis()`` and ``export_profile_data(path)`` as in the
    lesson, plus ``export_chrome_trace(path)``.
    """

    def __init__(self, device=None, track_memory: bool | None = None) -> None:
        self.profiler = Profiler(device)
        self._gpu = self.profiler.device.type == "cuda"
        # Allocator counters are read on the host for free; on the CPU the
        # resident set is read from /proc (tens of microseconds): off by default.
        self.track_memory = self._gpu if track_memory is None else track_memory
        self._memory: dict[str, list[float]] = defaultdict(list)
        self._ranges_read = 0  # ranges already returned by profile_training_step

    def _allocated(self) -> int:
        if self._gpu:
            return torch.cuda.memory_allocated(self.profiler.device)
        return _C.read_host_memory()["rss"]

    @contextlib.contextmanager
    def profile_block(self, name: str) -> Iterator[None]:
        before = self._allocated() if self.track_memory else 0
        with self.profiler.range(name):
            yield
        if self.track_memory:
            self._memory[name].append((self._allocated() - before) / 2**20)

    @property
    def timings(self) -> dict[str, list[float]]:
        """Seconds per call and name: GPU time when timed on a GPU, else host time."""
        out: dict[str, list[float]] = defaultdict(list)
        for r in self.profiler.ranges():
            out[r["name"]].append(_seconds(r))
        return dict(out)

    @property
    def memory_usage(self) -> dict[str, list[float]]:
        return dict(self._memory)

    def profile_training_step(self, model, crops, loss_fn, optimizer) -> dict[str, float]:
        """One DINO step in the lesson's blocks (``model`` has ``student``,
        ``teacher`` and ``update_teacher()``; ``loss_fn(student_outputs,
        teacher_outputs)``). Returns this step's time per block (seconds, keys
        ``<block>_time``), which waits for the step's GPU work."""
        with self.profile_block("data_movement"):
            crops = [c.to(self.profiler.device, non_blocking=True) for c in crops]
        with self.profile_block("student_forward"):
            student_outputs = [model.student(c) for c in crops]
        with self.profile_block("teacher_forward"), torch.no_grad():
            teacher_outputs = [model.teacher(c) for c in crops]
        with self.profile_block("loss_computation"):
            loss = loss_fn(student_outputs, teacher_outputs)
        with self.profile_block("backward_pass"):
            loss.backward()
        with self.profile_block("optimizer_step"):
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        with self.profile_block("teacher_update"):
            model.update_teacher()
        step = self.profiler.current_step()
        self.profiler.step(int(crops[0].shape[0]) if crops else 0)
        # Only the ranges finished since the last call: reading all of them
        # each step would cost O(steps) per step.
        if self._ranges_read > self.profiler.range_count():  # cleared meanwhile
            self._ranges_read = 0
        new = self.profiler.ranges(self._ranges_read)
        self._ranges_read += len(new)
        return {f"{r['name']}_time": _seconds(r) for r in new if r["step"] == step}

    def get_summary_stats(self) -> dict[str, dict[str, float]]:
        """Per block, in seconds: the lesson's mean/std/min/max/total_time and
        count, plus median_time, p95_time, host_mean_time and share_of_step."""
        return self._summary(self.timings)

    def _summary(self, timings: dict[str, list[float]]) -> dict[str, dict[str, float]]:
        native = self.profiler.stats()
        stats = {}
        for name, times in timings.items():
            t = np.asarray(times)
            stats[name] = {
                "mean_time": float(t.mean()),
                "std_time": float(t.std()),
                "min_time": float(t.min()),
                "max_time": float(t.max()),
                "total_time": float(t.sum()),
                "count": int(t.size),
                "median_time": float(np.median(t)),
                "p95_time": float(np.percentile(t, 95)),
                "host_mean_time": native[name]["host"]["mean"] / 1e3,
                "share_of_step": native[name]["share_of_step"],
            }
        return stats

    def plot_performance_analysis(self, path=None):
        """The lesson's 2x2 figure: time per block, memory per block, time over
        steps, and consistency (1 / (1 + coefficient of variation)). Saved to
        ``path`` (PNG) when given; returns the matplotlib figure."""

        timings = self.timings
        names = list(timings)
        fig = Figure(figsize=(15, 10))
        axes = fig.subplots(2, 2)
        fig.suptitle("DINO training performance" + (" (GPU time)" if self._gpu else " (host time)"))
        axes[0, 0].bar(names, [np.mean(timings[n]) * 1e3 for n in names])
        axes[0, 0].set_title("Mean time per block")
        axes[0, 0].set_ylabel("ms")
        memory = self.memory_usage
        axes[0, 1].set_title("Mean memory change per block")
        if memory:
            axes[0, 1].bar(list(memory), [np.mean(v) for v in memory.values()])
            axes[0, 1].set_ylabel("MB")
        else:
            axes[0, 1].text(0.5, 0.5, "not tracked (track_memory=False)", ha="center", va="center")
            axes[0, 1].set_axis_off()
        for name in names:
            axes[1, 0].plot(np.asarray(timings[name]) * 1e3, label=name)
        axes[1, 0].set_title("Time per call")
        axes[1, 0].set_xlabel("call")
        axes[1, 0].set_ylabel("ms")
        if names:
            axes[1, 0].legend(fontsize=8)
        consistency = [
            1 / (1 + np.std(timings[n]) / np.mean(timings[n])) if np.mean(timings[n]) > 0 else 1.0
            for n in names
        ]
        axes[1, 1].bar(names, consistency)
        axes[1, 1].set_title("Consistency (higher is steadier)")
        axes[1, 1].set_ylim(0, 1)
        for ax in (axes[0, 0], axes[0, 1], axes[1, 1]):
            ax.tick_params(axis="x", rotation=45)
        fig.tight_layout()
        if path is not None:
            fig.savefig(path, dpi=100)
        return fig

    def export_profile_data(self, filename) -> Path:
        """JSON with the lesson's ``timings``, ``memory_usage`` and
        ``summary_stats``, plus ``steps`` and ``throughput`` (samples/s)."""
        path = Path(filename)
        timings = self.timings
        data = {
            "timings": timings,
            "memory_usage": self.memory_usage,
            "summary_stats": self._summary(timings),
            "steps": self.profiler.steps(),
            "throughput": self.profiler.throughput(),
        }
        path.write_text(json.dumps(data, indent=2))
        return path

    def export_chrome_trace(self, path) -> Path:
        return self.profiler.export_chrome_trace(path)


class PerformanceMonitor:
    """Flags throughput degradation (the lesson's rule: the mean of the last
    ``window`` values below ``threshold`` x the mean of the first ``window``).

    ``log_performance(throughput, memory_usage)`` returns an alert dict when
    degraded (and logs a warning), else None; alerts are kept in ``alerts``.
    """

    def __init__(
        self, window: int = 10, threshold: float = 0.8, min_history: int = 100, log_alerts=True
    ) -> None:
        if window < 1 or not 0 < threshold <= 1 or min_history < 2 * window:
            raise ValueError(
                "PerformanceMonitor: need window >= 1, 0 < threshold <= 1 and "
                f"min_history >= 2 * window, got {window}, {threshold}, {min_history}"
            )
        self.window, self.threshold, self.min_history = window, threshold, min_history
        self.log_alerts = log_alerts  # False: the caller reports alerts (health.py)
        self.throughput_history: list[float] = []
        self.memory_history: list[float] = []
        self.alerts: list[dict] = []

    def log_performance(self, throughput: float, memory_usage: float) -> dict | None:
        self.throughput_history.append(float(throughput))
        self.memory_history.append(float(memory_usage))
        if len(self.throughput_history) <= self.min_history:
            return None
        recent = float(np.mean(self.throughput_history[-self.window :]))
        baseline = float(np.mean(self.throughput_history[: self.window]))
        if recent >= self.threshold * baseline:
            return None
        alert = {
            "step": len(self.throughput_history) - 1,
            "recent_throughput": recent,
            "baseline_throughput": baseline,
            "ratio": recent / baseline,
            "memory_usage": float(memory_usage),
        }
        self.alerts.append(alert)
        if not self.log_alerts:
            return alert
        log.warning(
            "throughput degraded to %.0f%% of the baseline (%.1f vs %.1f)",
            100 * alert["ratio"],
            recent,
            baseline,
        )
        return alert


class PerformanceProfiler:
    """The distributed-training guide's profiler (``profile(name)``,
    ``record_gpu_memory()``, ``print_summary()``) over the same native core."""

    def __init__(self, device=None) -> None:
        self.profiler = Profiler(device)
        self.gpu_memory: list[float] = []

    def profile(self, name: str):
        return self.profiler.range(name)

    def record_gpu_memory(self) -> None:
        """Appends the allocated GPU memory (GiB); nothing without a GPU."""
        if self.profiler.device.type == "cuda":
            self.gpu_memory.append(torch.cuda.memory_allocated(self.profiler.device) / 2**30)

    def summary(self) -> dict:
        return self.profiler.stats()

    def print_summary(self) -> None:
        stats = self.summary()
        total = sum(s["host"]["total"] for s in stats.values()) or 1.0
        print(f"{'range':<24}{'calls':>7}{'mean ms':>10}{'p95 ms':>10}{'gpu ms':>10}{'share':>8}")
        for name, s in sorted(stats.items(), key=lambda kv: -kv[1]["host"]["total"]):
            host, device = s["host"], s["device"]
            share = s["share_of_step"] or host["total"] / total
            gpu = f"{device['mean']:10.3f}" if device else f"{'-':>10}"
            print(
                f"{name:<24}{host['count']:>7}{host['mean']:>10.3f}{host['p95']:>10.3f}{gpu}{share:>8.1%}"
            )
        if self.gpu_memory:
            print(f"GPU memory allocated: max {max(self.gpu_memory):.2f} GiB")


class TrainingProfiler:
    """``torch.profiler`` over a few training steps, with a schedule (skip
    ``wait`` steps, warm up ``warmup``, record ``active``) and a trace handler:
    ``"tensorboard"`` (view with TensorBoard's profiler plugin) or ``"chrome"``
    (one trace file per cycle, for Perfetto / chrome://tracing), in ``log_dir``.
    The kernel-level view, for when the ranges of :class:`Profiler` point at a
    block worth opening up."""

    def __init__(
        self,
        log_dir="./logs",
        wait: int = 2,
        warmup: int = 2,
        active: int = 6,
        repeat: int = 1,
        handler: str = "tensorboard",
        record_shapes: bool = False,
        profile_memory: bool = False,
        with_stack: bool = False,
    ) -> None:
        if handler not in ("tensorboard", "chrome"):
            raise ValueError(
                f"TrainingProfiler: handler must be 'tensorboard' or 'chrome', got {handler!r}"
            )
        self.log_dir = Path(log_dir)
        self.schedule = torch.profiler.schedule(
            wait=wait, warmup=warmup, active=active, repeat=repeat
        )
        self.handler = handler
        self.options = dict(
            record_shapes=record_shapes, profile_memory=profile_memory, with_stack=with_stack
        )
        self.steps_needed = (wait + warmup + active) * max(repeat, 1)

    def _on_trace_ready(self):
        self.log_dir.mkdir(parents=True, exist_ok=True)
        if self.handler == "tensorboard":
            return torch.profiler.tensorboard_trace_handler(str(self.log_dir))
        return lambda prof: prof.export_chrome_trace(
            str(self.log_dir / f"trace_step{prof.step_num}.json")
        )

    def profile_training(self, model, dataloader, steps: int | None = None, step_fn=None):
        """Runs ``step_fn(batch)`` (default: ``model.training_step(batch).backward()``,
        as in the seed material) for ``steps`` batches (default: what the schedule
        needs) under the profiler; returns the ``torch.profiler.profile`` object
        (``prof.key_averages().table(...)`` summarises it)."""
        if step_fn is None:

            def step_fn(batch):
                model.training_step(batch).backward()

        activities = [torch.profiler.ProfilerActivity.CPU]
        if torch.cuda.is_available():
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        steps = self.steps_needed if steps is None else steps
        with torch.profiler.profile(
            activities=activities,
            schedule=self.schedule,
            on_trace_ready=self._on_trace_ready(),
            **self.options,
        ) as prof:
            for i, batch in enumerate(dataloader):
                if i >= steps:
                    break
                step_fn(batch)
                prof.step()
        return prof
