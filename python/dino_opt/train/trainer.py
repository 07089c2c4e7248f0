"""The one training step of every recipe: the memory-optimised DINO trainer.

``MemoryOptimizedDINOTrainer`` keeps the lesson's constructor
``(model, loss_fn, optimizer, config, device)`` and its two calls,
``train_step_optimized(crops, epoch)`` (forward and backward of one
micro-batch) and ``optimize_step()`` (clip, step, teacher update), and is
the step of every recipe: a recipe contributes its terms (:class:`StepTerms`:
inputs, teacher targets, student passes, loss; DINO's are
:class:`DINOTerms`, DINOv3's are DINOv2's plus the Gram term), and the
engine owns the rest:

- AMP runs in bfloat16 where the device computes it (no GradScaler needed),
  float16 with a GradScaler otherwise, or float32;
- the teacher runs under ``no_grad``, on the global crops;
- crop batching (DINO's terms) bounds activation memory by running forward
  *and backward* per group of student views: the DINO loss is a sum of
  per-view terms once the teacher's targets are fixed, and the loss
  operator computes each group's share of it (``DINOLoss(..., views=...)``);
- gradient clipping is one global norm (``foreach`` kernels, no host
  synchronisation), the last layer is frozen in the first
  ``freeze_last_layer`` epochs (its weight gradient not computed, except
  under DDP), a non-finite step is skipped on the device
  by a fused optimizer, and nothing calls ``.item()`` on the hot path: the
  returned loss is a device tensor."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch
from torch import nn

from ..models import WeightNormLinear
from ..ops import EMATeacher, Schedules
from ..runtime import no_sync, replicated, resolve_precision
from .param_groups import param_groups

__all__ = [
    "DINOModel",
    "DINOTerms",
    "MemoryOptimizedDINOTrainer",
    "StepHooks",
    "StepTerms",
    "param_groups",
]


class DINOModel(nn.Module):
    """A student and its momentum teacher (both multi-crop wrappers).

    ``update_teacher(step)`` applies the fused EMA with the momentum of
    ``step`` from ``momentum_schedule`` (a float, a per-step sequence or a
    callable) and returns it. ``copy_buffers``: the update also copies the
    student's buffers (BatchNorm statistics) into the teacher, for the
    recipes whose teacher never runs a training-mode forward of its own
    (a distillation: the EMA is only the result).
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        momentum_schedule=0.996,
        copy_buffers: bool = False,
    ):
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


def _weight_norm_last_layers(student: nn.Module) -> list[WeightNormLinear]:
    """The student's weight-normalised last layers (through any wrapper)."""
    return [
        m
        for n, m in student.named_modules()
        if isinstance(m, WeightNormLinear) and n.rsplit(".", 1)[-1] == "last_layer"
    ]


def _skips_frozen_weight_gradient(student: nn.Module) -> bool:
    """Whether a frozen epoch may skip the last layers' weight gradient: not
    under DistributedDataParallel, whose reducer waits for a gradient of
    every parameter it was built with, so there the gradient is computed and
    discarded, as DINO does."""
    return not isinstance(student, nn.parallel.DistributedDataParallel)


def _backbone_params(student: nn.Module) -> list[nn.Parameter]:
    return [
        p
        for n, p in student.named_parameters()
        if n.removeprefix("module.").startswith("backbone.")
    ]


class StepHooks:
    """What every part of the one step (:class:`MemoryOptimizedDINOTrainer`)
    may add: a check of the trainer's config, its targets, its scheduled
    values and its work at the optimizer steps' boundaries; each hook gets
    the trainer and does nothing by default. Extra terms (the engine's
    ``extra_terms``: DINOv3's Gram term) are these hooks alone."""

    def attach(self, trainer: MemoryOptimizedDINOTrainer) -> None:
        """Called once by the trainer's constructor (checks its config)."""

    def targets(self, trainer, inputs, targets=None):
        """The teacher's side, run under ``no_grad``; an extra term gets the
        main terms' ``targets`` and returns them with its own added."""
        return targets

    def set_schedules(self, trainer, schedules: Schedules, iteration: int) -> None:
        """The recipe's scheduled values of ``iteration`` (beyond lr and wd)."""

    def before_step(self, trainer) -> None:
        """At an optimizer step's first micro-batch."""

    def after_step(self, trainer) -> None:
        """After an optimizer step (the teacher updated)."""


