"""The typed configuration: DINO defaults, YAML round trips, overrides, errors."""

import json
import os
import re

import pytest
import yaml
from dino_opt.cli import main
from dino_opt.config import (
    Config,
    ConfigError,
    apply_overrides,
    config_to_yaml,
    default_config,
    effective_lr,
    load_config,
    save_config,
    validate,
)
from dino_opt.config import load as config_module


def write(tmp_path, text, name="cfg.yaml"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


# ---------------------------------------------------------------------------
# Defaults
# ---------------------------------------------------------------------------


def test_defaults_are_dinos_vit_s16_recipe():
    c = default_config()
    # facebookresearch/dino main_dino.py defaults (docs/design.md, "The algorithm").
    assert (c.model.backbone, c.model.patch_size) == ("vit_small", 16)
    assert c.model.out_dim == 65536
    assert c.model.norm_last_layer is True and c.model.use_bn_in_head is False
    assert (c.model.hidden_dim, c.model.bottleneck_dim) == (2048, 256)
    assert c.model.drop_path_rate == 0.1
    assert c.data.batch_size == 64
    assert (c.augmentation.global_crop_size, c.augmentation.local_crop_size) == (224, 96)
    assert c.augmentation.num_local_views == 8
    assert c.augmentation.global_crops_scale == (0.4, 1.0)
    assert c.augmentation.local_crops_scale == (0.05, 0.4)
    a = c.augmentation
    assert (a.flip_p, a.jitter_p, a.grayscale_p) == (0.5, 0.8, 0.2)
    assert (a.brightness, a.contrast, a.saturation, a.hue) == (0.4, 0.4, 0.2, 0.1)
    assert a.blur_sigma == (0.1, 2.0)
    assert (a.blur_p_global1, a.blur_p_global2, a.blur_p_local) == (1.0, 0.1, 0.5)
    assert a.solarize_p_global2 == 0.2
    o = c.optim
    assert o.optimizer == "adamw"
    assert (o.lr, o.min_lr) == (0.0005, 1e-6)
    assert (o.weight_decay, o.weight_decay_end) == (0.04, 0.4)
    assert o.clip_grad == 3.0 and o.freeze_last_layer == 1 and o.accumulation_steps == 1
    s = c.schedule
    assert (s.epochs, s.warmup_epochs) == (100, 10)
    assert s.momentum_teacher == 0.996
    assert (s.warmup_teacher_temp, s.teacher_temp, s.warmup_teacher_temp_epochs) == (
        0.04,
        0.04,
        0,
    )
    assert (s.student_temp, s.center_momentum) == (0.1, 0.9)
    assert (c.eval.knn_k, c.eval.knn_temperature) == (20, 0.07)
    assert c.hardware.seed == 0 and c.hardware.precision == "auto"
    assert c.data.root is None and c.data.num_workers is None and c.checkpoint.resume == "auto"
    # torchrun's --max-restarts default; the faults are injected only when asked for
    assert c.distributed.max_restarts == 3 and c.debug.inject_kill_at_step is None
    assert c.debug.inject_attempts == 1


def test_default_config_is_a_fresh_object_each_call():
    a, b = default_config(), default_config()
    a.data.batch_size = 8
    assert b.data.batch_size == 64
    assert Config() == default_config() != a


def test_defaults_pass_validation():
    assert validate(default_config()) == Config()


def test_to_dict_is_plain_and_yaml_safe():
    d = default_config().to_dict()
    assert list(d) == [
        "data",
        "augmentation",
        "model",
        "optim",
        "schedule",
        "recipe",
        "hardware",
        "logging",
        "checkpoint",
        "eval",
        "health",
        "distributed",
        "debug",
    ]
    assert d["augmentation"]["global_crops_scale"] == [0.4, 1.0]
    assert isinstance(d["augmentation"]["blur_sigma"], list)
    yaml.safe_dump(d)  # raises on anything but builtins
    assert json.loads(json.dumps(d)) == d


# ---------------------------------------------------------------------------
# Round trips and partial input
# ---------------------------------------------------------------------------


def custom_config():
    c = default_config()
    c.data.root = "/data/imagenet/train"
    c.data.batch_size = 32
    c.data.num_workers = 6
    c.data.dtype = "bfloat16"
    c.augmentation.local_crops_scale = (0.1, 0.3)
    c.model.backbone = "vit_tiny"
    c.model.patch_size = 8
    c.optim.min_lr = 2.5e-7
    c.optim.fused = False
    c.schedule.warmup_teacher_temp_epochs = 30
    c.schedule.teacher_temp = 0.07
    c.hardware.device = "cuda:1"
    c.hardware.crop_batch_size = 4
    c.logging.output_dir = "true"  # a string that YAML would read as a bool unquoted
    c.checkpoint.resume = "auto"
    return c


@pytest.mark.parametrize("comments", [True, False])
def test_yaml_round_trip(tmp_path, comments):
    cfg = custom_config()
    text = config_to_yaml(cfg, comments=comments)
    assert Config.from_dict(yaml.safe_load(text)) == cfg
    path = save_config(cfg, tmp_path / "run" / "config.yaml")
    assert path == tmp_path / "run" / "config.yaml"
    loaded = load_config(path)
    assert loaded == cfg
    assert loaded.logging.output_dir == "true"
    assert loaded.augmentation.local_crops_scale == (0.1, 0.3)


def test_yaml_comments_document_keys_and_choices():
    text = config_to_yaml(default_config())
    line = next(ln for ln in text.splitlines() if ln.startswith("  backbone:"))
    assert "vit_tiny | vit_small | vit_base | vit_large | vit_giant2 | vit_small_dinov3 |" in line
    assert "| vit_7b_dinov3 | resnet18 | resnet50" in line
    assert "  global_crops_scale: [0.4, 1.0]  #" in text
    assert "# " not in config_to_yaml(default_config(), comments=False)


def test_from_dict_partial_and_empty():
    assert Config.from_dict(None) == default_config()
    assert Config.from_dict({}) == default_config()
    assert Config.from_dict({"data": None}) == default_config()
    c = Config.from_dict({"model": {"backbone": "vit_tiny"}, "optim": {"lr": 1}})
    assert c.model.backbone == "vit_tiny"
    assert c.optim.lr == 1.0 and isinstance(c.optim.lr, float)  # an int where a float belongs
    assert c.data == default_config().data


def test_load_config_none_and_empty_file_give_defaults(tmp_path):
    assert load_config(None) == default_config()
    assert load_config(write(tmp_path, "")) == default_config()
    assert load_config(write(tmp_path, "# nothing but a comment\n")) == default_config()


def test_partial_yaml(tmp_path):
    path = write(
        tmp_path,
        "data:\n  batch_size: 16\naugmentation:\n  num_local_views: 4\n"
        "model:\n  backbone: resnet18\noptim:\n  min_lr: 1e-7\nschedule:\n",
    )
    c = load_config(path)
    assert c.data.batch_size == 16
    assert c.augmentation.num_local_views == 4
    assert c.model.backbone == "resnet18"
    assert c.optim.min_lr == 1e-7  # PyYAML reads 1e-7 (no dot) as a string
    assert c.schedule == default_config().schedule
    assert c.data.pin_memory is True


# ---------------------------------------------------------------------------
# Overrides
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, section, key, expected",
    [
        ("data.batch_size=32", "data", "batch_size", 32),
        ("optim.lr=0.001", "optim", "lr", 0.001),
        ("optim.min_lr=1e-6", "optim", "min_lr", 1e-6),
        ("optim.clip_grad=0", "optim", "clip_grad", 0.0),
        ("hardware.compile=true", "hardware", "compile", True),
        ("data.pin_memory=False", "data", "pin_memory", False),
        ("model.backbone=vit_tiny", "model", "backbone", "vit_tiny"),
        ("hardware.device=cuda:0", "hardware", "device", "cuda:0"),
        ("logging.output_dir=2024", "logging", "output_dir", "2024"),
        ("data.root='my images'", "data", "root", "my images"),
        # a path is a path: no YAML comment cut at its '#'; quoted, YAML's string
        ("model.init_from=runs/exp #3/ckpt.pth", "model", "init_from", "runs/exp #3/ckpt.pth"),
        ('model.init_from="~"', "model", "init_from", "~"),
        ("data.root=a: b", "data", "root", "a: b"),
        (
            "augmentation.global_crops_scale=[0.3,1.0]",
            "augmentation",
            "global_crops_scale",
            (0.3, 1.0),
        ),
        ("augmentation.local_crops_scale=0.1,0.5", "augmentation", "local_crops_scale", (0.1, 0.5)),
        ("augmentation.blur_sigma=(0.5, 1)", "augmentation", "blur_sigma", (0.5, 1.0)),
        ("data.num_workers=null", "data", "num_workers", None),
        ("data.num_workers=None", "data", "num_workers", None),
        ("optim.fused=", "optim", "fused", None),
        ("checkpoint.resume=~", "checkpoint", "resume", None),
        ("data.num_workers=3", "data", "num_workers", 3),
        ("distributed.max_restarts=0", "distributed", "max_restarts", 0),
        ("debug.inject_kill_at_step=7", "debug", "inject_kill_at_step", 7),
    ],
)
def test_override_types(override, section, key, expected):
    base = default_config()
    base.checkpoint.resume = "auto"
    base.optim.fused = True
    c = apply_overrides(base, [override])
    value = getattr(getattr(c, section), key)
    assert value == expected and type(value) is type(expected)
    assert base.checkpoint.resume == "auto"  # the input is left as it was


