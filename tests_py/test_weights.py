"""Weights in and out: exports that timm, transformers and the original DINO
code load, giving dino_opt's features; imports of each format back into
dino_opt (bit-exact round trips, continued pretraining from a DINO training
checkpoint); and the errors that name what is wrong."""

import contextlib
import io
import json
import math

import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import apply_overrides, default_config
from dino_opt.data import builtin_dataset
from dino_opt.models import VisionTransformer
from dino_opt.train import build_models, build_optimizer
from dino_opt.weights import (
    evaluate_weights,
    export_weights,
    init_from,
    open_backbone,
    read_weights,
)
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tiny import TINY

timm = pytest.importorskip("timm")
transformers = pytest.importorskip("transformers")

SMALL_HEAD = ["model.out_dim=64", "model.hidden_dim=32", "model.bottleneck_dim=16"]
DINO_BLOCK = ("norm1", "attn.qkv", "attn.proj", "norm2", "mlp.fc1", "mlp.fc2")


def _config(backbone: str, patch: int):
    return apply_overrides(
        default_config(), [f"model.backbone={backbone}", f"model.patch_size={patch}", *SMALL_HEAD]
    )


def _randomize(module: torch.nn.Module, gen: torch.Generator) -> None:
    """Every parameter random (biases and norms too), so a key swapped in a
    layout cannot go unnoticed."""
    with torch.no_grad():
        for name, p in module.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=p.dtype) * 0.1
            p.copy_(noise + (1.0 if "norm" in name and name.endswith("weight") else 0.0))


def _checkpoint(tmp_path, gen, backbone="vit_tiny", patch=16):
    """A checkpoint as dino-opt train writes it (student, teacher, config) of
    a randomly initialised model; returns (path, teacher)."""
    cfg = _config(backbone, patch)
    student, teacher = build_models(cfg)
    _randomize(student, gen)
    _randomize(teacher, gen)
    path = tmp_path / f"{backbone}_{patch}.pth"
    state = {"student": student.state_dict(), "teacher": teacher.state_dict()}
    torch.save({**state, "config": cfg.to_dict()}, path)
    return path, teacher.eval()


def _timm_model(path):
    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
    model = timm.create_model(meta["timm_model"], **json.loads(meta["timm_kwargs"]))
    model.load_state_dict(load_file(path), strict=True)
    return model.eval()


def _hf_model(folder):
    return transformers.ViTModel.from_pretrained(str(folder), add_pooling_layer=False).eval()


@pytest.mark.parametrize(
    "backbone,patch", [("vit_tiny", 16), ("vit_tiny", 8), ("vit_small", 16), ("vit_small", 8)]
)
@pytest.mark.parametrize("size", [224, 96])
def test_exports_give_dino_opt_features(backbone, patch, size, tmp_path, gen):
    source, teacher = _checkpoint(tmp_path, gen, backbone, patch)
    x = torch.randn(2, 3, size, size, generator=gen)
    with torch.no_grad():
        ours = teacher.backbone(x)
        r = export_weights(source, "timm", tmp_path / "timm.safetensors", image_size=size)
        from_timm = _timm_model(r.path)(x)
        assert (size == 224) == (not r.notes)  # a resized table is said so
        h = export_weights(source, "hf", tmp_path / "hf", image_size=size)
        from_hf = _hf_model(h.path)(pixel_values=x).last_hidden_state[:, 0]
    assert from_timm.shape == ours.shape == from_hf.shape
    assert (from_timm - ours).abs().max().item() <= 1e-5
    assert (from_hf - ours).abs().max().item() <= 1e-5
    assert json.loads((h.path / "config.json").read_text())["image_size"] == size


