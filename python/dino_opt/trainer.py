"""The memory-optimised DINO trainer.

``MemoryOptimizedDINOTrainer`` keeps the lesson's constructor
``(model, loss_fn, optimizer, config, device)`` and its two calls,
``train_step_optimized(crops, epoch)`` (forward and backward of one
micro-batch) and ``optimize_step()`` (clip, step, teacher update), but:

- AMP runs in bfloat16 where the device supports it (no GradScaler needed),
  float16 with a GradScaler otherwise, or float32;
- the teacher sees only the global crops, under ``no_grad``;
- crop batching bounds activation memory by running forward *and backward*
  per group of student views (the DINO loss is a sum of per-view terms once
  the teacher's targets are fixed), with no per-crop loop and no
  ``empty_cache()``;
- gradient clipping is one global norm over all parameters (``foreach``
  kernels, no host synchronisation), the last layer is frozen in the first
  ``freeze_last_layer`` epochs, and nothing calls ``.item()`` on the hot path:
  the returned loss is a device tensor.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .distributed import no_sync
from .ema import EMATeacher, cosine_scheduler

__all__ = [
    "DINOModel",
    "MemoryOptimizedDINOTrainer",
    "PROFILE_PHASES",
    "Schedules",
    "build_loss",
    "build_models",
    "data_roots",
    "evaluate_checkpoint",
    "load_checkpoint",
    "param_groups",
    "resolve_device",
    "resolve_precision",
    "run_training",
]


class DINOModel(nn.Module):
    """A student and its momentum teacher (both multi-crop wrappers).

    ``update_teacher(step)`` applies the fused EMA with the momentum of
    ``step`` from ``momentum_schedule`` (a float, a per-step sequence or a
    callable) and returns it.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, momentum_schedule=0.996):
        super().__init__()
        self.student = student
        self.teacher = teacher
        self._ema = EMATeacher(student, teacher, momentum_schedule)
        self.teacher_step = 0

    def update_teacher(self, step: int | None = None) -> float:
        step = self.teacher_step if step is None else step
        m = self._ema.update(step)
        self.teacher_step = step + 1
        return m


