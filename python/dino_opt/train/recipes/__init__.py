"""The training recipes, one module each (:mod:`.dino`, :mod:`.dinov2`,
:mod:`.dinov3`, :mod:`.distill`): :func:`recipe_of` gives a config's;
:data:`DEMO_PRESETS`, each one's demo."""

from .base import RECIPES, Recipe, WeightsReader, recipe_of, register
from .demos import DEMO_PRESETS
from .dino import DINORecipe
from .dinov2 import DINOv2Recipe
from .dinov3 import DINOv3Recipe
from .distill import DistillRecipe

__all__ = [
    "DEMO_PRESETS",
    "DINORecipe",
    "DINOv2Recipe",
    "DINOv3Recipe",
    "DistillRecipe",
    "RECIPES",
    "Recipe",
    "WeightsReader",
    "recipe_of",
    "register",
]
