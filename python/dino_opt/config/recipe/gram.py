"""``recipe.gram``: the Gram anchoring of the dinov3 recipe (Siméoni et al.,
2025), the student's patch-to-patch similarities kept near those of a Gram
teacher, a frozen copy of the teacher's backbone; its options as dinov3's
``gram:`` section names them, read as they are by
:class:`~dino_opt.train.DINOv3Loss` and its Gram teacher, and checked
together and against the run's crops when a config is read
(:func:`gram_conflicts`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..option import option

__all__ = ["GramConfig", "gram_conflicts"]


@dataclass
class GramConfig:
    """Gram anchoring (dinov3): the Gram teacher's weights and refreshes, the loss, its weight."""

    use_loss: bool = option(
        True,
        "Gram anchoring on; false: no Gram teacher and no Gram term (DINOv3's pretraining and "
        "its ImageNet-1k recipe), the other recipe.gram keys not read",
    )
    loss_weight: float = option(1.0, "weight of the Gram anchoring loss (DINOv3's 7B run: 2)", ge=0)
    ckpt: str | None = option(
        None,
        "the Gram teacher's first weights, in any format model.init_from reads (a dino-opt "
        "checkpoint's teacher backbone, a backbone's state dict, DINOv3's, timm's or Hugging "
        "Face's files); null: none, the EMA teacher's at recipe.gram.it_load_ema_teacher",
    )
    it_load_ema_teacher: int = option(
        0,
        "at the start of this iteration the Gram teacher becomes a copy of the EMA teacher's "
        "backbone; -1: never (then recipe.gram.ckpt is needed)",
        ge=-1,
    )
    rep_update: bool = option(
        True, "refresh the Gram teacher from the EMA teacher every recipe.gram.update_frequency"
    )
    update_frequency: int = option(50000, "iterations between refreshes of the Gram teacher", ge=1)
    it_first_update: int = option(0, "no refresh before this many iterations are done", ge=0)
    max_updates: int | None = option(
        None, "the most refreshes of the Gram teacher; null: no limit", ge=0
    )
    img_level: bool = option(
        True, "one Gram matrix per image (false: one over the batch's patches)"
    )
    normalized: bool = option(True, "L2-normalise the patch features before their Gram matrices")
    remove_neg: bool = option(False, "clamp the student's and the Gram teacher's similarities at 0")
    remove_only_teacher_neg: bool = option(
        False,
        "clamp the Gram teacher's similarities at 0, the student's left as they are (as dinov3 "
        "runs it: it clamps the teacher first, so its later mask of pairs where both are "
        "negative is empty)",
    )
    tokens_used: str = option(
        "all",
        "the patch tokens of the Gram loss: all, or those masked or unmasked for the student "
        "(these two need recipe.gram.img_level: false)",
        choices=("all", "masked", "unmasked"),
    )
    teacher_crop_size: int | tuple[int, ...] | None = option(
        None,
        "side in pixels the global crops are resized to for the Gram teacher (its patch "
        "features are resized back to the student's grid, bicubic); a list: one per crop-size "
        "pair (DINOv3's gram_teacher_crops_size); null: the student's crops as they are",
        ge=1,
    )
    loss_weight_start: float | None = option(
        None,
        "the Gram weight's schedule: it starts here and rises linearly to recipe.gram.loss_weight "
        "over recipe.gram.loss_weight_warmup_epochs; null: recipe.gram.loss_weight",
        ge=0,
    )
    loss_weight_end: float | None = option(
        None,
        "after the warm-up the Gram weight follows a half cosine from recipe.gram.loss_weight to "
        "this value, then stays there; null: recipe.gram.loss_weight",
        ge=0,
    )
    loss_weight_warmup_epochs: int = option(0, "epochs of the Gram weight's linear warm-up", ge=0)
    loss_weight_cosine_epochs: int | None = option(
        None, "epochs of the Gram weight's cosine (then constant); null: the rest of the run", ge=0
    )

    def teacher_sides(self, crop_size_pairs: list[tuple[int, int]]) -> int | dict[int, int] | None:
        """The Gram teacher's input side: ``teacher_crop_size`` as it is, a
        list (one per crop-size pair) as a dict from each pair's global crop
        side to its Gram teacher side (a step knows its pair by its global
        crops' side)."""
        size = self.teacher_crop_size
        if not isinstance(size, tuple):
            return size
        if len(size) != len(crop_size_pairs):
            raise ValueError(
                f"recipe.gram.teacher_crop_size has {len(size)} sides for "
                f"{len(crop_size_pairs)} crop-size pair(s)"
            )
        return {g: s for (g, _), s in zip(crop_size_pairs, size, strict=True)}