def test_overrides_apply_on_top_of_the_file_in_order(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 16\nschedule:\n  epochs: 5\n  warmup_epochs: 1\n")
    c = load_config(path, ["data.batch_size=8", "schedule.epochs=3", "data.batch_size=4"])
    assert c.data.batch_size == 4 and c.schedule.epochs == 3 and c.schedule.warmup_epochs == 1


def test_an_override_can_fix_the_file(tmp_path):
    # Relations are checked on the merged result, not the file alone.
    path = write(tmp_path, "schedule:\n  epochs: 5\n")
    with pytest.raises(ConfigError, match=r"warmup_epochs \(10\) must be <= schedule.epochs"):
        load_config(path)
    assert load_config(path, ["schedule.warmup_epochs=2"]).schedule.warmup_epochs == 2


def test_a_single_override_string_is_one_override():
    assert load_config(None, "data.batch_size=7").data.batch_size == 7


@pytest.mark.parametrize(
    "override, pattern",
    [
        ("data.batch_size", r"override 'data.batch_size' must be key=value"),
        (
            "batch_size=3",
            r"override key 'batch_size' must be section.key.*did you mean 'data.batch_size'",
        ),
        ("data.x.y=3", r"override key 'data.x.y' must be section.key"),
        ("datta.batch_size=3", r"unknown section 'datta' \(did you mean 'data'\?"),
        ("data.batchsize=3", r"unknown key 'data.batchsize' \(did you mean 'data.batch_size'\?"),
    ],
)
def test_bad_overrides(override, pattern):
    with pytest.raises(ConfigError, match=pattern):
        load_config(None, [override])


# ---------------------------------------------------------------------------
# Unknown names
# ---------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest_and_lists_the_section():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"data": {"batchsize": 32}})
    msg = str(e.value)
    assert msg.startswith("unknown key 'data.batchsize' (did you mean 'data.batch_size'? ")
    assert "known keys in data: root, batch_size, num_workers, pin_memory" in msg


def test_unknown_key_in_the_wrong_section_points_to_the_right_one():
    with pytest.raises(
        ConfigError, match=r"unknown key 'optim.epochs' \(did you mean 'schedule.epochs'"
    ):
        Config.from_dict({"optim": {"epochs": 3}})


def test_unknown_sections():
    with pytest.raises(ConfigError, match=r"unknown section 'modle' \(did you mean 'model'\?"):
        Config.from_dict({"modle": {}})
    with pytest.raises(
        ConfigError, match=r"unknown section 'batch_size' \(did you mean 'data.batch_size'"
    ):
        Config.from_dict({"batch_size": 32})
    with pytest.raises(ConfigError, match=r"unknown section 'zzz' \(known sections: data, aug"):
        Config.from_dict({"zzz": {}})


def test_unknown_key_no_suggestion():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"eval": {"qqqqqq": 1}})
    assert "did you mean" not in str(e.value)
    assert "known keys in eval: knn_k, knn_temperature, every_epochs" in str(e.value)


