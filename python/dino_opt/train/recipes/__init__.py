"""The training recipes, one module each (:mod:`.dino`, :mod:`.dinov2`, :mod:`.dinov3`):
:func:`recipe_of` gives a config's."""

from .base import RECIPES, Recipe, recipe_of, register
from .dino import DINORecipe
from .dinov2 import DINOv2Recipe
from .dinov3 import DINOv3Recipe

__all__ = [
    "DINORecipe",
    "DINOv2Recipe",
    "DINOv3Recipe",
    "RECIPES",
    "Recipe",
    "recipe_of",
    "register",
]
