"""The memory of a distillation's networks that the ViT formulas of
:mod:`~dino_opt.tune.memory.model` do not cover: the frozen teacher's forward
pass (no gradients, a block at a time) and a student that is not a ViT (a
ResNet, a ConvNeXt), measured by tracing instead of modelled by formula:
the student is built on the meta device (no memory, no compute) and its
forward pass over the global crops and its loss run there, with a hook that
records every tensor autograd keeps for the backward pass. What is kept is
then exactly what this network's operators save, whatever its layers; the
parameters, their gradients, AdamW's moments and the EMA are counted from
the built modules. DDP only (the job shards ViT students alone)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ...config import Config, DistillConfig
from ...models import Tokens, feature_width
from ...train import FeatureDistillLoss, LocalViews, build_models, teacher_side

__all__ = [
    "FP32",
    "SavedTrace",
    "frozen_forward_bytes",
    "frozen_gathered",
    "parameter_numel",
    "trace_saved",
    "traced_student",
    "whitening_state_bytes",
]

FP32 = 4  # bytes of a float32


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage()._cdata


@dataclass
class SavedTrace:
    """What autograd keeps in a forward pass, in forward order: ``kept`` (the
    bytes of each distinct storage, where it was first saved), ``grads``
    (the float32 gradient bytes of each module's own trainable parameters,
    where its forward began); positions count the saved storages before."""

    kept: list[tuple[int, int]] = field(default_factory=list)
    grads: list[tuple[int, int]] = field(default_factory=list)

    @property
    def total(self) -> int:
        return sum(b for _, b in self.kept)

    @property
    def largest(self) -> int:
        return max((b for _, b in self.kept), default=0)

    def backward_peak(self) -> int:
        """The most that is alive during the backward pass, less all the
        gradients: the backward frees the saved values from the last saved
        to the first and makes the gradients from the last module to the
        first, so where it has come back to position k the values saved up
        to k and the gradients from k on are alive, with the working set of
        the operation there (twice its saved value: the gradients of its
        output and of its input)."""
        events = sorted([(p, b) for p, b in self.kept] + [(p, -b) for p, b in self.grads])
        best = alive = 0
        for _, b in events:
            alive += b
            best = max(best, alive + 2 * max(b, 0))
        return best


def trace_saved(run, model: nn.Module, a: int = FP32) -> SavedTrace:
    """The :class:`SavedTrace` of ``run()`` (a forward pass through ``model``
    and what follows it), leaving out ``model``'s parameters. Floating-point
    values count ``a`` bytes each (the 16-bit copies autocast makes where
    ``a`` is 2)."""
    trace, seen = SavedTrace(), {_storage(p) for p in model.parameters()}

    def pack(t: torch.Tensor) -> torch.Tensor:
        key = _storage(t)
        if key not in seen:
            seen.add(key)
            per = a if t.is_floating_point() and t.element_size() == FP32 else t.element_size()
            trace.kept.append(
                (len(trace.kept), t.untyped_storage().nbytes() // t.element_size() * per)
            )
        return t

    def begins(module: nn.Module, _) -> None:
        own = sum(p.numel() for p in module.parameters(recurse=False) if p.requires_grad)
        if own and module not in started:
            started.add(module)
            trace.grads.append((len(trace.kept), FP32 * own))

    started: set[nn.Module] = set()
    hooks = [m.register_forward_pre_hook(begins) for m in model.modules()]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in hooks:
            h.remove()
    return trace


def parameter_numel(module: nn.Module, trainable: bool = False) -> int:
    """The number of ``module``'s parameters (its trainable ones with ``trainable``)."""
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable)