def _sizes_conflicts(sizes: tuple[int, ...], pairs: list, patch: int) -> list[str]:
    """A list of Gram teacher crop sides: one per crop-size pair, multiples of
    the patch size, one side per global crop size (the step knows its pair by
    its global crops' side)."""
    key = "recipe.gram.teacher_crop_size"
    if len(sizes) != len(pairs):
        return [
            f"{key} has {len(sizes)} sizes for {len(pairs)} crop-size pair(s) "
            "(augmentation.global_crop_size / local_crop_size)"
        ]
    bad = [v for v in sizes if v % patch]
    if bad:
        return [f"{key} {list(sizes)}: {bad[0]} must be a multiple of model.patch_size ({patch})"]
    by_global: dict[int, int] = {}
    for (glob, _), side in zip(pairs, sizes, strict=True):
        if by_global.setdefault(glob, side) != side:
            return [
                f"{key} {list(sizes)} gives the global crop size {glob} two sides "
                f"({by_global[glob]} and {side}); pairs with one global size need one"
            ]
    return []


def gram_conflicts(cfg, needs: dict) -> list[str]:
    """The ``recipe.gram`` keys of a recipe with a Gram teacher (``needs``:
    the recipe's row of ``RECIPE_NEEDS``), checked together and against the
    run's crops, patch size and epochs (``cfg``: the whole config)."""
    name, g = cfg.recipe.name, cfg.recipe.gram
    if not needs.get("gram_teacher") or not g.use_loss:
        return []
    errors = []
    if g.ckpt is None and g.it_load_ema_teacher < 0:
        errors.append(
            f"recipe.name={name} needs weights for its Gram teacher: set recipe.gram.ckpt, "
            "or recipe.gram.it_load_ema_teacher >= 0 (it is -1)"
        )
    if g.remove_neg and g.remove_only_teacher_neg:
        errors.append(
            "recipe.gram.remove_neg and recipe.gram.remove_only_teacher_neg exclude each other"
        )
    if g.tokens_used != "all" and g.img_level:
        errors.append(
            f"recipe.gram.tokens_used={g.tokens_used} needs recipe.gram.img_level=false "
            "(a crop's masked or unmasked tokens vary in number: one Gram matrix over the batch)"
        )
    size, patch = g.teacher_crop_size, cfg.model.patch_size
    if isinstance(size, int) and size % patch:
        errors.append(
            f"recipe.gram.teacher_crop_size ({size}) must be a multiple of model.patch_size "
            f"({patch})"
        )
    if isinstance(size, tuple):
        errors += _sizes_conflicts(size, cfg.augmentation.crop_size_pairs, patch)
    cosine = g.loss_weight_cosine_epochs or 0
    if cfg.schedule.epochs != "auto" and g.loss_weight_warmup_epochs + cosine > cfg.schedule.epochs:
        errors.append(
            f"recipe.gram.loss_weight_warmup_epochs ({g.loss_weight_warmup_epochs}) plus "
            f"recipe.gram.loss_weight_cosine_epochs ({cosine}) must be <= schedule.epochs "
            f"({cfg.schedule.epochs})"
        )
    return errors
