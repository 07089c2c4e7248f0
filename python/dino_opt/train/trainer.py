"""The one-step engine: the memory-optimised DINO trainer.

``MemoryOptimizedDINOTrainer`` keeps the lesson's constructor
``(model, loss_fn, optimizer, config, device)`` and its two calls,
``train_step_optimized(crops, epoch)`` (forward and backward of one
micro-batch) and ``optimize_step()`` (clip, step, teacher update), but:

- AMP runs in bfloat16 where the device supports it (no GradScaler needed),
  float16 with a GradScaler otherwise, or float32;
- the teacher sees only the global crops, under ``no_grad``;
- crop batching bounds activation memory by running forward *and backward*
  per group of student views: the DINO loss is a sum of per-view terms once
  the teacher's targets are fixed, and the loss operator computes each
  group's share of it (``DINOLoss(..., views=...)``); no per-crop loop and no
  ``empty_cache()``;
- gradient clipping is one global norm over all parameters (``foreach``
  kernels, no host synchronisation), the last layer is frozen in the first
  ``freeze_last_layer`` epochs, and nothing calls ``.item()`` on the hot path:
  the returned loss is a device tensor.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..ops import EMATeacher, Schedules
from ..runtime import no_sync, replicated, resolve_precision
from .param_groups import param_groups

__all__ = ["DINOModel", "MemoryOptimizedDINOTrainer", "param_groups"]


class DINOModel(nn.Module):
    """A student and its momentum teacher (both multi-crop wrappers).

    ``update_teacher(step)`` applies the fused EMA with the momentum of
    ``step`` from ``momentum_schedule`` (a float, a per-step sequence or a
    callable) and returns it. ``copy_buffers``: the update also copies the
    student's buffers (BatchNorm statistics) into the teacher, for the
    recipes whose teacher never runs a training-mode forward of its own
    (a distillation: the EMA is only the result).
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, momentum_schedule=0.996,
                 copy_buffers: bool = False):  # fmt: skip
        super().__init__()
        self.student = student
        self.teacher = teacher
        self._ema = EMATeacher(student, teacher, momentum_schedule, copy_buffers=copy_buffers)
        self.teacher_step = 0

    def update_teacher(self, step: int | None = None) -> float:
        step = self.teacher_step if step is None else step
        m = self._ema.update(step)
        self.teacher_step = step + 1
        return m


def _for_loss(x: torch.Tensor) -> torch.Tensor:
    # Half-precision outputs of autocast go to float32 for the loss; float32
    # and float64 models keep their dtype.
    return x.float() if x.dtype in (torch.float16, torch.bfloat16) else x


def _last_layer_params(student: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in student.named_parameters() if "last_layer" in n]


def _backbone_params(student: nn.Module) -> list[nn.Parameter]:
    return [p for n, p in student.named_parameters()
            if n.removeprefix("module.").startswith("backbone.")]  # fmt: skip