class StepTerms(StepHooks, ABC):
    """A recipe's part of the one step: what it feeds the networks, its
    teacher targets, its student passes and its loss. Everything else
    (autocast, accumulation, DDP's all-reduce on the last pass, clipping, the
    optimizer step, the EMA, the schedules) is the engine's, written once."""

    def inputs(self, trainer, crops: Sequence[torch.Tensor], masks: torch.Tensor | None):
        """The micro-batch on the device (host-side work first)."""
        return trainer.to_device(crops)

    def passes(self, trainer, inputs) -> list:
        """The student passes of a micro-batch, each run forward and backward
        on its own (only one pass's activations alive at a time)."""
        return [None]

    @abstractmethod
    def student(self, trainer, inputs, views):
        """The student's forward of one pass (under autocast)."""

    @abstractmethod
    def loss(self, trainer, out, targets, inputs, views, last: bool) -> tuple[torch.Tensor, dict]:
        """One pass's loss and its detached parts; ``last``: the micro-batch's
        last pass (where running statistics such as a center update)."""

    def clip_groups(self, trainer, params: list[nn.Parameter]) -> list[list[nn.Parameter]]:
        """The parameter groups clipped each to its own norm (one by default)."""
        return [params]


class DINOTerms(StepTerms):
    """DINO's terms: the teacher's head outputs of the global crops as
    targets, the student on every crop, :class:`~dino_opt.ops.DINOLoss`.
    With ``crop_batch_size`` the student views run in groups, each forward
    and backward on its own: the loss is a sum of per-view terms once the
    targets are fixed, and the loss operator computes each group's share
    (``views=``); the center is updated once, with the last group."""

    def targets(self, trainer, inputs, targets=None):
        teacher = trainer.model.teacher
        glob = inputs[: trainer.n_global]
        with trainer.autocast():
            if trainer.capture_outputs and hasattr(teacher, "forward_backbone"):
                features = teacher.forward_backbone(glob)
                out = teacher.head(features)
                trainer.captured["features"] = features.detach()
            else:
                out = teacher(glob)
        out = _for_loss(out)
        if trainer.capture_outputs:
            trainer.captured["teacher_logits"] = out.detach()
        return out

    def passes(self, trainer, inputs) -> list:
        n, size = len(inputs), trainer.crop_batch_size
        if not size or size >= n:
            return [None]
        return [range(i, min(i + size, n)) for i in range(0, n, size)]

    def student(self, trainer, inputs, views):
        crops = inputs if views is None else [inputs[v] for v in views]
        return _for_loss(trainer.model.student(crops))

    def loss(self, trainer, out, targets, inputs, views, last):
        epoch = trainer.epoch
        if views is None:
            loss = trainer.loss_fn(out, targets, epoch)
        else:
            loss = trainer.loss_fn(out, targets, epoch, views=views, update_center=last)
        if trainer.capture_outputs:  # the global views' rows, in view order
            b = inputs[0].shape[0]
            views = range(len(inputs)) if views is None else views
            rows = [
                out[i * b : (i + 1) * b].detach()
                for i, v in enumerate(views)
                if v < trainer.n_global
            ]
            captured = trainer.captured
            captured.setdefault("student_parts", []).extend(rows)
            if last:
                captured["student_logits"] = torch.cat(captured.pop("student_parts"))
        return loss, {}