def test_unknown_key_in_a_file_names_the_file(tmp_path):
    path = write(tmp_path, "model:\n  backbon: vit_tiny\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: unknown key 'model.backbon'")):
        load_config(path)


# ---------------------------------------------------------------------------
# Bad values
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        ("data", "batch_size", "abc", "data.batch_size must be an int, got 'abc'"),
        ("data", "batch_size", 32.5, "data.batch_size must be an int, got 32.5"),
        ("data", "batch_size", True, "data.batch_size must be an int, got True"),
        ("data", "batch_size", None, "data.batch_size must be an int, got null"),
        ("data", "num_workers", "four", "data.num_workers must be an int or null, got 'four'"),
        ("data", "pin_memory", 1, "data.pin_memory must be a bool (true or false), got 1"),
        ("data", "pin_memory", "yes", "data.pin_memory must be a bool (true or false), got 'yes'"),
        ("optim", "lr", "fast", "optim.lr must be a finite number, got 'fast'"),
        ("optim", "lr", [1], "optim.lr must be a finite number, got [1]"),
        ("model", "backbone", 5, "model.backbone must be a string, got 5"),
        (
            "augmentation",
            "global_crops_scale",
            [0.4],
            "augmentation.global_crops_scale must be a pair of numbers [lo, hi], got [0.4]",
        ),
        (
            "augmentation",
            "blur_sigma",
            ["a", 1],
            "augmentation.blur_sigma must be a pair of numbers [lo, hi], got ['a', 1]",
        ),
        ("data", "root", {"a": 1}, "data.root must be a string or null, got {'a': 1}"),
    ],
)
def test_wrong_types(section, key, value, message):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({section: {key: value}})
    assert str(e.value) == message


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (
            "schedule",
            "momentum_teacher",
            1.5,
            "schedule.momentum_teacher must be in [0, 1], got 1.5",
        ),
        ("schedule", "center_momentum", -0.1, "schedule.center_momentum must be in [0, 1]"),
        ("data", "batch_size", 0, "data.batch_size must be >= 1, got 0"),
        ("data", "num_workers", 0, "data.num_workers must be >= 1, got 0"),
        ("data", "prefetch", 0, "data.prefetch must be >= 1"),
        ("augmentation", "num_local_views", -1, "augmentation.num_local_views must be >= 0"),
        ("augmentation", "flip_p", -0.1, "augmentation.flip_p must be in [0, 1], got -0.1"),
        (
            "augmentation",
            "solarize_p_global2",
            1.01,
            "augmentation.solarize_p_global2 must be in [0, 1]",
        ),
        ("augmentation", "hue", 0.6, "augmentation.hue must be in [0, 0.5], got 0.6"),
        ("augmentation", "brightness", -1, "augmentation.brightness must be >= 0"),
        (
            "augmentation",
            "local_crops_scale",
            [0, 0.4],
            "augmentation.local_crops_scale must be [lo, hi] with 0 < lo <= hi <= 1, "
            "got [0.0, 0.4]",
        ),
        (
            "augmentation",
            "global_crops_scale",
            [0.5, 0.3],
            "augmentation.global_crops_scale must be [lo, hi] with 0 < lo <= hi <= 1",
        ),
        (
            "augmentation",
            "global_crops_scale",
            [0.5, 1.2],
            "augmentation.global_crops_scale must be [lo, hi] with 0 < lo <= hi <= 1",
        ),
        (
            "augmentation",
            "blur_sigma",
            [2.0, 1.0],
            "augmentation.blur_sigma must be [lo, hi] with lo <= hi, got [2.0, 1.0]",
        ),
        ("augmentation", "blur_sigma", [0, 1], "both ends of augmentation.blur_sigma must be > 0"),
        ("model", "drop_path_rate", 1.0, "model.drop_path_rate must be in [0, 1), got 1.0"),
        ("model", "out_dim", 0, "model.out_dim must be >= 1"),
        ("optim", "lr", 0, "optim.lr must be > 0, got 0.0"),
        ("optim", "lr", float("nan"), "optim.lr must be a finite number, got nan"),
        ("optim", "clip_grad", float("inf"), "optim.clip_grad must be a finite number, got inf"),
        ("optim", "accumulation_steps", 0, "optim.accumulation_steps must be >= 1"),
        ("schedule", "teacher_temp", 0.0, "schedule.teacher_temp must be > 0"),
        ("schedule", "epochs", 0, "schedule.epochs must be >= 1"),
        ("hardware", "seed", -1, "hardware.seed must be in [0, 4294967295], got -1"),
        ("hardware", "crop_batch_size", 0, "hardware.crop_batch_size must be >= 1"),
        ("logging", "log_every", 0, "logging.log_every must be >= 1"),
        ("checkpoint", "keep", 0, "checkpoint.keep must be >= 1"),
        ("checkpoint", "resume", "  ", "checkpoint.resume must be a non-empty string or null"),
        ("eval", "knn_k", 0, "eval.knn_k must be >= 1"),
        ("eval", "knn_temperature", 0, "eval.knn_temperature must be > 0"),
        ("data", "shuffle_buffer", 0, "data.shuffle_buffer must be >= 1"),
        ("data", "index_dir", " ", "data.index_dir must be a non-empty string or null"),
        ("data", "image_column", "", "data.image_column must be a non-empty string or null"),
        ("eval", "val_root", "", "eval.val_root must be a non-empty string or null"),
        ("distributed", "max_restarts", -1, "distributed.max_restarts must be >= 0"),
        ("debug", "inject_kill_at_step", 0, "debug.inject_kill_at_step must be >= 1"),
        ("debug", "inject_attempts", 0, "debug.inject_attempts must be >= 1"),
    ],
)
def test_range_errors(section, key, value, message):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({section: {key: value}})
    assert str(e.value).startswith(message)


