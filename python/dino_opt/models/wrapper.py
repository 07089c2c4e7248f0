"""Multi-crop forward: one backbone pass per resolution, one head pass in all."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

__all__ = ["MultiCropWrapper"]


class MultiCropWrapper(nn.Module):
    """Backbone + head over a list of crops of possibly different resolutions.

    ``forward(crops)`` takes a list of image batches (B, C, H, W) ordered as DINO
    orders them (global crops first, then local crops). Each run of consecutive
    crops with the same spatial size is concatenated along the batch dimension
    and goes through the backbone in one call (so 2 global + 10 local crops cost
    2 backbone calls, not 12); a backbone whose ``packs_crops`` is true (the
    ViTs) takes the whole list and runs every size in one packed pass. The
    features of all crops are then concatenated and go through the head once.
    The output is ``head(features)`` with the crops' rows in input order:
    shape (sum of batch sizes, head output dim). A single tensor is treated
    as a list of one crop.
    """

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    @staticmethod
    def resolution_groups(crops: Sequence[torch.Tensor]) -> list[tuple[int, int]]:
        """``[start, end)`` index ranges of consecutive crops of equal spatial size."""
        groups: list[tuple[int, int]] = []
        start = 0
        for i in range(1, len(crops) + 1):
            if i == len(crops) or crops[i].shape[-2:] != crops[start].shape[-2:]:
                groups.append((start, i))
                start = i
        return groups

    def forward_backbone(self, crops: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        """Backbone features of all crops, concatenated in input order."""
        if isinstance(crops, torch.Tensor):
            crops = [crops]
        if len(crops) == 0:
            raise ValueError("MultiCropWrapper: no crops given")
        if getattr(self.backbone, "packs_crops", False):
            return self.backbone(list(crops))
        feats = []
        for start, end in self.resolution_groups(crops):
            group = crops[start] if end - start == 1 else torch.cat(list(crops[start:end]))
            feats.append(self.backbone(group))
        return feats[0] if len(feats) == 1 else torch.cat(feats)

    def forward(self, crops: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
        return self.head(self.forward_backbone(crops))
