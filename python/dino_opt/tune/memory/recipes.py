"""The memory model's terms of each recipe, keyed by the recipe's name: the
masked tokens of a batch, the rows through the heads, what the loss keeps per
logit and what the teacher's (and a frozen copy's) pass leaves for the
student's. The recipes themselves (:mod:`dino_opt.train.recipes`) know none
of these; a new recipe adds its row to :data:`MEMORY_TERMS`."""

from __future__ import annotations

from ...config import Config
from ...data import mask_upperbound
from ...train import recipe_of
from .distill import FP32

__all__ = ["MEMORY_TERMS", "RecipeTerms", "terms_of"]


class RecipeTerms:
    """DINO's terms: no masks, every crop's class token through the DINO
    head, the fused loss's float32 copy of the logits."""

    def masked_tokens(self, cfg: Config, global_tokens: int) -> int:
        """The most masked patch tokens of a batch (rows of a patch loss)."""
        return 0

    def head_rows(self, rows: int, masked: int, separate_patch_head: bool) -> tuple[int, int]:
        """(rows through the DINO head, rows through a separate patch head),
        given the class-token rows and the masked tokens."""
        return rows, 0

    def loss_bytes_per_logit(self, a: int) -> int:
        """What the loss keeps per head logit besides the logits in the
        autocast dtype (``a`` bytes)."""
        return a + FP32  # the fused loss's float32 copy of the logits

    def teacher_output_bytes(self, cfg: Config, global_rows: int, masked: int, a: int) -> int:
        """What the teacher's pass leaves for the student's."""
        # the teacher's logits of the global crops, autocast dtype and float32
        return global_rows * cfg.model.out_dim * (a + FP32)

    def frozen_copy_output_bytes(self, cfg: Config, embed_dim: int, batch: int) -> int:
        """What the recipe's frozen copies of the teacher's backbone leave
        for the student's loss."""
        return 0


class DINOv2Terms(RecipeTerms):
    """DINOv2's: iBOT's masked tokens (through the DINO head, or a patch head
    of their own), the loss's float32 log-probabilities, iBOT's targets."""

    def masked_tokens(self, cfg: Config, global_tokens: int) -> int:
        ibot = cfg.recipe.ibot
        return mask_upperbound(
            2 * cfg.data.batch_size,
            global_tokens,
            tuple(ibot.mask_ratio_min_max),
            ibot.mask_sample_probability,
        )

    def head_rows(self, rows: int, masked: int, separate_patch_head: bool) -> tuple[int, int]:
        return (rows, masked) if separate_patch_head else (rows + masked, 0)

    def loss_bytes_per_logit(self, a: int) -> int:
        return a + 2 * FP32  # DINOv2's loss also keeps its float32 log-probabilities

    def teacher_output_bytes(self, cfg: Config, global_rows: int, masked: int, a: int) -> int:
        # float32 targets and logits of the class tokens, the masked tokens' iBOT targets
        k = cfg.model.out_dim
        return global_rows * k * 2 * FP32 + masked * recipe_of(cfg).patch_head_dim(cfg) * FP32


class DINOv3Terms(DINOv2Terms):
    """DINOv3's: DINOv2's, and the Gram teacher's patch tokens."""

    def frozen_copy_output_bytes(self, cfg: Config, embed_dim: int, batch: int) -> int:
        if not cfg.recipe.gram.use_loss:
            return 0
        # the Gram teacher's patch tokens of the global crops, float32, kept for the Gram loss
        side = cfg.augmentation.largest_crop_sizes[0] // cfg.model.patch_size  # the largest pair
        return 2 * batch * side * side * embed_dim * FP32


class DistillTerms(DINOv2Terms):
    """A distillation's: DINOv2's through heads; no masks between features."""

    def masked_tokens(self, cfg: Config, global_tokens: int) -> int:
        return super().masked_tokens(cfg, global_tokens) if recipe_of(cfg).builds_heads(cfg) else 0


#: Recipe name -> its terms (every registered recipe has a row; tests_py/test_recipes.py).
MEMORY_TERMS: dict[str, RecipeTerms] = {
    "dino": RecipeTerms(),
    "dinov2": DINOv2Terms(),
    "dinov3": DINOv3Terms(),
    "distill": DistillTerms(),
}


def terms_of(cfg: Config) -> RecipeTerms:
    """The terms of the recipe ``cfg.recipe.name`` names."""
    recipe_of(cfg)  # an unknown recipe: its own line
    try:
        return MEMORY_TERMS[cfg.recipe.name]
    except KeyError:
        raise ValueError(
            f"recipe.name: the memory model has no terms for recipe {cfg.recipe.name!r} "
            "(dino_opt.tune.memory.recipes.MEMORY_TERMS)"
        ) from None