def _assert_same(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


@pytest.mark.parametrize("backbone,patch", [("vit_tiny", 8), ("vit_small", 16)])
def test_round_trips_through_timm_and_transformers_are_bit_exact(backbone, patch, tmp_path, gen):
    source, teacher = _checkpoint(tmp_path, gen, backbone, patch)
    mine = {
        k.removeprefix("backbone."): v
        for k, v in teacher.state_dict().items()
        if k.startswith("backbone.")
    }
    exported = export_weights(source, "timm", tmp_path / "t.safetensors")
    resaved = tmp_path / "resaved.safetensors"  # what a timm user saves after loading it
    save_file(_timm_model(exported.path).state_dict(), str(resaved))
    _assert_same(read_weights(resaved).teacher["backbone"], mine)
    folder = export_weights(source, "hf", tmp_path / "hf").path
    _hf_model(folder).save_pretrained(tmp_path / "hf_resaved")
    back = read_weights(tmp_path / "hf_resaved")
    assert back.format == "hf" and back.teacher["head"] is None
    _assert_same(back.teacher["backbone"], mine)
    # and into a dino_opt model, student and teacher alike
    student, fresh = build_models(_config(backbone, patch))
    notes = init_from(resaved, student, fresh)
    assert notes[0].startswith("timm weights")
    for net in (student, fresh):
        _assert_same(net.backbone.state_dict(), mine)


def _dino_vit_keys(depth: int) -> set[str]:
    """The keys of the original DINO ViT (vision_transformer.py: patch
    embedding, CLS token, position table, blocks, final norm; head Identity)."""
    keys = {
        "cls_token",
        "pos_embed",
        "patch_embed.proj.weight",
        "patch_embed.proj.bias",
        "norm.weight",
        "norm.bias",
    }
    for i in range(depth):
        keys |= {
            f"blocks.{i}.{layer}.{kind}" for layer in DINO_BLOCK for kind in ("weight", "bias")
        }
    return keys


def test_dino_backbone_file_has_the_model_zoo_layout(tmp_path, gen):
    source, teacher = _checkpoint(tmp_path, gen, "vit_small", 16)
    r = export_weights(source, "dino", tmp_path / "dino_deitsmall16.pth")
    state = torch.load(r.path, weights_only=True)
    assert set(state) == _dino_vit_keys(12)
    assert state["pos_embed"].shape == (1, 197, 384)
    assert state["blocks.0.attn.qkv.weight"].shape == (1152, 384)
    zoo = timm.create_model("vit_small_patch16_224", num_classes=0)  # DINO's layout
    zoo.load_state_dict(state, strict=True)
    ours = VisionTransformer(patch_size=16, embed_dim=384, depth=12, num_heads=6)
    ours.load_state_dict(state, strict=True)
    x = torch.randn(2, 3, 224, 224, generator=gen)
    with torch.no_grad():
        assert torch.equal(ours.eval()(x), teacher.backbone(x))
    assert read_weights(r.path).format == "dino"


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory):
    return builtin_dataset(
        tmp_path_factory.mktemp("data") / "builtin",
        train_per_class=2,
        val_per_class=1,
        test_per_class=1,
        image_size=40,
    )


@pytest.fixture(scope="module")
def run(tiny_data, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "run"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(
                [
                    "train",
                    "--output-dir",
                    str(out),
                    "--quiet",
                    f"data.root={tiny_data / 'train'}",
                    *TINY,
                ]
            )
            == 0
        )
    return out


def _cli(capsys, *args) -> dict:
    capsys.readouterr()
    assert main(list(args)) == 0
    return json.loads(capsys.readouterr().out)


def _cli_error(capsys, *args) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main(list(args))
    assert e.value.code == 2
    return capsys.readouterr().err


def test_full_dino_checkpoint_has_main_dino_layout(run, tmp_path, capsys):
    out = _cli(
        capsys,
        "export",
        str(run),
        "--format",
        "dino",
        "--full",
        "--output",
        str(tmp_path / "checkpoint.pth"),
    )
    assert out["format"] == "dino-full"
    state = torch.load(out["path"], weights_only=True)
    assert {"student", "teacher", "optimizer", "epoch", "dino_loss", "args"} <= set(state)
    cfg = apply_overrides(default_config(), TINY)
    student, teacher = build_models(cfg)
    # DistributedDataParallel's prefix on the student, as main_dino.py saves it
    assert set(state["student"]) == {f"module.{k}" for k in student.state_dict()}
    assert set(state["teacher"]) == set(teacher.state_dict())
    assert state["dino_loss"]["center"].shape == (1, 64) and state["epoch"] == 2
    # DINO's two parameter groups in its order: an AdamW over them takes the state
    optimizer = build_optimizer(cfg, student, torch.device("cpu"))
    optimizer.load_state_dict(state["optimizer"])
    assert len(optimizer.state) == sum(p.requires_grad for p in student.parameters())


