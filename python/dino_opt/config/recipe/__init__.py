"""The ``recipe`` section and its nested sections, one module each by
concern: the DINOv2 losses (:mod:`.losses`), Gram anchoring (:mod:`.gram`),
distillation (:mod:`.distill`)."""

from .distill import DistillConfig, distill_conflicts
from .gram import GramConfig, gram_conflicts
from .losses import DINOConfig, IBOTConfig, KoLeoConfig
from .section import RECIPE_NEEDS, RecipeConfig

__all__ = [
    "RECIPE_NEEDS",
    "DINOConfig",
    "DistillConfig",
    "GramConfig",
    "IBOTConfig",
    "KoLeoConfig",
    "RecipeConfig",
    "distill_conflicts",
    "gram_conflicts",
]
