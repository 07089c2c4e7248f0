"""The ``recipe`` section: which recipe trains, and its losses' sections
(``recipe.dino``, ``recipe.ibot``, ``recipe.koleo``, ``recipe.gram``,
``recipe.distill``), each the dataclass its users read."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..option import option
from .distill import DistillConfig
from .gram import GramConfig
from .losses import DINOConfig, IBOTConfig, KoLeoConfig

__all__ = ["RECIPE_NEEDS", "RecipeConfig"]

#: The recipes, and what each needs of the rest of a configuration, checked
#: when it is parsed (each recipe's module in dino_opt.train.recipes builds
#: everything else): ``patch_tokens``, a ViT backbone, with the reason.
RECIPE_NEEDS: dict[str, dict[str, str]] = {
    "dino": {},
    "dinov2": {"patch_tokens": "its iBOT loss is over patch tokens"},
    "dinov3": {
        "patch_tokens": "its iBOT and Gram anchoring losses are over patch tokens",
        "gram_teacher": "its Gram teacher is a whole copy of the teacher's backbone",
    },
    "distill": {"external_teacher": "it learns from the frozen teacher of recipe.distill.teacher"},
}


@dataclass
class RecipeConfig:
    """Which self-supervised recipe trains, and its losses' sections (nested below).

    DINO, DINOv2 (DINO + iBOT + KoLeo), DINOv3 (DINOv2's losses plus Gram
    anchoring), or a distillation from a frozen teacher."""

    name: str = option(
        "dino",
        "dino: the DINO loss over the class tokens; dinov2: DINO's loss plus iBOT's masked-patch "
        "loss and the KoLeo regulariser; dinov3: dinov2's losses plus Gram anchoring of the "
        "patch tokens to a Gram teacher; distill: learn from the frozen teacher of "
        "recipe.distill.teacher",
        choices=tuple(RECIPE_NEEDS),
    )
    centering: str = option(
        "centering",
        "dinov2, dinov3, distill (heads): the teacher's targets of the DINO and iBOT losses by "
        "softmax centering or sinkhorn_knopp",
        choices=("centering", "sinkhorn_knopp"),
    )
    dino: DINOConfig = field(default_factory=DINOConfig)
    ibot: IBOTConfig = field(default_factory=IBOTConfig)
    koleo: KoLeoConfig = field(default_factory=KoLeoConfig)
    gram: GramConfig = field(default_factory=GramConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
