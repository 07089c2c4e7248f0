"""DINOv2's names, for code written against facebookresearch/dinov2: the
losses (``dinov2.loss``), the masking and the collate (``dinov2.data``), the
ViT builders (``dinov2.models.vision_transformer``) and the parameter groups
(``dinov2.utils.param_groups``), each with dinov2's constructor and call,
backed by dino_opt's fused operators and native loader.

    from dino_opt.dinov2 import DINOLoss, iBOTPatchLoss, KoLeoLoss, MaskingGenerator

The training recipe itself is ``recipe.name: dinov2`` of ``dino-opt train``
(docs/dinov2.md).
"""

from .data import MaskingGenerator, collate_data_and_cast, mask_targets
from .models import vit_base, vit_giant2, vit_large, vit_small
from .ops.dinov2_loss import DINOLoss, KoLeoLoss, iBOTPatchLoss, sinkhorn_knopp
from .train import DINOv2Loss, DINOv2Trainer, dinov2_param_groups

__all__ = [
    "DINOLoss",
    "DINOv2Loss",
    "DINOv2Trainer",
    "KoLeoLoss",
    "MaskingGenerator",
    "collate_data_and_cast",
    "dinov2_param_groups",
    "iBOTPatchLoss",
    "mask_targets",
    "sinkhorn_knopp",
    "vit_base",
    "vit_giant2",
    "vit_large",
    "vit_small",
]