@pytest.mark.parametrize(
    "section, key, value, message",
    [
        (
            "model",
            "backbone",
            "vit_smal",
            "model.backbone must be one of vit_tiny, vit_small, vit_base, vit_large, vit_giant2, "
            "vit_small_dinov3, vit_small_plus_dinov3, vit_base_dinov3, vit_large_dinov3, "
            "vit_large_plus_dinov3, vit_huge_plus_dinov3, vit_7b_dinov3, resnet18, resnet50, "
            "convnext_tiny, convnext_small, convnext_base, convnext_large, or timm:NAME, "
            "torchvision:NAME or package.module:function; got 'vit_smal' (did you mean "
            "'vit_small'?)",
        ),
        ("model", "patch_size", 12, "model.patch_size must be one of 8, 14, 16; got 12"),
        ("optim", "optimizer", "lars", "optim.optimizer must be one of adamw, sgd; got 'lars'"),
        (
            "hardware",
            "precision",
            "fp8",
            "hardware.precision must be one of auto, bf16, fp16, fp32",
        ),
        ("data", "dtype", "float64", "data.dtype must be one of float32, bfloat16, float16"),
        ("data", "photometric", "tpu", "data.photometric must be one of cpu, gpu; got 'tpu'"),
        ("data", "on_error", "ignore", "data.on_error must be one of raise, skip; got 'ignore'"),
        (
            "data",
            "format",
            "shard",
            "data.format must be one of auto, folder, shards, list, hf; got 'shard' "
            "(did you mean 'shards'?)",
        ),
        ("hardware", "device", "tpu", "hardware.device must be auto, cpu, cuda or cuda:N"),
        ("hardware", "device", "cuda:x", "hardware.device must be auto, cpu, cuda or cuda:N"),
    ],
)
def test_choice_errors(section, key, value, message):
    with pytest.raises(ConfigError) as e:
        Config.from_dict({section: {key: value}})
    assert str(e.value).startswith(message)


