"""What a training recipe is, and the registry of recipes.

A recipe is one object that says everything it changes of a run: the
backbone options it needs (the position-embedding grid, a mask token), the
heads it wraps around student and teacher, its loss, the loader's masks, its
parameter groups, schedules and frozen last layer, its trainer step, the
frozen copies of the teacher's backbone its loss keeps and its demo preset
(its terms of the memory model are the memory model's:
:mod:`dino_opt.tune.memory.recipes`). The builders, the job and the memory
model ask :func:`recipe_of` and never test a recipe's name. Its configuration
keys (the ``recipe`` section) and what it needs of the rest of the
configuration are in :mod:`dino_opt.config`, which parses without building
anything.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import NamedTuple

from torch import nn

from ...config import Config

__all__ = ["RECIPES", "Recipe", "WeightsReader", "recipe_of", "register"]


class WeightsReader(NamedTuple):
    """What a recipe may read of weights files, handed down by the job
    (:func:`dino_opt.weights.weights_reader`; the weights package sits above
    the recipes): ``load_backbone(path, module)`` loads a backbone's weights
    of any format into ``module``; ``open_teacher(path, heads)`` opens a
    frozen teacher (:class:`~dino_opt.weights.OpenedTeacher`)."""

    load_backbone: Callable
    open_teacher: Callable


class Recipe(ABC):
    """The interface; :class:`~dino_opt.train.recipes.dino.DINORecipe` is
    the first implementation, and the others derive from it."""

    name: str = ""
    #: The changes to DINO's demo preset that make this recipe's demo
    #: (``dino-opt train --demo NAME``), as nested dicts of config sections.
    demo_changes: dict = {}
    #: Whether the EMA also copies the student's buffers (BatchNorm
    #: statistics): True where the EMA network never runs a training-mode
    #: forward that would keep its own (a distillation).
    ema_copies_buffers: bool = False
    #: Whether the recipe learns from a frozen teacher opened from a file (a
    #: distillation): the memory model then needs that network.
    external_teacher: bool = False

    @abstractmethod
    def backbone_options(self, cfg: Config) -> dict:
        """ViT options beyond ``cfg.model``'s: ``img_size`` (the position
        embeddings' grid when ``model.img_size`` is unset) and ``use_mask_token``."""

    @abstractmethod
    def wrap_models(self, cfg: Config, student: nn.Module, teacher: nn.Module | None):
        """Student and teacher as the recipe trains them, from DINO's pair
        (or, where :meth:`builds_heads` is False, from the student's
        backbone in a ``MultiCropWrapper`` without a head, and no teacher)."""

    def builds_heads(self, cfg: Config) -> bool:
        """Whether :meth:`wrap_models` starts from DINO's pair (a backbone
        and a DINO head each) rather than the student's backbone alone."""
        return True

    @abstractmethod
    def build_loss(self, cfg: Config) -> nn.Module:
        """The recipe's loss module, on the CPU."""

    @abstractmethod
    def loader_masks(self, cfg: Config) -> dict | None:
        """The loader's ``masks`` argument (block masks of the global crops), or None."""

    @abstractmethod
    def param_groups(self, cfg: Config, student: nn.Module) -> list[dict]:
        """The optimizer's parameter groups of ``student``."""

    @abstractmethod
    def build_schedules(self, cfg: Config, niter_per_epoch: int, base_lr: float):
        """The per-iteration schedules (:class:`~dino_opt.ops.Schedules`) from ``base_lr``."""

    @abstractmethod
    def freeze_last_layer(self, cfg: Config) -> int:
        """Epochs the trainer keeps the head's last layer frozen (0: the
        schedules do it)."""

    @abstractmethod
    def trainer_class(self, cfg: Config) -> type:
        """The one-step engine's class."""

    @abstractmethod
    def frozen_copies(
        self,
        cfg: Config,
        loss_fn: nn.Module,
        teacher: nn.Module,
        reader: WeightsReader | None = None,
    ) -> list[nn.Module]:
        """Makes the frozen copies of ``teacher``'s backbone that ``loss_fn``
        (the recipe's loss) keeps, :meth:`frozen_backbone_copies` of them,
        with the weights of files read through ``reader`` where the config
        names some, and returns them. The job calls it before it spreads the
        networks over the ranks (the teacher whole) and spreads each copy as
        the teacher's backbone (``fsdp``: sharded alike, so a copy of the
        teacher's weights stays local); a trainer makes them itself when
        they are not made yet."""

    @abstractmethod
    def resolve(self, cfg: Config, reader: WeightsReader) -> Config:
        """The config with what the recipe reads from files when a run
        starts written into it (a distillation: its teacher's widths), so
        that the saved config builds the same networks; ``cfg`` itself for
        the recipes that read nothing."""

    @abstractmethod
    def attach_teacher(self, cfg: Config, loss_fn: nn.Module, reader: WeightsReader):
        """Opens the frozen teacher the recipe learns from (distillation)
        through ``reader``, hands it to ``loss_fn`` and returns its network
        (for the job to place on its device); None for the recipes without
        one."""

    def student_configs(self, cfg: Config) -> list[Config]:
        """The configs of the students a run trains, one each (``cfg``
        alone, but for a distillation into several students)."""
        return [cfg]

    def student_alone(self, cfg: Config, index: int) -> Config:
        """The config of student ``index`` of :meth:`student_configs`
        trained alone (``cfg`` itself for a recipe of one student)."""
        if index != 0:
            raise ValueError(f"recipe {self.name} trains one student, not student {index}")
        return cfg

    def join_students(self, cfg: Config, pairs: list[tuple[nn.Module, nn.Module]]):
        """One (student, teacher) pair of the (student, teacher) ``pairs``
        of :meth:`student_configs`, for the recipes with several students."""
        raise ValueError(f"recipe {self.name} trains one student, got {len(pairs)}")

    # ---------------------------------------------------------- patch head, frozen copies

    @abstractmethod
    def patch_head_dim(self, cfg: Config) -> int:
        """Output dimension of the separate patch head (when there is one)."""

    @abstractmethod
    def frozen_backbone_copies(self, cfg: Config) -> int:
        """Frozen copies of the teacher's backbone the recipe keeps besides
        the teacher (DINOv3: its Gram teacher)."""


RECIPES: dict[str, Recipe] = {}


def register(recipe: Recipe) -> Recipe:
    """Adds ``recipe`` under its name (one recipe per name)."""
    if recipe.name in RECIPES:
        raise ValueError(f"a recipe named {recipe.name!r} is registered already")
    RECIPES[recipe.name] = recipe
    return recipe


def recipe_of(cfg: Config) -> Recipe:
    """The recipe ``cfg.recipe.name`` names."""
    try:
        return RECIPES[cfg.recipe.name]
    except KeyError:
        raise ValueError(
            f"recipe.name: unknown recipe {cfg.recipe.name!r}; registered: {sorted(RECIPES)}"
        ) from None
