"""DINOv3's Gram anchoring loss with dinov3's constructor and call
(``dinov3.loss.GramLoss``), backed by the fused ``dino_opt::gram_loss``."""

import torch
from torch import nn

from .library import gram_loss

__all__ = ["GramLoss"]


class GramLoss(nn.Module):
    """The mean squared difference between the Gram matrices (patch-to-patch
    similarities) of the student's and the Gram teacher's patch features.

    ``apply_norm``: divide each feature row by its L2 norm first.
    ``remove_neg``: clamp both the student's and the teacher's similarities at
    0. ``remove_only_teacher_neg``: clamp the teacher's at 0 and leave the
    student's as they are, as dinov3's code runs it (it clamps the teacher
    first, then the student where both are negative: a mask that is then
    empty). The two options exclude each other. ``img_level`` is taken and
    kept as dinov3 takes it; as in dinov3, the call's own ``img_level``
    (default True) decides.

    Differences from dinov3: no N x N matrix is made; float64 inputs are
    computed in float64 (dinov3 casts to float32); the target gets no gradient
    (dinov3's Gram teacher runs without one).
    """

    def __init__(
        self,
        apply_norm: bool = True,
        img_level: bool = True,
        remove_neg: bool = True,
        remove_only_teacher_neg: bool = False,
    ):
        super().__init__()
        if remove_neg and remove_only_teacher_neg:
            raise ValueError("GramLoss: remove_neg and remove_only_teacher_neg exclude each other")
        self.apply_norm = apply_norm
        self.img_level = img_level
        self.remove_neg = remove_neg
        self.remove_only_teacher_neg = remove_only_teacher_neg

    def forward(
        self, output_feats: torch.Tensor, target_feats: torch.Tensor, img_level: bool = True
    ) -> torch.Tensor:
        """``output_feats`` (student) and ``target_feats`` (Gram teacher):
        ``[B, N, D]``; with ``img_level`` a Gram matrix per image, else one over
        all B x N patches (``[B * N, D]`` is taken too). Returns a 0-dim float32
        tensor (float64 for float64 features)."""
        if img_level and (output_feats.dim() != 3 or target_feats.dim() != 3):
            raise ValueError(
                "GramLoss: img_level=True needs [B, N, D] features, got "
                f"{tuple(output_feats.shape)} and {tuple(target_feats.shape)}"
            )
        if not img_level:
            output_feats = output_feats.flatten(0, -2) if output_feats.dim() == 3 else output_feats
            target_feats = target_feats.flatten(0, -2) if target_feats.dim() == 3 else target_feats
        return gram_loss(
            output_feats,
            target_feats,
            apply_norm=self.apply_norm,
            remove_neg=self.remove_neg,
            remove_only_teacher_neg=self.remove_only_teacher_neg,
        )