def test_data_source_keys_default_and_set():
    c = Config()
    assert (c.data.format, c.data.shuffle_buffer, c.data.index_dir) == ("auto", 1024, None)
    assert (c.data.list_root, c.data.image_column, c.data.label_column) == (None, None, None)
    assert (c.eval.train_root, c.eval.val_root, c.eval.test_root) == (None, None, None)
    c = load_config(None, ["data.format=shards", "data.shuffle_buffer=64", "eval.val_root=/v.csv"])
    assert (c.data.format, c.data.shuffle_buffer, c.eval.val_root) == ("shards", 64, "/v.csv")


def test_every_problem_is_reported_at_once():
    with pytest.raises(ConfigError) as e:
        Config.from_dict({"data": {"batch_size": 0, "bogus": 1}, "optim": {"lr": "x"}, "nope": {}})
    assert len(e.value.errors) == 4
    assert str(e.value).count("\n") == 3
    assert isinstance(e.value, ValueError)


def test_sections_must_be_mappings(tmp_path):
    with pytest.raises(ConfigError, match=r"section 'data' must be a mapping of keys"):
        Config.from_dict({"data": 5})
    with pytest.raises(ConfigError, match=r"a config must be a mapping of sections"):
        Config.from_dict([1, 2])
    path = write(tmp_path, "- data\n- model\n")
    with pytest.raises(ConfigError, match=re.escape(f"{path}: the top level must be a mapping")):
        load_config(path)