class MemoryOptimizedDINOTrainer:
    """One DINO training step at a time, memory-lean; see the module docstring.

    ``config`` (a dict) takes the lesson's keys: ``use_amp`` (default True),
    ``gradient_checkpointing`` (False), ``crop_batch_size`` (student views per
    forward/backward group; None or >= the number of crops: one group),
    ``accumulation_steps`` (1), ``gradient_clip`` (3.0; 0 disables); and
    ``precision`` ('auto'; with ``use_amp=False``, float32),
    ``freeze_last_layer`` (epochs, 1), ``freeze_backbone`` (epochs the
    student's backbone is not updated while its heads warm up, 0),
    ``n_global`` (teacher views, 2).
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
        self.freeze_backbone = int(self.config.get("freeze_backbone", 0))
        self.n_global = int(self.config.get("n_global", 2))
        if self.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        self._epoch = 0
        self._micro_steps = 0  # micro-batches accumulated towards the next optimizer step
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

    def to_device(self, tensors: Sequence) -> list:
        """The step's one input path: each tensor of ``tensors`` copied to the
        device without blocking the host (other items as they are). Copies to
        a GPU come from pinned memory (the loader's batches are pinned; a
        small pageable tensor, such as mask indices made on the host, is
        pinned first), so that the host never waits for the device."""
        cuda = self.device.type == "cuda"
        return [
            (t.pin_memory() if cuda and t.device.type == "cpu" and not t.is_pinned() else t)
            .to(self.device, non_blocking=True)
            if isinstance(t, torch.Tensor) else t
            for t in tensors
        ]  # fmt: skip

    def train_step_optimized(
        self, crops: Sequence[torch.Tensor], epoch: int
    ) -> tuple[torch.Tensor, dict]:
        """Forward and backward of one micro-batch of crops (global crops
        first). Gradients accumulate until :meth:`optimize_step`. Returns the
        loss as a detached device tensor (no host synchronisation) and metrics
        that are also device tensors."""
        crops = self.to_device(crops)
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
        each group of student views runs forward and backward on its own
        (its share of the loss through the loss operator), so only one
        group's activations are alive at a time. The center is updated once,
        with the last group."""
        b = crops[0].shape[0]
        total = teacher_out.new_zeros(())
        for gi, group in enumerate(groups):
            last = gi == len(groups) - 1
            with no_sync(self.model.student, skip=not (self._sync_last and last)):
                with self._autocast():
                    out = _for_loss(self.model.student([crops[v] for v in group]))
                loss = self.loss_fn(out, teacher_out, epoch, views=group, update_center=last)
                self._backward(loss * scale)
            if self.capture_outputs:  # the global views' rows, in view order
                rows = [
                    out[i * b : (i + 1) * b].detach()
                    for i, v in enumerate(group)
                    if v < self.n_global
                ]
                self.captured.setdefault("student_parts", []).extend(rows)
            total = total + loss.detach()
        if self.capture_outputs:
            self.captured["student_logits"] = torch.cat(self.captured.pop("student_parts"))
        return total

    def optimize_step(self) -> bool:
        """Unscale (fp16), freeze the last layer (and the backbone, when
        adapting) in the first epochs, clip the
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
        if self._epoch < self.freeze_backbone:  # no gradient: neither a step nor decay
            for p in _backbone_params(student):
                p.grad = None
        params = [p for p in student.parameters() if p.grad is not None]
        # Sharded gradients (FSDP): the norm is reduced over the ranks on the
        # device and comes back replicated; no host synchronisation.
        self.last_grad_norm = replicated(self._clip(params))
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

    def _clip(self, params: list[nn.Parameter]) -> torch.Tensor:
        """Clips ``params``' gradients to ``gradient_clip`` (0: measures
        only); returns their norm before clipping."""
        if self.gradient_clip > 0:
            return torch.nn.utils.clip_grad_norm_(params, self.gradient_clip, foreach=True)
        return torch.nn.utils.get_total_norm([p.grad for p in params], foreach=True)

    def discard_accumulation(self) -> None:
        """Drops the gradients of micro-batches not yet stepped (a rollback
        abandons them), so the next micro-batch starts an optimizer step."""
        self.optimizer.zero_grad(set_to_none=True)
        self._micro_steps = 0
        self.captured = {}

    @property
    def at_step_boundary(self) -> bool:
        """Whether no micro-batch is waiting for an optimizer step (true after
        :meth:`optimize_step` has stepped, and before the first micro-batch)."""
        return self._micro_steps == 0

    def set_schedules(self, schedules: Schedules, iteration: int, lr_scale: float = 1.0) -> None:
        """Applies the lr (times ``lr_scale``) and weight decay of ``iteration``
        to the optimizer, each group's times its ``lr_multiplier`` and
        ``wd_multiplier`` (:mod:`dino_opt.train.param_groups`; of groups
        without a ``wd_multiplier`` only the first gets the weight decay, as
        DINO sets it); groups flagged
        ``is_last_layer`` follow ``schedules.last_layer_lr`` where there is one."""
        last = schedules.last_layer_lr
        for i, group in enumerate(self.optimizer.param_groups):
            lr = last if last is not None and group.get("is_last_layer") else schedules.lr
            group["lr"] = float(lr[iteration]) * group.get("lr_multiplier", 1.0) * lr_scale
            if "wd_multiplier" in group or i == 0:
                wd_mult = group.get("wd_multiplier", 1.0)
                group["weight_decay"] = float(schedules.weight_decay[iteration]) * wd_mult