def param_groups(model: nn.Module) -> list[dict]:
    """DINO's two groups: weight decay on weights, none on biases and norms
    (every parameter with fewer than two dimensions)."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim <= 1 or name.endswith(".bias") else decay).append(p)
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


@dataclass
class Schedules:
    """Per-iteration schedules of DESIGN.md section 4 (DINO's main_dino.py)."""

    lr: np.ndarray
    weight_decay: np.ndarray
    momentum: np.ndarray

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
        """``base_lr`` is already scaled by the global batch (lr * batch / 256)."""
        return cls(
            lr=cosine_scheduler(base_lr, min_lr, epochs, niter_per_epoch, warmup_epochs),
            weight_decay=cosine_scheduler(weight_decay, weight_decay_end, epochs, niter_per_epoch),
            momentum=cosine_scheduler(momentum_teacher, 1.0, epochs, niter_per_epoch),
        )


def resolve_precision(precision: str, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for ``precision`` ('auto', 'bf16', 'fp16', 'fp32'),
    None for float32. 'auto' is bfloat16 on a GPU that supports it, float32
    elsewhere (bfloat16 autocast on a CPU is slower than float32 for most models)."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        return None
    choices = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": None}
    if precision not in choices:
        raise ValueError(f"precision must be one of auto, bf16, fp16, fp32, got {precision!r}")
    return choices[precision]


def _for_loss(x: torch.Tensor) -> torch.Tensor:
    # Half-precision outputs of autocast go to float32 for the loss; float32
    # and float64 models keep their dtype.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _last_layer_params(student: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in student.named_parameters() if "last_layer" in n]


class MemoryOptimizedDINOTrainer:
    """One DINO training step at a time, memory-lean; see the module docstring.

    ``config`` (a dict) takes the lesson's keys: ``use_amp`` (default True),
    ``gradient_checkpointing`` (False), ``crop_batch_size`` (student views per
    forward/backward group; None or >= the number of crops: one group),
    ``accumulation_steps`` (1), ``gradient_clip`` (3.0; 0 disables); and
    ``precision`` ('auto'; with ``use_amp=False``, float32),
    ``freeze_last_layer`` (epochs, 1), ``n_global`` (teacher views, 2).
    """

    def __init__(
        self,
        model: DINOModel,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: dict,
        device: torch.device,
    ):
        self.model = model
        self.loss_fn = loss_fn
        self.optimizer = optimizer
        self.config = dict(config)
        self.device = torch.device(device)
        use_amp = bool(self.config.get("use_amp", True))
        precision = self.config.get("precision", "auto") if use_amp else "fp32"
        self.amp_dtype = resolve_precision(precision, self.device)
        self.use_amp = self.amp_dtype is not None
        self.scaler = (
            torch.amp.GradScaler(self.device.type) if self.amp_dtype == torch.float16 else None
        )
        self.gradient_checkpointing = bool(self.config.get("gradient_checkpointing", False))
        self.crop_batch_size = self.config.get("crop_batch_size")
        self.accumulation_steps = int(self.config.get("accumulation_steps", 1))
        if self.accumulation_steps < 1:
            raise ValueError(f"accumulation_steps must be >= 1, got {self.accumulation_steps}")
        self.gradient_clip = float(self.config.get("gradient_clip", 3.0))
        self.freeze_last_layer = int(self.config.get("freeze_last_layer", 1))
        self.n_global = int(self.config.get("n_global", 2))
        if self.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        self._epoch = 0
        self._micro_steps = 0
        # Set capture_outputs before a step to keep its teacher and student
        # outputs of the global views and the teacher's backbone features in
        # ``captured`` (for health diagnostics at logging intervals).
        self.capture_outputs = False
        self.captured: dict[str, torch.Tensor] = {}
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_finite: torch.Tensor | None = None

    def _enable_gradient_checkpointing(self) -> None:
        backbone = getattr(self.model.student, "backbone", None)
        if backbone is None or not hasattr(backbone, "set_grad_checkpointing"):
            raise ValueError("gradient_checkpointing needs a ViT backbone (set_grad_checkpointing)")
        backbone.set_grad_checkpointing(True)

    def _autocast(self):
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.use_amp)

    def train_step_optimized(
        self, crops: Sequence[torch.Tensor], epoch: int
    ) -> tuple[torch.Tensor, dict]:
        """Forward and backward of one micro-batch of crops (global crops
        first). Gradients accumulate until :meth:`optimize_step`. Returns the
        loss as a detached device tensor (no host synchronisation) and metrics
        that are also device tensors."""
        crops = [c.to(self.device, non_blocking=True) for c in crops]
        self._epoch = epoch
        scale = 1.0 / self.accumulation_steps
        capture = self.capture_outputs
        self.captured = {}
        teacher = self.model.teacher
        with torch.no_grad(), self._autocast():
            if capture and hasattr(teacher, "forward_backbone"):
                features = teacher.forward_backbone(crops[: self.n_global])
                teacher_out = teacher.head(features)
                self.captured["features"] = features.detach()
            else:
                teacher_out = teacher(crops[: self.n_global])
        if capture:
            self.captured["teacher_logits"] = _for_loss(teacher_out).detach()
        groups = self._view_groups(len(crops))
        # With DDP, only the last backward of an optimizer step all-reduces.
        self._sync_last = self._micro_steps + 1 >= self.accumulation_steps
        if len(groups) == 1:
            with no_sync(self.model.student, skip=not self._sync_last):
                with self._autocast():
                    student_out = self.model.student(crops)
                loss = self.loss_fn(_for_loss(student_out), _for_loss(teacher_out), epoch)
                self._backward(loss * scale)
            if capture:
                rows = self.n_global * crops[0].shape[0]
                self.captured["student_logits"] = _for_loss(student_out[:rows]).detach()
        else:
            loss = self._grouped_backward(crops, _for_loss(teacher_out), epoch, groups, scale)
        self._micro_steps += 1
        return loss.detach(), {"loss": loss.detach()}

    def _view_groups(self, n_views: int) -> list[range]:
        size = self.crop_batch_size
        if not size or size >= n_views:
            return [range(n_views)]
        return [range(i, min(i + size, n_views)) for i in range(0, n_views, size)]

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def _grouped_backward(self, crops, teacher_out, epoch, groups, scale) -> torch.Tensor:
        """The loss as a sum of per-view terms given fixed teacher targets:
        each group of student views runs forward and backward on its own, so
        only one group's activations are alive at a time."""
        lf = self.loss_fn
        lf.apply_center_update()
        b = crops[0].shape[0]
        temp = lf._teacher_temps[epoch]
        targets = F.softmax((teacher_out - lf.center) / temp, dim=-1).chunk(self.n_global)
        total_targets = sum(targets)
        n_views = len(crops)
        n_terms = self.n_global * n_views - min(self.n_global, n_views)
        total = teacher_out.new_zeros(())
        for gi, group in enumerate(groups):
            sync = self._sync_last and gi == len(groups) - 1
            with no_sync(self.model.student, skip=not sync):
                group_loss = self._group_forward_backward(
                    crops, group, b, targets, total_targets, n_terms, scale
                )
            total = total + group_loss
        lf.update_center(teacher_out)
        if self.capture_outputs:
            self.captured["student_logits"] = torch.cat(self.captured.pop("student_parts"))
        return total

    def _group_forward_backward(self, crops, group, b, targets, total_targets, n_terms, scale):
        lf = self.loss_fn
        with self._autocast():
            out = _for_loss(self.model.student([crops[v] for v in group]))
        logp = F.log_softmax(out / lf.student_temp, dim=-1)
        if self.capture_outputs:  # the global views' rows, in view order
            globals_ = [i for i, v in enumerate(group) if v < self.n_global]
            rows = [out[i * b : (i + 1) * b].detach() for i in globals_]
            self.captured.setdefault("student_parts", []).extend(rows)
        group_loss = out.new_zeros(())
        for i, v in enumerate(group):
            p = total_targets - targets[v] if v < self.n_global else total_targets
            group_loss = group_loss - (p * logp[i * b : (i + 1) * b]).sum(-1).mean()
        group_loss = group_loss / n_terms
        self._backward(group_loss * scale)
        return group_loss.detach()

    def optimize_step(self) -> bool:
        """Unscale (fp16), freeze the last layer in the first epochs, clip the
        global gradient norm, step the optimizer, update the teacher. Returns
        False (and skips) until ``accumulation_steps`` micro-batches have
        accumulated. The gradient norm is kept as a device tensor in
        ``self.last_grad_norm``."""
        if self._micro_steps < self.accumulation_steps:
            return False
        self._micro_steps = 0
        student = self.model.student
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self._epoch < self.freeze_last_layer:
            for p in _last_layer_params(student):
                p.grad = None
        params = [p for p in student.parameters() if p.grad is not None]
        if self.gradient_clip > 0:
            self.last_grad_norm = torch.nn.utils.clip_grad_norm_(
                params, self.gradient_clip, foreach=True
            )
        else:
            self.last_grad_norm = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(p.grad) for p in params])
            )
        # A NaN/inf loss or gradient skips the update (counted by the caller
        # from last_step_finite). fp16: GradScaler skips it and lowers its
        # scale; a fused optimizer skips it on the device (found_inf, as
        # GradScaler drives it); any other optimizer needs one host sync.
        ok = torch.isfinite(self.last_grad_norm)
        self.last_step_finite = ok
        update_teacher = True
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        elif getattr(self.optimizer, "_step_supports_amp_scaling", False):
            self.optimizer.found_inf = (~ok).float()
            try:
                self.optimizer.step()
            finally:
                del self.optimizer.found_inf
        elif bool(ok):
            self.optimizer.step()
        else:
            update_teacher = False
        self.optimizer.zero_grad(set_to_none=True)
        if update_teacher:
            self.model.update_teacher()
        else:
            self.model.teacher_step += 1  # the momentum schedule stays aligned with the steps
        return True

    def set_schedules(self, schedules: Schedules, iteration: int) -> None:
        """Applies the lr and weight decay of ``iteration`` to the optimizer
        (weight decay only to the group that has it, as DINO does)."""
        for i, group in enumerate(self.optimizer.param_groups):
            group["lr"] = float(schedules.lr[iteration])
            if i == 0:
                group["weight_decay"] = float(schedules.weight_decay[iteration])