# ---------------------------------------------------------------------------
# Relations between fields
# ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "d, message",
    [
        (
            {"schedule": {"epochs": 5, "warmup_epochs": 6}},
            "schedule.warmup_epochs (6) must be <= schedule.epochs (5)",
        ),
        (
            {"schedule": {"epochs": 20, "warmup_epochs": 0, "warmup_teacher_temp_epochs": 30}},
            "schedule.warmup_teacher_temp_epochs (30) must be <= schedule.epochs (20)",
        ),
        (
            {"optim": {"lr": 1e-4, "min_lr": 1e-3}},
            "optim.min_lr (0.001) must be <= optim.lr (0.0001)",
        ),
        (
            {"model": {"backbone": "resnet50", "patch_size": 8}},
            "model.patch_size applies to ViT backbones only; model.backbone is 'resnet50'",
        ),
        (
            {"augmentation": {"local_crop_size": 100}},
            "augmentation.local_crop_size (100) must be a multiple of model.patch_size (16)",
        ),
        (
            {"model": {"patch_size": 8}, "augmentation": {"global_crop_size": 220}},
            "augmentation.global_crop_size (220) must be a multiple of model.patch_size (8)",
        ),
    ],
)
def test_cross_field_errors(d, message):
    with pytest.raises(ConfigError) as e:
        Config.from_dict(d)
    assert str(e.value).startswith(message)


def test_cross_field_edges_that_are_allowed():
    c = Config.from_dict(
        {
            "schedule": {"epochs": 10, "warmup_epochs": 10, "warmup_teacher_temp_epochs": 10},
            "optim": {"lr": 1e-6, "min_lr": 1e-6},
        }
    )
    assert c.schedule.warmup_epochs == c.schedule.epochs
    # A ResNet takes any crop size; patch_size left at its default is ignored.
    c = Config.from_dict(
        {"model": {"backbone": "resnet18"}, "augmentation": {"local_crop_size": 100}}
    )
    assert c.augmentation.local_crop_size == 100


