"""Each recipe's demo: the DINO demo preset
(:data:`~dino_opt.config.DEMO_PRESET`) with the recipe's ``demo_changes``
(its module says them), what ``dino-opt train --demo RECIPE`` runs."""

from __future__ import annotations

from ...config import DEMO_PRESET
from . import dino, dinov2, dinov3, distill  # noqa: F401  (each registers its recipe)
from .base import RECIPES

__all__ = ["DEMO_PRESETS"]


def _merged(base: dict, changes: dict) -> dict:
    return {s: {**base.get(s, {}), **changes.get(s, {})} for s in {*base, *changes}}


DEMO_PRESETS = {name: _merged(DEMO_PRESET, r.demo_changes) for name, r in RECIPES.items()}
