"""``recipe.distill``: a distillation from a frozen teacher (the distill
recipe; dinov3's ``distillation:`` section), read as it is by the
distillation's losses, its student projectors and the memory model."""

from __future__ import annotations

from dataclasses import dataclass

from ..names import BACKBONE_NAMES
from ..option import option

__all__ = ["DistillConfig"]


@dataclass
class DistillConfig:
    """Distillation (the distill recipe): the frozen teacher, the mode, the terms, more students."""

    teacher: str | None = option(
        None,
        "the frozen teacher: a dino_opt run or checkpoint, or weights in any format "
        "model.init_from reads (DINO, DINOv2, DINOv3, timm, Hugging Face); required",
        check="nonempty",
    )
    mode: str = option(
        "features",
        "features (the student's projected class and patch tokens matched to the teacher's; any "
        "teacher, any student) or heads (DINOv2's losses against the teacher's head targets; a "
        "dino_opt teacher with heads, a ViT student)",
        choices=("features", "heads"),
    )
    teacher_scale: float = option(
        1.0, "the teacher's input side over the student's crop side", gt=0
    )
    teacher_dim: int | None = option(
        None,
        "the teacher's feature width; null: read from the teacher's file when the run starts",
        ge=1,
    )
    cls_weight: float = option(1.0, "weight of the class-token terms", ge=0)
    patch_weight: float = option(1.0, "weight of the patch-token terms", ge=0)
    cosine_weight: float = option(1.0, "weight of the cosine terms", ge=0)
    smooth_l1_weight: float = option(1.0, "weight of the smooth-L1 terms", ge=0)
    local_weight: float = option(
        0.0,
        "features: weight of the local crops' class tokens pulled to the teacher's of their "
        "image's global crops (DINO's local-to-global view; the teacher never sees a local "
        "crop); 0: the local crops are not used",
        ge=0,
    )
    standardize: bool = option(
        False,
        "features: the teacher's class and patch tokens standardised per channel over the "
        "batch (mean 0, variance 1) before they are matched, so that each channel weighs by how "
        "it varies between images, not by its size",
    )
    whiten: float = option(
        0.0,
        "features: the teacher's tokens whitened (running mean and covariance, ZCA) with this "
        "floor on the eigenvalues, relative to the largest, before they are matched; 0: not "
        "whitened",
        ge=0,
        le=1,
    )
    projector_hidden: int = option(
        0, "hidden width of the student's projectors; 0: one linear layer", ge=0
    )
    students: tuple[str, ...] = option(
        (),
        "features: more students beside model.backbone, by backbone name (or timm:NAME, "
        "torchvision:NAME, package.module:function), trained in the same run from the same "
        "teacher forward (each its own projector, parameter groups, clipping, EMA, evaluation "
        "and export)",
        choices=BACKBONE_NAMES,
    )
    students_init_from: tuple[str, ...] = option(
        (),
        "each of recipe.distill.students' first weights, in order (any file model.init_from "
        "reads; a network of your own: its state dict); none: random init; empty: all random",
    )
