"""Hardware presets: the table (dino_opt.config.presets), the choice by memory, how a
preset enters a config in the one explicit resolution step
(dino_opt.tune.resolve_hardware: explicit keys win, loading never probes),
and `dino-opt presets`."""

import copy
import json

import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import (
    DEMO_PRESET,
    PRESET_KEYS,
    PRESETS,
    Config,
    ConfigError,
    apply_overrides,
    load_config,
    preset_for_memory,
    save_config,
)
from dino_opt.distributed import launch as distributed_mod
from dino_opt.runtime import device as device_module
from dino_opt.tune import dynamic_batch_size, hardware, resolve_hardware, resolve_preset


def resolved(cfg: Config) -> Config:
    return resolve_hardware(cfg)[0]


def _values(cfg: Config) -> dict:
    out = {}
    for dotted in PRESET_KEYS:
        section, key = dotted.split(".")
        out[dotted] = getattr(getattr(cfg, section), key)
    return out


@pytest.fixture
def fake_gpu(monkeypatch):
    """Makes detection report a GPU of the given size and bf16 support."""

    def install(memory_gb: float, bf16: bool = True):
        detected = ("cuda:0 (fake)", memory_gb, bf16)
        monkeypatch.setattr(hardware, "detect_device_memory", lambda device="auto": detected)

    return install


# ---------------------------------------------------------------- the table


def test_table_follows_the_course_guide():
    # "Configurations by GPU": 8GB 16/ResNet18/4, 12GB 32/ResNet18/6,
    # 16GB 32/ResNet50/6, 24GB+ 64/ResNet50 or ViT/6-8.
    rows = {n: (p.batch_size, p.backbone, p.num_local_views) for n, p in PRESETS.items()}
    assert rows["8gb"] == (16, "resnet18", 4)
    assert rows["12gb"] == (32, "resnet18", 6)
    assert rows["16gb"] == (32, "resnet50", 6)
    assert rows["24gb"] == (64, "vit_small", 8)
    assert set(PRESET_KEYS) == {
        "data.batch_size",
        "augmentation.num_local_views",
        "model.backbone",
        "hardware.precision",
        "hardware.activation_checkpointing",
    }


@pytest.mark.parametrize(
    "memory, expected",
    [
        (None, "cpu"),
        (7.2, "8gb"),  # an "8 GB" card reports a little under 8 GiB
        (7.9, "8gb"),
        (10.79, "8gb"),
        (10.8, "12gb"),
        (15.9, "16gb"),
        (23.6, "24gb"),  # RTX 3090
        (79.1, "24gb"),  # H100
        (139.8, "24gb"),  # H200
    ],
)
def test_row_by_memory(memory, expected):
    assert preset_for_memory(memory).name == expected


def test_below_the_smallest_row_the_batch_shrinks_with_memory():
    assert preset_for_memory(7.0).batch_size == 8  # 16 * 7/8 = 14 -> 8
    assert preset_for_memory(4.0).batch_size == 8
    assert preset_for_memory(1.0).batch_size == 2
    assert preset_for_memory(1.0).backbone == "resnet18"
    for bad in (0, -3.0):
        with pytest.raises(ValueError, match="memory_gb"):
            preset_for_memory(bad)


# ---------------------------------------------------------------- resolution


def test_precision_follows_the_card():
    assert resolve_preset("auto", memory_gb=24).values["hardware.precision"] == "bf16"
    old = resolve_preset("auto", memory_gb=8, bf16=False)
    assert old.values["hardware.precision"] == "fp16"
    assert old.preset.name == "8gb"


@pytest.mark.parametrize("native", [False, True])
def test_on_a_cpu_auto_is_the_cpu_row_with_the_precision_this_cpu_computes(monkeypatch, native):
    monkeypatch.setattr(device_module, "cpu_computes_bf16", lambda: native)
    choice = resolve_preset("auto", device="cpu")
    assert choice.preset.name == "cpu"
    # bfloat16 where the CPU computes it natively, else float32 (test_step)
    assert choice.values["hardware.precision"] == ("bf16" if native else "fp32")
    assert choice.memory_gb is None
    # a GPU row named on a machine without one: precision left to the run
    assert resolve_preset("16gb", device="cpu").values["hardware.precision"] == "auto"