# ---------------------------------------------------------------- the training job


def resolve_device(name: str) -> torch.device:
    """'auto' is the current CUDA device when there is one, else the CPU."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"hardware.device={name} but CUDA is not available")
    return device


def build_models(cfg) -> tuple[nn.Module, nn.Module]:
    """Student and teacher of ``cfg.model`` (``models.build_dino_models``), on
    the CPU: what ``run_training`` trains and what ``dino-opt knn`` loads a
    checkpoint into."""
    from .models import build_dino_models

    m = cfg.model
    return build_dino_models(
        m.backbone, m.out_dim, m.patch_size, m.drop_path_rate, m.norm_last_layer,
        m.use_bn_in_head, m.hidden_dim, m.bottleneck_dim,
    )  # fmt: skip


def build_loss(cfg) -> nn.Module:
    """The DINO loss of ``cfg`` (temperatures, centre momentum, crops per
    image), on the CPU."""
    from .loss import DINOLoss

    s = cfg.schedule
    return DINOLoss(
        cfg.model.out_dim, 2 + cfg.augmentation.num_local_views, s.warmup_teacher_temp,
        s.teacher_temp, s.warmup_teacher_temp_epochs, s.epochs, s.student_temp,
        s.center_momentum,
    )  # fmt: skip


def data_roots(cfg) -> tuple[Path, Path | None]:
    """``(train, val)`` folders of a config: the built-in data set's ``train``
    and ``val`` when ``cfg.data.root`` is None, else ``cfg.data.root`` and its
    sibling ``val`` (None when there is none)."""
    if cfg.data.root is None:
        from .datasets import builtin_dataset

        root = builtin_dataset()
        return root / "train", root / "val"
    train_root = Path(cfg.data.root)
    val_root = train_root.parent / "val"
    return train_root, val_root if val_root.is_dir() else None


# The phases of a training step that run_training times (profile.json).
PROFILE_PHASES = ("data_wait", "forward_backward", "optimizer_step")


def _profile_summary(profiler, phases: Sequence[str] = PROFILE_PHASES) -> dict:
    """Per-phase statistics of the finished steps of ``profiler`` (a
    ``profiler.Profiler`` whose ranges are named after ``phases``), in seconds.

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


