"""Training on images that are not 8-bit RGB (data.image_mode: native): a
1-channel 16-bit and a 6-channel run of the tiny recipe on the built-in
data set's variants train, resume bit for bit after a kill, record their
channels and normalisation in the run's config, and export to timm and
Hugging Face with them; released RGB weights adapted to N channels give
timm's filters; a model of other channels than the data's is refused."""

import json

import numpy as np
import pytest
import torch
from dino_opt.cli import main
from dino_opt.config import Config, ConfigError, apply_overrides, load_config
from dino_opt.data import builtin_dataset
from dino_opt.data.segmentation import segmentation_splits
from dino_opt.eval.evaluate import evaluate_backbone
from dino_opt.models import (
    VisionTransformer,
    adapt_input_weight,
    build_backbone,
    build_dino_models,
    input_channels,
)
from dino_opt.train import data_roots, resolve_input
from dino_opt.weights import init_from
from dino_opt.weights.layouts.dinov3 import dinov3_arch, timm_dinov3_model
from dino_opt.weights.layouts.vit import hf_vit_config, timm_model, vit_arch
from tiny import (
    RESUMABLE,
    TINY,
    assert_same_states,
    final_state,
    run_cli_ok,
    run_killed_and_resumed,
    train_args,
)

NATIVE = [*TINY, "data.image_mode=native", "model.drop_path_rate=0.1"]


def variant_root(tmp_path_factory, variant: str):
    folder = tmp_path_factory.mktemp(variant) / "builtin"
    sizes = dict(train_per_class=2, val_per_class=1, test_per_class=0, image_size=40)
    return builtin_dataset(folder, variant=variant, **sizes)


@pytest.mark.slow
@pytest.mark.parametrize("variant,channels", [("gray16", 1), ("multichannel", 6)])
def test_native_run_trains_resumes_bit_for_bit_and_exports(tmp_path_factory, variant, channels):
    root = variant_root(tmp_path_factory, variant)
    config = [*NATIVE, *RESUMABLE, "eval.every_epochs=0"]
    reference = tmp_path_factory.mktemp("reference") / "run"
    run_cli_ok(train_args(reference, root / "train", *config))
    resumed = tmp_path_factory.mktemp("resumed") / "run"
    run_killed_and_resumed(resumed, train_args(resumed, root / "train", *config), at_step=3)
    a, b = final_state(reference), final_state(resumed)
    assert_same_states(a, b)
    saved = Config.from_dict(a["config"])
    assert saved.model.in_channels == channels and len(saved.data.mean) == channels
    assert a["student"]["backbone.patch_embed.proj.weight"].shape[1] == channels
    report = json.loads((reference / "report.json").read_text())
    assert np.isfinite(report["knn_top1_trained"])
    for fmt in ("timm", "hf"):
        out = tmp_path_factory.mktemp(fmt) / f"export.{fmt}"
        assert main(["export", str(reference), "--format", fmt, "--output", str(out)]) == 0
    config_json = json.loads((out / "config.json").read_text())
    assert config_json["num_channels"] == channels


def test_rgb_weights_adapted_to_n_channels_give_timms_filters(tmp_path):
    torch.manual_seed(0)
    rgb = torch.randn(8, 3, 4, 4)
    one = adapt_input_weight(rgb, 1)
    torch.testing.assert_close(one, rgb.sum(1, keepdim=True))
    six = adapt_input_weight(rgb, 6)
    torch.testing.assert_close(six, torch.cat([rgb, rgb], 1) * 0.5)
    seven = adapt_input_weight(rgb, 7)
    torch.testing.assert_close(seven, torch.cat([rgb, rgb, rgb[:, :1]], 1) * (3 / 7))
    # An image whose channels are all equal gets the RGB network's response.
    x = torch.rand(2, 1, 8, 8)
    conv = torch.nn.functional.conv2d
    torch.testing.assert_close(conv(x.repeat(1, 6, 1, 1), six), conv(x.repeat(1, 3, 1, 1), rgb))
    torch.testing.assert_close(conv(x, one), conv(x.repeat(1, 3, 1, 1), rgb))
    # model.init_from of an RGB network into a 6-channel one: the filters, and one line saying so.
    tiny = dict(hidden_dim=32, bottleneck_dim=16, img_size=32, depth=1)
    student, teacher = build_dino_models("vit_tiny", 64, 8, 0.0, **tiny)
    path = tmp_path / "rgb.pth"
    torch.save({"student": student.state_dict(), "teacher": teacher.state_dict()}, path)
    s6, t6 = build_dino_models("vit_tiny", 64, 8, 0.0, in_chans=6, **tiny)
    notes = init_from(path, s6, t6)
    line = [n for n in notes if "adapted to 6 channel" in n]
    assert len(line) == 2 and "scaled by 3/6" in line[0]  # student and teacher
    w = teacher.backbone.patch_embed.proj.weight
    torch.testing.assert_close(t6.backbone.patch_embed.proj.weight, adapt_input_weight(w, 6))