def test_checkpointing_turns_on_when_the_estimate_is_below_the_batch():
    # ViT-S/8 at 224/96 px has 4x the tokens of ViT-S/16
    expected = dynamic_batch_size(
        24, 224, 384, patch_size=8, depth=12, n_local=8, local_resolution=96, bytes_per_value=2
    )
    assert expected < 64
    choice = resolve_preset("auto", memory_gb=24, patch_size=8)
    assert choice.estimated_max_batch == expected
    assert choice.values["hardware.activation_checkpointing"] == "full"
    assert "checkpointing is on" in choice.reason
    # the recipe's ViT-S/16 fits without it
    plain = resolve_preset("auto", memory_gb=24)
    assert plain.values["hardware.activation_checkpointing"] == "none"
    assert plain.estimated_max_batch == dynamic_batch_size(24, 224, 384)
    # a batch the config sets itself is what the estimate is held against
    small = resolve_preset("auto", memory_gb=24, patch_size=8, fixed={"data.batch_size": 32})
    assert small.values["hardware.activation_checkpointing"] == "none"
    # ResNet rows have no estimate
    assert resolve_preset("auto", memory_gb=12).estimated_max_batch is None


def test_the_estimate_uses_the_backbone_the_config_sets():
    choice = resolve_preset("auto", memory_gb=12, fixed={"model.backbone": "vit_base"})
    assert choice.estimated_max_batch == dynamic_batch_size(12, 224, 768, n_local=6)
    assert choice.values["model.backbone"] == "resnet18"  # the row's; the config keeps its own


def test_unknown_preset_names_the_choices():
    with pytest.raises(ValueError, match="did you mean '24gb'"):
        resolve_preset("24GB")


def test_overrides_text():
    choice = resolve_preset("12gb", memory_gb=12)
    assert choice.overrides() == [
        "data.batch_size=32",
        "augmentation.num_local_views=6",
        "model.backbone=resnet18",
        "hardware.precision=bf16",
        "hardware.activation_checkpointing=none",
    ]
    assert load_config(None, choice.overrides()).model.backbone == "resnet18"


# ---------------------------------------------------------------- in a config


def test_preset_off_changes_nothing():
    assert Config.from_dict({}).hardware.preset == "off"
    assert _values(Config.from_dict({})) == _values(Config())


def test_loading_never_probes_the_device(monkeypatch, tmp_path):
    def probe(device="auto"):
        raise AssertionError("loading a config looked at the device")

    monkeypatch.setattr(hardware, "detect_device_memory", probe)
    path = tmp_path / "run.yaml"
    path.write_text("hardware: auto\n")
    cfg = load_config(path, ["data.batch_size=48"])
    assert cfg.hardware.preset == "auto"
    assert (cfg.model.backbone, cfg.data.batch_size) == ("vit_small", 48)  # nothing filled in
    assert {"hardware.preset", "data.batch_size"} <= cfg.given_keys


def test_resolution_is_one_step_and_leaves_a_self_contained_config(fake_gpu):
    fake_gpu(11.5, bf16=False)
    cfg, choice = resolve_hardware(load_config(None, ["hardware.preset=auto"]))
    assert choice.preset.name == "12gb" and "chosen by memory" in choice.reason
    assert cfg.hardware.preset == "off"  # resolved: nothing to resolve again
    assert set(PRESET_KEYS) <= cfg.given_keys
    again, none = resolve_hardware(cfg)
    assert again is cfg and none is None
    plain, none = resolve_hardware(Config())  # no preset: only compile's null is resolved
    assert none is None and plain.hardware.compile is torch.cuda.is_available()
    assert resolve_hardware(plain) == (plain, None)


def test_auto_on_this_cpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = resolved(load_config(None, ["hardware.preset=auto"]))
    assert _values(cfg) == resolve_preset("cpu", device="cpu").values


def test_auto_on_a_gpu_of_11_gib(fake_gpu):
    fake_gpu(11.5, bf16=False)
    cfg = resolved(load_config(None, ["hardware.preset=auto"]))
    assert _values(cfg) == {
        "data.batch_size": 32,
        "augmentation.num_local_views": 6,
        "model.backbone": "resnet18",
        "hardware.precision": "fp16",
        "hardware.activation_checkpointing": "none",
    }


def test_yaml_shorthand_and_explicit_keys_win(tmp_path, fake_gpu):
    fake_gpu(24)
    path = tmp_path / "run.yaml"
    path.write_text("hardware: auto\ndata:\n  batch_size: 64\n")
    cfg = resolved(load_config(path))
    assert cfg.data.batch_size == 64  # set by the file (to its default: still the file's)
    assert cfg.model.backbone == "vit_small"  # set by the preset
    assert cfg.augmentation.num_local_views == 8
    fake_gpu(11.5)
    assert resolved(load_config(path)).data.batch_size == 64  # the 12gb row's 32 loses
    # the override wins too
    assert resolved(load_config(path, ["model.backbone=vit_base"])).model.backbone == "vit_base"