def load_checkpoint(
    path: str | os.PathLike, keys: Sequence[str] = ("student", "teacher", "config")
) -> dict:
    """The state dict of a checkpoint written by ``dino-opt train``, on the
    CPU (read with ``weights_only``). ``path`` is a checkpoint file, a run
    folder or its ``checkpoints/`` folder (then the newest checkpoint that
    verifies). A checkpoint whose recorded SHA-256 does not match is refused.
    A missing file raises ``FileNotFoundError``; an unreadable one, or one
    without ``keys``, ``ValueError``; both name the path."""
    from .checkpoint import CheckpointManager

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"checkpoint {str(path)!r} does not exist")
    if path.is_dir():
        folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
        latest = CheckpointManager(folder).load_latest()
        if latest is None:
            raise FileNotFoundError(f"no checkpoint that verifies in {str(folder)!r}")
        ckpt, path = latest
    else:
        manager = CheckpointManager(path.parent)
        ckpt = manager.load(path, verify=manager.sidecar_path(path).exists())
    missing = [k for k in keys if k not in ckpt]
    if missing:
        raise ValueError(
            f"checkpoint {str(path)!r} lacks {', '.join(map(repr, missing))} "
            f"(it has {', '.join(map(repr, ckpt)) or 'nothing'}); dino-opt train writes "
            "'student', 'teacher' and 'config'"
        )
    return ckpt


