"""Post-training analysis of a ``dino-opt train`` run folder: convergence of
the loss, how the weights moved from checkpoint to checkpoint, throughput,
memory and time per phase.

::

    analyzer = DINOTrainingAnalyzer("runs/demo")        # or its checkpoints/ folder,
    analyzer = DINOTrainingAnalyzer(trainer.checkpoint_manager)  # or a CheckpointManager
    analyzer.analyze_convergence()          # dict: loss statistics, trend, plateau, verdict
    analyzer.analyze_model_evolution()      # one row per checkpoint: norms and drifts
    analyzer.generate_checkpoint_report()   # + checkpoint_report.json, model_evolution.png
    analyzer.generate_performance_report()  # + performance_report.json, training_curves.png
    print(format_report(analyzer.generate_report()))   # what `dino-opt report` prints

The run folder is the one ``CheckpointedDINOTrainer`` writes: ``metrics.jsonl``
(one row per logging interval), ``profile.json`` (time per phase),
``report.json`` and ``checkpoints/`` (a :class:`~dino_opt.checkpoint.CheckpointManager`
directory). Any of them may be missing, but not both the metrics and the
checkpoints. Without a ``metrics.jsonl`` next to the checkpoints, the metric
rows come from the ``history`` of the newest checkpoint that verifies.

Checkpoints are loaded one at a time, on the CPU, after their SHA-256 is
checked; one that fails is reported as skipped, with the reason, and the
analysis goes on. Nothing here writes into the checkpoint directory.
"""

from __future__ import annotations

import json
import math
import os
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from ..checkpoint import CheckpointManager
from .plots import MEMORY_KEYS, plot_training_curves, read_metrics, style_step_panel
from .report import format_report  # the text of generate_report(); also importable here
from .runfiles import RunFolder

__all__ = ["DINOTrainingAnalyzer", "format_report"]


VERDICTS = ("decreasing", "plateau", "diverging", "too short to tell")


# ------------------------------------------------------------------ helpers


def _finite(value: Any) -> float | None:
    """``value`` as a float when it is a finite number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    value = float(value)
    return value if math.isfinite(value) else None


def _row_step(row: Mapping[str, Any], index: int) -> int:
    """The row's step; a row without one counts as its position (1-based)."""
    step = _finite(row.get("step"))
    return int(step) if step is not None else index + 1


def _ratio(num: float, den: float) -> float | None:
    """``num / den``; 0 when both are 0, None when only ``den`` is (undefined)."""
    if den > 0:
        return num / den
    return 0.0 if num == 0 else None


def _read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics file. ``plots.read_metrics`` reads a clean file;
    a file with bad lines is read again line by line, skipping (with a
    warning naming the file and line) lines that are not a JSON object."""
    try:
        rows = read_metrics(path)
        if all(isinstance(r, dict) for r in rows):
            return rows
    except ValueError:  # a line that is not JSON (or not UTF-8)
        pass
    rows = []
    with open(path, "rb") as f:
        for n, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                row = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, json.JSONDecodeError) as e:
                warnings.warn(
                    f"{os.fspath(path)}:{n}: skipped, not a JSON line ({e})", stacklevel=4
                )
                continue
            if not isinstance(row, dict):
                warnings.warn(
                    f"{os.fspath(path)}:{n}: skipped, a JSON {type(row).__name__}, not an object",
                    stacklevel=4,
                )
                continue
            rows.append(row)
    return rows


def _read_json(path: Path) -> Any:
    """A JSON file's content; None (with a warning naming it) when it cannot be read."""
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        warnings.warn(f"cannot read {os.fspath(path)!r}: {e}; left out", stacklevel=3)
        return None


def _write_json(path: Path, data: Any) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=2) + "\n", encoding="utf-8")
    return path


def _float_tensors(state: Any) -> dict[str, torch.Tensor]:
    """The floating-point tensors of a model state dict (integer buffers such
    as BatchNorm's ``num_batches_tracked`` are left out)."""
    if not isinstance(state, Mapping):
        return {}
    return {
        k: v.detach()
        for k, v in state.items()
        if isinstance(k, str) and isinstance(v, torch.Tensor) and v.is_floating_point()
    }