@pytest.mark.parametrize(
    "backbone", ["vit_tiny", "resnet18", "convnext_tiny", "timm:resnet18", "torchvision:resnet18"]
)
def test_every_backbone_takes_in_channels(backbone):
    kw = dict(img_size=32, patch_size=8) if backbone.startswith("vit") else {}
    net, dim = build_backbone(backbone, drop_path_rate=0.0, in_chans=5, **kw)
    out = net(torch.rand(2, 5, 32, 32))
    assert out.shape == (2, dim)
    with pytest.raises((RuntimeError, ValueError)):
        net(torch.rand(2, 3, 32, 32))


def test_a_model_of_other_channels_than_the_data_is_refused(tmp_path_factory):
    root = variant_root(tmp_path_factory, "gray16")
    base = [f"data.root={root / 'train'}", "data.image_mode=native"]
    cfg = resolve_input(apply_overrides(Config(), base))
    assert cfg.model.in_channels == 1 and len(cfg.data.mean) == 1 and cfg.data.std[0] > 0
    with pytest.raises(
        ConfigError, match=r"model.in_channels=3, but the data are 1-channel uint16"
    ):
        resolve_input(apply_overrides(Config(), [*base, "model.in_channels=3"]))
    with pytest.raises(ConfigError, match="model.in_channels=4, but data.image_mode: rgb"):
        resolve_input(apply_overrides(Config(), ["model.in_channels=4"]))
    assert input_channels(VisionTransformer(in_chans=1, patch_size=8, img_size=32, depth=1)) == 1


def test_architectures_read_from_weights_carry_the_channels():
    vit, _ = build_backbone("vit_tiny", patch_size=8, img_size=32, depth=1, in_chans=6)
    arch = vit_arch(vit.state_dict())
    assert arch.in_chans == 6 and arch.model_kwargs()["in_chans"] == 6
    assert timm_model(arch, 32)[1]["in_chans"] == 6
    assert hf_vit_config(arch, 32)["num_channels"] == 6
    v3, _ = build_backbone("vit_small_dinov3", drop_path_rate=0.0, in_chans=2, depth=1)
    arch3 = dinov3_arch(v3.state_dict())
    assert arch3.in_chans == 2 and timm_dinov3_model(arch3, 224)[1]["in_chans"] == 2
    rgb, _ = build_backbone("vit_tiny", patch_size=8, img_size=32, depth=1)
    assert vit_arch(rgb.state_dict()).in_chans == 3


def test_the_end_of_run_evaluation_reads_native_images(tmp_path_factory):
    """k-NN and the linear probe on the 1-channel 16-bit variant, whose
    segmentation masks the dense probe (8-bit RGB through PIL) leaves."""
    root = variant_root(tmp_path_factory, "gray16")
    assert segmentation_splits(root) is not None  # the variant has masks
    cfg = load_config(
        None,
        [
            *NATIVE,
            f"data.root={root / 'train'}",
            "eval.linear=true",
            "eval.linear_epochs=2",
            "eval.dense=true",
        ],
    )
    cfg = resolve_input(cfg)
    net = build_backbone("vit_tiny", patch_size=8, in_chans=1, depth=2)[0]
    out = evaluate_backbone(cfg, data_roots(cfg), net, torch.device("cpu"))
    assert np.isfinite(out["knn"]["val"]["top1"]) and "linear" in out and "dense" not in out