def evaluate_checkpoint(
    path: str | os.PathLike,
    data: str | os.PathLike | None = None,
    image_size: int | None = None,
    k: int | None = None,
    temperature: float | None = None,
    device: str = "auto",
    which: str = "teacher",
) -> dict:
    """k-NN top-1/top-5 of the backbone of a ``run_training`` checkpoint
    (``which``: its teacher or student) on ``data/train`` vs ``data/val``.

    Defaults come from the checkpoint's config, as ``run_training`` used
    them: the data of :func:`data_roots`, ``image_size`` the global crop
    size, ``k`` and ``temperature`` its ``eval`` section; so the teacher's
    top-1 equals the run's ``knn_top1_trained`` on the same device."""
    from .config import Config
    from .knn import knn_evaluate

    if which not in ("teacher", "student"):
        raise ValueError(f"which must be 'teacher' or 'student', got {which!r}")
    ckpt = load_checkpoint(path, keys=(which, "config"))
    try:
        cfg = Config.from_dict(ckpt["config"])
    except (ValueError, TypeError, AttributeError) as e:
        raise ValueError(f"checkpoint {str(path)!r}: its config is not valid: {e}") from e
    if data is not None:
        root = Path(data)
        train_root, val_root = root / "train", root / "val"
    else:
        train_root, val_root = data_roots(cfg)
        if val_root is None:
            raise FileNotFoundError(
                f"no held-out split beside {str(train_root)!r} (no "
                f"{str(train_root.parent / 'val')!r}); pass --data ROOT with ROOT/train "
                "and ROOT/val"
            )
    for split in (train_root, val_root):
        if not split.is_dir():
            raise FileNotFoundError(f"data folder {str(split)!r} does not exist")
    student, teacher = build_models(cfg)
    model = teacher if which == "teacher" else student
    try:
        model.load_state_dict(ckpt[which])
    except (RuntimeError, TypeError, AttributeError) as e:
        raise ValueError(
            f"checkpoint {str(path)!r}: its {which} weights do not fit the model of its "
            f"config ({cfg.model.backbone}): {e}"
        ) from e
    dev = resolve_device(device)
    size = image_size if image_size is not None else cfg.augmentation.global_crop_size
    result = knn_evaluate(
        model.backbone.to(dev), train_root, val_root, size, dev,
        k=k if k is not None else cfg.eval.knn_k,
        temperature=temperature if temperature is not None else cfg.eval.knn_temperature,
    )  # fmt: skip
    return {
        "checkpoint": str(path),
        "which": which,
        "train": str(train_root),
        "val": str(val_root),
        "image_size": size,
        "device": str(dev),
        **result,
    }


def run_training(cfg, *, output_dir: str | os.PathLike | None = None, quiet: bool = False) -> dict:
    """The whole job of ``dino-opt train``:
    ``CheckpointedDINOTrainer(cfg, output_dir=..., quiet=...).train()``.

    Data (the built-in set when ``cfg.data.root`` is None), student and
    teacher, the native loader, the fused loss and EMA, AMP, the DINO
    schedules; metrics as JSONL (and TensorBoard) with health diagnostics,
    the resolved config, checkpoints under ``checkpoints/`` (resumed per
    ``cfg.checkpoint.resume``) and, at the end, k-NN top-1 of the trained
    teacher beside the same network at random initialisation. Returns the
    report (also written as report.json).

    The run folder also gets ``training_curves.png`` (the metrics over the
    steps), ``profile.json`` (time per step phase; ``logging.profile``) and,
    with a held-out split and ``logging.tsne``, ``tsne_random_init.png`` and
    ``tsne_trained.png`` (t-SNE maps of the val features)."""
    from .checkpoint import CheckpointedDINOTrainer

    return CheckpointedDINOTrainer(cfg, output_dir=output_dir, quiet=quiet).train()
