"""The DINO training step as the original code runs it, in plain PyTorch:
the baseline of bench/bench_train.py, written from the paper and the recipe in
docs/design.md ("The algorithm"; not copied from any code base).

One step of :class:`ReferenceDINOTrainer`:

1. the learning rate and weight decay of the iteration are written into the
   optimizer's groups (weight decay into the first group only);
2. the crops go to the device; under autocast (float16 with a GradScaler on a
   GPU, as DINO's ``use_fp16``; float32 on the CPU) the teacher sees the 2
   global crops and the student all crops, each network through
   :func:`multicrop_forward`: one backbone call per run of same-size crops
   (concatenated), one head call on all features;
3. the loss is :class:`ReferenceDINOLoss`: the double loop over teacher x
   student views skipping same-view pairs, with centering and sharpening,
   then the center update with a synchronous all-reduce when
   torch.distributed is initialised;
4. ``loss.item()`` stops on a non-finite loss; backward (scaled with fp16);
5. :func:`clip_gradients`: each parameter's gradient norm clipped to the
   clip value on its own, every norm read with ``.item()``;
6. :func:`cancel_gradients_last_layer`: in the first ``freeze_last_layer``
   epochs the head's last layer gets no gradient (``grad = None``);
7. the optimizer steps (through the GradScaler with fp16);
8. :func:`ema_update_loop`: the teacher follows the student, one parameter
   at a time, ``t.mul_(m).add_((1 - m) * s)``;
9. ``torch.cuda.synchronize()`` on a GPU and ``loss.item()`` for the log.

The pieces are also used one by one by the benchmark, to switch a single
optimisation off in dino_opt's trainer: :class:`ReferenceDINOLoss` is a
drop-in for ``dino_opt.DINOLoss``, :class:`LoopEMAModel` for
``dino_opt.train.DINOModel``, and :func:`make_pil_loader` gives DINO's
torchvision (PIL) multi-crop pipeline through ``torch.utils.data.DataLoader``
(bench/baseline_augment.py).
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
sys.path.insert(0, str(_HERE.parent / "tests_py"))
from baseline_augment import PILMultiCrop, collate_multicrop, list_image_folder  # noqa: E402
from dino_opt.ops import DINOLoss  # noqa: E402
from dino_opt.train import DINOModel  # noqa: E402
from reference import dino_loss_reference  # noqa: E402

__all__ = [
    "LoopEMAModel",
    "ReferenceDINOLoss",
    "ReferenceDINOTrainer",
    "cancel_gradients_last_layer",
    "clip_gradients",
    "dino_loss_reference",
    "ema_update_loop",
    "endless",
    "make_pil_loader",
    "momentum_at",
    "multicrop_forward",
]


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _unwrap(model: nn.Module) -> nn.Module:
    return model.module if hasattr(model, "module") else model


# ---------------------------------------------------------------- the networks


def multicrop_forward(wrapper: nn.Module, crops: Sequence[torch.Tensor]) -> torch.Tensor:
    """DINO's multi-crop forward of a ``MultiCropWrapper`` (``.backbone``,
    ``.head``): consecutive crops of the same size are concatenated and go
    through the backbone in one call (2 calls for 2 global + n local crops),
    the features of all crops are concatenated and go through the head once."""
    net = _unwrap(wrapper)
    sizes = [tuple(c.shape[-2:]) for c in crops]
    features, start = [], 0
    while start < len(crops):
        end = start + 1
        while end < len(crops) and sizes[end] == sizes[start]:
            end += 1
        features.append(net.backbone(torch.cat(list(crops[start:end]))))
        start = end
    return net.head(torch.cat(features))


# ---------------------------------------------------------------- the loss


class ReferenceDINOLoss(DINOLoss):
    """The DINO loss of the paper, written as the original double loop.

    Constructed and called as ``dino_opt.DINOLoss`` (whose constructor, center
    buffer and temperature schedule it shares), but the loss is
    ``tests_py/reference.py``'s :func:`dino_loss_reference` (for each teacher
    view and each other student view, the cross-entropy between the centred,
    sharpened teacher softmax and the student log-softmax, averaged over the
    pairs), and the center then moves towards the mean teacher row of the
    batch, all-reduced synchronously over the ranks when torch.distributed is
    initialised: ``c <- m c + (1 - m) mean(T)``. Nothing is ever pending.
    """

    def forward(
        self, student_output: torch.Tensor, teacher_output: torch.Tensor, epoch: int
    ) -> torch.Tensor:
        loss = dino_loss_reference(
            student_output,
            teacher_output.detach(),
            self.center,
            self.student_temp,
            self._teacher_temps[epoch],
            self.ncrops,
        )
        self.update_center(teacher_output)
        return loss

    @torch.no_grad()
    def update_center(self, teacher_output: torch.Tensor) -> None:
        batch_center = torch.sum(teacher_output, dim=0, keepdim=True)
        world = 1
        if _distributed():
            dist.all_reduce(batch_center)  # synchronous, as the original
            world = dist.get_world_size()
        batch_center = batch_center / (len(teacher_output) * world)
        self.center = self.center * self.center_momentum + batch_center * (1 - self.center_momentum)


# ---------------------------------------------------------------- the optimisation step


def clip_gradients(model: nn.Module, clip: float) -> list[float]:
    """DINO's clipping: every parameter's gradient on its own is scaled down
    to norm ``clip`` when its norm exceeds it (``clip / (norm + 1e-6)``).
    Each norm is read on the host (``.item()``); returns them."""
    norms = []
    for p in model.parameters():
        if p.grad is None:
            continue
        norm = p.grad.detach().norm(2).item()
        norms.append(norm)
        coef = clip / (norm + 1e-6)
        if coef < 1:
            p.grad.detach().mul_(coef)
    return norms


def cancel_gradients_last_layer(epoch: int, model: nn.Module, freeze_last_layer: int) -> None:
    """No update of the head's last layer in the first ``freeze_last_layer``
    epochs: its gradients are dropped (``None``, so the optimizer skips it)."""
    if epoch >= freeze_last_layer:
        return
    for name, p in model.named_parameters():
        if "last_layer" in name:
            p.grad = None


@torch.no_grad()
def ema_update_loop(student: nn.Module, teacher: nn.Module, m: float) -> None:
    """``teacher <- m * teacher + (1 - m) * student``, one parameter at a time."""
    for s, t in zip(_unwrap(student).parameters(), _unwrap(teacher).parameters(), strict=True):
        t.mul_(m).add_((1 - m) * s.detach())


@torch.no_grad()
def ema_update_foreach(student: nn.Module, teacher: nn.Module, m: float) -> None:
    """The same update over all parameters at once, as dinov2 writes it:
    ``_foreach_mul_`` then ``_foreach_add_`` with ``alpha = 1 - m`` (what a
    careful user writes in place of the loop)."""
    students = list(_unwrap(student).parameters())
    teachers = list(_unwrap(teacher).parameters())
    if len(students) != len(teachers):
        raise ValueError(f"student has {len(students)} parameters, teacher {len(teachers)}")
    torch._foreach_mul_(teachers, m)
    torch._foreach_add_(teachers, students, alpha=1 - m)


EMA_UPDATES = {"loop": ema_update_loop, "foreach": ema_update_foreach}


def momentum_at(schedule, step: int) -> float:
    """The value of a schedule (a number, a per-step sequence or a callable) at ``step``."""
    if callable(schedule):
        return float(schedule(step))
    if isinstance(schedule, (int, float)):
        return float(schedule)
    return float(schedule[step])


class LoopEMAModel(DINOModel):
    """``dino_opt.train.DINOModel`` whose ``update_teacher`` is the
    per-parameter Python loop (:func:`ema_update_loop`) instead of the fused
    operator; same momentum schedule, same step counting."""

    def __init__(self, student: nn.Module, teacher: nn.Module, momentum_schedule=0.996):
        super().__init__(student, teacher, momentum_schedule)
        self._momentum_schedule = momentum_schedule

    def update_teacher(self, step: int | None = None) -> float:
        step = self.teacher_step if step is None else step
        m = momentum_at(self._momentum_schedule, step)
        ema_update_loop(self.student, self.teacher, m)
        self.teacher_step = step + 1
        return m


class ReferenceDINOTrainer:
    """One DINO training step at a time, as the original code runs it (see
    the module docstring for the steps).

    Args:
        student, teacher: multi-crop wrappers (``.backbone``, ``.head``) of the
            same architecture; the teacher's parameters need no gradient.
        loss_fn: the loss, called ``loss_fn(student_out, teacher_out, epoch)``
            (:class:`ReferenceDINOLoss`).
        optimizer: over the student's parameters (AdamW with DINO's groups).
        device: where the step runs; crops are moved there.
        precision: ``"fp16"`` (autocast float16 + GradScaler, DINO's default on
            a GPU), ``"bf16"`` (autocast bfloat16) or ``"fp32"``.
        clip_grad: per-parameter clip (3.0); 0 disables.
        freeze_last_layer: epochs without last-layer updates (1).
        lr_schedule, wd_schedule: per-iteration values written into the
            optimizer's groups at each step (None: left as they are).
        momentum_schedule: teacher momentum, a number or per-iteration values.
        n_global: teacher views (2).
        ema: ``"loop"`` (:func:`ema_update_loop`, DINO's) or ``"foreach"``
            (:func:`ema_update_foreach`, dinov2's).
    """

    def __init__(
        self,
        student: nn.Module,
        teacher: nn.Module,
        loss_fn: nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        device: torch.device | str,
        precision: str = "fp16",
        clip_grad: float = 3.0,
        freeze_last_layer: int = 1,
        lr_schedule: Sequence[float] | None = None,
        wd_schedule: Sequence[float] | None = None,
        momentum_schedule=0.996,
        n_global: int = 2,
        ema: str = "loop",
    ) -> None:
        if precision not in ("fp16", "bf16", "fp32"):
            raise ValueError(f"precision must be fp16, bf16 or fp32, got {precision!r}")
        if ema not in EMA_UPDATES:
            raise ValueError(f"ema must be one of {sorted(EMA_UPDATES)}, got {ema!r}")
        self.ema_update = EMA_UPDATES[ema]
        self.student, self.teacher = student, teacher
        self.loss_fn, self.optimizer = loss_fn, optimizer
        self.device = torch.device(device)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16, "fp32": None}[precision]
        self.scaler = torch.amp.GradScaler(self.device.type) if precision == "fp16" else None
        self.clip_grad = float(clip_grad)
        self.freeze_last_layer = int(freeze_last_layer)
        self.lr_schedule, self.wd_schedule = lr_schedule, wd_schedule
        self.momentum_schedule = momentum_schedule
        self.n_global = int(n_global)
        self.last_grad_norms: list[float] = []

    def train_step(self, crops: Sequence[torch.Tensor], epoch: int, it: int) -> float:
        """One step on ``crops`` (global crops first) at global iteration
        ``it`` of ``epoch``; returns the loss (a Python float)."""
        for i, group in enumerate(self.optimizer.param_groups):
            if self.lr_schedule is not None:
                group["lr"] = float(self.lr_schedule[it])
            if i == 0 and self.wd_schedule is not None:
                group["weight_decay"] = float(self.wd_schedule[it])
        crops = [c.to(self.device, non_blocking=True) for c in crops]
        with torch.autocast(
            self.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None
        ):
            teacher_output = multicrop_forward(self.teacher, crops[: self.n_global])
            student_output = multicrop_forward(self.student, crops)
            loss = self.loss_fn(student_output, teacher_output, epoch)
        if not math.isfinite(loss.item()):
            raise FloatingPointError(f"Loss is {loss.item()}, stopping training")

        self.optimizer.zero_grad()
        if self.scaler is None:
            loss.backward()
            if self.clip_grad:
                self.last_grad_norms = clip_gradients(self.student, self.clip_grad)
            cancel_gradients_last_layer(epoch, self.student, self.freeze_last_layer)
            self.optimizer.step()
        else:
            self.scaler.scale(loss).backward()
            if self.clip_grad:
                self.scaler.unscale_(self.optimizer)  # clip the true gradients
                self.last_grad_norms = clip_gradients(self.student, self.clip_grad)
            cancel_gradients_last_layer(epoch, self.student, self.freeze_last_layer)
            self.scaler.step(self.optimizer)
            self.scaler.update()

        self.ema_update(self.student, self.teacher, momentum_at(self.momentum_schedule, it))
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return loss.item()


# ---------------------------------------------------------------- the data


def make_pil_loader(
    source: str | Path | Sequence[tuple[str, int]],
    batch_size: int,
    *,
    workers: int,
    global_size: int = 224,
    local_size: int = 96,
    n_local: int = 8,
    global_scale: tuple[float, float] = (0.4, 1.0),
    local_scale: tuple[float, float] = (0.05, 0.4),
    seed: int = 0,
    pin_memory: bool | None = None,
    persistent_workers: bool = True,
) -> torch.utils.data.DataLoader:
    """DINO's data pipeline: the torchvision (PIL) multi-crop augmentation of
    bench/baseline_augment.py over an ImageFolder tree (or (path, label)
    pairs) through ``DataLoader`` (shuffled, ``drop_last``, pinned memory when
    CUDA is available; a ``DistributedSampler`` when torch.distributed is
    initialised). Batches are ``(list of 2 + n_local crop tensors, labels)``.
    Workers persist across epochs (DINO's loader restarts them each epoch;
    keeping them is the kinder choice for the baseline)."""
    samples = list_image_folder(source) if isinstance(source, (str, Path)) else list(source)
    dataset = PILMultiCrop(
        samples,
        global_size=global_size,
        local_size=local_size,
        n_local=n_local,
        global_scale=tuple(global_scale),
        local_scale=tuple(local_scale),
    )
    if pin_memory is None:
        pin_memory = torch.cuda.is_available()
    sampler, shuffle = None, True
    if _distributed():
        sampler = torch.utils.data.DistributedSampler(dataset, shuffle=True, seed=seed)
        shuffle = None
    extra = dict(persistent_workers=persistent_workers) if workers > 0 else {}
    return torch.utils.data.DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        sampler=sampler,
        generator=torch.Generator().manual_seed(seed),
        num_workers=workers,
        pin_memory=pin_memory,
        drop_last=True,
        collate_fn=collate_multicrop,
        **extra,
    )


def endless(loader, set_epoch: Callable[[int], None] | None = None) -> Iterator:
    """The loader's batches epoch after epoch (``set_epoch`` before each one;
    by default the ``DistributedSampler``'s when there is one)."""
    if set_epoch is None:
        sampler = getattr(loader, "sampler", None)
        set_epoch = getattr(sampler, "set_epoch", None)
    epoch = 0
    while True:
        if set_epoch is not None:
            set_epoch(epoch)
        n = 0
        for batch in loader:
            n += 1
            yield batch
        if n == 0:
            raise ValueError("the loader gives no batch (fewer images than one batch?)")
        epoch += 1