class MemoryOptimizedDINOTrainer:
    """The one training step of every recipe, a micro-batch at a time,
    memory-lean; see the module docstring.

    ``config`` (a dict) takes the lesson's keys: ``use_amp`` (default True),
    ``gradient_checkpointing`` (False), ``crop_batch_size`` (student views per
    forward/backward group; None or >= the number of crops: one group),
    ``accumulation_steps`` (1), ``gradient_clip`` (3.0; 0 disables); and
    ``precision`` ('auto'; with ``use_amp=False``, float32),
    ``freeze_last_layer`` (epochs, 1), ``freeze_backbone`` (epochs the
    student's backbone is not updated while its heads warm up, 0),
    ``n_global`` (teacher views, 2), ``cuda_graphs`` (the networks' compiled
    graphs replay as CUDA graphs, ``reduce-overhead``: each optimizer step
    starts a new generation of them; False). ``terms``: the recipe's part of the step
    (:class:`StepTerms`; DINO's by default), ``extra_terms`` added to it
    (:class:`StepHooks`).
    """

    def __init__(
        self,
        model: DINOModel,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        config: dict,
        device: torch.device,
        *,
        terms: StepTerms | None = None,
        extra_terms: Sequence[StepHooks] = (),
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
        # found once, not per step (a walk over every module); a wrapper put
        # around the student later holds the same layers
        self._weight_norm_last_layers = _weight_norm_last_layers(model.student)
        self.n_global = int(self.config.get("n_global", 2))
        self.cuda_graphs = bool(self.config.get("cuda_graphs", False))
        if self.gradient_checkpointing:
            self._enable_gradient_checkpointing()
        self.epoch = 0
        self._micro_steps = 0  # micro-batches accumulated towards the next optimizer step
        # Set capture_outputs before a step to keep its teacher and student
        # outputs of the global views and the teacher's backbone features in
        # ``captured`` (for health diagnostics at logging intervals).
        self.capture_outputs = False
        self.captured: dict[str, torch.Tensor] = {}
        self.last_grad_norm: torch.Tensor | None = None
        self.last_step_finite: torch.Tensor | None = None
        self.terms = terms if terms is not None else DINOTerms()
        self.extra_terms = tuple(extra_terms)
        for t in self._all_terms:
            t.attach(self)

    @property
    def _all_terms(self) -> tuple[StepHooks, ...]:
        return (self.terms, *self.extra_terms)

    def _enable_gradient_checkpointing(self) -> None:
        backbone = getattr(self.model.student, "backbone", None)
        if backbone is None or not hasattr(backbone, "set_grad_checkpointing"):
            raise ValueError("gradient_checkpointing needs a ViT backbone (set_grad_checkpointing)")
        backbone.set_grad_checkpointing(True)

    def autocast(self):
        """The step's autocast context (disabled in float32)."""
        return torch.autocast(self.device.type, dtype=self.amp_dtype, enabled=self.use_amp)

    def to_device(self, tensors: Sequence) -> list:
        """The step's one input path: each tensor of ``tensors`` copied to the
        device without blocking the host (other items as they are). Copies to
        a GPU come from pinned memory (the loader's batches are pinned; a
        small pageable tensor, such as mask indices made on the host, is
        pinned first), so that the host never waits for the device."""
        cuda = self.device.type == "cuda"
        return [
            (t.pin_memory() if cuda and t.device.type == "cpu" and not t.is_pinned() else t).to(
                self.device, non_blocking=True
            )
            if isinstance(t, torch.Tensor)
            else t
            for t in tensors
        ]

    def train_step_optimized(
        self, crops: Sequence[torch.Tensor], epoch: int, masks: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, dict]:
        """Forward and backward of one micro-batch of crops (global crops
        first; ``masks``: the global crops' masks, for the recipes whose
        terms need them). Gradients accumulate until :meth:`optimize_step`.
        Returns the loss as a detached device tensor (no host
        synchronisation) and metrics that are also device tensors."""
        self.epoch = epoch
        if self.at_step_boundary:
            if self.cuda_graphs and self.device.type == "cuda":
                # the last step's graph outputs are dead (its gradients stepped and
                # freed): their memory may be replayed into; on a CPU nothing replays
                torch.compiler.cudagraph_mark_step_begin()
            # set every step, so that a flag left by an earlier run never outlives it
            frozen = self.epoch < self.freeze_last_layer and _skips_frozen_weight_gradient(
                self.model.student
            )
            for layer in self._weight_norm_last_layers:
                layer.frozen = frozen
            for t in self._all_terms:
                t.before_step(self)
        inputs = self.terms.inputs(self, crops, masks)
        self.captured = {}
        with torch.no_grad():
            targets = self.terms.targets(self, inputs)
            for t in self.extra_terms:
                targets = t.targets(self, inputs, targets)
        passes = self.terms.passes(self, inputs)
        # With DDP, only the last backward of an optimizer step all-reduces.
        sync = self._micro_steps + 1 >= self.accumulation_steps
        total, parts = None, {}
        for i, views in enumerate(passes):
            last = i == len(passes) - 1
            with no_sync(self.model.student, skip=not (sync and last)):
                with self.autocast():
                    out = self.terms.student(self, inputs, views)
                loss, parts = self.terms.loss(self, out, targets, inputs, views, last)
                self._backward(loss / self.accumulation_steps)
            total = loss.detach() if total is None else total + loss.detach()
        self._micro_steps += 1
        return total, {"loss": total, **parts}

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

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
        if self.epoch < self.freeze_last_layer:
            for p in _last_layer_params(student):
                p.grad = None
        if self.epoch < self.freeze_backbone:  # no gradient: neither a step nor decay
            for p in _backbone_params(student):
                p.grad = None
        params = [p for p in student.parameters() if p.grad is not None]
        # Sharded gradients (FSDP): the norm is reduced over the ranks on the
        # device and comes back replicated; no host synchronisation.
        groups = self.terms.clip_groups(self, params)
        norms = [replicated(self._clip(g)) for g in groups]
        self.last_grad_norm = (
            norms[0] if len(norms) == 1 else torch.linalg.vector_norm(torch.stack(norms))
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
        for t in self._all_terms:
            t.after_step(self)
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
        ``is_last_layer`` follow ``schedules.last_layer_lr`` where there is one;
        then the terms' own scheduled values (a teacher temperature, a Gram
        weight)."""
        last = schedules.last_layer_lr
        for i, group in enumerate(self.optimizer.param_groups):
            lr = last if last is not None and group.get("is_last_layer") else schedules.lr
            group["lr"] = float(lr[iteration]) * group.get("lr_multiplier", 1.0) * lr_scale
            if "wd_multiplier" in group or i == 0:
                wd_mult = group.get("wd_multiplier", 1.0)
                group["weight_decay"] = float(schedules.weight_decay[iteration]) * wd_mult
        for t in self._all_terms:
            t.set_schedules(self, schedules, iteration)
