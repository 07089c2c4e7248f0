"""Key layouts of ViT weights (DINO's, DINOv2's, timm's, Hugging Face's; DINOv3's), both
ways, and the architecture a state dict holds: what the export writes and the reader reads."""

from .dinov3 import DinoV3Arch
from .vit import ViTArch

__all__ = ["DinoV3Arch", "ViTArch"]
