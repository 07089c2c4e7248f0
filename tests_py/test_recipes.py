"""The recipes as modules of their own: every recipe the config accepts is
registered (and the other way round), has a demo, and nothing outside the
recipes and the config's table of their needs tests a recipe's name."""

import re
from pathlib import Path

import pytest
from dino_opt.config import RECIPE_NEEDS, apply_overrides, default_config, load_config
from dino_opt.train import DEMO_PRESETS, RECIPES, build_loss, build_models, recipe_of
from dino_opt.train.recipes import DINORecipe, register
from dino_opt.tune import MEMORY_TERMS, terms_of

PACKAGE = Path(__file__).resolve().parent.parent / "python" / "dino_opt"
NAME_TEST = re.compile(r"\b(recipe|r)\.name\s*(==|!=|\bin\b)")


def test_the_config_and_the_registry_name_the_same_recipes():
    assert set(RECIPE_NEEDS) == set(RECIPES) == set(DEMO_PRESETS) == set(MEMORY_TERMS)
    for name, recipe in RECIPES.items():
        assert recipe.name == name
        # a distillation's demo names its teacher on the command line
        teacher = RECIPE_NEEDS[name].get("external_teacher")
        extra = ["recipe.distill.teacher=t.pt"] if teacher else []
        assert load_config(DEMO_PRESETS[name], extra).recipe.name == name


def test_nothing_outside_the_recipes_tests_a_recipe_name():
    found = [
        f"{path.relative_to(PACKAGE)}:{n}: {line.strip()}"
        for path in PACKAGE.rglob("*.py")
        if "recipes" not in path.parts
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if NAME_TEST.search(line)
    ]
    assert not found, found


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_each_recipe_builds_its_models_and_loss(name):
    extra = ["recipe.distill.teacher=t.pt"] if RECIPE_NEEDS[name].get("external_teacher") else []
    cfg = apply_overrides(
        default_config(),
        [f"recipe.name={name}", "model.backbone=vit_tiny", "model.out_dim=64", *extra],
    )
    student, teacher = build_models(cfg)
    assert type(student) is type(teacher)
    assert recipe_of(cfg) is RECIPES[name]
    assert isinstance(build_loss(cfg), type(RECIPES[name].build_loss(cfg)))


def test_a_name_is_registered_once_and_an_unknown_one_is_named():
    with pytest.raises(ValueError, match="'dino' is registered already"):
        register(DINORecipe())
    cfg = default_config()
    object.__setattr__(cfg.recipe, "name", "dinov9")
    with pytest.raises(ValueError, match="unknown recipe 'dinov9'; registered: "):
        recipe_of(cfg)


def test_a_recipe_without_memory_terms_is_named(monkeypatch):
    monkeypatch.delitem(MEMORY_TERMS, "dino")
    with pytest.raises(ValueError, match="memory model has no terms for recipe 'dino'"):
        terms_of(default_config())