def test_training_continues_from_a_dino_checkpoint(run, tiny_data, tmp_path, capsys):
    full = tmp_path / "checkpoint.pth"
    _cli(capsys, "export", str(run), "--format", "dino", "--full", "--output", str(full))
    saved = torch.load(full, weights_only=True)
    cfg = apply_overrides(default_config(), TINY)
    student, teacher = build_models(cfg)
    loss = torch.nn.Module()
    loss.register_buffer("center", torch.zeros(1, 64))
    notes = init_from(full, student, teacher, loss)
    assert notes[0].startswith("dino-full weights") and any("center" in n for n in notes)
    _assert_same(teacher.state_dict(), saved["teacher"])
    _assert_same(student.state_dict(), {k[7:]: v for k, v in saved["student"].items()})
    assert torch.equal(loss.center, saved["dino_loss"]["center"])
    out = tmp_path / "continued"
    with contextlib.redirect_stdout(io.StringIO()):
        assert (
            main(
                [
                    "train",
                    "--output-dir",
                    str(out),
                    "--quiet",
                    f"data.root={tiny_data / 'train'}",
                    *TINY,
                    "schedule.epochs=1",
                    "schedule.warmup_epochs=0",
                    f"model.init_from={full}",
                ]
            )
            == 0
        )
    report = json.loads((out / "report.json").read_text())
    assert report["init_from"][0].startswith("dino-full weights")
    assert report["steps"] > 0 and math.isfinite(report["final_loss"])


def test_knn_on_exported_weights_equals_the_run(run, tiny_data, tmp_path, capsys):
    report = json.loads((run / "report.json").read_text())
    exported = _cli(
        capsys,
        "export",
        str(run),
        "--format",
        "timm",
        "--image-size",
        "32",
        "--output",
        str(tmp_path / "t.safetensors"),
    )
    result = _cli(
        capsys, "knn", "--weights", exported["path"], "--data", str(tiny_data), "--device", "cpu"
    )
    assert result["format"] == "timm" and result["image_size"] == 32
    assert result["top1"] == report["knn_top1_trained"]
    assert result["test_top1"] == report["knn_test_top1_trained"]
    direct = evaluate_weights(run, tiny_data, image_size=32, device="cpu")  # a run folder too
    assert direct["format"] == "dino_opt" and direct["top1"] == result["top1"]


@pytest.mark.parametrize(
    "fmt,name", [("timm", "t.safetensors"), ("hf", "hf"), ("dinov2", "v2.pth"), ("dino", "d.pth")]
)
def test_an_export_carries_the_input_it_was_trained_at(run, tiny_data, tmp_path, capsys, fmt, name):
    """TINY trains at 32 px with a position table for 224: every export says
    32 (and ImageNet's normalisation), and evaluating it without a size gives
    the run's own figures."""
    report = json.loads((run / "report.json").read_text())
    exported = _cli(capsys, "export", str(run), "--format", fmt, "--output", str(tmp_path / name))
    trained = read_weights(exported["path"]).training
    assert trained == {
        "image_size": 32,
        "mean": [0.485, 0.456, 0.406],
        "std": [0.229, 0.224, 0.225],
    }
    assert read_weights(run).training == trained
    assert open_backbone(exported["path"]).image_size == 32
    result = evaluate_weights(exported["path"], tiny_data, device="cpu")
    assert result["image_size"] == 32 and result["top1"] == report["knn_top1_trained"]
    if fmt == "hf":  # transformers keeps the extra key and loads the model
        model = transformers.AutoModel.from_pretrained(exported["path"])
        assert model.config.dino_opt_training["image_size"] == 32
    if fmt in ("dinov2", "dino"):  # torch files: the record sits beside them
        sidecar = tmp_path / f"{name}.json"
        sidecar.write_text('{"dino_opt_training": {"image_size": 0}}')
        with pytest.raises(ValueError, match=f"{sidecar}: its dino_opt_training record"):
            read_weights(exported["path"])


