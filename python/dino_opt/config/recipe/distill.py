"""``recipe.distill``: a distillation from a frozen teacher (the distill
recipe; dinov3's ``distillation:`` section), read as it is by the
distillation's losses, its student projectors and the memory model, and
checked together and against the rest of the run when a config is read
(:func:`distill_conflicts`)."""

from __future__ import annotations

from dataclasses import dataclass

from ..names import BACKBONE_NAMES, is_external
from ..option import option

__all__ = ["DistillConfig", "distill_conflicts"]


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


def distill_conflicts(cfg, needs: dict) -> list[str]:
    """The ``recipe.distill`` keys (and ``distributed.student_groups``) of a
    recipe with an external teacher (``needs``: the recipe's row of
    ``RECIPE_NEEDS``), checked together and against the run's backbone,
    crops, batch and start (``cfg``: the whole config); refused for another
    recipe."""
    name, d = cfg.recipe.name, cfg.recipe.distill
    if not needs.get("external_teacher"):
        if is_external(cfg.model.backbone):
            return [
                f"model.backbone={cfg.model.backbone!r}: a network of your own is a student "
                f"of recipe.name=distill (features), not of {name}"
            ]
        if d.students or d.students_init_from:
            return [f"recipe.distill.students is for recipe.name=distill, not {name}"]
        if cfg.distributed.student_groups:
            return [f"distributed.student_groups is for recipe.name=distill, not {name}"]
        return []
    errors = _students_conflicts(cfg) + _groups_conflicts(cfg)
    if d.teacher is None:
        errors.append(
            f"recipe.name={name} needs its teacher: set recipe.distill.teacher (a dino_opt run "
            "or checkpoint, or weights in any format model.init_from reads)"
        )
    starts = d.students_init_from
    if starts and len(starts) != len(d.students):
        errors.append(
            f"recipe.distill.students_init_from names {len(starts)} start(s) for "
            f"{len(d.students)} student(s) of recipe.distill.students, one each in its order "
            "('none': random initialisation)"
        )
    if d.mode == "heads" and not cfg.model.backbone.startswith("vit"):
        errors.append(
            f"recipe.distill.mode=heads trains a ViT student (its iBOT loss is over masked patch "
            f"tokens); model.backbone is {cfg.model.backbone!r} (use recipe.distill.mode=features)"
        )
    return errors + _features_conflicts(cfg)


def _features_conflicts(cfg) -> list[str]:
    """``recipe.distill.standardize`` or ``whiten`` (one of them): a features
    distillation; ``recipe.distill.local_weight``: a features distillation
    with local crops."""
    d = cfg.recipe.distill
    for key, value in (("standardize", d.standardize), ("whiten", d.whiten)):
        if value and d.mode != "features":
            return [
                f"recipe.distill.{key} is for recipe.distill.mode=features (heads matches the "
                "teacher's head outputs, not its tokens)"
            ]
    if d.standardize and d.whiten:
        return [
            f"recipe.distill.standardize and recipe.distill.whiten={d.whiten:g} both rescale "
            "the teacher's tokens; choose one"
        ]
    if d.local_weight == 0:
        return []
    if d.mode != "features":
        return [
            f"recipe.distill.local_weight={d.local_weight:g} is for recipe.distill.mode=features "
            "(heads trains on the local crops with DINOv2's losses already)"
        ]
    if cfg.augmentation.num_local_views == 0:
        return [
            f"recipe.distill.local_weight={d.local_weight:g} needs local crops; "
            "augmentation.num_local_views is 0"
        ]
    return []


def _students_conflicts(cfg) -> list[str]:
    """``recipe.distill.students``: distinct backbones beside
    ``model.backbone``, in a features distillation."""
    students = cfg.recipe.distill.students
    if not students:
        return []
    names = cfg.student_names
    if len(set(names)) < len(names):
        return [
            f"recipe.distill.students {list(students)} with model.backbone={cfg.model.backbone} "
            "names a backbone twice; each student is named by its backbone"
        ]
    if cfg.recipe.distill.mode != "features":
        return [
            "recipe.distill.students trains several students with recipe.distill.mode="
            f"features; got {cfg.recipe.distill.mode}"
        ]
    return []


def _groups_conflicts(cfg) -> list[str]:
    """``distributed.student_groups``: two students or more, a batch the
    students' ranks can split, no ``model.init_from`` (fsdp: ViT students,
    :func:`_sharding_conflicts`)."""
    if not cfg.distributed.student_groups:
        return []
    n = len(cfg.student_names)
    if n < 2:
        return [
            "distributed.student_groups puts each student on its own group of ranks; name more "
            "students with recipe.distill.students"
        ]
    errors = []
    if cfg.data.batch_size % n:
        errors.append(
            f"distributed.student_groups splits each batch's teacher forward over the {n} "
            f"students' ranks: data.batch_size ({cfg.data.batch_size}) must be a multiple of {n}"
        )
    if cfg.model.init_from is not None:
        errors.append(
            "model.init_from starts one network; with distributed.student_groups each rank "
            "trains one of several (set it to null)"
        )
    return errors
