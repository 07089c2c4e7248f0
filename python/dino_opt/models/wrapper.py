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

    #: whether a head sees the same number of rows at each call for a crop
    #: size (DINO's: one per crop); a wrapper whose heads also see a varying
    #: number of rows (DINOv2's masked patches) says False
    head_rows_fixed = True

    def __init__(self, backbone: nn.Module, head: nn.Module) -> None:
        super().__init__()
        self.backbone = backbone
        self.head = head

    def compile_heads(self, mode: str | None = None) -> None:
        """``torch.compile`` of each head with parameters (``head``, and an
        ``ibot_head`` where there is one) in place, whole (``fullgraph``):
        static shapes where ``head_rows_fixed``, else the rows dynamic (one
        graph for every count of masked patches). Dynamic rows keep the
        default mode where ``mode`` is ``reduce-overhead``: a CUDA graph is
        recorded per shape, so one per count of masked patches."""
        dynamic = not self.head_rows_fixed
        if dynamic and mode == "reduce-overhead":
            mode = "default"
        for name in ("head", "ibot_head"):
            head = getattr(self, name, None)
            if isinstance(head, nn.Module) and any(True for _ in head.parameters()):
                head.compile(mode=mode, fullgraph=True, dynamic=dynamic)

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