def test_a_named_preset_in_yaml(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("hardware: 12gb\n")
    cfg = resolved(load_config(path))
    assert (cfg.data.batch_size, cfg.model.backbone, cfg.augmentation.num_local_views) == (
        32,
        "resnet18",
        6,
    )


def test_a_resolved_config_reloads_unchanged(tmp_path, fake_gpu):
    fake_gpu(16)
    cfg = resolved(load_config(None, ["hardware.preset=auto"]))
    save_config(cfg, tmp_path / "config.yaml")
    fake_gpu(80)  # another machine: the saved run keeps what it was resolved to
    again = resolved(load_config(tmp_path / "config.yaml"))
    assert again == cfg
    assert again.model.backbone == "resnet50"


def test_the_preset_sets_only_what_the_config_leaves_to_it():
    cfg = resolved(apply_overrides(Config(), ["hardware.preset=16gb"]))
    assert (cfg.model.backbone, cfg.data.batch_size) == ("resnet50", 32)
    custom = apply_overrides(Config(), ["model.backbone=vit_base"])
    kept = resolved(apply_overrides(custom, ["hardware.preset=16gb", "data.batch_size=8"]))
    assert (kept.model.backbone, kept.data.batch_size) == ("vit_base", 8)
    assert kept.augmentation.num_local_views == 6  # at its default before: the preset's


def test_the_demo_preset_keeps_its_own_keys():
    before = copy.deepcopy(DEMO_PRESET)
    cfg = resolved(load_config(DEMO_PRESET, ["hardware.preset=24gb"]))
    assert DEMO_PRESET == before  # not modified
    assert cfg.model.backbone == "vit_tiny"  # the demo sets it
    assert cfg.data.batch_size == 64
    assert cfg.augmentation.num_local_views == 4


def test_bad_preset_and_relations_are_named():
    with pytest.raises(ConfigError, match="hardware.preset must be one of"):
        load_config(None, ["hardware.preset=huge"])
    # a ResNet row with a ViT-only key the config sets
    with pytest.raises(ConfigError, match="model.patch_size applies to ViT backbones only"):
        resolved(load_config(None, ["hardware.preset=8gb", "model.patch_size=8"]))


def test_auto_on_a_missing_gpu_says_so(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match="hardware.preset=auto: hardware.device=cuda but CUDA"):
        resolved(load_config(None, ["hardware.preset=auto", "hardware.device=cuda"]))


def test_the_launcher_resolves_once_and_hands_the_result_to_its_processes(fake_gpu, monkeypatch):
    fake_gpu(24)
    handed = {}

    def fake_agent(entry, args, **settings):
        handed.update(cfg=args[0], output_dir=args[1], settings=settings)
        return {0: {"steps": 0}}

    monkeypatch.setattr(distributed_mod, "run_agent", fake_agent)
    report = distributed_mod.launch_distributed_training(
        None, 2, overrides=["hardware.preset=auto", "hardware.device=cpu"], output_dir="x"
    )
    assert report == {"steps": 0}
    cfg = handed["cfg"]
    assert isinstance(cfg, Config) and cfg.hardware.preset == "off"
    assert cfg.model.backbone == "vit_small"  # the 24 GB row, resolved here; "off": never again
    assert handed["settings"]["max_restarts"] == cfg.distributed.max_restarts == 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_detects_this_gpu():
    where, memory, bf16 = hardware.detect_device_memory("cuda:0")
    props = torch.cuda.get_device_properties(0)
    assert memory == pytest.approx(props.total_memory / 2**30)
    assert bf16 == (props.major >= 8)
    assert props.name in where


# ---------------------------------------------------------------- the command


def test_cli_prints_the_table_and_the_choice(capsys):
    assert main(["presets", "--memory", "12"]) == 0
    out = capsys.readouterr().out
    for name in PRESETS:
        assert name in out
    assert "preset 12gb (chosen by memory" in out
    assert "hardware.preset=auto sets: data.batch_size=32" in out


def test_cli_json(capsys):
    assert main(["presets", "--memory", "24", "--json", "model.patch_size=8"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["chosen"] == "24gb"
    assert report["values"]["hardware.activation_checkpointing"] == "full"
    assert set(report["presets"]) == set(PRESETS)


def test_cli_measure_refines_the_batch_size_on_this_machine(capsys):
    tiny = [
        "hardware.preset=cpu",
        "hardware.device=cpu",
        "augmentation.global_crop_size=32",
        "augmentation.local_crop_size=16",
        "model.out_dim=128",
        "model.hidden_dim=64",
        "model.bottleneck_dim=32",
    ]
    assert main(["presets", "--measure", "--max-batch", "4", "--steps", "1", "--json", *tiny]) == 0
    measured = json.loads(capsys.readouterr().out)["measured"]
    assert [t["batch_size"] for t in measured["trials"]] == [1, 2, 4]
    assert measured["batch_size"] in (1, 2, 4)
    assert all(t["fits"] and t["images_per_second"] > 0 for t in measured["trials"])


def test_cli_measure_refuses_a_foreign_memory():
    with pytest.raises(SystemExit) as e:
        main(["presets", "--measure", "--memory", "8"])
    assert e.value.code == 2
