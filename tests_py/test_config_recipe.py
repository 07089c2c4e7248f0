"""The recipe's nested sections (recipe.dino, ibot, koleo, gram, distill):
parsed from nested YAML and dotted overrides, the old flat keys read with
one deprecation line (files and checkpoints written before), what a resume
may change as the fields' metadata, and the docs' key tables written from
the fields' help (scripts/config_tables.py)."""

import dataclasses
import sys
import warnings
from pathlib import Path

import pytest
import torch
import yaml
from dino_opt.config import (
    Config,
    ConfigError,
    DistillConfig,
    GramConfig,
    IBOTConfig,
    apply_overrides,
    config_to_yaml,
    default_config,
    key_table,
    load_config,
    may_change_on_resume,
    resume_differences,
    validate,
)
from dino_opt.train import build_models
from dino_opt.weights import open_teacher
from tiny import TINY

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import config_tables  # noqa: E402

# The recipe section as dino_opt wrote it before its sections were nested
# (into run folders' config.yaml and checkpoints' "config"): every key flat,
# here a dinov2 run with a separate iBOT head of 40 prototypes.
OLD_FLAT_RECIPE = {
    "name": "dinov2",
    "centering": "sinkhorn_knopp",
    "dino_loss_weight": 1.0,
    "ibot_loss_weight": 0.5,
    "koleo_loss_weight": 0.1,
    "mask_ratio_min_max": [0.1, 0.5],
    "mask_sample_probability": 0.5,
    "ibot_separate_head": True,
    "ibot_out_dim": 40,
    "gram_use_loss": True,
    "gram_loss_weight": 1.0,
    "gram_ckpt": None,
    "gram_it_load_ema_teacher": 0,
    "gram_rep_update": True,
    "gram_update_frequency": 50000,
    "gram_it_first_update": 0,
    "gram_max_updates": None,
    "gram_img_level": True,
    "gram_normalized": True,
    "gram_remove_neg": False,
    "gram_remove_only_teacher_neg": False,
    "gram_tokens_used": "all",
    "gram_teacher_crop_size": None,
    "gram_loss_weight_start": None,
    "gram_loss_weight_end": None,
    "gram_loss_weight_warmup_epochs": 0,
    "gram_loss_weight_cosine_epochs": None,
    "distill_teacher": None,
    "distill_mode": "features",
    "distill_teacher_scale": 1.0,
    "distill_teacher_dim": None,
    "distill_cls_weight": 1.0,
    "distill_patch_weight": 1.0,
    "distill_cosine_weight": 1.0,
    "distill_smooth_l1_weight": 1.0,
    "distill_local_weight": 0.0,
    "distill_standardize": False,
    "distill_whiten": 0.0,
    "distill_projector_hidden": 0,
    "distill_students": [],
    "distill_students_init_from": [],
}


def _deprecations(record) -> list[str]:
    return [str(w.message) for w in record if issubclass(w.category, FutureWarning)]


# ---------------------------------------------------------------- the sections


def test_the_recipe_nests_one_dataclass_per_concern():
    r = default_config().recipe
    assert isinstance(r.gram, GramConfig) and isinstance(r.distill, DistillConfig)
    assert isinstance(r.ibot, IBOTConfig) and r.ibot.out_dim == 65536
    assert (r.dino.loss_weight, r.ibot.loss_weight, r.koleo.loss_weight) == (1.0, 1.0, 0.1)
    d = default_config().to_dict()["recipe"]
    assert list(d) == ["name", "centering", "dino", "ibot", "koleo", "gram", "distill"]
    assert d["gram"]["loss_weight"] == 1.0 and d["ibot"]["mask_ratio_min_max"] == [0.1, 0.5]
    flat = default_config().to_flat_dict()
    assert flat["recipe.gram.loss_weight"] == 1.0 and flat["data.batch_size"] == 64
    # the YAML nests them too, each section's doc above it, each key's help beside it
    text = config_to_yaml(default_config())
    assert "\n  # Gram anchoring (dinov3)" in text and "\n  gram:\n" in text
    assert "\n    loss_weight: 1.0  # weight of the Gram anchoring loss" in text
    assert Config.from_dict(yaml.safe_load(text)) == default_config()


def test_nested_yaml_and_dotted_overrides(tmp_path):
    path = tmp_path / "cfg.yaml"
    path.write_text(
        "recipe:\n  name: dinov3\n  gram:\n    loss_weight: 2.0\n    max_updates: 3\n"
        "  ibot: {separate_head: true}\n"
    )
    cfg = load_config(path, ["recipe.gram.max_updates=5", "recipe.distill.cls_weight=0.5"])
    g = cfg.recipe.gram
    assert (g.loss_weight, g.max_updates, cfg.recipe.ibot.separate_head) == (2.0, 5, True)
    assert cfg.recipe.distill.cls_weight == 0.5
    assert {"recipe.gram.loss_weight", "recipe.gram.max_updates"} <= cfg.given_keys
    again = apply_overrides(cfg, ["recipe.gram.loss_weight=0.5"])
    assert (again.recipe.gram.loss_weight, again.recipe.gram.max_updates) == (0.5, 5)
    assert load_config({"recipe": {"name": "dinov2", "gram": None}}).recipe.gram == GramConfig()


