"""The DINOv3 recipe's training step: DINOv2's terms (DINO's class-token
loss, iBOT's masked-patch loss, KoLeo) plus the Gram anchoring term
(:class:`GramTerm`), composed in the one step (:class:`DINOv3Trainer`).

Gram anchoring (Siméoni et al., 2025) keeps the student's patch-to-patch
similarities near those of a Gram teacher: ``gram_weight * GramLoss(student's
patch tokens of the global crops, the Gram teacher's of the same crops)``,
both after the backbone's final norm, the student's with its masks. The Gram
teacher (:class:`GramTeacher`) is a frozen copy of the teacher's backbone
held by the loss (:class:`DINOv3Loss`), so that its weights and its count of
refreshes are in the loss's state dict, saved in each checkpoint and restored
on resume. It gets its weights from a file (:meth:`GramTeacher.load_file`),
or from the EMA teacher at the start of iteration ``it_load_ema_teacher``; it
is refreshed from the EMA teacher after each optimizer step whose iteration
``it`` has ``it + 1 >= it_first_update`` and ``(it + 1) % update_frequency ==
0``, at most ``max_updates`` times (:func:`refresh_due`). Until it has
weights the step has no Gram term.

Under ``distributed.strategy: fsdp`` the job makes the Gram teacher before it
shards the teacher and shards it as the teacher's backbone
(:func:`~dino_opt.runtime.shard_frozen_backbone`): each rank holds its
shards, a copy from the EMA teacher is a copy of local shards, and the
checkpoint keeps its weights as shards.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from ..config import GramConfig
from ..ops import Schedules
from ..ops.gram_loss import GramLoss
from .dinov2 import DINOv2Loss, DINOv2Trainer, TeacherTargets
from .trainer import StepHooks

__all__ = ["DINOv3Loss", "DINOv3Trainer", "GramTeacher", "GramTerm", "refresh_due"]


def refresh_due(options: GramConfig, iteration: int, updates: int) -> bool:
    """Whether the Gram teacher is refreshed from the EMA teacher after the
    optimizer step of ``iteration`` (from 0), ``updates`` refreshes done."""
    o, done = options, iteration + 1
    return (
        o.use_loss
        and o.rep_update
        and done >= o.it_first_update
        and done % o.update_frequency == 0
        and (o.max_updates is None or updates < o.max_updates)
    )


def _layout(t: torch.Tensor) -> str:
    if not isinstance(t, DTensor):
        return f"whole {tuple(t.shape)}"
    return f"{tuple(t.shape)} placed {t.placements} on mesh {t.device_mesh.mesh.tolist()}"


def _copy_shards(target: dict, source: dict) -> None:
    """``source``'s tensors into ``target``'s of the same names (state dicts
    of two backbones), shard by shard: each rank copies its local pieces, no
    communication, so every sharded tensor must be placed alike in both."""
    if target.keys() != source.keys():
        lacks, more = sorted(target.keys() - source.keys()), sorted(source.keys() - target.keys())
        raise ValueError(
            f"the Gram teacher and the teacher's backbone differ: the teacher lacks "
            f"{lacks[:3]}, has more {more[:3]}"
        )
    for name, dst in target.items():
        src = source[name]
        alike = isinstance(dst, DTensor) == isinstance(src, DTensor) and dst.shape == src.shape
        if alike and isinstance(dst, DTensor):
            alike = dst.placements == src.placements and dst.device_mesh == src.device_mesh
        if not alike:
            raise ValueError(
                f"the Gram teacher's {name} is {_layout(dst)}, the teacher's {_layout(src)}: "
                "a copy of local shards needs both sharded alike (shard_frozen_backbone)"
            )
        if isinstance(dst, DTensor):
            dst, src = dst.to_local(), src.to_local()
        dst.copy_(src)


class GramTeacher(nn.Module):
    """A frozen copy of the teacher's backbone (:meth:`attach`) and its
    schedule: ``loaded`` (it has weights) and ``updates`` (refreshes done),
    kept in the state dict. :meth:`before_step` and :meth:`after_step` apply
    the schedule of ``options`` (the config's ``recipe.gram``,
    :class:`~dino_opt.config.GramConfig`); :meth:`patch_tokens` gives its
    patch features of the global crops on the student's grid, at the side
    ``options.teacher_crop_size`` gives each of ``crop_size_pairs``."""

    def __init__(self, options: GramConfig, crop_size_pairs: list[tuple[int, int]] = ()):
        super().__init__()
        self.options = options
        self.teacher_crop_size = options.teacher_sides(list(crop_size_pairs))
        self.backbone: nn.Module | None = None
        self.loaded = False
        self.updates = 0

    def train(self, mode: bool = True) -> GramTeacher:
        """The flag only: the Gram teacher's backbone stays in eval mode."""
        super().train(mode)
        if self.backbone is not None:
            self.backbone.eval()
        return self

    def get_extra_state(self) -> dict:
        return {"loaded": self.loaded, "updates": self.updates}

    def set_extra_state(self, state: dict) -> None:
        self.loaded, self.updates = bool(state["loaded"]), int(state["updates"])

    def attach(self, teacher_backbone: nn.Module, load_backbone: Callable | None = None) -> None:
        """Makes the Gram teacher a frozen copy of ``teacher_backbone``'s
        architecture, with the weights of ``options.ckpt`` when given (read
        by ``load_backbone``, :func:`~dino_opt.weights.load_backbone`). The
        teacher must not be sharded yet (the copy is sharded after it)."""
        if any(isinstance(p, DTensor) for p in teacher_backbone.parameters()):
            raise ValueError(
                "the Gram teacher is a copy of the teacher's backbone made before the teacher is "
                "sharded (distributed.strategy=fsdp: the job's spread shards both alike)"
            )
        self.backbone = copy.deepcopy(teacher_backbone).requires_grad_(False).eval()
        if self.options.ckpt is not None:
            self.load_file(self.options.ckpt, load_backbone)

    def load_file(self, path: str, load_backbone: Callable | None) -> None:
        """The weights of ``path``, any format
        :func:`~dino_opt.weights.read_weights` reads (a dino-opt checkpoint's
        teacher backbone, a backbone's state dict, DINOv3's, timm's or
        Hugging Face's files ...), loaded by ``load_backbone``
        (:func:`~dino_opt.weights.load_backbone`, which the job hands down);
        a one-line ValueError naming the file when they do not fit."""
        if load_backbone is None:
            raise ValueError(
                f"recipe.gram.ckpt={path!r}: reading it needs dino_opt.weights' load_backbone "
                "(attach_frozen_copies(..., reader=weights_reader()))"
            )
        try:
            load_backbone(path, self.backbone)
        except ValueError as e:
            reason = str(e).removeprefix(f"{path}: ")
            raise ValueError(
                f"recipe.gram.ckpt={path!r} does not fit the Gram teacher (the teacher's "
                f"backbone): {reason}"
            ) from None
        self.loaded = True

    @torch.no_grad()
    def copy_from(self, teacher_backbone: nn.Module) -> None:
        """The weights and buffers of ``teacher_backbone``, copied in. When
        they are sharded, each rank copies its own shards (both backbones
        sharded alike; ValueError naming the first that is not)."""
        source, target = teacher_backbone.state_dict(), self.backbone.state_dict()
        if any(isinstance(v, DTensor) for v in (*source.values(), *target.values())):
            _copy_shards(target, source)
        else:
            self.backbone.load_state_dict(source)
        self.loaded = True

    def before_step(self, iteration: int, teacher_backbone: nn.Module) -> bool:
        """At the start of ``iteration``: the EMA teacher's weights when it is
        ``it_load_ema_teacher``. Returns whether they were copied."""
        if not self.options.use_loss or iteration != self.options.it_load_ema_teacher:
            return False
        self.copy_from(teacher_backbone)
        return True

    def after_step(self, iteration: int, teacher_backbone: nn.Module) -> bool:
        """After the optimizer step of ``iteration``: a refresh when
        :func:`refresh_due`. Returns whether there was one."""
        if not refresh_due(self.options, iteration, self.updates):
            return False
        self.copy_from(teacher_backbone)
        self.updates += 1
        return True

    @torch.no_grad()
    def patch_tokens(self, glob: Sequence[torch.Tensor]) -> torch.Tensor:
        """Patch features [2B, N, D] of the global crops ``glob`` (after the
        final norm, no masks), on the student's grid: crops resized to
        ``teacher_crop_size`` first when set (a dict: the side it gives
        the crops' side, one per crop-size pair), features resized back
        (bicubic) when their grid differs."""
        images = torch.cat(list(glob))
        size = self.teacher_crop_size
        if isinstance(size, dict):
            size = size.get(images.shape[-1])
        student_grid = [s // self.backbone.patch_size for s in images.shape[-2:]]
        if size is not None and size != images.shape[-1]:
            images = F.interpolate(images, size=(size, size), mode="bicubic", align_corners=False)
        tokens = self.backbone.forward_features(images)["x_norm_patchtokens"]
        grid = [s // self.backbone.patch_size for s in images.shape[-2:]]
        if grid == student_grid:
            return tokens
        maps = tokens.transpose(1, 2).unflatten(-1, grid)
        maps = F.interpolate(maps, size=student_grid, mode="bicubic", align_corners=False)
        return maps.flatten(-2).transpose(1, 2)


class DINOv3Loss(DINOv2Loss):
    """:class:`DINOv2Loss` plus Gram anchoring: ``gram``
    (:class:`~dino_opt.ops.gram_loss.GramLoss`) weighted by
    ``gram.loss_weight``, and the Gram teacher ``gram_teacher``
    (:class:`GramTeacher`, in the state dict), ``gram`` the config's
    ``recipe.gram`` and ``crop_size_pairs`` the augmentation's. The other
    arguments are :class:`DINOv2Loss`'s."""

    def __init__(
        self,
        out_dim: int,
        ibot_out_dim: int,
        n_local: int,
        *,
        gram: GramConfig | None = None,
        crop_size_pairs: list[tuple[int, int]] = (),
        **dinov2,
    ) -> None:
        super().__init__(out_dim, ibot_out_dim, n_local, **dinov2)
        gram = gram or GramConfig()
        self.gram = GramLoss(
            apply_norm=gram.normalized,
            img_level=gram.img_level,
            remove_neg=gram.remove_neg,
            remove_only_teacher_neg=gram.remove_only_teacher_neg,
        )
        self.gram_teacher = GramTeacher(gram, crop_size_pairs)
        self.gram_weight = gram.loss_weight

    def gram_term(self, student: torch.Tensor, teacher: torch.Tensor, masks: torch.Tensor):
        """The Gram loss of the student's patch tokens [2B, N, D] against the
        Gram teacher's, over ``tokens_used`` (``masks`` [2B, N]: the
        student's masked patches)."""
        o = self.gram_teacher.options
        if o.tokens_used != "all":
            keep = masks if o.tokens_used == "masked" else ~masks
            student, teacher = student[keep], teacher[keep]
        # half-precision features are computed in float32 by the operator
        return self.gram(student, teacher.to(student.dtype), img_level=o.img_level)

    def forward(self, student, targets: TeacherTargets, mask_info: dict):
        """:class:`DINOv2Loss`'s total and parts, plus ``gram_weight`` times
        the Gram term (part ``gram``) when ``targets.gram`` holds the Gram
        teacher's features."""
        total, parts = super().forward(student, targets, mask_info)
        if targets.gram is None:
            return total, parts
        gram = self.gram_term(student.global_patches, targets.gram, mask_info["collated_masks"])
        parts["gram"] = gram.detach()
        return total + self.gram_weight * gram, parts


class GramTerm(StepHooks):
    """Gram anchoring as an extra term of the one step (added to
    :class:`~dino_opt.train.DINOv2Terms`): the Gram teacher's patch tokens of
    the global crops in the targets (once it has weights), the loss's weight
    from ``schedules.gram_weight``, and the teacher's load and refreshes at
    the optimizer steps' boundaries (``model.teacher_step``, restored on
    resume). The term itself is :meth:`DINOv3Loss.gram_term`."""

    def __init__(self, gram_teacher: GramTeacher) -> None:
        self.gram_teacher = gram_teacher

    def attach(self, trainer) -> None:
        # else it never has weights: no Gram term; made already by the job
        # (Recipe.frozen_copies, before the teacher is spread): as it is
        if self.gram_teacher.options.use_loss and self.gram_teacher.backbone is None:
            self.gram_teacher.attach(trainer.model.teacher.backbone)
            self.gram_teacher.to(trainer.device)

    def set_schedules(self, trainer, schedules: Schedules, iteration: int) -> None:
        if schedules.gram_weight is not None:
            trainer.loss_fn.gram_weight = float(schedules.gram_weight[iteration])

    def before_step(self, trainer) -> None:
        self.gram_teacher.before_step(trainer.model.teacher_step, trainer.model.teacher.backbone)

    def after_step(self, trainer) -> None:
        # the step just taken: update_teacher has counted it
        self.gram_teacher.after_step(trainer.model.teacher_step - 1, trainer.model.teacher.backbone)

    def targets(self, trainer, inputs, targets=None) -> TeacherTargets:
        if not self.gram_teacher.loaded:
            return targets
        crops, _ = inputs
        with trainer.autocast():
            gram = self.gram_teacher.patch_tokens(crops[:2])
        return targets._replace(gram=gram)


class DINOv3Trainer(DINOv2Trainer):
    """The one step with DINOv2's terms and the Gram term
    (:class:`GramTerm`), ``loss_fn`` a :class:`DINOv3Loss` whose Gram teacher
    is made here when the job has not made it (a copy of the teacher's
    backbone): see the module docstring. The student must keep its global
    patch tokens (the recipe's wrapper). ``gram_teacher``: the loss's."""

    def __init__(self, model, loss_fn, optimizer, config, device):
        self.gram_teacher = loss_fn.gram_teacher
        super().__init__(
            model, loss_fn, optimizer, config, device, extra_terms=(GramTerm(self.gram_teacher),)
        )
