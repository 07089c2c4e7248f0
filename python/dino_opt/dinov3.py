"""DINOv3's names, for code written against facebookresearch/dinov3, each
with dinov3's constructor and call, backed by dino_opt's fused operators:
for now the Gram anchoring loss (``dinov3.loss.GramLoss``).

    from dino_opt.dinov3 import GramLoss
"""

from .ops.gram_loss import GramLoss

__all__ = ["GramLoss"]