def _module_of(name: str) -> str:
    """Top-level module of a parameter name: ``backbone.blocks.0.x`` -> ``backbone``."""
    return name.split(".", 1)[0]


# The sums below run in NumPy on views of the tensors: single-threaded,
# float64 and per tensor. torch's intra-op threads would gain little on these
# memory-bound reductions and slow down badly on a machine whose cores are
# busy with other work.


def _array(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.dtype not in (torch.float16, torch.float32, torch.float64):  # bfloat16 and the like
        t = t.to(torch.float32)
    return t.numpy()


def _sq(t: torch.Tensor) -> float:
    """Squared L2 norm in float64."""
    return float(np.square(_array(t), dtype=np.float64).sum())


def _sq_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Squared L2 norm of ``a - b`` in float64 (the difference too)."""
    return float(np.square(np.subtract(_array(a), _array(b), dtype=np.float64)).sum())


def _norms_by_module(tensors: Mapping[str, torch.Tensor]) -> dict[str, float]:
    """Squared L2 norm per top-level module (float64 sums)."""
    out: dict[str, float] = {}
    for name, t in tensors.items():
        m = _module_of(name)
        out[m] = out.get(m, 0.0) + _sq(t)
    return out


def _diff_by_module(
    a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]
) -> tuple[dict[str, float], dict[str, float], int]:
    """Over the names both hold with the same shape: squared L2 norm of
    ``a - b`` and of ``b`` per top-level module, and how many tensors were
    compared."""
    diff: dict[str, float] = {}
    ref: dict[str, float] = {}
    n = 0
    for name, ta in a.items():
        tb = b.get(name)
        if tb is None or tb.shape != ta.shape:
            continue
        m = _module_of(name)
        diff[m] = diff.get(m, 0.0) + _sq_diff(ta, tb)
        ref[m] = ref.get(m, 0.0) + _sq(tb)
        n += 1
    return diff, ref, n


def _percentile(values: Sequence[float], q: float) -> float:
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


def _trailing_mean(values: Sequence[float], k: int) -> list[float]:
    """Mean of each value and the up to ``k - 1`` before it."""
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= k:
            total -= values[i - k]
        out.append(total / min(i + 1, k))
    return out


# ----------------------------------------------------------------- analyzer


def _scan_rows(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """One pass over the logged rows: the finite losses and their steps,
    whether the last logged loss was finite (None: none logged), the
    non-finite losses and steps, and the alerts by name."""
    steps: list[int] = []
    losses: list[float] = []
    bad_rows, bad_steps_total, first_bad = 0, 0.0, None
    last_loss_finite = None
    alerts: dict[str, dict[str, int]] = {}
    for i, row in enumerate(rows):
        step = _row_step(row, i)
        bad = False
        if "loss" in row:
            value = _finite(row["loss"])
            last_loss_finite = value is not None
            if value is None:
                bad_rows += 1
                bad = True
            else:
                steps.append(step)
                losses.append(value)
        skipped = _finite(row.get("nonfinite_steps"))
        if skipped:
            bad_steps_total += skipped
            bad = True
        if bad and first_bad is None:
            first_bad = step
        names = row.get("alerts")
        for name in names if isinstance(names, list) else []:
            new = {"count": 0, "first_step": step, "last_step": step}
            entry = alerts.setdefault(str(name), new)
            entry["count"] += 1
            entry["last_step"] = step
    nonfinite = {
        "seen": first_bad is not None,
        "first_step": first_bad,
        "rows_with_nonfinite_loss": bad_rows,
        "nonfinite_steps": bad_steps_total,
    }
    return {
        "steps": steps,
        "losses": losses,
        "last_loss_finite": last_loss_finite,
        "nonfinite": nonfinite,
        "alerts": alerts,
    }


def _trend(steps: Sequence[int], losses: Sequence[float]) -> dict[str, Any] | None:
    """The least-squares slope of loss against step, per 1,000 steps, and
    the steps it spans; None with fewer than two distinct steps."""
    xs, ys = np.asarray(steps, np.float64), np.asarray(losses, np.float64)
    if len(xs) < 2 or not float(np.ptp(xs)) > 0:
        return None
    dx = xs - xs.mean()
    slope = float(dx @ (ys - ys.mean()) / (dx @ dx))
    return {
        "per_1k_steps": slope * 1000.0,
        "from_step": int(xs[0]),
        "to_step": int(xs[-1]),
        "points": len(xs),
    }


def _plateau(
    steps: Sequence[int],
    losses: Sequence[float],
    window: int | None,
    smoothing: int,
    threshold: float,
) -> tuple[dict[str, Any] | None, float | None]:
    """The plateau of the loss (see :meth:`DINOTrainingAnalyzer.analyze_convergence`)
    and how much the smoothed loss rose over its window; (None, None) with
    fewer than two points."""
    n = len(losses)
    if n < 2:
        return None, None
    w_used = min(window if window is not None else max(3, n // 4), n)
    smooth = _trailing_mean(losses, smoothing)
    start, end = smooth[n - w_used], smooth[-1]
    improvement = _ratio(start - end, abs(start))
    plateau = {
        "detected": improvement is not None and improvement < threshold,
        "relative_improvement": improvement,
        "window_points": w_used,
        "from_step": steps[n - w_used],
        "to_step": steps[-1],
        "threshold": threshold,
        "smoothing": smoothing,
    }
    return plateau, end - start


def _checkpoint_weights(
    manager: CheckpointManager, path: Path, row: dict[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """The student's and the teacher's floating-point weights of the
    checkpoint at ``path``, read on the CPU, and into its ``row`` whether it
    verified, its epoch and step as the state holds them and why it was
    saved; None (the row says why it was skipped) when it fails
    verification, cannot be loaded or holds no student weights."""
    reason = manager.verify_reason(path)
    row["verified"] = reason is None
    state = None
    if reason is None:
        try:
            state = manager.load(path, map_location="cpu", verify=False)
        except (ValueError, OSError) as e:
            reason = str(e)
    if state is not None and not _float_tensors(state.get("student")):
        reason = "it holds no student weights"
    if reason is not None:
        row.update(skipped=True, reason=reason)
        return None
    student = _float_tensors(state["student"])
    teacher = _float_tensors(state.get("teacher"))
    for key in ("epoch", "step"):
        value = state.get(key)
        if isinstance(value, int) and not isinstance(value, bool):
            row[key] = value
    if isinstance(state.get("reason"), str):
        row["saved_because"] = state["reason"]
    return student, teacher  # the optimizer state and the rest: not kept


def _add_distance(
    row: dict[str, Any],
    modules: dict[str, dict[str, float | None]],
    label: str,
    student: Mapping[str, torch.Tensor],
    ref: Mapping[str, torch.Tensor] | None,
) -> None:
    """``|student - ref| / |ref|`` as ``row[label]`` and per module in
    ``modules``, over the tensors both hold with the same shape; None
    without ``ref`` or where they share none."""
    if ref is None:
        row[label] = None
        for entry in modules.values():
            entry[label] = None
        return
    diff, base, _ = _diff_by_module(student, ref)
    row[label] = (
        _ratio(math.sqrt(sum(diff.values())), math.sqrt(sum(base.values()))) if diff else None
    )
    for m, entry in modules.items():
        entry[label] = _ratio(math.sqrt(diff[m]), math.sqrt(base[m])) if m in diff else None


class DINOTrainingAnalyzer:
    """Analyses a training run after (or while) it ran.

    ``source``: a run folder of ``dino-opt train``, its ``checkpoints/``
    folder, or a :class:`~dino_opt.checkpoint.CheckpointManager` (e.g.
    ``trainer.checkpoint_manager``). The run folder is the one holding
    ``metrics.jsonl``: the folder given, or the checkpoint directory's parent
    when it holds one. Raises ``FileNotFoundError`` naming the path when the
    folder does not exist, ``ValueError`` naming it when it is not a folder or
    holds neither metrics nor checkpoints.

    Attributes: ``run_dir`` (None when no metrics file was found next to the
    checkpoints), ``checkpoint_manager``, ``metrics_path`` (None when absent).
    """

    def __init__(self, source: str | os.PathLike | CheckpointManager):
        if isinstance(source, CheckpointManager):
            manager = source
            parent = manager.directory.parent
            run_dir = parent if RunFolder(parent).metrics.is_file() else None
            where = manager.directory
        else:
            path = Path(source)
            if not path.exists():
                raise FileNotFoundError(f"run folder {os.fspath(path)!r} does not exist")
            if not path.is_dir():
                raise ValueError(
                    f"{os.fspath(path)!r} is not a folder (give a run folder of "
                    "`dino-opt train` or its checkpoints/ folder)"
                )
            if RunFolder(path).is_run():
                run_dir = path
                manager = CheckpointManager(RunFolder(path).checkpoints, keep_last=None)
            else:  # a checkpoints/ folder
                manager = CheckpointManager(path, keep_last=None)
                parent = path.parent
                run_dir = parent if RunFolder(parent).metrics.is_file() else None
            where = path
        self.checkpoint_manager = manager
        self.run_dir = run_dir
        metrics = RunFolder(run_dir).metrics if run_dir is not None else None
        self.metrics_path = metrics if metrics is not None and metrics.is_file() else None
        if self.metrics_path is None and not manager.checkpoints():
            raise ValueError(
                f"{os.fspath(where)!r} holds no {RunFolder.METRICS} and no checkpoints "
                f"(looked for {os.fspath(manager.directory / 'checkpoint-*.pth')!r})"
            )
        self._rows: list[dict[str, Any]] | None = None
        self.metrics_source: str | None = None

    # ------------------------------------------------------------- inputs

    @property
    def default_output_dir(self) -> Path:
        """Where reports go by default: the run folder, else the checkpoint folder."""
        return self.run_dir if self.run_dir is not None else self.checkpoint_manager.directory

    @property
    def rows(self) -> list[dict[str, Any]]:
        """The metric rows: ``metrics.jsonl`` (bad lines skipped with a
        warning), else the ``history`` of the newest good checkpoint (read
        once, then cached)."""
        if self._rows is None:
            if self.metrics_path is not None:
                self._rows = _read_rows(self.metrics_path)
                self.metrics_source = os.fspath(self.metrics_path)
            else:
                self._rows = []
                latest = self.checkpoint_manager.load_latest()
                if latest is not None:
                    state, path = latest
                    history = state.get("history") or []
                    self._rows = [r for r in history if isinstance(r, dict)]
                    self.metrics_source = f"{os.fspath(path)} (history)"
                    del state
        return self._rows

    def _run_file(self, name: str) -> Any:
        if self.run_dir is None or not (self.run_dir / name).is_file():
            return None
        return _read_json(self.run_dir / name)

    # -------------------------------------------------------- convergence

    def analyze_convergence(
        self,
        window: int | None = None,
        threshold: float = 0.01,
        smoothing: int = 5,
        min_points: int = 5,
    ) -> dict[str, Any]:
        """How the loss of the logged rows went.

        * ``loss``: ``first``, ``last``, ``min`` (each ``{"step", "value"}``)
          over the finite losses; ``points``: how many.
        * ``trend``: least-squares slope of loss against step over the last
          half of the finite points, ``per_1k_steps``, and the steps it spans.
        * ``plateau``: the loss smoothed by a trailing mean over ``smoothing``
          rows; its relative improvement ``(start - end) / |start|`` over the
          last ``window`` finite points (default: a quarter of them, at least
          3); ``detected`` when it is below ``threshold`` (default 0.01, 1 %).
        * ``nonfinite``: whether a logged loss was NaN/inf (or the trainer
          counted ``nonfinite_steps``), the first step, the counts.
        * ``alerts``: the health alerts seen, ``{name: {"count", "first_step",
          "last_step"}}``.
        * ``verdict``: ``"diverging"`` when the last logged loss is not finite
          or the improvement is below ``-threshold``; ``"too short to tell"``
          with fewer than ``min_points`` finite losses; else ``"plateau"``
          when the plateau is detected, ``"decreasing"`` otherwise.
        """
        if smoothing < 1:
            raise ValueError(f"smoothing must be >= 1, got {smoothing}")
        if window is not None and window < 2:
            raise ValueError(f"window must be >= 2 rows, got {window}")
        if not threshold >= 0:
            raise ValueError(f"threshold must be >= 0, got {threshold}")
        rows = self.rows
        scan = _scan_rows(rows)
        steps, losses = scan["steps"], scan["losses"]
        n = len(losses)
        result: dict[str, Any] = {
            "rows": len(rows),
            "metrics": self.metrics_source,
            "loss": {"points": n, "first": None, "last": None, "min": None},
            "trend": _trend(steps[n // 2 :], losses[n // 2 :]),
            "plateau": None,
            "nonfinite": scan["nonfinite"],
            "alerts": scan["alerts"],
        }
        if n:
            i_min = min(range(n), key=losses.__getitem__)
            result["loss"].update(
                first={"step": steps[0], "value": losses[0]},
                last={"step": steps[-1], "value": losses[-1]},
                min={"step": steps[i_min], "value": losses[i_min]},
            )
        result["plateau"], rise = _plateau(steps, losses, window, smoothing, threshold)
        improvement = result["plateau"]["relative_improvement"] if n >= 2 else None
        if scan["last_loss_finite"] is False:
            verdict = "diverging"
        elif n < max(min_points, 2):
            verdict = "too short to tell"
        elif improvement is None:  # the smoothed loss started at 0 and moved
            verdict = "diverging" if rise > 0 else "decreasing"
        elif improvement < -threshold:
            verdict = "diverging"
        elif result["plateau"]["detected"]:
            verdict = "plateau"
        else:
            verdict = "decreasing"
        result["verdict"] = verdict
        return result

    # ---------------------------------------------------------- evolution

    def analyze_model_evolution(self) -> list[dict[str, Any]]:
        """One row per checkpoint, oldest to newest.

        Each: ``path``, ``epoch``, ``step``, ``milestone``, ``verified``,
        ``skipped`` (and ``reason`` when skipped: it failed verification or
        could not be loaded), and for a loaded one: ``student_norm`` (L2 norm
        of the student's floating-point weights), ``drift_from_previous``
        (``|w - w_prev| / |w_prev|``, against the previous checkpoint that
        loaded, ``previous_step``; None for the first), ``drift_from_first``
        (0 for the first that loaded),
        ``teacher_student_distance`` (``|w_student - w_teacher| / |w_teacher|``
        over the floating-point tensors both hold with the same shape; None
        without a teacher) and ``modules``: the same per top-level module
        (``backbone``, ``head``): ``norm``, ``drift_from_previous``,
        ``drift_from_first``, ``teacher_student_distance``.

        Checkpoints are read one at a time, on the CPU; only the first and the
        previous student weights are kept between them.
        """
        manager = self.checkpoint_manager
        rows: list[dict[str, Any]] = []
        first = previous = None
        previous_step = None
        with torch.no_grad():
            for record in manager.checkpoints():
                row: dict[str, Any] = {
                    "path": os.fspath(record.path),
                    "epoch": record.epoch,
                    "step": record.step,
                    "milestone": record.milestone,
                }
                loaded = _checkpoint_weights(manager, record.path, row)
                rows.append(row)
                if loaded is None:
                    continue
                student, teacher = loaded
                norms = _norms_by_module(student)
                modules: dict[str, dict[str, float | None]] = {
                    m: {"norm": math.sqrt(v)} for m, v in norms.items()
                }
                row.update(skipped=False, student_norm=math.sqrt(sum(norms.values())))
                if first is None:  # its drift from the first checkpoint is 0
                    first = student
                for label, ref in (
                    ("drift_from_previous", previous),
                    ("drift_from_first", first),
                    ("teacher_student_distance", teacher or None),
                ):
                    _add_distance(row, modules, label, student, ref)
                row["previous_step"] = previous_step
                row["modules"] = modules
                previous, previous_step = student, row["step"]
                del teacher
        return rows

    # ------------------------------------------------------------ reports

    def generate_checkpoint_report(self, output_dir: str | os.PathLike | None = None) -> dict:
        """The checkpoints (``path``, ``file``, ``epoch``, ``step``,
        ``milestone``, ``size`` in bytes, ``verified``, ``reason`` when not),
        the rows of :meth:`analyze_model_evolution` and a summary. Writes
        ``checkpoint_report.json`` and, when a checkpoint loaded,
        ``model_evolution.png`` into ``output_dir`` (default: the run folder)."""
        out = Path(output_dir) if output_dir is not None else self.default_output_dir
        evolution = self.analyze_model_evolution()
        by_path = {r["path"]: r for r in evolution}
        checkpoints = []
        for record in self.checkpoint_manager.checkpoints():
            row = by_path.get(os.fspath(record.path), {})
            size = record.size  # a sharded checkpoint's: all its files
            if size is None:
                try:
                    size = record.path.stat().st_size
                except OSError:
                    size = None
            entry = {
                "path": os.fspath(record.path),
                "file": record.path.name,
                "epoch": record.epoch,
                "step": record.step,
                "milestone": record.milestone,
                "size": size,
                "verified": bool(row.get("verified", False)),
            }
            if row.get("skipped"):
                entry["reason"] = row.get("reason")
            checkpoints.append(entry)
        loaded = [r for r in evolution if not r.get("skipped")]
        out.mkdir(parents=True, exist_ok=True)
        plot = _plot_evolution(loaded, RunFolder(out).model_evolution) if loaded else None
        report = {
            "run_dir": os.fspath(self.run_dir) if self.run_dir is not None else None,
            "checkpoint_dir": os.fspath(self.checkpoint_manager.directory),
            "summary": {
                "count": len(checkpoints),
                "verified": sum(c["verified"] for c in checkpoints),
                "skipped": sum(bool(r.get("skipped")) for r in evolution),
                "milestones": sum(c["milestone"] for c in checkpoints),
                "total_size": sum(c["size"] or 0 for c in checkpoints),
            },
            "checkpoints": checkpoints,
            "evolution": evolution,
            "plot": os.fspath(plot) if plot is not None else None,
        }
        report["report"] = os.fspath(_write_json(RunFolder(out).checkpoint_report, report))
        return report

    def generate_performance_report(self, output_dir: str | os.PathLike | None = None) -> dict:
        """Throughput (images/s over the logged rows: ``median``, ``p10``,
        ``p90``, ``mean``; the first row, the warm-up, left out when there
        are more than 2), the peak of each memory key (GiB: ``plots.MEMORY_KEYS``
        and any other ``gpu_memory_*_gb``), the time per
        phase from ``profile.json`` (None without one), the run's
        ``report.json`` (with the evaluation's numbers), the run's
        ``pictures`` and :meth:`analyze_convergence`. Writes
        ``performance_report.json`` and, when there are metric rows,
        ``training_curves.png`` (``plots.plot_training_curves``) into
        ``output_dir`` (default: the run folder)."""
        out = Path(output_dir) if output_dir is not None else self.default_output_dir
        rows = self.rows
        convergence = self.analyze_convergence()

        rates = [_finite(r.get("images_per_second")) for r in rows]
        warmup = len(rows) > 2
        used = [v for v in (rates[1:] if warmup else rates) if v is not None]
        throughput = None
        if used:
            throughput = {
                "median": _percentile(used, 50),
                "p10": _percentile(used, 10),
                "p90": _percentile(used, 90),
                "mean": float(np.mean(used)),
                "rows": len(used),
                "warmup_excluded": warmup,
            }

        memory_keys = list(MEMORY_KEYS)
        for r in rows:  # any other GPU memory key a row holds, after the known ones
            memory_keys += [
                k
                for k in r
                if k.startswith("gpu_memory_") and k.endswith("_gb") and k not in memory_keys
            ]
        peak_memory = {}
        for key in memory_keys:
            values = [v for v in (_finite(r.get(key)) for r in rows) if v is not None]
            if values:
                peak_memory[key] = max(values)

        profile = self._run_file(RunFolder.PROFILE)
        phases = None
        if isinstance(profile, dict) and isinstance(profile.get("phases"), dict):
            phases = {
                "clock": profile.get("clock"),
                "steps": profile.get("steps"),
                "images_per_second": profile.get("images_per_second"),
                "step_seconds": profile.get("step_seconds"),
                "phases": {
                    name: {k: p.get(k) for k in ("mean", "median", "p90", "total", "share_of_step")}
                    for name, p in profile["phases"].items()
                    if isinstance(p, dict)
                },
                "other_share_of_step": profile.get("other_share_of_step"),
            }
        run_report = self._run_file(RunFolder.REPORT)

        out.mkdir(parents=True, exist_ok=True)
        curves = plot_training_curves(rows, RunFolder(out).training_curves) if rows else None
        report = {
            "run_dir": os.fspath(self.run_dir) if self.run_dir is not None else None,
            "metrics": self.metrics_source,
            "rows": len(rows),
            "throughput": throughput,
            "peak_memory_gb": peak_memory,
            "profile": phases,
            "run_report": run_report if isinstance(run_report, dict) else None,
            "convergence": convergence,
            "plot": os.fspath(curves) if curves is not None else None,
            "pictures": self._pictures(),
        }
        report["report"] = os.fspath(_write_json(RunFolder(out).performance_report, report))
        return report

    def _pictures(self) -> list[str]:
        """The run's attention and PCA pictures (``pictures/*.png``)."""
        if self.run_dir is None or not RunFolder(self.run_dir).pictures.is_dir():
            return []
        return sorted(os.fspath(p) for p in RunFolder(self.run_dir).pictures.glob("*.png"))

    def generate_report(self, output_dir: str | os.PathLike | None = None) -> dict:
        """Both reports (and their files): ``{"run_dir", "checkpoints", "performance"}``,
        what :func:`format_report` prints."""
        return {
            "run_dir": os.fspath(self.run_dir) if self.run_dir is not None else None,
            "checkpoints": self.generate_checkpoint_report(output_dir),
            "performance": self.generate_performance_report(output_dir),
        }


# -------------------------------------------------------------------- plot


def _plot_evolution(rows: Sequence[Mapping[str, Any]], path: Path) -> Path:
    """PNG of the evolution rows against the step: the student's weight
    norm, its drift from the previous and the first checkpoint, the
    teacher-student distance, and each module's drift from the first."""

    fig = Figure(figsize=(12, 8), dpi=100)
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, 2).ravel()
    modules = sorted({m for r in rows for m in r.get("modules", {})})
    panels = [
        ("Student weight norm", "L2 norm", [("student_norm", "student", None)]),
        (
            "Student drift",
            "relative L2 change",
            [
                ("drift_from_previous", "from previous checkpoint", None),
                ("drift_from_first", "from first checkpoint", None),
            ],
        ),
        (
            "Teacher-student distance",
            "|student - teacher| / |teacher|",
            [("teacher_student_distance", "all", None)]
            + [("teacher_student_distance", m, m) for m in modules],
        ),
        (
            "Drift from first checkpoint by module",
            "relative L2 change",
            [("drift_from_first", m, m) for m in modules],
        ),
    ]
    for ax, (title, ylabel, series) in zip(axes, panels, strict=True):
        drawn = 0
        for key, label, module in series:
            xs, ys = [], []
            for r in rows:
                source = r.get("modules", {}).get(module, {}) if module else r
                y = _finite(source.get(key))
                if y is not None:
                    xs.append(r["step"])
                    ys.append(y)
            if xs:
                ax.plot(xs, ys, marker="o", markersize=3, linewidth=1.2, label=label)
                drawn += 1
        if not style_step_panel(ax, title, ylabel, drawn, legend=drawn > 1):
            continue
        ax.ticklabel_format(axis="y", useOffset=False)  # a norm that barely moves: no "+8.4e1"
    fig.suptitle(f"Model evolution over {len(rows)} checkpoints")
    fig.tight_layout()
    fig.savefig(path, format="png")
    return path
