"""The training recipes, one module each (:mod:`.dino`, :mod:`.dinov2`):
:func:`recipe_of` gives a config's."""

from .base import RECIPES, Recipe, recipe_of, register
from .dino import DINORecipe
from .dinov2 import DINOv2Recipe

__all__ = ["DINORecipe", "DINOv2Recipe", "RECIPES", "Recipe", "recipe_of", "register"]
