"""The DINOv2 losses' options, each a section of ``recipe`` read by the
dinov2, dinov3 and distill (heads) recipes: ``recipe.dino`` (the class-token
loss), ``recipe.ibot`` (the masked-patch loss and its masks),
``recipe.koleo`` (the KoLeo regulariser), as dinov3's config nests them."""

from __future__ import annotations

from dataclasses import dataclass

from ..option import option

__all__ = ["DINOConfig", "IBOTConfig", "KoLeoConfig"]


@dataclass
class DINOConfig:
    """DINO's class-token loss in the DINOv2 recipes (the dino recipe has no weight of it)."""

    loss_weight: float = option(1.0, "weight of the class-token DINO loss", ge=0)


@dataclass
class IBOTConfig:
    """iBOT's masked-patch loss: its weight, its head and the loader's block masks."""

    loss_weight: float = option(1.0, "weight of the iBOT masked-patch loss", ge=0)
    mask_ratio_min_max: tuple[float, float] = option(
        (0.1, 0.5),
        "masked fraction of a masked crop's patches, spread over the batch",
        check="scale",
    )
    mask_sample_probability: float = option(
        0.5, "fraction of the global crops that are masked", gt=0, le=1
    )
    separate_head: bool = option(
        False, "a head of its own for the patch tokens (else DINO's head is shared)"
    )
    out_dim: int = option(
        65536, "prototypes of the separate iBOT head (recipe.ibot.separate_head)", ge=1
    )


@dataclass
class KoLeoConfig:
    """The KoLeo regulariser on the student's class tokens."""

    loss_weight: float = option(0.1, "weight of the KoLeo loss on the student's class tokens", ge=0)