@pytest.mark.parametrize(
    "source, overrides, needle",
    [
        (None, ["recipe.gram.los_weight=1"], "did you mean 'recipe.gram.loss_weight'?"),
        (None, ["recipe.gram=1"], "recipe.gram is a section; give one of its keys"),
        ({"recipe": {"gram": 5}}, [], "recipe.gram must be a mapping of keys (use_loss,"),
        (None, ["recipe.gram.loss_weight=-1"], "recipe.gram.loss_weight must be >= 0"),
        (None, ["recipe.distill.mode=both"], "recipe.distill.mode must be one of features"),
    ],
)
def test_nested_key_errors_in_one_line(source, overrides, needle):
    with pytest.raises(ConfigError) as e:
        load_config(source, overrides)
    assert len(e.value.errors) == 1 and needle in str(e.value) and "\n" not in str(e.value)


def test_validate_checks_a_nested_section_changed_in_code():
    cfg = default_config()
    cfg.recipe.gram.update_frequency = 0
    with pytest.raises(ConfigError, match="recipe.gram.update_frequency must be >= 1"):
        validate(cfg)
    cfg = default_config()
    cfg.recipe.distill = None
    with pytest.raises(ConfigError, match="recipe.distill must be a DistillConfig"):
        validate(cfg)


# ---------------------------------------------------------------- the old keys


def test_old_flat_keys_are_read_with_one_deprecation_line(tmp_path):
    path = tmp_path / "old.yaml"
    path.write_text(yaml.safe_dump({"recipe": OLD_FLAT_RECIPE}))
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        cfg = load_config(path)
    (line,) = _deprecations(record)
    assert "recipe.dino_loss_weight -> recipe.dino.loss_weight" in line and "\n" not in line
    assert (cfg.recipe.ibot.out_dim, cfg.recipe.ibot.loss_weight) == (40, 0.5)
    assert cfg.recipe.ibot.separate_head and cfg.recipe.centering == "sinkhorn_knopp"
    ibot = {"loss_weight": 0.5, "separate_head": True, "out_dim": 40}
    nested = {"recipe": {"name": "dinov2", "centering": "sinkhorn_knopp", "ibot": ibot}}
    assert cfg == load_config(nested)
    # an old key as an override, with the same line; it wins over the file's new key
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        over = load_config(nested, ["recipe.ibot_out_dim=48", "recipe.distill_teacher=t.pt"])
    assert len(_deprecations(record)) == 1
    assert (over.recipe.ibot.out_dim, over.recipe.distill.teacher) == (48, "t.pt")
    # and a new override wins over the file's old key
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert load_config(path, ["recipe.ibot.out_dim=64"]).recipe.ibot.out_dim == 64


def test_an_old_key_and_its_new_key_must_agree():
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        same = {"recipe": {"gram_loss_weight": 2.0, "gram": {"loss_weight": 2.0}}}
        assert load_config(same).recipe.gram.loss_weight == 2.0
        with pytest.raises(ConfigError, match="recipe.gram_loss_weight .the old name of "):
            load_config({"recipe": {"gram_loss_weight": 2.0, "gram": {"loss_weight": 1.0}}})


def test_a_checkpoint_with_an_old_flat_config_opens_and_resumes(tmp_path):
    ibot = [
        "recipe.ibot.loss_weight=0.5",
        "recipe.ibot.separate_head=true",
        "recipe.ibot.out_dim=40",
    ]
    new = load_config(None, [*TINY, "recipe.name=dinov2", "recipe.centering=sinkhorn_knopp", *ibot])
    old = {**new.to_dict(), "recipe": OLD_FLAT_RECIPE}
    _, teacher = build_models(new)
    path = tmp_path / "checkpoint.pth"
    torch.save({"teacher": teacher.state_dict(), "config": old}, path)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        opened = open_teacher(path, heads=True)  # built from the checkpoint's config
        assert resume_differences(old, new) == []  # the same run
        changed = resume_differences(old, apply_overrides(new, ["recipe.ibot.out_dim=48"]))
    assert _deprecations(record)
    assert (opened.out_dim, opened.ibot_out_dim) == (64, 40)
    assert changed == ["recipe.ibot.out_dim: 40 in the checkpoint, 48 now"]


# ---------------------------------------------------------------- resume


def test_what_a_resume_may_change_is_the_fields_metadata():
    assert may_change_on_resume("logging", "log_every")  # the section says so
    assert may_change_on_resume("data", "num_workers") and may_change_on_resume(
        "model", "init_from"
    )
    assert not may_change_on_resume("data", "batch_size")
    assert not may_change_on_resume("recipe", "gram.loss_weight")
    assert may_change_on_resume("eval", "removed_since")  # a key since removed: its section's
    saved = default_config().to_dict()
    now = load_config(
        None, ["logging.log_every=3", "data.num_workers=2", "recipe.koleo.loss_weight=0"]
    )
    assert resume_differences(saved, now) == [
        "recipe.koleo.loss_weight: 0.1 in the checkpoint, 0.0 now"
    ]


# ---------------------------------------------------------------- the docs' tables


def test_the_docs_key_tables_are_written_from_the_fields():
    assert config_tables.stale() == []  # run scripts/config_tables.py after changing a field
    table = key_table("recipe.gram").splitlines()
    assert table[0] == "| key | default | meaning |"
    assert len(table) == 2 + len(dataclasses.fields(GramConfig))
    assert table[2].startswith("| `recipe.gram.use_loss` | true | Gram anchoring on;")
    assert "| `recipe.distill.students` | [] |" in key_table("recipe.distill")
    assert key_table("recipe.centering").count("\n") == 3
    with pytest.raises(ConfigError, match="names no key"):
        key_table("recipe.nothing")
