"""The DINOv2 recipe's terms of the one step: DINO's class-token loss, iBOT's
loss on masked patch tokens and the KoLeo regulariser (:class:`DINOv2Terms`,
run by :class:`~dino_opt.train.MemoryOptimizedDINOTrainer`: the same AMP,
accumulation, clipping, optimizer step and EMA as every recipe).

The step follows DINOv2's (``SSLMetaArch.forward_backward``):

- teacher, on the global crops: class tokens through the DINO head, the
  masked patch tokens (the student's masks) through the iBOT head (DINO's,
  shared, unless ``recipe.ibot.separate_head``); targets by softmax centering
  (then the centers' update) or Sinkhorn-Knopp, at the iteration's teacher
  temperature; the two global crops' class targets swapped, so that each
  student global crop learns from the other crop's teacher;
- student: the global crops with their masks (masked patches replaced by the
  mask token) and the local crops, one head pass over the local and global
  class tokens and the masked patch tokens;
- loss: ``dino_w * (local + global) + koleo_w * KoLeo + ibot_w * iBOT``,
  the DINO terms over DINO's ``2 * (1 + n_local)`` pairs, KoLeo on each
  global crop's backbone class tokens.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..data import mask_targets
from ..models import MultiCropWrapper
from ..ops import Schedules
from ..ops.dinov2_loss import DINOLoss, KoLeoLoss, iBOTPatchLoss
from .trainer import MemoryOptimizedDINOTrainer, StepTerms

__all__ = [
    "DINOv2Loss",
    "DINOv2Terms",
    "DINOv2Trainer",
    "DINOv2Wrapper",
    "PatchStudentOutputs",
    "StudentOutputs",
    "TeacherTargets",
]


class TeacherTargets(NamedTuple):
    """The teacher's side of a step: DINO targets [2, B, K] (crop order
    swapped), iBOT targets [masked tokens, K'], and its head's class-token
    logits [2B, K] in crop order (for the health checks); ``gram``: a Gram
    teacher's patch features of the global crops [2B, N, D] (the dinov3
    recipe), else None."""

    dino: torch.Tensor
    ibot: torch.Tensor
    cls_logits: torch.Tensor
    gram: torch.Tensor | None = None


class DINOv2Loss(nn.Module):
    """The DINOv2 recipe's losses and their weights: ``dino``
    (:class:`~dino_opt.ops.dinov2_loss.DINOLoss`), ``ibot``
    (:class:`~dino_opt.ops.dinov2_loss.iBOTPatchLoss`), ``koleo``. The
    centers are buffers of ``dino`` and ``ibot`` (in the state dict)."""

    def __init__(
        self,
        out_dim: int,
        ibot_out_dim: int,
        n_local: int,
        *,
        student_temp: float = 0.1,
        center_momentum: float = 0.9,
        centering: str = "centering",
        weights: tuple[float, float, float] = (1.0, 1.0, 0.1),
    ) -> None:
        super().__init__()
        if centering not in ("centering", "sinkhorn_knopp"):
            raise ValueError(
                f"DINOv2Loss: centering must be centering or sinkhorn_knopp, got {centering!r}"
            )
        self.dino = DINOLoss(out_dim, student_temp, center_momentum)
        self.ibot = iBOTPatchLoss(ibot_out_dim, student_temp, center_momentum)
        self.koleo = KoLeoLoss()
        self.n_local = n_local
        self.centering = centering
        self.student_temp = student_temp
        self.dino_weight, self.ibot_weight, self.koleo_weight = weights

    @property
    def center(self) -> torch.Tensor:
        """The class-token center (what DINO's health checks read)."""
        return self.dino.center

    @torch.no_grad()
    def teacher_targets(self, cls_logits, patch_logits, temp, n_masked) -> TeacherTargets:
        """Targets from the teacher's head outputs: ``cls_logits`` [2B, K] in
        crop order, ``patch_logits`` [masked tokens, K'], ``n_masked`` the
        masked-token count, a [1] tensor (Sinkhorn-Knopp all-reduces it)."""
        b = cls_logits.shape[0] // 2
        swapped = torch.cat((cls_logits[b:], cls_logits[:b])).float()
        patches = patch_logits.float()
        if self.centering == "centering":
            dino = self.dino.softmax_center_teacher(swapped, teacher_temp=temp)
            self.dino.update_center(swapped)
            ibot = self.ibot.softmax_center_teacher(patches.unsqueeze(0), teacher_temp=temp)[0]
            self.ibot.update_center(patches.unsqueeze(0))
        else:
            dino = self.dino.sinkhorn_knopp_teacher(swapped, teacher_temp=temp)
            ibot = self.ibot.sinkhorn_knopp_teacher(
                patches, teacher_temp=temp, n_masked_patches_tensor=n_masked
            )
        return TeacherTargets(dino.view(2, b, -1), ibot, cls_logits.float())

    def forward(self, student, targets: TeacherTargets, mask_info: dict):
        """The weighted total and its parts (detached) from the student's
        head outputs ``student`` (:class:`StudentOutputs`); ``mask_info`` is
        :func:`~dino_opt.data.mask_targets` of the step's masks."""
        n_terms = 2 * (1 + self.n_local)
        parts = {}
        if self.n_local:
            local = self.dino(list(student.local_logits.chunk(self.n_local)), list(targets.dino))
            parts["dino_local"] = local / n_terms
        glob = self.dino([student.global_logits], [targets.dino.flatten(0, 1)])
        parts["dino_global"] = glob * 2 / n_terms
        parts["koleo"] = sum(self.koleo(c) for c in student.global_cls.float().chunk(2))
        parts["ibot"] = self.ibot.forward_masked(
            student.patch_logits,
            targets.ibot,
            student_masks_flat=mask_info["collated_masks"],
            n_masked_patches=len(mask_info["mask_indices_list"]),
            masks_weight=mask_info["masks_weight"],
        )
        dino = parts.get("dino_local", 0.0) + parts["dino_global"]
        total = (
            self.dino_weight * dino
            + self.koleo_weight * parts["koleo"]
            + self.ibot_weight * parts["ibot"]
        )
        return total, {k: v.detach() for k, v in parts.items()}


class StudentOutputs(NamedTuple):
    """The student's side of a step: head outputs of the local crops' and
    global crops' class tokens and of the masked patch tokens, and the global
    crops' backbone class tokens (KoLeo's input)."""

    local_logits: torch.Tensor | None
    global_logits: torch.Tensor
    patch_logits: torch.Tensor
    global_cls: torch.Tensor


class PatchStudentOutputs(NamedTuple):
    """:class:`StudentOutputs` and the global crops' patch tokens after the
    backbone's final norm, ``global_patches`` [2B, N, D] (a Gram loss's input)."""

    local_logits: torch.Tensor | None
    global_logits: torch.Tensor
    patch_logits: torch.Tensor
    global_cls: torch.Tensor
    global_patches: torch.Tensor


class DINOv2Wrapper(MultiCropWrapper):
    """A :class:`~dino_opt.models.MultiCropWrapper` with DINOv2's outputs:
    ``forward(crops)`` is DINO's (head outputs of every crop's class token,
    what evaluation and export use); ``forward(crops, mask_indices=...)``
    returns :class:`StudentOutputs` of the global crops ``crops[:2]`` (with
    ``masks`` [2B, tokens] replacing masked patches by the mask token) and the
    local crops ``crops[2:]``, the patch tokens at ``mask_indices`` (into the
    flattened [2B * tokens]) through ``ibot_head`` (None: DINO's head, shared).
    With ``keep_patch_tokens`` the outputs are :class:`PatchStudentOutputs`,
    which also hold the global crops' patch tokens. Going through ``forward`` keeps
    DistributedDataParallel's hooks."""

    head_rows_fixed = False  # the masked patches' count changes from step to step

    def __init__(self, backbone: nn.Module, head: nn.Module, ibot_head: nn.Module | None = None):
        super().__init__(backbone, head)
        self.ibot_head = ibot_head
        self.keep_patch_tokens = False

    def forward(self, crops, masks=None, mask_indices=None):
        if mask_indices is None:
            return super().forward(crops)
        glob, local = torch.cat(list(crops[:2])), crops[2:]
        if local and getattr(self.backbone, "packs_crops", False):  # one packed pass
            out, local_out = self.backbone.forward_features_list(
                [glob, torch.cat(list(local))], [masks, None]
            )
        else:
            out = self.backbone.forward_features(glob, masks=masks)
            local_out = self.backbone.forward_features(torch.cat(list(local))) if local else None
        cls = out["x_norm_clstoken"]
        patches = out["x_norm_patchtokens"].flatten(0, 1)[mask_indices]
        local_cls = cls[:0] if local_out is None else local_out["x_norm_clstoken"]
        rows = [local_cls, cls] if self.ibot_head is not None else [local_cls, cls, patches]
        logits = self.head(torch.cat(rows))
        n_local, n_glob = len(local_cls), len(cls)
        patch_logits = (
            self.ibot_head(patches) if self.ibot_head is not None else logits[n_local + n_glob :]
        )
        outputs = (
            logits[:n_local] if local else None,
            logits[n_local : n_local + n_glob],
            patch_logits,
            cls,
        )
        if self.keep_patch_tokens:
            return PatchStudentOutputs(*outputs, out["x_norm_patchtokens"])
        return StudentOutputs(*outputs)


class DINOv2Terms(StepTerms):
    """DINOv2's terms of the one step (:class:`~dino_opt.train.StepTerms`):
    the masked tokens' indices found on the host (the loader's masks are
    there; finding them on a GPU makes the host wait for it), the teacher's
    targets at the iteration's temperature (:meth:`DINOv2Loss.teacher_targets`),
    one student pass over the masked global crops and the local crops, and
    :class:`DINOv2Loss`. Crop batching does not apply."""

    def __init__(self) -> None:
        self.teacher_temp = 0.04

    def attach(self, trainer) -> None:
        if trainer.crop_batch_size:
            raise ValueError("crop_batch_size is not supported by the dinov2 recipe")

    def set_schedules(self, trainer, schedules: Schedules, iteration: int) -> None:
        if schedules.teacher_temp is not None:
            self.teacher_temp = float(schedules.teacher_temp[iteration])

    def inputs(self, trainer, crops, masks):
        if masks is None:
            raise ValueError("the dinov2 recipe needs the global crops' masks (masks=...)")
        if masks.shape[0] != 2 * crops[0].shape[0]:
            raise ValueError(
                f"masks: {masks.shape[0]} rows for {crops[0].shape[0]} images; "
                "need one per global crop (2B)"
            )
        info = mask_targets(masks)
        info = dict(zip(info, trainer.to_device(list(info.values())), strict=True))
        return trainer.to_device(crops), info

    def teacher_outputs(self, trainer, glob: list[torch.Tensor], info):
        """The teacher's head outputs of the global crops (the EMA teacher's)."""
        with trainer.autocast():
            return trainer.model.teacher(glob, mask_indices=info["mask_indices_list"])

    def targets(self, trainer, inputs, targets=None) -> TeacherTargets:
        crops, info = inputs
        out = self.teacher_outputs(trainer, crops[:2], info)
        if trainer.capture_outputs:
            trainer.captured["features"] = out.global_cls.detach().float()
        return trainer.loss_fn.teacher_targets(
            out.global_logits, out.patch_logits, self.teacher_temp, info["n_masked_patches"]
        )

    def student(self, trainer, inputs, views):
        crops, info = inputs
        return trainer.model.student(
            crops, masks=info["collated_masks"], mask_indices=info["mask_indices_list"]
        )

    def loss(self, trainer, out, targets, inputs, views, last):
        loss, parts = trainer.loss_fn(out, targets, inputs[1])
        if trainer.capture_outputs:
            trainer.captured.update(
                teacher_logits=targets.cls_logits,
                student_logits=out.global_logits.detach().float(),
                teacher_temp=self.teacher_temp,
            )
        return loss, parts


class DINOv2Trainer(MemoryOptimizedDINOTrainer):
    """The one step (:class:`~dino_opt.train.MemoryOptimizedDINOTrainer`) with
    :class:`DINOv2Terms`, ``loss_fn`` a :class:`DINOv2Loss`:
    ``train_step_optimized(crops, epoch, masks=...)`` needs the global crops'
    masks, bool [2B, h, w] (the native loader's ``Batch.masks``). The teacher
    temperature is the schedule's of the iteration (``set_schedules``)."""

    def __init__(self, model, loss_fn, optimizer, config, device, *, terms=None, extra_terms=()):
        super().__init__(
            model,
            loss_fn,
            optimizer,
            config,
            device,
            terms=terms or DINOv2Terms(),
            extra_terms=extra_terms,
        )