def test_validate_checks_and_converts_a_mutated_config():
    c = default_config()
    c.optim.lr = 1  # an int where a float belongs: converted
    c.augmentation.blur_sigma = [0.2, 1.5]  # a list where a pair belongs: converted
    assert validate(c) is c
    assert isinstance(c.optim.lr, float) and c.augmentation.blur_sigma == (0.2, 1.5)
    c.data.batch_size = "64"
    with pytest.raises(ConfigError, match=r"data.batch_size must be an int, got '64'"):
        c.validate()
    c.data.batch_size = 64
    c.schedule.warmup_epochs = 1000
    with pytest.raises(ConfigError, match=r"schedule.warmup_epochs \(1000\)"):
        save_config(c, "/nonexistent-dir-never-written/config.yaml")
    assert not os.path.exists("/nonexistent-dir-never-written")


# ---------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------


def test_file_not_found_names_the_path(tmp_path):
    path = tmp_path / "missing.yaml"
    with pytest.raises(ConfigError, match=re.escape(f"config file not found: {path}")):
        load_config(path)
    with pytest.raises(
        ConfigError, match=re.escape(f"config path is a directory, not a file: {tmp_path}")
    ):
        load_config(tmp_path)


def test_malformed_yaml_names_the_file_and_line(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 32\n  num_workers: [1, 2\nmodel:\n  backbone: x\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    msg = str(e.value)
    assert re.match(rf"{re.escape(str(path))}:\d+:\d+: malformed YAML", msg), msg
    line = int(msg[len(str(path)) + 1 :].split(":")[0])
    assert line in (3, 4)  # where the unclosed list is noticed

    path = write(tmp_path, "data:\n  batch_size: 32\n   bad indent: 1\n", name="indent.yaml")
    with pytest.raises(ConfigError, match=re.escape(f"{path}:3:")):
        load_config(path)


def test_duplicate_key_is_an_error_with_its_line(tmp_path):
    path = write(tmp_path, "data:\n  batch_size: 32\n  batch_size: 16\n")
    with pytest.raises(
        ConfigError, match=re.escape(f"{path}:3:3: malformed YAML") + ".*duplicate key 'batch_size'"
    ):
        load_config(path)
    path = write(tmp_path, "data: {}\nmodel: {}\ndata: {}\n", name="sections.yaml")
    with pytest.raises(ConfigError, match=r":3:1: .*duplicate key 'data'"):
        load_config(path)


def test_yaml_merge_keys_still_work(tmp_path):
    path = write(
        tmp_path,
        "base: &b {batch_size: 16, prefetch: 2}\n",
    )
    # The anchor's section is unknown, which is reported, not a duplicate-key error.
    with pytest.raises(ConfigError, match="unknown section 'base'"):
        load_config(path)
    text = "data:\n  <<: {batch_size: 16, prefetch: 2}\n  batch_size: 8\n"
    c = load_config(write(tmp_path, text, name="merge.yaml"))
    assert (c.data.batch_size, c.data.prefetch) == (8, 2)


def test_atomic_save_leaves_no_temp_file_and_replaces(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text("old\n")
    save_config(custom_config(), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert load_config(path) == custom_config()


def test_failed_save_keeps_the_old_file_and_no_temp_file(tmp_path, monkeypatch):
    path = tmp_path / "config.yaml"
    save_config(default_config(), path)
    before = path.read_text()

    def failing_replace(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(config_module.os, "replace", failing_replace)
    with pytest.raises(OSError, match="disk full"):
        save_config(custom_config(), path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]
    assert path.read_text() == before


# ---------------------------------------------------------------------------
# Derived values
# ---------------------------------------------------------------------------


def test_effective_lr_is_dinos_linear_scaling():
    c = default_config()
    assert effective_lr(c) == pytest.approx(0.0005 * 64 / 256)
    assert effective_lr(c, world_size=16) == pytest.approx(0.002)  # DINO's 1024-image batch
    c.data.batch_size, c.optim.accumulation_steps = 32, 4
    assert effective_lr(c, world_size=2) == pytest.approx(0.0005 * 32 * 2 * 4 / 256)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ConfigError, match="world_size must be an int >= 1"):
            effective_lr(c, bad)


def test_sharding_keys_and_their_conflicts():
    cfg = load_config(
        None, ["distributed.strategy=fsdp", "distributed.reshard_after_forward=false"]
    )
    assert cfg.distributed.strategy == "fsdp" and cfg.distributed.reshard_after_forward is False
    assert load_config(None).distributed.strategy == "ddp"
    with pytest.raises(ConfigError, match="distributed.strategy must be one of"):
        load_config(None, ["distributed.strategy=zero3"])
    with pytest.raises(ConfigError, match="not fp16"):
        load_config(None, ["distributed.strategy=fsdp", "hardware.precision=fp16"])
    with pytest.raises(ConfigError, match="use distributed.strategy=ddp"):
        load_config(None, ["distributed.strategy=fsdp", "model.backbone=resnet18"])
    load_config(None, ["hardware.precision=fp16", "model.backbone=resnet18"])  # fine with ddp


# ---------------------------------------------------------------------------
# Activation checkpointing and its old key
# ---------------------------------------------------------------------------


def test_activation_checkpointing_keys():
    c = default_config()
    assert (c.hardware.activation_checkpointing, c.hardware.checkpoint_every) == ("none", 1)
    assert c.hardware.grad_checkpointing is False
    c = load_config(
        None, ["hardware.activation_checkpointing=selective", "hardware.checkpoint_every=2"]
    )
    assert (c.hardware.activation_checkpointing, c.hardware.checkpoint_every) == ("selective", 2)
    assert c.hardware.grad_checkpointing is True  # read-only: whether any block is checkpointed
    with pytest.raises(ConfigError, match="none, full, selective, auto; got 'partial'"):
        load_config(None, ["hardware.activation_checkpointing=partial"])
    with pytest.raises(ConfigError, match="hardware.checkpoint_every must be >= 1, got 0"):
        load_config(None, ["hardware.checkpoint_every=0"])


def test_grad_checkpointing_is_the_old_name_of_full(tmp_path):
    path = write(tmp_path, "hardware:\n  grad_checkpointing: true\n")
    for c in (load_config(path), load_config(None, ["hardware.grad_checkpointing=true"])):
        assert c.hardware.activation_checkpointing == "full"
        assert "hardware.activation_checkpointing" in c.given_keys
        assert "grad_checkpointing" not in c.to_dict()["hardware"]  # written as the new key
    assert (
        load_config(None, ["hardware.grad_checkpointing=false"]).hardware.grad_checkpointing
        is False
    )
    # what a run folder keeps reloads to the same values
    saved = save_config(load_config(path), tmp_path / "resolved.yaml")
    assert load_config(saved) == load_config(path)
    # the same meaning twice is fine; two meanings are not
    same = write(tmp_path, "hardware: {grad_checkpointing: true, activation_checkpointing: full}\n")
    assert load_config(same).hardware.activation_checkpointing == "full"
    both = write(
        tmp_path, "hardware: {grad_checkpointing: true, activation_checkpointing: selective}\n"
    )
    with pytest.raises(
        ConfigError,
        match="hardware.grad_checkpointing .the old name of "
        "hardware.activation_checkpointing. says 'full' but",
    ):
        load_config(both)
    # an override wins over the file's old key
    assert (
        load_config(
            path, ["hardware.activation_checkpointing=selective"]
        ).hardware.activation_checkpointing
        == "selective"
    )
    with pytest.raises(
        ConfigError,
        match="grad_checkpointing .the old name of .*must be one of true, false, got 'often'",
    ):
        load_config(None, ["hardware.grad_checkpointing=often"])
    with pytest.raises(ConfigError, match="must be one of true, false, got 1"):
        Config.from_dict({"hardware": {"grad_checkpointing": 1}})


@pytest.mark.parametrize("path", ["runs/exp #3/ckpt.pth", "~", "null", "[a, b]"])
def test_adapt_takes_its_path_as_written(path, tmp_path, capsys, monkeypatch):
    """``train --adapt PATH``: the path as it was typed, never YAML."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        main(["train", "--adapt", path, "--output-dir", str(tmp_path / "run"), "--quiet"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"model.init_from={path!r}: weights {path!r} do not exist" in err