def traced_student(cfg: Config, a: int) -> dict[str, int]:
    """One student of a feature distillation under DDP (``cfg`` its own
    config), in bytes: its states (float32 parameters, gradients, AdamW's two
    moments, DDP's buckets, the EMA; the projector's gradients, the first the
    backward makes), what its forward over the global crops (and the local
    ones, with ``recipe.distill.local_weight``) and its loss keep
    (``activations``; with 16-bit autocast also its weights' cached casts),
    the backward's working set at its start (``working``: the gradient of the
    largest kept value and the one it makes) and, less all its gradients, the
    most alive during the backward with that working set (``end``:
    :meth:`SavedTrace.backward_peak`; a convolutional network's largest
    values are its first, its largest gradients its last)."""
    a_, batch = cfg.augmentation, cfg.data.batch_size
    local_weight = cfg.recipe.distill.local_weight
    with torch.device("meta"):
        student, ema = build_models(cfg)
        side, local_side = a_.largest_crop_sizes
        images = torch.empty(2 * batch, 3, side, side)
        n_local = a_.num_local_views if local_weight > 0 else 0
        local = [torch.empty(batch, 3, local_side, local_side) for _ in range(n_local)]
    loss = FeatureDistillLoss(DistillConfig(local_weight=local_weight))

    def step() -> None:
        out = student(images, local)
        tokens = LocalViews.global_tokens(out)
        teacher = Tokens(
            torch.empty_like(tokens.cls), torch.empty_like(tokens.patches), tokens.grid
        )
        loss(out, teacher)

    trace = trace_saved(step, student, a)
    numel, trainable = parameter_numel(student), parameter_numel(student, trainable=True)
    ema_numel = parameter_numel(ema)
    casts = a * numel if a != FP32 else 0
    return {
        "parameters": FP32 * numel,
        "gradients": FP32 * trainable,
        "optimizer": 2 * FP32 * trainable,
        "teacher": FP32 * ema_numel,
        "buckets": FP32 * trainable,
        "head_gradients": FP32 * parameter_numel(student.head),
        "parameter_count": numel,
        "trainable_count": trainable,
        "teacher_count": ema_numel,
        "unsharded": 0,
        "activations": trace.total + casts,
        "working": 2 * trace.largest,
        "end": trace.backward_peak(),
    }


def frozen_gathered(teacher: nn.Module) -> int:
    """Parameters of a sharded frozen teacher gathered at once in its
    forward: its backbone's root (what is not in a block) and two blocks
    (the heads of a teacher with heads are whole, not gathered)."""
    backbone = getattr(teacher, "backbone", teacher)
    blocks = getattr(backbone, "blocks", None) or []
    block = max((parameter_numel(b) for b in blocks), default=0)
    return parameter_numel(backbone) - sum(parameter_numel(b) for b in blocks) + 2 * block


def frozen_forward_bytes(cfg: Config, teacher: nn.Module, a: int) -> int:
    """The frozen teacher's forward pass over the global crops (no
    gradients, one block at a time): the residual stream in and out of a
    block, the MLP's input, hidden and activated values; and its tokens.
    A network without blocks (a ResNet): its output only. A teacher with
    heads: its backbone's pass (the heads' rows are DINOv2's terms). With
    whitened tokens, after the pass: the tokens, two copies and eigh's
    matrices, when that is more."""
    teacher = getattr(teacher, "backbone", teacher)
    side = cfg.augmentation.largest_crop_sizes[0]
    patch = int(getattr(teacher, "patch_size", 1))
    width = feature_width(teacher)
    grid = teacher_side(side, cfg.recipe.distill.teacher_scale, patch) // patch
    tokens = (
        2 * cfg.data.batch_size * (grid * grid + 1 + getattr(teacher, "num_register_tokens", 0))
    )
    # after it, whitening (recipe.distill.whiten): its tokens, a centred and a whitened copy, eigh
    out = 3 * tokens * width + 3 * width * width if cfg.recipe.distill.whiten else tokens * width
    blocks = getattr(teacher, "blocks", None)
    if not blocks:
        return out * FP32
    mlp = blocks[0].mlp
    hidden = mlp.fc1.out_features if hasattr(mlp, "fc1") else mlp.w3.in_features
    return max(tokens * (2 * FP32 * width + a * (width + 2 * hidden)), out * FP32)


def whitening_state_bytes(cfg: Config, teacher: nn.Module) -> int:
    """The whiteners of ``recipe.distill.whiten`` (class and patch tokens):
    each a float64 mean and covariance, a float32 matrix and a count, kept
    all run."""
    if not cfg.recipe.distill.whiten:
        return 0
    width = feature_width(getattr(teacher, "backbone", teacher))
    return 2 * (12 * width * width + 8 * width + 8)