def test_errors_name_the_problem(run, tiny_data, tmp_path, capsys, gen):
    target = tmp_path / "t.safetensors"
    _cli(capsys, "export", str(run), "--format", "timm", "--output", str(target))
    err = _cli_error(capsys, "export", str(run), "--format", "timm", "--output", str(target))
    assert str(target) in err and "--force" in err
    _cli(capsys, "export", str(run), "--format", "timm", "--output", str(target), "--force")
    err = _cli_error(capsys, "export", str(run), "--format", "hf", "--full", "--output", "x")
    assert "--format dino" in err
    err = _cli_error(capsys, "knn", "--weights", str(target))
    assert "--data" in err
    partial = tmp_path / "partial.pth"
    torch.save({"student": {}}, partial)
    err = _cli_error(capsys, "export", str(partial), "--format", "dino", "--output", "y")
    assert str(partial) in err and "'teacher'" in err
    # a key missing and one too many: both listed
    state = load_file(target)
    state["blocks.0.attn.extra"] = state.pop("blocks.0.attn.proj.bias")
    broken = tmp_path / "broken.safetensors"
    save_file(state, str(broken))
    student, teacher = build_models(apply_overrides(default_config(), TINY))
    with pytest.raises(
        ValueError, match=r"missing keys.*attn\.proj\.bias.*unexpected.*attn\.extra"
    ):
        init_from(broken, student, teacher)
    # another architecture is named as such
    other, _ = _checkpoint(tmp_path, gen, "vit_tiny", 16)
    with pytest.raises(ValueError, match="vit_tiny with patch 16.*patch 8"):
        init_from(other, student, teacher)
    err = _cli_error(
        capsys,
        "train",
        "--output-dir",
        str(tmp_path / "r"),
        "--quiet",
        f"data.root={tiny_data / 'train'}",
        *TINY,
        f"model.init_from={tmp_path / 'nowhere.pth'}",
    )
    assert "model.init_from" in err and "nowhere.pth" in err


def test_resnet_exports_as_torchvision_and_timm_state_dicts(tmp_path, gen):
    cfg = apply_overrides(default_config(), ["model.backbone=resnet18", *SMALL_HEAD])
    student, teacher = build_models(cfg)
    path = tmp_path / "r.pth"
    torch.save(
        {"student": student.state_dict(), "teacher": teacher.state_dict(), "config": cfg.to_dict()},
        path,
    )
    with pytest.raises(ValueError, match="--format hf does not write a resnet18.*dino or "):
        export_weights(path, "hf", tmp_path / "r.safetensors")
    timm = pytest.importorskip("timm")
    t = export_weights(path, "timm", tmp_path / "r_timm.pth")
    net = timm.create_model("resnet18", num_classes=0)
    net.load_state_dict(torch.load(t.path, weights_only=True))
    assert torch.equal(net.conv1.weight, teacher.backbone.conv1.weight)
    r = export_weights(path, "dino", tmp_path / "r18.pth")
    torchvision = pytest.importorskip("torchvision")
    net = torchvision.models.resnet18()
    missing = net.load_state_dict(torch.load(r.path, weights_only=True), strict=False)
    assert set(missing.missing_keys) == {"fc.weight", "fc.bias"} and not missing.unexpected_keys
    assert read_weights(r.path).backbone == "resnet18"


def test_the_format_is_read_from_the_file_not_its_name(tmp_path, gen):
    source, _ = _checkpoint(tmp_path, gen)
    timm_file = export_weights(source, "timm", tmp_path / "weights.bin").path
    dino_file = export_weights(source, "dino", tmp_path / "weights.safetensors").path
    assert read_weights(timm_file).format == "timm" and read_weights(dino_file).format == "dino"
    junk = tmp_path / "junk.pth"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{ not json or a zip")
    with pytest.raises(ValueError, match=str(junk)):
        read_weights(junk)
