"""Training health monitoring for DINO: collapse, gradients, throughput, NaN.

DINO fails in a few well-known ways (Caron et al. 2021, section 5.3 and
figure 7): the teacher's output collapses to the uniform distribution (its
entropy reaches ``log(out_dim)``), or one prototype dominates (every row puts
its mass on the same dimension, so even the batch-mean distribution has low
entropy), or the backbone maps every image to the same feature. Besides
these, gradients explode, throughput drops, and a loss turns NaN.

:class:`TrainingHealthMonitor` watches all of these. :meth:`~TrainingHealthMonitor.observe`
is called every step (or at a cadence) and works on the tensors' device without
any host synchronisation: it only launches a few small kernels and adds the
results to running device sums. At logging intervals,
:meth:`~TrainingHealthMonitor.summary` reads the window's averages with one
device-to-host copy and :meth:`~TrainingHealthMonitor.check_training_health`
(the lesson's method) turns them into :class:`HealthAlert` objects, logged
through the ``dino_opt.observe.health`` logger.

The metrics, for teacher logits ``T`` [N, K] (the global views), student
logits ``S`` [N, K] for the same views, center ``c`` and temperatures
``tau_t``, ``tau_s``:

- ``teacher_entropy``: ``mean_i H(p_i)`` in nats with
  ``p_i = softmax((T_i - c) / tau_t)``; ``teacher_entropy_normalised`` divides
  by ``log K`` (1: uniform);
- ``teacher_mean_entropy``: ``H(mean_i p_i)`` in nats, the entropy of the
  batch's average teacher distribution (``exp`` of it is the effective number
  of prototypes the batch uses; at most ``log min(N, K)`` for sharp rows);
- ``kl_teacher_student``: ``mean_i KL(p_i || q_i)`` with
  ``q_i = softmax(S_i / tau_s)``: row ``i`` of the teacher against row ``i`` of
  the student, i.e. the two networks' outputs for the same global crop
  (``student_logits`` may hold all crops, global views first as in DINO; then
  its first N rows are used);
- ``feature_std``: per-dimension standard deviation over the batch of the
  L2-normalised backbone features, averaged over dimensions (SimSiam's
  collapse indicator: 0 for a constant output, ``1/sqrt(D)`` for isotropic
  features); ``feature_std_normalised`` is ``feature_std * sqrt(D)``, which is
  comparable across backbones and is what the collapse threshold applies to.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import numbers
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from .profiler import PerformanceMonitor

__all__ = [
    "HealthAlert",
    "HealthThresholds",
    "CollapseError",
    "NonFiniteError",
    "TrainingHealthMonitor",
    "step_is_finite",
    "teacher_entropy_per_row",
]

log = logging.getLogger(__name__)

Severity = Literal["warning", "error"]


class NonFiniteError(FloatingPointError):
    """More consecutive non-finite steps (loss or gradient norm NaN/inf) than
    allowed. ``consecutive`` is how many, ``first_step`` and ``last_step`` the
    steps where that run of steps began and ended."""

    def __init__(
        self,
        consecutive: int,
        first_step: int | None,
        last_step: int | None,
        limit: int,
        note: str | None = None,
    ) -> None:
        self.consecutive = consecutive
        self.first_step = first_step
        self.last_step = last_step
        self.limit = limit
        where = f" at steps {first_step}-{last_step}" if last_step is not None else ""
        super().__init__(
            f"{consecutive} consecutive non-finite steps (loss or gradient norm NaN or inf)"
            f"{where}, more than max_nonfinite_steps={limit}: training "
            + (f"has diverged; {note}. " if note else "has diverged. ")
            + "Resume from the last good checkpoint with a lower learning rate "
            "(or a longer warm-up, or stronger gradient clipping); with fp16 autocast, use "
            "bf16 instead (hardware.precision=bf16), whose range does not overflow."
        )

    def __reduce__(self):
        return (type(self), (self.consecutive, self.first_step, self.last_step, self.limit))


class CollapseError(RuntimeError):
    """A collapse that rollbacks did not cure: ``alerts`` names the collapse
    alerts of the last logging interval."""

    def __init__(self, message: str, alerts: list[str] | tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.alerts = list(alerts)


@dataclass(frozen=True)
class HealthAlert:
    """One problem found by :meth:`TrainingHealthMonitor.check_training_health`.

    ``name`` is one of ``collapse_constant``, ``collapse_uniform``,
    ``collapse_dominant``, ``gradient_explosion``, ``throughput_degradation``,
    ``nonfinite``; ``value`` is the metric and ``threshold`` the limit it
    crossed."""

    name: str
    severity: Severity
    message: str
    value: float
    threshold: float

    def __str__(self) -> str:
        return f"[{self.severity}] {self.name}: {self.message}"


@dataclass
class HealthThresholds:
    """Limits of :meth:`TrainingHealthMonitor.check_training_health`.

    Attributes:
        feature_std_min: collapse to a constant when the per-dimension std of
            the L2-normalised features, in units of ``1/sqrt(D)``
            (``feature_std_normalised``: 1 for isotropic features, 0 for a
            constant output, about 0.5-0.7 for a randomly initialised ViT), is
            below this. Default 0.1, the lesson's limit.
        entropy_uniform_max: uniform collapse when the teacher's mean entropy
            divided by ``log(out_dim)`` exceeds this. Default 0.98.
        entropy_dominant_min: dominant-dimension collapse when the entropy of
            the batch-mean teacher distribution, in nats, is below this.
            Default 1.0 nats, i.e. the batch uses fewer than ``e`` (about 2.7)
            prototypes' worth of mass (one prototype holding 90% of it gives
            about 0.8 nats). A batch of N teacher rows cannot exceed
            ``log N`` with sharp rows, so use more than 2 rows.
        grad_norm_max: gradient explosion when the window's mean gradient norm
            (before clipping) exceeds this. Default 10.0, the lesson's limit.
        throughput_drop: throughput degradation when throughput falls below
            this fraction of the baseline. Default 0.8, the lesson's ratio;
            0 disables the check. Without a given baseline the rule is the
            profiler's :class:`~dino_opt.observe.PerformanceMonitor`: the
            mean of the last ``throughput_window`` logged values against the
            mean of the first ``throughput_window`` (after twice that many).
        throughput_window: logging intervals averaged on each side (default 3).
        max_nonfinite_steps: :class:`NonFiniteError` when more consecutive
            steps than this had a non-finite loss or gradient norm. Default 20,
            which leaves room for the skipped steps of fp16 loss scaling
            while it finds its scale.
    """

    feature_std_min: float = 0.1
    entropy_uniform_max: float = 0.98
    entropy_dominant_min: float = 1.0
    grad_norm_max: float = 10.0
    throughput_drop: float = 0.8
    throughput_window: int = 3
    max_nonfinite_steps: int = 20

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            kind = int if f.name in ("max_nonfinite_steps", "throughput_window") else numbers.Real
            if isinstance(value, bool) or not isinstance(value, kind):
                what = "an int" if kind is int else "a number"
                raise ValueError(f"HealthThresholds.{f.name} must be {what}, got {value!r}")
            if math.isnan(value) or value < 0:
                raise ValueError(f"HealthThresholds.{f.name} must be >= 0, got {value!r}")
        if self.entropy_uniform_max > 1:
            raise ValueError(
                f"HealthThresholds.entropy_uniform_max must be in [0, 1] (a fraction of "
                f"log(out_dim)), got {self.entropy_uniform_max!r}"
            )
        if self.throughput_window < 1:
            raise ValueError(
                f"HealthThresholds.throughput_window must be >= 1, got {self.throughput_window!r}"
            )
        if self.throughput_drop > 1:
            raise ValueError(
                f"HealthThresholds.throughput_drop must be in [0, 1] (a fraction of the "
                f"baseline), got {self.throughput_drop!r}"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> HealthThresholds:
        """The thresholds of a config's ``health`` section (a
        :class:`dino_opt.config.HealthConfig`; a whole ``Config`` also works)."""
        section = getattr(cfg, "health", cfg)
        names = [f.name for f in dataclasses.fields(cls)]
        missing = [n for n in names if not hasattr(section, n)]
        if missing:
            raise TypeError(
                f"HealthThresholds.from_config: {type(section).__name__} has no "
                f"{', '.join(missing)}; pass cfg.health"
            )
        return cls(**{n: getattr(section, n) for n in names})

    @classmethod
    def coerce(cls, thresholds: HealthThresholds | Mapping[str, Any] | None) -> HealthThresholds:
        """``None`` (the defaults), a dict of some of the fields, or thresholds."""
        if thresholds is None:
            return cls()
        if isinstance(thresholds, cls):
            return dataclasses.replace(thresholds)
        if isinstance(thresholds, Mapping):
            names = [f.name for f in dataclasses.fields(cls)]
            unknown = [k for k in thresholds if k not in names]
            if unknown:
                raise ValueError(
                    f"unknown health threshold(s) {', '.join(map(repr, unknown))}; "
                    f"known: {', '.join(names)}"
                )
            return cls(**thresholds)
        raise TypeError(
            f"thresholds must be HealthThresholds, a dict or None, got {type(thresholds).__name__}"
        )


def _as_tensor(x: Any, name: str) -> torch.Tensor:
    if isinstance(x, torch.Tensor):
        return x.detach()
    if isinstance(x, numbers.Real) and not isinstance(x, bool):
        return torch.full((), float(x), dtype=torch.float64)
    raise TypeError(f"{name} must be a tensor or a number, got {type(x).__name__}")


def step_is_finite(
    loss: torch.Tensor | float | None, grad_norm: torch.Tensor | float | None = None
) -> torch.Tensor:
    """A 0-d bool tensor on the inputs' device: the loss and the gradient norm
    are both finite (either may be None). No host synchronisation.

    To skip a bad optimizer step without a sync: a fused optimizer
    (``torch.optim.AdamW(..., fused=True)``) skips its update on the device
    when given ``optimizer.found_inf = (~ok).float()`` before ``step()`` (the
    mechanism ``GradScaler`` uses; delete the attribute afterwards). Other
    optimizers need the old parameters and states restored with
    ``torch.where(ok, new, old)`` (zeroing NaN gradients by multiplying does
    not work: NaN * 0 is NaN, and weight decay and momentum would still move).
    """
    if loss is None and grad_norm is None:
        raise ValueError("step_is_finite needs a loss or a grad_norm")
    parts = [
        _as_tensor(x, n) for x, n in ((loss, "loss"), (grad_norm, "grad_norm")) if x is not None
    ]
    device = next((p.device for p in parts if p.device.type != "cpu"), parts[0].device)
    ok = torch.ones((), dtype=torch.bool, device=device)
    for p in parts:
        ok = ok & torch.isfinite(p).all().to(device, non_blocking=True)
    return ok


# The averaged metrics, in the order of the device accumulators.
_METRICS = (
    "teacher_entropy",
    "teacher_entropy_normalised",
    "teacher_mean_entropy",
    "teacher_mean_entropy_normalised",
    "kl_teacher_student",
    "feature_std",
    "feature_std_normalised",
    "grad_norm",
    "loss",
    "throughput",
)
_INDEX = {name: i for i, name in enumerate(_METRICS)}
# The other accumulators (_state).
_GRAD_MAX, _NONFINITE, _STREAK, _STREAK_MAX, _STREAK_STEP = range(5)


def _logits(x: Any, name: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 2 or x.shape[0] < 1 or x.shape[1] < 2:
        raise ValueError(f"{name} must be [rows, out_dim] with out_dim >= 2, got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    return x.detach().float()


def _temperature(x: Any, name: str, device: torch.device) -> torch.Tensor | float:
    if isinstance(x, torch.Tensor):
        return x.detach().float().to(device, non_blocking=True)
    if isinstance(x, bool) or not isinstance(x, numbers.Real) or not x > 0:
        raise ValueError(f"{name} must be a number > 0 (or a tensor), got {x!r}")
    return float(x)


def teacher_entropy_per_row(
    teacher_logits: torch.Tensor, center: torch.Tensor, temp: float
) -> torch.Tensor:
    """Entropy (nats) of each row's centred, sharpened teacher distribution
    ``softmax((T - c) / temp)``, on the CPU (for a histogram per image)."""
    p = torch.softmax((teacher_logits.float() - center) / temp, dim=-1)
    return torch.special.entr(p).sum(-1).cpu()


_Reader = Callable[..., "float | None"]


def _reader(m: Mapping[str, Any]) -> _Reader:
    """``get(*names)``: the first of ``names`` that ``m`` holds (not None),
    as a float (numbers or tensors); None when it holds none."""

    def get(*names: str) -> float | None:
        for name in names:
            if name in m and m[name] is not None:
                value = m[name]
                return float(value.item() if isinstance(value, torch.Tensor) else value)
        return None

    return get


def _nonfinite_alert(get: _Reader) -> HealthAlert | None:
    """A non-finite loss or gradient norm now (error), or non-finite steps
    in the window (warning)."""
    loss = get("loss")
    grad = get("grad_norm")
    bad = [(n, v) for n, v in (("loss", loss), ("grad_norm", grad)) if v is not None]
    bad = [(n, v) for n, v in bad if not math.isfinite(v)]
    nonfinite = get("nonfinite_steps") or 0.0
    if not (bad or nonfinite > 0):
        return None
    what = ", ".join(f"{n} is {v}" for n, v in bad) or (
        f"{nonfinite:g} step(s) with a non-finite loss or gradient norm in the window"
    )
    return HealthAlert(
        "nonfinite",
        "error" if bad else "warning",
        f"{what}; such steps must be skipped (see step_is_finite)",
        float(nonfinite) if not bad else bad[0][1],
        0.0,
    )


def _collapse_alerts(get: _Reader, th: HealthThresholds) -> list[HealthAlert]:
    """DINO's three collapses: a constant feature, a uniform teacher, one
    dominant dimension."""
    alerts = []
    diversity = get("feature_std_normalised", "feature_diversity")
    if diversity is None:
        raw, dim = get("feature_std"), get("feature_dim")
        diversity = raw * math.sqrt(dim) if raw is not None and dim is not None else raw
    if diversity is not None and diversity < th.feature_std_min:
        alerts.append(
            HealthAlert(
                "collapse_constant",
                "error",
                f"mode collapse: feature diversity (per-dimension std of the normalised "
                f"features, x sqrt(dim)) is {diversity:.4g} < {th.feature_std_min:g}; the "
                "backbone maps all images to nearly the same feature",
                diversity,
                th.feature_std_min,
            )
        )
    entropy = get("teacher_entropy_normalised")
    if entropy is not None and entropy > th.entropy_uniform_max:
        alerts.append(
            HealthAlert(
                "collapse_uniform",
                "error",
                f"uniform collapse: teacher entropy is {entropy:.4g} of log(out_dim) > "
                f"{th.entropy_uniform_max:g}; the teacher's output is nearly uniform (too "
                "little sharpening: lower the teacher temperature)",
                entropy,
                th.entropy_uniform_max,
            )
        )
    mean_entropy = get("teacher_mean_entropy")
    if mean_entropy is not None and mean_entropy < th.entropy_dominant_min:
        alerts.append(
            HealthAlert(
                "collapse_dominant",
                "error",
                f"dominant-dimension collapse: the batch-mean teacher distribution has entropy "
                f"{mean_entropy:.4g} nats < {th.entropy_dominant_min:g} (about "
                f"{math.exp(mean_entropy):.3g} prototypes in use); check the centering "
                "(center_momentum) and the teacher temperature",
                mean_entropy,
                th.entropy_dominant_min,
            )
        )
    return alerts


def _gradient_alert(get: _Reader, th: HealthThresholds) -> HealthAlert | None:
    grad = get("grad_norm")
    if grad is None or not (math.isfinite(grad) and grad > th.grad_norm_max):
        return None
    return HealthAlert(
        "gradient_explosion",
        "warning",
        f"gradient explosion: gradient norm {grad:.4g} > {th.grad_norm_max:g}; lower the "
        "learning rate or clip gradients (optim.clip_grad)",
        grad,
        th.grad_norm_max,
    )


def _streak_error(get: _Reader, th: HealthThresholds) -> NonFiniteError | None:
    """The error of a non-finite streak longer than ``max_nonfinite_steps``."""
    streak = get("nonfinite_streak_max", "nonfinite_streak")
    if streak is None or not streak > th.max_nonfinite_steps:
        return None
    last = get("nonfinite_streak_step")
    last = int(last) if last is not None and last >= 0 else None
    first = last - int(streak) + 1 if last is not None else None
    return NonFiniteError(int(streak), first, last, th.max_nonfinite_steps)


class TrainingHealthMonitor:
    """DINO training health: the lesson's ``TrainingHealthMonitor``, without
    host synchronisation in the training step.

    Args:
        thresholds: :class:`HealthThresholds`, a dict of some of its fields, or
            None (the defaults); see :meth:`HealthThresholds.from_config`.
        max_nonfinite_steps: overrides ``thresholds.max_nonfinite_steps``.
        throughput_baseline: images/s that throughput is compared with; None:
            the first throughput that :meth:`check_training_health` sees (so
            skip warm-up steps, e.g. torch.compile, before reporting it).

    Typical use::

        monitor = TrainingHealthMonitor(HealthThresholds.from_config(cfg))
        for step, batch in enumerate(loader):
            ...
            monitor.observe(teacher_logits=t, student_logits=s[: len(t)],
                            teacher_temp=temp, center=loss_fn.center,
                            features=backbone_cls, grad_norm=gn, loss=loss, step=step)
            if step % log_every == 0:
                alerts = monitor.check_training_health()  # may raise NonFiniteError

    Counting of non-finite steps: every :meth:`observe` with a ``loss`` or a
    ``grad_norm`` records one step (non-finite if either is NaN or inf), and so
    does every :meth:`record_nonfinite`; use one of the two per step. The
    current run of consecutive non-finite steps carries over between windows.
    """

    def __init__(
        self,
        thresholds: HealthThresholds | Mapping[str, Any] | None = None,
        *,
        max_nonfinite_steps: int | None = None,
        throughput_baseline: float | None = None,
    ) -> None:
        self.thresholds = HealthThresholds.coerce(thresholds)
        if max_nonfinite_steps is not None:
            self.thresholds = dataclasses.replace(
                self.thresholds, max_nonfinite_steps=max_nonfinite_steps
            )
        if throughput_baseline is not None and not (
            isinstance(throughput_baseline, numbers.Real) and throughput_baseline > 0
        ):
            raise ValueError(f"throughput_baseline must be > 0, got {throughput_baseline!r}")
        self.throughput_baseline = throughput_baseline
        self._performance: PerformanceMonitor | None = None  # when no baseline is given
        self.last_alerts: list[HealthAlert] = []
        self._device: torch.device | None = None
        self._sum: torch.Tensor | None = None  # [len(_METRICS)]
        self._cnt: torch.Tensor | None = None  # [len(_METRICS)]
        self._state: torch.Tensor | None = None  # [5], see _GRAD_MAX...
        self._index_cache: dict[tuple[str, ...], torch.Tensor] = {}
        self._step = -1  # the last step recorded
        self._observations = 0  # observe() calls in the window

    @property
    def max_nonfinite_steps(self) -> int:
        return self.thresholds.max_nonfinite_steps

    # ------------------------------------------------------------ accumulators

    def _dtype(self) -> torch.dtype:
        assert self._device is not None
        return torch.float32 if self._device.type == "mps" else torch.float64

    def _use_device(self, tensors: list[torch.Tensor]) -> None:
        """Puts the accumulators on the first accelerator among ``tensors``
        (they start on the CPU when only host values were seen)."""
        device = next((t.device for t in tensors if t.device.type != "cpu"), None)
        if self._device is None:
            self._device = device or torch.device("cpu")
            dtype = self._dtype()
            self._sum = torch.zeros(len(_METRICS), dtype=dtype, device=self._device)
            self._cnt = torch.zeros(len(_METRICS), dtype=dtype, device=self._device)
            self._state = torch.zeros(5, dtype=dtype, device=self._device)
            self._state[_GRAD_MAX] = -math.inf
            self._state[_STREAK_STEP] = -1
        elif device is not None and device != self._device:
            if self._device.type != "cpu":
                raise ValueError(
                    f"TrainingHealthMonitor: its sums are on {self._device}, got a tensor on "
                    f"{device}; use one monitor per device"
                )
            # host -> device copies of our own tensors: no synchronisation
            self._device = device
            dtype = self._dtype()
            self._sum = self._sum.to(device, dtype, non_blocking=True)
            self._cnt = self._cnt.to(device, dtype, non_blocking=True)
            self._state = self._state.to(device, dtype, non_blocking=True)
            self._index_cache.clear()

    def _put(self, x: torch.Tensor) -> torch.Tensor:
        """A value on the accumulators' device and dtype (host to device only)."""
        return x.to(self._device, self._dtype(), non_blocking=True)

    def _add(self, values: dict[str, torch.Tensor]) -> None:
        names = tuple(values)
        index = self._index_cache.get(names)
        if index is None:
            # built on the host, copied without waiting (a blocking copy would sync)
            index = torch.tensor([_INDEX[n] for n in names])
            index = index.to(self._device, non_blocking=True)
            self._index_cache[names] = index
        v = torch.stack([self._put(values[n]).reshape(()) for n in names])
        finite = torch.isfinite(v)
        self._sum.index_add_(0, index, torch.where(finite, v, torch.zeros_like(v)))
        self._cnt.index_add_(0, index, finite.to(v.dtype))

    def _record_steps(self, bad: torch.Tensor, step: int | None) -> None:
        """``bad``: how many non-finite steps just now (0: a finite step, which
        ends the current run)."""
        self._step = self._step + 1 if step is None else int(step)
        bad = self._put(bad).reshape(())
        s = self._state
        streak = (s[_STREAK] + bad) * (bad > 0)
        longer = streak > s[_STREAK_MAX]
        s[_NONFINITE] += bad
        s[_STREAK_STEP] = torch.where(longer, float(self._step), s[_STREAK_STEP])
        s[_STREAK_MAX] = torch.maximum(s[_STREAK_MAX], streak)
        s[_STREAK] = streak

    # ------------------------------------------------------------ per step

    def observe(
        self,
        *,
        teacher_logits: torch.Tensor | None = None,
        student_logits: torch.Tensor | None = None,
        teacher_temp: float | torch.Tensor | None = None,
        student_temp: float | torch.Tensor = 0.1,
        center: torch.Tensor | None = None,
        features: torch.Tensor | None = None,
        grad_norm: torch.Tensor | float | None = None,
        loss: torch.Tensor | float | None = None,
        throughput: torch.Tensor | float | None = None,
        step: int | None = None,
    ) -> None:
        """Adds one step's metrics to the window; no host synchronisation.

        Args:
            teacher_logits: the teacher's head output for the global views,
                [N, K] (N = B * n_global); needs ``teacher_temp``.
            student_logits: the student's head output for the same global
                views, row for row [N, K] (or all crops, global views first:
                its first N rows are used). Gives ``kl_teacher_student``.
            teacher_temp, student_temp: the loss's temperatures.
            center: the loss's center, [K] or [1, K]; None: no centering.
            features: backbone features [B, D] (e.g. the CLS token), B >= 2.
            grad_norm: the global gradient norm before clipping.
            loss: the step's loss.
            throughput: images per second (the lesson's metric).
            step: the training step (default: one more than the last).

        Each argument is optional; a metric is averaged over the steps that
        gave it, and non-finite values are counted, not averaged.
        """
        given = [
            x
            for x in (teacher_logits, student_logits, features, grad_norm, loss, throughput, center)
            if isinstance(x, torch.Tensor)
        ]
        values: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            if teacher_logits is not None:
                values.update(
                    self._teacher_metrics(
                        teacher_logits, student_logits, teacher_temp, student_temp, center
                    )
                )
            elif student_logits is not None:
                raise ValueError(
                    "student_logits needs teacher_logits (the KL is teacher || student)"
                )
            if features is not None:
                values.update(self._feature_metrics(features))
            grad = _as_tensor(grad_norm, "grad_norm") if grad_norm is not None else None
            lossv = _as_tensor(loss, "loss") if loss is not None else None
            for name, x in (("grad_norm", grad), ("loss", lossv)):
                if x is not None and x.numel() != 1:
                    raise ValueError(f"{name} must be a scalar, got shape {tuple(x.shape)}")
            if grad is not None:
                values["grad_norm"] = grad
            if lossv is not None:
                values["loss"] = lossv
            if throughput is not None:
                values["throughput"] = _as_tensor(throughput, "throughput")
            self._use_device(given)
            if values:
                self._add(values)
            if grad is not None:
                g = self._put(grad).reshape(())
                g = torch.where(torch.isfinite(g), g, torch.full_like(g, -math.inf))
                self._state[_GRAD_MAX] = torch.maximum(self._state[_GRAD_MAX], g)
            if grad is not None or lossv is not None:
                ok = step_is_finite(lossv, grad)
                self._record_steps((~self._put_bool(ok)).to(self._dtype()), step)
        self._observations += 1

    def _put_bool(self, x: torch.Tensor) -> torch.Tensor:
        return x.to(self._device, non_blocking=True)

    def _teacher_metrics(self, teacher_logits, student_logits, teacher_temp, student_temp, center):
        t = _logits(teacher_logits, "teacher_logits")
        n, k = t.shape
        if teacher_temp is None:
            raise ValueError("teacher_logits needs teacher_temp (the loss's teacher temperature)")
        temp_t = _temperature(teacher_temp, "teacher_temp", t.device)
        if center is not None:
            if not isinstance(center, torch.Tensor) or center.shape[-1] != k or center.numel() != k:
                shape = tuple(center.shape) if isinstance(center, torch.Tensor) else center
                raise ValueError(f"center must be [{k}] or [1, {k}] like the logits, got {shape}")
            t = t - center.detach().float().reshape(1, k).to(t.device, non_blocking=True)
        logp = F.log_softmax(t / temp_t, dim=-1)
        p = logp.exp()
        entropy = torch.special.entr(p).sum(-1).mean()
        mean_entropy = torch.special.entr(p.mean(0)).sum()
        log_k = math.log(k)
        out = {
            "teacher_entropy": entropy,
            "teacher_entropy_normalised": entropy / log_k,
            "teacher_mean_entropy": mean_entropy,
            "teacher_mean_entropy_normalised": mean_entropy / log_k,
        }
        if student_logits is not None:
            s = _logits(student_logits, "student_logits")
            rows_ok = s.shape[0] == n or (s.shape[0] > n and s.shape[0] % n == 0)
            if s.shape[1] != k or not rows_ok:
                raise ValueError(
                    f"student_logits must be [{n}, {k}] like teacher_logits (or all crops, "
                    f"[multiple of {n}, {k}], global views first), got {tuple(s.shape)}"
                )
            temp_s = _temperature(student_temp, "student_temp", s.device)
            logq = F.log_softmax(s[:n].to(t.device, non_blocking=True) / temp_s, dim=-1)
            terms = torch.where(p > 0, p * (logp - logq), torch.zeros_like(p))
            out["kl_teacher_student"] = terms.sum(-1).mean()
        return out

    def _feature_metrics(self, features):
        if not isinstance(features, torch.Tensor):
            raise TypeError(f"features must be a tensor, got {type(features).__name__}")
        if features.dim() < 2 or features.shape[-1] < 1:
            raise ValueError(f"features must be [batch, dim], got {tuple(features.shape)}")
        f = features.detach().float().reshape(-1, features.shape[-1])
        if f.shape[0] < 2:
            raise ValueError(
                f"features need at least 2 rows for a std across the batch, got {f.shape[0]}"
            )
        std = F.normalize(f, dim=-1).std(dim=0, correction=0).mean()
        return {"feature_std": std, "feature_std_normalised": std * math.sqrt(f.shape[1])}

    def record_nonfinite(self, count: int | torch.Tensor = 1, *, step: int | None = None) -> None:
        """Records one step's outcome found by the caller: ``count``
        non-finite steps (e.g. ``(~ok).int()`` from :func:`step_is_finite`, a
        device tensor: no synchronisation); 0 is a finite step, which ends the
        current run of consecutive non-finite steps."""
        if isinstance(count, torch.Tensor):
            c = count.detach()
        elif isinstance(count, numbers.Integral) and not isinstance(count, bool) and count >= 0:
            c = torch.full((), float(count), dtype=torch.float64)
        else:
            raise ValueError(f"count must be an int >= 0 or a tensor, got {count!r}")
        self._use_device([c])
        with torch.no_grad():
            self._record_steps(c, step)

    def current_streak(self) -> int:
        """The current run of consecutive non-finite steps (one host sync;
        0 before any step). The window is left as it is."""
        return 0 if self._state is None else int(self._state[_STREAK].item())

    # ------------------------------------------------------------ at logging intervals

    def summary(self) -> dict[str, float]:
        """The window's averages (one device-to-host copy), then starts a new window.

        Keys: those of the metrics observed in the window (``teacher_entropy``,
        ``teacher_entropy_normalised``, ``teacher_mean_entropy``,
        ``teacher_mean_entropy_normalised``, ``kl_teacher_student``,
        ``feature_std``, ``feature_std_normalised``, ``grad_norm``,
        ``grad_norm_max``, ``loss``, ``throughput``; averages of their finite
        values), and always ``nonfinite_steps`` (in the window),
        ``nonfinite_streak`` (the current run of consecutive non-finite
        steps), ``nonfinite_streak_max`` (the longest run that grew in the
        window, counting its steps before the window), ``nonfinite_streak_step``
        (the step where that run reached its length; -1: none) and
        ``observations`` (observe calls in the window).
        """
        out: dict[str, float] = {}
        if self._sum is None:
            out.update(
                nonfinite_steps=0.0,
                nonfinite_streak=0.0,
                nonfinite_streak_max=0.0,
                nonfinite_streak_step=-1.0,
            )
        else:
            m = len(_METRICS)
            flat = torch.cat([self._sum, self._cnt, self._state]).tolist()  # the one sync
            sums, counts, state = flat[:m], flat[m : 2 * m], flat[2 * m :]
            for i, name in enumerate(_METRICS):
                if counts[i] > 0:
                    out[name] = sums[i] / counts[i]
                if name == "grad_norm" and state[_GRAD_MAX] > -math.inf:
                    out["grad_norm_max"] = state[_GRAD_MAX]
            out["nonfinite_steps"] = state[_NONFINITE]
            out["nonfinite_streak"] = state[_STREAK]
            out["nonfinite_streak_max"] = state[_STREAK_MAX]
            out["nonfinite_streak_step"] = state[_STREAK_STEP]
            # A new window. The current run of non-finite steps carries over: if
            # it goes on, its length counts its steps before the window.
            self._sum.zero_()
            self._cnt.zero_()
            self._state[_GRAD_MAX] = -math.inf
            self._state[_NONFINITE] = 0
            self._state[_STREAK_MAX] = 0
        out["observations"] = float(self._observations)
        self._observations = 0
        return out

    def check_training_health(self, metrics: Mapping[str, Any] | None = None) -> list[HealthAlert]:
        """The lesson's health check: alerts for what is wrong, logged through
        the ``dino_opt.observe.health`` logger (errors at ERROR, warnings at WARNING).

        ``metrics``: a dict with any of the keys of :meth:`summary` (values
        may be numbers or tensors) and the lesson's keys ``feature_diversity``
        (taken as ``feature_std_normalised``), ``grad_norm`` and
        ``throughput``; a missing key skips its check. None: this monitor's
        own :meth:`summary` (which starts a new window).

        Raises :class:`NonFiniteError` (after logging the alerts) when more
        than ``max_nonfinite_steps`` consecutive non-finite steps were seen.
        """
        m = self.summary() if metrics is None else dict(metrics)
        get, th = _reader(m), self.thresholds
        found = [
            _nonfinite_alert(get),
            *_collapse_alerts(get, th),
            _gradient_alert(get, th),
            self._throughput_alert(get),
        ]
        alerts = [a for a in found if a is not None]
        self._log_new(alerts)
        error = _streak_error(get, th)
        if error is not None:
            log.error("%s", error)
            raise error
        return alerts

    def _throughput_alert(self, get: _Reader) -> HealthAlert | None:
        """A drop of the throughput below ``throughput_drop`` x the
        baseline: the one given, else the first window's (the profiler's
        :class:`~dino_opt.observe.profiler.PerformanceMonitor`)."""
        th = self.thresholds
        throughput = get("throughput")
        if throughput is None or not (math.isfinite(throughput) and throughput > 0):
            return None
        if self.throughput_baseline is not None:  # the lesson's rule: a given baseline
            recent, baseline = throughput, self.throughput_baseline
            degraded = throughput < th.throughput_drop * baseline
        else:  # the profiler's PerformanceMonitor: first window vs last window
            if self._performance is None:
                w = th.throughput_window
                self._performance = PerformanceMonitor(
                    window=w,
                    threshold=th.throughput_drop or 1.0,
                    min_history=2 * w,
                    log_alerts=False,
                )
            found = self._performance.log_performance(throughput, 0.0)
            degraded = found is not None and th.throughput_drop > 0
            if found is not None:
                recent, baseline = found["recent_throughput"], found["baseline_throughput"]
        if not degraded:
            return None
        return HealthAlert(
            "throughput_degradation",
            "warning",
            f"performance degradation: throughput {recent:.4g} images/s < "
            f"{th.throughput_drop:g} x baseline {baseline:.4g}",
            recent,
            th.throughput_drop * baseline,
        )

    def _log_new(self, alerts: list[HealthAlert]) -> None:
        """Logs an alert when it appears, not at every interval while it lasts
        (the metrics file and TensorBoard record every interval)."""
        previous = {a.name for a in self.last_alerts}
        for a in alerts:
            if a.name not in previous:
                log.log(logging.ERROR if a.severity == "error" else logging.WARNING, "%s", a)
        self.last_alerts = alerts
